"""A long job's faults, injected into the real trainer: checkpoints that cannot lie, restarts
that always find one, every failure named.

Every test starts ranks (``orchmllm.testing``: in-process workers, ``python -m
orchmllm.train`` processes as torchrun starts them, or torchrun itself) and injects its fault
from outside: corrupted, cut or removed checkpoint files, a NaN in one rank's forward, a second
job on the same checkpoint directory, SIGKILL (also under ``torchrun --max-restarts``),
SIGSTOP during the dataset write and during a checkpoint, a resume on half the ranks. Each
checks the promised outcome: the error names the cause (step, rank, file, owner), or the run
ends with the losses and parameters of one uninterrupted run (the module's reference, float64:
2 ranks x 4 examples, 4 steps, a checkpoint after every step).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from orchmllm import checkpoint
from orchmllm.models.llm import LLM
from orchmllm.testing import (
    run_distributed,
)
from orchmllm.train import NonFiniteStep, main
from tests.test_train import _argv, _config

pytestmark = pytest.mark.integration

STEPS, PER_RANK, WORLD = 4, 4, 2
RTOL = 1e-6  # same global batch, float64: only summation orders differ
RTOL_RESHARDED = 1e-5  # another world size sums in another order


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    """The uninterrupted run: metrics, final parameters and a checkpoint after every step
    (``ref/ckpt``), on 2 ranks; its dataset in ``ref/data`` serves every test."""
    tmp = tmp_path_factory.mktemp("ref")
    _config(tmp, "cfg", examples_per_rank=PER_RANK)
    argv = [*_base(tmp), *_outputs(tmp / "ref"), "--checkpoint-dir", str(tmp / "ckpt"),
            "--checkpoint-every", "1"]  # fmt: skip
    run_distributed(_main_worker, WORLD, [argv], timeout=150)
    return tmp


def _base(ref: Path, config: str = "cfg") -> list[str]:
    """The run's command line: a config in ``ref`` (the reference's, or another written
    there) and the reference's dataset (``ref/data``)."""
    return [*_argv(str(ref / f"{config}.yaml"), ref, "full", STEPS), "--timeout", "60"]


def _outputs(prefix: Path) -> list[str]:
    return ["--metrics", f"{prefix}.jsonl", "--save", f"{prefix}.pt"]


