"""`relevancy evaluate --benchmark shapes-vqa` and `relevancy explain-question`: the metrics on hand-made maps, the
result structure on a tiny random shapes LXMERT, the command lines and their errors."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relevancy.apps.demos import questions as vqa_show
from relevancy.worlds.questions import N_REGIONS, QUESTION_TYPES, make_questions, question_tokenizer
from relevancy.worlds.shapes_lxmert import VQA_CONFIG, VQA_TEST_SEED, build_vqa_lxmert
from relevancy.apps.cli import main
from relevancy.evaluation import shapes_vqa as SV

TINY = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, l_layers=1, x_layers=1, r_layers=1)


def run(*argv) -> int:
    return main([str(a) for a in argv])


def tiny_model():
    torch.manual_seed(0)
    return build_vqa_lxmert(dict(VQA_CONFIG, **TINY)).eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small models: one thread is as fast and does not fight other work for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def batch():
    return make_questions(12, VQA_TEST_SEED)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """Saved as training.shapes_lxmert saves the shipped weights: safetensors and a .json beside them."""
    from training.shapes_lxmert import save_vqa

    path = tmp_path_factory.mktemp("vqa") / "tiny.safetensors"
    save_vqa(tiny_model(), question_tokenizer(), dict(VQA_CONFIG, **TINY), path, {})
    return path


# ------------------------------------------------------------------------------------------------ metrics
def test_region_metrics_on_hand_made_maps():
    target = torch.tensor([[False, True, True, False], [False, True, False, False], [True, False, False, False]])
    other = torch.tensor([[True, False, False, False], [False, False, True, False], [False, True, False, False]])
    # all relevance on the targets / on another object / nothing positive (negative scores do not count)
    scores = torch.tensor([[0.0, 2.0, 1.0, 0.0], [-5.0, 0.0, 3.0, 0.0], [-1.0, -2.0, -1.0, -3.0]])
    r = SV.region_scores(scores, target, other)
    assert r["share"].tolist() == [1.0, 0.0, 0.0] and r["other_share"].tolist() == [0.0, 1.0, 0.0]
    assert r["pointing"].tolist() == [1.0, 0.0, 1.0]  # row 3: the top region (-1, first on ties) is the target
    assert r["empty"].tolist() == [False, False, True]
    half = SV.region_scores(torch.tensor([[1.0, 1.0, 2.0, 0.0]]), target[:1], other[:1])
    assert half["share"].item() == pytest.approx(0.75) and half["other_share"].item() == pytest.approx(0.25)


def test_token_f1_takes_as_many_words_as_name_the_object():
    # <start> what color is the star <end> pad ; <start> is there a red star <end>
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
    naming = torch.zeros(3, 8, dtype=torch.bool)
    naming[0, 5] = True
    naming[1, [4, 5]] = True
    # the special tokens score highest everywhere: they never count
    scores = torch.tensor([
        [9.0, 0.1, 0.2, 0.1, 0.3, 1.0, 9.0, 0.0],   # k = 1: "star" on top -> 1
        [9.0, 0.1, 0.2, 0.1, 1.0, 0.05, 9.0, 0.0],  # k = 2: "red" and "there" on top -> 1/2
        [9.0, 1.0, 0.2, 0.1, 0.3, 0.4, 9.0, 0.0],   # no naming words -> NaN
    ])
    f1 = SV.naming_f1(scores, mask, naming)
    assert f1[0].item() == 1.0 and f1[1].item() == pytest.approx(0.5) and math.isnan(f1[2].item())
    wrong = scores.clone()
    wrong[0, 5] = 0.0
    assert SV.naming_f1(wrong, mask, naming)[0].item() == 0.0


def fake_explain(batch, perfect: bool):
    """An `explain` that puts every question's relevance on its target regions and naming words (perfect) or on
    everything else, and answers the true answer."""
    def rows(inputs):
        return [next(i for i in range(len(batch)) if torch.equal(batch.visual_feats[i], f) and
                     torch.equal(batch.input_ids[i], ids)) for f, ids in zip(inputs["visual_feats"], inputs["input_ids"])]

    def explain(model, inputs, method, target=None, **options):
        index = rows(inputs)
        image = batch.target_regions[index].float()
        text = batch.target_tokens[index].float()
        if not perfect:
            image = 1.0 - image
            text = (1.0 - text) * batch.attention_mask[index]
        parts = {"image": SimpleNamespace(scores=image), "text": SimpleNamespace(scores=text)}
        return SimpleNamespace(parts=parts, target=batch.answers[index])

    return explain


@pytest.mark.parametrize("perfect", [True, False])
def test_metrics_of_perfect_and_wrong_maps(monkeypatch, batch, perfect):
    monkeypatch.setattr(SV, "explain", fake_explain(batch, perfect))
    r = SV.evaluate_shapes_vqa(tiny_model(), n=len(batch), methods=["rollout"], batch_size=5, perturbation_n=0, batch=batch)
    m = r["methods"]["rollout"]
    value = 1.0 if perfect else 0.0
    assert (m["share"], m["pointing"], m["token_f1"], m["other_share"] == 0) == (value, value, value, perfect)
    assert m["correct"]["n"] == r["with_target"] == int(batch.has_target.sum()) and m["correct"]["share"] == value
    assert "perturbation" not in m and r["perturbation"]["n"] == 0
    for name in QUESTION_TYPES:
        if r["with_target_per_type"][name]:
            assert m["per_type"][name]["share"] == value
    expected = (batch.target_regions.sum(1).double() / N_REGIONS)[torch.from_numpy(batch.has_target)].mean().item()
    assert r["chance"]["share"] == pytest.approx(expected) and r["chance"]["pointing"] == pytest.approx(expected)


def test_real_maps_give_a_complete_result(batch):
    model = tiny_model()
    supported = SV.supported_methods(model, ["lrp", "generic_attention", "cdam"])
    assert supported == ("generic_attention", "cdam")  # lrp explains one-stream models
    r = SV.evaluate_shapes_vqa(model, n=len(batch), methods=supported, batch_size=5, perturbation_n=1, batch=batch)
    assert r["benchmark"] == "shapes-vqa" and r["n"] == 12 and r["seed"] == VQA_TEST_SEED and r["perturbation"]["n"] == 1
    assert list(r["methods"]) == ["generic_attention", "cdam"] and 0 <= r["accuracy"]["overall"] <= 1
    for m in r["methods"].values():
        assert all(0 <= m[k] <= 1 for k in ("share", "other_share", "pointing", "token_f1"))
        assert m["share"] + m["other_share"] <= 1 + 1e-9 and m["seconds_per_question"] > 0
        p = m["perturbation"]
        assert len(p["text"]["steps"]) == 9 and len(p["image"]["steps"]) == 8  # LXMERT cannot run without regions
        for modality in ("text", "image"):
            for sign in ("positive", "negative"):
                assert 0 <= p[modality][sign]["auc"] <= 1 and len(p[modality][sign]["accuracy"]) == len(p[modality]["steps"])
        assert p["seconds_per_question"] > 0
    assert 0 < r["chance"]["share"] < r["chance"]["objects"]["share"] <= 1
    json.dumps(r)
    report = SV.vqa_report({**r, "model": "tiny"})
    assert "| `generic_attention` |" in report and "| uniform random (chance) |" in report and "| color |" in report


# ------------------------------------------------------------------------------------------------ evaluate
def test_the_command_writes_results_and_report(tmp_path, capsys, tiny_checkpoint):
    out = tmp_path / "out"
    assert run("evaluate", "--benchmark", "shapes-vqa", "--model", tiny_checkpoint, "-n", 6, "--perturbation-n", 1,
               "--methods", "generic_attention,rollout", "--threads", 1, "--quiet", "--out", out, "--json") == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]
    results = json.loads((out / "results.json").read_text())
    assert json.loads(captured.out) == results and captured.err.count("wrote") == 2
    assert list(results)[:3] == ["benchmark", "model", "n"] and results["model"] == str(tiny_checkpoint)
    assert results["benchmark"] == "shapes-vqa" and results["n"] == 6 and results["seed"] == VQA_TEST_SEED
    assert list(results["methods"]) == ["generic_attention", "rollout"] and results["perturbation"]["n"] == 1
    assert "| `rollout` |" in (out / "report.md").read_text()
    # all: every method that explains LXMERT (not lrp); --seed S: make_questions seed VQA_TEST_SEED + 3 S
    assert run("evaluate", "--benchmark", "shapes-vqa", "--model", tiny_checkpoint, "-n", 2, "--perturbation-n", 0,
               "--threads", 1, "--quiet", "--out", out, "--seed", 2) == 0
    results = json.loads((out / "results.json").read_text())
    assert "lrp" not in results["methods"] and {"generic_attention", "cdam", "partial_lrp"} <= set(results["methods"])
    assert results["seed"] == VQA_TEST_SEED + 6 and "perturbation" not in results["methods"]["rollout"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "x"], "--data is not used with --benchmark shapes-vqa"),
        (["--arch", "shapes"], "--arch is not used with --benchmark shapes-vqa"),
        (["-n", "0"], "--n must be at least 1"),
        (["-n", "10001"], "--n must be at most 10000"),
        (["--seed", "1000"], "--seed must be at most 999"),
        (["-n", "5", "--perturbation-n", "6"], "--perturbation-n must be between 0 (no perturbation test) and --n (5)"),
        (["--perturbation-n", "-1"], "--perturbation-n must be between 0"),
        (["--threshold", "0.5"], "--threshold is used only with --benchmark shapes-detection"),
        (["--paper-settings"], "--paper-settings is not used"),
        (["--methods", "rolout"], "unknown method 'rolout'"),
        (["--methods", "rollout,lrp"], "method lrp does not explain LXMERT; shapes-vqa takes raw_attention, rollout,"),
    ],
)
def test_bad_requests_are_clear_errors_and_write_nothing(tmp_path, capsys, tiny_checkpoint, argv, message):
    out = tmp_path / "out"
    assert run("evaluate", "--benchmark", "shapes-vqa", "--model", tiny_checkpoint, "--out", out, "--quiet", "-n", 3, *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("relevancy evaluate: error:") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_bad_models_are_clear_errors(tmp_path, capsys, monkeypatch, tiny_checkpoint):
    out = tmp_path / "out"

    def fails(*argv) -> str:
        assert run("evaluate", "--out", out, "--quiet", *argv) == 2
        return capsys.readouterr().err

    assert "--perturbation-n is used only with --benchmark shapes-vqa" in fails("--perturbation-n", "3")
    monkeypatch.setattr("relevancy.worlds.shapes_lxmert.VQA_WEIGHTS_PATH", tmp_path / "missing.safetensors")
    assert "the shipped shapes LXMERT is missing" in fails("--benchmark", "shapes-vqa")
    assert "a shapes-LXMERT .safetensors file with its .json" in fails("--benchmark", "shapes-vqa", "--model", tmp_path / "no.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(tiny_checkpoint.read_bytes())
    broken.with_suffix(".json").write_text("{}")
    assert "cannot load a shapes LXMERT" in fails("--benchmark", "shapes-vqa", "--model", broken)
    assert not out.exists()


def test_a_failure_midway_writes_nothing(tmp_path, capsys, monkeypatch, tiny_checkpoint):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("old")
    calls = []
    real = SV.explain

    def fails_late(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # rollout's warm-up and first batch, then fail
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(SV, "explain", fails_late)
    argv = ["evaluate", "--benchmark", "shapes-vqa", "--model", tiny_checkpoint, "-n", 4, "--batch-size", 2,
            "--methods", "rollout", "--out", out, "--quiet"]
    assert run(*argv) == 2
    assert "boom" in capsys.readouterr().err
    # the first batch's record stays (partial/) for the same command run again; results.json is untouched
    assert sorted(p.name for p in out.iterdir()) == ["partial", "results.json"] and (out / "results.json").read_text() == "old"
    monkeypatch.undo()
    assert run(*argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]


# ------------------------------------------------------------------------------------------------ explain-question
def test_explain_question_writes_a_png_and_a_page_per_question(tmp_path, capsys, tiny_checkpoint):
    out = tmp_path / "out"
    assert run("explain-question", "--model", tiny_checkpoint, "--n", 2, "--out", out) == 0
    printed = capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 4 and all(n.endswith(("_generic_attention.png", "_generic_attention.html")) for n in names)
    assert names[0].startswith("q000_") and names[2].startswith("q001_") and "(true answer:" in printed
    page = next(p for p in out.iterdir() if p.name.startswith("q000") and p.suffix == ".html").read_text()
    assert "<span title=" in page and "&lt;start&gt;" not in page  # coloured words, no special tokens
    png = next(p for p in out.iterdir() if p.suffix == ".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_question_asks_your_questions(tmp_path, capsys, tiny_checkpoint):
    out = tmp_path / "out"
    assert run("explain-question", "--model", tiny_checkpoint, "--question", "what color is the star?", "--question",
               "how many objects are there", "--scene", 3, "--method", "all", "--out", out, "--json") == 0
    results = json.loads(capsys.readouterr().out)  # one to_json() per method, each over both questions
    methods = {result["method"]: result for result in results}
    assert "lrp" not in methods and {"generic_attention", "cdam"} <= set(methods)
    cdam = methods["cdam"]
    assert cdam["kind"] == "RegionTextExplanation" and cdam["tokens"][0] == ["<start>", "what", "color", "is", "the", "star", "<end>"]
    assert cdam["tensors"]["scores/image"]["shape"] == [2, N_REGIONS] and len(cdam["scores"]["text"][0]) >= 7
    assert len(list(out.iterdir())) == 2 * 2 * len(methods)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--question", "what colour is the star"], "unknown words 'colour'"),
        (["--question", "  "], "--question is empty"),
        (["--question", "is there a star", "--n", "3"], "--n and --seed pick questions of the world"),
        (["--scene", "3"], "--scene is the scene of your --question(s)"),
        (["--n", "0"], "--n must be in 1..1000"),
        (["--seed", "1000"], "--seed must be in 0..999"),
        (["--method", "rolout"], "unknown method 'rolout'"),
        (["--method", "lrp"], "method lrp does not explain LXMERT"),
        (["--model", "nowhere.safetensors"], "a shapes-LXMERT .safetensors file with its .json"),
    ],
)
def test_explain_question_errors_write_nothing(tmp_path, capsys, tiny_checkpoint, argv, message):
    out = tmp_path / "out"
    argv = ["--model", tiny_checkpoint, *argv] if "--model" not in argv else argv
    assert run("explain-question", "--out", out, *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("relevancy explain-question: error:") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_explain_question_failure_while_drawing_leaves_nothing(tmp_path, capsys, monkeypatch, tiny_checkpoint):
    out = tmp_path / "out"
    calls = []
    real = vqa_show.render_question

    def fails_late(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(vqa_show, "render_question", fails_late)
    assert run("explain-question", "--model", tiny_checkpoint, "--n", 2, "--out", out) == 2
    assert "boom" in capsys.readouterr().err and not out.exists()


def test_python_api_saves_one_picture_per_question(tmp_path, batch):
    expl = vqa_show.explain_questions(tiny_model(), batch, method="rollout")
    assert expl.parts["image"].scores.shape == (12, N_REGIONS) and expl.tokens[0][0] == "<start>"
    one = vqa_show.question_row(expl, 3)
    assert torch.equal(one.parts["image"].scores, expl.parts["image"].scores[3:4]) and one.tokens == expl.tokens[3:4]
    written = vqa_show.save_questions(expl, batch, tmp_path / "q", indices=[0, 3])
    assert [p.suffix for p in written] == [".png", ".html", ".png", ".html"] and written[2].name.startswith("q003_")
    expl.save(tmp_path / "all.png", batch.pixels)  # the library's own: every question in one row, and the page
    assert (tmp_path / "all.png").stat().st_size > 0 and "what" in expl.save(tmp_path / "all.html").read_text()
