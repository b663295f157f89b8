"""The detection world (relevancy.worlds.detection) and the shipped shapes DETR."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import relevancy
from relevancy.worlds.detection import (
    DETECTION_TEST_SEED, boxes_from_masks, detector_inputs, evaluate_detector, load_detector, make_detection_scenes,
)
from relevancy.worlds.scenes import make_scenes



def test_scenes_hold_one_to_three_objects_of_distinct_classes():
    scenes = make_detection_scenes(60, seed=7)
    counts = np.array([len(labels) for labels in scenes.labels])
    assert set(counts) == {1, 2, 3}
    for labels, masks, boxes in zip(scenes.labels, scenes.masks, scenes.boxes):
        assert len(set(labels.tolist())) == len(labels) == len(masks) == len(boxes)
        assert not (masks.sum(0) > 1).any()  # objects never overlap
    again = make_detection_scenes(60, seed=7)
    assert np.array_equal(scenes.pixels, again.pixels)
    assert all(torch.equal(a, b) for a, b in zip(scenes.boxes, again.boxes))


def test_boxes_are_tight_around_the_masks():
    masks = make_scenes(20, seed=3, objects=3).masks.flatten(0, 1)
    boxes = boxes_from_masks(masks).long()
    for mask, (x0, y0, x1, y1) in zip(masks, boxes.tolist()):
        ys, xs = mask.nonzero(as_tuple=True)
        assert (x0, y0, x1, y1) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)


def test_training_targets_are_normalised_centre_boxes():
    scenes = make_detection_scenes(8, seed=1)
    for target, boxes in zip(scenes.hf_targets(), scenes.boxes):
        cx, cy, w, h = (target["boxes"] * 64).unbind(-1)
        assert torch.allclose(torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1), boxes, atol=1e-5)


@pytest.fixture(scope="module")
def detector():
    return load_detector()


def test_shipped_detector_finds_the_objects(detector):
    """The model card's figures are measured on 1,000 unseen scenes (src/relevancy/worlds/weights/shapes_detr.md);
    here 200 unseen scenes from the same seed, with some slack."""
    scores = evaluate_detector(detector, n=200, seed=DETECTION_TEST_SEED)
    assert scores["ap50"] >= 0.88 and scores["class_accuracy"] >= 0.9 and scores["recall50"] >= 0.93


def test_shipped_detector_maps_fall_on_the_detected_object(detector):
    scenes = make_detection_scenes(16, seed=DETECTION_TEST_SEED + 500)
    inputs = detector_inputs(scenes.images)
    expl = relevancy.explain(detector, inputs, method="generic_attention")  # every detection above 0.5
    boxes = {(i, d.query): d.box for i, found in enumerate(relevancy.detect(detector, inputs)) for d in found}
    maps = torch.nn.functional.interpolate(expl.parts["image"].scores[:, None].float(), size=(64, 64), mode="bilinear")[:, 0]
    shares, chance = [], []
    for row, (image, query) in enumerate(zip(expl.image.tolist(), expl.query.tolist())):
        positive = maps[row].clamp(min=0)
        x0, y0, x1, y1 = boxes[(image, query)]
        centre = torch.tensor([(x0 + x1) / 2, (y0 + y1) / 2])
        # the ground-truth object nearest to the detected box's centre
        masks = scenes.masks[image]
        centres = torch.stack([torch.stack(m.nonzero(as_tuple=True)[::-1]).float().mean(1) for m in masks])
        mask = masks[torch.argmin((centres - centre).norm(dim=1))]
        shares.append(float(positive[mask].sum() / positive.sum()))
        chance.append(float(mask.float().mean()))
    assert len(shares) >= 16
    assert np.mean(shares) > 3 * np.mean(chance)
