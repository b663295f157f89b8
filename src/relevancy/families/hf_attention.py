"""An eager attention for transformers models that relevancy registers under `EXACT_ATTENTION`.

transformers' own eager attention computes the softmax in float32 even for float64 models (about 1e-8 off the
authors' float64 code) and sdpa returns no probabilities. This one keeps the softmax in the model's dtype
(float32 for half precision) and keeps the probabilities on the autograd graph even when no weight needs a
gradient, so that the explained score can always be differentiated with respect to them. Families switch a
model's configs to it for a call and restore them after.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .base import transformers_configs

# the name of relevancy's exact eager attention (and of its mask function) in transformers' registries
EXACT_ATTENTION = "relevancy_exact_eager"


def softmax_on_graph(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over keys in the scores' dtype (float32 for half precision), on the graph even if nothing upstream
    needs a gradient (frozen weights), so that the probabilities can always be differentiated."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)
    if torch.is_grad_enabled() and not probs.requires_grad:
        probs.requires_grad_(True)
    return probs


def exact_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention with the softmax in the model's dtype; returns (output, probabilities)."""
    # in place: the largest tensors of a long sequence are not allocated twice (same arithmetic, same graph)
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scaling)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # a mask made for sdpa (True: attend): a user's forward from another thread may build its mask just before a
        # call switches the implementation, or just after it switches back
        scores = scores.masked_fill_(~attention_mask[..., : key.shape[-2]], torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores.add_(attention_mask[..., : key.shape[-2]])
    elif kwargs.get("is_causal") and query.shape[-2] > 1:  # no mask made for us: keep the model causal anyway
        blocked = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    probs = softmax_on_graph(scores)
    if dropout > 0.0 and module.training:
        probs = F.dropout(probs, p=dropout, training=True)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return output, probs


def register_exact_attention() -> None:
    """Register the exact eager attention and its mask function (transformers' eager mask) under EXACT_ATTENTION."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(EXACT_ATTENTION, exact_eager_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(EXACT_ATTENTION, eager_mask)


def attention_probabilities(output: object) -> torch.Tensor:
    """The probabilities in a transformers attention module's output `(context, probabilities)`; a clear error
    where the model's attention implementation returned none."""
    probabilities = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
    if probabilities is None:
        raise RuntimeError(
            "the attention returned no probabilities: the model does not use eager attention (relevancy switches it "
            "on for the call; a custom attention implementation may ignore the switch)"
        )
    return probabilities


@contextmanager
def explaining_call(model: nn.Module, implementation: str | None) -> Iterator[None]:
    """Eval mode and, with `implementation` (EXACT_ATTENTION, or "eager"), that attention in every config of the
    model for one call; modes and implementations restored after, also after an exception."""
    configs = transformers_configs(model)
    before = [getattr(c, "_attn_implementation", None) for c in configs]
    training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        if implementation is not None:
            if implementation == EXACT_ATTENTION:
                register_exact_attention()
            for config in configs:
                config._attn_implementation = implementation
        yield
    finally:
        for config, value in zip(configs, before):  # parents first: a parent's setter also sets its sub-configs
            if getattr(config, "_attn_implementation", None) != value:
                config._attn_implementation = value
        for module, flag in training.items():
            module.training = flag
