"""What balancing buys in step time: data parallelism emulated faithfully on one device.

One GPU cannot run many NCCL ranks, so this emulates ``--ranks`` data-parallel ranks:

1. sample every rank's mini-batch from the synthetic multimodal mix (the training generator,
   ``orchmllm.data.synthetic``), disjoint examples per rank and per step;
2. gather their segment tables and plan them exactly as training does, with the orchestrator's
   pure planning function (``orchmllm.plan_step``, the config's policies) for each
   mode: ``none`` (no rearrangement), ``llm`` (only the LLM phase balanced, the pre-balancing
   ablation) and ``full`` (every phase balanced, OrchMLLM);
3. run each rank's step on the device, one rank after another, in training order: vision
   forward, audio forward, LLM forward+backward, audio backward, vision backward. The LLM gets
   the rank's examples in the LLM layout: text embeddings interleaved with stand-in encoder
   outputs (leaf tensors of the encoded lengths; their gradients are what the all-to-all would
   send back), so its compute and memory are those of the real step. Each encoder's backward
   takes a random upstream gradient of its output's shape.

Timing (the "sound step"): per rank, every mode's exact inputs run once untimed, so every
shape the timed runs meet is warm (kernel selection, allocator, caches: a new shape's first
call is what ``--new-shape-cost`` measures); then ``--repeats`` (3) timed rounds, each running
every mode, in an order rotated each round, so the modes see the same state. A phase's time on
a rank is the median of its repeats; the record keeps the spread (``<phase>_spread_max``) and
every repeat's step. CUDA events time the phases on a GPU (read after a synchronize at the end
of each rank's step); on CPU the thread's CPU time (torch runs single-threaded there), which on
a shared CPU does not count other processes' time slices.

Self-check: ``llm`` balances only the LLM, so every encoder runs the very same inputs on every
rank under ``none`` and ``llm``; their encoder phases must time within ``--tolerance`` (5%) of
each other (slowest rank and mean rank), else the record is marked unsound (``sound``,
``unsound_phases``). Every record carries ``definitions`` (what each figure means), a
``run_id`` and, per phase, measured over simulated (``<phase>_<max|mean>_over_sim``).

The emulated step time is, per phase, the slowest rank's time (FSDP's collectives make every
rank wait for it), summed over phases, plus the dispatch cost: the measured planning time
(zero for ``none``, which plans nothing) and the all-to-all time estimated from the planned
moves (largest per-rank send or receive volume of each move over ``--link-gbs``; one device
cannot measure NVLink). The ideal step gives every phase its mean rank time.

Per mode it reports: step time, speed-up over ``none`` (and ``llm``), per-phase imbalance
(measured max/mean time; also the planner's cost-model imbalance), peak memory of the worst
rank, LLM tokens/s per GPU and the ratio to the ideal step. Beside each figure it prints the
simulator's prediction for the same set-up and the very batches it sampled
(:class:`orchmllm.sim.emulated.EmulatedSetup`: model shape and layers, ranks, examples per
rank, modes, link speed, no optimizer), stored as ``sim_<figure>`` in every record. The targets
of the full mode (speed-up over ``none`` and ``llm``, step over ideal) are these predictions: a
measured figure on the wrong side of its prediction is printed as a miss, a finding to report
with the figures, not a failure to hide.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over a rank's whole step (gradients
are dropped between ranks, so every rank starts from the parameters alone). On CPU there is no
allocator counter, so a documented proxy is used: parameter bytes + gradient bytes + the bytes
of every tensor autograd saved for backward during the rank's three forwards (deduplicated by
storage), which is what is alive when the LLM backward starts.

Model. On CUDA the default is ``configs/mllm-10b.yaml`` (the paper's MLLM-10B: hidden and FFN
sizes, heads, vocabulary 152064, downsample rates and image/audio bounds unchanged) with every
module's layer count divided by ``--layer-divisor`` (default 4: LLM 28 -> 7, vision 36 -> 9,
audio 32 -> 8 layers), so parameters, gradients and the activations of 60 examples fit one
80 GB GPU; the layer ratios between modules, and so the phases' shares of the step, are kept
(the embedding, LM head and connectors are not scaled). The step runs the config's training
recipe, the trainer's (``recipe:``, :mod:`orchmllm.models.parallelize`): for MLLM-10B bf16
compute (parameters stored in bf16: one device and no optimizer need no fp32 master weights),
activation checkpointing of every block and a chunked LM-head loss (the full
``[tokens, 152064]`` logits would not fit). With no GPU it runs ``configs/tiny.yaml`` on CPU
(float32, no checkpointing), so the whole path is testable.

From the checkout's root (nothing to install; the C++ planner core is built in place first,
since a fresh clone does not have it)::

    python setup.py build_ext --inplace
    python -m benchmarks.gpu_step [--quick] [--ranks R] [--examples-per-rank B ...] [--json PATH]
    python -m benchmarks.gpu_step --new-shape-cost [--json PATH]

``benchmarks/gpu_check.py`` runs it at the set-ups the project reports (8 ranks x 60 and 32 x
20, layers / 8), together with the other GPU checks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from orchmllm.config import RunConfig, load_config
from orchmllm.data import TEXT, SyntheticConfig, generate_example
from orchmllm.data.recipe import ItemLengths
from orchmllm.models import MLLM, apply_checkpointing, build_model, compute_dtype
from orchmllm.planner.segments import local_metadata
from orchmllm.planner.step_options import MODES, StepOptions, default_phases
from orchmllm.planner.step_plan import plan_step
from orchmllm.provenance import RUN_ID_ENV, write_records
from orchmllm.schema import IGNORE_INDEX, LLM, MODALITIES
from orchmllm.sim.batch import Batch
from orchmllm.sim.emulated import EmulatedSetup

ROOT = Path(__file__).resolve().parents[1]


# -- model set-up --------------------------------------------------------------------------


def scale_layers(cfg: RunConfig, divisor: int) -> RunConfig:
    """Every module's layer count divided by ``divisor`` (at least 1); nothing else changes."""
    if divisor < 1:
        raise ValueError(f"layer_divisor must be >= 1, got {divisor!r}")
    m = cfg.model

    def fewer(sub):
        return dataclasses.replace(sub, layers=max(1, round(sub.layers / divisor)))

    encoders = {name: fewer(enc) for name, enc in m.encoders.items()}
    model = dataclasses.replace(m, encoders=encoders, llm=fewer(m.llm))
    return dataclasses.replace(cfg, model=model)


