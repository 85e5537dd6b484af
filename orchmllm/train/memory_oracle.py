"""Torch's own memory accounting of the trainer's step, per phase, at any world size.

The memory model (:mod:`orchmllm.sim.memory`) replays the step by hand; this module asks torch
instead. :class:`PhaseTracker` runs a step's phases under ``FSDPMemTracker``
(``torch.distributed._tools.fsdp2_mem_tracker``), which sees every tensor an op of the step
creates (FSDP2's all-gather outputs, unsharded parameters, reduce-scatter inputs, sharded
gradients, activations, temporaries, AdamW's state) and frees it with its storage. It measures
the trainer's real step on real gloo ranks (``tests/test_memory_oracle.py``), and
:func:`step_peaks` measures one rank's step at world size N in one process, on torch's fake
process group (``dist.init_process_group("fake")``: collectives return at once, FSDP2 allocates
its buffers as on N ranks), so 8 or 64 ranks cost what one does.

What works on the CPU build (torch 2.13) and what does not:

- fake process group + real tensors + ``FSDPMemTracker``: works at any world size. The rank's
  step really computes (on garbage gathered weights: the fake all-gather fills nothing), at
  the cost of one rank's step.
- ``FakeTensorMode`` (torchtitan's way: no compute at all) does not: the models pack
  variable-length sequences, so they read their lengths as values (``check_lengths``, the
  padded audio width, the attention's offsets), which a fake tensor refuses
  (``DataDependentOutputException: aten._local_scalar_dense``); building the model under it
  fails earlier (``Module.to``: "Couldn't swap Linear.weight"), on the meta device too.
- The orchestrator's exchange cannot run on the fake group (its all-to-alls deliver nothing,
  so the received sizes are wrong): :func:`step_peaks` runs the step from the rank's own
  items on (its encoders, the assembly, the LLM and its loss), the shapes the orchestrator
  would have delivered (:class:`RankBatch`).

The tracker counts tensors, not the allocator: kernels' internal workspaces (the CPU flash
attention's per-thread blocks) and gloo's own buffers are outside it; so is the allocator's
rounding on CPU. The fake group differs from gloo in one respect found so far: on gloo ranks
a reduce-scatter's input stays alive past the point where FSDP2 drops it (the LLM unit's, the
LM head's fp32 gradient, through the embedding's backward), on the fake group it does not, so
:func:`step_peaks` at N > 1 ranks reads one such buffer lower than N gloo ranks
(``tests/test_memory_oracle.py``); at one rank it equals the trainer's step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from orchmllm.config import ModelConfig, TrainRecipe
from orchmllm.models import build_model
from orchmllm.models.mllm import MLLM
from orchmllm.models.parallelize import compute_dtype, parallelize, storage_dtype
from orchmllm.schema import IGNORE_INDEX
from orchmllm.sim.batch import Batch
from orchmllm.sim.layout import Layout
from orchmllm.train.run import set_sum_reduction

PHASES = ("forward", "backward", "optimizer")
_TOTAL = "Total"


@dataclass(frozen=True)
class RankBatch:
    """What one rank computes in a step, as lengths.

    Attributes:
        items: encoder name -> raw rows of each item the rank encodes.
        sequences: LLM tokens of each sequence the rank runs (text plus encoded items).
    """

    items: Mapping[str, tuple[int, ...]]
    sequences: tuple[int, ...]

    @classmethod
    def of_layout(cls, config: ModelConfig, batch: Batch, layout: Layout, rank: int) -> RankBatch:
        """Rank ``rank``'s share of ``batch`` laid out as ``layout``."""
        if not 0 <= rank < batch.num_ranks:
            raise ValueError(f"rank must be in [0, {batch.num_ranks}), got {rank!r}")
        items = {
            name: tuple(int(r) for r in batch.of(name).raw[layout.items[name] == rank])
            for name in config.encoders
        }
        seq = batch.llm_lengths(config)[layout.example == rank]
        return cls(items, tuple(int(s) for s in seq))


@dataclass
class PhasePeaks:
    """One step's tracked bytes: ``static``, live when it starts (sharded parameters and
    optimizer state), and per phase the peak above it with the tracker's categories
    (``by_kind``: sharded/unsharded parameters and gradients, all-gather and reduce-scatter
    buffers, activations, temporaries, optimizer state) at that peak."""

    static: int = 0
    peaks: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)


