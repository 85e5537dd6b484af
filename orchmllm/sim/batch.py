"""The lengths of one global batch: everything the planner and the step model need.

Rank ``r`` samples examples ``r*b .. r*b+b-1`` (gather order). An example holds text tokens and
any number of items of each modality (raw rows: image patches, mel frames, ...), each owned by
one example.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from orchmllm.config import ModelConfig
from orchmllm.data.recipe import ItemLengths
from orchmllm.schema import modality_named


def _ints(name: str, values: object) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must be non-negative, got {int(arr.min())}")
    return arr


@dataclass(frozen=True)
class Batch:
    """One step's global batch as lengths, ``examples_per_rank`` examples on every rank.

    Attributes:
        num_ranks: data-parallel ranks.
        text: int64 ``[n]``, text tokens per example.
        items: modality name -> its items (owning example, raw rows), for the modalities the
            batch holds (a modality the model does not encode must hold no item).
    """

    num_ranks: int
    text: np.ndarray
    items: Mapping[str, ItemLengths]

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks!r}")
        object.__setattr__(self, "text", _ints("text", self.text))
        n = self.text.size
        if n % self.num_ranks:
            raise ValueError(f"text: {n} examples do not split evenly over {self.num_ranks} ranks")
        items = {}
        for name, it in self.items.items():
            modality_named(name)
            owner, raw = _ints(f"{name} example", it.example), _ints(f"{name} raw", it.raw)
            if owner.shape != raw.shape:
                raise ValueError(
                    f"{name}: an item list and its owners differ: {owner.shape} vs {raw.shape}"
                )
            if owner.size and owner.max() >= n:
                raise ValueError(f"{name} item owners must index examples < {n}, got {owner.max()}")
            items[name] = ItemLengths(owner, raw)
        object.__setattr__(self, "items", items)

    @property
    def examples_per_rank(self) -> int:
        return self.text.size // self.num_ranks

    @property
    def example_src(self) -> np.ndarray:
        """Rank each example was sampled on."""
        return np.arange(self.text.size, dtype=np.int64) // self.examples_per_rank

    def of(self, name: str) -> ItemLengths:
        """The items of modality ``name`` (none when the batch holds none)."""
        empty = np.zeros(0, np.int64)
        return self.items.get(name, ItemLengths(empty, empty))

    def encoder_lengths(self, name: str, config: ModelConfig) -> np.ndarray:
        """Encoder sequence length per item of ``name`` (raw rows over its encoder's stride)."""
        return self.of(name).raw // config.encoders[name].stride

    def llm_lengths(self, config: ModelConfig) -> np.ndarray:
        """Whole interleaved sequence per example: text plus every encoded item."""
        n = self.text.size
        total = self.text.copy()
        for name, enc in config.encoders.items():
            it = self.of(name)
            total += np.bincount(
                it.example, weights=it.raw // enc.rate.divisor, minlength=n
            ).astype(np.int64)
        return total

    def check_encoded_by(self, config: ModelConfig) -> None:
        """Raise ``ValueError`` when an item belongs to a modality ``config`` has no encoder for."""
        for name, it in self.items.items():
            if it.raw.size and name not in config.encoders:
                raise ValueError(
                    f"the batch holds {it.raw.size} {name} items, but the model has no "
                    f"{name} encoder (encoders: {list(config.encoders)})"
                )

    def take(self, examples_per_rank: int) -> Batch:
        """The first ``examples_per_rank`` examples of every rank (nested mini-batches).

        Growing the mini-batch only adds examples, so the memory a rank needs grows with it and
        a search over mini-batch sizes sees one sample, not a fresh draw per size.
        """
        b = self.examples_per_rank
        if not 1 <= examples_per_rank <= b:
            raise ValueError(f"examples_per_rank must be in [1, {b}], got {examples_per_rank!r}")
        idx = np.arange(self.text.size, dtype=np.int64)
        keep = idx % b < examples_per_rank
        new_id = np.cumsum(keep) - 1
        items = {}
        for name, it in self.items.items():
            k = keep[it.example]
            items[name] = ItemLengths(new_id[it.example[k]], it.raw[k])
        return Batch(self.num_ranks, self.text[keep], items)

    @classmethod
    def from_record(cls, record: Mapping) -> Batch:
        """A batch written as JSON: ``{"num_ranks": d, "text": [...], "items": {name:
        {"example": [...], "raw": [...]}}}`` (as ``orchmllm.train.phase_memory`` writes a
        step's)."""
        items = {
            name: ItemLengths(np.asarray(it["example"], np.int64), np.asarray(it["raw"], np.int64))
            for name, it in record["items"].items()
        }
        return cls(int(record["num_ranks"]), np.asarray(record["text"], np.int64), items)

    @classmethod
    def uniform(
        cls, num_ranks: int, examples_per_rank: int, *, text: int, raw: Mapping[str, int]
    ) -> Batch:
        """Every example identical: one item of each modality in ``raw`` (name -> raw rows, 0
        for none) each (a no-imbalance control)."""
        n = num_ranks * examples_per_rank
        idx = np.arange(n, dtype=np.int64)
        items = {
            name: ItemLengths(idx if rows else idx[:0], np.full(n, rows) if rows else idx[:0])
            for name, rows in raw.items()
        }
        return cls(num_ranks, text=np.full(n, text), items=items)
