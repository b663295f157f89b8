"""Token-level rationale agreement on ERASER datasets (Movie Reviews in Chefer et al., CVPR'21).

Protocol of the authors' ``BERT_rationale_benchmark/models/pipeline/bert_pipeline.py`` and the ERASER
scorer ``BERT_rationale_benchmark/metrics.py`` (``score_hard_rationale_predictions`` on token-level
rationales, the ``token_prf`` entry):

* word scores: the explanation of the *true* class, clamped at 0, is mapped from word pieces to the
  document's whitespace words by giving every character its piece's score and taking the max over each
  word's characters (:func:`word_scores`); words beyond the model's truncation are dropped;
* for ``k = 5, 10, ..., 80`` the predicted rationale is the set of words returned by ``torch.topk`` for
  every ``k' <= k`` (the reference never clears its list between ``k`` values; the scorer takes sets);
* truth = every token ``start_token <= t < end_token`` of every evidence of the annotation, keyed by
  ``(annotation_id, docid)``;
* ``micro``: precision / recall over the pooled (key, token) sets; ``macro``: per key precision (0 without
  predictions) and recall (0 without truth), F1 = 0 when either is 0, each then averaged over keys (the
  macro F1 is the mean of the per-key F1s).

The ERASER reader (``docs/`` or ``docs.jsonl`` plus ``{train,val,test}.jsonl``) is here too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SPECIAL_TOKENS",
    "TOP_K",
    "Annotation",
    "Evidence",
    "RationaleTest",
    "load_annotations",
    "load_documents",
    "load_eraser",
    "token_prf",
    "top_k_tokens",
    "word_scores",
]

TOP_K: tuple[int, ...] = tuple(range(5, 85, 5))
SPECIAL_TOKENS: tuple[str, ...] = ("[CLS]", "[SEP]", "[UNK]", "[PAD]")

Scores = torch.Tensor | Sequence[float]


@dataclass(frozen=True)
class Evidence:
    """One evidence span of a document: tokens ``start_token <= t < end_token``."""

    text: str
    docid: str
    start_token: int = -1
    end_token: int = -1
    start_sentence: int = -1
    end_sentence: int = -1


@dataclass(frozen=True)
class Annotation:
    """One ERASER example: the label and its groups of evidences."""

    annotation_id: str
    query: str
    evidences: tuple[tuple[Evidence, ...], ...]
    classification: str
    query_type: str | None = None
    docids: tuple[str, ...] | None = None

    def all_evidences(self) -> tuple[Evidence, ...]:
        """The evidences of all groups, flattened."""
        return tuple(ev for group in self.evidences for ev in group)

    @property
    def docid(self) -> str:
        """The document of the first evidence (the one the reference pipeline explains), else of ``docids``."""
        if self.evidences and self.evidences[0]:
            return self.evidences[0][0].docid
        if self.docids:
            return self.docids[0]
        raise ValueError(f"annotation {self.annotation_id} names no document")

    def truth(self) -> dict[str, set[int]]:
        """``{docid: token indices}`` covered by the evidences."""
        out: dict[str, set[int]] = {}
        for ev in self.all_evidences():
            out.setdefault(ev.docid, set()).update(range(ev.start_token, ev.end_token))
        return out


_EVIDENCE_FIELDS = ("text", "docid", "start_token", "end_token", "start_sentence", "end_sentence")


def load_annotations(path: str | Path) -> list[Annotation]:
    """Read an ERASER ``{split}.jsonl`` file (one annotation per line)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            groups = tuple(
                tuple(Evidence(**{k: ev[k] for k in _EVIDENCE_FIELDS if k in ev}) for ev in group)
                for group in d["evidences"]
            )
            docids = d.get("docids")
            out.append(Annotation(
                annotation_id=d["annotation_id"], query=d.get("query", ""), evidences=groups,
                classification=d["classification"], query_type=d.get("query_type"),
                docids=tuple(docids) if docids is not None else None,
            ))
    return out


