"""The relevance of many positions of one sequence from one forward: every generated token of a generation,
explained over the tokens before it, as a causal `(G, N)` matrix.

Under the causal mask the hidden state at position `p` depends on positions `0..p` only, so one forward over the
whole sequence holds every prefix's forward: the backward of the logit of token `g` read at the position before it
(the graph kept between backward passes, several logits per pass) gives exactly what explaining that prefix alone
gives.
"""
from __future__ import annotations

import torch

from ...cancel import checkpoint
from ...lrp.attnlrp import RuleSet
from .adapter import CausalLMAdapter, input_times_gradient, widened


def causal_rows(prompt_length: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """`(G, N)` bool: row `g` (the token at position `prompt_length + g`) covers the positions before it."""
    generated = torch.arange(prompt_length, length, device=device)
    return torch.arange(length, device=device)[None, :] < generated[:, None]


#: generated tokens explained by one (batched) backward pass: fewer passes are faster (about a fifth at 8 on one CPU
#: thread), while the pass's transient memory grows with the rows (benchmarks/generation_speed.py)
ROWS_PER_BACKWARD = 8


def generation_relevance(adapter: CausalLMAdapter, ids: torch.Tensor, prompt_length: int, rules: RuleSet | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scores (G, N), explained logits (G,))` for the one sequence `ids` `(1, N)` whose tokens from
    `prompt_length` on were generated: row `g` is input x gradient (under `rules`; None: the plain gradient) of the
    logit of token `prompt_length + g` read at the position before it, over the positions before it (0 elsewhere).
    One forward (the last token is only explained, never read) and `ceil(G / ROWS_PER_BACKWARD)` backward passes,
    each batched over its rows (`is_grads_batched`: one unit vector per explained logit)."""
    length = ids.shape[1]
    if ids.shape[0] != 1 or not 1 <= prompt_length < length:
        raise ValueError(f"one sequence (1, N) with 1 <= prompt_length < N is explained, got {tuple(ids.shape)} and {prompt_length}")
    read = ids[:, :-1]
    embeddings = getattr(adapter.decoder, adapter.layout.embeddings)(read).detach().requires_grad_(True)
    mask = torch.ones_like(read)
    generated = ids[0, prompt_length:]
    rows = []
    with adapter.rules_applied(rules), adapter.weights_frozen():
        hidden = adapter.hidden_states(embeddings, mask)
        logits = adapter.model.lm_head(hidden[0, prompt_length - 1:])  # (G, V): the logits read before each generated token
        explained = logits.gather(1, generated[:, None])[:, 0]
        units = torch.eye(len(generated), dtype=explained.dtype, device=explained.device)
        for start in range(0, len(generated), ROWS_PER_BACKWARD):
            checkpoint()  # a caller's should_stop (relevancy.cancel) is asked before each backward round
            (gradient,) = torch.autograd.grad(explained, embeddings, grad_outputs=units[start: start + ROWS_PER_BACKWARD],
                                              retain_graph=start + ROWS_PER_BACKWARD < len(generated), is_grads_batched=True)
            rows.append(input_times_gradient(embeddings, gradient)[:, 0])
    scores = torch.nn.functional.pad(torch.cat(rows), (0, 1))  # the last token is read by no row
    return scores * causal_rows(prompt_length, length, scores.device), widened(explained)
