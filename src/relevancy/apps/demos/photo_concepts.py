"""Concepts that generalise: on a real photograph with two objects, does a concept made from example images of
one object, taken from *other* photographs, put its CDAM relevance on that object? (issue 24 item 9)

The photographs available offline that show two or more objects with a hand-drawn box each (`SCENES`, boxes in the
photograph's pixels, `(top, left, bottom, right)`, an object possibly several boxes):
- scikit-image's astronaut: a person, a flag, a rocket (a model space shuttle);
- matplotlib's Grace Hopper portrait: a person, a flag;
- scikit-image's cameraman: a person, a camera on a tripod;
- scikit-image's rocket: a rocket, launch towers.
A concept of object X for scene S is made only from photographs other than S: crops of X's boxes in the other
scenes (a person from the two other portraits, a flag from the other flag, the launch photograph's rocket for the
astronaut's model and back). Objects that appear in one photograph only (camera, towers) have no concept, but
their boxes still count as "the other object". Five more concepts from photographs with one object (`DISTRACTORS`:
cat, coffee cup, motorcycle, flower, temple) complete each scene's set of concepts.

Each scene (resized whole to `SIZE` x `SIZE`, and its mirror image) is explained by CDAM for every object that has a
concept, both as the plain concept (the examples' mean image feature) and as the concept contrasted with the rest
of the set (`relevancy.Concept.contrasted`); `relevancy.evaluation.metrics.discrimination` scores each map against the
object's box ("target") and the box of the other object of the pair ("other").
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from ...core.extras import require
from ...methods.targets import CONCEPT_KINDS
from .photos import EXAMPLES, PHOTOS, Photo, _grace_hopper, _skimage

SIZE = 224  # 16 x 16 patches
Box = tuple[int, int, int, int]  # top, left, bottom, right (exclusive), in the photograph's pixels


@dataclass(frozen=True)
class Scene:
    """A photograph and its objects' boxes."""

    credit: str
    read: Callable[[], np.ndarray]
    objects: dict[str, tuple[Box, ...]]


@functools.cache
def _sklearn(name: str) -> np.ndarray:
    return require("sklearn.datasets", "photos").load_sample_image(name)


#: the photographs with two or more boxed objects (boxes drawn by hand for this benchmark)
SCENES = {
    "astronaut": Scene("scikit-image data.astronaut (NASA)", _skimage("astronaut"), {
        "person": ((10, 110, 260, 310), (260, 20, 512, 360)),
        "flag": ((0, 0, 260, 90),),
        "rocket": ((0, 350, 260, 475),),
    }),
    "grace_hopper": Scene("matplotlib sample data grace_hopper.jpg", _grace_hopper, {
        "person": ((20, 150, 600, 512), (340, 20, 600, 150)),
        "flag": ((0, 0, 340, 150),),
    }),
    "camera": Scene("scikit-image data.camera", _skimage("camera"), {
        "person": ((60, 0, 512, 150), (60, 150, 340, 250)),
        "camera": ((130, 250, 512, 410),),
    }),
    "rocket": Scene("scikit-image data.rocket (SpaceX)", _skimage("rocket"), {
        "rocket": ((125, 295, 410, 345),),
        "tower": ((0, 0, 427, 90), (0, 550, 427, 640)),
    }),
}
#: concepts from photographs of one object, never explained: the rest of every scene's set of concepts
DISTRACTORS = {
    **{name: PHOTOS[name] for name in ("cat", "coffee cup", "motorcycle")},
    "flower": Photo("flower", "scikit-learn sample image flower.jpg", functools.partial(_sklearn, "flower.jpg"), (90, 160, 300)),
    "temple": Photo("china", "scikit-learn sample image china.jpg", functools.partial(_sklearn, "china.jpg"), (10, 0, 400)),
}


