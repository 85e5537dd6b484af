"""BalancedDataLoader on real gloo processes: coverage, balance, prefetch, resume, errors."""

import contextlib
import dataclasses
import gc
import inspect
import io
import os
import subprocess
import sys
import threading
import warnings
from collections import Counter

import datasets
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from orchmllm.data import exchange as ex
from orchmllm.data.collate import BalancedCollator
from orchmllm.data.exchange import EpochMismatch, PeerFailed
from orchmllm.data.lengths import dataset_lengths, map_lengths
from orchmllm.data.loader import DATALOADER_KEYWORDS, BalancedDataLoader, PlannedBatch
from orchmllm.data.options import LoaderOptions, PlanningOptions, SamplingOptions
from orchmllm.data.orchestrated import orchestrated_loader
from orchmllm.data.planners import BalancePlanner, LayoutMismatchWarning
from orchmllm.data.sampling import local_batches, token_budget_batches
from orchmllm.data.stats import METRICS
from orchmllm.data.synthetic import SyntheticConfig, as_example, build_dataset
from orchmllm.dist import agreement
from orchmllm.dist.dispatcher import BatchDispatcher
from orchmllm.dist.orchestrator import LocalBatch, Orchestrator
from orchmllm.dist.topology import Topology
from orchmllm.planner.assembly import assembly
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.step_options import StepOptions, default_phases
from orchmllm.schema import EncodingRates, example_metadata
from orchmllm.testing import run_distributed
from tests.payloads import PHASES, payload_batches

T = 30.0  # collective timeout inside the workers


def _own() -> Topology:
    """A topology for one loader alone (as it builds without one), with the tests' timeout."""
    return Topology.build(timeout=T)


def _dataset(n: int, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 60, size=n)
    return datasets.Dataset.from_dict(
        {
            "id": list(range(n)),
            "input_ids": [list(range(i, i + s)) for i, s in enumerate(sizes)],
            "n_tokens": sizes.tolist(),
        }
    )


def _ids(examples: list) -> list[int]:
    """Collate that checks the payload survived and keeps only the ids."""
    for e in examples:
        ids = list(e["input_ids"])
        assert len(ids) == e["n_tokens"] and ids[:1] == [e["id"]], e
    return [int(e["id"]) for e in examples]


def _len_ids(example) -> int:
    return len(example["input_ids"])


def _epoch(loader, steps=None):
    """Batches (and per-step plan info) of one pass, up to ``steps`` batches."""
    out, infos = [], []
    for batch in loader:
        out.append(batch)
        infos.append(loader.last_step)
        if steps is not None and len(out) == steps:
            break
    return out, infos


def _loads(info, ranks):
    dst = info.plan.dst_rank
    lengths = info.meta[:, 0]
    return [int(lengths[dst == r].sum()) for r in range(ranks)]


def _index_mode_worker(rank, world, n, batch):
    ds = _dataset(n)
    res = {}
    kw = dict(batch_size=batch, collate_fn=_ids, sampling=SamplingOptions(seed=3))
    sync = BalancedDataLoader(
        ds, length_column="n_tokens", options=LoaderOptions(prefetch=0), topology=_own(), **kw
    )
    fetch = BalancedDataLoader(ds, length_column="n_tokens", topology=_own(), **kw)
    assert fetch.mode == "index"
    for epoch in (0, 1):
        sync.set_epoch(epoch)
        fetch.set_epoch(epoch)
        s_batches, s_infos = _epoch(sync)
        f_batches, f_infos = _epoch(fetch)
        res[f"sync{epoch}"], res[f"fetch{epoch}"] = s_batches, f_batches
        res[f"dst{epoch}"] = [i.plan.dst_rank.tolist() for i in f_infos]
        res[f"dst_sync{epoch}"] = [i.plan.dst_rank.tolist() for i in s_infos]
        res[f"loads{epoch}"] = [_loads(i, world) for i in f_infos]
        res[f"max_item{epoch}"] = [int(i.meta[:, 0].max()) for i in f_infos]
        res[f"bytes_payload{epoch}"] = sum(i.bytes_payload for i in f_infos)
    # Resume: stop after 2 steps (2 more prefetched), restart a fresh loader from the state.
    fetch.set_epoch(1)
    head, _ = _epoch(fetch, steps=2)
    state = fetch.state_dict()
    fetch.close()
    again = BalancedDataLoader(ds, length_column="n_tokens", topology=_own(), **kw)
    again.load_state_dict(state)
    tail, _ = _epoch(again)
    res["resumed"] = head + tail
    res["state"] = state
    # An abandoned epoch leaves the group usable: the next pass is complete and correct.
    again.set_epoch(0)
    _epoch(again, steps=1)
    again.set_epoch(0)
    res["after_break"], _ = _epoch(again)
    # Local mode: the batch as sampled, plus the plan (what the orchestrator consumes).
    local = BalancedDataLoader(
        ds,
        mode="local",
        length_fn=_len_ids,
        options=LoaderOptions(prefetch=1),
        topology=_own(),
        **kw,
    )
    local_out = list(local)
    assert all(isinstance(b, PlannedBatch) for b in local_out)
    res["local"] = [b.batch for b in local_out]
    res["local_plan_ok"] = all(
        np.array_equal(b.plan.dst_rank, BalancePlanner()(b.info.meta, b.info.src, world).dst_rank)
        for b in local_out
    )
    res["local_dst"] = [b.plan.dst_rank.tolist() for b in local_out]
    # The same sampling through the move strategy: examples travel instead of indices.
    moved = BalancedDataLoader(ds, mode="move", length_column="n_tokens", topology=_own(), **kw)
    res["move"], move_infos = _epoch(moved)
    res["move_dst"] = [i.plan.dst_rank.tolist() for i in move_infos]
    return res


def _sampler_epoch(n, world, batch, epoch, seed=3):
    return [
        local_batches(n, rank=r, num_replicas=world, batch_size=batch, epoch=epoch, seed=seed)
        for r in range(world)
    ]


WORLD = 2
INDEX_N, INDEX_BATCH = 47, 4  # 47 is odd: DistributedSampler pads one example
MOVE_N, MOVE_BATCH = 25, 4  # shards of 13 and 12 items: rank 0 has one step more
AGREE_N = 24


def _without_timings(stats):
    return {k: v for k, v in stats.items() if not k.endswith("_ms")}


def _index_and_synthetic_worker(rank, world):
    return (
        _index_mode_worker(rank, world, INDEX_N, INDEX_BATCH),
        _synthetic_worker(rank, world),
        _agreement_worker(rank, world),
    )


def _move_and_errors_worker(rank, world):
    return (
        _move_mode_worker(rank, world, MOVE_N, MOVE_BATCH),
        _errors_worker(rank, world),
        _bad_length_index_worker(rank, world),
        _uneven_exit_worker(rank, world),
        _failing_dataset_worker(rank, world),
    )


@pytest.fixture(scope="module")
def index_run():
    """One set of processes for the index-mode and synthetic-data checks (start-up is
    most of a multi-process test's time)."""
    return run_distributed(_index_and_synthetic_worker, WORLD, timeout=90)


@pytest.fixture(scope="module")
def move_run():
    return run_distributed(_move_and_errors_worker, WORLD, timeout=90)


@pytest.mark.integration
def test_index_mode_epoch_prefetch_resume_uneven(index_run):
    world, n, batch = WORLD, INDEX_N, INDEX_BATCH
    out = [r[0] for r in index_run]
    for epoch in (0, 1):
        expected = _sampler_epoch(n, world, batch, epoch)
        steps = {len(r[f"fetch{epoch}"]) for r in out}
        assert steps == {len(expected[0])}  # equal step counts on every rank
        got = Counter(i for r in out for b in r[f"fetch{epoch}"] for i in b)
        assert got == Counter(i for b in (bb for r in expected for bb in r) for i in b)
        assert set(got) == set(range(n))
        for s in range(len(expected[0])):  # every step: same examples, just rebalanced
            step_ids = sorted(i for r in out for i in r[f"fetch{epoch}"][s])
            assert step_ids == sorted(i for r in expected for i in r[s])
        for r in out:
            assert r[f"fetch{epoch}"] == r[f"sync{epoch}"]  # prefetched == synchronous
            assert r[f"dst{epoch}"] == r[f"dst_sync{epoch}"]
            assert r[f"bytes_payload{epoch}"] == 0  # index mode moves no example
        for loads, max_item in zip(
            out[0][f"loads{epoch}"], out[0][f"max_item{epoch}"], strict=True
        ):
            assert max(loads) <= sum(loads) / world + max_item  # list-scheduling bound
    for r in out:
        assert r["state"]["step"] == 2 and r["state"]["epoch"] == 1
        assert r["resumed"] == r["fetch1"]
        assert r["after_break"] == r["fetch0"]
    # local mode: each rank's batch is exactly its DistributedSampler batch
    expected = _sampler_epoch(n, world, batch, 0)
    for rank, r in enumerate(out):
        assert r["local"] == expected[rank]
        assert r["local_plan_ok"]
        # The exchange strategies are interchangeable: on the same sampled steps, index
        # (indices travel), move (examples travel) and local (nothing travels) make the
        # same plans, and index and move hand every rank the same examples in the same order.
        assert r["move_dst"] == r["local_dst"] == r["dst0"]
        assert r["move"] == r["fetch0"]