# -- sampling and planning -------------------------------------------------------------------


def sample_ranks(cfg: RunConfig, *, step: int, ranks: int, per_rank: int, seed: int) -> list:
    """``ranks`` mini-batches of ``per_rank`` synthetic examples; disjoint ids across steps."""
    syn = SyntheticConfig.for_run(cfg, num_examples=0, seed=seed)
    base = step * ranks * per_rank
    return [
        [generate_example(base + r * per_rank + j, syn, cfg.rates) for j in range(per_rank)]
        for r in range(ranks)
    ]


def gathered_rows(batches: Sequence[Sequence[dict]]) -> tuple[np.ndarray, np.ndarray]:
    """What ``comm.all_gather_rows(local_metadata(...))`` returns on every rank: rank order."""
    tables = [local_metadata(b) for b in batches]
    src = np.concatenate([np.full(t.shape[0], r, dtype=np.int64) for r, t in enumerate(tables)])
    return np.concatenate(tables), src


def sim_batch(batches: Sequence[Sequence[dict]]) -> Batch:
    """The simulator's view of the sampled mini-batches (lengths only, rank order): what
    :class:`~orchmllm.sim.emulated.EmulatedSetup` predicts the step of."""
    examples = [ex for b in batches for ex in b]

    def items(key: str) -> ItemLengths:
        owner = [i for i, ex in enumerate(examples) for _ in ex.get(key, ())]
        return ItemLengths(
            np.asarray(owner, np.int64),
            np.asarray([len(a) for ex in examples for a in ex.get(key, ())], np.int64),
        )

    return Batch(
        len(batches),
        np.asarray([len(ex["input_ids"]) for ex in examples], np.int64),
        {m.name: items(m.key) for m in MODALITIES.values()},
    )


def make_phases(cfg: RunConfig):
    """The encoder phases as training plans them (policies from the config)."""
    return default_phases(
        cfg.rates,
        feature_dims=cfg.model.feature_dims,
        policies={name: cfg.balance.policy(name) for name in cfg.model.encoders},
    )


def ranks_per_node(cfg: RunConfig, ranks: int) -> int:
    """The config's ranks per node (8, one H100 node, when unset), at most ``ranks``."""
    rpn = min(cfg.balance.ranks_per_node or 8, ranks)
    if ranks % rpn:
        raise ValueError(f"ranks={ranks} is not a multiple of ranks_per_node={rpn}")
    return rpn


