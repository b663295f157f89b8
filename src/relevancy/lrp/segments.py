"""Gradient checkpointing of a stack of layers that the model calls one by one in its own loop, holding about
log2(L / 8) + 2 layer inputs at once instead of L.

torch's checkpoint around each layer keeps every layer's input for the backward. Here the forward runs each layer
without a graph and keeps only the stack's input (a stack: layers called one after the other, each on the previous
one's output); each layer's output is joined to the graph as a function of that input (`_Joined`). Its backward
runs the layers up to that one again by bisection (`_backpropagated`): the first half without a graph to reach the
second half's input, the second half's gradient first, then the first half's from it, down to runs of `SEGMENT`
layers, whose layers' inputs are each made again from the run's start, last first; one layer at a time with a
graph. Held at once: one input per level, about log2(L / SEGMENT) + 2 of them, and one layer's activations; the
cost about log2(L / SEGMENT) / 2 + (SEGMENT - 1) / 2 + 1 forwards more than the plain call (5.5 at 32 layers, 4 inputs
held; plain bisection 3.5 and 6). The recomputation runs under
`guard.acting_for` the calling thread, so the call's switches (rule forwards) act in whatever thread autograd runs
the backward in.

The gradient reaches the stack's input exactly, also from a layer whose output is read elsewhere (a vision tower's
chosen hidden states: its own node runs the stack up to it again); the gradient *at* a layer's output inside the
stack is not formed, so a caller that reads it (latent relevance) checkpoints per layer.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..core.guard import acting_for
from .engine import replaced

__all__ = ["stacks_recomputed"]

#: one recorded layer call: the layer's own forward, the positional arguments after the hidden state, the keywords
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _hidden(output: Any) -> torch.Tensor:
    """A layer's hidden state: its output, or the first element of a tuple output."""
    return output if isinstance(output, torch.Tensor) else output[0]


def _run(calls: tuple[Call, ...], hidden: torch.Tensor) -> torch.Tensor:
    """The hidden state after `calls`, one after the other from `hidden`."""
    for run, rest, kwargs in calls:
        hidden = _hidden(run(hidden, *rest, **kwargs))
    return hidden


#: a run of at most this many layers is not bisected further: each of its layers' inputs is made again from the
#: run's start, last layer first (one input held for the run instead of three levels of the bisection). On
#: LLaVA-1.5-7B's shape at full depth (NVIDIA H200) the peak beyond the weights: 2.06x a forward's with plain
#: bisection, 2.06x with runs of 4, 1.99x with runs of 8; 5.6, 6.0 and 7.5 forwards
SEGMENT = 8


def _layer_backpropagated(call: Call, start: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient at `start` of one layer's output, given `grad` there: the layer run with a graph."""
    leaf = start.detach().requires_grad_(True)
    with torch.enable_grad():
        (gradient,) = torch.autograd.grad(_run((call,), leaf), leaf, grad)
    return gradient


def _backpropagated(calls: tuple[Call, ...], start: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient at `start` of the output of `calls` run from it, given `grad` there, by bisection: one input
    held per level, one layer's graph at a time; a run of `SEGMENT` layers or fewer from its start alone."""
    if len(calls) <= SEGMENT:
        for last in range(len(calls) - 1, 0, -1):
            with torch.no_grad():
                before = _run(calls[:last], start)
            grad = _layer_backpropagated(calls[last], before, grad)
            del before
        return _layer_backpropagated(calls[0], start, grad)
    half = len(calls) // 2
    with torch.no_grad():
        middle = _run(calls[:half], start)
    grad = _backpropagated(calls[half:], middle, grad)
    del middle
    return _backpropagated(calls[:half], start, grad)


class _Joined(torch.autograd.Function):
    """A layer's `output` (computed without a graph) joined to the graph as a function of its stack's input `start`."""

    @staticmethod
    def forward(ctx: Any, start: torch.Tensor, output: list[torch.Tensor], calls: tuple[Call, ...], owner: int) -> torch.Tensor:
        ctx.save_for_backward(start)
        ctx.calls, ctx.owner = calls, owner
        return output.pop()  # handed over in a list: not an input of the node, so autograd takes it as its output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (start,) = ctx.saved_tensors
        with acting_for(ctx.owner):
            return _backpropagated(ctx.calls, start, grad), None, None, None


@contextmanager
def stacks_recomputed(layers: list[nn.Module]) -> Iterator[None]:
    """Within the block, `layers` run as the module docstring says, their forwards patched in this thread only and
    given back after (`engine.replaced`). A layer whose hidden-state input is not the previous layer's output (the
    first, the next stack, a model that changes the state between layers) starts a stack."""
    owner = threading.get_ident()
    stack: dict[str, Any] = {"start": None, "calls": [], "last": None}

    def forward(*args: Any, _own: Callable[..., Any], **kwargs: Any) -> Any:
        hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        if hidden is not stack["last"]:
            stack["start"], stack["calls"] = hidden, []
        stack["calls"].append((_own, rest, kwargs))
        with torch.no_grad():
            output = _own(hidden, *rest, **kwargs)
        joined = _Joined.apply(stack["start"], [_hidden(output)], tuple(stack["calls"]), owner)
        stack["last"] = joined
        return joined if isinstance(output, torch.Tensor) else (joined, *output[1:])

    with replaced([(layer, "forward", lambda *args, _own=layer.forward, **kwargs: forward(*args, _own=_own, **kwargs))
                   for layer in layers]):
        try:
            yield
        finally:
            stack.clear()
