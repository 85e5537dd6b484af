"""Cost models: how long one rank takes to run a batch of variable-length items.

Balancing minimises the slowest rank, so every policy needs the cost of a batch as a function of
its item lengths. The paper's eq. 2 gives the shape for a Transformer block:

- packed (flash varlen attention, no padding): ``alpha*sum(l) + beta*sum(l^2)``: the linear
  part is the MLP and projections, the quadratic part attention, which is per item;
- padded (dense attention over a ``[b, max(l)]`` tensor): ``alpha*b*max(l) + beta*b*max(l)^2``.

Both get a constant per non-empty batch (kernel launches, collectives) and a ``multiplier``:
a frozen module with nothing trainable upstream runs forward only, about a third of
forward+backward, which matters when its phase is balanced against a trained one.
``fit_packed``/``fit_padded`` calibrate alpha, beta and const by least squares from measured
``(batch shape, time)`` records; :func:`load_calibration` reads the measured H100 records that
ship with the package (``orchmllm/sim/data``, the one in-repo copy; the simulator reads it too).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, NamedTuple

import numpy as np

KINDS = ("packed", "padded")

# Backward costs about twice the forward pass (two matmuls per forward matmul), so forward
# alone is about a third of forward+backward.
FORWARD_FRACTION = 1.0 / 3.0
# Measured H100 block timings shipped in orchmllm/sim/data (see shared/DESIGN.md for fields).
CALIBRATIONS = ("h100_block_fwd_bwd.json", "h100_table1_blocks.json")


@dataclass(frozen=True)
class CostModel:
    """Cost of one batch: ``multiplier * (alpha*A + beta*B + const)`` (const only if non-empty).

    packed: ``A = sum(l)``, ``B = sum(l^2)``; padded: ``A = b*max(l)``, ``B = b*max(l)^2``
    with ``b`` the item count. Units are those of the calibration (ms for the shipped
    records); the default ``CostModel("packed")`` is plain token counts.

    Attributes:
        kind: ``"packed"`` (flash varlen attention, cost additive over items) or ``"padded"``
            (dense attention over a ``[b, max(l)]`` tensor).
        alpha: coefficient of the linear term ``A`` (MLP and projections).
        beta: coefficient of the quadratic term ``B`` (attention); 0 for a linear cost.
        const: added once per non-empty batch (kernel launches, collectives).
        multiplier: scales the whole cost, > 0, e.g. ``FORWARD_FRACTION`` for a frozen module
            (:meth:`forward_only`) or a repeat count (:meth:`scaled`).

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``, a coefficient is not finite, or
            ``multiplier <= 0``.
    """

    kind: Literal["packed", "padded"]
    alpha: float = 1.0
    beta: float = 0.0
    const: float = 0.0
    multiplier: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("alpha", "beta", "const", "multiplier"):
            value = getattr(self, name)
            if not np.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.multiplier <= 0:
            raise ValueError(f"multiplier must be > 0, got {self.multiplier!r}")

    @property
    def packed(self) -> bool:
        """Whether the kind is ``packed``, i.e. the cost is additive over items."""
        return self.kind == "packed"

    def batch_cost(self, lengths: Sequence[int] | np.ndarray) -> float:
        """Cost of one batch holding items of these lengths.

        Args:
            lengths: length of every item in the batch, 1-D.

        Returns:
            The batch's cost as a float; 0.0 for an empty batch (no ``const``).
        """
        l = np.asarray(lengths, dtype=np.float64)
        if l.size == 0:
            return 0.0
        if self.packed:
            raw = self.alpha * l.sum() + self.beta * (l * l).sum()
        else:
            top = l.max()
            raw = self.alpha * l.size * top + self.beta * l.size * top * top
        return float(self.multiplier * (raw + self.const))

    def item_costs(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Additive per-item cost ``multiplier*(alpha*l + beta*l^2)`` (packed only).

        A packed batch costs the sum of its items' costs plus ``multiplier*const``, which is
        what makes longest-processing-time scheduling on these weights exact for this
        objective.

        Args:
            lengths: length of every item.

        Returns:
            float64 array of the same shape as ``lengths``: each item's cost, without
            ``const``.

        Raises:
            ValueError: the model's kind is ``padded``, whose cost is not additive.
        """
        if not self.packed:
            raise ValueError("kind='padded' has no additive per-item cost; use batch_cost")
        l = np.asarray(lengths, dtype=np.float64)
        return self.multiplier * (self.alpha * l + self.beta * l * l)

    def piece_costs(self, lengths: Any, tokens: Any, pieces: Any) -> np.ndarray:
        """Cost of one piece of an item split for context parallelism (packed only):
        ``multiplier*(alpha*tokens + beta*length^2/pieces)``, without ``const``.

        An item of ``length`` tokens cut in ``pieces`` pieces on as many ranks computes its
        MLP and projections on the piece's own ``tokens`` and its attention over the whole
        sequence (the keys and values gathered in the group). Causal attention makes a query
        late in the sequence cost more than an early one, so contiguous pieces would cost
        unequally; load-balanced chunking (the item in ``2*pieces`` chunks, piece ``j``
        holding chunk ``j`` and chunk ``2*pieces-1-j``, as ``balance(context_parallel=)``
        lays pieces out) gives every piece the same share ``1/pieces`` of the quadratic term,
        up to the rounding of chunk boundaries to whole tokens, which this ignores. It also
        ignores the gather of the keys and values (each rank receives the other pieces' K/V,
        about ``(pieces-1)/pieces`` of the item's K/V bytes, forward and, reduce-scattered,
        backward) and the ring's latency: splitting is free in this model, so the planner
        splits only to meet a budget or to lower the slowest rank. The pieces of an item sum
        to :meth:`item_costs` (up to float rounding).

        Args:
            lengths: the item's length, per piece (arrays broadcast).
            tokens: the piece's own tokens.
            pieces: how many pieces the item is cut in (>= 1).

        Returns:
            float64 array of the broadcast shape.

        Raises:
            ValueError: the model's kind is ``padded``.
        """
        if not self.packed:
            raise ValueError("kind='padded' has no per-piece cost: context parallelism is packed")
        l = np.asarray(lengths, dtype=np.float64)
        t = np.asarray(tokens, dtype=np.float64)
        k = np.asarray(pieces, dtype=np.float64)
        return self.multiplier * (self.alpha * t + self.beta * l * l / k)

    def loads(self, lengths: np.ndarray, dst: np.ndarray, num_ranks: int) -> np.ndarray:
        """Cost of every destination batch, vectorised: :meth:`batch_cost` of each rank's items.

        Terms whose coefficient leaves the sum unchanged (``beta = 0``, ``const = 0``, factors
        of 1) are skipped: one ``bincount`` for plain token sums, same result bit for bit.

        Args:
            lengths: length of every item, 1-D.
            dst: rank of every item, integers in ``[0, num_ranks)``, same size as ``lengths``
                (not checked).
            num_ranks: number of ranks (batches).

        Returns:
            float64 ``(num_ranks,)``: the cost of each rank's batch, 0.0 for a rank with no
            items.
        """
        l = np.asarray(lengths, dtype=np.float64)
        dst = np.asarray(dst, dtype=np.int64)
        count = None
        if self.packed:
            # (float64 even with no items, where bincount gives int64)
            raw = np.bincount(dst, weights=l, minlength=num_ranks).astype(np.float64, copy=False)
            if self.alpha != 1.0:
                raw *= self.alpha
            if self.beta != 0.0:
                raw += self.beta * np.bincount(dst, weights=l * l, minlength=num_ranks)
        else:
            count = np.bincount(dst, minlength=num_ranks).astype(np.float64)
            top = np.zeros(num_ranks, dtype=np.float64)
            np.maximum.at(top, dst, l)
            raw = self.alpha * count * top + self.beta * count * top * top
        if self.const != 0.0:
            if count is None:
                count = np.bincount(dst, minlength=num_ranks)
            raw += self.const * (count > 0)
        if self.multiplier != 1.0:
            raw *= self.multiplier
        return raw

    def scaled(self, factor: float) -> CostModel:
        """The same model with the multiplier scaled (e.g. a cheaper or repeated module).

        Args:
            factor: what the multiplier is multiplied by, > 0.

        Returns:
            A new :class:`CostModel`; this one is unchanged.

        Raises:
            ValueError: the scaled multiplier is not finite or not > 0.
        """
        return dataclasses.replace(self, multiplier=self.multiplier * factor)

    def forward_only(self, fraction: float = FORWARD_FRACTION) -> CostModel:
        """Cost of a frozen module whose backward pass is skipped entirely.

        Only valid when nothing upstream is trainable; otherwise the input gradient still needs
        a backward pass.

        Args:
            fraction: forward time over forward+backward time, in ``(0, 1]`` (default
                ``FORWARD_FRACTION``, 1/3).

        Returns:
            A new :class:`CostModel` with the multiplier scaled by ``fraction``.

        Raises:
            ValueError: ``fraction`` is outside ``(0, 1]``.
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        return self.scaled(fraction)

    def crossover_length(self) -> float:
        """Item length where the quadratic term equals the linear one (``alpha/beta``).

        Above it the quadratic (attention) term dominates an item's cost.

        Returns:
            ``alpha/beta`` as a float; ``inf`` when ``beta <= 0`` (no quadratic term).
        """
        return float("inf") if self.beta <= 0 else self.alpha / self.beta


class Fit(NamedTuple):
    """A calibrated model and its residuals on the records it was fitted to."""

    model: CostModel
    stats: dict[str, float]


def _get(record: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if name in record:
            return record[name]
    raise ValueError(f"records: a record lacks any of {names}: {dict(record)!r}")


def _packed_features(record: Mapping[str, Any]) -> tuple[float, float]:
    if "lengths" in record:
        l = np.asarray(record["lengths"], dtype=np.float64)
        return float(l.sum()), float((l * l).sum())
    return float(_get(record, "tokens")), float(_get(record, "sum_l2"))


def _padded_features(record: Mapping[str, Any]) -> tuple[float, float]:
    if "lengths" in record:
        l = np.asarray(record["lengths"], dtype=np.float64)
        b, top = float(l.size), float(l.max())
    else:
        b, top = float(_get(record, "n")), float(_get(record, "max_len", "maxlen"))
    return b * top, b * top * top


def _fit(
    records: Iterable[Mapping[str, Any]], kind: str, features, time_key: str, fit_const: bool
) -> Fit:
    rows, times = [], []
    for record in records:
        rows.append(features(record))
        times.append(float(_get(record, time_key)))
    n_params = 3 if fit_const else 2
    if len(rows) < n_params:
        raise ValueError(f"records: need at least {n_params} records, got {len(rows)}")
    y = np.asarray(times)
    a = np.asarray(rows)
    if fit_const:
        a = np.column_stack([a, np.ones(len(rows))])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    pred = a @ coef
    rel = pred / y - 1.0
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    stats = {
        "n_records": float(len(rows)),
        "rmse": float(np.sqrt(ss_res / len(rows))),
        "rms_rel_err": float(np.sqrt(np.mean(rel**2))),
        "max_rel_err": float(np.abs(rel).max()),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
    }
    const = float(coef[2]) if fit_const else 0.0
    return Fit(CostModel(kind, alpha=float(coef[0]), beta=float(coef[1]), const=const), stats)


def fit_packed(
    records: Iterable[Mapping[str, Any]], *, time_key: str = "ms", fit_const: bool = True
) -> Fit:
    """Ordinary least squares ``t ~ alpha*sum(l) + beta*sum(l^2) + const``.

    Each record holds either ``lengths`` or the summaries ``tokens`` and ``sum_l2``, plus the
    measured time under ``time_key``. Returns the model and its residual statistics
    (``rmse``, ``rms_rel_err``, ``max_rel_err``, ``r2``, ``n_records``).
    """
    return _fit(records, "packed", _packed_features, time_key, fit_const)


def fit_padded(
    records: Iterable[Mapping[str, Any]], *, time_key: str = "ms", fit_const: bool = True
) -> Fit:
    """Ordinary least squares ``t ~ alpha*b*max(l) + beta*b*max(l)^2 + const``.

    Each record holds either ``lengths`` or ``n`` and ``max_len`` (or ``maxlen``), plus the
    measured time under ``time_key``. Returns the model and its residual statistics.
    """
    return _fit(records, "padded", _padded_features, time_key, fit_const)


def load_calibration(name: str) -> list[dict[str, Any]]:
    """The measured records of calibration file ``name`` (one of ``CALIBRATIONS``).

    Read from the package (``orchmllm/sim/data``), so tests and benchmarks work from a plain
    checkout or an installed wheel without the shared data folder.
    """
    if name not in CALIBRATIONS:
        raise ValueError(f"name must be one of {CALIBRATIONS}, got {name!r}")
    text = resources.files("orchmllm").joinpath("sim", "data", name).read_text()
    return json.loads(text)


def imbalance(loads: np.ndarray) -> float:
    """The slowest rank's load over the mean (max / mean; 1.0 when there is no load at all):
    the figure every balance statistic reports."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = float(loads.mean()) if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0
