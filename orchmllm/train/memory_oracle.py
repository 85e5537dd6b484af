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

What works on the CPU build (torch 2.13):

- fake tensors + fake process group + ``FSDPMemTracker`` (torchtitan's way; the default of
  :func:`step_peaks`): nothing of the model, its gradients, activations or optimizer state is
  allocated or computed, so MLLM-10B at 64 ranks runs on this machine (its widths with one
  block per module in seconds, all its blocks in minutes). Three things stood in the way:
  the models read their lengths as values (``check_lengths``'s minimum, the packed width
  ``int(lengths.sum())``, ``lengths.tolist()`` to split by, the padded audio width
  ``int(lengths.max())``), which a fake tensor refuses (``DataDependentOutputException:
  aten._local_scalar_dense``), and index with boolean masks of the padded frames
  (``DynamicOutputShapeException: aten.nonzero``): :class:`HostIntegers` keeps the integer
  tensors real. ``build_model``'s ``Module.to(dtype)`` swapped every parameter, which a fake
  tensor refuses ("Couldn't swap Linear.weight": the fake mode holds a weak reference to
  it): it converts only parameters of another dtype now, so ``float64`` (built in fp32 and
  converted) is the one precision fake tensors refuse. The device mesh reads its rank map
  as values: it is made before the fake mode. It measures exactly what the same step on
  real tensors measures, byte for byte per phase and kind
  (``tests/test_memory_oracle_fake.py``).
- fake process group + real tensors (``fake_tensors=False``): the rank's step really
  computes (on garbage gathered weights: the fake all-gather fills nothing).
- The orchestrator's exchange cannot run on the fake group (its all-to-alls deliver nothing,
  so the received sizes are wrong): :func:`step_peaks` runs the step from the rank's own
  items on (its encoders, the assembly, the LLM and its loss), the shapes the orchestrator
  would have delivered (:class:`RankBatch`).

The tracker counts tensors, not the allocator: kernels' internal workspaces (the CPU flash
attention's per-thread blocks) are outside it, and so is the allocator's rounding on CPU.
It does see gloo's own buffer: gloo's reduce-scatter returns its result through a buffer
the size of its input, made in the collective's ``work.wait()``; FSDP2 on NCCL and the fake
group have none, so on N > 1 gloo ranks the trainer's backward tracks one reduce-scatter
input (the LLM unit's, alive through the token embedding's backward) more than
:func:`step_peaks` (``tests/test_memory_oracle.py`` measures it apart); at one rank no
collective runs and the two agree.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from orchmllm.config import ModelConfig, TrainRecipe, load_config
from orchmllm.data.recipe import ItemLengths
from orchmllm.models import build_model
from orchmllm.models.mllm import MLLM
from orchmllm.models.parallelize import compute_dtype, parallelize, storage_dtype
from orchmllm.schema import IGNORE_INDEX
from orchmllm.sim.batch import Batch
from orchmllm.sim.layout import Layout
from orchmllm.sim.memory import MemoryModel
from orchmllm.train.run import set_sum_reduction

PHASES = ("forward", "backward", "optimizer")
_TOTAL = "Total"
aten = torch.ops.aten
_INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default)
# Precisions whose storage dtype is the one the model is built in (no dtype conversion).
_FAKE_PRECISIONS = frozenset({"float32", "bf16-mixed"})


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


