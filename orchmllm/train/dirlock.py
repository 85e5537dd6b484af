"""One live job per directory: a lock file with its owner's host, pid, job and heartbeat.

Two jobs writing one checkpoint directory (a scheduler requeued a job while the old one still
runs) overwrite each other's checkpoints; the second must refuse to start, naming the first.
A lock on a shared filesystem cannot rely on ``flock`` (not honoured across nodes by every
network filesystem) nor on the owner removing it (a killed job cannot), so the lock is a file
created exclusively (``O_EXCL``) whose owner rewrites it as a heartbeat; it is stale, and
taken over, when its heartbeat is older than ``stale_after`` seconds, when its process is
known to be gone (same host), or when it belongs to this same job (an earlier restart attempt
of it, named by :func:`orchmllm.dist.topology.job_token`). Taking a stale lock renames it aside
first, so of two jobs taking it together only one succeeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from orchmllm.dist.watch import Process

__all__ = ["DirectoryLock", "LockHeld", "Owner"]

LOCK_NAME = ".lock"


@dataclass(frozen=True)
class Owner:
    """Who holds a lock: the process, its job, a token of this acquisition, when it started
    and its last heartbeat (wall-clock seconds)."""

    host: str
    pid: int
    start: int
    job: str | None
    token: str
    since: float
    beat: float

    @property
    def process(self) -> Process:
        return Process(self.host, self.pid, self.start)

    def describe(self) -> str:
        age = time.time() - self.beat
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return (
            f"host {self.host}, pid {self.pid}"
            + (f", job {self.job}" if self.job else "")
            + f", started {started}, last heartbeat {age:.1f} s ago"
        )


class LockHeld(RuntimeError):
    """The directory is locked by a live job (the message names it)."""

    def __init__(self, message: str, owner: Owner) -> None:
        super().__init__(message)
        self.owner = owner

    def __reduce__(self):  # the owner survives pickling (rank 0 sends the error to the others)
        return (type(self), (str(self), self.owner))


class DirectoryLock:
    """The lock of ``directory`` for this process (see the module docstring).

    Args:
        directory: the directory to lock (created if missing).
        stale_after: seconds after its last heartbeat at which a lock counts as abandoned.
        job: this job's token (:func:`orchmllm.dist.topology.job_token`): a lock of the same job
            (an earlier restart attempt) is taken over at once. None: no such job.

    :meth:`acquire` takes it (raising :class:`LockHeld`), a daemon thread rewrites it every
    ``stale_after / 5`` seconds (:attr:`interval`), :meth:`release` removes it. A lock whose
    owner on another host missed two heartbeats is waited for (a requeued job finding a dead
    job's lock there), at most until it counts as abandoned. :attr:`lost` names the owner
    that took it over if that happened (this process stalled past ``stale_after``).
    """

    def __init__(self, directory: str, *, stale_after: float, job: str | None = None) -> None:
        if not (isinstance(stale_after, int | float) and stale_after > 0):
            raise ValueError(f"stale_after must be a number of seconds > 0, got {stale_after!r}")
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.stale_after = float(stale_after)
        self.interval = self.stale_after / 5
        self.job = job
        p = Process.this()
        now = time.time()
        self.owner = Owner(p.host, p.pid, p.start, job, secrets.token_hex(8), now, now)
        self.lost: Owner | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- acquiring ---------------------------------------------------------------------

    def acquire(self, log: Callable[[str], object] | None = None) -> str | None:
        """Take the lock; returns why a previous owner's lock was taken over (None: there
        was none). Raises :class:`LockHeld` naming a live owner (heartbeat fresh, or its
        process running on this host). An owner on another host that missed two heartbeats
        (a dead job there: its process cannot be checked from here) is waited for until its
        lock is abandoned (at most ``stale_after`` seconds after its last heartbeat), saying
        so once through ``log``; if it beats again meanwhile it is live after all."""
        os.makedirs(self.directory, exist_ok=True)
        took_over, told, rounds = None, None, 0
        while rounds < 8:  # each round succeeds, waits, or removes an abandoned lock
            if self._create():
                self._start_heartbeat()
                return took_over
            held = self._read(self.path)
            if held is None:  # vanished, or being written this instant
                time.sleep(0.05)
                rounds += 1
                continue
            why = self._abandoned(held)
            if why is None:
                age = time.time() - held.beat
                if age <= 2 * self.interval or held.process.here():  # a live process here
                    raise LockHeld(
                        f"{self.directory} is in use by another job ({held.describe()}): two "
                        "jobs writing one checkpoint directory would overwrite each other's "
                        "checkpoints. Stop that job or wait for it; its lock counts as "
                        f"abandoned {self.stale_after:.0f} s after its last heartbeat",
                        held,
                    )
                if told != held.token and log is not None:
                    log(
                        f"{self.directory}: its lock's owner ({held.describe()}) stopped "
                        f"heartbeating; waiting up to {self.stale_after - age:.0f} s more for "
                        f"the lock to count as abandoned ({self.stale_after:.0f} s without a "
                        "heartbeat)"
                    )
                told = held.token
                time.sleep(min(self.interval / 2, max(self.stale_after - age, 0.0) + 0.05))
                continue
            rounds += 1
            if self._set_aside(held):
                took_over = f"took over the lock of {held.describe()}: {why}"
        raise RuntimeError(f"could not take the lock {self.path}: it keeps changing")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(self.owner)))
            f.flush()
            os.fsync(f.fileno())
        return True

    def _abandoned(self, held: Owner) -> str | None:
        """Why ``held`` is abandoned, or None when its owner may be alive."""
        if self.job is not None and held.job == self.job:
            return "it is this job's, left by an earlier attempt"
        gone = held.process.gone()
        if gone is not None:
            return f"its {held.process} {gone}"
        age = time.time() - held.beat
        if age > self.stale_after:
            return f"no heartbeat for {age:.0f} s (abandoned after {self.stale_after:.0f} s)"
        return None

    def _set_aside(self, held: Owner) -> bool:
        """Rename the abandoned lock ``held`` aside and delete it; False when another job did
        so first (or replaced it: then the new lock is put back)."""
        aside = f"{self.path}.abandoned-{self.owner.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if self._read(aside) != held:  # a new owner's lock, taken in between: give it back
            with contextlib.suppress(OSError):
                os.rename(aside, self.path)
            return False
        os.remove(aside)
        return True

    @staticmethod
    def _read(path: str) -> Owner | None:
        try:
            with open(path) as f:
                return Owner(**json.loads(f.read()))
        except (OSError, ValueError, TypeError):
            return None

    # -- holding -----------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="orchmllm-dirlock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.stale_after / 5):
            held = self._read(self.path)
            if held is not None and held.token != self.owner.token:
                self.lost = held
                return
            self.owner = Owner(**{**asdict(self.owner), "beat": time.time()})
            tmp = f"{self.path}.beat-{self.owner.token}"
            try:
                with open(tmp, "w") as f:
                    f.write(json.dumps(asdict(self.owner)))
                os.replace(tmp, self.path)
            except OSError:  # a full or unreachable filesystem: the next beat retries
                with contextlib.suppress(OSError):
                    os.remove(tmp)

    def check(self) -> None:
        """Raise :class:`LockHeld` if another job took this lock over."""
        if self.lost is not None:
            raise LockHeld(
                f"{self.directory}: another job took over this job's lock ("
                f"{self.lost.describe()}) after this one missed its heartbeats; stopping "
                "before writing anything more",
                self.lost,
            )

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        held = self._read(self.path)
        if held is not None and held.token == self.owner.token:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
