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
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from orchmllm.models.llm import LLM
from orchmllm.testing import (
    launch_ranks,
    launcher_store,
    run_distributed,
    stop_all,
    torchrun,
    wait_for,
    worker_ranks,
)
from orchmllm.train import NonFiniteStep, checkpoint, main
from tests.conftest import ROOT
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


def _base(ref: Path, config: Path | None = None) -> list[str]:
    """The run's command line: the reference's config (or ``config``) and its dataset
    (``ref/data``)."""
    return [*_argv(str(config or ref / "cfg.yaml"), ref, "full", STEPS), "--timeout", "60"]


def _module(argv: list[str]) -> list[str]:
    return ["-m", "orchmllm.train", *argv]


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


# -- item 3 (one writer) and item 5 (a dead peer named) ----------------------------------


def test_a_second_job_is_refused_a_dead_peer_is_named_and_the_requeued_job_resumes(
    ref, tmp_path, repo_env
):
    """Items 3 and 5. Job A runs; paused (SIGSTOP: a slow step; its process runs on this
    host, so it is live), the same command is started again (a scheduler's requeue while A
    runs): job B exits 1 naming A (host, pid) on every rank and writes nothing. A goes on;
    its rank 1 is SIGKILLed: A's rank 0 names rank 1 dead (its process exited, or still
    exiting: seen before it is a zombie) instead of "every rank arrived", and exits 1,
    releasing the lock. The requeued job C resumes from A's newest checkpoint and ends as
    the uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    argv = _module([*_base(ref), *_outputs(tmp_path / "out"), "--checkpoint-dir", str(ckpt),
                    "--checkpoint-every", "1"])  # fmt: skip
    jobs = {}

    def launch(name: str) -> list:
        store = launcher_store()
        jobs[name] = (store, launch_ranks(argv, WORLD, port=store.port, logdir=tmp_path / name,
                                          env=repo_env, cwd=ROOT))  # fmt: skip
        return jobs[name][1]

    try:
        a = launch("a")
        wait_for(lambda: (ckpt / "step-00000001").is_dir(), timeout=180, procs=a)
        for p in a:
            p.send_signal(signal.SIGSTOP)
        before = _listing(ckpt)
        b = launch("b")
        for rank, p in enumerate(b):
            assert p.wait(timeout=180) == 1, (tmp_path / "b" / f"err{rank}").read_text()[-3000:]
        owner = rf"\(host {socket.gethostname()}, pid {a[0].pid}, job \w+, started .*, last"
        for rank in range(WORLD):  # every rank names the owner, not only rank 0
            refusal = (tmp_path / "b" / f"err{rank}").read_text()
            assert re.search(rf"{re.escape(str(ckpt))} is in use by another job {owner}", refusal)
        assert _listing(ckpt) == before
        for p in a:
            p.send_signal(signal.SIGCONT)
        a[1].kill()
        a[1].wait()
        assert a[0].wait(timeout=120) == 1
        err = (tmp_path / "a" / "err0").read_text()
        dead = rf"rank 1: dead: its process {a[1].pid} on {socket.gethostname()} "
        assert re.search(f"{dead}(exited|exiting|being killed)", err), err  # not yet a zombie
        assert "every rank arrived" not in err
        assert not os.path.exists(ckpt / ".lock")
        c = launch("c")
        for rank, p in enumerate(c):
            assert p.wait(timeout=240) == 0, (tmp_path / "c" / f"err{rank}").read_text()[-3000:]
    finally:
        for _, procs in jobs.values():
            stop_all(procs)
    assert "resumed at step" in (tmp_path / "c" / "out0").read_text()
    _assert_same_run(tmp_path / "out", ref)


def _listing(directory: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in sorted(directory.rglob("*"))}


# -- item 4: automatic restart under torchrun ----------------------------------------------


def test_torchrun_restarts_a_killed_rank_and_the_job_ends_as_if_uninterrupted(
    ref, tmp_path, repo_env
):
    """Item 4. ``torchrun --max-restarts=1``; rank 1 is SIGKILLed once the first checkpoint
    exists. torchrun restarts both workers, which meet in a store namespace of their own
    (the dead attempt's keys are still in the agent's store: without it the restarted
    workers read them), resume from the newest checkpoint that verifies (taking over the
    lock if the dead attempt left it), and end with the reference's losses and parameters."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "torchrun.log"
    argv = _module([*_base(ref), *_outputs(tmp_path / "out"), "--checkpoint-dir", str(ckpt),
                    "--checkpoint-every", "1"])  # fmt: skip
    job = torchrun(argv, WORLD, log=log, max_restarts=1, env=repo_env, cwd=ROOT)
    try:
        wait_for(lambda: (ckpt / "step-00000001").is_dir(), timeout=240, procs=[job])
        workers = worker_ranks(job.pid)
        os.kill(workers[1], signal.SIGKILL)
        assert job.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        stop_all([job])
    text = log.read_text()
    resumed = re.findall(r"resumed at step (\d+) from", text)
    assert len(resumed) == 1 and 1 <= int(resumed[0]) < STEPS, text[-4000:]
    assert "Connection refused" not in text
    _assert_same_run(tmp_path / "out", ref)


