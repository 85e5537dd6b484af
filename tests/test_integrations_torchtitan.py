"""torchtitan's dataloader component (``orchmllm.integrations.torchtitan``), on its own.

torchtitan's trainer needs a GPU (and a model's assets), so the component is tested as the
trainer uses it: built from its ``Config`` with the trainer's build arguments, a dataset
folder from ``save_to_disk``, iterated as ``(input_dict, labels)`` pairs on 2 gloo ranks, and
checkpointed through ``state_dict``. One epoch conserves every document's tokens, keeps each
rank within ``local_batch_size * seq_len`` tokens, is better balanced than the same steps
unbalanced, and a loader resumed from a mid-epoch state yields the batches that followed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torchtitan.components.dataloader")  # and its dependencies
datasets = pytest.importorskip("datasets")

from orchmllm.integrations.torchtitan import BalancedTitanLoader  # noqa: E402
from orchmllm.testing import run_distributed  # noqa: E402

SEQ_LEN, LOCAL_BATCH = 32, 2
DEALT = str(Path(__file__).resolve().parent / "plugins" / "dealt_policy.py")


def _save_documents(path: str, n: int = 60, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(2.8, 0.9, n), 1, 80).astype(int)
    docs = [rng.integers(0, 1000, k).tolist() for k in lengths] + [[], [7]]  # nothing to predict
    datasets.Dataset.from_dict({"input_ids": docs}).save_to_disk(path)
    return docs


def _worker(rank: int, world: int, path: str, policies: list[str]) -> dict:
    return {p: _epoch(rank, world, path, p) for p in policies}


def _epoch(rank: int, world: int, path: str, policy: str) -> dict:
    plugins = [DEALT] if policy == "dealt" else []  # a user's policy, from its plugin file
    config = BalancedTitanLoader.Config(
        dataset_path=path, policy=policy, infinite=False, plugins=plugins
    )
    build = {"dp_world_size": world, "dp_rank": rank, "tokenizer": None, "seq_len": SEQ_LEN}
    build.update(local_batch_size=LOCAL_BATCH, snapshot_every_n_steps=None)
    loader = config.build(**build)
    assert isinstance(loader, BalancedTitanLoader)
    steps, state = [], None
    for k, (inputs, labels) in enumerate(loader):
        assert set(inputs) == {"input"} and inputs["input"].shape == labels.shape
        steps.append((inputs["input"][0].tolist(), labels[0].tolist()))
        if k == 1:
            state = loader.state_dict()
    resumed = config.build(**build)
    resumed.load_state_dict(state)
    after = [(i["input"][0].tolist(), y[0].tolist()) for i, y in resumed]
    return {"steps": steps, "after": after}


@pytest.mark.integration
def test_titan_loader_balances_conserves_and_resumes(tmp_path):
    path = str(tmp_path / "docs")
    docs = _save_documents(path)
    policies = ["identity", "greedy", "dealt"]
    per_rank = run_distributed(_worker, 2, path, policies, timeout=120)
    runs = {p: [r[p] for r in per_rank] for p in policies}
    for policy, per_rank in runs.items():
        labels = sorted(t for r in per_rank for _, y in r["steps"] for t in y)
        assert labels == sorted(t for d in docs for t in d[1 : SEQ_LEN + 1]), policy
        for r in per_rank:
            assert all(len(x) <= SEQ_LEN * LOCAL_BATCH for x, _ in r["steps"])
            assert r["after"] == r["steps"][2:]  # resumed after the second step
    imbalance = {}
    for policy, per_rank in runs.items():
        tokens = np.array([[len(x) for x, _ in r["steps"]] for r in per_rank])  # [rank, step]
        imbalance[policy] = float(np.mean(tokens.max(0) / tokens.mean(0)))
    before, after = imbalance["identity"], imbalance["greedy"]
    print(f"torchtitan loader: mean imbalance {before:.3f} -> {after:.3f}")
    assert imbalance["greedy"] < imbalance["identity"]
