"""Argument checks shared by the planner's public functions (``balance``, the policy
registry, the dispatcher): every bad value raises a ``ValueError`` that names the argument and
the value, before any work is done."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from orchmllm.planner.cost import CostModel
from orchmllm.schema import is_integer

__all__ = [
    "check_caps",
    "check_count",
    "check_finite_cost",
    "check_lengths",
    "check_ranks",
    "int_array",
]


def check_caps(max_items_per_rank: Any, max_load_per_rank: Any) -> None:
    """Refuse a per-rank cap that is no valid value, whatever the batch (whether a plan can meet
    it is :func:`orchmllm.balance`'s question), so that a dispatcher can refuse it when it is
    built.

    Args:
        max_items_per_rank: None, or an integer >= 1.
        max_load_per_rank: None, or a number > 0 (``inf`` caps nothing).

    Raises:
        ValueError: naming the cap and the value.
    """
    if max_items_per_rank is not None:
        check_count("max_items_per_rank", max_items_per_rank)
    load = max_load_per_rank
    if load is not None and not (
        isinstance(load, numbers.Real) and not isinstance(load, bool | np.bool_) and load > 0
    ):
        raise ValueError(f"max_load_per_rank must be a number > 0, got {load!r}")


def check_count(name: str, value: Any) -> int:
    """``value`` as an int >= 1, else a ValueError naming ``name``."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def int_array(name: str, value: Any) -> np.ndarray:
    """``value`` as a 1-D int64 array: integer-valued floats and Python ints are accepted,
    anything that is not an integer or does not fit int64 is refused, naming ``name``, the
    first bad value and its position."""
    try:
        a = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a 1-D integer array, got {value!r}") from e
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind == "i":
        return a.astype(np.int64, copy=False)
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            raise ValueError(f"{name} must be integers, got {a[bad][0]!r} at {np.argmax(bad)}")
    elif a.dtype == object:  # Python ints beyond int64 (or mixed with other objects)
        bad = np.array([not is_integer(x) for x in a])
        if bad.any():
            raise ValueError(f"{name} must be integers, got {a[bad][0]!r} at {np.argmax(bad)}")
    elif a.dtype.kind != "u":
        raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
    # Checked before the cast, which would wrap 2**63 and above to negative values.
    wide = np.asarray((a >= 2**63) | (a < -(2**63)), dtype=bool)
    if wide.any():
        at = int(np.argmax(wide))
        # numpy may have rounded a list's big int to float: show the caller's own value
        shown = value[at] if isinstance(value, list | tuple) else a[at]
        raise ValueError(f"{name} must be int64 values (below 2**63), got {shown} at {at}")
    return a.astype(np.int64)


def check_lengths(lengths: Any) -> np.ndarray:
    """``lengths`` as a 1-D int64 array of values >= 0."""
    l = int_array("lengths", lengths)
    if l.size and l.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {l[l < 0][0]} at {np.argmax(l < 0)}")
    return l


def check_ranks(name: str, value: Any, n: int, d: int) -> np.ndarray:
    """``value`` as an int64 array of ``n`` ranks in ``[0, d)``: ``src``, or the ``dst`` a
    registered policy returns."""
    s = int_array(name, value)
    if s.size != n:
        raise ValueError(f"{name} must have one entry per item ({n}), got {s.size}")
    if s.size and (s.min() < 0 or s.max() >= d):
        bad = (s < 0) | (s >= d)
        raise ValueError(f"{name} must be in [0, {d}), got {s[bad][0]} at {np.argmax(bad)}")
    return s


def check_finite_cost(longest: int, n: int, d: int, cost: CostModel) -> None:
    """Refuse a cost that overflows float64 on ``n`` lengths up to ``longest`` (loads and sums
    would be inf): ``n`` items of the longest length bound every rank's load and their sum,
    for both kinds."""
    x = float(longest)
    bound = cost.multiplier * (cost.alpha * n * x + cost.beta * n * x * x + cost.const * d)
    if not math.isfinite(bound):
        raise ValueError(
            f"cost overflows float64 on lengths up to {longest} ({n} items, {d} ranks): {cost!r}"
        )
