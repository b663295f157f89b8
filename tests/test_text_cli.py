"""The shipped sentiment model and `relevancy explain-text`, end to end (offline: the encoder comes from a package)."""
from __future__ import annotations

import argparse
import warnings

import pytest
import torch

import relevancy

from relevancy.text import encode, load_model
from relevancy.text.cli import add_explain_text_parser, run_explain_text

POSITIVE = "This medicine worked wonders, I feel great and I highly recommend it."
NEGATIVE = "Terrible side effects, I felt awful and sick every day. Worst drug ever."


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_model()


def args(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_explain_text_parser(parser.add_subparsers(dest="command"))
    argv = ["explain-text", *given.pop("texts")]
    for key, value in given.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return parser.parse_args(argv)


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
    for method in relevancy.METHODS:
        assert f"{method}: negative" in page


def test_cli_refuses_bad_requests_before_writing(tmp_path):
    out = tmp_path / "x.html"
    with pytest.raises(ValueError, match="unknown target 'happy'.*negative \\(0\\), positive \\(1\\)"):
        run_explain_text(args(texts=[POSITIVE], target="happy", out=out))
    with pytest.raises(ValueError, match="out of range"):
        run_explain_text(args(texts=[POSITIVE], target=5, out=out))
    with pytest.raises(ValueError, match="empty"):
        run_explain_text(args(texts=["   "], out=out))
    with pytest.raises(ValueError, match="Did you mean 'rollout'"):
        run_explain_text(args(texts=[POSITIVE], method="rolout", out=out))
    with pytest.raises(ValueError, match="html"):
        run_explain_text(args(texts=[POSITIVE], out=tmp_path / "x.png"))
    with pytest.raises(RuntimeError, match="could not load"):
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
