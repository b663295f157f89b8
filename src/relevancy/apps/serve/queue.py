"""A bounded queue in front of the models: at most K explanations run at once, a few more may wait, the rest
are turned away at once with 503 (before their body is read), one client address may hold only a few places
(429 beyond), and every request has a time limit.

The count of admitted requests lives on the event loop (one thread), so it needs no lock. The work itself runs
in a pool of K threads; a request whose time is up is answered (503 while it waited for a slot, 504 once
running), and a request whose client disconnects is dropped; either way its job is told to stop
(`Deadline.stop`), its thread stops at the next step it checks (between methods; between generated tokens and
backward rounds of a generation, `relevancy.core.cancel`) and only then frees its slot and its memory, so no more
than K computations ever run, whatever the clients do.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

from ...core.cancel import Cancelled
from .limits import ASGIApp, Receive, RequestError, Scope, Send, respond

T = TypeVar("T")

#: seconds a client turned away with 503 is asked to wait (the Retry-After header)
RETRY_AFTER_S = 1


class Deadline:
    """The time left to one request, and whether its job should stop: long jobs call `check()` between steps (or
    hand `should_stop` to the library), so a late or abandoned request stops early."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self._stop = threading.Event()

    def left(self) -> float:
        return self.end - time.monotonic()

    def stop(self) -> None:
        """Ask the job to stop at its next check (its answer is no longer wanted)."""
        self._stop.set()

    def should_stop(self) -> bool:
        """Whether the job should stop: asked to (`stop`) or out of time (the library's `should_stop` hook)."""
        return self._stop.is_set() or self.left() <= 0

    def check(self) -> None:
        if self.should_stop():
            raise TimeUp


class TimeUp(Exception):
    """A job found its request's time used up, or its client gone, between two steps."""


class Gate:
    """Admission (`admit` / `leave`, called by `Admission` for every explanation request) and the K slots
    (`run`). `admitted` counts requests between admission and their answer, `running` the jobs in worker threads
    (a job stopped after its answer still runs to its next check)."""

    def __init__(self, max_running: int, max_waiting: int, time_limit_s: float) -> None:
        self.max_running = max_running
        self.capacity = max_running + max_waiting
        self.time_limit_s = time_limit_s
        self.admitted = 0
        self.running = 0
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None  # of the serving loop
        self._pool = ThreadPoolExecutor(max_workers=max_running, thread_name_prefix="relevancy-explain")

    def admit(self) -> bool:
        if self.admitted >= self.capacity:
            return False
        self.admitted += 1
        return True

    def leave(self) -> None:
        self.admitted -= 1

    async def run(self, job: Callable[[Deadline], T], disconnected: Callable[[], Awaitable[object]] | None = None,
                  advice: str = "ask for fewer methods, a faster method or fewer captions") -> T:
        """`job(deadline)` in a worker thread once a slot is free; 503 when none frees in time, 504 when the job
        itself outlasts the limit (its message ends with `advice`, what asks for less work at this endpoint).
        `disconnected`: awaited alongside, it returns when the client has gone (the job is then stopped and the
        request dropped)."""
        deadline = Deadline(self.time_limit_s)
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:  # a semaphore belongs to one loop (tests start several)
            self._slots = (loop, asyncio.Semaphore(self.max_running))
        slots = self._slots[1]
        gone = asyncio.ensure_future(disconnected()) if disconnected is not None else loop.create_future()
        try:
            slot = asyncio.ensure_future(slots.acquire())
            await asyncio.wait({slot, gone}, timeout=max(deadline.left(), 0), return_when=asyncio.FIRST_COMPLETED)
            if not slot.done():
                slot.cancel()  # asyncio's semaphore hands a slot it was about to give to a cancelled waiter on
                if gone.done():
                    raise RequestError(499, "the client closed the connection while the request waited for a slot")
                raise RequestError(503, f"the server is busy: no explanation slot freed within the time limit of {self.time_limit_s:g} s; try again",
                                   {"Retry-After": str(RETRY_AFTER_S)})
            future = loop.run_in_executor(self._pool, job, deadline)
            self.running += 1
            future.add_done_callback(lambda _: self._done(slots))  # the slot is free when the thread is, not before
            await asyncio.wait({future, gone}, timeout=max(deadline.left(), 0), return_when=asyncio.FIRST_COMPLETED)
            if future.done() and not isinstance(future.exception(), (TimeUp, Cancelled)):
                return future.result()
            deadline.stop()  # the thread stops at its next check and frees its slot and memory then
            future.add_done_callback(_consume)
            if gone.done():
                raise RequestError(499, "the client closed the connection before the answer")
            raise RequestError(504, f"the explanation took longer than the time limit of {self.time_limit_s:g} s; {advice}")
        finally:
            gone.cancel()

    def _done(self, slots: asyncio.Semaphore) -> None:
        self.running -= 1
        slots.release()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _consume(future: asyncio.Future) -> None:
    """Retrieve a late job's outcome, so that its exception is not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


async def until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns once the ASGI `receive` (after the request body) reports the client's disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Admission:
    """ASGI middleware: a request to one of `paths` is let in only while its client address holds fewer than
    `per_client` places (else 429) and the gate has room (else 503), answered before its body is read, so excess
    requests cost no memory and one client cannot fill the queue."""

    def __init__(self, app: ASGIApp, gate: Gate, paths: frozenset[str], per_client: int) -> None:
        self.app = app
        self.gate = gate
        self.paths = paths
        self.per_client = per_client
        self.held: Counter[str] = Counter()  # places held per client address, on the event loop (no lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown",))[0]
        if self.held[client] >= self.per_client:
            await respond(send, 429, f"too many requests from {client}: {self.per_client} explanation requests of "
                                     "yours are in flight; wait for their answers", {"Retry-After": str(RETRY_AFTER_S)})
            return
        if not self.gate.admit():
            await respond(send, 503, f"the server is busy: {self.gate.max_running} explanations are running and "
                                     f"{self.gate.capacity - self.gate.max_running} waiting; try again",
                          {"Retry-After": str(RETRY_AFTER_S)})
            return
        self.held[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.leave()
            self.held[client] -= 1
            if not self.held[client]:
                del self.held[client]
