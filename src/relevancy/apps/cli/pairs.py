"""`relevancy explain IMAGE... --text TEXT...`: image-text pairs of a CLIP model; a PNG and an HTML page per image."""
from __future__ import annotations

import argparse
from pathlib import Path

from ...core.files import check_folder, distinct_stems
from ..catalogue import SHIPPED
from ..common import UsageError, check_inputs, resolve_methods
from .common import DEFAULT_OUT, print_results

#: the most captions per run (each is a row of every image's PNG), their longest, and the most image-text pairs
MAX_CAPTIONS = 16
MAX_CAPTION_CHARS = 1_000
MAX_PAIRS = 256


def run_explain_pairs(args: argparse.Namespace, pictures: list) -> list[Path]:
    """Every image against every `--text`: per image one PNG (a row per text, a column per method) and one HTML
    page of the coloured texts; `--json`: the numbers."""
    from ...families.clip.adapter import ClipAdapter

    methods = resolve_methods(args.method, ClipAdapter.methods, "image-text pairs")
    if args.target is not None:
        raise UsageError("--target picks a class; with --text the explained score is each image-text pair's logit")
    if any(not text.strip() for text in args.text):
        raise UsageError("--text is empty: give a caption to explain, e.g. --text 'a red star'")
    check_inputs("--text captions", args.text, MAX_CAPTIONS, MAX_CAPTION_CHARS)
    if len(pictures) * len(args.text) > MAX_PAIRS:
        raise UsageError(f"{len(pictures)} images x {len(args.text)} texts = {len(pictures) * len(args.text):,} pairs; "
                         f"the limit is {MAX_PAIRS} pairs per run")
    out = None if args.out is None and args.json else Path(args.out or DEFAULT_OUT)
    stems = [f"{stem}_{args.method}" for stem in distinct_stems(args.images)]
    if out is not None:
        check_folder(out, [f"{stem}{suffix}" for stem in stems for suffix in (".png", ".html")])

    from ... import models
    from ...api import explain
    from ...results.explanation import html_page, texts_html
    from ...families.clip.batch import ImageTextBatch
    from ...families.clip.towers import towers_of
    from ...core.files import write_atomic
    from ...results.viz import method_grid, save_figure
    from ...core.pictures import normalised

    bundle = models.load_clip_model(args.model or SHIPPED["pairs"].name)
    try:
        encoded = bundle.encode(list(args.text))
    except ValueError as error:  # the shipped tokenizer names unknown words
        raise UsageError(str(error)) from error
    images = normalised(pictures, bundle.image_size, bundle.mean, bundle.std)
    ends = towers_of(bundle.model).readout_index(encoded["input_ids"]).tolist()  # strings up to the end token
    tokens = [row[: end + 1] for row, end in zip(bundle.token_strings(encoded["input_ids"]), ends)]
    batch = ImageTextBatch.grid(images, encoded, tokens=tokens)
    results = {m: explain(bundle.model, batch, method=m) for m in methods}
    texts = len(args.text)
    if args.json:
        print_results(results.values())
    if out is None:
        return []
    first = next(iter(results.values()))
    shown = first.parts["image"].pixels(images)
    written = []
    for i, stem in enumerate(stems):
        rows = slice(i * texts, (i + 1) * texts)
        captions = [f"{args.text[j]} ({first.logits[i * texts + j, 0]:.2f})" for j in range(texts)]
        figure = method_grid(
            shown[i : i + 1].expand(texts, *shown.shape[1:]),
            {m: r.heatmap()[rows] for m, r in results.items()},
            {m: r.signed for m, r in results.items()},
            captions,
        )
        written.append(save_figure(figure, out / f"{stem}.png"))
        body = "".join(
            f"<h3>{m}</h3>" + texts_html(_rows(r.parts["text"], rows), captions) for m, r in results.items()
        )
        written.append(write_atomic(out / f"{stem}.html", html_page(f"{Path(args.images[i]).name}: {args.method}", body)))
    return written


def _rows(part, rows: slice):
    """The text part of the pairs in `rows`."""
    from dataclasses import replace

    return replace(part, scores=part.scores[rows], tokens=part.tokens[rows] if part.tokens else None,
                   attention_mask=None if part.attention_mask is None else part.attention_mask[rows])