class _Shard(IterableDataset):
    """This rank's shard of a stream: uneven sizes across ranks, so one runs out first."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.ds, self.rank, self.world = _dataset(n), rank, world

    def __iter__(self):
        for i in range(self.rank, len(self.ds), self.world):
            yield self.ds[i]


def _move_mode_worker(rank, world, n, batch):
    res = {}
    kw = dict(batch_size=batch, length_fn=_len_ids, collate_fn=_ids)
    shard = _Shard(n, rank, world)
    sync = BalancedDataLoader(shard, options=LoaderOptions(prefetch=0), topology=_own(), **kw)
    fetch = BalancedDataLoader(shard, options=LoaderOptions(prefetch=3), topology=_own(), **kw)
    assert fetch.mode == "move"
    res["sync"], s_infos = _epoch(sync)
    res["fetch"], f_infos = _epoch(fetch)
    res["plans_equal"] = all(
        np.array_equal(a.plan.dst_rank, b.plan.dst_rank)
        for a, b in zip(s_infos, f_infos, strict=True)
    )
    res["payload"] = sum(i.bytes_payload for i in f_infos)
    res["moved_items"] = sum(
        int(((i.plan.src_rank == rank) & (i.plan.dst_rank != rank)).sum()) for i in f_infos
    )
    head, _ = _epoch(fetch, steps=2)
    state = fetch.state_dict()
    fetch.close()
    again = BalancedDataLoader(shard, topology=_own(), **kw)
    again.load_state_dict(state)
    res["resumed"] = head + _epoch(again)[0]

    # An existing DataLoader (with DistributedSampler and 1 worker) wrapped as it is.
    ds = _dataset(n)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=5)
    dl = DataLoader(ds, batch_size=batch, sampler=sampler, collate_fn=_ids, num_workers=1)
    wrapped = BalancedDataLoader(dl, length_column="n_tokens", topology=_own())
    res["dl"], _ = _epoch(wrapped)
    # A user keeping their own DataLoader: only the collate function changes.
    col = BalancedCollator(_ids, length_column="n_tokens", topology=_own())
    res["collator"] = list(DataLoader(ds, batch_size=batch, sampler=sampler, collate_fn=col))
    res["collator_bytes"] = col.last_step.bytes_payload if col.last_step else -1
    return res


@pytest.mark.integration
def test_move_mode_iterable_dataloader_and_collator(move_run):
    world, n = WORLD, MOVE_N
    out = [r[0] for r in move_run]
    steps = {len(r["fetch"]) for r in out}
    assert steps == {4}  # no rank stops early (rank 0's last item is balanced too)
    assert sorted(i for r in out for b in r["fetch"] for i in b) == list(range(n))
    for r in out:
        assert r["fetch"] == r["sync"] and r["plans_equal"]
        assert r["resumed"] == r["fetch"]
    assert sum(r["moved_items"] for r in out) > 0 and all(
        (r["payload"] > 0) == (r["moved_items"] > 0) for r in out
    )
    sampler_epoch = Counter(
        i
        for rank in range(world)
        for i in DistributedSampler(range(n), num_replicas=world, rank=rank, seed=5)
    )
    for key in ("dl", "collator"):
        assert len({len(r[key]) for r in out}) == 1
        assert Counter(i for r in out for b in r[key] for i in b) == sampler_epoch
    assert any(r["collator_bytes"] > 0 for r in out)


_RATES = EncodingRates()


def _seq_len(example):
    return example_metadata(example["segments"], _RATES).seq_len


def _synthetic_worker(rank, world):
    cfg = SyntheticConfig(num_examples=30, seed=4, scale=0.05)
    ds = build_dataset(cfg, _RATES, keep_in_memory=True)
    loader = BalancedDataLoader(
        ds,
        batch_size=3,
        length_fn=_seq_len,
        collate_fn=lambda rows: [as_example(r) for r in rows],
        options=LoaderOptions(length_columns=["segments"]),
        topology=_own(),
    )
    out = []
    for batch in loader:
        info = loader.last_step
        mine = info.indices[info.plan.items_at(rank)]
        assert [e["id"] for e in batch] == mine.tolist()
        out.append([(e["id"], _seq_len(e)) for e in batch])
    # The orchestrator's per-phase plans, prefetched, equal the plans computed in the step
    # (which gathers on the orchestrator's group while the loader thread uses its own), and
    # the assembly the loader carries is the one run() computes without it.
    phases = default_phases(_RATES, feature_dims=cfg.widths)
    orch = Orchestrator(StepOptions(phases), topology=_own())
    same, steps, stats, carried = [], 0, [], []
    loader = orchestrated_loader(
        ds, orch, batch_size=3, sampling=SamplingOptions(seed=1), topology=_own()
    )
    for planned in loader:
        assert isinstance(planned.batch, LocalBatch)
        same.append(orch.plan_batch(planned.batch).same_as(planned.plan))
        stats.append((planned.stats, _expected_orchestrated_stats(planned.plan, orch)))
        carried.append(_carried_assembly_runs_the_same(planned, orch, rank, world, steps == 0))
        steps += 1
    return out, same, steps, stats, carried


def _first_rows(orch):
    """Encoders that keep the first raw row of every LLM token (outputs follow the rows)."""
    return {
        p.name: (lambda x, lengths, d=p.divisor: x.reshape(-1, d, x.shape[1])[:, 0])
        for p in orch.phases
    }


def _same_llm_batch(a, b) -> bool:
    tensors = ("input_ids", "lengths", "targets", "loss_mask", "index")
    return (
        all(torch.equal(getattr(a, f), getattr(b, f)) for f in tensors)
        and a.num_targets == b.num_targets
        and np.array_equal(a.example_ids, b.example_ids)
        and len(a.encoded) == len(b.encoded)
        and all(torch.equal(x, y) for x, y in zip(a.encoded, b.encoded, strict=True))
    )


def _carried_assembly_runs_the_same(planned, orch, rank, world, check_refusal) -> bool:
    """The prefetched assembly is this rank's of the plan, and run() with it gives the LLM
    batch it gives without it; another rank's is refused (on every rank, before a move)."""
    mine = assembly(planned.plan, rank)
    fields = ("examples", "lengths", "index", "text_pos", "seq_start")
    carried = all(np.array_equal(getattr(planned.assembly, f), getattr(mine, f)) for f in fields)
    carried = carried and planned.assembly.rows == mine.rows
    enc = _first_rows(orch)
    with_it = orch.run(planned.batch, enc, plan=planned.plan, assembly=planned.assembly)
    without = orch.run(planned.batch, enc, plan=planned.plan)
    if check_refusal:
        other = assembly(planned.plan, (rank + 1) % world)
        with pytest.raises(ValueError, match=f"assembly is not rank {rank}'s of this plan"):
            orch.run(planned.batch, enc, plan=planned.plan, assembly=other)
    return carried and _same_llm_batch(with_it, without) and with_it.num_targets > 0


def _expected_orchestrated_stats(plan, orch):
    """Per phase, what the metrics must be: length units of the moved items, and bytes
    of the moved inputs (float32 raw rows; int64 token ids and loss mask) by node."""
    out = {}
    moves = [(p.name, plan.phases[p.name].encoder, plan.phases[p.name].raw, 4 * p.feature_dim)
             for p in orch.phases]  # fmt: skip
    for name, move, units, row_bytes in moves:
        moved = move.src_rank != move.dst_rank
        out[f"{name}/tokens_moved"] = int(units[moved].sum())
        out[f"{name}/bytes_intra"] = int(units[moved].sum()) * row_bytes  # one node
    moved = plan.llm.src_rank != plan.llm.dst_rank
    out["llm/tokens_moved"] = int(plan.seq_len[moved].sum())
    out["llm/bytes_intra"] = int(plan.text_len[moved].sum()) * 16
    return out


