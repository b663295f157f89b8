"""The decoder layouts: where a transformers `...ForCausalLM` keeps its parts, what each part must be, and the one
rule map of each layout, written once in the rule vocabulary (`lrp.rule_sets`) for every rule set: the seeds'
explicit relevance pass (transformer attribution, LRP, partial LRP under `PAPER` / `VANILLA`) and the modified
gradient of AttnLRP and CP-LRP.

A layout is chosen by `config.model_type` and then checked on the model's own modules (types, shapes, and what a
norm or an MLP computes on a probe input: Llama's RMSNorm `x / rms(x) * w` and Gemma's `x / rms(x) * (1 + w)` have the
same parameters and differ only there). A model whose name says one layout and whose layers say another is
refused, naming the first part that does not fit; a model of an unknown `model_type` is taken by the first layout
its modules fit.

The rule map of a layout: each part's forward in the engine's operations (`Part.forward`: norms, MLPs, a mixture's
experts), the layer's residual adds (`Residual`: pre-norm, Gemma's norms around both branches, OLMo 2's after
them, GPT-NeoX's parallel branches, Cohere's from one norm), and attention through the config: the adapter
switches every config to relevancy's attention (`lrp.attention.attend`), which reads the call's session off the
attention module. Under a rule set that carries a gradient the layers run as they are (their additions' gradient
is the rule); under an explicit one every module runs through the rule map (`rule_map`), RoPE's rotation passing
relevance coordinate by coordinate (a position-dependent rotation carries no relevance of its own).
"""
from __future__ import annotations

import functools
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...core import dispatch, linears
from ...lrp import gradient
from ...lrp.engine import ACTIVATION as ACTIVATION_LEAF
from ...lrp.engine import (
    ForwardFactory, MissingRuleError, Replacements, Session, activation, add, branch, by_type, gate, leaf, linear,
    normalisation, passthrough, replaced, unchanged,
)
from ...lrp.rule_sets import weight_rule
from ..base import UnsupportedModelError
from ..hf_attention import gated_activation, gated_forward, gated_product, transformers_leaves
from . import recurrent

#: the attribute of an attention module (a seeds' relevance session) or of a config (a gradient rule set's session, for
#: every attention of the config's modules) that holds the call's session, read by relevancy's attention
SESSION = "relevancy_session"
#: a module and the call's session -> the forward that replaces the module's for one call
RuleForward = Callable[[nn.Module, Session], Callable[..., torch.Tensor]]
#: a module and the model's width -> whether it is the part (types, shapes, what it computes)
Fits = Callable[[nn.Module, int], bool]


@dataclass(frozen=True)
class Part:
    """A kind of module a layout rules: `what` it must be (named in a refusal), whether a module `fits`, its rule
    forward (None: it runs as it is under the rules), `owns`: the children (or its own parameters: gpt-oss's
    sinks) whose parameters it accounts for, those the module has (None: all; attention accounts for its
    projections, its query and key norms are parts of their own) and
    `inner`: children that run a rule forward of their own (a mixture's experts)."""

    what: str
    fits: Fits
    forward: RuleForward | None = None
    owns: tuple[str, ...] | None = None
    inner: tuple[tuple[str, "Part"], ...] = ()

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The parameters of `module` this part accounts for."""
        if self.owns is None:
            return list(module.parameters())
        owned = [item for item in (getattr(module, name) for name in self.owns) if item is not None]  # DeepSeek's q_proj or q_a_proj
        return [p for item in owned for p in ([item] if isinstance(item, nn.Parameter) else item.parameters())]


@functools.lru_cache(maxsize=None)
def _signature(layer_type: type) -> inspect.Signature:
    return inspect.signature(layer_type.forward)


def _by_name(layer: nn.Module, args: tuple, kwargs: dict) -> dict:
    """A layer's inputs after the hidden states, by the names of its own forward (GPT-2's come in order); refused
    where they hold a KV cache or cross-attention: relevance runs over the whole sequence at once."""
    named = _signature(type(layer)).bind(layer, None, *args, **kwargs).arguments
    named = {**{key: value for key, value in list(named.items())[2:] if key != "kwargs"}, **named.get("kwargs", {})}
    if any(named.get(name) is not None for name in ("cache", "past_key_values", "layer_past", "encoder_hidden_states")):
        raise MissingRuleError("relevance propagation runs decoders over the whole sequence: no KV cache, no cross-attention")
    return named


@dataclass(frozen=True)
class Residual:
    """How a layer adds its attention and its MLP to the residual stream, by the names of its modules: the norms
    `before_...` a branch (its input) and `after_...` it (its output; None: no such norm; one norm named before both
    is computed once and read by both, as Cohere computes it), `parallel`, the layer's flag that says the MLP reads
    the layer's input beside attention (GPT-NeoX) or True where it always does (Cohere), summed as the model sums,
    and `branch_scale`, the layer's attribute that scales each branch's output before its add (Granite's
    `residual_multiplier`; a pair: attention's and the MLP's, InternViT's layer scale `lambda_1`, `lambda_2`; a
    constant factor passes relevance)."""

    attention: str
    mlp: str
    before_attention: str | None
    before_mlp: str | None
    after_attention: str | None = None
    after_mlp: str | None = None
    parallel: str | bool | None = None
    branch_scale: str | tuple[str, str] | None = None

    def is_parallel(self, layer: nn.Module) -> bool:
        """Whether `layer` feeds its MLP beside attention."""
        return self.parallel is True or (isinstance(self.parallel, str) and bool(getattr(layer, self.parallel)))

    def rule(self, layer: nn.Module, session: Session) -> Replacements:
        """The layer's forward with both residual adds under the add rule, each input feeding two branches."""

        def around(name: str | None, x: torch.Tensor) -> torch.Tensor:
            return x if name is None else getattr(layer, name)(x)

        def mlp(x: torch.Tensor) -> torch.Tensor:  # gpt-oss's mixture returns its router's scores beside its output
            out = getattr(layer, self.mlp)(x)
            return out[0] if isinstance(out, tuple) else out

        def scaled(x: torch.Tensor, branch: int) -> torch.Tensor:
            if self.branch_scale is None:
                return x
            name = self.branch_scale if isinstance(self.branch_scale, str) else self.branch_scale[branch]
            return passthrough(session, lambda t: t * getattr(layer, name), x)

        def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            named = _by_name(layer, args, kwargs)
            x = branch(session, hidden_states)
            shared = self.before_attention is not None and self.before_attention == self.before_mlp
            normed = branch(session, around(self.before_attention, x)) if shared else around(self.before_attention, x)
            attended = scaled(around(self.after_attention, getattr(layer, self.attention)(normed, **named)[0]), 0)
            if self.is_parallel(layer):
                fed = scaled(around(self.after_mlp, mlp(normed if shared else around(self.before_mlp, x))), 1)
                return add(session, add(session, fed, attended), x)
            x = branch(session, add(session, x, attended))
            return add(session, x, scaled(around(self.after_mlp, mlp(around(self.before_mlp, x))), 1))

        return {"forward": forward}


@dataclass(frozen=True)
class LogitScale:
    """The config's `attribute` a model scales its logits by: multiplied (Cohere's `logit_scale`) or, with
    `divides`, divided (Granite's `logits_scaling`), as the model computes it; a constant factor passes relevance."""

    attribute: str
    divides: bool = False

    def __call__(self, logits: torch.Tensor, config: object) -> torch.Tensor:
        factor = getattr(config, self.attribute)
        return logits / factor if self.divides else logits * factor


