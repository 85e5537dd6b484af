"""Preemption: a scheduler's stop signal ends the job at a step every rank agrees on.

A scheduler preempting a job sends SIGTERM (SLURM first sends an optional warning signal,
``--signal=USR1@90``) and kills it a grace period later. Dying at the signal loses every step
since the last periodic checkpoint; so each rank only notes the signal, and at the end of
every step the ranks agree, in one small all-reduce, whether any of them got one. The first
step at which they do is the last one for every rank: the trainer writes its checkpoint,
releases the directory's lock and exits with :data:`PREEMPTED`. A signal that arrives during
a collective, a checkpoint or start-up is seen at the next step's end.

Grace. The signal also starts a clock in a watcher thread (it learns of the signal through
the interpreter's wakeup fd, so even a main thread blocked in a collective does not delay
it): if the job has not ended ``grace`` seconds after the signal, it is abandoned there (the
lock released, the partial checkpoint left for the next job to remove) and the process exits
with :data:`PREEMPTED`, before the scheduler's SIGKILL. Without a checkpoint directory there
is nothing to finish: the process exits at once, saying so.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from orchmllm.compat import leave_process

__all__ = ["DEFAULT_SIGNALS", "PREEMPTED", "Preempted", "Preemption", "parse_signal"]

PREEMPTED = 75  # EX_TEMPFAIL: stopped by the scheduler, rerun the same command to continue
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT")


class Preempted(RuntimeError):
    """The ranks agreed to stop at a signal (raised on every rank at the same step)."""

    def __init__(self, message: str, *, signal_name: str, step: int) -> None:
        super().__init__(message)
        self.signal_name, self.step = signal_name, step


def parse_signal(name: str) -> signal.Signals:
    """A signal by name (``SIGUSR1``, ``USR1``) or number; ValueError naming the value."""
    text = str(name).strip().upper()
    try:
        return (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
        )
    except (KeyError, ValueError):
        raise ValueError(
            f"--preempt-signal must name a signal (SIGUSR1, USR1, 10), got {name!r}"
        ) from None


class Preemption:
    """Notes the stop signals of this process and keeps the grace clock (module docstring).

    Args:
        signals: the signals that preempt (each caught instead of its default action).
        grace: seconds from the first signal to a forced exit.
        saving: whether the job can save at the agreed step (``--checkpoint-dir``); if not, a
            signal exits the process at once.
        on_abandon: called (in the watcher thread) before a forced exit, e.g. to release a
            lock; errors in it are reported, not raised.

    A context manager: entering installs the handlers (only the main thread can take
    signals: elsewhere it does nothing and :attr:`signal_name` stays None), leaving restores
    the previous ones.
    """

    def __init__(
        self,
        signals: Sequence[signal.Signals],
        *,
        grace: float,
        saving: bool,
        on_abandon: Callable[[], None] | None = None,
    ) -> None:
        if not (isinstance(grace, int | float) and grace > 0):
            raise ValueError(f"--preempt-grace must be a number of seconds > 0, got {grace!r}")
        self.signals = tuple(dict.fromkeys(signals))
        self.grace, self.saving = float(grace), saving
        self.on_abandon = on_abandon
        self.signal_name: str | None = None  # the first stop signal received
        self.where = "start-up"  # what the job is doing, for the message of a forced exit
        self._at: float | None = None
        self._lock = threading.RLock()  # a second signal may run the handler inside the first
        self._previous: dict[signal.Signals, object] = {}
        self._old_wakeup: int | None = None
        self._pipe: tuple[socket.socket, socket.socket] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- installing ----------------------------------------------------------------------

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        self._pipe = socket.socketpair()
        for end in self._pipe:
            end.setblocking(False)
        self._old_wakeup = signal.set_wakeup_fd(self._pipe[1].fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="orchmllm-preempt", daemon=True)
        self._thread.start()
        global _installed
        _installed = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        global _installed
        _installed = None
        self._stop.set()
        self._thread.join()
        signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        for end in self._pipe or ():
            end.close()
        self._thread = self._pipe = None

    # -- noting the signal --------------------------------------------------------------

    def _handler(self, signum: int, frame: object) -> None:
        self._note(signum)

    def _note(self, signum: int) -> None:
        """The first stop signal: remember it and start the grace clock (idempotent: a
        scheduler and torchrun both forward the same signal)."""
        with self._lock:
            if self._at is not None:
                return
            self._at = time.monotonic()
            self.signal_name = signal.Signals(signum).name
        rank = dist.get_rank() if dist.is_initialized() else 0
        if not self.saving:
            _say(
                f"rank {rank}: {self.signal_name}: stopping now; nothing was saved (no "
                f"--checkpoint-dir): a rerun starts over. Exit status {PREEMPTED}"
            )
            leave_process(PREEMPTED)
        _say(
            f"rank {rank}: {self.signal_name}: stopping after the step in progress, with a "
            f"checkpoint, within {self.grace:.0f} s (--preempt-grace)"
        )

    def _watch(self) -> None:
        assert self._pipe is not None
        wanted = {int(s) for s in self.signals}
        while not self._stop.is_set():
            left = None if self._at is None else self._at + self.grace - time.monotonic()
            if left is not None and left <= 0:
                self._abandon()
            ready, _, _ = select.select([self._pipe[0]], [], [], min(left or 0.2, 0.2))
            if ready:
                with contextlib.suppress(BlockingIOError):
                    for signum in self._pipe[0].recv(64):
                        if signum in wanted:
                            self._note(signum)

    def _abandon(self) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        _say(
            f"rank {rank}: {self.signal_name}: the job did not stop within --preempt-grace "
            f"{self.grace:.0f} s ({self.where}); abandoned there without a checkpoint of it: a "
            f"rerun resumes from the newest complete checkpoint. Exit status {PREEMPTED}"
        )
        if self.on_abandon is not None:
            try:
                self.on_abandon()
            except Exception as exc:
                _say(f"rank {rank}: while abandoning: {type(exc).__name__}: {exc}")
        leave_process(PREEMPTED)

    # -- agreeing ------------------------------------------------------------------------

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank got a stop signal (collective, default group: every rank calls it
        at the end of every step, and all get the same answer)."""
        flag = torch.tensor([0 if self.signal_name is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_installed: Preemption | None = None


def _after_fork() -> None:
    """A process forked from an installed one (a DataLoader worker) ignores the stop signals
    (a scheduler signals every process; the worker's parent ends it) and has no watcher."""
    global _installed
    if _installed is not None:
        signal.set_wakeup_fd(-1)
        for sig in _installed.signals:
            signal.signal(sig, signal.SIG_IGN)
        _installed = None


os.register_at_fork(after_in_child=_after_fork)