@pytest.mark.integration
def test_synthetic_multimodal_index_mode_and_orchestrator_plans(index_run):
    out = [r[1] for r in index_run]
    items = [x for r, *_ in out for b in r for x in b]
    assert sorted(i for i, _ in items) == list(range(30))
    assert all(length > 0 for _, length in items)
    for _, same, steps, _, carried in out:
        assert steps == 5 and all(same) and len(same) == steps
        assert carried == [True] * steps
    # Every PlannedBatch carries its step's metrics per phase, the same on every rank.
    for (stats, expected), (peer, _) in zip(out[0][3], out[1][3], strict=True):
        for phase in ("vision", "audio", "llm"):
            assert {f"{phase}/{m}" for m in METRICS} <= set(stats)
            assert 1.0 <= stats[f"{phase}/imbalance_after"] <= stats[f"{phase}/imbalance_before"]
            assert stats[f"{phase}/bytes_inter"] == 0  # one node
        assert {k: stats[k] for k in expected} == expected
        assert _without_timings(stats) == _without_timings(peer)


class _Counted:
    """A real planner, counting the calls it gets on this rank."""

    def __init__(self, planner):
        self.planner, self.calls = planner, 0

    @property
    def deterministic(self):
        return self.planner.deterministic

    def __call__(self, *args):
        self.calls += 1
        return self.planner(*args)


def _fingerprints(plan) -> tuple[int, ...]:
    if isinstance(plan, Rearrangement):
        return (plan.fingerprint(),)
    moves = [plan.llm] + [m for p in plan.phases.values() for m in (p.encoder, p.to_llm)]
    return tuple(m.fingerprint() for m in moves)


def _planned_epoch(loader, planner) -> dict:
    loader.planner = counted = _Counted(planner)
    batches, infos = _epoch(loader)
    return {
        "calls": counted.calls,
        "steps": len(infos),
        "fingerprints": [_fingerprints(i.plan) for i in infos],
        "batches": batches,
    }


def _agreement_worker(rank, world):
    """Plans that are not a pure function of the gathered metadata: rank 0's, everywhere."""
    res = {}
    res["shared"] = agreement.agreed_plan(
        lambda: ("plan of", rank), deterministic=False, group=None, timeout=T
    )
    res["local"] = agreement.agreed_plan(
        lambda: ("plan of", rank), deterministic=True, group=None, timeout=T
    )

    def fail():
        raise ValueError("no plan")

    try:
        agreement.agreed_plan(fail, deterministic=False, group=None, timeout=T)
    except (ValueError, PeerFailed) as exc:
        res["failed"] = f"{type(exc).__name__}: {exc}"

    ilp = BalancePlanner(ranks_per_node=1, placement="ilp")
    # One topology for the loaders and the orchestrator, used one after another.
    topology = Topology.build(ranks_per_node=1, timeout=T)
    kw = dict(batch_size=4, collate_fn=_ids, topology=topology)
    ds = _dataset(AGREE_N)
    res["ilp_index"] = _planned_epoch(BalancedDataLoader(ds, length_column="n_tokens", **kw), ilp)
    res["greedy_index"] = _planned_epoch(
        BalancedDataLoader(ds, length_column="n_tokens", **kw), BalancePlanner()
    )
    shard = _Shard(AGREE_N, rank, world)
    res["ilp_move"] = _planned_epoch(BalancedDataLoader(shard, length_fn=_len_ids, **kw), ilp)
    syn = SyntheticConfig(num_examples=12, seed=5, scale=0.05)
    phases = default_phases(_RATES, feature_dims=syn.widths)
    orch = Orchestrator(StepOptions(phases, placement="ilp"), topology=topology)
    assert orch.options.ranks_per_node == 1  # the topology's
    loader = orchestrated_loader(
        build_dataset(syn, _RATES, keep_in_memory=True), orch, batch_size=3, topology=topology
    )
    res["ilp_orchestrated"] = _planned_epoch(loader, loader.planner)
    res["ilp_orchestrated"]["batches"] = []
    return res


@pytest.mark.integration
def test_nondeterministic_plans_are_computed_on_rank_zero_and_shared(index_run):
    out = [r[2] for r in index_run]
    assert [r["shared"] for r in out] == [("plan of", 0)] * WORLD
    assert [r["local"] for r in out] == [("plan of", r) for r in range(WORLD)]
    assert out[0]["failed"] == "ValueError: no plan"
    assert out[1]["failed"] == "PeerFailed: rank 0 failed to compute the plan: ValueError: no plan"
    for key in ("ilp_index", "ilp_move", "ilp_orchestrated"):
        runs = [r[key] for r in out]
        assert runs[0]["steps"] == runs[1]["steps"] > 0
        assert runs[0]["fingerprints"] == runs[1]["fingerprints"]  # identical plans
        assert [r["calls"] for r in runs] == [runs[0]["steps"], 0]  # planned on rank 0 alone
    # Deterministic plans: every rank plans by itself (no broadcast to wait for).
    assert all(r["greedy_index"]["calls"] == r["greedy_index"]["steps"] for r in out)
    for key in ("ilp_index", "greedy_index", "ilp_move"):  # every example arrives once
        assert sorted(i for r in out for b in r[key]["batches"] for i in b) == list(range(AGREE_N))


class _FailingCollate:
    def __init__(self, rank):
        self.rank = rank

    def __call__(self, examples):
        if self.rank == 1:
            raise RuntimeError("collate failed on rank 1")
        return examples


def _bad_length(example):
    return -5 if example["id"] == 7 else len(example["input_ids"])


def _errors_worker(rank, world):
    ds = _dataset(16)
    res = {}
    shard = _Shard(16, rank, world)
    # A bad length on one rank's example: that rank raises it, the peer is told (no hang).
    loader = BalancedDataLoader(
        shard, batch_size=4, length_fn=_bad_length, collate_fn=_ids, topology=_own()
    )
    try:
        _epoch(loader)
    except (ValueError, PeerFailed) as exc:
        res["bad_length"] = f"{type(exc).__name__}: {exc}"
    # A failure after the gather (collate) on rank 1 only.
    loader = BalancedDataLoader(
        ds, batch_size=2, length_column="n_tokens", collate_fn=_FailingCollate(rank),
        topology=_own(),
    )  # fmt: skip
    try:
        _epoch(loader)
    except (RuntimeError, PeerFailed) as exc:
        res["collate"] = f"{type(exc).__name__}: {exc}"
    # The same with the collation in DataLoader workers, which plan 2 * 2 steps ahead of
    # loading: the peers still learn of the failure at the step that failed (every rank
    # confirms it loaded its share).
    loader = BalancedDataLoader(
        _dataset(40), batch_size=2, length_column="n_tokens", collate_fn=_FailingCollate(rank),
        options=LoaderOptions(num_workers=2), topology=_own(),
    )  # fmt: skip
    try:
        _epoch(loader)
    except (RuntimeError, PeerFailed) as exc:
        res["collate_workers"] = f"{type(exc).__name__}: {exc}"
    # Ranks that disagree on the world size fail at the start of the epoch.
    loader = BalancedDataLoader(
        ds, batch_size=2, length_column="n_tokens",
        sampling=SamplingOptions(num_replicas=world + rank), topology=_own(),
    )  # fmt: skip
    try:
        iter(loader)
    except ValueError as exc:
        res["world"] = str(exc)
    dist.barrier()
    # Leaving an epoch early without close(): the process still exits (no hang at exit).
    abandoned = BalancedDataLoader(
        ds, batch_size=2, length_column="n_tokens", collate_fn=_ids, topology=_own()
    )
    next(iter(abandoned))
    return res


@pytest.mark.integration
def test_errors_surface_on_every_rank_without_hanging(move_run):
    out = [r[1] for r in move_run]
    bad = [r["bad_length"] for r in out]
    owner = 7 % 2  # rank whose shard holds example 7
    assert "length_fn must return a non-negative integer" in bad[owner]
    assert bad[1 - owner].startswith("PeerFailed") and f"[{owner}]" in bad[1 - owner]
    assert out[1]["collate"] == "RuntimeError: collate failed on rank 1"
    assert out[0]["collate"].startswith("PeerFailed")
    assert "collate failed on rank 1" in out[1]["collate_workers"]
    assert out[0]["collate_workers"] == (
        "PeerFailed: rank(s) [1] failed to prepare step 0; see their logs"
    )
    for r in out:
        assert "num_replicas differs between ranks: [2, 3]" in r["world"]


