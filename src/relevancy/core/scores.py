"""Per-token scores of a class or token target read from logits: what token ablation, the decoders' targets and the
benchmarks explain ("logit", "log_prob", or a callable), named once below the families and methods that read them."""
from __future__ import annotations

from typing import Callable

import torch

from .messages import quoted

__all__ = ["TokenScore", "SCORES", "finite_scores", "token_score"]

#: `f(logits (N, V), ids (N,)) -> (N,)`: the score of each explained token from the logits that predict it
TokenScore = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SCORES: dict[str, TokenScore] = {
    "logit": lambda logits, ids: logits.gather(1, ids[:, None])[:, 0],
    "log_prob": lambda logits, ids: logits.log_softmax(-1).gather(1, ids[:, None])[:, 0],
}


def token_score(score: object) -> TokenScore:
    """The per-token score `score` names ("logit", "log_prob") or is (a callable); a one-line error otherwise."""
    if callable(score):
        return score
    if isinstance(score, str) and score in SCORES:
        return SCORES[score]
    raise ValueError(f"score must be one of {', '.join(SCORES)} or a callable f(logits (N, V), ids (N,)) -> (N,), got {quoted(score)}")


def finite_scores(values: torch.Tensor, what: str = "the explained score") -> torch.Tensor:
    """`values` (one explained score per row) where every one is finite; a one-line ValueError naming the rows
    otherwise (a target function or a `score=` that gives NaN or infinity makes every map NaN)."""
    bad = ~torch.isfinite(values.detach())
    if bool(bad.any()):
        rows = bad.reshape(len(bad), -1).any(1).nonzero()[:, 0].tolist() if bad.ndim else [0]
        raise ValueError(f"{what} is NaN or infinite for row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:10]))}: "
                         "a map of it is not defined; check the target function or score=")
    return values
