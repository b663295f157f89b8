"""What the transformers families share: the eager attention relevancy registers under `EXACT_ATTENTION`, the
switch of a model's configs to it for one call, and the leaf rules of transformers' modules.

A config's attention implementation is read by every thread that runs the model, and the lock of a call does not
hold back the user's own forwards from other threads. So every implementation relevancy switches a config to is
registered thread-gated (`register_gated`): its attention and mask functions act in the thread that switched the
config (`switch_attention`); in any other thread they run the config's own implementation (its mask and its
attention), so a forward or `generate()` of the user's computes as if nothing were switched, whenever the switch
happens between the mask and the attention of that forward.

transformers' own eager attention computes the softmax in float32 even for float64 models (about 1e-8 off the
authors' float64 code) and sdpa returns no probabilities. This one is relevancy's one attention
(`lrp.attention.attend`, outside a session; the rule-aware forwards are the same function inside one): the softmax
in the model's dtype (float32 for half precision), the probabilities on the autograd graph even when no weight
needs a gradient, so that the explained score can always be differentiated with respect to them. Families switch
a model's configs to it for a call and restore them after.
"""
from __future__ import annotations

import sys
import threading
import weakref
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..core.guard import acts_for
from ..lrp import gradient
from ..lrp.attention import attend
from ..lrp.engine import ACTIVATION, ForwardFactory, Replacements, Session, activation, add, default_leaves, gate
from ._shared import config_image_fields, eval_mode, transformers_configs

# the name of relevancy's exact eager attention (and of its mask function) in transformers' registries
EXACT_ATTENTION = "relevancy_exact_eager"
# transformers' own eager attention of each model (and its eager mask), registered thread-gated under this name
EAGER = "relevancy_eager"

#: per switched config (by id): [the thread that holds the switch (None once given back), the config's own
#: implementation, how many switches the thread holds on it]; an entry lives as long as its config
_switches: dict[int, list[Any]] = {}
_switches_lock = threading.Lock()


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


