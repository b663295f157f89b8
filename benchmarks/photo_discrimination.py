"""Class discrimination on real photographs: two scikit-image photographs side by side, each explained for its
concept, with the DINOv2-S/14 of the `photos` extra (relevancy.apps.demos.photos.discrimination).

    python benchmarks/photo_discrimination.py [--count 60] [--size 112] [--threads 1] [--out benchmarks/results/photo_discrimination]

Writes OUT.json (every number) and OUT.md (the table in the README) and prints progress.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from relevancy.apps.demos.photos import DISCRIMINATION_METHODS, PHOTOS, discrimination
from relevancy.zoo.photos import dinov2_small
from dinov2_speed import cpu_name


def table(result: dict) -> str:
    concepts = list(PHOTOS)
    head = ["method", "own share ↑", "peak on own half ↑", *[f"{c}" for c in concepts], "s / map"]
    rows = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for label, r in result["methods"].items():
        method, _, variant = label.partition(" ")
        cells = [f"`{method}` {variant}".strip(),
                 f"{r['own_share']:.1f}", f"{r['pointing']:.1f}", *[f"{r['per_concept'][c]:.1f}" for c in concepts],
                 f"{r['seconds'] / r['maps']:.2f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=60, help="composites (default 60: each ordered pair of the 5 concepts 3 times)")
    parser.add_argument("--size", type=int, default=112, help="pixels per half (a multiple of 14; default 112)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default=",".join(DISCRIMINATION_METHODS), help="comma-separated labels")
    parser.add_argument("--out", default="benchmarks/results/photo_discrimination")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = discrimination(dinov2_small("hf"), args.count, args.size, methods=tuple(args.methods.split(",")),
                            log=lambda message: print(message, flush=True))
    result.update(cpu=cpu_name(), threads=args.threads, torch=torch.__version__,
                  minutes=(time.perf_counter() - started) / 60)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(
        f"{args.count} composites of two photographs ({args.size} x {2 * args.size} px), each explained for the concept of "
        f"each half: {2 * args.count} maps per method. Percent; own share: positive relevance on the concept's half "
        f"(chance 50). {result['minutes']:.0f} minutes on {args.threads} thread(s).\n\n" + table(result)
    )
    print(table(result))


if __name__ == "__main__":
    main()
