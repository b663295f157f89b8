"""Cost of explaining every object of an image with DETR, in no-grad forward passes of the same images.

    python benchmarks/detr_speed.py [--batch 1 4] [--objects 1 5] [--size 800 1066] [--repeats 3] [--threads 2]
                                    [--methods generic_attention ...] [--whole-batch] [--device cpu|cuda] [--out FILE]

The model is DETR-R50-sized with random weights, built offline: `DetrForObjectDetection(DetrConfig(
use_pretrained_backbone=False))` (timm ResNet-50 backbone, d_model 256, 6 encoder and 6 decoder layers, 8 heads,
100 queries, 91 classes), float32, eval, attention as configured (sdpa). Inputs: random normal (normalised) images.
Random weights detect nothing, so the explained objects are given: queries 0..K-1 of every image, class 1.

relevancy runs the model once per image (the backbone without an autograd graph) and one backward through the
encoder-decoder per explained object (each object's score has its own gradients), so each further object adds
about a third of a forward; on a CPU it takes the images one at a time (see `DetrAdapter.independent_groups`).
The authors' code runs the whole model, forward and backward, once per object. `--whole-batch` makes a CPU take
the batch at once, as a GPU does (to measure what taking the images one at a time saves). Times are medians over `--repeats`, each interleaved with
a no-grad forward so that load from other work affects both sides of a ratio.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clip_speed import cpu_model, write_atomically  # noqa: E402

import relevancy  # noqa: E402

METHODS = ("generic_attention", "raw_attention", "rollout", "attention_gradcam")
TARGET = 3.0  # the issues' target: generic_attention costs at most 3 forwards (DETR: for all objects of an image)


def build(device: str) -> torch.nn.Module:
    from transformers import DetrConfig, DetrForObjectDetection

    torch.manual_seed(0)
    return DetrForObjectDetection(DetrConfig(use_pretrained_backbone=False)).to(device).float().eval()


def seconds(run) -> float:
    """Wall time of `run()`, the GPU's queued work included."""
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model, inputs: dict, target, methods: tuple[str, ...], repeats: int) -> dict[str, float]:
    """Median seconds of a no-grad forward of `inputs` and of each method explaining `target` on them."""
    def forward() -> None:
        with torch.no_grad():
            model(**inputs)

    runs = {"forward_no_grad": forward}
    runs.update({m: (lambda m=m: relevancy.explain(model, inputs, method=m, target=target)) for m in methods})
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            if name != "forward_no_grad":
                times["forward_no_grad"].append(seconds(forward))
            times[name].append(seconds(run))
    return {name: statistics.median(values) for name, values in times.items()}


def ratio_rows(forward_cells: str, method_cells: str, medians: dict[str, float], methods: tuple[str, ...]) -> list[str]:
    """Table rows: the plain forward, then each method's time as a multiple of it (generic_attention flagged over
    the 3-forward target); printed as they come."""
    base = medians["forward_no_grad"]
    rows = [f"| {forward_cells} | forward_no_grad | {base:.3f} | 1.00 |"]
    for method in methods:
        ratio = medians[method] / base
        flag = " (over target)" if method == "generic_attention" and ratio > TARGET else ""
        rows.append(f"| {method_cells} | {method} | {medians[method]:.3f} | {ratio:.2f}{flag} |")
    print("\n".join(rows), flush=True)
    return rows


def finish(lines: list[str], out: str | None) -> None:
    """Print the whole table and write it to `out` (atomically) if given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        write_atomically(out, text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--objects", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--size", type=int, nargs=2, default=[800, 1066], metavar=("H", "W"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--whole-batch", action="store_true", help="the images of a batch at once, also on a CPU")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.device)
    if args.whole_batch:
        from relevancy.families.detr.adapter import DetrAdapter

        DetrAdapter.independent_groups = lambda self, inputs: None
    device = torch.cuda.get_device_name() if args.device == "cuda" else cpu_model()
    lines = [
        f"# DETR-R50 (random init) at {args.size[0]}x{args.size[1]}, {device}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {platform.python_implementation()} {platform.python_version()}; "
        f"median of {args.repeats}; cost in no-grad forwards of the same images"
        f"{'; the images of a batch at once (--whole-batch)' if args.whole_batch else ''}",
        "| batch | objects / image | method | seconds | x forward |",
        "|---|---|---|---|---|",
    ]
    for batch in args.batch:
        images = torch.randn(batch, 3, *args.size, generator=torch.Generator().manual_seed(0)).to(args.device)
        for objects in args.objects:
            targets = [[(q, 1) for q in range(objects)] for _ in range(batch)]
            medians = measure(model, {"pixel_values": images}, targets, tuple(args.methods), args.repeats)
            lines += ratio_rows(f"{batch} | -", f"{batch} | {objects}", medians, tuple(args.methods))
    finish(lines, args.out)


if __name__ == "__main__":
    main()