class _FailsOnRank1:
    """A map-style dataset whose reads fail on rank 1 from its ``after``-th read on (a
    corrupt file, a lost mount: on one rank, while the others read fine)."""

    def __init__(self, ds, after: int) -> None:
        self.ds, self.after, self.reads = ds, after, 0

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):
        self.reads += 1
        if dist.get_rank() == 1 and self.reads > self.after:
            raise OSError(f"cannot read example {i} on rank 1")
        return self.ds[i]


def _train_on(batches) -> tuple[int, str]:
    """Steps a training loop (an all-reduce per step, as FSDP's) finished, and how it ended."""
    steps = 0
    try:
        for _ in batches:
            dist.all_reduce(torch.ones(1))
            steps += 1
    except (OSError, PeerFailed) as exc:
        return steps, f"{type(exc).__name__}: {exc}"
    return steps, "finished"


def _failing_dataset_worker(rank, world):
    """A dataset that fails on one rank after the plan (index mode loads the balanced
    indices after the exchange), and one read by the user's own DataLoader, whose
    BalancedCollator that rank then never calls."""
    ds = _dataset(24)
    out = {}
    loader = BalancedDataLoader(
        _FailsOnRank1(ds, after=5), batch_size=2, lengths=ds["n_tokens"], collate_fn=_ids,
        mode="index", topology=_own(),
    )  # fmt: skip
    out["index"] = _train_on(loader)
    # The collator: rank 1's DataLoader raises before the collator is called; it then stays
    # out of the exchange (as a failed rank does), so the peers' exchange times out.
    collator = BalancedCollator(_ids, length_column="n_tokens", topology=Topology.build(timeout=3))
    source = DataLoader(
        _FailsOnRank1(ds, after=4), batch_size=2, collate_fn=collator,
        sampler=DistributedSampler(ds, shuffle=False),
    )  # fmt: skip
    out["collator"] = _train_on(source)
    dist.barrier()  # rank 1 waits here for the peers' roll call
    return out


BAD_ID = 13  # its position in a local batch of 4 is below 4, so never 13 itself


@pytest.mark.integration
def test_a_dataset_failing_on_one_rank_is_named_on_every_rank(move_run):
    """Index mode: a read that fails on rank 1 after the plan fails that step on every rank
    (rank 1 its own error, the others PeerFailed naming it) before any rank trains on it.
    The collator: rank 1's own DataLoader fails (the collator never runs there); the peer's
    exchange then fails, and a roll call names rank 1 as the rank that did not answer."""
    out = [r[4] for r in move_run]
    (steps1, err1), (steps0, err0) = out[1]["index"], out[0]["index"]
    assert err1.startswith("OSError: cannot read example") and steps0 == steps1 >= 1
    assert err0 == f"PeerFailed: rank(s) [1] failed to prepare step {steps1}; see their logs"
    assert out[1]["collator"][1].startswith("OSError: cannot read example")
    steps0, err0 = out[0]["collator"]
    assert steps0 == out[1]["collator"][0] and err0.startswith(
        f"PeerFailed: the metadata exchange of step {steps0} failed"
    )
    assert "rank(s) [1] did not answer a roll call within 3 s" in err0


def _bad_13(example) -> int:
    return -5 if example["id"] == BAD_ID else len(example["input_ids"])


def _first_error(loader) -> str | None:
    try:
        _epoch(loader)
    except (ValueError, PeerFailed) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _bad_length_index_worker(rank, world):
    """A bad or missing length in move mode names the example's dataset index (or, for a
    stream, its position in this rank's stream), not its position in the local batch."""
    ds = _dataset(16)
    res = {"owner": BAD_ID in list(DistributedSampler(ds, num_replicas=world, rank=rank))}
    res["map"] = _first_error(
        BalancedDataLoader(
            ds, batch_size=4, mode="move", length_fn=_bad_13, collate_fn=_ids, topology=_own()
        )
    )
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=0)
    dl = DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=_ids, num_workers=1)
    res["dataloader"] = _first_error(BalancedDataLoader(dl, length_fn=_bad_13, topology=_own()))
    rows = [dict(ds[i]) for i in range(16)]
    del rows[BAD_ID]["n_tokens"]
    res["missing"] = _first_error(
        BalancedDataLoader(
            rows, batch_size=4, length_column="n_tokens", collate_fn=_ids, topology=_own()
        )
    )
    # Rank 1's shard holds ids 1, 3, ..., 15: id 13 is item 6 of its stream (item 2 of batch 1).
    res["stream"] = _first_error(
        BalancedDataLoader(
            _Shard(16, rank, world),
            batch_size=4,
            length_fn=_bad_13,
            collate_fn=_ids,
            topology=_own(),
        )  # fmt: skip
    )
    return res


@pytest.mark.integration
def test_bad_or_missing_length_names_the_dataset_index(move_run):
    out = [r[2] for r in move_run]
    (owner,) = [rank for rank, r in enumerate(out) if r["owner"]]
    peer = out[1 - owner]
    for key in ("map", "dataloader"):
        assert out[owner][key] == (
            f"ValueError: length_fn must return a non-negative integer; example {BAD_ID} gave -5"
        ), key
        assert peer[key].startswith("PeerFailed") and f"[{owner}]" in peer[key], key
    assert out[owner]["missing"].startswith(
        f"ValueError: length_column='n_tokens' is missing from example {BAD_ID} (dict)"
    )
    assert out[1]["stream"] == (
        "ValueError: length_fn must return a non-negative integer; item 6 of this rank's "
        "stream gave -5"
    )
    assert out[0]["stream"].startswith("PeerFailed") and "[1]" in out[0]["stream"]


def _leave_after(loader, batches):
    """Leave the epoch after ``batches`` batches; the EpochMismatch text, if any."""
    try:
        for i, _ in enumerate(loader):
            if i + 1 == batches:
                break
        loader.close()
    except EpochMismatch as exc:
        return str(exc)
    return None


def _uneven_exit_worker(rank, world):
    """Rank 0 leaves the epoch after 1 batch, rank 1 after 4: a clear error on both ranks
    (before: gloo collective mismatch, SIGABRT), and the loader stays usable."""
    ds = _dataset(40)  # 10 steps of 2 per rank
    res = {}
    for prefetch, workers in UNEVEN:
        name = f"train-p{prefetch}-w{workers}"
        loader = BalancedDataLoader(
            ds, batch_size=2, length_column="n_tokens", collate_fn=_ids, topology=_own(),
            options=LoaderOptions(prefetch=prefetch, num_workers=workers, name=name),
        )  # fmt: skip
        res[f"error-{name}"] = _leave_after(loader, 1 if rank == 0 else 4)
        loader.set_epoch(1)
        res[f"next_epoch-{name}"] = [i for b in loader for i in b]
        # Leaving after the same number of batches is fine, prefetched or not.
        res[f"even-{name}"] = _leave_after(loader, 3)
    return res


# (prefetch, num_workers) -> the step rank 1 went on to: with prefetch, the first step rank
# 0's thread never started (1 + 2 + 1); with workers also the 2 * 2 index batches the
# DataLoader asks for ahead of loading (each asking plans a step).
UNEVEN = {(0, 0): 1, (2, 0): 4, (2, 2): 8}


@pytest.mark.integration
def test_ranks_leaving_an_epoch_at_different_steps_fail_clearly_on_every_rank(move_run):
    out = [r[3] for r in move_run]
    for (prefetch, workers), step in UNEVEN.items():
        name = f"train-p{prefetch}-w{workers}"
        expected = (
            f"{name}, epoch 0: ranks left the epoch at different steps: rank(s) [0] "
            f"stopped after 1 batch(es); rank(s) [1] went on to step {step}. Every rank must "
            "consume the same number of batches"
        )
        for r in out:
            assert r[f"error-{name}"].startswith(expected), r[f"error-{name}"]
            assert r[f"even-{name}"] is None
        assert sorted(i for r in out for i in r[f"next_epoch-{name}"]) == list(range(40))


# -- DataLoader parity, token budget, metrics -------------------------------------------

PAR_N = 37  # odd: the sampler pads; rank 0's stream shard is one example longer
BUDGET = 120  # tokens per rank per step (lengths are 1..59)


