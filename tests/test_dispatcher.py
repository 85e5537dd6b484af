"""BatchDispatcher on real gloo groups: conservation, exact undo, unchanged gradients, checks.

All checks run in one 4-process session (process start-up dominates the cost); each test
reports one check.
"""

import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import orchmllm
from orchmllm.data.loader import BalancedDataLoader
from orchmllm.dist import comm, dispatcher
from orchmllm.dist.agreement import PeerFailed
from orchmllm.dist.dispatcher import BatchDispatcher, PlanMismatchError, debug_enabled
from orchmllm.dist.topology import Topology
from orchmllm.planner.plan import Rearrangement
from orchmllm.testing import assert_check_passed, run_checks, run_distributed

TIMEOUT = 20.0


def _topo(**kwargs) -> Topology:
    """A topology of one dispatcher's own (as it builds without one), with the timeout."""
    return Topology.build(timeout=TIMEOUT, **kwargs)


def _cases(world: int) -> list[list[list[int]]]:
    """Per-rank length lists, identical on every rank."""
    rng = np.random.default_rng(world)
    random = [rng.integers(1, 40, size=rng.integers(1, 7)).tolist() for _ in range(world)]
    skewed = [[int(x) for x in rng.integers(1, 60, size=6)]] + [[] for _ in range(world - 1)]
    one = [[] for _ in range(world)]
    one[-1] = [9]
    few = [[5] if r % 2 == 0 else [] for r in range(world)]  # more ranks than items
    zero_len = [[0, 3], [7, 0, 2]] + [[1] for _ in range(world - 2)]
    nothing = [[] for _ in range(world)]
    return [random, skewed, one, few, zero_len, nothing]


def _global_ids(per_rank: list[list[int]], rank: int) -> np.ndarray:
    start = sum(len(x) for x in per_rank[:rank])
    return np.arange(start, start + len(per_rank[rank]), dtype=np.int64)


