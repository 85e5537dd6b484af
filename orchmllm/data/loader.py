"""BalancedDataLoader: balanced mini-batches with planning hidden behind the training step.

A background thread prepares the next ``prefetch`` steps while the current one trains
(paper section 6, "Computation overhead overlapping"): it samples the local mini-batch,
all-gathers its metadata on its topology's CPU (gloo) group, computes the plan (the C++
balancing core releases the GIL) and, depending on the mode, builds the balanced batch:

- ``"index"``: map-style dataset with lengths known before loading (a length column, a
  length function mapped once over an HF dataset, or a ``lengths`` array). Ranks exchange
  only dataset indices and lengths; each rank then loads and collates exactly the examples
  assigned to it (in DataLoader workers if ``num_workers``), so no example crosses the
  network.
- ``"move"``: iterable/streaming data, or an existing DataLoader, where a rank can read
  only its own shard: examples are loaded locally, then moved to their destination rank
  with one all-to-all of their serialized bytes, then collated.
- ``"local"``: the local batch is collated as sampled and yielded with the planner's
  output (for the multimodal orchestrator, which moves data per phase on the device).

Every rank yields the same number of steps per epoch, ``set_epoch`` reshuffles, and
``state_dict()`` records the steps the training loop consumed (not what was prefetched),
so a job restarted from it sees exactly the batches it would have seen, workers or not.
Batches are cut by count (``batch_size``) or by a per-rank token budget
(``max_tokens_per_rank``). Each step's balance metrics come as a plain dict (see
:mod:`orchmllm.data.stats`).

Balancing moves examples between ranks, so a loss averaged per rank would weight them
differently than before: normalise the loss by the global count of loss-bearing items
(``orchmllm.global_num_items``), as in the module docstring of :mod:`orchmllm.dist.dispatcher`.
"""

from __future__ import annotations

import itertools
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate
from torch.utils.data._utils.pin_memory import pin_memory

from orchmllm.data import exchange as ex
from orchmllm.data import sources as sr
from orchmllm.data import stats as st
from orchmllm.data.exchange import StepInfo
from orchmllm.data.lengths import (
    LengthFn,
    check_lengths,
    dataset_lengths,
    example_length,
    is_hf_dataset,
)
from orchmllm.data.options import (
    LoaderOptions,
    PlanningOptions,
    SamplingOptions,
    given,
    with_keywords,
)
from orchmllm.data.planners import BalancePlanner, warn_on_layout_mismatch
from orchmllm.data.prefetch import Prefetcher
from orchmllm.data.sampling import (
    check_budget,
    local_batches,
    rank_indices,
    steps_per_epoch,
    token_budget_batches,
)
from orchmllm.dist.topology import Topology
from orchmllm.planner.plan import Rearrangement

# How examples cross the ranks (``mode=``): not the balance modes of
# orchmllm.planner.step_options.MODES.
EXCHANGE_MODES = ("auto", "index", "move", "local")
# DataLoader's own keywords the loader takes besides batch_size and collate_fn: the ones a
# wrapper (orchestrated_loader, an adapted model's loader) forwards as they are.
DATALOADER_KEYWORDS = (
    "shuffle",
    "drop_last",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "timeout",
    "worker_init_fn",
    "generator",
    "multiprocessing_context",
)
_CREATED = itertools.count(1)  # loaders created by this process, for their default names
_HANDSHAKE = (
    "world_size",
    "num_replicas",
    "batch_size",
    "max_tokens_per_rank",
    "dataset_len",
    "epoch",
    "step",
    "mode",
    "seed",
    "shuffle",
    "drop_last",
    "prefetch",
    "num_workers",
)


@dataclass(frozen=True)
class PlannedBatch:
    """What ``mode="local"`` yields: the batch as sampled on this rank, and its plan.

    Attributes:
        batch: This rank's local mini-batch, collated, as sampled (nothing moved yet).
        plan: The planner's output for the step, identical on every rank: a
            :class:`~orchmllm.planner.plan.Rearrangement` (execute it with
            ``BatchDispatcher.dispatch(..., plan=plan)``) or, from
            :func:`~orchmllm.data.orchestrated.orchestrated_loader`, a ``StepPlan`` (pass it
            to ``Orchestrator.run(batch, encoders, plan=plan, assembly=assembly)``).
        info: The step's record (:class:`~orchmllm.data.exchange.StepInfo`).
        stats: The step's balance metrics (see :mod:`orchmllm.data.stats`).
        assembly: This rank's share of the plan, computed in the background thread with it
            when the planner has an ``assembly(plan, rank)`` method (from
            :func:`~orchmllm.data.orchestrated.orchestrated_loader`: the
            :class:`~orchmllm.planner.assembly.Assembly` of this rank's LLM sequences, so that
            ``Orchestrator.run`` only moves data and runs the encoders); else None.
    """

    batch: Any
    plan: Any
    info: StepInfo
    stats: dict[str, float] = field(default_factory=dict)
    assembly: Any = None