# -- item 6: resume on another world size -------------------------------------------------


def _resume_on_two_worker(rank: int, world: int, refused: list[str], argv: list[str]) -> None:
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match=r"was written by 4 ranks x 2 examples per rank \(global "
                       r"batch 8\); this run has 2 x 2 = 4\. .*on 2 ranks set "
                       r"data.examples_per_rank to 4"):  # fmt: skip
        main(refused)
    main(argv)


def test_a_job_that_lost_half_its_ranks_resumes_on_the_rest(ref, tmp_path, repo_env, capfd):
    """Item 6. 4 ranks x 2 examples (the reference's global batch of 8 on twice the ranks)
    are all SIGKILLed after their first checkpoint; the job goes on on 2 ranks. With 2
    examples per rank (a global batch of 4) it is refused, naming the setting that would
    allow it; with 4 it resumes: DCP reshards model and optimizer, the loader's position is
    the global step, and the run ends with the reference's losses and parameters (float64,
    to 1e-5: another world size sums in another order)."""
    ckpt = tmp_path / "ckpt"
    half = Path(_config(tmp_path, "half", examples_per_rank=PER_RANK // 2))
    common = [*_outputs(tmp_path / "out"), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    store = launcher_store()
    four = launch_ranks(_module([*_base(ref, half), *common]), 2 * WORLD, port=store.port,
                        logdir=tmp_path / "four", env=repo_env, cwd=ROOT)  # fmt: skip
    try:
        wait_for(lambda: (ckpt / "step-00000001").is_dir(), timeout=240, procs=four)
    finally:
        stop_all(four)
    killed_at = checkpoint.latest_step(str(ckpt))
    assert killed_at is not None and killed_at < STEPS
    refused = [*_base(ref, half), "--checkpoint-dir", str(ckpt)]
    run_distributed(_resume_on_two_worker, WORLD, refused, [*_base(ref), *common], timeout=200)
    out, err = capfd.readouterr()
    assert "(written by 4 ranks, resharded onto 2)" in out
    assert "took over the lock" in err and "exited" in err
    records = _assert_same_run(tmp_path / "out", ref, rtol=RTOL_RESHARDED)
    assert [r["world_size"] for r in records] == [4] * killed_at + [2] * (STEPS - killed_at)


# -- item 5: a rank stopped in the dataset write or in a checkpoint is named ---------------


def test_a_rank_stopped_in_the_dataset_write_or_in_a_checkpoint_is_named(ref, tmp_path, repo_env):
    """Item 5. With ``--timeout 8``, rank 1 is SIGSTOPped (1) while rank 0 writes the dataset
    (rank 1's probe file is there before and after the stop: it is inside the write), (2)
    inside a checkpoint save, two checkpoints in (its ``.partial`` directory still there
    after the stop; else it is continued and the next save is tried). Each time rank 0 exits
    1 naming the section (the dataset write; the checkpoint save at step N) and rank 1 as
    silent; the failed save leaves no partial directory and the earlier checkpoints verify."""
    timeout, data, ckpt = 8, tmp_path / "data", tmp_path / "ckpt"
    argv = _module(["--config", str(ref / "cfg.yaml"), "--steps", "30", "--quiet",
                    "--data-dir", str(data), "--timeout", str(timeout)])  # fmt: skip

    def probe() -> list[str]:
        return glob.glob(str(data / ".orchmllm-probe-*-1"))

    store = launcher_store()
    procs = launch_ranks(argv, WORLD, port=store.port, logdir=tmp_path / "write",
                         env=repo_env, cwd=ROOT)  # fmt: skip
    try:
        wait_for(probe, timeout=180, procs=procs)
        procs[1].send_signal(signal.SIGSTOP)
        assert probe(), "rank 1 left the dataset write before it was stopped"
        assert procs[0].wait(timeout=timeout + 60) == 1
    finally:
        stop_all(procs)
    err = (tmp_path / "write" / "err0").read_text()
    assert "rank 0: dataset write (section 1) failed after" in err, err[-3000:]
    assert "ranks that did not arrive at dataset write (section 1): [1]" in err, err[-3000:]
    assert "rank 1: silent for" in err

    def partial() -> list[str]:
        return glob.glob(str(ckpt / "*.partial"))

    store = launcher_store()
    ckpt_argv = [*argv, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    procs = launch_ranks(ckpt_argv, WORLD, port=store.port, logdir=tmp_path / "save",
                         env=repo_env, cwd=ROOT)  # fmt: skip
    try:
        wait_for(lambda: (ckpt / "step-00000002").is_dir(), timeout=180, procs=procs)
        while True:
            wait_for(partial, timeout=180, procs=procs)
            procs[1].send_signal(signal.SIGSTOP)
            stopped_in = partial()
            if stopped_in:
                break
            procs[1].send_signal(signal.SIGCONT)  # it had left that save: try the next one
        step = int(re.search(r"step-(\d+)\.partial", stopped_in[0]).group(1))
        assert procs[0].wait(timeout=timeout + 60) == 1
    finally:
        stop_all(procs)
    err = (tmp_path / "save" / "err0").read_text()
    where = f"checkpoint save at step {step} (section"
    assert f"rank 0: {where}" in err and "failed after" in err, err[-3000:]
    assert f"ranks that did not arrive at {where}" in err and "rank 1: silent for" in err
    assert not partial()
    assert checkpoint.latest_step(str(ckpt)) == step - 1
    assert all(
        checkpoint.verify(checkpoint.step_dir(str(ckpt), s)) == []
        for s in checkpoint.steps(str(ckpt))
    )


# -- issue 41: preemption -------------------------------------------------------------------


def _metric_lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def test_a_preempted_torchrun_job_saves_where_every_rank_stopped_and_the_rerun_ends_as_if_uninterrupted(  # noqa: E501
    ref, tmp_path, repo_env
):
    """A scheduler preempting a torchrun job of 2 ranks: once step 0 is recorded the workers
    are paused (so the signal lands inside a step), then SIGTERM goes to torchrun and to
    every worker (as SLURM signals every process of the job), and they go on. Every rank
    stops after the same step k, the checkpoint of step k is the only one written (no
    periodic checkpoints here) and verifies, the lock is gone, each rank says so with exit
    status 75, and the metrics hold steps 0..k-1. Rerunning the same command resumes at step
    k, redoes no step and ends with the reference's losses and parameters."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "out.jsonl"
    argv = _module([*_base(ref), *_outputs(tmp_path / "out"), "--checkpoint-dir", str(ckpt)])
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    job = torchrun(argv, WORLD, log=first, env=repo_env, cwd=ROOT)
    try:
        wait_for(lambda: _metric_lines(metrics) >= 1, timeout=180, procs=[job])
        workers = list(worker_ranks(job.pid).values())
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        for pid in [job.pid, *workers]:
            os.kill(pid, signal.SIGTERM)
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        job.wait(timeout=120)
    finally:
        stop_all([job])
    text = first.read_text()
    stopped = set(re.findall(r"rank \d: SIGTERM: stopped after step (\d+) of", text))
    assert len(stopped) == 1, text[-4000:]
    k = int(stopped.pop()) + 1
    assert 1 <= k < STEPS and _metric_lines(metrics) == k
    assert len(re.findall(r"resume at step \d+ \(exit status 75\)", text)) == WORLD, text[-4000:]
    assert checkpoint.steps(str(ckpt)) == [k]
    assert checkpoint.verify(checkpoint.step_dir(str(ckpt), k)) == []
    assert sorted(os.listdir(ckpt)) == [f"step-{k:08d}"]  # no lock, no partial checkpoint

    job = torchrun(argv, WORLD, log=second, env=repo_env, cwd=ROOT)
    try:
        assert job.wait(timeout=240) == 0, second.read_text()[-4000:]
    finally:
        stop_all([job])
    assert f"resumed at step {k} from" in second.read_text()
    _assert_same_run(tmp_path / "out", ref)


def test_a_preempted_job_without_checkpoints_exits_at_once_and_one_past_its_grace_is_abandoned(
    ref, tmp_path, repo_env
):
    """Without ``--checkpoint-dir`` SIGTERM (sent inside a step: the ranks are paused first)
    ends both ranks at once with status 75, each saying nothing was saved. With one, but rank
    1 stopped (SIGSTOP) and only rank 0 signalled, rank 0 waits in the step for rank 1 until
    ``--preempt-grace 2`` runs out, then exits 75 naming the grace and the step, and releases
    the lock."""
    plain = _module([*_base(ref), "--metrics", str(tmp_path / "m.jsonl")])
    store = launcher_store()
    procs = launch_ranks(plain, WORLD, port=store.port, logdir=tmp_path / "plain",
                         env=repo_env, cwd=ROOT)  # fmt: skip
    try:
        wait_for(lambda: _metric_lines(tmp_path / "m.jsonl") >= 1, timeout=180, procs=procs)
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):  # inside a step
            for p in procs:
                p.send_signal(sig)
        assert [p.wait(timeout=10) for p in procs] == [75] * WORLD
    finally:
        stop_all(procs)
    for rank in range(WORLD):
        err = (tmp_path / "plain" / f"err{rank}").read_text()
        assert f"rank {rank}: SIGTERM: stopping now; nothing was saved (no --checkpoint-dir)" in err

    ckpt = tmp_path / "ckpt"
    argv = [*plain, "--checkpoint-dir", str(ckpt), "--preempt-grace", "2",
            "--metrics", str(tmp_path / "m2.jsonl")]  # fmt: skip
    store = launcher_store()
    procs = launch_ranks(argv, WORLD, port=store.port, logdir=tmp_path / "grace",
                         env=repo_env, cwd=ROOT)  # fmt: skip
    try:
        wait_for(lambda: _metric_lines(tmp_path / "m2.jsonl") >= 1, timeout=180, procs=procs)
        procs[1].send_signal(signal.SIGSTOP)
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=20) == 75
        assert not (ckpt / ".lock").exists()
    finally:
        stop_all(procs)
    err = (tmp_path / "grace" / "err0").read_text()
    assert re.search(
        r"rank 0: SIGTERM: the job did not stop within --preempt-grace 2 s \(training step \d+\); "
        "abandoned there",
        err,
    ), err[-3000:]


# -- issue 41: a checkpoint of another model, a diverged run ------------------------------


def _refusals_worker(rank: int, world: int, base: list[str], tmp: str) -> None:
    torch.set_num_threads(1)
    # Another model (a wider LLM, a deeper vision encoder, a larger vocabulary): refused
    # before any tensor is read, every differing key named with both values.
    with pytest.raises(
        ValueError,
        match=r"^--checkpoint-dir .*step-00000001 was written for another model, which cannot "
        r"load into this one: model\.encoders\.vision\.layers 2 there, 3 now; model\.llm\.hidden "
        r"64 there, 96 now; model\.vocab 512 there, 600 now\. Resume with the same config",
    ):
        main([*base, "--config", f"{tmp}/wide.yaml", "--checkpoint-dir", f"{tmp}/wide"])
    # Other balancing policies: the training is the same, the checkpoint resumes.
    main([*base, "--config", f"{tmp}/policy.yaml", "--checkpoint-dir", f"{tmp}/policy"])
    # A diverged run (learning rate 1e30, float32) skipping step after step: stopped.
    with pytest.raises(
        NonFiniteStep,
        match=r"2 consecutive training steps skipped \(steps 1-2; train\.max_skipped_steps is "
        r"2\), the first at step 1: the run has diverged",
    ):
        main([*base, "--config", f"{tmp}/diverged.yaml", "--precision", "float32",
              "--on-nonfinite", "skip"])  # fmt: skip


def test_a_checkpoint_of_another_model_is_refused_before_loading_and_a_diverged_run_stops(
    ref, tmp_path, capfd
):
    """A resume with another model (a width, a layer count, the vocabulary) is refused on
    every rank in the error's first line, naming each changed key with both values, before
    DCP reads a tensor (no "Size mismatch"); one with other balancing policies resumes. With
    ``--on-nonfinite skip`` a run at learning rate 1e30 stops after
    ``train.max_skipped_steps`` (2) consecutive skipped steps, naming the count and the
    first."""
    ckpt = str(ref / "ckpt")
    shutil.copytree(checkpoint.step_dir(ckpt, 1), tmp_path / "wide" / "step-00000001")
    shutil.copytree(checkpoint.step_dir(ckpt, 3), tmp_path / "policy" / "step-00000003")
    model = {"llm": {"hidden": 96}, "encoders": {"vision": {"layers": 3}}, "vocab": 600}
    _config(tmp_path, "wide", model=model, examples_per_rank=PER_RANK)
    policies = {"policies": {"vision": "binary_search", "llm": "binary_search"}}
    _config(tmp_path, "policy", balance=policies, examples_per_rank=PER_RANK)
    diverged = {"lr": 1.0e30, "max_skipped_steps": 2}
    _config(tmp_path, "diverged", train=diverged, examples_per_rank=PER_RANK)
    run_distributed(_refusals_worker, WORLD, _base(ref), str(tmp_path), timeout=200)
    out, err = capfd.readouterr()
    assert f"resumed at step 3 from {checkpoint.step_dir(str(tmp_path / 'policy'), 3)}" in out
    assert "Size mismatch" not in err and "CheckpointException" not in err


# -- issue 41: a full disk --------------------------------------------------------------------


def _full_disk_worker(rank: int, world: int, base: list[str], small: str, tiny: str) -> list:
    torch.set_num_threads(1)
    errors = []
    for directory in (small, tiny):
        with pytest.raises(checkpoint.NoSpace) as exc:
            main([*base, "--checkpoint-dir", directory, "--checkpoint-every", "1"])
        errors.append(str(exc.value))
    return errors


@pytest.fixture
def small_filesystems(tmp_path):
    """Two tmpfs mounts, 15 MB (one checkpoint of the reference, 10 MB, fits; a second does
    not) and 4 MB (none fits); skipped where mounting is not allowed (not root)."""
    mounts = [tmp_path / "small", tmp_path / "tiny"]
    done = []
    try:
        for path, size in zip(mounts, ("15m", "4m"), strict=True):
            path.mkdir()
            cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                pytest.skip("cannot mount a small tmpfs here (needs root)")
            done.append(path)
        yield mounts
    finally:
        for path in done:
            subprocess.run(["umount", str(path)], check=False)


def test_a_full_disk_is_named_in_the_first_line_with_the_bytes_needed_and_free(
    ref, small_filesystems
):
    """A checkpoint directory on a filesystem with room for one checkpoint: the second save
    is refused before writing, naming the directory, the bytes the last checkpoint took and
    the bytes free. On one with no room, the write fails and says no space is left (not
    DCP's "CheckpointException ranks:..."), naming the partial directory, on every rank."""
    small, tiny = map(str, small_filesystems)
    results = run_distributed(_full_disk_worker, WORLD, _base(ref), small, tiny, timeout=200)
    for first, second in results:
        assert re.match(
            rf"no space for the checkpoint of step 2 in {re.escape(small)}: it needs about "
            rf"\d+ bytes \(the size of {re.escape(small)}/step-00000001\), \d+ bytes are free "
            "there", first
        ), first  # fmt: skip
        assert re.match(
            rf"writing the checkpoint of step 1 to {re.escape(tiny)}/step-00000001.partial "
            r"failed: no space left: it needs more, \d+ bytes are free there", second
        ), second  # fmt: skip
    assert os.listdir(tiny) == []  # the partial checkpoint removed, no lock left
    assert sorted(os.listdir(small)) == ["step-00000001"]
