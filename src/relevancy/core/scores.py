"""Per-token scores of a class or token target read from logits: what token ablation, the decoders' targets and the
benchmarks explain ("logit", "log_prob", or a callable), named once below the families and methods that read them."""
from __future__ import annotations

from typing import Callable

import torch

from .messages import quoted

__all__ = ["TokenScore", "SCORES", "token_score"]

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
