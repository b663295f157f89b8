"""Cost of each method in forward passes (method time / plain forward time, same batch, one process) and peak memory.

    python benchmarks/speed.py [--batches 1 8] [--repeats 3] [--model vit_base_patch16_224] [--memory] [--exact] [--checkpoint]

Times are medians over `repeats`, methods interleaved with the plain forward so that machine load affects both.
Peak memory (`--memory`) runs each measurement in a fresh subprocess (after one warm-up run, with the free heap
handed back to the system) and reports the peak growth of resident memory during the run, as a ratio to a
plain forward + backward (input and parameter gradients) measured the same way. `--exact` also times each LRP
method with `exact=True` (the authors' arithmetic), `--checkpoint` each method that takes it with `checkpoint=True`,
interleaved with the rest.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import statistics
import subprocess
import sys
import threading
import time

import timm
import torch

import relevancy
from relevancy.families.base import SEED_METHODS

PATCH_METHODS = [m for m in SEED_METHODS if m != "token_ablation"]
LRP_METHODS = ("transformer_attribution", "partial_lrp", "lrp")


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False).eval()


def plain_forward(model, images):
    with torch.no_grad():
        model(images)


def forward_backward(model, images):
    images = images.clone().requires_grad_(True)
    model(images).max(-1).values.sum().backward()


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


CHECKPOINT_METHODS = ("transformer_attribution", "lrp", "generic_attention")


def time_methods(model, batch: int, repeats: int, methods: list[str], exact: bool = False, checkpoint: bool = False) -> dict:
    images = torch.randn(batch, 3, 224, 224)
    tokens = model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 0)  # Swin: no prefix tokens
    runs = {m: (lambda m=m: relevancy.explain(model, images, method=m)) for m in methods}
    if exact:
        runs.update({f"{m}, exact=True": (lambda m=m: relevancy.explain(model, images, method=m, exact=True)) for m in methods if m in LRP_METHODS})
    if checkpoint:
        runs.update({f"{m}, checkpoint=True": (lambda m=m: relevancy.explain(model, images, method=m, checkpoint=True))
                     for m in methods if m in CHECKPOINT_METHODS})
    if "token_ablation" in methods:
        # the reference point for ablation: its N+1 sequences as plain batched forwards
        runs["n_plus_1_forwards"] = lambda: [plain_forward(model, images.expand(tokens, -1, -1, -1)[: tokens]) for _ in range(batch)]
    plain_forward(model, images)  # warm-up
    for fn in runs.values():
        fn()
    forward, timings = [], {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            forward.append(seconds(lambda: plain_forward(model, images)))
            timings[name].append(seconds(fn))
    base = statistics.median(forward)
    result = {"forward_seconds": base}
    for name, values in timings.items():
        result[name] = statistics.median(values) / base
    if "token_ablation" in result:
        result["token_ablation_vs_n_plus_1_forwards"] = result["token_ablation"] / result.pop("n_plus_1_forwards")
    return result


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_memory_child(name: str, batch: int, what: str) -> None:
    """Peak resident memory during one run above the memory before it (free heap handed back first)."""
    model = build(name)
    images = torch.randn(batch, 3, 224, 224)
    run = (lambda: forward_backward(model, images)) if what == "forward_backward" else (lambda: relevancy.explain(model, images, method=what))
    run()  # warm-up: one-time allocations are not the method's cost
    model.zero_grad(set_to_none=True)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline, peak, done = resident_bytes(), [0], threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.0005)

    watcher = threading.Thread(target=poll)
    watcher.start()
    run()
    done.set()
    watcher.join()
    print(json.dumps({"peak_kib": (max(peak[0], resident_bytes()) - baseline) // 1024}))


def peak_memory(name: str, batch: int, what: str) -> int:
    out = subprocess.run([sys.executable, __file__, "--child", name, str(batch), what], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_base_patch16_224")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(PATCH_METHODS))
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--exact", action="store_true", help="also time the LRP methods with exact=True")
    parser.add_argument("--checkpoint", action="store_true", help="also time the methods that take checkpoint=True with it")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, batch, what = args.child
        peak_memory_child(name, int(batch), what)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    model = build(args.model)
    print(f"# {args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for batch in args.batches:
        result = time_methods(model, batch, args.repeats, methods, args.exact, args.checkpoint)
        print(f"batch {batch}: plain forward {result.pop('forward_seconds'):.3f} s")
        for name, ratio in result.items():
            print(f"  {name:40s} {ratio:6.2f} x forward")
        if args.memory:
            reference = peak_memory(args.model, batch, "forward_backward")
            print(f"  peak memory, plain forward + backward: {reference / 1024:.0f} MiB")
            for method in methods:
                used = peak_memory(args.model, batch, method)
                print(f"  peak memory {method:28s} {used / 1024:7.0f} MiB = {used / reference:.2f} x forward+backward")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
