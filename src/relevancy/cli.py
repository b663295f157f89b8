"""Command line: `relevancy explain | explain-text | demo | evaluate`.

Every command's options are defined here, in a module that imports neither torch nor the model libraries, so
`relevancy --help` answers at once; each handler imports what it needs when it runs. Handlers check the request
(numbers, input files, output paths) before loading a model, so a bad request costs nothing and writes nothing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import __version__
from .extras import MissingExtraError
from .files import check_folder, distinct_stems, strict_json

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from torch import nn

    from .explanation import Explanation

#: the built-in methods (`relevancy.METHODS`), named here so that the help loads no torch; a test keeps them equal
METHOD_NAMES = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "transformer_attribution",
                "partial_lrp", "lrp", "cdam", "token_ablation")
#: larger images are refused (PIL warns above 89 Mpixel and refuses above 179 Mpixel)
MAX_IMAGE_PIXELS = 100_000_000
DEFAULT_OUT = "relevancy-out"


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2, nothing written."""


def warn(command: str, message: str) -> None:
    """A one-line warning on stderr (stdout may carry JSON)."""
    print(f"relevancy {command}: warning: {message}", file=sys.stderr)


def at_least(option: str, value: int | None, minimum: int, why: str = "") -> None:
    """A UsageError unless `value` (None: not given) is at least `minimum`."""
    if value is not None and value < minimum:
        raise UsageError(f"{option} must be at least {minimum}{why}, got {value}")


def print_json(value: Any) -> None:
    """`value` as strict JSON on stdout (NaN and infinities as null)."""
    print(json.dumps(strict_json(value), allow_nan=False))


def explanation_numbers(explanation: Explanation, index: int) -> dict[str, Any]:
    """What `--json` prints for one input and method: the target, its class name and logit, the scores."""
    target = int(explanation.target[index])
    names = explanation.class_names
    return {
        "target": target,
        "class": names[target] if names and 0 <= target < len(names) else None,
        "logit": float(explanation.logits[index, target]) if target >= 0 else None,
        "signed": explanation.signed,
        "scores": explanation.scores[index].detach().float().cpu().tolist(),
    }


# -- images ---------------------------------------------------------------------------------------------------
def read_image(path: str) -> Image.Image:
    """An image file as an 8-bit RGB picture, as it is meant to be seen: EXIF orientation applied, 16-bit and
    float pixels scaled by their range (not clipped), the first frame of an animation (with a warning)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    file = Path(path)
    if file.is_dir():
        raise UsageError(f"image {path} is a folder, not an image file")
    if not file.is_file():
        raise UsageError(f"image {path} does not exist")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own, lower limit applies
            with Image.open(file) as image:
                if image.width * image.height > MAX_IMAGE_PIXELS:
                    raise UsageError(f"image {path} is too large: {image.width}x{image.height} pixels, the limit is {MAX_IMAGE_PIXELS:,}")
                frames = getattr(image, "n_frames", 1)
                if frames > 1:
                    warn("explain", f"{path} is animated: uses frame 1 of {frames}")
                return _rgb(ImageOps.exif_transpose(image), path)
    except Image.DecompressionBombError:
        raise UsageError(f"image {path} is too large: more than {MAX_IMAGE_PIXELS:,} pixels") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise UsageError(f"{path} is not a readable image ({error})") from error


def _rgb(image: Image.Image, path: str) -> Image.Image:
    """8-bit RGB. 16-bit pixels are scaled by 65535; 32-bit integers by 65535 when they fit 16 bits, else by
    their range; float pixels are kept within [0, 1] and scaled by their range otherwise."""
    from PIL import Image

    if image.mode not in ("I", "F") and not image.mode.startswith("I;16"):
        return image.convert("RGB")
    import numpy as np

    values = np.asarray(image, dtype=np.float64)
    if not np.isfinite(values).all():
        raise UsageError(f"image {path} has NaN or infinite pixels")
    low, high = float(values.min()), float(values.max())
    if image.mode.startswith("I;16") or (image.mode == "I" and low >= 0 and high <= 65535):
        values = values / 65535
    elif low < 0 or high > 1:
        values = (values - low) / (high - low) if high > low else np.zeros_like(values)
    return Image.fromarray(np.round(values * 255).astype(np.uint8), "L").convert("RGB")


def preprocess(pictures: Sequence[Image.Image], model: nn.Module) -> torch.Tensor:
    """The model's own preprocessing (timm data config) of every picture, as one batch."""
    import torch
    from timm.data import create_transform, resolve_data_config

    config = resolve_data_config({}, model=model)
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "strict_img_size", False):
        config["input_size"] = (3, *patch_embed.img_size)  # a model built at another size than its hub config
    transform = create_transform(**config)
    return torch.stack([transform(picture) for picture in pictures])