class HostIntegers(TorchDispatchMode):
    """Under ``FakeTensorMode``, computes the step's integer tensors for real.

    The models pack variable-length sequences, so they read lengths as values: a sum for a
    width (``packed_attention``, ``positions_from_lengths``), a list to split by, a maximum
    for the padded audio width, a minimum to check, boolean masks of the padded frames to
    index with. A fake tensor has no values and refuses each of those reads
    (``DataDependentOutputException: aten._local_scalar_dense``; the masks'
    ``DynamicOutputShapeException: aten.nonzero``). This mode runs every op whose tensors are
    all real (a length, a token id, a target, anything derived from them alone), and every
    factory of an integer or boolean dtype, on real tensors with the fake mode set aside; an
    op that mixes in a fake tensor goes to the fake mode (which takes the real ones as
    inputs), with a real boolean index turned into its positions first (``x[mask]`` is
    ``x[mask.nonzero().unbind(1)]``), so the output's shape is known. Floating factories stay
    fake: they are the model's weights, activations and buffers. The real tensors are the
    step's own (the same shapes and dtypes as in a real step), and the tracker counts them.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if all(map(_is_real, tensors)) and (tensors or _integer_factory(func, args, kwargs)):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in _INDEXING and any(_is_real(i) and i.dtype == torch.bool for i in args[1]):
            with unset_fake_temporarily():
                positions = [
                    p
                    for i in args[1]
                    for p in (
                        i.nonzero().unbind(1) if _is_real(i) and i.dtype == torch.bool else (i,)
                    )
                ]
            args = (args[0], positions, *args[2:])
        return func(*args, **kwargs)


def _is_real(t: torch.Tensor | None) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)


def _integer_factory(func, args, kwargs) -> bool:
    """Whether ``func`` makes a new tensor of an integer or boolean dtype from no tensor
    (``arange`` of ints without a dtype makes int64)."""
    dtype = kwargs.get("dtype")
    if dtype is None and func.overloadpacket is aten.arange:
        dtype = torch.int64 if all(isinstance(a, int) for a in args) else None
    return dtype is not None and not dtype.is_floating_point and not dtype.is_complex


class _RankStep:
    """The rank's inputs and its step from the encoders on (what ``train.step_forward`` runs
    after the orchestrator's moves): every encoder over its items, the text embedded and
    assembled with the encoded items into the packed sequences, the LLM and its chunked loss.
    The values are random (memory depends on shapes alone). As the trainer's ``LLMBatch``,
    the encoder outputs, the targets and the loss mask live to the step's end (``held``,
    cleared by :meth:`end`)."""

    def __init__(self, config: ModelConfig, recipe: TrainRecipe, batch: RankBatch, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.config, self.recipe = config, recipe
        self.inputs = {}
        encoded = 0
        for name, enc in config.encoders.items():
            raw = batch.items.get(name, ())
            bad = [r for r in raw if r % enc.rate.divisor or r < enc.rate.divisor]
            if bad:
                raise ValueError(f"items[{name!r}]: raw rows must be positive multiples of "
                                 f"{enc.rate.divisor}, got {bad}")  # fmt: skip
            lengths = torch.tensor(raw, dtype=torch.int64)
            rows = torch.randn(int(lengths.sum()), enc.feature_dim, generator=self.gen)
            self.inputs[name] = (rows, lengths)
            encoded += sum(r // enc.rate.divisor for r in raw)
        self.tokens = sum(batch.sequences)
        if self.tokens < encoded:
            raise ValueError(
                f"sequences: {self.tokens} tokens cannot hold the {encoded} encoded ones"
            )
        self.text_ids = torch.randint(config.vocab, (self.tokens - encoded,), generator=self.gen)
        self.order = torch.randperm(self.tokens, generator=self.gen)
        self.lengths = torch.tensor(batch.sequences, dtype=torch.int64)
        self.held: list[torch.Tensor] = []

    def __call__(self, model: MLLM) -> torch.Tensor:
        dtype = compute_dtype(self.recipe)
        outs = [model.encoders[n](x.to(dtype), ln) for n, (x, ln) in self.inputs.items()]
        targets = torch.randint(self.config.vocab, (self.tokens,), generator=self.gen)
        targets[torch.cumsum(self.lengths, 0) - 1] = IGNORE_INDEX
        text = model.llm.embed(self.text_ids)
        outs = [o.to(text.dtype) for o in outs]
        self.held = [*outs, targets, targets != IGNORE_INDEX]
        embeds = torch.cat([text, *outs]).index_select(0, self.order)
        return model.llm(embeds, self.lengths, targets, denom=max(self.tokens, 1),
                         loss_chunk=self.recipe.loss_chunk)  # fmt: skip

    def end(self) -> None:
        self.held = []


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
    fake_tensors: bool = True,
) -> PhasePeaks:
    """One rank's step at ``world_size`` ranks, measured by torch's tracker per phase.

    Builds and shards the model as the trainer does (``build_model``, ``parallelize``: the
    recipe's precision and checkpointing, FSDP2 with its default reshard and prefetch, sum
    reduction), with AdamW, on a fake process group of ``world_size`` ranks that this call
    creates and destroys (so the process must have none). Runs two steps of ``batch`` and
    returns the second's phases (AdamW's state exists by then; the first step's batch is
    gone, as in a step measured on its own).

    With ``fake_tensors`` (the default) the model, its gradients, activations and optimizer
    state are fake tensors: nothing of them is allocated or computed, so a paper-scale model
    costs what its op count does; the step's integer tensors (lengths, token ids, targets
    and whatever the models derive from them) stay real (:class:`HostIntegers`). Without it
    the rank's step computes on real tensors (the same figures, ``tests/test_memory_oracle.py``).
    """
    return step_peaks_many(
        config, recipe, world_size, [batch], seed=seed, lr=lr, fake_tensors=fake_tensors
    )[0]


def step_peaks_many(
    config: ModelConfig,
    recipe: TrainRecipe,
    world_size: int,
    batches: Sequence[RankBatch],
    *,
    seed: int = 0,
    lr: float = 1e-3,
    fake_tensors: bool = True,
    foreach: bool | None = None,
) -> list[PhasePeaks]:
    """:func:`step_peaks` of each of ``batches`` on one built model: a step of the first
    batch untracked, then one tracked step of each (AdamW's state exists from the first on,
    and nothing of a step outlives it, so each figure is what :func:`step_peaks` of that
    batch alone gives; ``tests/test_memory_fit.py`` checks it). Building and sharding the
    model once is what makes tracing a design of shapes cheap. ``foreach``: AdamW's
    implementation (None: torch's choice for the tensors' device, the single-tensor loop on
    CPU; True: the multi-tensor one CUDA runs, whose temporaries span a parameter group)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if not batches:
        raise ValueError("batches must hold at least one RankBatch, got none")
    if recipe.precision not in _FAKE_PRECISIONS and fake_tensors:
        raise ValueError(
            f"fake_tensors needs a recipe.precision in {sorted(_FAKE_PRECISIONS)}, got "
            f"{recipe.precision!r} (converting a built model's dtype swaps its fake parameters, "
            "which torch refuses)"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "step_peaks creates its own fake process group: call it in a process without one"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        if not fake_tensors:
            return _measure(config, recipe, batches, seed=seed, lr=lr, foreach=foreach)
        # The mesh reads its rank map as values, so it is made before the fake mode.
        mesh = init_device_mesh("cpu", (world_size,))
        with FakeTensorMode(allow_non_fake_inputs=True), HostIntegers():
            return _measure(config, recipe, batches, seed=seed, lr=lr, mesh=mesh, foreach=foreach)
    finally:
        dist.destroy_process_group()


def rank_step_peaks(
    config: ModelConfig, recipe: TrainRecipe, batch: RankBatch, *, seed: int = 0, lr: float = 1e-3
) -> PhasePeaks:
    """:func:`step_peaks` on the process group already there (every rank of it calls), on
    real tensors."""
    return _measure(config, recipe, [batch], seed=seed, lr=lr)[0]


def _measure(
    config: ModelConfig,
    recipe: TrainRecipe,
    batches: Sequence[RankBatch],
    *,
    seed: int,
    lr: float,
    mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
) -> list[PhasePeaks]:
    model = build_model(config, seed=seed, dtype=storage_dtype(recipe))
    model = parallelize(model, recipe=recipe, mesh=mesh)
    set_sum_reduction(model)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, foreach=foreach)
    out = []
    for i, batch in enumerate([batches[0], *batches]):
        tracker = PhaseTracker(model, optim) if i else None
        forward = _RankStep(config, recipe, batch, seed)
        with _phase(tracker, "forward"):
            loss = model(forward)
        with _phase(tracker, "backward"):
            loss.backward()
        del loss
        with _phase(tracker, "optimizer"):
            optim.step()
            optim.zero_grad(set_to_none=True)
        forward.end()
        if tracker is not None:
            out.append(tracker.result)
    return out


