"""BalancedDataLoader: balanced mini-batches with planning hidden behind the training step.

A background thread prepares the next ``prefetch`` steps while the current one trains
(paper section 6, "Computation overhead overlapping"): it samples the local mini-batch,
all-gathers its metadata on a CPU (gloo) group of its own, computes the plan (the C++
balancing core releases the GIL) and, depending on the mode, builds the balanced batch:

- ``"index"``: map-style dataset with lengths known before loading (a length column, a
  length function mapped once over an HF dataset, or a ``lengths`` array). Ranks exchange
  only dataset indices and lengths; each rank then loads and collates exactly the examples
  assigned to it, so no example crosses the network.
- ``"move"``: iterable/streaming data, or an existing DataLoader, where a rank can read
  only its own shard: examples are loaded locally, then moved to their destination rank
  with one all-to-all of their serialized bytes, then collated.
- ``"local"``: the local batch is collated as sampled and yielded with the planner's
  output (for the multimodal orchestrator, which moves data per phase on the device).

Every rank yields the same number of steps per epoch, ``set_epoch`` reshuffles, and
``state_dict()`` records the steps the training loop consumed (not what was prefetched),
so a job restarted from it sees exactly the batches it would have seen.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate

from orchmllm.data import exchange as ex
from orchmllm.data.exchange import StepInfo
from orchmllm.data.lengths import (
    LengthFn,
    check_lengths,
    dataset_lengths,
    example_length,
    is_hf_dataset,
)
from orchmllm.data.planners import BalancePlanner
from orchmllm.data.prefetch import Prefetcher
from orchmllm.data.sampling import local_batches, steps_per_epoch

MODES = ("auto", "index", "move", "local")
_CREATED = itertools.count(1)  # loaders created by this process, for their default names
_HANDSHAKE = (
    "world_size",
    "num_replicas",
    "batch_size",
    "dataset_len",
    "epoch",
    "step",
    "mode",
    "seed",
    "shuffle",
    "drop_last",
)


@dataclass(frozen=True)
class PlannedBatch:
    """``mode="local"``: the batch as sampled on this rank, plus the plan for it."""

    batch: Any
    plan: Any
    info: StepInfo


def _as_list(examples: list) -> list:
    """Collate for the wrapped DataLoader's workers: keep examples as a list."""
    return list(examples)


class _Indexed:
    """A map-style dataset whose items come with their index, so that errors about an
    example loaded by a DataLoader's workers can name its dataset index."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[int, Any]]:
        return list(zip(indices, _load(self.dataset, indices), strict=True))


def _load(dataset: Any, indices: Sequence[int]) -> list:
    keys = [int(i) for i in indices]
    if not keys:
        return []
    if hasattr(dataset, "__getitems__"):
        return list(dataset.__getitems__(keys))
    return [dataset[i] for i in keys]


def _is_map_style(source: Any) -> bool:
    if isinstance(source, (DataLoader, IterableDataset)) or is_hf_dataset(source, iterable=True):
        return False
    return hasattr(source, "__getitem__") and hasattr(source, "__len__")


class _Sampled:
    """Local mini-batches of a map-style dataset, by distributed-sampler indices."""

    def __init__(self, dataset: Any, loader: BalancedDataLoader) -> None:
        self.dataset = dataset
        self.loader = loader
        self.batches: list[list[int]] = []

    def start(self, epoch: int, step: int) -> int:
        lo = self.loader
        self.batches = local_batches(
            len(self.dataset),
            rank=lo._group.rank,
            num_replicas=lo.num_replicas,
            batch_size=lo.options.batch_size,
            epoch=epoch,
            seed=lo.options.seed,
            shuffle=lo.options.shuffle,
            drop_last=lo.options.drop_last,
        )
        return len(self.batches)

    def local(self, step: int) -> list[tuple[int, Any]] | None:
        """This rank's examples of ``step`` as (dataset index, example), or None at the end."""
        if step >= len(self.batches):
            return None
        keys = self.batches[step]
        return list(zip(keys, _load(self.dataset, keys), strict=True))


