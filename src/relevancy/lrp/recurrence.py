"""The recurrences of state-space layers (Mamba's selective scan, Mamba-2's scan per head) and their rule: MambaLRP's
(Jafari et al., NeurIPS 2024), for the rule sets that carry a gradient.

A selective state-space layer computes `s_t = exp(dt_t A) s_{t-1} + dt_t B_t u_t`, `y_t = C_t s_t + D u_t`, where the
step `dt_t` and the matrices `B_t`, `C_t` are computed from the layer's input. Under the rule they are held constant
(`held`): the recurrence is then linear in what it carries, `u`, and gradient x input through it passes relevance
from each output to the inputs it is a weighted sum of, exactly (the epsilon-0 rule of that linear map). Relevance
never flows into `dt`, `B`, `C` (as it never flows into what decides where attention goes under CP-LRP; AttnLRP's
rules for attention do not apply here: there is no softmax whose inputs could share). The recurrences below compute
in the inputs' dtype (Mamba's one position at a time, Mamba-2's chunk by chunk), so that a float64 model's maps are
float64's.

The gated delta rule of Qwen3-Next's and Qwen3.5's linear attention (`gated_delta_rule`) is a recurrence of the same
kind whose transition is itself built from the keys: its rule (`delta_rule_factors`) holds the transition constant
and lets the queries, the written keys and the values share the backward as a softmax attention's do
(`shared_factors`). MiniMax's lightning attention is a linear attention whose transition is a constant decay per
head: Mamba-2's scan per head (`head_scan`) with a unit step, the keys as `B`, the queries as `C` and the values as
what it carries, under the same sharing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gradient
from .engine import Session


def held(session: Session | None, *parameters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The input-dependent parameters of a recurrence (`dt`, `B`, `C`) as constants under a rule set; as they are
    (on the graph) without one."""
    return tuple(p.detach() for p in parameters) if session is not None else parameters