def plan_mode(
    rows: np.ndarray, src: np.ndarray, cfg: RunConfig, *, ranks: int, mode: str, repeats: int = 3
):
    """One mode's plan, as training makes it (``orchmllm.train.run.make_orchestrator``: the
    config's policies and node-wise placement), and its planning time, the dispatch cost on
    the critical path: the fastest of ``repeats`` runs, since planning is deterministic CPU
    work and slower runs measure only interference from other processes."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        options = StepOptions(
            make_phases(cfg),
            mode=mode,
            llm_policy=cfg.balance.policy(LLM),
            placement=cfg.balance.placement,
            ranks_per_node=ranks_per_node(cfg, ranks),
        )
        plan = plan_step(rows, src, options, num_ranks=ranks)
        best = min(best, time.perf_counter() - t0)
    return plan, best


def a2a_estimate_s(plan, cfg: RunConfig, *, elem_bytes: int, link_bytes_per_s: float) -> float:
    """All-to-all time of the plan's moves at ``link_bytes_per_s`` per rank and direction.

    Per encoder: raw inputs to the encoder layout, outputs to the LLM layout (forward) and
    their gradients back (backward); text ids and loss mask (2 x int64) to the LLM layout.
    Each move waits for its busiest rank.
    """
    row_bytes = {name: enc.feature_dim * elem_bytes for name, enc in cfg.model.encoders.items()}
    out_bytes = cfg.model.llm.hidden * elem_bytes

    def busiest(move, sizes, width) -> float:
        t = move.traffic(sizes=sizes)
        return max(t["max_sent_rank"], t["max_recv_rank"]) * width

    total = busiest(plan.llm, plan.text_len, 16)
    for name, pp in plan.phases.items():
        total += busiest(pp.encoder, pp.raw, row_bytes[name])
        total += 2 * busiest(pp.to_llm, pp.encoded, out_bytes)
    return total / link_bytes_per_s


# -- one rank's step ---------------------------------------------------------------------------


@dataclass
class RankWork:
    """One rank's inputs in its planned layouts (CPU tensors).

    Attributes:
        raw: encoder name -> its items' raw rows in the encoder layout, concatenated.
        raw_lengths: encoder name -> raw rows per item.
        input_ids, targets, seq_lengths: the LLM's text, targets per position and sequences.
        order: LLM input = cat([text embeds, stand-in encoder tokens])[order].
        encoder_tokens: rows of the stand-in encoder outputs.
    """

    raw: dict[str, Tensor]
    raw_lengths: dict[str, Tensor]
    input_ids: Tensor
    targets: Tensor
    seq_lengths: Tensor
    order: Tensor
    encoder_tokens: int

    @property
    def llm_tokens(self) -> int:
        return int(self.seq_lengths.sum())


def _cat(arrays: list, width: int, dtype: torch.dtype) -> Tensor:
    if not arrays:
        return torch.zeros(0, width, dtype=dtype)
    return torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.float32) for a in arrays])).to(
        dtype
    )


def _ints(parts: list) -> Tensor:
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(np.concatenate(parts).astype(np.int64))


def rank_work(plan, rank: int, examples: list[dict], cfg: RunConfig, dtype) -> RankWork:
    """``rank``'s encoder items and LLM sequences under ``plan``; ``examples`` in gather order."""
    raw, raw_lengths = {}, {}
    for name, enc in cfg.model.encoders.items():
        items = [a for ex in examples for a in ex[MODALITIES[name].key]]
        phase = plan.phases[name]
        mine = phase.encoder.items_at(rank)
        raw[name] = _cat([items[i] for i in mine], enc.feature_dim, dtype)
        raw_lengths[name] = torch.as_tensor(phase.raw[mine], dtype=torch.int64)
    ids, labels, text_rows, standin_rows, seq_lengths = [], [], [], [], []
    pos = 0
    for e in plan.llm.items_at(rank):
        ex = examples[e]
        tokens = np.asarray(ex["input_ids"], dtype=np.int64)
        mask = np.asarray(ex["loss_mask"]) != 0
        start, text_at = pos, 0
        for kind, count in ex["segments"]:
            if kind == TEXT:
                piece = slice(text_at, text_at + count)
                ids.append(tokens[piece])
                labels.append(np.where(mask[piece], tokens[piece], IGNORE_INDEX))
                text_rows.append(np.arange(pos, pos + count))
                text_at += count
                pos += count
            else:
                n = count // cfg.rates.divisor(kind)
                labels.append(np.full(n, IGNORE_INDEX, dtype=np.int64))
                standin_rows.append(np.arange(pos, pos + n))
                pos += n
        seq_lengths.append(pos - start)
    # Position p predicts the label at p + 1 of the same sequence.
    label = _ints(labels)
    targets = torch.cat([label[1:], torch.tensor([IGNORE_INDEX])]) if pos else label
    ends = torch.cumsum(torch.as_tensor(seq_lengths, dtype=torch.int64), 0) - 1
    targets[ends] = IGNORE_INDEX
    return RankWork(
        raw=raw,
        raw_lengths=raw_lengths,
        input_ids=_ints(ids),
        targets=targets,
        seq_lengths=torch.as_tensor(seq_lengths, dtype=torch.int64),
        order=torch.argsort(_ints(text_rows + standin_rows)),
        encoder_tokens=sum(r.size for r in standin_rows),
    )


@dataclass
class RankResult:
    times: dict[str, float]  # phase -> forward + backward seconds
    peak_bytes: int  # CUDA: allocator peak; CPU: parameters + gradients + saved tensors
    llm_tokens: int
    items: dict[str, int]  # encoder name -> items this rank encoded


class _Clock:
    """CUDA events on GPU (read after one synchronize); on CPU the calling thread's CPU time
    (``time.thread_time``: torch runs single-threaded there, so every op runs in this thread),
    which, unlike wall time, does not count the time slices other processes take on a shared
    CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.thread_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class _SavedBytes:
    """CPU memory proxy: bytes of the storages autograd saves for backward (not parameters)."""

    def __init__(self, params: Sequence[Tensor]):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}

    def _pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


@dataclass
class Emulator:
    """The model on the device, run as one rank at a time."""

    cfg: RunConfig
    device: torch.device
    dtype: torch.dtype
    model: MLLM

    @classmethod
    def build(cls, cfg: RunConfig, *, device: torch.device, seed: int) -> Emulator:
        """The model under the config's training recipe as one rank runs it: parameters in
        the compute dtype (bf16 for ``bf16-mixed``: one device, no optimizer, so no master
        weights), the recipe's activation checkpointing, its chunked loss."""
        dtype = compute_dtype(cfg.recipe)
        model = build_model(cfg.model, seed=seed, dtype=dtype, device=device)
        apply_checkpointing(model, recipe=cfg.recipe)
        return cls(cfg, device, dtype, model)

    def params(self) -> list[Tensor]:
        return list(self.model.parameters())

    def run(self, work: RankWork, *, denom: float) -> RankResult:
        """One rank's step in training order (each encoder's forward, the LLM's forward and
        backward, each encoder's backward in reverse); times each phase's forward and
        backward."""
        dev, dt, hidden = self.device, self.dtype, self.cfg.model.llm.hidden
        encoders = self.cfg.model.encoders
        params = self.params()
        for p in params:
            p.grad = None
        raw = {n: t.to(dev, non_blocking=True) for n, t in work.raw.items()}
        lengths = {n: t.to(dev, non_blocking=True) for n, t in work.raw_lengths.items()}
        ids, order = work.input_ids.to(dev), work.order.to(dev)
        seq_lengths, targets = work.seq_lengths.to(dev), work.targets.to(dev)
        upstream = {
            n: torch.randn(int(lengths[n].sum()) // e.rate.divisor, hidden, device=dev, dtype=dt)
            for n, e in encoders.items()
        }
        standin = torch.randn(work.encoder_tokens, hidden, device=dev, dtype=dt)
        standin.requires_grad_(True)
        clock = _Clock(dev)
        saved = _SavedBytes(params)
        if clock.cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        forward, backward, out = {}, {}, {}
        with contextlib.nullcontext() if clock.cuda else saved.hooks():
            for name in encoders:
                start = clock.mark()
                out[name] = self.model.encoders[name](raw[name], lengths[name])
                forward[name] = (start, clock.mark())
            start = clock.mark()
            embeds = torch.cat([self.model.llm.embed(ids), standin])[order]
            loss = self.model.llm(
                embeds, seq_lengths, targets, denom=denom, loss_chunk=self.cfg.recipe.loss_chunk
            )
        loss.backward()
        forward[LLM] = (start, clock.mark())
        for name in reversed(encoders):
            start = clock.mark()
            if out[name].requires_grad:
                out[name].backward(upstream[name])
            backward[name] = (start, clock.mark())
        if clock.cuda:
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev)
        else:
            grads = sum(p.grad.nbytes for p in params if p.grad is not None)
            peak = sum(p.nbytes for p in params) + grads + saved.total
        times = {n: clock.seconds(*forward[n]) for n in forward}
        for name, span in backward.items():
            times[name] += clock.seconds(*span)
        return RankResult(
            times,
            int(peak),
            work.llm_tokens,
            {n: t.numel() for n, t in work.raw_lengths.items()},
        )