class _Streamed:
    """Local mini-batches read in order from an iterable (this rank's shard) or a DataLoader."""

    def __init__(self, source: Any, batch_size: int | None) -> None:
        self.batch_size = batch_size
        self.source = source
        # A DataLoader over a map-style dataset yields (dataset index, example) pairs.
        self.indexed = isinstance(source, DataLoader) and _is_map_style(source.dataset)
        self.iterable = _list_loader(source) if isinstance(source, DataLoader) else source
        self.it: Iterator | None = None
        self.read = 0  # examples read from this rank's stream this epoch

    def start(self, epoch: int, step: int) -> None:
        for obj in (
            self.source,
            getattr(self.source, "sampler", None),
            getattr(self.source, "batch_sampler", None),
            getattr(getattr(self.source, "batch_sampler", None), "sampler", None),
            getattr(self.source, "dataset", None),
        ):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
        self.it = iter(self.iterable)
        self.read = 0
        for _ in range(step):  # resume: the skipped steps' local batches, without planning
            if self.local(-1) is None:
                break

    def local(self, step: int) -> list[tuple[int | str, Any]] | None:
        """This rank's next examples as (dataset index, example), or (where a stream has no
        index) (position in this rank's stream, example); None at the end."""
        assert self.it is not None
        if self.batch_size is None:  # a DataLoader already yields lists of examples
            batch = next(self.it, None) or []
        else:
            batch = list(itertools.islice(self.it, self.batch_size))
        if not batch:
            return None
        start, self.read = self.read, self.read + len(batch)
        if self.indexed:
            return batch
        return [(f"item {start + i} of this rank's stream", e) for i, e in enumerate(batch)]


def _list_loader(dl: DataLoader) -> DataLoader:
    """The same DataLoader (dataset, sampler, workers) yielding lists of raw examples, so
    examples can be balanced before the user's collate function runs."""
    if dl.batch_size is None and dl.batch_sampler is None:
        raise ValueError("dataloader must batch (batch_size or batch_sampler), got batch_size=None")
    kwargs: dict[str, Any] = {
        "num_workers": dl.num_workers,
        "collate_fn": _as_list,
        "timeout": dl.timeout,
        "worker_init_fn": dl.worker_init_fn,
        "multiprocessing_context": dl.multiprocessing_context,
        "generator": dl.generator,
        "persistent_workers": dl.persistent_workers,
    }
    if dl.num_workers:
        kwargs["prefetch_factor"] = dl.prefetch_factor
    if isinstance(dl.dataset, IterableDataset):
        return DataLoader(dl.dataset, batch_size=dl.batch_size, drop_last=dl.drop_last, **kwargs)
    return DataLoader(_Indexed(dl.dataset), batch_sampler=dl.batch_sampler, **kwargs)


