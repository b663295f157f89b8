"""What a language model's explanation is about: the next token, an answer span read teacher-forced after the prompt,
or the difference of two (`Contrast`), scored by their logits, their log-probabilities or a function of the user's.

A target of several tokens (a text of several tokens, a `Span`) is explained teacher-forced: its tokens but the last
are appended to the prompt, and token `j` is scored at the position that predicts it (the prompt's last real token
for `j = 0`, the span's token `j - 1` after it); the explained score is the sum over the span's tokens. A `Contrast`
whose foil has several tokens reads the foil in a row of its own (the same prompt, the foil appended), so the two
spans may differ in length and in their earlier tokens; a one-token foil is read at the prompt's last position.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Sequence, Union

import numpy as np
import torch

from ...core.messages import quoted


@dataclass(frozen=True)
class Span:
    """Tokens explained together, teacher-forced after the prompt: a text (tokenised without special tokens, needs
    `tokenizer=`) or token ids. A text of several tokens is a span already; `Span([id, id])` says so for ids (a
    list of ids as a target is one token per row)."""

    tokens: Union[str, Sequence[int]]

    def __post_init__(self) -> None:
        """A text or a sequence of token ids, refused at once otherwise (None, floats, bools); an empty one names
        that it needs at least one token. Ids as a tensor or array (1-D integers) are kept as a tuple of ints."""
        tokens = self.tokens
        if isinstance(tokens, (torch.Tensor, np.ndarray)):
            integers = not tokens.dtype.is_floating_point and not tokens.dtype.is_complex and tokens.dtype != torch.bool \
                if isinstance(tokens, torch.Tensor) else tokens.dtype.kind in "iu"
            if tokens.ndim != 1 or not integers:
                raise TypeError(f"a Span of token ids as a tensor or array is 1-D integers, got shape {tuple(tokens.shape)} of {tokens.dtype}")
            tokens = tuple(tokens.tolist())
            object.__setattr__(self, "tokens", tokens)
        ids = not isinstance(tokens, (str, bytes)) and isinstance(tokens, Sequence) and all(
            isinstance(t, Integral) and not isinstance(t, bool) for t in tokens)
        if not isinstance(tokens, str) and not ids:
            raise TypeError(f"a Span is a text (a non-empty str) or token ids (a non-empty list of ints), got {quoted(tokens)} "
                            f"({type(tokens).__name__})")
        if len(tokens) == 0:
            raise ValueError("a Span needs at least one token id or a non-empty text, got an empty one")


Token = Union[int, str, Span]


@dataclass(frozen=True)
class Contrast:
    """Why `token` rather than `foil`: the explained score is the score of `token` minus that of `foil`. Each is a
    token id, a text (one or more tokens, e.g. " Paris" or " New York"; needs `tokenizer=`) or a `Span`."""

    token: Token
    foil: Token


def _one_id(token: object, tokenizer: object | None, vocab: int) -> int:
    if isinstance(token, bool) or not isinstance(token, Integral):
        raise TypeError(f"a target token is an int (token id), a str (text) or a relevancy.Span, got {type(token).__name__}")
    token = int(token)  # numpy's and other integer types, as `explain` takes them elsewhere
    if not 0 <= token < vocab:
        raise ValueError(f"target token id {token} is outside the vocabulary 0..{vocab - 1}")
    return token


def span_ids(token: object, tokenizer: object | None, vocab: int) -> tuple[int, ...]:
    """The token ids one target stands for: an id, a text (one or more tokens), a `Span` of text or ids."""
    if isinstance(token, Span):
        token = token.tokens if isinstance(token.tokens, str) else list(token.tokens)
    if isinstance(token, str):
        if tokenizer is None:
            raise ValueError(f"the target {token!r} is text: pass the tokenizer too, explain(..., tokenizer=tokenizer), or give token ids")
        ids = list(tokenizer(token, add_special_tokens=False)["input_ids"])
        if not ids:
            raise ValueError(f"the target {token!r} has no tokens: give a non-empty text")
        return tuple(_one_id(i, tokenizer, vocab) for i in ids)
    if isinstance(token, (list, tuple)):
        if not token:
            raise ValueError("a span target needs at least one token id, got none")
        return tuple(_one_id(i, tokenizer, vocab) for i in token)
    return (_one_id(token, tokenizer, vocab),)


@dataclass(frozen=True)
class RowTarget:
    """One row's explained tokens (1 or more; empty: the predicted next token) and its foil's (empty: none)."""

    tokens: tuple[int, ...]
    foil: tuple[int, ...] = ()


def row_targets(target: object, rows: int, tokenizer: object | None, vocab: int) -> list[RowTarget]:
    """Per row, what `target` explains: None (the predicted next token), a token id, text or `Span`, a `Contrast`,
    or a list of these (one per row; a list or tuple of ids inside it is that row's span), or a tensor of ids."""
    if target is None:
        return [RowTarget(())] * rows
    if isinstance(target, (torch.Tensor, np.ndarray)):
        target = target.tolist()
    per_row = list(target) if isinstance(target, (list, tuple)) else [target] * rows
    if len(per_row) != rows:
        raise ValueError(f"target lists {len(per_row)} tokens for a batch of {rows} sequences: give one per sequence, or one for all")
    out = []
    for item in per_row:
        if isinstance(item, Contrast):
            tokens, foil = span_ids(item.token, tokenizer, vocab), span_ids(item.foil, tokenizer, vocab)
            if tokens == foil:  # the score minus itself: 0 whatever the input, a map of nothing
                what = f"token {tokens[0]}" if len(tokens) == 1 else f"span {list(tokens)}"
                raise ValueError(f"Contrast({item.token!r}, {item.foil!r}) sets {what} against itself: the score is 0 whatever "
                                 f"the input; give a foil other than the {what.split()[0]}")
            out.append(RowTarget(tokens, foil))
        else:
            out.append(RowTarget(span_ids(item, tokenizer, vocab)))
    return out


@dataclass
class Reading:
    """The rows one forward reads to explain a batch's targets, and where each explained token is scored.

    Reading row `r` (`ids`, `mask`: the prompt's `T` columns, then the appended tokens) explains batch row
    `source[r]`: the first `B` rows are the batch with each row's span but its last token appended; a foil of
    several tokens gets a row of its own with the foil appended. `terms`: per explained token its reading row,
    position, token id (-1: the predicted token, read after the forward) and sign (+1; -1 for a foil); the first
    `B` terms are each row's first explained token (its next-token logits).
    `columns` `(R, T + A)`: where each reading column goes among the result's `T + S + F` columns: the prompt,
    then the span's `S` tokens, then the foil's `F` tokens (the last token of each is scored, never read: 0)."""

    ids: torch.Tensor
    mask: torch.Tensor
    prompt_length: int
    source: torch.Tensor
    columns: torch.Tensor
    term_rows: torch.Tensor
    term_positions: torch.Tensor
    term_ids: torch.Tensor
    term_signs: torch.Tensor
    span_ids: torch.Tensor  # (B, S) the explained tokens per row, -1 past a row's end
    foil_ids: torch.Tensor  # (B, F) the foils' tokens, -1 past a row's end (F = 0 without a contrast)

    @property
    def width(self) -> int:
        """`T + S + F`: the prompt's columns, the span's and the foil's."""
        return self.prompt_length + self.span_ids.shape[1] + self.foil_ids.shape[1]

    def gathered(self, values: torch.Tensor) -> torch.Tensor:
        """Per-reading-row values `(R, T + A, ...)` (0 where the mask is 0) summed into the batch's rows and the
        result's columns, `(B, T + S + F, ...)` (a masked column past a short span adds its 0 beyond them)."""
        rows, width = len(self.span_ids), self.width
        full = max(width, int(self.columns.max()) + 1)
        flat = (self.source[:, None] * full + self.columns).flatten()
        out = values.new_zeros(rows * full, *values.shape[2:])
        out.index_add_(0, flat.to(values.device), values.flatten(0, 1))
        return out.view(rows, full, *values.shape[2:])[:, :width]


def _padded(spans: list[tuple[int, ...]]) -> torch.Tensor:
    width = max((len(s) for s in spans), default=0)
    return torch.tensor([list(s) + [-1] * (width - len(s)) for s in spans], dtype=torch.long).view(len(spans), width)


def reading(ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor, targets: list[RowTarget]) -> Reading:
    """The reading rows of a batch `ids`, `mask` `(B, T)` (each row's last real token at `last`) for `targets`."""
    rows, length = ids.shape
    spans = [t.tokens or (-1,) for t in targets]
    foils = [t.foil for t in targets]
    size, foil_size = max(len(s) for s in spans), max((len(f) for f in foils), default=0)
    own = [row for row, foil in enumerate(foils) if len(foil) > 1]  # foils read in a row of their own
    appended = max([size - 1] + [len(foils[row]) - 1 for row in own])
    sources = list(range(rows)) + own
    read = [spans[row][:-1] for row in range(rows)] + [foils[row][:-1] for row in own]
    extra_ids = torch.zeros(len(sources), appended, dtype=ids.dtype)
    extra_mask = torch.zeros(len(sources), appended, dtype=mask.dtype)
    for r, tokens in enumerate(read):
        extra_ids[r, :len(tokens)] = torch.tensor(tokens, dtype=ids.dtype)
        extra_mask[r, :len(tokens)] = 1
    source = torch.tensor(sources, dtype=torch.long)
    offsets = torch.tensor([0] * rows + [size] * len(own))
    columns = torch.cat([torch.arange(length).expand(len(sources), -1),
                         length + torch.arange(appended)[None] + offsets[:, None]], 1)
    # (reading row, position, id, sign); each row's first token first, so that terms[:B] are the next tokens
    terms: list[tuple[int, int, int, int]] = [(row, int(last[row]), spans[row][0], 1) for row in range(rows)]
    for row in range(rows):
        terms += [(row, length + j - 1, token, 1) for j, token in enumerate(spans[row]) if j > 0]
        if len(foils[row]) == 1:
            terms.append((row, int(last[row]), foils[row][0], -1))
    for r, row in enumerate(own, start=rows):
        terms += [(r, int(last[row]) if j == 0 else length + j - 1, token, -1) for j, token in enumerate(foils[row])]
    term_rows, term_positions, term_ids, term_signs = (torch.tensor(column, dtype=torch.long) for column in zip(*terms))
    device = ids.device
    return Reading(
        ids=torch.cat([ids[source.to(device)], extra_ids.to(device)], 1),
        mask=torch.cat([mask[source.to(device)], extra_mask.to(device)], 1), prompt_length=length, source=source.to(device),
        columns=columns.to(device), term_rows=term_rows.to(device), term_positions=term_positions.to(device),
        term_ids=term_ids.to(device), term_signs=term_signs.to(device), span_ids=_padded(spans).to(device),
        foil_ids=_padded(foils).to(device) if foil_size else torch.zeros(rows, 0, dtype=torch.long, device=device),
    )
