"""Positive and negative perturbation tests (Chefer et al., CVPR'21).

Protocol of the authors' ``baselines/ViT/generate_visualizations.py`` and
``baselines/ViT/pertubation_eval_from_hdf5.py``:

* the map is upsampled to the image with bilinear interpolation (``align_corners=False``) and min-max
  normalised per image (what they store in ``results.hdf5``);
* for the negative test the map is negated; for each step ``s`` the pixels
  ``torch.topk(map, int(H * W * s))`` are set to 0 in all channels of the *un-normalised* [0, 1] image, which
  is then normalised again and classified;
* a hit is ``argmax(logits) == true label``; step 0 is the clean image (nothing removed);
* the AUC is ``100 * trapezoid(accuracy, x=steps)`` over ``0.0, 0.1, ..., 0.9`` (at most 90).

Ranking uses ``torch.topk`` with a fresh ``k`` per step, like the reference, so ties are broken the same
way on the same device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .segmentation import normalised_maps

__all__ = ["STEPS", "TESTS", "PerturbationTest", "perturbation_auc", "perturbation_test"]

STEPS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
TESTS: tuple[str, ...] = ("positive", "negative")

Transform = Callable[[torch.Tensor], torch.Tensor]


def _pixel_transforms(
    images: torch.Tensor,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    unnormalize: Transform | None,
    normalize: Transform | None,
) -> tuple[Transform, Transform]:
    """The (unnormalize, normalize) pair: given callables, or built from mean/std, or identities."""
    if (unnormalize is None) != (normalize is None):
        raise ValueError("give both unnormalize and normalize, or neither")
    if unnormalize is not None and normalize is not None:
        return unnormalize, normalize
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std, or neither")
    if mean is None or std is None:
        return (lambda x: x), (lambda x: x)
    m = torch.as_tensor(mean, dtype=images.dtype, device=images.device)[None, :, None, None]
    s = torch.as_tensor(std, dtype=images.dtype, device=images.device)[None, :, None, None]
    return (lambda x: x * s + m), (lambda x: (x - m) / s)


def _removal_masks(vis: torch.Tensor, steps: Sequence[float]) -> torch.Tensor:
    """``(S, B, H*W)`` bool: the ``int(H*W*step)`` top entries of ``vis`` for each step."""
    n = vis.shape[1]
    masks = torch.zeros((len(steps), *vis.shape), dtype=torch.bool, device=vis.device)
    for i, step in enumerate(steps):
        k = int(n * step)
        if k > 0:
            masks[i].scatter_(1, torch.topk(vis, k, dim=-1).indices, True)
    return masks


@torch.no_grad()
def perturbation_test(
    model: Callable[[torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    maps: torch.Tensor,
    labels: torch.Tensor,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    unnormalize: Transform | None = None,
    normalize: Transform | None = None,
    tests: Sequence[str] = TESTS,
    steps: Sequence[float] = STEPS,
    batch_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Top-1 hits of ``model`` on perturbed copies of ``images``: ``{test: (B, len(steps)) bool}``.

    ``images`` are normalised model inputs ``(B, 3, H, W)``; ``mean``/``std`` (or the
    ``unnormalize``/``normalize`` pair) map them to [0, 1] pixels and back; with neither, images are taken
    to be pixels already. ``maps`` are ``(B, h, w)`` patch-grid or ``(B, H, W)`` pixel relevance maps,
    ``labels`` the true classes. All perturbed copies (the clean one shared by the tests) are classified in
    forward passes of ``batch_size`` images (default: ``B``).
    """
    unknown = set(tests) - set(TESTS)
    if unknown:
        raise ValueError(f"unknown tests {sorted(unknown)}; choose from {TESTS}")
    b, _, h, w = images.shape
    unnorm, norm = _pixel_transforms(images, mean, std, unnormalize, normalize)
    pixels = unnorm(images).reshape(b, images.shape[1], h * w)
    vis = normalised_maps(maps.to(images.device), (h, w)).flatten(1)
    labels = labels.to(images.device)

    # One removal mask per (test, step); a step that removes nothing is classified once for all tests.
    masks, slots = [], {}
    for test in tests:
        test_masks = _removal_masks(-vis if test == "negative" else vis, steps)
        for i, step in enumerate(steps):
            key = ("clean",) if int(h * w * step) == 0 else (test, i)
            if key not in slots:
                slots[key] = len(masks)
                masks.append(test_masks[i])
    stacked = torch.stack(masks)  # (V, B, H*W)

    flat_hits = torch.empty(stacked.shape[0] * b, dtype=torch.bool, device=images.device)
    chunk = batch_size or b
    for start in range(0, flat_hits.numel(), chunk):
        idx = torch.arange(start, min(start + chunk, flat_hits.numel()), device=images.device)
        version, image = idx // b, idx % b
        removed = stacked[version, image][:, None, :]
        x = torch.where(removed, torch.zeros((), dtype=pixels.dtype, device=pixels.device), pixels[image])
        logits = model(norm(x.reshape(len(idx), -1, h, w)))
        flat_hits[start : start + len(idx)] = logits.argmax(dim=1) == labels[image]
    hits = flat_hits.reshape(stacked.shape[0], b)

    out = {}
    for test in tests:
        rows = [slots[("clean",) if int(h * w * step) == 0 else (test, i)] for i, step in enumerate(steps)]
        out[test] = hits[rows].T.contiguous()
    return out


