"""The report of a corpus run (`relevancy.explain_corpus`): ``report.md`` with corpus-level figures and two pictures,
read from the run's Parquet part files one at a time (a corpus need not fit in memory).

Each explained map counts once: a prompt's row (the relevance of its tokens for its target), or, for generations,
each generated token's row over the tokens before it. A map's shares are its tokens' absolute relevance over the
map's total, so long and short prompts, large and small logits weigh alike.
"""
from __future__ import annotations

import io
import math
import re
import unicodedata
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..core.extras import require
from ..core.files import write_atomic

#: the relative positions' bins of the table of relevance by position (tenths of the prompt)
BINS = 10
#: token kinds, in the order the report lists them
KINDS = ("special", "line break", "space", "punctuation", "number", "word")
_SPECIAL = re.compile(r"<[^<>\s]{1,40}>|\[[A-Z]{2,10}\]")


def token_kind(text: str) -> str:
    """A token's kind by its text: a special token (``<|...|>``, ``<s>``, ``[CLS]``), a line break, white space,
    punctuation, a number, or a word (anything else)."""
    stripped = text.strip()
    if _SPECIAL.fullmatch(stripped):
        return "special"
    if "\n" in text:
        return "line break"
    if not stripped:
        return "space"
    if all(unicodedata.category(c).startswith(("P", "S")) for c in stripped):
        return "punctuation"
    if all(c.isdigit() or c in ".,-" for c in stripped):
        return "number"
    return "word"


def _maps(row: dict[str, Any]) -> Iterator[tuple[list[str], np.ndarray]]:
    """The maps of one row: `(tokens read, scores)`; a generation's row `g` reads the prompt and `g` generated tokens."""
    scores = row["scores"]
    if scores and isinstance(scores[0], list):
        start = row["prompt_length"]
        for g, values in enumerate(scores):
            yield row["tokens"][: start + g], np.asarray(values[: start + g], dtype=np.float64)
    else:
        yield row["tokens"], np.asarray(scores, dtype=np.float64)


def _rows(paths: Sequence[Path]) -> Iterator[dict[str, Any]]:
    """The rows of the part files, one file in memory at a time."""
    require("pyarrow", "corpus")
    import pyarrow.parquet as pq

    for path in paths:
        yield from pq.read_table(path).to_pylist()


def _flat(values: Any) -> list[float]:
    """Numbers of a row's field (a number, a list, a list of lists) flattened; None left out."""
    if values is None:
        return []
    if isinstance(values, list):
        return [v for item in values for v in _flat(item)]
    return [float(values)]


def write_report(out: Path, paths: Sequence[Path], method: str, generate: bool) -> tuple[Path, ...]:
    """Write ``report.md``, ``report-sinks.png`` and ``report-totals.png`` into `out` from the run's part files; the
    files written."""
    prompts = tokens = maps = 0
    by_bin = np.zeros(BINS)
    first = last = 0.0
    kinds = {kind: [0, 0.0] for kind in KINDS}  # tokens, summed shares
    sinks: list[list[float]] = []
    totals: list[float] = []
    lengths: list[int] = []
    for row in _rows(paths):
        prompts += 1
        lengths.append(len(row["tokens"]) - len(row["target_ids"]) if generate else len(row["tokens"]))
        sinks.extend([row["sink_share"]] if not generate else row["sink_share"])
        totals.extend(_flat(row["relevance_total"]))
        for texts, scores in _maps(row):
            size = np.abs(scores).sum()
            if not len(scores) or size == 0:
                continue
            share = np.abs(scores) / size
            maps += 1
            tokens += len(scores)
            first, last = first + share[0], last + share[-1]
            np.add.at(by_bin, np.minimum((np.arange(len(share)) * BINS) // len(share), BINS - 1), share)
            for text, value in zip(texts, share):
                entry = kinds[token_kind(text)]
                entry[0] += 1
                entry[1] += value
    sink_array = np.asarray(sinks, dtype=np.float64).reshape(-1, 2)
    written = [write_atomic(out / "report-sinks.png", _histograms(
        [("first token", sink_array[:, 0]), ("last token", sink_array[:, 1])], "share of the positive relevance", "maps"))]
    if totals:
        written.append(write_atomic(out / "report-totals.png", _histograms(
            [("relevance_total", np.asarray(totals))], "relevance reaching the tokens / explained score", "maps")))
    lines = [f"# Corpus explained with {method}", "",
             f"{prompts:,} prompts ({sum(lengths):,} prompt tokens, {np.mean(lengths) if lengths else math.nan:.1f} per prompt"
             f" on average, {max(lengths, default=0)} the longest); {maps:,} maps"
             + (" (one per generated token)" if generate else " (one per prompt)") + f" over {tokens:,} tokens read.", "",
             "Shares: each map's absolute relevance per token over the map's total, averaged over the maps.", "",
             "## Relevance by position", "",
             "| where | mean share |", "|---|---|",
             f"| the first token | {first / max(maps, 1):.3f} |", f"| the last token | {last / max(maps, 1):.3f} |",
             *(f"| tenth {b + 1} of the tokens read | {by_bin[b] / max(maps, 1):.3f} |" for b in range(BINS)), "",
             "## Relevance by token kind", "",
             "| kind | tokens | share of all relevance | mean share per token |", "|---|---|---|---|",
             *(f"| {kind} | {count:,} | {value / max(maps, 1):.3f} | {value / count if count else math.nan:.4f} |"
               for kind, (count, value) in kinds.items()), "",
             "## Attention sinks", "",
             f"The share of each map's positive relevance on its first token: mean {_mean(sink_array[:, 0]):.3f}, median "
             f"{_median(sink_array[:, 0]):.3f}; on its last token: mean {_mean(sink_array[:, 1]):.3f}, median "
             f"{_median(sink_array[:, 1]):.3f}.", "", "![sink shares](report-sinks.png)", ""]
    if totals:
        lines += ["## Conservation", "", f"`relevance_total` (the share of the explained score reaching the tokens): mean "
                  f"{_mean(np.asarray(totals)):.3f}, from {min(totals):.3f} to {max(totals):.3f}.", "",
                  "![relevance totals](report-totals.png)", ""]
    written.append(write_atomic(out / "report.md", "\n".join(lines)))
    return tuple(written)


def _mean(values: np.ndarray) -> float:
    """The mean (NaN for none)."""
    return float(values.mean()) if len(values) else math.nan


def _median(values: np.ndarray) -> float:
    """The median (NaN for none)."""
    return float(np.median(values)) if len(values) else math.nan


def _histograms(series: list[tuple[str, np.ndarray]], xlabel: str, ylabel: str) -> bytes:
    """A PNG of one histogram per named series, side by side."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.4), squeeze=False)
    for ax, (name, values) in zip(axes[0], series):
        finite = values[np.isfinite(values)]
        ax.hist(finite, bins=30, color="#c0392b")
        ax.set_title(f"{name} (n = {len(finite):,})", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
