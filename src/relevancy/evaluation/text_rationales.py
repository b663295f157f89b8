"""An offline rationale set for the token-F1 test: sentiment phrases at known positions in neutral text.

ERASER Movie Reviews (the papers' token-F1 data) cannot be fetched here, so this module generates its own,
in the same shape: documents as whitespace tokens and, per document, the evidence spans (token ranges)
a human would mark. Each document of `make_rationale_set()` is a drug review made of neutral carrier
sentences (facts about taking a medication: no opinion) with one to three sentiment phrases of one polarity
inserted between them; the label is that polarity and the evidences are exactly the inserted phrases.
Everything is ASCII and the phrases are curated (not model-generated), so the truth is known by
construction. `write_eraser()` writes the ERASER layout (`docs.jsonl`, `test.jsonl`) that
`relevancy.evaluation.metrics.rationales.load_eraser` reads; `token_f1()` runs the whole test for a model and method.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .metrics.rationales import Annotation, Evidence, RationaleTest, word_scores

LABELS = ("negative", "positive")

POSITIVE = (
    "it worked wonders for me",
    "I feel so much better now",
    "this medicine changed my life",
    "I highly recommend it",
    "the results have been excellent",
    "my pain is completely gone",
    "I am very happy with it",
    "it has been a lifesaver",
    "I finally sleep great",
    "no side effects at all and it works",
    "best medication I have ever taken",
    "I am so grateful my doctor found it",
    "it works fast and works well",
    "my symptoms improved dramatically",
    "I would give it ten stars",
    "it gave me my energy back",
    "absolutely amazing results",
    "I feel like myself again",
)
NEGATIVE = (
    "it made me feel awful",
    "the side effects were unbearable",
    "I would not recommend it to anyone",
    "it did absolutely nothing for me",
    "worst medication I have ever taken",
    "I was sick and miserable the whole time",
    "my anxiety got much worse",
    "the headaches were terrible",
    "it was a complete waste of money",
    "I regret ever starting it",
    "I had horrible mood swings",
    "my symptoms got worse instead of better",
    "I felt dizzy and nauseous every day",
    "I stopped because it was so bad",
    "it ruined my sleep",
    "the pain became even worse",
    "I gained weight and felt depressed",
    "a terrible experience from the start",
)
CARRIERS = (
    "I started taking this medication in March.",
    "My doctor prescribed it for my condition.",
    "I take one tablet every morning with breakfast.",
    "The pharmacy had it in stock.",
    "I have been on it for about three months.",
    "The dose was changed after four weeks.",
    "I also take a vitamin every day.",
    "My insurance covered part of the cost.",
    "I read the leaflet before the first dose.",
    "The pills are small and white.",
    "I switched from another brand last year.",
    "My follow up appointment is next month.",
    "I keep the bottle in the kitchen cabinet.",
    "The prescription was for thirty days.",
    "I usually take it at the same time each day.",
    "My sister takes a similar medication.",
    "The first refill arrived by mail.",
    "I was diagnosed two years ago.",
)


@dataclass(frozen=True)
class RationaleSet:
    """Documents (`docid -> whitespace tokens`) and their annotations (label and evidence spans)."""

    documents: dict[str, list[str]]
    annotations: list[Annotation]

    def texts(self) -> list[str]:
        """The documents as strings, in the annotations' order."""
        return [" ".join(self.documents[a.docid]) for a in self.annotations]

    def labels(self, names: Sequence[str] = LABELS) -> list[int]:
        """Class index per annotation in `names` (a model's labels), matched case-insensitively by prefix:
        ERASER's "POS" / "NEG" are a sentiment model's "positive" / "negative"."""
        lowered = [n.lower() for n in names]
        indices = []
        for a in self.annotations:
            found = [i for i, n in enumerate(lowered) if n.startswith(a.classification.lower()) or a.classification.lower().startswith(n)]
            if len(found) != 1:
                raise ValueError(f"class {a.classification!r} of annotation {a.annotation_id} matches none or several of the model's labels {list(names)}")
            indices.extend(found)
        return indices


def _sentence(phrase: str) -> str:
    return phrase[0].upper() + phrase[1:] + "."


