"""Reproduce the OrchMLLM paper's section 8 at cluster scale with the simulator.

For MLLM-10B/18B/84B (configs/mllm-*.yaml, Table 1 shapes) and 64..2560 simulated H100s this
prints, next to the figures the paper's text reports and the ratio between them:

- Figure 8 decomposed: per model and scale, the largest mini-batch without balancing and with
  OrchMLLM (both from the simulator's memory model, never the paper's settings), the speed-up
  of balancing at the no-balancing mini-batch, the speed-up of the larger mini-batch balancing
  allows, and their product (the MFU ratio), beside the paper's; the same decomposition at the
  paper's mini-batches (65/40/15 -> 80/60/30); at least ``FIG8_STEPS`` sampled steps per seed;
- Figure 9 from the same cases: LLM tokens per second per GPU, none and full, at both
  mini-batch settings (the Megatron-LM baseline is not simulated: see the notes);
- sensitivity: Figure 8 at both settings as every length is scaled (0.5x-3x) and as the audio
  tasks' share of the mix changes, and the length scale at which Table 2's forward time equals
  the paper's (a derived figure; the workload stays the config's);
- Figure 10 (encoder-balancing ablation, 128 GPUs, the paper's ablation mini-batch 75/50/25):
  none, llm, disttrain and full, MFU and peak memory; out-of-memory cases are marked OOM and
  report no MFU;
- Figure 11 (tailored algorithms vs one algorithm for both encoders, 128 GPUs);
- Figure 12 (the all-to-all dispatcher vs an all-gather communicator, 128 GPUs): dispatch time,
  MFU, peak memory, and the largest mini-batch the all-gather fits;
- Figure 13 (inter-node volume per dispatcher with and without node-wise placement, 128 GPUs);
- Table 2 (dispatch overhead and forward time vs GPUs, MLLM-10B, mini-batch 60, one seed), with
  the planning time of the real C++ planner and placement solver measured at that scale;
- validation: for every ``gpu_step_*.json`` record of ``benchmarks/gpu_step.py --json`` under
  ``--gpu-results``, the same set-up (model shape and layer counts, emulated ranks, examples per
  rank, the very examples, modes) simulated, and simulated vs measured step time and speed-up,
  and per phase measured / simulated time (mean and slowest rank) on that identical work.

Every speed-up is a mean with its min-max over ``--seeds`` seeds (5; 2 with ``--quick``). The
paper's figures are images; only the numbers its text states are compared. Everything here is a
model: see orchmllm/sim for what it includes and what it leaves out.

    python benchmarks/reproduce_paper.py [--quick] [--json PATH] [--out DIR] [--gpu-results DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchmllm.config import load_config
from orchmllm.data.synthetic import BLOCK, block_seed
from orchmllm.provenance import write_records
from orchmllm.recipe import ItemLengths
from orchmllm.schema import LLM
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import load_block_records, measured_fits
from orchmllm.sim.emulated import EmulatedSetup
from orchmllm.sim.step import Cluster
from orchmllm.sim.sweep import (
    PAPER_MODELS,
    SimModel,
    audio_share,
    default_steps,
    fitting_minibatches,
    largest_minibatch,
    load_model,
    placement_for,
    run_case,
    sample_pool,
    with_workload,
)

ROOT = Path(__file__).resolve().parents[1]
RANKS = (64, 128, 256, 512, 1024, 2560)  # Table 2's scales
# The paper's Figure 8 is at 2560; two smaller scales for the trend, and 16,384 (2048 nodes of
# 8), where clusters go next.
FIG8_RANKS = (64, 256, 2560, 16384)
QUICK_RANKS = (32, 64)
ABLATION_RANKS = 128  # section 8.3 microbenchmarks
DEFAULTS_RANKS = (2560, 16384)  # the scales the shipped policies are chosen for
QUICK_DEFAULTS_RANKS = (64,)
DEFAULTS_TIE = 0.001  # MFU ratios closer than this are a tie (see defaults())
QUICK_ABLATION_RANKS = 32
# The sensitivity sweep runs at one hybrid-shard group (the paper's 256 ranks), where a rank's
# memory is what it is at 2560; every length times these scales, and these audio shares.
SENSITIVITY_RANKS, QUICK_SENSITIVITY_RANKS = 256, 32
SENSITIVITY_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
QUICK_SENSITIVITY_SCALES = (0.5, 1.0, 2.0)
AUDIO_SHARES = (0.1, 0.7)  # beside the config's own (the paper mix: 0.39)
TABLE2_SCALE_RANKS, QUICK_TABLE2_SCALE_RANKS = (64, 2560), (64,)
SEEDS, QUICK_SEEDS = 5, 2
FIG8_STEPS = 3  # sampled steps per seed in Figure 8, at least (see _fig8_steps)
# The simulator's modes (orchmllm.sim.layout.MODES) in the order the tables show them.
MODES = ("none", "llm", "disttrain", "full")
GPU_RESULTS = ROOT / "benchmarks" / "results"

# What the paper's text states (section 8), for comparison only: no simulated figure reads
# these except where a setting is named as the paper's (the ablation and Table 2 mini-batches).
# Mini-batches are per rank.
PAPER = {
    "minibatch_full": {"mllm-10b": 80, "mllm-18b": 60, "mllm-84b": 30},
    "minibatch_none": {"mllm-10b": 65, "mllm-18b": 40, "mllm-84b": 15},
    "minibatch_ablation": {"mllm-10b": 75, "mllm-18b": 50, "mllm-84b": 25},
    # OrchMLLM / no balance, 1.5x-2.0x MFU, growing with model size (section 8.1)
    "fig8_mfu_ratio": {"mllm-10b": 1.5, "mllm-84b": 2.0},
    "fig8_mfu_ratio_range": (1.5, 2.0),
    # OrchMLLM / no balance, 1.4x-1.9x the training throughput (section 8.1, Figure 9)
    "fig9_tpt_ratio_range": (1.4, 1.9),
    "fig8_mfu_full_84b_2560": 0.416,
    # llm-only balance on MLLM-84B: OOM at 25, runs at 18 with 24.16% MFU and 62.7 GB
    "fig10_llm_84b": {"oom_at": 25, "max_minibatch": 18, "mfu": 0.2416, "memory_gb": 62.7},
    # the all-gather communicator on MLLM-84B: OOM at 25, runs at 20 with 25.51% MFU, 61.8 GB
    "fig12_allgather_84b": {"oom_at": 25, "max_minibatch": 20, "mfu": 0.2551, "memory_gb": 61.8},
    "fig13_reduction_range": (0.436, 0.722),
    "table2_minibatch": 60,
    "table2": {  # GPUs: (overhead ms, forward duration s)
        64: (16.66, 3.79),
        128: (18.49, 3.81),
        256: (21.32, 3.85),
        512: (24.64, 3.92),
        1024: (31.37, 3.96),
        2560: (53.88, 4.05),
    },
}


# Why the simulation and the paper part ways (qualitative; the numbers are in the tables above).
NOTES = (
    "Agrees by construction: nothing. Inputs are the H100 block timings (measured), the model "
    "shapes (Table 1), the H100's published memory, FLOPs and link speeds, and the paper's "
    "cluster and settings (8 GPUs per node, hybrid-shard group 256, the ablation and Table 2 "
    "mini-batches). The training recipe is each config's (recipe:, what orchmllm.train runs: "
    "bf16 compute over fp32 master weights, every block checkpointed, 4096-token loss "
    "chunks). Assumed: 6 GB reserved per GPU, 2 us per all-to-all peer.",
    "Mini-batch (Fig. 8): the memory model replays the trainer's step under that recipe "
    "(checked per phase against the CPU allocator by tests/test_memory_measured.py), and "
    "`python -m orchmllm.sim.plan_memory` prints the same mini-batches. Where they sit above the "
    "paper's, the likelier cause is the workload, not the memory model: the sensitivity "
    "table shows the mini-batches falling as every length grows, and Table 2's forward time "
    "matches the paper's only at a length scale well above 1 (the derived table). The "
    "workload's lengths are public dataset statistics or labelled assumptions "
    "(orchmllm/workload_facts.py); none is tuned to the paper, so that scale is reported, "
    "never used. Where ZeRO-3 traffic hides behind compute the only per-step fixed cost is "
    "the fitted per-block constant, so a larger mini-batch raises almost no MFU and the "
    "Figure 8 ratio is balancing alone; where it does not (small mini-batches of a large "
    "model), the larger mini-batch pays.",
    "Fig. 9: throughput is LLM tokens per second per GPU, so at one mini-batch its full/none "
    "ratio is the step-time ratio, as is the MFU's. Megatron-LM (the paper's Figures 8-9 "
    "baseline, TP 8 with PP 2/4/10) is not simulated: the sim models FSDP data parallelism "
    "only and has no measured tensor-parallel collectives or pipeline schedule to time it "
    "with, so any Megatron figure would be invented.",
    "Fig. 12: the all-gather communicator sends every rank the whole global batch of each "
    "move, padded to the largest rank's (NCCL gathers equal sizes), timed by NCCL's ring "
    "bus-bandwidth model at link peak; its receive buffers enter the replayed step at the "
    "move, so the extra memory counts only where it raises a phase's peak.",
    "MFU (Fig. 8, 10, 11): the sim counts block compute with recompute, ZeRO-3 traffic and "
    "dispatch only; no optimizer step, embeddings, connectors, data loading, kernel gaps or "
    "exposed collective latency, so its MFU is an upper bound.",
    "Fig. 10: the sim's llm-only mode loses only the encoders' imbalance; the paper's much "
    "lower MFU for it on MLLM-84B points at costs the sim does not model.",
    "Fig. 13: greedy rebuilds every batch from scratch, so a batch draws from every node "
    "alike and no permutation keeps much traffic inside a node; movement-aware batches "
    "(greedy_stay) reach reductions of the paper's size on the vision and LLM dispatchers, not "
    "on audio (binary_search batches in both rows).",
    "Table 2: the sim's overhead is the all-to-all transfer at link peak plus per-peer latency; "
    "the paper's also holds copies, assembly and synchronisation. The forward time is lower: "
    "the sim has no overheads, and its examples are likely lighter than the paper's (whose "
    "data the paper does not describe in numbers); the derived table gives the length scale "
    "that would close the gap if the per-token compute were right.",
)


def _ratio(sim: float | None, paper: float | None) -> float | None:
    return sim / paper if paper and sim is not None else None


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean and min-max of one figure over seeds."""
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()), "n": v.size}


