"""`relevancy evaluate --benchmark shapes-detection`: the metrics on hand-made maps, the matching, the result
structure on a tiny random DETR whose detection is forced, the command line and its errors."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from safetensors.torch import save_file

from relevancy.worlds.detection import DETECTION_TEST_SEED, DETECTOR_CONFIG, make_detection_scenes
from relevancy.apps.cli import main
from relevancy.evaluation import shapes_detection as SD

TINY = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=1)


def tiny_config(**changes) -> dict:
    config = copy.deepcopy(DETECTOR_CONFIG)
    config["backbone_config"].update(hidden_sizes=[8, 16], depths=[1, 1])
    config.update(TINY, **changes)
    return config


def tiny_detector(box_xyxy: list[float], label: int, **changes):
    """A random tiny shapes DETR whose every query detects `label` (probability ~1) at `box_xyxy` (pixels of 64)."""
    from transformers import DetrConfig, DetrForObjectDetection

    torch.manual_seed(0)
    model = DetrForObjectDetection(DetrConfig(**tiny_config(**changes))).eval()
    x0, y0, x1, y1 = (v / 64 for v in box_xyxy)
    cxcywh = torch.tensor([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0])
    with torch.no_grad():
        model.class_labels_classifier.weight.zero_()
        model.class_labels_classifier.bias.zero_()
        model.class_labels_classifier.bias[label] = 12.0
        last = model.bbox_predictor.layers[-1]
        last.weight.zero_()
        last.bias.copy_(torch.logit(cxcywh))
    return model


def save_detector(model, path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps({"config": tiny_config(num_labels=model.config.num_labels,
                                                                          id2label=model.config.id2label,
                                                                          label2id=model.config.label2id)}))
    return path


@pytest.fixture(scope="module")
def two_object_seed() -> int:
    """The first seed from DETECTION_TEST_SEED whose one scene holds two or more objects."""
    for seed in range(DETECTION_TEST_SEED, DETECTION_TEST_SEED + 50):
        if len(make_detection_scenes(1, seed).labels[0]) >= 2:
            return seed
    raise AssertionError("no two-object scene in 50 seeds")


@pytest.fixture(scope="module")
def scene(two_object_seed):
    return make_detection_scenes(1, two_object_seed)


@pytest.fixture(scope="module")
def cli_detector(tmp_path_factory) -> Path:
    """Saved as training.shapes_detr saves: weights and a .json with the config; detects object 0 of scene 0."""
    scenes = make_detection_scenes(2, DETECTION_TEST_SEED)
    model = tiny_detector(scenes.boxes[0][0].tolist(), int(scenes.labels[0][0]))
    return save_detector(model, tmp_path_factory.mktemp("detr") / "tiny_detr.safetensors")


# ------------------------------------------------------------------------------------------------ metrics


def test_a_map_equal_to_the_object_scores_perfectly_and_one_on_another_object_scores_zero(scene):
    masks = scene.masks[0]
    own, other = masks[0:1], masks[1:2]
    others = masks[1:].any(0, keepdim=True)
    # the object's own mask as a pixel map: Otsu keeps exactly it
    assert torch.equal(SD.otsu_masks(own.float(), (64, 64)).bool(), own)
    perfect = SD.placement_scores(own.float(), own, others)
    assert perfect["own_share"].item() == 1 and perfect["other_share"].item() == 0 and perfect["background_share"].item() == 0
    assert perfect["pointing"].item() and not perfect["pointing_other"].item() and not perfect["empty"].item()
    assert SD.object_ap(own.float(), own).item() == pytest.approx(1.0)
    wrong = SD.placement_scores(other.float(), own, others)
    assert wrong["own_share"].item() == 0 and wrong["other_share"].item() == 1 and wrong["background_share"].item() == 0
    assert not wrong["pointing"].item() and wrong["pointing_other"].item()
    assert SD.object_ap(other.float(), own).item() == pytest.approx(own.float().mean().item())  # no better than chance
    counts = SD._counts(SD.otsu_masks(other.float(), (64, 64)), own)
    assert counts["intersection"][1] == 0 and counts["union"][1] == int(own.sum() + other.sum())
    # a constant map has no positive relevance when it is zero, and puts it uniformly otherwise
    zero = SD.placement_scores(torch.zeros(1, 8, 8), own, others)
    assert zero["empty"].item() and zero["own_share"].item() == 0 and zero["background_share"].item() == 0
    flat = SD.placement_scores(torch.ones(1, 8, 8), own, others)
    assert flat["own_share"].item() == pytest.approx(own.float().mean().item())
    assert not SD.otsu_masks(torch.ones(1, 8, 8), (64, 64)).any()


def test_token_maps_follow_the_authors_mask_steps():
    """A token map on one token: Otsu keeps that token; the bilinear upsampling, on where > 0, widens it by up to
    half a token on each side (DETR's PostProcessSegm), never more."""
    grid = torch.zeros(1, 8, 8)
    grid[0, 2, 3] = 1.0
    mask = SD.otsu_masks(grid, (64, 64))[0].bool()
    rows, cols = mask.any(1).nonzero()[:, 0], mask.any(0).nonzero()[:, 0]
    assert 12 <= rows.min() <= 16 and 23 <= rows.max() <= 27 and 20 <= cols.min() <= 24 and 31 <= cols.max() <= 35
    assert mask[16:24, 24:32].all()


def test_matching_is_greedy_by_score_with_each_object_taken_once():
    truth = torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]])
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 31], [40, 40, 50, 50]])
    scores = torch.tensor([0.6, 0.9, 0.7, 0.8])
    # the 0.9 detection takes object 0 (IoU 0.81), the exact 0.6 box finds it taken; no box near (40, 40)
    assert SD.match_detections(boxes, scores, truth) == [None, 0, 1, None]
    assert SD.match_detections(boxes[:1], scores[:1], truth[:0]) == [None]
    assert SD.match_detections(torch.tensor([[0.0, 0, 10, 20]]), torch.tensor([1.0]), truth) == [0]  # IoU 0.5 counts


