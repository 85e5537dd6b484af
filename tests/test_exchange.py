"""One exchange step in a single process (the multi-process paths run in test_loader), and
the step header's planner agreement on real gloo groups."""

import numpy as np
import pytest

from orchmllm.data import exchange as ex
from orchmllm.data.orchestrated import OrchestratorPlanner
from orchmllm.data.planners import BalancePlanner
from orchmllm.dist import comm
from orchmllm.dist.orchestrator import Orchestrator
from orchmllm.dist.topology import Topology
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.step_options import StepOptions, default_phases
from orchmllm.schema import EncodingRates
from orchmllm.testing import assert_check_passed, run_checks

TIMEOUT = 20.0


def test_gather_pads_rows_and_counts_nothing_sent_alone():
    g = ex.Group(Topology.build(timeout=5))
    out = ex.gather_step(g, [[3, 1], [4]])
    np.testing.assert_array_equal(out.meta, [[3, 1], [4, ex.PAD]])
    np.testing.assert_array_equal(out.src, [0, 0])
    assert out.bytes_sent == 0  # no peers


def test_gather_reraises_own_error():
    g = ex.Group(Topology.build(timeout=5))
    with pytest.raises(KeyError, match="mine"):
        ex.gather_step(g, None, error=KeyError("mine"))


def test_pickled_examples_roundtrip_through_the_move_path():
    g = ex.Group(Topology.build(timeout=5))
    examples = [{"a": np.arange(k), "b": "x" * k} for k in (3, 0, 5)]
    blobs = ex.serialize(examples)
    plan = Rearrangement.from_assignment([0, 0, 0], [0, 0, 0], num_ranks=1)
    got, sent = g.path.move_objects(plan, blobs, np.array([len(b) for b in blobs]))
    assert sent == 0
    assert [e["b"] for e in got] == [e["b"] for e in examples]
    assert all(np.array_equal(x["a"], y["a"]) for x, y in zip(got, examples, strict=True))


def test_balance_step_checks_planner_output():
    g = ex.Group(Topology.build(timeout=5))

    def prepare():
        return [{"n": 1}], [[1]]

    with pytest.raises(ValueError, match="planner must return a Rearrangement"):
        ex.balance_step(g, lambda meta, src, d: "no plan", prepare, step=0, move=True)
    wrong = Rearrangement.from_assignment([0, 0], [0, 0], num_ranks=1)
    with pytest.raises(ValueError, match="plan for 2 items on 1 ranks; expected 1 items"):
        ex.balance_step(g, lambda meta, src, d: wrong, prepare, step=0, move=True)
    assert ex.balance_step(g, lambda *a: None, lambda: (None, []), step=0, move=True) is None


def test_planner_signature_is_stable_and_tells_options_apart():
    phases = default_phases(EncodingRates(), feature_dims={"vision": 12, "audio": 8})

    def fp(planner):
        return comm.fingerprint(ex.planner_signature(planner))

    orch = [
        OrchestratorPlanner(Orchestrator(StepOptions(phases, mode=m)))
        for m in ("full", "full", "llm")
    ]
    assert fp(orch[0]) == fp(orch[1]) != fp(orch[2])  # options, not object identity
    assert fp(BalancePlanner("greedy")) == fp(BalancePlanner("greedy"))
    assert fp(BalancePlanner("greedy")) != fp(BalancePlanner("kk"))

    def mine(meta, src, n):
        return None

    assert ex.planner_signature(mine).endswith(".<locals>.mine")


def _examples(rank: int) -> list[dict]:
    return [{"id": 10 * rank + i, "x": np.arange(i + rank)} for i in range(rank + 1)]


def _w_planner_mismatch(rank: int, world: int):
    g = ex.Group(Topology.build(timeout=TIMEOUT))  # as the loader talks

    def prepare():
        examples = _examples(rank)
        return examples, [[len(e["x"])] for e in examples]

    odd = BalancePlanner("kk" if rank == 1 else "greedy")
    match = r"step 3: ranks disagree: 'planner' differs: ranks \[1\]"
    with pytest.raises(comm.MismatchError, match=match):
        ex.balance_step(g, odd, prepare, step=3, move=True)
    # The step failed together, so the group is still in step: the same planner works.
    done = ex.balance_step(g, BalancePlanner("greedy"), prepare, step=4, move=True)
    got = [e["id"] for e in done.examples]
    everyone = comm.all_gather_rows(np.array(got).reshape(-1, 1), timeout=TIMEOUT)[0][:, 0]
    assert sorted(everyone.tolist()) == sorted(e["id"] for r in range(world) for e in _examples(r))


@pytest.mark.integration
def test_ranks_with_different_planners_fail_the_step_together():
    """Before the header carried the planner, rank 1 planned with another policy and moved
    examples by a plan the others did not share (a gloo size mismatch or lost examples)."""
    results = run_checks({"planner_mismatch": _w_planner_mismatch}, 3, timeout=TIMEOUT)
    assert_check_passed(results, "planner_mismatch")
