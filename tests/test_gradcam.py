"""`gradcam`: Grad-CAM on the tokens entering the last attention equals pytorch-grad-cam's own maps (grad-cam 1.5.7,
run in a venv of its own by benchmarks/gradcam_reference.py; nothing of it imported here), in float64."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import relevancy
from relevancy.families.base import UnsupportedModelError
from models import tiny_swin, tiny_vit

GOLDEN = torch.load(Path(__file__).parent / "golden" / "gradcam_reference.pt", weights_only=False)
IMAGES = GOLDEN["images"]


def loaded(build, name: str) -> torch.nn.Module:
    model = build().double()
    model.load_state_dict(GOLDEN[name]["state_dict"])
    return model.eval()


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().amax() / theirs.abs().amax()).item()


def test_vit_equals_pytorch_grad_cam_on_the_patch_grid():
    result = relevancy.explain(loaded(tiny_vit, "vit"), IMAGES, method="gradcam")
    assert torch.equal(result.target, GOLDEN["vit"]["classes"])
    assert relative(result.scores.reshape(3, 4, 4), GOLDEN["vit"]["grid"]) < 1e-12


def test_swin_equals_pytorch_grad_cam_on_the_last_stage_and_is_laid_on_the_first_grid():
    """The last stage's 4 x 4 map spread over the first stage's 8 x 8 patches, each coarse value shared equally by its
    2 x 2 patches: summed back, pytorch-grad-cam's map."""
    result = relevancy.explain(loaded(tiny_swin, "swin"), IMAGES, method="gradcam")
    assert result.scores.shape[-2:] == (8, 8)
    assert torch.equal(result.target, GOLDEN["swin"]["classes"])
    summed = F.avg_pool2d(result.scores.reshape(3, 1, 8, 8), 2).reshape(3, 4, 4) * 4
    assert relative(summed, GOLDEN["swin"]["grid"]) < 1e-12


def test_normalize_is_pytorch_grad_cams_min_max_and_keeps_the_order():
    model = loaded(tiny_vit, "vit")
    plain = relevancy.explain(model, IMAGES, method="gradcam").scores.flatten(1)
    shown = relevancy.explain(model, IMAGES, method="gradcam", normalize=True).scores.flatten(1)
    grid = GOLDEN["vit"]["grid"].flatten(1)
    grid = grid - grid.amin(1, keepdim=True)
    assert (shown - grid / (grid.amax(1, keepdim=True) + 1e-7)).abs().max() < 1e-12
    assert torch.equal(plain.argsort(dim=1, stable=True), shown.argsort(dim=1, stable=True))


@pytest.mark.parametrize("build", [tiny_vit, tiny_swin])
def test_model_unchanged_and_batched_rows_equal_each_image_alone(build):
    model = build().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batched = relevancy.explain(model, IMAGES, method="gradcam").scores
    alone = torch.cat([relevancy.explain(model, IMAGES[i:i + 1], method="gradcam").scores for i in range(3)])
    assert (batched - alone).abs().max() < 1e-12
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_refused_where_the_family_does_not_offer_it():
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                     intermediate_size=16)).eval()
    with pytest.raises(UnsupportedModelError, match="gradcam"):
        relevancy.explain(model, torch.tensor([[1, 2, 3]]), method="gradcam")
