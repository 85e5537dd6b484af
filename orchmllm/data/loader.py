"""BalancedDataLoader: balanced mini-batches with planning hidden behind the training step.

A background thread prepares the next ``prefetch`` steps while the current one trains
(paper section 6, "Computation overhead overlapping"): it samples the local mini-batch,
all-gathers its metadata on its topology's CPU (gloo) group, computes the plan (the C++
balancing core releases the GIL) and builds the step as the loader's exchange strategy
says (one per mode, :mod:`orchmllm.data.strategies`; picked once, when the loader is built):

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

This module is the shell around them: its arguments, sampling (:mod:`orchmllm.data.rank_steps`),
the prefetch thread, the ranks' handshake, epochs and resume.

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
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from orchmllm.data import exchange as ex
from orchmllm.data import loader_args as la
from orchmllm.data import sources as sr
from orchmllm.data import stats as st
from orchmllm.data.exchange import StepInfo
from orchmllm.data.lengths import LengthFn, check_lengths, dataset_lengths
from orchmllm.data.loader_args import DATALOADER_KEYWORDS, EXCHANGE_MODES
from orchmllm.data.options import (
    LoaderOptions,
    PlanningOptions,
    SamplingOptions,
    given,
    with_keywords,
)
from orchmllm.data.planners import BalancePlanner, WithinBudget, warn_on_layout_mismatch
from orchmllm.data.prefetch import Prefetcher
from orchmllm.data.rank_steps import RankSteps, make_reader
from orchmllm.data.sampling import check_budget
from orchmllm.data.strategies import (
    EpochState,
    ExchangeStrategy,
    PlannedBatch,
    Setup,
    Step,
    strategy_for,
)
from orchmllm.dist.topology import Topology

__all__ = ["DATALOADER_KEYWORDS", "EXCHANGE_MODES", "BalancedDataLoader", "PlannedBatch"]

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
        self.planning = plan = given(planning, PlanningOptions, "planning")
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
        la.check_lengths_args(lengths_from, mode, plan)
        budgets_lengths = bool(lengths_from) and not plan.custom_rows
        la.check_batch_args(batch_size, max_tokens_per_rank, budgets_lengths=budgets_lengths)
        la.check_source(
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
        self.mode = la.resolve_mode(
            source, mode, lengths=lengths, length_column=length_column, planning=plan
        )
        is_loader = isinstance(source, DataLoader)
        self.collate_fn = collate_fn or (source.collate_fn if is_loader else default_collate)
        planner = plan.planner or BalancePlanner(policy=plan.policy, cost=plan.cost)
        warn_on_layout_mismatch(self.collate_fn, planner)
        self.topology = topology if topology is not None else Topology.build()
        self._group = ex.Group(self.topology)
        self._strategy = self._build(planner, lengths)
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

    def _build(
        self, planner: ex.Planner, lengths: Sequence[int] | np.ndarray | None
    ) -> ExchangeStrategy:
        """The strategy of ``self.mode``, with all it needs: the one place a mode is picked."""
        source, budget = self.source, self.max_tokens_per_rank
        self.num_replicas = la.num_replicas(source, self.sampling, self._group)
        strategy = strategy_for(self.mode)
        known = self._known_lengths(lengths, needed=strategy.plans_before_loading)
        if budget is not None and known is not None:
            check_budget(known, budget)  # an example no step can hold: fail now
        pin = la.pinning(source, self.options)
        reader = make_reader(
            source,
            sr.Workers.of(self.options),
            batch_size=self.batch_size,
            collate_fn=self.collate_fn if strategy.plans_before_loading else None,
        )
        self._steps = RankSteps(
            source,
            reader,
            rank=self._group.rank,
            num_replicas=self.num_replicas,
            sampling=self.sampling,
            batch_size=self.batch_size,
            max_tokens_per_rank=budget,
            lengths=known,
            length_column=self.length_column,
            length_fn=self.length_fn,
            meta_fn=self.planning.meta_fn,
        )
        self._steps_known = self._steps.agreed_stream_steps(self._group)
        setup = Setup(
            group=self._group,
            planner=planner if budget is None else WithinBudget(planner, budget),
            collate_fn=self.collate_fn,
            steps=self._steps,
            pin=pin,
            stats_cost=st.planner_cost(planner),
            ranks_per_node=getattr(planner, "ranks_per_node", None),
            batch_meta_fn=self.planning.batch_meta_fn,
        )
        return strategy(setup)

    @property
    def planner(self) -> ex.Planner:
        """What plans each step (the default ``BalancePlanner``, or the planning options'
        own; wrapped to keep ``max_tokens_per_rank``). Replace it between epochs only."""
        return self._strategy.setup.planner

    @planner.setter
    def planner(self, planner: ex.Planner) -> None:
        self._strategy.setup.planner = planner

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

    def _known_lengths(
        self, lengths: Sequence[int] | np.ndarray | None, *, needed: bool
    ) -> np.ndarray | None:
        """Every example's length by dataset index, when known before loading: always when
        the strategy plans on these alone (``needed``), else only if given."""
        source = self.source
        if lengths is not None:
            known = check_lengths(lengths, source="lengths")
            if known.size != len(source):
                raise ValueError(f"lengths has {known.size} entries, the dataset {len(source)}")
            return known
        if not needed:
            return None
        return dataset_lengths(
            source,
            length_column=self.length_column,
            length_fn=self.length_fn,
            columns=self.options.length_columns,
            num_proc=self.options.num_proc,
        )

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
        steps = self._steps.count(self.epoch)
        if steps is not None:
            return steps
        if self._steps_known is not None:
            return self._steps_known
        raise TypeError(
            f"{self.name}: the number of steps is known only at the end of the epoch for "
            f"{type(self.source).__name__} data (give it a __len__: the examples in this "
            "rank's shard), or with a token budget over lengths known only when loaded"
        )

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

    def _begin(self, epoch: int, start: int) -> EpochState:
        """The state of a pass over ``epoch`` from step ``start`` (nothing loaded yet)."""
        sampled = self._steps.sampled(epoch)
        ep = EpochState(epoch, start, None if sampled is None else len(sampled), start)
        self._strategy.begin(ep, sampled)
        return ep

    # -- one step (runs in the background thread) ---------------------------------------

    def _produce(self, ep: EpochState, step: int) -> Step:
        if ep.num_steps is not None and step >= ep.num_steps:
            raise StopIteration
        try:
            return self._strategy.produce(ep, step)
        except ex.EpochMismatch as exc:  # a peer's loop left the epoch before this one
            raise self._record(exc, ep.epoch) from None

    def _leave(self, ep: EpochState, step: int, consumed: int) -> None:
        """The loop left the epoch after ``consumed`` batches and the thread stopped before
        producing ``step``: tell the peers at the next exchange (see
        :func:`~orchmllm.data.exchange.leave_epoch`)."""
        planned = ep.num_steps is not None and ep.next_gather >= ep.num_steps
        if planned and not self._strategy.pending_exchange(ep, step):
            return  # every rank's producer ends at num_steps by itself: nothing pending
        try:
            ex.leave_epoch(self._group, consumed=consumed, step=ep.next_gather)
        except ex.EpochMismatch as exc:
            raise self._record(exc, ep.epoch) from None

    def _record(self, exc: ex.EpochMismatch, epoch: int) -> ex.EpochMismatch:
        """The error named after this loader, kept until the loop or close() raises it."""
        self._failure = ex.EpochMismatch(f"{self.name}, epoch {epoch}: {exc}")
        return self._failure


class _EpochIterator(Iterator[Any]):
    """One pass over an epoch from a start step; owns the background thread."""

    def __init__(self, loader: BalancedDataLoader, ep: EpochState) -> None:
        self.loader = loader

        def produce(step: int) -> Step:
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