class _WorkerShard(IterableDataset):
    """This rank's shard of a stream, split between DataLoader workers as an
    IterableDataset must be; its __len__ is the examples in this rank's shard."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.ds, self.ids = _dataset(n), list(range(rank, n, world))

    def __len__(self):
        return len(self.ids)

    def __iter__(self):
        info = get_worker_info()
        ids = self.ids if info is None else self.ids[info.id :: info.num_workers]
        for i in ids:
            yield self.ds[i]


def _two_epochs(loader):
    out = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        out.append([b for b in loader])
    return out


def _resumed(make, *, epoch, head):
    """Stop after ``head`` batches of ``epoch``, then a new loader resumes from the state."""
    first = make()
    first.set_epoch(epoch)
    batches, _ = _epoch(first, steps=head)
    state = first.state_dict()
    first.close()
    again = make()
    again.load_state_dict(state)
    return batches + list(again)


def _parity_worker(rank, world):
    """Workers (persistent too) in every form give the batches of the same loader without
    them; len() and resume are exact."""
    ds = _dataset(PAR_N)
    kw = dict(length_column="n_tokens", collate_fn=_ids)
    res = {}
    for mode in ("index", "move"):

        def make(mode=mode, options=None):
            return BalancedDataLoader(
                ds, batch_size=3, mode=mode, options=options, topology=_own(), **kw
            )

        pooled = make(options=LoaderOptions(num_workers=2, persistent_workers=True))
        res[mode] = {
            "plain": _two_epochs(make()),
            "workers": _two_epochs(pooled),
            "len": len(pooled),
            "resumed": _resumed(
                lambda: make(options=LoaderOptions(num_workers=2)), epoch=1, head=2
            ),
        }

    def stream():
        return BalancedDataLoader(
            _WorkerShard(PAR_N, rank, world), batch_size=3, length_fn=_len_ids, collate_fn=_ids,
            options=LoaderOptions(num_workers=2), topology=_own(),
        )  # fmt: skip

    loader = stream()
    res["stream"] = {
        "epochs": _two_epochs(loader),
        "len": len(loader),
        "resumed": _resumed(stream, epoch=1, head=2),
    }

    def wrapped():
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=5)
        dl = DataLoader(
            ds, batch_size=3, sampler=sampler, collate_fn=_ids, num_workers=2,
            persistent_workers=True,
        )  # fmt: skip
        return BalancedDataLoader(dl, length_column="n_tokens", topology=_own())

    loader = wrapped()
    res["dataloader"] = {
        "epochs": _two_epochs(loader),
        "len": len(loader),
        "dl_len": len(loader.source),
        "resumed": _resumed(wrapped, epoch=1, head=2),
    }
    return res


def _budget_worker(rank, world):
    ds = _dataset(60)
    kw = dict(max_tokens_per_rank=BUDGET, collate_fn=_ids)
    res = {"lengths": ds["n_tokens"]}
    index = BalancedDataLoader(
        ds, length_column="n_tokens", sampling=SamplingOptions(seed=2),
        options=LoaderOptions(num_workers=1, with_stats=True), topology=_own(), **kw,
    )  # fmt: skip
    res["index"] = {"steps": list(index), "len": len(index)}
    stream = BalancedDataLoader(
        _Shard(60, rank, world), length_fn=_len_ids, options=LoaderOptions(with_stats=True),
        topology=_own(), **kw,
    )  # fmt: skip
    res["stream"] = {"steps": list(stream)}
    return res


def _stats_worker(rank, world):
    """Metrics in move mode: one node (everything intra-node) and one rank per node
    (everything inter-node); log_every prints on rank 0 only."""
    ds = _dataset(24)
    res = {}
    for key, planner in (
        ("one_node", BalancePlanner()),
        ("rank_per_node", BalancePlanner(ranks_per_node=1)),
    ):
        loader = BalancedDataLoader(
            _Shard(24, rank, world), batch_size=4, length_fn=_len_ids, collate_fn=_ids,
            planning=PlanningOptions(planner=planner), options=LoaderOptions(with_stats=True),
            topology=_own(),
        )  # fmt: skip
        res[key] = [(stats, _moved_tokens(loader.last_step)) for _, stats in loader]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        logged = BalancedDataLoader(
            ds, batch_size=2, length_column="n_tokens", collate_fn=_ids, topology=_own(),
            options=LoaderOptions(log_every=2, name="logged"),
        )  # fmt: skip
        res["log_steps"] = len(list(logged))
    res["log"] = out.getvalue()
    return res


def _moved_tokens(info):
    return int(info.meta[info.plan.src_rank != info.plan.dst_rank, 0].sum())


def _threads_and_files() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _python_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def _one_of_each(ds, kw, rank, world):
    """A loader, a dispatcher and an orchestrator built without a topology, used together:
    two loaders prefetch in their threads while the dispatcher and the orchestrator gather in
    this one (safe only because each owns its group). Their metadata groups, and the bytes
    the dispatcher and the orchestrator saw, for the checks."""
    loaders = [BalancedDataLoader(ds, **kw) for _ in range(2)]
    disp = BatchDispatcher()
    orch = Orchestrator(StepOptions(PHASES))
    batch = LocalBatch.from_examples(payload_batches(world)[rank], PHASES)
    tokens = 0
    for step, _ in enumerate(zip(*loaders, strict=True)):
        lengths = torch.tensor([1 + step, 2 + rank])
        d = disp.dispatch({"x": torch.arange(int(lengths.sum()))}, lengths)
        tokens += int(d.lengths.sum())
        orch.plan_batch(batch)
        if step == 1:
            break  # leave the epoch early: dropping the iterators closes their threads
    groups = [x.topology.meta_group for x in (*loaders, disp, orch)]
    return groups, tokens


def _groups_worker(rank, world):
    """Objects built without a topology own one gloo group each, and hold no thread or socket
    once dropped, even mid-epoch (a loader per epoch); objects given a topology share its
    group, opening none."""
    ds = _dataset(16)
    kw = dict(batch_size=2, length_column="n_tokens", collate_fn=_ids)
    _one_of_each(ds, kw, rank, world)  # warm-up: lazy imports and allocator pools
    gc.collect()
    threads, before = _python_threads(), _threads_and_files()
    distinct, tokens = [], []
    for _ in range(10):
        groups, moved = _one_of_each(ds, kw, rank, world)
        distinct.append(len({id(g) for g in groups}) == len(groups) and None not in groups)
        tokens.append(moved)
        del groups
        gc.collect()
    after = _threads_and_files()
    res = {"own": (before, after), "threads": (threads, _python_threads())}
    res["distinct"], res["tokens"] = distinct, tokens
    with Topology.build(timeout=T) as topology:
        shared = [BalancedDataLoader(ds, topology=topology, **kw) for _ in range(3)]
        users = [*shared, BatchDispatcher(topology=topology)]
        users.append(Orchestrator(StepOptions(PHASES), topology=topology))
        res["shared"] = [x.topology is topology for x in users]
        res["gathers_on"] = [x._group.group is topology.meta_group for x in shared]
        res["steps"] = [len(list(loader)) for loader in shared]  # one after another
    gc.collect()
    res["closed"] = _threads_and_files()
    return res


def _features_worker(rank, world):
    return {
        "parity": _parity_worker(rank, world),
        "budget": _budget_worker(rank, world),
        "stats": _stats_worker(rank, world),
        "groups": _groups_worker(rank, world),
    }


@pytest.fixture(scope="module")
def features_run():
    return run_distributed(_features_worker, WORLD, timeout=150)


@pytest.mark.integration
def test_workers_in_every_form_keep_batches_len_and_resume_exact(features_run):
    out = [r["parity"] for r in features_run]
    for mode in ("index", "move"):
        steps = len(_sampler_epoch(PAR_N, WORLD, 3, 0)[0])
        for r in out:
            assert r[mode]["workers"] == r[mode]["plain"]  # same batches with workers
            assert r[mode]["len"] == steps == len(r[mode]["workers"][0])
            assert r[mode]["resumed"] == r[mode]["plain"][1]
    for form in ("stream", "dataloader"):
        for r in out:
            assert r[form]["resumed"] == r[form]["epochs"][1]
            assert all(r[form]["len"] == len(e) for e in r[form]["epochs"])
        assert len({r[form]["len"] for r in out}) == 1  # the same on every rank
    # The stream's epoch lasts as long as the longest shard (19 examples: 7 steps of 3).
    assert out[0]["stream"]["len"] == 7
    for epoch in (0, 1):
        got = sorted(i for r in out for b in r["stream"]["epochs"][epoch] for i in b)
        assert got == list(range(PAR_N))  # workers split the shard: every example once
    assert all(r["dataloader"]["len"] == r["dataloader"]["dl_len"] for r in out)


@pytest.mark.integration
def test_objects_without_a_topology_own_their_groups_and_leave_nothing_behind(features_run):
    for r in (r["groups"] for r in features_run):
        (threads0, files0), (threads1, files1) = r["own"]
        # 10 x (2 loaders, a dispatcher, an orchestrator) with a gloo group each leaked >= 2
        # native threads and sockets per group while groups outlived their owners.
        assert threads1 - threads0 < 10 and files1 - files0 < 10, r["own"]
        before, after = r["threads"]
        assert after == before and not [t for t in after if t.startswith("orchmllm-loader")]
        assert all(r["distinct"])  # four objects, four groups
        assert r["shared"] == [True] * 5 and all(r["gathers_on"]) and r["steps"] == [4] * 3
        # The shared topology's group, closed, is gone too.
        assert r["closed"][0] - threads0 < 10 and r["closed"][1] - files0 < 10, r["closed"]
    # The dispatcher conserved the tokens: in 2 steps, every rank's inputs arrived once.
    sent = sum(1 + step + 2 + rank for step in range(2) for rank in range(WORLD))
    received = np.sum([r["groups"]["tokens"] for r in features_run], axis=0)
    assert received.tolist() == [sent] * 10


@pytest.mark.integration
def test_token_budget_batches_are_balanced_within_the_budget(features_run):
    out = [r["budget"] for r in features_run]
    lengths = out[0]["lengths"]
    for key in ("index", "stream"):
        runs = [r[key]["steps"] for r in out]
        assert len({len(steps) for steps in runs}) == 1  # the same step count on every rank
        for (batch, stats), (peer, peer_stats) in zip(*runs, strict=True):
            for ids in (batch, peer):
                assert sum(lengths[i] for i in ids) <= BUDGET
            assert stats["batch/imbalance_after"] <= stats["batch/imbalance_before"]
            assert _without_timings(stats) == _without_timings(peer_stats)
        ids = sorted(i for steps in runs for batch, _ in steps for i in batch)
        assert ids == list(range(60))  # every example exactly once
    packing = token_budget_batches(lengths, num_replicas=WORLD, max_tokens=BUDGET, seed=2)
    assert out[0]["index"]["len"] == len(out[0]["index"]["steps"]) == len(packing)
    # Full steps: all but the last hold more than half the ranks' budget on average.
    totals = [sum(lengths[i] for r in out for i in r["index"]["steps"][s][0])
              for s in range(len(packing) - 1)]  # fmt: skip
    assert min(totals) > WORLD * BUDGET / 2


@pytest.mark.integration
def test_every_batch_carries_its_step_metrics_and_log_every_prints_on_rank_zero(features_run):
    out = [r["stats"] for r in features_run]
    for key, local, remote in (("one_node", "intra", "inter"), ("rank_per_node", "inter", "intra")):
        steps = [r[key] for r in out]
        assert any(stats["batch/tokens_moved"] > 0 for stats, _ in steps[0])
        for (stats, moved), (peer, _) in zip(*steps, strict=True):
            assert {"epoch", "step", "prepare_ms", "wait_ms", "bytes_meta"} <= set(stats)
            assert {f"batch/{m}" for m in METRICS} <= set(stats)
            assert stats["batch/tokens_moved"] == moved
            assert (stats[f"batch/bytes_{local}"] > 0) == (moved > 0)
            assert stats[f"batch/bytes_{remote}"] == 0
            assert _without_timings(stats) == _without_timings(peer)
    lines = out[0]["log"].splitlines()
    assert len(lines) == -(-out[0]["log_steps"] // 2) and out[1]["log"] == ""
    assert lines[0].startswith("logged epoch 0 step 0 | batch imbalance ")
    assert lines[1].startswith("logged epoch 0 step 2 | ")


def test_single_process_and_bad_arguments():
    ds = _dataset(10)
    loader = BalancedDataLoader(ds, batch_size=3, length_column="n_tokens", collate_fn=_ids)
    assert sorted(i for b in loader for i in b) == list(range(10)) and len(loader) == 4
    with pytest.raises(ValueError, match="length_column='nope' is not a column"):
        BalancedDataLoader(ds, batch_size=3, length_column="nope")
    with pytest.raises(ValueError, match="length_column='nope' is not a column"):
        BalancedDataLoader(ds, batch_size=3, length_column="nope", mode="move")
    with pytest.raises(ValueError, match="mode='index' needs a map-style dataset"):
        BalancedDataLoader(_Shard(4, 0, 1), batch_size=3, length_fn=_len_ids, mode="index")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BalancedDataLoader(ds, batch_size=0, length_column="n_tokens")
    with pytest.raises(ValueError, match="mode must be one of"):
        BalancedDataLoader(ds, batch_size=2, length_column="n_tokens", mode="fast")
    with pytest.raises(ValueError, match="lengths must be non-negative"):
        BalancedDataLoader(ds, batch_size=2, lengths=[-1] * 10)
    with pytest.raises(ValueError, match="at most one"):
        BalancedDataLoader(ds, batch_size=2, lengths=[1] * 10, length_column="n_tokens")
    bad = BalancedDataLoader(_Shard(4, 0, 1), batch_size=2, length_fn=lambda e: 1.5)
    with pytest.raises(ValueError, match=r"length_fn must return a non-negative integer.*1\.5"):
        list(bad)


def test_loader_and_collator_warn_when_the_policy_assumes_the_other_layout():
    def padded(examples):
        return _ids(examples)

    padded.orchmllm_layout = "padded"
    ds = _dataset(6)
    with pytest.warns(LayoutMismatchWarning, match="use policy='padded_cost'"):
        BalancedDataLoader(ds, batch_size=3, length_column="n_tokens", collate_fn=padded)
    with pytest.warns(LayoutMismatchWarning, match="use policy='padded_cost'"):
        BalancedCollator(padded, length_column="n_tokens")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutMismatchWarning)
        loader = BalancedDataLoader(
            ds, batch_size=3, length_column="n_tokens", collate_fn=padded,
            planning=PlanningOptions(policy="padded_cost"),
        )  # fmt: skip
        assert sorted(i for b in loader for i in b) == list(range(6))


def test_option_groups_are_checked_when_built_and_shared_between_loaders():
    ds = _dataset(10)
    sampling = SamplingOptions(seed=4)
    kw = dict(batch_size=3, length_column="n_tokens", collate_fn=_ids)
    first, second = (BalancedDataLoader(ds, sampling=sampling, **kw) for _ in range(2))
    assert first.sampling is second.sampling is sampling
    assert list(first) == list(second)
    assert list(first) != list(BalancedDataLoader(ds, **kw))  # seed 0 shuffles otherwise
    assert dataclasses.replace(sampling, seed=5).seed == 5 and sampling.seed == 4
    # A group's field is a keyword of the loader only where it is DataLoader's own keyword
    # (the same name there), so a DataLoader call carries over as it is typed.
    groups = (SamplingOptions, PlanningOptions, LoaderOptions)
    fields = {f.name for g in groups for f in dataclasses.fields(g)}
    both = fields & set(inspect.signature(BalancedDataLoader).parameters)
    assert both == set(DATALOADER_KEYWORDS) <= set(inspect.signature(DataLoader).parameters)
    with pytest.raises(ValueError, match="prefetch must be >= 0, got -1"):
        LoaderOptions(prefetch=-1)
    with pytest.raises(ValueError, match="num_replicas must be >= 1 or None, got 0"):
        SamplingOptions(num_replicas=0)
    with pytest.raises(ValueError, match="pass meta_fn= or batch_meta_fn=, not both"):
        PlanningOptions(meta_fn=len, batch_meta_fn=len)
    with pytest.raises(TypeError, match="unexpected keyword argument 'seed'"):
        BalancedDataLoader(ds, seed=3, **kw)
    with pytest.raises(TypeError, match="sampling must be a SamplingOptions, got dict"):
        BalancedDataLoader(ds, sampling={"seed": 3}, **kw)
    with pytest.raises(TypeError, match="options must be a LoaderOptions, got SamplingOptions"):
        BalancedDataLoader(ds, options=sampling, **kw)
    with pytest.raises(ValueError, match="batch_meta_fn needs mode='local'"):
        BalancedDataLoader(ds, batch_size=2, planning=PlanningOptions(batch_meta_fn=len))
    with pytest.raises(ValueError, match="mode='index' plans on lengths only"):
        BalancedDataLoader(ds, batch_size=2, mode="index", planning=PlanningOptions(meta_fn=len))


def test_dataloader_parity_combinations_that_cannot_work_fail_at_construction():
    ds = _dataset(12)
    kw = dict(length_column="n_tokens", collate_fn=_ids)
    dl = DataLoader(ds, batch_size=3, collate_fn=_ids)
    with pytest.raises(ValueError, match=r"set them on it \(DataLoader\(\.\.\., num_workers=N\)\)"):
        BalancedDataLoader(dl, length_column="n_tokens", options=LoaderOptions(num_workers=2))
    with pytest.raises(ValueError, match="batch_size comes from the dataloader's batches"):
        BalancedDataLoader(dl, batch_size=3, length_column="n_tokens")
    with pytest.raises(ValueError, match="wrap it in an IterableDataset, or use num_workers=0"):
        BalancedDataLoader(
            iter(list(ds)), batch_size=3, length_fn=_len_ids, options=LoaderOptions(num_workers=2)
        )
    with pytest.raises(ValueError, match="persistent_workers=True needs num_workers > 0"):
        LoaderOptions(persistent_workers=True)
    with pytest.raises(ValueError, match="pass batch_size= or max_tokens_per_rank=, not both"):
        BalancedDataLoader(ds, batch_size=3, max_tokens_per_rank=10, **kw)
    with pytest.raises(ValueError, match="max_tokens_per_rank=10 is below the length of example"):
        BalancedDataLoader(ds, max_tokens_per_rank=10, **kw)  # lengths up to 59
    with pytest.raises(ValueError, match="max_tokens_per_rank budgets lengths"):
        BalancedDataLoader(
            ds, max_tokens_per_rank=100, mode="local", planning=PlanningOptions(batch_meta_fn=len)
        )
    # A token budget on a stream: an example over the budget is named when it is read.
    over = BalancedDataLoader(_Shard(12, 0, 1), max_tokens_per_rank=10, length_fn=_len_ids)
    with pytest.raises(ValueError, match="below the length of item 0 of this rank's stream"):
        list(over)
    # len() in every form: map-style, DataLoader, a stream with __len__; a clear TypeError
    # where no rank can know it.
    assert len(BalancedDataLoader(ds, batch_size=5, **kw)) == 3
    assert len(BalancedDataLoader(dl, length_column="n_tokens")) == len(dl) == 4
    assert len(BalancedDataLoader(_WorkerShard(12, 0, 1), batch_size=5, length_fn=_len_ids)) == 3
    with pytest.raises(TypeError, match="known only at the end of the epoch for _Shard data"):
        len(BalancedDataLoader(_Shard(12, 0, 1), batch_size=5, length_fn=_len_ids))
    budget = BalancedDataLoader(ds, max_tokens_per_rank=100, **kw)
    assert len(budget) == len(list(budget))


def _id_tensor(examples):
    return torch.tensor(_ids(examples))


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator path")
def test_pin_memory_without_an_accelerator_warns_and_still_yields():
    ds = _dataset(6)
    with pytest.warns(UserWarning, match="no accelerator is available: batches are not pinned"):
        loader = BalancedDataLoader(
            ds, batch_size=2, length_column="n_tokens", collate_fn=_id_tensor,
            options=LoaderOptions(pin_memory=True),
        )  # fmt: skip
    assert sorted(torch.cat(list(loader)).tolist()) == list(range(6))


def test_public_names_document_args_returns_raises_and_the_loss_normalisation():
    from orchmllm.data.orchestrated import orchestrated_loader

    norm = "global_num_items"  # where the docs send users for the loss normalisation
    docs = {
        "BalancedDataLoader": (BalancedDataLoader, ("Args:", "Raises:", norm)),
        "BalancedCollator": (BalancedCollator, ("Args:", "Returns", "Raises:", norm)),
        "orchestrated_loader": (orchestrated_loader, ("Args:", "Returns:", "Raises:", norm)),
        "PlannedBatch": (PlannedBatch, ("Attributes:", "stats", "assembly")),
        "SamplingOptions": (SamplingOptions, ("Attributes:",)),
        "PlanningOptions": (PlanningOptions, ("Attributes:",)),
        "LoaderOptions": (LoaderOptions, ("Attributes:",)),
    }
    for name, (obj, sections) in docs.items():
        doc = inspect.getdoc(obj)
        assert all(s in doc for s in sections), (name, [s for s in sections if s not in doc])
    loader_doc = inspect.getdoc(BalancedDataLoader)
    for name in inspect.signature(BalancedDataLoader).parameters:  # every argument documented
        assert f"    {name}: " in loader_doc, name
    assert "yields" in loader_doc
    for group in (SamplingOptions, PlanningOptions, LoaderOptions):
        doc = inspect.getdoc(group)
        for f in dataclasses.fields(group):  # every option is documented
            assert f"    {f.name}: " in doc, (group.__name__, f.name)


def test_abandoned_iteration_stops_its_thread_when_dropped():
    """An iterator dropped mid-epoch closes itself (its steps are bounded by what was consumed,
    so this is collective-safe); no prefetch thread may outlive it and race a later
    destroy_process_group."""
    loader = BalancedDataLoader(
        _dataset(40), batch_size=2, length_column="n_tokens", collate_fn=_ids
    )
    next(iter(loader))
    assert not [t for t in threading.enumerate() if t.name.startswith("orchmllm-loader")]
    assert len(list(loader)) == len(loader) - 1  # still usable: continues after the consumed step


@pytest.mark.integration
def test_package_exports_load_lazily():
    """``import orchmllm.data`` stays light; the loader's names load on first use."""
    heavy = ("torch", "datasets", "orchmllm.data.loader")
    code = f"import sys, orchmllm.data; print(sorted(set({heavy!r}) & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    import orchmllm.data as data

    exported = (
        (data.BalancedDataLoader, BalancedDataLoader),
        (data.LoaderOptions, LoaderOptions),
        (data.SamplingOptions, SamplingOptions),
        (data.PlanningOptions, PlanningOptions),
        (data.PlannedBatch, PlannedBatch),
        (data.BalancedCollator, BalancedCollator),
        (data.StepInfo, ex.StepInfo),
        (data.PeerFailed, PeerFailed),
        (data.EpochMismatch, EpochMismatch),
        (data.BalancePlanner, BalancePlanner),
        (data.orchestrated_loader, orchestrated_loader),
        (data.map_lengths, map_lengths),
        (data.dataset_lengths, dataset_lengths),
        (data.SyntheticConfig, SyntheticConfig),
    )
    assert all(got is defined for got, defined in exported)
    assert len(set(data.__all__)) == len(data.__all__) and "map_lengths" in data.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        data.nope  # noqa: B018


