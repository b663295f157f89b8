"""The relevance of many positions of one forward: every generated token of a batch of generations, explained over
the tokens before it, as a causal `(B, G, N)` tensor.

Under the causal mask the hidden state at position `p` depends on positions `0..p` only, so one forward over the
whole sequence holds every prefix's forward: the backward of the logit of token `g` read at the position before it
(the graph kept between backward passes, several logits per pass) gives exactly what explaining that prefix alone
gives. Rows of a batch are independent, so one backward pass explains the same step of every row.
"""
from __future__ import annotations

import torch

from ...core.cancel import checkpoint
from ...lrp.rule_sets import RuleSet
from ..text_batch import TextBatch
from .adapter import CausalLMAdapter, input_times_gradient, widened


def causal_rows(prompt_length: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """`(G, N)` bool: row `g` (the token at position `prompt_length + g`) covers the positions before it."""
    generated = torch.arange(prompt_length, length, device=device)
    return torch.arange(length, device=device)[None, :] < generated[:, None]


def explained_logits(head: torch.nn.Linear, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`(B, G)`: the head's logit of each token `tokens[b, g]` read from `hidden[b, g]`, the rows of the head's
    weight those tokens pick (no `(B, G, vocabulary)` logits: a long generation's would not fit)."""
    logits = (hidden * head.weight[tokens]).sum(-1)
    return logits if head.bias is None else logits + head.bias[tokens]


#: generated tokens explained by one (batched) backward pass, over the rows of a batch together: fewer passes are
#: faster (about a fifth at 8 on one CPU thread), while the pass's transient memory grows with the logits it takes
#: (benchmarks/generation_speed.py)
ROWS_PER_BACKWARD = 8


def generation_relevance(adapter: CausalLMAdapter, ids: torch.Tensor, mask: torch.Tensor, prompt_length: int,
                         rules: RuleSet | None, inputs: TextBatch | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`(scores (B, G, N), explained logits (B, G), further)` for the sequences `ids` `(B, N)` (`mask`: 1 at real
    tokens; prompts left-padded to `prompt_length`, the generated tokens after it, right-padded where a row ended
    sooner): `scores[b, g]` is input x gradient (under `rules`; None: the plain gradient) of the logit of token
    `prompt_length + g` read at the position before it, over the real positions before it (0 elsewhere; rows past a
    sequence's end are meaningless). `inputs`: what else the forward reads per row (a vision-language decoder's
    image, `adapter.leaves_forward`); `further` holds each such leaf's input x gradient laid on the pixels `(B, G, H,
    W)` (`adapter.pixel_relevance`: the colour channels summed, Qwen2-VL's flattened patches laid back). One forward (the last token is only explained, never
    read) and `ceil(G / max(1, ROWS_PER_BACKWARD // B))` backward passes, each batched over its steps
    (`is_grads_batched`)."""
    rows, length = ids.shape
    if not 1 <= prompt_length < length:
        raise ValueError(f"sequences (B, N) with 1 <= prompt_length < N are explained, got {tuple(ids.shape)} and {prompt_length}")
    steps = length - prompt_length
    per_pass = max(1, ROWS_PER_BACKWARD // rows)
    passes: list[list[torch.Tensor]] = []
    with adapter.rules_applied(rules), adapter.weights_frozen():
        leaves, hidden = adapter.leaves_forward(inputs, ids[:, :-1], mask[:, :-1], torch.arange(rows, device=ids.device))
        explained = adapter.finished(explained_logits(adapter.model.get_output_embeddings(), hidden[:, prompt_length - 1:],
                                                    ids[:, prompt_length:]))
        for start in range(0, steps, per_pass):
            checkpoint()  # a caller's should_stop (relevancy.core.cancel) is asked before each backward round
            count = min(per_pass, steps - start)
            units = torch.zeros(count, rows, steps, dtype=explained.dtype, device=explained.device)
            units[torch.arange(count), :, torch.arange(start, start + count)] = 1
            gradients = torch.autograd.grad(explained, list(leaves.values()), grad_outputs=units,
                                            retain_graph=start + count < steps, is_grads_batched=True)
            text, *others = zip(leaves.values(), gradients)
            passes.append([input_times_gradient(*text),  # (count, B, N - 1)
                           *(adapter.pixel_relevance(widened(x * g).flatten(0, 1), inputs).unflatten(0, (count, rows))
                             for x, g in others)])  # (count, B, H, W)
    scores = torch.nn.functional.pad(torch.cat([p[0] for p in passes]).transpose(0, 1), (0, 1))  # the last token is read by no row
    valid = causal_rows(prompt_length, length, scores.device)[None] & mask.bool()[:, None, :]
    further = {name: torch.cat([p[k] for p in passes]).transpose(0, 1) for k, name in enumerate(list(leaves)[1:], 1)}
    return scores * valid, widened(explained), further
