"""The simulator against measured steps: every ``benchmarks/gpu_step.py --json`` record's set-up
and very examples simulated, step time, speed-up and per phase time compared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from orchmllm.config import load_config
from orchmllm.data.recipe import ItemLengths
from orchmllm.data.synthetic import BLOCK, block_seed
from orchmllm.schema import LLM
from orchmllm.sim.batch import Batch
from orchmllm.sim.emulated import EmulatedSetup
from orchmllm.sim.sweep import SimModel, sample_pool

from .sweep import Sweep, print_table, ratio_or_none

ROOT = Path(__file__).resolve().parents[2]


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
                    "speedup_ratio": ratio_or_none(sim_speedup, rec.get("speedup_vs_none")),
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
    print_table(
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
        print_table(
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
                **{f"{s}_ratio": ratio_or_none(measured[s], simulated[s]) for s in measured},
            }
        )
    return out
