"""TAM's plausibility metrics (`relevancy.evaluation.metrics.plausibility`): Otsu's threshold (OpenCV's, the DETR
test's) as scikit-image finds it,
the object IoU of a thresholded map, the function IoU against a threshold, their F1, and the common grey scale."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from skimage.filters import threshold_otsu

from relevancy.evaluation.metrics.detection_masks import otsu_threshold
from relevancy.evaluation.metrics.plausibility import f1_iou, function_iou, grey_levels, object_iou


@pytest.mark.parametrize("seed", range(5))
def test_otsu_equals_scikit_image(seed):
    """Two blobs of grey levels: the level that splits them best, as scikit-image's `threshold_otsu` gives it."""
    rng = np.random.default_rng(seed)
    grey = np.concatenate([rng.normal(60, 15, 500), rng.normal(170, 25, 300)]).clip(0, 255).astype(np.uint8)
    assert otsu_threshold(grey) == int(threshold_otsu(grey))


def test_otsu_of_constant_and_two_levels():
    assert otsu_threshold(np.full((4, 4), 7, dtype=np.uint8)) == 0
    two = np.array([10] * 5 + [200] * 3, dtype=np.uint8)
    assert 10 <= otsu_threshold(two) < 200  # everything at 200 above it, at 10 not


def test_object_iou_of_a_map_on_its_mask():
    """A map that is the mask itself (on a 4 x 4 grid, upsampled to 8 x 8) has IoU 1; half of it on the mask, 1/2."""
    mask = torch.zeros(1, 8, 8, dtype=torch.bool)
    mask[0, :4, :4] = True
    grid = torch.zeros(1, 4, 4, dtype=torch.uint8)
    grid[0, :2, :2] = 255
    iou, threshold = object_iou(grid, mask)
    assert 0 <= threshold[0] < 255 and iou[0] > 0.5
    exact = torch.zeros(1, 8, 8, dtype=torch.uint8)
    exact[0, :4, :4] = 255
    assert object_iou(exact, mask)[0][0] == 1
    wider = torch.zeros(1, 8, 8, dtype=torch.uint8)
    wider[0, :4, :8] = 255
    assert object_iou(wider, mask)[0][0] == 0.5


def test_function_iou_grey_levels_and_f1():
    grey = torch.tensor([[[0, 10], [100, 200]]], dtype=torch.uint8)
    assert function_iou(grey, torch.tensor([50.0]))[0] == 0.5
    assert torch.equal(grey_levels(torch.tensor([[[-1.0, 0.5], [1.0, 2.0]]]), torch.tensor([2.0])),
                       torch.tensor([[[0, 63], [127, 255]]], dtype=torch.uint8))
    assert torch.equal(grey_levels(torch.ones(1, 2, 2), torch.tensor([0.0])), torch.zeros(1, 2, 2, dtype=torch.uint8))
    assert f1_iou(0.5, 0.5) == 0.5 and f1_iou(0.0, 0.0) == 0.0 and math.isnan(f1_iou(math.nan, 0.5))