def make_rationale_set(size: int = 200, seed: int = 0, carriers: tuple[int, int] = (3, 6), phrases: tuple[int, int] = (1, 3)) -> RationaleSet:
    """`size` generated reviews, half of each polarity, reproducible from `seed`.

    Each review has `carriers` (min, max) neutral sentences and `phrases` (min, max) distinct sentiment phrases
    of its label, each inserted as its own sentence at a random place; the evidences are the phrases' tokens.
    """
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    rng = random.Random(seed)
    documents: dict[str, list[str]] = {}
    annotations: list[Annotation] = []
    for n in range(size):
        label = LABELS[n % 2]
        pool = POSITIVE if label == "positive" else NEGATIVE
        chosen = rng.sample(pool, rng.randint(*phrases))
        sentences: list[tuple[str, bool]] = [(s, False) for s in rng.sample(CARRIERS, rng.randint(*carriers))]
        for phrase in chosen:
            sentences.insert(rng.randint(0, len(sentences)), (_sentence(phrase), True))
        docid = f"generated_{seed}_{n:05d}"
        tokens: list[str] = []
        evidences = []
        for sentence, is_evidence in sentences:
            words = sentence.split()
            if is_evidence:
                evidences.append(Evidence(text=sentence, docid=docid, start_token=len(tokens), end_token=len(tokens) + len(words)))
            tokens.extend(words)
        documents[docid] = tokens
        annotations.append(Annotation(annotation_id=docid, query="What is the sentiment of this review?",
                                      evidences=(tuple(evidences),), classification=label, docids=(docid,)))
    return RationaleSet(documents, annotations)


def write_eraser(rationales: RationaleSet, folder: str | Path, split: str = "test") -> Path:
    """The ERASER layout: `docs.jsonl` and `{split}.jsonl` (readable by `relevancy.evaluation.metrics.rationales.load_eraser`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "docs.jsonl", "w", encoding="utf-8") as f:
        for docid, tokens in rationales.documents.items():
            f.write(json.dumps({"docid": docid, "document": " ".join(tokens)}) + "\n")
    with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
        for a in rationales.annotations:
            f.write(json.dumps({
                "annotation_id": a.annotation_id, "query": a.query, "classification": a.classification,
                "docids": list(a.docids or ()), "query_type": a.query_type,
                "evidences": [[{"text": e.text, "docid": e.docid, "start_token": e.start_token, "end_token": e.end_token,
                                "start_sentence": e.start_sentence, "end_sentence": e.end_sentence} for e in group]
                              for group in a.evidences],
            }) + "\n")
    return folder


def token_f1(
    model, tokenizer, method: str, rationales: RationaleSet, ks: Sequence[int] | None = None, batch_size: int = 16,
    labels: Sequence[int] | None = None, **options,
) -> dict:
    """ERASER token-level precision / recall / F1 of `method`'s top-k words against the evidences.

    As the papers' protocol: the map of the *true* class, clamped at 0, from word pieces to whitespace words
    (max over each word's characters), top-k words for each k. Returns `RationaleTest.compute()`.
    """
    labels = list(labels) if labels is not None else rationales.labels()
    test = RationaleTest() if ks is None else RationaleTest(ks)
    for start in range(0, len(rationales.annotations), batch_size):
        test.merge(rationale_test(model, tokenizer, method, rationales, range(start, start + batch_size), labels, ks, **options))
    return test.compute()


def rationale_test(model, tokenizer, method: str, rationales: RationaleSet, rows: range, labels: Sequence[int],
                   ks: Sequence[int] | None = None, **options) -> RationaleTest:
    """The token-F1 accumulator of the annotations `rows` (one `explain` call; see `token_f1`)."""
    from .. import explain
    from ..zoo.text.model import encode

    test = RationaleTest() if ks is None else RationaleTest(ks)
    chunk = rationales.annotations[rows.start:rows.stop]
    texts = [" ".join(rationales.documents[a.docid]) for a in chunk]
    expl = explain(model, encode(tokenizer, texts, model=model), method=method, target=list(labels[rows.start:rows.stop]), **options)
    scores = []
    for row, annotation in enumerate(chunk):
        pieces = [token for token, _ in expl.token_scores(row)]
        values = [score for _, score in expl.token_scores(row)]
        scores.append(word_scores(rationales.documents[annotation.docid], pieces, values))
    test.update(chunk, scores)
    return test
