"""Concepts that generalise: real photographs with two boxed objects, each explained by CDAM for a concept made
from other photographs, as a plain, a contrasted and an LDA concept (relevancy.apps.demos.photo_concepts).

    python benchmarks/photo_concepts.py [--seeds 3] [--examples 16] [--threads 1] [--out benchmarks/results/photo_concepts]

Writes OUT.json (every map's numbers) and OUT.md (the tables in docs/concepts.md) and prints progress.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from relevancy.apps.demos.photo_concepts import SIZE, evaluate
from relevancy.zoo.photos import dinov2_small
from dinov2_speed import cpu_name

COLUMNS = (("on_target", "on target ↑"), ("on_other", "on other ↓"), ("peak_on_target", "peak on target ↑"),
           ("target_beats_other", "target > other ↑"), ("denser_on_target", "target > other per area ↑"))


def tables(result: dict) -> str:
    """The overall table (one row per concept kind) and the per-pair table (target share / other share per kind)."""
    kinds = list(result["kinds"])
    head = ["concept kind", *(title for _, title in COLUMNS), "maps"]
    rows = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for kind, found in result["kinds"].items():
        rows.append("| " + " | ".join([f"`{kind}`", *(f"{found[key]:.1f}" for key, _ in COLUMNS), str(found["maps"])]) + " |")
    pairs = result["kinds"][kinds[0]]["per_pair"]
    head = ["scene: target vs other", "box areas (target / other)", *(f"`{kind}` target / other" for kind in kinds)]
    rows += ["", "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for pair, first in pairs.items():
        cells = [pair, f"{first['target_area']:.0f} / {first['other_area']:.0f}"]
        cells += [f"{result['kinds'][kind]['per_pair'][pair]['on_target']:.1f} / {result['kinds'][kind]['per_pair'][pair]['on_other']:.1f}" for kind in kinds]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="sets of example crops per scene (default 3)")
    parser.add_argument("--examples", type=int, default=16, help="example crops per concept (default 16)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/photo_concepts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = evaluate(dinov2_small("hf"), seeds=args.seeds, count=args.examples, log=lambda message: print(message, flush=True))
    result.update(cpu=cpu_name(), threads=args.threads, torch=torch.__version__, minutes=(time.perf_counter() - started) / 60)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(
        f"Four photographs ({SIZE} x {SIZE} px, and their mirror images), each object with a concept made from other "
        f"photographs explained by CDAM against each other boxed object: {args.seeds} sets of {args.examples} example "
        f"crops per concept. Percent of the map's positive relevance on the target's and the other object's box; "
        f"peak: the map's largest pixel is in the target's box. {result['minutes']:.0f} minutes on {args.threads} "
        f"thread(s).\n\n" + tables(result)
    )
    print(tables(result))


if __name__ == "__main__":
    main()
