"""`relevancy demo`: explain generated scenes with the shipped model, every method, every object present."""
from __future__ import annotations

import argparse
import html
import time
from pathlib import Path

import torch

from ..files import write_atomic

DEMO_SEED = 20_261_122  # far from the training seeds


def _explain_all(model, images: torch.Tensor, targets: torch.Tensor, methods: list[str]) -> dict:
    from .. import explain

    return {m: explain(model, images, method=m, target=targets) for m in methods}


def run_demo(out: str | Path = "demo", singles: int = 3, pairs: int = 3, methods: list[str] | None = None, seed: int = DEMO_SEED) -> Path:
    """Write `out/index.html` and one PNG grid per scene (scene, mask, one map per method per object class)."""
    from .. import METHODS
    from ..viz import method_grid, save_figure
    from . import CLASSES, load_model, make_scenes

    methods = list(methods or METHODS)
    model = load_model()
    out = Path(out)
    scenes = [make_scenes(singles, seed=seed, objects=1), make_scenes(pairs, seed=seed + 1, objects=2)]
    # one row per (scene, object): the image repeated, the object's class as target
    rows = []
    for group, kind in zip(scenes, ("single", "pair")):
        for i in range(len(group)):
            for j in range(group.objects):
                rows.append((kind, i, j, group))
    images = torch.stack([g.images[i] for _, i, _, g in rows])
    targets = torch.tensor([int(g.labels[i, j]) for _, i, j, g in rows])
    masks = torch.stack([g.masks[i, j] for _, i, j, g in rows])
    started = time.perf_counter()
    results = _explain_all(model, images, targets, methods)
    seconds = time.perf_counter() - started
    first = results[methods[0]]
    pictures = first.pixels(images)
    probabilities = first.logits.softmax(-1)

    entries = []
    out.mkdir(parents=True, exist_ok=True)
    for kind, i, _, group in rows:
        name = f"{kind}_{i}.png"
        if any(e[0] == name for e in entries):
            continue
        members = [r for r, row in enumerate(rows) if row[0] == kind and row[1] == i]
        titles = [f"{CLASSES[int(targets[r])]} (p={probabilities[r, targets[r]]:.2f})" for r in members]
        figure = method_grid(
            pictures[members],
            {m: results[m].heatmap()[members] for m in methods},
            {m: results[m].signed for m in methods},
            titles,
            extra={"object mask": masks[members]},
        )
        save_figure(figure, out / name)
        top = probabilities[members[0]].topk(2)
        predicted = ", ".join(f"{CLASSES[int(k)]} {float(p):.2f}" for p, k in zip(top.values, top.indices))
        present = " + ".join(CLASSES[int(targets[r])] for r in members)
        entries.append((name, f"{kind}-object scene {i}: {present}; model's top-2: {predicted}"))

    _write_index(out, entries, methods, seconds, len(rows))
    return out / "index.html"


def _write_index(out: Path, entries: list[tuple[str, str]], methods: list[str], seconds: float, rows: int) -> None:
    from ..methods import REGISTRY

    legend = "".join(f"<li><b>{m}</b>: {html.escape(REGISTRY[m].summary)}{' (signed: red +, blue -)' if REGISTRY[m].signed else ''}</li>" for m in methods)
    figures = "".join(f'<figure><img src="{html.escape(n)}"><figcaption>{html.escape(c)}</figcaption></figure>' for n, c in entries)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>relevancy demo</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1600px}} img{{max-width:100%}} figure{{margin:1.5em 0}}</style></head>
<body><h1>relevancy demo: what the shapes ViT looked at</h1>
<p>Each row explains one object class present in the scene (the target), with every method;
the second panel is that object's ground-truth mask. {rows} explanations per method, all methods in {seconds:.1f} s.</p>
<ul>{legend}</ul>{figures}</body></html>"""
    write_atomic(out / "index.html", page)


def add_demo_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("demo", help="explain generated scenes with the shipped model (offline) and write an HTML page")
    p.add_argument("--out", default="demo", help="output folder (default: demo)")
    p.add_argument("--singles", type=int, default=3, help="single-object scenes")
    p.add_argument("--pairs", type=int, default=3, help="two-object scenes")
    p.add_argument("--methods", default="all", help="'all' or a comma-separated list")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> list[Path]:
    from ..cli import resolve_methods

    methods = [m for name in args.methods.split(",") for m in resolve_methods(name.strip())]
    index = run_demo(args.out, args.singles, args.pairs, methods)
    print(f"open {index} (one PNG grid per scene beside it)")
    return []
