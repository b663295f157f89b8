"""The typed input of the BERT family: a tokenised batch (no tensor impersonation, nothing hidden on the adapter)."""
from __future__ import annotations

from dataclasses import dataclass, replace

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
