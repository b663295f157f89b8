"""`relevancy evaluate --benchmark vlm-shapes`: the scoring on hand-made maps and a model that reads one patch, the
words and their inputs, and the whole benchmark with maps given from outside on the shipped shapes LLaVA."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from relevancy.worlds.shapes_vlm import VLM_TEST_SEED, build_tokenizer, load_shapes_llava
from relevancy.worlds.vision_language import make_vlm
from relevancy.evaluation import vlm_shapes as VS
from relevancy.evaluation.deletion import area


class OnePatch(nn.Module):
    """A stand-in decoder whose log-probability of token 7 is the mean of patch (2, 3)'s pixels: deleting that patch
    (setting it to 0) is the only deletion that changes it."""

    config = SimpleNamespace(vision_config=SimpleNamespace(image_size=64, patch_size=8))

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, position_ids, pixel_values, use_cache):
        value = pixel_values[:, :, 16:24, 24:32].mean((1, 2, 3))
        logits = torch.zeros(len(input_ids), input_ids.shape[1], 10)
        logits[:, -1, 7] = value
        return SimpleNamespace(logits=logits)


def test_grounding_on_hand_made_maps():
    target = torch.zeros(3, 64, 64, dtype=torch.bool)
    target[:, :16, :16] = True  # patches (0..1, 0..1)
    other = torch.zeros(3, 64, 64, dtype=torch.bool)
    other[:, 48:, 48:] = True  # patches (6..7, 6..7)
    maps = torch.zeros(3, 8, 8)
    maps[0, 0, 0] = 1.0  # inside the target only
    maps[1, 7, 7], maps[1, 0, 0] = 3.0, 1.0  # mostly on the other object, top patch there
    maps[2] = -1.0  # nothing positive
    g = VS.grounding(maps, target, other)
    assert g["share"][0] == 1.0 and g["other_share"][0] == 0.0 and g["pointing"][0] == 1.0
    assert g["share"][1] < 0.5 < g["other_share"][1] and g["pointing"][1] == 0.0
    assert g["share"][2] == 0.0 and g["other_share"][2] == 0.0


def test_object_cover_is_the_share_of_each_patch_in_the_masks():
    masks = torch.zeros(1, 64, 64, dtype=torch.bool)
    masks[0, :8, :4] = True
    cover = VS.object_cover(masks, 8, 8)
    assert cover[0, 0, 0] == 0.5 and cover.sum() == 0.5


def test_delete_patches_sets_exactly_the_removed_patches_to_the_mean():
    pixels = torch.randn(2, 3, 64, 64) + 5.0
    removed = torch.zeros(2, 8, 8, dtype=torch.bool)
    removed[0, 2, 3] = True
    out = VS.delete_patches(pixels, removed, 8)
    assert (out[0, :, 16:24, 24:32] == 0).all() and torch.equal(out[1], pixels[1])
    changed = (out != pixels).any(1)
    assert changed.sum() == 64 and out.data_ptr() != pixels.data_ptr()


def test_deletion_finds_the_one_patch_the_model_reads():
    """(The patch ablation reference is `token_ablation`: tests/test_vision_language_ablation.py checks it by hand.)"""
    model = OnePatch()
    inputs = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long),
              "pixel_values": torch.full((2, 3, 64, 64), 2.0)}
    targets = torch.tensor([7, 7])
    perfect = torch.zeros(2, 8, 8)
    perfect[:, 2, 3] = 1.0
    worst = -perfect
    clean, curves = VS.deletion_curves(model, inputs, targets, {"perfect": perfect, "worst": worst}, batch_size=7)
    assert clean.shape == (2,)
    for direction in ("morf", "lerf"):
        assert (curves["perfect"][direction][:, 0] == 0).all() and curves["perfect"][direction].shape == (2, 11)
    morf, lerf = area(curves["perfect"]["morf"]), area(curves["perfect"]["lerf"])
    assert (morf < lerf).all() and (area(curves["worst"]["morf"]) > morf).all()
    # removing everything is one deletion whichever order asked for it: the curves end at the same value
    assert torch.equal(curves["perfect"]["morf"][:, -1], curves["worst"]["lerf"][:, -1])


def test_object_words_keep_right_answers_only_and_their_inputs_end_before_the_word():
    batch = make_vlm(12, seed=VLM_TEST_SEED + 99)
    said = list(batch.answers)
    said[0] = "wrong"
    words = VS.object_words(batch, said)
    assert all(w.item != 0 for w in words)
    expected = sum(sum(j >= 0 for j in batch.named[i]) for i in range(1, 12))
    assert len(words) == expected and {w.kind for w in words} <= {"color", "shape"}
    tokenizer = build_tokenizer()
    inputs, targets = VS.word_inputs(tokenizer, batch, words)
    for row, w in enumerate(words):
        text = tokenizer.decode(inputs["input_ids"][row][inputs["attention_mask"][row].bool()], skip_special_tokens=True)
        before = " ".join([batch.prompts[w.item], *batch.answers[w.item].split()[:w.position]])
        assert " ".join(text.split()) == before and tokenizer.convert_ids_to_tokens(int(targets[row])) == w.word
        assert torch.equal(inputs["pixel_values"][row], batch.images[w.item])


@pytest.fixture(scope="module")
def shipped():
    return load_shapes_llava()


def test_the_benchmark_scores_maps_given_from_outside(shipped):
    """An oracle map (the named object's own cover, nothing for a function word) beats the word-blind objects row,
    which beats random scores, in share and object IoU, and leaves every function word's map below threshold;
    patch ablation, the reference, is scored and timed; every number is in its range."""
    model, processor = shipped
    batch = make_vlm(6, seed=VLM_TEST_SEED)
    words_of = {}

    def oracle(model, inputs, targets):
        rows = words_of["rows"]
        return VS.object_cover(torch.stack([batch.masks[w.item, w.obj] if w.obj >= 0 else torch.zeros_like(batch.masks[0, 0])
                                            for w in rows]), 8, 8)

    said = VS.generate(model, processor.tokenizer, batch.images, batch.prompts)
    words_of["rows"] = VS.object_words(batch, said) + VS.function_words(batch, said)
    results = VS.evaluate_vlm_shapes(model, processor, methods=(), n=6, batch_size=6, explainers={"oracle": oracle},
                                     batch=batch)
    m = results["methods"]
    assert list(m) == ["oracle", "patch_ablation", "random", "objects"]
    assert results["words"] == len(VS.object_words(batch, said)) > 0 and 0 < results["answered"] <= 6
    assert results["function_words"] == len(VS.function_words(batch, said)) > 0
    assert m["oracle"]["share"] > 0.3 and m["oracle"]["pointing"] >= 0.8
    assert m["oracle"]["share"] > m["objects"]["share"] > m["random"]["share"]
    assert m["oracle"]["object_iou"] > m["objects"]["object_iou"] > m["random"]["object_iou"]
    assert m["oracle"]["function_iou"] == 1 > m["objects"]["function_iou"]
    assert m["patch_ablation"]["time_ratio"] > 5 and "time_ratio" not in m["random"]  # 64 patches per word, batched
    for entry in m.values():
        assert all(0 <= entry[k] <= 1 for k in ("share", "other_share", "pointing", "object_iou", "function_iou", "f1_iou"))
        assert math.isclose(entry["gap"], entry["lerf"] - entry["morf"], abs_tol=1e-9)
    report = VS.vlm_report(results)
    assert "| oracle " not in report and "| `oracle` |" in report and "patch ablation (reference)" in report


# ------------------------------------------------------------------------------------------------ evaluate
def run(*argv) -> int:
    from relevancy.apps.cli import main

    return main([str(a) for a in argv])


def test_the_command_explains_the_shipped_model_and_writes_results_and_report(tmp_path, capsys):
    out = tmp_path / "out"
    assert run("evaluate", "--benchmark", "vlm-shapes", "-n", 3, "--methods", "attnlrp", "--batch-size", 2,
               "--threads", 1, "--quiet", "--out", out, "--json", "--seed", 1) == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]
    results = json.loads((out / "results.json").read_text())
    assert json.loads(captured.out) == results
    assert results["benchmark"] == "vlm-shapes" and results["model"] == "shapes-llava (shipped)" and results["n"] == 3
    assert results["seed"] == VLM_TEST_SEED + 32 and results["words"] > 0
    assert list(results["methods"]) == ["attnlrp", "patch_ablation", "random", "objects"]
    assert results["methods"]["attnlrp"]["time_ratio"] < results["methods"]["patch_ablation"]["time_ratio"]
    assert "| `attnlrp` |" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "x"], "--data is not used with --benchmark vlm-shapes"),
        (["-n", "2001"], "--n must be at most 2000"),
        (["--seed", "300"], "--seed must be at most 299"),
        (["--methods", "rolout"], "method 'rolout' is not evaluated by vlm-shapes; valid methods: attnlrp,"),
        (["--model", "nothing.safetensors"], "--model for vlm-shapes: 'shapes' (the shipped shapes LLaVA), 'shapes-qwen-vl'"),
    ],
)
def test_bad_requests_are_clear_errors_and_write_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert run("evaluate", "--benchmark", "vlm-shapes", "--out", out, "--quiet", "-n", 3, *argv) == 2
    assert message in capsys.readouterr().err and not out.exists()
