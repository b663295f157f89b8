"""The image benchmarks' data: what each batch holds.

Every benchmark is a fixed list of batches (a batch = a list of item indices). Process ``rank`` of ``world``
takes batches ``rank, rank + world, ...`` (`relevancy.evaluation.shards`); the batches themselves do not depend
on the number of processes, so every image is explained in exactly the same batch as in a single-process run and
the merged metrics are exactly the single-process ones.

* ``shapes``: scene ``i`` of each set is rendered alone from its own seed (:func:`scene_seed`), so any subset
  of scenes can be produced in any process. Set ``single`` (one object) and set ``pair`` (two objects).
* ``imagenet``: an ImageFolder validation set; the ``n`` images are the first ``n`` of a permutation of the
  whole folder drawn with ``--seed`` (the folder is sorted by class, its head would be one class).
* ``imagenet-seg``: ``gtsegs_ijcv.mat``, its first ``n`` images in file order.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "BENCHMARKS",
    "MAX_SCENES",
    "SHAPES_SEED_BASE",
    "Batch",
    "plan_batches",
    "scene_seed",
    "shapes_batch",
]

BENCHMARKS = ("shapes", "imagenet", "imagenet-seg", "eraser", "shapes-clip", "coco-detr", "shapes-detection", "shapes-vqa",
              "llm-retrieval", "vlm-shapes")

#: first per-scene seed of the evaluation scenes: above every training seed (< 10**9) and away from the
#: whole-batch seeds of ``bench.evaluate_accuracy`` (10**9, 10**9 + 1) and of training validation (10**9 + 10**4)
SHAPES_SEED_BASE = 1_100_000_000
#: scenes per set and per ``--seed`` (each seed owns a disjoint block of scene seeds)
MAX_SCENES = 5_000_000


def scene_seed(seed: int, kind: str, index: int) -> int:
    """The ``make_scenes`` seed of scene ``index`` of set ``kind`` ("single" or "pair") under run seed ``seed``."""
    if not 0 <= index < MAX_SCENES:
        raise ValueError(f"scene index must be in 0..{MAX_SCENES - 1}, got {index}")
    return SHAPES_SEED_BASE + seed * 2 * MAX_SCENES + 2 * index + (kind == "pair")


@dataclass(frozen=True)
class Batch:
    """One unit of work: ``kind`` names the set ("single", "pair", "images"), ``indices`` its items."""

    kind: str
    indices: tuple[int, ...]


def plan_batches(kind: str, indices: Sequence[int], batch_size: int) -> list[Batch]:
    """``indices`` cut into consecutive batches of ``batch_size`` (the last one may be shorter)."""
    return [Batch(kind, tuple(int(i) for i in indices[s : s + batch_size])) for s in range(0, len(indices), batch_size)]


def shapes_batch(batch: Batch, seed: int) -> Mapping[str, torch.Tensor]:
    """Render the scenes of ``batch``: ``images`` (B, 3, H, W), ``labels`` (B, objects), ``masks`` (B, objects, H, W)."""
    from ..worlds import make_scenes

    objects = 2 if batch.kind == "pair" else 1
    scenes = [make_scenes(1, seed=scene_seed(seed, batch.kind, i), objects=objects) for i in batch.indices]
    return {
        "images": torch.cat([s.images for s in scenes]),
        "labels": torch.cat([s.labels for s in scenes]),
        "masks": torch.cat([s.masks for s in scenes]),
    }


def imagenet_order(length: int, seed: int) -> np.ndarray:
    """The evaluation order of an ImageFolder of ``length`` images: a permutation drawn with ``seed``."""
    return np.random.default_rng(seed).permutation(length)


class WnidToImageNetIndex:
    """Target transform: folder index -> ImageNet-1k class index of the folder's WordNet id (picklable)."""

    def __init__(self, classes: Sequence[str], synsets: Sequence[str]) -> None:
        position = {w: i for i, w in enumerate(synsets)}
        self.indices = [position[c] for c in classes]

    def __call__(self, target: int) -> int:
        return self.indices[target]


def imagenet_labels(dataset: Any, num_classes: int | None) -> str:
    """Make ``dataset`` (an ImageFolder) give ImageNet-1k class indices when that is what the folders are.

    ImageFolder numbers the folders in sorted order, which is ImageNet's order only for the full 1,000 classes;
    for a 1000-class model and folders that are all ImageNet-1k WordNet ids, the label of each folder is
    its ImageNet index (a subset of the classes then keeps the right labels). Returns how labels are read.
    """
    from timm.data import ImageNetInfo

    synsets = list(ImageNetInfo().label_names())
    classes = list(dataset.classes)
    if num_classes == len(synsets) and set(classes) <= set(synsets):
        if classes != synsets:
            dataset.target_transform = WnidToImageNetIndex(classes, synsets)
        return "ImageNet-1k index of each folder's WordNet id"
    return "sorted folder order (ImageFolder)"


def loader(dataset: Any, batches: Sequence[Batch], workers: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, targets)`` of each of ``batches`` from a map-style ``dataset``, in order."""
    from torch.utils.data import DataLoader

    sampler = [list(b.indices) for b in batches]
    return iter(DataLoader(dataset, batch_sampler=sampler, num_workers=workers))
