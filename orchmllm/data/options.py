"""The options of the balanced loader and collator, in small groups checked when built.

The common arguments (``batch_size=``, ``length_column=``, ``collate_fn=``, ...) are keywords of
:class:`~orchmllm.data.loader.BalancedDataLoader` itself; the rest come in three groups, each
one frozen dataclass that can be shared between loaders or kept in a config
(``dataclasses.replace(sampling, seed=1)`` gives a checked copy): how examples are sampled
(:class:`SamplingOptions`), how the plan is made (:class:`PlanningOptions`, also taken by
:class:`~orchmllm.data.collate.BalancedCollator`) and how the loader runs and reports
(:class:`LoaderOptions`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:  # the options themselves are torch-free
    import torch

    from orchmllm.data.exchange import Planner

__all__ = ["LoaderOptions", "PlanningOptions", "SamplingOptions", "given", "with_keywords"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """Which examples each rank samples, in which order: as ``DistributedSampler``.

    Attributes:
        shuffle: Reshuffle the sampling order every epoch.
        seed: The shuffling seed; the same on every rank.
        drop_last: Drop the tail that does not divide evenly over the ranks (with a token
            budget: the last, partial step).
        num_replicas: Ranks the data is split over (default: the wrapped ``DataLoader``'s
            ``DistributedSampler``'s, else the process group's size).
    """

    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    num_replicas: int | None = None

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1 or None, got {self.num_replicas!r}")


@dataclass(frozen=True, kw_only=True)
class PlanningOptions:
    """How the ranks agree on each step's plan: a balancing policy, or a planner of your own
    and the metadata rows it gets.

    Attributes:
        policy: The balancing policy (a name in ``orchmllm.POLICIES``): ``greedy`` for
            packed batches, ``padded_cost`` or ``binary_search`` for padded ones. A
            ``collate_fn`` whose layout is known (Hugging Face's collators, or one with an
            ``orchmllm_layout`` attribute: :func:`~orchmllm.data.planners.collate_layout`)
            paired with a policy for the other layout warns once
            (:class:`~orchmllm.data.planners.LayoutMismatchWarning`).
        cost: An ``orchmllm.CostModel`` for the policy (None: the policy's default).
        planner: ``planner(meta, src, num_ranks) -> plan`` replacing the default
            ``BalancePlanner(policy, cost)`` (see :data:`orchmllm.data.exchange.Planner`).
        meta_fn: ``meta_fn(example) -> ints``, the row gathered per example instead of
            ``[length]`` (for a custom ``planner``; not in index mode).
        batch_meta_fn: ``batch_meta_fn(collated_batch) -> rows`` (``mode="local"`` only): any
            number of rows per batch, e.g. the orchestrator's segment table.
    """

    policy: str = "greedy"
    cost: Any = None
    planner: Planner | None = None
    meta_fn: Callable[[Any], Sequence[int]] | None = None
    batch_meta_fn: Callable[[Any], np.ndarray] | None = None

    def __post_init__(self) -> None:
        if self.meta_fn is not None and self.batch_meta_fn is not None:
            raise ValueError("pass meta_fn= or batch_meta_fn=, not both")

    @property
    def custom_rows(self) -> bool:
        """Whether the planner gets rows of its own instead of lengths."""
        return self.meta_fn is not None or self.batch_meta_fn is not None


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """How the loader runs and what it reports: prefetching, worker processes, pinning, the
    one-off length computation, its name, metrics and log lines.

    The worker settings are ``DataLoader``'s, with its names and meaning (the loader's own
    keywords set them too); for a ``DataLoader`` source set them on that DataLoader.

    Attributes:
        prefetch: Steps prepared ahead in a background thread (0: synchronous).
        num_workers: DataLoader worker processes that load (and in index mode collate)
            examples, as ``DataLoader(num_workers=)``. An ``IterableDataset`` must split
            itself between workers.
        pin_memory: Pin the yielded batches' tensors (for fast copies to the accelerator).
        persistent_workers: Keep the workers between epochs (needs ``num_workers > 0``).
        prefetch_factor: Batches each worker loads ahead (needs ``num_workers > 0``; None:
            DataLoader's default).
        timeout: Seconds to wait for a batch from the workers (0: no limit).
        worker_init_fn: Called in each worker with its id, after seeding, before loading.
        generator: The ``torch.Generator`` the workers' base seed is drawn from (so their
            random numbers repeat with it); the sampling order comes from ``seed``.
        multiprocessing_context: How workers start (``"fork"``, ``"spawn"``...; None: the
            platform's default).
        num_proc: Processes for the one-off ``Dataset.map`` that computes lengths.
        length_columns: The only columns ``length_fn`` reads on an HF dataset, so that
            computing lengths never decodes images or audio.
        name: What errors and log lines call this loader (default ``BalancedDataLoader#k``,
            the k-th loader this process created: the same loader on every rank).
        with_stats: Yield ``(batch, stats)`` pairs instead of batches.
        log_every: Print one line of balance metrics on rank 0 every this many steps (0:
            never).
    """

    prefetch: int = 2
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    timeout: float = 0
    worker_init_fn: Callable[[int], None] | None = None
    generator: torch.Generator | None = None
    multiprocessing_context: Any = None
    num_proc: int | None = None
    length_columns: Sequence[str] | None = None
    name: str | None = None
    with_stats: bool = False
    log_every: int = 0

    def __post_init__(self) -> None:
        for name in ("prefetch", "num_workers", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {self.timeout}")
        for name in ("persistent_workers", "prefetch_factor"):
            value = getattr(self, name)
            if value not in (None, False) and not self.num_workers:
                raise ValueError(f"{name}={value!r} needs num_workers > 0, got num_workers=0")
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be >= 1 or None, got {self.prefetch_factor}")


def given(value: T | None, cls: type[T], name: str) -> T:
    """``value``, or ``cls()`` for None; another type is an error naming the argument."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    return value


def with_keywords(group: T, name: str, **keywords: Any) -> T:
    """``group`` with the settings given as keywords (those not None), for the loader's
    ``DataLoader`` keywords (``shuffle=``, ``num_workers=``...) that set fields of its option
    groups.

    A field the group sets to another value than both its default and the keyword's is an
    error naming both spellings; the result is checked as the group is when built.

    Args:
        group: A :class:`SamplingOptions` or :class:`LoaderOptions`.
        name: The argument the group came as (``"sampling"``, ``"options"``), for errors.
        **keywords: Field names of ``group`` and their values (None: not given).

    Raises:
        ValueError: A keyword and the group disagree, or the result fails the group's checks.
    """
    given_now = {k: v for k, v in keywords.items() if v is not None}
    defaults = {f.name: f.default for f in fields(group) if f.default is not MISSING}
    for key, value in given_now.items():
        current = getattr(group, key)
        if current != defaults[key] and current != value:
            raise ValueError(
                f"{key}={value!r} and {name}={type(group).__name__}({key}={current!r}) "
                f"disagree: give {key} one way"
            )
    return replace(group, **given_now) if given_now else group