# -- the emulated step -------------------------------------------------------------------------


@dataclass
class StepResult:
    """One emulated step of one mode: per phase and rank, the median of the timed repeats."""

    phases: tuple[str, ...]  # each encoder's, then the LLM's
    phase_times: np.ndarray  # (phases, ranks) seconds: median of the repeats
    phase_spread: np.ndarray  # (phases, ranks): (slowest - fastest repeat) / median
    repeat_steps: np.ndarray  # (repeats,) the step (compute) of each repeat alone
    plan_s: float
    a2a_s: float
    plan_imbalance: dict[str, float]
    peak_bytes: int
    llm_tokens: int
    items: dict[str, int]  # encoder name -> items encoded over all ranks
    raw_lengths: list[dict[str, Tensor]]  # per rank: encoder name -> raw rows per item

    @property
    def dispatch_s(self) -> float:
        return self.plan_s + self.a2a_s

    @property
    def step_s(self) -> float:
        return float(self.phase_times.max(axis=1).sum()) + self.dispatch_s

    @property
    def ideal_s(self) -> float:
        return float(self.phase_times.mean(axis=1).sum())


def emulate_modes(
    emu: Emulator,
    batches: Sequence[Sequence[dict]],
    *,
    link_bytes_per_s: float,
    modes: tuple[str, ...] = MODES,
    repeats: int = 3,
) -> dict[str, StepResult]:
    """Plan ``batches`` (one per rank) for every mode and time every rank's step in each.

    Per rank, every mode's exact inputs run once untimed first (each shape the timed runs meet
    is then warm: kernel selection, allocator, caches), then ``repeats`` timed rounds, each
    running every mode, in an order rotated each round (so no mode always runs first or
    follows the same one): all modes see the same state and drift hits them alike. A phase's
    time is the median of its repeats.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    ranks = len(batches)
    rows, src = gathered_rows(batches)
    examples = [ex for b in batches for ex in b]
    elem = torch.empty((), dtype=emu.dtype).element_size()
    plans, plan_s = {}, {}
    for mode in modes:
        plans[mode], plan_s[mode] = plan_mode(rows, src, emu.cfg, ranks=ranks, mode=mode)
    phases = emu.cfg.phases
    times = {m: np.zeros((len(phases), ranks, repeats)) for m in modes}
    runs: dict[str, list[RankResult]] = {m: [] for m in modes}
    lengths: dict[str, list] = {m: [] for m in modes}
    for r in range(ranks):
        works = {m: rank_work(plans[m], r, examples, emu.cfg, emu.dtype) for m in modes}
        for m in modes:  # warm: this rank's exact shapes, untimed
            emu.run(works[m], denom=plans[m].num_targets)
        for k in range(repeats):
            for m in modes[k % len(modes) :] + modes[: k % len(modes)]:  # each first in turn
                run = emu.run(works[m], denom=plans[m].num_targets)
                times[m][:, r, k] = [run.times[p] for p in phases]
                runs[m].append(run)
        for m in modes:
            lengths[m].append(works[m].raw_lengths)
    out = {}
    for m in modes:
        t = times[m]
        median = np.median(t, axis=2)
        with np.errstate(divide="ignore", invalid="ignore"):  # a phase with no item: 0 / 0
            spread = np.nan_to_num((t.max(axis=2) - t.min(axis=2)) / median)
        stats = plans[m].stats()
        out[m] = StepResult(
            phases=phases,
            phase_times=median,
            phase_spread=spread,
            repeat_steps=t.max(axis=1).sum(axis=0),
            plan_s=0.0 if m == "none" else plan_s[m],  # training without balancing plans nothing
            a2a_s=a2a_estimate_s(
                plans[m], emu.cfg, elem_bytes=elem, link_bytes_per_s=link_bytes_per_s
            ),
            plan_imbalance={p: float(stats[p]["imbalance_after"]) for p in phases},
            peak_bytes=max(run.peak_bytes for run in runs[m]),
            llm_tokens=sum(run.llm_tokens for run in runs[m][::repeats]),
            items={
                n: sum(run.items[n] for run in runs[m][::repeats]) for n in emu.cfg.model.encoders
            },
            raw_lengths=lengths[m],
        )
    return out


def emulate_step(
    emu: Emulator,
    batches: Sequence[Sequence[dict]],
    *,
    mode: str,
    link_bytes_per_s: float,
    repeats: int = 1,
) -> StepResult:
    """One mode of :func:`emulate_modes`."""
    res = emulate_modes(
        emu, batches, link_bytes_per_s=link_bytes_per_s, modes=(mode,), repeats=repeats
    )
    return res[mode]


# -- the identical-work self-check -------------------------------------------------------------

# Encoder work is identical under ``none`` and ``llm`` (only the LLM's layout changes), so
# their encoder phases must time alike; a gap larger than this says the timing is unsound.
CHECK_TOLERANCE = 0.05
CHECK_MODES = ("none", "llm")


def identical_work_check(
    steps: Sequence[dict[str, StepResult]], encoders: Sequence[str], *, tolerance: float
) -> dict:
    """Each encoder phase under ``llm`` over ``none``, slowest rank (what the step pays) and
    mean rank (the ideal), over the measured steps; the record is ``sound`` when every ratio
    is within ``tolerance`` of 1. A phase whose inputs differ between the two modes on some
    rank cannot be checked (it would mean ``llm`` moved encoder items) and fails the check."""
    out: dict = {"check_tolerance": tolerance, "check_modes": list(CHECK_MODES)}
    unsound = []
    a, b = CHECK_MODES
    for name in encoders:
        i = steps[0][a].phases.index(name)
        same = all(
            all(
                torch.equal(x[name], y[name])
                for x, y in zip(s[a].raw_lengths, s[b].raw_lengths, strict=True)
            )
            for s in steps
        )
        ratios = {}
        for stat, reduce in (("max", np.max), ("mean", np.mean)):
            base = sum(float(reduce(s[a].phase_times[i])) for s in steps)
            other = sum(float(reduce(s[b].phase_times[i])) for s in steps)
            ratios[stat] = other / base if base > 0 else 1.0
            out[f"check_{name}_{stat}_ratio"] = ratios[stat]
        out[f"check_{name}_identical_work"] = same
        if not same or any(abs(v - 1.0) > tolerance for v in ratios.values()):
            unsound.append(name)
    out["unsound_phases"] = unsound
    out["sound"] = not unsound
    return out


def _imbalance(times: np.ndarray) -> float:
    mean = float(times.mean())
    return float(times.max()) / mean if mean > 0 else 1.0


def summarize_mode(steps: Sequence[StepResult], *, ranks: int) -> dict:
    """Flat record of one mode over the measured steps (means, worst-rank memory)."""
    step_s = float(np.mean([s.step_s for s in steps]))
    ideal_s = float(np.mean([s.ideal_s for s in steps]))
    repeat_steps = np.mean([s.repeat_steps + s.dispatch_s for s in steps], axis=0)
    rec = {
        "step_time_s": step_s,
        "ideal_step_s": ideal_s,
        "step_over_ideal": step_s / ideal_s,
        "step_time_repeats_s": [float(x) for x in repeat_steps],
        "plan_s": float(np.mean([s.plan_s for s in steps])),
        "a2a_est_s": float(np.mean([s.a2a_s for s in steps])),
        "peak_mem_bytes": max(s.peak_bytes for s in steps),
        "llm_tokens_per_step": float(np.mean([s.llm_tokens for s in steps])),
    }
    for name in steps[0].items:
        rec[f"{name}_items_per_step"] = float(np.mean([s.items[name] for s in steps]))
    rec["tokens_per_s"] = rec["llm_tokens_per_step"] / ranks / step_s
    for i, p in enumerate(steps[0].phases):
        rec[f"{p}_max_s"] = float(np.mean([s.phase_times[i].max() for s in steps]))
        rec[f"{p}_mean_s"] = float(np.mean([s.phase_times[i].mean() for s in steps]))
        rec[f"{p}_imbalance"] = float(np.mean([_imbalance(s.phase_times[i]) for s in steps]))
        rec[f"{p}_plan_imbalance"] = float(np.mean([s.plan_imbalance[p] for s in steps]))
        rec[f"{p}_spread_max"] = float(max(s.phase_spread[i].max() for s in steps))
        rec[f"{p}_rank_s"] = [float(x) for x in np.mean([s.phase_times[i] for s in steps], 0)]
    return rec


# What every figure of a record means (written into each record, so a file read alone says).
DEFINITIONS = {
    "phase time": "one rank's forward + backward of the phase: the median of `repeats` timed "
    "runs after one untimed run of the same inputs (warm shapes); modes interleaved per rank",
    "<phase>_max_s": "slowest rank's phase time (FSDP makes every rank wait for it)",
    "<phase>_mean_s": "mean rank phase time",
    "<phase>_rank_s": "every rank's phase time",
    "<phase>_spread_max": "largest (slowest - fastest repeat) / median over the phase's ranks",
    "step_time_s": "sum over phases of <phase>_max_s, plus plan_s and a2a_est_s",
    "step_time_repeats_s": "step_time_s of each timed repeat alone (phases' slowest ranks)",
    "ideal_step_s": "sum over phases of <phase>_mean_s: every rank holding the mean load, no "
    "dispatch",
    "step_over_ideal": "step_time_s / ideal_step_s",
    "speedup_vs_none": "step_time_s of `none` / this mode's step_time_s (same batches)",
    "speedup_vs_llm": "step_time_s of `llm` / this mode's step_time_s (same batches)",
    "tokens_per_s": "LLM tokens per step / ranks / step_time_s",
    "sim_<figure>": "the simulator's figure for the same set-up and batches "
    "(orchmllm.sim.emulated)",
    "<phase>_<max|mean>_over_sim": "<phase>_<max|mean>_s / sim_<phase>_<max|mean>_s",
    "check_<encoder>_<max|mean>_ratio": "<encoder>_<max|mean>_s under `llm` / under `none`: "
    "identical work (same items on every rank), so it must be within check_tolerance of 1",
    "sound": "every check ratio within check_tolerance (else unsound_phases names them)",
    "run_id": "the run that wrote the record (gpu_check gives all its parts one)",
}


def _progress(line: str) -> None:
    """A line of progress, flushed: a run stopped by a time limit still says how far it got."""
    print(line, flush=True)


def run_benchmark(
    cfg: RunConfig,
    *,
    device: torch.device,
    ranks: int,
    examples_per_rank: Sequence[int],
    steps: int,
    seed: int,
    sim: EmulatedSetup,
    repeats: int = 3,
    tolerance: float = CHECK_TOLERANCE,
) -> list[dict]:
    """Records for every (examples per rank, mode), all modes on the same sampled batches,
    each with the simulator's prediction for the same set-up and batches (``sim_*``), the
    per-phase measured/simulated ratios and the identical-work self-check."""
    t0 = time.perf_counter()
    emu = Emulator.build(cfg, device=device, seed=seed)
    _progress(f"model built on {device} in {time.perf_counter() - t0:.1f} s")
    link = sim.link_gbs * 1e9
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    records = []
    for per_rank in examples_per_rank:
        results: list[dict[str, StepResult]] = []
        measured = []
        for step in range(steps):
            t0 = time.perf_counter()
            batches = sample_ranks(cfg, step=step, ranks=ranks, per_rank=per_rank, seed=seed)
            measured.append(sim_batch(batches))
            _progress(f"step {step}: sampled in {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            results.append(emulate_modes(emu, batches, link_bytes_per_s=link, repeats=repeats))
            _progress(
                f"step {step}: "
                + ", ".join(f"{m} {results[-1][m].step_s:.4f} s" for m in MODES)
                + f"; measured in {time.perf_counter() - t0:.1f} s"
            )
        summary = {m: summarize_mode([r[m] for r in results], ranks=ranks) for m in MODES}
        check = identical_work_check(results, list(cfg.model.encoders), tolerance=tolerance)
        predicted = sim.predict(measured, modes=MODES)
        for mode in MODES:
            rec = {
                "mode": mode,
                "device": dev_name,
                "method": "warm-median",  # gpu_step's timing method (DEFINITIONS)
                "ranks": ranks,
                "examples_per_rank": per_rank,
                "steps": steps,
                "repeats": repeats,
                "dtype": str(emu.dtype).removeprefix("torch."),
                "llm_layers": cfg.model.llm.layers,
                **{f"{n}_layers": e.layers for n, e in cfg.model.encoders.items()},
                "peak_mem_source": "cuda_max_memory_allocated"
                if device.type == "cuda"
                else "cpu_proxy_params_grads_saved_tensors",
                **summary[mode],
                **check,
            }
            rec["speedup_vs_none"] = summary["none"]["step_time_s"] / rec["step_time_s"]
            rec["speedup_vs_llm"] = summary["llm"]["step_time_s"] / rec["step_time_s"]
            rec.update({f"sim_{k}": v for k, v in predicted[mode].items()})
            for p in cfg.phases:
                for stat in ("max", "mean"):
                    simulated = rec[f"sim_{p}_{stat}_s"]
                    measured_s = rec[f"{p}_{stat}_s"]
                    rec[f"{p}_{stat}_over_sim"] = measured_s / simulated if simulated else None
            rec["definitions"] = DEFINITIONS
            records.append(rec)
    return records


# -- the cost of a new shape -------------------------------------------------------------------


def _encoder_pass(emu: Emulator, name: str, raw: Tensor, lengths: Tensor) -> float:
    """One encoder's forward and backward (random upstream gradient), timed; seconds."""
    clock = _Clock(emu.device)
    for p in emu.params():
        p.grad = None
    if clock.cuda:
        torch.cuda.synchronize(emu.device)
    start = clock.mark()
    out = emu.model.encoders[name](raw, lengths)
    if out.requires_grad:
        out.backward(torch.randn_like(out))
    end = clock.mark()
    if clock.cuda:
        torch.cuda.synchronize(emu.device)  # both events done before they are read
    return clock.seconds(start, end)