class PhaseTracker:
    """Measures each phase of a step with ``FSDPMemTracker`` (``memory=`` of
    ``orchmllm.train.forward_backward``: it has the ``phase`` of
    :class:`~orchmllm.train.phase_memory.PhaseMemory`). The tracker is entered once per phase: each
    entry starts its peak from the bytes live then, while it keeps following every tensor it
    saw, so a phase's peak counts what earlier phases left alive."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.tracker = FSDPMemTracker(model, optim)
        self.result = PhasePeaks()
        self._static: int | None = None

    def _total(self, kind: str) -> int:
        return sum(s[_TOTAL] for s in self.tracker.get_tracker_snapshot(kind).values())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the code run inside as phase ``name``; the first phase fixes the static
        bytes (what was live when it began)."""
        with self.tracker:
            if self._static is None:
                self._static = self._total("current")
                self.result.static = self._static
            yield
        peak = self.tracker.get_tracker_snapshot("peak")
        self.result.peaks[name] = self._total("peak") - self._static
        kinds: dict[str, int] = {}
        for snap in peak.values():
            for kind, n in snap.items():
                key = str(kind).rpartition(".")[2]
                kinds[key] = kinds.get(key, 0) + n
        self.result.by_kind[name] = kinds


def _rank_step(config: ModelConfig, recipe: TrainRecipe, batch: RankBatch, seed: int):
    """The rank's inputs and its step from the encoders on (what ``train.step_forward`` runs
    after the orchestrator's moves): every encoder over its items, the text embedded and
    assembled with the encoded items into the packed sequences, the LLM and its chunked loss.
    The values are random (memory depends on shapes alone)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = compute_dtype(recipe)
    inputs = {}
    encoded = 0
    for name, enc in config.encoders.items():
        raw = batch.items.get(name, ())
        bad = [r for r in raw if r % enc.rate.divisor or r < enc.rate.divisor]
        if bad:
            raise ValueError(f"items[{name!r}]: raw rows must be positive multiples of "
                             f"{enc.rate.divisor}, got {bad}")  # fmt: skip
        lengths = torch.tensor(raw, dtype=torch.int64)
        inputs[name] = (torch.randn(int(lengths.sum()), enc.feature_dim, generator=gen), lengths)
        encoded += sum(r // enc.rate.divisor for r in raw)
    tokens = sum(batch.sequences)
    if tokens < encoded:
        raise ValueError(f"sequences: {tokens} tokens cannot hold the {encoded} encoded ones")
    text_ids = torch.randint(config.vocab, (tokens - encoded,), generator=gen)
    order = torch.randperm(tokens, generator=gen)
    targets = torch.randint(config.vocab, (tokens,), generator=gen)
    targets[torch.cumsum(torch.tensor(batch.sequences), 0) - 1] = IGNORE_INDEX
    lengths = torch.tensor(batch.sequences, dtype=torch.int64)

    def forward(model: MLLM):
        outs = [model.encoders[n](x.to(dtype), ln) for n, (x, ln) in inputs.items()]
        text = model.llm.embed(text_ids)
        embeds = torch.cat([text, *(o.to(text.dtype) for o in outs)]).index_select(0, order)
        return model.llm(embeds, lengths, targets, denom=max(tokens, 1),
                         loss_chunk=recipe.loss_chunk)  # fmt: skip

    return forward


def _phase(tracker: PhaseTracker | None, name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if tracker is None else tracker.phase(name)


def step_peaks(
    config: ModelConfig,
    recipe: TrainRecipe,
    world_size: int,
    batch: RankBatch,
    *,
    seed: int = 0,
    lr: float = 1e-3,
) -> PhasePeaks:
    """One rank's step at ``world_size`` ranks, measured by torch's tracker per phase.

    Builds and shards the model as the trainer does (``build_model``, ``parallelize``: the
    recipe's precision and checkpointing, FSDP2 with its default reshard and prefetch, sum
    reduction), with AdamW, on a fake process group of ``world_size`` ranks that this call
    creates and destroys (so the process must have none). Runs two steps of ``batch`` and
    returns the second's phases (AdamW's state exists by then; the first step's batch is
    gone, as in a step measured on its own)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError(
            "step_peaks creates its own fake process group: call it in a process without one"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return rank_step_peaks(config, recipe, batch, seed=seed, lr=lr)
    finally:
        dist.destroy_process_group()


def rank_step_peaks(
    config: ModelConfig, recipe: TrainRecipe, batch: RankBatch, *, seed: int = 0, lr: float = 1e-3
) -> PhasePeaks:
    """:func:`step_peaks` on the process group already there (every rank of it calls)."""
    model = build_model(config, seed=seed, dtype=storage_dtype(recipe))
    model = parallelize(model, recipe=recipe)
    set_sum_reduction(model)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    forward = _rank_step(config, recipe, batch, seed)
    for tracker in (None, PhaseTracker(model, optim)):
        with _phase(tracker, "forward"):
            loss = model(forward)
        with _phase(tracker, "backward"):
            loss.backward()
        del loss
        with _phase(tracker, "optimizer"):
            optim.step()
            optim.zero_grad(set_to_none=True)
    return tracker.result
