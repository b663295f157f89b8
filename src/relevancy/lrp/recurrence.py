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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .engine import Session


def held(session: Session | None, *parameters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The input-dependent parameters of a recurrence (`dt`, `B`, `C`) as constants under a rule set; as they are
    (on the graph) without one."""
    return tuple(p.detach() for p in parameters) if session is not None else parameters


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