@dataclass(frozen=True)
class Layout:
    """One decoder layout: `classes` (the transformers classes it maps, for messages), `model_types`
    (`config.model_type`), the attribute of the bare decoder on the model, of its token embeddings and its list of
    layers on the decoder, of the self-attention on a layer and of what its output is read at for CDAM (the norm
    before attention; None where attention reads the residual stream: the layer's input), of the attention's
    output projection on the attention (its input: the heads' outputs side by side); `parts`: (path on a
    layer, the kinds of module it may be) and `final`: (path on the decoder, kind) - every module the rules touch;
    `residual`: how a layer adds its branches to the residual stream; `logit_scale`: how the model scales its logits
    (Granite's division by `logits_scaling`, Cohere's product with `logit_scale`; None: not at all);
    `embedding_scale`: the decoder's attribute that scales the embeddings it looks up itself but not those it is given
    (Falcon-H1's `embedding_multiplier`), applied by the adapter, which gives the decoder embeddings. `state_space`:
    what mixes tokens beside or instead of attention (Mamba's mixers, Falcon-H1's), said in the refusal of the methods
    that read attention alone; such a decoder (Mamba: no attention, `attention` and `attention_output` None) has no
    explicit rule map (`residual` None: its layers run as they are under the gradient rules, their residual adds'
    gradient the add rule). `mixer`: what a hybrid's layers without attention mix tokens with, named in the refusal
    of the methods that read attention. `linear_attention`: the kind of module at `attention` that is a linear
    attention (MiniMax keeps its lightning attention under the softmax attention's name): its layers have none.
    """

    name: str
    classes: tuple[str, ...]
    model_types: tuple[str, ...]
    decoder: str
    embeddings: str
    layers: str
    attention: str | None
    attention_norm: str | None
    attention_output: str | None
    parts: tuple[tuple[str, tuple[Part, ...]], ...]
    final: tuple[str, Part]
    residual: Residual | None
    logit_scale: LogitScale | None = None
    embedding_scale: str | None = None
    state_space: str | None = None
    mixer: str = "linear-attention"
    linear_attention: Part | None = None

    def attentionless(self, decoder: nn.Module) -> list[int]:
        """The indices of the bare `decoder`'s layers without softmax attention: every layer of a state-space decoder,
        a hybrid's layers without an attention module or whose attention is the layout's `linear_attention` (the
        bare decoder's: a vision-language model's decoder is one part of it)."""
        width, layers = _width(decoder), getattr(decoder, self.layers)
        modules = [None if self.attention is None else getattr(layer, self.attention, None) for layer in layers]
        return [index for index, module in enumerate(modules)
                if module is None or (self.linear_attention is not None and self.linear_attention.fits(module, width))]

    def misfit(self, model: nn.Module) -> str | None:
        """What in `model` does not fit this layout (the first such part, by its path), or None."""
        width = _width(model)
        decoder = getattr(model, self.decoder, None)
        layers = getattr(decoder, self.layers, None)
        if decoder is None or not isinstance(layers, nn.ModuleList) or model.get_output_embeddings() is None:
            return f"{type(model).__name__} has no .{self.decoder}.{self.layers} (a list of layers) and output embeddings"
        if not isinstance(getattr(decoder, self.embeddings, None), nn.Embedding):
            return f"{self.decoder}.{self.embeddings} is not the token embedding"
        for index, layer in enumerate(layers):
            problem = layer_misfit(layer, self.parts, width, f"{self.decoder}.{self.layers}.{index}", self.name)
            if problem is not None:
                return problem
        path, kind = self.final
        module = _get(decoder, path)
        if _kind(module, (kind,), width) is None:
            return f"{self.decoder}.{path} ({type(module).__name__}) is not {kind.what}"
        return None

    def ruled(self, model: nn.Module) -> list[tuple[nn.Module, RuleForward]]:
        """Every module of a fitting `model` that runs a rule forward under a rule set, with it."""
        width = _width(model)
        decoder = getattr(model, self.decoder)
        found = [(_get(layer, path), kinds) for layer in getattr(decoder, self.layers) for path, kinds in self.parts]
        found.append((_get(decoder, self.final[0]), (self.final[1],)))
        return rule_forwards(found, width)


def layer_misfit(layer: nn.Module, parts: tuple[tuple[str, tuple[Part, ...]], ...], width: int, where: str, name: str) -> str | None:
    """What in `layer` (at `where`) does not fit `parts` (path on the layer, the kinds of module it may be) of the
    layout `name`: the first part that fits none of its kinds, or a parameter that belongs to no part; None."""
    known = set()
    for path, kinds in parts:
        module = _get(layer, path)
        kind = _kind(module, kinds, width)
        if kind is None:
            found = type(module).__name__ if module is not None else "nothing"
            unknown = linears.unknown_linear(module) if module is not None else None
            if unknown is not None:  # a quantization relevancy does not read, rather than another structure
                name, child = unknown
                return (f"{where}.{path}{'.' + name if name else ''} ({type(child).__module__}.{type(child).__name__}) is a linear "
                        "layer of a kind relevancy does not read (it reads nn.Linear, bitsandbytes' 4- and 8-bit layers, peft's "
                        "LoRA layers and weights that dequantize themselves); dequantize the model first (e.g. model.dequantize(), "
                        "or load it without quantization)")
            return f"{where}.{path} ({found}) is not {' or '.join(k.what for k in kinds)}"
        known.update(id(p) for p in kind.parameters(module))
    unknown = next((path for path, p in layer.named_parameters() if id(p) not in known), None)
    if unknown is not None:  # e.g. a norm this layout does not rule
        return f"{where}.{unknown} belongs to no part of the {name} layout"
    return None


def rule_forwards(found: list[tuple[nn.Module, tuple[Part, ...]]], width: int) -> list[tuple[nn.Module, RuleForward]]:
    """Each fitting module's rule forward (and its inner parts'), for modules that fit one of their kinds."""
    ruled = []
    for module, kinds in found:
        kind = _kind(module, kinds, width)
        if kind.forward is not None:
            ruled.append((module, kind.forward))
        ruled.extend((getattr(module, name), part.forward) for name, part in kind.inner)
    return ruled


def _get(module: nn.Module, path: str) -> nn.Module | None:
    """The module at the dotted `path` on `module` ("" for itself: a part that is the whole module), or None."""
    for name in path.split(".") if path else ():
        module = getattr(module, name, None)
    return module if isinstance(module, nn.Module) else None


def _width(model: nn.Module) -> int:
    return getattr(model.config, "hidden_size", None) or model.config.n_embd


def _kind(module: nn.Module | None, kinds: tuple[Part, ...], width: int) -> Part | None:
    """The first of `kinds` that `module` fits (no module: `ABSENT` where it is one of them), or None."""
    if module is None:
        return ABSENT if ABSENT in kinds else None
    return next((kind for kind in kinds if kind.fits(module, width)), None)


# -- the parts: what each must be ------------------------------------------------------------------------------
def _linear(module: object, inputs: int | None = None, outputs: int | None = None) -> bool:
    """A linear layer (plain, quantized or LoRA-adapted: `core.linears`) of the given features."""
    return (linears.is_linear(module) and (inputs is None or linears.features(module)[0] == inputs)
            and (outputs is None or linears.features(module)[1] == outputs))


