"""Where a rank's examples come from before balancing: its local mini-batches.

A rank reads its examples in sampling order as ``(key, example)`` pairs (key: the dataset
index, or for a stream without one, a description of its position in this rank's stream,
so that errors can name it) and cuts them into local mini-batches, by count
(``batch_size``) or by a token budget. Loading runs in torch ``DataLoader`` worker
processes when asked (``num_workers``), as with a plain DataLoader; nothing here is
collective.

Workers start when a reader is called, in the calling thread, not when its batches are first
drawn: the balanced loader calls its reader in ``iter()``, so the workers fork from the training
loop's thread, as a plain DataLoader's do, and not from the prefetch thread while the loop's
thread may be in the middle of a step (a fork copies the locks other threads hold, not the
threads).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from orchmllm.data.lengths import is_hf_dataset, which_example
from orchmllm.data.sampling import over_budget

Key = int | str
CHUNK = 16  # examples per worker task when a token budget, not a count, cuts the batches


@dataclass(frozen=True)
class Local:
    """One rank's local mini-batch: keys, examples and (token-budget batches) lengths."""

    keys: list[Key]
    examples: list[Any]
    lengths: list[int] | None = None


@dataclass(frozen=True)
class Workers:
    """DataLoader worker settings for loading (``num_workers=0``: in the calling thread), with
    DataLoader's names and defaults."""

    num_workers: int = 0
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    timeout: float = 0
    worker_init_fn: Callable[[int], None] | None = None
    generator: Any = None
    multiprocessing_context: Any = None

    @classmethod
    def of(cls, settings: Any) -> Workers:
        """The worker settings of a ``DataLoader`` or a ``LoaderOptions``."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def loader(self, dataset: Any, **kwargs: Any) -> DataLoader:
        settings = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.num_workers:  # DataLoader refuses a prefetch_factor without workers
            settings.pop("prefetch_factor")
        return DataLoader(dataset, **settings, **kwargs)


def as_list(examples: list) -> list:
    """Collate for loading workers: keep the examples as a list (balanced before collation)."""
    return list(examples)


def load(dataset: Any, indices: Sequence[int]) -> list:
    """``dataset[i]`` for each index, batched where the dataset can (``__getitems__``)."""
    keys = [int(i) for i in indices]
    if not keys:
        return []
    if hasattr(dataset, "__getitems__"):
        return list(dataset.__getitems__(keys))
    return [dataset[i] for i in keys]


def is_map_style(source: Any) -> bool:
    if isinstance(source, (DataLoader, IterableDataset)) or is_hf_dataset(source, iterable=True):
        return False
    return hasattr(source, "__getitem__") and hasattr(source, "__len__")


def set_epoch(*objects: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on each object that has it (samplers, HF iterable datasets)."""
    for obj in objects:
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)


