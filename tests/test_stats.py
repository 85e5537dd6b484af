"""Step metrics: imbalance under the cost model, tokens and bytes moved by node, one log line."""

import numpy as np
import pytest

from orchmllm.data import stats as st
from orchmllm.planner.cost import CostModel
from orchmllm.planner.plan import Rearrangement


def test_phase_stats_measure_the_plan_under_the_cost_model_and_split_bytes_by_node():
    lengths = np.array([10, 30, 20, 40])
    src = np.array([0, 0, 1, 1])  # loads 40 | 60
    dst = np.array([0, 1, 2, 3])  # loads 10 | 30 | 20 | 40 on 4 ranks, 2 per node
    plan = Rearrangement.from_assignment(src, dst, num_ranks=4)
    item_bytes = np.array([100, 300, 200, 400])
    got = st.phase_stats(
        "llm", plan, lengths, cost=CostModel("packed"), plan_ms=2.5, item_bytes=item_bytes,
        ranks_per_node=2,
    )  # fmt: skip
    assert list(got) == [f"llm/{m}" for m in st.METRICS]
    assert got["llm/imbalance_before"] == pytest.approx(60 / 25)
    assert got["llm/imbalance_after"] == pytest.approx(40 / 25)
    assert (got["llm/load_max_before"], got["llm/load_max_after"]) == (60, 40)
    assert got["llm/tokens_moved"] == 30 + 20 + 40  # item 0 stays on rank 0
    assert got["llm/bytes_intra"] == 300  # rank 0 -> 1, one node
    assert got["llm/bytes_inter"] == 200 + 400  # rank 1 -> 2 and 3, across nodes
    quadratic = st.phase_stats("llm", plan, lengths, cost=CostModel("packed", 0, 1), plan_ms=0)
    assert quadratic["llm/imbalance_before"] == pytest.approx(2000 / 750)
    assert quadratic["llm/bytes_intra"] == quadratic["llm/bytes_inter"] == 0  # nothing moved
    assert st.planner_cost(object()) == CostModel("packed")


def test_under_padding_the_ratio_can_rise_while_the_slowest_rank_gets_lighter():
    """The issue's case: a plan that groups the long items removes padding, so the mean
    falls faster than the maximum and max/mean rises; the slowest rank's padded cost, the
    metric beside it, shows the step got faster."""
    lengths = np.array([10, 1, 1, 9])
    src = np.array([0, 0, 0, 1])  # [10, 1, 1] | [9]: padded 30 | 9, mean 19.5
    dst = np.array([0, 1, 1, 0])  # [10, 9] | [1, 1]: padded 20 | 2, mean 11
    got = st.phase_stats(
        "batch", Rearrangement.from_assignment(src, dst, num_ranks=2), lengths,
        cost=CostModel("padded"), plan_ms=0,
    )  # fmt: skip
    assert got["batch/imbalance_before"] == pytest.approx(30 / 19.5)
    assert got["batch/imbalance_after"] == pytest.approx(20 / 11)  # higher
    assert (got["batch/load_max_before"], got["batch/load_max_after"]) == (30, 20)  # lighter


def test_format_line_names_the_loader_step_and_every_phase():
    stats = {"epoch": 1, "step": 7, **st.named("vision", (1.5, 1.01, 900, 640, 12, 2048, 0, 0.4))}
    stats.update(st.named("llm", (1.2, 1.0, 50, 40, 300, 0, 3 * 2**20, 1.25)))
    assert st.format_line("train", stats) == (
        "train epoch 1 step 7 | vision imbalance 1.500 -> 1.010 (slowest 900 -> 640), moved "
        "12 tok (2.0 KB intra, 0 B inter), plan 0.4 ms | llm imbalance 1.200 -> 1.000 "
        "(slowest 50 -> 40), moved 300 tok (0 B intra, 3.0 MB inter), plan 1.2 ms"
    )
