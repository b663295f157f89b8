"""Per-token scores of a class or token target read from logits: what token ablation, the decoders' targets and the
benchmarks explain ("logit", "log_prob", or a callable), named once below the families and methods that read them."""
from __future__ import annotations

from typing import Callable

import torch

from .messages import quoted

__all__ = ["TokenScore", "SCORES", "checked_scores", "token_score"]

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


def checked_scores(values: object, what: str, count: int, graph: bool, per: str = "row") -> torch.Tensor:
    """`values`, the scores `what` gave (a user's target function or `score=`, or a computed logit), checked: a torch
    tensor of floating point scores, `(count,)` (one per `per`), attached to the model's output where `graph` (the
    method takes their gradient), every one finite; a one-line error naming `what`, what it got and what is taken
    otherwise, since such a score would fail in torch's backward without a word of the function, or give NaN maps."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{what} must return a torch tensor of shape ({count},), one score per {per}; got {type(values).__name__}: "
                        "return the tensor computed from the logits, not its .item(), .tolist() or .numpy()")
    if not values.is_floating_point():
        raise TypeError(f"{what} must return floating point scores, got {values.dtype}: an index or a comparison (argmax, >) "
                        "is no score to explain; return the logits' values (e.g. logits.gather(1, ids[:, None])[:, 0])")
    if tuple(values.shape) != (count,):
        raise ValueError(f"{what} must return one score per {per}, a tensor of shape ({count},); got shape {tuple(values.shape)}")
    if graph and not values.requires_grad:
        raise ValueError(f"{what} returned scores detached from the model's output (by .detach(), .item(), .numpy() or torch.no_grad() "
                         "inside it, or a new tensor): a map needs their gradient; compute them from the logits with torch operations")
    bad = ~torch.isfinite(values.detach())
    if bool(bad.any()):
        rows = bad.nonzero()[:, 0].tolist()
        raise ValueError(f"the explained score is NaN or infinite for {per}{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:10]))} "
                         f"({what}): a map of it is not defined; check the target function or score=")
    return values