def new_shape_cost(
    emu: Emulator, *, items: int, shapes: int, repeats: int, seed: int
) -> list[dict]:
    """Per encoder, what its first forward and backward on a new input shape costs over the
    same call once that shape is warm: ``shapes`` shapes never run before in the process (the
    first ``items`` items the data mix samples, every length grown by a further step of the
    encoder's length unit: a new padded width for audio, a new packed total for vision), each
    run once (first) then ``repeats`` times (warm, median). One throwaway shape runs first, so the
    process's own start-up is not counted."""
    cfg = emu.cfg
    gen = torch.Generator().manual_seed(seed)
    records = []
    for name, enc in cfg.model.encoders.items():
        base, step = [], 0
        while len(base) < items and step < 100:  # the first ``items`` items the mix samples
            (batch,) = sample_ranks(cfg, step=step, ranks=1, per_rank=items, seed=seed)
            base += [len(a) for ex in batch for a in ex[MODALITIES[name].key]]
            step += 1
        base = base[:items]
        if not base:
            continue
        unit = enc.rate.divisor
        grown = [torch.as_tensor(base, dtype=torch.int64) + k * unit for k in range(shapes + 1)]

        def inputs(lengths: Tensor, width: int = enc.feature_dim) -> tuple[Tensor, Tensor]:
            raw = torch.randn(int(lengths.sum()), width, generator=gen)
            return raw.to(emu.device, emu.dtype), lengths.to(emu.device)

        _encoder_pass(emu, name, *inputs(grown[0]))  # process start-up, not a new-shape cost
        first, warm = [], []
        for k in range(1, shapes + 1):
            raw, lengths = inputs(grown[k])
            first.append(_encoder_pass(emu, name, raw, lengths))
            warm.append(float(np.median([_encoder_pass(emu, name, raw, lengths)
                                         for _ in range(repeats)])))  # fmt: skip
        cost = [f - w for f, w in zip(first, warm, strict=True)]
        records.append(
            {
                "figure": "new_shape_cost",
                "encoder": name,
                "items": len(base),
                "shapes": shapes,
                "repeats": repeats,
                "length_unit": unit,
                "first_s": float(np.median(first)),
                "warm_s": float(np.median(warm)),
                "cost_s": float(np.median(cost)),
                "cost_over_warm": float(np.median(cost) / np.median(warm)),
                "cost_each_s": cost,
            }
        )
    return records


