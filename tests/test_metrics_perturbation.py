import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from relevancy.evaluation.metrics import STEPS, PerturbationTest, all_gather, perturbation_auc, perturbation_test
from relevancy.evaluation.metrics.perturbation import _removal_masks

H = W = 16
MEAN = STD = (0.5, 0.5, 0.5)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    """The authors' ``normalize`` (in place on a clone): ``(x - mean) / std``."""
    m = torch.as_tensor(MEAN)[None, :, None, None]
    s = torch.as_tensor(STD)[None, :, None, None]
    return x.clone().sub_(m).div_(s)


def _setup(b: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Dyadic pixels: normalising and un-normalising with 0.5 is exact, so both paths see the same input.
    pixels = torch.randint(0, 256, (b, 3, H, W), generator=g).float() / 256
    maps = torch.rand(b, 4, 4, generator=g)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * H * W, 4))
    with torch.no_grad():
        model[1].weight.copy_(torch.randn(4, 3 * H * W, generator=g) * 0.05)
        model[1].bias.zero_()
        labels = model(_normalize(pixels)).argmax(1)
    labels[::3] = (labels[::3] + 1) % 4  # some images start out wrong
    return model.eval(), pixels, maps, labels


def _reference_hits(model, pixels, maps, labels, neg: bool) -> np.ndarray:
    """The loop of ``pertubation_eval_from_hdf5.py`` on what ``generate_visualizations.py`` stores."""
    res = F.interpolate(maps[:, None], scale_factor=H // maps.shape[-1], mode="bilinear")
    vis = torch.stack([(r - r.min()) / (r.max() - r.min()) for r in res])  # batch size 1 there
    base_size = H * W
    steps = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    with torch.no_grad():
        clean = (labels == model(_normalize(pixels)).max(1, keepdim=True)[1].squeeze(1)).numpy()
        org_shape = pixels.shape
        if neg:
            vis = -vis
        vis = vis.reshape(org_shape[0], -1)
        rows = [clean]
        for step in steps:
            data = pixels.clone()
            _, idx = torch.topk(vis, int(base_size * step), dim=-1)
            idx = idx.unsqueeze(1).repeat(1, org_shape[1], 1)
            data = data.reshape(org_shape[0], org_shape[1], -1).scatter_(-1, idx, 0).reshape(*org_shape)
            out = model(_normalize(data))
            rows.append((labels == out.max(1, keepdim=True)[1].squeeze(1)).numpy())
    return np.stack(rows, axis=1)


def test_matches_reference_loop():
    model, pixels, maps, labels = _setup()
    hits = perturbation_test(model, _normalize(pixels), maps, labels, mean=MEAN, std=STD)
    for test in ("positive", "negative"):
        ref = _reference_hits(model, pixels, maps, labels, neg=test == "negative")
        assert hits[test].shape == (6, 10)
        assert np.array_equal(hits[test].numpy(), ref)


def test_chunking_and_callables_do_not_change_hits():
    model, pixels, maps, labels = _setup(seed=1)
    images = _normalize(pixels)
    a = perturbation_test(model, images, maps, labels, mean=MEAN, std=STD)
    b = perturbation_test(
        model, images, maps, labels, unnormalize=lambda x: x * 0.5 + 0.5, normalize=lambda x: (x - 0.5) / 0.5,
        batch_size=7,
    )
    c = perturbation_test(model, pixels, maps, labels)  # no normalisation: images are pixels
    for t in a:
        assert torch.equal(a[t], b[t])
    assert c["positive"].shape == (6, 10)


def test_step_zero_is_clean_accuracy():
    model, pixels, maps, labels = _setup(seed=2)
    images = _normalize(pixels)
    hits = perturbation_test(model, images, maps, labels, mean=MEAN, std=STD)
    clean = model(images).argmax(1) == labels
    assert torch.equal(hits["positive"][:, 0], clean)
    assert torch.equal(hits["negative"][:, 0], clean)


def test_removed_pixel_counts_and_order():
    vis = torch.arange(10.0)[None]  # pixel 9 most relevant
    masks = _removal_masks(vis, STEPS)
    assert masks.sum(dim=(1, 2)).tolist() == [int(10 * s) for s in STEPS]
    assert masks[3, 0].nonzero().flatten().tolist() == [7, 8, 9]
    assert _removal_masks(-vis, STEPS)[3, 0].nonzero().flatten().tolist() == [0, 1, 2]


def test_relevant_region_model_positive_vs_negative():
    # The class is decided by the mean of the top-left quadrant; a map pointing there is faithful.
    class Quadrant(nn.Module):
        def forward(self, x):
            s = x[:, :, : H // 2, : W // 2].mean(dim=(1, 2, 3))
            return torch.stack([-s, s], dim=1)

    pixels = torch.full((4, 3, H, W), 0.75)
    labels = torch.ones(4, dtype=torch.long)
    maps = torch.zeros(4, H, W)
    maps[:, : H // 2, : W // 2] = 1.0
    hits = perturbation_test(Quadrant(), _normalize(pixels), maps, labels, mean=MEAN, std=STD)
    pos = hits["positive"].float().mean(0).tolist()
    neg = hits["negative"].float().mean(0).tolist()
    # Positive: 10% of the top pixels already turn the quadrant's mean negative (0.5 * 39/64 - 25/64).
    assert pos == [1.0] + [0.0] * 9
    # Negative: the quadrant (25%) goes last; at 90% its mean is 0.5 * 26/64 - 38/64 < 0.
    assert neg == [1.0] * 9 + [0.0]
    assert perturbation_auc(pos) == pytest.approx(5.0)
    assert perturbation_auc(neg) == pytest.approx(85.0)


def test_auc_of_known_curves():
    assert perturbation_auc([1.0] * 10) == pytest.approx(90.0)
    assert perturbation_auc([0.0] * 10) == 0.0
    line = [1 - s for s in STEPS]  # area of 1 - x over [0, 0.9] = 0.9 - 0.405
    assert perturbation_auc(line) == pytest.approx(100 * (0.9 - 0.405))
    assert perturbation_auc([0.8, 0.5] + [0.0] * 8) == pytest.approx(100 * (0.1 * 1.3 / 2 + 0.1 * 0.5 / 2))


def test_accumulator_merge_equals_single_run():
    model, pixels, maps, labels = _setup(b=8, seed=3)
    images = _normalize(pixels)
    single = PerturbationTest(mean=MEAN, std=STD)
    single.update(model, images, maps, labels)
    parts = [PerturbationTest(mean=MEAN, std=STD) for _ in range(3)]
    for acc, sl in zip(parts, (slice(0, 3), slice(3, 5), slice(5, 8))):
        acc.update(model, images[sl], maps[sl], labels[sl])
    left = PerturbationTest.from_state(parts[0].state_dict()).merge(parts[1]).merge(parts[2])
    right = parts[0].merge(PerturbationTest.from_state(parts[1].state_dict()).merge(parts[2]))
    want = single.compute()
    assert left.compute() == want
    assert right.compute() == want
    assert all_gather(single) is single  # not distributed: unchanged
    ref = _reference_hits(model, pixels, maps, labels, neg=False).mean(0)
    assert want["positive_curve"] == pytest.approx(ref.tolist())
    assert want["positive_auc"] == pytest.approx(100 * np.trapezoid(ref, x=np.arange(10) / 10))
    assert want["num_images"] == 8


def test_rejects_bad_arguments():
    model, pixels, maps, labels = _setup(b=2)
    with pytest.raises(ValueError):
        perturbation_test(model, pixels, maps, labels, tests=("sideways",))
    with pytest.raises(ValueError):
        perturbation_test(model, pixels, maps, labels, mean=MEAN)
    with pytest.raises(ValueError):
        PerturbationTest(steps=(0.0, 0.5)).merge(PerturbationTest())
