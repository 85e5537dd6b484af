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
   takes a random upstream gradient of its output's shape. Pieces are timed with CUDA events
   after warm-up on GPU, with ``time.perf_counter`` on CPU.

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

``benchmarks/gpu_check.py`` runs it at the set-ups the project reports (8 ranks x 60 and 32 x
20), together with the other GPU checks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from orchmllm.models import MLLM, apply_checkpointing, build_model, compute_dtype
from orchmllm.provenance import write_records
from orchmllm.recipe import ItemLengths
from orchmllm.schema import IGNORE_INDEX, LLM, MODALITIES
from orchmllm.sim.batch import Batch
from orchmllm.sim.emulated import EmulatedSetup
from orchmllm.step_plan import MODES, StepOptions, default_phases, local_metadata, plan_step

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
    """One mode's plan, as training makes it (``orchmllm.train.make_orchestrator``: the
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
    """CUDA events on GPU (read after one synchronize), ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
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
    """One emulated step of one mode."""

    phases: tuple[str, ...]  # each encoder's, then the LLM's
    phase_times: np.ndarray  # (phases, ranks) seconds
    plan_s: float
    a2a_s: float
    plan_imbalance: dict[str, float]
    peak_bytes: int
    llm_tokens: int
    items: dict[str, int]  # encoder name -> items encoded over all ranks

    @property
    def dispatch_s(self) -> float:
        return self.plan_s + self.a2a_s

    @property
    def step_s(self) -> float:
        return float(self.phase_times.max(axis=1).sum()) + self.dispatch_s

    @property
    def ideal_s(self) -> float:
        return float(self.phase_times.mean(axis=1).sum())


def emulate_step(
    emu: Emulator,
    batches: Sequence[Sequence[dict]],
    *,
    mode: str,
    link_bytes_per_s: float,
    only_ranks: Sequence[int] | None = None,
    repeats: int = 1,
) -> StepResult:
    """Plan ``batches`` (one per rank) for ``mode`` and run every rank's step in turn.

    With ``repeats`` > 1 each rank's step runs that many times and each phase keeps its
    fastest time: the work is identical, slower runs only measure interference (shared CPU).
    """
    ranks = len(batches)
    rows, src = gathered_rows(batches)
    plan, plan_s = plan_mode(rows, src, emu.cfg, ranks=ranks, mode=mode)
    examples = [ex for b in batches for ex in b]
    elem = torch.empty((), dtype=emu.dtype).element_size()
    a2a_s = a2a_estimate_s(plan, emu.cfg, elem_bytes=elem, link_bytes_per_s=link_bytes_per_s)
    phases = emu.cfg.phases
    times = np.zeros((len(phases), ranks))
    results = []
    for r in range(ranks) if only_ranks is None else only_ranks:
        work = rank_work(plan, r, examples, emu.cfg, emu.dtype)
        runs = [emu.run(work, denom=plan.num_targets) for _ in range(repeats)]
        times[:, r] = [min(run.times[p] for run in runs) for p in phases]
        results.append(runs[0])
    stats = plan.stats()
    return StepResult(
        phases=phases,
        phase_times=times,
        plan_s=0.0 if mode == "none" else plan_s,  # training without balancing plans nothing
        a2a_s=a2a_s,
        plan_imbalance={p: float(stats[p]["imbalance_after"]) for p in phases},
        peak_bytes=max(r.peak_bytes for r in results),
        llm_tokens=sum(r.llm_tokens for r in results),
        items={n: sum(r.items[n] for r in results) for n in emu.cfg.model.encoders},
    )


def _imbalance(times: np.ndarray) -> float:
    mean = float(times.mean())
    return float(times.max()) / mean if mean > 0 else 1.0


