"""`relevancy explain-generation "PROMPT" [--model smollm2|FOLDER] [--image PICTURE] [--method M] [--max-new-tokens N]
[--target TEXT] [--json] [--out x.html]`.

The options are defined in `relevancy.apps.cli` (which loads no torch); this is the handler. It prints each generated
token's row (the tokens before it, coloured) in a terminal, token and score columns when stdout is not a terminal,
the numbers as JSON with `--json`, and writes the HTML page with `--out`. The request is checked before the model
loads; errors are one line (exit status 2) and leave no file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...core.files import check_file
from ...core.messages import quoted
from ..common import GENERATION_METHOD_NAMES, MAX_NEW_TOKENS, MAX_TEXT_CHARS, UsageError, at_most, check_inputs
from .common import print_results


def _check(args: argparse.Namespace) -> None:
    """A UsageError for anything wrong with the request that needs no model."""
    if args.method not in GENERATION_METHOD_NAMES:
        raise UsageError(f"--method must be one of {', '.join(GENERATION_METHOD_NAMES)} (one forward for every generated token), got {quoted(args.method)}")
    at_most("--max-new-tokens", args.max_new_tokens, 1, MAX_NEW_TOKENS)
    check_inputs("prompts", [args.prompt], 1, MAX_TEXT_CHARS)
    if not args.prompt.strip():
        raise UsageError("the prompt is empty: there is nothing to generate from")
    if args.target is not None and not args.target:
        raise UsageError("--target is empty: give the continuation to explain, or leave --target out to generate")
    if args.out is not None:
        if Path(args.out).suffix.lower() not in (".html", ".htm"):
            raise UsageError(f"--out must name an .html file, got {args.out}")
        check_file(args.out)
    if args.image is not None and not Path(args.model).expanduser().is_dir():
        raise UsageError(f"--image needs --model FOLDER, a local folder of a vision-language decoder and its processor "
                         f"(save_pretrained), got --model {args.model}")


def run_explain_generation(args: argparse.Namespace) -> list[Path]:
    """Generate from `args.prompt` and explain every generated token; returns the files written."""
    _check(args)
    from ...generation import explain_generation
    from ...models import load_language_model, load_vision_language_model
    from ...core.pictures import read_image

    picture = None if args.image is None else read_image(args.image, warn=lambda line: print(line, file=sys.stderr))
    model, tokenizer = load_language_model(args.model) if picture is None else load_vision_language_model(args.model)
    result = explain_generation(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, method=args.method,
                                continuation=args.target, image=picture)
    if args.json:
        print_results([result])
    elif sys.stdout.isatty():
        result.show()
    else:
        print_columns(result)
    return [] if args.out is None else [result.save(args.out)]


def print_columns(result) -> None:
    """The generated text, then per generated token a `# g. token (logit)` line and the tokens before it with their
    scores, one per line (each token's text as a JSON string: its spaces and newlines stay visible; a character
    whose bytes span tokens is one line, their scores summed)."""
    print(f"# {result.method}: generated {json.dumps(result.text)}")
    for g, caption in enumerate(result.labels()):
        print(f"# {g + 1}. {caption}")
        for text, score in result.parts["text"].units(g, by_word=False, special=True):
            print(f"{json.dumps(text)}\t{score:.6g}")
        print()
