"""`relevancy evaluate` end to end: shapes, a tiny ImageNet folder and a tiny gtsegs file, bad input, and a
2-process gloo run giving exactly the single-process numbers."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from relevancy.apps.cli import main
from relevancy.evaluation import data as D
from relevancy.evaluation.shards import Shards
from models import tiny_vit
from data_files import write_gtsegs

TINY_SHAPES = dict(embed_dim=32, depth=2, num_heads=2)


@pytest.fixture(scope="module")
def shapes_checkpoint(tmp_path_factory) -> Path:
    """A small random shapes ViT saved as `training.shapes_vit` saves it (architecture in the metadata)."""
    from relevancy.worlds import build_model

    torch.manual_seed(0)
    model = build_model(**TINY_SHAPES)
    path = tmp_path_factory.mktemp("ckpt") / "tiny_shapes.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"model_config": json.dumps(TINY_SHAPES), "steps": "0", "final": "false"})
    return path


@pytest.fixture(scope="module")
def swin_checkpoint(tmp_path_factory) -> Path:
    """A small random shapes Swin saved as `training.shapes_swin` saves it (architecture in the metadata)."""
    from relevancy.worlds.shapes_swin import build_swin

    torch.manual_seed(0)
    config = dict(embed_dim=16, depths=[2, 2], num_heads=[2, 2])
    path = tmp_path_factory.mktemp("ckpt") / "tiny_swin.safetensors"
    save_file({k: v.contiguous() for k, v in build_swin(**config).state_dict().items()}, str(path),
              metadata={"model_config": json.dumps(config), "steps": "0", "final": "false"})
    return path


def run(*argv) -> int:
    return main([str(a) for a in argv])


def shapes(checkpoint: Path, out: Path, *extra) -> int:
    return run("evaluate", "--model", checkpoint, "--arch", "shapes", "--out", out, "--threads", "1", "--quiet", *extra)


def finite_or_none(x) -> bool:
    return x is None or math.isfinite(x)


def test_a_shapes_swin_checkpoint_runs_every_method_it_offers(tmp_path, swin_checkpoint):
    """`--arch shapes-swin` reads a checkpoint of the shapes Swin; `--methods all` is every method of the Swin family,
    maps laid on its first stage's 16 x 16 grid."""
    from relevancy.families import adapter_for
    from relevancy.worlds.shapes_swin import load_swin

    out = tmp_path / "swin"
    assert run("evaluate", "--model", swin_checkpoint, "--arch", "shapes-swin", "--out", out, "--threads", "1", "--quiet",
               "--methods", "all", "-n", 2) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == list(adapter_for(load_swin(swin_checkpoint)).methods)
    assert results["model_info"] == {"steps": 0, "final": False}
    assert all(0 <= m["perturbation"]["positive_auc"] <= 90 for m in results["methods"].values())