def summarize_mode(steps: Sequence[StepResult], *, ranks: int) -> dict:
    """Flat record of one mode over the measured steps (means, worst-rank memory)."""
    step_s = float(np.mean([s.step_s for s in steps]))
    ideal_s = float(np.mean([s.ideal_s for s in steps]))
    rec = {
        "step_time_s": step_s,
        "ideal_step_s": ideal_s,
        "step_over_ideal": step_s / ideal_s,
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
    return rec


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
    warmup_ranks: int,
    repeats: int = 1,
) -> list[dict]:
    """Records for every (examples per rank, mode), all modes on the same sampled batches,
    each with the simulator's prediction for the same set-up and batches (``sim_*``)."""
    t0 = time.perf_counter()
    emu = Emulator.build(cfg, device=device, seed=seed)
    _progress(f"model built on {device} in {time.perf_counter() - t0:.1f} s")
    link = sim.link_gbs * 1e9
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    records = []
    for per_rank in examples_per_rank:
        if warmup_ranks:  # unmeasured batches (ids after the measured ones)
            t0 = time.perf_counter()
            batches = sample_ranks(cfg, step=steps, ranks=ranks, per_rank=per_rank, seed=seed)
            only = range(min(warmup_ranks, ranks))
            emulate_step(emu, batches, mode="full", link_bytes_per_s=link, only_ranks=only)
            _progress(f"warm-up on {len(only)} ranks in {time.perf_counter() - t0:.1f} s")
        results: dict[str, list[StepResult]] = {m: [] for m in MODES}
        measured = []
        for step in range(steps):
            t0 = time.perf_counter()
            batches = sample_ranks(cfg, step=step, ranks=ranks, per_rank=per_rank, seed=seed)
            measured.append(sim_batch(batches))
            _progress(f"step {step}: sampled in {time.perf_counter() - t0:.1f} s")
            for mode in MODES:  # interleaved, so drift hits every mode alike
                t0 = time.perf_counter()
                results[mode].append(
                    emulate_step(emu, batches, mode=mode, link_bytes_per_s=link, repeats=repeats)
                )
                _progress(
                    f"step {step} {mode}: emulated step {results[mode][-1].step_s:.3f} s, "
                    f"measured in {time.perf_counter() - t0:.1f} s"
                )
        summary = {m: summarize_mode(results[m], ranks=ranks) for m in MODES}
        predicted = sim.predict(measured, modes=MODES)
        for mode in MODES:
            rec = {
                "mode": mode,
                "device": dev_name,
                "ranks": ranks,
                "examples_per_rank": per_rank,
                "steps": steps,
                "repeats": repeats,
                "warmup_ranks": min(warmup_ranks, ranks),
                "dtype": str(emu.dtype).removeprefix("torch."),
                "llm_layers": cfg.model.llm.layers,
                **{f"{n}_layers": e.layers for n, e in cfg.model.encoders.items()},
                "peak_mem_source": "cuda_max_memory_allocated"
                if device.type == "cuda"
                else "cpu_proxy_params_grads_saved_tensors",
                **summary[mode],
            }
            rec["speedup_vs_none"] = summary["none"]["step_time_s"] / rec["step_time_s"]
            rec["speedup_vs_llm"] = summary["llm"]["step_time_s"] / rec["step_time_s"]
            rec.update({f"sim_{k}": v for k, v in predicted[mode].items()})
            records.append(rec)
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
        help="mini-batch sizes (default: 60 20 on CUDA, the config's on CPU)",
    )
    ap.add_argument("--steps", type=int, default=None, help="measured steps (3 GPU, 2 CPU)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="runs per rank, fastest kept (1 GPU, 3 CPU)"
    )
    ap.add_argument(
        "--warmup-ranks",
        type=int,
        default=None,
        help="ranks of the unmeasured warm-up step, from rank 0 (all on GPU, 1 on CPU; 0: none)",
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
    for name in ("layer_divisor", "ranks", "steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup_ranks is not None and args.warmup_ranks < 0:
        ap.error(f"--warmup-ranks must be >= 0, got {args.warmup_ranks}")
    if args.examples_per_rank and min(args.examples_per_rank) < 1:
        ap.error(f"--examples-per-rank must be >= 1, got {args.examples_per_rank}")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
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
    if args.quick:
        ranks, sizes, steps = 4 if not cuda else 8, [4] if not cuda else [20], 1
    else:
        ranks = 8 if cuda else 4
        sizes = [60, 20] if cuda else [cfg.data.examples_per_rank]
        steps = 3 if cuda else 2
    ranks = args.ranks or ranks
    sizes = args.examples_per_rank or sizes
    steps = args.steps or steps
    repeats = args.repeats or (1 if cuda else 3)
    warmup_ranks = (ranks if cuda else 1) if args.warmup_ranks is None else args.warmup_ranks
    config = args.config or f"configs/{default_config}"
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
        + f"; ranks={ranks} examples/rank={sizes} steps={steps} repeats={repeats} "
        f"warm-up ranks={warmup_ranks}",
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
        warmup_ranks=warmup_ranks,
        repeats=repeats,
    )
    for r in records:  # what benchmarks/reproduce_paper.py needs to simulate the same set-up
        r.update(config=config, layer_divisor=divisor, seed=args.seed, link_gbs=args.link_gbs)
    print_table(records, cfg.phases)
    print("targets: the simulator's prediction for this set-up (orchmllm.sim.emulated)")
    for line in target_lines(records):
        print(line)
    if not cuda:
        print("(on CPU the prediction is still an H100's: only the speed-ups compare)")
    if args.json:
        write_records(args.json, records)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
