"""Agreement between explanation methods (Brocki & Chung, CDAM paper, Sec. 4.3).

* Pearson correlation between two methods' token scores, pooled over the tokens of all images (one
  correlation per pair of methods, e.g. CDAM vs token ablation);
* sparsity of a method: mean over images of the fraction of tokens with
  ``|score| < 0.05 * max |score|`` of that image.

Per image the moments ``n, sum x, sum x^2`` (per method) and ``sum x*y`` (per pair) are kept, each
summed exactly rounded with ``math.fsum`` over float64 products; ``compute`` sums them over images with
``math.fsum`` too, so the result does not depend on batching or on how accumulators were merged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import combinations
from typing import Any

import torch

__all__ = ["AgreementTest", "pearson", "sparsity"]


def _row_sums(values: torch.Tensor) -> list[float]:
    """Exactly rounded sum of each row of a ``(B, N)`` float64 tensor."""
    return [math.fsum(row) for row in values.cpu().tolist()]


def _correlation(n: float, sx: float, sy: float, sxx: float, syy: float, sxy: float) -> float:
    """Pearson's r from pooled moments (NaN when a variable is constant)."""
    cov = n * sxy - sx * sy
    var = (n * sxx - sx * sx) * (n * syy - sy * sy)
    return cov / math.sqrt(var) if var > 0 else math.nan


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two same-shape score tensors, pooled over all their entries."""
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    a = x.detach().double().reshape(1, -1)
    b = y.detach().double().reshape(1, -1)
    sums = [_row_sums(t)[0] for t in (a, b, a * a, b * b, a * b)]
    return _correlation(float(a.shape[1]), *sums)


def sparsity(scores: torch.Tensor, threshold: float = 0.05) -> torch.Tensor:
    """Per image ``(B,)``: fraction of tokens with ``|score| < threshold * max |score|`` (float64)."""
    a = scores.detach().double().flatten(1).abs()
    return (a < threshold * a.amax(dim=1, keepdim=True)).double().mean(dim=1).cpu()


class AgreementTest:
    """Pairwise pooled Pearson correlations and per-method sparsity over a stream of images.

    ``update`` takes ``{method: (B, ...) scores}``, the same methods with the same shapes in one call.
    The state holds one entry per image in each column: token count, per-method sum, sum of squares and
    sparsity, per-pair sum of products.
    """

    def __init__(self, threshold: float = 0.05) -> None:
        self.threshold = threshold
        self.methods: list[str] = []
        self.n: list[int] = []
        self.s: dict[str, list[float]] = {}
        self.ss: dict[str, list[float]] = {}
        self.sp: dict[str, list[float]] = {}
        self.xy: dict[str, dict[str, list[float]]] = {}

    def _pairs(self) -> list[tuple[str, str]]:
        return list(combinations(self.methods, 2))

    def _init_methods(self, methods: list[str]) -> None:
        """Fix the method set on first use; later calls must name the same methods."""
        if not self.methods:
            self.methods = sorted(methods)
            self.s = {m: [] for m in self.methods}
            self.ss = {m: [] for m in self.methods}
            self.sp = {m: [] for m in self.methods}
            self.xy = {a: {} for a in self.methods}
            for a, b in self._pairs():
                self.xy[a][b] = []
        elif sorted(methods) != self.methods:
            raise ValueError(f"methods {sorted(methods)} differ from the accumulated {self.methods}")

    def update(self, scores: Mapping[str, torch.Tensor]) -> None:
        """Add a batch: one ``(B, ...)`` score tensor per method, the same shape for all methods."""
        shapes = {tuple(s.shape) for s in scores.values()}
        if len(shapes) != 1:
            raise ValueError(f"score shapes differ: { {m: tuple(s.shape) for m, s in scores.items()} }")
        self._init_methods(list(scores))
        x = {m: s.detach().double().flatten(1) for m, s in scores.items()}
        batch, tokens = next(iter(x.values())).shape
        self.n.extend([tokens] * batch)
        for m in self.methods:
            self.s[m].extend(_row_sums(x[m]))
            self.ss[m].extend(_row_sums(x[m] * x[m]))
            self.sp[m].extend(sparsity(x[m], self.threshold).tolist())
        for a, b in self._pairs():
            self.xy[a][b].extend(_row_sums(x[a] * x[b]))

    def merge(self, other: AgreementTest) -> AgreementTest:
        """Add ``other``'s images to this accumulator (in place; returns ``self``)."""
        if other.threshold != self.threshold:
            raise ValueError("cannot merge agreement tests with different thresholds")
        if not other.methods:
            return self
        self._init_methods(other.methods)
        self.n.extend(other.n)
        for m in self.methods:
            self.s[m].extend(other.s[m])
            self.ss[m].extend(other.ss[m])
            self.sp[m].extend(other.sp[m])
        for a, b in self._pairs():
            self.xy[a][b].extend(other.xy[a][b])
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (for ``torch.distributed.all_gather_object``)."""
        return {
            "threshold": self.threshold,
            "methods": list(self.methods),
            "n": list(self.n),
            "s": {m: list(v) for m, v in self.s.items()},
            "ss": {m: list(v) for m, v in self.ss.items()},
            "sp": {m: list(v) for m, v in self.sp.items()},
            "xy": {a: {b: list(v) for b, v in d.items()} for a, d in self.xy.items()},
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AgreementTest:
        """Rebuild an accumulator from :meth:`state_dict`."""
        acc = cls(threshold=state["threshold"])
        if state["methods"]:
            acc._init_methods(list(state["methods"]))
            acc.n = [int(v) for v in state["n"]]
            for m in acc.methods:
                acc.s[m] = [float(v) for v in state["s"][m]]
                acc.ss[m] = [float(v) for v in state["ss"][m]]
                acc.sp[m] = [float(v) for v in state["sp"][m]]
            for a, b in acc._pairs():
                acc.xy[a][b] = [float(v) for v in state["xy"][a][b]]
        return acc

    def compute(self) -> dict[str, Any]:
        """``pearson[a][b]`` (symmetric) for every pair of methods, ``sparsity[m]``, ``num_images``."""
        n = float(sum(self.n))
        s = {m: math.fsum(v) for m, v in self.s.items()}
        ss = {m: math.fsum(v) for m, v in self.ss.items()}
        corr: dict[str, dict[str, float]] = {m: {} for m in self.methods}
        for a, b in self._pairs():
            corr[a][b] = corr[b][a] = _correlation(n, s[a], s[b], ss[a], ss[b], math.fsum(self.xy[a][b]))
        count = len(self.n)
        return {
            "pearson": corr,
            "sparsity": {m: math.fsum(v) / count if count else math.nan for m, v in self.sp.items()},
            "num_images": count,
        }