def gated_activation(mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A gated feed-forward's activation: `act_fn`, or Llama 4's `activation_fn`; None where it has neither."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    return act if callable(act) else None


def gated_forward(mlp: nn.Module, session: Session | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' gated feed-forward (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`: DINOv2's SwiGLU, the
    decoders' MLPs) in the engine's operations: the activation under the activation rule, the gating product under
    the gate rule, the projections under their own entries (or as they are, for a rule set that carries a gradient)."""
    return lambda x: mlp.down_proj(gated_product(session, gated_activation(mlp), mlp.gate_proj(x), mlp.up_proj(x)))


def gated_product(session: Session | None, act: Callable[[torch.Tensor], torch.Tensor], gate_values: torch.Tensor,
                  up: torch.Tensor) -> torch.Tensor:
    """A gated MLP's hidden layer `act(gate_values) * up` under the session's activation and gate rules; a rule set
    that carries a gradient runs both as one operation (`lrp.gradient.gated`: fewer large tensors, the same
    arithmetic)."""
    if session is not None and not session.rule_set.explicit:
        return gradient.gated(act, gate_values, up, session.rule_set.gate)
    return gate(session, up, activation(session, act, gate_values))


def gated_mlp(mlp: nn.Module, session: Session) -> Replacements:
    """A rule map entry for transformers' gated feed-forward (`gated_forward`)."""
    return {"forward": gated_forward(mlp, session)}


def post_norm_residual(module: nn.Module, session: Session) -> Replacements:
    """BERT's `...SelfOutput` / `...Output` (LXMERT's alike): `LayerNorm(dropout(dense(h)) + input)`, the add under
    the add rule."""

    def forward(hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return module.LayerNorm(add(session, module.dropout(module.dense(hidden_states)), input_tensor))

    return {"forward": forward}


def transformers_leaves() -> dict[type, ForwardFactory]:
    """The default leaf map plus every activation module transformers builds (`ACT2CLS`)."""
    from transformers.activations import ACT2CLS

    classes = [entry[0] if isinstance(entry, tuple) else entry for entry in ACT2CLS.values()]
    return {**default_leaves(), **{cls: ACTIVATION for cls in classes if isinstance(cls, type)}}


def _elsewhere(config: object) -> tuple[bool, str | None]:
    """`(True, the config's own implementation)` in a thread other than the one holding a switch of `config`, else
    `(False, None)`."""
    entry = _switches.get(id(config))
    if entry is None or acts_for(entry[0]):  # the switching thread, or its work in another (guard.acting_for)
        return False, None
    return True, entry[1]


def _own_attention(module: nn.Module, implementation: str | None) -> Callable[..., Any]:
    """The attention function `module` runs under `implementation` (its modeling file's eager one for "eager")."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation not in (None, "eager") and implementation in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[implementation]
    return sys.modules[type(module).__module__].eager_attention_forward


def register_gated(name: str, attention: Callable[..., Any], mask: Callable[..., Any]) -> None:
    """Register `attention` and its `mask` function under `name` in transformers' registries, acting only in the
    thread that switched the config to `name` (`switch_attention`); in any other thread the config's own
    implementation's attention and mask run instead."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    def gated_attention(module, *args, **kwargs):
        other, own = _elsewhere(getattr(module, "config", None))
        return (_own_attention(module, own) if other else attention)(module, *args, **kwargs)

    def gated_mask(*args, **kwargs):
        other, own = _elsewhere(kwargs.get("config"))
        return (ALL_MASK_ATTENTION_FUNCTIONS.get(own or "eager", eager_mask) if other else mask)(*args, **kwargs)

    AttentionInterface.register(name, gated_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, gated_mask)


def _eager(module, *args, **kwargs):
    """transformers' own eager attention of `module`'s model."""
    return _own_attention(module, "eager")(module, *args, **kwargs)


def register_exact_attention() -> None:
    """Register the exact eager attention under EXACT_ATTENTION and transformers' own eager one under EAGER, each
    with transformers' eager mask, thread-gated."""
    from transformers.masking_utils import eager_mask

    register_gated(EXACT_ATTENTION, exact_eager_attention, eager_mask)
    register_gated(EAGER, _eager, eager_mask)


def switch_attention(configs: list, name: str) -> Callable[[], None]:
    """Switch `configs` to the gated implementation `name` for the calling thread (other threads keep running each
    config's own implementation); returns what gives every config back its implementation. Nested switches by one
    thread keep the outermost's record of the config's own implementation."""
    before = [getattr(c, "_attn_implementation", None) for c in configs]
    owner = threading.get_ident()
    with _switches_lock:
        for config, own in zip(configs, before):
            entry = _switches.get(id(config))
            if entry is None:
                entry = _switches[id(config)] = [None, own, 0]
                weakref.finalize(config, _switches.pop, id(config), None)
            if entry[2] == 0:
                entry[0], entry[1] = owner, own
            entry[2] += 1
    for config in configs:
        config._attn_implementation = name

    def restore() -> None:
        for config, value in zip(configs, before):  # parents first: a parent's setter also sets its sub-configs
            if getattr(config, "_attn_implementation", None) != value:
                config._attn_implementation = value
        with _switches_lock:
            for config in configs:
                entry = _switches[id(config)]
                entry[2] -= 1
                if entry[2] == 0:
                    entry[0] = None  # kept: a forward that read the name just before may still call in
    return restore


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
    """Eval mode and, with `implementation` (EXACT_ATTENTION, or EAGER: transformers' own eager attention), that
    attention in every config of the model for one call, in the calling thread (`switch_attention`); modes and
    implementations restored after, also after an exception."""
    with eval_mode(model):
        restore = None
        try:
            if implementation is not None:
                register_exact_attention()
                restore = switch_attention(transformers_configs(model), implementation)
            yield
        finally:
            if restore is not None:
                restore()


class TransformersImageCalls:
    """What the adapter of a transformers image model (`self.model` with its config) says of its inputs and switches for
    a call; shared by the ViT and Swin adapters, placed before their adapter base class."""

    model: nn.Module

    def describe_inputs(self, inputs: torch.Tensor) -> dict:
        """The input size; the normalisation where the config records it (as `relevancy.models.dinov2_small` does)."""
        return config_image_fields(self.model.config, inputs)

    def explaining(self, attention_probabilities: bool) -> AbstractContextManager[None]:
        """Eval mode and, if asked, the exact eager attention for one call; both restored after."""
        return explaining_call(self.model, EXACT_ATTENTION if attention_probabilities else None)

    def shared_state(self) -> list[object]:
        """The configs whose attention implementation `explaining` switches: models built from one config share it."""
        return transformers_configs(self.model)
