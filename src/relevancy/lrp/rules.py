"""Relevance rules: how relevance `R` at an operation's output is shared among its inputs.

Each rule takes the operation's inputs (detached) and the relevance at its output, and returns one relevance
tensor per input. Definitions follow Chefer et al. CVPR'21 (`layers_ours`, "paper" rules) and their LRP
baselines (`layers_lrp`, "vanilla" rules); docs/methods.md states them.

Two arithmetics share these rules. `exact=True` divides as the authors' code does (`safe_divide`, 1e-9 added to
every denominator). The default divides with `stable_divide`: where a sum cancels (`|z|` below `RELATIVE_FLOOR`
of the magnitude of its terms), the denominator is held at that floor with its sign kept, so the float32
rounding of the forward pass is amplified at most `1 / RELATIVE_FLOOR` times instead of without bound; every
other denominator is used as it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EPSILON = 1e-9
RELATIVE_FLOOR = 3e-2
# `positive_part_sum`: where the magnitude exceeds this multiple of the sum, the sum is recomputed term by term
CANCELLATION_RATIO = 4.0
# ... term by term in a row where one entry in this many at most cancels; beyond, the whole row
CANCELLED_SHARE_LIMIT = 128
# the Linear rule computes only the rows with relevance where they are at most this share of all rows
LIVE_ROW_SHARE = 0.25
# the matmul rule runs a causal (lower block-triangular) product in this many bands of rows, each at least
# `MIN_BAND_ROWS` rows, and skips the blocks above the diagonal (`causal_bands`)
BANDS = 8
MIN_BAND_ROWS = 128


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """`a / (b + 1e-9)`, and 0 where `b == 0`: the reference's stabiliser.

    The reference writes the denominator as `b.clamp(min=1e-9) + b.clamp(max=1e-9)`, which is `b + 1e-9`
    bit for bit. (It also maps a denominator of exactly -1e-9 to +1e-9; that float never occurs in practice.)
    """
    return (numerator / (denominator + EPSILON)).masked_fill_(denominator == 0, 0.0)


def stable_quotients(relevance: torch.Tensor, z: torch.Tensor, magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(signed, unsigned)` quotients for sharing `relevance` over the terms of `z` (`magnitude`: the sum of their
    absolute values).

    Where `|z| >= RELATIVE_FLOOR * magnitude`, `signed = R / z` and `unsigned = 0`: the plain rule. Where the sum
    cancels, `z` is held at the floor (its sign kept) and the relevance this leaves unshared, `R (1 - z / held)`,
    goes to the terms in proportion to their magnitudes (`unsigned`). So each term's share is
    `term * signed + |term| * unsigned`: relevance is conserved, continuously in `z`, and float32 rounding is
    amplified at most `1 / RELATIVE_FLOOR` times. Both are 0 where every term is 0.
    """
    # in place where the arithmetic allows: large tensors cost more to allocate than to compute
    held = z.abs()
    torch.maximum(held, RELATIVE_FLOOR * magnitude, out=held).copysign_(z)
    signed = torch.div(relevance, held).masked_fill_(magnitude == 0, 0.0)
    unsigned = signed * z
    # (R - signed z) / magnitude; 0 where z is not held (every term 0 included: z is 0 and held == z there)
    torch.sub(relevance, unsigned, out=unsigned).div_(magnitude).masked_fill_(held == z, 0.0)
    return signed, unsigned


