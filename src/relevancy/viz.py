"""Colormaps and overlays: signed maps diverge around zero, non-negative maps use a sequential scale."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from .files import write_atomic  # noqa: E402

SIGNED_CMAP = "RdBu_r"
UNSIGNED_CMAP = "inferno"


ROBUST_QUANTILE = 0.995  # LRP maps have a few extreme pixels; clip the colour scale there, not at the max


def color_limits(scores: torch.Tensor, signed: bool) -> tuple[float, float]:
    """Symmetric limits around zero for signed maps, the map's own (robust) range otherwise."""
    values = scores.flatten().float()
    if signed:
        bound = float(torch.quantile(values.abs(), ROBUST_QUANTILE)) or float(values.abs().max()) or 1.0
        return -bound, bound
    low, high = float(values.min()), float(torch.quantile(values, ROBUST_QUANTILE))
    return low, high if high > low else low + 1.0


def draw_map(axis: plt.Axes, scores: torch.Tensor, signed: bool, picture: torch.Tensor | None = None) -> None:
    """One map on `axis`, over a grey copy of the picture when given."""
    low, high = color_limits(scores, signed)
    if picture is not None:
        axis.imshow(picture.mean(-1).numpy(), cmap="gray", vmin=0, vmax=1)
    alpha = 0.6 if picture is not None else 1.0
    image = axis.imshow(scores.float().numpy(), cmap=SIGNED_CMAP if signed else UNSIGNED_CMAP, vmin=low, vmax=high, alpha=alpha)
    axis.figure.colorbar(image, ax=axis, fraction=0.046, pad=0.02)
    axis.set_axis_off()


def overlay_figure(maps: torch.Tensor, pictures: torch.Tensor | None, signed: bool, titles: Sequence[str]) -> plt.Figure:
    """A row of panels: each map upsampled to its picture, drawn over it."""
    count = len(maps)
    figure, axes = plt.subplots(1, count, figsize=(3.4 * count, 3.2), squeeze=False)
    for i, axis in enumerate(axes[0]):
        draw_map(axis, maps[i], signed, pictures[i] if pictures is not None else None)
        axis.set_title(titles[i], fontsize=9)
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
        axes[r, 0].set_title(row_titles[r], fontsize=8)
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
