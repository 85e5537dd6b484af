"""One exchange step in a single process (the multi-process paths run in test_loader)."""

import numpy as np
import pytest

from orchmllm.data import exchange as ex
from orchmllm.plan import Rearrangement


def test_gather_pads_rows_and_counts_nothing_sent_alone():
    g = ex.Group(None, timeout=5)
    out = ex.gather_step(g, [[3, 1], [4]])
    np.testing.assert_array_equal(out.meta, [[3, 1], [4, ex.PAD]])
    np.testing.assert_array_equal(out.src, [0, 0])
    assert out.bytes_sent == 0  # no peers


def test_gather_reraises_own_error():
    g = ex.Group(None, timeout=5)
    with pytest.raises(KeyError, match="mine"):
        ex.gather_step(g, None, error=KeyError("mine"))


def test_move_examples_roundtrip_any_python_object():
    g = ex.Group(None, timeout=5)
    examples = [{"a": np.arange(k), "b": "x" * k} for k in (3, 0, 5)]
    blobs = ex.serialize(examples)
    plan = Rearrangement.from_assignment([0, 0, 0], [0, 0, 0], num_ranks=1)
    got, sent = ex.move_examples(g, plan, blobs, np.array([len(b) for b in blobs]))
    assert sent == 0
    assert [e["b"] for e in got] == [e["b"] for e in examples]
    assert all(np.array_equal(x["a"], y["a"]) for x, y in zip(got, examples, strict=True))


def test_balance_step_checks_planner_output():
    g = ex.Group(None, timeout=5)

    def prepare():
        return [{"n": 1}], [[1]]

    with pytest.raises(ValueError, match="planner must return a Rearrangement"):
        ex.balance_step(g, lambda meta, src, d: "no plan", prepare, step=0, move=True)
    wrong = Rearrangement.from_assignment([0, 0], [0, 0], num_ranks=1)
    with pytest.raises(ValueError, match="plan for 2 items on 1 ranks; expected 1 items"):
        ex.balance_step(g, lambda meta, src, d: wrong, prepare, step=0, move=True)
    assert ex.balance_step(g, lambda *a: None, lambda: (None, []), step=0, move=True) is None
