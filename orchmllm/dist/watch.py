"""Which rank is missing when a collective fails, and why.

A collective that times out only says that it did: every healthy rank sees the same generic
gloo or NCCL error, and nothing names the rank that hung. So every rank publishes where it is
in the job's c10d key-value store (under torchrun the agent holds it, so it outlives any
worker): the last step it entered in each stream of collectives (the training loop; the
loader's metadata exchange, which runs ahead in a thread; the job's sections outside the
training steps: start-up, the dataset write, checkpoint saves and loads, each a numbered
section with a name), a state (running, done, failed and why), the process (host, pid) and a
heartbeat that a daemon thread refreshes. When a step or section fails,
:meth:`Progress.diagnose` reads every rank's entry and names the ranks that did not arrive:
behind this rank in the failing stream, finished, silent (no heartbeat for half the timeout:
stopped, hung in the kernel) or dead. A peer that died makes its collectives fail at once
("Connection closed by peer"), before its heartbeat can age: a peer on this host is checked
directly (its process is gone), one elsewhere is watched for a few heartbeat intervals.

Cost: one small store write per rank per step and stream, and one per heartbeat interval
(a tenth of the timeout, at most 5 s). Heartbeat ages compare wall clocks across nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

__all__ = [
    "STREAMS",
    "Process",
    "Progress",
    "RankState",
    "StepFailed",
    "arrive",
    "current",
    "install",
    "is_failure",
    "section",
]

STREAMS = ("train", "exchange", "job")
_NAMES = {"train": "training step", "exchange": "loader exchange of step", "job": "section"}
_READ_TIMEOUT_S = 5.0  # a diagnosis never waits longer on the store than this


@dataclass(frozen=True)
class Process:
    """A process as its peers can recognise it: host, pid and start time (clock ticks after
    boot, so a reused pid is not taken for the process)."""

    host: str
    pid: int
    start: int

    @classmethod
    def this(cls) -> Process:
        stat = _stat(os.getpid())
        return cls(socket.gethostname(), os.getpid(), stat[1] if stat else 0)

    def here(self) -> bool:
        """Whether it runs on this host, where :meth:`gone` knows the answer."""
        return self.host == socket.gethostname()

    def gone(self) -> str | None:
        """Why this process is known to be gone ("exited ...", "exiting ..."), or None:
        running, or on another host (see :meth:`here`).

        A killed process closes its sockets (its peers' collectives fail at once) before it
        becomes a zombie: in between /proc still lists it as running, and a peer that looked
        only at its state called it alive. So a process that is exiting (the kernel's
        PF_EXITING) or has a SIGKILL pending counts as gone too."""
        if not self.here():
            return None
        stat = _stat(self.pid)
        if stat is None:
            return "exited"
        state, start, flags = stat
        if self.start and start and start != self.start:
            return "exited (its pid now belongs to another process)"
        if state in ("Z", "X"):
            return "exited (a zombie not yet reaped)"
        if flags & _PF_EXITING:
            return "exiting (killed or ending, not yet a zombie)"
        if _kill_pending(self.pid):
            return "being killed (SIGKILL pending)"
        return None

    def __str__(self) -> str:
        return f"process {self.pid} on {self.host}"


_PF_EXITING = 0x4  # the kernel's per-task flag: do_exit() has begun
_SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in /proc's pending-signal masks


def _kill_pending(pid: int) -> bool:
    """Whether a SIGKILL is queued for process ``pid`` (sent; the shared mask keeps it while
    the process dies)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [
                int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))
            ]
    except (OSError, ValueError, IndexError):
        return False
    return any(m & _SIGKILL_BIT for m in masks)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """A process's state letter, start time (clock ticks after boot) and kernel flags from
    /proc; None: no such process. Without /proc: ("?", 0, 0) for a process that exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return fields[0], int(fields[19]), int(fields[6])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?", 0, 0


@dataclass(frozen=True)
class RankState:
    """One rank's entry as read back from the store (``age_s`` None: no entry)."""

    rank: int
    steps: dict[str, int]
    state: str
    age_s: float | None
    section: str = ""
    process: Process | None = None
    beat: float = 0.0  # the heartbeat's wall-clock time