# -- command line ------------------------------------------------------------------------------


def print_table(records: Sequence[dict], phases: Sequence[str]) -> None:
    """Measured figures per (ranks, examples per rank, mode); ``sim`` columns are the
    simulator's prediction for the same set-up and batches."""
    imbalances = "".join(f" {'imb ' + p[:4]:>9}" for p in phases)
    print(
        f"{'ranks':>5} {'B/rank':>6} {'mode':>5} {'step s':>9} {'sim s':>7} {'x none':>7}"
        f" {'sim':>6} {'x llm':>6} {'sim':>6} {'/ideal':>7} {'sim':>6}"
        f"{imbalances} {'plan ms':>8} {'a2a ms':>7} {'peak GiB':>9} {'sim':>6} {'tok/s/GPU':>10}"
    )
    for r in records:
        imbalances = "".join(f" {r[p + '_imbalance']:>9.3f}" for p in phases)
        print(
            f"{r['ranks']:>5} {r['examples_per_rank']:>6} {r['mode']:>5}"
            f" {r['step_time_s']:>9.4f} {r['sim_step_time_s']:>7.3f}"
            f" {r['speedup_vs_none']:>7.3f} {r['sim_speedup_vs_none']:>6.3f}"
            f" {r['speedup_vs_llm']:>6.3f} {r['sim_speedup_vs_llm']:>6.3f}"
            f" {r['step_over_ideal']:>7.3f} {r['sim_step_over_ideal']:>6.3f}{imbalances}"
            f" {r['plan_s'] * 1e3:>8.2f} {r['a2a_est_s'] * 1e3:>7.3f}"
            f" {r['peak_mem_bytes'] / 2**30:>9.3f} {r['sim_peak_mem_bytes'] / 2**30:>6.2f}"
            f" {r['tokens_per_s']:>10.1f}"
        )


