"""`relevancy demo`: explain generated scenes with the shipped model, every method, every object present.

The page is HTML text around one small PNG per panel (scene, object mask, one map per method), laid out by a
CSS grid: titles, colour scales and notes stay readable at any page width, unlike one wide matplotlib grid.
"""
from __future__ import annotations

import html
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...core.files import write_atomic

DEMO_SEED = 20_261_122  # far from the training seeds
IMAGES = "images"  # the panels' folder, beside index.html
PANEL_PIXELS = 256  # a 64-px scene is drawn 4x: large enough to see each patch, small enough for a 6-column grid

WHY_BLUE_QUESTION = "Why blue on the explained object?"
WHY_BLUE = (
    "token_ablation and cdam judge one patch at a time, with all other patches "
    "present. An object covers several patches that carry the same evidence: with one of them removed the model "
    "still sees the shape in the others, and its attention (a softmax over fewer tokens) gives them more weight, "
    "so the score can rise: that patch comes out blue. CDAM is a first-order (gradient x input) estimate of the "
    "same effect at the last attention, so it can be blue there too, and also where a patch's features speak for a "
    "competing class (in two-object scenes, the other object's). lrp is signed as well: its vanilla rules do not "
    "conserve relevance, its pixel maps mix both signs, and a few extreme patches can dominate its colour scale."
)


@dataclass(frozen=True)
class Panel:
    """One picture of the page: its file (relative to index.html), its caption, and what is under it."""

    image: str
    title: str
    detail: str = ""
    scale: tuple[float, float, bool] | None = None  # (low, high, signed): the map's colour limits
    note: str = ""


@dataclass(frozen=True)
class Row:
    """One explained object of a scene: the target and its panels."""

    heading: str
    panels: list[Panel]


@dataclass(frozen=True)
class Scene:
    """One scene: what it shows and what the model predicts, then one row per object explained."""

    heading: str
    rows: list[Row]


def _explain_all(model, images: torch.Tensor, targets: torch.Tensor, methods: list[str]) -> dict:
    from ... import explain

    return {m: explain(model, images, method=m, target=targets) for m in methods}


