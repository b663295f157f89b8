"""The shipped sentiment model and `relevancy explain-text`, end to end (offline: the encoder comes from a package)."""
from __future__ import annotations

import argparse
import json
import time
import warnings

import pytest
import torch

import relevancy

from relevancy.apps.cli import UsageError, build_parser, main
from relevancy.zoo.text import encode, load_model
from relevancy.apps.cli.text import run_explain_text
from relevancy.families.base import SEED_METHODS

POSITIVE = "This medicine worked wonders, I feel great and I highly recommend it."
NEGATIVE = "Terrible side effects, I felt awful and sick every day. Worst drug ever."


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_model()


def argv(**given) -> list[str]:
    words = ["explain-text", *given.pop("texts")]
    for key, value in given.items():
        words += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return words


def args(**given) -> argparse.Namespace:
    return build_parser().parse_args(argv(**given))


def test_default_model_is_a_bert_classifier_with_named_labels(shipped):
    model, tokenizer = shipped
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert not model.training
    with torch.no_grad():
        logits = model(**encode(tokenizer, [NEGATIVE, POSITIVE])).logits
    assert logits.argmax(-1).tolist() == [0, 1]


def test_explaining_the_default_model_reads_words(shipped):
    model, tokenizer = shipped
    expl = relevancy.explain(model, encode(tokenizer, [POSITIVE, NEGATIVE]), method="transformer_attribution")
    assert expl.target.tolist() == [1, 0]
    assert expl.labels()[0].startswith("positive")
    words = [w for w, _ in expl.words(0)]
    assert words[:3] == ["this", "medicine", "worked"] and "wonders" in words
    assert expl.tokens[0][0] == "[CLS]" and expl.tokens[0][-1] == "[SEP]"


def test_cli_handler_writes_the_html_page(tmp_path, capsys):
    out = tmp_path / "page.html"
    written = run_explain_text(args(texts=[POSITIVE, NEGATIVE], method="rollout", out=out))
    assert written == [out]
    page = out.read_text()
    assert "wonders" in page and "positive" in page and "negative" in page
    assert "worked" in capsys.readouterr().out  # the terminal view


def test_cli_all_methods_and_a_named_target(tmp_path):
    out = tmp_path / "all.html"
    run_explain_text(args(texts=[POSITIVE], method="all", target="negative", out=out, quiet=True))
    page = out.read_text()
    for method in SEED_METHODS:
        assert f"{method}: negative" in page


def test_cli_refuses_bad_requests_before_writing(tmp_path):
    out = tmp_path / "x.html"
    with pytest.raises(ValueError, match="unknown target 'happy'.*negative \\(0\\), positive \\(1\\)"):
        run_explain_text(args(texts=[POSITIVE], target="happy", out=out))
    with pytest.raises(ValueError, match="out of range"):
        run_explain_text(args(texts=[POSITIVE], target=5, out=out))
    with pytest.raises(UsageError, match="empty"):
        run_explain_text(args(texts=["   "], out=out))
    with pytest.raises(UsageError, match="Did you mean 'rollout'"):
        run_explain_text(args(texts=[POSITIVE], method="rolout", out=out))
    with pytest.raises(UsageError, match="html"):
        run_explain_text(args(texts=[POSITIVE], out=tmp_path / "x.png"))
    with pytest.raises(FileNotFoundError, match="no-such-model: no such folder"):
        run_explain_text(args(texts=[POSITIVE], model=tmp_path / "no-such-model", out=out))
    assert not out.exists()


def test_cli_loads_a_local_classifier_folder(tmp_path, shipped):
    model, tokenizer = shipped
    model.save_pretrained(tmp_path / "copy")
    tokenizer.save_pretrained(tmp_path / "copy")
    out = tmp_path / "copy.html"
    run_explain_text(args(texts=[NEGATIVE], model=tmp_path / "copy", method="raw_attention", out=out, quiet=True))
    assert "awful" in out.read_text()


def test_long_texts_are_truncated_with_a_warning(shipped):
    model, tokenizer = shipped
    with pytest.warns(UserWarning, match="text 1 has .* tokens; only its first 16"):
        batch = encode(tokenizer, ["short", "word " * 40], max_length=16)
    assert batch["input_ids"].shape == (2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encode(tokenizer, ["short"], model=model)


# ------------------------------------------------------------------------------------- checks before work


@pytest.fixture()
def no_work(forbid):
    """Fail the test if the command loads a model or explains anything."""
    forbid("relevancy.models.load_text_classifier", "relevancy.api.explain")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"max_length": -5}, "--max-length must be at least 3 ([CLS], a token and [SEP]), got -5"),
        ({"max_length": 2}, "--max-length must be at least 3"),
        ({"target": -1}, "--target must be a class index (0 or more) or a class name, got '-1'"),
        ({"method": "rolout"}, "Did you mean 'rollout'?"),
    ],
)
def test_bad_numbers_are_refused_before_loading(tmp_path, capsys, no_work, given, message):
    assert main(argv(texts=[POSITIVE], out=tmp_path / "x.html", **given)) == 2
    err = capsys.readouterr().err
    assert err.startswith("relevancy explain-text: error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "x.html").exists()


def test_the_output_file_is_checked_before_loading(tmp_path, capsys, no_work):
    folder = tmp_path / "page.html"
    folder.mkdir()
    assert main(argv(texts=[POSITIVE], out=folder)) == 2
    assert f"{folder} is a folder; give a file name" in capsys.readouterr().err
    a_file = tmp_path / "taken"
    a_file.write_text("keep me")
    assert main(argv(texts=[POSITIVE], out=a_file / "x.html")) == 2
    assert f"{a_file} exists and is not a folder" in capsys.readouterr().err
    assert main(argv(texts=[POSITIVE], out="/proc/relevancy/x.html")) == 2
    assert "is not writable" in capsys.readouterr().err


def test_json_prints_tokens_and_scores(capsys):
    assert main(argv(texts=[POSITIVE, NEGATIVE], method="all", json=True)) == 0
    results = json.loads(capsys.readouterr().out)  # one to_json() per method, each over both texts
    assert [result["method"] for result in results] == list(SEED_METHODS) + ["attnlrp", "cp_lrp", "input_x_gradient"]
    for result in results:
        assert result["kind"] == "TextExplanation" and result["class_names"] == ["negative", "positive"]
        assert len(result["target"]) == 2 and all(k in (0, 1) for k in result["target"])
        for tokens, mask, scores in zip(result["tokens"], result["attention_mask"], result["scores"]["text"]):
            assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and sum(mask) == len(tokens) == len(scores) - mask.count(0)
            assert all(isinstance(x, float) for x in scores)
    # the two texts have different lengths: each lists its own tokens
    first, second = results[0]["tokens"]
    assert "wonders" in first and "awful" in second and len(first) != len(second)


def test_without_a_terminal_the_scores_are_printed_as_columns(capsys):
    assert main(argv(texts=[POSITIVE], method="cdam")) == 0  # pytest's stdout is not a terminal
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# text 1, cdam: positive (")
    rows = [line.split("\t") for line in lines[1:] if line]
    assert [word for word, _ in rows][:3] == ["this", "medicine", "worked"]
    assert all(float(score) == float(score) for _, score in rows)  # every row holds a number


def test_an_offline_hub_name_fails_in_seconds(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr("relevancy.models.hub_reachable", lambda: False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="cannot be reached and it is not in the local cache; pass a local model folder"):
        run_explain_text(args(texts=[POSITIVE], model="someone/sentiment-classifier"))
    assert time.perf_counter() - started < 10
    assert constants.HF_HUB_OFFLINE is False