# The targets of the full mode: each measured figure against the simulator's prediction for
# the same set-up (figure, the direction that is better).
TARGETS = (
    ("speedup_vs_none", "higher"),
    ("speedup_vs_llm", "higher"),
    ("step_over_ideal", "lower"),
)


def target_lines(records: Sequence[dict]) -> list[str]:
    """One line per full-mode record: each target figure measured and predicted. A measured
    figure on the wrong side of its prediction is a finding to report, not a failure."""
    lines = []
    for r in records:
        if r["mode"] != "full":
            continue
        parts = []
        for key, better in TARGETS:
            got, want = r[key], r[f"sim_{key}"]
            meets = got >= want if better == "higher" else got <= want
            word = "meets" if meets else "MISSES"
            parts.append(f"{key} {got:.3f} (predicted {want:.3f}: {word} it)")
        lines.append(
            f"{r['ranks']} ranks x {r['examples_per_rank']}/rank full: " + ", ".join(parts)
        )
    return lines


def print_phases(records: Sequence[dict], phases: Sequence[str]) -> None:
    """Per phase, measured mean rank time beside the simulator's, and their ratio."""
    cols = "".join(f" {p[:6] + ' s':>9} {'sim':>8} {'/sim':>6}" for p in phases)
    print(f"{'ranks':>5} {'B/rank':>6} {'mode':>5}{cols}   (mean rank time per phase)")
    for r in records:
        cols = "".join(
            f" {r[f'{p}_mean_s']:>9.4f} {r[f'sim_{p}_mean_s']:>8.4f}"
            f" {_ratio_text(r[f'{p}_mean_over_sim']):>6}"
            for p in phases
        )
        print(f"{r['ranks']:>5} {r['examples_per_rank']:>6} {r['mode']:>5}{cols}")


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def check_lines(records: Sequence[dict]) -> list[str]:
    """One line per set-up: the identical-work self-check, sound or naming what failed."""
    lines = []
    for r in records:
        if r["mode"] != "none":
            continue
        ratios = ", ".join(
            f"{k.removeprefix('check_').removesuffix('_ratio')} {v:.3f}"
            for k, v in r.items()
            if k.startswith("check_") and k.endswith("_ratio")
        )
        verdict = "sound" if r["sound"] else "UNSOUND: " + ", ".join(r["unsound_phases"])
        lines.append(
            f"{r['ranks']} ranks x {r['examples_per_rank']}/rank self-check (llm/none on "
            f"identical work, tolerance {r['check_tolerance']:.0%}): {ratios}: {verdict}"
        )
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument(
        "--config", default=None, help="run config (default: mllm-10b on CUDA, tiny on CPU)"
    )
    ap.add_argument(
        "--layer-divisor",
        type=int,
        default=None,
        help="divide every module's layers by this (default: 4 for the "
        "default CUDA config, else 1)",
    )
    ap.add_argument("--ranks", type=int, default=None, help="emulated DP ranks (8 GPU, 4 CPU)")
    ap.add_argument(
        "--examples-per-rank",
        type=int,
        nargs="+",
        default=None,
        help="mini-batch sizes (default: 60 20 on CUDA, the config's on CPU); with "
        "--new-shape-cost, the items per encoder call (60 CUDA, 16 CPU)",
    )
    ap.add_argument("--steps", type=int, default=None, help="measured steps (1 GPU, 2 CPU)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per rank and mode after one untimed run; the median is kept (3)",
    )
    ap.add_argument(
        "--tolerance",
        type=float,
        default=CHECK_TOLERANCE,
        help="the identical-work self-check: encoder phases under llm and none must time "
        f"within this fraction of each other (default {CHECK_TOLERANCE})",
    )
    ap.add_argument(
        "--new-shape-cost",
        action="store_true",
        help="measure only what an encoder's first call on a new input shape costs over a "
        "warm call (records with figure new_shape_cost)",
    )
    ap.add_argument(
        "--shapes", type=int, default=5, help="new shapes per encoder for --new-shape-cost"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--link-gbs",
        type=float,
        default=450.0,
        help="all-to-all bandwidth per rank and direction, GB/s (H100 NVLink)",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes, seconds on CPU")
    ap.add_argument("--json", default=None, help="write the records (a JSON list) here")
    args = ap.parse_args(argv)
    for name in ("layer_divisor", "ranks", "steps", "repeats", "shapes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.tolerance < 1:
        ap.error(f"--tolerance must be in (0, 1), got {args.tolerance}")
    if args.examples_per_rank and min(args.examples_per_rank) < 1:
        ap.error(f"--examples-per-rank must be >= 1, got {args.examples_per_rank}")
    return args


def new_run_id() -> str:
    """A run id: UTC time to the second and the process id."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    # Every record names its run (provenance writes RUN_ID_ENV); gpu_check sets one for all
    # its parts, so the figures of one check can be told from another's.
    os.environ.setdefault(RUN_ID_ENV, new_run_id())
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        # Small CPU ops are far slower with threads fighting over shared cores; one thread
        # gives stable per-rank timings (ranks run one after another anyway).
        torch.set_num_threads(1)
    default_config = "mllm-10b.yaml" if cuda else "tiny.yaml"
    cfg = load_config(args.config or str(ROOT / "configs" / default_config))
    divisor = args.layer_divisor or (4 if cuda and args.config is None else 1)
    cfg = scale_layers(cfg, divisor)
    config = args.config or f"configs/{default_config}"
    if args.new_shape_cost:
        emu = Emulator.build(cfg, device=device, seed=args.seed)
        items = args.examples_per_rank[0] if args.examples_per_rank else (60 if cuda else 16)
        records = new_shape_cost(
            emu, items=items, shapes=args.shapes, repeats=args.repeats, seed=args.seed
        )
        device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
        for r in records:
            r.update(device=device_name, config=config, layer_divisor=divisor,
                     dtype=str(emu.dtype).removeprefix("torch."))  # fmt: skip
        print(
            f"{'encoder':>8} {'items':>5} {'first s':>9} {'warm s':>9} {'cost s':>9} {'/warm':>6}"
        )
        for r in records:
            print(
                f"{r['encoder']:>8} {r['items']:>5} {r['first_s']:>9.4f} {r['warm_s']:>9.4f}"
                f" {r['cost_s']:>9.4f} {r['cost_over_warm']:>6.2f}"
            )
        if args.json:
            write_records(args.json, records)
        return records
    if args.quick:
        ranks, sizes, steps = 4 if not cuda else 8, [4] if not cuda else [20], 1
    else:
        ranks = 8 if cuda else 4
        sizes = [60, 20] if cuda else [cfg.data.examples_per_rank]
        steps = 1 if cuda else 2
    ranks = args.ranks or ranks
    sizes = args.examples_per_rank or sizes
    steps = args.steps or steps
    sim = EmulatedSetup.load(
        config if Path(config).is_absolute() else ROOT / config,
        layers={
            **{n: e.layers for n, e in cfg.model.encoders.items()},
            LLM: cfg.model.llm.layers,
        },
        link_gbs=args.link_gbs,  # the config's recipe, as Emulator.build applies it
        device="cuda" if cuda else "cpu",
    )
    print(
        f"device={device} config={config} layers/{divisor}: "
        f"llm {cfg.model.llm.layers}, "
        + ", ".join(f"{n} {e.layers}" for n, e in cfg.model.encoders.items())
        + f"; ranks={ranks} examples/rank={sizes} steps={steps} repeats={args.repeats} "
        f"run {os.environ[RUN_ID_ENV]}",
        flush=True,
    )
    records = run_benchmark(
        cfg,
        device=device,
        ranks=ranks,
        examples_per_rank=sizes,
        steps=steps,
        seed=args.seed,
        sim=sim,
        repeats=args.repeats,
        tolerance=args.tolerance,
    )
    for r in records:  # what benchmarks/reproduce_paper.py needs to simulate the same set-up
        r.update(config=config, layer_divisor=divisor, seed=args.seed, link_gbs=args.link_gbs)
    print_table(records, cfg.phases)
    print_phases(records, cfg.phases)
    print("targets: the simulator's prediction for this set-up (orchmllm.sim.emulated)")
    for line in target_lines(records):
        print(line)
    for line in check_lines(records):
        print(line)
    if not cuda:
        print("(on CPU the prediction is still an H100's: only the speed-ups compare)")
    if args.json:
        write_records(args.json, records)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
