"""`relevancy explain-generation --image PICTURE --model FOLDER` end to end: the tiny random LLaVA of `vlm_models.py`
saved with its offline processor (`vlm_processor.py`) to a folder; the JSON equals the library call's, the page
holds the picture and the image maps; requests the command refuses before loading a model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from vlm_processor import picture, saved_llava

import relevancy
from relevancy.apps.cli import main
from relevancy.core.files import strict_json

PROMPT = "what is in the image ?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return saved_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("image") / "scene.png"
    picture(4).save(path)
    return path


def run(capsys, *words: str) -> tuple[int, str, str]:
    code = main(["explain-generation", *words])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_equals_the_library_call_and_the_page(folder, image, capsys, tmp_path):
    out = tmp_path / "seen.html"
    code, text, _ = run(capsys, PROMPT, "--model", str(folder), "--image", str(image), "--max-new-tokens", "3", "--json",
                        "--out", str(out))
    assert code == 0
    (numbers,) = json.loads(text)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
    expected = relevancy.explain_generation(model, transformers.AutoProcessor.from_pretrained(folder), PROMPT,
                                            image=relevancy.core.pictures.read_image(str(image)), max_new_tokens=3)
    assert numbers == json.loads(json.dumps(strict_json(expected.to_json())))
    assert numbers["kind"] == "VisionLanguageGenerationExplanation" and len(numbers["scores"]["image"]) == 3
    page = out.read_text()
    assert "function relevancyGeneration" in page and expected.image_url in page


def test_columns_when_piped(folder, image, capsys):
    code, text, _ = run(capsys, PROMPT, "--model", str(folder), "--image", str(image), "--max-new-tokens", "2", "--method", "cp_lrp")
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("# cp_lrp: generated ") and lines[1].startswith("# 1. ")


def test_what_is_refused(folder, image, capsys, tmp_path):
    code, _, err = run(capsys, PROMPT, "--image", str(image))
    assert code == 2 and "--image needs --model FOLDER, a local folder of a vision-language decoder" in err
    code, _, err = run(capsys, PROMPT, "--model", str(folder), "--image", str(tmp_path / "missing.png"))
    assert code == 2 and "does not exist" in err
    text_folder = tmp_path / "text"
    text_folder.mkdir()
    (text_folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    code, _, err = run(capsys, PROMPT, "--model", str(text_folder), "--image", str(image))
    assert code == 2 and "holds a LlamaForCausalLM; this command takes a vision-language decoder" in err
    code, _, err = run(capsys, PROMPT, "--model", str(folder))
    assert code == 2 and "holds a LlavaForConditionalGeneration" in err and "--image" in err
