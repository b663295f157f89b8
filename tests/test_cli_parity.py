"""Every subcommand gives what its Python API counterpart gives, on every shipped model (issue 24 item 2): the
command reads the picture or text from a file or the shell, preprocesses it as the model needs and explains it;
the API is called on the world's own tensors, and the command's `--json` is that call's `to_json()`."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

import relevancy
from relevancy.apps.cli import main

TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def assert_is_to_json(got: dict, expl) -> None:
    """`got`, one entry of a command's `--json`, is `expl.to_json()`: the same keys, the same values, the tensors'
    dtypes and shapes, and their numbers equal up to `TOLERANCE` (the command reads the picture from a file)."""
    from relevancy.core.files import strict_json

    expected = json.loads(json.dumps(strict_json(expl.to_json())))
    assert got.keys() == expected.keys() and got["tensors"] == expected["tensors"] and got["kind"] == expected["kind"]
    loaded = relevancy.load(got)
    for item in dataclasses.fields(expl):
        mine, theirs = getattr(loaded, item.name), getattr(expl, item.name)
        if item.name == "concept":
            continue
        if isinstance(theirs, torch.Tensor) and theirs.is_floating_point():
            torch.testing.assert_close(mine, theirs.cpu(), **TOLERANCE)
        elif isinstance(theirs, torch.Tensor):
            assert torch.equal(mine, theirs.cpu()), item.name
        else:
            assert mine == theirs, item.name


def cli_json(capsys, *argv: str) -> object:
    return cli_run(capsys, *argv)[0]


def cli_run(capsys, *argv: str) -> tuple[object, str]:
    """The command's JSON (stdout) and its stderr."""
    assert main(list(argv)) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    """A two-object scene of the shapes world, saved as PNG, with its tensors."""
    from relevancy.worlds import make_scenes

    scenes = make_scenes(1, seed=11, objects=2)
    path = tmp_path_factory.mktemp("parity") / "scene.png"
    Image.fromarray(scenes.pixels[0]).save(path)
    return path, scenes


def test_explain_gives_the_api_s_map_with_the_shipped_vit(scene, capsys):
    from relevancy.worlds import load_model

    path, scenes = scene
    (got,) = cli_json(capsys, "explain", str(path), "--method", "transformer_attribution", "--target", "star", "--json")
    expl = relevancy.explain(load_model(), scenes.images, method="transformer_attribution", target="star")
    assert got["target"] == [5] and got["class_names"][5] == "star"
    assert_is_to_json(got, expl)


def test_explain_text_pairs_give_the_api_s_maps_with_the_shipped_clip(scene, capsys):
    from relevancy.worlds import load_clip
    from relevancy.worlds.shapes_clip import CONTEXT_LENGTH
    from relevancy.families.clip.batch import ImageTextBatch

    path, scenes = scene
    caption = "a red star"
    (got,) = cli_json(capsys, "explain", str(path), "--text", caption, "--method", "generic_attention", "--json")
    model, tokenizer = load_clip()
    encoded = tokenizer.encode([caption], CONTEXT_LENGTH)
    words = tokenizer.tokens(encoded["input_ids"])  # the command names the tokens too
    expl = relevancy.explain(model, ImageTextBatch.grid(scenes.images, encoded, tokens=words), method="generic_attention")
    assert got["tokens"] == [["<start>", "a", "red", "star", "<end>"]]
    assert_is_to_json(got, expl)


def test_explain_text_gives_the_api_s_scores_with_the_shipped_classifier(capsys):
    from relevancy.models import load_text_classifier
    from relevancy.zoo.text.model import encode

    text = "This medicine worked well and I slept better."
    (got,) = cli_json(capsys, "explain-text", text, "--target", "Negative", "--json", "--tokens")
    model, tokenizer = load_text_classifier(None)
    expl = relevancy.explain(model, encode(tokenizer, [text], model=model), target="Negative")
    assert got["class_names"][got["target"][0]].lower() == "negative"
    assert_is_to_json(got, expl)


@pytest.fixture(scope="module")
def detector_folder(tmp_path_factory):
    """The shipped shapes DETR saved with save_pretrained (no image-processor config), and a scene of its world."""
    from relevancy.worlds.detection import DETECTION_TEST_SEED, load_detector, make_detection_scenes

    folder = tmp_path_factory.mktemp("detr")
    load_detector().save_pretrained(folder / "model")
    scenes = make_detection_scenes(1, DETECTION_TEST_SEED + 1)
    Image.fromarray(scenes.pixels[0]).save(folder / "scene.png")
    return folder, scenes


def test_explain_detections_finds_what_the_api_finds_with_the_shipped_detr(detector_folder, capsys):
    from relevancy.worlds.detection import detector_inputs, load_detector

    folder, scenes = detector_folder
    (got,) = cli_json(capsys, "explain-detections", str(folder / "scene.png"), "--model", str(folder / "model"), "--json")
    model = load_detector()
    inputs = detector_inputs(scenes.images)
    detections = sorted(relevancy.detect(model, inputs)[0], key=lambda d: -d.score)
    assert len(detections) >= len(scenes.labels[0]) >= 1
    expl = relevancy.explain(model, inputs, method="generic_attention", target=[[(d.query, d.label) for d in detections]])
    expl = dataclasses.replace(expl, boxes=torch.tensor([d.box for d in detections]))
    assert got["query"] == [d.query for d in detections] and got["target"] == [d.label for d in detections]
    assert_is_to_json(got, expl)


def test_explain_detections_names_the_best_probability_when_nothing_passes(detector_folder, capsys):
    folder, _ = detector_folder
    report, err = cli_run(capsys, "explain-detections", str(folder / "scene.png"), "--model", str(folder / "model"),
                          "--threshold", "0.99999999", "--json")
    assert report == []  # no image with an object: no result
    assert "no object above --threshold 0.99999999; the best is" in err and "at probability 0.99" in err


def test_explain_detections_takes_the_folder_s_image_processor(detector_folder, tmp_path, capsys):
    """A folder with a preprocessor_config.json is preprocessed by it: here the shapes world's own settings."""
    from transformers import DetrImageProcessor

    folder, _ = detector_folder
    DetrImageProcessor(size={"height": 64, "width": 64}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                       do_pad=False).save_pretrained(folder / "model")
    try:
        with_processor = cli_json(capsys, "explain-detections", str(folder / "scene.png"), "--model", str(folder / "model"), "--json")
    finally:
        (folder / "model" / "preprocessor_config.json").unlink()
    by_family = cli_json(capsys, "explain-detections", str(folder / "scene.png"), "--model", str(folder / "model"), "--json")
    assert with_processor[0]["query"] == by_family[0]["query"]
    np.testing.assert_allclose(with_processor[0]["scores"]["image"], by_family[0]["scores"]["image"], rtol=1e-3, atol=1e-5)


def test_explain_question_gives_the_api_s_answer_and_maps_with_the_shipped_lxmert(capsys):
    from relevancy.worlds.shapes_lxmert import load_vqa_lxmert
    from relevancy.apps.demos.questions import ask, explain_questions

    question = "what color is the square"
    (got,) = cli_json(capsys, "explain-question", "--question", question, "--scene", "0", "--json")
    model, tokenizer = load_vqa_lxmert()
    batch = ask([question], 0, tokenizer)
    assert_is_to_json(got, explain_questions(model, batch, method="generic_attention", tokenizer=tokenizer))
    plain = relevancy.explain(model, batch.model_inputs(), method="generic_attention")  # the API on the world's tensors
    torch.testing.assert_close(torch.tensor(got["scores"]["image"]), plain.parts["image"].scores.float(), **TOLERANCE)