def perturbation_auc(accuracy: Sequence[float], steps: Sequence[float] = STEPS) -> float:
    """``100 * trapezoid(accuracy, x=steps)``: the papers' AUC of an accuracy curve (max 90 for 0..0.9)."""
    return 100.0 * float(np.trapezoid(np.asarray(accuracy, dtype=np.float64), x=np.asarray(steps)))


class PerturbationTest:
    """Accumulates per-image perturbation hits; ``compute()`` gives accuracy curves and AUCs.

    State is the per-image hit lists (plain Python), so ``merge`` of partial results from several
    processes gives exactly the single-process result.
    """

    def __init__(
        self,
        *,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        unnormalize: Transform | None = None,
        normalize: Transform | None = None,
        tests: Sequence[str] = TESTS,
        steps: Sequence[float] = STEPS,
        batch_size: int | None = None,
    ) -> None:
        self.mean, self.std = mean, std
        self.unnormalize, self.normalize = unnormalize, normalize
        self.steps = tuple(float(s) for s in steps)
        self.batch_size = batch_size
        self.hits: dict[str, list[list[bool]]] = {t: [] for t in tests}

    def update(
        self,
        model: Callable[[torch.Tensor], torch.Tensor],
        images: torch.Tensor,
        maps: torch.Tensor,
        labels: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Run the tests on a batch (see :func:`perturbation_test`), store and return the hits."""
        hits = perturbation_test(
            model, images, maps, labels, mean=self.mean, std=self.std, unnormalize=self.unnormalize,
            normalize=self.normalize, tests=tuple(self.hits), steps=self.steps, batch_size=self.batch_size,
        )
        for test, h in hits.items():
            self.hits[test].extend(h.cpu().tolist())
        return hits

    def merge(self, other: PerturbationTest) -> PerturbationTest:
        """Add ``other``'s images to this accumulator (in place; returns ``self``)."""
        if other.steps != self.steps or set(other.hits) != set(self.hits):
            raise ValueError("cannot merge perturbation tests with different steps or tests")
        for test in self.hits:
            self.hits[test].extend(other.hits[test])
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (for ``torch.distributed.all_gather_object``)."""
        return {"steps": list(self.steps), "hits": {t: [list(r) for r in h] for t, h in self.hits.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PerturbationTest:
        """Rebuild an accumulator (without model-side settings) from :meth:`state_dict`."""
        acc = cls(tests=tuple(state["hits"]), steps=state["steps"])
        acc.hits = {t: [list(r) for r in h] for t, h in state["hits"].items()}
        return acc

    def compute(self) -> dict[str, Any]:
        """``{'<test>_auc', '<test>_curve' (accuracy per step), 'steps', 'num_images'}``."""
        out: dict[str, Any] = {"steps": list(self.steps)}
        for test, rows in self.hits.items():
            n = len(rows)
            counts = np.asarray(rows, dtype=np.int64).reshape(n, len(self.steps)).sum(axis=0)
            curve = (counts / n if n else np.full(len(self.steps), np.nan)).tolist()
            out[f"{test}_curve"] = curve
            out[f"{test}_auc"] = perturbation_auc(curve, self.steps)
            out["num_images"] = n
        return out
