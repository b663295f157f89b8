"""AttnLRP's rules for decoder language models (Achtibat et al., ICML 2024), and CP-LRP's variant of them.

Both are written in the gradient x input form: each rule changes what flows backward through one operation, so
that one ordinary backward pass of the explained logit, multiplied by the input embeddings, gives the relevance of
each input dimension. The rules, operation by operation:
- Linear layers (projections, the output head): gradient x input is LRP's epsilon-0 rule, the bias keeping its share.
- An element-wise non-linearity `y = f(x)` (SiLU, GELU): the identity rule, all relevance passes unchanged:
  the backward multiplies by `f(x) / x` instead of `f'(x)` (`identity_rule`).
- A product of two model-dependent factors (the gate times the up projection of a gated MLP; attention's
  `q k^T` and `probabilities @ v`): the uniform rule, half to each factor. Gradient x input would give each factor
  the whole product, so the backward is halved (`share`). In attention this folds into the inputs: values get
  1/2 (they are a factor once), queries and keys 1/4 (a factor of `q k^T`, whose result, through the softmax,
  is the other factor of `probabilities @ v`).
- Softmax: its true gradient (gradient x input on a softmax is the rule the paper derives for it).
- RMSNorm and LayerNorm: the identity rule on the normalisation: the divisor (the root mean square, the
  standard deviation) is held constant in the backward (`norm_identity`), so relevance passes as through a
  fixed scaling.
CP-LRP (Ali et al., ICML 2022) keeps relevance off everything that only decides where attention goes: queries and
keys are detached (the probabilities are a constant weighting of the values, which take the whole relevance), and
in a gated MLP the gate is detached (a constant weighting of the up projection).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


class _ScaledBackward(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by a constant."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _IdentityRule(torch.autograd.Function):
    """`y = f(x)` forward; backward `grad * f(x) / x` (0 where x is 0), so that input x gradient equals the
    output's relevance element by element. The ratio is one division and one in-place pass (what is not finite,
    i.e. x == 0, set to 0) rather than a comparison, a division and a selection: a few percent of a decoder's
    backward in bf16 on one CPU thread (torch.profiler)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        y = fn(x)
        ctx.save_for_backward(torch.div(y, x).nan_to_num_(0.0, 0.0, 0.0))
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (ratio,) = ctx.saved_tensors
        return grad * ratio, None


def share(x: torch.Tensor, factor: float) -> torch.Tensor:
    """`x` unchanged, with `factor` of the relevance flowing back into it (the uniform rule's share)."""
    return _ScaledBackward.apply(x, factor)


def identity_rule(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an element-wise `fn`, relevance passed through unchanged."""
    return _IdentityRule.apply(x, fn)


def norm_identity(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """`x / divisor` with the divisor constant in the backward: the identity rule on a normalisation."""
    return x / divisor.detach()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (as Llama computes it: in float32 at least, scaled after the cast back) under the identity rule; the
    weight detached (relevance never flows into weights: autograd keeps no copy of the normed tokens for it)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = norm_identity(wide, torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + eps))
    return weight.detach() * normed.to(x.dtype)


def one_plus_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm `x / rms(x) * (1 + w)` under the identity rule, as Gemma computes it (in float32, scaled
    before the cast back)."""
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps).detach()
    return (normed * (1.0 + weight.float())).type_as(x)


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """A LayerNorm module's output under the identity rule (the centring stays linear, the divisor constant); in
    float32 at least and rounded once at the end, as torch's LayerNorm computes half precision; weight and bias
    detached (as in `rms_norm`); contiguous, as torch's LayerNorm returns it (Idefics3's pixel shuffle views it)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32)).contiguous()
    centred = wide - wide.mean(-1, keepdim=True)
    y = norm_identity(centred, torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps))
    if norm.weight is not None:
        y = y * norm.weight.detach().to(wide.dtype)
    if norm.bias is not None:
        y = y + norm.bias.detach().to(wide.dtype)
    return y.to(x.dtype)


@dataclass(frozen=True)
class RuleSet:
    """How much relevance each input of a product receives: `None` detaches it (CP-LRP), a number shares it."""

    name: str
    query_key: float | None  # queries and keys of attention
    value: float  # values of attention
    gate: float | None  # the gate of a gated MLP
    up: float  # the up projection of a gated MLP

    def take(self, x: torch.Tensor, factor: float | None) -> torch.Tensor:
        """`x` as one input of a product under this rule set."""
        if factor is None:
            return x.detach()
        return x if factor == 1.0 else share(x, factor)

    def activation(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """An element-wise activation: the identity rule (a detached input needs none)."""
        return fn(x) if not x.requires_grad else identity_rule(fn, x)


ATTNLRP = RuleSet("attnlrp", query_key=0.25, value=0.5, gate=0.5, up=0.5)
CP_LRP = RuleSet("cp_lrp", query_key=None, value=1.0, gate=None, up=1.0)
RULE_SETS = {rules.name: rules for rules in (ATTNLRP, CP_LRP)}


def gated(rules: RuleSet, act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`act(gate) * up` under `rules`: the identity rule on the activation, the product's rule on the factors."""
    return rules.activation(act, rules.take(gate, rules.gate)) * rules.take(up, rules.up)


