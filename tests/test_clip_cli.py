"""`relevancy explain IMAGE --text ...`: image-text pairs from the shell, for the shipped CLIP, a Hugging Face CLIP
folder (with its tokenizer and image processor) and an open_clip model by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from golden import GOLDEN  # noqa: E402
from relevancy.apps.cli import main  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def tiny_tokenizer(folder, vocab_size: int) -> None:
    """A CLIPTokenizer whose words are spelled letter by letter (no merges), end token = the largest id."""
    vocab = {c: i for i, c in enumerate(LETTERS)} | {c + "</w>": 26 + i for i, c in enumerate(LETTERS)}
    vocab |= {"<|startoftext|>": vocab_size - 2, "<|endoftext|>": vocab_size - 1}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(folder)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The golden tiny CLIP saved as a Hugging Face folder with a tokenizer and an image processor."""
    case = torch.load(GOLDEN / "clip_reference.pt", weights_only=True)[0]
    folder = tmp_path_factory.mktemp("tiny-clip")
    model = transformers.CLIPModel(transformers.CLIPConfig(**case["hf_config"])).eval()
    model.load_state_dict({k: v.float() for k, v in case["state_dict_hf"].items()}, strict=True)
    model.save_pretrained(folder)
    size = case["config"]["image_resolution"]
    transformers.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(folder)
    tiny_tokenizer(folder, case["hf_config"]["text_config"]["vocab_size"])
    return folder


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "cat.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(path)
    return path


def test_hugging_face_folder(hf_folder, photo, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["explain", str(photo), "--text", "a red star", "--text", "a ring", "--model", str(hf_folder),
                 "--method", "generic_attention", "--out", str(out), "--json"])
    assert code == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["kind"] == "PairExplanation" and result["pairs"] == [[0, 0], [0, 1]]  # the image with each text
    assert np.array(result["scores"]["image"]).shape == (2, 4, 4)  # 32 px, patch 8
    first = result["tokens"][0]
    assert first[0] == "<|startoftext|>" and first[-1] == "<|endoftext|>" and result["readout"][0] == len(first) - 1
    assert sorted(p.name for p in out.iterdir()) == ["cat_generic_attention.html", "cat_generic_attention.png"]
    page = (out / "cat_generic_attention.html").read_text()
    assert "a red star" in page and "<span" in page


def test_open_clip_by_name(photo, tmp_path, capsys):
    code = main(["explain", str(photo), "--text", "a photo of a cat", "--model", "open_clip:ViT-S-32:random",
                 "--method", "raw_attention", "--json"])
    assert code == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert np.array(result["scores"]["image"]).shape == (1, 7, 7)  # 224 px, patch 32
    assert result["tokens"][0][0] == "<start_of_text>" and result["tokens"][0][-1] == "<end_of_text>"


@pytest.mark.parametrize("argv, message", [
    (["--text", ""], "--text is empty"),
    (["--text", "a star", "--target", "1"], "--target picks a class"),
    (["--text", "a star", "--method", "lrp"], "does not explain image-text pairs"),
    (["--text", "a star", "--model", "open_clip:ViT-Q-99"], "open_clip has no model"),
    (["--text", "a star", "--model", "open_clip:ViT-S-32"], "names no weights, and untrained weights explain nothing"),
])
def test_bad_requests(photo, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    code = main(["explain", str(photo), "--out", str(out), *argv])
    assert code != 0
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def scene_file(tmp_path_factory):
    from relevancy.worlds import make_scenes

    path = tmp_path_factory.mktemp("scenes") / "scene.png"
    Image.fromarray(make_scenes(1, seed=5, objects=2).pixels[0]).save(path)
    return path


def test_shipped_clip_is_the_default(scene_file, tmp_path, capsys):
    code = main(["explain", str(scene_file), "--text", "a red star", "--method", "generic_attention", "--json"])
    assert code == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["tokens"][0][1:-1] == ["a", "red", "star"]
    assert np.array(result["scores"]["image"]).shape == (1, 8, 8)


def test_unknown_word_is_a_usage_error(scene_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["explain", str(scene_file), "--text", "a purple elephant", "--out", str(out)]) != 0
    assert "elephant" in capsys.readouterr().err and not out.exists()


def test_evaluate_shapes_clip(tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["evaluate", "--benchmark", "shapes-clip", "--n", "4", "--batch-size", "2", "--methods",
                 "generic_attention,cdam", "--out", str(out), "--json", "--quiet"])
    assert code == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results["methods"]) == {"generic_attention", "generic_attention_all_layers", "cdam"}
    for values in results["methods"].values():
        assert set(values) >= {"own_share", "other_share", "pointing", "pointing_other", "iou", "token_f1"}
        assert all(0 <= values[k] <= 1 for k in ("own_share", "other_share", "pointing", "iou", "token_f1"))
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]
    assert "| `cdam` |" in (out / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--data", "x"], "--data is not used"),
    (["--methods", "lrp"], "does not explain image-text pairs"),
    (["--model", "nowhere.safetensors"], "shapes-CLIP .safetensors file"),
])
def test_evaluate_shapes_clip_bad_requests(tmp_path, capsys, argv, message):
    out = tmp_path / "eval"
    assert main(["evaluate", "--benchmark", "shapes-clip", "--n", "2", "--out", str(out), *argv]) != 0
    assert message in capsys.readouterr().err and not out.exists()