@dataclass(frozen=True, kw_only=True, eq=False)
class LoaderOptions:
    """Every option of :class:`BalancedDataLoader`, checked when built.

    ``BalancedDataLoader(source, batch_size=8, ...)`` builds one from its keyword
    arguments; build it yourself to share a set-up between loaders or to keep it in a
    config (``dataclasses.replace(options, seed=1)`` gives a checked copy).

    Attributes:
        batch_size: Examples each rank samples per step (as ``DataLoader(batch_size=)``).
            Required, except for a ``DataLoader`` source, whose own batches are used.
        collate_fn: Turns a list of examples into a batch; runs on the balanced examples.
            Default: the ``DataLoader`` source's own, else torch's ``default_collate``.
        length_fn: ``length_fn(example) -> int``, the example's length (its cost unit,
            e.g. tokens). On an HF dataset it is mapped once over the data (cached).
        length_column: A column (or key) of each example holding its length.
        lengths: One length per dataset index (map-style datasets only).
        length_columns: The only columns ``length_fn`` reads on an HF dataset, so that
            computing lengths never decodes images or audio.
        num_proc: Processes for the one-off ``Dataset.map`` that computes lengths.
        meta_fn: ``meta_fn(example) -> ints``, the row gathered per example instead of
            ``[length]`` (for a custom ``planner``; not in index mode).
        batch_meta_fn: ``batch_meta_fn(collated_batch) -> rows`` (``mode="local"`` only): any
            number of rows per batch, e.g. the orchestrator's segment table.
        planner: ``planner(meta, src, num_ranks) -> plan`` replacing the default
            ``BalancePlanner(policy, cost)`` (see :data:`orchmllm.data.exchange.Planner`).
        policy: The balancing policy (a name in ``orchmllm.POLICIES``): ``greedy`` for
            packed batches, ``padded_cost`` or ``binary_search`` for padded ones.
        cost: An ``orchmllm.CostModel`` for the policy (None: the policy's default).
        mode: ``"index"`` (ranks exchange dataset indices and lengths, each loads its
            balanced share: needs a map-style dataset with lengths known up front),
            ``"move"`` (each rank loads what it sampled, examples then move to their
            destination as bytes: streams, ``DataLoader`` sources), ``"local"`` (the batch
            as sampled plus the plan: :class:`PlannedBatch`), or ``"auto"`` (index when
            possible, else move).
        prefetch: Steps prepared ahead in a background thread (0: synchronous).
        shuffle: Reshuffle the sampling order every epoch (as ``DistributedSampler``).
        seed: The shuffling seed; the same on every rank.
        drop_last: Drop the tail that does not divide evenly over the ranks.
        num_replicas: Ranks the data is split over (default: the process group's size).
        group: The CPU (gloo) process group for the loader's collectives (default: a new
            gloo group over all ranks, so the loader never shares the training group).
        timeout: Seconds any collective of the loader may wait for the other ranks.
        name: What errors call this loader (default ``BalancedDataLoader#k``, the k-th
            loader this process created: the same loader on every rank).
    """

    batch_size: int | None = None
    collate_fn: Callable[[list], Any] | None = None
    length_fn: LengthFn | None = None
    length_column: str | None = None
    lengths: Sequence[int] | np.ndarray | None = None
    length_columns: Sequence[str] | None = None
    num_proc: int | None = None
    meta_fn: Callable[[Any], Sequence[int]] | None = None
    batch_meta_fn: Callable[[Any], np.ndarray] | None = None
    planner: ex.Planner | None = None
    policy: str = "greedy"
    cost: Any = None
    mode: str = "auto"
    prefetch: int = 2
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    num_replicas: int | None = None
    group: dist.ProcessGroup | None = None
    timeout: float = 600.0
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")
        sources = [
            n for n in ("length_fn", "length_column", "lengths") if getattr(self, n) is not None
        ]
        if len(sources) > 1:
            raise ValueError(
                f"pass at most one of length_fn, length_column, lengths; got {sources}"
            )
        if not sources and self.meta_fn is None and self.batch_meta_fn is None:
            raise ValueError("pass one of length_fn=, length_column=, lengths= (or meta_fn=)")
        if self.batch_meta_fn is not None and self.mode != "local":
            raise ValueError(f"batch_meta_fn needs mode='local', got mode={self.mode!r}")
        if self.mode == "index" and self.meta_fn is not None:
            raise ValueError(
                "mode='index' plans on lengths only; meta_fn needs mode 'move'/'local'"
            )


def _options(options: LoaderOptions | None, kwargs: dict[str, Any]) -> LoaderOptions:
    """``options`` with ``kwargs`` applied (both checked by ``LoaderOptions``)."""
    if options is None:
        return LoaderOptions(**kwargs)
    if not isinstance(options, LoaderOptions):
        raise TypeError(f"options must be a LoaderOptions, got {type(options).__name__}")
    return replace(options, **kwargs) if kwargs else options


def _resolve_mode(source: Any, opts: LoaderOptions) -> str:
    """The mode ``"auto"`` stands for with this source, after checking the source fits."""
    map_style = _is_map_style(source)
    if isinstance(source, DataLoader):
        if opts.batch_size is not None:
            raise ValueError("batch_size comes from the dataloader; do not pass it too")
    elif opts.batch_size is None:
        raise ValueError("batch_size must be >= 1, got None")
    if opts.lengths is not None and not map_style:
        raise ValueError("lengths= needs a map-style dataset (one length per index)")
    mode = opts.mode
    if mode == "auto":
        known = opts.lengths is not None or (is_hf_dataset(source) and opts.meta_fn is None)
        mode = "index" if map_style and known else "move"
    if mode == "index" and not map_style:
        raise ValueError(
            f"mode='index' needs a map-style dataset, got {type(source).__name__}; "
            "use mode='move' for iterable data or a DataLoader"
        )
    if (
        mode != "index"
        and is_hf_dataset(source)
        and opts.length_column is not None
        and opts.length_column not in source.column_names
    ):
        raise ValueError(
            f"length_column={opts.length_column!r} is not a column of the dataset; "
            f"columns are {source.column_names}"
        )
    return mode


