"""Exact smallest makespan under a per-rank item cap, for small instances.

:func:`orchmllm.balance.balance` steers its caps with heuristics first; when they miss a load
cap, only an exact answer can tell "no plan exists" from "the heuristic missed one". This is
that answer: a mixed-integer program solved by HiGHS (scipy), limited to small instances and a
fixed number of branch-and-bound nodes, never a clock, so every rank reaches the same result.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Items x ranks at most: 0/1 variables of the program. At 400 (e.g. 50 items on 8 ranks) HiGHS
# proves the optimum in well under a second on the instances of tests/test_caps.py.
EXACT_MAX_CELLS = 400
# Branch-and-bound nodes before giving up without a proof (counted, so deterministic).
EXACT_NODE_LIMIT = 2_000


class ExactMakespan(NamedTuple):
    """``dst``: the best plan found (``None``: none within the node limit); ``proven``:
    ``dst`` is optimal."""

    dst: np.ndarray | None
    proven: bool


def min_makespan(weights: np.ndarray, num_ranks: int, *, max_items: int) -> ExactMakespan:
    """Fewest max load of additive ``weights`` on ``num_ranks`` ranks with at most
    ``max_items`` items each (``max_items * num_ranks >= len(weights)``), exactly when
    ``proven``. The ranks are interchangeable, so the ``k``-th heaviest item may only go to
    ranks ``0..k`` (any plan can be relabelled so; it removes the mirror images of a plan).
    """
    # scipy.optimize costs about 0.3 s to import: paid by the first call that needs an exact
    # answer, not by every `import orchmllm`.
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    w = np.asarray(weights, dtype=np.float64)
    n, d = w.size, int(num_ranks)
    if n == 0:
        return ExactMakespan(np.zeros(0, dtype=np.int64), True)
    order = np.lexsort((np.arange(n), -w))  # heaviest first, ties by index
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    cols = np.arange(n * d)
    item, rank = cols // d, cols % d
    allowed = rank <= position[item]
    t = n * d  # the makespan variable, after the n*d assignment variables
    one = coo_matrix((np.ones(n * d), (item, cols)), shape=(n, t + 1))
    # load_r - makespan <= 0 for every rank r
    entries = np.append(w[item], -np.ones(d))
    rows, at = np.append(rank, np.arange(d)), np.append(cols, [t] * d)
    load = coo_matrix((entries, (rows, at)), shape=(d, t + 1))
    count = coo_matrix((np.ones(n * d), (rank, cols)), shape=(d, t + 1))
    integral = bool(np.all(w == np.floor(w)))
    lower = max(float(w.sum()) / d, float(w.max()))
    res = milp(
        np.append(np.zeros(n * d), 1.0),
        constraints=[
            LinearConstraint(one, 1, 1),
            LinearConstraint(load, -np.inf, 0),
            LinearConstraint(count, 0, max_items),
        ],
        # integer weights: an integer makespan, which lets HiGHS round its bounds up
        integrality=np.append(np.ones(n * d), float(integral)),
        bounds=Bounds(
            np.append(np.zeros(n * d), lower),
            np.append(allowed.astype(np.float64), np.inf),
        ),
        options={"node_limit": EXACT_NODE_LIMIT, "mip_rel_gap": 0.0},
    )
    if res.x is None:
        return ExactMakespan(None, False)
    x = np.round(res.x[: n * d]).reshape(n, d)
    return ExactMakespan(np.argmax(x, axis=1).astype(np.int64), res.status == 0)
