"""The typed input of LXMERT: a tokenised, right-padded question batch and the regions' features and boxes."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..regions import gather_tokens


@dataclass(frozen=True)
class LxmertBatch:
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

    def __len__(self) -> int:
        return len(self.input_ids)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward."""
        inputs = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "visual_feats": self.visual_feats,
            "visual_pos": self.visual_pos,
        }
        for name in ("token_type_ids", "visual_attention_mask"):
            value = getattr(self, name)
            if value is not None:
                inputs[name] = value
        return inputs

    def rows(self, part: slice) -> "LxmertBatch":
        """The inputs of `part`, every field sliced alike."""
        def cut(value):
            return None if value is None else value[part]

        return replace(
            self, input_ids=self.input_ids[part], attention_mask=self.attention_mask[part],
            visual_feats=self.visual_feats[part], visual_pos=self.visual_pos[part],
            token_type_ids=cut(self.token_type_ids), visual_attention_mask=cut(self.visual_attention_mask),
            tokens=cut(self.tokens),
        )

    def select(self, rows: torch.Tensor, text: torch.Tensor | None = None, regions: torch.Tensor | None = None) -> "LxmertBatch":
        """The inputs of batch rows `rows` `(R,)`, each keeping the question tokens at `text[r]` and the regions at
        `regions[r]` (`(R, T')`, `(R, N')`; None: all): what the model's forward takes for a token-ablated batch."""
        return LxmertBatch(
            gather_tokens(self.input_ids, rows, text), gather_tokens(self.attention_mask, rows, text),
            gather_tokens(self.visual_feats, rows, regions), gather_tokens(self.visual_pos, rows, regions),
            gather_tokens(self.token_type_ids, rows, text), gather_tokens(self.visual_attention_mask, rows, regions),
        )
