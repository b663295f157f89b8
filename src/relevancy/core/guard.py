"""Safe under any call: one explanation at a time per model, and autograd on whatever context the caller is in.

An explanation switches state on the user's model for its duration (eval mode, timm's `fused_attn`, a text
model's attention implementation, hooks, patched forwards), so two calls on one model from different threads
would see each other's switches. `exclusive` serialises them with a re-entrant lock per object (a nested call
from the same thread goes through); calls on different models run in parallel. The locks live in a registry
that holds its objects weakly, keyed by identity, so models are still garbage-collected and objects without a
hash (Hugging Face configs) can be locked too.

The lock does not hold back the user's own forward passes on the model from other threads. So everything an
explanation attaches to the model (hooks, patched forwards) acts only in the thread that attached it
(`this_thread_only`); in any other thread the model computes as it always does and nothing is recorded. The one
exception is the call's own backward: autograd may run it in a thread of its own (CUDA's device threads), and a
checkpoint's recomputation of the call's layers there must run the call's forwards. The recomputation enters
`acting_for(owner)` (torch's checkpoint `context_fn`: `recomputed_as_this_thread`), which lets the gates of the thread
`owner` act in the thread running it for that block only; a user's forward in any other thread stays untouched.
"""
from __future__ import annotations

import dataclasses
import threading
import types
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator, TypeVar

import torch

_locks: dict[int, threading.RLock] = {}
_registry = threading.Lock()
#: per thread, the idents of the threads whose gates act in it besides its own (see `acting_for`)
_acting = threading.local()

T = TypeVar("T")


def this_thread_only(hook: Callable[..., T], otherwise: Callable[..., T] | None = None) -> Callable[..., T | None]:
    """`hook` as it acts in the calling thread; in any other thread `otherwise(*args)` (by default nothing, which
    for a forward hook means "output unchanged"). For everything an explanation attaches to a user's model."""
    owner = threading.get_ident()

    state = types.SimpleNamespace(retired=None)  # not the function itself: a gate must not refer to itself (a cycle)

    def gated(*args, **kwargs):
        if state.retired is None and acts_for(owner):
            return hook(*args, **kwargs)
        return None if otherwise is None else otherwise(*args, **kwargs)

    # the hook's signature (`inspect.signature` follows `__wrapped__`: transformers inspects forwards, e.g.
    # feed_forward_chunk) and name; not `functools.wraps`, which copies more and costs a microsecond per gate
    gated.__wrapped__, gated.__name__, gated.__qualname__ = hook, getattr(hook, "__name__", "gated"), getattr(hook, "__qualname__", "gated")

    #: `state.retired` is set by `lrp.engine.replaced` when its call ends while a later call's patch sits on top of
    #: this gate: from then on the gate only hands on to `otherwise`, and the later call's restore skips it
    #: (`(had_own, previous)`: what the gate replaced)
    gated.gate_state = state
    return gated


def acts_for(owner: int) -> bool:
    """Whether the calling thread acts for thread `owner`: it is that thread, or runs that thread's work under
    `acting_for`. Every gate of a call's switches asks this."""
    return threading.get_ident() == owner or owner in getattr(_acting, "owners", ())


@contextmanager
def acting_for(owner: int) -> Iterator[None]:
    """For the block, in the calling thread, the gates that `this_thread_only` made in thread `owner` act as in
    that thread: for the call's own work that autograd runs elsewhere (a checkpoint's recomputation in a device
    thread). Nested and concurrent blocks keep their own owners; every other thread is unaffected."""
    before = getattr(_acting, "owners", frozenset())
    _acting.owners = before | {owner}
    try:
        yield
    finally:
        _acting.owners = before


def recomputed_as_this_thread() -> Callable[[], tuple[ContextManager[None], ContextManager[None]]]:
    """A `context_fn` for `torch.utils.checkpoint.checkpoint` made in the explaining thread: the forward as it is,
    the recomputation (in whatever thread autograd runs the backward) under `acting_for` this thread, so that it
    runs the call's forwards again, not the model's own."""
    owner = threading.get_ident()
    return lambda: (nullcontext(), acting_for(owner))


def _lock_of(owner: object) -> threading.RLock:
    """The re-entrant lock of `owner`, created on first use and dropped when `owner` is garbage-collected."""
    with _registry:
        lock = _locks.get(id(owner))
        if lock is None:
            lock = _locks[id(owner)] = threading.RLock()
            # runs while `owner` is collected, before its id can be reused; dict.pop is atomic, so no lock needed
            weakref.finalize(owner, _locks.pop, id(owner), None)
        return lock


@contextmanager
def exclusive(*owners: object) -> Iterator[None]:
    """Hold the locks of all `owners` for the block; taken in one global order, so two calls never deadlock."""
    distinct = {id(owner): owner for owner in owners}
    with ExitStack() as stack:
        for key in sorted(distinct):
            stack.enter_context(_lock_of(distinct[key]))
        yield


@contextmanager
def gradients_enabled() -> Iterator[None]:
    """Autograd on for the block, also when the caller is inside `no_grad`, `set_grad_enabled(False)` or
    `inference_mode`: the gradient methods need a graph, and tensors made here are ordinary tensors."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def ordinary(value: T) -> T:
    """`value` with inference tensors (made under `torch.inference_mode`, which autograd cannot save) cloned into
    ordinary ones; a tensor or the tensor fields of a dataclass (a tokenised batch). Use inside `gradients_enabled`."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cloned = {
            f.name: getattr(value, f.name).clone()
            for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), torch.Tensor) and getattr(value, f.name).is_inference()
        }
        return dataclasses.replace(value, **cloned) if cloned else value
    return value


def finite(value: T) -> T:
    """`value` (a tensor, or a dataclass of tensors: a checked batch) as it is, where every floating-point tensor holds
    finite numbers only; a one-line ValueError naming the input otherwise (NaN or infinite pixels or features give
    maps of NaN, never an explanation)."""
    named = [("inputs", value)] if isinstance(value, torch.Tensor) else [
        (f.name, getattr(value, f.name)) for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) and not isinstance(value, type) else []
    for name, tensor in named:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{name} holds {bad} NaN or infinite value{'s' if bad > 1 else ''} (of {tensor.numel()}): "
                             "relevance of such inputs is not defined; check the preprocessing")
    return value
