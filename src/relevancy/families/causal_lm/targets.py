"""What a language model's explanation is about: the next token's logit, or the difference of two (`Contrast`)."""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Union

import torch

Token = Union[int, str]


@dataclass(frozen=True)
class Contrast:
    """Why `token` rather than `foil`: the explained score is `logit[token] - logit[foil]`. Each is a token id or
    a token's text (one token of the tokenizer, e.g. " Paris"; needs `tokenizer=`)."""

    token: Token
    foil: Token


def token_id(token: Token, tokenizer: object | None, vocab: int) -> int:
    """A token id from an id or a token's text; a one-line error for text that is not exactly one token."""
    if isinstance(token, bool) or not isinstance(token, (Integral, str)):
        raise TypeError(f"a target token is an int (token id) or a str (the token's text), got {type(token).__name__}")
    if isinstance(token, str):
        if tokenizer is None:
            raise ValueError(f"the target {token!r} is text: pass the tokenizer too, explain(..., tokenizer=tokenizer), or give token ids")
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            pieces = tokenizer.convert_ids_to_tokens(ids)
            raise ValueError(f"the target {token!r} is {len(ids)} tokens {pieces}, not one: give one token (mind the leading space)")
        token = ids[0]
    token = int(token)  # numpy's and other integer types, as `explain` takes them elsewhere
    if not 0 <= token < vocab:
        raise ValueError(f"target token id {token} is outside the vocabulary 0..{vocab - 1}")
    return token


def target_scores(logits: torch.Tensor, target: object, tokenizer: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scores (B,), token ids (B,))` from next-token logits `(B, V)`. `target`: None (each row's most probable next
    token), a token id or text, a `Contrast`, or a list of these (one per row), or a tensor of ids."""
    rows, vocab = logits.shape
    if target is None:
        ids = logits.detach().argmax(-1)
        return logits.gather(1, ids[:, None])[:, 0], ids
    if isinstance(target, torch.Tensor):
        target = target.tolist()
    per_row = list(target) if isinstance(target, (list, tuple)) else [target] * rows
    if len(per_row) != rows:
        raise ValueError(f"target lists {len(per_row)} tokens for a batch of {rows} sequences: give one per sequence, or one for all")
    wanted = [(token_id(t.token, tokenizer, vocab), token_id(t.foil, tokenizer, vocab)) if isinstance(t, Contrast)
              else (token_id(t, tokenizer, vocab), None) for t in per_row]
    for t, (token, foil) in zip(per_row, wanted):
        if token == foil:  # the logit minus itself: 0 whatever the input, a map of nothing
            raise ValueError(f"Contrast({t.token!r}, {t.foil!r}) sets token {token} against itself: the score is 0 whatever "
                             "the input; give a foil other than the token")
    ids = torch.tensor([token for token, _ in wanted], device=logits.device)
    scores = logits.gather(1, ids[:, None])[:, 0]
    foils = [(row, foil) for row, (_, foil) in enumerate(wanted) if foil is not None]
    if foils:
        index = torch.tensor([row for row, _ in foils], device=logits.device)
        foil_ids = torch.tensor([foil for _, foil in foils], device=logits.device)
        scores = scores.index_add(0, index, -logits[index, foil_ids])
    return scores, ids