def test_shapes_end_to_end(tmp_path, shapes_checkpoint, capsys):
    out = tmp_path / "out"
    assert shapes(shapes_checkpoint, out, "--methods", "rollout,lrp", "-n", 4, "--batch-size", 3) == 0
    assert sorted(p.name for p in out.iterdir()) == ["perturbation.png", "report.md", "results.json"]
    assert capsys.readouterr().out.count("wrote") == 3
    results = json.loads((out / "results.json").read_text())
    assert results["benchmark"] == "shapes" and results["n"] == 4 and results["model"] == str(shapes_checkpoint)
    assert results["splits"]["single"] == 4 and results["splits"]["pair"] == 2
    assert list(results)[:5] == ["benchmark", "model", "n", "units", "methods"] and results["units"].startswith("percent (0-100)")
    assert results["accuracy"]["single_top1"] in (0, 25, 50, 75, 100)
    assert results["model_info"] == {"steps": 0, "final": False}
    assert list(results["methods"]) == ["rollout", "lrp"]
    for name, m in results["methods"].items():
        assert set(m) >= {"perturbation", "segmentation", "discrimination", "agreement", "seconds_per_image"}
        p = m["perturbation"]
        for key in ("positive_auc", "negative_auc", "positive_auc_target", "negative_auc_target"):
            assert 0 <= p[key] <= 90
        assert p["num_images"] == 4 and len(p["curves"]["positive"]) == 10 and p["curves"]["steps"][-1] == 0.9
        assert p["curves"]["positive"][0] == p["curves"]["negative"][0]  # step 0: the clean image
        assert all(any(abs(v - 25 * k) < 1e-9 for k in range(5)) for v in p["curves"]["positive"])  # percent of 4 images
        assert p["positive_auc"] == pytest.approx(np.trapezoid(p["curves"]["positive"], p["curves"]["steps"]))
        s = m["segmentation"]
        assert all(0 <= s[k] <= 100 for k in ("pixel_accuracy", "miou", "map")) and s["num_images"] == 4
        assert s["miou"] == pytest.approx(sum(s["iou"]) / 2)
        d = m["discrimination"]
        assert d["num_images"] == 4  # 2 two-object scenes, each explained for both of its classes
        assert 0 <= d["target_share"] + d["other_share"] <= 100 + 1e-7 and d["pointing_game"] in (0, 25, 50, 75, 100)
        assert finite_or_none(m["agreement"]["pearson_tam"]) and 0 <= m["agreement"]["sparsity"] <= 100
        assert m["seconds_per_image"] > 0 and m["metric_seconds_per_image"] > 0
        # one map per one-object scene, more for wrongly predicted scenes (true class), two per two-object scene
        assert 4 + 4 <= m["maps"] <= 4 + 4 + 4
    report = (out / "report.md").read_text()
    assert "| method | pos. AUC ↓ | neg. AUC ↑" in report and "| rollout |" in report and "| lrp |" in report
    assert "2 two-object scenes" in report and "summed over each patch" in report
    assert (out / "perturbation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    umask = os.umask(0)
    os.umask(umask)
    assert all((out / name).stat().st_mode & 0o777 == 0o666 & ~umask for name in ("results.json", "report.md"))


def test_shapes_paper_settings_and_reference_method(tmp_path, shapes_checkpoint):
    out = tmp_path / "out"
    assert shapes(shapes_checkpoint, out, "--methods", "transformer_attribution,token_ablation,attention_gradcam",
                  "-n", 2, "--paper-settings") == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["method_options"] == {
        "transformer_attribution": {"start_layer": 1}, "attention_gradcam": {"normalize": True}}
    assert results["methods"]["token_ablation"]["agreement"]["pearson_tam"] == 1.0
    assert results["timing"]["reference_seconds"] == 0  # token_ablation is evaluated: no extra reference run
    assert results["splits"]["pair"] == 1
    assert "--paper-settings" in (out / "report.md").read_text()


def test_scenes_are_per_index_and_shards_partition_the_batches():
    batches = D.plan_batches("single", range(7), 3) + D.plan_batches("pair", range(3), 3)
    assert [len(b.indices) for b in batches] == [3, 3, 1, 3]
    shares = [Shards(None, r, 3).pending(len(batches)) for r in range(3)]
    assert sorted(k for share in shares for k in share) == list(range(len(batches))) and shares[1] == [1]
    whole = D.shapes_batch(D.Batch("single", (0, 1, 2, 3)), seed=0)
    part = D.shapes_batch(D.Batch("single", (2, 3)), seed=0)
    assert torch.equal(whole["images"][2:], part["images"]) and torch.equal(whole["masks"][2:], part["masks"])
    seeds = {D.scene_seed(s, k, i) for s in (0, 1) for k in ("single", "pair") for i in (0, 1, D.MAX_SCENES - 1)}
    assert len(seeds) == 12 and min(seeds) >= 10**9 + 10**8
    pair = D.shapes_batch(D.Batch("pair", (0,)), seed=0)
    assert pair["labels"].shape == (1, 2) and pair["masks"].shape == (1, 2, 64, 64)


# ---------------------------------------------------------------------------------------------- ImageNet


def image_folder(root: Path, per_class: int = 3) -> Path:
    rng = np.random.default_rng(0)
    for wnid in ("n01440764", "n01443537"):
        (root / wnid).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(root / wnid / f"ILSVRC2012_val_{wnid}_{i}.JPEG", format="JPEG")
    return root


def test_imagenet_subset_folders_keep_their_imagenet_labels(tmp_path):
    from relevancy.evaluation.datasets import imagenet_folder

    for wnid in ("n01443537", "n01484850"):  # ImageNet-1k classes 1 and 2; ImageFolder calls them 0 and 1
        (tmp_path / wnid).mkdir()
        Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / wnid / "a.png")
    config = {"input_size": (3, 8, 8), "mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 1.0}
    folder = imagenet_folder(tmp_path, config)
    assert D.imagenet_labels(folder, 1000).startswith("ImageNet-1k index")
    assert [folder[i][1] for i in range(2)] == [1, 2]
    other = imagenet_folder(tmp_path, config)
    assert D.imagenet_labels(other, 5).startswith("sorted folder order") and other[1][1] == 1


def gtsegs(path: Path, count: int = 3) -> Path:
    """A tiny ``gtsegs_ijcv.mat`` with a rectangle mask per image."""
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (24 + i, 30, 3), dtype=np.uint8) for i in range(count)]
    masks = []
    for i, img in enumerate(images):
        mask = np.zeros(img.shape[:2], dtype=np.uint8)
        mask[4:15, 6 + i : 20] = 1
        masks.append(mask)
    return write_gtsegs(path, images, masks)


