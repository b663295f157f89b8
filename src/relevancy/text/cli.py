"""`relevancy explain-text "TEXT" [--model NAME_OR_DIR] [--method M] [--target K] [--out x.html]`.

Registered by `relevancy.cli` through `add_explain_text_parser(subparsers)`; the handler prints each text as
coloured words to the terminal and, with `--out`, writes the HTML page. Errors are ValueErrors or
RuntimeErrors with one-line messages (the main CLI prints them and exits with status 2, writing nothing).
"""
from __future__ import annotations

import argparse
from functools import lru_cache
from pathlib import Path

DEFAULT_METHOD = "transformer_attribution"


def add_explain_text_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `explain-text` subcommand to an `argparse` subparsers object."""
    from .. import METHODS

    p = subparsers.add_parser("explain-text", help="explain texts with a BERT-family text classifier")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="one or more texts (quote each)")
    p.add_argument("--model", default=None,
                   help="hub name or local folder of a BERT/RoBERTa/DistilBERT sequence classifier "
                        "(default: the shipped drug-review sentiment model)")
    p.add_argument("--method", default=DEFAULT_METHOD, help=f"one of {', '.join(METHODS)}, or 'all'")
    p.add_argument("--target", default=None,
                   help="class to explain: an index or a label name, e.g. 'positive' (default: the predicted class)")
    p.add_argument("--out", default=None, help="write an HTML page of the coloured texts here (e.g. x.html)")
    p.add_argument("--max-length", type=int, default=None, help="truncate longer texts to this many tokens (with a warning)")
    p.add_argument("--tokens", action="store_true", help="show word pieces instead of words")
    p.add_argument("--quiet", action="store_true", help="do not print the coloured texts to the terminal")
    p.set_defaults(handler=run_explain_text)
    return p


def resolve_target(target: str | int | None, model) -> int | None:
    """An index from an index or a label name of `model.config`; a ValueError listing the classes otherwise."""
    if target is None or isinstance(target, int):
        return target
    text = str(target).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    config = getattr(model, "config", None)
    label2id = {str(k).lower(): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
    if text.lower() in label2id:
        return label2id[text.lower()]
    id2label = getattr(config, "id2label", None) or {}
    classes = ", ".join(f"{name} ({i})" for i, name in sorted((int(i), n) for i, n in id2label.items()))
    raise ValueError(f"unknown target '{text}': the model's classes are {classes}")


def run_explain_text(args: argparse.Namespace) -> list[Path]:
    """Explain `args.texts`; returns the files written (the HTML page when `--out` is given)."""
    from .. import METHODS, explain
    from ..api import get_method
    from .explanation import TextExplanation
    from .model import encode

    methods = list(METHODS) if args.method == "all" else [args.method]
    for method in methods:
        get_method(method)  # a ValueError naming the closest method, before any loading
    if args.out is not None and Path(args.out).suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"--out must name an .html file, got {args.out}")
    for i, text in enumerate(args.texts):
        if not text.strip():
            raise ValueError(f"text {i} is empty: there is nothing to explain")
    model, tokenizer = _load(None if args.model is None else str(args.model))
    target = resolve_target(args.target, model)
    batch = encode(tokenizer, args.texts, max_length=args.max_length, model=model)
    results: list[TextExplanation] = []
    for method in methods:
        try:
            results.append(explain(model, batch, method=method, target=target))
        except TypeError as error:  # e.g. relevance rules missing for this family: say which method
            raise RuntimeError(f"{method}: {error}") from error
    by_word = not getattr(args, "tokens", False)
    if not getattr(args, "quiet", False):
        for result in results:
            result.show(by_word=by_word)
    if args.out is None:
        return []
    return [save_all(results, Path(args.out), by_word)]


@lru_cache(maxsize=2)
def _load(name_or_dir: str | None):
    """The model and tokenizer, loaded once per process (the handler may run several times, e.g. in tests)."""
    from .model import load_model

    try:
        return load_model(name_or_dir)
    except OSError as error:
        raise RuntimeError(str(error)) from error


def save_all(results: list, path: Path, by_word: bool = True) -> Path:
    """One HTML page with every method's explanation of every text (atomically written)."""
    if len(results) == 1:
        return results[0].save(path, by_word=by_word)
    from ..files import write_atomic

    body = "<hr>".join(result.to_html(by_word) for result in results)
    page = f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>relevancy</title></head><body>{body}</body></html>\n'
    return write_atomic(path, page)