# ------------------------------------------------------------------------------------------------ the benchmark


def fake_explain(scene, obj: int):
    """`explain` returning, for every row, object `obj`'s exact mask as a 64 x 64 map."""
    def run(model, inputs, method, target):
        rows = [(i, q) for i, per_image in enumerate(target) for q, _ in per_image]
        scores = torch.stack([scene.masks[0][obj].float() for _ in rows])
        return SimpleNamespace(image=torch.tensor([i for i, _ in rows]), query=torch.tensor([q for _, q in rows]),
                               parts={"image": SimpleNamespace(scores=scores)})
    return run


def test_perfect_maps_give_perfect_scores_end_to_end(scene, two_object_seed, monkeypatch):
    model = tiny_detector(scene.boxes[0][0].tolist(), int(scene.labels[0][0]))
    monkeypatch.setattr(SD, "explain", fake_explain(scene, 0))
    r = SD.evaluate_shapes_detection(model, n=1, methods=["generic_attention"], seed=two_object_seed)
    assert r["detection"] == {"objects": len(scene.labels[0]), "detected": 1, "matched": 1, "class_correct": 1,
                              "matched_in_multi_object_scenes": 1, "unmatched": 0}
    m = r["methods"]["generic_attention"]
    seg = m["segmentation"]
    assert seg["pixel_accuracy"] == pytest.approx(1) and seg["miou"] == pytest.approx(1) and seg["object_iou"] == pytest.approx(1)
    assert seg["map"] == pytest.approx(1) and seg["object_ap"] == pytest.approx(1) and seg["num_objects"] == 1
    assert (m["pointing"], m["pointing_other"], m["own_share"], m["other_share"], m["background_share"]) == (1, 0, 1, 0, 0)
    # one class of the scene's k found perfectly at every IoU threshold, the others not at all
    assert m["coco_segm"]["AP"] == pytest.approx(1 / len(scene.labels[0]))
    area = scene.masks[0][0].float().mean().item()
    assert r["chance"]["own_share"] == pytest.approx(area) and r["chance"]["empty_mask"]["pixel_accuracy"] == pytest.approx(1 - area)

    monkeypatch.setattr(SD, "explain", fake_explain(scene, 1))
    m = SD.evaluate_shapes_detection(model, n=1, methods=["rollout"], seed=two_object_seed)["methods"]["rollout"]
    assert m["segmentation"]["object_iou"] == 0 and m["coco_segm"]["AP"] == 0
    assert (m["pointing"], m["pointing_other"], m["own_share"], m["other_share"]) == (0, 1, 0, 1)


