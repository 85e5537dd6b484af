"""What every figure of the reproduction shares: the sweep over seeds on pooled steps, the
spread of a figure over seeds, and the printed tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from orchmllm.sim.batch import Batch
from orchmllm.sim.sweep import SimModel, default_steps, run_case, sample_pool

# The simulator's modes (orchmllm.sim.layout.MODES) in the order the tables show them.
MODES = ("none", "llm", "disttrain", "full")


def ratio_or_none(sim: float | None, paper: float | None) -> float | None:
    """``sim / paper``, None where either figure is missing."""
    return sim / paper if paper and sim is not None else None


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean and min-max of one figure over seeds."""
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()), "n": v.size}


def fmt_spread(s: dict[str, float] | None) -> str:
    if s is None:
        return "OOM"
    return f"{s['mean']:.3g} ({s['min']:.3g}-{s['max']:.3g})"


def _steps_for(ranks: int, override: int | None) -> int:
    """Several steps where a step holds few examples (``orchmllm.sim.sweep.default_steps``)."""
    return override or default_steps(ranks)


class Sweep:
    """Runs cases over seeds; within a seed every mode sees the same sampled batches."""

    def __init__(
        self, models: dict[str, SimModel], steps: int | None, seeds: Sequence[int]
    ) -> None:
        self.models, self.steps_override, self.seeds = models, steps, tuple(seeds)
        self.records: list[dict[str, Any]] = []
        self._pools: dict[tuple[str, int, int, int], dict[int, Batch]] = {}

    def fresh_pools(self, model: str, ranks: int, per_rank: int, seed: int) -> dict[int, Batch]:
        """Step ``k`` of seed ``seed`` draws with ``default_rng([seed, k])``."""
        steps = _steps_for(ranks, self.steps_override)
        return {
            k: sample_pool(self.models[model], ranks, per_rank, (seed, k)) for k in range(steps)
        }

    def pools(self, model: str, ranks: int, per_rank: int, seed: int) -> dict[int, Batch]:
        key = (model, ranks, per_rank, seed)
        if key not in self._pools:
            self._pools[key] = self.fresh_pools(model, ranks, per_rank, seed)
        return self._pools[key]

    def case(
        self,
        figure: str,
        model: str,
        ranks: int,
        mode: str,
        b: int,
        pool_b: int,
        seed: int,
        **kwargs: Any,
    ) -> dict[str, Any]:
        pools = self.pools(model, ranks, pool_b, seed)
        rec = run_case(
            self.models[model], ranks, mode, examples_per_rank=b, steps=len(pools), pools=pools,
            **kwargs,
        )  # fmt: skip
        rec.update(figure=figure, seed=seed)
        self.records.append(rec)
        return rec


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n== {title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
