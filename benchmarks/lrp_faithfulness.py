"""Is the stable LRP arithmetic (the default) less faithful than the authors' (`exact=True`)? Shapes world, offline.

For `transformer_attribution`, `partial_lrp` and `lrp`, each arithmetic, with the shipped shapes ViT in float32
(as shipped) and in float64 (no rounding: only the arithmetic differs), the papers' metrics through the library's
own accumulators, called as `relevancy evaluate --benchmark shapes` calls them (`relevancy.evaluation.runner`):
- on one-object scenes, maps of the predicted class: positive and negative perturbation AUC (hits = the true
  class, the model's accuracy per step), segmentation pixel accuracy, mIoU and mAP against the object's mask;
- on two-object scenes, each explained for both of its classes: the share of the positive relevance on the
  target object and on the other object, and the pointing game.
A second table gives stable - exact per metric with the standard error of the paired per-image differences
(mIoU is pooled over images: no per-image value, no standard error).

Scenes come from evaluation seeds (`EVAL_SEED_BASE + 777`, `+ 778`): above every training seed and apart from
the seeds of `evaluate_accuracy`, of training validation and of `relevancy evaluate`.
The reading at the end of the results file is written by hand.

    python benchmarks/lrp_faithfulness.py [--singles 200] [--pairs 100] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import relevancy
from relevancy.worlds import EVAL_SEED_BASE, MEAN, STD, Scenes, load_model, make_scenes
from relevancy.evaluation.metrics import DiscriminationTest, PerturbationTest, SegmentationTest, perturbation_auc

METHODS = ("transformer_attribution", "partial_lrp", "lrp")
ARITHMETICS: dict[str, dict[str, Any]] = {"stable (default)": {}, "exact (authors')": {"exact": True}}
SINGLE_SEED = EVAL_SEED_BASE + 777
PAIR_SEED = EVAL_SEED_BASE + 778
BATCH = 50
#: pooled metrics and per-image values of one configuration
Result = tuple[dict[str, float], dict[str, list[float]]]
#: (key, column title; the arrow says whether higher or lower is better)
METRICS: tuple[tuple[str, str], ...] = (
    ("positive_auc", "positive AUC ↓"),
    ("negative_auc", "negative AUC ↑"),
    ("pixel_accuracy", "pixel acc. ↑"),
    ("miou", "mIoU ↑"),
    ("map", "mAP ↑"),
    ("target_share", "target share ↑"),
    ("other_share", "other share ↓"),
    ("pointing", "pointing ↑"),
)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def batches(scenes: Scenes, dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(images, labels, masks)`` of ``scenes`` in chunks of :data:`BATCH`, images in ``dtype``."""
    for start in range(0, len(scenes), BATCH):
        end = start + BATCH
        yield scenes.images[start:end].to(dtype), scenes.labels[start:end], scenes.masks[start:end]


def evaluate(model: torch.nn.Module, singles: Scenes, pairs: Scenes, method: str, options: dict[str, Any],
             dtype: torch.dtype) -> Result:
    """Pooled metrics and per-image values of one method and arithmetic (the runner's calls, see module doc)."""
    perturbation = PerturbationTest(mean=MEAN, std=STD, batch_size=64)
    segmentation = SegmentationTest()
    discrimination = DiscriminationTest()
    pixel_accuracy: list[float] = []
    for images, labels, masks in batches(singles, dtype):
        maps = relevancy.explain(model, images, method=method, **options).scores
        perturbation.update(model, images, maps, labels[:, 0])
        s = segmentation.update(maps, masks[:, 0].long())
        pixel_accuracy += (s["correct"] / s["labeled"]).tolist()
    for images, labels, masks in batches(pairs, dtype):
        targets = torch.cat([labels[:, 0], labels[:, 1]])
        maps = relevancy.explain(model, torch.cat([images, images]), method=method, target=targets, **options).scores
        discrimination.update(maps, torch.cat([masks[:, 0], masks[:, 1]]), torch.cat([masks[:, 1], masks[:, 0]]))
    p, s, d = perturbation.compute(), segmentation.compute(), discrimination.compute()
    pooled = {"positive_auc": p["positive_auc"], "negative_auc": p["negative_auc"],
              "pixel_accuracy": s["pixel_accuracy"], "miou": s["miou"], "map": s["map"],
              "target_share": d["target_share"], "other_share": d["other_share"], "pointing": d["pointing"]}
    per_image = {f"{t}_auc": [perturbation_auc(row, perturbation.steps) for row in perturbation.hits[t]]
                 for t in ("positive", "negative")}
    per_image.update(pixel_accuracy=pixel_accuracy, map=segmentation.ap, **discrimination.scores)
    return pooled, per_image


