"""The process groups of one data-parallel job: the only place the package opens one.

Post-balancing talks on two groups over the same ranks: the training group, where examples
and encoder outputs move (NCCL in production), and a CPU (gloo) group, where metadata is
gathered and non-deterministic plans are broadcast, so a loader can plan in a background
thread beside GPU traffic. A :class:`Topology` holds both, the ranks per node (node-wise
placement and the intra/inter-node byte counts need it) and the timeout of every collective;
``BatchDispatcher``, ``Orchestrator``, ``BalancedDataLoader`` and ``BalancedCollator`` take
one (``topology=``).

Sharing. Collectives on one group must be issued in the same order on every rank, and a
loader issues its own from a background thread. So each object given no topology builds its
own over the default group (a collective: build objects on every rank in the same order) and
is then independent of every other: two loaders may be iterated together, a dispatcher may
run while a loader prefetches. Its gloo group (a few threads and sockets) lives as long as the
object: dropping the object destroys it. Pass one topology to several objects to share one
gloo group (and the user's own data-parallel group, ``Topology.build(group=...)``): then no
two of them may use the metadata group at the same time (iterate one of its loaders at a
time; do not dispatch or plan on the topology while one of its loaders prefetches).
A training loop shares one: the loader gathers and plans in its thread, and
``Orchestrator.run`` with the prefetched plan only moves data on the data-parallel group.

Exit. A process that ends with a gloo group alive can abort in interpreter finalisation
("terminate called without an active exception", SIGABRT, exit -6): when a collective finishes,
the group's worker thread (``pt_gloo_runloop``) still holds the finished work and its tensors,
and releasing a tensor that Python created takes the GIL; once finalisation has begun, a thread
taking the GIL is ended with ``pthread_exit``, whose unwinding through that C++ destructor calls
``std::terminate``. Any gloo collective in the last milliseconds before exit can do it (a loader
leaving an epoch when the training loop dropped it mid-way, the last step's metadata gather), so
the library does not leave its groups to finalisation: an ``atexit`` hook, which runs while other
threads can still take the GIL, closes every live topology in creation order (the same on every
rank): first the objects using it (:meth:`Topology.on_close`: the loaders' prefetch threads, which
may still exchange with their peers), then the groups it created, whose threads the freed group
joins. No user code has to call anything at exit. A process ended by an uncaught exception
is left as before: its peers may never reach the collectives a close runs, and a failed rank
must end at once (so that the launcher stops the others), not wait out the timeout. Groups
the user created (the default group, a ``group=`` of their own) stay theirs:
``dist.destroy_process_group()`` at the end of a script ends those cleanly.

Forked children. A DataLoader worker is a fork of its rank, holding copies of every object
the rank held, process groups among them, but none of their threads. Destroying such a copy
there (the child's garbage collector finding a group the rank no longer referenced but had not
collected yet) makes gloo join threads that do not exist: the worker hangs or dies. So, once
this module is imported, a forked child freezes everything it inherited (``gc.freeze``): it
collects only the objects it creates, as CPython's documentation recommends for forks.

Restart attempts. Under ``torchrun --max-restarts`` every attempt's workers meet in the same
key-value store, so the keys of a dead attempt must not be read by the next one:
:func:`attempt_store` gives each attempt a namespace of its own, and :func:`job_token` names
the job across its attempts.

Data parallelism is the one axis today. A sequence- or tensor-parallel axis would be another
group here (built from a device mesh), with ``group`` the data-parallel one the balancer
moves examples across.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import os
import secrets
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from orchmllm import compat

__all__ = ["Topology", "attempt_store", "job_token"]

DEFAULT_TIMEOUT_S = 600.0
_ATTEMPT = "orchmllm/attempt"
_JOB = "orchmllm/job"
_POLL_S = 0.01

# A forked child never collects what its parent left (module docstring: "Forked children").
os.register_at_fork(after_in_child=gc.freeze)

_BUILT = itertools.count()  # creation order of the live topologies, for the exit hook
_LIVE: dict[int, weakref.ref[Topology]] = {}


class Topology:
    """The process groups of one data-parallel job, its ranks per node and its timeout.

    Build it with :meth:`build` (every rank together); use it as a context manager, call
    :meth:`close`, or drop it to destroy the groups it created; at interpreter exit every live
    topology is closed (module docstring: "Exit").

    Attributes:
        group: the data-parallel group examples and encoder outputs move on (None: the
            default group).
        meta_group: a gloo group over the same ranks, separate from ``group`` even when that
            is gloo, so that metadata can be gathered in a background thread while training
            collectives run (None: not distributed). Reading it after :meth:`close` raises
            ``RuntimeError``.
        ranks_per_node: consecutive ranks per node (None: unknown, node-wise placement off).
        timeout: seconds any one collective may wait.
        owned: (constructor only) the groups this topology created, which :meth:`close`
            destroys; :meth:`build` passes them.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        meta_group: dist.ProcessGroup | None,
        ranks_per_node: int | None,
        timeout: float,
        owned: list[dist.ProcessGroup] | None = None,
    ) -> None:
        self.group = group
        self._meta_group = meta_group
        self.ranks_per_node = ranks_per_node
        self.timeout = timeout
        self._owned = owned if owned is not None else []  # the groups close() destroys
        self._owns_meta = meta_group is not None and meta_group in self._owned
        self._users: list[tuple[weakref.ref, Callable[[Any], None]]] = []  # see on_close
        self._closed = False
        key = next(_BUILT)
        _LIVE[key] = weakref.ref(self)
        # A dropped topology frees its group (and leaves the exit hook's table); at exit the
        # hook closes it instead, users first (weakref's own exit pass would run before it).
        weakref.finalize(self, _drop, key, self._owned).atexit = False

    def __repr__(self) -> str:
        return (
            f"Topology(group={self.group!r}, meta_group={self._meta_group!r}, "
            f"ranks_per_node={self.ranks_per_node!r}, timeout={self.timeout!r})"
        )

    @property
    def meta_group(self) -> dist.ProcessGroup | None:
        """The gloo metadata group (class docstring); ``RuntimeError`` once closed."""
        if self._closed and self._owns_meta:
            raise RuntimeError("this Topology was closed: its metadata group is destroyed")
        return self._meta_group

    @classmethod
    def build(
        cls,
        *,
        group: dist.ProcessGroup | None = None,
        meta_group: dist.ProcessGroup | None = None,
        ranks_per_node: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> Topology:
        """The topology over ``group``'s ranks (not distributed: one without groups).

        Creates the gloo metadata group when ``meta_group`` is None, the one place the
        package opens a process group: a collective, so every rank builds its topologies
        together and in the same order (:meth:`close`, or dropping the topology, destroys
        it).

        Args:
            group: the data-parallel group, e.g. a user's own (None: the default group).
            meta_group: a gloo group over the same ranks to gather metadata on (None: one is
                created, owned by the topology).
            ranks_per_node: consecutive ranks per node (None: unknown).
            timeout: seconds any one collective may wait.

        Returns:
            The :class:`Topology`.

        Raises:
            ValueError: a ``timeout`` that is not a number > 0, a ``ranks_per_node`` that is
                not a positive integer, or a ``meta_group`` that is not gloo.
        """
        if not (isinstance(timeout, int | float) and not isinstance(timeout, bool)) or not (
            timeout > 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if ranks_per_node is not None and (
            not isinstance(ranks_per_node, int)
            or isinstance(ranks_per_node, bool)
            or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, None, ranks_per_node, float(timeout))
        owned: list[dist.ProcessGroup] = []
        if meta_group is None:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            meta_group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout))
            # Return only once every rank has connected: a rank dropping this topology at once
            # would otherwise destroy the group under a peer still connecting to it.
            dist.barrier(group=meta_group)
            owned.append(meta_group)
        elif dist.get_backend(meta_group) != "gloo":
            raise ValueError(
                f"meta_group must be a gloo group, got backend {dist.get_backend(meta_group)!r}"
            )
        return cls(group, meta_group, ranks_per_node, float(timeout), owned)

    @property
    def distributed(self) -> bool:
        """Whether ``torch.distributed`` is initialised (else one process, no groups)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        """This process's rank in ``group`` (0 when not distributed)."""
        return dist.get_rank(self.group) if self.distributed else 0

    @property
    def size(self) -> int:
        """The number of ranks in ``group`` (1 when not distributed)."""
        return dist.get_world_size(self.group) if self.distributed else 1

    def on_close(self, user: Any, close: Callable[[Any], None]) -> None:
        """Have :meth:`close` call ``close(user)`` first, while ``user`` is alive (it is held
        weakly): an object that talks on the groups from a thread of its own (a loader's
        prefetch thread) stops it there, before the groups go. Users are closed in the order
        they were registered, the same on every rank.

        Args:
            user: the object using this topology (held weakly: a user already collected is
                not called).
            close: called as ``close(user)`` by :meth:`close`, before the groups are destroyed.
        """
        self._users = [(ref, stop) for ref, stop in self._users if ref() is not None]
        self._users.append((weakref.ref(user), close))

    def close(self) -> None:
        """Close the objects using this topology (:meth:`on_close`), then destroy the groups it
        created and let them go, which joins their threads (idempotent; collective: every rank
        calls it, at the same point)."""
        users, self._users = self._users, []
        try:
            for ref, stop in users:
                user = ref()
                if user is not None:
                    stop(user)
        finally:
            self._closed = True
            if self._owns_meta:
                self._meta_group = None  # the last reference: freeing it joins gloo's threads
            _destroy(self._owned)

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop(key: int, owned: list[dist.ProcessGroup]) -> None:
    _LIVE.pop(key, None)
    _destroy(owned)


