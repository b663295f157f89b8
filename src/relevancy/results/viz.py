"""Colormaps and overlays: signed maps diverge around zero, non-negative maps use a sequential scale."""
from __future__ import annotations

import base64
import io
import textwrap
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from ..core.files import write_atomic  # noqa: E402


def data_url(pixels: np.ndarray) -> str:
    """An `(H, W, 3)` uint8 picture as a PNG data URL."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def picture_url(picture: torch.Tensor) -> str:
    """The input as the model saw it (`(H, W, 3)` in [0, 1]) as a PNG data URL."""
    return data_url((picture.float().numpy() * 255).round().astype(np.uint8))


SIGNED_CMAP = "RdBu_r"
UNSIGNED_CMAP = "inferno"


ROBUST_QUANTILE = 0.995  # LRP maps have a few extreme pixels; clip the colour scale there, not at the max
MAP_OPACITY = 0.6  # a map drawn over a picture: 60 % map colour, 40 % grey picture
ALL_ZERO_NOTE = "all zero: this method gives no relevance here"
#: characters per title line of a panel (3.4 inches wide, 9 pt); longer titles wrap instead of running into the next
TITLE_CHARACTERS = 40


def set_title(axis: plt.Axes, title: str, fontsize: float = 9, characters: int = TITLE_CHARACTERS) -> None:
    """A panel's title, wrapped to lines of at most `characters` so that neighbouring titles never overlap."""
    axis.set_title(textwrap.fill(title, characters, break_long_words=True, break_on_hyphens=False), fontsize=fontsize)


def is_all_zero(scores: torch.Tensor) -> bool:
    """A map without any relevance: shown as a note, not as a blank panel with a made-up colour scale."""
    return not bool(scores.any())


def colormap_name(signed: bool) -> str:
    """Diverging around zero for signed maps, sequential otherwise."""
    return SIGNED_CMAP if signed else UNSIGNED_CMAP


def color_limits(scores: torch.Tensor, signed: bool) -> tuple[float, float]:
    """Symmetric limits around zero for signed maps, the map's own (robust) range otherwise."""
    values = scores.flatten().float()
    if signed:
        bound = float(torch.quantile(values.abs(), ROBUST_QUANTILE)) or float(values.abs().max()) or 1.0
        return -bound, bound
    low, high = float(values.min()), float(torch.quantile(values, ROBUST_QUANTILE))
    return low, high if high > low else low + 1.0


def draw_map(axis: plt.Axes, scores: torch.Tensor, signed: bool, picture: torch.Tensor | None = None) -> None:
    """One map on `axis`, over a grey copy of the picture when given; an all-zero map gets a note instead."""
    axis.set_axis_off()
    if picture is not None:
        axis.imshow(picture.mean(-1).numpy(), cmap="gray", vmin=0, vmax=1)
    if is_all_zero(scores):
        axis.text(0.5, 0.5, ALL_ZERO_NOTE.replace(": ", ":\n"), transform=axis.transAxes, ha="center", va="center",
                  fontsize=7, bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"})
        return
    low, high = color_limits(scores, signed)
    alpha = MAP_OPACITY if picture is not None else 1.0
    image = axis.imshow(scores.float().numpy(), cmap=colormap_name(signed), vmin=low, vmax=high, alpha=alpha)
    axis.figure.colorbar(image, ax=axis, fraction=0.046, pad=0.02)


#: panels per row of an overlay figure
OVERLAY_COLUMNS = 6


def overlay_figure(
    maps: torch.Tensor, pictures: torch.Tensor | None, signed: bool, titles: Sequence[str],
    boxes: Sequence[Sequence[float]] | None = None,
) -> plt.Figure:
    """Panels in rows of at most `OVERLAY_COLUMNS` (a bounded width): each map upsampled to its picture, drawn over
    it; `boxes`: a rectangle (x0, y0, x1, y1) in pixels per panel (a detected object)."""
    count = len(maps)
    columns = min(count, OVERLAY_COLUMNS)
    rows = -(-count // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 3.2 * rows), squeeze=False)
    for axis in axes.flat[count:]:
        axis.set_axis_off()
    for i, axis in enumerate(axes.flat[:count]):
        draw_map(axis, maps[i], signed, pictures[i] if pictures is not None else None)
        set_title(axis, titles[i])
        if boxes is not None:
            x0, y0, x1, y1 = (float(v) for v in boxes[i])
            axis.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor="lime", linewidth=1.5))
    figure.tight_layout()
    return figure


def save_figure(figure: plt.Figure, path: str | Path) -> Path:
    """Save as PNG; a failure leaves no partial file."""
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=110)
    finally:
        plt.close(figure)
    return write_atomic(path, buffer.getvalue())