def fmt_spread(s: dict[str, float] | None) -> str:
    if s is None:
        return "OOM"
    return f"{s['mean']:.3g} ({s['min']:.3g}-{s['max']:.3g})"


def _steps_for(ranks: int, override: int | None) -> int:
    """Several steps where a step holds few examples (``orchmllm.sim.sweep.default_steps``)."""
    return override or default_steps(ranks)


class Sweep:
    """Runs cases over seeds; within a seed every mode sees the same sampled batches."""

    def __init__(
        self, models: dict[str, SimModel], steps: int | None, seeds: Sequence[int]
    ) -> None:
        self.models, self.steps_override, self.seeds = models, steps, tuple(seeds)
        self.records: list[dict[str, Any]] = []
        self._pools: dict[tuple[str, int, int, int], dict[int, Batch]] = {}

    def fresh_pools(self, model: str, ranks: int, per_rank: int, seed: int) -> dict[int, Batch]:
        """Step ``k`` of seed ``seed`` draws with ``default_rng([seed, k])``."""
        steps = _steps_for(ranks, self.steps_override)
        return {
            k: sample_pool(self.models[model], ranks, per_rank, (seed, k)) for k in range(steps)
        }

    def pools(self, model: str, ranks: int, per_rank: int, seed: int) -> dict[int, Batch]:
        key = (model, ranks, per_rank, seed)
        if key not in self._pools:
            self._pools[key] = self.fresh_pools(model, ranks, per_rank, seed)
        return self._pools[key]

    def case(
        self,
        figure: str,
        model: str,
        ranks: int,
        mode: str,
        b: int,
        pool_b: int,
        seed: int,
        **kwargs: Any,
    ) -> dict[str, Any]:
        pools = self.pools(model, ranks, pool_b, seed)
        rec = run_case(
            self.models[model], ranks, mode, examples_per_rank=b, steps=len(pools), pools=pools,
            **kwargs,
        )  # fmt: skip
        rec.update(figure=figure, seed=seed)
        self.records.append(rec)
        return rec


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n== {title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def calibration() -> list[dict[str, Any]]:
    rows, out = [], []
    for name, fit in measured_fits().items():
        n = sum(r["shape"] == name for r in load_block_records())
        rows.append(
            [
                name,
                fit.shape.attention,
                n,
                fit.linear_rate / 1e12,
                fit.attention_rate / 1e12,
                fit.stats["max_rel_err"],
            ]
        )
        out.append(
            {
                "figure": "calibration",
                "shape": name,
                "linear_tflops": fit.linear_rate / 1e12,
                "attention_tflops": fit.attention_rate / 1e12,
                "max_rel_err": fit.stats["max_rel_err"],
            }
        )
    _table(
        "Calibration on h100_table1_blocks.json (per-shape least squares, orchmllm.planner.cost)",
        ["shape", "attention", "records", "linear TF/s", "attn TF/s", "max rel err"],
        rows,
    )
    return out


def speedups(sw: Sweep) -> None:
    """Step-time speed-up over no balancing at a fixed mini-batch (MLLM-10B, 64 GPUs)."""
    model, d, rows = "mllm-10b", 64, []
    if model not in sw.models:
        return
    for b in (60, 20):
        gains: dict[str, list[float]] = {m: [] for m in MODES[1:]}
        imb: dict[str, list[float]] = {p: [] for p in ("vision", "audio", "llm")}
        oom = set()
        for seed in sw.seeds:
            recs = {
                mode: sw.case("speedup", model, d, mode, b, 60, seed, placement=placement_for(mode))
                for mode in MODES
            }
            base = recs["none"]["step_time_s"]
            for mode, rec in recs.items():
                rec["speedup_over_none"] = base / rec["step_time_s"]
                if rec["oom"]:
                    oom.add(mode)
            for mode in gains:
                gains[mode].append(recs[mode]["speedup_over_none"])
            for p in imb:
                imb[p].append(recs["none"][f"imbalance_{p}"])
        summary = {m: None if m in oom else spread(v) for m, v in gains.items()}
        sw.records.append(
            {
                "figure": "speedup_summary",
                "model": model,
                "ranks": d,
                "examples_per_rank": b,
                "seeds": len(sw.seeds),
                "oom_modes": sorted(oom),
                **{f"speedup_{m}": s for m, s in summary.items()},
            }
        )
        rows.append(
            [b, "OOM" if "none" in oom else "ok"]
            + [fmt_spread(summary[m]) for m in gains]
            + [float(np.mean(imb[p])) for p in imb]
        )
    _table(
        f"Step-time speed-up over none at a fixed mini-batch ({model}, {d} GPUs), mean "
        f"(min-max) over {len(sw.seeds)} seeds",
        ["b", "none mem", "llm", "disttrain", "full", "none imb vis", "aud", "llm"],
        rows,
    )


def _fig8_cases(
    sw: Sweep,
    m: SimModel,
    d: int,
    seed: int,
    pools: dict[int, Batch],
    b0: int,
    b1: int,
    *,
    at: str,
    found: dict[str, dict[str, Any]] | None = None,
    figure: str = "fig8_case",
    tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The three cases of one Figure 8 point, none at ``b0``, full at ``b0`` and at ``b1``, on
    one seed's pooled steps (``found``: records the mini-batch search already made), and
    their decomposition: ``balance`` (full/none at ``b0``, the same work) x ``minibatch``
    (full at ``b1`` over full at ``b0``) = ``product`` (the MFU ratio), beside each side's
    LLM tokens per second per GPU (Figure 9). A factor whose cases run out of memory is
    None."""
    found = found or {}

    def run(mode: str, b: int) -> dict[str, Any]:
        return run_case(
            m, d, mode, examples_per_rank=b, placement=placement_for(mode), steps=len(pools),
            pools=pools,
        )  # fmt: skip

    none = found.get("none") or run("none", b0)
    full0 = run("full", b0)
    full = found.get("full") or run("full", b1)
    prefix = "" if at == "own" else f"{at}_"
    for role, rec in (("none@b_none", none), ("full@b_none", full0), ("full@b_full", full)):
        rec.update(figure=figure, seed=seed, role=prefix + role, minibatches=at, **(tags or {}))
        sw.records.append(rec)
    fits = {k: not r["oom"] for k, r in (("none", none), ("full0", full0), ("full", full))}
    ends = fits["none"] and fits["full"]
    out: dict[str, Any] = {"oom": not all(fits.values())}
    out["mfu_none"] = none["mfu"] if fits["none"] else None
    out["mfu_full"] = full["mfu"] if fits["full"] else None
    out["tpt_none"] = none["tokens_per_s_per_gpu"] if fits["none"] else None
    out["tpt_full"] = full["tokens_per_s_per_gpu"] if fits["full"] else None
    out["product"] = full["mfu"] / none["mfu"] if ends else None
    out["tpt_ratio"] = full["tokens_per_s_per_gpu"] / none["tokens_per_s_per_gpu"] if ends else None
    out["balance"] = full0["mfu"] / none["mfu"] if fits["none"] and fits["full0"] else None
    out["minibatch"] = full["mfu"] / full0["mfu"] if fits["full0"] and fits["full"] else None
    return out


def _fig8_point(
    sw: Sweep,
    m: SimModel,
    d: int,
    seed: int,
    prev: dict[str, int] | None,
    *,
    steps: int,
    figure: str = "fig8_case",
    tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One seed of one Figure 8 point, at the largest mini-batches that fit (``own``: from
    the memory model under the config's training recipe, by ``fitting_minibatches``, the
    search ``python -m orchmllm.sim.plan_memory`` runs, so the two print the same mini-batches)
    and at the paper's (``paper``), on the same ``steps`` pooled steps.

    ``prev`` (this seed's mini-batches at the previous scale) only sets where the searches
    start."""
    guesses = {"none": prev["b_none"], "full": prev["b_full"]} if prev else None
    pools, found = fitting_minibatches(
        m, d, ("none", "full"), seed=seed, steps=steps, guesses=guesses
    )
    (b0, none), (b1, full) = found["none"], found["full"]
    out: dict[str, Any] = {"b_none": b0, "b_full": b1, "steps": len(pools)}
    if none is None or full is None:
        out["own"] = None  # not even one example per rank fits
    else:
        out["own"] = _fig8_cases(
            sw, m, d, seed, pools, b0, b1, at="own", found={"none": none, "full": full},
            figure=figure, tags=tags,
        )  # fmt: skip
    p0, p1 = PAPER["minibatch_none"][m.name], PAPER["minibatch_full"][m.name]
    out["paper"] = _fig8_cases(sw, m, d, seed, pools, p0, p1, at="paper", figure=figure, tags=tags)
    return out


def _fig8_steps(ranks: int, override: int | None) -> int:
    """Sampled steps per seed in Figure 8: at least ``FIG8_STEPS`` (one step at 16,384
    GPUs would make each seed's figure a single draw)."""
    return override or max(FIG8_STEPS, default_steps(ranks))


FACTORS = ("balance", "minibatch", "product", "mfu_none", "mfu_full")
TPT = ("tpt_none", "tpt_full", "tpt_ratio")


def _summary(points: Sequence[dict[str, Any] | None], keys: Sequence[str]) -> dict[str, Any]:
    """Each key's spread over the seeds where it has a value (None where none has)."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [p[key] for p in points if p is not None and p[key] is not None]
        out[key] = spread(values) if values else None
    return out


def figure8(sw: Sweep, ranks: Sequence[int]) -> None:
    rows, paper_rows, tpt_rows, headline = [], [], [], ""
    for model in sw.models:
        prev: dict[int, dict[str, int] | None] = dict.fromkeys(sw.seeds)
        for d in ranks:
            points = {}
            for seed in sw.seeds:
                points[seed] = _fig8_point(
                    sw, sw.models[model], d, seed, prev[seed],
                    steps=_fig8_steps(d, sw.steps_override),
                )  # fmt: skip
                p = points[seed]
                prev[seed] = p if p["b_none"] and p["b_full"] else None
            own = [p["own"] for p in points.values()]
            paper = [p["paper"] for p in points.values()]
            rec: dict[str, Any] = {
                "figure": "fig8",
                "model": model,
                "ranks": d,
                "seeds": len(sw.seeds),
                "steps": points[sw.seeds[0]]["steps"],
                "oom_seeds": sum(o is None or o["oom"] for o in own),
                "b_none": spread([p["b_none"] for p in points.values()]),
                "b_full": spread([p["b_full"] for p in points.values()]),
                "paper_b_none": PAPER["minibatch_none"][model],
                "paper_b_full": PAPER["minibatch_full"][model],
                "paper_mfu_ratio": PAPER["fig8_mfu_ratio"].get(model),
                "paper_mfu_ratio_range": list(PAPER["fig8_mfu_ratio_range"]),
                **_summary(own, FACTORS + TPT),
                "at_paper_oom_seeds": sum(p["oom"] for p in paper),
                **{f"at_paper_{k}": v for k, v in _summary(paper, FACTORS + TPT).items()},
            }
            rec["balance_factor"], rec["minibatch_factor"] = rec["balance"], rec["minibatch"]
            sw.records.append(rec)
            ratio = rec["paper_mfu_ratio"]
            if model == "mllm-84b" and d == 2560 and rec["mfu_full"]:
                ref = PAPER["fig8_mfu_full_84b_2560"]
                rec["paper_mfu_full"] = ref
                headline = (
                    f"MLLM-84B, 2560 GPUs, full at its own mini-batch: MFU "
                    f"{fmt_spread(rec['mfu_full'])} vs the paper's {ref} (sim/paper "
                    f"{rec['mfu_full']['mean'] / ref:.2f})"
                )
            paper_x = ratio if ratio else "1.5-2.0"
            rows.append(
                [model, d, fmt_spread(rec["b_none"]), fmt_spread(rec["b_full"])]
                + [fmt_spread(rec[k]) for k in ("balance", "minibatch", "product")]
                + [paper_x, _ratio(rec["product"]["mean"], ratio) if rec["product"] else None]
                + [fmt_spread(rec["mfu_none"]), fmt_spread(rec["mfu_full"])]
            )
            paper_rows.append(
                [model, d, f"{rec['paper_b_none']}->{rec['paper_b_full']}"]
                + [fmt_spread(rec[f"at_paper_{k}"]) for k in ("balance", "minibatch", "product")]
                + [
                    paper_x,
                    _ratio(rec["at_paper_product"]["mean"], ratio)
                    if rec["at_paper_product"]
                    else None,
                ]
                + [fmt_spread(rec[f"at_paper_{k}"]) for k in ("mfu_none", "mfu_full")]
            )
            lo, hi = PAPER["fig9_tpt_ratio_range"]
            fig9 = {
                "figure": "fig9",
                "model": model,
                "ranks": d,
                "seeds": len(sw.seeds),
                "paper_tpt_ratio_range": [lo, hi],
                **{k: rec[k] for k in TPT},
                **{f"at_paper_{k}": rec[f"at_paper_{k}"] for k in TPT},
            }
            sw.records.append(fig9)
            tpt_rows.append(
                [model, d]
                + [fmt_spread(fig9[k]) for k in TPT]
                + [fmt_spread(fig9[f"at_paper_{k}"]) for k in TPT]
                + [f"{lo}-{hi}"]
            )
    seeds = len(sw.seeds)
    _table(
        "Figure 8 decomposed, at the largest mini-batch per rank the memory model lets run "
        "(none, full): speed-up of balancing at the none mini-batch x speed-up of full's larger "
        f"mini-batch = MFU ratio full/none; mean (min-max) over {seeds} seeds; OOM: not even a "
        "balanced step at the none mini-batch fits",
        ["model", "GPUs", "b none", "b full", "balance x", "mini-batch x", "product x",
         "paper x", "sim/paper", "MFU none", "MFU full"],
        rows,
    )  # fmt: skip
    _table(
        "Figure 8 decomposed, at the paper's mini-batches (none -> full, section 8.1), on the "
        f"same sampled steps; mean (min-max) over {seeds} seeds; OOM: the simulator's memory "
        "model does not fit that mini-batch",
        ["model", "GPUs", "paper b", "balance x", "mini-batch x", "product x", "paper x",
         "sim/paper", "MFU none", "MFU full"],
        paper_rows,
    )  # fmt: skip
    _table(
        "Figure 9: LLM tokens per second per GPU (the paper's TPT), none and full and their "
        f"ratio, at the largest fitting mini-batches and at the paper's; mean (min-max) over "
        f"{seeds} seeds; the paper's full/none ratio from its text. Megatron-LM: not simulated "
        "(see the notes)",
        ["model", "GPUs", "none", "full", "full/none", "none@paper b", "full@paper b",
         "full/none@paper b", "paper full/none"],
        tpt_rows,
    )  # fmt: skip
    if headline:
        print(headline)


def table2_scale(sw: Sweep, d: int, *, lo: float = 0.5, hi: float = 4.0) -> dict[str, Any]:
    """The length scale (:func:`orchmllm.sim.sweep.with_workload`) at which the simulated
    forward time of Table 2's set-up (MLLM-10B, mini-batch 60, full + node-wise, the first
    seed's step) equals the paper's at ``d`` GPUs, by bisection on ``log(scale)`` in
    ``[lo, hi]`` to 1% (the forward time grows with every length). A derived figure: how much
    heavier the paper's examples would have to be; never used as the workload. ``scale`` is
    None when the paper's time lies outside the forward times at ``lo`` and ``hi``."""
    model, b = "mllm-10b", PAPER["table2_minibatch"]
    base, seed, target = sw.models[model], sw.seeds[0], PAPER["table2"][d][1]

    def forward(scale: float) -> dict[str, Any]:
        m = with_workload(base, scale=scale)
        pools = {0: sample_pool(m, d, b, (seed, 0))}  # Table 2's first step at this scale
        return run_case(m, d, "full", examples_per_rank=b, placement="node", pools=pools)

    at = {lo: forward(lo), hi: forward(hi)}
    rec: dict[str, Any] = {
        "figure": "table2_scale", "model": model, "ranks": d, "examples_per_rank": b,
        "seed": seed, "paper_forward_s": target, "forward_s_at_1": forward(1.0)["forward_s"],
        "searched": [lo, hi], "scale": None,
    }  # fmt: skip
    if at[lo]["forward_s"] <= target <= at[hi]["forward_s"]:
        while hi / lo > 1.01:
            mid = float(np.sqrt(lo * hi))
            at[mid] = forward(mid)
            lo, hi = (mid, hi) if at[mid]["forward_s"] < target else (lo, mid)
        scale = float(np.sqrt(lo * hi))
        match = forward(scale)
        rec.update(scale=scale, forward_s=match["forward_s"], oom=match["oom"],
                   peak_memory_gb=match["peak_memory_gb"])  # fmt: skip
    sw.records.append(rec)
    return rec


SENSITIVITY_KEYS = ("balance", "minibatch", "product")


def sensitivity(sw: Sweep, d: int, scales: Sequence[float], table2_ranks: Sequence[int]) -> None:
    """Figure 8 (both mini-batch settings) as the workload changes: every length times a
    scale, and the audio tasks' share of the image-or-audio tasks (at scale 1), on the first
    seed's steps at ``d`` GPUs; then the scale at which Table 2's forward time is the
    paper's. The shipped workload is scale 1 with the config's mix."""
    seed, rows = sw.seeds[0], []
    for model, base in sw.models.items():
        own = audio_share(base)
        variants = [(s, None) for s in scales] + [(1.0, a) for a in AUDIO_SHARES if a != own]
        for scale, share in variants:
            m = with_workload(base, scale=scale, audio_share=share)
            tags = {
                "length_scale": scale,
                "audio_share": audio_share(m),
                "varied": "scale" if share is None else "mix",
            }
            p = _fig8_point(
                sw, m, d, seed, None, steps=default_steps(d), figure="sensitivity_case", tags=tags
            )
            rec = {
                "figure": "sensitivity", "model": model, "ranks": d, "seed": seed, **tags,
                "b_none": p["b_none"], "b_full": p["b_full"],
                "paper_b_none": PAPER["minibatch_none"][model],
                "paper_b_full": PAPER["minibatch_full"][model],
                "paper_mfu_ratio": PAPER["fig8_mfu_ratio"].get(model),
                **{k: (p["own"] or {}).get(k) for k in SENSITIVITY_KEYS},
                **{f"at_paper_{k}": p["paper"][k] for k in SENSITIVITY_KEYS},
                "at_paper_oom": p["paper"]["oom"],
            }  # fmt: skip
            sw.records.append(rec)
            rows.append(
                [model, scale, f"{rec['audio_share']:.2f}", rec["b_none"], rec["b_full"],
                 f"{rec['paper_b_none']}->{rec['paper_b_full']}"]
                + [rec[k] for k in SENSITIVITY_KEYS]
                + ["OOM" if rec["at_paper_oom"] else "ok"]
                + [rec[f"at_paper_{k}"] for k in SENSITIVITY_KEYS]
            )  # fmt: skip
    _table(
        f"Sensitivity of Figure 8 to the workload ({d} GPUs, hybrid-shard group "
        f"{min(d, 256)}; seed {seed}, {default_steps(d)} step(s)): every "
        "length times a scale, and the audio tasks' share of the tasks with an image or a clip "
        "(at scale 1); the largest fitting mini-batches and their factors, then the factors at "
        "the paper's mini-batches (OOM: the memory model does not fit them)",
        ["model", "scale", "audio share", "b none", "b full", "paper b", "balance x",
         "mini-batch x", "product x", "paper b mem", "balance x", "mini-batch x", "product x"],
        rows,
    )  # fmt: skip
    if "mllm-10b" not in sw.models:
        return
    rows = []
    for r in (table2_scale(sw, t) for t in table2_ranks):
        rows.append([r["ranks"], r["forward_s_at_1"], r["paper_forward_s"], r["scale"],
                     r.get("forward_s"), "OOM" if r.get("oom") else "ok"])  # fmt: skip
    _table(
        "Derived, not used: the length scale at which Table 2's forward time (MLLM-10B, "
        "mini-batch 60, full) equals the paper's ('-': outside the scales searched)",
        ["GPUs", "forward s at 1", "paper", "scale", "forward s there", "mem"],
        rows,
    )


def figure10(sw: Sweep, d: int) -> None:
    rows = []
    for model in sw.models:
        b = PAPER["minibatch_ablation"][model]
        per_mode: dict[str, list[dict]] = {m: [] for m in MODES}
        for seed in sw.seeds:
            for mode in MODES:
                rec = sw.case("fig10", model, d, mode, b, b, seed, placement=placement_for(mode))
                per_mode[mode].append(rec)
        row: list[Any] = [model, b]
        for mode in MODES:
            recs = per_mode[mode]
            oom = any(r["oom"] for r in recs)
            mfu = None if oom else spread([r["mfu"] for r in recs])
            gb = max(r["peak_memory_gb"] for r in recs)
            sw.records.append(
                {
                    "figure": "fig10_summary",
                    "model": model,
                    "ranks": d,
                    "mode": mode,
                    "examples_per_rank": b,
                    "seeds": len(recs),
                    "oom": oom,
                    "mfu": mfu,
                    "peak_memory_gb_max": gb,
                }
            )
            row += [fmt_spread(mfu), f"{gb:.1f}" + (" OOM" if oom else "")]
        rows.append(row)
        if model == "mllm-84b":
            ref = PAPER["fig10_llm_84b"]
            found = []
            for seed in sw.seeds:
                pools = sw.pools(model, d, 4 * b, seed)
                bmax, rec = largest_minibatch(
                    sw.models[model], d, "llm", pools=pools, placement="node"
                )
                if rec is not None:
                    rec.update(
                        figure="fig10_llm_max",
                        seed=seed,
                        **{f"paper_{k}": v for k, v in ref.items()},
                    )
                    sw.records.append(rec)
                    found.append((bmax, rec))
            if found:
                bs = spread([f[0] for f in found])
                mfu = spread([f[1]["mfu"] for f in found])
                gb = max(f[1]["peak_memory_gb"] for f in found)
                print(
                    f"\nMLLM-84B llm-only at {d} GPUs: paper OOM at {ref['oom_at']}, runs at "
                    f"{ref['max_minibatch']} with MFU {ref['mfu']:.4f} and {ref['memory_gb']} "
                    f"GB; sim: {'OOM' if any(r['oom'] for r in per_mode['llm']) else 'fits'} at "
                    f"{b}, largest fitting {fmt_spread(bs)}, MFU there {fmt_spread(mfu)} "
                    f"(sim/paper {mfu['mean'] / ref['mfu']:.2f}), up to {gb:.1f} GB"
                )
    _table(
        f"Figure 10 analogue ({d} GPUs, the paper's ablation mini-batch): MFU mean (min-max) over "
        f"{len(sw.seeds)} seeds and worst peak memory (GB) per mode; OOM if any seed runs out",
        ["model", "b", "none", "GB", "llm", "GB", "disttrain", "GB", "full", "GB"],
        rows,
    )


def figure11(sw: Sweep, d: int) -> None:
    rows = []
    variants = {
        "tailored": None,
        "all_rmpad": {"audio": "greedy"},  # audio gets the vision (no-padding) algorithm
        "all_pad": {"vision": "binary_search"},  # vision gets the audio (padding) algorithm
    }
    for model in sw.models:
        b = PAPER["minibatch_ablation"][model]
        gain: dict[str, list[float]] = {"all_rmpad": [], "all_pad": []}
        stats: dict[str, list[float]] = {}
        oom = False
        for seed in sw.seeds:
            recs = {}
            for name, pol in variants.items():
                recs[name] = sw.case("fig11", model, d, "full", b, b, seed, policies=pol)
                recs[name]["variant"] = name
                oom |= recs[name]["oom"]
            for name in gain:
                gain[name].append(recs[name]["step_time_s"] / recs["tailored"]["step_time_s"])
            for key, rec, field in (
                ("mfu", recs["tailored"], "mfu"),
                ("vis", recs["tailored"], "imbalance_vision"),
                ("vis_pad", recs["all_pad"], "imbalance_vision"),
                ("aud", recs["tailored"], "imbalance_audio"),
                ("aud_rmpad", recs["all_rmpad"], "imbalance_audio"),
            ):
                stats.setdefault(key, []).append(rec[field])
        summary = {n: spread(v) for n, v in gain.items()}
        sw.records.append(
            {
                "figure": "fig11_summary",
                "model": model,
                "ranks": d,
                "seeds": len(sw.seeds),
                "oom": oom,
                **{f"speedup_tailored_over_{n}": s for n, s in summary.items()},
            }
        )
        rows.append(
            [
                model,
                "OOM" if oom else fmt_spread(spread(stats["mfu"])),
                fmt_spread(summary["all_rmpad"]),
                fmt_spread(summary["all_pad"]),
            ]
            + [float(np.mean(stats[k])) for k in ("vis", "vis_pad", "aud", "aud_rmpad")]
        )
    _table(
        f"Figure 11 analogue ({d} GPUs): tailored vs one algorithm for both encoders: tailored "
        f"MFU, step-time speed-up of tailored over each (mean (min-max), {len(sw.seeds)} seeds), "
        "mean phase imbalance max/mean",
        [
            "model",
            "tailored MFU",
            "x all_rmpad",
            "x all_pad",
            "vis imb",
            "vis imb all_pad",
            "aud imb",
            "aud imb all_rmpad",
        ],
        rows,
    )


def figure12(sw: Sweep, d: int) -> None:
    """OrchMLLM's all-to-all dispatcher against an all-gather communicator (every rank
    receives the whole global batch of a move, padded to the largest rank's, and keeps its
    own), both with full balancing and node-wise placement at the ablation mini-batch: the
    dispatch time, MFU and peak memory; then the largest mini-batch the all-gather fits."""
    rows, gather = [], Cluster(communicator="all_gather")
    for model in sw.models:
        b = PAPER["minibatch_ablation"][model]
        per: dict[str, list[dict[str, Any]]] = {"all_to_all": [], "all_gather": []}
        for seed in sw.seeds:
            for name, cluster in (("all_to_all", None), ("all_gather", gather)):
                rec = sw.case("fig12", model, d, "full", b, b, seed, placement="node",
                              cluster=cluster)  # fmt: skip
                rec["communicator"] = name
                per[name].append(rec)
        row: list[Any] = [model, b]
        for name, recs in per.items():
            oom = any(r["oom"] for r in recs)
            summary = {
                "figure": "fig12_summary", "model": model, "ranks": d, "communicator": name,
                "examples_per_rank": b, "seeds": len(recs), "oom": oom,
                "mfu": None if oom else spread([r["mfu"] for r in recs]),
                "dispatch_ms": spread([r["dispatch_fwd_ms"] + r["dispatch_bwd_ms"] for r in recs]),
                "peak_memory_gb_max": max(r["peak_memory_gb"] for r in recs),
            }  # fmt: skip
            sw.records.append(summary)
            row += [fmt_spread(summary["dispatch_ms"]), fmt_spread(summary["mfu"]),
                    f"{summary['peak_memory_gb_max']:.1f}" + (" OOM" if oom else "")]  # fmt: skip
        found = []
        for seed in sw.seeds:
            pools = sw.pools(model, d, 4 * b, seed)
            bmax, rec = largest_minibatch(
                sw.models[model], d, "full", pools=pools, placement="node", cluster=gather,
                guess=b,
            )  # fmt: skip
            if rec is not None:
                rec.update(figure="fig12_max", seed=seed, communicator="all_gather")
                sw.records.append(rec)
                found.append((bmax, rec))
        row.append(fmt_spread(spread([f[0] for f in found])) if found else "OOM")
        if model == "mllm-84b":
            row.append(f"{PAPER['fig12_allgather_84b']['max_minibatch']}")
        else:
            row.append(None)
        rows.append(row)
    ref = PAPER["fig12_allgather_84b"]
    _table(
        f"Figure 12 analogue ({d} GPUs, the paper's ablation mini-batch, full + node-wise): "
        "all-to-all vs all-gather dispatch, forward+backward dispatch ms, MFU and worst peak "
        f"memory (GB), mean (min-max) over {len(sw.seeds)} seeds; the largest mini-batch the "
        f"all-gather fits (the paper: MLLM-84B OOM at {ref['oom_at']}, runs at "
        f"{ref['max_minibatch']} with MFU {ref['mfu']} and {ref['memory_gb']} GB)",
        ["model", "b", "a2a ms", "a2a MFU", "a2a GB", "gather ms", "gather MFU", "gather GB",
         "gather max b", "paper max b"],
        rows,
    )  # fmt: skip


def figure13(sw: Sweep, d: int) -> None:
    """Node-wise placement with the paper's greedy batches, and with movement-aware batches
    (``greedy_stay`` on the packed phases), which keep items where they are when they can; both
    against the paper's greedy batches without placement."""
    rows = []
    lo, hi = PAPER["fig13_reduction_range"]
    stay = {"vision": "greedy_stay", "llm": "greedy_stay"}
    phases = ("vision", "audio", "llm")
    for model in sw.models:
        b = PAPER["minibatch_ablation"][model]
        offs = {s: sw.case("fig13", model, d, "full", b, b, s, placement="none") for s in sw.seeds}
        for label, pol in (("greedy", None), ("greedy_stay", stay)):
            red: dict[str, list[float]] = {k: [] for k in (*phases, "max_rank", "mfu")}
            for seed, off in offs.items():
                on = sw.case("fig13", model, d, "full", b, b, seed, placement="node", policies=pol)
                for phase in phases:
                    before = off[f"inter_node_bytes_mean_rank_{phase}"]
                    after = on[f"inter_node_bytes_mean_rank_{phase}"]
                    on[f"inter_node_reduction_{phase}"] = 1 - after / before if before else 0.0
                    red[phase].append(on[f"inter_node_reduction_{phase}"])
                before = off["inter_node_bytes_max_rank"]
                on["inter_node_reduction_max_rank"] = (
                    1 - on["inter_node_bytes_max_rank"] / before if before else 0.0
                )
                red["max_rank"].append(on["inter_node_reduction_max_rank"])
                red["mfu"].append(on["mfu"] / off["mfu"])
                on["paper_reduction_range"] = f"{lo}-{hi}"
            summary = {k: spread(v) for k, v in red.items()}
            sw.records.append(
                {
                    "figure": "fig13_summary",
                    "model": model,
                    "ranks": d,
                    "batches": label,
                    "seeds": len(sw.seeds),
                    **{f"reduction_{k}": summary[k] for k in (*phases, "max_rank")},
                    "speedup_placement": summary["mfu"],
                    "paper_reduction_range": [lo, hi],
                }
            )
            rows.append(
                [model, label]
                + [fmt_spread(summary[k]) for k in (*phases, "max_rank", "mfu")]
                + [f"{lo}-{hi}"]
            )
    _table(
        f"Figure 13 analogue ({d} GPUs): reduction of mean inter-node bytes per rank per "
        "dispatcher (1 - on/off; off: greedy batches, no placement; on: the row's batches with "
        f"node-wise placement) and MFU on/off, mean (min-max) over {len(sw.seeds)} seeds",
        ["model", "batches", "vision", "audio", "llm", "max-rank", "MFU on/off", "paper"],
        rows,
    )


def table2(sw: Sweep, ranks: Sequence[int]) -> None:
    model, b, rows = "mllm-10b", PAPER["table2_minibatch"], []
    if model not in sw.models:
        return
    seed = sw.seeds[0]
    for d in ranks:
        rec = sw.case("table2", model, d, "full", b, b, seed, placement="node")
        p_over, p_dur = PAPER["table2"].get(d, (None, None))
        rec.update(
            {
                "paper_overhead_ms": p_over,
                "paper_forward_s": p_dur,
                "overhead_ratio_to_paper": _ratio(rec["dispatch_fwd_ms"], p_over),
                "forward_ratio_to_paper": _ratio(rec["forward_s"], p_dur),
            }
        )
        rows.append(
            [
                d,
                rec["dispatch_fwd_ms"],
                p_over,
                rec["overhead_ratio_to_paper"],
                rec["forward_s"],
                p_dur,
                rec["forward_ratio_to_paper"],
                100 * rec["dispatch_fwd_ms"] / 1e3 / rec["forward_s"],
                rec["plan_ms"],
                "yes" if rec["plan_hidden"] else "NO",
                "OOM" if rec["oom"] else "ok",
            ]
        )
    _table(
        f"Table 2 analogue (MLLM-10B, the paper's mini-batch {b}, full + node-wise, seed {seed} "
        "only: overheads, not speed-ups): forward dispatch overhead, forward time, planning time "
        "of the real planner",
        [
            "GPUs",
            "overhead ms",
            "paper",
            "sim/paper",
            "forward s",
            "paper",
            "sim/paper",
            "overhead %",
            "plan ms",
            "plan hidden",
            "mem",
        ],
        rows,
    )


def gpu_setup(rec: dict[str, Any]) -> EmulatedSetup:
    """The set-up a ``gpu_step`` record ran: its run config (the record's ``config``, else
    gpu_step's default for the device) with the record's layer counts and the config's
    training recipe, at the record's link speed."""
    cpu = rec["device"] == "cpu"
    default = "configs/tiny.yaml" if cpu else "configs/mllm-10b.yaml"
    path = Path(rec.get("config") or default)
    if not path.is_absolute():
        path = ROOT / path
    return EmulatedSetup.load(
        path,
        layers={p: rec[f"{p}_layers"] for p in load_config(path).phases},
        link_gbs=float(rec.get("link_gbs", 450.0)),  # gpu_step's --link-gbs default
        device="cpu" if cpu else "cuda",
    )


def gpu_batch(model: SimModel, ranks: int, per_rank: int, step: int, seed: int) -> Batch:
    """The examples ``gpu_step`` ran in ``step``: ids ``step * ranks * per_rank`` onwards, rank
    ``r`` holding the ``r``-th run of ``per_rank``; example ``i`` has the lengths of example
    ``i % BLOCK`` of the recipe draw seeded ``block_seed(seed, i // BLOCK)``
    (``orchmllm.data.synthetic``)."""
    ids = np.arange(step * ranks * per_rank, (step + 1) * ranks * per_rank)
    text: list[np.ndarray] = []
    items: dict[str, list[ItemLengths]] = {n: [] for n in model.config.encoders}
    start = 0
    for block in np.unique(ids // BLOCK):
        drawn = sample_pool(model, 1, BLOCK, block_seed(seed, int(block)))
        local = ids[ids // BLOCK == block] % BLOCK
        new_id = np.full(BLOCK, -1)
        new_id[local] = start + np.arange(local.size)
        text.append(drawn.text[local])
        for name, parts in items.items():
            it = drawn.of(name)
            keep = new_id[it.example] >= 0
            parts.append(ItemLengths(new_id[it.example[keep]], it.raw[keep]))
        start += local.size
    return Batch(
        ranks,
        np.concatenate(text),
        {
            n: ItemLengths(
                np.concatenate([p.example for p in ps]), np.concatenate([p.raw for p in ps])
            )
            for n, ps in items.items()
        },
    )


def validation(sw: Sweep, results_dir: Path) -> None:
    """Simulated vs measured step time and speed-up, and per phase measured / simulated, for
    every record of ``results_dir`` (a gpu_step ``--json`` file, or a directory of
    ``gpu_step_*.json`` files)."""
    files = [results_dir] if results_dir.is_file() else sorted(results_dir.glob("gpu_step_*.json"))
    print("\n== Validation against measurement (benchmarks/gpu_step.py --json records)")
    if not files:
        print(
            f"no GPU record: nothing matches {results_dir}/gpu_step_*.json, so no simulated "
            "figure has been checked against a measured step (write them on a GPU with "
            "`python -m benchmarks.gpu_check`)"
        )
        sw.records.append({"figure": "gpu_validation", "gpu_records": 0})
        return
    rows, phase_rows, devices = [], [], set()
    for path in files:
        measured = json.loads(path.read_text())
        for ranks, per_rank in sorted({(r["ranks"], r["examples_per_rank"]) for r in measured}):
            group = {
                r["mode"]: r
                for r in measured
                if (r["ranks"], r["examples_per_rank"]) == (ranks, per_rank)
            }
            r0 = next(iter(group.values()))
            devices.add(r0["device"])
            setup = gpu_setup(r0)
            model = setup.model
            batches = [
                gpu_batch(model, ranks, per_rank, k, int(r0.get("seed", 0)))
                for k in range(r0["steps"])
            ]
            predicted = setup.predict(batches, modes=list(group))
            sim = {mode: p["step_time_s"] for mode, p in predicted.items()}
            for mode, rec in group.items():
                sim_speedup = sim["none"] / sim[mode] if "none" in sim else None
                # which gpu_step run and method measured it, and whether its self-check held
                origin = {  # run_id is this run's own (provenance): gpu_run_id the GPU's
                    "gpu_run_id": rec.get("run_id"),
                    "method": rec.get("method"),
                    "sound": rec.get("sound"),
                }
                for out in phase_validation(path.name, rec, predicted[mode], model, origin):
                    sw.records.append(out)
                    phase_rows.append(
                        [path.name, rec["device"], rec["ranks"], per_rank, mode, out["phase"],
                         out["measured_mean_s"], out["sim_mean_s"], out["mean_ratio"],
                         out["measured_max_s"], out["sim_max_s"], out["max_ratio"]]
                    )  # fmt: skip
                out = {
                    "figure": "gpu_validation",
                    "source": path.name,
                    **origin,
                    "device": rec["device"],
                    "model": model.name,
                    "layers": [rec[f"{p}_layers"] for p in (*model.config.encoders, "llm")],
                    "ranks": rec["ranks"],
                    "examples_per_rank": per_rank,
                    "steps": rec["steps"],
                    "mode": mode,
                    "sim_step_s": sim[mode],
                    "measured_step_s": rec["step_time_s"],
                    "step_ratio": sim[mode] / rec["step_time_s"],
                    "sim_speedup": sim_speedup,
                    "measured_speedup": rec.get("speedup_vs_none"),
                    "speedup_ratio": _ratio(sim_speedup, rec.get("speedup_vs_none")),
                }
                sw.records.append(out)
                rows.append(
                    [
                        path.name,
                        rec["device"],
                        f"{model.name} {'/'.join(map(str, out['layers']))}",
                        rec["ranks"],
                        per_rank,
                        mode,
                        out["sim_step_s"],
                        out["measured_step_s"],
                        out["step_ratio"],
                        out["sim_speedup"],
                        out["measured_speedup"],
                        out["speedup_ratio"],
                    ]
                )
    _table(
        "Simulated vs measured (same model shape and layers, ranks, examples, modes): step time "
        "(s) and speed-up over none",
        [
            "record",
            "device",
            "model v/a/llm layers",
            "ranks",
            "b",
            "mode",
            "sim step",
            "measured",
            "sim/meas",
            "sim x",
            "measured x",
            "sim/meas",
        ],
        rows,
    )
    if phase_rows:
        _table(
            "Per phase, measured / simulated on identical work (the same examples in the same "
            "layout on every rank; mean rank and slowest rank, s)",
            ["record", "device", "ranks", "b", "mode", "phase", "measured mean", "sim mean",
             "meas/sim", "measured max", "sim max", "meas/sim"],
            phase_rows,
        )  # fmt: skip
    if "cpu" in devices:
        print(
            "cpu records: the simulator's compute is the H100's, so their step-time ratio "
            "measures only the device; their speed-ups are comparable"
        )


def phase_validation(
    source: str,
    rec: dict[str, Any],
    predicted: dict[str, float],
    model: SimModel,
    origin: dict[str, Any],
) -> list[dict[str, Any]]:
    """Per phase of one gpu_step record (those that time phases: mean and slowest rank), the
    measured time over the simulated one for the same examples and layout. Records of
    gpu_step's replaced method (no ``method``) ran each rank once on cold shapes: kept, and
    marked by ``method`` None."""
    out = []
    for phase in (*model.config.encoders, LLM):
        if f"{phase}_mean_s" not in rec or f"{phase}_mean_s" not in predicted:
            continue
        measured = {s: rec[f"{phase}_{s}_s"] for s in ("mean", "max")}
        simulated = {s: predicted[f"{phase}_{s}_s"] for s in ("mean", "max")}
        out.append(
            {
                "figure": "gpu_phase_validation",
                "source": source,
                **origin,
                "device": rec["device"],
                "model": model.name,
                "ranks": rec["ranks"],
                "examples_per_rank": rec["examples_per_rank"],
                "mode": rec["mode"],
                "phase": phase,
                **{f"measured_{s}_s": v for s, v in measured.items()},
                **{f"sim_{s}_s": v for s, v in simulated.items()},
                **{f"{s}_ratio": _ratio(measured[s], simulated[s]) for s in measured},
            }
        )
    return out


def plots(records: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def pick(figure: str, **match: Any) -> list[dict[str, Any]]:
        return [
            r
            for r in records
            if r.get("figure") == figure and all(r.get(k) == v for k, v in match.items())
        ]

    models = sorted({r["model"] for r in records if "model" in r and "ranks" in r})
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rs = sorted(pick("fig8", model=model), key=lambda r: r["ranks"])
        for key, style in (("mfu_none", "o--"), ("mfu_full", "s-")):
            ok = [r for r in rs if r[key]]  # an out-of-memory point is not plotted
            mean = np.array([100 * r[key]["mean"] for r in ok])
            err = [
                mean - [100 * r[key]["min"] for r in ok],
                [100 * r[key]["max"] for r in ok] - mean,
            ]
            ax.errorbar([r["ranks"] for r in ok], mean, yerr=err, fmt=style, capsize=3,
                        label=f"{key[4:]} at its own mini-batch")  # fmt: skip
        if model == "mllm-84b":
            ax.axhline(
                100 * PAPER["fig8_mfu_full_84b_2560"], color="gray", lw=0.8,
                label="paper full @2560",
            )  # fmt: skip
        ax.set_xscale("log")
        ticks = [r["ranks"] for r in rs]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_title(model)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("MFU (%), mean and min-max over seeds")
        ax.legend(fontsize=7)
    save(fig, "fig8_mfu.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(models))
    for i, mode in enumerate(MODES):
        rs = [pick("fig10_summary", model=m, mode=mode) for m in models]
        mfu = [100 * r[0]["mfu"]["mean"] if r and r[0]["mfu"] else 0 for r in rs]
        a1.bar(x + 0.2 * i, mfu, 0.2, label=mode)
        for j, r in enumerate(rs):
            if r and r[0]["oom"]:
                a1.text(x[j] + 0.2 * i, 1, "OOM", rotation=90, ha="center", fontsize=7)
        a2.bar(x + 0.2 * i, [r[0]["peak_memory_gb_max"] if r else 0 for r in rs], 0.2, label=mode)
    budget = next((r["memory_budget_gb"] for r in records if "memory_budget_gb" in r), None)
    if budget:
        a2.axhline(budget, color="red", lw=0.8, label="budget")
    for ax, label in ((a1, "MFU (%), OOM not plotted"), (a2, "peak memory (GB)")):
        ax.set_xticks(x + 0.3, models)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    save(fig, "fig10_ablation.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for i, variant in enumerate(("tailored", "all_rmpad", "all_pad")):
        rs = [[r for r in pick("fig11", model=m) if r.get("variant") == variant] for m in models]
        mfu = [100 * np.mean([x["mfu"] for x in r]) if r and not any(x["oom"] for x in r) else 0
               for r in rs]  # fmt: skip
        ax.bar(x + 0.25 * i, mfu, 0.25, label=variant)
    ax.set_xticks(x + 0.25, models)
    ax.set_ylabel("MFU (%), mean over seeds")
    ax.legend(fontsize=7)
    save(fig, "fig11_algorithms.png")

    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    phases = ("vision", "audio", "llm")
    for ax, model in zip(axes[0], models, strict=True):
        for j, placement in enumerate(("none", "node")):
            rs = pick("fig13", model=model, placement=placement, policies="tailored")
            vals = [
                np.mean([r[f"inter_node_bytes_mean_rank_{p}"] for r in rs]) / 1e6 if rs else 0
                for p in phases
            ]
            ax.bar(np.arange(3) + 0.4 * j, vals, 0.4, label=f"placement={placement}")
        ax.set_xticks(np.arange(3) + 0.2, phases)
        ax.set_title(model)
        ax.set_ylabel("inter-node MB per rank, mean over seeds")
        ax.legend(fontsize=7)
    save(fig, "fig13_internode.png")

    sens = pick("sensitivity")
    if sens:
        fig, axes = plt.subplots(2, len(models), figsize=(4.5 * len(models), 6), squeeze=False)
        for j, model in enumerate(models):
            rs = sorted(
                (r for r in sens if r["model"] == model and r["varied"] == "scale"),
                key=lambda r: r["length_scale"],
            )
            x = [r["length_scale"] for r in rs]
            for key, style, at in (
                ("product", "s-", "own b"),
                ("at_paper_product", "o--", "paper's b"),
            ):
                y = [r[key] if r[key] else np.nan for r in rs]
                axes[0][j].plot(x, y, style, label=f"full/none at {at}")
            axes[0][j].set_title(model)
            axes[0][j].set_ylabel("MFU ratio full/none")
            axes[0][j].legend(fontsize=7)
            for key, style in (("b_none", "o--"), ("b_full", "s-")):
                axes[1][j].plot(x, [r[key] for r in rs], style, label=key)
                axes[1][j].axhline(rs[0][f"paper_{key}"], color="gray", lw=0.8, ls=style[1:])
            axes[1][j].set_xlabel("length scale")
            axes[1][j].set_ylabel("largest mini-batch (gray: paper's)")
            axes[1][j].legend(fontsize=7)
        save(fig, "sensitivity.png")

    rs = sorted(pick("table2"), key=lambda r: r["ranks"])
    if rs:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        d = [r["ranks"] for r in rs]
        ax.plot(d, [r["dispatch_fwd_ms"] for r in rs], "s-", label="sim overhead")
        ax.plot(d, [r["paper_overhead_ms"] for r in rs], "o--", label="paper overhead")
        ax.plot(d, [r["plan_ms"] for r in rs], "^:", label="measured plan (hidden)")
        ax.set_xscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
        save(fig, "table2_overhead.png")
    return written


def defaults(sw: Sweep, ranks: Sequence[int]) -> None:
    """Which batches to ship (issue 16, item 5): the Figure 13 comparison at production scales,
    the paper's greedy batches against movement-aware ones, both with node-wise placement,
    then the row with the higher predicted MFU per model and scale (a tie keeps the paper's)."""
    for d in ranks:
        figure13(sw, d)
    rows = []
    for model in sw.models:
        for d in ranks:
            summary = {
                r["batches"]: r
                for r in sw.records
                if r["figure"] == "fig13_summary" and r["model"] == model and r["ranks"] == d
            }
            mfu = {k: v["speedup_placement"]["mean"] for k, v in summary.items()}
            # Below DEFAULTS_TIE the simulator cannot tell (its MFU is an upper bound that
            # leaves out kernel gaps and exposed latency): keep the paper's batches.
            stay_wins = mfu["greedy_stay"] > mfu["greedy"] * (1 + DEFAULTS_TIE)
            best = "greedy_stay" if stay_wins else "greedy"
            sw.records.append(
                {"figure": "defaults", "model": model, "ranks": d, "ship": best,
                 "tie": DEFAULTS_TIE}
            )  # fmt: skip
            rows.append(
                [model, d, f"{mfu['greedy']:.4f}", f"{mfu['greedy_stay']:.4f}", best]
                + [fmt_spread(summary[best]["reduction_max_rank"])]
            )
    _table(
        "Defaults from the simulator: MFU over the paper's greedy batches without placement "
        "(mean over seeds), with node-wise placement on the paper's batches and on "
        "movement-aware ones (greedy_stay on vision and LLM); the winner, and its reduction "
        "of the busiest rank's inter-node bytes",
        ["model", "GPUs", "greedy+node", "greedy_stay+node", "ship", "max-rank reduction"],
        rows,
    )


def closing(records: list[dict[str, Any]]) -> list[str]:
    """The closing note's figures, from this run's records: Figure 8 at the paper's
    mini-batches (the largest scale up to the paper's 2560) with their spreads, and the
    length scale at which Table 2's forward time is the paper's."""
    out = []
    fig8 = [r for r in records if r.get("figure") == "fig8"]
    top = max((r["ranks"] for r in fig8 if r["ranks"] <= 2560), default=None)
    at = [r for r in fig8 if r["ranks"] == top]
    if at:
        out.append(
            f"Figure 8 at {top} GPUs, MFU ratio full/none at the paper's mini-batches: "
            + "; ".join(f"{r['model']} {fmt_spread(r['at_paper_product'])}" for r in at)
            + " (at the largest fitting: "
            + "; ".join(f"{r['model']} {fmt_spread(r['product'])}" for r in at)
            + "); the paper: 1.5-2.0."
        )
    for r in records:
        if r.get("figure") == "table2_scale":
            where = f"scale {r['scale']:.2f}" if r["scale"] else "no scale searched"
            out.append(
                f"Table 2's forward time at {r['ranks']} GPUs ({r['paper_forward_s']} s; the sim "
                f"{r['forward_s_at_1']:.3g} s) is matched at length {where} (derived, not used)."
            )
    return out


SECTIONS = (
    "speedup", "fig8", "sensitivity", "fig10", "fig11", "fig12", "fig13", "table2", "validation",
    "defaults",
)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help=f"reduced sweep, {QUICK_SEEDS} seeds, seconds"
    )
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("reproduce_paper_out"),
        help="directory for the PNG plots and records.json",
    )
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS))
    ap.add_argument("--steps", type=int, default=None, help="sampled steps per case")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds ({SEEDS}; quick {QUICK_SEEDS})")
    ap.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run"
    )
    ap.add_argument(
        "--gpu-results",
        type=Path,
        default=GPU_RESULTS,
        help="a benchmarks/gpu_step.py --json file, or a directory of them named gpu_step_*.json",
    )
    ap.add_argument(
        "--fig8-ranks", type=int, nargs="+", default=None, help=f"Figure 8 scales ({FIG8_RANKS})"
    )
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    for m in args.models:
        if m not in PAPER_MODELS:
            ap.error(f"--models: {m!r} is not one of {PAPER_MODELS}")
    for name in ("steps", "seeds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name} must be >= 1, got {value}")
    start = time.perf_counter()
    models = {m: load_model(m) for m in args.models}
    seeds = args.seeds or (QUICK_SEEDS if args.quick else SEEDS)
    sw = Sweep(models, 1 if args.quick else args.steps, range(args.seed, args.seed + seeds))
    ranks = QUICK_RANKS if args.quick else RANKS
    ablation = QUICK_ABLATION_RANKS if args.quick else ABLATION_RANKS
    print(
        f"{seeds} seeds per speed-up"
        + (" (--quick: fewer than the full run's 5)" if args.quick else "")
    )
    sw.records.extend(calibration())
    sections: dict[str, Callable[[], None]] = {
        "speedup": lambda: speedups(sw),
        "fig8": lambda: figure8(sw, args.fig8_ranks or (QUICK_RANKS if args.quick else FIG8_RANKS)),
        "sensitivity": lambda: sensitivity(
            sw,
            QUICK_SENSITIVITY_RANKS if args.quick else SENSITIVITY_RANKS,
            QUICK_SENSITIVITY_SCALES if args.quick else SENSITIVITY_SCALES,
            QUICK_TABLE2_SCALE_RANKS if args.quick else TABLE2_SCALE_RANKS,
        ),
        "fig10": lambda: figure10(sw, ablation),
        "fig11": lambda: figure11(sw, ablation),
        "fig12": lambda: figure12(sw, ablation),
        "fig13": lambda: figure13(sw, ablation),
        "table2": lambda: table2(sw, ranks),
        "validation": lambda: validation(sw, args.gpu_results),
        "defaults": lambda: defaults(sw, QUICK_DEFAULTS_RANKS if args.quick else DEFAULTS_RANKS),
    }
    for name in SECTIONS:
        if name in args.sections:
            sections[name]()
    print("\n== Where the simulation disagrees with the paper, and why")
    for note in NOTES:
        print(f"- {note}")
    for line in closing(sw.records):
        print(f"- {line}")
    if not args.no_plots and "fig8" in args.sections:
        written = plots(sw.records, args.out)
        print("\nplots: " + ", ".join(str(p) for p in written))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "records.json").write_text(json.dumps(sw.records, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_records(args.json, sw.records)
    print(f"\n{len(sw.records)} records in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
