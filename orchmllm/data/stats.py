"""Per-step balance metrics as a flat dict of plain numbers, ready for any logger.

Keys are ``"<phase>/<metric>"`` (a single-phase loader's phase is ``"batch"``; the
multimodal orchestrator's are its encoder phases and ``"llm"``), beside ``"epoch"``,
``"step"``, ``"prepare_ms"`` and ``"bytes_meta"``. Per phase:

- ``imbalance_before`` / ``imbalance_after``: max over ranks of the phase's cost (its cost
  model) divided by the mean, as sampled and after the plan (1.0 is perfect balance). Each
  divides by its own layout's mean: under a padded cost (a rank pays its longest item times
  its item count) a plan that groups similar lengths removes padding, so the mean falls and
  ``imbalance_after`` can exceed ``imbalance_before`` although the slowest rank got lighter;
  the step waits for the slowest rank, so compare the next two;
- ``load_max_before`` / ``load_max_after``: the slowest rank's cost, in the cost model's
  units (tokens for packed, padded tokens for padded), as sampled and after the plan: what
  the step's time follows, and never higher after a plan of a never-worse policy;
- ``tokens_moved``: length units (tokens, patches, frames) of the items the plan moves;
- ``bytes_intra`` / ``bytes_inter``: bytes the plan moves between ranks of one node and
  across nodes (``ranks_per_node`` ranks per node; unknown: one node);
- ``plan_ms``: milliseconds to plan the phase (for a single phase: gather plus plan).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from orchmllm.planner.cost import CostModel, imbalance
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.policies import POLICIES, default_cost

METRICS = (
    "imbalance_before",
    "imbalance_after",
    "load_max_before",
    "load_max_after",
    "tokens_moved",
    "bytes_intra",
    "bytes_inter",
    "plan_ms",
)


def planner_cost(planner: Any) -> CostModel:
    """The cost model balance is measured with: the planner's ``cost``, else its policy's
    default (padded for padded policies, else packed tokens)."""
    cost = getattr(planner, "cost", None)
    if isinstance(cost, CostModel):
        return cost
    policy = getattr(planner, "policy", None)
    return default_cost(policy) if policy in POLICIES else CostModel("packed")


def phase_stats(
    phase: str,
    plan: Rearrangement,
    lengths: np.ndarray,
    *,
    cost: CostModel,
    plan_ms: float,
    item_bytes: np.ndarray | None = None,
    ranks_per_node: int | None = None,
) -> dict[str, float]:
    """The metrics of one phase whose items (in plan order) have these ``lengths``;
    ``item_bytes``: bytes each item takes on the wire when moved (None: nothing moves
    through this step, e.g. index mode, where each rank loads its own examples)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    before = cost.loads(lengths, plan.src_rank, plan.num_ranks)
    after = cost.loads(lengths, plan.dst_rank, plan.num_ranks)
    moved = plan.src_rank != plan.dst_rank
    traffic = {"intra": 0, "inter": 0}
    if item_bytes is not None:
        traffic = plan.traffic(sizes=item_bytes, ranks_per_node=ranks_per_node)
    values = (
        imbalance(before),
        imbalance(after),
        slowest(before),
        slowest(after),
        int(lengths[moved].sum()),
        int(traffic["intra"]),
        int(traffic["inter"]),
        float(plan_ms),
    )
    return named(phase, values)


def slowest(loads: Sequence[float] | np.ndarray) -> float:
    """The slowest rank's load (0.0 for no ranks)."""
    return float(max(loads, default=0.0))


def named(phase: str, values: Sequence[float]) -> dict[str, float]:
    """``{"<phase>/<metric>": value}`` for the :data:`METRICS`, in order."""
    return {f"{phase}/{name}": v for name, v in zip(METRICS, values, strict=True)}


def phases(stats: Mapping[str, float]) -> list[str]:
    """The phases present in a stats dict, in order of appearance."""
    return list(dict.fromkeys(k.split("/", 1)[0] for k in stats if "/" in k))


def format_line(name: str, stats: Mapping[str, float]) -> str:
    """One log line: ``name epoch E step S | batch imbalance 1.31 -> 1.01 (slowest 5120 ->
    3968), moved ...``: the max/mean ratio, then the slowest rank's cost (what a step waits
    for; the ratio's mean shrinks with padding)."""
    parts = []
    for p in phases(stats):
        parts.append(
            f"{p} imbalance {stats[f'{p}/imbalance_before']:.3f} -> "
            f"{stats[f'{p}/imbalance_after']:.3f} (slowest {stats[f'{p}/load_max_before']:.0f}"
            f" -> {stats[f'{p}/load_max_after']:.0f}), moved {stats[f'{p}/tokens_moved']} tok "
            f"({_size(stats[f'{p}/bytes_intra'])} intra, {_size(stats[f'{p}/bytes_inter'])} "
            f"inter), plan {stats[f'{p}/plan_ms']:.1f} ms"
        )
    head = f"{name} epoch {stats['epoch']} step {stats['step']}"
    return " | ".join([head, *parts])


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
