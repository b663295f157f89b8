"""Blocks run again in the backward, so that one block's activations are held at a time (checkpointing by hand).

While `BlockRecompute.recording()` is active, each block runs without an autograd graph: what it was called with
is kept and its output becomes a leaf of the graph, so the forward keeps each block's input tokens and the graph
after the last block. The backward then goes down block by block (`passes_down`): each block runs again with its
graph, every pass (a gradient pass, a relevance pass) crosses it, and its graph is dropped before the next.
Unlike torch's checkpoint, several passes share one rerun, and the caller reads tensors made inside the block
(the attention probabilities) as each block is crossed. The values are the forward's own: a block computes the
same numbers when it runs again.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..families.base import Adapter, UnsupportedModelError
from ..core.guard import this_thread_only

# (mode, outputs, inputs, seed at the outputs) -> the pass's values at the inputs (zeros where they do not depend)
Backward = Callable[[str, torch.Tensor, list[torch.Tensor], torch.Tensor], list[torch.Tensor]]


def tokens_in(args: tuple, kwargs: dict) -> torch.Tensor:
    """The tokens a block is called with: its first argument, or Hugging Face's `hidden_states` keyword."""
    return args[0] if args else kwargs["hidden_states"]


def with_tokens_in(args: tuple, kwargs: dict, tokens: torch.Tensor) -> tuple[tuple, dict]:
    """A block's call with other tokens in their place (see `tokens_in`)."""
    if args:
        return (tokens, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": tokens}


def _tokens_of(output: Any) -> torch.Tensor:
    """A block's output tokens: the output itself or the first item of a tuple (Hugging Face layers)."""
    return output if isinstance(output, torch.Tensor) else output[0]


def _with_tokens_of(output: Any, tokens: torch.Tensor) -> Any:
    return tokens if isinstance(output, torch.Tensor) else (tokens, *output[1:])


@dataclass
class BlockCall:
    """One block's call in the forward: its arguments, the tokens that entered (with the forward's graph: the first
    block's come from the embedding) and the leaf the model went on with."""

    args: tuple
    kwargs: dict
    entered: torch.Tensor
    grad_enabled: bool
    left: torch.Tensor | None = None


class BlockRecompute:
    """The blocks of a one-stream model (`Adapter.blocks`), run without a graph in the forward and again in the
    backward. `forget`: lists that a block appends to as it runs (a relevance session's attentions); what a block
    added in the forward is dropped at its end, so the forward holds no block's tensors."""

    def __init__(self, blocks: Sequence[nn.Module], forget: Sequence[list] = ()) -> None:
        self.blocks = list(blocks)
        self.forget = list(forget)
        self.calls: list[BlockCall] = []
        self.rerunning = False

    @classmethod
    def of(cls, adapter: Adapter, inputs: Any, forget: Sequence[list] = (), last_only: bool = False) -> BlockRecompute:
        """The adapter's blocks; a clear error for families with several streams or no named blocks, and, unless the
        passes cross the `last_only` block, for streams whose tokens are merged between blocks."""
        streams = adapter.streams(inputs)
        if len(streams) != 1 or not adapter.blocks:
            raise checkpoint_refused(adapter)
        (stream,) = streams.values()
        if not last_only and stream.layout is not None and any(merge is not None for merge in stream.layout.merges):
            raise UnsupportedModelError(
                f"checkpoint=True runs each block again from the previous block's output; the {adapter.family} family "
                "merges its tokens between stages (outside the blocks). To hold less memory, explain fewer inputs at "
                "once: rows_at_once=1")
        return cls(adapter.blocks, forget)

    @contextmanager
    def recording(self) -> Iterator[BlockRecompute]:
        """The forward in this block keeps no block's graph (see the class)."""
        grad_before = torch.is_grad_enabled()
        lengths: list[int] = []

        def before(_module, args: tuple, kwargs: dict) -> None:
            if self.rerunning:
                return
            self.calls.append(BlockCall(args, kwargs, tokens_in(args, kwargs), torch.is_grad_enabled()))
            lengths[:] = [len(kept) for kept in self.forget]
            torch.set_grad_enabled(False)

        def after(_module, _args: tuple, _kwargs: dict, output: Any) -> Any:
            if self.rerunning:
                return None
            call = self.calls[-1]
            torch.set_grad_enabled(call.grad_enabled)
            for kept, length in zip(self.forget, lengths):
                del kept[length:]
            call.left = _tokens_of(output).detach().requires_grad_(call.grad_enabled)
            return _with_tokens_of(output, call.left)

        handles = [h for block in self.blocks for h in (
            block.register_forward_pre_hook(this_thread_only(before), with_kwargs=True),
            block.register_forward_hook(this_thread_only(after), with_kwargs=True),
        )]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            torch.set_grad_enabled(grad_before)
        if len(self.calls) != len(self.blocks):
            raise RuntimeError(f"the forward called {len(self.calls)} blocks where the model has {len(self.blocks)}")

    @property
    def output(self) -> torch.Tensor:
        """The last block's output as the rest of the model read it: a leaf, where the passes down start."""
        return self.calls[-1].left

    def rerun(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `index` run again with its graph: `(its input, a leaf; its output tokens)`."""
        call = self.calls[index]
        tokens = call.entered.detach().requires_grad_(True)
        args, kwargs = with_tokens_in(call.args, call.kwargs, tokens)
        self.rerunning = True
        try:
            with torch.enable_grad():
                output = self.blocks[index](*args, **kwargs)
        finally:
            self.rerunning = False
        return tokens, _tokens_of(output)


def checkpoint_refused(adapter: Adapter) -> UnsupportedModelError:
    """The error for `checkpoint=True` on a family it does not apply to, naming what does."""
    return UnsupportedModelError(
        f"checkpoint=True runs each block of a one-stream model again in the backward (ViT, BERT, decoder language "
        f"models); the {adapter.family} family has several token streams. To hold less memory, explain fewer inputs "
        "at once: rows_at_once=1"
    )


def passes_down(
    recompute: BlockRecompute,
    first: int,
    score: torch.Tensor,
    modes: tuple[str, ...],
    backward: Backward,
    made: list[torch.Tensor],
    visit: Callable[[int, list[torch.Tensor], dict[str, list[torch.Tensor]]], None] = lambda *_: None,
) -> dict[str, torch.Tensor]:
    """Each pass (`modes`, run by `backward`) from the explained `score` `(B,)`, recorded while `recompute` recorded
    the forward, down to the input of block `first`: through the graph after the blocks to the last block's
    output, then one block run again at a time. `made`: the list a rerun appends its attention probabilities to
    (read and emptied after each block); `visit(block, those tensors, per mode the pass's values at them)`. Returns
    per mode the values at the input of block `first`."""
    total = score.sum()
    at = {mode: backward(mode, total, [recompute.output], torch.ones_like(total))[0] for mode in modes}
    for index in reversed(range(first, len(recompute.blocks))):
        made.clear()
        tokens, output = recompute.rerun(index)
        inside = list(made)
        found = {mode: backward(mode, output, [tokens, *inside], seed) for mode, seed in at.items()}
        visit(index, inside, {mode: values[1:] for mode, values in found.items()})
        at = {mode: values[0] for mode, values in found.items()}
        del tokens, output, inside, found
    made.clear()
    return at


def gradient_pass(_mode: str, outputs: torch.Tensor, inputs: list[torch.Tensor], seed: torch.Tensor) -> list[torch.Tensor]:
    """An ordinary gradient pass as a `Backward` (zeros where the outputs do not depend on an input)."""
    found = torch.autograd.grad(outputs, inputs, seed, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found)]
