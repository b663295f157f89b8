"""The recurrent token mixers as layout parts - the state-space mixers of transformers' Mamba, Mamba-2 and Falcon-H1
decoders, the gated DeltaNet (linear attention) of Qwen3-Next and Qwen3.5, MiniMax's lightning attention, LFM2's
gated short convolution - what each must be, and its forward under a rule set that carries a gradient (AttnLRP's and
CP-LRP's; the seeds' explicit rules have no map of a recurrence and are not offered on these layouts). The gated
DeltaNet's rules: `gated_delta_net` and `lrp.recurrence.delta_rule_factors`.

A state-space mixer's forward is the model's own computation, written with the engine's operations so that each
rule applies where MambaLRP (Jafari et al., NeurIPS 2024) puts it:
- the input projection, the causal depth-wise convolution and the output projection: linear, gradient x input;
- the SiLU after the convolution: the identity rule (`engine.activation`);
- the selective scan: `dt`, `B`, `C` held constant (`lrp.recurrence.held`), so that the recurrence is a linear map
  of what it carries; the skip `D u` linear;
- the output times `silu(z)`, a product of two input-dependent factors: the gate rule (`hf_attention.gated_product`:
  AttnLRP's uniform rule, half to each, the SiLU under the identity rule; CP-LRP holds the gate constant);
- Mamba-2's gated RMSNorm: that product, then the group-wise RMS divisor held constant (the identity rule on a
  normalisation); Falcon-H1's mixer is Mamba-2's with constant multipliers, its norm optional or after the gate;
- LFM2's short convolution `C * conv(B * x)`: its gates `B`, `C` held constant as the scan's are, the convolution
  linear (`short_convolution`).
- MiniMax's lightning attention: a linear attention with a constant decay per head (`lightning_attention`), its
  queries, keys and values sharing the backward as the gated DeltaNet's do.
The recurrence runs in float32 at least (transformers casts parts of its own scan to float32: a float64 model's maps
are float64's here, its own logits float32's at those steps).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from transformers.activations import ACT2FN

from ...lrp import recurrence
from ...lrp.engine import MissingRuleError, Session, activation
from ..hf_attention import gated_product


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Padding positions set to 0, as the mixers set them (`apply_mask_to_padding_states`)."""
    return x if mask is None else (x * mask[:, :, None]).to(x.dtype)


def _refuse_cache(cache: object) -> None:
    if cache is not None:
        raise MissingRuleError("relevance propagation runs decoders over the whole sequence: no cache")