def _index_lengths(source: Any, opts: LoaderOptions) -> np.ndarray:
    """Every example's length, by dataset index (index mode plans on these alone)."""
    if opts.lengths is None:
        return dataset_lengths(
            source,
            length_column=opts.length_column,
            length_fn=opts.length_fn,
            columns=opts.length_columns,
            num_proc=opts.num_proc,
        )
    lengths = check_lengths(opts.lengths, source="lengths")
    if lengths.size != len(source):
        raise ValueError(f"lengths has {lengths.size} entries, the dataset {len(source)}")
    return lengths


def _num_replicas(source: Any, opts: LoaderOptions, group: ex.Group) -> int:
    """Given, else the wrapped DataLoader's DistributedSampler's, else the group's size."""
    if opts.num_replicas is not None:
        return opts.num_replicas
    sampler = getattr(source, "sampler", None) if isinstance(source, DataLoader) else None
    return getattr(sampler, "num_replicas", group.size)


class BalancedDataLoader:
    """Iterate balanced mini-batches; see the module docstring for the modes.

    ``source``: a map-style dataset (HF ``datasets.Dataset`` or anything with
    ``__getitem__``/``__len__``), an iterable dataset holding this rank's shard, or a
    ``DataLoader`` (its sampler, workers and, unless ``collate_fn`` is given, its collate
    function are kept; examples are balanced before collation). The options are a
    :class:`LoaderOptions`, or its fields as keyword arguments.

    Collective: create and iterate it on every rank in the same order; every rank must
    consume the same number of batches before breaking out of an epoch.
    """

    def __init__(self, source: Any, options: LoaderOptions | None = None, /, **kwargs: Any) -> None:
        opts = _options(options, kwargs)
        self.options = opts
        self.name = opts.name or f"BalancedDataLoader#{next(_CREATED)}"
        self.source = source
        self.mode = _resolve_mode(source, opts)
        is_loader = isinstance(source, DataLoader)
        self.collate_fn = opts.collate_fn or (source.collate_fn if is_loader else default_collate)
        self.planner = opts.planner or BalancePlanner(policy=opts.policy, cost=opts.cost)
        group = opts.group if opts.group is not None else ex.new_cpu_group(timeout=opts.timeout)
        self._group = ex.Group(group, timeout=opts.timeout)
        self.num_replicas = _num_replicas(source, opts, self._group)
        self._lengths = _index_lengths(source, opts) if self.mode == "index" else None
        map_style = _is_map_style(source)
        self._sampled = _Sampled(source, self) if map_style else None
        batch = None if is_loader else opts.batch_size
        self._streamed = None if map_style else _Streamed(source, batch)
        self.epoch = 0
        self._step = 0  # steps of self.epoch the training loop has consumed
        # Held weakly: an iterator the loop drops mid-epoch is then collected at once, and
        # collecting it closes its prefetch thread (the thread keeps this loader alive, so a
        # strong reference here would keep that thread running past the process group).
        self._active: weakref.ref[_EpochIterator] | None = None
        self.last_step: StepInfo | None = None
        # An EpochMismatch not yet raised in the loop; close() and the next iteration raise it.
        self._failure: ex.EpochMismatch | None = None

    # -- sampler semantics ----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first step on the next iteration (reshuffles)."""
        self.epoch = int(epoch)
        self._step = 0

    def state_dict(self) -> dict[str, int]:
        """Position of the training loop: batches it consumed, not those prefetched."""
        return {"epoch": self.epoch, "step": self._step, "seed": self.options.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration yields the batches from ``state['step']`` on."""
        missing = {"epoch", "step", "seed"} - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}")
        if int(state["seed"]) != self.options.seed:
            raise ValueError(f"state seed {state['seed']} differs from seed={self.options.seed}")
        if int(state["step"]) < 0:
            raise ValueError(f"state step must be >= 0, got {state['step']}")
        self.close()
        self.epoch, self._step = int(state["epoch"]), int(state["step"])

    def __len__(self) -> int:
        """Steps per epoch (map-style sources only)."""
        if self._sampled is None:
            raise TypeError("the number of steps of iterable data is known only at its end")
        return steps_per_epoch(
            len(self.source),
            num_replicas=self.num_replicas,
            batch_size=self.options.batch_size,
            drop_last=self.options.drop_last,
        )

    # -- iteration ---------------------------------------------------------------------

    def __iter__(self) -> _EpochIterator:
        self.close()
        self._handshake()
        it = _EpochIterator(self, self.epoch, self._step)
        self._active = weakref.ref(it)
        return it

    def close(self) -> None:
        """Stop the background thread of the current iteration (collective-safe: call it
        on every rank after the same number of batches). Iterating again, set_epoch's next
        iteration and ``with`` blocks close it too.

        Raises :class:`~orchmllm.data.exchange.EpochMismatch` (on every rank) when the
        ranks' loops left the epoch after different numbers of batches.
        """
        active = self._active() if self._active is not None else None
        self._active = None
        try:
            if active is not None:
                active.close()
        finally:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def __enter__(self) -> BalancedDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handshake(self) -> None:
        """Every rank checks that all ranks agree on the set-up, so a mismatch fails here
        with a clear message instead of hanging in a later collective."""
        g = self._group
        dataset_len = len(self.source) if self._sampled is not None else -1
        mine = [
            g.size,
            self.num_replicas,
            self.options.batch_size or -1,
            dataset_len,
            self.epoch,
            self._step,
            MODES.index(self.mode),
            self.options.seed,
            int(self.options.shuffle),
            int(self.options.drop_last),
        ]
        table = g.all_gather_fixed(mine)
        for col, name in enumerate(_HANDSHAKE):
            if np.any(table[:, col] != table[0, col]):
                raise ValueError(
                    f"{self.name}: {name} differs between ranks: {table[:, col].tolist()} "
                    "(rank order)"
                )
        if self.num_replicas != g.size:
            raise ValueError(
                f"{self.name}: num_replicas={self.num_replicas} but the process group has "
                f"{g.size} ranks"
            )

    # -- one step (runs in the background thread) ---------------------------------------

    def _meta_row(self, example: Any, index: int | str) -> list[int]:
        if self.options.meta_fn is not None:
            row = [int(v) for v in self.options.meta_fn(example)]
            return row
        return [
            example_length(
                example,
                index=index,
                length_column=self.options.length_column,
                length_fn=self.options.length_fn,
            )
        ]

    def _produce(self, epoch: int, num_steps: int | None, step: int) -> tuple[Any, StepInfo]:
        if num_steps is not None and step >= num_steps:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            if self.mode == "index":
                return self._produce_index(epoch, step, t0)
            return self._produce_local_or_move(epoch, num_steps, step, t0)
        except ex.EpochMismatch as exc:  # a peer's loop left the epoch before this one
            raise self._record(exc, epoch) from None

    def _leave(self, epoch: int, num_steps: int | None, step: int, consumed: int) -> None:
        """The loop left the epoch after ``consumed`` batches; the thread stopped before
        ``step`` (see :func:`~orchmllm.data.exchange.leave_epoch`)."""
        if num_steps is not None and step >= num_steps:
            return  # every rank's producer ends at num_steps by itself: nothing pending
        try:
            ex.leave_epoch(self._group, consumed=consumed, step=step)
        except ex.EpochMismatch as exc:
            raise self._record(exc, epoch) from None

    def _record(self, exc: ex.EpochMismatch, epoch: int) -> ex.EpochMismatch:
        """The error named after this loader, kept until the loop or close() raises it."""
        self._failure = ex.EpochMismatch(f"{self.name}, epoch {epoch}: {exc}")
        return self._failure

    def _after_gather(self, step: int, num_steps: int | None, work: Callable[[], Any]) -> Any:
        """Run this rank's work that follows the gather; if it fails, tell the peers at
        the next step's header (where they will be) so that they fail instead of wait."""
        try:
            return work()
        except Exception as exc:
            if num_steps is None or step + 1 < num_steps:
                ex.gather_step(self._group, None, error=exc, step=step + 1)
            raise

    def _produce_index(self, epoch: int, step: int, t0: float) -> tuple[Any, StepInfo]:
        g = self._group
        assert self._sampled is not None and self._lengths is not None
        local = self._sampled.batches[step]
        rows = [[i, int(self._lengths[i])] for i in local]
        gathered = ex.gather_step(g, rows, step=step)
        plan = ex.check_rearrangement(
            ex.run_planner(g, self.planner, gathered.meta[:, 1:], gathered.src),
            g,
            len(gathered.src),
        )
        plan_s = time.perf_counter() - t0
        indices = gathered.meta[:, 0]

        def load() -> Any:
            return self.collate_fn(_load(self.source, indices[plan.items_at(g.rank)]))

        batch = self._after_gather(step, len(self._sampled.batches), load)
        info = StepInfo(
            epoch,
            step,
            gathered.meta[:, 1:],
            gathered.src,
            indices,
            plan,
            plan_s,
            time.perf_counter() - t0,
            gathered.bytes_sent,
            0,
        )
        return batch, info

    def _produce_local_or_move(
        self, epoch: int, num_steps: int | None, step: int, t0: float
    ) -> tuple[Any, StepInfo]:
        source = self._sampled if self._sampled is not None else self._streamed
        assert source is not None

        local = self.mode == "local"

        def prepare() -> tuple[Any, Sequence[Sequence[int]]]:
            keyed = source.local(step)
            if keyed is None:
                return None, []
            examples = [e for _, e in keyed]
            if local and self.options.batch_meta_fn is not None:
                batch = self.collate_fn(examples)
                return batch, np.asarray(self.options.batch_meta_fn(batch), dtype=np.int64)
            rows = [self._meta_row(e, key) for key, e in keyed]
            return (self.collate_fn(examples) if local else examples), rows

        done = ex.balance_step(self._group, self.planner, prepare, step=step, move=not local)
        if done is None:
            raise StopIteration
        if local:  # collated before the gather: nothing can fail after it
            batch = done.examples
        else:
            batch = self._after_gather(step, num_steps, lambda: self.collate_fn(done.examples))
        info = done.info(epoch=epoch, step=step, prep_s=time.perf_counter() - t0)
        if local:
            return PlannedBatch(batch, done.plan, info), info
        return batch, info


class _EpochIterator(Iterator[Any]):
    """One pass over an epoch from a start step; owns the background thread."""

    def __init__(self, loader: BalancedDataLoader, epoch: int, start: int) -> None:
        self.loader = loader
        num_steps = None
        if loader._sampled is not None:
            num_steps = loader._sampled.start(epoch, start)
        else:
            assert loader._streamed is not None
            loader._streamed.start(epoch, start)

        def produce(step: int) -> tuple[Any, StepInfo]:
            return loader._produce(epoch, num_steps, step)

        def leave(step: int, consumed: int) -> None:
            loader._leave(epoch, num_steps, step, consumed)

        self.prefetcher = Prefetcher(
            produce,
            start=start,
            depth=loader.options.prefetch,
            name=f"orchmllm-loader-{loader.name}-e{epoch}",
            close_timeout=loader.options.timeout,
            on_close=leave,
        )

    def __next__(self) -> Any:
        try:
            batch, info = next(self.prefetcher)
        except StopIteration:
            self.loader._step = 0
            self.close()
            raise
        except ex.EpochMismatch as exc:
            if exc is self.loader._failure:  # raised here: close() need not raise it again
                self.loader._failure = None
            raise
        self.loader._step = info.step + 1
        self.loader.last_step = info
        return batch

    @property
    def wait_s(self) -> float:
        """Seconds the training loop spent waiting for batches (planning not hidden)."""
        return self.prefetcher.wait_s

    def close(self) -> None:
        self.prefetcher.close()
