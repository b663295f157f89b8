"""The rules of the rule sets that carry a gradient (`RuleSet.carries == "gradient"`): AttnLRP (Achtibat et al.,
ICML 2024) and CP-LRP's variant of it, as autograd operations the engine's operations apply (`engine.gate`,
`engine.activation`, `engine.normalisation`, `attention.attend`).

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

from typing import Callable

import torch


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


class _GatedRule(torch.autograd.Function):
    """A gated MLP's product `act(g) * u` under the identity rule on `act` and the uniform shares of the product, as
    one operation: the backward is `grad * share_u * act(g)` to `u` and `grad * share_g * u * act(g) / g` to `g`
    (0 where g is 0). The same arithmetic as `identity_rule` and `share` composed with the product, with three
    large tensors fewer per layer: forward and backward of SmolLM2's product 1.7x faster at 100 tokens and 1.8x at
    1,000 on one CPU thread (fresh tensors cost more there than the arithmetic). It keeps its inputs and makes
    `act(g)` again in the backward (one element-wise step), so that the forward holds two fewer tensors of the
    MLP's width at once (the product made in place): what bounds a checkpointed layer's peak. A share None: that
    factor is a constant."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
                value_share: float, gate_share: float | None) -> torch.Tensor:
        ctx.fn, ctx.shares = fn, (value_share, gate_share)
        ctx.save_for_backward(g, u)
        return _activated(fn, g).mul_(u)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        g, u = ctx.saved_tensors
        value_share, gate_share = ctx.shares
        activated = _activated(ctx.fn, g)
        to_gate = None
        if gate_share is not None and ctx.needs_input_grad[0]:
            to_gate = torch.div(activated, g).nan_to_num_(0.0, 0.0, 0.0).mul_(u)
            if gate_share != 1.0:
                to_gate.mul_(gate_share)
            to_gate = _times_gradient(to_gate, grad)
        to_value = None
        if ctx.needs_input_grad[1]:  # `activated` is this backward's own: scaled in place
            to_value = _times_gradient(activated.mul_(value_share) if value_share != 1.0 else activated, grad)
        return to_gate, to_value, None, None, None


def _activated(fn: Callable[[torch.Tensor], torch.Tensor], g: torch.Tensor) -> torch.Tensor:
    """`fn(g)` as a tensor of its own, to be written into (an activation that hands back its input is copied: the
    gate `g`, kept for the backward, is never written over)."""
    activated = fn(g)
    return activated.clone() if activated.data_ptr() == g.data_ptr() else activated


