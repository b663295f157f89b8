"""The shapes benchmark's ViT and Swin side by side: one Markdown table from two `relevancy evaluate --benchmark shapes`
results.json files (docs/vision.md's table).

    python benchmarks/shapes_vit_swin_table.py docs/results/shapes500/results.json docs/results/shapes500_swin/results.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

#: (column, section, key, better): the CVPR'21 perturbation and segmentation figures and the discrimination test
COLUMNS = (("pos. AUC", "perturbation", "positive_auc", "low"), ("neg. AUC", "perturbation", "negative_auc", "high"),
           ("mIoU", "segmentation", "miou", "high"), ("pixel acc", "segmentation", "pixel_accuracy", "high"),
           ("target share", "discrimination", "target_share", "high"), ("pointing", "discrimination", "pointing_game", "high"))


def table(vit: dict, swin: dict) -> str:
    """Rows: the methods both runs have, in the ViT run's order; for each figure the ViT's then the Swin's, the best of
    each model's column in bold."""
    methods = [m for m in vit["methods"] if m in swin["methods"]]
    best = {}
    for name, results in (("vit", vit), ("swin", swin)):
        for column, section, key, better in COLUMNS:
            values = [results["methods"][m][section][key] for m in methods]
            best[name, column] = (min if better == "low" else max)(v for v in values if v is not None)
    arrows = {"low": "↓", "high": "↑"}
    head = "| method | " + " | ".join(f"{c} {arrows[b]} ViT | Swin" for c, _, _, b in COLUMNS) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(COLUMNS))]
    for m in methods:
        cells = []
        for column, section, key, _ in COLUMNS:
            for name, results in (("vit", vit), ("swin", swin)):
                value = results["methods"][m][section][key]
                text = "n/a" if value is None else f"{value:.1f}"
                cells.append(f"**{text}**" if value is not None and value == best[name, column] else text)
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vit", type=Path)
    parser.add_argument("swin", type=Path)
    args = parser.parse_args()
    print(table(json.loads(args.vit.read_text()), json.loads(args.swin.read_text())))


if __name__ == "__main__":
    main()
