"""Token ablation (TAM): how much the explained score drops when one content token is removed."""
from __future__ import annotations

from typing import Any

import torch

from ..families.base import Adapter
from .targets import Target, resolve_target, target_score
from ..core.conventions import ClassEntry, check_choice, given_or
from .attention import set_class_entry


def token_ablation(adapter: Adapter, inputs: Any, target: Target, chunk_size: int = 256, cls_entry: str | None = None) -> tuple:
    """`f(all tokens) - f(all but token i)`, per stream the adapter embeds: each content token (patch, word, image
    token) dropped before the first block, the other streams left whole.

    The N ablated sequences of every input run as batches of `chunk_size` sequences. A padding token's entry is 0.
    `cls_entry`: the entry of a stream's readout token where it is a content token (text models): "keep" the drop
    of removing it, or set it as `set_class_entry` does (the question-answering families: "zero", the token the
    answer is read from is no content to remove).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of sequences, got {chunk_size}")
    how = check_choice("cls_entry", given_or(cls_entry, adapter.conventions.token_ablation.cls_entry), ClassEntry)
    scores = {}
    with torch.no_grad():
        tokens = adapter.embed(inputs)
        logits, pre_logits = adapter.forward_tokens(inputs, tokens)
        indices = resolve_target(target, logits)
        full = target_score(target, indices, logits, pre_logits)
        streams = adapter.streams(inputs)
        for name, values in tokens.items():
            stream = streams[name]
            batch, length, _ = values.shape
            p = stream.prefix_tokens
            content = length - p
            # keep[i] lists the token positions that remain when content token i is dropped
            positions = torch.arange(length, device=full.device)
            keep = positions.expand(content, length)[positions[p:, None] != positions].view(content, length - 1)
            row_of = torch.arange(batch, device=full.device).repeat_interleave(content)
            kept_of = keep.repeat(batch, 1)
            ablated = torch.empty(batch * content, device=full.device, dtype=full.dtype)
            for start in range(0, batch * content, chunk_size):
                part = slice(start, start + chunk_size)
                rows, kept = row_of[part], kept_of[part]
                selected = {
                    other: values[rows[:, None], kept] if other == name else values[rows]
                    for other, values in tokens.items()
                }
                chunk_logits, chunk_pre = adapter.forward_tokens(inputs, selected, rows, {name: kept})
                ablated[part] = target_score(target, indices[rows], chunk_logits, chunk_pre)
            drop = full[:, None] - ablated.view(batch, content)
            valid = stream.content_valid()
            scores[name] = set_class_entry(drop if valid is None else drop.masked_fill(~valid, 0), how, stream)
    return scores, indices, logits