def _times_gradient(factor: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`factor * grad`, written into `factor` (a backward's own tensor: one MLP-wide tensor fewer at once), or a new
    tensor where `grad` is one of a batch of gradients (`torch.autograd.grad(..., is_grads_batched=True)`: a
    generation's tokens in one backward), which torch's batching refuses to write into an unbatched tensor (it says
    so before writing anything; nothing in the backward tells such a gradient apart beforehand)."""
    try:
        return factor.mul_(grad)
    except RuntimeError:
        return factor * grad


def gated(fn: Callable[[torch.Tensor], torch.Tensor], g: torch.Tensor, u: torch.Tensor,
          shares: tuple[float, float | None]) -> torch.Tensor:
    """`fn(g) * u` (a gated MLP's hidden layer) with the identity rule on the element-wise `fn` and the product's
    shares `(value, gate)` of relevance (the gate None: a constant weighting of `u`)."""
    return _GatedRule.apply(g, u, fn, *shares)


class _Rotation(torch.autograd.Function):
    """RoPE's rotation `x cos + rotate_half(x) sin` (`rotate_half(x) = (-x2, x1)`, the halves of the last
    dimension), the same roundings as transformers' (each product rounded, then added), and its backward
    `g cos + (g2 sin2, -g1 sin1)`: one large tensor and two of half its size each way, where the separate
    steps make five (the rotation is linear: its gradient is the rule)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].sub_(x[..., half:] * sin[..., :half])
        out[..., half:].add_(x[..., :half] * sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        out = grad * cos
        out[..., :half].add_(grad[..., half:] * sin[..., half:])
        out[..., half:].sub_(grad[..., :half] * sin[..., :half])
        return out, None, None


def rotated(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb` (Llama's: the whole head dimension rotated, `cos` and `sin` unsqueezed
    at `unsqueeze_dim`) as one operation per tensor (`_Rotation`)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _Rotation.apply(q, cos, sin), _Rotation.apply(k, cos, sin)


def share(x: torch.Tensor, factor: float) -> torch.Tensor:
    """`x` unchanged, with `factor` of the relevance flowing back into it (the uniform rule's share)."""
    return _ScaledBackward.apply(x, factor)


def identity_rule(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an element-wise `fn`, relevance passed through unchanged."""
    return _IdentityRule.apply(x, fn)


def norm_identity(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """`x / divisor` with the divisor constant in the backward: the identity rule on a normalisation."""
    return x / divisor.detach()


class _RMSNormRule(torch.autograd.Function):
    """Llama's RMSNorm `w * (x / rms(x))` (in float32 at least, scaled after the cast back) with the divisor constant
    in the backward: `grad * w / rms(x)`. One operation, so that the backward keeps only the `(..., 1)` divisor
    (not the input or the normed tokens) and the forward and backward make one large tensor fewer each than the same
    arithmetic as separate autograd steps (torch.profiler: fresh tensors cost a decoder on one CPU thread more than
    the element-wise arithmetic itself)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        divisor = torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        normed = torch.div(wide, divisor).to(x.dtype)
        ctx.save_for_backward(weight, divisor)
        ctx.dtypes = x.dtype, wide.dtype
        if torch.result_type(weight, normed) == normed.dtype:
            return normed.mul_(weight)
        return weight * normed

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        weight, divisor = ctx.saved_tensors
        dtype, wide = ctx.dtypes
        return (grad * weight).to(dtype).to(wide).div_(divisor).to(dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (as Llama computes it: in float32 at least, scaled after the cast back) under the identity rule; the
    weight detached (relevance never flows into weights: autograd keeps no copy of the normed tokens for it)."""
    return _RMSNormRule.apply(x, weight.detach(), eps)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x)` without a weight (torch's RMSNorm without one; Llama 4's query and key norm, its "L2 norm") under
    the identity rule, in float32 at least, as the models compute it."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return norm_identity(wide, torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def one_plus_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm `x / rms(x) * (1 + w)` under the identity rule, as Gemma computes it (in float32, scaled
    before the cast back)."""
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps).detach()
    return (normed * (1.0 + weight.float())).type_as(x)


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """A LayerNorm module's output under the identity rule (`centred_norm`)."""
    return centred_norm(x, norm.weight, norm.bias, norm.eps)


def centred_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`(x - mean(x)) / std(x) * w + b` over the last dimension (a LayerNorm; Cohere's, weight only) under the identity
    rule (the centring stays linear, the divisor constant); in float32 at least and rounded once at the end, as
    torch's LayerNorm computes half precision; weight and bias detached (as in `rms_norm`); contiguous, as torch's
    LayerNorm returns it (Idefics3's pixel shuffle views it)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32)).contiguous()
    centred = wide - wide.mean(-1, keepdim=True)
    y = norm_identity(centred, torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps))
    if weight is not None:
        y = y * weight.detach().to(wide.dtype)
    if bias is not None:
        y = y + bias.detach().to(wide.dtype)
    return y.to(x.dtype)


def module_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm module's output under the identity rule: a LayerNorm over the last dimension (`layer_norm`) or an
    RMSNorm (`rms_norm`; without a weight, `x / rms(x)`); a one-line error naming them for any other norm."""
    if isinstance(norm, torch.nn.LayerNorm) and len(norm.normalized_shape) == 1:
        return layer_norm(x, norm)
    if isinstance(norm, getattr(torch.nn, "RMSNorm", ())) and len(norm.normalized_shape) == 1:
        eps = torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
        if norm.weight is None:
            return weightless_rms_norm(x, eps)
        return rms_norm(x, norm.weight, eps)
    raise TypeError(f"the gradient rule sets (attnlrp, cp_lrp) rule LayerNorm and RMSNorm over the last dimension; "
                    f"got {type(norm).__name__} over {tuple(getattr(norm, 'normalized_shape', ()))}")


def take(x: torch.Tensor, factor: float | None) -> torch.Tensor:
    """`x` as one factor of a product whose backward it shares by `factor` (None: detached, a constant)."""
    if factor is None:
        return x.detach()
    return x if factor == 1.0 else share(x, factor)
