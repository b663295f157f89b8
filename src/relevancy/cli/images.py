"""`relevancy explain IMAGE...` and `relevancy demo`: images in, overlays out."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..files import check_folder, distinct_stems
from .common import DEFAULT_OUT, UsageError, at_least, explanation_numbers, print_json, resolve_methods
from .pictures import preprocess, read_image


def run_explain(args: argparse.Namespace) -> list[Path]:
    """`relevancy explain`: checks, then one PNG per image (methods side by side) and/or the numbers as JSON;
    with `--text`, image-text pairs of a CLIP model (`cli.pairs`)."""
    if args.text:
        from .pairs import run_explain_pairs

        return run_explain_pairs(args, [read_image(path) for path in args.images])
    methods = resolve_methods(args.method)
    at_least("--target", args.target, 0)
    out = None if args.out is None and args.json else Path(args.out or DEFAULT_OUT)
    names = [f"{stem}_{args.method}.png" for stem in distinct_stems(args.images)]
    if out is not None:
        check_folder(out, names)
    pictures = [read_image(path) for path in args.images]

    from .. import models
    from ..api import explain

    model = models.load_image_model(args.model or models.SHIPPED, args.arch)
    images = preprocess(pictures, model)
    results = {m: explain(model, images, method=m, target=args.target) for m in methods}
    if args.json:
        print_json({"model": args.model or models.SHIPPED, "method": args.method, "images": [
            {"file": path, "methods": {m: explanation_numbers(r, i) for m, r in results.items()}}
            for i, path in enumerate(args.images)
        ]})
    if out is None:
        return []
    from ..viz import method_grid, save_figure

    first = next(iter(results.values()))
    shown = first.pixels(images)
    written = []
    for i, (path, name) in enumerate(zip(args.images, names)):
        figure = method_grid(
            shown[i : i + 1],
            {m: r.heatmap()[i : i + 1] for m, r in results.items()},
            {m: r.signed for m, r in results.items()},
            [f"{Path(path).stem}: {first.labels()[i]}"],
        )
        written.append(save_figure(figure, out / name))
    return written


def run_demo(args: argparse.Namespace) -> list[Path]:
    """`relevancy demo`: checks the scene counts and the output folder, then runs the demo."""
    from ..bench import demo

    methods = [m for name in args.methods.split(",") for m in resolve_methods(name.strip())]
    at_least("--singles", args.singles, 0)
    at_least("--pairs", args.pairs, 0)
    if args.singles + args.pairs == 0:
        raise UsageError("--singles and --pairs are both 0: there is no scene to explain")
    check_folder(args.out, ["index.html"])
    check_folder(Path(args.out) / demo.IMAGES)
    index = demo.run_demo(args.out, args.singles, args.pairs, methods)
    print(f"open {index} (its pictures are in {index.parent / demo.IMAGES})")
    return []


