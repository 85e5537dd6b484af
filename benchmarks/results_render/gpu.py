"""Sections measured on a GPU: the emulated training step (``gpu_step.py``), the cost of a new
encoder shape, the trainer's memory; the README's GPU block; and the rule that every GPU figure
quoted as current comes from one run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tables import RESULTS, Records, fmt, read, span, table, target_table, verdict

# gpu_step's timing method since issue 38 (its records say ``method``): warm shapes, median of
# repeats, modes interleaved, the identical-work self-check. Records without it are history.
SOUND_METHOD = "warm-median"


def is_sound_method(r: dict[str, Any]) -> bool:
    return r.get("method") == SOUND_METHOD


def gpu_step(recs: Records) -> list[str]:
    """The sound step's records (one run), then the replaced method's, marked as history."""
    current = [r for r in recs if is_sound_method(r)]
    old = [r for r in recs if not is_sound_method(r)]
    lines = []
    if current:
        lines += _gpu_step_current(current)
    else:
        lines += [
            "No record of the sound step yet (`benchmarks/gpu_step.py` since issue 38: every "
            "rank's exact inputs once untimed, then timed repeats, median kept, modes "
            "interleaved, the identical-work self-check): `python -m benchmarks.gpu_check` on a "
            "GPU writes one.",
            "",
        ]
    if old:
        lines += _gpu_step_history(old)
    return lines


def _gpu_step_table(recs: Records) -> tuple[list[str], list[list[str]]]:
    """The step table and the full mode's target verdicts."""
    rows, targets = [], []
    for r in recs:
        encoders = [k for k in r if k.endswith("_layers") and k != "llm_layers"]
        layers = "/".join(str(r[k]) for k in [*encoders, "llm_layers"])
        rows.append(
            [r["device"], layers, r["ranks"], r["examples_per_rank"], f"`{r['mode']}`",
             f"{r['step_time_s']:.4f}", f"{r['sim_step_time_s']:.4f}",
             f"{r['speedup_vs_none']:.3f}", f"{r['sim_speedup_vs_none']:.3f}",
             f"{r['speedup_vs_llm']:.3f}", f"{r['step_over_ideal']:.3f}",
             f"{r['peak_mem_bytes'] / 2**30:.2f}", f"{r['sim_peak_mem_bytes'] / 2**30:.2f}",
             f"{r['tokens_per_s']:,.0f}"]
        )  # fmt: skip
        if r["mode"] != "full" or not r.get("sound", True):  # no verdict on unsound timing
            continue
        where_ = f"{r['ranks']} ranks x {r['examples_per_rank']}/rank, `full`"
        for key, name in (("speedup_vs_none", "`none`"), ("speedup_vs_llm", "`llm`")):
            want = r[f"sim_{key}"]
            targets.append(
                [f"{where_}: × {name} ≥ the prediction {want:.3f}", f"{r[key]:.3f}",
                 verdict(r[key], at_least=want)]
            )  # fmt: skip
    table_lines = table(
        ["device", "layers", "ranks", "b", "mode", "step s", "sim s", "× none", "sim",
         "× llm", "/ ideal", "peak GiB", "sim GiB", "LLM tokens/s per GPU"],
        rows,
    )  # fmt: skip
    return table_lines, targets


def _phases(r: dict[str, Any]) -> list[str]:
    return [k.removesuffix("_mean_over_sim") for k in r if k.endswith("_mean_over_sim")]


