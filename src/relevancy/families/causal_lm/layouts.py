"""The decoder layouts relevancy knows, as small maps of their differences: where the decoder, its embeddings, its
attention's output projection, its MLPs and its norms are, and how each MLP and norm runs under a relevance rule set (see `lrp.attnlrp`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ...lrp import attnlrp
from ...lrp.attnlrp import RuleSet
from ...lrp.engine import ForwardFactory
from .rules import gpt2_rules, llama_rules

#: a module and a rule set -> the forward that replaces the module's for one call
RuleForward = Callable[[nn.Module, RuleSet], Callable[[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class Layout:
    """One decoder layout: `model_types` (transformers' `config.model_type`), the attribute of the bare decoder on
    the `...ForCausalLM` model, of its token embeddings and its list of layers on the decoder, of the self-attention
    and of the norm before it on a layer, of the attention's output projection on the attention (its input: the
    heads' outputs side by side), `rules`: which modules run under an AttnLRP rule set (a test on the module)
    and the forward they run instead (attention is switched through the config), and `rule_map`: the rule map
    for the seeds' LRP methods from the model, its decoder and its layers (see `rules.py`)."""

    name: str
    model_types: tuple[str, ...]
    decoder: str
    embeddings: str
    layers: str
    attention: str
    attention_norm: str
    attention_output: str
    rules: tuple[tuple[Callable[[nn.Module], bool], RuleForward], ...]
    rule_map: Callable[[nn.Module, nn.Module, list[nn.Module]], dict[type, ForwardFactory]]

    def rule_forward(self, module: nn.Module) -> RuleForward | None:
        """The rule forward of `module`, None where it runs as it is."""
        return next((forward for matches, forward in self.rules if matches(module)), None)


def _has(*attributes: str) -> Callable[[nn.Module], bool]:
    return lambda module: all(hasattr(module, a) for a in attributes)


def _gated_mlp(module: nn.Module, rules: RuleSet) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: attnlrp.gated_mlp(rules, module.gate_proj, module.up_proj, module.down_proj, module.act_fn, x)


def _rms_norm(module: nn.Module, rules: RuleSet) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: attnlrp.rms_norm(x, module.weight, module.variance_epsilon)


def _plain_mlp(module: nn.Module, rules: RuleSet) -> Callable[[torch.Tensor], torch.Tensor]:
    """GPT-2's MLP: `c_proj(act(c_fc(x)))`, the activation under the identity rule (its dropout is off in eval)."""
    return lambda x: module.c_proj(rules.activation(module.act, module.c_fc(x)))


def _layer_norm(module: nn.Module, rules: RuleSet) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: attnlrp.layer_norm(x, module)


LLAMA = Layout(
    "llama", ("llama", "mistral", "qwen2"), decoder="model", embeddings="embed_tokens", layers="layers", attention="self_attn",
    attention_norm="input_layernorm", attention_output="o_proj",
    rules=((_has("gate_proj", "up_proj", "down_proj", "act_fn"), _gated_mlp), (_has("weight", "variance_epsilon"), _rms_norm)),
    rule_map=llama_rules,
)
GPT2 = Layout(
    "gpt2", ("gpt2",), decoder="transformer", embeddings="wte", layers="h", attention="attn", attention_norm="ln_1",
    attention_output="c_proj",
    rules=((_has("c_fc", "c_proj", "act"), _plain_mlp), (lambda module: isinstance(module, nn.LayerNorm), _layer_norm)),
    rule_map=gpt2_rules,
)
LAYOUTS = (LLAMA, GPT2)


def layout_of(model: nn.Module) -> Layout | None:
    """The layout of a transformers `...ForCausalLM` / `...LMHeadModel`, or None."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for layout in LAYOUTS:
        if model_type in layout.model_types and hasattr(model, layout.decoder) and hasattr(model, "lm_head"):
            return layout
    return None