def run_demo(out: str | Path = "demo", singles: int = 3, pairs: int = 3, methods: list[str] | None = None, seed: int = DEMO_SEED) -> Path:
    """Write `out/index.html` and its panels in `out/images/` (scene, mask, one map per method per object class)."""
    from ...families import adapter_for
    from ...results.viz import ALL_ZERO_NOTE, color_limits, is_all_zero, overlay_pixels, save_png
    from ...worlds import CLASSES, load_model, make_scenes

    model = load_model()
    methods = list(methods or adapter_for(model).methods)
    out = Path(out)
    scenes = [make_scenes(singles, seed=seed, objects=1), make_scenes(pairs, seed=seed + 1, objects=2)]
    # one explained row per (scene, object): the image repeated, the object's class as target
    rows = [(kind, i, j, group) for group, kind in zip(scenes, ("single", "pair")) for i in range(len(group)) for j in range(group.objects)]
    images = torch.stack([g.images[i] for _, i, _, g in rows])
    targets = torch.tensor([int(g.labels[i, j]) for _, i, j, g in rows])
    masks = torch.stack([g.masks[i, j] for _, i, j, g in rows])
    started = time.perf_counter()
    results = _explain_all(model, images, targets, methods)
    seconds = time.perf_counter() - started
    first = results[methods[0]]
    pictures = first.pixels(images)
    probabilities = first.logits.softmax(-1)
    maps = {m: results[m].heatmap().cpu() for m in methods}
    scale = max(1, PANEL_PIXELS // pictures.shape[1])

    (out / IMAGES).mkdir(parents=True, exist_ok=True)

    def save(pixels, name: str, enlarge: bool = True) -> str:
        """Write a panel (each pixel a `scale` square unless already enlarged); its path relative to the page."""
        save_png(pixels.repeat(scale, 0).repeat(scale, 1) if enlarge else pixels, out / IMAGES / name)
        return f"{IMAGES}/{name}"

    sections: list[Scene] = []
    for r, (kind, i, j, group) in enumerate(rows):
        stem = f"{kind}_{i}"
        if j == 0:
            top = probabilities[r].topk(2)
            predicted = ", ".join(f"{CLASSES[int(k)]} {float(p):.2f}" for p, k in zip(top.values, top.indices))
            present = " + ".join(CLASSES[int(k)] for k in group.labels[i])
            sections.append(Scene(f"{'Single' if kind == 'single' else 'Two'}-object scene {i}: {present}. "
                                  f"The model's top 2: {predicted}", []))
            scene_image = save((pictures[r].numpy() * 255).round().astype("uint8"), f"{stem}.png")
        name = CLASSES[int(targets[r])]
        panels = [
            Panel(scene_image, "scene"),
            Panel(save(masks[r].numpy().astype("uint8") * 255, f"{stem}_mask{j}.png"), "object mask", f"the {name}'s pixels"),
        ]
        for method in methods:
            scores, signed = maps[method][r], results[method].signed
            image = save(overlay_pixels(scores, signed, pictures[r], scale), f"{stem}_target{j}_{method}.png", enlarge=False)
            if is_all_zero(scores):
                panels.append(Panel(image, method, note=ALL_ZERO_NOTE))
            else:
                panels.append(Panel(image, method, scale=(*color_limits(scores, signed), signed)))
        sections[-1].rows.append(Row(f"Explaining {name} (p = {float(probabilities[r, targets[r]]):.2f})", panels))

    _write_index(out, sections, methods, seconds, len(rows))
    return out / "index.html"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; padding: 0 1em; max-width: 1500px; color: #222; line-height: 1.4; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; } h3 { font-size: 1.05em; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(190px, 1fr)); gap: 14px 12px; }
figure { margin: 0; }
figure img { display: block; width: 100%; max-width: 256px; image-rendering: pixelated; border: 1px solid #ddd; }
figcaption { font-size: 0.95em; margin-top: 4px; max-width: 256px; }
figcaption .detail { color: #555; font-size: 0.9em; }
.bar { height: 10px; max-width: 256px; border: 1px solid #bbb; margin-top: 3px; }
.ticks { display: flex; justify-content: space-between; max-width: 258px; font-size: 0.85em; color: #444; }
.note { background: #fff4d6; border-left: 3px solid #e0a800; padding: 2px 6px; font-size: 0.9em; }
.legend { background: #f4f4f4; padding: 0.6em 1em; }
.red { color: #b2182b; font-weight: bold; } .blue { color: #2166ac; font-weight: bold; }
"""


def _figure(panel: Panel) -> str:
    from ...results.viz import css_gradient

    parts = [f'<img src="{html.escape(panel.image)}" alt="{html.escape(panel.title)}">', f"<figcaption><b>{html.escape(panel.title)}</b>"]
    if panel.detail:
        parts.append(f' <span class="detail">{html.escape(panel.detail)}</span>')
    if panel.scale is not None:
        low, high, signed = panel.scale
        ticks = (low, 0.0, high) if signed else (low, high)
        parts.append(f'<div class="bar" style="background: {css_gradient(signed)}"></div>'
                     f'<div class="ticks">{"".join(f"<span>{t:.3g}</span>" for t in ticks)}</div>')
    if panel.note:
        parts.append(f'<div class="note">{html.escape(panel.note)}</div>')
    parts.append("</figcaption>")
    return f"<figure>{''.join(parts)}</figure>"


def _write_index(out: Path, scenes: list[Scene], methods: list[str], seconds: float, rows: int) -> None:
    from ...methods import REGISTRY

    listed = "".join(
        f"<li><b>{m}</b>{' (signed)' if REGISTRY[m].signed else ''}: {html.escape(REGISTRY[m].summary)}</li>" for m in methods
    )
    signed = [m for m in methods if REGISTRY[m].signed]
    signed_line = (
        f'Signed maps ({", ".join(signed)}): <span class="red">red</span>: evidence for the class; '
        f'<span class="blue">blue</span>: evidence against (colour scale symmetric around 0).<br>' if signed else ""
    )
    legend = (f'<p class="legend">{signed_line}Unsigned maps: dark (low) to bright yellow (high), over the map\'s own '
              "range. The bar under each map gives its colour limits (clipped at the 99.5th percentile).</p>")
    body = "".join(
        f"<section><h2>{html.escape(scene.heading)}</h2>"
        + "".join(f'<h3>{html.escape(row.heading)}</h3><div class="grid">{"".join(_figure(p) for p in row.panels)}</div>' for row in scene.rows)
        + "</section>"
        for scene in scenes
    )
    why = f"<p><b>{WHY_BLUE_QUESTION}</b> {html.escape(WHY_BLUE)}</p>" if {"token_ablation", "cdam"} & set(signed) else ""
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>relevancy demo</title>
<style>{STYLE}</style></head>
<body><h1>relevancy demo: what the shapes ViT looked at</h1>
<p>Generated scenes, explained by the shipped shapes ViT. Each row explains one object class present in the
scene (the target): the scene, that object's ground-truth mask, then one map per method drawn over a grey copy
of the scene. {rows} explanations per method; all methods together took {seconds:.1f} s.</p>
{legend}{why}<ul>{listed}</ul>{body}</body></html>"""
    write_atomic(out / "index.html", page)
