"""Which rank is missing when a collective times out.

A collective that times out only says that it did: every healthy rank sees the same generic
gloo or NCCL error, and nothing names the rank that hung. So every rank publishes where it is
in the job's c10d key-value store (under torchrun the agent holds it, so it outlives any
worker): the last step it entered in each stream of collectives (the training loop; the
loader's metadata exchange, which runs ahead in a thread), a state (running, done, failed
and why) and a heartbeat that a daemon thread refreshes. When a step fails,
:meth:`Progress.diagnose` reads every rank's entry and names the ranks that did not arrive:
behind this rank in the failing stream, finished, or silent (no heartbeat for half the
timeout: stopped, hung in the kernel, dead).

Cost: one small store write per rank per step and stream, and one per heartbeat interval
(a tenth of the timeout, at most 5 s). Heartbeat ages compare wall clocks across nodes.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

__all__ = ["STREAMS", "Progress", "RankState", "StepFailed", "arrive", "current", "install"]

STREAMS = ("train", "exchange")
_NAMES = {"train": "training step", "exchange": "loader exchange of step"}
_READ_TIMEOUT_S = 5.0  # a diagnosis never waits longer on the store than this


@dataclass(frozen=True)
class RankState:
    """One rank's entry as read back from the store (``age_s`` None: no entry)."""

    rank: int
    steps: dict[str, int]
    state: str
    age_s: float | None


class StepFailed(RuntimeError):
    """A step failed on this rank; the message names the ranks that did not arrive."""

    def __init__(self, message: str, *, stream: str, step: int, missing: list[int]) -> None:
        super().__init__(message)
        self.stream, self.step, self.missing = stream, step, missing


class Progress:
    """This rank's entry in ``store`` (a c10d Store shared by all ranks), kept current.

    ``timeout``: the collectives' timeout in seconds; a rank whose heartbeat is older than
    half of it counts as silent.
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, timeout: float) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.stale_after = self.timeout / 2
        self._store = dist.PrefixStore("orchmllm/progress", store.clone())
        self._lock = threading.Lock()  # one store connection, several threads
        self._steps = dict.fromkeys(STREAMS, -1)
        self._state = "running"
        self._stop = threading.Event()
        self._publish()
        interval = min(self.timeout / 10, 5.0)
        self._thread = threading.Thread(
            target=self._beat, args=(interval,), name="orchmllm-heartbeat", daemon=True
        )
        self._thread.start()

    def arrive(self, stream: str, step: int) -> None:
        """This rank entered ``step`` of ``stream`` (before its first collective)."""
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
        self._steps[stream] = int(step)
        self._publish()

    def position(self, stream: str) -> int:
        return self._steps[stream]

    def close(self, state: str = "done") -> None:
        """Stop the heartbeat and leave ``state`` for the peers to read."""
        self._stop.set()
        self._state = state
        self._publish()

    def _publish(self) -> None:
        value = json.dumps({"t": time.time(), "steps": self._steps, "state": self._state})
        with self._lock:
            self._store.set(str(self.rank), value)

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._publish()
            except Exception:  # the store is gone: the job is ending
                return

    def ranks(self) -> list[RankState]:
        """Every rank's entry, read within a few seconds even if the store host hangs."""
        out = []
        with self._lock:
            self._store.set_timeout(timedelta(seconds=min(_READ_TIMEOUT_S, self.timeout)))
            for r in range(self.world_size):
                try:
                    if not self._store.check([str(r)]):
                        raise KeyError(r)
                    raw = json.loads(self._store.get(str(r)))
                except Exception:
                    out.append(RankState(r, dict.fromkeys(STREAMS, -1), "unreadable", None))
                    continue
                age = max(0.0, time.time() - raw["t"])
                out.append(RankState(r, raw["steps"], raw["state"], age))
        return out

    def diagnose(self, exc: BaseException, *, stream: str, elapsed_s: float) -> StepFailed:
        """The error to raise for ``exc``, which ended this rank's current step of ``stream``
        after ``elapsed_s`` seconds: which ranks did not arrive there, and why. Also leaves
        this rank's failure in the store, so peers that fail later do not count it missing."""
        step = self._steps[stream]
        where = f"{_NAMES[stream]} {step}"
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        head = f"rank {self.rank}: {where} failed after {elapsed_s:.1f} s: {type(exc).__name__}"
        head += f": {first}" if first else ""
        self.close(f"failed at {where}: {type(exc).__name__}")
        missing, lines = [], []
        for s in self.ranks():
            if s.rank == self.rank:
                continue
            why = self._why_missing(s, stream, step)
            if why is not None:
                missing.append(s.rank)
                lines.append(f"  rank {s.rank}: {why}")
            elif s.state.startswith("failed"):
                lines.append(f"  rank {s.rank}: {s.state} (arrived)")
        if missing:
            head += f"\nranks that did not arrive at {where}: {missing}"
        else:
            head += f"\nevery rank arrived at {where}; the error is this rank's or the network's"
        return StepFailed("\n".join([head, *lines]), stream=stream, step=step, missing=missing)

    def _why_missing(self, s: RankState, stream: str, step: int) -> str | None:
        if s.age_s is None:
            return "no entry in the store (never started, or the store is unreachable)"
        pos = "last entered " + " and ".join(f"{_NAMES[k]} {v}" for k, v in s.steps.items())
        if s.state == "done":
            return f"finished the run ({pos})"
        if s.state.startswith("failed"):
            return None if s.steps[stream] >= step else f"{s.state} ({pos})"
        if s.age_s > self.stale_after:
            return f"silent for {s.age_s:.1f} s: stopped, hung or dead ({pos})"
        if s.steps[stream] < step:
            return f"alive but behind ({pos})"
        return None


_current: Progress | None = None


def install(progress: Progress | None) -> None:
    """Make ``progress`` this process's entry (None: none), as :func:`arrive` reports to."""
    global _current
    _current = progress


def current() -> Progress | None:
    return _current


def arrive(stream: str, step: int) -> None:
    """Report an arrival to the installed :class:`Progress`; nothing when none is."""
    if _current is not None:
        _current.arrive(stream, step)
