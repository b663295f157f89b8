"""One forward pass that records what the methods read: attention probabilities and the last attentions' inputs."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..core.cancel import checkpoint
from ..families.base import Adapter, forward_hooks
from ..core.guard import this_thread_only
from .recompute import tokens_in, with_tokens_in
from ..core.streams import AttentionSite
from .targets import Target, resolve_target, target_score

# what `Forward.gradients` applies to each gradient and its tensor before gathering the rows
Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Forward:
    """A recorded forward pass: outputs, recorded tensors, and the resolved target with its score."""

    logits: torch.Tensor
    pre_logits: torch.Tensor
    indices: torch.Tensor  # (B,) explained class per input, -1 for a concept or a callable target
    score: torch.Tensor  # (B,) the explained score, differentiable when recorded with gradients
    sites: list[AttentionSite] = field(default_factory=list)
    attentions: list[torch.Tensor | None] = field(default_factory=list)  # per site (B, heads, T_query, T_key); None: not kept
    attention_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # per stream (B, T, D), CDAM's X
    # with a shared forward: the batch entry each row reads (R,), and the recorded tensor behind each row view
    sources: torch.Tensor | None = None
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)

    def self_attentions(self, stream: str) -> list[torch.Tensor]:
        """The recorded self-attentions of `stream`, block by block."""
        return [a for site, a in zip(self.sites, self.attentions) if site.is_self and site.query == stream]

    def gradients(self, tensors: list[torch.Tensor], combine: Combine | None = None) -> list[torch.Tensor]:
        """d score / d tensor for each tensor, per row; inputs of a batch do not mix, so one backward serves all
        rows of distinct forwards. Rows sharing a forward get theirs from one backward per round (round m: the
        m-th row of every forward): with `combine` reducing each round in place this took half the time of one
        batched backward (`benchmarks/detr_gradient_rounds.py`). A tensor the score does not
        depend on (LXMERT's last image-to-text attention) gets zeros.

        `combine(gradient, tensor)` (detached; it may overwrite the gradient) is applied before the rows are
        gathered, so that a reduction such as generic attention's positive head mean never holds every row's
        full gradient at once."""
        def combined(grads: tuple, originals: list[torch.Tensor]) -> list[torch.Tensor]:
            filled = [torch.zeros_like(t) if g is None else g for t, g in zip(originals, grads)]
            return filled if combine is None else [combine(g, t.detach()) for g, t in zip(filled, originals)]

        if self.sources is None:
            return combined(torch.autograd.grad(self.score.sum(), tensors, allow_unused=True), tensors)
        originals = [self.recorded[id(t)] for t in tensors]
        rounds = _rounds(self.sources)
        count = int(rounds.max()) + 1
        per_round = []
        for m in range(count):
            checkpoint()  # a caller's should_stop (relevancy.core.cancel) is asked before each round
            output = (rounds == m).to(self.score.dtype)
            grads = torch.autograd.grad(self.score, originals, grad_outputs=output, retain_graph=m < count - 1,
                                        allow_unused=True)
            per_round.append(combined(grads, originals))
        if bool((self.sources == 0).all()):  # one forward: round r is row r
            return [torch.cat([grads[k] for grads in per_round]) for k in range(len(tensors))]
        return [torch.stack([grads[k] for grads in per_round])[rounds, self.sources] for k in range(len(tensors))]

    def reduced_gradients(self, tensors: list[torch.Tensor], reduce: Combine, roots: list[torch.Tensor]) -> list[torch.Tensor]:
        """`reduce(d score / d tensor, tensor)` for each tensor, computed as the backward reaches it (a tensor hook),
        so that the full gradients (`(B, heads, T, T)` per block for attention maps) are never held together: one
        backward to `roots` (per stream its earliest tensor: every later one lies on the way to it). `reduce` must
        not write into the gradient, which the backward goes on with. Rows sharing a forward: `gradients` with
        `reduce` as its combine."""
        if self.sources is not None:
            return self.gradients(tensors, combine=reduce)
        reduced: list[torch.Tensor | None] = [None] * len(tensors)

        def keeper(index: int) -> Callable[[torch.Tensor], None]:
            def hook(gradient: torch.Tensor) -> None:
                reduced[index] = reduce(gradient, tensors[index].detach())
            return hook

        handles = [tensor.register_hook(keeper(index)) for index, tensor in enumerate(tensors)]
        try:
            torch.autograd.grad(self.score.sum(), roots, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        return [reduce(torch.zeros_like(t), t.detach()) if r is None else r for t, r in zip(tensors, reduced)]


@contextmanager
def graph_from_last_block(blocks: list, recorded: dict[str, torch.Tensor]) -> Iterator[None]:
    """During the block, the forward records no graph before the last of `blocks`, whose input becomes a leaf of the
    graph (the values are the same; gradients inside the last block and at its input are the same). A tensor of
    `recorded` that is that input (a post-norm block's attention input: the previous block's output) is replaced by
    the leaf. Grad mode is left to the caller's `set_grad_enabled`, which restores it."""
    if len(blocks) < 2:
        yield
        return

    def before_first(_module, _args) -> None:
        torch.set_grad_enabled(False)

    def leaf(tokens: torch.Tensor) -> torch.Tensor:
        made = tokens.detach().requires_grad_(True)
        for name, tensor in list(recorded.items()):
            if tensor is tokens:
                recorded[name] = made
        return made

    def before_last(_module, args: tuple, kwargs: dict):
        torch.set_grad_enabled(True)
        return with_tokens_in(args, kwargs, leaf(tokens_in(args, kwargs)))

    handles = [blocks[0].register_forward_pre_hook(this_thread_only(before_first)),
               blocks[-1].register_forward_pre_hook(this_thread_only(before_last), with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _rounds(sources: torch.Tensor) -> torch.Tensor:
    """For each row, how many earlier rows read the same forward."""
    same = sources[:, None] == sources[None, :]
    return (same.tril(-1)).sum(1)


def _per_row(tensor: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """The recorded tensor's entry for each row: a broadcast view when every row reads the one forward."""
    if len(tensor) == 1:
        return tensor.expand(len(sources), *tensor.shape[1:])
    return tensor[sources]


def record_forward(
    adapter: Adapter,
    inputs: Any,
    target: Target,
    *,
    attentions: bool = False,
    attention_inputs: bool = False,
    gradients: bool = False,
    share_rows: bool = False,
    head_mean: bool = False,
    last_block_graph: bool = False,
    last_attention_only: bool = False,
) -> Forward:
    """Run the model once, recording the asked-for tensors (the adapter's `explaining` context must be active).

    `share_rows`: rows that explain scores of one forward pass (`Adapter.forward_shared`) run it once; the
    recorded tensors are then views per row and `Forward.gradients` gives each row its own gradient. For
    methods that read attentions and gradients only (LRP needs a backward of its own per row).
    `head_mean`: keep each attention's mean over its heads only, `(B, 1, T_query, T_key)`, as soon as it is made
    (methods that read no gradient and no single head: a head's `(T, T)` map per block is not held).
    `last_block_graph`: with `gradients`, record the autograd graph from the last block's input on only (one-stream
    families that name their `blocks`): for methods whose gradients are taken inside the last block, the backward
    crosses one block and the graph of the others is never held. `last_attention_only`: keep each stream's last
    self-attention only (the others are None), for methods that read nothing else."""
    sites = adapter.attention_sites() if attentions else []
    recorded: list[torch.Tensor] = [None] * len(sites)  # type: ignore[list-item]
    entering = adapter.attention_inputs() if attention_inputs else {}
    seen: dict[str, torch.Tensor] = {}
    names = list(entering)

    last_of_stream = {site.query: k for k, site in enumerate(sites) if site.is_self}
    kept = set(last_of_stream.values()) if last_attention_only else set(range(len(sites)))

    def keep_attention(k: int, out: torch.Tensor) -> None:
        if k in kept:
            recorded[k] = out.mean(1, keepdim=True) if head_mean else out

    def keep_input(k: int, out: torch.Tensor) -> None:
        seen[names[k]] = out

    with forward_hooks([s.probabilities for s in sites], keep_attention), forward_hooks(
        list(entering.values()), keep_input
    ), torch.set_grad_enabled(gradients), graph_from_last_block(adapter.blocks if gradients and last_block_graph else (), seen):
        shared = adapter.forward_shared(inputs, graph=gradients) if share_rows else None
        if shared is None:
            logits, pre_logits = adapter.forward(inputs, graph=gradients)
            sources = None
        else:
            logits, pre_logits, sources = shared
        indices = resolve_target(target, logits)
        score = target_score(target, indices, logits, pre_logits, graph=gradients)
    behind: dict[int, torch.Tensor] = {}

    def per_row(tensor: torch.Tensor) -> torch.Tensor:
        view = _per_row(tensor, sources)
        behind[id(view)] = tensor
        return view

    if sources is not None:
        recorded = [None if t is None else per_row(t) for t in recorded]
        seen = {name: per_row(t) for name, t in seen.items()}
    return Forward(
        logits=logits.detach(),
        pre_logits=pre_logits.detach(),
        indices=indices,
        score=score,
        sites=sites,
        attentions=recorded,
        attention_inputs=seen,
        sources=sources,
        recorded=behind,
    )
