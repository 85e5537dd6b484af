"""Per-example lengths for planning: validated, computed once, cached.

Planning needs every example's length before (index mode) or right after (data-move mode)
loading it. For HF ``datasets`` the lengths come from a column, or from a length function
run once over the dataset with ``Dataset.map`` (optionally multi-process) and memoised by the
dataset's fingerprint, so a second loader over the same data pays nothing.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # HF datasets is imported only by code that is handed one
    import datasets

LengthFn = Callable[[Any], int]

# (dataset fingerprint, length function hash, columns) -> lengths; read-only arrays.
_CACHE: dict[str, np.ndarray] = {}


def is_hf_dataset(obj: object, *, iterable: bool = False) -> bool:
    """Whether ``obj`` is an HF ``Dataset`` (or ``IterableDataset``), without importing
    ``datasets``: if it was never imported, ``obj`` cannot be one."""
    hf = sys.modules.get("datasets")
    return hf is not None and isinstance(obj, hf.IterableDataset if iterable else hf.Dataset)


def which_example(index: int | str) -> str:
    """An example as an error names it: its dataset index, or where a stream gave it."""
    return f"example {index}" if isinstance(index, int) else index


def check_length(value: object, *, index: int | str, source: str) -> int:
    """``value`` as a Python int, or ``ValueError`` naming ``source`` and the example.

    ``index``: the example's dataset index, or (streams, which have none) a description
    such as ``"item 12 of this rank's stream"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{source} must return a non-negative integer; {which_example(index)} gave {value!r} "
            f"({type(value).__name__})"
        )
    if value < 0:
        raise ValueError(
            f"{source} must return a non-negative integer; {which_example(index)} gave {int(value)}"
        )
    return int(value)


def check_lengths(values: object, *, source: str) -> np.ndarray:
    """A 1-D int64 array of non-negative lengths, or ``ValueError`` naming ``source``."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{source} must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{source} must hold integers, got dtype {arr.dtype}: {arr[:5]!r}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{source} must be non-negative; example {i} has {int(arr[i])}")
    return arr


def column_lengths(dataset: datasets.Dataset, column: str) -> np.ndarray:
    """The integer column ``column`` of ``dataset`` as int64 (reads no other column)."""
    if column not in dataset.column_names:
        raise ValueError(
            f"length_column={column!r} is not a column of the dataset; "
            f"columns are {dataset.column_names}"
        )
    return check_lengths(
        np.asarray(dataset.select_columns([column])[column]), source=f"column {column!r}"
    )


def _map_lengths(batch: dict[str, list], indices: list[int], *, fn: LengthFn) -> dict:
    keys = list(batch)
    return {
        "__length": [
            check_length(fn({k: batch[k][j] for k in keys}), index=i, source="length_fn")
            for j, i in enumerate(indices)
        ]
    }


def _cache_key(dataset: datasets.Dataset, fn: LengthFn, columns: Sequence[str] | None) -> str:
    from datasets.fingerprint import Hasher

    try:
        return Hasher.hash((dataset._fingerprint, fn, tuple(columns or ())))
    except Exception:  # an unhashable closure: compute without caching
        return ""


def map_lengths(
    dataset: datasets.Dataset,
    length_fn: LengthFn,
    *,
    columns: Sequence[str] | None = None,
    num_proc: int | None = None,
) -> np.ndarray:
    """``length_fn(row)`` for every row, computed with ``Dataset.map`` once and cached.

    The cache (in this process) is keyed by the dataset's fingerprint, ``length_fn``'s hash
    and ``columns``, so a second loader over the same data pays nothing; a ``length_fn`` that
    HF ``datasets`` cannot hash is run every time.

    Args:
        dataset: an HF ``datasets.Dataset``.
        length_fn: ``length_fn(row) -> int``, a row's length (a non-negative integer).
        columns: the only columns each row holds (e.g. ``["segments"]``), so a length that
            depends on metadata never decodes images or audio (None: every column).
        num_proc: ``num_proc > 1`` runs the map in that many processes (None or 1: this one).

    Returns:
        int64 ``(len(dataset),)``, one length per row in index order; treat it as read-only
        (it may be the cached array, which is flagged so).

    Raises:
        ValueError: ``num_proc < 1``; a name in ``columns`` that is not a column;
            ``length_fn`` returning a negative or non-integer value (naming the example).
    """
    if num_proc is not None and num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    if columns is not None:
        missing = [c for c in columns if c not in dataset.column_names]
        if missing:
            raise ValueError(
                f"columns {missing} are not columns of the dataset; "
                f"columns are {dataset.column_names}"
            )
    key = _cache_key(dataset, length_fn, columns)
    if key and key in _CACHE:
        return _CACHE[key]
    view = dataset.select_columns(list(columns)) if columns is not None else dataset
    if len(view) == 0:
        return np.zeros(0, dtype=np.int64)
    out = view.map(
        _map_lengths,
        fn_kwargs={"fn": length_fn},
        batched=True,
        with_indices=True,
        remove_columns=view.column_names,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        desc="orchmllm: lengths",
    )
    lengths = check_lengths(np.asarray(out["__length"]), source="length_fn")
    lengths.setflags(write=False)
    if key:
        _CACHE[key] = lengths
    return lengths


def dataset_lengths(
    dataset: Any,
    *,
    length_column: str | None = None,
    length_fn: LengthFn | None = None,
    columns: Sequence[str] | None = None,
    num_proc: int | None = None,
) -> np.ndarray:
    """Lengths of every example of a map-style dataset, in index order.

    HF datasets: from ``length_column`` or via :func:`map_lengths`. Other map-style
    datasets (``__getitem__`` + ``__len__``): ``length_fn(dataset[i])`` (or
    ``dataset[i][length_column]``) for every ``i`` (this loads each example once; prefer a
    length column for large data).

    Args:
        dataset: an HF ``datasets.Dataset`` or any map-style dataset.
        length_column: the column (or key of each example) holding its length.
        length_fn: ``length_fn(example) -> int``, an example's length.
        columns: HF datasets with ``length_fn`` only: the columns it reads
            (see :func:`map_lengths`).
        num_proc: HF datasets with ``length_fn`` only: processes for the map.

    Returns:
        int64 ``(len(dataset),)``, one non-negative length per example.

    Raises:
        ValueError: not exactly one of ``length_column`` and ``length_fn`` given; a length
            column missing from the dataset or an example; a length that is negative or not
            an integer (naming the example).
    """
    if (length_column is None) == (length_fn is None):
        raise ValueError("pass exactly one of length_column= or length_fn=")
    if is_hf_dataset(dataset):
        if length_column is not None:
            return column_lengths(dataset, length_column)
        return map_lengths(dataset, length_fn, columns=columns, num_proc=num_proc)
    return np.array(
        [
            example_length(dataset[i], index=i, length_column=length_column, length_fn=length_fn)
            for i in range(len(dataset))
        ],
        dtype=np.int64,
    )


def example_length(
    example: Any,
    *,
    index: int | str,
    length_column: str | None = None,
    length_fn: LengthFn | None = None,
) -> int:
    """Length of one loaded example, from its ``length_column`` entry or ``length_fn``;
    errors name the example by ``index`` (see :func:`check_length`)."""
    if length_fn is not None:
        return check_length(length_fn(example), index=index, source="length_fn")
    try:
        value = example[length_column]
    except (KeyError, TypeError, IndexError):
        raise ValueError(
            f"length_column={length_column!r} is missing from {which_example(index)} "
            f"({type(example).__name__})"
        ) from None
    return check_length(value, index=index, source=f"column {length_column!r}")