@atexit.register
def _close_live_topologies() -> None:
    """The exit hook (module docstring: "Exit"): close every live topology, oldest first;
    the first error is raised once all are closed. Nothing is closed when an uncaught exception
    ends the interpreter (Python records it in ``sys.last_value`` before running the hooks)."""
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return
    errors = []
    for key in sorted(_LIVE):
        topology = _LIVE.pop(key)()
        try:
            if topology is not None:
                topology.close()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _destroy(groups: list[dist.ProcessGroup]) -> None:
    while groups:
        group = groups.pop()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)


def attempt_store(store: dist.Store, *, rank: int, world_size: int, timeout: float) -> dist.Store:
    """A view of the launcher's ``store`` that only this launch attempt's processes share
    (collective: every rank of the attempt calls it once, before building any group on it).

    Why: under ``torchrun`` the workers connect to the elastic agent's TCPStore, which its
    rendezvous shares with them by default (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``) and keeps
    for every rendezvous round, and ``init_process_group(store=)``, ``new_group`` and
    store-based barriers use fixed key names ("0/", "1/", counters). A restarted attempt thus
    finds the dead attempt's keys: gloo's full-mesh connect reads a dead worker's address
    ("Connection refused"), counters start from the old values, and the progress watch reads
    the old ranks' entries. ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each
    agent counts only the restarts its own workers' failures caused (a node restarted because
    another one failed counts none), so the count differs between nodes (pytorch#135712).

    So the attempt's rank 0 draws a fresh token and hands it to every other rank under a key
    that only that rank can know, a nonce it drew itself and published under its rank:
    whatever a dead attempt left under the same rank, rank 0 answers it too, but nobody waits
    for that answer. Each rank acknowledges on a counter under the token, and rank 0 returns
    once all have. Costs a few store round trips per rank at start-up.

    Raises:
        TimeoutError: some rank did not join within ``timeout`` seconds (rank 0), or rank 0
            did not answer (the others, from the store's own timeout).
    """
    if world_size == 1:
        return dist.PrefixStore(f"{_ATTEMPT}/{secrets.token_hex(8)}", store)
    nonce = secrets.token_hex(8)
    hello = [f"{_ATTEMPT}/hello/{r}" for r in range(1, world_size)]
    if rank != 0:
        store.set(hello[rank - 1], nonce)
        token = store.get(f"{_ATTEMPT}/welcome/{nonce}").decode()
        store.add(f"{_ATTEMPT}/{token}/joined", 1)
        return dist.PrefixStore(f"{_ATTEMPT}/{token}", store)
    token, answered = nonce, set()
    deadline = time.monotonic() + timeout
    while store.add(f"{_ATTEMPT}/{token}/joined", 0) < world_size - 1:
        for value in store.multi_get(hello):  # waits for ranks that never ran before
            if value not in answered:
                store.set(f"{_ATTEMPT}/welcome/{value.decode()}", token)
                answered.add(value)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{world_size - 1 - store.add(f'{_ATTEMPT}/{token}/joined', 0)} of the "
                f"{world_size - 1} other ranks did not join this attempt within {timeout:.0f} s"
            )
        time.sleep(_POLL_S)
    return dist.PrefixStore(f"{_ATTEMPT}/{token}", store)


def job_token() -> str | None:
    """A token every process of this job shares, the same in each of its restart attempts
    (None when not distributed): kept at the root of the launcher's store, outside every
    attempt's namespace. Under ``torchrun`` that store lives as long as the job, so the token
    tells a job's own earlier attempt from another job (the checkpoint directory's lock)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = compat.default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.compare_set(_JOB, "", secrets.token_hex(8)).decode()
