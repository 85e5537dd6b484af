"""benchmarks/shape_buckets.py: each bucket runs in a fresh process over the same batches; a
larger bucket meets no more shapes and pads no less, and the break-even follows its records."""

from __future__ import annotations

import pytest

from benchmarks.shape_buckets import main, with_break_even


@pytest.mark.integration  # one fresh process per bucket
def test_quick_run_measures_every_bucket_on_the_same_batches(tmp_path):
    records = main(["--quick", "--json", str(tmp_path / "b.json")])
    by_bucket = {r["bucket"]: r for r in records}
    assert sorted(by_bucket) == [1, 32]
    none, coarse = by_bucket[1], by_bucket[32]
    assert coarse["distinct_shapes"] <= none["distinct_shapes"]
    assert coarse["padding_over_frames"] >= none["padding_over_frames"] >= 1.0
    assert none["max_frames"] == coarse["max_frames"]  # the same batches
    assert (tmp_path / "b.json").read_text().startswith("[")


def _record(bucket: int, new_shape_s: float, warm_step_s: float) -> dict:
    return {"bucket": bucket, "new_shape_s": new_shape_s, "warm_step_s": warm_step_s,
            "max_frames": 100}  # fmt: skip


def test_break_even_is_saved_setups_over_the_padding_each_step_costs():
    none, coarse = with_break_even([_record(1, 0.01, 1.0), _record(10, 0.01, 1.1)])
    assert coarse["break_even_steps"] == pytest.approx((100 - 10) * 0.01 / 0.1)
    free = with_break_even([_record(1, 0.0, 1.0), _record(10, 0.0, 1.1)])[1]
    assert free["break_even_steps"] == 0  # nothing to save: never faster
    cheap = with_break_even([_record(1, 0.01, 1.0), _record(10, 0.01, 0.9)])[1]
    assert cheap["break_even_steps"] is None  # no padding cost seen: faster at any length
