"""Hostile probes of the decoders, their generations, model folders, the command line's texts and the web page's
generation endpoint (issue 35): each gets a clear one-line error naming the problem and the valid choices (and
writes nothing), or the right result. The tiny float64 Llama (rotary positions) and GPT-2 (a learned table) of
test_causal_lm, both with 16 positions; a tiny Llama saved with a byte-level BPE tokenizer for real text."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from language_models import save_tiny_llama, tiny_tokenizer
from test_causal_lm import batch, build
from test_generation import Characters

import relevancy
from relevancy.apps.cli import main
from relevancy.families.causal_lm.targets import Contrast
from relevancy.core.files import OutputError
from relevancy.methods import REGISTRY

ARCHS = ("llama", "gpt2")
ATTENTION_METHODS = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "cdam")
TOKEN_METHODS = tuple(name for name, method in REGISTRY.items() if method.token_targets)
LONGEST_ERROR = 1_000  # characters
#: prompts whose characters take several tokens of a byte-level vocabulary
MULTI_BYTE = ("the cat 😀 sat", "中文 the mat", "café où 👩‍🔬", "🎉🎉")


def one_line(error: pytest.ExceptionInfo, *words: str) -> str:
    message = str(error.value)
    assert "\n" not in message and len(message) < LONGEST_ERROR, message
    for word in words:
        assert word in message, (word, message)
    return message


@pytest.fixture(scope="module", params=ARCHS)
def model(request) -> torch.nn.Module:
    return build(request.param)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def saved(folder) -> tuple[torch.nn.Module, object]:
    from relevancy.models import load_language_model

    return load_language_model(str(folder))


@pytest.fixture(scope="module")
def generation(model) -> relevancy.GenerationExplanation:
    return relevancy.explain_generation(model, Characters(), "abcdef", max_new_tokens=3, method="cp_lrp")


# -- targets on decoders --------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_a_token_text_with_an_attention_method_names_the_methods_that_take_it(model, method):
    with pytest.raises(TypeError) as error:
        relevancy.explain(model, batch("single0"), method=method, target=" the")
    message = one_line(error, f"method '{method}' takes token ids", "attnlrp, cp_lrp, input_x_gradient", "tokenizer=")
    assert "class name" not in message


@pytest.mark.parametrize("method", ("rollout", "generic_attention", "cdam"))
def test_a_contrast_with_an_attention_method_names_the_methods_that_take_it(model, method):
    with pytest.raises(TypeError) as error:
        relevancy.explain(model, batch("single0"), method=method, target=[Contrast(1, 2)])
    assert "class name" not in one_line(error, "takes token ids", "got Contrast", "Contrast targets are taken by attnlrp")


@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_a_contrast_of_a_token_with_itself_is_refused(model, method):
    with pytest.raises(ValueError) as error:
        relevancy.explain(model, batch("single0"), method=method, target=Contrast(7, 7))
    one_line(error, "Contrast(7, 7)", "against itself", "give a foil other than the token")


def test_a_contrast_of_a_token_text_with_its_own_id_is_refused(saved):
    model, tokenizer = saved
    inputs = tokenizer(["the cat sat on the"], return_tensors="pt")
    token = tokenizer(" mat", add_special_tokens=False)["input_ids"][0]
    with pytest.raises(ValueError) as error:
        relevancy.explain(model, inputs, method="attnlrp", target=Contrast(" mat", token), tokenizer=tokenizer)
    one_line(error, f"sets token {token} against itself")


@pytest.mark.parametrize("integer", (np.int64, np.int32, np.uint8))
@pytest.mark.parametrize("method", ("attnlrp", "generic_attention"))
def test_numpy_integer_targets_are_token_ids(model, method, integer):
    plain = relevancy.explain(model, batch("single0"), method=method, target=5)
    numpy = relevancy.explain(model, batch("single0"), method=method, target=integer(5))
    assert int(numpy.target[0]) == 5 and torch.equal(numpy.scores, plain.scores)


def test_a_numpy_contrast_equals_the_int_one(model):
    plain = relevancy.explain(model, batch("single0"), method="cp_lrp", target=Contrast(5, 9))
    numpy = relevancy.explain(model, batch("single0"), method="cp_lrp", target=Contrast(np.int64(5), np.int16(9)))
    assert torch.equal(numpy.scores, plain.scores)


# -- context windows, every position scheme -----------------------------------------------------------------
@pytest.mark.parametrize("method", ("attnlrp", "generic_attention"))
def test_a_prompt_over_the_context_window_is_refused(model, method):
    with pytest.raises(ValueError) as error:
        relevancy.explain(model, torch.ones(1, 17, dtype=torch.long), method=method)
    one_line(error, "17 real tokens", "context window is 16 tokens", "shorten the text")


def test_a_prompt_at_the_context_window_is_explained(model):
    assert relevancy.explain(model, torch.ones(1, 16, dtype=torch.long), method="attnlrp").scores.shape == (1, 16)


@pytest.mark.parametrize("new", (1, 8))
def test_a_generation_past_the_context_window_is_refused(model, new):
    with pytest.raises(ValueError) as error:
        relevancy.explain_generation(model, Characters(), "a" * (17 - new), max_new_tokens=new)
    one_line(error, f"{17 - new} tokens and {new} new ones", "context window of 16 tokens")


# -- explain_generation's arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize("integer", (np.int64, np.int8))
def test_numpy_integers_are_taken_as_max_new_tokens(model, integer):
    result = relevancy.explain_generation(model, Characters(), "abcdef", max_new_tokens=integer(2), method="cp_lrp")
    assert result.scores.shape == (2, 8)


@pytest.mark.parametrize("bad", (np.float64(2.0), "2", None))
def test_other_max_new_tokens_are_refused(model, bad):
    with pytest.raises(ValueError) as error:
        relevancy.explain_generation(model, Characters(), "abcdef", max_new_tokens=bad)
    one_line(error, "max_new_tokens must be a whole number from 1 to the model's context window")


def test_no_tokenizer_is_one_short_line(model):
    with pytest.raises(TypeError) as error:
        relevancy.explain_generation(model, None, "abcdef")
    one_line(error, "tokenizer must be the model's tokenizer", "NoneType")


@pytest.mark.parametrize("bad", (None, "gpt2", torch.nn.Linear(2, 2)))
def test_no_model_is_one_short_line(bad):
    with pytest.raises((TypeError, relevancy.families.UnsupportedModelError)) as error:
        relevancy.explain_generation(bad, Characters(), "abcdef")
    one_line(error, "decoder language model")


@pytest.mark.parametrize("bad", (None, 3, "a model"))
def test_explain_without_a_model_is_one_short_line(bad):
    with pytest.raises(TypeError) as error:
        relevancy.explain(bad, batch("single0"))
    one_line(error, "model must be a torch.nn.Module", type(bad).__name__)


def test_an_unsupported_module_lists_the_families_in_under_1000_characters():
    with pytest.raises(relevancy.families.UnsupportedModelError) as error:
        relevancy.explain(torch.nn.Linear(2, 2), torch.zeros(1, 2))
    one_line(error, "Supported families", "decoder language model", "relevancy.families.adapters()")


# -- generations: tokens, saving ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", MULTI_BYTE)
def test_multi_byte_characters_span_their_tokens(saved, prompt):
    model, tokenizer = saved
    result = relevancy.explain_generation(model, tokenizer, prompt, continuation=" 👍 ok", method="cp_lrp")
    ids = tokenizer(prompt)["input_ids"] + result.generated_ids.tolist()
    assert len(result.tokens) == len(ids) and any("\ufffd" in tokenizer.decode([token]) for token in ids)  # bytes apart
    assert "" in result.tokens[: result.prompt_length]  # a character spans tokens: the ones before its last are empty
    assert "\ufffd" not in "".join(result.tokens)
    assert "".join(result.tokens) == tokenizer.decode(ids)
    assert "".join(result.tokens[: result.prompt_length]) == prompt


def test_the_json_and_html_carry_whole_characters(saved, tmp_path):
    model, tokenizer = saved
    result = relevancy.explain_generation(model, tokenizer, "🎉 the cat", continuation=" 中", method="cp_lrp")
    data = result.to_json()
    words = data.pop("words")  # a row read before the last byte of 中 ends in U+FFFD, holding those bytes' relevance
    text = json.dumps(data, ensure_ascii=False)
    assert "🎉" in text and "中" in text and "\ufffd" not in text
    assert [word for word, _ in words[0]] == ["🎉", "the", "cat"] and all(row[0][0] == "🎉" for row in words)
    page = result.save(tmp_path / "page.html").read_text(encoding="utf-8")
    assert "\ufffd" not in page and ("🎉" in page or "\\ud83c\\udf89" in page.lower() or "&#127881;" in page)


@pytest.mark.parametrize("name", ("x.png", "x", "x.html.txt"))  # x.json: the JSON relevancy.load reads (test_load.py)
def test_a_generation_saved_under_another_suffix_is_refused(generation, tmp_path, name):
    with pytest.raises(OutputError) as error:
        generation.save(tmp_path / name)
    one_line(error, "a GenerationExplanation is saved as .json, .npz, .html, .htm (chosen by the path's suffix)", name)
    assert not (tmp_path / name).exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ("x.html", "x.HTM"))
def test_a_generation_saved_as_html(generation, tmp_path, name):
    path = generation.save(tmp_path / name)
    assert path.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")


def test_saving_onto_a_folder_is_one_line(generation, tmp_path):
    (tmp_path / "page.html").mkdir()
    with pytest.raises(OutputError) as error:
        generation.save(tmp_path / "page.html")
    one_line(error, "is a folder; give a file name")


@pytest.mark.parametrize("below", ("child.html", "a/child.html"))
def test_saving_below_a_file_is_one_line(generation, tmp_path, below):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError) as error:
        generation.save(tmp_path / "file" / below)
    one_line(error, "cannot write", "is a file" if "/" in below else "is not a folder")
    assert (tmp_path / "file").read_text() == "x"


# -- model folders and files that are special files ---------------------------------------------------------
@pytest.fixture(scope="module")
def special(tmp_path_factory) -> Path:
    """A folder whose config.json is a FIFO, one whose weights are, a FIFO checkpoint and an image."""
    from relevancy.worlds import make_scenes
    from PIL import Image

    root = tmp_path_factory.mktemp("special")
    (root / "config_fifo").mkdir()
    os.mkfifo(root / "config_fifo" / "config.json")
    save_tiny_llama(root / "weights_fifo")
    weights = next((root / "weights_fifo").glob("*.safetensors"))
    weights.unlink()
    os.mkfifo(weights)
    os.mkfifo(root / "model.pth")
    os.mkfifo(root / "picture.png")
    Image.fromarray(make_scenes(1, seed=3, objects=2).pixels[0]).save(root / "scene.png")
    return root


def model_commands(root: Path, model: str) -> dict[str, list[str]]:
    scene = str(root / "scene.png")
    return {
        "explain-generation": ["explain-generation", "hi", "--model", model],
        "explain-text": ["explain-text", "hi", "--model", model],
        "explain-detections": ["explain-detections", scene, "--model", model],
        "explain --text": ["explain", scene, "--text", "a red star", "--model", model],
        "explain-question": ["explain-question", "--model", model],
        "evaluate": ["evaluate", "--benchmark", "llm-retrieval", "--model", model],
        "serve --language-model": ["serve", "--language-model", model, "--text-model", "none", "--clip-model", "none"],
        "serve --text-model": ["serve", "--text-model", model, "--clip-model", "none", "--language-model", "none"],
    }


@pytest.mark.parametrize("command", list(model_commands(Path("."), "x")))
def test_a_model_folder_whose_config_is_a_fifo_is_refused_by_every_command(special, capsys, command):
    started = time.perf_counter()
    assert main(model_commands(special, str(special / "config_fifo"))[command]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "its config.json is a named pipe (FIFO)" in error, error
    assert time.perf_counter() - started < 30  # refused before any model loads, never read


@pytest.mark.parametrize("command", ("explain-generation", "explain-text", "serve --language-model"))
def test_a_model_folder_whose_weights_are_a_fifo_is_refused(special, capsys, command):
    assert main(model_commands(special, str(special / "weights_fifo"))[command]) == 2
    assert "model.safetensors is a named pipe (FIFO)" in capsys.readouterr().err


@pytest.mark.parametrize("command", ("explain-generation", "explain-text", "explain --text"))
def test_a_device_as_the_model_is_named(special, capsys, command):
    assert main(model_commands(special, "/dev/zero")[command]) == 2
    assert "--model /dev/zero is a character device, not a model file or folder" in capsys.readouterr().err


def test_a_fifo_checkpoint_is_named(special, capsys):
    assert main(["explain", str(special / "scene.png"), "--model", str(special / "model.pth"), "--arch", "vit_tiny_patch16_224"]) == 2
    assert "model.pth is a named pipe (FIFO), not a model file or folder" in capsys.readouterr().err


@pytest.mark.parametrize("picture", ("picture.png", "/dev/zero"))
def test_a_special_image_file_is_named_not_missing(special, capsys, picture):
    assert main(["explain", str(special / picture)]) == 2
    error = capsys.readouterr().err
    assert ("is a named pipe (FIFO)" in error or "is a character device" in error) and "does not exist" not in error


def test_an_oversized_config_is_refused_unread(tmp_path):
    from relevancy.models import MAX_CONFIG_BYTES, load_language_model

    folder = save_tiny_llama(tmp_path / "big")
    with open(folder / "config.json", "r+b") as file:
        file.truncate(MAX_CONFIG_BYTES + 1)  # sparse: no disk written
    with pytest.raises(ValueError) as error:
        load_language_model(str(folder))
    one_line(error, "config.json is over 16 MiB")


# -- command-line texts that are not UTF-8 --------------------------------------------------------------------
@pytest.mark.parametrize("words, shown, byte", [
    (["explain-generation", os.fsdecode(b"caf\xe9")], "PROMPT", "0xe9 at character 4"),
    (["explain-text", "fine", os.fsdecode(b"\xff\xfe")], "TEXT", "0xff at character 1"),
    (["explain-generation", "fine", "--target", os.fsdecode(b" \xc3")], "--target", "0xc3 at character 2"),
    (["explain-question", "--question", os.fsdecode(b"what \x80")], "--question", "0x80 at character 6"),
])
def test_a_text_that_is_not_utf8_is_named_in_relevancys_words(capsys, words, shown, byte):
    assert main(words) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith("(as a terminal set to a UTF-8 locale does)") and f"{shown} is not UTF-8 text: byte {byte}" in error


# -- the web page's generation endpoint -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(folder):
    from fastapi.testclient import TestClient

    from relevancy.apps.serve import create_app, load_catalog, make_samples
    from relevancy.apps.serve.limits import Limits

    catalog = load_catalog(["shapes"], text="none", pairs="none", language=str(folder))
    limits = Limits(max_text_chars=2_000, max_prompt_tokens=24, max_running=1, max_waiting=2, time_limit_s=60)
    with TestClient(create_app(catalog, make_samples(scenes=1, pairs=1), limits)) as test_client:
        yield test_client


def refused_with(response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.parametrize("prompt", ("😀" * 300, "中" * 500, "é" * 400))
def test_a_prompt_within_the_characters_but_over_the_tokens_is_413(client, prompt):
    response = client.post("/api/explain-generation", json={"prompt": prompt, "max_new_tokens": 1})
    tokens = len(tiny_tokenizer()(prompt)["input_ids"])
    refused_with(response, 413, f"the prompt is {tokens:,} tokens", "the limit is 24")


def test_a_prompt_at_the_token_limit_is_answered(client):
    tokenizer = tiny_tokenizer()
    prompt = " ".join(["the cat"] * 12)
    assert len(tokenizer(prompt)["input_ids"]) <= 24
    response = client.post("/api/explain-generation", json={"prompt": prompt, "max_new_tokens": 1, "method": "cp_lrp"})
    assert response.status_code == 200, response.text


def test_the_endpoint_answers_whole_characters(client):
    response = client.post("/api/explain-generation", json={"prompt": "🎉 the cat", "max_new_tokens": 2, "method": "cp_lrp"})
    assert response.status_code == 200, response.text
    tokens = response.json()["results"][0]["explanation"]["tokens"]
    assert "🎉" in tokens and not any("\ufffd" in token for token in tokens[:4])  # the prompt's tokens: whole characters


def test_the_info_names_the_token_limit(client):
    assert client.get("/api/info").json()["limits"]["max_prompt_tokens"] == 24


@pytest.mark.parametrize("value, shown", [("0", "0"), ("100001", "100,001")])
def test_the_token_limit_is_a_serve_option_with_a_range(capsys, value, shown):
    assert main(["serve", "--text-model", "none", "--clip-model", "none", "--language-model", "none",
                 "--max-prompt-tokens", value]) == 2
    assert f"--max-prompt-tokens must be between 1 and 100,000, got {shown}" in capsys.readouterr().err


def test_a_generation_past_its_time_limit_asks_for_less_generation(client, monkeypatch):
    from relevancy.apps.serve import app as app_module

    def slow(request, catalog, samples, limits):
        return lambda deadline: time.sleep(0.5) or {}

    gate = client.app.state.gate
    monkeypatch.setattr(gate, "time_limit_s", 0.1)
    monkeypatch.setattr(app_module, "check_generation", slow)
    response = client.post("/api/explain-generation", json={"prompt": "the cat", "max_new_tokens": 1})
    refused_with(response, 504, "time limit", "fewer new tokens", "shorter prompt")
    assert "captions" not in response.json()["error"]
    time.sleep(0.5)  # the slow job's slot frees


def test_the_gates_default_advice_stays_for_the_other_endpoints():
    from relevancy.apps.serve.limits import RequestError
    from relevancy.apps.serve.queue import Gate

    gate = Gate(1, 0, 0.05)
    with pytest.raises(RequestError) as error:
        asyncio.run(gate.run(lambda deadline: time.sleep(0.3)))
    assert error.value.status == 504 and "fewer captions" in error.value.message
    gate.close()


def test_limits_refuse_a_zero_token_limit():
    from relevancy.apps.serve.limits import Limits

    with pytest.raises(ValueError, match="max_prompt_tokens must be at least 1, got 0"):
        dataclasses.replace(Limits(), max_prompt_tokens=0)