def _check_lengths_args(lengths_from: list[str], mode: str, planning: PlanningOptions) -> None:
    """Where the planner's rows come from (``lengths_from``: the names of the length arguments
    given), checked against the mode and the planning options."""
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"mode must be one of {EXCHANGE_MODES}, got {mode!r}")
    if len(lengths_from) > 1:
        raise ValueError(
            f"pass at most one of length_fn, length_column, lengths; got {lengths_from}"
        )
    if not lengths_from and not planning.custom_rows:
        raise ValueError(
            "pass one of length_fn=, length_column=, lengths= (or a planning meta_fn=)"
        )
    if planning.batch_meta_fn is not None and mode != "local":
        raise ValueError(f"batch_meta_fn needs mode='local', got mode={mode!r}")
    if mode == "index" and planning.meta_fn is not None:
        raise ValueError("mode='index' plans on lengths only; meta_fn needs mode 'move'/'local'")


def _check_batch_args(
    batch_size: int | None, max_tokens_per_rank: int | None, *, budgets_lengths: bool
) -> None:
    """What one step holds: a count or a token budget, never both; a budget needs the
    lengths (``budgets_lengths``: lengths given, no custom planner rows)."""
    for name, value in (("batch_size", batch_size), ("max_tokens_per_rank", max_tokens_per_rank)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    if max_tokens_per_rank is None:
        return
    if batch_size is not None:
        raise ValueError(
            f"pass batch_size= or max_tokens_per_rank=, not both; got batch_size={batch_size}, "
            f"max_tokens_per_rank={max_tokens_per_rank}"
        )
    if not budgets_lengths:
        raise ValueError(
            "max_tokens_per_rank budgets lengths: pass length_fn=, length_column= or lengths=, "
            "and no meta_fn= or batch_meta_fn= (a custom planner's rows)"
        )


def _check_source(
    source: Any,
    *,
    batch_size: int | None,
    max_tokens_per_rank: int | None,
    lengths: Any,
    options: LoaderOptions,
    sampled: dict[str, bool],
) -> None:
    """Options this kind of source cannot honour fail here, saying what to use instead
    (``sampled``: the sampling keywords given to the loader itself)."""
    if isinstance(source, DataLoader):
        for name, value in (
            ("batch_size", batch_size),
            ("max_tokens_per_rank", max_tokens_per_rank),
        ):
            if value is not None:
                raise ValueError(
                    f"{name} comes from the dataloader's batches; do not pass it too (or pass "
                    "the dataset instead of the DataLoader)"
                )
        default = sr.Workers()
        workers = {k: v for k, v in vars(sr.Workers.of(options)).items() if v != vars(default)[k]}
        if workers:
            raise ValueError(
                "the worker settings come from the dataloader: set them on it "
                f"(DataLoader(..., num_workers=N)); got {workers}"
            )
        if sampled:
            raise ValueError(
                "shuffle and drop_last come from the dataloader's sampler: set them on it "
                f"(DistributedSampler(..., shuffle=, drop_last=)); got {sampled}"
            )
        return
    if batch_size is None and max_tokens_per_rank is None:
        raise ValueError("pass batch_size= (>= 1) or max_tokens_per_rank=, got neither")
    workers = options.num_workers
    if workers and not (sr.is_map_style(source) or isinstance(source, IterableDataset)):
        raise ValueError(
            f"num_workers={workers} needs a map-style dataset, a torch IterableDataset "
            f"or a DataLoader; got {type(source).__name__}: wrap it in an IterableDataset, or "
            "use num_workers=0"
        )
    if lengths is not None and not sr.is_map_style(source):
        raise ValueError("lengths= needs a map-style dataset (one length per index)")


def _resolve_mode(
    source: Any,
    mode: str,
    *,
    lengths: Any,
    length_column: str | None,
    planning: PlanningOptions,
) -> str:
    """The mode ``"auto"`` stands for with this source (a source that fits, see
    :func:`_check_source`)."""
    map_style = sr.is_map_style(source)
    if mode == "auto":
        known = lengths is not None or (is_hf_dataset(source) and planning.meta_fn is None)
        mode = "index" if map_style and known else "move"
    if mode == "index" and not map_style:
        raise ValueError(
            f"mode='index' needs a map-style dataset, got {type(source).__name__}; "
            "use mode='move' for iterable data or a DataLoader"
        )
    if (
        mode != "index"
        and is_hf_dataset(source)
        and length_column is not None
        and length_column not in source.column_names
    ):
        raise ValueError(
            f"length_column={length_column!r} is not a column of the dataset; "
            f"columns are {source.column_names}"
        )
    return mode


def _num_replicas(source: Any, sampling: SamplingOptions, group: ex.Group) -> int:
    """Given, else the wrapped DataLoader's DistributedSampler's, else the group's size."""
    if sampling.num_replicas is not None:
        return sampling.num_replicas
    sampler = getattr(source, "sampler", None) if isinstance(source, DataLoader) else None
    return getattr(sampler, "num_replicas", group.size)


def _pinning(source: Any, options: LoaderOptions) -> bool:
    """Whether to pin batches: asked (here or on a DataLoader source) and possible."""
    asked = options.pin_memory or (isinstance(source, DataLoader) and source.pin_memory)
    if asked and not torch.accelerator.is_available():
        warnings.warn(
            "pin_memory=True but no accelerator is available: batches are not pinned",
            stacklevel=4,
        )
        return False
    return bool(asked)


@dataclass(frozen=True)
class _WithinBudget:
    """A planner whose plans keep every rank within ``max_tokens`` (column 0 of the
    metadata): a plan that would not is replaced by the sampled layout, which is."""

    planner: ex.Planner
    max_tokens: int

    @property
    def deterministic(self) -> bool:
        return getattr(self.planner, "deterministic", True)

    def __call__(self, meta: np.ndarray, src: np.ndarray, num_ranks: int) -> Rearrangement:
        plan = self.planner(meta, src, num_ranks)
        if not isinstance(plan, Rearrangement):
            raise ValueError(
                f"max_tokens_per_rank needs a planner returning a Rearrangement, got "
                f"{type(plan).__name__}"
            )
        loads = np.bincount(plan.dst_rank, weights=meta[:, 0], minlength=num_ranks)
        if loads.size and loads.max() > self.max_tokens:
            return Rearrangement.from_assignment(src, src, num_ranks=num_ranks)
        return plan


@dataclass
class _Epoch:
    """One pass over an epoch from ``start``: what the producer thread keeps between steps."""

    epoch: int
    start: int
    num_steps: int | None  # None: known only when every rank is exhausted
    next_gather: int  # the step of the next metadata exchange
    sampled: list[list[int]] = field(default_factory=list)  # index mode: local indices/step
    batches: Iterator[sr.Local] | None = None  # other modes: local batches from start
    planned: deque = field(default_factory=deque)  # index mode: plans made ahead of loading
    loaded: Iterator[Any] | None = None  # index mode: the balanced batches, loaded
    planning_failed: bool = False  # the error came from a collective step, on every rank


class _Planned(NamedTuple):
    gathered: ex.Gathered
    plan: Rearrangement
    t0: float
    plan_s: float


class _Step(NamedTuple):
    batch: Any
    info: StepInfo
    stats: dict[str, float]


class BalancedDataLoader:
    """Iterate balanced mini-batches: a drop-in for ``DataLoader`` + ``DistributedSampler``.

    Each iteration is one epoch: every rank samples its mini-batch as a
    ``DistributedSampler`` would (or by token budget), the ranks agree on a plan that
    evens out their work, and each rank gets its balanced share. The global batch of every
    step is unchanged; only which rank computes which example changes, so normalise the
    loss by the global count of loss-bearing items (``orchmllm.global_num_items``) and the
    gradients equal an unbalanced run's.

    It takes ``DataLoader``'s own keywords as a ``DataLoader`` does
    (``BalancedDataLoader(dataset, batch_size=8, shuffle=True, num_workers=2,
    length_column="n_tokens", collate_fn=collate)``); what is ours comes in three small option
    objects, each checked when built and shareable between loaders: ``sampling=``
    (:class:`SamplingOptions`: shuffle, seed, drop_last, num_replicas), ``planning=``
    (:class:`PlanningOptions`: policy, cost, a planner of your own and its rows) and
    ``options=`` (:class:`LoaderOptions`: prefetch, workers, pinning, name, metrics). A
    ``DataLoader`` keyword sets the same field of its group; giving a setting both ways with
    different values is an error.

    Args:
        source: A map-style dataset (HF ``datasets.Dataset`` or anything with
            ``__getitem__``/``__len__``: every rank passes the whole dataset), an iterable
            holding this rank's shard (torch/HF ``IterableDataset`` or any iterable), or a
            ``DataLoader`` (its sampler, workers and, unless ``collate_fn`` is given, its
            collate function are kept; examples are balanced before collation).
        batch_size: Examples each rank samples per step (as ``DataLoader(batch_size=)``).
            Pass it or ``max_tokens_per_rank``, except for a ``DataLoader`` source, whose
            own batches are used.
        max_tokens_per_rank: Instead of ``batch_size``: each rank's batch holds at most this
            many length units (tokens) after balancing. With lengths known up front the
            epoch is packed into steps of one batch per rank under the budget
            (:func:`~orchmllm.data.sampling.token_budget_batches`); otherwise each rank
            cuts its stream at the budget. A plan that would put more on a rank is
            replaced by the sampled layout. Every rank takes the same number of steps.
        length_column: A column (or key) of each example holding its length (cost unit,
            e.g. tokens). Pass one of ``length_column``, ``length_fn``, ``lengths`` (or a
            planning ``meta_fn``/``batch_meta_fn``).
        length_fn: ``length_fn(example) -> int``, the example's length. On an HF dataset it
            is mapped once over the data (cached; see ``LoaderOptions.length_columns``).
        lengths: One length per dataset index (map-style datasets only).
        collate_fn: Turns a list of examples into a batch; runs on the balanced examples.
            Default: the ``DataLoader`` source's own, else torch's ``default_collate``.
        shuffle: Reshuffle every epoch, as ``DataLoader``'s with a ``DistributedSampler``
            (the order from ``SamplingOptions.seed`` and the epoch). This and ``drop_last``
            default to the ``sampling`` group's (``True``, ``False`` unless set); for a
            ``DataLoader`` source set them on its sampler.
        drop_last: Drop the tail that does not divide evenly over the ranks.
        num_workers: Worker processes loading the examples, as ``DataLoader``'s. This and
            the worker settings below default to the ``options`` group's (DataLoader's
            defaults unless set; see :class:`LoaderOptions`); for a ``DataLoader`` source
            set them on it.
        pin_memory: Pin the yielded batches' tensors.
        persistent_workers: Keep the workers between epochs.
        prefetch_factor: Batches each worker loads ahead.
        timeout: Seconds to wait for a batch from the workers.
        worker_init_fn: Called in each worker with its id.
        generator: The ``torch.Generator`` the workers' base seed is drawn from.
        multiprocessing_context: How the workers start.
        mode: ``"index"`` (ranks exchange dataset indices and lengths, each loads its
            balanced share: needs a map-style dataset with lengths known up front),
            ``"move"`` (each rank loads what it sampled, examples then move to their
            destination as bytes: streams, ``DataLoader`` sources), ``"local"`` (the batch
            as sampled plus the plan: :class:`PlannedBatch`), or ``"auto"`` (index when
            possible, else move).
        sampling: A :class:`SamplingOptions` (None: the defaults).
        planning: A :class:`PlanningOptions` (None: the ``greedy`` policy).
        options: A :class:`LoaderOptions` (None: the defaults).
        topology: The job's process groups (:class:`orchmllm.dist.topology.Topology`): the loader
            talks on its gloo metadata group only, with its timeout. None builds one over the
            default group that this loader owns, so that loaders never share a group:
            several may be iterated together (dropping the loader destroys its group). A
            topology shared between loaders (or with a dispatcher) saves the group, but its
            users must not gather at the same time: iterate one of its loaders at a time.

    Iterating yields, per step: the collated balanced batch (``mode`` index or move), or a
    :class:`PlannedBatch` (``mode="local"``); with ``LoaderOptions(with_stats=True)`` a pair
    ``(that, stats)``, ``stats`` a flat dict of numbers (:mod:`orchmllm.data.stats`),
    also kept in ``last_stats``. ``len()`` is the number of steps per epoch.

    Raises:
        ValueError: A bad option or a combination that cannot work (naming it and what to
            use instead), ranks that disagree on the set-up (at the start of an epoch), a
            bad length (naming the example's dataset index).
        TypeError: ``sampling``, ``planning`` or ``options`` of another type.
        EpochMismatch: The ranks left an epoch after different numbers of batches (on
            every rank, from the loop or from ``close()``).
        PeerFailed: Another rank failed to prepare a step (its own error is raised there).

    Collective: create and iterate it on every rank in the same order; every rank must
    consume the same number of batches before leaving an epoch.
    """

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int | None = None,
        max_tokens_per_rank: int | None = None,
        length_column: str | None = None,
        length_fn: LengthFn | None = None,
        lengths: Sequence[int] | np.ndarray | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        timeout: float | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        generator: torch.Generator | None = None,
        multiprocessing_context: Any = None,
        mode: str = "auto",
        sampling: SamplingOptions | None = None,
        planning: PlanningOptions | None = None,
        options: LoaderOptions | None = None,
        topology: Topology | None = None,
    ) -> None:
        sampled = {"shuffle": shuffle, "drop_last": drop_last}
        sampled = {name: value for name, value in sampled.items() if value is not None}
        self.sampling = with_keywords(
            given(sampling, SamplingOptions, "sampling"), "sampling", **sampled
        )
        self.planning = given(planning, PlanningOptions, "planning")
        self.options = with_keywords(
            given(options, LoaderOptions, "options"),
            "options",
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            generator=generator,
            multiprocessing_context=multiprocessing_context,
        )
        length_args = {"length_fn": length_fn, "length_column": length_column, "lengths": lengths}
        lengths_from = [name for name, value in length_args.items() if value is not None]
        _check_lengths_args(lengths_from, mode, self.planning)
        budgets_lengths = bool(lengths_from) and not self.planning.custom_rows
        _check_batch_args(batch_size, max_tokens_per_rank, budgets_lengths=budgets_lengths)
        _check_source(
            source,
            batch_size=batch_size,
            max_tokens_per_rank=max_tokens_per_rank,
            lengths=lengths,
            options=self.options,
            sampled=sampled,
        )
        self.batch_size, self.max_tokens_per_rank = batch_size, max_tokens_per_rank
        self.length_column, self.length_fn = length_column, length_fn
        self.name = self.options.name or f"BalancedDataLoader#{next(_CREATED)}"
        self.source = source
        self.mode = _resolve_mode(
            source, mode, lengths=lengths, length_column=length_column, planning=self.planning
        )
        is_loader = isinstance(source, DataLoader)
        self.collate_fn = collate_fn or (source.collate_fn if is_loader else default_collate)
        plan = self.planning
        planner = plan.planner or BalancePlanner(policy=plan.policy, cost=plan.cost)
        warn_on_layout_mismatch(self.collate_fn, planner)
        self._stats_cost = st.planner_cost(planner)
        self._ranks_per_node = getattr(planner, "ranks_per_node", None)
        budget = max_tokens_per_rank
        self.planner = planner if budget is None else _WithinBudget(planner, budget)
        self.topology = topology if topology is not None else Topology.build()
        self._group = ex.Group(self.topology)
        self.num_replicas = _num_replicas(source, self.sampling, self._group)
        self._lengths = self._known_lengths(lengths)
        if budget is not None and self._lengths is not None:
            check_budget(self._lengths, budget)  # an example no step can hold: fail now
        self._pin = _pinning(source, self.options)
        self._reader = self._make_reader()
        self._steps_known = self._agreed_stream_steps()
        self._packing: tuple[int, list[list[list[int]]]] | None = None  # (epoch, steps)
        self.epoch = 0
        self._step = 0  # steps of self.epoch the training loop has consumed
        # Held weakly: an iterator the loop drops mid-epoch is then collected at once, and
        # collecting it closes its prefetch thread (the thread keeps this loader alive, so a
        # strong reference here would keep that thread running past the process group).
        self._active: weakref.ref[_EpochIterator] | None = None
        self.last_step: StepInfo | None = None
        self.last_stats: dict[str, float] = {}
        # An EpochMismatch not yet raised in the loop; close() and the next iteration raise it.
        self._failure: ex.EpochMismatch | None = None
        self._check_yields_a_step()

    def _check_yields_a_step(self) -> None:
        """Raise when an epoch would have no step (an empty dataset, fewer examples than one
        step takes): a loop over it would end at once without a word. Streams of unknown
        length are checked at the end of their first epoch (:class:`_EpochIterator`)."""
        try:
            steps = len(self)
        except TypeError:
            return
        if steps == 0:
            raise ValueError(self._no_step())

    def _no_step(self) -> str:
        try:
            size = f"{len(self.source)} examples"
        except TypeError:
            size = "no examples on any rank"
        per = (
            f"batch_size {self.batch_size}"
            if self.max_tokens_per_rank is None
            else f"max_tokens_per_rank {self.max_tokens_per_rank}"
        )
        drop = ", drop_last" if self.sampling.drop_last else ""
        return (
            f"{self.name}: the dataset ({type(self.source).__name__}, {size}) yields no step "
            f"of {self.num_replicas} ranks x {per}{drop}: a loop over it would end at once. "
            "Give it more examples or take smaller batches"
        )

    def _known_lengths(self, lengths: Sequence[int] | np.ndarray | None) -> np.ndarray | None:
        """Every example's length by dataset index, when known before loading: always in
        index mode (it plans on these alone), in the other modes only if given."""
        source = self.source
        if lengths is not None:
            known = check_lengths(lengths, source="lengths")
            if known.size != len(source):
                raise ValueError(f"lengths has {known.size} entries, the dataset {len(source)}")
            return known
        if self.mode != "index":
            return None
        return dataset_lengths(
            source,
            length_column=self.length_column,
            length_fn=self.length_fn,
            columns=self.options.length_columns,
            num_proc=self.options.num_proc,
        )

    def _make_reader(self) -> sr.MapLoader | sr.IterStream | sr.LoaderBatches:
        """What loads this rank's examples (one object for all epochs: persistent workers)."""
        workers = sr.Workers.of(self.options)
        if isinstance(self.source, DataLoader):
            return sr.LoaderBatches(self.source)
        if not sr.is_map_style(self.source):
            return sr.IterStream(self.source, chunk=self.batch_size or sr.CHUNK, workers=workers)
        if self.mode == "index":  # workers load and collate the balanced indices
            return sr.MapLoader(self.source, workers, collate_fn=self.collate_fn, indexed=False)
        return sr.MapLoader(self.source, workers, indexed=True)

    def _agreed_stream_steps(self) -> int | None:
        """Steps per epoch of a stream or DataLoader source, when every rank knows its own
        count (the epoch lasts as long as the longest rank's). Collective."""
        if sr.is_map_style(self.source):
            return None
        local = -1
        if self.max_tokens_per_rank is None:
            try:
                n = len(self.source)
                local = n if isinstance(self.source, DataLoader) else -(-n // self.batch_size)
            except TypeError:  # no __len__: known only at the end
                pass
        counts = self._group.all_gather_fixed([local])
        return int(counts.max()) if np.all(counts >= 0) else None

    # -- sampler semantics ----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first step on the next iteration (reshuffles).

        As ``DistributedSampler.set_epoch``: the loader does not advance the epoch itself, so
        call it with the same value on every rank before each epoch.

        Args:
            epoch: the epoch number; with ``seed`` it decides the epoch's shuffle and
                token-budget packing (it is also passed to the ``set_epoch`` of a source,
                sampler or HF iterable dataset that has one).
        """
        self.epoch = int(epoch)
        self._step = 0

    def set_costs(self, costs: Mapping[str, Any]) -> None:
        """Plan with new cost models (phase name -> ``CostModel``; costs learned from the
        run, :mod:`orchmllm.dist.calibrator`) from the first step the prefetcher cannot have begun
        (the steps the loop consumed plus the prefetch depth, plus one), the same step on
        every rank: call it on every rank between the same two steps.

        Args:
            costs: phase name (or ``"llm"``) -> its new cost model.

        Raises:
            TypeError: the planner's costs cannot change (only the orchestrator's can).
        """
        schedule = getattr(self.planner, "set_costs", None)
        if schedule is None:
            raise TypeError(f"the planner {type(self.planner).__name__} takes no new costs")
        schedule(costs, epoch=self.epoch, step=self._step + self.options.prefetch + 1)

    def state_dict(self) -> dict[str, int]:
        """Position of the training loop: batches it consumed, not those prefetched.

        Returns:
            ``{"epoch", "step", "seed"}``: the current epoch, the steps of it the loop has
            consumed (0 again once an epoch ran to its end) and the loader's seed. Save it
            with the model's checkpoint and pass it to :meth:`load_state_dict` to resume.
        """
        return {"epoch": self.epoch, "step": self._step, "seed": self.sampling.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration yields the batches from ``state['step']`` on.

        Closes the current iteration first (see :meth:`close`).

        Args:
            state: a :meth:`state_dict` (from a loader with the same seed and set-up).

        Raises:
            ValueError: ``state`` lacks ``epoch``, ``step`` or ``seed``, its seed differs
                from this loader's, or its step is negative.
            EpochMismatch: as :meth:`close`.
        """
        missing = {"epoch", "step", "seed"} - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}")
        if int(state["seed"]) != self.sampling.seed:
            raise ValueError(f"state seed {state['seed']} differs from seed={self.sampling.seed}")
        if int(state["step"]) < 0:
            raise ValueError(f"state step must be >= 0, got {state['step']}")
        self.close()
        self.epoch, self._step = int(state["epoch"]), int(state["step"])

    def __len__(self) -> int:
        """Steps per epoch (of the current epoch: token-budget packings vary by epoch).

        Raises ``TypeError`` for a stream whose length some rank does not know (an
        iterable without ``__len__``, or token-budget batches cut as the stream is read).
        """
        if sr.is_map_style(self.source) and self.max_tokens_per_rank is None:
            return steps_per_epoch(
                len(self.source),
                num_replicas=self.num_replicas,
                batch_size=self.batch_size,
                drop_last=self.sampling.drop_last,
            )
        steps = self._sampled_steps(self.epoch)  # token budget over known lengths
        if steps is not None:
            return len(steps)
        if self._steps_known is not None:
            return self._steps_known
        raise TypeError(
            f"{self.name}: the number of steps is known only at the end of the epoch for "
            f"{type(self.source).__name__} data (give it a __len__: the examples in this "
            "rank's shard), or with a token budget over lengths known only when loaded"
        )

    def _sampled_steps(self, epoch: int) -> list[list[int]] | None:
        """This rank's sampled dataset indices per step, where sampling needs no loading: a
        map-style dataset cut by count, or by token budget over lengths known up front."""
        sampling = self.sampling
        if not sr.is_map_style(self.source):
            return None
        if self.max_tokens_per_rank is None:
            return local_batches(
                len(self.source),
                rank=self._group.rank,
                num_replicas=self.num_replicas,
                batch_size=self.batch_size,
                epoch=epoch,
                seed=sampling.seed,
                shuffle=sampling.shuffle,
                drop_last=sampling.drop_last,
            )
        if self._lengths is None:
            return None
        if self._packing is None or self._packing[0] != epoch:
            steps = token_budget_batches(
                self._lengths,
                num_replicas=self.num_replicas,
                max_tokens=self.max_tokens_per_rank,
                epoch=epoch,
                seed=sampling.seed,
                shuffle=sampling.shuffle,
                drop_last=sampling.drop_last,
            )
            self._packing = (epoch, steps)
        return [per_rank[self._group.rank] for per_rank in self._packing[1]]

    # -- iteration ---------------------------------------------------------------------

    def __iter__(self) -> _EpochIterator:
        self.close()
        self._handshake()
        it = _EpochIterator(self, self._begin(self.epoch, self._step))
        self._active = weakref.ref(it)
        # Closed before the topology's groups go, at exit too (orchmllm.dist.topology: "Exit").
        self.topology.on_close(it, _EpochIterator.close)
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
        g, sampling, opts = self._group, self.sampling, self.options
        source = self.source
        workers = source.num_workers if isinstance(source, DataLoader) else opts.num_workers
        mine = [
            g.size,
            self.num_replicas,
            self.batch_size or -1,
            self.max_tokens_per_rank or -1,
            len(source) if sr.is_map_style(source) else -1,
            self.epoch,
            self._step,
            EXCHANGE_MODES.index(self.mode),
            sampling.seed,
            int(sampling.shuffle),
            int(sampling.drop_last),
            opts.prefetch,
            workers,
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

    def _begin(self, epoch: int, start: int) -> _Epoch:
        """The state of a pass over ``epoch`` from step ``start`` (nothing loaded yet)."""
        sampled = self._sampled_steps(epoch)
        ep = _Epoch(epoch, start, None if sampled is None else len(sampled), start)
        if self.mode == "index":
            ep.sampled = sampled
            # The workers start here, in the caller's thread, and their batch sampler plans
            # the steps they load first (every rank alike; the rest plan in the prefetch thread).
            ep.loaded = self._reader(self._plan_index_steps(ep))
        elif sampled is not None:  # only this rank's sampled steps from start are loaded
            ep.batches = (self._local(pairs) for pairs in self._reader(sampled[start:]))
        elif isinstance(self._reader, sr.LoaderBatches):
            ep.batches = self._reader(epoch, start)
        else:  # read (and drop) the steps before start: their cut depends on the data
            ep.batches = itertools.islice(self._cut(self._pairs(epoch)), start, None)
        return ep

    def _pairs(self, epoch: int) -> Iterator[tuple[sr.Key, Any]]:
        """This rank's examples of the epoch as (key, example), in sampling order."""
        if isinstance(self._reader, sr.MapLoader):  # token budget, lengths known when loaded
            order = rank_indices(
                len(self.source),
                rank=self._group.rank,
                num_replicas=self.num_replicas,
                epoch=epoch,
                seed=self.sampling.seed,
                shuffle=self.sampling.shuffle,
                drop_last=self.sampling.drop_last,
            )
            chunks = (order[i : i + sr.CHUNK] for i in range(0, len(order), sr.CHUNK))
            return itertools.chain.from_iterable(self._reader(chunks))
        assert isinstance(self._reader, sr.IterStream)
        return self._reader(epoch)

    def _cut(self, pairs: Iterator[tuple[sr.Key, Any]]) -> Iterator[sr.Local]:
        """Local batches from a stream of pairs: by count or by token budget."""
        if self.max_tokens_per_rank is None:
            return sr.by_count(pairs, self.batch_size)
        return sr.by_tokens(pairs, self._length, self.max_tokens_per_rank)

    def _local(self, pairs: list[tuple[int, Any]]) -> sr.Local:
        keys = [k for k, _ in pairs]
        lengths = None
        if self.max_tokens_per_rank is not None:  # packed on lengths known up front
            lengths = self._lengths[keys].tolist()
        return sr.Local(keys, [e for _, e in pairs], lengths)

    # -- one step (runs in the background thread) ---------------------------------------

    def _length(self, example: Any, key: sr.Key) -> int:
        if self._lengths is not None and isinstance(key, int):
            return int(self._lengths[key])
        return example_length(
            example,
            index=key,
            length_column=self.length_column,
            length_fn=self.length_fn,
        )

    def _meta_row(self, example: Any, key: sr.Key) -> list[int]:
        meta_fn = self.planning.meta_fn
        if meta_fn is not None:
            return [int(v) for v in meta_fn(example)]
        return [self._length(example, key)]

    def _produce(self, ep: _Epoch, step: int) -> _Step:
        if ep.num_steps is not None and step >= ep.num_steps:
            raise StopIteration
        try:
            if self.mode == "index":
                return self._produce_index(ep, step)
            return self._produce_local_or_move(ep, step)
        except ex.EpochMismatch as exc:  # a peer's loop left the epoch before this one
            raise self._record(exc, ep.epoch) from None

    def _leave(self, ep: _Epoch, step: int, consumed: int) -> None:
        """The loop left the epoch after ``consumed`` batches and the thread stopped before
        producing ``step``: tell the peers at the next exchange (see
        :func:`~orchmllm.data.exchange.leave_epoch`)."""
        planned = ep.num_steps is not None and ep.next_gather >= ep.num_steps
        confirming = self.mode == "index" and ep.num_steps is not None and step < ep.num_steps
        if planned and not confirming:
            return  # every rank's producer ends at num_steps by itself: nothing pending
        try:
            ex.leave_epoch(self._group, consumed=consumed, step=ep.next_gather)
        except ex.EpochMismatch as exc:
            raise self._record(exc, ep.epoch) from None

    def _record(self, exc: ex.EpochMismatch, epoch: int) -> ex.EpochMismatch:
        """The error named after this loader, kept until the loop or close() raises it."""
        self._failure = ex.EpochMismatch(f"{self.name}, epoch {epoch}: {exc}")
        return self._failure

    def _after_gather(self, ep: _Epoch, work: Callable[[], Any]) -> Any:
        """Run this rank's work that follows a gather; if it fails, tell the peers at the
        next exchange (where they will be) so that they fail instead of wait."""
        try:
            return work()
        except Exception as exc:
            if not ep.planning_failed and (ep.num_steps is None or ep.next_gather < ep.num_steps):
                ex.gather_step(self._group, None, error=exc, step=ep.next_gather)
            raise

    def _finish(self, batch: Any) -> Any:
        return pin_memory(batch) if self._pin else batch

    def _plan_index_steps(self, ep: _Epoch) -> Iterator[list[int]]:
        """The batch sampler of index mode: per step, gather the ranks' sampled (index,
        length) rows, plan, and yield the indices this rank loads. Runs where the loader
        asks for indices (ahead of loading by ``prefetch_factor * num_workers`` steps)."""
        g = self._group
        assert self._lengths is not None
        for step in range(ep.start, len(ep.sampled)):
            t0 = time.perf_counter()
            rows = [[i, int(self._lengths[i])] for i in ep.sampled[step]]
            ep.next_gather = step + 1
            planner = ex.planner_at(self.planner, ep.epoch, step)
            try:
                gathered = ex.gather_step(g, rows, step=step, planner=planner)
                plan = ex.run_planner(g, planner, gathered.meta[:, 1:], gathered.src)
                plan = ex.check_rearrangement(plan, g, len(gathered.src))
            except BaseException:
                ep.planning_failed = True
                raise
            ep.planned.append(_Planned(gathered, plan, t0, time.perf_counter() - t0))
            yield gathered.meta[plan.items_at(g.rank), 0].tolist()

    def _produce_index(self, ep: _Epoch, step: int) -> _Step:
        assert ep.loaded is not None
        batch, error = None, None
        try:
            batch = self._finish(next(ep.loaded))
        except Exception as exc:
            if ep.planning_failed:  # a collective error: raised on every rank already
                raise
            error = exc
        # Index mode loads after the plan: every rank says whether it loaded its share, so a
        # failure (the dataset or the collate function raised) is raised at this step on
        # every rank, naming the rank, before any rank trains on the step.
        ex.gather_step(self._group, [], error=error, step=step)
        gathered, plan, t0, plan_s = ep.planned.popleft()
        meta = gathered.meta[:, 1:]
        info = StepInfo(
            ep.epoch,
            step,
            meta,
            gathered.src,
            gathered.meta[:, 0],
            plan,
            plan_s,
            time.perf_counter() - t0,
            gathered.bytes_sent,
            0,
        )
        stats = st.phase_stats(
            "batch", plan, meta[:, 0], cost=self._stats_cost, plan_ms=1e3 * plan_s
        )
        return _Step(batch, info, self._step_stats(info, stats))

    def _produce_local_or_move(self, ep: _Epoch, step: int) -> _Step:
        assert ep.batches is not None
        t0 = time.perf_counter()
        local = self.mode == "local"
        batch_meta_fn = self.planning.batch_meta_fn

        def prepare() -> tuple[Any, Sequence[Sequence[int]]]:
            mine = next(ep.batches, None)
            if mine is None:
                return None, []
            if local and batch_meta_fn is not None:
                batch = self._finish(self.collate_fn(mine.examples))
                return batch, np.asarray(batch_meta_fn(batch), dtype=np.int64)
            if mine.lengths is not None:
                rows = [[n] for n in mine.lengths]
            else:
                pairs = zip(mine.keys, mine.examples, strict=True)
                rows = [self._meta_row(e, k) for k, e in pairs]
            return (self._finish(self.collate_fn(mine.examples)) if local else mine.examples), rows

        ep.next_gather = step + 1
        planner = ex.planner_at(self.planner, ep.epoch, step)
        done = ex.balance_step(self._group, planner, prepare, step=step, move=not local)
        if done is None:
            raise StopIteration
        if local:  # collated before the gather
            batch = done.examples
            stats = self._local_stats(done, batch)
            assembly = self._after_gather(ep, lambda: self._assembly(done.plan))
        else:
            batch = self._after_gather(ep, lambda: self._finish(self.collate_fn(done.examples)))
            stats = st.phase_stats(
                "batch",
                done.plan,
                done.meta[:, 0],
                cost=self._stats_cost,
                plan_ms=1e3 * done.plan_s,
                item_bytes=done.gathered.meta[:, 0],
                ranks_per_node=self._ranks_per_node,
            )
        info = done.info(epoch=ep.epoch, step=step, prep_s=time.perf_counter() - t0)
        stats = self._step_stats(info, stats)
        if local:
            return _Step(PlannedBatch(batch, done.plan, info, stats, assembly), info, stats)
        return _Step(batch, info, stats)

    def _assembly(self, plan: Any) -> Any:
        """This rank's share of ``plan``, when the planner says how to compute it."""
        share = getattr(self.planner, "assembly", None)
        return None if share is None else share(plan, self._group.rank)

    def _local_stats(self, done: ex.BalancedStep, batch: Any) -> dict[str, float]:
        """Local mode: the planner's own metrics if it has them (the orchestrator's, per
        phase), else the single phase's; the loader moves nothing, so no bytes here."""
        step_stats = getattr(self.planner, "step_stats", None)
        if step_stats is not None:
            return step_stats(done.plan, batch)
        if isinstance(done.plan, Rearrangement):
            lengths = done.meta[:, 0]
            return st.phase_stats(
                "batch", done.plan, lengths, cost=self._stats_cost, plan_ms=1e3 * done.plan_s
            )
        return {}

    @staticmethod
    def _step_stats(info: StepInfo, phases: dict[str, float]) -> dict[str, float]:
        return {
            "epoch": info.epoch,
            "step": info.step,
            "prepare_ms": 1e3 * info.prep_s,
            "bytes_meta": info.bytes_meta,
            **phases,
        }


class _EpochIterator(Iterator[Any]):
    """One pass over an epoch from a start step; owns the background thread."""

    def __init__(self, loader: BalancedDataLoader, ep: _Epoch) -> None:
        self.loader = loader

        def produce(step: int) -> _Step:
            return loader._produce(ep, step)

        def leave(step: int, consumed: int) -> None:
            loader._leave(ep, step, consumed)

        self.from_start, self.steps = ep.start == 0, 0
        self.prefetcher = Prefetcher(
            produce,
            start=ep.start,
            depth=loader.options.prefetch,
            name=f"orchmllm-loader-{loader.name}-e{ep.epoch}",
            close_timeout=loader.topology.timeout,
            on_close=leave,
        )

    def __next__(self) -> Any:
        lo = self.loader
        waited = self.prefetcher.wait_s
        try:
            step = next(self.prefetcher)
        except StopIteration:
            lo._step = 0
            self.close()
            if self.from_start and not self.steps:  # a stream that turned out empty
                raise ValueError(lo._no_step()) from None
            raise
        except ex.EpochMismatch as exc:
            if exc is lo._failure:  # raised here: close() need not raise it again
                lo._failure = None
            raise
        lo._step = step.info.step + 1
        self.steps += 1
        lo.last_step = step.info
        step.stats["wait_ms"] = 1e3 * (self.prefetcher.wait_s - waited)
        lo.last_stats = step.stats
        every = lo.options.log_every
        if every and lo._group.rank == 0 and step.info.step % every == 0:
            print(st.format_line(lo.name, step.stats), flush=True)
        return (step.batch, step.stats) if lo.options.with_stats else step.batch

    @property
    def wait_s(self) -> float:
        """Seconds the training loop spent waiting for batches (planning not hidden)."""
        return self.prefetcher.wait_s

    def close(self) -> None:
        self.prefetcher.close()
