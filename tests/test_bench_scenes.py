"""The synthetic shapes world: determinism, exact masks, layout and speed."""

import time

import numpy as np
import pytest
import torch

from relevancy.worlds import CLASSES, IMAGE_SIZE, MEAN, PATCH_SIZE, STD, make_scenes, render_object


def test_constants_and_shapes():
    assert IMAGE_SIZE == 64 and PATCH_SIZE == 8 and IMAGE_SIZE % PATCH_SIZE == 0
    assert len(CLASSES) >= 10 and len(set(CLASSES)) == len(CLASSES)
    for objects in (1, 2):
        s = make_scenes(16, seed=3, objects=objects)
        assert len(s) == 16 and s.objects == objects
        assert s.images.shape == (16, 3, 64, 64) and s.images.dtype == torch.float32
        assert s.pixels.shape == (16, 64, 64, 3) and s.pixels.dtype == np.uint8
        assert s.labels.shape == (16, objects) and s.labels.dtype == torch.long
        assert s.masks.shape == (16, objects, 64, 64) and s.masks.dtype == torch.bool
        assert int(s.labels.min()) >= 0 and int(s.labels.max()) < len(CLASSES)
        assert s.masks.flatten(2).any(2).all(), "every object paints pixels"


def test_images_are_normalised_pixels():
    s = make_scenes(8, seed=1)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    expect = (torch.from_numpy(s.pixels).permute(0, 3, 1, 2).float() / 255 - mean) / std
    assert torch.allclose(s.images, expect, atol=1e-6)


@pytest.mark.parametrize("objects", [1, 2])
def test_deterministic_for_seed(objects):
    a = make_scenes(40, seed=123, objects=objects)
    b = make_scenes(40, seed=123, objects=objects)
    c = make_scenes(40, seed=124, objects=objects)
    assert np.array_equal(a.pixels, b.pixels)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.masks, b.masks)
    assert not np.array_equal(a.pixels, c.pixels)


def test_chunking_does_not_change_scenes():
    a = make_scenes(30, seed=5, chunk=7)
    b = make_scenes(30, seed=5)
    # noise streams are per chunk, so only objects (painted last) must agree
    assert torch.equal(a.masks, b.masks) and torch.equal(a.labels, b.labels)
    m = a.masks[:, 0].numpy()
    assert np.array_equal(a.pixels[m], b.pixels[m])


@pytest.mark.parametrize("objects", [1, 2])
def test_masks_match_rerendered_objects(objects):
    s = make_scenes(60, seed=7, objects=objects)
    for i in range(len(s)):
        for j in range(objects):
            pix, mask = render_object(**s.object_params(i, j))
            assert np.array_equal(mask, s.masks[i, j].numpy())
            # the scene shows exactly the object's own pixels inside its mask
            assert np.array_equal(pix[mask], s.pixels[i][mask])
            assert not pix[~mask].any()
            assert s.object_params(i, j)["cls"] == s.labels[i, j]


def test_every_class_renders_and_is_distinct():
    base = dict(cx=32.0, cy=32.0, scale=14.0, angle=0.3, ax=1.0, ay=1.0, color=(200.0, 50.0, 50.0),
                color2=(100.0, 25.0, 25.0), tex=0, tex_angle=0.0, tex_period=4.0, tex_phase=0.0,
                tex_k=0.0)
    masks = [render_object(cls=k, **base)[1] for k in range(len(CLASSES))]
    for k, m in enumerate(masks):
        assert 80 < m.sum() < 64 * 64 // 2, CLASSES[k]
    for a in range(len(masks)):
        for b in range(a + 1, len(masks)):
            iou = (masks[a] & masks[b]).sum() / (masks[a] | masks[b]).sum()
            assert iou < 0.9, (CLASSES[a], CLASSES[b])


def test_two_object_masks_disjoint_with_gap():
    s = make_scenes(500, seed=11, objects=2)
    m = s.masks.numpy()
    assert not (m[:, 0] & m[:, 1]).any()
    assert (s.labels[:, 0] != s.labels[:, 1]).all()
    # at least a one-pixel gap: dilating object 0 by one pixel does not touch object 1
    d = m[:, 0].copy()
    d[:, 1:] |= m[:, 0, :-1]
    d[:, :-1] |= m[:, 0, 1:]
    d[:, :, 1:] |= m[:, 0, :, :-1]
    d[:, :, :-1] |= m[:, 0, :, 1:]
    assert not (d & m[:, 1]).any()


def test_classes_balanced():
    C = len(CLASSES)
    for objects in (1, 2):
        s = make_scenes(6000, seed=17, objects=objects)
        counts = np.bincount(s.labels.flatten().numpy(), minlength=C)
        expect = 6000 * objects / C
        assert counts.min() > 0.85 * expect and counts.max() < 1.15 * expect, counts


def test_scenes_vary_within_class():
    s = make_scenes(2000, seed=19)
    p = s.params
    for k in range(len(CLASSES)):
        sel = p["cls"][:, 0] == k
        assert np.ptp(p["scale"][sel, 0]) > 4
        assert np.ptp(p["angle"][sel, 0]) > 0.6
        assert np.ptp(p["color"][sel, 0], axis=0).min() > 150
        assert len(np.unique(p["tex"][sel, 0])) == 4


def test_clutter_present_outside_objects():
    s = make_scenes(200, seed=23)
    bg = ~s.masks[:, 0].numpy()
    # pixel noise and gradients: background is not flat
    assert np.mean([s.pixels[i][bg[i]].std() for i in range(200)]) > 5
    # distractors reuse the object colours: in many scenes some background
    # pixel has exactly an object colour variant
    hits = 0
    for i in range(200):
        pix, mask = render_object(**s.object_params(i, 0))
        cols = np.unique(pix[mask], axis=0)[:4]
        hits += any((s.pixels[i][bg[i]] == c).all(1).any() for c in cols)
    assert hits > 30


def test_generation_speed():
    make_scenes(64, seed=0)
    t = time.perf_counter()
    make_scenes(1000, seed=29, objects=2)
    dt = time.perf_counter() - t
    assert dt < 10.0, f"1000 scenes took {dt:.2f}s"  # typically ~0.6 s on one core


def test_clutter_only_changes_the_background():
    a = make_scenes(30, seed=31)
    b = make_scenes(30, seed=31, clutter=1.0)
    c = make_scenes(30, seed=31, clutter=np.linspace(0, 1, 30))
    assert np.array_equal(a.pixels, b.pixels)
    assert torch.equal(a.masks, c.masks) and torch.equal(a.labels, c.labels)
    assert np.array_equal(a.pixels[-1], c.pixels[-1])
    assert not np.array_equal(a.pixels[0], c.pixels[0])