def _gpu_step_current(recs: Records) -> list[str]:
    runs = sorted({str(r.get("run_id")) for r in recs})
    lines = [
        "Data-parallel ranks emulated on one device (`benchmarks/gpu_step.py` says how): per "
        "rank, every mode's exact inputs run once untimed, then "
        f"{span(r['repeats'] for r in recs)} timed repeats with the modes interleaved; a "
        "phase's time is the median of its repeats (CUDA events on a GPU). The step is the "
        "slowest rank per phase plus the dispatch cost; the ideal step gives every phase its "
        "mean rank time (each record defines its figures in `definitions`). `sim` columns are "
        "the simulator's prediction for the same set-up and the very batches measured "
        "(`orchmllm.sim.emulated`); a measured speed-up below it is a finding, not hidden. "
        f"Layers: each encoder's, then the LLM's. Run `{'`, `'.join(runs)}`.",
        "",
    ]
    table_lines, targets = _gpu_step_table(recs)
    lines += table_lines
    checks = []
    for (ranks, b), group in _by_setup(recs).items():
        r = group.get("none") or next(iter(group.values()))
        ratios = [k for k in r if k.startswith("check_") and k.endswith("_ratio")]
        checks.append(
            [f"{ranks} x {b}", f"{r['check_tolerance']:.0%}",
             ", ".join(f"{k.removeprefix('check_').removesuffix('_ratio')} {r[k]:.3f}"
                       for k in ratios),
             "sound" if r["sound"] else "**unsound**: " + ", ".join(r["unsound_phases"])]
        )  # fmt: skip
    lines += [
        "**Self-check**: `llm` runs `none`'s very encoder inputs on every rank, so each "
        "encoder phase under `llm` over `none` (slowest and mean rank) must be within the "
        "tolerance of 1; an unsound set-up's figures say more about the timing than about "
        "balancing.",
        "",
        *table(["set-up", "tolerance", "llm / none", "verdict"], checks),
    ]
    if targets:
        lines += target_table(targets)
    phase_rows = [
        [f"{r['ranks']} x {r['examples_per_rank']}", f"`{r['mode']}`", p,
         f"{r[f'{p}_mean_s']:.4f}", f"{r[f'sim_{p}_mean_s']:.4f}",
         fmt(r[f"{p}_mean_over_sim"], ".2f"), f"{r[f'{p}_max_s']:.4f}",
         f"{r[f'sim_{p}_max_s']:.4f}", fmt(r[f"{p}_max_over_sim"], ".2f"),
         f"{r[f'{p}_spread_max']:.1%}"]
        for r in recs
        for p in _phases(r)
    ]  # fmt: skip
    lines += [
        "**Per phase, measured against simulated** on the same work (the same examples in the "
        "same layout on every rank; from the same records): mean rank and slowest rank time, "
        "and the largest spread of a rank's repeats ((slowest - fastest) / median).",
        "",
        *table(["set-up", "mode", "phase", "mean s", "sim", "meas/sim", "max s", "sim",
                "meas/sim", "spread"], phase_rows),
    ]  # fmt: skip
    return lines


def _gpu_step_history(recs: Records) -> list[str]:
    """The replaced method's records: kept, their flaw measured from themselves."""
    lines = [
        "**History: the replaced method, unsound.** These records timed each rank once, for "
        "one step, after a warm-up on other batches, so a rank meeting padded shapes it had "
        "not run paid their first-call cost inside its timing (issue 38). Their own figures "
        "show it: `llm` runs `none`'s very audio inputs, yet its audio phase timed "
        + "; ".join(
            f"{g['none']['audio_mean_s'] / g['llm']['audio_mean_s']:.1f}x faster at "
            f"{ranks} x {b} (mean rank)"
            for (ranks, b), g in _by_setup(recs).items()
            if {"none", "llm"} <= set(g) and g["llm"].get("audio_mean_s")
        )
        + ". No conclusion is drawn from them.",
        "",
    ]
    table_lines, _ = _gpu_step_table(recs)
    return lines + table_lines


def _by_setup(recs: Records) -> dict[tuple[int, int], dict[str, dict]]:
    """gpu_step records by (ranks, examples per rank), then by mode."""
    out: dict[tuple[int, int], dict[str, dict]] = {}
    for r in recs:
        out.setdefault((r["ranks"], r["examples_per_rank"]), {})[r["mode"]] = r
    return out


