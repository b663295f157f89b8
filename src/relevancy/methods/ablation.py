"""Token ablation (TAM): how much the explained score drops when one content token is removed."""
from __future__ import annotations

from typing import Any

import torch

from ..families.base import Adapter
from .targets import Concept, Target, is_score_function, resolve_target, target_score
from ..core.conventions import ClassEntry, check_choice, given_or
from ..core.scores import token_score
from ..core.messages import quoted
from .attention import set_class_entry


def token_ablation(adapter: Adapter, inputs: Any, target: Target, chunk_size: int = 256, cls_entry: str | None = None,
                   score: str = "logit", ablate: str | None = None) -> tuple:
    """`f(all tokens) - f(all but token i)`, per unit the adapter ablates (`Adapter.ablated`: by default each stream
    it embeds, each content token dropped before the first block, the other streams left whole; a vision-language
    decoder: the prompt's text tokens, and the tower's patches, each set to the processor's mean).

    The ablated sequences of every input run as batches of `chunk_size` sequences; a token that is not valid in its
    unit (padding, a vision-language decoder's image placeholders) is not run and its entry is 0.
    `cls_entry`: the entry of a stream's readout token where it is a content token (text models): "keep" the drop
    of removing it, or set it as `set_class_entry` does (the question-answering families: "zero", the token the
    answer is read from is no content to remove).
    `score`: what `f` reads of a class or token target, its "logit" or its "log_prob" (the log-softmax over the
    logits: the vlm-shapes benchmark's patch ablation); a `Concept` or a callable target is its own score.
    `ablate`: the one unit whose tokens are removed ("image": a vision-language decoder's patches only), the others'
    scores left at 0 (not computed); None: every unit.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of sequences, got {chunk_size}")
    how = check_choice("cls_entry", given_or(cls_entry, adapter.conventions.token_ablation.cls_entry), ClassEntry)
    scorer = token_score(score)
    if score != "logit" and (isinstance(target, Concept) or is_score_function(target)):
        raise ValueError(f"score={score!r} scores a class or token target; a Concept or a callable target is its own score")

    def scored(indices: torch.Tensor, logits: torch.Tensor, pre_logits: torch.Tensor) -> torch.Tensor:
        return scorer(logits, indices) if score != "logit" else target_score(target, indices, logits, pre_logits, graph=False)

    scores = {}
    with torch.no_grad():
        tokens, units = adapter.ablated(inputs)
        if ablate is not None and ablate not in units:
            raise ValueError(f"ablate must be one of {', '.join(units)} (or None: all), got {quoted(ablate)}")
        logits, pre_logits = adapter.forward_tokens(inputs, tokens)
        indices = resolve_target(target, logits)
        full = scored(indices, logits, pre_logits)
        for name, values in tokens.items():
            stream = units[name]
            batch, length = values.shape[:2]
            p = stream.prefix_tokens
            content = length - p
            # keep[i] lists the token positions that remain when content token i is dropped
            positions = torch.arange(length, device=full.device)
            keep = positions.expand(content, length)[positions[p:, None] != positions].view(content, length - 1)
            valid = stream.content_valid()
            run = torch.ones(batch, content, dtype=torch.bool, device=full.device) if valid is None else valid.to(full.device)
            run &= ablate in (None, name)
            row_of, dropped = run.nonzero(as_tuple=True)  # the (row, token) pairs run, in row order
            kept_of = keep[dropped]
            ablated = torch.empty(len(row_of), device=full.device, dtype=full.dtype)
            for start in range(0, len(row_of), chunk_size):
                part = slice(start, start + chunk_size)
                rows, kept = row_of[part], kept_of[part]
                selected = {
                    other: values[rows[:, None], kept] if other == name else values[rows]
                    for other, values in tokens.items()
                }
                chunk_logits, chunk_pre = adapter.forward_tokens(inputs, selected, rows, {name: kept})
                ablated[part] = scored(indices[rows], chunk_logits, chunk_pre)
            drop = torch.zeros(batch, content, device=full.device, dtype=full.dtype)
            drop[row_of, dropped] = full[row_of] - ablated
            scores[name] = set_class_entry(drop, how, stream)
    return scores, indices, logits
