"""The memory model against the allocator: one real trainer step per shape x recipe, on CPU.

Each case runs ``orchmllm.train``'s own set-up and step (FSDP2 on gloo, one rank, the real
orchestrator, data and model) for two steps and measures the second (AdamW's state exists by
then) with ``torch.profiler`` (``profile_memory=True``): the running sum of its ``[memory]``
events is the bytes allocated above the step's start, which is the static footprint (sharded
parameters and optimizer state; the previous step's batch is released first). The memory
model predicts the same step from its plan (:func:`orchmllm.sim.memory.step_of_plan`), per
phase; measured/predicted must lie in [0.9, 1.1] for every phase of every case.

One rank: gloo's collectives allocate buffers of their own on CPU (in its worker threads,
freed when they finish), which at two ranks moved the measured peak from run to run; NCCL's
work in the buffers FSDP2 gives them. At one rank no collective runs inside the step.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from orchmllm.testing import run_distributed
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

PHASES = ("forward", "backward", "optimizer")
WIDE = {
    "encoders": {
        "vision": {"hidden": 128, "ffn": 256, "heads": 4, "kv_heads": 4},
        "audio": {"hidden": 128, "ffn": 256, "heads": 4, "kv_heads": 4},
    },
    "llm": {"hidden": 128, "ffn": 320, "heads": 8, "kv_heads": 2},
}
AUDIO = {
    "tasks": {"asr": {"weight": 0.7}, "spoken_qa": {"weight": 0.3}},
    "examples_per_rank": 6,
    "scale": 0.2,
}
# name -> (model overrides of configs/tiny.yaml, data overrides, precision, checkpointing,
# loss chunk): both widths, checkpointing on (every block, every second) and off, bf16 mixed
# and fp32, one and two loss chunks, a mix where the padded audio phase dominates
CASES = {
    "h64 ckpt": ({}, {}, "bf16-mixed", 1, 4096),
    "h64 plain": ({}, {}, "float32", 0, 4096),
    "h128 plain, 2 chunks": (WIDE, {}, "bf16-mixed", 0, 128),
    "h128 ckpt": (WIDE, {}, "float32", 1, 4096),
    "audio ckpt": (
        {"encoders": {"audio": {"hidden": 96, "ffn": 256}}},
        AUDIO,
        "bf16-mixed",
        1,
        4096,
    ),
    "audio ckpt/2": (
        {"encoders": {"audio": {"hidden": 96, "ffn": 256}}},
        AUDIO,
        "float32",
        2,
        4096,
    ),
}


class _Marks:
    """Marks each phase of the step in the profile (``forward_backward``'s ``memory=``)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"##{name}"):
            yield


def _phase_peaks(prof) -> dict[str, float]:
    """Each phase's peak of allocated bytes above the step's start."""
    events = list(prof.profiler.kineto_results.events())
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times = [t for t, _ in mem]
    live = np.cumsum([n for _, n in mem])
    out = {}
    for e in events:
        if e.name().startswith("##"):
            i, j = bisect.bisect_left(times, e.start_ns()), bisect.bisect_right(times, e.end_ns())
            out[e.name()[2:]] = float(live[i:j].max()) if j > i else 0.0
    return out


def _measure(rank: int, world: int, config: str, precision: str, ckpt: int, chunk: int,
             data_dir: str) -> dict:  # fmt: skip
    """One case: the trainer's second step, measured and predicted."""
    from orchmllm import train
    from orchmllm.sim.memory import MemoryModel, step_of_plan

    argv = [
        "--config", config, "--precision", precision, "--checkpointing", str(ckpt),
        "--loss-chunk", str(chunk), "--data-dir", data_dir, "--prefetch", "0", "--quiet",
        "--steps", "2",
    ]  # fmt: skip
    run = train.setup(train.parse_args(argv))
    batches = iter(run.loader)
    loss = out = None
    for step in range(2):
        planned = next(batches)
        profiler = contextlib.nullcontext()
        if step == 1:
            loss = out = None  # the static footprint alone when the measured step starts
            gc.collect()
            profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
        with profiler as prof:
            loss, out = train.forward_backward(run, planned, memory=_Marks())
            with _Marks().phase("optimizer"):
                run.optim.step()
                run.optim.zero_grad(set_to_none=True)
    run.loader.close()
    measured = _phase_peaks(prof)
    batch, layout, moves = step_of_plan(planned.plan)
    memory = MemoryModel(
        device="cpu", threads=torch.get_num_threads(), shard_group=world, previous_batch=False
    )
    cfg = run.cfg
    features = memory.rank_features(cfg.model, cfg.recipe, batch, layout)
    predicted = memory.phase_peaks(cfg.model, cfg.recipe, features, num_ranks=world, moves=moves)
    return {
        "measured": measured,
        "predicted": {p: float(v[rank]) for p, v in predicted.items()},
        "llm_tokens": int(features["llm.tokens"][rank]),
        "audio_rows": int(features["audio.rows"][rank]),
        "hidden": cfg.model.llm.hidden,
    }


def _cases_worker(rank: int, world: int, cases: list[tuple], data_dir: str) -> list[dict]:
    return [_measure(rank, world, *case, data_dir) for case in cases]


def _config(tmp_path: Path, name: str, model: dict, data: dict) -> str:
    path = tmp_path / f"{name.replace(' ', '_').replace(',', '').replace('/', '_')}.yaml"
    raw = {"base": str(ROOT / "configs" / "tiny.yaml"), "model": model, "data": data}
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_predicted_peaks_match_the_allocator_within_ten_percent(tmp_path):
    cases = [
        (_config(tmp_path, name, model, data), precision, ckpt, chunk)
        for name, (model, data, precision, ckpt, chunk) in CASES.items()
    ]
    results = run_distributed(_cases_worker, 1, cases, str(tmp_path / "data"), timeout=900)[0]
    lines = [
        f"{'case':<22}{'recipe':>16}{'LLM tok':>8}{'audio rows':>11}"
        + "".join(f"{p + ' MB meas/pred':>26}" for p in PHASES)
        + f"{'step ratio':>11}"
    ]
    ratios = {}
    for (name, spec), r in zip(CASES.items(), results, strict=True):
        recipe = f"{spec[2]}, ckpt {spec[3]}"
        cells = "".join(
            f"{r['measured'][p] / 1e6:>12.3f} {r['predicted'][p] / 1e6:>7.3f} "
            f"{r['measured'][p] / r['predicted'][p]:>5.3f}"
            for p in PHASES
        )
        step = max(r["measured"].values()) / max(r["predicted"].values())
        ratios[name] = {p: r["measured"][p] / r["predicted"][p] for p in PHASES} | {"step": step}
        lines.append(
            f"{name:<22}{recipe:>16}{r['llm_tokens']:>8}{r['audio_rows']:>11}{cells}{step:>11.3f}"
        )
    print("\n".join(lines))
    for name, by_phase in ratios.items():
        for phase, ratio in by_phase.items():
            assert 0.9 <= ratio <= 1.1, (name, phase, ratio)