def method_grid(
    pictures: torch.Tensor, maps: dict[str, torch.Tensor], signed: dict[str, bool], row_titles: Sequence[str], extra: dict[str, torch.Tensor] | None = None
) -> plt.Figure:
    """One row per image: the picture, any extra panels (e.g. a ground-truth mask), then one map per method."""
    extra = extra or {}
    columns = 1 + len(extra) + len(maps)
    rows = len(pictures)
    figure, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.5 * rows), squeeze=False)
    for r in range(rows):
        axes[r, 0].imshow(pictures[r].numpy())
        set_title(axes[r, 0], row_titles[r], fontsize=8, characters=32)
        axes[r, 0].set_axis_off()
        for c, (name, panel) in enumerate(extra.items(), start=1):
            axes[r, c].imshow(panel[r].float().numpy(), cmap="gray", vmin=0, vmax=1)
            axes[r, c].set_title(name, fontsize=8)
            axes[r, c].set_axis_off()
        for c, (name, scores) in enumerate(maps.items(), start=1 + len(extra)):
            draw_map(axes[r, c], scores[r].cpu(), signed[name], pictures[r])
            axes[r, c].set_title(name, fontsize=8)
    figure.tight_layout()
    return figure


def overlay_pixels(scores: torch.Tensor, signed: bool, picture: torch.Tensor, scale: int = 1) -> np.ndarray:
    """`(H * scale, W * scale, 3)` uint8: the map's colours over a grey copy of the picture `(H, W, 3)` in [0, 1],
    as `draw_map` draws them; an all-zero map gives the grey picture alone. Each pixel becomes a `scale` square."""
    grey = picture.float().mean(-1, keepdim=True).expand(*picture.shape[:2], 3).numpy()
    if is_all_zero(scores):
        blended = grey
    else:
        low, high = color_limits(scores, signed)
        normalised = ((scores.float().cpu().numpy() - low) / (high - low)).clip(0, 1)
        colours = matplotlib.colormaps[colormap_name(signed)](normalised)[..., :3]
        blended = MAP_OPACITY * colours + (1 - MAP_OPACITY) * grey
    pixels = (blended * 255).round().astype(np.uint8)
    return pixels.repeat(scale, axis=0).repeat(scale, axis=1)


def css_gradient(signed: bool, stops: int = 11) -> str:
    """The map colours (as drawn over a mid-grey picture) as a CSS `linear-gradient`, low to high: an HTML colour
    bar whose labels stay readable at any page width."""
    colours = matplotlib.colormaps[colormap_name(signed)](np.linspace(0, 1, stops))[:, :3]
    colours = MAP_OPACITY * colours + (1 - MAP_OPACITY) * 0.5
    return "linear-gradient(to right, " + ", ".join(
        "#" + "".join(f"{round(float(c) * 255):02x}" for c in colour) for colour in colours
    ) + ")"


def save_png(pixels: np.ndarray, path: str | Path) -> Path:
    """Save a uint8 `(H, W, 3)` or `(H, W)` array as PNG; a failure leaves no partial file."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return write_atomic(path, buffer.getvalue())


def region_figure(
    scores: torch.Tensor, boxes: torch.Tensor | None, pictures: Sequence | None, signed: bool, titles: Sequence[str],
) -> plt.Figure:
    """A row of panels, one per input: each region's box (x0, y0, x1, y1, normalised to 0..1) over its picture,
    filled with its score's colour (the strongest opaque); without boxes, a bar per region."""
    count = len(scores)
    figure, axes = plt.subplots(1, count, figsize=(3.6 * count, 3.3), squeeze=False)
    cmap = plt.get_cmap(colormap_name(signed))
    for i, axis in enumerate(axes[0]):
        row = scores[i].float()
        low, high = color_limits(row, signed)
        span = high - low if high > low else 1.0
        set_title(axis, titles[i])
        if boxes is None:
            axis.bar(range(len(row)), row.numpy(), color=[cmap((float(v) - low) / span) for v in row])
            axis.set_xlabel("region")
            continue
        height, width = (1, 1)
        if pictures is not None:
            picture = pictures[i]
            axis.imshow(picture)
            height, width = picture.shape[:2]
        else:
            axis.set_xlim(0, 1)
            axis.set_ylim(1, 0)
        axis.set_axis_off()
        strength = (row - low).abs() / span
        for k in strength.argsort().tolist():  # the strongest drawn last, on top
            x0, y0, x1, y1 = (float(v) for v in boxes[i, k])
            colour = cmap((float(row[k]) - low) / span)
            axis.add_patch(plt.Rectangle((x0 * width, y0 * height), (x1 - x0) * width, (y1 - y0) * height,
                                         facecolor=colour, alpha=0.15 + 0.6 * float(strength[k]), edgecolor=colour))
        mappable = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(low, high))
        figure.colorbar(mappable, ax=axis, fraction=0.046, pad=0.02)
    figure.tight_layout()
    return figure
