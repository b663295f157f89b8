"""Sample pictures a visitor can pick instead of uploading: shapes scenes and scikit-image's photographs.

They are made once when the server starts and kept in memory as PNG files; a request names one by its id, which
is looked up in that table (never used as a path).
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

#: scikit-image's bundled photographs offered as samples (read from the package, no download)
PHOTOS = ("chelsea", "astronaut", "coffee", "rocket")


@dataclass(frozen=True)
class Sample:
    title: str
    png: bytes


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def make_samples(scenes: int = 3, pairs: int = 3) -> dict[str, Sample]:
    """`scenes` one-object and `pairs` two-object shapes scenes (fixed seeds), then the photographs when
    scikit-image is installed."""
    from ...worlds import CLASSES, make_scenes

    samples: dict[str, Sample] = {}
    for objects, count, seed in ((1, scenes, 7), (2, pairs, 11)):
        made = make_scenes(count, seed=seed, objects=objects)
        for i in range(count):
            shapes = " and ".join(CLASSES[k] for k in made.labels[i].tolist())
            samples[f"scene-{len(samples) + 1}"] = Sample(f"scene {len(samples) + 1}: {shapes}", _png(made.pixels[i]))
    try:
        from skimage import data
    except ImportError:
        return samples
    for name in PHOTOS:
        pixels = getattr(data, name)()
        samples[f"photo-{name}"] = Sample(f"photo: {name}", _png(pixels[..., :3] if pixels.ndim == 3 else pixels))
    return samples