def _token_keys(ids: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
    """Token-major key ``global id * 1000 + position`` for items ``ids``."""
    if ids.size == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(np.concatenate([i * 1000 + np.arange(lengths[i]) for i in ids]))


def _w_packed(rank: int, world: int):
    disp = BatchDispatcher("greedy", topology=_topo(ranks_per_node=2), check_plan=True)
    for per_rank in _cases(world):
        glob = np.array([x for r in per_rank for x in r], dtype=np.int64)
        src = np.repeat(np.arange(world), [len(x) for x in per_rank])
        ids = _global_ids(per_rank, rank)
        key = _token_keys(ids, glob)
        tokens = {
            "key": key,
            "emb": key.double()[:, None, None].mul(0.5).repeat(1, 2, 3).float(),
            "mask": key % 2 == 0,
        }
        items = {"id": torch.from_numpy(ids), "i16": torch.from_numpy(ids[:, None] * [1, -1])}
        items["i16"] = items["i16"].to(torch.int16)
        d = disp.dispatch(tokens, torch.tensor(per_rank[rank], dtype=torch.int32), items)

        # The plan is the policy's plan; every item arrives exactly once, at its rank, intact.
        expect_dst = orchmllm.balance(glob, world, "greedy", src=src).dst
        assert np.array_equal(d.plan.dst_rank, expect_dst)
        mine = d.plan.items_at(rank)
        assert np.array_equal(d.plan.dst_rank[mine], np.full(mine.size, rank))
        assert d.items["id"].tolist() == mine.tolist()
        assert d.items["i16"].tolist() == [[i, -i] for i in mine.tolist()]
        assert d.lengths.tolist() == glob[mine].tolist()
        assert torch.equal(d.tokens["key"], _token_keys(mine, glob))
        assert torch.equal(
            d.tokens["emb"],
            d.tokens["key"].double()[:, None, None].mul(0.5).repeat(1, 2, 3).float(),
        )
        assert torch.equal(d.tokens["mask"], d.tokens["key"] % 2 == 0)
        everywhere, _ = comm.all_gather_rows(d.items["id"].numpy()[:, None], timeout=TIMEOUT)
        assert sorted(everywhere[:, 0].tolist()) == list(range(glob.size))

        # undo(dispatch(x)) == x exactly, token- and item-major.
        assert torch.equal(disp.undo(d, d.tokens["emb"]), tokens["emb"])
        assert torch.equal(disp.undo(d, d.tokens["key"] * 3), key * 3)
        assert torch.equal(disp.undo(d, d.items["i16"], items=True), items["i16"])

        # Statistics agree with an independent count.
        per_item = glob * (8 + 24 + 1) + (8 + 4)
        moved = d.plan.src_rank != d.plan.dst_rank
        inter = moved & (d.plan.src_rank // 2 != d.plan.dst_rank // 2)
        assert d.stats["bytes_inter"] == per_item[inter].sum()
        assert d.stats["bytes_intra"] == per_item[moved & ~inter].sum()
        assert d.stats["bytes_sent"] == per_item[moved & (d.plan.src_rank == rank)].sum()
        assert d.stats["tokens_moved"] + d.stats["tokens_kept"] == glob.sum()
        assert d.stats["imbalance_after"] <= d.stats["imbalance_before"] + 1e-9
        assert sum(d.stats["loads_after"]) == pytest.approx(glob.sum())


def _w_padded(rank: int, world: int):
    disp = BatchDispatcher(layout="padded", topology=_topo(), check_plan=True)
    assert disp.policy == "padded_cost"
    for per_rank in _cases(world):
        glob = np.array([x for r in per_rank for x in r], dtype=np.int64)
        ids = _global_ids(per_rank, rank)
        lengths = torch.tensor(per_rank[rank], dtype=torch.int64)
        pad_to = (max(per_rank[rank]) if per_rank[rank] else 0) + rank  # T may exceed max
        x = torch.zeros(len(ids), pad_to, 2)
        for b, i in enumerate(ids):
            x[b, : glob[i], 0] = torch.arange(glob[i]) + 1000.0 * i
            x[b, : glob[i], 1] = -float(i)
        d = disp.dispatch({"x": x}, lengths, {"id": torch.from_numpy(ids)})

        mine = d.plan.items_at(rank)
        new_max = int(glob[mine].max()) if mine.size else 0
        assert d.tokens["x"].shape == (mine.size, new_max, 2)  # re-padded to the new local max
        assert d.items["id"].tolist() == mine.tolist()
        for b, i in enumerate(mine):
            row = d.tokens["x"][b]
            assert torch.equal(row[: glob[i], 0], torch.arange(glob[i]) + 1000.0 * i)
            assert torch.all(row[: glob[i], 1] == -float(i))
            assert torch.all(row[glob[i] :] == 0)
        assert torch.equal(disp.undo(d, d.tokens["x"]), x)
        assert d.stats["imbalance_after"] <= d.stats["imbalance_before"] + 1e-9
        assert d.stats["padded_tokens_after"] <= d.stats["padded_tokens_before"] or glob.size == 0


class _Broadcasts:
    """Counts ``torch.distributed.broadcast`` calls in a block (a pass-through spy: every
    call still runs)."""

    def __enter__(self) -> "_Broadcasts":
        self.calls, self._real = 0, dist.broadcast

        def spy(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        dist.broadcast = spy
        return self

    def __exit__(self, *exc) -> None:
        dist.broadcast = self._real


def _same_everywhere(value: int) -> bool:
    everyone = comm.all_gather_fixed(np.array([value]), timeout=TIMEOUT)[:, 0]
    return bool(np.all(everyone == everyone[0]))


def _check_moved(d, rank: int, glob: np.ndarray) -> None:
    """Every item arrives exactly once, at its planned rank, with its tokens intact."""
    mine = d.plan.items_at(rank)
    assert d.items["id"].tolist() == mine.tolist()
    assert d.lengths.tolist() == glob[mine].tolist()
    assert torch.equal(d.tokens["key"], _token_keys(mine, glob))
    everywhere, _ = comm.all_gather_rows(d.items["id"].numpy()[:, None], timeout=TIMEOUT)
    assert sorted(everywhere[:, 0].tolist()) == list(range(glob.size))


def _dispatch_keys(disp: BatchDispatcher, per_rank: list[list[int]], rank: int, **kwargs):
    glob = np.array([x for r in per_rank for x in r], dtype=np.int64)
    ids = _global_ids(per_rank, rank)
    tokens = {"key": _token_keys(ids, glob)}
    lengths = torch.tensor(per_rank[rank], dtype=torch.int64)
    return disp.dispatch(tokens, lengths, {"id": torch.from_numpy(ids)}, **kwargs), glob


def _w_ilp_agrees(rank: int, world: int):
    """``placement="ilp"`` stops CBC at a load-dependent point, so ranks solving it on their
    own could reach different placements: rank 0 solves, every rank uses its plan."""
    rng = np.random.default_rng(11)  # the same lengths on every rank
    disp = BatchDispatcher("greedy", placement="ilp", topology=_topo(ranks_per_node=1))
    assert not disp.deterministic
    for _ in range(3):
        per_rank = [rng.integers(1, 900, size=rng.integers(40, 160)).tolist() for _ in range(world)]
        with _Broadcasts() as b:
            d, glob = _dispatch_keys(disp, per_rank, rank)
        assert b.calls == 2  # the plan's size, then the plan
        assert _same_everywhere(d.plan.fingerprint())
        # Solved once: rank 0's solve time reached every rank with its plan.
        solve_ms = np.float64(d.stats["placement_solve_ms"]).view(np.int64)
        assert _same_everywhere(int(solve_ms))
        _check_moved(d, rank, glob)
        assert d.stats["imbalance_after"] < d.stats["imbalance_before"]


def _w_deterministic_no_broadcast(rank: int, world: int):
    per_rank = _cases(world)[0]
    for policy, placement in (("greedy", "none"), ("greedy_stay", "assign"), ("kk", "auto")):
        disp = BatchDispatcher(policy, placement=placement, topology=_topo(ranks_per_node=2))
        assert disp.deterministic
        with _Broadcasts() as b:
            d, glob = _dispatch_keys(disp, per_rank, rank)
        assert b.calls == 0
        assert _same_everywhere(d.plan.fingerprint())
        _check_moved(d, rank, glob)


def _w_caps(rank: int, world: int):
    """A memory budget per rank is met by every plan that can meet it; one that no plan
    meets raises on every rank at once (the plan is computed everywhere from the same
    lengths), naming the smallest budget that works, and the group goes on working."""
    per_rank = [[30, 25, 20, 15, 10, 5]] + [[1] for _ in range(world - 1)]  # 108 tokens
    for policy, budget in (("greedy", 30), ("greedy_stay", 30), ("kk", 31)):
        disp = BatchDispatcher(
            policy, max_load_per_rank=budget, max_items_per_rank=3,
            topology=_topo(ranks_per_node=2),
        )  # fmt: skip
        d, glob = _dispatch_keys(disp, per_rank, rank)
        assert int(d.lengths.sum()) <= budget and d.lengths.numel() <= 3
        _check_moved(d, rank, glob)
    disp = BatchDispatcher("greedy", max_load_per_rank=29, topology=_topo())
    with pytest.raises(orchmllm.InfeasibleCapError, match="smallest value that works is 30"):
        _dispatch_keys(disp, per_rank, rank)
    d, glob = _dispatch_keys(BatchDispatcher(topology=_topo()), per_rank, rank)
    _check_moved(d, rank, glob)


def _n(example: dict) -> int:
    return example["n"]


def _keys(ids: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
    """Token keys ``id * 1000 + position`` of items with these ids and lengths, packed."""
    parts = [i * 1000 + np.arange(n) for i, n in zip(ids, lengths, strict=True)]
    return torch.from_numpy(np.concatenate([np.zeros(0, dtype=np.int64), *parts]))


def _collate_keys(examples: list[dict]) -> dict[str, torch.Tensor]:
    """A local batch: packed token keys, lengths and ids."""
    ids = np.array([e["id"] for e in examples], dtype=np.int64)
    lengths = np.array([e["n"] for e in examples], dtype=np.int64)
    return {
        "key": _keys(ids, lengths),
        "lengths": torch.from_numpy(lengths),
        "id": torch.from_numpy(ids),
    }


def _w_precomputed_plan(rank: int, world: int):
    """Single-phase prefetching: the loader plans in its thread (``mode="local"``), the
    dispatcher executes that plan (the same as its own) with the on-device all-to-all."""
    rng = np.random.default_rng(5)
    data = [{"id": i, "n": int(n)} for i, n in enumerate(rng.integers(1, 200, size=12 * world))]
    loader = BalancedDataLoader(
        data, batch_size=3, mode="local", length_fn=_n, collate_fn=_collate_keys, topology=_topo()
    )
    disp = BatchDispatcher("greedy", topology=_topo())
    steps = 0
    for planned in loader:
        b = planned.batch
        args = ({"key": b["key"]}, b["lengths"], {"id": b["id"]})
        d = disp.dispatch(*args, plan=planned.plan)
        own = disp.dispatch(*args)
        assert d.plan == own.plan and d.plan is planned.plan
        ids, _ = comm.all_gather_rows(b["id"].numpy()[:, None], timeout=TIMEOUT)
        mine = ids[d.plan.items_at(rank), 0]
        assert d.items["id"].tolist() == mine.tolist()
        assert torch.equal(d.tokens["key"], _keys(mine, d.lengths.numpy()))
        assert torch.equal(d.tokens["key"], own.tokens["key"])
        everywhere, _ = comm.all_gather_rows(d.items["id"].numpy()[:, None], timeout=TIMEOUT)
        assert sorted(everywhere[:, 0].tolist()) == sorted(ids[:, 0].tolist())
        assert d.stats["imbalance_after"] == own.stats["imbalance_after"]
        steps += 1
    assert steps == 4
    # A plan for other items fails on every rank (the check follows the gather).
    one = {"key": b["key"][: int(b["lengths"][0])]}, b["lengths"][:1], {"id": b["id"][:1]}
    with pytest.raises(ValueError, match=r"plan does not match the gathered lengths: it takes"):
        disp.dispatch(*one, plan=planned.plan)
    src, slot = own.plan.src_rank, own.plan.src_slot
    backwards = np.bincount(src, minlength=world)[src] - 1 - slot
    shuffled = Rearrangement(world, src, backwards, src, backwards)
    with pytest.raises(ValueError, match="not numbered in gather order"):
        disp.dispatch(*args, plan=shuffled)
    with pytest.raises(ValueError, match="plan must be a Rearrangement or None, got PlannedBatch"):
        disp.dispatch(*args, plan=planned)


def _losses(x: torch.Tensor, w: torch.Tensor, lin: torch.nn.Linear, total: int) -> torch.Tensor:
    """A per-token loss normalised by the global token count (not the local one)."""
    return ((lin(x) ** 2).sum(-1) * w + x.sin().sum(-1)).sum() / total


def _grads(lin: torch.nn.Linear) -> list[torch.Tensor]:
    out = []
    for p in lin.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # what DDP/FSDP do
        out.append(g)
    return out


def _w_grad(rank: int, world: int):
    per_rank = [[30, 2, 5, 40], [], [3, 3], [1]]
    glob = np.array([x for r in per_rank for x in r])
    n_local = sum(per_rank[rank])
    gen = torch.Generator().manual_seed(rank)
    x0 = torch.randn(n_local, 4, generator=gen, dtype=torch.float64)
    w = torch.rand(n_local, generator=gen, dtype=torch.float64)
    lengths = torch.tensor(per_rank[rank], dtype=torch.int64)
    results = {}
    for mode in ("plain", "packed", "padded"):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3).double()
        x = x0.clone().requires_grad_(True)
        if mode == "plain":
            loss = _losses(x, w, lin, int(glob.sum()))
        elif mode == "packed":
            disp = BatchDispatcher(topology=_topo())
            d = disp.dispatch({"x": x, "w": w}, lengths)
            loss = _losses(d.tokens["x"], d.tokens["w"], lin, int(d.global_lengths.sum()))
        else:  # padded: [B, T, 4]; padding positions carry weight 0
            disp = BatchDispatcher(layout="padded", topology=_topo())
            top = int(lengths.max()) if lengths.numel() else 0
            mask = torch.arange(top)[None, :] < lengths[:, None]
            xp = x.new_zeros(len(lengths), top, 4)
            xp[mask] = x
            wp = w.new_zeros(len(lengths), top)
            wp[mask] = w
            d = disp.dispatch({"x": xp, "w": wp}, lengths)
            m = torch.arange(d.tokens["x"].shape[1])[None, :] < d.lengths[:, None]
            loss = _losses(d.tokens["x"][m], d.tokens["w"][m], lin, int(d.global_lengths.sum()))
        loss.backward()
        results[mode] = (x.grad.clone(), _grads(lin))
    for mode in ("packed", "padded"):
        assert torch.allclose(results[mode][0], results["plain"][0], rtol=1e-12, atol=1e-14)
        for a, b in zip(results[mode][1], results["plain"][1], strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def _w_mismatch(rank: int, world: int):
    os.environ["ORCHMLLM_DEBUG"] = "1"
    try:
        _mismatch(rank)
    finally:
        del os.environ["ORCHMLLM_DEBUG"]


def _mismatch(rank: int):
    assert debug_enabled() and BatchDispatcher(topology=_topo()).check_plan  # debug: on
    lengths = torch.tensor([10, 10, 10] if rank == 0 else [1])
    x = torch.zeros(int(lengths.sum()), 2)
    # Same policy everywhere, but rank 1's balancing drifts (a bug, a nondeterministic
    # solver): only the full plan comparison of debug mode can see it.
    disp = BatchDispatcher("greedy", topology=_topo())

    def drifted(lengths, num_ranks, policy, **kw):
        return orchmllm.balance(lengths, num_ranks, "identity", **kw)

    with pytest.MonkeyPatch.context() as mp:
        if rank == 1:
            mp.setattr(dispatcher, "balance", drifted)
        with pytest.raises(
            PlanMismatchError, match=r"plans computed from the same 6 gathered lengths.*ranks \[1\]"
        ):
            disp.dispatch({"x": x}, lengths)
    # The same dispatcher works once inputs agree.
    d = disp.dispatch({"x": x}, lengths)
    assert d.stats["num_items"] == 6
    # Bad input raises ValueError naming the argument (no collective is entered).
    with pytest.raises(ValueError, match="lengths"):
        disp.dispatch({"x": x}, lengths.float())
    with pytest.raises(ValueError, match="tokens\\['x'\\]"):
        disp.dispatch({"x": x[:-1]}, lengths)
    with pytest.raises(ValueError, match="items\\['y'\\]"):
        disp.dispatch({"x": x}, lengths, {"y": torch.zeros(7)})
    with pytest.raises(ValueError, match="policy"):
        BatchDispatcher("nope")
    with pytest.raises(ValueError, match="layout"):
        BatchDispatcher(layout="ragged")


def _w_disagreement(rank: int, world: int):
    """Not in debug mode: what ranks pass is compared in the lengths gather itself, so a
    difference on one rank raises PlanMismatchError on every rank (naming the field and the
    rank) instead of a gloo abort or, for requires_grad, a hang in the backward."""
    assert not debug_enabled()
    lengths = torch.tensor([3, 1] if rank % 2 else [2])
    n = int(lengths.sum())
    x, ids = torch.ones(n, 4), torch.arange(n)
    odd = rank == 1
    cases = {  # field -> (policy, tokens) with rank 1 the odd one out
        "dtypes": ("greedy", {"x": x.double() if odd else x, "ids": ids}),
        "trailing shapes": ("greedy", {"x": torch.ones(n, 5) if odd else x, "ids": ids}),
        "policy": ("kk" if odd else "greedy", {"x": x, "ids": ids}),
        "tensor names": ("greedy", {"x": x, "ids": ids, **({"extra": x} if odd else {})}),
        "requires_grad": ("greedy", {"x": x.clone().requires_grad_(odd), "ids": ids}),
    }
    for field, (policy, tokens) in cases.items():
        disp = BatchDispatcher(policy, topology=_topo())
        with pytest.raises(PlanMismatchError, match=rf"'{field}' differs: ranks \[1\] pass"):
            disp.dispatch(tokens, lengths)
    # The README's call takes a dict of tensors; a bare tensor is named before any collective.
    with pytest.raises(ValueError, match="tokens must be a dict of name -> tensor .* got Tensor"):
        BatchDispatcher("greedy", topology=_topo()).dispatch(x, lengths)
    # Nothing was left half-done: the group still works once the inputs agree.
    d = BatchDispatcher(topology=_topo()).dispatch({"x": x, "ids": ids}, lengths)
    assert d.stats["num_items"] == sum(2 if r % 2 else 1 for r in range(world))


CHECKS = {
    "packed_conservation_and_undo": _w_packed,
    "padded_conservation_and_undo": _w_padded,
    "gradient_unchanged": _w_grad,
    "plan_mismatch_detected": _w_mismatch,
    "inputs_disagree_fail_on_every_rank": _w_disagreement,
    "ilp_plan_computed_once_and_shared": _w_ilp_agrees,
    "deterministic_plans_local_no_broadcast": _w_deterministic_no_broadcast,
    "precomputed_plan_from_loader": _w_precomputed_plan,
    "caps_met_or_refused_everywhere": _w_caps,
}


@pytest.fixture(scope="module")
def session() -> list[dict[str, str | None]]:
    return run_checks(CHECKS, 4, timeout=60)


@pytest.mark.integration
@pytest.mark.parametrize("name", list(CHECKS))
def test_check(session, name):
    assert_check_passed(session, name)


def test_debug_mode_flag(monkeypatch):
    monkeypatch.delenv("ORCHMLLM_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    assert not debug_enabled()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert debug_enabled()


@pytest.mark.parametrize(
    "caps, match",
    [
        ({"max_items_per_rank": 0}, "max_items_per_rank must be an integer >= 1, got 0"),
        ({"max_items_per_rank": 2.5}, "max_items_per_rank must be an integer >= 1, got 2.5"),
        ({"max_load_per_rank": -1}, "max_load_per_rank must be a number > 0, got -1"),
        ({"max_load_per_rank": True}, "max_load_per_rank must be a number > 0, got True"),
    ],
)
def test_a_bad_cap_is_refused_when_the_dispatcher_is_built(caps, match):
    """Before any process group or collective: not at the first dispatch, on every rank."""
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=match):
        BatchDispatcher(**caps)


def test_placement_without_ranks_per_node_is_refused_before_any_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"placement='ilp' needs ranks_per_node: pass topology="):
        BatchDispatcher(placement="ilp")


def _absent_rank_worker(rank: int, world: int) -> str | None:
    """Rank 1 does not come to the second dispatch (busy elsewhere past the timeout, as a
    stopped or hung rank); rank 0's error, or None on rank 1."""
    d = BatchDispatcher(topology=Topology.build(timeout=2.0))
    tokens = {"x": torch.arange(6.0)[:, None]}
    d.dispatch(tokens, torch.tensor([2, 4]))
    if rank == 1:
        time.sleep(2.0 + comm.ROLL_CALL_S + 2.0)
        return None
    try:
        d.dispatch(tokens, torch.tensor([2, 4]))
    except PeerFailed as exc:
        return str(exc)
    return "no error"


@pytest.mark.integration
def test_a_dispatch_that_times_out_names_the_rank_that_did_not_arrive():
    """In a user's own loop (no trainer, nothing of the trainer's progress reporting), a
    dispatch that waits past the timeout for a rank fails naming that rank, not with the
    backend's bare "timed out"."""
    message = run_distributed(_absent_rank_worker, 2, timeout=60)[0]
    assert message.startswith("rank 0: BatchDispatcher.dispatch (call 2) failed ("), message
    assert "rank(s) [1] did not answer a roll call within 2 s: failed, stopped or dead" in message
