"""What the transformers families share: the eager attention relevancy registers under `EXACT_ATTENTION`, the
switch of a model's configs to it for one call, and the leaf rules of transformers' modules.

transformers' own eager attention computes the softmax in float32 even for float64 models (about 1e-8 off the
authors' float64 code) and sdpa returns no probabilities. This one is relevancy's one attention
(`lrp.attention.attend`, outside a session; the rule-aware forwards are the same function inside one): the softmax
in the model's dtype (float32 for half precision), the probabilities on the autograd graph even when no weight
needs a gradient, so that the explained score can always be differentiated with respect to them. Families switch
a model's configs to it for a call and restore them after.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..lrp.attention import attend
from ..lrp.engine import ACTIVATION, ForwardFactory, Replacements, Session, default_leaves, gate
from ._shared import eval_mode, transformers_configs

# the name of relevancy's exact eager attention (and of its mask function) in transformers' registries
EXACT_ATTENTION = "relevancy_exact_eager"


def on_graph(probabilities: torch.Tensor) -> torch.Tensor:
    """The probabilities on the graph even if nothing upstream needs a gradient (frozen weights), so that they can
    always be differentiated."""
    if torch.is_grad_enabled() and not probabilities.requires_grad:
        probabilities.requires_grad_(True)
    return probabilities


def exact_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention as relevancy's one attention computes it (`lrp.attention.attend`, outside a
    session); returns `(output, probabilities)`."""
    drop = (lambda p: F.dropout(on_graph(p), p=dropout, training=True)) if dropout > 0.0 and module.training else on_graph
    context, probabilities = attend(None, query, key, value, scaling, attention_mask,
                                    causal=bool(kwargs.get("is_causal")), dropout=drop)
    return context.transpose(1, 2).contiguous(), probabilities


def gated_mlp(mlp: nn.Module, session: Session) -> Replacements:
    """transformers' gated feed-forward (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`: DINOv2's SwiGLU, Llama's
    MLP): the gating product under the gate rule, the projections under their own entries."""
    return {"forward": lambda x: mlp.down_proj(gate(session, mlp.up_proj(x), mlp.act_fn(mlp.gate_proj(x))))}


def transformers_leaves() -> dict[type, ForwardFactory]:
    """The default leaf map plus every activation module transformers builds (`ACT2CLS`)."""
    from transformers.activations import ACT2CLS

    classes = [entry[0] if isinstance(entry, tuple) else entry for entry in ACT2CLS.values()]
    return {**default_leaves(), **{cls: ACTIVATION for cls in classes if isinstance(cls, type)}}


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
    with eval_mode(model):
        try:
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
