"""checkpoint: manifests that catch every damaged file, a load that falls back past them,
keep-last that deletes only behind a verified checkpoint, and the directory's lock.

Single process (DCP and the checkpoint helpers run without a process group); the
multi-process faults (a corrupted resume that ends as an uninterrupted run, two writers,
restarts, another world size) are in test_train_faults.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from orchmllm.train import checkpoint
from orchmllm.train.dirlock import LockHeld

# DCP without a process group says it assumes one process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return model, optim


def _save(directory, step: int, seed: int, **kw) -> str:
    model, optim = _model(seed)
    return checkpoint.save(str(directory), step, model=model, optim=optim, run={"s": seed}, **kw)


def _shard(path: str) -> str:
    return os.path.join(path, next(n for n in sorted(os.listdir(path)) if n.endswith(".distcp")))


def test_a_checkpoint_verifies_and_every_damage_is_named(tmp_path):
    path = _save(tmp_path, 3, seed=0)
    manifest = json.loads(Path(path, checkpoint.MANIFEST).read_text())
    assert manifest["step"] == 3 and set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    assert checkpoint.verify(path) == []

    damaged = {}
    for name, damage in {
        "corrupt": lambda p: _overwrite(_shard(p), 100, b"\xff" * 64),
        "cut": lambda p: os.truncate(_shard(p), 100),
        "removed": lambda p: os.remove(os.path.join(p, ".metadata")),
        "no-manifest": lambda p: os.remove(os.path.join(p, checkpoint.MANIFEST)),
        "bad-manifest": lambda p: Path(p, checkpoint.MANIFEST).write_text("{"),
    }.items():
        copy = str(tmp_path / name)
        shutil.copytree(path, copy)
        damage(copy)
        damaged[name] = checkpoint.verify(copy)
    assert damaged["corrupt"] == [
        "__0_0.distcp: checksum differs from its manifest's (corrupted bytes)"
    ]
    size = manifest["files"]["__0_0.distcp"]["size"]
    assert damaged["cut"] == [f"__0_0.distcp has 100 bytes, its manifest {size} (cut or grown)"]
    assert damaged["removed"] == [".metadata is missing"]
    assert damaged["no-manifest"][0].startswith("no manifest.json")
    assert damaged["bad-manifest"][0].startswith("manifest.json unreadable (JSONDecodeError")


def _overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_load_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    for step in (1, 2, 3):
        _save(tmp_path, step, seed=step)
    os.makedirs(tmp_path / "step-00000004.partial")  # a write a killed job left: never loaded
    _overwrite(_shard(checkpoint.step_dir(str(tmp_path), 3)), 64, b"\xff" * 64)
    os.remove(os.path.join(checkpoint.step_dir(str(tmp_path), 2), checkpoint.MANIFEST))
    model, optim = _model(seed=99)
    step, run = checkpoint.load(str(tmp_path), model=model, optim=optim)
    assert (step, run) == (1, {"s": 1})
    want, _ = _model(seed=1)
    for p, q in zip(model.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    err = capsys.readouterr().err
    assert "step-00000003 is not usable: __0_0.distcp: checksum differs" in err
    assert "step-00000002 is not usable: no manifest.json" in err

    os.remove(os.path.join(checkpoint.step_dir(str(tmp_path), 1), ".metadata"))
    reasons = r"step-00000003: __0_0.distcp: checksum .*\.metadata is missing"
    with pytest.raises(
        checkpoint.NoUsableCheckpoint, match=rf"no checkpoint in .* verifies: .*{reasons}"
    ):
        checkpoint.load(str(tmp_path), model=model, optim=optim)
    assert checkpoint.load(str(tmp_path / "empty"), model=model, optim=optim) is None


def test_keep_last_deletes_only_behind_a_verified_checkpoint(tmp_path):
    for step in (1, 2, 3, 5):
        _save(tmp_path, step, seed=step)
    _save(tmp_path, 4, seed=4, keep_last=2)  # resumed from an older one: 5 is left alone
    assert checkpoint.steps(str(tmp_path)) == [5, 4, 3]
    assert checkpoint.prune(str(tmp_path), keep_last=1, newest=5) == [4, 3]
    assert checkpoint.steps(str(tmp_path)) == [5]
    with pytest.raises(ValueError, match="keep_last must be >= 1, got 0"):
        checkpoint.prune(str(tmp_path), keep_last=0, newest=5)


def test_a_failed_write_keeps_earlier_checkpoints_and_leaves_no_partial(tmp_path):
    _save(tmp_path, 1, seed=1)
    model, optim = _model(seed=2)
    with pytest.raises(TypeError):  # an unserialisable run state fails the write midway
        checkpoint.save(str(tmp_path), 2, model=model, optim=optim, run={"bad": object()})
    assert sorted(os.listdir(tmp_path)) == ["step-00000001"]
    assert checkpoint.verify(checkpoint.step_dir(str(tmp_path), 1)) == []


def test_claim_takes_the_lock_cleans_partials_and_refuses_a_live_owner(tmp_path, capsys):
    os.makedirs(tmp_path / "step-00000002.partial")
    lock = checkpoint.claim(str(tmp_path), stale_after=60, job="job-a")
    try:
        assert not (tmp_path / "step-00000002.partial").exists()
        assert "removing step-00000002.partial" in capsys.readouterr().err
        with pytest.raises(LockHeld, match=f"in use by another job .*pid {os.getpid()}"):
            checkpoint.claim(str(tmp_path), stale_after=60, job="job-b")
        model, optim = _model(seed=0)
        lock.lost = lock.owner  # as if another job had taken it over
        with pytest.raises(LockHeld, match="another job took over this job's lock"):
            checkpoint.save(str(tmp_path), 1, model=model, optim=optim, run={}, lock=lock)
        assert checkpoint.steps(str(tmp_path)) == []
    finally:
        lock.release()
    assert not os.path.exists(lock.path)