def _main_worker(rank: int, world: int, argvs: list[list[str]]) -> None:
    torch.set_num_threads(1)  # several ranks share few cores; OMP spinning would stall gloo
    for argv in argvs:
        main(argv)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_same_run(prefix: Path, ref: Path, *, rtol: float = RTOL) -> list[dict]:
    """The run whose metrics and parameters are at ``prefix`` trained exactly as the
    reference: every step once, the same losses, the same final parameters."""
    records, want = _records(Path(f"{prefix}.jsonl")), _records(ref / "ref.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in want], rtol=rtol)
    params, want_params = torch.load(f"{prefix}.pt"), torch.load(ref / "ref.pt")
    assert params.keys() == want_params.keys()
    for name, p in want_params.items():
        torch.testing.assert_close(params[name], p, rtol=rtol, atol=1e-9, msg=name)
    return records


# -- items 1-2: checkpoints that cannot lie, a resume that always finds one ------------------


def _nan_on_rank1_at_step(step: int):
    """A forward hook that makes rank 1's LLM output NaN in the given step (its LLM runs
    once per step): the fault a bad batch or a diverging kernel causes on one rank."""
    calls = {"n": 0}

    def hook(module, args, output):
        if isinstance(module, LLM) and torch.distributed.get_rank() == 1:
            calls["n"] += 1
            if calls["n"] == step + 1:
                return output * float("nan")
        return None

    return torch.nn.modules.module.register_module_forward_hook(hook)


def _resume_faults_worker(rank: int, world: int, base: list[str], tmp: str) -> None:
    torch.set_num_threads(1)
    # A corrupted, a cut and an incomplete checkpoint: resumed from the newest that verifies.
    main([*base, *_outputs(Path(tmp, "resumed")), "--checkpoint-dir", f"{tmp}/ckpt",
          "--checkpoint-every", "1", "--keep-last", "2"])  # fmt: skip
    # Checkpoints, none of which verifies: refused with each one's reason, not started over.
    with pytest.raises(checkpoint.NoUsableCheckpoint, match=r"step-00000001: no manifest.json"):
        main([*base, "--checkpoint-dir", f"{tmp}/unusable"])
    # A NaN in rank 1's forward at step 2: stopped there, naming the step and the rank.
    hook = _nan_on_rank1_at_step(2)
    try:
        with pytest.raises(
            NonFiniteStep,
            match=r"training step 2: the loss is nan \(not finite on rank\(s\) \[1\]\); stopped "
            "before the optimizer step and before any checkpoint of it was written",
        ):
            main([*base, "--metrics", f"{tmp}/nan.jsonl", "--checkpoint-dir", f"{tmp}/nan",
                  "--checkpoint-every", "1"])  # fmt: skip
    finally:
        hook.remove()
    # The same, skipped: the run goes on.
    hook = _nan_on_rank1_at_step(2)
    try:
        main([*base, *_outputs(Path(tmp, "skip")), "--on-nonfinite", "skip"])
    finally:
        hook.remove()


def test_damaged_checkpoints_are_named_and_the_run_resumes_as_if_uninterrupted(
    ref, tmp_path, capfd
):
    """Items 1-2. The reference's checkpoints, damaged: step 4 has 64 bytes of 0xFF inside a
    shard, step 3 a shard cut in half, step 2 no ``.metadata``, and a ``.partial`` is left
    over. The rerun names each damage, resumes from step 1 (the newest that verifies), ends
    with the reference's losses and parameters, and keeps only the last 2 checkpoints, each
    verified; the partial is gone. A directory whose only checkpoint has no manifest is
    refused with the reason. A NaN injected into rank 1's forward at step 2 stops the run
    with an error naming step 2 and rank 1 before its optimizer step: the metrics hold steps
    0-1, the checkpoints steps 1-2, nothing of step 2's update; with ``--on-nonfinite skip``
    the step is skipped (recorded) and the run ends with finite parameters."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ref / "ckpt", ckpt)
    shards = {s: sorted(glob.glob(f"{checkpoint.step_dir(str(ckpt), s)}/*.distcp")) for s in (3, 4)}
    with open(shards[4][1], "r+b") as f:
        f.seek(os.path.getsize(shards[4][1]) // 2)
        f.write(b"\xff" * 64)
    size = os.path.getsize(shards[3][0])
    os.truncate(shards[3][0], size // 2)
    os.remove(os.path.join(checkpoint.step_dir(str(ckpt), 2), ".metadata"))
    (ckpt / "step-00000005.partial").mkdir()
    shutil.copy(ref / "ref.jsonl", tmp_path / "resumed.jsonl")  # the killed run's metrics
    unusable = tmp_path / "unusable"
    shutil.copytree(checkpoint.step_dir(str(ref / "ckpt"), 1), unusable / "step-00000001")
    os.remove(unusable / "step-00000001" / checkpoint.MANIFEST)

    run_distributed(_resume_faults_worker, WORLD, _base(ref), str(tmp_path), timeout=240)
    out, err = capfd.readouterr()
    for step, why in (
        (4, f"{os.path.basename(shards[4][1])}: checksum differs from its manifest's (corrupted"),
        (3, f"{os.path.basename(shards[3][0])} has {size // 2} bytes, its manifest {size}"),
        (2, ".metadata is missing"),
    ):
        assert f"checkpoint {checkpoint.step_dir(str(ckpt), step)} is not usable: {why}" in err
    assert "removing step-00000005.partial, a checkpoint an earlier job did not finish" in err
    assert f"resumed at step 1 from {checkpoint.step_dir(str(ckpt), 1)}" in out
    _assert_same_run(tmp_path / "resumed", ref)
    assert sorted(os.listdir(ckpt)) == ["step-00000003", "step-00000004"]  # --keep-last 2
    assert all(checkpoint.verify(checkpoint.step_dir(str(ckpt), s)) == [] for s in (3, 4))

    nan = _records(tmp_path / "nan.jsonl")
    assert [r["step"] for r in nan] == [0, 1]
    assert checkpoint.steps(str(tmp_path / "nan")) == [2, 1]
    assert not glob.glob(str(tmp_path / "nan" / "*.partial"))
    skip, want = _records(tmp_path / "skip.jsonl"), _records(ref / "ref.jsonl")
    assert [r["skipped"] for r in skip] == [False, False, True, False]
    assert np.isnan(skip[2]["loss"]) and np.isnan(skip[2]["grad_norm"])
    np.testing.assert_allclose(
        [r["loss"] for r in skip[:2]], [r["loss"] for r in want[:2]], rtol=RTOL
    )
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for i, r in enumerate(skip) if i != 2)
    assert all(torch.isfinite(p).all() for p in torch.load(tmp_path / "skip.pt").values())
    assert "training step 2 skipped: the loss is nan (not finite on rank(s) [1])" in err