def gated_mlp(rules: RuleSet, gate_proj: torch.nn.Module, up_proj: torch.nn.Module, down_proj: torch.nn.Module,
              act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`down(act(gate(x)) * up(x))` under `rules`."""
    return down_proj(gated(rules, act, gate_proj(x), up_proj(x)))


def fused_gated_mlp(rules: RuleSet, gate_up_proj: torch.nn.Module, down_proj: torch.nn.Module,
                    act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Phi-3's MLP `down(up * act(gate))`, `gate, up = gate_up_proj(x).chunk(2)`, under `rules`."""
    gate, up = gate_up_proj(x).chunk(2, dim=-1)
    return down_proj(gated(rules, act, gate, up))


def routed_experts(rules: RuleSet, gate_up: torch.Tensor, down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                   x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A mixture of experts `sum_k w_k expert_k(x)` over tokens `x (N, D)`, each token's experts `index (N, k)` and
    router weights `weights (N, k)`, experts stored as `gate_up (E, 2I, D)`, `down (E, D, I)` (transformers 5's
    Qwen3-MoE and Mixtral). Each expert is a gated MLP under `rules`; the product of its output and its router
    weight is a product of two model-dependent factors, the router weight taking the gate's share (AttnLRP: half
    each, as lxt's qwen3_moe map; CP-LRP: the weight is a constant, the expert's output takes it all). The router's
    softmax and top-k run in the model's own forward, with their gradient."""
    out = torch.zeros_like(x)
    for expert in index.unique().tolist():
        if expert >= len(gate_up):  # transformers' marker of an unused slot
            continue
        token, slot = torch.where(index == expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        hidden = F.linear(gated(rules, act, gate, up), down[expert])
        weighted = rules.take(hidden, rules.up) * rules.take(weights[token, slot, None], rules.gate)
        out = out.index_add(0, token, weighted.to(out.dtype))
    return out


def attention(rules: RuleSet | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None, scaling: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact eager attention `(output (B, T, H, d), probabilities (B, H, T, S))` over heads `(B, H, T, d)`, keys
    and values shared by groups of query heads (grouped-query attention: the query heads are viewed as
    (key heads, group) and broadcast against their key head, so keys and values are never copied per head),
    softmax in the model's dtype (float32 at least); `rules` None: the plain gradient. `softcap` (Gemma 2): the
    scores soft-capped `c tanh(s / c)` before the mask, with their gradient (part of the softmax's argument)."""
    batch, heads, length, width = query.shape
    if rules is not None:
        query, key, value = rules.take(query, rules.query_key), rules.take(key, rules.query_key), rules.take(value, rules.value)
    grouped = (query * scaling).view(batch, key.shape[1], heads // key.shape[1], length, width)
    scores = torch.matmul(grouped, key.unsqueeze(2).transpose(-1, -2))  # scaled on the (T, d) side: one (T, T) pass less
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.add_(mask[..., : key.shape[-2]].unsqueeze(2))  # in place: the product's backward keeps no copy of it
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)
    flat = probabilities.flatten(1, 2)  # (B, H, T, S): what is returned is what the output is computed from (on the graph)
    output = torch.matmul(flat.view(probabilities.shape), value.unsqueeze(2)).reshape(batch, heads, length, width)
    return output.transpose(1, 2).contiguous(), flat


def fused_attention(rules: RuleSet | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """The same attention through torch's fused kernel (`scaled_dot_product_attention`), output `(B, T, H, d)`, no
    probabilities: the rules only scale what flows back into queries, keys and values and the softmax keeps its
    own gradient, so a pass that needs the input's relevance alone need not hold the `(T, T)` probabilities.
    `mask`: transformers' sdpa mask (boolean, True where allowed), None for a plain causal one."""
    if rules is not None:
        query, key, value = rules.take(query, rules.query_key), rules.take(key, rules.query_key), rules.take(value, rules.value)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None and query.shape[2] > 1,
                                            scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return output.transpose(1, 2).contiguous()
