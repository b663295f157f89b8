"""`relevancy explain IMAGE...` and `relevancy demo`: images in, overlays out."""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..files import check_folder, distinct_stems
from .common import DEFAULT_OUT, UsageError, at_least, explanation_numbers, print_json, resolve_methods, warn

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from torch import nn

#: larger images are refused (PIL warns above 89 Mpixel and refuses above 179 Mpixel)
MAX_IMAGE_PIXELS = 100_000_000
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


def normalised(pictures: Sequence[Image.Image], size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """CLIP-style preprocessing: the shorter side resized to `size` (bicubic), the centre `size x size` cropped,
    normalised with `mean` and `std`; one batch."""
    import torch
    from torchvision.transforms import v2

    transform = v2.Compose([
        v2.ToImage(), v2.Resize(size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True), v2.CenterCrop(size),
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std)),
    ])
    return torch.stack([transform(picture) for picture in pictures])


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


