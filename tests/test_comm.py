"""comm: metadata all-gather and the plan-driven all-to-all on real gloo process groups.

All checks run in one 4-process session (process start-up dominates the cost); each test
reports one check.
"""

import threading

import numpy as np
import pytest
import torch

from orchmllm.dist import comm
from orchmllm.dist.topology import Topology
from orchmllm.planner.plan import Rearrangement
from orchmllm.testing import assert_check_passed, run_checks

TIMEOUT = 20.0


def _random_plan(seed: int, d: int, per_rank: list[int], max_len: int = 6):
    """Same random plan and sizes on every rank (seeded), src in gather order."""
    rng = np.random.default_rng(seed)
    src = np.repeat(np.arange(d), per_rank)
    dst = rng.integers(0, d, size=src.size)
    sizes = rng.integers(0, max_len + 1, size=src.size)
    return Rearrangement.from_assignment(src, dst, num_ranks=d), sizes


def _payloads(ids: np.ndarray, sizes: np.ndarray) -> dict[str, torch.Tensor]:
    """Rows identifying (item id, row) in several dtypes and trailing shapes."""
    item = np.repeat(ids, sizes[ids]).astype(np.int64)
    row = np.concatenate([np.arange(sizes[i]) for i in ids]) if ids.size else np.zeros(0, int)
    key = torch.from_numpy(item * 100 + row)
    return {
        "ids": key.clone(),
        "f32": (key.double()[:, None, None] + torch.arange(6.0).reshape(1, 2, 3)).float(),
        "bool": (key % 3 == 0),
        "i16": (key % 30000).to(torch.int16)[:, None].repeat(1, 2),  # gloo has no int16: bytes
        "bf16": (key % 200).to(torch.bfloat16),
        "u8": (key % 250).to(torch.uint8)[:, None],
    }


def _w_gather_rows(rank: int, world: int):
    local = np.arange(rank * 3).reshape(rank, 3) + 1000 * rank  # rank 0 holds zero rows
    rows, src = comm.all_gather_rows(local, timeout=TIMEOUT)
    expect = np.concatenate([np.arange(r * 3).reshape(r, 3) + 1000 * r for r in range(world)])
    assert np.array_equal(rows, expect) and rows.dtype == np.int64
    assert np.array_equal(src, np.repeat(np.arange(world), np.arange(world)))
    empty_rows, empty_src = comm.all_gather_rows(np.zeros((0, 2), np.int64), timeout=TIMEOUT)
    assert empty_rows.shape == (0, 2) and empty_src.size == 0
    with pytest.raises(ValueError, match="same number of columns"):
        comm.all_gather_rows(np.zeros((1, 1 + rank), np.int64), timeout=TIMEOUT)
    # Values the ranks must share ride in the same gather; a difference fails on every rank.
    agree = {"width": 3, "dtype": "float16" if rank == 2 else "float32"}
    match = rf"'dtype' differs: ranks \[2\] pass another value than ranks \[0, 1, 3\] \(rank {rank}"
    with pytest.raises(comm.MismatchError, match=match):
        comm.all_gather_rows(local, timeout=TIMEOUT, agree=agree)
    rows, _ = comm.all_gather_rows(local, timeout=TIMEOUT, agree={"dtype": "float32"})
    assert np.array_equal(rows, expect)


CASES = [  # (seed, per-rank item counts) for world size 4
    (0, [3, 5, 0, 2]),  # a rank with zero items
    (1, [0, 0, 1, 0]),  # one item in total
    (2, [1, 0, 1, 0]),  # more ranks than items
    (3, [7, 1, 4, 9]),
    (4, [0, 0, 0, 0]),  # nothing at all
]


def _w_move(rank: int, world: int):
    for seed, per_rank in CASES:
        plan, sizes = _random_plan(seed, world, per_rank)
        src_data = _payloads(plan.source_items_at(rank), sizes)
        names = list(src_data)
        moved = comm.move_many(
            plan, [src_data[k] for k in names], [sizes] * len(names), timeout=TIMEOUT
        )
        expect = _payloads(plan.items_at(rank), sizes)
        for k, out in zip(names, moved, strict=True):
            assert out.dtype == expect[k].dtype and torch.equal(out, expect[k]), (seed, k)
            assert out._base is None  # owns its storage: safe to modify in place
        # Single-tensor path and the inverse plan (non-trivial receive reordering).
        back = comm.move(plan.inverse(), moved[names.index("f32")], sizes=sizes, timeout=TIMEOUT)
        assert torch.equal(back, src_data["f32"])
        # The strawman gives the same result.
        straw = comm.all_gather_move(plan, src_data["f32"], sizes=sizes, timeout=TIMEOUT)
        assert torch.equal(straw, expect["f32"])
        straw16 = comm.all_gather_move(plan, src_data["i16"], sizes=sizes, timeout=TIMEOUT)
        assert torch.equal(straw16, expect["i16"])


def _weights(ids: np.ndarray, sizes: np.ndarray) -> torch.Tensor:
    item = np.repeat(ids, sizes[ids])
    row = np.concatenate([np.arange(sizes[i]) for i in ids]) if ids.size else np.zeros(0, int)
    return torch.from_numpy(np.sin(item * 1.3 + row * 0.7))[:, None].repeat(1, 2).float()


