"""`relevancy explain-text "TEXT" [--model NAME_OR_DIR] [--method M] [--target K] [--out x.html] [--json]`.

The options are defined in `relevancy.apps.cli` (which loads no torch); this is the handler. It prints each text as
coloured words in a terminal, as word and score columns when stdout is not a terminal (a pipe or a file), the
numbers as JSON with `--json`, and writes the HTML page with `--out`. Everything that can be checked is checked
before the model loads; errors are one-line UsageErrors, ValueErrors or RuntimeErrors (exit status 2).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..catalogue import SHIPPED
from ..common import MAX_TEXT_CHARS, UsageError, at_least, check_inputs, resolve_methods
from .common import MAX_TEXTS, class_target, print_results
from ...core.files import check_file

#: the shortest --max-length: [CLS], one token of text and [SEP]
MIN_LENGTH = 3


def _check(args: argparse.Namespace) -> list[str]:
    """The methods to run; a UsageError for anything wrong with the request that needs no model."""
    from ...families.hf_bert.adapter import HFBertAdapter

    methods = resolve_methods(args.method, HFBertAdapter.methods, "text classifiers")
    at_least("--max-length", args.max_length, MIN_LENGTH, " ([CLS], a token and [SEP])")
    class_target(args.target)
    check_inputs("texts", args.texts, MAX_TEXTS, MAX_TEXT_CHARS)
    for i, text in enumerate(args.texts):
        if not text.strip():
            raise UsageError(f"text {i} is empty: there is nothing to explain")
    if args.out is not None:
        if Path(args.out).suffix.lower() not in (".html", ".htm"):
            raise UsageError(f"--out must name an .html file, got {args.out}")
        check_file(args.out)
    return methods


def run_explain_text(args: argparse.Namespace) -> list[Path]:
    """Explain `args.texts`; returns the files written (the HTML page when `--out` is given)."""
    from ...api import explain
    from ...results.explanation import TextExplanation
    from ...models import load_text_classifier
    from ...zoo.text.model import encode

    methods = _check(args)
    model, tokenizer = load_text_classifier(None if SHIPPED["text"].means(args.model) else str(args.model))
    target = class_target(args.target)
    batch = encode(tokenizer, args.texts, max_length=args.max_length, model=model)
    results: list[TextExplanation] = []
    for method in methods:
        try:
            results.append(explain(model, batch, method=method, target=target))
        except TypeError as error:  # e.g. relevance rules missing for this family: say which method
            raise RuntimeError(f"{method}: {error}") from error
    by_word = not args.tokens
    if args.json:
        print_results(results)
    elif not args.quiet:
        for result in results:
            if sys.stdout.isatty():
                result.show(by_word=by_word)
            else:
                print_columns(result, by_word)
    if args.out is None:
        return []
    return [save_all(results, Path(args.out), by_word)]


def print_columns(result, by_word: bool = True) -> None:
    """Each text as plain columns, word (or token, as the text it stands for) and score, under a `# method: class
    (logit)` line."""
    for i, caption in enumerate(result.labels()):
        print(f"# text {i + 1}, {result.method}: {caption}")
        units = result.words(i) if by_word else result.parts["text"].units(i, by_word=False, special=True)
        for unit, score in units:
            print(f"{unit}\t{score:.6g}")
        print()


def save_all(results: list, path: Path, by_word: bool = True) -> Path:
    """One HTML page with every method's explanation of every text (atomically written)."""
    if len(results) == 1:
        return results[0].save(path, by_word=by_word)
    from ...results.explanation import html_page
    from ...core.files import write_atomic

    return write_atomic(path, html_page("relevancy", "<hr>".join(result.to_html(by_word) for result in results)))
