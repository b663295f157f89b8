"""The typed input of VisualBERT: a tokenised, right-padded question batch and the regions' embeddings."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..regions import gather_tokens


@dataclass(frozen=True)
class VisualBertBatch:
    """What `VisualBertModel.forward` takes, checked and on the model's device (see `VisualBertAdapter.check_inputs`).

    The model reads one sequence: the question's `T` tokens, then the `N` regions of `visual_embeds` `(B, N, F)`.
    `visual_attention_mask` `(B, N)` marks the real regions (None: all, as the model assumes); `tokens[i]` are the
    strings of question `i`'s real tokens.
    """

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 at real tokens, right-padded
    visual_embeds: torch.Tensor
    token_type_ids: torch.Tensor | None = None
    visual_attention_mask: torch.Tensor | None = None  # (B, N) long
    visual_token_type_ids: torch.Tensor | None = None  # (B, N) long
    tokens: list[list[str]] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def text_length(self) -> int:
        """T: the question positions (padding included) before the regions in the model's sequence."""
        return self.input_ids.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """`(B, T + N)` bool: the real tokens and regions of the model's one sequence."""
        regions = self.visual_attention_mask
        if regions is None:
            regions = torch.ones(self.visual_embeds.shape[:2], dtype=torch.long, device=self.input_ids.device)
        return torch.cat([self.attention_mask, regions.to(self.attention_mask.device)], 1).bool()

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward."""
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "visual_embeds": self.visual_embeds}
        for name in ("token_type_ids", "visual_attention_mask", "visual_token_type_ids"):
            value = getattr(self, name)
            if value is not None:
                inputs[name] = value
        return inputs

    def rows(self, part: slice) -> "VisualBertBatch":
        """The inputs of `part`, every field sliced alike."""
        def cut(value):
            return None if value is None else value[part]

        return replace(
            self, input_ids=self.input_ids[part], attention_mask=self.attention_mask[part],
            visual_embeds=self.visual_embeds[part], token_type_ids=cut(self.token_type_ids),
            visual_attention_mask=cut(self.visual_attention_mask),
            visual_token_type_ids=cut(self.visual_token_type_ids), tokens=cut(self.tokens),
        )

    def select(self, rows: torch.Tensor, text: torch.Tensor | None = None, regions: torch.Tensor | None = None) -> "VisualBertBatch":
        """The inputs of batch rows `rows` `(R,)`, each keeping the question tokens at `text[r]` and the regions at
        `regions[r]` (`(R, T')`, `(R, N')`; None: all): what the model's forward takes for a token-ablated batch."""
        return VisualBertBatch(
            gather_tokens(self.input_ids, rows, text), gather_tokens(self.attention_mask, rows, text),
            gather_tokens(self.visual_embeds, rows, regions), gather_tokens(self.token_type_ids, rows, text),
            gather_tokens(self.visual_attention_mask, rows, regions),
            gather_tokens(self.visual_token_type_ids, rows, regions),
        )
