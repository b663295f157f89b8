import pytest
import torch

from relevancy.evaluation.metrics import DiscriminationTest, class_discrimination


def _scene():
    target = torch.zeros(2, 4, 4, dtype=torch.bool)
    other = torch.zeros(2, 4, 4, dtype=torch.bool)
    target[:, :2, :2] = True
    other[:, 2:, 2:] = True
    maps = torch.zeros(2, 4, 4)
    maps[0, 0, 0], maps[0, 1, 1], maps[0, 3, 3], maps[0, 0, 3] = 3.0, 1.0, -5.0, 1.0  # on target
    maps[1, 3, 3], maps[1, 0, 0] = 2.0, 2.0  # tie: the first argmax (0, 0) lies in the target
    maps[1, 2, 2] = 1.0
    return maps, target, other


def test_hand_made_scene():
    maps, target, other = _scene()
    s = class_discrimination(maps, target, other)
    assert s["target_share"].tolist() == pytest.approx([4 / 5, 2 / 5])
    assert s["other_share"].tolist() == pytest.approx([0.0, 3 / 5])
    assert s["pointing"].tolist() == [True, True]


def test_pointing_miss_and_no_positive_relevance():
    target = torch.zeros(2, 4, 4, dtype=torch.bool)
    target[:, 0, 0] = True
    other = ~target
    maps = -torch.ones(2, 4, 4)
    maps[0, 2, 2] = 1.0
    s = class_discrimination(maps, target, other)
    assert s["pointing"].tolist() == [False, True]  # all -1: first pixel, in the target
    assert s["target_share"].tolist() == [0.0, 0.0]
    assert s["other_share"].tolist() == [1.0, 0.0]


def test_patch_grid_maps_are_upsampled():
    grid = torch.zeros(1, 2, 2)
    grid[0, 0, 0] = 1.0
    target = torch.zeros(1, 8, 8, dtype=torch.bool)
    target[0, :4, :4] = True
    s = class_discrimination(grid, target, ~target)
    assert s["pointing"].item()
    assert 0.5 < s["target_share"].item() < 1.0


def test_accumulator_means_and_merge():
    maps, target, other = _scene()
    single = DiscriminationTest()
    single.update(maps, target, other)
    a, b = DiscriminationTest(), DiscriminationTest()
    a.update(maps[:1], target[:1], other[:1])
    b.update(maps[1:], target[1:], other[1:])
    merged = DiscriminationTest.from_state(a.state_dict()).merge(DiscriminationTest.from_state(b.state_dict()))
    out = single.compute()
    assert merged.compute() == out
    assert out["target_share"] == pytest.approx(0.6)
    assert out["other_share"] == pytest.approx(0.3)
    assert out["pointing"] == 1.0 and out["num_images"] == 2