class _ForkedFrom(torch.utils.data.Dataset):
    """Each example names the thread its worker process was forked from (a forked child keeps
    the forking thread's name)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": [1] * (i + 1), "thread": threading.current_thread().name}


def _as_is(batch: list) -> list:
    return batch


@pytest.mark.integration
@pytest.mark.parametrize("source", ["dataloader", "move", "index"])
def test_workers_fork_from_the_thread_that_iterates_not_the_prefetch_thread(source):
    """A fork copies the locks other threads hold: the workers start in ``iter()``, in the
    training loop's thread, as a plain DataLoader's do, for every epoch and every mode (index
    mode's batch sampler plans, so its first steps plan in ``iter()`` too)."""
    length = {"length_fn": lambda ex: len(ex["input_ids"])}
    if source == "dataloader":
        dl = DataLoader(_ForkedFrom(), batch_size=3, num_workers=1, collate_fn=_as_is)
        loader = BalancedDataLoader(dl, **length)
    else:
        loader = BalancedDataLoader(
            _ForkedFrom(), batch_size=3, mode=source, collate_fn=_as_is,
            options=LoaderOptions(num_workers=1), **length,
        )  # fmt: skip
    for epoch in range(2):
        loader.set_epoch(epoch)
        examples = [ex for batch in loader for ex in batch]
        assert len(examples) == 12  # every example, once
        assert {ex["thread"] for ex in examples} == {threading.current_thread().name}


def _empty_worker(rank, world):
    """Datasets that yield no step: each error's message, or None when nothing raised."""
    out = {}
    cases = {
        "empty": lambda: BalancedDataLoader(
            _dataset(0), batch_size=2, length_column="n_tokens", collate_fn=_ids,
            options=LoaderOptions(name="captions"), topology=_own(),
        ),
        "short": lambda: BalancedDataLoader(
            _dataset(1), batch_size=4, length_column="n_tokens", collate_fn=_ids,
            sampling=SamplingOptions(drop_last=True), topology=_own(),
        ),
        "stream": lambda: _epoch(BalancedDataLoader(
            _Shard(0, rank, world), batch_size=4, length_fn=_len_ids, collate_fn=_ids,
            options=LoaderOptions(name="stream"), topology=_own(),
        )),
    }  # fmt: skip
    for name, make in cases.items():
        try:
            make()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.integration
def test_a_dataset_that_yields_no_step_raises_naming_it_and_the_batch_size():
    """An empty map-style dataset, one example for 2 ranks x 4 with drop_last, and a stream
    whose shards are empty (found at the end of its first epoch): each raises on every rank,
    naming the loader, the dataset and the batch size, instead of an epoch of 0 steps."""
    for out in run_distributed(_empty_worker, 2, timeout=60):
        assert out["empty"] == (
            "captions: the dataset (Dataset, 0 examples) yields no step of 2 ranks x batch_size "
            "2: a loop over it would end at once. Give it more examples or take smaller batches"
        )
        assert (
            "the dataset (Dataset, 1 examples) yields no step of 2 ranks x batch_size 4, "
            "drop_last" in out["short"]
        )
        assert out["stream"].startswith(
            "stream: the dataset (_Shard, no examples on any rank) yields no step of 2 ranks x "
            "batch_size 4"
        )


KW_N, KW_BATCH = 23, 3  # odd: drop_last=True drops one example of the sampler's epoch
_WORKER_TAG = -1  # set in each loading worker by _tag_worker; -1 in the loop's process


def _tag_worker(worker_id: int) -> None:
    global _WORKER_TAG
    _WORKER_TAG = 100 + worker_id


class _Drawn(torch.utils.data.Dataset):
    """Each example with a draw from its loading process's torch RNG (seeded, in a worker,
    from the DataLoader's generator) and the tag of that process (set by worker_init_fn)."""

    def __len__(self) -> int:
        return KW_N

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return i, int(torch.randint(1 << 30, ())), _WORKER_TAG


def _keywords_worker(rank, world):
    """The same loader spelled with DataLoader's keywords and with the option groups; the
    worker settings that only DataLoader's workers see (generator, worker_init_fn)."""
    ds = _dataset(KW_N)
    kw = dict(batch_size=KW_BATCH, length_column="n_tokens", collate_fn=_ids)
    as_dataloader = BalancedDataLoader(
        ds, shuffle=True, num_workers=2, pin_memory=False, drop_last=True, prefetch_factor=1,
        persistent_workers=True, timeout=T, topology=_own(), **kw,
    )  # fmt: skip
    as_groups = BalancedDataLoader(
        ds, sampling=SamplingOptions(shuffle=True, drop_last=True),
        options=LoaderOptions(num_workers=2, persistent_workers=True, prefetch_factor=1),
        topology=_own(), **kw,
    )  # fmt: skip
    unshuffled = BalancedDataLoader(ds, shuffle=False, num_workers=2, topology=_own(), **kw)
    res = {
        "keywords": _two_epochs(as_dataloader),
        "groups": _two_epochs(as_groups),
        "unshuffled": _two_epochs(unshuffled),
        "settings": (as_dataloader.sampling, as_dataloader.options, len(as_dataloader)),
    }

    def drawn(seed):
        loader = BalancedDataLoader(
            _Drawn(), batch_size=KW_BATCH, lengths=np.ones(KW_N, np.int64), collate_fn=_as_is,
            num_workers=2, worker_init_fn=_tag_worker,
            generator=torch.Generator().manual_seed(seed), topology=_own(),
        )  # fmt: skip
        return sorted(ex for batch in loader for ex in batch)

    res["drawn"] = [drawn(seed) for seed in (7, 7, 8)]
    return res


@pytest.mark.integration
def test_dataloader_keywords_give_the_loader_of_the_option_groups():
    out = run_distributed(_keywords_worker, WORLD, timeout=60)
    for r in out:
        assert r["keywords"] == r["groups"]  # the same batches, step by step, both epochs
        sampling, options, steps = r["settings"]
        assert (sampling.shuffle, sampling.drop_last, options.num_workers) == (True, True, 2)
        assert (options.persistent_workers, options.prefetch_factor, options.timeout) == (
            True, 1, T,
        )  # fmt: skip
        assert steps == len(r["keywords"][0]) == -(-(KW_N // WORLD) // KW_BATCH)
    for epoch in (0, 1):
        # As DataLoader(sampler=DistributedSampler(shuffle=True, drop_last=True)): the
        # sampler's examples of the epoch, each seen exactly once over the ranks.
        seen = [i for r in out for batch in r["keywords"][epoch] for i in batch]
        expected = []
        for rank in range(WORLD):
            sampler = DistributedSampler(range(KW_N), WORLD, rank, shuffle=True, drop_last=True)
            sampler.set_epoch(epoch)
            expected += list(sampler)
        assert len(seen) == len(set(seen)) == KW_N - 1
        assert sorted(seen) == sorted(expected)
        unshuffled = sorted(i for r in out for batch in r["unshuffled"][epoch] for i in batch)
        assert unshuffled == sorted([*range(KW_N), 0])  # drop_last=False pads with example 0
    first = [[i for batch in r["keywords"][0] for i in batch] for r in out]
    second = [[i for batch in r["keywords"][1] for i in batch] for r in out]
    assert first != second  # shuffle=True reshuffles per epoch
    assert [[i for b in r["unshuffled"][0] for i in b] for r in out] == [
        [i for b in r["unshuffled"][1] for i in b] for r in out
    ]
    loaded = sorted(i for r in out for i, _, _ in r["drawn"][0])
    assert len(loaded) == KW_N + 1 and set(loaded) == set(range(KW_N))  # padded by one
    for r in out:
        same, again, other = r["drawn"]
        assert same == again  # the generator decides the workers' draws
        assert [d for _, d, _ in same] != [d for _, d, _ in other]
        assert {tag for _, _, tag in same} == {100, 101}  # loaded in both workers, initialised


def test_a_setting_given_both_ways_must_agree_and_a_dataloader_keeps_its_own():
    ds = _dataset(12)
    kw = dict(batch_size=3, length_column="n_tokens", collate_fn=_ids)
    with pytest.raises(
        ValueError,
        match=r"num_workers=1 and options=LoaderOptions\(num_workers=2\) disagree: give "
        r"num_workers one way",
    ):
        BalancedDataLoader(ds, num_workers=1, options=LoaderOptions(num_workers=2), **kw)
    with pytest.raises(
        ValueError, match=r"drop_last=False and sampling=SamplingOptions\(drop_last=True\)"
    ):
        BalancedDataLoader(ds, drop_last=False, sampling=SamplingOptions(drop_last=True), **kw)
    # Both ways alike, or a group field left at its default: the keyword sets it.
    both = BalancedDataLoader(
        ds, shuffle=False, num_workers=0, sampling=SamplingOptions(shuffle=False, seed=4), **kw
    )
    assert (both.sampling.shuffle, both.sampling.seed, both.options.num_workers) == (False, 4, 0)
    assert sorted(i for batch in both for i in batch) == list(range(12))
    assert not BalancedDataLoader(
        ds, shuffle=False, sampling=SamplingOptions(seed=4), **kw
    ).sampling.shuffle
    with pytest.raises(ValueError, match="prefetch_factor=4 needs num_workers > 0"):
        BalancedDataLoader(ds, prefetch_factor=4, **kw)
    with pytest.raises(ValueError, match="timeout must be >= 0, got -1"):
        BalancedDataLoader(ds, timeout=-1, **kw)
    dl = DataLoader(ds, batch_size=3, collate_fn=_ids)
    with pytest.raises(ValueError, match=r"set them on it .*got \{'generator': "):
        BalancedDataLoader(dl, length_column="n_tokens", generator=torch.Generator())
    with pytest.raises(ValueError, match=r"set them on it \(DistributedSampler.*'shuffle': False"):
        BalancedDataLoader(dl, length_column="n_tokens", shuffle=False)
    # The orchestrated loader forwards DataLoader's keywords, and only those.
    orchestrator = Orchestrator(StepOptions(PHASES))
    planned = orchestrated_loader(ds, orchestrator, batch_size=2, shuffle=False, drop_last=True)
    assert (planned.sampling.shuffle, planned.sampling.drop_last) == (False, True)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['length_fn'\]"):
        orchestrated_loader(ds, orchestrator, batch_size=2, length_fn=len)
