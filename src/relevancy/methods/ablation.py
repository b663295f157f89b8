"""Token ablation (TAM): how much the explained score drops when one patch token is removed."""
from __future__ import annotations

import torch

from ..families.base import Adapter
from ..targets import Target, resolve_target, target_score


def select_tokens(adapter: Adapter, tokens: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`tokens[rows[:, None], positions]`; adapters carrying per-token state (a text attention mask) select it alike."""
    select = getattr(adapter, "select_tokens", None)
    return select(tokens, rows, positions) if select is not None else tokens[rows[:, None], positions]


def token_ablation(adapter: Adapter, inputs: torch.Tensor, target: Target, chunk_size: int = 256) -> tuple[torch.Tensor, ...]:
    """`f(all tokens) - f(all but patch token i)`, the token dropped before the first block.

    The N ablated sequences of every image run as batches of `chunk_size` sequences.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of sequences, got {chunk_size}")
    with torch.no_grad():
        tokens = adapter.embed(inputs)
        logits, pre_logits = adapter.forward_tokens(tokens)
        indices = resolve_target(target, logits)
        full = target_score(target, indices, logits, pre_logits)

        batch, length, _ = tokens.shape
        p = adapter.num_prefix_tokens
        patches = length - p
        # keep[i] lists the token positions that remain when patch token i is dropped
        positions = torch.arange(length, device=tokens.device)
        keep = positions.expand(patches, length)[positions[p:, None] != positions].view(patches, length - 1)
        image_of = torch.arange(batch, device=tokens.device).repeat_interleave(patches)
        drop_of = keep.repeat(batch, 1)
        ablated = torch.empty(batch * patches, device=tokens.device, dtype=full.dtype)
        for start in range(0, batch * patches, chunk_size):
            rows = slice(start, start + chunk_size)
            images = image_of[rows]
            sequences = select_tokens(adapter, tokens, images, drop_of[rows])
            chunk_logits, chunk_pre = adapter.forward_tokens(sequences)
            ablated[rows] = target_score(target, indices[images], chunk_logits, chunk_pre)
    return full[:, None] - ablated.view(batch, patches), indices, logits
