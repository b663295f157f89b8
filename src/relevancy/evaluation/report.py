"""The files `relevancy evaluate` writes: results.json, report.md (the papers' table layout), perturbation.png.

Every percentage in results.json is in percent (0-100), as report.md and the papers show them; its ``units``
field says so. All three files are rendered in memory first, then written to temporary files in the output
folder and moved into place with ``os.replace``: a failure leaves no partial file.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from ..core.files import strict_json

__all__ = ["OUTPUT_FILES", "PERCENT_KEYS", "UNITS", "in_percent", "render_report", "summary", "write_outputs"]

OUTPUT_FILES = ("results.json", "report.md", "perturbation.png")
#: fractions the runner computes in [0, 1] that results.json gives in percent, wherever the key occurs
#: (the perturbation curves, segmentation, discrimination, sparsity, model accuracy, a checkpoint's val accuracy)
PERCENT_KEYS = frozenset({
    "positive", "negative", "positive_target", "negative_target",
    "pixel_accuracy", "miou", "map", "iou",
    "target_share", "other_share", "pointing_game",
    "sparsity", "single_top1", "pair_top2",
})
UNITS = ("percent (0-100): accuracy curves, pixel_accuracy, miou, map, iou, target_share, other_share, pointing_game, "
         "sparsity, single_top1, pair_top2; AUCs: trapezoid of the percent accuracy curve over steps (at most 90); "
         "pearson_tam and agreement_pearson: correlations in [-1, 1]; steps: fractions of pixels removed; "
         "*seconds*: seconds")

# (section, key, column title, decimals); values as in results.json
_COLUMNS: tuple[tuple[str, str, str, int], ...] = (
    ("perturbation", "positive_auc", "pos. AUC ↓", 2),
    ("perturbation", "negative_auc", "neg. AUC ↑", 2),
    ("perturbation", "positive_auc_target", "pos. AUC, true class ↓", 2),
    ("perturbation", "negative_auc_target", "neg. AUC, true class ↑", 2),
    ("segmentation", "pixel_accuracy", "pixel acc ↑", 2),
    ("segmentation", "miou", "mIoU ↑", 2),
    ("segmentation", "map", "mAP ↑", 2),
    ("discrimination", "target_share", "target share ↑", 1),
    ("discrimination", "other_share", "other share ↓", 1),
    ("discrimination", "pointing_game", "pointing ↑", 1),
    ("agreement", "pearson_tam", "r with TAM", 3),
    ("agreement", "sparsity", "sparsity", 1),
)


def in_percent(results: dict[str, Any]) -> dict[str, Any]:
    """A copy of the runner's results with every fraction of `PERCENT_KEYS` in percent and a ``units`` field
    saying so (placed before ``methods``); results that have the field are returned as they are."""
    if "units" in results:
        return results

    def scale(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [scale(v) for v in value]
        if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
            return float(f"{100 * value:.15g}")  # 15 digits: no float noise such as 99.60000000000001
        return value

    def convert(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: scale(v) if k in PERCENT_KEYS else convert(v) for k, v in value.items()}
        return value

    converted: dict[str, Any] = {}
    for key, value in results.items():
        if key == "methods":
            converted["units"] = UNITS
        converted[key] = convert(value)
    converted.setdefault("units", UNITS)
    return converted


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """results.json without its lists (perturbation curves, per-class IoU, settings' lists) and the sections
    that held only lists: what `evaluate --json` prints."""
    def scalars(value: dict[str, Any]) -> dict[str, Any]:
        kept = {}
        for key, item in value.items():
            if isinstance(item, dict) and item:
                item = scalars(item)
                if not item:
                    continue
            elif isinstance(item, (list, tuple)):
                continue
            kept[key] = item
        return kept

    return scalars(in_percent(results))


def _dumps(value: Any, indent: int = 0) -> str:
    """JSON with two-space indentation, lists of numbers (the curves) kept on one line."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        return "[\n" + ",\n".join(f"{inner}{_dumps(v, indent + 1)}" for v in value) + "\n" + pad + "]"
    return json.dumps(value, allow_nan=False)


def _describe(info: dict[str, Any]) -> str:
    """``steps 762, final False, val single_top1 21.3% ...`` from a checkpoint's metadata (in percent)."""
    def fmt(key: str, v: Any) -> str:
        if isinstance(v, dict):
            return " ".join(f"{k} {fmt(k, x)}" for k, x in v.items())
        if key in PERCENT_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool):
            return f"{v:.1f}%"
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)

    return ", ".join(f"{k} {fmt(k, v)}" for k, v in info.items())