def load_documents(data_dir: str | Path, docids: Iterable[str] | None = None) -> dict[str, list[str]]:
    """``{docid: whitespace tokens}`` from ``data_dir/docs/<docid>`` or ``data_dir/docs.jsonl``."""
    data_dir = Path(data_dir)
    wanted = None if docids is None else set(docids)
    if (data_dir / "docs.jsonl").exists():
        docs = {}
        with open(data_dir / "docs.jsonl", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    if wanted is None or d["docid"] in wanted:
                        docs[d["docid"]] = d["document"].split()
        return docs
    names = sorted(p.name for p in (data_dir / "docs").iterdir()) if wanted is None else sorted(wanted)
    return {n: (data_dir / "docs" / n).read_text(encoding="utf-8").split() for n in names}


def load_eraser(data_dir: str | Path, split: str = "test") -> tuple[list[Annotation], dict[str, list[str]]]:
    """The annotations of ``split`` and the documents they refer to."""
    annotations = load_annotations(Path(data_dir) / f"{split}.jsonl")
    docids = {ev.docid for ann in annotations for ev in ann.all_evidences()}
    return annotations, load_documents(data_dir, docids)


def word_scores(
    words: Sequence[str],
    pieces: Sequence[str],
    scores: Scores,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
) -> torch.Tensor:
    """Word-piece scores to per-word scores, as the reference pipeline does it.

    ``pieces`` are the tokenizer's tokens for the sequence (``##`` continuation marks are stripped,
    special tokens skipped); each character gets its piece's score and a word gets the max over its
    characters. Words past the last scored character (truncation) get no score: the result has
    ``<= len(words)`` entries. Raises ``ValueError`` if the characters do not line up with the words
    (compared case-insensitively).
    """
    values = torch.as_tensor(scores).detach().flatten().cpu()
    chars: list[str] = []
    char_scores: list[torch.Tensor] = []
    for piece, score in zip(pieces, values):
        if piece in special_tokens:
            continue
        piece = piece.replace("##", "")
        chars.extend(piece)
        char_scores.extend([score] * len(piece))
    out, start = [], 0
    for word in words:
        if start >= len(chars):
            break
        end = start + len(word)
        seen = "".join(chars[start:end])
        if end <= len(chars) and seen.lower() != word.lower():
            raise ValueError(f"word pieces do not line up with the words: {seen!r} vs {word!r}")
        out.append(torch.stack(char_scores[start:end]).max())
        start = end
    return torch.stack(out) if out else values.new_zeros(0)


def top_k_tokens(scores: Scores, ks: Sequence[int] = TOP_K) -> list[set[int]]:
    """The predicted rationale (word indices) for each ``k``: union of ``topk(max(scores, 0), k')``, ``k' <= k``.

    ``k`` larger than the number of words is clamped to it (the reference would fail there).
    """
    values = torch.as_tensor(scores).detach().flatten().clamp(min=0)
    out, chosen = [], set()
    for k in ks:
        chosen = chosen | set(torch.topk(values, min(k, values.numel())).indices.tolist())
        out.append(set(chosen))
    return out


def _f1(p: float, r: float) -> float:
    return 0.0 if p == 0 or r == 0 else 2 * p * r / (p + r)


def _prf(counts: Sequence[tuple[int, int, int]]) -> dict[str, dict[str, float]]:
    """Micro and macro precision / recall / F1 from per-key ``(n_truth, n_pred, n_common)``."""
    t = sum(c[0] for c in counts)
    p = sum(c[1] for c in counts)
    c = sum(c[2] for c in counts)
    micro_p = c / p if p else 0.0
    micro_r = c / t if t else 0.0
    ps = [ci / pi if pi else 0.0 for ti, pi, ci in counts]
    rs = [ci / ti if ti else 0.0 for ti, pi, ci in counts]
    f1s = [_f1(a, b) for a, b in zip(ps, rs)]
    n = len(counts)
    return {
        "micro": {"p": micro_p, "r": micro_r, "f1": _f1(micro_p, micro_r)},
        "macro": {
            "p": math.fsum(ps) / n if n else 0.0,
            "r": math.fsum(rs) / n if n else 0.0,
            "f1": math.fsum(f1s) / n if n else 0.0,
        },
    }


def token_prf(truth: Sequence[set[int]], predicted: Sequence[set[int]]) -> dict[str, dict[str, float]]:
    """ERASER token-level ``micro`` and ``macro`` precision / recall / F1 of one set per instance."""
    if len(truth) != len(predicted):
        raise ValueError("truth and predicted must have one set per instance")
    return _prf([(len(t), len(p), len(t & p)) for t, p in zip(truth, predicted)])


class RationaleTest:
    """Token-F1 of top-k rationales over a stream of ERASER annotations.

    The state keeps ``(n_truth, n_pred, n_common)`` per ``(annotation_id, docid)`` key and per ``k``;
    ``merge`` of accumulators over disjoint annotations is exact.
    """

    def __init__(self, ks: Sequence[int] = TOP_K) -> None:
        self.ks = tuple(int(k) for k in ks)
        self.counts: dict[tuple[str, str], list[tuple[int, int, int]]] = {}

    def _add(self, key: tuple[str, str], counts: list[tuple[int, int, int]]) -> None:
        if key in self.counts:
            raise ValueError(f"instance {key} was already scored")
        self.counts[key] = counts

    def update(self, annotations: Sequence[Annotation], scores: Sequence[Scores | Mapping[str, Scores]]) -> None:
        """Score a batch: per annotation, word scores of its document (or ``{docid: word scores}``)."""
        if len(annotations) != len(scores):
            raise ValueError("one score entry per annotation")
        for ann, sc in zip(annotations, scores):
            per_doc = dict(sc) if isinstance(sc, Mapping) else {ann.docid: sc}
            truth = ann.truth()
            for docid in sorted(set(truth) | set(per_doc)):
                t = truth.get(docid, set())
                preds = top_k_tokens(per_doc[docid], self.ks) if docid in per_doc else [set()] * len(self.ks)
                self._add((ann.annotation_id, docid), [(len(t), len(p), len(t & p)) for p in preds])

    def merge(self, other: RationaleTest) -> RationaleTest:
        """Add ``other``'s instances (disjoint from this one's) to this accumulator (in place)."""
        if other.ks != self.ks:
            raise ValueError("cannot merge rationale tests with different ks")
        for key, counts in other.counts.items():
            self._add(key, counts)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (for ``torch.distributed.all_gather_object``)."""
        return {
            "ks": list(self.ks),
            "instances": [[a, d, [list(c) for c in counts]] for (a, d), counts in self.counts.items()],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RationaleTest:
        """Rebuild an accumulator from :meth:`state_dict`."""
        acc = cls(ks=state["ks"])
        for a, d, counts in state["instances"]:
            acc._add((a, d), [tuple(int(v) for v in c) for c in counts])
        return acc

    def compute(self) -> dict[str, Any]:
        """``{'scores': {k: {'micro': {p, r, f1}, 'macro': {p, r, f1}}}, 'num_instances': n}``."""
        values = list(self.counts.values())
        return {
            "scores": {k: _prf([v[i] for v in values]) for i, k in enumerate(self.ks)},
            "num_instances": len(values),
        }