def safe_divide_into(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """`safe_divide`, bit for bit, written into `denominator` (the caller's scratch, of the numerator's shape): one
    large allocation fewer."""
    zero = denominator == 0
    return torch.div(numerator, denominator.add_(EPSILON), out=denominator).masked_fill_(zero, 0.0)


def sign_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(t.clamp(min=0), t.clamp(max=0))`, the same numbers for finite `t` in about half the time (`relu`, then a
    subtraction)."""
    positive = torch.relu(t)
    return positive, t - positive


def per_sample_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over everything but the batch dimension, kept broadcastable: `(B, 1, ..., 1)`."""
    return x.reshape(len(x), -1).sum(1).reshape(len(x), *([1] * (x.ndim - 1)))


def passthrough(relevance: torch.Tensor) -> torch.Tensor:
    """LayerNorm, GELU, softmax, scaling: relevance passes unchanged."""
    return relevance


def linear_alpha1_beta0(
    x: torch.Tensor,
    weight: torch.Tensor,
    relevance: torch.Tensor,
    shared_denominator: bool,
    output: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Alpha=1, beta=0 rule: positive contributions `x+ W+` and `x- W-` share the relevance (bias ignored).

    With `shared_denominator` (the paper's rule) both parts are divided by their sum `Z = x+ W+ + x- W-`, which
    conserves relevance; the vanilla rule divides each part by itself, which does not. `output`, when the caller
    has it from the forward pass, is `x W^T + bias` (`bias` None for none): on token sequences the paper's rule then
    takes the product from it instead of computing it again (`positive_part_sum`). Every term is a sum of non-negative products, to the precision that
    `positive_part_sum` states. Where few rows (tokens) carry relevance (`live_rows`), only those are computed.
    """
    live = live_rows(relevance, len(x)) if x.ndim >= 3 else None
    if live is not None:
        return rows_one_at_a_time(x, weight, relevance, live, shared_denominator)
    outputs = live_columns(relevance) if x.ndim < 3 else None
    if outputs is not None:  # a head read at one logit: its other outputs' weights take no part
        return linear_alpha1_beta0(x, weight[outputs], relevance[..., outputs], shared_denominator,
                                   None if output is None else output[..., outputs], None if bias is None else bias[outputs])
    if not shared_denominator:
        return direct_rule(x, sign_parts(weight), relevance, shared_denominator)
    x_abs, w_abs = x.abs(), weight.abs()
    if output is None or x.ndim < 3:
        # no product to reuse, or one row per input (a head), where BLAS's few-row kernels would make a batch's
        # numbers differ from one input's: the direct sum (its two products cost nothing on so few rows)
        z = direct_positive_part_sum(x, weight)
    else:
        product, slack = (output.clone(), None) if bias is None else (output - bias, bias.abs())
        z = positive_part_sum(x, weight, product, F.linear(x_abs, w_abs), slack)
    s = safe_divide_into(relevance, z)
    # x+ (s W+) + x- (s W-) with W+- = (W +- |W|) / 2: two products, against W and |W|
    return (s @ weight).mul_(x).addcmul_(x_abs, s @ w_abs).mul_(0.5)


def live_rows(relevance: torch.Tensor, inputs: int) -> torch.Tensor | None:
    """The indices of the rows (tokens, over every dimension but the last) with any relevance, where there are at
    most as many as `inputs` and at most `LIVE_ROW_SHARE` of all rows (the last block under a readout row: one row
    per input); None otherwise."""
    flat = relevance.reshape(-1, relevance.shape[-1])
    limit = min(inputs, LIVE_ROW_SHARE * len(flat))
    if int(flat[:, 0].count_nonzero()) > limit:  # rows live at their first entry already too many: dense, at 1 / width of the cost
        return None
    rows = flat.ne(0).any(-1).nonzero().squeeze(1)  # one read back to the host (a synchronisation on a GPU), not two
    return rows if len(rows) <= limit else None


def live_columns(relevance: torch.Tensor) -> torch.Tensor | None:
    """The indices of the outputs (last dimension) with any relevance, where they are at most `LIVE_ROW_SHARE` of
    all (a classifier's or a language model's head, explained at one class or token); None otherwise."""
    live = relevance.reshape(-1, relevance.shape[-1]).ne(0).any(0)
    columns = live.nonzero().squeeze(1)
    return columns if 0 < len(columns) <= LIVE_ROW_SHARE * len(live) else None


def rows_one_at_a_time(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor, rows: torch.Tensor, shared_denominator: bool) -> torch.Tensor:
    """The rule on the given rows only (zeros elsewhere), each row alone: a row's numbers do not depend on which
    other rows a call runs (BLAS's kernels differ with the number of rows), so a batch gives each input's."""
    flat_x, flat_r = x.reshape(-1, x.shape[-1]), relevance.reshape(-1, relevance.shape[-1])
    shares, weight_parts = torch.zeros_like(flat_x), sign_parts(weight)
    for row in rows.tolist():
        shares[row] = direct_rule(flat_x[row:row + 1], weight_parts, flat_r[row:row + 1], shared_denominator)[0]
    return shares.view(x.shape)


def direct_rule(
    x: torch.Tensor, weight_parts: tuple[torch.Tensor, torch.Tensor], relevance: torch.Tensor, shared_denominator: bool
) -> torch.Tensor:
    """The alpha1-beta0 rule from the positive and negative parts (`sign_parts` of the weight) directly: every sum is
    of non-negative terms, nothing cancels."""
    (x_pos, x_neg), (w_pos, w_neg) = sign_parts(x), weight_parts
    z_pos, z_neg = F.linear(x_pos, w_pos), F.linear(x_neg, w_neg)
    if shared_denominator:
        s_pos = s_neg = safe_divide_into(relevance, z_pos.add_(z_neg))
    else:
        s_pos, s_neg = safe_divide_into(relevance, z_pos), safe_divide_into(relevance, z_neg)
    return (s_pos @ w_pos).mul_(x_pos).addcmul_(x_neg, s_neg @ w_neg)


def direct_positive_part_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`Z = x+ W+ + x- W-` as two products of non-negative terms: nothing cancels."""
    (x_pos, x_neg), (w_pos, w_neg) = sign_parts(x), sign_parts(weight)
    return F.linear(x_pos, w_pos).add_(F.linear(x_neg, w_neg))


def positive_part_sum(
    x: torch.Tensor, weight: torch.Tensor, product: torch.Tensor, magnitude: torch.Tensor, slack: torch.Tensor | None
) -> torch.Tensor:
    """`Z = sum_k max(x_k W_jk, 0)` (`= x+ W+ + x- W-`) from the computed `product = x W^T` and `magnitude = |x| |W|^T`
    as `(product + magnitude) / 2`, recomputed term by term where that cancels. `slack` (or None): a bound on the
    absolute values added to and taken back from `product` (a bias), broadcastable to it. `product` and
    `magnitude` are the caller's scratch: both are overwritten (fewer large allocations).

    Why this is as good as summing the non-negative terms: with `m` the exact magnitude, each computed dot product
    of length K is off by at most `g m`, `g = K eps / (1 - K eps)` (any summation order); a bias added and taken back
    adds at most `2 eps (m + slack)`. So the computed `Z'` is off by at most about `(g + eps) (m + slack)`. Where it
    is kept, `m' + slack <= CANCELLATION_RATIO Z'`, so its error is at most about
    `CANCELLATION_RATIO (K + 1) eps Z'`: `CANCELLATION_RATIO` times the bound `K eps Z` of summing the K non-negative
    terms directly. Everywhere else (the sum cancels) `Z` is recomputed as that direct sum: term by term where a
    row (one token) has few such entries, the whole row as products with the weight's positive and negative parts
    where more than `1 / CANCELLED_SHARE_LIMIT` of its entries cancel. Which way a row goes depends on that row
    alone, not on the rest of the batch.
    """
    z = product.add_(magnitude).mul_(0.5)
    excess = magnitude.sub_(z, alpha=CANCELLATION_RATIO)  # m - c Z: above -slack where the sum cancels
    cancelled = (excess > 0 if slack is None else excess > -slack).reshape(-1, z.shape[-1])
    if not cancelled.any():
        return z
    flat_x, flat_z = x.reshape(-1, x.shape[-1]), z.view(-1, z.shape[-1])
    dense = cancelled.sum(-1) * CANCELLED_SHARE_LIMIT > z.shape[-1]
    if dense.any():
        flat_z[dense] = direct_positive_part_sum(flat_x[dense], weight)
        cancelled[dense] = False
    rows, columns = cancelled.nonzero(as_tuple=True)
    chunk = len(flat_x)  # entries per step: the terms held at once are at most the size of `x`
    for start in range(0, len(rows), chunk):
        at_rows, at_columns = rows[start : start + chunk], columns[start : start + chunk]
        flat_z[at_rows, at_columns] = (flat_x[at_rows] * weight[at_columns]).clamp_(min=0).sum(-1)
    return z


def reweigh_branches(x: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """The reference's `Clone` and `IndexSelect`: relevance arriving at `x` times `x / (x + 1e-9)` (0 where x == 0)."""
    return x * safe_divide(relevance, x)


def add(a: torch.Tensor, b: torch.Tensor, relevance: torch.Tensor, rescale: bool, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`z = a + b`: each input gets its share `x * R / z`.

    With `rescale` (the paper's residual rule) the shares are then scaled so that, per sample, their sums
    split `sum R` in proportion to `|sum R_a|` and `|sum R_b|`: relevance is conserved through the residual.
    """
    if exact:
        s = safe_divide(relevance, a + b)
        r_a, r_b = a * s, b * s
    else:
        a_abs, b_abs = a.abs(), b.abs()
        signed, unsigned = stable_quotients(relevance, a + b, a_abs + b_abs)
        r_a, r_b = (a * signed).addcmul_(a_abs, unsigned), (b * signed).addcmul_(b_abs, unsigned)
    if rescale:
        sum_a, sum_b, total = per_sample_sum(r_a), per_sample_sum(r_b), per_sample_sum(relevance)
        norm = sum_a.abs() + sum_b.abs()
        r_a = r_a * safe_divide(safe_divide(sum_a.abs(), norm) * total, sum_a)
        r_b = r_b * safe_divide(safe_divide(sum_b.abs(), norm) * total, sum_b)
    return r_a, r_b


def matmul(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`u @ v`, the same numbers; batches of matrices with the same leading dimensions go to `bmm` as views, since
    `torch.matmul` copies a transposed operand of more than three dimensions first (about twice the time)."""
    if u.ndim == v.ndim > 3 and u.shape[:-2] == v.shape[:-2]:
        return torch.bmm(u.flatten(0, -3), v.flatten(0, -3)).unflatten(0, u.shape[:-2])
    return u @ v


def matmul_halved(
    u: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor, exact: bool, product: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Z = u @ v` of two feature maps: `R_u = u * (R/Z) v^T`, `R_v = v * u^T (R/Z)`, each halved. `product`: `Z` as
    the forward computed it (`matmul(u, v)`, the same numbers), or None to compute it; it is not written.
    A causal attention's products (the relevance at `q k^T`, or the probabilities in `A v`, zero above the
    diagonal) run in bands of rows without the blocks above it (`causal_bands`): the same sums without their zero
    terms (equal to rounding), in about half the time and with one band's temporaries at a time."""
    if product is None:
        product = matmul(u, v)
    bands = causal_bands(u, relevance)
    if bands is not None:
        return banded_matmul_halved(u, v, relevance, exact, product, bands)
    v_t, u_t = v.transpose(-2, -1), u.transpose(-2, -1)
    if exact:
        half_s = safe_divide(relevance, product).mul_(0.5)  # halving S halves both shares exactly (a power of 2)
        return u * matmul(half_s, v_t), v * matmul(u_t, half_s)
    u_abs, v_abs = u.abs(), v.abs()
    # both quotients are linear in the relevance: halving it halves them exactly
    signed, unsigned = stable_quotients(relevance * 0.5, product, matmul(u_abs, v_abs))
    r_u = matmul(signed, v_t).mul_(u).addcmul_(u_abs, matmul(unsigned, v_abs.transpose(-2, -1)))
    r_v = matmul(u_t, signed).mul_(v).addcmul_(v_abs, matmul(u_abs.transpose(-2, -1), unsigned))
    return r_u, r_v


def causal_bands(u: torch.Tensor, relevance: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
    """`[(first row, end row, columns of u, columns of the relevance)]` per band of rows where a square operand (`u`
    in `A v`, the relevance in `q k^T`) is zero right of its band's end in every row of the batch (the causal
    mask's staircase), so the band's products stop there; None where nothing is skipped (too few rows, a
    non-causal attention: the plain rule) and off the CPU."""
    rows = u.shape[-2]
    count = min(BANDS, rows // MIN_BAND_ROWS)
    if count < 2 or u.device.type != "cpu":  # a GPU takes the whole matrices: each band's check would wait for it
        return None
    edges = [rows * k // count for k in range(count + 1)]
    on_u, on_relevance = staircase(u, edges), staircase(relevance, edges)
    if not (on_u or on_relevance):
        return None
    return [(a, b, b if on_u else u.shape[-1], b if on_relevance else relevance.shape[-1]) for a, b in zip(edges, edges[1:])]


def staircase(matrix: torch.Tensor, edges: list[int]) -> bool:
    """Whether a square `matrix` is zero right of each band's end in every row of the band (bands from `edges`)."""
    return matrix.shape[-1] == matrix.shape[-2] and not any(bool(matrix[..., a:b, b:].any()) for a, b in zip(edges[:-2], edges[1:-1]))


def banded_matmul_halved(
    u: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor, exact: bool, product: torch.Tensor, bands: list[tuple[int, int, int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`matmul_halved` band by band (`causal_bands`): each band's rows of `R_u` from its columns of `u` and of the
    relevance, its share of `u^T (R/Z)` added to the columns it reaches; `R_v` multiplied out at the end."""
    r_u = torch.empty_like(u)  # each band writes its rows: its columns of u, and zeros right of them
    at_v, at_v_abs = torch.zeros_like(v), (None if exact else torch.zeros_like(v))
    v_abs = None if exact else v.abs()
    for first, end, inner, outer in bands:
        r_u[..., first:end, inner:] = 0
        band_u, band_v = u[..., first:end, :inner], v[..., :inner, :outer]
        band_r, band_z = relevance[..., first:end, :outer], product[..., first:end, :outer]
        if exact:
            half_s = safe_divide(band_r, band_z).mul_(0.5)
            r_u[..., first:end, :inner] = band_u * matmul(half_s, band_v.transpose(-2, -1))
            at_v[..., :inner, :outer] += matmul(band_u.transpose(-2, -1), half_s)
            continue
        band_u_abs, band_v_abs = band_u.abs(), v_abs[..., :inner, :outer]
        signed, unsigned = stable_quotients(band_r * 0.5, band_z, matmul(band_u_abs, band_v_abs))
        r_u[..., first:end, :inner] = matmul(signed, band_v.transpose(-2, -1)).mul_(band_u).addcmul_(
            band_u_abs, matmul(unsigned, band_v_abs.transpose(-2, -1)))
        at_v[..., :inner, :outer] += matmul(band_u.transpose(-2, -1), signed)
        at_v_abs[..., :inner, :outer] += matmul(band_u_abs.transpose(-2, -1), unsigned)
    r_v = at_v.mul_(v) if exact else at_v.mul_(v).addcmul_(v_abs, at_v_abs)
    return r_u, r_v


def matmul_gradient(
    u: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, wanted: tuple[bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradient of `u @ v` at `u` and `v` (None where not `wanted`), as autograd gives it. A causal attention's
    products skip the blocks above the diagonal (`causal_bands`): where the gradient at `q k^T` is zero there, both
    factors' gradients run band by band; where the probabilities of `A v` are, the values' gradient does, and the
    probabilities' own gradient stays whole (it is not zero above the diagonal)."""
    bands = causal_bands(u, grad)
    v_t, u_t = v.transpose(-2, -1), u.transpose(-2, -1)
    if bands is None:
        return matmul(grad, v_t) if wanted[0] else None, matmul(u_t, grad) if wanted[1] else None
    on_grad = bands[0][3] != grad.shape[-1]  # the gradient is the staircase (else the probabilities are)
    at_u = (torch.empty_like(u) if on_grad else matmul(grad, v_t)) if wanted[0] else None
    at_v = torch.zeros_like(v) if wanted[1] else None
    for first, end, inner, outer in bands:
        band_grad = grad[..., first:end, :outer]
        if at_u is not None and on_grad:
            at_u[..., first:end, :] = matmul(band_grad, v_t[..., :outer, :])
        if at_v is not None:
            at_v[..., :inner, :outer] += matmul(u_t[..., :inner, first:end], band_grad)
    return at_u, at_v


def conv_zb(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor, stride, padding, exact: bool) -> torch.Tensor:
    """z^B rule for the pixel layer: inputs bounded by each image's minimum `L` and maximum `H`.

    `Z = conv(x, W) - conv(L, W+) - conv(H, W-)` is the sum of the non-negative `conv(x - L, W+)` and
    `conv(x - H, W-)`; the default computes it so (nothing cancels), `exact` as the reference writes it.
    """
    dims = tuple(range(1, x.ndim))
    low = x.amin(dim=dims, keepdim=True).expand_as(x)
    high = x.amax(dim=dims, keepdim=True).expand_as(x)
    w_pos, w_neg = sign_parts(weight)

    def back(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.nn.grad.conv2d_input(x.shape, w, s, stride=stride, padding=padding)

    if not exact:
        above, below = x - low, x - high
        z = F.conv2d(above, w_pos, stride=stride, padding=padding) + F.conv2d(below, w_neg, stride=stride, padding=padding)
        s = safe_divide(relevance, z)
        return above * back(w_pos, s) + below * back(w_neg, s)
    z = (
        F.conv2d(x, weight, stride=stride, padding=padding)
        - F.conv2d(low, w_pos, stride=stride, padding=padding)
        - F.conv2d(high, w_neg, stride=stride, padding=padding)
        + EPSILON
    )
    s = relevance / z
    return x * back(weight, s) - low * back(w_pos, s) - high * back(w_neg, s)