def resolve_methods(method: str) -> list[str]:
    """`all` or one method name, checked against the registry (a UsageError with the closest name)."""
    from . import METHODS
    from .api import get_method

    if method == "all":
        return list(METHODS)
    try:
        get_method(method)
    except ValueError as error:
        raise UsageError(str(error)) from error
    return [method]


# -- commands -------------------------------------------------------------------------------------------------
def run_explain(args: argparse.Namespace) -> list[Path]:
    """`relevancy explain`: checks, then one PNG per image (methods side by side) and/or the numbers as JSON."""
    methods = resolve_methods(args.method)
    at_least("--target", args.target, 0)
    out = None if args.out is None and args.json else Path(args.out or DEFAULT_OUT)
    names = [f"{stem}_{args.method}.png" for stem in distinct_stems(args.images)]
    if out is not None:
        check_folder(out, names)
    pictures = [read_image(path) for path in args.images]

    from . import models
    from .api import explain

    model = models.load_image_model(args.model, args.arch)
    images = preprocess(pictures, model)
    results = {m: explain(model, images, method=m, target=args.target) for m in methods}
    if args.json:
        print_json({"model": args.model, "method": args.method, "images": [
            {"file": path, "methods": {m: explanation_numbers(r, i) for m, r in results.items()}}
            for i, path in enumerate(args.images)
        ]})
    if out is None:
        return []
    from .viz import method_grid, save_figure

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
    from .bench import demo

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


