"""Relevance rules: how relevance `R` at an operation's output is shared among its inputs.

Each rule takes the operation's inputs (detached) and the relevance at its output, and returns one relevance
tensor per input. Definitions follow Chefer et al. CVPR'21 (`layers_ours`, "paper" rules) and their LRP
baselines (`layers_lrp`, "vanilla" rules); see ../shared/METHODS.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EPSILON = 1e-9


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """`a / (b + 1e-9)`, and 0 where `b == 0`: the reference's stabiliser.

    The reference writes the denominator as `b.clamp(min=1e-9) + b.clamp(max=1e-9)`, which is `b + 1e-9`
    bit for bit. (It also maps a denominator of exactly -1e-9 to +1e-9; that float never occurs in practice.)
    """
    return (numerator / (denominator + EPSILON)).masked_fill_(denominator == 0, 0.0)


def per_sample_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over everything but the batch dimension, kept broadcastable: `(B, 1, ..., 1)`."""
    return x.reshape(len(x), -1).sum(1).reshape(len(x), *([1] * (x.ndim - 1)))


def passthrough(relevance: torch.Tensor) -> torch.Tensor:
    """LayerNorm, GELU, softmax, scaling: relevance passes unchanged."""
    return relevance


def linear_alpha1_beta0(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor, shared_denominator: bool) -> torch.Tensor:
    """Alpha=1, beta=0 rule: positive contributions `x+ W+` and `x- W-` share the relevance (bias ignored).

    With `shared_denominator` (the paper's rule) both parts are divided by their sum `Z = x+ W+ + x- W-`, which
    conserves relevance; the vanilla rule divides each part by itself, which does not. Every term is a sum of
    non-negative products, so nothing cancels in float32 (the shorter `(x W + |x| |W|) / 2` does, where the
    negative products dominate).
    """
    x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
    w_pos, w_neg = weight.clamp(min=0), weight.clamp(max=0)
    z_pos, z_neg = F.linear(x_pos, w_pos), F.linear(x_neg, w_neg)
    if shared_denominator:
        s_pos = s_neg = safe_divide(relevance, z_pos + z_neg)
    else:
        s_pos, s_neg = safe_divide(relevance, z_pos), safe_divide(relevance, z_neg)
    return x_pos * (s_pos @ w_pos) + x_neg * (s_neg @ w_neg)


def reweigh_branches(x: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """The reference's `Clone` and `IndexSelect`: relevance arriving at `x` times `x / (x + 1e-9)` (0 where x == 0)."""
    return x * safe_divide(relevance, x)


def add(a: torch.Tensor, b: torch.Tensor, relevance: torch.Tensor, rescale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`z = a + b`: each input gets its share `x * R / z`.

    With `rescale` (the paper's residual rule) the shares are then scaled so that, per sample, their sums
    split `sum R` in proportion to `|sum R_a|` and `|sum R_b|`: relevance is conserved through the residual.
    """
    s = safe_divide(relevance, a + b)
    r_a, r_b = a * s, b * s
    if rescale:
        sum_a, sum_b, total = per_sample_sum(r_a), per_sample_sum(r_b), per_sample_sum(relevance)
        norm = sum_a.abs() + sum_b.abs()
        r_a = r_a * safe_divide(safe_divide(sum_a.abs(), norm) * total, sum_a)
        r_b = r_b * safe_divide(safe_divide(sum_b.abs(), norm) * total, sum_b)
    return r_a, r_b


def matmul_halved(u: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Z = u @ v` of two feature maps: `R_u = u * (R/Z) v^T`, `R_v = v * u^T (R/Z)`, each halved."""
    half_s = safe_divide(relevance, u @ v).mul_(0.5)  # halving S halves both shares exactly (a power of 2)
    return u * (half_s @ v.transpose(-2, -1)), v * (u.transpose(-2, -1) @ half_s)


def conv_zb(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor, stride, padding) -> torch.Tensor:
    """z^B rule for the pixel layer: inputs bounded by each image's minimum `L` and maximum `H`."""
    dims = tuple(range(1, x.ndim))
    low = x.amin(dim=dims, keepdim=True).expand_as(x)
    high = x.amax(dim=dims, keepdim=True).expand_as(x)
    w_pos, w_neg = weight.clamp(min=0), weight.clamp(max=0)
    z = (
        F.conv2d(x, weight, stride=stride, padding=padding)
        - F.conv2d(low, w_pos, stride=stride, padding=padding)
        - F.conv2d(high, w_neg, stride=stride, padding=padding)
        + EPSILON
    )
    s = relevance / z

    def back(w: torch.Tensor) -> torch.Tensor:
        return torch.nn.grad.conv2d_input(x.shape, w, s, stride=stride, padding=padding)

    return x * back(weight) - low * back(w_pos) - high * back(w_neg)