class Indexed:
    """A map-style dataset whose items come with their index, so that errors about an
    example loaded in a worker can name its dataset index."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[int, Any]]:
        return list(zip(indices, load(self.dataset, indices), strict=True))


class Batches:
    """A batch sampler that yields what it is given before each iteration, so one
    DataLoader (and its persistent workers) serves every epoch and every resume point."""

    def __init__(self) -> None:
        self.batches: Iterable[list[int]] = ()

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)


class MapLoader:
    """Loads batches of dataset indices given per epoch, through one DataLoader (and so
    its persistent workers) for every epoch and resume point.

    ``indexed``: yield ``(index, example)`` pairs (for balancing before collation);
    otherwise ``collate_fn`` collates each batch, in the workers when there are any.
    """

    def __init__(
        self, dataset: Any, workers: Workers, *, collate_fn: Callable = as_list, indexed: bool
    ) -> None:
        self.sampler = Batches()
        self.loader = workers.loader(
            Indexed(dataset) if indexed else dataset,
            batch_sampler=self.sampler,
            collate_fn=collate_fn,
        )

    def __call__(self, batches: Iterable[list[int]]) -> Iterator[Any]:
        """The loaded batches, in order; ``batches`` is drawn from as the loader needs
        them (a worker pool asks ``prefetch_factor * num_workers`` ahead, from now on)."""
        self.sampler.batches = batches
        return iter(self.loader)


class IterStream:
    """This rank's shard of an iterable as ``(position, example)`` pairs: a torch
    ``IterableDataset`` (loaded by workers if asked; it must then split itself between
    workers, as with a plain DataLoader) or any Python iterable (loaded in place)."""

    def __init__(self, source: Any, *, chunk: int, workers: Workers) -> None:
        self.source = source
        self.loader = None
        if isinstance(source, IterableDataset):
            self.loader = workers.loader(source, batch_size=chunk, collate_fn=as_list)

    def __call__(self, epoch: int) -> Iterator[tuple[Key, Any]]:
        set_epoch(self.source, epoch=epoch)
        it = iter(self.source if self.loader is None else self.loader)  # workers start here
        if self.loader is not None:
            it = itertools.chain.from_iterable(it)
        return ((f"item {k} of this rank's stream", example) for k, example in enumerate(it))


def by_count(pairs: Iterator[tuple[Key, Any]], batch_size: int) -> Iterator[Local]:
    """Consecutive batches of ``batch_size`` pairs (the last one may be smaller)."""
    while batch := list(itertools.islice(pairs, batch_size)):
        keys, examples = zip(*batch, strict=True)
        yield Local(list(keys), list(examples))


def by_tokens(
    pairs: Iterator[tuple[Key, Any]],
    length: Callable[[Any, Key], int],
    max_tokens: int,
) -> Iterator[Local]:
    """Consecutive batches of at most ``max_tokens`` tokens (``length(example, key)``):
    a batch ends before the example that would not fit. ``ValueError`` names an example
    longer than the budget."""
    batch = Local([], [], [])
    total = 0
    for key, example in pairs:
        n = length(example, key)
        if n > max_tokens:
            raise over_budget(max_tokens, which_example(key), n)
        if batch.keys and total + n > max_tokens:
            yield batch
            batch, total = Local([], [], []), 0
        batch.keys.append(key)
        batch.examples.append(example)
        batch.lengths.append(n)
        total += n
    if batch.keys:
        yield batch


class LoaderBatches:
    """The batches of a user's ``DataLoader`` as raw examples (its dataset, sampler,
    workers and their settings kept; its collate function runs after balancing)."""

    def __init__(self, dl: DataLoader) -> None:
        if dl.batch_size is None and dl.batch_sampler is None:
            raise ValueError(
                "dataloader must batch (batch_size or batch_sampler), got batch_size=None"
            )
        self.dl = dl
        self.indexed = not isinstance(dl.dataset, IterableDataset)
        workers = Workers.of(dl)
        if self.indexed:  # resume skips index batches, never loading the skipped examples
            self.sampler = Batches()
            self.loader = workers.loader(
                Indexed(dl.dataset), batch_sampler=self.sampler, collate_fn=as_list
            )
        else:
            self.loader = workers.loader(
                dl.dataset, batch_size=dl.batch_size, drop_last=dl.drop_last, collate_fn=as_list
            )

    def __call__(self, epoch: int, skip: int) -> Iterator[Local]:
        """The epoch's batches from the ``skip``-th on (skipped index batches are never
        loaded; an iterable dataset's are read and dropped). The workers start now."""
        bs = self.dl.batch_sampler
        set_epoch(self.dl.sampler, bs, getattr(bs, "sampler", None), self.dl.dataset, epoch=epoch)
        if self.indexed:
            self.sampler.batches = itertools.islice(bs, skip, None)
            return _indexed_batches(iter(self.loader))
        return _stream_batches(iter(self.loader), skip)


def _indexed_batches(loaded: Iterator[list[tuple[int, Any]]]) -> Iterator[Local]:
    """Local batches from loaded ``(index, example)`` pairs: the index is the key."""
    for pairs in loaded:
        keys, examples = zip(*pairs, strict=True)
        yield Local(list(keys), list(examples))


def _stream_batches(loaded: Iterator[list[Any]], skip: int) -> Iterator[Local]:
    """Local batches of a stream from its ``skip``-th on, keyed by position in it (the
    skipped ones are read: a stream cannot seek)."""
    read = 0
    for b, examples in enumerate(loaded):
        keys = [f"item {read + i} of this rank's stream" for i in range(len(examples))]
        read += len(examples)
        if b >= skip:
            yield Local(keys, examples)
