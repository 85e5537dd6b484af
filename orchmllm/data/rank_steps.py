"""This rank's steps of an epoch, as the loader samples them: the sampling half of its shell.

A map-style dataset is sampled as ``DistributedSampler`` would (by count, or packed into
token-budget steps when the lengths are known up front); a stream or a ``DataLoader`` is
read in order and cut into steps as it comes. Nothing here talks to the other ranks except
:meth:`RankSteps.agreed_stream_steps`, called once when the loader is built.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from orchmllm.data import exchange as ex
from orchmllm.data import sources as sr
from orchmllm.data.lengths import LengthFn, example_length
from orchmllm.data.options import SamplingOptions
from orchmllm.data.sampling import (
    local_batches,
    rank_indices,
    steps_per_epoch,
    token_budget_batches,
)

Reader = sr.MapLoader | sr.IterStream | sr.LoaderBatches


def make_reader(
    source: Any, workers: sr.Workers, *, batch_size: int | None, collate_fn: Callable | None
) -> Reader:
    """What loads this rank's examples (one object for all epochs: persistent workers);
    ``collate_fn``: the workers load and collate balanced index batches with it."""
    if isinstance(source, DataLoader):
        return sr.LoaderBatches(source)
    if not sr.is_map_style(source):
        return sr.IterStream(source, chunk=batch_size or sr.CHUNK, workers=workers)
    if collate_fn is not None:
        return sr.MapLoader(source, workers, collate_fn=collate_fn, indexed=False)
    return sr.MapLoader(source, workers, indexed=True)


class RankSteps:
    """This rank's sampled steps and their examples' metadata rows.

    Args:
        source: the loader's source (a map-style dataset, a stream or a ``DataLoader``).
        reader: what loads its examples (:func:`make_reader`).
        rank: this rank in the loader's group.
        num_replicas: ranks the data is split over.
        sampling: shuffle, seed, drop_last.
        batch_size: examples per step (None: a token budget or the DataLoader's batches).
        max_tokens_per_rank: the token budget per rank and step (None: by count).
        lengths: every example's length by dataset index, when known before loading.
        length_column: the key of an example holding its length.
        length_fn: or a function of the example giving it.
        meta_fn: the row gathered per example instead of ``[length]`` (None: the length).
    """

    def __init__(
        self,
        source: Any,
        reader: Reader,
        *,
        rank: int,
        num_replicas: int,
        sampling: SamplingOptions,
        batch_size: int | None,
        max_tokens_per_rank: int | None,
        lengths: np.ndarray | None,
        length_column: str | None,
        length_fn: LengthFn | None,
        meta_fn: Callable[[Any], Sequence[int]] | None,
    ) -> None:
        self.source, self.reader = source, reader
        self.rank, self.num_replicas, self.sampling = rank, num_replicas, sampling
        self.batch_size, self.max_tokens_per_rank = batch_size, max_tokens_per_rank
        self.lengths = lengths
        self.length_column, self.length_fn, self.meta_fn = length_column, length_fn, meta_fn
        self._packing: tuple[int, list[list[list[int]]]] | None = None  # (epoch, steps)

    def sampled(self, epoch: int) -> list[list[int]] | None:
        """This rank's sampled dataset indices per step, where sampling needs no loading: a
        map-style dataset cut by count, or by token budget over lengths known up front."""
        sampling = self.sampling
        if not sr.is_map_style(self.source):
            return None
        if self.max_tokens_per_rank is None:
            return local_batches(
                len(self.source),
                rank=self.rank,
                num_replicas=self.num_replicas,
                batch_size=self.batch_size,
                epoch=epoch,
                seed=sampling.seed,
                shuffle=sampling.shuffle,
                drop_last=sampling.drop_last,
            )
        if self.lengths is None:
            return None
        if self._packing is None or self._packing[0] != epoch:
            steps = token_budget_batches(
                self.lengths,
                num_replicas=self.num_replicas,
                max_tokens=self.max_tokens_per_rank,
                epoch=epoch,
                seed=sampling.seed,
                shuffle=sampling.shuffle,
                drop_last=sampling.drop_last,
            )
            self._packing = (epoch, steps)
        return [per_rank[self.rank] for per_rank in self._packing[1]]

    def count(self, epoch: int) -> int | None:
        """Steps of ``epoch`` known without reading it (None: only the stream can tell)."""
        if sr.is_map_style(self.source) and self.max_tokens_per_rank is None:
            return steps_per_epoch(
                len(self.source),
                num_replicas=self.num_replicas,
                batch_size=self.batch_size,
                drop_last=self.sampling.drop_last,
            )
        steps = self.sampled(epoch)  # token budget over known lengths
        return None if steps is None else len(steps)

    def agreed_stream_steps(self, group: ex.Group) -> int | None:
        """Steps per epoch of a stream or DataLoader source, when every rank knows its own
        count (the epoch lasts as long as the longest rank's). Collective."""
        if sr.is_map_style(self.source):
            return None
        local = -1
        if self.max_tokens_per_rank is None:
            try:
                n = len(self.source)
                local = n if isinstance(self.source, DataLoader) else -(-n // self.batch_size)
            except TypeError:  # no __len__: known only at the end
                pass
        counts = group.all_gather_fixed([local])
        return int(counts.max()) if np.all(counts >= 0) else None

    def local_batches(
        self, epoch: int, start: int, sampled: list[list[int]] | None
    ) -> Iterator[sr.Local]:
        """This rank's local batches of ``epoch`` from step ``start``, loaded as drawn
        (``sampled``: :meth:`sampled` of the epoch)."""
        reader = self.reader
        if sampled is not None:  # only this rank's sampled steps from start are loaded
            return (self._local(pairs) for pairs in reader(sampled[start:]))
        if isinstance(reader, sr.LoaderBatches):
            return reader(epoch, start)
        # read (and drop) the steps before start: their cut depends on the data
        return itertools.islice(self._cut(self._pairs(epoch)), start, None)

    def _pairs(self, epoch: int) -> Iterator[tuple[sr.Key, Any]]:
        """This rank's examples of the epoch as (key, example), in sampling order."""
        if isinstance(self.reader, sr.MapLoader):  # token budget, lengths known when loaded
            order = rank_indices(
                len(self.source),
                rank=self.rank,
                num_replicas=self.num_replicas,
                epoch=epoch,
                seed=self.sampling.seed,
                shuffle=self.sampling.shuffle,
                drop_last=self.sampling.drop_last,
            )
            chunks = (order[i : i + sr.CHUNK] for i in range(0, len(order), sr.CHUNK))
            return itertools.chain.from_iterable(self.reader(chunks))
        assert isinstance(self.reader, sr.IterStream)
        return self.reader(epoch)

    def _cut(self, pairs: Iterator[tuple[sr.Key, Any]]) -> Iterator[sr.Local]:
        """Local batches from a stream of pairs: by count or by token budget."""
        if self.max_tokens_per_rank is None:
            return sr.by_count(pairs, self.batch_size)
        return sr.by_tokens(pairs, self.length, self.max_tokens_per_rank)

    def _local(self, pairs: list[tuple[int, Any]]) -> sr.Local:
        keys = [k for k, _ in pairs]
        lengths = None
        if self.max_tokens_per_rank is not None:  # packed on lengths known up front
            lengths = self.lengths[keys].tolist()
        return sr.Local(keys, [e for _, e in pairs], lengths)

    def length(self, example: Any, key: sr.Key) -> int:
        """An example's length: known up front by its index, else read from it."""
        if self.lengths is not None and isinstance(key, int):
            return int(self.lengths[key])
        return example_length(
            example,
            index=key,
            length_column=self.length_column,
            length_fn=self.length_fn,
        )

    def rows(self, local: sr.Local) -> list[list[int]]:
        """The metadata rows of a local batch: lengths, or the planning ``meta_fn``'s."""
        if local.lengths is not None:
            return [[n] for n in local.lengths]
        pairs = zip(local.keys, local.examples, strict=True)
        if self.meta_fn is not None:
            return [[int(v) for v in self.meta_fn(e)] for _, e in pairs]
        return [[self.length(e, k)] for k, e in pairs]
