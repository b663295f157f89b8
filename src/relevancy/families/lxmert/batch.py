"""The typed input of LXMERT: a tokenised, right-padded question batch and the regions' features and boxes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..regions import RegionBatch


@dataclass(frozen=True)
class LxmertBatch(RegionBatch):
    """What `LxmertModel.forward` takes, checked and on the model's device (see `LxmertAdapter.check_inputs`).

    `visual_feats` `(B, N, F)` and `visual_pos` `(B, N, 4)` are the detector's region features and normalised boxes;
    `visual_attention_mask` `(B, N)` marks the real regions (None: all). `tokens[i]` are the strings of question
    `i`'s real tokens.
    """

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 at real tokens, right-padded
    visual_feats: torch.Tensor
    visual_pos: torch.Tensor
    token_type_ids: torch.Tensor | None = None
    visual_attention_mask: torch.Tensor | None = None  # (B, N) long
    tokens: list[list[str]] | None = None

    REGION_FIELDS = ("visual_feats", "visual_pos", "visual_attention_mask")