def _cell(value: Any, decimals: int, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value * scale:.{decimals}f}"


def _notes(results: dict[str, Any]) -> list[str]:
    s = results.get("settings", {})
    splits = results.get("splits", {})
    notes = []
    if results["benchmark"] == "shapes":
        notes.append(
            f"Scenes: {splits.get('single')} one-object scenes (perturbation, segmentation, agreement) and "
            f"{splits.get('pair')} two-object scenes (discrimination; each explained once for each of its two "
            f"classes, so {2 * int(splits.get('pair') or 0)} maps), run seed {splits.get('seed')}: scene i is "
            f"{splits.get('scene_seed')}. Evaluation scenes never occur in training (training seeds < 10^9)."
        )
    else:
        order = "a permutation of the folder drawn with seed" if results["benchmark"] == "imagenet" else "file order; seed"
        notes.append(f"Images: the first {splits.get('images')} in {order} {splits.get('seed')}; preprocessing: the model's "
                     f"timm data config (mean {s.get('mean')}, std {s.get('std')})"
                     + (f"; labels: {splits['labels']}." if splits.get("labels") else "."))
    present = {section for m in results["methods"].values() for section in m if isinstance(m[section], dict)}
    described = {
        "perturbation": "Perturbation (CVPR'21 protocol): the map is upsampled bilinearly, the top `step` fraction of "
        "pixels (positive: most relevant first; negative: least relevant first) is set to 0 in [0, 1] pixel space for "
        "steps 0.0..0.9, and top-1 accuracy against the true label is recorded; AUC = 100 × trapezoid over the steps "
        "(at most 90). Columns without 'true class' explain the predicted class, the others the true class.",
        "segmentation": "Segmentation: predicted class, map upsampled and min-max normalised, threshold at its mean; "
        "pixel accuracy and IoU (mIoU = mean of background and foreground IoU) accumulated over all images, mAP = "
        "mean per-image AP (percent).",
        "discrimination": "Discrimination (two-object scenes): share of the positive relevance inside the explained "
        "object's mask (target) and inside the other object's mask (other), mean over maps; pointing = the map's "
        "maximum lies inside the explained object (percent).",
        "agreement": "Agreement (CDAM paper): Pearson's r between the method's token scores and token ablation's "
        "(TAM), pooled over all tokens of all one-object scenes (predicted class); sparsity = mean fraction of tokens "
        "with |score| < 0.05 × max |score| (percent). `lrp` gives pixel maps: they are summed over each patch first.",
    }
    notes += [text for section, text in described.items() if section in present]
    notes.append(
        "Timing: explain = seconds per explanation map (one image, one target), metric = seconds spent in the "
        "metrics per explanation map"
        + (" (the perturbation test's 19 forward passes per map dominate)" if "perturbation" in present else "")
        + f", in milliseconds, summed over {s.get('world_size', 1)} process(es)."
    )
    if s.get("paper_settings"):
        notes.append(f"--paper-settings: method options {json.dumps(s.get('method_options', {}))} (the authors' "
                     "evaluation scripts).")
    else:
        notes.append("Library defaults for every method (start_layer 0; rerun with --paper-settings for the "
                     "authors' start_layer 1 for rollout and transformer_attribution, normalised attention_gradcam).")
    return notes


