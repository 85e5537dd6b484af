"""Reproduce the OrchMLLM paper's section 8 at cluster scale with the simulator.

The command line of ``benchmarks/reproduce_paper.py`` (its docstring says what each section
prints): the scales and seeds of a full and a ``--quick`` run, the sections in order, the
calibration table first and the closing note last.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orchmllm.provenance import write_records
from orchmllm.sim.compute import load_block_records, measured_fits
from orchmllm.sim.sweep import PAPER_MODELS, load_model

from .ablations import defaults, figure10, figure11, figure12, figure13, speedups, table2
from .figure8 import figure8, sensitivity
from .paper import NOTES
from .plots import plots
from .sweep import Sweep, fmt_spread, print_table
from .validation import validation

ROOT = Path(__file__).resolve().parents[2]
RANKS = (64, 128, 256, 512, 1024, 2560)  # Table 2's scales
# The paper's Figure 8 is at 2560; two smaller scales for the trend, and 16,384 (2048 nodes of
# 8), where clusters go next.
FIG8_RANKS = (64, 256, 2560, 16384)
QUICK_RANKS = (32, 64)
ABLATION_RANKS = 128  # section 8.3 microbenchmarks
DEFAULTS_RANKS = (2560, 16384)  # the scales the shipped policies are chosen for
QUICK_DEFAULTS_RANKS = (64,)
QUICK_ABLATION_RANKS = 32
# The sensitivity sweep runs at one hybrid-shard group (the paper's 256 ranks), where a rank's
# memory is what it is at 2560; every length times these scales, and these audio shares.
SENSITIVITY_RANKS, QUICK_SENSITIVITY_RANKS = 256, 32
SENSITIVITY_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
QUICK_SENSITIVITY_SCALES = (0.5, 1.0, 2.0)
TABLE2_SCALE_RANKS, QUICK_TABLE2_SCALE_RANKS = (64, 2560), (64,)
SEEDS, QUICK_SEEDS = 5, 2
GPU_RESULTS = ROOT / "benchmarks" / "results"


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
    print_table(
        "Calibration on h100_table1_blocks.json (per-shape least squares, orchmllm.planner.cost)",
        ["shape", "attention", "records", "linear TF/s", "attn TF/s", "max rel err"],
        rows,
    )
    return out


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
