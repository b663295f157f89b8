"""Gradient checkpointing in segments of layers, for stacks whose model calls the layers one by one in its own loop.

torch's checkpoint around each layer keeps every layer's input for the backward: L inputs at once. Here the forward
runs each layer without a graph and keeps only the input of each segment's first layer (a segment: up to `size`
layers called one after the other, each on the previous one's output); each layer's output is joined to the graph
as a function of its segment's first input (`_Joined`). Its backward runs the segment's layers up to that one again
from that input, each under torch's non-reentrant checkpoint (so only their inputs are held, and one layer's
activations), and carries the gradient back to the segment's input. With `size` about sqrt(L) the inputs held at
once are about 2 sqrt(L) instead of L, for about one forward more than per-layer checkpointing. The recomputation
runs under `guard.acting_for` the calling thread, so that the call's switches (rule forwards) act in whatever thread
autograd runs the backward in.

The gradient reaches each segment's input exactly (also from a layer inside a segment whose output is read
elsewhere, as a vision tower's chosen hidden state: its own node recomputes the segment up to it); the gradient *at*
a layer output inside a segment is not formed, so a caller that reads it (latent relevance) checkpoints per layer.
"""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint
from torch import nn

from ..core.guard import acting_for, recomputed_as_this_thread
from .engine import replaced

__all__ = ["segment_size", "segments_recomputed"]

#: one recorded layer call: the layer's own forward, the positional arguments after the hidden state, the keywords
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def segment_size(layers: int) -> int:
    """Layers per segment for a stack of `layers` layers: ceil(sqrt(layers)), which about minimises the segments'
    inputs plus the inputs of the one segment run again (a vision tower and a decoder each their own)."""
    return max(1, math.ceil(math.sqrt(layers)))


def _hidden(output: Any) -> torch.Tensor:
    """A layer's hidden state: its output, or the first element of a tuple output."""
    return output if isinstance(output, torch.Tensor) else output[0]


def _rerun(calls: tuple[Call, ...], start: torch.Tensor, grad: torch.Tensor, owner: int) -> torch.Tensor:
    """The gradient at `start` of the last call's output, given `grad` there: `calls` run again from `start`, each
    layer under torch's checkpoint, with the call's switches acting (`acting_for(owner)`)."""
    with torch.enable_grad(), acting_for(owner):
        leaf = start.detach().requires_grad_(True)
        hidden = leaf
        context = recomputed_as_this_thread()
        for run, rest, kwargs in calls:
            hidden = _hidden(torch.utils.checkpoint.checkpoint(run, hidden, *rest, use_reentrant=False, context_fn=context, **kwargs))
        (gradient,) = torch.autograd.grad(hidden, leaf, grad)
    return gradient


class _Joined(torch.autograd.Function):
    """`output` (computed without a graph) joined to the graph as a function of its segment's first input `start`."""

    @staticmethod
    def forward(ctx: Any, start: torch.Tensor, output: list[torch.Tensor], calls: tuple[Call, ...], owner: int) -> torch.Tensor:
        ctx.save_for_backward(start)
        ctx.calls, ctx.owner = calls, owner
        return output.pop()  # handed over in a list: not an input of the node, so autograd takes it as its output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (start,) = ctx.saved_tensors
        return _rerun(ctx.calls, start, grad, ctx.owner), None, None, None


@contextmanager
def segments_recomputed(stacks: list[list[nn.Module]]) -> Iterator[None]:
    """Within the block, the layers of each stack (in the order the model calls them) run in segments of up to
    `segment_size(len(stack))` layers as the module docstring says (their forwards patched in this thread only and given back after, `engine.replaced`). A layer whose hidden-state input is not the previous layer's output
    (the next stack, a model that changes the state between layers) starts a new segment."""
    owner = threading.get_ident()
    segment: dict[str, Any] = {"start": None, "calls": [], "last": None}

    def forward(*args: Any, _run: Callable[..., Any], _size: int, **kwargs: Any) -> Any:
        hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        if hidden is not segment["last"] or len(segment["calls"]) == _size:
            segment["start"], segment["calls"] = hidden, []
        segment["calls"].append((_run, rest, kwargs))
        with torch.no_grad():
            output = _run(hidden, *rest, **kwargs)
        joined = _Joined.apply(segment["start"], [_hidden(output)], tuple(segment["calls"]), owner)
        segment["last"] = joined
        return joined if isinstance(output, torch.Tensor) else (joined, *output[1:])

    with replaced([(layer, "forward", lambda *args, _run=layer.forward, _size=segment_size(len(stack)), **kwargs:
                    forward(*args, _run=_run, _size=_size, **kwargs)) for stack in stacks for layer in stack]):
        try:
            yield
        finally:
            segment.clear()