def new_shape(recs: Records) -> list[str]:
    """What an encoder's first call on a new input shape costs over the same call warm."""
    rows = [
        [r["device"], r["encoder"], r["items"], r["shapes"], f"{r['first_s'] * 1e3:.2f}",
         f"{r['warm_s'] * 1e3:.2f}", f"{r['cost_s'] * 1e3:.2f}", f"{r['cost_over_warm']:.2f}"]
        for r in recs
    ]  # fmt: skip
    return [
        "Per encoder (forward and backward), the first call on an input shape the process has "
        "not run against the same call warm (median of its repeats), over shapes that differ "
        "only in every item's length growing by one length unit "
        "(`gpu_step.py --new-shape-cost`): the cost a training step pays for each new padded "
        "audio width or packed vision total it meets. On CPU, times are the thread's CPU time.",
        "",
        *table(["device", "encoder", "items", "shapes", "first ms", "warm ms", "cost ms",
                "cost / warm"], rows),
    ]  # fmt: skip


def shape_buckets(recs: Records) -> list[str]:
    """Whether padding the audio encoder's batches to buckets of frames pays for the shapes it
    saves."""

    def even(r: dict) -> str:
        steps = r["break_even_steps"]
        return "always" if steps is None else "never" if steps == 0 else f"{steps:.0f}"

    rows = [
        [r["device"], r["bucket"], r["distinct_shapes"], f"{r['padding_over_frames']:.3f}",
         f"{r['new_shape_s'] * 1e3:.2f}", f"{r['warm_step_s'] * 1e3:.2f}",
         f"{r['repeat_spread']:.1%}", even(r)]
        for r in recs
    ]  # fmt: skip
    return [
        "The tiny config's audio encoder (forward and backward) over the same LibriSpeech-length "
        "batches, per `model.encoders.audio.bucket` in a fresh process: a first pass that meets "
        "every shape new, then warm passes (the repeat of identical work gives `repeat`, the "
        "spread to read differences against). `new shape ms` is one shape's set-up, "
        "`break-even steps` the run length below which the bucket is faster than none (a run "
        "meets each longest length once, but pays the padding every step; `never`: no set-up "
        "to save). This is why the default bucket is 1 on CPU; a GPU record, when one is "
        "measured, decides there.",
        "",
        *table(["device", "bucket", "shapes", "padded / frames", "new shape ms",
                "warm step ms", "repeat", "break-even steps"], rows),
    ]  # fmt: skip


def gpu_memory(recs: Records) -> list[str]:
    """The trainer's measured peak memory per phase beside the memory model's prediction."""
    rows = [
        [r["step"], r["phase"], r["llm_tokens"], f"{r['measured_peak_bytes'] / 2**30:.2f}",
         "–" if r["predicted_bytes"] is None else f"{r['predicted_bytes'] / 2**30:.2f}",
         r["predicted_figure"] or "–",
         "–" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.3f}"]
        for r in recs
    ]  # fmt: skip
    first = recs[0]
    later = [
        r["measured_over_predicted"]
        for r in recs
        if r["step"] > first["step"] and r["measured_over_predicted"] is not None
    ]
    after_first = (
        f" From the second step on, measured / model is {min(later):.3f}-{max(later):.3f}. "
        "The first step's forward and backward run before AdamW's first update allocates its "
        "two moments per parameter, which the model counts as static from the start: they "
        "sit below it by those bytes."
        if later
        else ""
    )
    run = (
        f" Run `{first['run_id']}`."
        if first.get("run_id")
        else " Measured before records carried a run id (with the GPU section's history "
        "records); memory is not what the replaced timing method got wrong."
    )
    return [
        f"`orchmllm.train` on `{first['config']}` ({first['precision']}, checkpointing "
        f"{first['checkpointing']}, loss chunk {first['loss_chunk']}), one process, peak "
        f"memory per phase of each step ({first['source']}) beside the memory model's "
        f"prediction for the same step's batch (`benchmarks/train_memory.py`): its peak for "
        f"every phase (static bytes included). The memory model counts "
        f"{first['sim_parameters'] / 1e6:,.0f} M parameters, the model has "
        f"{first['model_parameters'] / 1e6:,.0f} M.{after_first}{run}",
        "",
        *table(
            ["step", "phase", "LLM tokens", "peak GiB", "model GiB", "model figure",
             "measured / model"],
            rows,
        ),
    ]  # fmt: skip