def _convolved(conv: nn.Conv1d, session: Session, x: torch.Tensor, mask: torch.Tensor | None,
               act: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """The causal depth-wise convolution `conv` (padded by its kernel's width less one on both sides, its last
    positions cut) over the positions of `x` `(batch, T, channels)`, a linear map (gradient x input), and its
    activation `act` (the identity rule; None: none, as LFM2's short convolution), padding set to 0 after it (`mask`
    None: not, as the gated DeltaNet does not): `(batch, T, channels)`."""
    convolved = conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
    return _masked(convolved if act is None else activation(session, act, convolved), mask)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def mamba_mixer(mixer: nn.Module, session: Session) -> Callable[..., torch.Tensor]:
    """Mamba's mixer (`MambaMixer`) under MambaLRP's rules."""

    def forward(hidden_states: torch.Tensor, cache: object = None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        _refuse_cache(cache)
        u, z = mixer.in_proj(_masked(hidden_states, attention_mask)).chunk(2, dim=-1)
        u = _convolved(mixer.conv1d, session, u, attention_mask, mixer.act)
        step, b, c = mixer.x_proj(u).split([mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
        dt, b, c = recurrence.held(session, F.softplus(_wide(mixer.dt_proj(step))), b, c)
        a = -torch.exp(_wide(mixer.A_log))
        y = recurrence.selective_scan(_wide(u), dt, a, _wide(b), _wide(c)) + _wide(u) * mixer.D
        return mixer.out_proj(gated_product(session, F.silu, _wide(z), y).to(hidden_states.dtype))

    return forward


def mamba2_mixer(mixer: nn.Module, session: Session) -> Callable[..., torch.Tensor]:
    """Mamba-2's mixer (`Mamba2Mixer`; Falcon-H1's `FalconH1Mixer`, the same with its constant multipliers on the input
    and on the projections, and its optional norm) under MambaLRP's rules carried to Mamba-2: its scan per head with
    the step, `B` and `C` held constant, its output gated (`_gated_output`)."""

    def forward(hidden_states: torch.Tensor, cache: object = None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        _refuse_cache(cache)
        batch, length, _ = hidden_states.shape
        inner, grouped = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
        projected = mixer.in_proj(_masked(hidden_states, attention_mask) * getattr(mixer, "ssm_in_multiplier", 1.0))
        z, xbc, dt = (projected * getattr(mixer, "mup_vector", 1.0)).split([inner, mixer.conv_dim, mixer.num_heads], dim=-1)
        x, b, c = _convolved(mixer.conv1d, session, xbc, attention_mask, mixer.act).split([inner, grouped, grouped], dim=-1)
        low, high = mixer.time_step_limit
        dt = torch.clamp(F.softplus(_wide(dt) + mixer.dt_bias), min=low, max=high)
        per_group = mixer.num_heads // mixer.n_groups
        b, c = (_wide(t).view(batch, length, mixer.n_groups, -1).repeat_interleave(per_group, dim=2) for t in (b, c))
        dt, b, c = recurrence.held(session, dt, b, c)
        heads = _wide(x).view(batch, length, mixer.num_heads, mixer.head_dim)
        y = recurrence.head_scan(heads, dt, -torch.exp(_wide(mixer.A_log)), b, c) + heads * mixer.D[:, None]
        return mixer.out_proj(_gated_output(mixer.norm, session, y.reshape(batch, length, inner), _wide(z)).to(hidden_states.dtype))

    return forward


def _gated_output(norm: nn.Module, session: Session, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The scan's output `y` gated by `silu(z)` (the gate rule) and normalised over groups of channels by their root mean
    square (held constant under a rule set), times the norm's weight: Mamba-2's `MambaRMSNormGated` gates first,
    Falcon-H1's `FalconH1RMSNormGated` gates first or after (`norm_before_gate`); Falcon-H1 without its norm
    (`nn.Identity`) only gates."""
    if isinstance(norm, nn.Identity):
        return gated_product(session, F.silu, z, y)
    after = getattr(norm, "norm_before_gate", False)
    x = y if after else gated_product(session, F.silu, z, y)
    groups = x.unflatten(-1, (getattr(norm, "n_groups", None) or x.shape[-1] // norm.group_size, -1))
    normed = norm.weight * _rms_divided(session, groups, norm.variance_epsilon).flatten(-2)
    return gated_product(session, F.silu, z, normed) if after else normed


def short_convolution(block: nn.Module, session: Session) -> Callable[..., torch.Tensor]:
    """LFM2's short-convolution block (`Lfm2ShortConv`) `out_proj(C * conv(B * x))`, `B, C, x = in_proj(h)`, under
    MambaLRP's rule carried to it: the input-dependent gates `B` and `C` held constant (`recurrence.held`, as the
    scan's `B` and `C`), so that the block is a linear map of what it carries, `x`; the projections and the causal
    depth-wise convolution linear (gradient x input: the epsilon rule of a linear map)."""

    def forward(hidden_states: torch.Tensor, cache: object = None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        _refuse_cache(cache)
        b, c, x = block.in_proj(_masked(hidden_states, attention_mask)).chunk(3, dim=-1)
        b, c = recurrence.held(session, b, c)
        return block.out_proj(c * _convolved(block.conv, session, b * x, None, None))

    return forward


def falcon_h1_mlp(mlp: nn.Module, session: Session) -> Callable[[torch.Tensor], torch.Tensor]:
    """Falcon-H1's MLP `down(up(x) * act(gate(x) * m_gate)) * m_down`: a gated MLP (the gate rule, the activation of
    the scaled gate under the identity rule), its constant multipliers passing relevance."""
    return lambda x: mlp.down_proj(gated_product(session, lambda g: mlp.act_fn(g * mlp.gate_multiplier), mlp.gate_proj(x),
                                                 mlp.up_proj(x))) * mlp.down_multiplier


def _rms_divided(session: Session | None, x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps)` over the last dimension, the divisor held constant under a rule set (the identity
    rule on a normalisation)."""
    divisor = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x / (divisor.detach() if session is not None else divisor)


def gated_delta_net(mixer: nn.Module, session: Session) -> Callable[..., torch.Tensor]:
    """Qwen3-Next's and Qwen3.5's linear attention (`...GatedDeltaNet`) under the rules stated in
    `lrp.recurrence.delta_rule_factors`: the projections, the causal depth-wise convolution and its SiLU (the
    identity rule), the queries and keys over their L2 norms (held constant), the delta rule, then the gated RMSNorm
    per head `w * o / rms(o) * silu(z)` (the divisor constant, the product under the gate rule) and `out_proj`."""

    def forward(hidden_states: torch.Tensor, cache: object = None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        _refuse_cache(cache)
        mixed, z, b, a = _delta_projections(mixer, _masked(hidden_states, attention_mask))
        act = ACT2FN[mixer.activation]
        q, k, v = _wide(_convolved(mixer.conv1d, session, mixed, None, act)).split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        repeat = mixer.num_v_heads // mixer.num_k_heads
        q, k = (_l2_normed(session, t.unflatten(-1, (-1, mixer.head_k_dim))).repeat_interleave(repeat, dim=2) for t in (q, k))
        beta, g = recurrence.held(session, torch.sigmoid(_wide(b)), -torch.exp(_wide(mixer.A_log)) * F.softplus(_wide(a) + mixer.dt_bias))
        q, transition, written, v = recurrence.delta_rule_factors(session, q / mixer.head_k_dim ** 0.5, k, v.unflatten(-1, (-1, mixer.head_v_dim)))
        o = recurrence.gated_delta_rule(q, transition, v, g, beta, written)
        normed = mixer.norm.weight * _rms_divided(session, o, mixer.norm.variance_epsilon)
        return mixer.out_proj(gated_product(session, F.silu, _wide(z), normed).flatten(2).to(hidden_states.dtype))

    return forward


def lightning_attention(attention: nn.Module, session: Session) -> Callable[..., tuple[torch.Tensor, None]]:
    """MiniMax's linear attention (`MiniMaxLightningAttention`): `qkv_proj` and its SiLU (the identity rule), padding
    set to 0 after it; per head `o_t = sum_{s <= t} exp(-lambda (t - s)) (q_t . k_s) v_s`, its decay `lambda` a
    constant per head (`recurrence.head_scan` with a unit step), the queries, keys and values sharing the backward
    (`recurrence.shared_factors`); the RMSNorm over all heads (a part of its own: the divisor held constant), the
    sigmoid output gate (the gate rule, the sigmoid under the identity rule), `out_proj`. Returned beside None, as the
    layer unpacks it."""

    def forward(hidden_states: torch.Tensor, position_embeddings: object = None, attention_mask: torch.Tensor | None = None,
                cache: object = None, **kwargs) -> tuple[torch.Tensor, None]:
        _refuse_cache(cache)
        width = attention.head_dim
        qkv = _masked(activation(session, attention.act_fn, attention.qkv_proj(hidden_states)), attention_mask)
        q, k, v = recurrence.shared_factors(session, *_wide(qkv).unflatten(-1, (attention.num_attention_heads, 3 * width)).split(width, dim=-1))
        o = recurrence.head_scan(v, torch.ones_like(q[..., 0]), -attention.slope_rate.flatten().to(q.dtype), k, q)
        gated = gated_product(session, torch.sigmoid, _wide(attention.output_gate(hidden_states)), attention.norm(o.flatten(2)))
        return attention.out_proj(gated.to(hidden_states.dtype)), None

    return forward


def _l2_normed(session: Session | None, x: torch.Tensor) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + 1e-6)` over the last dimension (transformers' `l2norm` of queries and keys), the divisor
    held constant under a rule set (the identity rule on a normalisation)."""
    (divisor,) = recurrence.held(session, torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6))
    return x / divisor


def _delta_projections(mixer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q, k, v side by side (batch, T, conv_dim), z (batch, T, heads, d_v), b, a (batch, T, heads))` from Qwen3.5's
    separate projections or Qwen3-Next's fused ones (ordered by the model's own `fix_query_key_value_ordering`)."""
    if hasattr(mixer, "in_proj_qkvz"):
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x), mixer.in_proj_ba(x))
        return torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1), z, b, a
    return mixer.in_proj_qkv(x), mixer.in_proj_z(x).unflatten(-1, (-1, mixer.head_v_dim)), mixer.in_proj_b(x), mixer.in_proj_a(x)


def fits_mamba_mixer(module: nn.Module, width: int) -> bool:
    """Mamba's mixer: `in_proj` to twice the inner width, a depth-wise `conv1d`, `x_proj` to the step's rank and twice
    the state, `dt_proj`, `A_log (inner, state)`, `D (inner,)`, `out_proj` back to the width."""
    inner, state, rank = (getattr(module, name, None) for name in ("intermediate_size", "ssm_state_size", "time_step_rank"))
    parts = [getattr(module, name, None) for name in ("in_proj", "x_proj", "dt_proj", "out_proj")]
    if not all(isinstance(p, nn.Linear) for p in parts) or not isinstance(getattr(module, "conv1d", None), nn.Conv1d):
        return False
    in_proj, x_proj, dt_proj, out_proj = parts
    return ((in_proj.in_features, in_proj.out_features) == (width, 2 * inner) and x_proj.out_features == rank + 2 * state
            and (dt_proj.in_features, dt_proj.out_features) == (rank, inner) and out_proj.out_features == width
            and tuple(module.A_log.shape) == (inner, state) and tuple(module.D.shape) == (inner,)
            and module.conv1d.groups == inner and callable(getattr(module, "act", None)))


def fits_mamba2_mixer(module: nn.Module, width: int) -> bool:
    """Mamba-2's mixer: `in_proj` to the gate, the convolved `x, B, C` and a step per head, a depth-wise `conv1d`,
    `A_log`, `D`, `dt_bias` per head, a gated RMSNorm over groups (Falcon-H1: or none), `out_proj` back to the width."""
    names = ("intermediate_size", "conv_dim", "num_heads", "head_dim", "n_groups", "ssm_state_size")
    inner, conv_dim, heads, head_dim, groups, state = (getattr(module, name, None) for name in names)
    in_proj, out_proj, norm = (getattr(module, name, None) for name in ("in_proj", "out_proj", "norm"))
    if not (isinstance(in_proj, nn.Linear) and isinstance(out_proj, nn.Linear) and isinstance(getattr(module, "conv1d", None), nn.Conv1d)):
        return False
    return ((in_proj.in_features, in_proj.out_features) == (width, inner + conv_dim + heads) and out_proj.out_features == width
            and conv_dim == inner + 2 * groups * state and heads * head_dim == inner and heads % groups == 0
            and all(tuple(getattr(module, name).shape) == (heads,) for name in ("A_log", "D", "dt_bias"))
            and (isinstance(norm, nn.Identity) or (isinstance(getattr(norm, "group_size", getattr(norm, "n_groups", None)), int)
                                                   and tuple(norm.weight.shape) == (inner,)))
            and module.conv1d.groups == conv_dim and callable(getattr(module, "act", None)))


def fits_short_convolution(module: nn.Module, width: int) -> bool:
    """LFM2's short-convolution block: `in_proj` from the width to `B`, `C`, `x` of the width each, a depth-wise
    causal `conv` over the width (padded by its kernel's width less one), `out_proj` back to the width."""
    in_proj, conv, out_proj = (getattr(module, name, None) for name in ("in_proj", "conv", "out_proj"))
    return (isinstance(in_proj, nn.Linear) and isinstance(out_proj, nn.Linear) and isinstance(conv, nn.Conv1d)
            and (in_proj.in_features, in_proj.out_features) == (width, 3 * width) and (out_proj.in_features, out_proj.out_features) == (width, width)
            and conv.in_channels == conv.out_channels == conv.groups == width and conv.padding == (conv.kernel_size[0] - 1,))


def fits_gated_delta_net(module: nn.Module, width: int) -> bool:
    """Qwen3-Next's or Qwen3.5's gated DeltaNet: from the width, Qwen3-Next's fused `in_proj_qkvz` and `in_proj_ba` or
    Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; a depth-wise `conv1d` over queries, keys and
    values; `A_log` and `dt_bias` per value head; a gated RMSNorm of a value head's width; `out_proj` back to the width."""
    names = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_dim")
    sizes = [getattr(module, name, None) for name in names]
    if not all(isinstance(size, int) for size in sizes) or not isinstance(getattr(module, "conv1d", None), nn.Conv1d):
        return False
    k_heads, v_heads, k_dim, v_dim, keys, values, conv_dim = sizes
    projections = ({"in_proj_qkvz": 2 * keys + 2 * values, "in_proj_ba": 2 * v_heads} if hasattr(module, "in_proj_qkvz")
                   else {"in_proj_qkv": conv_dim, "in_proj_z": values, "in_proj_b": v_heads, "in_proj_a": v_heads})
    linears = [(getattr(module, name, None), width, size) for name, size in projections.items()]
    linears.append((getattr(module, "out_proj", None), values, width))
    norm = getattr(module, "norm", None)
    return (all(isinstance(layer, nn.Linear) and (layer.in_features, layer.out_features) == (into, out) for layer, into, out in linears)
            and (keys, values, conv_dim) == (k_heads * k_dim, v_heads * v_dim, 2 * keys + values) and v_heads % k_heads == 0
            and all(tuple(getattr(getattr(module, name, None), "shape", ())) == (v_heads,) for name in ("A_log", "dt_bias"))
            and tuple(getattr(getattr(norm, "weight", None), "shape", ())) == (v_dim,) and isinstance(getattr(norm, "variance_epsilon", None), float)
            and module.conv1d.groups == conv_dim and module.conv1d.bias is None and getattr(module, "activation", None) in ACT2FN)


def fits_lightning_attention(module: nn.Module, width: int) -> bool:
    """MiniMax's lightning attention: `qkv_proj` from the width to the queries, keys and values of every head (each
    head's side by side), `output_gate` from the width to the heads' width, an RMSNorm of the heads' width,
    `out_proj` back to the width, a decay `slope_rate` per head and an activation `act_fn`."""
    heads, head_dim = getattr(module, "num_attention_heads", None), getattr(module, "head_dim", None)
    if not (isinstance(heads, int) and isinstance(head_dim, int)):
        return False
    inner, norm = heads * head_dim, getattr(module, "norm", None)
    linears = [(getattr(module, name, None), into, out) for name, into, out in
               (("qkv_proj", width, 3 * inner), ("output_gate", width, inner), ("out_proj", inner, width))]
    return (all(isinstance(layer, nn.Linear) and (layer.in_features, layer.out_features) == (into, out) and layer.bias is None
                for layer, into, out in linears)
            and tuple(getattr(getattr(module, "slope_rate", None), "shape", ())) == (heads, 1, 1) and callable(getattr(module, "act_fn", None))
            and tuple(getattr(getattr(norm, "weight", None), "shape", ())) == (inner,) and isinstance(getattr(norm, "variance_epsilon", None), float))
