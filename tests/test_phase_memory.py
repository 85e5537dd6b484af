"""train.py --memory-report: per-phase peaks and the step's batch, as the memory model reads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from orchmllm.config import load_config
from orchmllm.data import generate_example
from orchmllm.data.synthetic import SyntheticConfig
from orchmllm.planner.segments import local_metadata
from orchmllm.planner.step_options import StepOptions, default_phases
from orchmllm.planner.step_plan import plan_step
from orchmllm.sim.batch import Batch
from orchmllm.train.phase_memory import PhaseMemory

ROOT = Path(__file__).resolve().parents[1]


def _step_plan(ranks: int = 2, per_rank: int = 4):
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"))
    syn = SyntheticConfig.for_run(cfg, num_examples=0, seed=3)
    tables = [
        local_metadata(
            [generate_example(r * per_rank + j, syn, cfg.rates) for j in range(per_rank)]
        )
        for r in range(ranks)
    ]
    src = np.repeat(np.arange(ranks), [len(t) for t in tables])
    phases = default_phases(cfg.rates, feature_dims=cfg.model.feature_dims)
    plan = plan_step(np.concatenate(tables), src, StepOptions(phases, mode="full"), num_ranks=ranks)
    return cfg, plan


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_report_holds_the_steps_batch_as_the_simulator_reads_it(tmp_path):
    cfg, plan = _step_plan()
    path = tmp_path / "memory.jsonl"
    path.write_text("a line of an earlier run\n")
    memory = PhaseMemory(str(path), torch.device("cpu"))
    for step in range(2):
        for phase in ("forward", "backward", "optimizer"):
            with memory.phase(phase):
                pass
        memory.end_step(step, plan)
    lines = _lines(path)  # the earlier run's line is gone
    assert [line["step"] for line in lines] == [0, 1]
    line = lines[0]
    # no allocator counter on CPU: the phases are there, their figures null
    assert line["source"] is None
    assert line["phases"] == {
        p: {"peak_bytes": None, "allocated_bytes": None}
        for p in ("forward", "backward", "optimizer")
    }
    batch = Batch.from_record(line["batch"])
    assert batch.num_ranks == 2
    assert batch.text.tolist() == plan.text_len.tolist()
    # the simulator's LLM sequence of every example is the planner's
    assert batch.llm_lengths(cfg.model).tolist() == plan.seq_len.tolist()
    for name, phase in plan.phases.items():
        assert batch.of(name).raw.tolist() == phase.raw.tolist()
        assert batch.of(name).example.tolist() == phase.example.tolist()


def test_without_a_path_nothing_is_measured_or_written(tmp_path):
    _, plan = _step_plan()
    memory = PhaseMemory(None, torch.device("cpu"))
    with memory.phase("forward"):
        pass
    memory.end_step(0, plan)
    assert memory.step == {} and not list(tmp_path.iterdir())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_is_each_phases_own(tmp_path):
    """A phase's peak counts what it allocated on top of what was already there, and the next
    phase starts from the bytes still allocated, not from the earlier peak."""
    _, plan = _step_plan()
    device = torch.device("cuda", torch.cuda.current_device())
    path = tmp_path / "memory.jsonl"
    memory = PhaseMemory(str(path), device)
    kept = torch.empty(2**26, dtype=torch.uint8, device=device)  # 64 MiB held throughout
    with memory.phase("forward"):
        transient = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB, freed
        del transient
    with memory.phase("backward"):
        pass
    memory.end_step(0, plan)
    del kept
    phases = _lines(path)[0]["phases"]
    assert phases["forward"]["peak_bytes"] >= 2**28 + 2**26
    assert phases["backward"]["peak_bytes"] < 2**28
    assert phases["backward"]["allocated_bytes"] >= 2**26
