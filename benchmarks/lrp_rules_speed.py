"""The LRP rules of an older checkout against the current ones, swapped in one process and interleaved with the
plain forward, so that machine load falls on both alike: ViT-B/16 (random weights), one thread, each method with
the default arithmetic and with `exact=True`.

    git show COMMIT:src/relevancy/lrp/rules.py > /tmp/old_rules.py
    OMP_NUM_THREADS=1 python benchmarks/lrp_rules_speed.py /tmp/old_rules.py --batch 1 --runs 5

The older rules module must have the signatures of 0.1.x (`linear_alpha1_beta0(x, weight, relevance, shared)`,
`matmul_halved`, `add`, `conv_zb`). Each figure: the median over runs of the method's time over the median plain
forward (no gradients) of the same batch.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from types import ModuleType
from typing import Callable

import timm
import torch

import relevancy
from relevancy.lrp import rules

SWAPPED = ("linear_alpha1_beta0", "matmul_halved", "add", "conv_zb", "matmul")


def load_rules(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def older_table(old: ModuleType) -> dict[str, Callable]:
    """The older module's rules under the current names (the current Linear rule's extra arguments dropped)."""
    return {
        "linear_alpha1_beta0": lambda x, w, r, shared, _output=None, _bias=None: old.linear_alpha1_beta0(x, w, r, shared),
        "matmul_halved": old.matmul_halved,
        "add": old.add,
        "conv_zb": old.conv_zb,
        "matmul": torch.matmul,
    }


def use(table: dict[str, Callable]) -> None:
    for name, fn in table.items():
        setattr(rules, name, fn)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old_rules", help="path of an older lrp/rules.py")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--methods", default="transformer_attribution,lrp,partial_lrp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    current = {name: getattr(rules, name) for name in SWAPPED}
    tables = {"old": older_table(load_rules(args.old_rules)), "new": current}
    model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    images = torch.randn(args.batch, 3, 224, 224)

    def forward() -> None:
        with torch.no_grad():
            model(images)

    runs = [
        (f"{method}{', exact=True' if exact else ''}, {version} rules", version, method, exact)
        for method in args.methods.split(",") for exact in (False, True) for version in tables
    ]
    try:
        forward()
        for _, version, method, exact in runs:  # warm-up
            use(tables[version])
            relevancy.explain(model, images, method=method, exact=exact)
        forwards, times = [], {key: [] for key, *_ in runs}
        for _ in range(args.runs):
            for key, version, method, exact in runs:
                use(tables[version])
                forwards.append(seconds(forward))
                times[key].append(seconds(lambda: relevancy.explain(model, images, method=method, exact=exact)))
    finally:
        use(current)
    base = statistics.median(forwards)
    print(f"# ViT-B/16, batch {args.batch}, one thread, torch {torch.__version__}; {args.runs} runs each; plain forward "
          f"median {base:.3f} s (fastest {min(forwards):.3f} s)")
    for key, values in times.items():
        print(f"{key:48s} {statistics.median(values) / base:6.2f} x forward")


if __name__ == "__main__":
    main()