def render_report(results: dict[str, Any]) -> str:
    """``report.md``: a table like the papers', one row per method, then how it was measured (from the runner's
    results or from results.json)."""
    results = in_percent(results)
    methods: dict[str, Any] = results["methods"]
    present = [c for c in _COLUMNS if any(c[0] in m for m in methods.values())]
    head = ["method", *(c[2] for c in present), "explain ms/img", "metric ms/img"]
    lines = [f"# relevancy evaluate: {results['benchmark']}", ""]
    info = results.get("model_info") or {}
    described = _describe(info)
    lines.append(f"Model: `{results.get('model')}`{f' ({described})' if described else ''}; n = {results['n']}.")
    accuracy = results.get("accuracy") or {}
    if accuracy:
        parts = []
        if "single_top1" in accuracy:
            parts.append(f"top-1 accuracy {accuracy['single_top1']:.1f}%")
        if "pair_top2" in accuracy:
            parts.append(f"two-object scenes with both classes in the top 2: {accuracy['pair_top2']:.1f}%")
        lines.append(f"Model on these images: {'; '.join(parts)}.")
    lines += ["", "| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for name, m in methods.items():
        cells = [name]
        for section, key, _, decimals in present:
            cells.append(_cell(m.get(section, {}).get(key), decimals))
        cells.append(_cell(m.get("seconds_per_image"), 2, scale=1000.0))
        cells.append(_cell(m.get("metric_seconds_per_image"), 2, scale=1000.0))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## How it was measured", ""]
    lines += [f"- {n}" for n in _notes(results)]
    timing = results.get("timing") or {}
    if timing:
        spent = (f"Time in the batches {timing['batch_seconds']:.1f} s (summed over processes and over the runs of a "
                 "resumed evaluation)" if "batch_seconds" in timing else  # results written before runs could resume
                 f"Wall time {timing.get('wall_seconds', 0):.1f} s")
        lines.append(f"- {spent}; token ablation computed as the agreement "
                     f"reference only: {timing.get('reference_seconds', 0):.1f} s; agreement bookkeeping "
                     f"{timing.get('agreement_seconds', 0):.1f} s.")
    return "\n".join(lines) + "\n"


def _curves_png(results: dict[str, Any]) -> bytes:
    """Accuracy (percent) against the removed fraction, one line per method, one panel per test."""
    import io

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    curves = {n: m["perturbation"]["curves"] for n, m in results["methods"].items() if "perturbation" in m}
    panels = [("positive", "positive (most relevant removed first)"),
              ("negative", "negative (least relevant removed first)"),
              ("positive_target", "positive, true class explained"),
              ("negative_target", "negative, true class explained")]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for name, c in curves.items():
            values = [math.nan if v is None else v for v in c[key]]
            ax.plot(c["steps"], values, marker="o", markersize=3, label=name)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("fraction of pixels removed")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("top-1 accuracy (%)")
    if curves:
        axes[0, -1].legend(fontsize=7, loc="best")
    figure.suptitle(f"perturbation test, {results['benchmark']}, model {results.get('model')}, n = {results['n']}", fontsize=10)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()


def write_outputs(results: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``results.json`` (in percent), ``report.md`` and (with a perturbation section) ``perturbation.png``
    into ``out``."""
    results = in_percent(results)
    out = Path(out)
    files: dict[str, bytes] = {
        "results.json": (_dumps(strict_json(results)) + "\n").encode(),
        "report.md": render_report(results).encode(),
    }
    if any("perturbation" in m for m in results["methods"].values()):
        files["perturbation.png"] = _curves_png(results)
    out.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    temporary: dict[str, str] = {}
    try:
        for name, content in files.items():
            handle, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
            temporary[name] = path
            with os.fdopen(handle, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(path, 0o666 & ~umask)  # mkstemp makes 0600 files; results are ordinary files
        for name, path in temporary.items():
            os.replace(path, out / name)
    finally:
        for path in temporary.values():
            if os.path.exists(path):
                os.remove(path)
    return [out / name for name in files]