@pytest.fixture()
def tiny_timm(monkeypatch):
    model = tiny_vit()  # 32x32 input, patch 8, 5 classes
    monkeypatch.setattr("relevancy.models.load_image_model", lambda name, arch: model)
    return model


def test_imagenet_folder(tmp_path, tiny_timm):
    data, out = image_folder(tmp_path / "val"), tmp_path / "out"
    assert run("evaluate", "--benchmark", "imagenet", "--data", data, "--model", "tiny", "--methods", "raw_attention,lrp",
               "-n", 4, "--batch-size", 3, "--out", out, "--threads", 1, "--quiet") == 0
    results = json.loads((out / "results.json").read_text())
    assert results["benchmark"] == "imagenet" and results["n"] == 4 and results["model"] == "tiny"
    for m in results["methods"].values():
        assert set(k for k in m if isinstance(m[k], dict)) == {"perturbation"}  # the only protocol with labels
        assert m["perturbation"]["num_images"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["perturbation.png", "report.md", "results.json"]
    assert "mIoU" not in (out / "report.md").read_text()
    # default n: the whole folder, in a seeded order
    assert run("evaluate", "--benchmark", "imagenet", "--data", data, "--methods", "cdam", "--out", out, "--threads", 1, "--quiet") == 0
    assert json.loads((out / "results.json").read_text())["n"] == 6


def test_imagenet_segmentation(tmp_path, tiny_timm):
    data, out = gtsegs(tmp_path / "gtsegs_ijcv.mat"), tmp_path / "out"
    assert run("evaluate", "--benchmark", "imagenet-seg", "--data", data, "--methods", "rollout,cdam", "--batch-size", 2,
               "--out", out, "--threads", 1, "--quiet") == 0
    results = json.loads((out / "results.json").read_text())
    assert results["n"] == 3
    for m in results["methods"].values():
        assert set(k for k in m if isinstance(m[k], dict)) == {"segmentation"}
        assert m["segmentation"]["num_images"] == 3 and 0 <= m["segmentation"]["miou"] <= 100
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]  # no curves without perturbation
    assert "mIoU ↑" in (out / "report.md").read_text()


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--benchmark", "shape"], "unknown benchmark 'shape'. Did you mean 'shapes'?"),
        (["--methods", "rollout,rolout"], "unknown method 'rolout'"),
        (["--methods", "rollout,"], "comma-separated"),
        (["--benchmark", "imagenet"], "--benchmark imagenet needs --data"),
        (["--benchmark", "imagenet-seg"], "--benchmark imagenet-seg needs --data"),
        (["--benchmark", "imagenet", "--data", "nowhere"], "is not a directory"),
        (["-n", "0"], "--n must be at least 1, got 0"),
        (["--n", "-3"], "--n must be at least 1, got -3"),
        (["--batch-size", "0"], "--batch-size must be between 1 and 1,024, got 0"),
        (["--data", "x"], "--data is not used"),
        (["--model", "missing.safetensors", "--arch", "shapes"], "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert run("evaluate", *argv, "--out", out, "--quiet") == 2
    err = capsys.readouterr().err
    assert err.startswith("relevancy evaluate: error:") and message in err
    assert not out.exists()


def test_imagenet_seg_needs_a_file_and_shapes_needs_a_shapes_model(tmp_path, capsys, tiny_timm):
    out = tmp_path / "out"
    assert run("evaluate", "--benchmark", "imagenet-seg", "--data", tmp_path, "--out", out) == 2
    assert "is not a file" in capsys.readouterr().err
    assert run("evaluate", "--model", "tiny", "--out", out, "--quiet") == 2  # a 32x32 timm model on 64x64 scenes
    assert "the shapes benchmark needs a model taking 64x64 images" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture()
def no_work(forbid):
    """Fail the test if the command loads a model or runs an evaluation."""
    forbid("relevancy.apps.cli.evaluate.load_model", "relevancy.evaluation.run")


def test_the_output_folder_is_checked_before_any_work(tmp_path, capsys, no_work):
    a_file = tmp_path / "taken"
    a_file.write_text("keep me")
    occupied = tmp_path / "occupied"
    (occupied / "results.json").mkdir(parents=True)
    for out, message in [(a_file, f"{a_file} exists and is not a folder"),
                         (a_file / "run", f"cannot create the folder {a_file / 'run'}: {a_file} is a file"),
                         (occupied, f"cannot write {occupied / 'results.json'}: it is a folder"),
                         (Path("/proc/relevancy-eval"), "cannot write to /proc/relevancy-eval: /proc is not writable")]:
        assert run("evaluate", "--methods", "rollout", "-n", 2, "--out", out, "--quiet") == 2
        err = capsys.readouterr().err
        assert err.startswith("relevancy evaluate: error:") and message in err, err
    assert a_file.read_text() == "keep me"


def test_json_prints_the_summary(tmp_path, shapes_checkpoint, capsys):
    out = tmp_path / "out"
    assert shapes(shapes_checkpoint, out, "--methods", "rollout", "-n", 2, "--json") == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    written = json.loads((out / "results.json").read_text())
    assert summary["units"] == written["units"] and summary["n"] == 2
    assert summary["methods"]["rollout"]["segmentation"]["miou"] == written["methods"]["rollout"]["segmentation"]["miou"]
    assert "curves" not in summary["methods"]["rollout"]["perturbation"] and "iou" not in summary["methods"]["rollout"]["segmentation"]
    assert summary["methods"]["rollout"]["perturbation"]["positive_auc"] == written["methods"]["rollout"]["perturbation"]["positive_auc"]
    assert captured.err.count("wrote") == 3  # the file list goes to stderr: stdout holds only the JSON


def test_report_reads_results_json_as_written(tmp_path, shapes_checkpoint):
    from relevancy.evaluation import render_report

    out = tmp_path / "out"
    assert shapes(shapes_checkpoint, out, "--methods", "cdam", "-n", 2) == 0
    assert render_report(json.loads((out / "results.json").read_text())) == (out / "report.md").read_text()


def test_the_committed_example_is_in_percent():
    from relevancy.evaluation import render_report

    folder = Path(__file__).resolve().parents[1] / "docs" / "results" / "shapes500"
    results = json.loads((folder / "results.json").read_text())
    assert results["units"].startswith("percent (0-100)")
    raw = results["methods"]["raw_attention"]
    assert raw["segmentation"]["pixel_accuracy"] == pytest.approx(81.53, abs=0.005)
    assert raw["discrimination"]["pointing_game"] == pytest.approx(39.8) and raw["perturbation"]["curves"]["positive"][0] == 99.6
    assert render_report(results) == (folder / "report.md").read_text()


def test_failure_midway_leaves_no_files(tmp_path, shapes_checkpoint, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("old")
    calls = []

    def fails_on_second_method(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        from relevancy import explain

        return explain(*args, **kwargs)

    monkeypatch.setattr("relevancy.evaluation.runner.explain", fails_on_second_method)
    assert shapes(shapes_checkpoint, out, "--methods", "rollout,cdam", "-n", 2) == 2
    assert "boom" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["results.json"] and (out / "results.json").read_text() == "old"

    monkeypatch.undo()
    monkeypatch.setattr("relevancy.evaluation.report._curves_png", lambda results: (_ for _ in ()).throw(RuntimeError("no png")))
    assert shapes(shapes_checkpoint, out, "--methods", "rollout", "-n", 2) == 2
    assert sorted(p.name for p in out.iterdir()) == ["partial", "results.json"] and (out / "results.json").read_text() == "old"
    # the finished batches' records stay for the same command run again, which writes the files and removes them
    monkeypatch.undo()
    assert shapes(shapes_checkpoint, out, "--methods", "rollout", "-n", 2) == 0
    assert sorted(p.name for p in out.iterdir()) == ["perturbation.png", "report.md", "results.json"]


# ---------------------------------------------------------------------------------------------- processes


def _metric_values(results: dict) -> dict:
    """Everything but the timings (and the process count)."""
    results = json.loads(json.dumps(results))
    for m in results["methods"].values():
        m.pop("seconds_per_image")
        m.pop("metric_seconds_per_image")
    results.pop("timing")
    results["settings"].pop("world_size")
    return results


def test_two_gloo_processes_give_the_single_process_numbers(tmp_path, shapes_checkpoint):
    argv = ["--methods", "rollout,cdam", "-n", "5", "--batch-size", "2"]
    single, double = tmp_path / "single", tmp_path / "double"
    assert shapes(shapes_checkpoint, single, *argv) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "relevancy.apps.cli",
         "evaluate", "--model", str(shapes_checkpoint), "--arch", "shapes", "--out", str(double), "--threads", "1",
         "--quiet", *argv],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote") == 3  # rank 0 only
    one = json.loads((single / "results.json").read_text())
    two = json.loads((double / "results.json").read_text())
    assert two["settings"]["world_size"] == 2 and one["settings"]["world_size"] == 1
    assert _metric_values(one) == _metric_values(two)  # exactly equal, every metric of every method
    assert one["methods"]["cdam"]["maps"] == two["methods"]["cdam"]["maps"]