def test_real_maps_give_a_complete_json_result(two_object_seed):
    scenes = make_detection_scenes(3, two_object_seed)
    model = tiny_detector(scenes.boxes[0][0].tolist(), int(scenes.labels[0][0]))
    supported = SD.supported_methods(model, ["lrp", "generic_attention", "cdam"])
    assert supported == ("generic_attention", "cdam")  # lrp explains one-stream models
    r = SD.evaluate_shapes_detection(model, n=3, methods=["generic_attention", "cdam"], seed=two_object_seed, batch_size=2)
    json.dumps(r, allow_nan=False)  # no NaN: something was matched
    assert r["n"] == 3 and r["detection"]["detected"] == 3 and r["detection"]["matched"] >= 1
    assert list(r["methods"]) == ["generic_attention", "cdam"]
    for m in r["methods"].values():
        fractions = [*(m["segmentation"][k] for k in ("pixel_accuracy", "miou", "map", "object_ap", "object_iou")),
                     *m["segmentation"]["iou"], *m["coco_segm"].values(), m["pointing"], m["own_share"], m["background_share"]]
        assert all(0 <= v <= 1 for v in fractions)
        assert m["own_share"] + m["background_share"] <= 1 + 1e-9
        assert m["seconds_per_image"] > 0 and m["seconds_per_object"] > 0
    report = SD.detection_report({**r, "model": "tiny"})
    assert "| `generic_attention` |" in report and "| uniform map (chance) |" in report


def test_nothing_detected_gives_empty_metrics(scene):
    model = tiny_detector(scene.boxes[0][0].tolist(), int(scene.labels[0][0]))
    r = SD.evaluate_shapes_detection(model, n=1, methods=["rollout"], threshold=0.9999999, seed=DETECTION_TEST_SEED)
    assert r["detection"]["detected"] == 0 and math.isnan(r["methods"]["rollout"]["pointing"])
    assert r["methods"]["rollout"]["coco_segm"]["AP"] == 0
    assert "n/a" in SD.detection_report(r)


# ------------------------------------------------------------------------------------------------ command line


def run(*argv) -> int:
    return main([str(a) for a in argv])