def _w_grad(rank: int, world: int):
    plan, sizes = _random_plan(7, world, [4, 0, 6, 1])
    x = _weights(plan.source_items_at(rank), sizes).mul(3).requires_grad_(True)
    out = comm.move(plan, x, sizes=sizes, timeout=TIMEOUT)
    out.mul_(2.0)  # in-place on the output is allowed
    loss = (out * _weights(plan.items_at(rank), sizes)).sum()
    loss.backward()
    # d loss / d x = 2 * weight of the row, wherever that row was computed.
    assert torch.allclose(x.grad, 2 * _weights(plan.source_items_at(rank), sizes))
    # Integer tensors move alongside without breaking autograd.
    ids = torch.arange(x.shape[0])
    xi = x.detach().clone().requires_grad_(True)
    out_f, out_i = comm.move_many(plan, [xi, ids], [sizes, sizes], timeout=TIMEOUT)
    assert not out_i.requires_grad and out_f.requires_grad
    out_f.pow(2).sum().backward()
    assert torch.allclose(xi.grad, 2 * xi.detach())


def _w_background_meta(rank: int, world: int):
    """Metadata on a separate gloo group in a thread while the default group moves data."""
    topology = Topology.build(timeout=TIMEOUT)  # held: dropping it destroys the group
    meta = topology.meta_group
    result = {}

    def gather():
        for i in range(5):
            result[i] = comm.all_gather_rows(np.full((rank + 1, 2), i), group=meta, timeout=TIMEOUT)

    thread = threading.Thread(target=gather)
    thread.start()
    plan, sizes = _random_plan(11, world, [2, 5, 0, 1])
    for _ in range(5):
        data = _payloads(plan.source_items_at(rank), sizes)["f32"]
        out = comm.move(plan, data, sizes=sizes, timeout=TIMEOUT)
        assert torch.equal(out, _payloads(plan.items_at(rank), sizes)["f32"])
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    for i in range(5):
        rows, src = result[i]
        assert rows.shape == (10, 2) and np.all(rows == i)
        assert src.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]


def _w_bad_input(rank: int, world: int):
    plan, sizes = _random_plan(0, world, [2, 3, 0, 4])
    data = _payloads(plan.source_items_at(rank), sizes)["f32"]
    wrong = Rearrangement.from_assignment([0, 1, 2], [0, 1, 2], num_ranks=3)
    with pytest.raises(ValueError, match="num_ranks = 3"):
        comm.move(wrong, data[:1], sizes=[1, 1, 1])
    with pytest.raises(ValueError, match="rows"):
        comm.move(plan, torch.cat([data, data[:1], torch.zeros(1, 2, 3)]), sizes=sizes)
    with pytest.raises(ValueError, match="sizes"):
        comm.move(plan, data, sizes=sizes[:-1])


def _w_timeout(rank: int, world: int):
    """A rank that skips a collective makes the others fail within the timeout, not hang."""
    plan, sizes = _random_plan(0, world, [2, 3, 0, 4])
    data = _payloads(plan.source_items_at(rank), sizes)["f32"]
    if rank != 0:
        with pytest.raises(RuntimeError):
            comm.move(plan, data, sizes=sizes, timeout=2.0)


def _w_empty_stride0(rank: int, world: int):
    """A rank with no items whose empty int16 tensor is an expanded view (stride 0): gloo has
    no int16, so it travels as bytes, which needs a byte view of the empty buffer."""
    plan, sizes = _random_plan(5, world, [3, 0, 2, 4])
    mine = plan.source_items_at(rank)
    rows = int(sizes[mine].sum())
    if rows:
        ids = torch.from_numpy(np.repeat(mine, sizes[mine])).to(torch.int16)
    else:
        ids = torch.zeros(1, dtype=torch.int16).expand(0)
        assert ids.stride() == (0,)
    out = comm.move(plan, ids, sizes=sizes, timeout=TIMEOUT)
    got = plan.items_at(rank)
    assert torch.equal(out, torch.from_numpy(np.repeat(got, sizes[got])).to(torch.int16))
    (out2,) = comm.move_many(plan, [ids], [sizes], timeout=TIMEOUT)
    assert torch.equal(out2, out)
    straw = comm.all_gather_move(plan, ids, sizes=sizes, timeout=TIMEOUT)
    assert torch.equal(straw, out)


CHECKS = {  # run in this order; the timeout check leaves the group unusable, so it is last
    "gather_rows": _w_gather_rows,
    "move": _w_move,
    "grad": _w_grad,
    "background_meta": _w_background_meta,
    "bad_input": _w_bad_input,
    "empty_stride0": _w_empty_stride0,
    "timeout": _w_timeout,
}


@pytest.fixture(scope="module")
def session() -> list[dict[str, str | None]]:
    return run_checks(CHECKS, 4, timeout=60)


@pytest.mark.integration
@pytest.mark.parametrize("name", list(CHECKS))
def test_check(session, name):
    assert_check_passed(session, name)