def delta_rule_factors(session: Session | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`(q, transition keys, written keys, v)` of the gated delta rule (`gated_delta_rule`) under a rule set: the keys
    of the transition held constant (with `g` and `beta`, `held`: what the state keeps and erases), the queries, the
    written keys and the values sharing the backward as a softmax attention's queries, keys and values do under the
    same rule set (`RuleSet.query_key`, `value`: AttnLRP a quarter, a quarter, a half; CP-LRP the values alone).
    With the transition constant each output `o_t = sum_s beta_s (q_t^T A_ts w_s) v_s` is linear in each of `q`,
    `w`, `v`, so the three shares of gradient x input add up to the output. Without a rule set: as they are (the
    written keys None: the keys)."""
    if session is None:
        return q, k, None, v
    q, written, v = shared_factors(session, q, k, v)
    return q, k.detach(), written, v


def shared_factors(session: Session, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values of a linear attention whose output is linear in each of them (the transition
    held constant) sharing its backward as a softmax attention's do under the session's rule set (`RuleSet.query_key`,
    `value`: AttnLRP a quarter, a quarter, a half; CP-LRP the values alone): the three shares of gradient x input
    add up to the output."""
    rules = session.rule_set
    return gradient.take(q, rules.query_key), gradient.take(k, rules.query_key), gradient.take(v, rules.value)


def selective_scan(u: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Mamba's scan without its skip and gate: `u`, `dt` `(batch, T, channels)`, `a` `(channels, state)` (negative),
    `b`, `c` `(batch, T, state)` shared by the channels -> `y` `(batch, T, channels)`, a state per channel."""
    decay = torch.exp(dt[..., None] * a)  # (batch, T, channels, state)
    inflow = (dt * u)[..., None] * b[:, :, None, :]
    state = torch.zeros_like(inflow[:, 0])
    out = []
    for t in range(u.shape[1]):
        state = decay[:, t] * state + inflow[:, t]
        out.append(torch.linalg.vecdot(state, c[:, t, None, :]))
    return torch.stack(out, 1)


def head_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Mamba-2's scan without its skip: `x` `(batch, T, heads, head_dim)`, `dt` `(batch, T, heads)`, `a` `(heads,)`
    (negative, one scalar per head), `b`, `c` `(batch, T, heads, state)` -> `(batch, T, heads, head_dim)`: per head
    `y_l = sum_{s <= l} (c_l . b_s) exp(sum_{s < k <= l} dt_k a) dt_s x_s`. Computed as Mamba-2's state-space duality
    computes it: within each `chunk` of positions as that `(chunk, chunk)` matrix, between chunks through the state
    `(head_dim, state)` each chunk hands on (one step per chunk, not per position)."""
    batch, length, heads, width = x.shape
    pad = -length % chunk
    steps = F.pad(dt * a, (0, 0, 0, pad)).unflatten(1, (-1, chunk))  # (batch, chunks, chunk, heads): log decay per step
    inflow, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)).unflatten(1, (-1, chunk)) for t in (dt[..., None] * x, b, c))
    decayed = torch.cumsum(steps, 2)  # (batch, chunks, chunk, heads): log decay from the chunk's start
    within = decayed[:, :, :, None] - decayed[:, :, None, :]  # (batch, chunks, l, s, heads)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()[:, :, None]
    matrix = torch.einsum("bklhn,bkshn->bklsh", c, b) * torch.exp(within.masked_fill(~causal, float("-inf")))
    y = torch.einsum("bklsh,bkshp->bklhp", matrix, inflow)
    # each chunk's contribution to the state at its end, then the states entering each chunk, chunk by chunk
    ends = torch.einsum("bklh,bklhn,bklhp->bkhpn", torch.exp(decayed[:, :, -1:] - decayed), b, inflow)
    carried, entering = torch.zeros_like(ends[:, 0]), []
    for k in range(ends.shape[1]):
        entering.append(carried)
        carried = torch.exp(decayed[:, k, -1])[..., None, None] * carried + ends[:, k]
    y = y + torch.einsum("bklhn,bkhpn->bklhp", c, torch.stack(entering, 1)) * torch.exp(decayed)[..., None]
    return y.flatten(1, 2)[:, :length]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     written: torch.Tensor | None = None, chunk: int = 64) -> torch.Tensor:
    """The gated delta rule of Qwen3-Next's and Qwen3.5's linear attention: per head, a state `S_t` `(d_k, d_v)`,
    `S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t w_t v_t^T`, `o_t = S_t^T q_t`, with `q`, `k`, the
    written keys `w` (`written`; None: `k`, as the model computes it) `(batch, T, heads, d_k)`, `v`
    `(batch, T, heads, d_v)`, the log decay `g` and the write strength `beta` `(batch, T, heads)` -> `o`
    `(batch, T, heads, d_v)`. The keys play two parts: in the transition `(I - beta k k^T)` (what the state erases)
    and in the write `w v^T`; a rule holds the first constant and not the second, hence two arguments.

    Chunk by chunk: within a chunk of `C` positions (`gamma_t` the decay from the chunk's start, `D` its diagonal,
    `[.]_<` / `[.]_<=` the strictly / the lower triangular part, each entry `(t, s)` times `gamma_t / gamma_s`), the
    erased parts `e_s = exp(g_s) S_{s-1}^T k_s` solve `(I + [beta k k^T]_<) E = D K S_0 + [beta k w^T]_< V`, then
    `O = D Q S_0 + [beta q w^T]_<= V - [beta q k^T]_<= E` and the state handed on is
    `gamma_C S_0 + sum_s (gamma_C / gamma_s) beta_s (w_s v_s^T - k_s e_s^T)`: one step per chunk, not per position,
    in the inputs' dtype."""
    written = k if written is None else written
    batch, length, heads, _ = q.shape
    pad = -length % chunk

    def chunked(x: torch.Tensor) -> torch.Tensor:  # (batch, T, heads, ...) -> (batch, heads, chunks, chunk, ...)
        x = F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad))
        return x.unflatten(1, (-1, chunk)).movedim(3, 1)

    q, k, written, v = (chunked(t) for t in (q, k, written, v))
    g, beta = chunked(g[..., None])[..., 0], chunked(beta[..., None])[..., 0]  # (batch, heads, chunks, chunk)
    decayed = torch.cumsum(g, -1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((decayed[..., :, None] - decayed[..., None, :]).masked_fill(~lower, float("-inf")))  # (t, s)
    weighed = decay * beta[..., None, :]
    strictly = weighed.masked_fill(torch.eye(chunk, dtype=torch.bool, device=q.device), 0.0)
    erasing = strictly * (k @ k.transpose(-1, -2))
    writing = strictly * (k @ written.transpose(-1, -2))
    read_written, read_erased = weighed * (q @ written.transpose(-1, -2)), weighed * (q @ k.transpose(-1, -2))
    to_end = (torch.exp(decayed[..., -1:] - decayed) * beta)[..., None]  # (batch, heads, chunks, chunk, 1)
    start = torch.exp(decayed)[..., None]
    state = q.new_zeros(batch, heads, q.shape[-1], v.shape[-1])
    out = []
    for c in range(q.shape[2]):
        erased = torch.linalg.solve_triangular(erasing[:, :, c], start[:, :, c] * (k[:, :, c] @ state) + writing[:, :, c] @ v[:, :, c],
                                               upper=False, unitriangular=True)
        out.append(start[:, :, c] * (q[:, :, c] @ state) + read_written[:, :, c] @ v[:, :, c] - read_erased[:, :, c] @ erased)
        state = (torch.exp(decayed[:, :, c, -1])[..., None, None] * state + (to_end[:, :, c] * written[:, :, c]).transpose(-1, -2) @ v[:, :, c]
                 - (to_end[:, :, c] * k[:, :, c]).transpose(-1, -2) @ erased)
    return torch.stack(out, 2).flatten(2, 3)[:, :, :length].transpose(1, 2)