def _project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x W^T + b` of a linear layer in `x`'s dtype from its effective weight and bias (dequantized, adapters added;
    the bias where it has one: Qwen2.5-VL's tower MLPs), or through its own forward in the dtype it computes in where
    no weight can be read (DoRA, a quantization relevancy does not know: the gradient methods run through its forward;
    the explicit rules refuse it)."""
    try:
        weight, bias = linears.effective(linear)
    except linears.UnreadableLinearError:
        return linear(x.to(linears.compute_dtype(linear))).to(x.dtype)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _probe(module: nn.Module, width: int | tuple[int, ...]) -> torch.Tensor:
    """A fixed input `(2, width)` (`(2, *width)` for a tuple: Cohere's norm per head) in the dtype and on the device
    the module computes in (a quantized layer's packed bytes are not its dtype; an offloaded module's weights sit on
    the meta device)."""
    device = dispatch.execution_device(module)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = width if isinstance(width, tuple) else (width,)
    return torch.randn(2, *shape, generator=generator, device=device).to(linears.compute_dtype(module))


def _computes(module: nn.Module, width: int | tuple[int, ...], expected: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether the module's own forward gives `expected` on a probe input (to its dtype's precision, and to LLM.int8()'s
    where a layer quantizes its input too). `expected` gets the probe in float32 at least and reads the weights in that
    dtype (`x.dtype`), loaded where accelerate offloads them: a float32 model's weights are not copied (a 7B model's MLP
    weight in float64 would be a first call's largest allocation)."""
    x = _probe(module, width)
    with torch.no_grad(), linears.cpu_packing_undone(module):  # a probe must not repack a 4-bit layer's weights
        y = module(x).double()  # its own forward (which loads and offloads its weights itself)
        with dispatch.loaded(module):
            want = expected(x.to(torch.promote_types(x.dtype, torch.float32))).double()
    tolerance = 5e-2 if any(linears.quantizes_activations(m) for m in module.modules()) else 2e-2 if x.element_size() < 4 else 1e-4
    return y.shape == want.shape and bool(((y - want).abs() <= tolerance * want.abs().max().clamp(min=1e-12)).all())


def _eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _fits_rms_norm(one_plus: bool) -> Fits:
    def fits(module: nn.Module, width: int) -> bool:
        weight, eps = getattr(module, "weight", None), _eps(module)
        if not isinstance(weight, nn.Parameter) or weight.ndim != 1 or eps is None or getattr(module, "bias", None) is not None:
            return False
        return _computes(module, len(weight), lambda x: _normalised(x, eps) * (module.weight.to(x.dtype) + (1.0 if one_plus else 0.0)))

    return fits


def _fits_centred_norm(module: nn.Module, width: int) -> bool:
    """Cohere's LayerNorm: `(x - mean(x)) / std(x) * w` over the last dimension, a weight and no bias (its query and
    key norms: a weight per head, `(heads, head_dim)`)."""
    weight, eps = getattr(module, "weight", None), _eps(module)
    if not isinstance(weight, nn.Parameter) or weight.ndim not in (1, 2) or eps is None or getattr(module, "bias", None) is not None:
        return False
    return _computes(module, tuple(weight.shape), lambda x: gradient.centred_norm(x, module.weight.to(x.dtype), None, eps))


def _fits_layer_norm(module: nn.Module, width: int) -> bool:
    return isinstance(module, nn.LayerNorm) and module.normalized_shape == (width,)


def fits_gated_mlp(names: tuple[str, str, str], act: Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor] | None]) -> Fits:
    """A gated MLP `down(act(gate(x)) * up(x))` of consistent shapes, its linears by `names` (gate, up, down) and its
    activation read off the module by `act` (None: it has none)."""

    def fits(module: nn.Module, width: int) -> bool:
        gate, up, down = (getattr(module, name, None) for name in names)
        activation_of = act(module)
        if not (_linear(gate, width) and _linear(up, width, getattr(gate, "out_features", None))
                and _linear(down, getattr(gate, "out_features", None), width) and activation_of is not None):
            return False
        return _computes(module, width, lambda x: _project(down, activation_of(_project(gate, x)) * _project(up, x)))

    return fits


_fits_gated_mlp = fits_gated_mlp(("gate_proj", "up_proj", "down_proj"), gated_activation)


def _fits_fused_gated_mlp(module: nn.Module, width: int) -> bool:
    """Phi-3's MLP: `down(up * act(gate))` with `gate, up = gate_up_proj(x).chunk(2)`."""
    fused, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (_linear(fused, width) and _linear(down, fused.out_features // 2, width) and callable(getattr(module, "activation_fn", None))):
        return False

    def expected(x: torch.Tensor) -> torch.Tensor:
        gate, up = _project(fused, x).chunk(2, dim=-1)
        return _project(down, up * module.activation_fn(gate))

    return fused.bias is None and down.bias is None and _computes(module, width, expected)


def _fits_falcon_h1_mlp(module: nn.Module, width: int) -> bool:
    """Falcon-H1's MLP `down(up(x) * act(gate(x) * m_gate)) * m_down`."""
    gate, up, down = (getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    inner = getattr(gate, "out_features", None)
    if not (_linear(gate, width) and _linear(up, width, inner) and _linear(down, inner, width)
            and all(isinstance(getattr(module, name, None), (int, float)) for name in ("gate_multiplier", "down_multiplier"))):
        return False
    return _computes(module, width, lambda x: _project(down, module.act_fn(_project(gate, x) * module.gate_multiplier)
                                                       * _project(up, x)) * module.down_multiplier)


def fits_plain_mlp(into: str, out: str, act: str) -> Fits:
    """`out(act(into(x)))` (GPT-2's `Conv1D`s, GPT-NeoX's Linears)."""

    def fits(module: nn.Module, width: int) -> bool:
        first, second = getattr(module, into, None), getattr(module, out, None)
        if first is None or second is None or not callable(getattr(module, act, None)):
            return False
        from transformers.pytorch_utils import Conv1D

        shapes = [(layer.weight.shape[0], layer.weight.shape[1]) if isinstance(layer, Conv1D)
                  else linears.features(layer) if linears.is_linear(layer) else None for layer in (first, second)]
        return None not in shapes and shapes[0][0] == width and shapes[0][1] == shapes[1][0] and shapes[1][1] == width

    return fits


def _fits_router(module: nn.Module, width: int) -> bool:
    """A top-k router: a weight `(experts, width)` and `top_k`."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.ndim == 2 and weight.shape[1] == width and isinstance(getattr(module, "top_k", None), int)


def _fits_experts(module: nn.Module, width: int) -> bool:
    """Experts stored as `gate_up_proj (E, 2I, width)` and `down_proj (E, width, I)` (transformers 5's MoE layers)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.ndim == 3 and down.ndim == 3
            and gate_up.shape[2] == width and down.shape == (gate_up.shape[0], width, gate_up.shape[1] // 2)
            and callable(getattr(module, "act_fn", None)) and getattr(module, "num_experts", None) == gate_up.shape[0])


def _fits_gpt_oss_experts(module: nn.Module, width: int) -> bool:
    """gpt-oss's experts: `gate_up_proj (E, width, 2I)` (gate and up interleaved) and `down_proj (E, I, width)`
    stored transposed, each with a bias, and the clamped SwiGLU's `alpha` and `limit`."""
    shapes = [getattr(getattr(module, name, None), "shape", None) for name in
              ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]
    if None in shapes or len(shapes[0]) != 3:
        return False
    experts, inner = shapes[0][0], shapes[0][2] // 2
    return (tuple(shapes[0]) == (experts, width, 2 * inner) and tuple(shapes[1]) == (experts, 2 * inner)
            and tuple(shapes[2]) == (experts, inner, width) and tuple(shapes[3]) == (experts, width)
            and getattr(module, "num_experts", None) == experts
            and all(isinstance(getattr(module, name, None), float) for name in ("alpha", "limit")))


def _fits_gpt_oss_mixture(module: nn.Module, width: int) -> bool:
    """gpt-oss's mixture: a top-k `router` with a bias over as many `experts` as it scores."""
    router, experts = getattr(module, "router", None), getattr(module, "experts", None)
    return (router is not None and experts is not None and _fits_router(router, width) and _fits_gpt_oss_experts(experts, width)
            and isinstance(getattr(router, "bias", None), nn.Parameter) and router.weight.shape[0] == experts.gate_up_proj.shape[0])


def _fits_sink_attention(module: nn.Module, width: int) -> bool:
    """gpt-oss's self-attention: Llama's projections and a sink logit per query head (`sinks`)."""
    sinks = getattr(module, "sinks", None)
    return (fits_attention("q_proj", "k_proj", "v_proj", "o_proj")(module, width) and isinstance(sinks, nn.Parameter)
            and sinks.ndim == 1 and linears.features(module.q_proj)[1] == len(sinks) * getattr(module, "head_dim", 0))


def _fits_latent_attention(module: nn.Module, width: int) -> bool:
    """DeepSeek-V3's multi-head latent attention: the queries from `q_proj` or through the low-rank `q_a_proj` (its
    norm `q_a_layernorm` a part of its own) and `q_b_proj`, `(heads, nope + rope)`; `kv_a_proj_with_mqa` to the
    compressed latent and the one rotated key part all heads share, `kv_b_proj` from the latent to each head's
    unrotated key and value `(heads, nope + v)`; `o_proj` from the heads' values back to the width."""
    sizes = [getattr(module, name, None) for name in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")]
    if not all(isinstance(size, int) for size in sizes):
        return False
    heads, nope, rope, value, rank = sizes
    low_rank, width_of_queries = getattr(module, "q_a_proj", None), heads * (nope + rope)
    queries = (_linear(low_rank, width) and _linear(getattr(module, "q_b_proj", None), linears.features(low_rank)[1], width_of_queries)
               if low_rank is not None else _linear(getattr(module, "q_proj", None), width, width_of_queries))
    return (queries and _linear(getattr(module, "kv_a_proj_with_mqa", None), width, rank + rope)
            and _linear(getattr(module, "kv_b_proj", None), rank, heads * (nope + value))
            and _linear(getattr(module, "o_proj", None), heads * value, width))


def _fits_weightless_norm(module: nn.Module, width: int) -> bool:
    """Llama 4's query and key norm (`Llama4TextL2Norm`): `x / rms(x)`, no parameter."""
    eps = _eps(module)
    return eps is not None and next(module.parameters(), None) is None and _computes(module, width, lambda x: _normalised(x, eps))


def _fits_input_gated_experts(module: nn.Module, width: int) -> bool:
    """Llama 4's experts: `gate_up_proj (E, width, 2I)` (gate, then up) and `down_proj (E, I, width)` stored
    transposed, no biases."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.ndim == 3
            and gate_up.shape[1] == width and tuple(down.shape) == (gate_up.shape[0], gate_up.shape[2] // 2, width)
            and callable(getattr(module, "act_fn", None)) and getattr(module, "num_experts", None) == gate_up.shape[0])


def _fits_input_gated_mixture(module: nn.Module, width: int) -> bool:
    """Llama 4's mixture: a top-k `router` (a Linear without bias) over as many `experts` as it scores, and a gated MLP
    `shared_expert`."""
    router, experts, shared = (getattr(module, name, None) for name in ("router", "experts", "shared_expert"))
    return (router is not None and experts is not None and shared is not None and _fits_router(router, width)
            and getattr(router, "bias", None) is None and _fits_input_gated_experts(experts, width)
            and router.weight.shape[0] == experts.num_experts and _fits_gated_mlp(shared, width))


def _routes(module: nn.Module, width: int) -> bool:
    """A top-k router `gate` over as many `experts` as it scores."""
    router, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (router is not None and experts is not None and _fits_router(router, width) and _fits_experts(experts, width)
            and router.weight.shape[0] == experts.gate_up_proj.shape[0])


def _fits_mixture(module: nn.Module, width: int) -> bool:
    """Routed experts alone (Qwen3-MoE, Mixtral)."""
    return _routes(module, width) and not hasattr(module, "shared_experts")


def _fits_shared_mixture(module: nn.Module, width: int) -> bool:
    """GLM-4.5's mixture: routed experts and a gated MLP `shared_experts`."""
    shared = getattr(module, "shared_experts", None)
    return _routes(module, width) and shared is not None and _fits_gated_mlp(shared, width)


def _fits_sigmoid_gated_mixture(module: nn.Module, width: int) -> bool:
    """Qwen3-Next's mixture: routed experts, a gated MLP `shared_expert` and its gate `shared_expert_gate` (a Linear
    from the width to one number per token)."""
    shared, gate_values = getattr(module, "shared_expert", None), getattr(module, "shared_expert_gate", None)
    return _routes(module, width) and shared is not None and _linear(gate_values, width, 1) and _fits_gated_mlp(shared, width)


def _fits_gated_attention(module: nn.Module, width: int) -> bool:
    """Qwen3-Next's self-attention: Llama's projections, `q_proj` to twice the queries' width (each head's query,
    then its output gate)."""
    head_dim = getattr(module, "head_dim", None)
    return (fits_attention("q_proj", "k_proj", "v_proj", "o_proj")(module, width) and isinstance(head_dim, int)
            and linears.features(module.q_proj)[1] == 2 * linears.features(module.o_proj)[0])


def fits_attention(*projections: str) -> Fits:
    """Self-attention with Linear projections from the width (the first ones) and back to it (the last)."""

    def fits(module: nn.Module, width: int) -> bool:
        *into, out = (getattr(module, name, None) for name in projections)
        return all(_linear(p, width) for p in into) and _linear(out, None, width)

    return fits


def _fits_gpt2_attention(module: nn.Module, width: int) -> bool:
    from transformers.pytorch_utils import Conv1D

    into, out = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    return (isinstance(into, Conv1D) and isinstance(out, Conv1D) and into.weight.shape == (width, 3 * width)
            and out.weight.shape == (width, width) and not getattr(module, "is_cross_attention", False))


# -- the parts' rule forwards: the model's computation in the engine's operations ------------------------------
def _fused_gated_mlp(module: nn.Module, session: Session) -> Callable[[torch.Tensor], torch.Tensor]:
    """Phi-3's MLP `down(up * act(gate))`, `gate, up = gate_up_proj(x).chunk(2)`."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate_values, up = module.gate_up_proj(x).chunk(2, dim=-1)
        return module.down_proj(gated_product(session, module.activation_fn, gate_values, up))

    return forward


def _lfm2_mlp(module: nn.Module, session: Session) -> Callable[[torch.Tensor], torch.Tensor]:
    """LFM2's MLP `w2(silu(w1(x)) * w3(x))`: a gated MLP (the gate rule, the SiLU under the identity rule)."""
    return lambda x: module.w2(gated_product(session, F.silu, module.w1(x), module.w3(x)))


def plain_mlp(into: str, out: str, act: str) -> RuleForward:
    """`out(act(into(x)))` (dropout is off in eval)."""
    return lambda module, session: lambda x: getattr(module, out)(activation(session, getattr(module, act), getattr(module, into)(x)))


def _norm(constant_divisor: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> RuleForward:
    """A norm under the normalisation rule: its own forward, or `constant_divisor(module, x)` for a gradient rule set."""
    return lambda module, session: (lambda x, _own=module.forward: normalisation(session, _own, lambda t: constant_divisor(module, t), x))


#: the experts of a mixture, the call's session, one expert's index and its tokens `(n, D)` -> its outputs `(n, D)`
Expert = Callable[[nn.Module, Session, int, torch.Tensor], torch.Tensor]


def _mixed(expert_forward: Expert, gates_input: bool = False) -> RuleForward:
    """A mixture of experts `sum_k w_k expert_k(x)` over tokens `x (N, D)`, each token's experts `index (N, k)` and
    router weights `weights (N, k)`, each expert's outputs by `expert_forward`. An expert's output times its router
    weight is a gating product (the router weight the gate: AttnLRP half each, as lxt's qwen3_moe map; the seeds'
    rules and CP-LRP all to the expert's output). `gates_input`: the router weight multiplies the expert's input
    instead, `sum_k expert_k(w_k x)` (Llama 4), the same gating product on the input's side. The router's top-k
    runs in the model's own forward."""

    def ruled(module: nn.Module, session: Session) -> Callable[..., torch.Tensor]:
        def forward(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            slots, parts, places = index.shape[1], [], []
            for expert in index.unique().tolist():
                if expert >= module.num_experts:  # transformers' marker of an unused slot
                    continue
                token, slot = torch.where(index == expert)
                weight = weights[token, slot, None]
                if gates_input:
                    parts.append(expert_forward(module, session, expert, gate(session, x[token], weight).to(x.dtype)))
                else:
                    parts.append(gate(session, expert_forward(module, session, expert, x[token]), weight).to(x.dtype))
                places.append(token * slots + slot)
            # each token's experts side by side (N, k, D), then summed slot by slot under the add rule
            chosen = x.new_zeros(len(x) * slots, x.shape[-1]).index_copy(0, torch.cat(places), torch.cat(parts)).view(len(x), slots, -1)
            out = chosen[:, 0]
            for slot in range(1, slots):
                out = add(session, out, chosen[:, slot])
            return out

        return forward

    return ruled


def _gated_expert(module: nn.Module, session: Session, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert of `gate_up (E, 2I, D)`, `down (E, D, I)` (transformers 5's Qwen3-MoE and Mixtral): a gated MLP."""
    into, back = module.gate_up_proj[expert], module.down_proj[expert]
    gate_values, up = linear(session, lambda t: F.linear(t, into), x, into).chunk(2, dim=-1)
    return linear(session, lambda t: F.linear(t, back), gated_product(session, module.act_fn, gate_values, up), back)


def _clamped_swiglu_expert(module: nn.Module, session: Session, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One of gpt-oss's experts: `gate, up` interleaved in `x W1 + b1` (`W1 (D, 2I)` stored transposed), the clamped
    SwiGLU `(clamp(up, -l, l) + 1) * g sigmoid(alpha g)` with `g = clamp(gate, max=l)`, then `. W2 + b2`. The
    product is a gated MLP's (the house's gate rule: AttnLRP half each, CP-LRP all to the up side, the gate held
    constant), `g sigmoid(alpha g)` under the activation rule. The clamps are the model's own: their derivative (1
    within the limits, 0 where they cut: a cut value is the constant limit) carries the gradient and, in an
    explicit pass, the relevance; the `+ 1` is a constant like the biases (under a gradient rule set it takes its
    share of relevance; an explicit pass moves relevance through it unchanged)."""
    into, into_bias = module.gate_up_proj[expert], module.gate_up_proj_bias[expert]
    back, back_bias = module.down_proj[expert], module.down_proj_bias[expert]
    gate_up = linear(session, lambda t: t @ into + into_bias, x, into.t())
    gate_values, up = gate_up[..., ::2].clamp(max=module.limit), gate_up[..., 1::2].clamp(-module.limit, module.limit) + 1
    hidden = gated_product(session, lambda g: g * torch.sigmoid(g * module.alpha), gate_values, up)
    return linear(session, lambda t: t @ back + back_bias, hidden, back.t())


def _shared_mixture(module: nn.Module, session: Session) -> Callable[[torch.Tensor], torch.Tensor]:
    """GLM-4.5's mixture `experts(x; router(x)) + shared_experts(x)`: the router as the model runs it (sigmoid scores,
    the correction bias choosing the experts only, grouped top-k, the weights normalised and times
    `routed_scaling_factor`; its weights are the gates of `_mixed`'s gating products, the gate rule), the routed
    experts under `_mixed`'s rules, the shared experts a gated MLP, the two summed under the add rule (`x` feeding
    both)."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        x = branch(session, hidden_states)
        _, weights, index = module.gate(x)
        routed = module.experts(x.reshape(-1, x.shape[-1]), index, weights).view_as(x)
        return add(session, routed, module.shared_experts(x))

    return forward


def _transposed_gated_expert(module: nn.Module, session: Session, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One of Llama 4's experts: `(act(g) * u) W2` with `g, u = x W1` (`W1 (D, 2I)`, `W2 (I, D)` stored transposed):
    a gated MLP."""
    into, back = module.gate_up_proj[expert], module.down_proj[expert]
    gate_values, up = linear(session, lambda t: t @ into, x, into.t()).chunk(2, dim=-1)
    return linear(session, lambda t: t @ back, gated_product(session, module.act_fn, gate_values, up), back.t())


def _input_gated_mixture(module: nn.Module, session: Session) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Llama 4's mixture `shared_expert(x) + sum_k expert_k(s_k x)`: the router as the model runs it (its top-k
    logits, their sigmoid the scores `s_k`), each score times the expert's input a gating product (`_mixed` with
    `gates_input`: the score the gate), the shared expert a gated MLP, the two summed under the add rule (`x`
    feeding both), in the input's shape; the router's logits beside the output, as the model returns them."""

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = branch(session, hidden_states.reshape(-1, hidden_states.shape[-1]))
        scores, logits = module.router(x)
        index = logits.topk(module.router.top_k, dim=-1).indices  # the router's own choice (its `torch.topk`)
        routed = module.experts(x, index, scores.gather(1, index))
        return add(session, module.shared_expert(x), routed).view(hidden_states.shape), logits

    return forward


def _sigmoid_gated_mixture(module: nn.Module, session: Session) -> Callable[[torch.Tensor], torch.Tensor]:
    """Qwen3-Next's mixture `experts(x; router(x)) + sigmoid(shared_expert_gate(x)) * shared_expert(x)` over the
    tokens: the router as the model runs it (its weights the gates of `_mixed`'s gating products), the shared
    expert a gated MLP times its sigmoid gate (one number per token; the gate rule, the sigmoid under the identity
    rule), the two summed under the add rule (`x` feeding all)."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        x = branch(session, hidden_states.reshape(-1, hidden_states.shape[-1]))
        _, weights, index = module.gate(x)
        shared = module.shared_expert(x)
        gated_shared = gated_product(session, torch.sigmoid, module.shared_expert_gate(x).expand_as(shared), shared)
        return add(session, module.experts(x, index, weights), gated_shared).view(hidden_states.shape)

    return forward


def _gated_attention(attention: nn.Module, session: Session) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """Qwen3-Next's and Qwen3.5's full attention, the model's computation with its output gate under the gate rule:
    each head's query and gate from `q_proj`, the query and key norms (parts of their own), the modeling file's
    rotation (looked up per call: the adapter's replacement where it applies), the config's attention (relevancy's,
    under the session), then `context * sigmoid(gate)` (the gate rule, the sigmoid under the identity rule),
    `o_proj`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(attention).__module__]

    def forward(hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None,
                cache: object = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is not None:
            raise MissingRuleError("relevance propagation runs decoders over the whole sequence: no cache")
        shape, width = hidden_states.shape[:-1], attention.head_dim
        query, gate_values = attention.q_proj(hidden_states).view(*shape, -1, 2 * width).chunk(2, dim=-1)
        query = attention.q_norm(query).transpose(1, 2)
        key = attention.k_norm(attention.k_proj(hidden_states).view(*shape, -1, width)).transpose(1, 2)
        value = attention.v_proj(hidden_states).view(*shape, -1, width).transpose(1, 2)
        query, key = modeling.apply_rotary_pos_emb(query, key, *position_embeddings)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, modeling.eager_attention_forward)
        context, weights = interface(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling, **kwargs)
        context = context.reshape(*shape, -1)
        return attention.o_proj(gated_product(session, torch.sigmoid, gate_values.reshape(*shape, -1), context)), weights

    return forward


def _temperature_passing(attention: nn.Module, session: Session) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """Llama 4's attention, its own forward; on a layer without RoPE that tunes its queries' temperature
    (`attn_temperature_tuning`), in an explicit pass the queries' position-dependent factor (the model's
    `log1p(floor((t + 1) / floor_scale)) * attn_scale + 1`) is a constant passing relevance: applied to `q_proj`'s
    output (such a layer neither rotates nor norms its queries, so the factor per position commutes with the view
    to heads) and the module's own tuning off for the call (an instance attribute, as the session on attention)."""
    own = attention.forward
    if not (session.rule_set.explicit and attention.attn_temperature_tuning and not attention.use_rope):
        return own

    def forward(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        project = attention.q_proj.forward  # the call's (the Linear rule's), read when the call runs

        def scaled(x: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(x.shape[1], device=x.device)
            factor = torch.log1p(torch.floor((positions.float() + 1.0) / attention.floor_scale)) * attention.attn_scale + 1.0
            return passthrough(session, lambda t: (t * factor.view(1, -1, 1)).to(t.dtype), project(x))

        with replaced([(attention, "attn_temperature_tuning", False), (attention.q_proj, "forward", scaled)]):
            return own(*args, **kwargs)

    return forward


RMS_NORM = Part("an RMSNorm computing x / rms(x) * w", _fits_rms_norm(one_plus=False),
                _norm(lambda norm, x: gradient.rms_norm(x, norm.weight, _eps(norm))))
ONE_PLUS_RMS_NORM = Part("Gemma's RMSNorm computing x / rms(x) * (1 + w)", _fits_rms_norm(one_plus=True),
                         _norm(lambda norm, x: gradient.one_plus_rms_norm(x, norm.weight, _eps(norm))))
LAYER_NORM = Part("a LayerNorm of the model's width", _fits_layer_norm, _norm(lambda norm, x: gradient.layer_norm(x, norm)))
CENTRED_NORM = Part("a LayerNorm without bias computing (x - mean(x)) / std(x) * w", _fits_centred_norm,
                    _norm(lambda norm, x: gradient.centred_norm(x, norm.weight, None, _eps(norm))))
WEIGHTLESS_NORM = Part("a norm without weight computing x / rms(x)", _fits_weightless_norm,
                       _norm(lambda norm, x: gradient.weightless_rms_norm(x, _eps(norm))))
#: a part a layer may lack (Cohere's and GLM's query and key norms, `use_qk_norm`)
ABSENT = Part("absent", lambda module, width: False, owns=())
GATED_MLP = Part("a gated MLP down(act(gate(x)) * up(x)) of consistent shapes", _fits_gated_mlp, gated_forward)
FUSED_GATED_MLP = Part("a fused gated MLP (gate_up_proj, down_proj)", _fits_fused_gated_mlp, _fused_gated_mlp)
EXPERTS = Part("routed experts (gate_up_proj, down_proj)", _fits_experts, _mixed(_gated_expert))
GPT_OSS_EXPERTS = Part("gpt-oss's experts (gate_up_proj, down_proj and their biases, alpha, limit)", _fits_gpt_oss_experts,
                       _mixed(_clamped_swiglu_expert))
MIXTURE = Part("a mixture of experts (a top-k router `gate` and `experts` of gate_up_proj, down_proj)", _fits_mixture,
               inner=(("experts", EXPERTS),))
SHARED_MIXTURE = Part("a mixture of routed and shared experts (a top-k router `gate`, `experts`, `shared_experts`)",
                      _fits_shared_mixture, _shared_mixture, inner=(("experts", EXPERTS), ("shared_experts", GATED_MLP)))
INPUT_GATED_EXPERTS = Part("Llama 4's experts (gate_up_proj, down_proj stored transposed)", _fits_input_gated_experts,
                           _mixed(_transposed_gated_expert, gates_input=True))
INPUT_GATED_MIXTURE = Part("Llama 4's mixture (a top-k `router`, `experts` fed the scored input, a `shared_expert`)",
                           _fits_input_gated_mixture, _input_gated_mixture,
                           inner=(("experts", INPUT_GATED_EXPERTS), ("shared_expert", GATED_MLP)))
#: gpt-oss's mixture runs its own forward (its router, then the experts under their rules); it returns the router's
#: scores beside its output, which the layer drops
GPT_OSS_MIXTURE = Part("gpt-oss's mixture (a top-k `router` with a bias and `experts` with biases)", _fits_gpt_oss_mixture,
                       inner=(("experts", GPT_OSS_EXPERTS),))
ATTENTION = Part("self-attention with q_proj, k_proj, v_proj, o_proj", fits_attention("q_proj", "k_proj", "v_proj", "o_proj"),
                 owns=("q_proj", "k_proj", "v_proj", "o_proj"))
#: DeepSeek-V3's multi-head latent attention runs as it is: its projections are Linears, its norms parts of their
#: own, its rotation the file's (passing relevance in an explicit pass), its attention relevancy's
LATENT_ATTENTION = Part("multi-head latent attention (q_proj or q_a_proj and q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)",
                        _fits_latent_attention, owns=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
LLAMA4_ATTENTION = Part("Llama 4's self-attention with q_proj, k_proj, v_proj, o_proj", ATTENTION.fits, _temperature_passing,
                        owns=ATTENTION.owns)
SINK_ATTENTION = Part("self-attention with q_proj, k_proj, v_proj, o_proj and a sink per head", _fits_sink_attention,
                      owns=("q_proj", "k_proj", "v_proj", "o_proj", "sinks"))
FUSED_ATTENTION = Part("self-attention with a fused qkv_proj and o_proj", fits_attention("qkv_proj", "o_proj"), owns=("qkv_proj", "o_proj"))
NEOX_ATTENTION = Part("self-attention with a fused query_key_value and dense", fits_attention("query_key_value", "dense"),
                      owns=("query_key_value", "dense"))
GPT2_ATTENTION = Part("GPT-2's self-attention (c_attn, c_proj)", _fits_gpt2_attention, owns=("c_attn", "c_proj"))
GPT2_MLP = Part("GPT-2's MLP c_proj(act(c_fc(x)))", fits_plain_mlp("c_fc", "c_proj", "act"), plain_mlp("c_fc", "c_proj", "act"))
#: Qwen3-Next's and Qwen3.5's full attention: its output gate under the gate rule (`_gated_attention`)
GATED_ATTENTION = Part("self-attention with an output gate (q_proj to queries and gates, k_proj, v_proj, o_proj)", _fits_gated_attention,
                       _gated_attention, owns=ATTENTION.owns)
SIGMOID_GATED_MIXTURE = Part("a mixture of routed experts and a shared expert under a sigmoid gate (a top-k router `gate`, `experts`, "
                             "`shared_expert`, `shared_expert_gate`)", _fits_sigmoid_gated_mixture, _sigmoid_gated_mixture,
                             inner=(("experts", EXPERTS), ("shared_expert", GATED_MLP)))
GATED_DELTA_NET = Part("a gated DeltaNet (its projections, conv1d, A_log, dt_bias, a gated norm, out_proj)", recurrent.fits_gated_delta_net,
                       recurrent.gated_delta_net)
MAMBA_MIXER = Part("Mamba's state-space mixer (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj)", recurrent.fits_mamba_mixer,
                   recurrent.mamba_mixer)
FALCON_H1_MLP = Part("Falcon-H1's gated MLP with its gate and output multipliers", _fits_falcon_h1_mlp, recurrent.falcon_h1_mlp)
MAMBA2_MIXER = Part("Mamba-2's state-space mixer (in_proj, conv1d, A_log, D, dt_bias, a gated norm, out_proj)",
                    recurrent.fits_mamba2_mixer, recurrent.mamba2_mixer)
#: LFM2's gated short convolution, beside attention in a hybrid's other layers (`recurrent.short_convolution`)
SHORT_CONVOLUTION = Part("LFM2's gated short convolution (in_proj to B, C, x; a depth-wise conv; out_proj)", recurrent.fits_short_convolution,
                         recurrent.short_convolution)
#: MiniMax's lightning attention, at `self_attn` in its linear-attention layers (`recurrent.lightning_attention`)
LIGHTNING_ATTENTION = Part("MiniMax's lightning attention (qkv_proj, output_gate, a norm, out_proj, a decay per head)",
                           recurrent.fits_lightning_attention, recurrent.lightning_attention, owns=("qkv_proj", "output_gate", "out_proj"))
LFM2_MLP = Part("LFM2's gated MLP w2(silu(w1(x)) * w3(x))", fits_gated_mlp(("w1", "w3", "w2"), lambda module: F.silu), _lfm2_mlp)
LFM2_ATTENTION = Part("self-attention with q_proj, k_proj, v_proj, out_proj", fits_attention("q_proj", "k_proj", "v_proj", "out_proj"),
                      owns=("q_proj", "k_proj", "v_proj", "out_proj"))
NEOX_MLP = Part("an MLP dense_4h_to_h(act(dense_h_to_4h(x)))", fits_plain_mlp("dense_h_to_4h", "dense_4h_to_h", "act"),
                plain_mlp("dense_h_to_4h", "dense_4h_to_h", "act"))


def _pre_norm(attention: Part, mlp: tuple[Part, ...], norm: Part, *inner: str, optional: bool = False) -> tuple[tuple[str, tuple[Part, ...]], ...]:
    """A pre-norm layer's parts: the norms before attention and MLP, attention (with norms `inner` on its queries
    and keys; `optional`: a model may lack them), the MLP."""
    kinds = (norm, ABSENT) if optional else (norm,)
    return (("input_layernorm", (norm,)), ("self_attn", (attention,)), *((f"self_attn.{name}", kinds) for name in inner),
            ("post_attention_layernorm", (norm,)), ("mlp", mlp))


#: Llama's layer: a norm before each branch
PRE_NORM = Residual("self_attn", "mlp", before_attention="input_layernorm", before_mlp="post_attention_layernorm")
#: Gemma's: norms before and after each branch
SANDWICH = Residual("self_attn", "mlp", before_attention="input_layernorm", before_mlp="pre_feedforward_layernorm",
                    after_attention="post_attention_layernorm", after_mlp="post_feedforward_layernorm")
#: OLMo 2's: a norm after each branch
POST_NORM = Residual("self_attn", "mlp", before_attention=None, before_mlp=None, after_attention="post_attention_layernorm",
                     after_mlp="post_feedforward_layernorm")


def _llama_like(name: str, classes: tuple[str, ...], model_types: tuple[str, ...], parts: tuple, norm: Part,
                residual: Residual | None = PRE_NORM, attention_norm: str | None = "input_layernorm",
                logit_scale: LogitScale | None = None) -> Layout:
    """A layout with Llama's names: `model.embed_tokens`, `model.layers`, `self_attn`, the final `model.norm`."""
    return Layout(name, classes, model_types, decoder="model", embeddings="embed_tokens", layers="layers", attention="self_attn",
                  attention_norm=attention_norm, attention_output="o_proj", parts=parts, final=("norm", norm), residual=residual,
                  logit_scale=logit_scale)


#: Gemma's norms around the MLP as well as around attention
_GEMMA_MLP_NORMS = (("pre_feedforward_layernorm", (ONE_PLUS_RMS_NORM,)), ("post_feedforward_layernorm", (ONE_PLUS_RMS_NORM,)))
LLAMA = _llama_like("llama", ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"), ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text"),
                    _pre_norm(ATTENTION, (GATED_MLP,), RMS_NORM), RMS_NORM)
#: Granite: Llama's layer with its branches scaled (`residual_multiplier`), the embeddings scaled inside the decoder
#: (`embedding_multiplier`, before the layers where relevance is measured), the attention's own scale
#: (`attention_multiplier`, passed to the attention) and the logits divided by `logits_scaling`
GRANITE = _llama_like("granite", ("GraniteForCausalLM",), ("granite",), _pre_norm(ATTENTION, (GATED_MLP,), RMS_NORM), RMS_NORM,
                      Residual("self_attn", "mlp", before_attention="input_layernorm", before_mlp="post_attention_layernorm",
                               branch_scale="residual_multiplier"), logit_scale=LogitScale("logits_scaling", divides=True))
QWEN3 = _llama_like("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _pre_norm(ATTENTION, (GATED_MLP,), RMS_NORM, "q_norm", "k_norm"),
                    RMS_NORM)
QWEN3_MOE = _llama_like("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",),
                        _pre_norm(ATTENTION, (MIXTURE, GATED_MLP), RMS_NORM, "q_norm", "k_norm"), RMS_NORM)
MIXTRAL = _llama_like("mixtral", ("MixtralForCausalLM",), ("mixtral",), _pre_norm(ATTENTION, (MIXTURE,), RMS_NORM), RMS_NORM)
PHI3 = _llama_like("phi3", ("Phi3ForCausalLM",), ("phi3",), _pre_norm(FUSED_ATTENTION, (FUSED_GATED_MLP,), RMS_NORM), RMS_NORM)
GEMMA3 = _llama_like("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",),
                     _pre_norm(ATTENTION, (GATED_MLP,), ONE_PLUS_RMS_NORM, "q_norm", "k_norm") + _GEMMA_MLP_NORMS, ONE_PLUS_RMS_NORM,
                     SANDWICH)
#: Gemma (PaliGemma 1's decoder): Llama's layer with Gemma's norms (`1 + w`), the embeddings scaled in the embedding
GEMMA = _llama_like("gemma", ("GemmaForCausalLM",), ("gemma",), _pre_norm(ATTENTION, (GATED_MLP,), ONE_PLUS_RMS_NORM), ONE_PLUS_RMS_NORM)
GEMMA2 = _llama_like("gemma2", ("Gemma2ForCausalLM",), ("gemma2",),
                     _pre_norm(ATTENTION, (GATED_MLP,), ONE_PLUS_RMS_NORM) + _GEMMA_MLP_NORMS, ONE_PLUS_RMS_NORM, SANDWICH)
OLMO2 = _llama_like("olmo2", ("Olmo2ForCausalLM",), ("olmo2",),
                    (("self_attn", (ATTENTION,)), ("self_attn.q_norm", (RMS_NORM,)), ("self_attn.k_norm", (RMS_NORM,)),
                     ("post_attention_layernorm", (RMS_NORM,)), ("mlp", (GATED_MLP,)), ("post_feedforward_layernorm", (RMS_NORM,))),
                    RMS_NORM, POST_NORM, attention_norm=None)
#: GLM-4.5's MoE: Llama's layer, the first `first_k_dense_replace` layers' MLPs dense, the others a mixture of routed
#: and shared experts; query and key norms where `use_qk_norm`; a part of each head rotated (the file's own RoPE)
GLM4_MOE = _llama_like("glm4_moe", ("Glm4MoeForCausalLM",), ("glm4_moe",),
                       _pre_norm(ATTENTION, (SHARED_MIXTURE, GATED_MLP), RMS_NORM, "q_norm", "k_norm", optional=True), RMS_NORM)
#: Cohere (Command R): one weight-only LayerNorm read by attention and the MLP side by side, query and key norms per
#: head where `use_qk_norm`, RoPE on interleaved pairs (the file's own), the logits times `logit_scale`
COHERE = _llama_like("cohere", ("CohereForCausalLM",), ("cohere",),
                     (("input_layernorm", (CENTRED_NORM,)), ("self_attn", (ATTENTION,)), ("self_attn.q_norm", (CENTRED_NORM, ABSENT)),
                      ("self_attn.k_norm", (CENTRED_NORM, ABSENT)), ("mlp", (GATED_MLP,))), CENTRED_NORM,
                     Residual("self_attn", "mlp", before_attention="input_layernorm", before_mlp="input_layernorm", parallel=True),
                     logit_scale=LogitScale("logit_scale"))
#: gpt-oss: Llama's layer, attention with a sink per head (`attend`'s `sinks`), sliding-window and full layers
#: (`layer_types`, in the masks the model builds per layer type), a mixture of experts in every layer (a router with
#: a bias, experts with biases and a clamped SwiGLU); the file's own RoPE (halves rotated by half-width tables)
GPT_OSS = _llama_like("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), _pre_norm(SINK_ATTENTION, (GPT_OSS_MIXTURE,), RMS_NORM),
                      RMS_NORM)
#: DeepSeek-V3 (and Kimi K2, which runs DeepSeek-V3's classes): Llama's layer with multi-head latent attention
#: (low-rank queries and keys and values, the norms inside it, a rotated part of each query and one rotated key part
#: shared by the heads, RoPE on interleaved pairs where `rope_interleave`, yarn's `mscale` in the attention's scale),
#: the first `first_k_dense_replace` layers' MLPs dense, the others GLM-4.5's mixture of routed and shared experts
DEEPSEEK_V3 = _llama_like("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",),
                          _pre_norm(LATENT_ATTENTION, (SHARED_MIXTURE, GATED_MLP), RMS_NORM, "q_a_layernorm", "kv_a_layernorm",
                                    optional=True), RMS_NORM)
#: Llama 4's text decoder: chunked local attention layers with RoPE (complex rotation, the file's `apply_rotary_emb`)
#: and a weightless query and key norm, global layers without either and with the queries' temperature tuned by
#: position, mixture layers (routed experts fed their scored input, a shared expert) among dense ones (`feed_forward`)
LLAMA4 = _llama_like("llama4", ("Llama4ForCausalLM",), ("llama4_text",),
                     (("input_layernorm", (RMS_NORM,)), ("self_attn", (LLAMA4_ATTENTION,)),
                      ("self_attn.qk_norm", (WEIGHTLESS_NORM, ABSENT)), ("post_attention_layernorm", (RMS_NORM,)),
                      ("feed_forward", (INPUT_GATED_MIXTURE, GATED_MLP))), RMS_NORM,
                     Residual("self_attn", "feed_forward", before_attention="input_layernorm", before_mlp="post_attention_layernorm"))
#: Qwen3-Next and Qwen3.5 (dense and MoE): pre-norm layers of one token mixer each, linear attention (a gated
#: DeltaNet, `linear_attn`) or full attention with an output gate and query and key norms (`self_attn`), as the
#: config's `layer_types` alternate them; Gemma's norms `x / rms(x) * (1 + w)`; the MLP dense or a mixture with a
#: gated shared expert. The layers run as they are under the gradient rules (no explicit rule map: `residual`
#: None); the linear-attention layers have no attention matrix (the adapter offers the methods that need none)
QWEN3_NEXT = _llama_like("qwen3_next", ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
                         ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"),
                         (("input_layernorm", (ONE_PLUS_RMS_NORM,)), ("self_attn", (GATED_ATTENTION, ABSENT)),
                          ("self_attn.q_norm", (ONE_PLUS_RMS_NORM, ABSENT)), ("self_attn.k_norm", (ONE_PLUS_RMS_NORM, ABSENT)),
                          ("linear_attn", (GATED_DELTA_NET, ABSENT)), ("post_attention_layernorm", (ONE_PLUS_RMS_NORM,)),
                          ("mlp", (SIGMOID_GATED_MIXTURE, GATED_MLP))), ONE_PLUS_RMS_NORM, residual=None)
#: HunYuan-Dense V1: Llama's layer, its query and key norms per head after the rotation (`query_layernorm`,
#: `key_layernorm`; parts of their own, rotated relevance passing into them)
HUNYUAN_DENSE = _llama_like("hunyuan_v1_dense", ("HunYuanDenseV1ForCausalLM",), ("hunyuan_v1_dense",),
                            _pre_norm(ATTENTION, (GATED_MLP,), RMS_NORM, "query_layernorm", "key_layernorm"), RMS_NORM)
#: LFM2: pre-norm layers of one token mixer each, grouped-query attention with query and key norms (`self_attn`) or
#: a gated short convolution (`conv`) as the config's `layer_types` alternate them, then a gated MLP; the final norm
#: `embedding_norm`. The layers run as they are under the gradient rules (no explicit rule map: `residual` None);
#: the convolution layers have no attention matrix (the adapter offers the methods that need none)
LFM2 = Layout(
    "lfm2", ("Lfm2ForCausalLM",), ("lfm2",), decoder="model", embeddings="embed_tokens", layers="layers", attention="self_attn",
    attention_norm="operator_norm", attention_output="out_proj",
    parts=(("operator_norm", (RMS_NORM,)), ("self_attn", (LFM2_ATTENTION, ABSENT)), ("self_attn.q_layernorm", (RMS_NORM, ABSENT)),
           ("self_attn.k_layernorm", (RMS_NORM, ABSENT)), ("conv", (SHORT_CONVOLUTION, ABSENT)), ("ffn_norm", (RMS_NORM,)),
           ("feed_forward", (LFM2_MLP,))),
    final=("embedding_norm", RMS_NORM), residual=None, mixer="short-convolution")
#: MiniMax (MiniMax-Text-01): layers of one token mixer each under one name (`self_attn`), lightning (linear) attention
#: or grouped-query softmax attention as the config's `layer_types` alternate them, then a mixture of experts; each
#: branch's residual the normed input, the residual and the branch each times a constant (`..._alpha_factor`,
#: `..._beta_factor`: constant factors pass relevance); the lightning attention's norm a part of its own. The layers
#: run as they are under the gradient rules (no explicit rule map: `residual` None); the lightning layers have no
#: attention matrix (the adapter offers the methods that need none)
MINIMAX = Layout(
    "minimax", ("MiniMaxForCausalLM",), ("minimax",), decoder="model", embeddings="embed_tokens", layers="layers", attention="self_attn",
    attention_norm="input_layernorm", attention_output="o_proj",
    parts=(("input_layernorm", (RMS_NORM,)), ("self_attn", (ATTENTION, LIGHTNING_ATTENTION)), ("self_attn.norm", (RMS_NORM, ABSENT)),
           ("post_attention_layernorm", (RMS_NORM,)), ("mlp", (MIXTURE,))),
    final=("norm", RMS_NORM), residual=None, mixer="lightning-attention", linear_attention=LIGHTNING_ATTENTION)
GPT_NEOX = Layout(
    "gpt_neox", ("GPTNeoXForCausalLM",), ("gpt_neox",), decoder="gpt_neox", embeddings="embed_in", layers="layers",
    attention="attention", attention_norm="input_layernorm", attention_output="dense",
    parts=(("input_layernorm", (LAYER_NORM,)), ("attention", (NEOX_ATTENTION,)), ("post_attention_layernorm", (LAYER_NORM,)),
           ("mlp", (NEOX_MLP,))),
    final=("final_layer_norm", LAYER_NORM),
    residual=Residual("attention", "mlp", before_attention="input_layernorm", before_mlp="post_attention_layernorm",
                      parallel="use_parallel_residual"),
)
GPT2 = Layout(
    "gpt2", ("GPT2LMHeadModel",), ("gpt2",), decoder="transformer", embeddings="wte", layers="h", attention="attn", attention_norm="ln_1", attention_output="c_proj",
    parts=(("ln_1", (LAYER_NORM,)), ("attn", (GPT2_ATTENTION,)), ("ln_2", (LAYER_NORM,)), ("mlp", (GPT2_MLP,))),
    final=("ln_f", LAYER_NORM), residual=Residual("attn", "mlp", before_attention="ln_1", before_mlp="ln_2"),
)
#: Mamba: a norm and a state-space mixer per layer (`x + mixer(norm(x))`), no attention
MAMBA = Layout("mamba", ("MambaForCausalLM",), ("mamba",), decoder="backbone", embeddings="embeddings", layers="layers",
               attention=None, attention_norm="norm", attention_output=None,
               parts=(("norm", (RMS_NORM,)), ("mixer", (MAMBA_MIXER,))), final=("norm_f", RMS_NORM), residual=None,
               state_space="state-space mixers, no attention layers")
#: Mamba-2: Mamba's layer with Mamba-2's mixer (a scan per head, a gated RMSNorm)
MAMBA2 = Layout("mamba2", ("Mamba2ForCausalLM",), ("mamba2",), decoder="backbone", embeddings="embeddings", layers="layers",
                attention=None, attention_norm="norm", attention_output=None,
                parts=(("norm", (RMS_NORM,)), ("mixer", (MAMBA2_MIXER,))), final=("norm_f", RMS_NORM), residual=None,
                state_space="state-space mixers, no attention layers")
#: Falcon-H1: in every layer a Mamba-2 mixer beside attention, both reading one norm, summed (each times a constant),
#: then a gated MLP; the embeddings, keys, logits and the MLP's gate and output times constants (muP)
FALCON_H1 = Layout(
    "falcon_h1", ("FalconH1ForCausalLM",), ("falcon_h1",), decoder="model", embeddings="embed_tokens", layers="layers",
    attention="self_attn", attention_norm="input_layernorm", attention_output="o_proj",
    parts=(("input_layernorm", (RMS_NORM,)), ("self_attn", (ATTENTION,)), ("mamba", (MAMBA2_MIXER,)),
           ("pre_ff_layernorm", (RMS_NORM,)), ("feed_forward", (FALCON_H1_MLP,))),
    final=("final_layernorm", RMS_NORM), residual=None, logit_scale=LogitScale("lm_head_multiplier"),
    embedding_scale="embedding_multiplier",
    state_space="a state-space mixer beside attention in every layer, which attention maps do not see")
LAYOUTS = (LLAMA, GRANITE, QWEN3, QWEN3_MOE, MIXTRAL, GLM4_MOE, DEEPSEEK_V3, LLAMA4, QWEN3_NEXT, GEMMA3, GEMMA2, GEMMA, PHI3, OLMO2, COHERE, GPT_OSS,
           HUNYUAN_DENSE, LFM2, MINIMAX, GPT_NEOX, GPT2, MAMBA, MAMBA2, FALCON_H1)  # for an unknown model type: the first that fits
#: the decoder classes relevancy maps, for messages
DECODER_CLASSES = ", ".join(name for layout in LAYOUTS for name in layout.classes)


def is_causal_lm(model: nn.Module) -> bool:
    """Whether `model` is a transformers decoder language model (of any layout: `layout_of` says which)."""
    return (isinstance(getattr(getattr(model, "config", None), "model_type", None), str)
            and type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")) and callable(getattr(model, "get_output_embeddings", None)))


#: the models recognised so far, each with the structure it was recognised on (`structure`), its layout and its
#: ruled modules: the checks (probe forwards of every norm and MLP, each a read back to the host) run once per
#: model, not once per call
_RECOGNISED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Layout, list]] = weakref.WeakKeyDictionary()


def structure(model: nn.Module) -> tuple:
    """What the recognition (and the adapter's check of its forwards) depends on: the model type, each module's name
    and type, each parameter's shape, and each forward set on a module itself (a patched layer; accelerate's hooks)."""
    modules = tuple(model.named_modules())  # one walk: the parameters read from each module's own
    return (model.config.model_type, tuple((name, type(module), id(vars(module).get("forward"))) for name, module in modules),
            tuple((name, key, tuple(parameter.shape)) for name, module in modules
                  for key, parameter in module._parameters.items() if parameter is not None))


def recognised(model: nn.Module) -> tuple[tuple, Layout, list[tuple[nn.Module, RuleForward]]]:
    """`(structure(model), layout_of(model), its ruled modules)`, the layout checked again only when the model's
    structure changed (the structure is found once per call and handed on: the adapter's check of its forwards keys
    on it too)."""
    found = structure(model)
    known = _RECOGNISED.get(model)
    if known is None or known[0] != found:
        layout = layout_of(model)
        known = (found, layout, layout.ruled(model))
        _RECOGNISED[model] = known
    return known


def layout_of(model: nn.Module) -> Layout:
    """The layout of a transformers decoder language model: the one its `model_type` names, checked on its
    modules, or for an unknown model type the first its modules fit; a one-line refusal naming the part that
    does not fit otherwise."""
    model_type = model.config.model_type
    named = [layout for layout in LAYOUTS if model_type in layout.model_types]
    for layout in named or LAYOUTS:
        problem = layout.misfit(model)
        if problem is None:
            return layout
        if named:
            break
    said = f"its model type {model_type!r} says the {layout.name} layout, but {problem}" if named else \
        f"model type {model_type!r} fits no decoder layout"
    raise UnsupportedModelError(
        f"cannot map {type(model).__name__}: {said}; decoder families: {DECODER_CLASSES} (docs/adding-a-family.md)")


# -- the rule map of the explicit pass ---------------------------------------------------------------------------
#: transformers' `Conv1D` (GPT-2): `x W + b` with `W` stored `(in, out)`, under the Linear rule
def _conv1d_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A `Conv1D`'s `(W^T, b)` as the Linear rule reads them, loaded where accelerate offloads the layer."""
    with dispatch.loaded(module):
        return module.weight.t(), module.bias


CONV1D = leaf(lambda module: weight_rule(lambda: _conv1d_weight(module), affine=True))


def session_attribute(attention: nn.Module, session: Session) -> Replacements:
    """The call's session on the attention module, where relevancy's attention reads it (`adapter.session_of`)."""
    return {SESSION: session}


#: the modeling files' functions that rotate queries and keys `(q, k, *tables)`: Llama's, DeepSeek's on interleaved
#: pairs, Llama 4's complex one
ROTATIONS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_emb")


def _rotation_passing(modeling: object) -> ForwardFactory:
    """An entry (for the decoder, run once per call) that replaces the modeling file's rotations (`ROTATIONS`), for
    this thread and call, by the same rotation of queries and keys passing relevance coordinate by coordinate;
    nothing where the file rotates nothing (GPT-2)."""

    def passing(rotate: Callable, session: Session) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return lambda q, k, *args, **kwargs: (passthrough(session, lambda t: rotate(t, t, *args, **kwargs)[0], q),
                                              passthrough(session, lambda t: rotate(t, t, *args, **kwargs)[1], k))

    def factory(_decoder: nn.Module, session: Session) -> Replacements:
        return {(modeling, name): passing(getattr(modeling, name), session) for name in ROTATIONS if hasattr(modeling, name)}

    return factory


@functools.lru_cache(maxsize=None)
def _llama_rotation(rotate: Callable) -> bool:
    """Whether a modeling file's `apply_rotary_pos_emb` gives `gradient.rotated`'s numbers bit for bit on a probe
    (the whole head dimension rotated, as Llama rotates it)."""
    generator = torch.Generator().manual_seed(0)
    q, k, cos, sin = (torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu") for shape in ((1, 2, 3, 8), (1, 1, 3, 8), (1, 3, 8), (1, 3, 8)))
    try:
        theirs = rotate(q, k, cos, sin)
    except Exception:  # another signature: not Llama's
        return False
    return all(torch.equal(a, b) for a, b in zip(theirs, gradient.rotated(q, k, cos, sin)))


def rotation_replacements(attention: nn.Module) -> list[tuple[object, str, object]]:
    """For a rule set that carries a gradient: the modeling file's `apply_rotary_pos_emb` (the one `attention`'s
    forward calls) replaced by `gradient.rotated`, the same numbers as one autograd operation per tensor, where the
    file's is Llama's (`_llama_rotation`) and the call rotates whole heads of one dtype; the file's own otherwise
    (partial rotary, GPT-2: none)."""
    modeling = sys.modules[type(attention).__module__]
    own = getattr(modeling, "apply_rotary_pos_emb", None)
    if own is None or not _llama_rotation(own):
        return []

    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if args or set(kwargs) - {"unsqueeze_dim"} or not (q.shape[-1] == k.shape[-1] == cos.shape[-1] == sin.shape[-1]
                                                           and q.dtype == k.dtype == cos.dtype == sin.dtype):
            return own(q, k, cos, sin, *args, **kwargs)
        return gradient.rotated(q, k, cos, sin, **kwargs)

    return [(modeling, "apply_rotary_pos_emb", apply)]


def rule_map(layout: Layout, model: nn.Module, ruled: list[tuple[nn.Module, RuleForward]]) -> dict[type, ForwardFactory]:
    """The layout's rule map for a session that carries relevance (the seeds' LRP methods), keyed by the types of the
    model's own modules: transformers' leaves (Linear, GPT-2's `Conv1D`), the ruled parts' forwards, the layers'
    residual adds, attention's session and rotation; the model, the decoder, its rotary embedding, a mixture (but
    GLM's, a ruled part) and its router (`gate`; gpt-oss's `router`) as they are (the router's weights take no relevance: the gate rule).
    Activations run inside the MLPs' forwards, which apply the activation rule themselves."""
    from transformers.pytorch_utils import Conv1D

    decoder = getattr(model, layout.decoder)
    layers = list(getattr(decoder, layout.layers))
    attentions = [getattr(layer, layout.attention) for layer in layers]
    mixtures = [module for layer in layers for module in [getattr(layer, layout.residual.mlp)] if hasattr(module, "experts")]
    leaves = transformers_leaves()
    activations = {cls for cls, entry in leaves.items() if entry is ACTIVATION_LEAF}
    entries = {
        **leaves, **{cls: unchanged for cls in activations}, Conv1D: CONV1D,
        **by_type([model, getattr(decoder, "rotary_emb", None), *mixtures, *(getattr(m, "gate", None) or m.router for m in mixtures)],
                  unchanged),
        type(decoder): _rotation_passing(sys.modules[type(attentions[0]).__module__]),
        **by_type(layers, layout.residual.rule),
        **by_type(attentions, session_attribute),
    }
    for module, forward in ruled:  # a ruled part's forward on top of its type's entry (Llama 4's attention keeps its session)
        entries[type(module)] = _with_forward(entries.get(type(module), unchanged), forward)
    return entries


def _with_forward(entry: ForwardFactory, forward: RuleForward) -> ForwardFactory:
    """`entry`'s replacements and the rule forward `forward`."""
    return lambda module, session: {**entry(module, session), "forward": forward(module, session)}
