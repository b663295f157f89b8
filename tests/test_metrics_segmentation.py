import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import average_precision_score

from relevancy.evaluation.metrics import SegmentationTest, segmentation_scores


def _reference_image(res_grid: torch.Tensor, labels: torch.Tensor, scale: int):
    """``eval_batch`` of ``imagenet_seg_eval.py`` and ``utils/metrices.py`` for one image (batch size 1)."""
    res = F.interpolate(res_grid.reshape(1, 1, *res_grid.shape), scale_factor=scale, mode="bilinear")
    res = (res - res.min()) / (res.max() - res.min())
    ret = res.mean()
    res_1 = res.gt(ret).type(res.type())
    res_0 = res.le(ret).type(res.type())
    res_1_ap = res
    res_0_ap = 1 - res
    res_1[res_1 != res_1] = 0
    res_0[res_0 != res_0] = 0
    res_1_ap[res_1_ap != res_1_ap] = 0
    res_0_ap[res_0_ap != res_0_ap] = 0
    output = torch.cat((res_0, res_1), 1)
    output_ap = torch.cat((res_0_ap, res_1_ap), 1)
    labels = labels[None]

    # batch_pix_accuracy
    _, predict = torch.max(output[0], 0)
    predict = predict.numpy() + 1
    target = labels[0].numpy() + 1
    labeled = np.sum(target > 0)
    correct = np.sum((predict == target) * (target > 0))

    # batch_intersection_union
    predict = predict * (target > 0).astype(predict.dtype)
    intersection = predict * (predict == target)
    area_inter, _ = np.histogram(intersection, bins=2, range=(1, 2))
    area_pred, _ = np.histogram(predict, bins=2, range=(1, 2))
    area_lab, _ = np.histogram(target, bins=2, range=(1, 2))
    area_union = area_pred + area_lab - area_inter

    # get_ap_scores
    pred, tgt = output_ap[0], labels[0]
    t = tgt.unsqueeze(0).clamp(min=0).long()
    target_1hot = torch.zeros_like(tgt.unsqueeze(0).expand_as(pred)).scatter_(0, t, 1)
    ap = np.nan_to_num(average_precision_score(target_1hot.numpy().reshape(-1), pred.numpy().reshape(-1)))
    return correct, labeled, area_inter, area_union, ap


def _reference_totals(grids, masks, scale):
    total_inter, total_union, total_correct, total_label = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
    total_ap = []
    for g, m in zip(grids, masks):
        correct, labeled, inter, union, ap = _reference_image(g, m, scale)
        total_correct += correct.astype("int64")
        total_label += labeled.astype("int64")
        total_inter += inter.astype("int64")
        total_union += union.astype("int64")
        total_ap += [ap]
    pix_acc = np.float64(1.0) * total_correct / (np.spacing(1, dtype=np.float64) + total_label)
    iou = np.float64(1.0) * total_inter / (np.spacing(1, dtype=np.float64) + total_union)
    return pix_acc, iou, iou.mean(), np.mean(total_ap)


def _data(b=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    grids = torch.rand(b, 4, 4, generator=g) ** 3
    masks = torch.zeros(b, 32, 32, dtype=torch.long)
    for i in range(b):
        y, x = torch.randint(0, 16, (2,), generator=g).tolist()
        masks[i, y : y + 16, x : x + 12] = 1
    return grids, masks


def test_matches_reference_scripts():
    grids, masks = _data()
    acc = SegmentationTest()
    per_image = acc.update(grids, masks)
    for i in range(len(grids)):
        correct, labeled, inter, union, ap = _reference_image(grids[i], masks[i], 8)
        assert per_image["correct"][i] == correct and per_image["labeled"][i] == labeled
        assert per_image["intersection"][i].tolist() == inter.tolist()
        assert per_image["union"][i].tolist() == union.tolist()
        assert per_image["ap"][i].item() == ap
    pix_acc, iou, miou, m_ap = _reference_totals(grids, masks, 8)
    out = acc.compute()
    assert out["pixel_accuracy"] == pix_acc
    assert out["iou"] == iou.tolist()
    assert out["miou"] == miou
    assert out["map"] == pytest.approx(m_ap, rel=1e-15)


def test_hand_made_mask():
    # Pixel-level map (no upsampling): foreground prediction = pixels above the mean (here 3/16).
    res = torch.tensor([[[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    mask = torch.tensor([[[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]])
    s = segmentation_scores(res, mask)
    assert s["correct"].tolist() == [15] and s["labeled"].tolist() == [16]
    assert s["intersection"].tolist() == [[12, 3]]
    assert s["union"].tolist() == [[13, 4]]
    acc = SegmentationTest()
    acc.update(res, mask)
    out = acc.compute()
    assert out["pixel_accuracy"] == pytest.approx(15 / 16)
    assert out["iou"] == pytest.approx([12 / 13, 3 / 4])
    assert out["miou"] == pytest.approx((12 / 13 + 3 / 4) / 2)


def test_perfect_and_constant_maps():
    mask = torch.zeros(1, 8, 8, dtype=torch.long)
    mask[0, 2:6, 2:6] = 1
    s = segmentation_scores(mask.float(), mask)
    assert s["correct"].item() == 64 and s["ap"].item() == 1.0
    flat = segmentation_scores(torch.ones(1, 8, 8), mask)  # NaN after min-max: all background
    assert flat["correct"].item() == 48
    assert flat["intersection"].tolist() == [[48, 0]]
    assert flat["ap"].item() == 0.5  # all scores 0 over both channels, half of them positive


def test_merge_is_exact_and_associative():
    grids, masks = _data(b=7, seed=1)
    single = SegmentationTest()
    single.update(grids, masks)
    a, b, c = SegmentationTest(), SegmentationTest(), SegmentationTest()
    a.update(grids[:2], masks[:2])
    b.update(grids[2:3], masks[2:3])
    c.update(grids[3:], masks[3:])
    left = SegmentationTest.from_state(a.state_dict()).merge(b).merge(c)
    right = SegmentationTest.from_state(a.state_dict()).merge(SegmentationTest.from_state(b.state_dict()).merge(c))
    assert left.compute() == single.compute() == right.compute()
    assert single.compute()["num_images"] == 7
    assert math.isnan(SegmentationTest().compute()["map"])
