"""The balanced loader's arguments: checked, and resolved into an exchange mode.

Everything here runs when a :class:`~orchmllm.data.loader.BalancedDataLoader` is built, on
each rank alone (no collective), so a bad option or a combination that cannot work fails at
once with a message naming it and what to use instead.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from orchmllm.data import exchange as ex
from orchmllm.data import sources as sr
from orchmllm.data.lengths import is_hf_dataset
from orchmllm.data.options import LoaderOptions, PlanningOptions, SamplingOptions

# How examples cross the ranks (``mode=``): not the balance modes of
# orchmllm.planner.step_options.MODES.
EXCHANGE_MODES = ("auto", "index", "move", "local")
# DataLoader's own keywords the loader takes besides batch_size and collate_fn: the ones a
# wrapper (orchestrated_loader, an adapted model's loader) forwards as they are.
DATALOADER_KEYWORDS = (
    "shuffle",
    "drop_last",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "timeout",
    "worker_init_fn",
    "generator",
    "multiprocessing_context",
)


def check_lengths_args(lengths_from: list[str], mode: str, planning: PlanningOptions) -> None:
    """Where the planner's rows come from (``lengths_from``: the names of the length arguments
    given), checked against the mode and the planning options."""
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"mode must be one of {EXCHANGE_MODES}, got {mode!r}")
    if len(lengths_from) > 1:
        raise ValueError(
            f"pass at most one of length_fn, length_column, lengths; got {lengths_from}"
        )
    if not lengths_from and not planning.custom_rows:
        raise ValueError(
            "pass one of length_fn=, length_column=, lengths= (or a planning meta_fn=)"
        )
    if planning.batch_meta_fn is not None and mode != "local":
        raise ValueError(f"batch_meta_fn needs mode='local', got mode={mode!r}")
    if mode == "index" and planning.meta_fn is not None:
        raise ValueError("mode='index' plans on lengths only; meta_fn needs mode 'move'/'local'")


def check_batch_args(
    batch_size: int | None, max_tokens_per_rank: int | None, *, budgets_lengths: bool
) -> None:
    """What one step holds: a count or a token budget, never both; a budget needs the
    lengths (``budgets_lengths``: lengths given, no custom planner rows)."""
    for name, value in (("batch_size", batch_size), ("max_tokens_per_rank", max_tokens_per_rank)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    if max_tokens_per_rank is None:
        return
    if batch_size is not None:
        raise ValueError(
            f"pass batch_size= or max_tokens_per_rank=, not both; got batch_size={batch_size}, "
            f"max_tokens_per_rank={max_tokens_per_rank}"
        )
    if not budgets_lengths:
        raise ValueError(
            "max_tokens_per_rank budgets lengths: pass length_fn=, length_column= or lengths=, "
            "and no meta_fn= or batch_meta_fn= (a custom planner's rows)"
        )


def check_source(
    source: Any,
    *,
    batch_size: int | None,
    max_tokens_per_rank: int | None,
    lengths: Any,
    options: LoaderOptions,
    sampled: dict[str, bool],
) -> None:
    """Options this kind of source cannot honour fail here, saying what to use instead
    (``sampled``: the sampling keywords given to the loader itself)."""
    if isinstance(source, DataLoader):
        for name, value in (
            ("batch_size", batch_size),
            ("max_tokens_per_rank", max_tokens_per_rank),
        ):
            if value is not None:
                raise ValueError(
                    f"{name} comes from the dataloader's batches; do not pass it too (or pass "
                    "the dataset instead of the DataLoader)"
                )
        default = sr.Workers()
        workers = {k: v for k, v in vars(sr.Workers.of(options)).items() if v != vars(default)[k]}
        if workers:
            raise ValueError(
                "the worker settings come from the dataloader: set them on it "
                f"(DataLoader(..., num_workers=N)); got {workers}"
            )
        if sampled:
            raise ValueError(
                "shuffle and drop_last come from the dataloader's sampler: set them on it "
                f"(DistributedSampler(..., shuffle=, drop_last=)); got {sampled}"
            )
        return
    if batch_size is None and max_tokens_per_rank is None:
        raise ValueError("pass batch_size= (>= 1) or max_tokens_per_rank=, got neither")
    workers = options.num_workers
    if workers and not (sr.is_map_style(source) or isinstance(source, IterableDataset)):
        raise ValueError(
            f"num_workers={workers} needs a map-style dataset, a torch IterableDataset "
            f"or a DataLoader; got {type(source).__name__}: wrap it in an IterableDataset, or "
            "use num_workers=0"
        )
    if lengths is not None and not sr.is_map_style(source):
        raise ValueError("lengths= needs a map-style dataset (one length per index)")


def resolve_mode(
    source: Any,
    mode: str,
    *,
    lengths: Any,
    length_column: str | None,
    planning: PlanningOptions,
) -> str:
    """The mode ``"auto"`` stands for with this source (a source that fits, see
    :func:`check_source`)."""
    map_style = sr.is_map_style(source)
    if mode == "auto":
        known = lengths is not None or (is_hf_dataset(source) and planning.meta_fn is None)
        mode = "index" if map_style and known else "move"
    if mode == "index" and not map_style:
        raise ValueError(
            f"mode='index' needs a map-style dataset, got {type(source).__name__}; "
            "use mode='move' for iterable data or a DataLoader"
        )
    if (
        mode != "index"
        and is_hf_dataset(source)
        and length_column is not None
        and length_column not in source.column_names
    ):
        raise ValueError(
            f"length_column={length_column!r} is not a column of the dataset; "
            f"columns are {source.column_names}"
        )
    return mode


def num_replicas(source: Any, sampling: SamplingOptions, group: ex.Group) -> int:
    """Given, else the wrapped DataLoader's DistributedSampler's, else the group's size."""
    if sampling.num_replicas is not None:
        return sampling.num_replicas
    sampler = getattr(source, "sampler", None) if isinstance(source, DataLoader) else None
    return getattr(sampler, "num_replicas", group.size)


def pinning(source: Any, options: LoaderOptions) -> bool:
    """Whether to pin batches: asked (here or on a DataLoader source) and possible."""
    asked = options.pin_memory or (isinstance(source, DataLoader) and source.pin_memory)
    if asked and not torch.accelerator.is_available():
        warnings.warn(
            "pin_memory=True but no accelerator is available: batches are not pinned",
            stacklevel=4,
        )
        return False
    return bool(asked)
