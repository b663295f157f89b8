"""Image files in, model-ready batches out: reading (EXIF, modes, size limits) and each model kind's preprocessing.

Below both the command line (`cli/`) and the web server (`serve/`), which read pictures the same way.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from .files import special_kind

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from torch import nn

#: larger images are refused (PIL warns above 89 Mpixel and refuses above 179 Mpixel)
MAX_IMAGE_PIXELS = 100_000_000


class PictureError(ValueError):
    """A picture that cannot be read or used (one line, naming the file and the problem)."""


def read_image(path: str, warn: Callable[[str], None] | None = None) -> Image.Image:
    """An image file as an 8-bit RGB picture, as it is meant to be seen: EXIF orientation applied, 16-bit and
    float pixels scaled by their range (not clipped), the first frame of an animation (said through `warn`)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    file = Path(path)
    if file.is_dir():
        raise PictureError(f"image {path} is a folder, not an image file")
    kind = special_kind(file)
    if kind is not None:
        raise PictureError(f"image {path} is {kind}, not an image file")
    if not file.is_file():
        raise PictureError(f"image {path} does not exist")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own, lower limit applies
            with Image.open(file) as image:
                if image.width * image.height > MAX_IMAGE_PIXELS:
                    raise PictureError(f"image {path} is too large: {image.width}x{image.height} pixels, the limit is {MAX_IMAGE_PIXELS:,}")
                frames = getattr(image, "n_frames", 1)
                if frames > 1 and warn is not None:
                    warn(f"{path} is animated: uses frame 1 of {frames}")
                return to_rgb(ImageOps.exif_transpose(image), path)
    except PictureError:
        raise
    except Image.DecompressionBombError:
        raise PictureError(f"image {path} is too large: more than {MAX_IMAGE_PIXELS:,} pixels") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise PictureError(f"{path} is not a readable image ({error})") from error


def to_rgb(image: Image.Image, what: str) -> Image.Image:
    """`image` as 8-bit RGB (`what` names it in errors). 16-bit pixels are scaled by 65535; 32-bit integers by 65535 when they fit 16 bits, else by
    their range; float pixels are kept within [0, 1] and scaled by their range otherwise."""
    from PIL import Image

    if image.mode not in ("I", "F") and not image.mode.startswith("I;16"):
        return image.convert("RGB")
    import numpy as np

    values = np.asarray(image, dtype=np.float64)
    if not np.isfinite(values).all():
        raise PictureError(f"image {what} has NaN or infinite pixels")
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