class StepFailed(RuntimeError):
    """A step failed on this rank; the message names the ranks that did not arrive."""

    def __init__(self, message: str, *, stream: str, step: int, missing: list[int]) -> None:
        super().__init__(message)
        self.stream, self.step, self.missing = stream, step, missing


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure to diagnose: any ``Exception``, and the ``BaseException``s
    libraries raise for errors (``torch.distributed.checkpoint``'s CheckpointException), but
    not an interrupt or an exit."""
    return not isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit)


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
        self.interval = min(self.timeout / 10, 5.0)
        self.process = Process.this()
        self._store = dist.PrefixStore("orchmllm/progress", store.clone())
        self._lock = threading.Lock()  # one store connection, several threads
        self._steps = dict.fromkeys(STREAMS, -1)
        self._sections: list[str] = []  # the open sections, innermost last
        self._entered = ""  # the last section entered (open or not), for the peers
        self._state = "running"
        self._stop = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._beat, name="orchmllm-heartbeat", daemon=True)
        self._thread.start()

    def arrive(self, stream: str, step: int) -> None:
        """This rank entered ``step`` of ``stream`` (before its first collective)."""
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
        self._steps[stream] = int(step)
        self._publish()

    def position(self, stream: str) -> int:
        return self._steps[stream]

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A part of the job outside the training steps (start-up, the dataset write, a
        checkpoint) as a step of its own: every rank enters the same sections in the same
        order, so a failure inside one is diagnosed like a failed step, naming ``name``."""
        self._sections.append(name)
        self._entered = name
        self.arrive("job", self._steps["job"] + 1)
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, StepFailed) or not is_failure(exc):
                raise
            raise self.diagnose(exc, stream="job", elapsed_s=time.perf_counter() - t0) from exc
        finally:
            self._sections.pop()

    def close(self, state: str = "done") -> None:
        """Stop the heartbeat and leave ``state`` for the peers to read."""
        self._stop.set()
        self._state = state
        self._publish()

    def _entry(self) -> str:
        p = self.process
        return json.dumps(
            {
                "t": time.time(),
                "steps": self._steps,
                "state": self._state,
                "section": self._entered,
                "proc": [p.host, p.pid, p.start],
            }
        )

    def _publish(self) -> None:
        value = self._entry()
        with self._lock:
            self._store.set(str(self.rank), value)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
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
                steps = {**dict.fromkeys(STREAMS, -1), **raw["steps"]}
                proc = Process(*raw["proc"]) if "proc" in raw else None
                age = max(0.0, time.time() - raw["t"])
                out.append(
                    RankState(r, steps, raw["state"], age, raw.get("section", ""), proc, raw["t"])
                )
        return out

    def diagnose(self, exc: BaseException, *, stream: str, elapsed_s: float) -> StepFailed:
        """The error to raise for ``exc``, which ended this rank's current step of ``stream``
        after ``elapsed_s`` seconds: which ranks did not arrive there, and why. Also leaves
        this rank's failure in the store, so peers that fail later do not count it missing."""
        step = self._steps[stream]
        where = self._where(stream, step)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        head = f"rank {self.rank}: {where} failed after {elapsed_s:.1f} s: {type(exc).__name__}"
        head += f": {first}" if first else ""
        self.close(
            f"failed at {where}: {type(exc).__name__}" + (f": {first[:120]}" if first else "")
        )
        peers = self._settled([s for s in self.ranks() if s.rank != self.rank])
        missing, lines, died = [], [], False
        for s, dead in peers:
            why = self._why_missing(s, stream, step, dead)
            if why is not None:
                missing.append(s.rank)
                died = died or dead is not None
                lines.append(f"  rank {s.rank}: {why}")
            elif s.state.startswith("failed"):
                lines.append(f"  rank {s.rank}: {s.state} (arrived)")
        if missing:
            head += f"\nranks that did not arrive at {where}{' or died' if died else ''}: {missing}"
        else:
            head += f"\nevery rank arrived at {where} and is alive; the error is this rank's or "
            head += "the network's"
        return StepFailed("\n".join([head, *lines]), stream=stream, step=step, missing=missing)

    def _where(self, stream: str, step: int) -> str:
        if stream == "job":
            name = self._sections[-1] if self._sections else "?"
            return f"{name} (section {step})"
        return f"{_NAMES[stream]} {step}"

    def _settled(self, peers: list[RankState]) -> list[tuple[RankState, str | None]]:
        """Each peer with why it is dead (None: alive, or not knowable). A peer that looks
        alive (running, fresh heartbeat) may have just died: one on this host is checked by
        its process; one elsewhere must refresh its heartbeat within two intervals."""
        out: dict[int, tuple[RankState, str | None]] = {}
        unsure = []
        for s in peers:
            out[s.rank] = (s, None)
            if s.state.startswith(("done", "failed")) or s.age_s is None:
                continue
            if s.process is not None and s.process.here():
                gone = s.process.gone()
                if gone is not None:
                    out[s.rank] = (s, f"dead: its {s.process} {gone}")
            elif s.age_s <= self.stale_after:
                unsure.append(s)
        deadline = time.monotonic() + 2 * self.interval + 1.0
        while unsure and time.monotonic() < deadline:
            time.sleep(min(self.interval / 2, 0.5))
            now = {s.rank: s for s in self.ranks()}
            for s in list(unsure):
                if now[s.rank].beat > s.beat or now[s.rank].state != "running":
                    out[s.rank] = (now[s.rank], None)
                    unsure.remove(s)
        for s in unsure:
            age = time.time() - s.beat
            out[s.rank] = (s, f"dead or stopped: no heartbeat for {age:.1f} s")
        return [out[s.rank] for s in peers]

    def _why_missing(self, s: RankState, stream: str, step: int, dead: str | None) -> str | None:
        if s.age_s is None:
            return "no entry in the store (never started, or the store is unreachable)"
        pos = "last entered " + " and ".join(
            self._where_of(s, k, v) for k, v in s.steps.items() if v >= 0 or k != "job"
        )
        if s.state == "done":
            return f"finished the run ({pos})"
        if s.state.startswith("failed"):
            return None if s.steps[stream] >= step else f"{s.state} ({pos})"
        if dead is not None:
            return f"{dead} ({pos})"
        if s.age_s > self.stale_after:
            return f"silent for {s.age_s:.1f} s: stopped, hung or dead ({pos})"
        if s.steps[stream] < step:
            return f"alive but behind ({pos})"
        return None

    @staticmethod
    def _where_of(s: RankState, stream: str, step: int) -> str:
        if stream == "job":
            return f"section {step}" + (f" ({s.section})" if s.section else "")
        return f"{_NAMES[stream]} {step}"


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


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """:meth:`Progress.section` of the installed progress; a plain block when none is."""
    if _current is None:
        yield
        return
    with _current.section(name):
        yield
