"""Lengths: computed once with Dataset.map (also multi-process), cached, validated."""

import time

import datasets
import numpy as np
import pytest

from orchmllm.data import lengths as L


def _ds(n=40, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 30, size=n)
    return datasets.Dataset.from_dict(
        {
            "input_ids": [list(range(s)) for s in sizes],
            "n_tokens": sizes.tolist(),
            "big": [np.zeros(3, dtype=np.float32).tolist()] * n,
        }
    ), sizes


def _len_ids(ex):
    return len(ex["input_ids"])


@pytest.mark.parametrize("num_proc", [None, 2])
def test_map_lengths_matches_direct_and_is_cached(num_proc):
    ds, sizes = _ds(seed=1 if num_proc else 2)
    got = L.map_lengths(ds, _len_ids, columns=["input_ids"], num_proc=num_proc)
    np.testing.assert_array_equal(got, sizes)
    assert got.dtype == np.int64
    t0 = time.perf_counter()
    again = L.map_lengths(ds, _len_ids, columns=["input_ids"], num_proc=num_proc)
    assert again is got  # memoised by fingerprint: no second map
    assert time.perf_counter() - t0 < 0.5


def test_column_and_fn_agree_and_respect_selection():
    ds, sizes = _ds()
    sel = ds.shuffle(seed=3).select(range(10))
    by_col = L.dataset_lengths(sel, length_column="n_tokens")
    by_fn = L.dataset_lengths(sel, length_fn=_len_ids)
    np.testing.assert_array_equal(by_col, by_fn)
    np.testing.assert_array_equal(by_col, [len(r["input_ids"]) for r in sel])


def test_plain_map_style_dataset():
    data = [{"x": [0] * k} for k in (3, 0, 5)]
    np.testing.assert_array_equal(
        L.dataset_lengths(data, length_fn=lambda ex: len(ex["x"])), [3, 0, 5]
    )


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda ex: -1 if len(ex["input_ids"]) == 7 else 1, "7 gave -1"),
        (lambda ex: 2.0, "gave 2.0"),
        (lambda ex: True, "gave True"),
        (lambda ex: "12", "gave '12'"),
    ],
)
def test_bad_length_fn(fn, match):
    ds = datasets.Dataset.from_dict({"input_ids": [[0] * k for k in range(10)]})
    with pytest.raises(
        ValueError, match=f"length_fn must return a non-negative integer; example .*{match}"
    ):
        L.map_lengths(ds, fn)


def test_bad_length_fn_in_worker_processes():
    ds = datasets.Dataset.from_dict({"input_ids": [[0] * k for k in range(10)]})
    with pytest.raises(ValueError, match="example 7 gave -7"):
        L.map_lengths(ds, _minus_seven, num_proc=2)


def _minus_seven(ex):
    n = len(ex["input_ids"])
    return -n if n == 7 else n


def test_missing_and_bad_columns():
    ds, _ = _ds()
    with pytest.raises(ValueError, match="length_column='nope' is not a column"):
        L.dataset_lengths(ds, length_column="nope")
    with pytest.raises(ValueError, match="must hold integers"):
        L.column_lengths(ds.add_column("f", [0.5] * len(ds)), "f")
    with pytest.raises(ValueError, match=r"columns \['nope'\]"):
        L.map_lengths(ds, _len_ids, columns=["nope"])
    with pytest.raises(ValueError, match="length_column='n' is missing from example 0"):
        L.example_length({"m": 1}, index=0, length_column="n")
    with pytest.raises(ValueError, match="exactly one"):
        L.dataset_lengths(ds)