def gpu_runs(results: Path = RESULTS) -> dict[str, list[str]]:
    """Run id -> the files whose GPU records the documents quote as current: the sound
    step's gpu_step records, the new-shape cost and the trainer's memory measured on a GPU, and
    reproduce_paper's comparisons with those gpu_step records (their ``gpu_run_id``)."""
    runs: dict[str, set[str]] = {}

    def add(run_id: Any, name: str) -> None:
        runs.setdefault(str(run_id), set()).add(name)

    for path in sorted(results.glob("*.json")):
        recs = read(path)
        if not isinstance(recs, list):
            continue
        for r in recs:
            on_gpu = r.get("device", "cpu") != "cpu"
            measured = path.name.startswith("new_shape_") or (
                path.name.startswith("gpu_step_") and is_sound_method(r)
            )
            if measured and on_gpu:
                add(r.get("run_id"), path.name)
            elif path.name.startswith("gpu_memory_") and r.get("run_id"):
                add(r["run_id"], path.name)
            elif str(r.get("figure")).startswith("gpu_") and on_gpu and is_sound_method(r):
                add(r.get("gpu_run_id"), path.name)
    return {k: sorted(v) for k, v in runs.items()}


def check_one_gpu_run(results: Path) -> None:
    """Every GPU figure the documents quote as current comes from one run, else an error."""
    runs = gpu_runs(results)
    if len(runs) > 1:
        listed = "; ".join(f"{k}: {', '.join(v)}" for k, v in runs.items())
        raise ValueError(
            f"GPU records from {len(runs)} runs ({listed}): the documents quote one run; rerun "
            "`python -m benchmarks.gpu_check` (one run id for every part), then "
            "`benchmarks/reproduce_paper.py`"
        )


def gpu_proof(recs: Records) -> list[str]:
    """What the README says of the GPU: each set-up's measured speed-up beside its prediction,
    from the sound step's records only (one run)."""
    current = [r for r in recs if is_sound_method(r)]
    if not current:
        old = sorted({r["run_date"][:10] for r in recs})
        return [
            "- No GPU measurement by the sound method yet (`python -m benchmarks.gpu_check` on "
            "a GPU writes one). The records of " + ", ".join(old) + " came from gpu_step's "
            "replaced method, which timed start-up rather than work; docs/results.md keeps them "
            "as history."
        ]
    lines = []
    for (ranks, b), group in _by_setup(current).items():
        full = group["full"]
        lines.append(
            f"- {ranks} ranks x {b} examples: `full` over `none` {full['speedup_vs_none']:.3f}, "
            f"the simulator predicted {full['sim_speedup_vs_none']:.3f} for the same batches "
            f"(measured / predicted {full['speedup_vs_none'] / full['sim_speedup_vs_none']:.2f}); "
            f"`full` over `llm` {full['speedup_vs_llm']:.3f} (predicted "
            f"{full['sim_speedup_vs_llm']:.3f})"
            + ("" if full["sound"] else "; **unsound**: " + ", ".join(full["unsound_phases"])
               + " timed apart on identical work")
            + "."
        )  # fmt: skip
    r = current[0]
    return [
        *lines,
        "",
        f"({r['device']}, torch {r['torch_version']}, {r['run_date'][:10]}, run `{r['run_id']}`; "
        "docs/results.md has every figure, the memory measurements and what they mean.)",
    ]
