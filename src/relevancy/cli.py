"""Command line: `relevancy explain | demo | evaluate | explain-text`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import torch

from . import METHODS, explain
from .api import get_method


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2, nothing written."""


def load_images(paths: Sequence[str], model: torch.nn.Module) -> torch.Tensor:
    """Read and preprocess images with the model's own data config; every file is checked before any work."""
    from PIL import Image, UnidentifiedImageError
    from timm.data import create_transform, resolve_data_config

    config = resolve_data_config({}, model=model)
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "strict_img_size", False):
        config["input_size"] = (3, *patch_embed.img_size)  # a model built at another size than its hub config
    transform = create_transform(**config)
    tensors = []
    for path in paths:
        if not Path(path).is_file():
            raise UsageError(f"image {path} does not exist")
        try:
            with Image.open(path) as image:
                tensors.append(transform(image.convert("RGB")))
        except (UnidentifiedImageError, OSError) as error:
            raise UsageError(f"{path} is not a readable image ({error})") from error
    return torch.stack(tensors)


def resolve_methods(method: str) -> list[str]:
    if method == "all":
        return list(METHODS)
    try:
        get_method(method)
    except ValueError as error:
        raise UsageError(str(error)) from error
    return [method]


def run_explain(args: argparse.Namespace) -> list[Path]:
    from .models import load_image_model
    from .viz import method_grid, save_figure

    methods = resolve_methods(args.method)
    model = load_image_model(args.model, args.arch)
    images = load_images(args.images, model)
    target = args.target
    results = {m: explain(model, images, method=m, target=target) for m in methods}
    first = next(iter(results.values()))
    pictures = first.pixels(images)
    written = []
    out = Path(args.out)
    for i, path in enumerate(args.images):
        stem = Path(path).stem
        name = f"{stem}_{args.method}.png"
        caption = f"{stem}: {first.labels()[i]}"
        figure = method_grid(
            pictures[i : i + 1],
            {m: r.heatmap()[i : i + 1] for m, r in results.items()},
            {m: r.signed for m, r in results.items()},
            [caption],
        )
        written.append(save_figure(figure, out / name))
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relevancy", description="What a transformer looked at: relevance maps and their evaluation.")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("explain", help="explain images with a timm Vision Transformer")
    p.add_argument("images", nargs="+", help="image files")
    p.add_argument("--model", default="shapes", help="timm model name (hub weights), local checkpoint (.pth/.safetensors, with --arch), or 'shapes' (the shipped model, default)")
    p.add_argument("--arch", help="timm architecture of a local checkpoint")
    p.add_argument("--method", default="transformer_attribution", help=f"one of {', '.join(METHODS)}, or 'all' (side by side)")
    p.add_argument("--target", type=int, default=None, help="class index to explain (default: the predicted class)")
    p.add_argument("--out", default="relevancy-out", help="output folder for the PNGs")
    p.set_defaults(handler=run_explain)

    for register in _extra_commands():
        register(commands)
    return parser


def _extra_commands():
    """Subcommands that live beside their subject (demo, evaluate, explain-text)."""
    from .bench.demo import add_demo_parser
    from .evaluate import add_evaluate_parser

    registrars = [add_demo_parser, add_evaluate_parser]
    try:
        from .text.cli import add_explain_text_parser
    except ImportError:  # the text extra (transformers, rich) is not installed
        return registrars
    return registrars + [add_explain_text_parser]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = args.handler(args)
    except (UsageError, ValueError, TypeError, FileNotFoundError, RuntimeError) as error:
        print(f"relevancy {args.command}: error: {error}", file=sys.stderr)
        return 2
    for path in written or []:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
