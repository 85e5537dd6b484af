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

Context parallelism. A sequence longer than a rank's budget is split over ranks of a
context-parallel group, which all-gather its keys and values in every attention layer
(:mod:`orchmllm.dist.context_parallel`). ``build(context_parallel=N)`` opens the groups once,
at set-up, never per step: for every divisor k >= 2 of N, the aligned blocks of k consecutive
data-parallel ranks (k = 2 of N = 4: {0, 1}, {2, 3}, ...; k = 4: {0, 1, 2, 3}, ...), on the
backend of ``group`` (the keys live where the model does). Why blocks and not one group per
rank set: a group is a collective to create (every rank of the job joins each ``new_group``),
so the sets must be known at set-up, and the number of all subsets explodes; with N dividing
the ranks per node they never cross a node. The planner puts a sequence's k pieces on the k
least-loaded ranks of an N-block (the best balance), which need not be a block themselves: they
gather in the smallest block that holds them all (:meth:`Topology.context_parallel_block`), and
that block's other ranks join each of its gathers with no rows of their own, receiving keys
they do not use (the cost of the planner's freedom; pieces on aligned blocks would not pay it).

Data parallelism is the one balanced axis. A tensor-parallel axis would be another group here
(built from a device mesh), with ``group`` the data-parallel one the balancer moves examples
across.
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
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from orchmllm import compat

__all__ = ["Topology", "attempt_store", "context_parallel_blocks", "job_token"]

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
        context_groups: (constructor only) this rank's context-parallel groups by their
            data-parallel ranks (:meth:`context_parallel_group`); :meth:`build` passes them.
        context_parallel: the largest context-parallel group N the groups were opened for
            (1: none).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        meta_group: dist.ProcessGroup | None,
        ranks_per_node: int | None,
        timeout: float,
        owned: list[dist.ProcessGroup] | None = None,
        context_groups: dict[tuple[int, ...], dist.ProcessGroup] | None = None,
        context_parallel: int = 1,
    ) -> None:
        self.group = group
        self.context_parallel = context_parallel
        self._context_groups = context_groups or {}
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
        context_parallel: int = 1,
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
            context_parallel: the largest context-parallel group N; > 1 opens the groups of
                every aligned block of k consecutive ranks, k >= 2 dividing N (module
                docstring: "Context parallelism"), collectively, on ``group``'s backend.

        Returns:
            The :class:`Topology`.

        Raises:
            ValueError: a ``timeout`` that is not a number > 0, a ``ranks_per_node`` or
                ``context_parallel`` that is not a positive integer, a ``context_parallel``
                above the number of ranks, or a ``meta_group`` that is not gloo.
        """
        if not (isinstance(timeout, int | float) and not isinstance(timeout, bool)) or not (
            timeout > 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if ranks_per_node is not None and not _positive_int(ranks_per_node):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if not _positive_int(context_parallel):
            raise ValueError(
                f"context_parallel must be a positive integer, got {context_parallel!r}"
            )
        if not (dist.is_available() and dist.is_initialized()):
            if context_parallel > 1:
                raise ValueError(
                    f"context_parallel={context_parallel} needs torch.distributed initialised"
                )
            return cls(None, None, ranks_per_node, float(timeout))
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        if context_parallel > len(ranks):
            raise ValueError(
                f"context_parallel must be <= the {len(ranks)} ranks, got {context_parallel}"
            )
        owned: list[dist.ProcessGroup] = []
        if meta_group is None:
            meta_group = _new_group(ranks, "gloo", timeout)
            # Return only once every rank has connected: a rank dropping this topology at once
            # would otherwise destroy the group under a peer still connecting to it.
            dist.barrier(group=meta_group)
            owned.append(meta_group)
        elif dist.get_backend(meta_group) != "gloo":
            raise ValueError(
                f"meta_group must be a gloo group, got backend {dist.get_backend(meta_group)!r}"
            )
        context_groups = _open_context_groups(group, ranks, context_parallel, float(timeout))
        owned.extend(context_groups.values())
        return cls(
            group, meta_group, ranks_per_node, float(timeout), owned, context_groups,
            context_parallel,
        )  # fmt: skip

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

    def context_parallel_block(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The smallest block :meth:`build` opened a group for that holds all of ``ranks``
        (the ranks of one sequence's pieces): where its keys and values are gathered.

        Args:
            ranks: data-parallel ranks.

        Returns:
            The block's ranks, ascending.

        Raises:
            ValueError: no block holds them (ranks of two N-blocks, or no groups opened).
        """
        want = {int(r) for r in ranks}
        blocks = context_parallel_blocks(self.size, self.context_parallel)
        holding = [b for b in blocks if want <= set(b)]
        if not holding:
            raise ValueError(
                f"no context-parallel block of context_parallel={self.context_parallel} on "
                f"{self.size} ranks holds ranks {sorted(want)}"
            )
        return min(holding, key=len)

    def context_parallel_group(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The context-parallel group of a piece (module docstring: "Context parallelism").

        Args:
            ranks: data-parallel ranks, ascending: one of the aligned blocks :meth:`build`
                opened (``context_parallel=N``) that hold this rank.

        Returns:
            The group, the same object for every call (opened once, at set-up).

        Raises:
            ValueError: ``ranks`` is no such block holding this rank (the message lists them).
            RuntimeError: this topology was closed.
        """
        if self._closed:
            raise RuntimeError("this Topology was closed: its context-parallel groups are gone")
        key = tuple(int(r) for r in ranks)
        if key not in self._context_groups:
            raise ValueError(
                f"ranks {key} are no context-parallel group of rank {self.rank}: this topology "
                f"opened {sorted(self._context_groups)} for it (build(context_parallel=N) opens "
                "the aligned blocks of k consecutive ranks, k >= 2 dividing N)"
            )
        return self._context_groups[key]

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
            self._context_groups = {}
            _destroy(self._owned)

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_group(ranks: list[int], backend: str, timeout: float) -> dist.ProcessGroup:
    """The one call that opens a group (collective over every rank of the job)."""
    return dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def context_parallel_blocks(world: int, size: int) -> list[tuple[int, ...]]:
    """The rank sets :meth:`Topology.build` opens a context-parallel group over for
    ``context_parallel=size`` on ``world`` ranks: for every divisor k >= 2 of ``size``
    (ascending), the blocks (0..k-1), (k..2k-1), ... that fit in ``world``."""
    sizes = [k for k in range(2, size + 1) if size % k == 0]
    return [tuple(range(s, s + k)) for k in sizes for s in range(0, world - k + 1, k)]


def _open_context_groups(
    group: dist.ProcessGroup | None, ranks: list[int], size: int, timeout: float
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """Open the groups of :func:`context_parallel_blocks` (every rank of the job joins each
    ``new_group``, in the same order) and return those holding this rank, by their
    data-parallel ranks (``ranks``: their global ranks), once every member has connected."""
    me, mine = dist.get_rank(group), {}
    for block in context_parallel_blocks(len(ranks), size):
        opened = _new_group([ranks[r] for r in block], dist.get_backend(group), timeout)
        if me in block:
            mine[block] = opened
    for opened in mine.values():  # as for the metadata group: connected before it is used
        dist.barrier(group=opened)
    return mine


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
