"""Every subcommand gives what its Python API counterpart gives, on every shipped model (issue 24 item 2): the
command reads the picture or text from a file or the shell, preprocesses it as the model needs and explains it;
the API is called on the world's own tensors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import relevancy
from relevancy.cli import main

TOLERANCE = dict(rtol=1e-4, atol=1e-6)


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
    from relevancy.bench import make_scenes

    scenes = make_scenes(1, seed=11, objects=2)
    path = tmp_path_factory.mktemp("parity") / "scene.png"
    Image.fromarray(scenes.pixels[0]).save(path)
    return path, scenes


def test_explain_gives_the_api_s_map_with_the_shipped_vit(scene, capsys):
    from relevancy.bench import load_model

    path, scenes = scene
    numbers = cli_json(capsys, "explain", str(path), "--method", "transformer_attribution", "--target", "star", "--json")
    got = numbers["images"][0]["methods"]["transformer_attribution"]
    expl = relevancy.explain(load_model(), scenes.images, method="transformer_attribution", target="star")
    assert got["target"] == int(expl.target[0]) == 5 and got["class"] == "star"
    torch.testing.assert_close(torch.tensor(got["scores"]), expl.scores[0].float(), **TOLERANCE)


def test_explain_text_pairs_give_the_api_s_maps_with_the_shipped_clip(scene, capsys):
    from relevancy.bench import load_clip
    from relevancy.bench.clip_model import CONTEXT_LENGTH
    from relevancy.families.clip.batch import ImageTextBatch

    path, scenes = scene
    caption = "a red star"
    numbers = cli_json(capsys, "explain", str(path), "--text", caption, "--method", "generic_attention", "--json")
    got = numbers["images"][0]["pairs"][0]["methods"]["generic_attention"]
    model, tokenizer = load_clip()
    batch = ImageTextBatch.grid(scenes.images, tokenizer.encode([caption], CONTEXT_LENGTH))
    expl = relevancy.explain(model, batch, method="generic_attention")
    assert got["logit"] == pytest.approx(float(expl.logits[0, 0]), rel=1e-5)
    torch.testing.assert_close(torch.tensor(got["image_scores"]), expl.parts["image"].scores[0].float(), **TOLERANCE)
    text_scores = [score for _, score in expl.parts["text"].token_scores(0)]
    torch.testing.assert_close(torch.tensor(got["text_scores"]), torch.tensor(text_scores), **TOLERANCE)


def test_explain_text_gives_the_api_s_scores_with_the_shipped_classifier(capsys):
    from relevancy.models import load_text_classifier
    from relevancy.text.model import encode

    text = "This medicine worked well and I slept better."
    numbers = cli_json(capsys, "explain-text", text, "--target", "Negative", "--json", "--tokens")
    got = numbers["texts"][0]["methods"]["transformer_attribution"]
    model, tokenizer = load_text_classifier(None)
    expl = relevancy.explain(model, encode(tokenizer, [text]), target="negative")
    assert got["target"] == int(expl.target[0]) and got["class"].lower() == "negative"
    pairs = expl.token_scores(0)
    assert got["tokens"] == [token for token, _ in pairs]
    torch.testing.assert_close(torch.tensor(got["scores"]), torch.tensor([s for _, s in pairs]), **TOLERANCE)


@pytest.fixture(scope="module")
def detector_folder(tmp_path_factory):
    """The shipped shapes DETR saved with save_pretrained (no image-processor config), and a scene of its world."""
    from relevancy.bench.detection import DETECTION_TEST_SEED, load_detector, make_detection_scenes

    folder = tmp_path_factory.mktemp("detr")
    load_detector().save_pretrained(folder / "model")
    scenes = make_detection_scenes(1, DETECTION_TEST_SEED + 1)
    Image.fromarray(scenes.pixels[0]).save(folder / "scene.png")
    return folder, scenes


def test_explain_detections_finds_what_the_api_finds_with_the_shipped_detr(detector_folder, capsys):
    from relevancy.bench.detection import detector_inputs, load_detector

    folder, scenes = detector_folder
    report = cli_json(capsys, "explain-detections", str(folder / "scene.png"), "--model", str(folder / "model"), "--json")
    model = load_detector()
    inputs = detector_inputs(scenes.images)
    detections = sorted(relevancy.detect(model, inputs)[0], key=lambda d: -d.score)
    assert len(detections) >= len(scenes.labels[0]) >= 1
    objects = report[0]["objects"]
    assert [(o["query"], o["label"]) for o in objects] == [(d.query, d.label) for d in detections]
    assert [o["probability"] for o in objects] == pytest.approx([d.score for d in detections], rel=1e-5)
    expl = relevancy.explain(model, inputs, method="generic_attention", target=[[(d.query, d.label) for d in detections]])
    torch.testing.assert_close(torch.tensor([o["scores"] for o in objects]), expl.parts["image"].scores.float(), **TOLERANCE)


def test_explain_detections_names_the_best_probability_when_nothing_passes(detector_folder, capsys):
    folder, _ = detector_folder
    report, err = cli_run(capsys, "explain-detections", str(folder / "scene.png"), "--model", str(folder / "model"),
                          "--threshold", "0.99999999", "--json")
    assert report == [{"image": str(folder / "scene.png"), "objects": []}]
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
    assert [o["query"] for o in with_processor[0]["objects"]] == [o["query"] for o in by_family[0]["objects"]]
    np.testing.assert_allclose([o["scores"] for o in with_processor[0]["objects"]],
                               [o["scores"] for o in by_family[0]["objects"]], rtol=1e-3, atol=1e-5)


def test_explain_question_gives_the_api_s_answer_and_maps_with_the_shipped_lxmert(capsys):
    from relevancy.bench.vqa import ANSWERS
    from relevancy.bench.vqa_model import load_vqa_lxmert
    from relevancy.bench.vqa_show import ask

    question = "what color is the square"
    numbers = cli_json(capsys, "explain-question", "--question", question, "--scene", "0", "--json")
    model, tokenizer = load_vqa_lxmert()
    batch = ask([question], 0, tokenizer)
    expl = relevancy.explain(model, batch.model_inputs(), method="generic_attention")
    assert numbers[0]["answer"] == ANSWERS[int(expl.target[0])]
    got = numbers[0]["methods"]["generic_attention"]
    torch.testing.assert_close(torch.tensor(got["region_scores"]), expl.parts["image"].scores[0].float(), **TOLERANCE)