def symmetric_batch(
    world_size: int, items: Mapping[str, tuple[int, ...]], text: tuple[int, ...]
) -> tuple[Batch, Layout]:
    """A global batch in which every rank samples and runs the same examples (nothing
    moves): ``text`` tokens of each, ``items[name]`` the raw rows of its items (the i-th
    item belongs to example ``i % len(text)``)."""
    n = len(text)
    lengths, where = {}, {}
    for name, raw in items.items():
        owner = np.concatenate([np.arange(len(raw)) % n + r * n for r in range(world_size)])
        lengths[name] = ItemLengths(owner, np.tile(np.asarray(raw, np.int64), world_size))
        where[name] = owner // n
    batch = Batch(world_size, np.tile(np.asarray(text, np.int64), world_size), lengths)
    return batch, Layout(np.arange(world_size * n) // n, where)


def against_model(
    config: ModelConfig, recipe: TrainRecipe, world_size: int, batch: Batch, layout: Layout
) -> dict[str, tuple[int, float]]:
    """Rank 0's step of ``batch`` (laid out as ``layout``, no moves) measured by
    :func:`step_peaks` and predicted by the memory model without the attention kernels'
    workspaces (the tracker's scope): phase (and ``static``) -> (measured, predicted)."""
    measured = step_peaks(config, recipe, world_size, RankBatch.of_layout(config, batch, layout, 0))
    memory = MemoryModel(device="cpu", threads=1, shard_group=world_size, previous_batch=False)
    features = memory.rank_features(config, recipe, batch, layout)
    bare = {k: 0 * v if k.endswith((".attn_fwd", ".attn_bwd")) else v for k, v in features.items()}
    peaks = memory.phase_peaks(config, recipe, bare, num_ranks=world_size, moves=frozenset())
    out = {ph: (measured.peaks[ph], float(np.asarray(peaks[ph])[0])) for ph in PHASES}
    out["static"] = (measured.static, memory.static_bytes(config, recipe, world_size))
    return out


def with_layers(model: ModelConfig, layers: int) -> ModelConfig:
    """``model`` with ``layers`` blocks in every module (its widths kept): a paper config's
    shapes at the cost of a few blocks."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers!r}")
    return dataclasses.replace(
        model,
        encoders={n: dataclasses.replace(e, layers=layers) for n, e in model.encoders.items()},
        llm=dataclasses.replace(model.llm, layers=layers),
    )


def _lengths(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> None:
    """``python -m orchmllm.train.memory_oracle``: the oracle beside the memory model for
    one rank of a batch every rank holds alike, per phase."""
    p = argparse.ArgumentParser(
        prog="python -m orchmllm.train.memory_oracle", description=main.__doc__
    )
    p.add_argument("--config", required=True)
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=0, help="blocks per module (0: the config's)")
    p.add_argument("--text", default="2000,3000", help="text tokens of each example of a rank")
    p.add_argument("--items", action="append", default=[], metavar="NAME=ROWS,...",
                   help="raw rows of a modality's items on a rank (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    model = cfg.model
    if args.layers < 0:
        p.error(f"--layers must be >= 0, got {args.layers}")
    if args.layers:
        model = with_layers(model, args.layers)
    items = {}
    for spec in args.items:
        name, _, rows = spec.partition("=")
        if name not in model.encoders:
            p.error(f"--items {spec!r}: {name!r} is no encoder of the config")
        items[name] = _lengths(rows)
    batch, layout = symmetric_batch(args.world_size, items, _lengths(args.text))
    rows = against_model(model, cfg.recipe, args.world_size, batch, layout)
    print(f"{args.config}, {args.world_size} ranks, rank 0 (MB): phase, oracle, model, ratio")
    for ph, (m, pred) in rows.items():
        print(f"{ph:<10}{m / 1e6:>12.1f}{pred / 1e6:>12.1f}{m / pred:>8.3f}")


if __name__ == "__main__":
    main()
