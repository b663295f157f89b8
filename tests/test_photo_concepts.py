"""The real-photograph concept benchmark's protocol (bench.photo_concepts) and one real photograph explained."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from relevancy import Concept, explain
from relevancy.apps.demos import photo_concepts as pc
from relevancy.apps.demos import photos as photo_demo
from relevancy.evaluation.metrics.discrimination import class_discrimination
from relevancy.zoo.photos import dinov2_small, normalise


@pytest.mark.parametrize("scene", list(pc.SCENES))
def test_boxes_lie_inside_their_photograph_and_objects_do_not_overlap(scene):
    height, width = pc.SCENES[scene].read().shape[:2]
    for boxes in pc.SCENES[scene].objects.values():
        for top, left, bottom, right in boxes:
            assert 0 <= top < bottom <= height and 0 <= left < right <= width
    masks = {name: pc.object_mask(scene, name) for name in pc.SCENES[scene].objects}
    assert all(mask.any() for mask in masks.values())
    for target, other in pc.pairs(scene):
        assert not (masks[target] & masks[other]).any()


def test_a_scenes_concepts_come_only_from_other_photographs():
    for scene in pc.SCENES:
        sources = pc.example_sources(scene)
        assert all(photo.read is not pc.SCENES[scene].read for photos in sources.values() for photo in photos)
        assert set(pc.DISTRACTORS) <= set(sources)
    assert [p.name for p in pc.example_sources("astronaut")["person"]] == ["grace_hopper person", "camera person"]
    assert {target for target, _ in pc.pairs("camera")} == {"person"}  # the camera is in one photograph only
    assert len(pc.pairs("astronaut")) == 6


def test_an_object_square_holds_its_boxes_inside_the_photograph():
    photo = pc.object_photo("rocket", "rocket")
    top, left, side = photo.square
    assert (top, side) == (125, 285) and left <= 295 and left + side >= 345
    assert photo.crop(28).shape == (28, 28, 3)


def test_a_concept_from_other_portraits_finds_the_astronaut_rather_than_the_model_rocket():
    """Real photograph: the person concept (Grace Hopper, the cameraman) against the scene's other concepts puts
    more of its positive relevance on the astronaut than on the model rocket beside her, for every kind."""
    model = dinov2_small("hf")
    plain = pc.scene_concepts(model, "astronaut", count=2)
    images = normalise([pc.scene_picture("astronaut")])
    person, rocket = pc.object_mask("astronaut", "person")[None], pc.object_mask("astronaut", "rocket")[None]
    for kind in ("plain", "contrast", "lda"):
        maps = explain(model, images, method="cdam", target=Concept.contrasted(plain, kind=kind)["person"]).scores
        shares = class_discrimination(maps, person, rocket)
        assert shares["target_share"].item() > 2 * shares["other_share"].item(), kind


def test_the_concepts_page_example_runs_as_written(tmp_path, monkeypatch):
    page = (Path(__file__).resolve().parents[1] / "docs" / "concepts.md").read_text()
    monkeypatch.chdir(tmp_path)  # what the example saves (cup_concept.png) lands there, not in the checkout
    namespace: dict = {}
    exec(compile(re.search(r"```python\n(.*?)```", page, re.S).group(1), "docs/concepts.md python block", "exec"), namespace)
    assert {concept.kind for concept in namespace["concepts"].values()} == {"lda"} and namespace["cup"].kind == "lda"
    assert set(namespace["concepts"]) == set(photo_demo.PHOTOS)
    assert (tmp_path / "cup_concept.png").stat().st_size > 0