def fmt(key: str, value: float) -> str:
    """AUCs as they are (0..90), every other metric in per cent."""
    return f"{value:.1f}" if key.endswith("_auc") else f"{100 * value:.1f}"


def difference(key: str, stable: Result, exact: Result) -> str:
    """stable - exact, with the paired standard error where the metric is a mean over images."""
    delta = stable[0][key] - exact[0][key]
    text = f"{delta:+.1f}" if key.endswith("_auc") else f"{100 * delta:+.1f}"
    if key in stable[1]:
        diffs = [a - b for a, b in zip(stable[1][key], exact[1][key])]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs))
        text += f" ± {se:.1f}" if key.endswith("_auc") else f" ± {100 * se:.1f}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--singles", type=int, default=200, help="one-object scenes (perturbation, segmentation)")
    parser.add_argument("--pairs", type=int, default=100, help="two-object scenes (discrimination), two maps each")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lrp_stable_vs_exact.md"),
                        help="markdown file for the tables (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    singles = make_scenes(args.singles, seed=SINGLE_SEED, objects=1)
    pairs = make_scenes(args.pairs, seed=PAIR_SEED, objects=2)
    model32 = load_model()
    with torch.no_grad():
        accuracy = (model32(singles.images).argmax(-1) == singles.labels[:, 0]).double().mean().item()
    models = {"float32": (model32, torch.float32), "float64": (copy.deepcopy(model32).double(), torch.float64)}
    results: dict[tuple[str, str, str], Result] = {}
    for precision, (model, dtype) in models.items():
        for method in METHODS:
            for arithmetic, options in ARITHMETICS.items():
                results[precision, method, arithmetic] = evaluate(model, singles, pairs, method, options, dtype)
                print(precision, method, arithmetic, f"{time.perf_counter() - started:.0f} s", flush=True)
    titles = [title for _, title in METRICS]
    lines = [
        f"# LRP faithfulness, stable (default) vs exact (authors') arithmetic: shapes ViT, {cpu_name()}, "
        f"torch {torch.__version__}, 1 thread",
        "",
        f"{args.singles} one-object scenes (`make_scenes(seed={SINGLE_SEED})`, model top-1 {100 * accuracy:.1f} %) for "
        f"perturbation and segmentation; {args.pairs} two-object scenes (`make_scenes(seed={PAIR_SEED}, objects=2)`), "
        f"each explained for both classes ({2 * args.pairs} maps) for discrimination. AUCs over steps 0..0.9 "
        "(at most 90); every other figure in per cent. Command: `python benchmarks/lrp_faithfulness.py "
        f"--singles {args.singles} --pairs {args.pairs}`; {time.perf_counter() - started:.0f} s in all.",
        "",
        "| precision | method | arithmetic | " + " | ".join(titles) + " |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in titles) + " |",
    ]
    for (precision, method, arithmetic), (pooled, _) in results.items():
        cells = " | ".join(fmt(key, pooled[key]) for key, _ in METRICS)
        lines.append(f"| {precision} | `{method}` | {arithmetic} | {cells} |")
    lines += [
        "",
        "Stable - exact (± standard error of the paired per-image differences; the arrows say which sign is better):",
        "",
        "| precision | method | " + " | ".join(titles) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in titles) + " |",
    ]
    stable, exact = ARITHMETICS
    for precision in models:
        for method in METHODS:
            a, b = results[precision, method, stable], results[precision, method, exact]
            cells = " | ".join(difference(key, a, b) for key, _ in METRICS)
            lines.append(f"| {precision} | `{method}` | {cells} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