def object_photo(scene: str, name: str) -> Photo:
    """The square around an object's boxes (as large as their larger side, inside the photograph): where its
    example crops come from."""
    found = SCENES[scene]
    boxes = np.array(found.objects[name])
    top, left, bottom, right = boxes[:, 0].min(), boxes[:, 1].min(), boxes[:, 2].max(), boxes[:, 3].max()
    height, width = found.read().shape[:2]
    side = min(max(bottom - top, right - left), height, width)
    square_top = int(np.clip((top + bottom - side) // 2, 0, height - side))
    square_left = int(np.clip((left + right - side) // 2, 0, width - side))
    return Photo(f"{scene} {name}", found.credit, found.read, (square_top, square_left, int(side)))


def example_sources(scene: str) -> dict[str, list[Photo]]:
    """Every concept that can be made without `scene`'s photograph, with the photographs of its examples."""
    sources: dict[str, list[Photo]] = {}
    for other, found in SCENES.items():
        if other != scene:
            for name in found.objects:
                sources.setdefault(name, []).append(object_photo(other, name))
    return {**sources, **{name: [photo] for name, photo in DISTRACTORS.items()}}


def scene_concepts(model: nn.Module, scene: str, count: int = EXAMPLES, seed: int = 0) -> dict:
    """`scene`'s set of concepts (plain), each the mean feature of `count` random crops of its example
    photographs in turn (half to nine tenths of the object's square, flipped half of the time)."""
    from ... import Concept
    from ...zoo.photos import normalise

    made = {}
    for k, (name, photos) in enumerate(sorted(example_sources(scene).items())):
        rng = np.random.default_rng([seed, k])
        crops = [photos[i % len(photos)].crop(SIZE, rng, scale=(0.5, 0.9)) for i in range(count)]
        made[name] = Concept(model, normalise(crops))
    return made


def scene_picture(scene: str) -> np.ndarray:
    """The whole photograph resized to `SIZE` x `SIZE` (bicubic), RGB uint8."""
    from PIL import Image

    return np.array(Image.fromarray(SCENES[scene].read()).resize((SIZE, SIZE), Image.BICUBIC))


def object_mask(scene: str, name: str) -> torch.Tensor:
    """`(SIZE, SIZE)` bool: the pixels of the resized photograph whose centres lie in one of the object's boxes."""
    height, width = SCENES[scene].read().shape[:2]
    rows = (torch.arange(SIZE) + 0.5) * height / SIZE
    cols = (torch.arange(SIZE) + 0.5) * width / SIZE
    mask = torch.zeros(SIZE, SIZE, dtype=torch.bool)
    for top, left, bottom, right in SCENES[scene].objects[name]:
        mask |= ((rows >= top) & (rows < bottom))[:, None] & ((cols >= left) & (cols < right))[None, :]
    return mask


def pairs(scene: str) -> list[tuple[str, str]]:
    """`(target, other)`: every ordered pair of the scene's objects whose target has a concept without it."""
    explained = example_sources(scene)
    names = list(SCENES[scene].objects)
    return [(target, other) for target in names for other in names if other != target and target in explained]


def evaluate(model: nn.Module, seeds: int = 5, count: int = EXAMPLES, scenes: tuple[str, ...] = tuple(SCENES),
             log: Callable[[str], None] = lambda _m: None) -> dict:
    """Every scene (and its mirror image) explained by CDAM for every pair's target, with `seeds` sets of example
    crops, for each concept kind: per kind the means over maps of the share of positive relevance on the target's
    box and on the other object's box, how often the map's peak is on the target, how often the target's share beats
    the other's and how often it does per unit of area (the share divided by the box's share of the picture; percent),
    overall and per pair, with the boxes' shares of the picture (what a map spread evenly would put on them)."""
    from ... import Concept, explain
    from ...evaluation.metrics.discrimination import class_discrimination
    from ...zoo.photos import normalise

    started = time.perf_counter()
    rows: dict[str, list[dict]] = {kind: [] for kind in CONCEPT_KINDS}
    for scene in scenes:
        picture = scene_picture(scene)
        images = normalise([picture, picture[:, ::-1]])
        for seed in range(seeds):
            plain = scene_concepts(model, scene, count, seed)
            for kind in CONCEPT_KINDS:
                targets = Concept.contrasted(plain, kind=kind)
                for target, other in pairs(scene):
                    maps = explain(model, images, method="cdam", target=targets[target]).scores
                    masks = [object_mask(scene, name) for name in (target, other)]
                    scores = class_discrimination(maps, *(torch.stack([m, m.flip(-1)]) for m in masks))
                    for image in range(len(images)):
                        rows[kind].append({"pair": f"{scene}: {target} vs {other}", "seed": seed, "mirrored": bool(image),
                                           "target_area": float(masks[0].float().mean()), "other_area": float(masks[1].float().mean()),
                                           **{key: float(value[image]) for key, value in scores.items()}})
            log(f"{scene}, seed {seed}: {time.perf_counter() - started:.0f} s")
    return {"size": SIZE, "examples": count, "seeds": seeds, "seconds": time.perf_counter() - started,
            "kinds": {kind: summary(found) for kind, found in rows.items()}, "maps": rows}


def summary(rows: list[dict]) -> dict:
    """Percent means over maps, overall and per pair."""

    def means(chosen: list[dict]) -> dict:
        return {
            "on_target": 100 * float(np.mean([r["target_share"] for r in chosen])),
            "on_other": 100 * float(np.mean([r["other_share"] for r in chosen])),
            "peak_on_target": 100 * float(np.mean([r["pointing"] for r in chosen])),
            "target_beats_other": 100 * float(np.mean([r["target_share"] > r["other_share"] for r in chosen])),
            "denser_on_target": 100 * float(np.mean([r["target_share"] / r["target_area"] > r["other_share"] / r["other_area"] for r in chosen])),
            "target_area": 100 * float(np.mean([r["target_area"] for r in chosen])),
            "other_area": 100 * float(np.mean([r["other_area"] for r in chosen])),
            "maps": len(chosen),
        }

    names = list(dict.fromkeys(r["pair"] for r in rows))
    return {**means(rows), "per_pair": {name: means([r for r in rows if r["pair"] == name]) for name in names}}