def _lazy(module: str, function: str) -> Callable[[argparse.Namespace], list[Path]]:
    """A handler imported when its command runs: its module may import torch and the model libraries."""
    def handler(args: argparse.Namespace) -> list[Path]:
        return getattr(importlib.import_module(module), function)(args)

    return handler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relevancy", description="What a transformer looked at: relevance maps and their evaluation.")
    parser.add_argument("--version", action="version", version=f"relevancy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    methods = f"one of {', '.join(METHOD_NAMES)}"

    p = commands.add_parser("explain", help="explain images with a timm Vision Transformer",
                            description="Explain images with a timm Vision Transformer: one PNG per image (the "
                                        "methods side by side) and, with --json, the numbers on stdout.")
    p.add_argument("images", nargs="+", help="image files (16-bit and float images are scaled by their range; "
                                             f"EXIF orientation is applied; animations use frame 1; at most {MAX_IMAGE_PIXELS:,} pixels)")
    p.add_argument("--model", default="shapes", help="timm model name (hub weights), local checkpoint (.pth/.pt/.bin/.safetensors, with --arch), or 'shapes' (the shipped model, default)")
    p.add_argument("--arch", help="timm architecture of a local checkpoint")
    p.add_argument("--method", default="transformer_attribution", help=f"{methods}, or 'all' (side by side)")
    p.add_argument("--target", type=int, default=None, help="class index to explain (default: the predicted class)")
    p.add_argument("--out", default=None, help=f"output folder for the PNGs (default {DEFAULT_OUT}; with --json, PNGs are written only when --out is given)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON on stdout: per image and method the target, "
                                                       "its class name and logit, and the score grid (rows of columns)")
    p.set_defaults(handler=run_explain)

    p = commands.add_parser("explain-text", help="explain texts with a BERT-family text classifier",
                            description="Explain texts with a BERT-family text classifier: coloured words in a terminal, "
                                        "word and score columns when stdout is not a terminal, JSON with --json.")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="one or more texts (quote each)")
    p.add_argument("--model", default=None,
                   help="hub name or local folder of a BERT/RoBERTa/DistilBERT sequence classifier "
                        "(default: the shipped drug-review sentiment model)")
    p.add_argument("--method", default="transformer_attribution", help=f"{methods}, or 'all'")
    p.add_argument("--target", default=None,
                   help="class to explain: an index or a label name, e.g. 'positive' (default: the predicted class)")
    p.add_argument("--out", default=None, help="write an HTML page of the coloured texts here (e.g. x.html)")
    p.add_argument("--max-length", type=int, default=None, help="truncate longer texts to this many tokens, [CLS] and [SEP] included (with a warning)")
    p.add_argument("--tokens", action="store_true", help="show word pieces instead of words")
    p.add_argument("--quiet", action="store_true", help="print nothing but --json's numbers")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON on stdout: per text and method the target, "
                                                       "its class name and logit, the tokens and their scores")
    p.set_defaults(handler=_lazy("relevancy.text.cli", "run_explain_text"))

    p = commands.add_parser("demo", help="explain generated scenes with the shipped model (offline) and write an HTML page")
    p.add_argument("--out", default="demo", help="output folder (default: demo)")
    p.add_argument("--singles", type=int, default=3, help="single-object scenes (default 3)")
    p.add_argument("--pairs", type=int, default=3, help="two-object scenes (default 3)")
    p.add_argument("--methods", default="all", help="'all' or a comma-separated list")
    p.set_defaults(handler=run_demo)

    p = commands.add_parser(
        "evaluate",
        help="run the papers' evaluation protocols (perturbation, segmentation, discrimination, agreement)",
        description="Evaluate explanation methods: perturbation and segmentation tests (Chefer et al.), class "
                    "discrimination, agreement with token ablation (Brocki & Chung). Writes results.json (percentages "
                    "in percent), report.md and perturbation.png to --out. Run under `torchrun --nproc-per-node K` to "
                    "shard the images over K processes (gloo); the results are the same.",
    )
    p.add_argument("--benchmark", default="shapes",
                   help="shapes (synthetic scenes with exact masks, offline; default), imagenet (perturbation on an "
                        "ImageFolder validation set), imagenet-seg (segmentation on gtsegs_ijcv.mat) or eraser "
                        "(token-F1 of a text classifier against ERASER rationales, e.g. Movie Reviews)")
    p.add_argument("--data", help="imagenet: the validation folder (DIR/<wnid>/*.JPEG); imagenet-seg: gtsegs_ijcv.mat")
    p.add_argument("--model", default="shapes", help="'shapes' (the shipped model, default), a timm model name, or a local checkpoint (with --arch)")
    p.add_argument("--arch", help="timm architecture of a local checkpoint, or 'shapes' for a checkpoint of the shapes ViT")
    p.add_argument("--methods", default="all", help="'all' (default) or a comma-separated list of methods")
    p.add_argument("--n", "-n", "--num-images", dest="n", type=int, default=None,
                   help="images to evaluate (shapes: one-object scenes, default 500, plus n//2 two-object scenes; "
                        "imagenet, imagenet-seg: default all). Under torchrun write -n or --num-images: torchrun "
                        "reads --n as an abbreviation of its own options")
    p.add_argument("--batch-size", type=int, default=16, help="images explained together (default 16)")
    p.add_argument("--out", default="relevancy-eval", help="output folder (default relevancy-eval)")
    p.add_argument("--seed", type=int, default=0, help="shapes: which scenes; imagenet: which images (default 0)")
    p.add_argument("--paper-settings", action="store_true",
                   help="the authors' evaluation options: start_layer=1 for rollout and transformer_attribution, "
                        "normalised attention_gradcam, squash resize without crop for ImageNet")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default: torch's choice)")
    p.add_argument("--workers", type=int, default=0, help="data-loading worker processes for the ImageNet benchmarks")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--split", default="test", help="eraser: which split's annotations (default test)")
    p.add_argument("--json", action="store_true", help="also print the summary metrics as JSON on stdout (results.json "
                                                       "without its lists: curves, per-class IoU)")
    p.set_defaults(handler=_lazy("relevancy.evaluate", "evaluate"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = args.handler(args)
    except (UsageError, ValueError, TypeError, OSError, RuntimeError, MissingExtraError) as error:
        message = " ".join(str(error).split())  # one line, whatever the library wrote
        print(f"relevancy {args.command}: error: {message}", file=sys.stderr)
        return 2
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout  # stdout carries the JSON
    for path in written or []:
        print(f"wrote {path}", file=stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
