"""What every exchange strategy shares: its set-up, the state of an epoch, and its interface.

The loader's shell samples this rank's steps and runs a strategy's ``produce`` in its
prefetch thread; the strategy decides how the ranks exchange the step (see
:mod:`orchmllm.data.strategies`). A strategy holds no state between epochs beyond its
:class:`Setup`; what a pass over an epoch keeps between steps lives in :class:`EpochState`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
from torch.utils.data._utils.pin_memory import pin_memory

from orchmllm.data import exchange as ex
from orchmllm.data import sources as sr
from orchmllm.data.exchange import StepInfo
from orchmllm.data.rank_steps import RankSteps


@dataclass
class Setup:
    """What a strategy needs of the loader, set when the loader is built (the planner may be
    replaced between epochs: ``BalancedDataLoader.planner``).

    Attributes:
        group: the gloo group the ranks gather on.
        planner: plans each step (wrapped to keep a token budget, when one is set).
        collate_fn: turns a list of examples into a batch.
        steps: this rank's sampled steps, their examples and metadata rows.
        pin: pin the yielded batches' tensors.
        stats_cost: the cost model the balance metrics count in.
        ranks_per_node: for the intra-/inter-node byte counts (None: unknown).
        batch_meta_fn: ``mode="local"``: the rows of a collated batch (None: per example).
    """

    group: ex.Group
    planner: ex.Planner
    collate_fn: Callable[[list], Any]
    steps: RankSteps
    pin: bool
    stats_cost: Any
    ranks_per_node: int | None
    batch_meta_fn: Callable[[Any], np.ndarray] | None

    def finish(self, batch: Any) -> Any:
        """The batch as yielded: pinned when asked."""
        return pin_memory(batch) if self.pin else batch

    def collate(self, examples: list) -> Any:
        return self.finish(self.collate_fn(examples))


@dataclass
class EpochState:
    """One pass over an epoch from ``start``: what the producer thread keeps between steps."""

    epoch: int
    start: int
    num_steps: int | None  # None: known only when every rank is exhausted
    next_gather: int  # the step of the next metadata exchange
    sampled: list[list[int]] = field(default_factory=list)  # index: local indices per step
    batches: Iterator[sr.Local] | None = None  # other strategies: local batches from start
    planned: deque = field(default_factory=deque)  # index: plans made ahead of loading
    loaded: Iterator[Any] | None = None  # index: the balanced batches, loaded
    planning_failed: bool = False  # the error came from a collective step, on every rank


class Step(NamedTuple):
    """A produced step: what the loop gets, the step's record and its metrics."""

    batch: Any
    info: StepInfo
    stats: dict[str, float]


def step_stats(info: StepInfo, phases: dict[str, float]) -> dict[str, float]:
    """A step's metrics: its place, preparation time and metadata bytes, then its phases'."""
    return {
        "epoch": info.epoch,
        "step": info.step,
        "prepare_ms": 1e3 * info.prep_s,
        "bytes_meta": info.bytes_meta,
        **phases,
    }


class ExchangeStrategy:
    """How the ranks exchange one step: the interface every exchange mode implements.

    ``begin`` readies a pass over an epoch (the shell has sampled it: ``sampled``, this
    rank's dataset indices per step, or None where sampling needs loading), ``produce``
    makes one step in the prefetch thread (``StopIteration`` at the end of the epoch), and
    ``pending_exchange`` says whether a step the thread stopped before still holds an
    exchange the peers take part in (see :meth:`BalancedDataLoader.close`).
    """

    mode: ClassVar[str]
    plans_before_loading: ClassVar[bool] = False  # plans on lengths known up front

    def __init__(self, setup: Setup) -> None:
        self.setup = setup

    def begin(self, ep: EpochState, sampled: list[list[int]] | None) -> None:
        """This rank's local batches of the epoch from ``ep.start``, loaded as drawn."""
        ep.batches = self.setup.steps.local_batches(ep.epoch, ep.start, sampled)

    def produce(self, ep: EpochState, step: int) -> Step:
        raise NotImplementedError

    def pending_exchange(self, ep: EpochState, step: int) -> bool:
        """Whether the thread, stopped before ``step``, still owes its peers an exchange."""
        return False

    def after_gather(self, ep: EpochState, work: Callable[[], Any]) -> Any:
        """Run this rank's work that follows a gather; if it fails, tell the peers at the
        next exchange (where they will be) so that they fail instead of wait."""
        try:
            return work()
        except Exception as exc:
            if not ep.planning_failed and (ep.num_steps is None or ep.next_gather < ep.num_steps):
                ex.gather_step(self.setup.group, None, error=exc, step=ep.next_gather)
            raise
