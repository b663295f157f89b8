"""How much float32 rounding moves the LRP-based maps, on the two shipped models (offline).

For each LRP-based method and each arithmetic (`exact=True`: the authors' stabiliser placements; the default:
relevancy's stable rules), over N inputs per model:
- float32 vs float64: the map of the float32 model against the map of the same model in float64;
- batched vs single: float32 maps of the whole set run in batches (padded, for text) against one input at a time;
- default vs exact, both float64: how far the stable default is from the authors' arithmetic.
Each error is `max |a - b| / max |b|` per input; the table gives the median and the largest.

    python benchmarks/lrp_conditioning.py [--n 100] [--batch 20] [--out benchmarks/results/lrp_conditioning.md]
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
from pathlib import Path
from typing import Callable

import torch

import relevancy
from relevancy.worlds import load_model as load_shapes_model, make_scenes
from relevancy.zoo.text import encode, load_model as load_text_model
from relevancy.evaluation.text_rationales import make_rationale_set

METHODS = ("transformer_attribution", "partial_lrp", "lrp")
SHORT_TEXTS = ("Great.", "Awful.", "It worked.", "Terrible side effects.", "Works well, no problems.")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def relative_errors(maps: torch.Tensor, references: torch.Tensor) -> list[float]:
    """Per input: largest absolute difference over the reference map's largest magnitude."""
    flat, ref = maps.flatten(1).double(), references.flatten(1).double()
    scale = ref.abs().amax(1).clamp(min=1e-300)
    return ((flat - ref).abs().amax(1) / scale).tolist()


def image_inputs(n: int) -> tuple[torch.nn.Module, list[torch.Tensor], Callable]:
    model = load_shapes_model()
    single = make_scenes(n // 2, seed=12345, objects=1).images
    pairs = make_scenes(n - n // 2, seed=54321, objects=2).images
    images = torch.cat([single, pairs])

    def batches(size: int) -> list[torch.Tensor]:
        return list(images.split(size))

    return model, [images[i:i + 1] for i in range(n)], batches


def text_inputs(n: int) -> tuple[torch.nn.Module, list[dict], Callable]:
    model, tokenizer = load_text_model()
    texts = list(SHORT_TEXTS) + make_rationale_set(max(n - len(SHORT_TEXTS), 1), seed=7).texts()
    texts = texts[:n]

    def batches(size: int) -> list[dict]:
        # mix short and long texts in every batch: padding is where batched and single runs can differ
        order = [i for k in range(size) for i in range(k, n, size)]
        chunks = [order[i:i + size] for i in range(0, n, size)]
        return [dict(encode(tokenizer, [texts[i] for i in chunk])) for chunk in chunks], order

    return model, [dict(encode(tokenizer, [t])) for t in texts], batches


def run(model: torch.nn.Module, inputs, method: str, exact: bool) -> torch.Tensor:
    options = {"exact": True} if exact else {}  # no option at all for the default: older versions run this too
    return relevancy.explain(model, inputs, method=method, **options).scores


def maps_of(model: torch.nn.Module, inputs: list, method: str, exact: bool) -> list[torch.Tensor]:
    return [run(model, x, method, exact)[0] for x in inputs]


def as_double(inputs: list) -> list:
    return [x.double() if isinstance(x, torch.Tensor) else x for x in inputs]


def summarise(errors: list[float]) -> str:
    return f"{statistics.median(errors):.1e} / {max(errors):.1e}"


def measure(name: str, model: torch.nn.Module, singles: list, batches: Callable, batch_size: int, arithmetics: list[bool]) -> list[str]:
    model64 = copy.deepcopy(model).double()
    rows = []
    for method in METHODS:
        results = {}
        for exact in arithmetics:
            maps32 = maps_of(model, singles, method, exact)
            maps64 = maps_of(model64, as_double(singles), method, exact)
            results[exact] = maps64
            f32 = [relative_errors(a[None], b[None])[0] for a, b in zip(maps32, maps64)]
            batched = []
            chunks = batches(batch_size)
            if isinstance(chunks, tuple):  # text: padded batches in a mixed order
                chunks, order = chunks
                position = iter(order)
                for chunk in chunks:
                    for row in run(model, chunk, method, exact):
                        i = next(position)
                        length = maps32[i].shape[-1]
                        batched.append(relative_errors(row[None, :length], maps32[i][None])[0])
            else:
                start = 0
                for chunk in chunks:
                    batched += relative_errors(run(model, chunk, method, exact), torch.stack(maps32[start:start + len(chunk)]))
                    start += len(chunk)
            arithmetic = "exact (authors')" if exact else "default (stable)"
            rows.append(f"| {name} | `{method}` | {arithmetic} | {summarise(f32)} | {summarise(batched)} |")
            print(rows[-1], flush=True)
        if len(results) == 2:
            drift = [relative_errors(a[None], b[None])[0] for a, b in zip(results[False], results[True])]
            rows.append(f"| {name} | `{method}` | default vs exact, float64 | {summarise(drift)} | |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100, help="inputs per model")
    parser.add_argument("--batch", type=int, default=20, help="batch size of the batched runs")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    parser.add_argument("--default-only", action="store_true", help="measure the default arithmetic only (versions without `exact`)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = [
        f"# LRP conditioning: {args.n} inputs per model, batches of {args.batch}, {cpu_name()}, torch {torch.__version__}",
        "",
        "| model | method | arithmetic | float32 vs float64 (median / max) | batched vs single, float32 (median / max) |",
        "| --- | --- | --- | --- | --- |",
    ]
    print("\n".join(header), flush=True)
    rows = []
    for name, build in (("shapes ViT", image_inputs), ("sentiment MiniLM", text_inputs)):
        model, singles, batches = build(args.n)
        rows += measure(name, model, singles, batches, args.batch, [False] if args.default_only else [True, False])
    if args.out:
        args.out.write_text("\n".join(header + rows) + "\n")


if __name__ == "__main__":
    main()
