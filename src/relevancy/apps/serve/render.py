"""How the page draws a result beside its `to_json()`: overlay and map PNGs (data URLs) and a colour bar (colormap
stops and limits). The numbers themselves are the result's `to_json()`, never restated here."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...results import viz
from ...results.viz import data_url

COLOUR_STOPS = 11  # colours sampled along the colormap for the page's colour bar (a CSS gradient)


def colour_bar(signed: bool, low: float, high: float) -> dict[str, Any]:
    """What the page needs to draw a colour bar: the colormap's colours from `low` to `high`, and a legend."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    palette = colormaps[viz.colormap_name(signed)]
    stops = [to_hex(palette(k / (COLOUR_STOPS - 1))) for k in range(COLOUR_STOPS)]
    legend = "red: evidence for, blue: against, white: 0" if signed else "brighter: more relevant"
    return {"colormap": viz.colormap_name(signed), "low": low, "high": high, "stops": stops, "legend": legend}


def image_view(heatmap: torch.Tensor, signed: bool, picture: torch.Tensor) -> dict[str, Any]:
    """How the page draws one map of one image: `heatmap` the map upsampled to the picture `(H, W)`, `picture`
    `(H, W, 3)` in [0, 1]."""
    from matplotlib import colormaps

    heatmap = heatmap.detach().float().cpu()
    empty = viz.is_all_zero(heatmap)
    low, high = viz.color_limits(heatmap, signed)
    colours = colormaps[viz.colormap_name(signed)](((heatmap.numpy() - low) / (high - low)).clip(0, 1))[..., :3]
    return {
        "overlay": data_url(viz.overlay_pixels(heatmap, signed, picture)),
        "map_png": data_url((colours * 255).round().astype(np.uint8)),
        "colour_bar": None if empty else colour_bar(signed, low, high),
        "note": viz.ALL_ZERO_NOTE if empty else None,
    }
