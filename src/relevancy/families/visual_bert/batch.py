"""The typed input of VisualBERT: a tokenised, right-padded question batch and the regions' embeddings."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..regions import RegionBatch


@dataclass(frozen=True)
class VisualBertBatch(RegionBatch):
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

    REGION_FIELDS = ("visual_embeds", "visual_attention_mask", "visual_token_type_ids")

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
