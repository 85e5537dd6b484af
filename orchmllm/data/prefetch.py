"""Run a per-step producer ahead of the training loop in a background thread.

The producer of a balanced loader issues collectives (metadata all-gather, example
moves), so every rank must run exactly the same steps of it, even when the loop stops
early. The rule that guarantees it: the producer runs at most ``depth`` steps ahead of
what the loop consumed (a bounded queue), and on close it may still finish every step it
could have started, ``< start + consumed + depth + 1``, and no other. That bound depends
only on how many steps the loop consumed, so ranks that stop at the same step run the
same collectives and nothing hangs. Errors in the producer are re-raised in the loop.

Ranks whose loops stop at different steps cannot be told apart by that rule alone: the
one that consumed more is still producing when the other stops. ``on_close(step,
consumed)`` runs at ``step``, the first step the rule forbids, so that a producer can tell
its peers where its loop stopped at a point every peer reaches (see
:func:`orchmllm.data.exchange.leave_epoch`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_ITEM, _END, _ERROR = 0, 1, 2


class _Shared:
    """What the producer thread sees: no reference back to the iterator, so an
    abandoned iterator can be garbage collected (and closed) while the thread runs."""

    def __init__(self, depth: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.limit: int | None = None  # exclusive bound on steps the producer may start
        self.consumed = 0  # absolute count of items the loop consumed, set before limit
        self.close_error: BaseException | None = None  # raised by on_close


def _run(
    produce: Callable[[int], T],
    start: int,
    shared: _Shared,
    on_close: Callable[[int, int], None] | None,
) -> None:
    step = start
    try:
        while shared.limit is None or step < shared.limit:
            try:
                item = produce(step)
            except StopIteration:
                shared.queue.put((_END, None))
                return
            shared.queue.put((_ITEM, item))
            step += 1
    except BaseException as exc:  # surfaces in the training loop
        shared.queue.put((_ERROR, exc))
        return
    if on_close is not None:  # stopped by close(), at step == limit
        try:
            on_close(step, shared.consumed)
        except BaseException as exc:  # surfaces in close()
            shared.close_error = exc


class Prefetcher(Generic[T], Iterator[T]):
    """Yields ``produce(start)``, ``produce(start + 1)``, ... until it raises StopIteration.

    With ``depth >= 1`` a daemon thread keeps up to ``depth`` results ready; with
    ``depth == 0`` each result is produced when asked (synchronous, same results).
    ``on_close(step, consumed)``: see the module docstring; it is not called when the
    producer ended by itself (StopIteration or an error).
    """

    def __init__(
        self,
        produce: Callable[[int], T],
        *,
        start: int = 0,
        depth: int = 2,
        name: str = "orchmllm-prefetch",
        close_timeout: float = 300.0,
        on_close: Callable[[int, int], None] | None = None,
    ) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.produce = produce
        self.start = start
        self.depth = depth
        self.consumed = 0
        self.close_timeout = close_timeout
        self.on_close = on_close
        self.wait_s = 0.0  # time the loop spent blocked in __next__ (not hidden)
        self._done = False
        self._ended = False  # the producer is done: StopIteration, an error, or close()
        self._pid = os.getpid()
        self._shared = _Shared(depth)
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(
                target=_run,
                args=(produce, start, self._shared, on_close),
                name=name,
                daemon=True,
            )
            self._thread.start()

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            if self._thread is None:
                try:
                    item = self.produce(self.start + self.consumed)
                except BaseException:
                    self._done = self._ended = True
                    raise
            else:
                kind, item = self._shared.queue.get()
                if kind == _END:
                    self._done = True
                    raise StopIteration
                if kind == _ERROR:
                    self._done = True
                    raise item
        finally:
            self.wait_s += time.perf_counter() - t0
        self.consumed += 1
        return item

    def close(self) -> None:
        """Let the producer finish the steps it may have started, then stop it.

        Blocks until the thread ends (at most ``depth + 1`` more steps of work, then
        ``on_close``) or ``close_timeout`` passes; raises ``TimeoutError`` in the latter
        case (a peer rank stopped at a different step, so a collective cannot complete).
        Raises what ``on_close`` raised.
        """
        self._done = True
        if self._ended:
            return
        consumed = self.start + self.consumed
        thread = self._thread
        if thread is None:
            self._ended = True
            if self.on_close is not None:
                self.on_close(consumed, consumed)
            return
        self._shared.consumed = consumed
        self._shared.limit = consumed + self.depth + 1
        deadline = time.monotonic() + self.close_timeout
        while thread.is_alive():
            # drain, so a producer blocked on a full queue can finish
            with contextlib.suppress(queue.Empty):
                self._shared.queue.get(timeout=0.05)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"prefetch thread {thread.name} did not stop within {self.close_timeout}s: "
                    "another rank is still iterating, or stopped after another number of steps"
                )
        thread.join()
        self._thread, self._ended = None, True
        error, self._shared.close_error = self._shared.close_error, None
        if error is not None:
            raise error

    def __del__(self, _getpid=os.getpid, _finalizing=sys.is_finalizing) -> None:
        # Dropped mid-way: stop as close() would, but never in a process forked from this
        # one (a DataLoader worker): on_close may run a collective on the parent's sockets.
        # Nor at interpreter shutdown: module globals may be gone by then (hence the two
        # functions bound as defaults), the daemon thread can no longer run to let close()
        # finish, and it ends with the process anyway.
        if _finalizing() or getattr(self, "_ended", True) or _getpid() != self._pid:
            return
        with contextlib.suppress(Exception):
            self.close()
