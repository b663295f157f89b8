"""Cooperative cancellation: a long call asks, between its steps, whether its caller wants it stopped.

`stopping(should_stop)` makes `should_stop` (a callable answering True once the work should end: a deadline
passed, a client gone) the current thread's hook; `checkpoint()` raises `Cancelled` where it answers True. The
checks sit between steps (generated tokens, backward rounds, groups of rows, methods), never inside one, so a
stopped call leaves the model as every call does: its `finally` blocks restore it. No thread is killed.
"""
from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["Cancelled", "cancellable", "checkpoint", "stopping"]

F = TypeVar("F", bound=Callable[..., Any])

_hook: ContextVar[Callable[[], bool] | None] = ContextVar("relevancy_should_stop", default=None)


class Cancelled(RuntimeError):
    """The work was stopped between two steps because its `should_stop` answered True."""


@contextmanager
def stopping(should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, `checkpoint()` in this thread (and context) asks `should_stop`; None: never stop."""
    if should_stop is not None and not callable(should_stop):
        raise TypeError(f"should_stop must be a callable returning True to stop, or None, got {type(should_stop).__name__}")
    token = _hook.set(should_stop)
    try:
        yield
    finally:
        _hook.reset(token)


def checkpoint() -> None:
    """Raise `Cancelled` if the current `should_stop` answers True (nothing without one)."""
    should_stop = _hook.get()
    if should_stop is not None and should_stop():
        raise Cancelled("stopped between two steps: the caller's should_stop answered True")


def cancellable(function: F) -> F:
    """`function` with a keyword `should_stop` (default None): it runs within `stopping(should_stop)`."""
    @functools.wraps(function)
    def wrapper(*args: Any, should_stop: Callable[[], bool] | None = None, **kwargs: Any) -> Any:
        with stopping(should_stop):
            checkpoint()
            return function(*args, **kwargs)

    signature = inspect.signature(function)
    extra = inspect.Parameter("should_stop", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Callable[[], bool] | None")
    wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), extra])  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
