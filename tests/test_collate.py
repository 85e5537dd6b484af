"""BalancedCollator in a user's own DataLoader: metrics, pin_memory, and a clear error
where it cannot work (worker processes cannot run collectives)."""

import pytest
import torch
from torch.utils.data import DataLoader

from orchmllm.data.collate import BalancedCollator
from orchmllm.data.options import PlanningOptions
from orchmllm.data.stats import METRICS

ROWS = [{"id": i, "n": 1 + i % 5} for i in range(8)]


def _ids(examples):
    return torch.tensor([e["id"] for e in examples])


@pytest.mark.integration
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_collator_in_workers_fails_saying_what_to_use_instead(context):
    """Forked workers fail at their first batch; spawned ones as the iterator starts (the
    collator refuses to be pickled), before a worker process even runs."""
    dl = DataLoader(
        ROWS,
        batch_size=4,
        num_workers=1,
        multiprocessing_context=context,
        collate_fn=BalancedCollator(_ids, length_column="n"),
    )
    use_instead = r"use num_workers=0, or BalancedDataLoader\(your_dataloader\)"
    if context == "spawn":
        with pytest.raises(RuntimeError, match=use_instead):
            iter(dl)
    else:
        with pytest.raises(RuntimeError, match=use_instead):
            next(iter(dl))


def test_collator_keeps_pin_memory_and_reports_each_step():
    collator = BalancedCollator(_ids, length_column="n")
    pin = torch.accelerator.is_available()
    dl = DataLoader(ROWS, batch_size=4, collate_fn=collator, pin_memory=pin)
    batches = list(dl)
    assert sorted(torch.cat(batches).tolist()) == list(range(8))
    assert all(b.is_pinned() == pin for b in batches)
    stats = collator.last_stats
    assert stats["step"] == 1 and {f"batch/{m}" for m in METRICS} <= set(stats)
    assert stats["batch/imbalance_before"] == stats["batch/imbalance_after"] == 1.0  # one rank
    assert stats["batch/tokens_moved"] == stats["batch/bytes_intra"] == 0


def test_collator_takes_the_planning_options_and_refuses_what_it_cannot_use():
    rows = PlanningOptions(meta_fn=lambda e: [e["n"], e["id"]])  # a row per example, not a length
    collator = BalancedCollator(_ids, planning=rows)
    batches = list(DataLoader(ROWS, batch_size=4, collate_fn=collator))
    assert sorted(torch.cat(batches).tolist()) == list(range(8))
    assert collator.last_step.meta.shape == (4, 2)
    with pytest.raises(ValueError, match=r"exactly one of .*; got \['length_column', 'meta_fn'\]"):
        BalancedCollator(_ids, length_column="n", planning=rows)
    with pytest.raises(ValueError, match=r"exactly one of .*; got \[\]"):
        BalancedCollator(_ids)
    with pytest.raises(ValueError, match=r"batch_meta_fn needs BalancedDataLoader\(mode='local'\)"):
        BalancedCollator(_ids, planning=PlanningOptions(batch_meta_fn=len))
    with pytest.raises(TypeError, match="planning must be a PlanningOptions, got dict"):
        BalancedCollator(_ids, length_column="n", planning={"policy": "kk"})