def test_command_line_end_to_end(tmp_path, cli_detector, capsys):
    out = tmp_path / "out"
    assert run("evaluate", "--benchmark", "shapes-detection", "--model", cli_detector, "-n", 2, "--methods",
               "generic_attention,rollout", "--threads", 1, "--quiet", "--out", out, "--json") == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]
    results = json.loads((out / "results.json").read_text())
    assert json.loads(captured.out) == results and captured.err.count("wrote") == 2
    assert list(results)[:3] == ["benchmark", "model", "n"] and results["model"] == str(cli_detector)
    assert results["benchmark"] == "shapes-detection" and results["n"] == 2 and results["seed"] == DETECTION_TEST_SEED
    assert results["threshold"] == 0.5 and results["detection"]["detected"] == 2 and results["detection"]["matched"] >= 1
    assert list(results["methods"]) == ["generic_attention", "rollout"]
    report = (out / "report.md").read_text()
    assert "| `rollout` |" in report and "| method | pixel acc | mIoU |" in report and "| method | pointing |" in report
    # all: every method that explains DETR (not lrp)
    assert run("evaluate", "--benchmark", "shapes-detection", "--model", cli_detector, "-n", 1, "--threads", 1,
               "--quiet", "--out", out, "--threshold", 0.3, "--seed", 1) == 0
    results = json.loads((out / "results.json").read_text())
    assert "lrp" not in results["methods"] and {"generic_attention", "cdam", "partial_lrp"} <= set(results["methods"])
    assert results["threshold"] == 0.3 and results["seed"] == DETECTION_TEST_SEED + 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "x"], "--data is not used with --benchmark shapes-detection"),
        (["--arch", "shapes"], "--arch is not used with --benchmark shapes-detection"),
        (["-n", "0"], "--n must be at least 1"),
        (["-n", "10001"], "--n must be at most 10000"),
        (["--seed", "1000"], "--seed must be at most 999"),
        (["--threshold", "1.0"], "--threshold must be a probability in [0, 1)"),
        (["--paper-settings"], "--paper-settings is not used"),
        (["--methods", "rolout"], "unknown method 'rolout'"),
        (["--methods", "rollout,lrp"], "method lrp does not explain DETR; shapes-detection takes raw_attention, rollout,"),
    ],
)
def test_bad_requests_are_clear_errors_and_write_nothing(tmp_path, capsys, cli_detector, argv, message):
    out = tmp_path / "out"
    assert run("evaluate", "--benchmark", "shapes-detection", "--model", cli_detector, "--out", out, "--quiet", *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("relevancy evaluate: error:") and message in err, err
    assert not out.exists()


def test_bad_models_are_clear_errors(tmp_path, capsys, monkeypatch, cli_detector):
    out = tmp_path / "out"

    def fails(*argv) -> str:
        assert run("evaluate", "--out", out, "--quiet", *argv) == 2
        return capsys.readouterr().err

    assert "--threshold is used only with --benchmark shapes-detection" in fails("--threshold", "0.5")
    monkeypatch.setattr("relevancy.worlds.detection.DETECTOR_WEIGHTS_PATH", tmp_path / "missing.safetensors")
    assert "the shipped shapes detector is missing" in fails("--benchmark", "shapes-detection")
    missing = tmp_path / "no.safetensors"
    assert "a shapes-DETR .safetensors file with its .json" in fails("--benchmark", "shapes-detection", "--model", missing)
    lone = tmp_path / "lone.safetensors"
    lone.write_bytes(cli_detector.read_bytes())  # no .json beside it
    assert "with its .json" in fails("--benchmark", "shapes-detection", "--model", lone)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(cli_detector.read_bytes())
    broken.with_suffix(".json").write_text("{}")
    assert "cannot load a shapes detector" in fails("--benchmark", "shapes-detection", "--model", broken)
    three = save_detector(tiny_detector([0, 0, 10, 10], 0, num_labels=3, id2label={i: str(i) for i in range(3)},
                                        label2id={str(i): i for i in range(3)}), tmp_path / "three.safetensors")
    assert "needs a detector of the 12 shape classes" in fails("--benchmark", "shapes-detection", "--model", three)
    assert not out.exists()


def test_a_failure_midway_writes_nothing(tmp_path, cli_detector, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("old")
    calls = []

    def fails_late(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:  # rollout's warm-up, then fail
            raise RuntimeError("boom")
        from relevancy import explain

        return explain(*args, **kwargs)

    monkeypatch.setattr(SD, "explain", fails_late)
    assert run("evaluate", "--benchmark", "shapes-detection", "--model", cli_detector, "-n", 2, "--methods",
               "rollout,cdam", "--out", out, "--quiet") == 2
    assert "boom" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["results.json"] and (out / "results.json").read_text() == "old"
