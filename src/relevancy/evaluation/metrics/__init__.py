"""Evaluation protocols of the papers: pure functions on tensors plus mergeable accumulators.

Every accumulator has ``update(...)``, ``merge(other)``, ``compute()``, ``state_dict()`` (plain Python)
and ``from_state(state)``; :func:`all_gather` combines them across ``torch.distributed`` ranks.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from .agreement import AgreementTest, pearson, sparsity
from .discrimination import DiscriminationTest, class_discrimination
from .perturbation import STEPS, PerturbationTest, perturbation_auc, perturbation_test
from .rationales import TOP_K, RationaleTest, token_prf, top_k_tokens, word_scores
from .segmentation import SegmentationTest, segmentation_scores

__all__ = [
    "STEPS",
    "TOP_K",
    "AgreementTest",
    "DiscriminationTest",
    "PerturbationTest",
    "RationaleTest",
    "SegmentationTest",
    "all_gather",
    "class_discrimination",
    "pearson",
    "perturbation_auc",
    "perturbation_test",
    "segmentation_scores",
    "sparsity",
    "token_prf",
    "top_k_tokens",
    "word_scores",
]


class _Accumulator(Protocol):
    def merge(self, other: Any) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Any: ...


A = TypeVar("A", bound=_Accumulator)


def all_gather(acc: A) -> A:
    """The accumulator merged over all ``torch.distributed`` ranks (``acc`` itself when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return acc
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, acc.state_dict())
    merged = type(acc).from_state(states[0])
    for state in states[1:]:
        merged.merge(type(acc).from_state(state))
    return merged
