"""AttnLRP, CP-LRP and input x gradient on the encoders (ViT, DeiT, DINOv2, BERT, CLIP's towers, Swin): the family's
rule map (the same canonical forwards as the seeds' LRP methods) run under a rule set that carries a gradient, and
input x gradient at each stream's embeddings (`Adapter.embedding_leaves`), summed over the width, as lxt measures it.

The rule map's operations apply the gradient rule set's rules (`lrp.gradient`): LayerNorm and RMSNorm with the
divisor constant, the activations under the identity rule, attention's queries and keys 1/4 and values 1/2 of the
backward (AttnLRP) or queries and keys detached (CP-LRP), gating products their shares; Linear layers,
convolutions, additions and the softmax keep their own gradient. Relevance reaching the [CLS] and position
embeddings and the biases is not on the map: `relevance_total` is the share of the explained score that reaches
the embeddings read.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn

from ..core.guard import this_thread_only
from ..families.base import Adapter
from ..lrp import RuleSet, relevance_session
from .capture import record_forward
from .relevance import masked
from .targets import Target


def _leaf_hook(kept: list[torch.Tensor]) -> Callable[[nn.Module, tuple, Any], Any]:
    """A forward hook that makes the module's output (a tuple's first item) a leaf of the graph, kept in `kept`."""

    def hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
        tokens = output[0] if isinstance(output, tuple) else output
        leaf = tokens.detach().requires_grad_(True)
        kept.append(leaf)
        return (leaf, *output[1:]) if isinstance(output, tuple) else leaf

    return hook


def embedding_relevance(adapter: Adapter, inputs: Any, target: Target, rules: RuleSet | None) -> tuple:
    """`(scores, indices, logits, fields)`: per stream, input x gradient of the explained score at its embeddings
    `(B, N)` over its content tokens, the backward under `rules` (None: the plain gradient, the model's own forward);
    the rule-based ones report `relevance_total`, the share of the explained score reaching the embeddings (0 where
    the score is 0)."""
    places = adapter.embedding_leaves()
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in places}
    handles = [place.module.register_forward_hook(this_thread_only(_leaf_hook(kept[name]))) for name, place in places.items()]
    session = nullcontext() if rules is None else relevance_session(adapter.model, adapter.relevance_rule_map(), rules)
    try:
        with session:
            fwd = record_forward(adapter, inputs, target, gradients=True)
    finally:
        for handle in handles:
            handle.remove()
    if any(len(leaves) != 1 for leaves in kept.values()):
        counts = ", ".join(f"{name}: {len(leaves)}" for name, leaves in kept.items())
        raise RuntimeError(f"each stream's embeddings must run once per forward; they ran {counts}")
    leaves = [leaves[0] for leaves in kept.values()]
    grads = torch.autograd.grad(fwd.score.sum(), leaves, allow_unused=True)
    streams = adapter.streams(inputs)
    scores: dict[str, torch.Tensor] = {}
    for (name, place), leaf, grad in zip(places.items(), leaves, grads):
        relevance = torch.zeros_like(leaf) if grad is None else leaf.detach() * grad
        scores[name] = masked(streams[name], relevance.sum(place.width).flatten(1))
    fields: dict[str, Any] = {}
    if rules is not None:
        explained = fwd.score.detach()
        nonzero = explained != 0
        totals = [(s.sum(1) / explained.where(nonzero, 1)) * nonzero for s in scores.values()]
        fields["relevance_total"] = totals[0] if len(totals) == 1 else torch.stack(totals, 1)
    return (next(iter(scores.values())) if len(scores) == 1 else scores), fwd.indices, fwd.logits, fields
