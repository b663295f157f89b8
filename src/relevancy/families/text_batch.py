"""The typed input of the text families (BERT-family classifiers, decoder language models): a tokenised batch (no
tensor impersonation, nothing hidden on the adapter), and its checks of what a tokenizer returns."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(frozen=True)
class TextBatch:
    """A tokenised batch on the model's device; `tokens`/`word_ids` per text when the tokenizer gave them."""

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 at real tokens
    token_type_ids: torch.Tensor | None = None
    tokens: list[list[str]] | None = None  # token strings of the real (unpadded) tokens
    word_ids: list[list[int | None]] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def valid(self) -> torch.Tensor:
        """`(B, T)` bool: the real tokens."""
        return self.attention_mask.bool()

    def rows(self, part: slice) -> "TextBatch":
        """The texts of `part`, every field sliced alike."""
        return replace(
            self, input_ids=self.input_ids[part], attention_mask=self.attention_mask[part],
            token_type_ids=None if self.token_type_ids is None else self.token_type_ids[part],
            tokens=None if self.tokens is None else self.tokens[part],
            word_ids=None if self.word_ids is None else self.word_ids[part],
        )


def from_encoding(encoding: Mapping, pad_id: int | None) -> TextBatch:
    """A `TextBatch` from a tokenizer's output (`input_ids`, optionally `attention_mask` and `token_type_ids`; one
    text without the batch dimension accepted): the mask from trailing pad ids where none is given, the token
    strings and word ids where a fast tokenizer gave them."""
    if "input_ids" not in encoding:
        raise ValueError(f"the tokenizer's output must hold 'input_ids' (got keys {sorted(encoding.keys())}); inputs_embeds are not supported")
    ids = token_tensor(encoding["input_ids"], "input_ids")
    single = ids.ndim == 1
    ids = ids[None] if single else ids
    fields = {}
    for name in ("attention_mask", "token_type_ids"):
        value = encoding.get(name)
        if value is not None:
            value = token_tensor(value, name)
            fields[name] = value[None] if single and value.ndim == 1 else value
    mask = fields.get("attention_mask")
    if mask is None:
        mask = mask_from_padding(ids, pad_id)
    elif mask.shape != ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, got {tuple(mask.shape)}")
    types = fields.get("token_type_ids")
    tokens = word_ids = None
    if getattr(encoding, "encodings", None) and not single:  # a fast tokenizer's BatchEncoding
        valid = mask.bool()
        tokens = [[t for t, v in zip(encoding.tokens(i), valid[i]) if v] for i in range(len(ids))]
        word_ids = [[w for w, v in zip(encoding.word_ids(i), valid[i]) if v] for i in range(len(ids))]
    return TextBatch(ids.long(), mask, types, tokens, word_ids)


def token_tensor(value: object, name: str) -> torch.Tensor:
    """Token ids, an attention mask or token types (tensor, array, list of rows) as a long tensor; one-line errors
    for rows of different lengths and for anything but integers."""
    rows = isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(row, (list, tuple)) or isinstance(row, (torch.Tensor, np.ndarray)) and row.ndim > 0 for row in value
    )
    if rows and len({len(row) for row in value}) > 1:
        raise ValueError(
            f"{name} rows have different lengths {[len(row) for row in value]}: pad the batch (relevancy.zoo.text.encode("
            "tokenizer, texts) or tokenizer(texts, padding=True, return_tensors='pt')) or explain one text at a time"
        )
    try:
        tensor = torch.stack([torch.as_tensor(row) for row in value]) if rows else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):  # strings, objects
        tensor = None
    if tensor is not None and tensor.numel() == 0:
        return tensor.long()  # `[]` converts to float; the empty-batch check names the problem
    if tensor is None or tensor.is_floating_point() or tensor.is_complex() or (tensor.dtype == torch.bool and name != "attention_mask"):
        got = type(value).__name__ if tensor is None else str(tensor.dtype)
        raise TypeError(f"{name} must be integers (a tensor, array or list of rows of ints, as the tokenizer returns), got {got}")
    return tensor.long()


def mask_from_padding(ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """The attention mask of `input_ids` given without one: 0 at the pad ids that end a row, with a warning."""
    if pad_id is None or ids.ndim != 2:  # a wrong shape is named by the shape check
        return torch.ones_like(ids)
    trailing = (ids == pad_id).long().flip(1).cumprod(1).flip(1).bool()
    if trailing.any():
        padded = int(trailing.any(1).sum())
        warnings.warn(
            f"input_ids of {padded} text(s) end in the pad id {pad_id} but no attention_mask was given: relevancy treats "
            "those positions as padding; pass the tokenizer's attention_mask to say which tokens are real"
        )
    return (~trailing).long()


def placeholder_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[str]]:
    """Placeholder token strings (`[id]`) when the tokenizer did not say which strings the ids stand for."""
    return [[f"[{int(t)}]" for t, v in zip(row, valid) if v] for row, valid in zip(ids.tolist(), mask.bool().tolist())]
