"""All-to-all batch communicator versus the all-gather strawman (paper section 5.2.1).

Every rank samples a mini-batch of variable-length sequences (log-normal lengths, a long
tail as in multimodal data), the ranks gather the lengths and plan a balanced layout
(``greedy``), and the batch (``[tokens, hidden]`` float32) is moved to that layout twice
with the same plan: by ``comm.move`` (one all-to-all, each rank sends only the items that
leave it) and by ``comm.all_gather_move`` (the strawman: every rank gathers every batch,
padded to the largest, then keeps its own items). Both results are checked to be equal.

Measured cases (real processes: gloo on CPU, or NCCL when enough GPUs are present; the
smaller world sizes run on subgroups of one launch). Per world size ``d``:
- bytes per rank: the most any rank sends / receives in the all-to-all (from the split sizes
  handed to the collective), and ``(d-1) * max batch`` for the all-gather (every rank
  receives every other rank's padded buffer);
- peak extra memory per rank beyond input and output: on CUDA measured with
  ``max_memory_allocated``; on CPU (no allocator counter) the buffers each implementation
  allocates: all-to-all = its send-order copy of the local batch (when the plan reorders),
  all-gather = padded local buffer + ``d`` gathered buffers = ``(d+1) * max batch``;
- wall time (median over repetitions, slowest rank) and the ratio all-gather / all-to-all.

Simulated cases (larger ``d``, no processes): the same sampler and planner, byte counts
from the plan alone, to check the paper's claim: all-to-all traffic per rank stays flat
(bounded by the largest batch) as ``d`` grows, all-gather traffic grows as ``(d-1) x max
batch``.

    python benchmarks/dispatch_bench.py [--quick] [--json PATH] [--backend auto|gloo|nccl]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from orchmllm import balance
from orchmllm.dist import comm
from orchmllm.planner.plan import Rearrangement
from orchmllm.provenance import write_records
from orchmllm.testing import run_distributed

FULL = dict(
    worlds=[2, 4], batch=8, mean_len=1024, hidden=512, reps=7,
    sim_worlds=[2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], sim_seeds=5,
)  # fmt: skip
QUICK = dict(
    worlds=[2, 4], batch=4, mean_len=64, hidden=32, reps=2,
    sim_worlds=[2, 4, 8, 16, 32], sim_seeds=2,
)  # fmt: skip
TIMEOUT_S = 120.0
BYTES_PER_ELEMENT = 4  # float32 payload


def sample_lengths(rng: np.random.Generator, batch: int, mean_len: int) -> np.ndarray:
    """Long-tailed sequence lengths, median ``mean_len``, clipped to [8, 16 x median]."""
    raw = rng.lognormal(mean=np.log(mean_len), sigma=0.8, size=batch)
    return np.clip(np.rint(raw), 8, 16 * mean_len).astype(np.int64)


def plan_traffic(plan: Rearrangement, lengths: np.ndarray, row_bytes: int) -> dict[str, float]:
    """Per-rank byte counts of both communicators for one plan (what each rank puts on or
    takes off the wire; items that stay are not sent)."""
    m = plan.count_matrix(sizes=lengths).astype(np.float64) * row_bytes
    off = m - np.diag(np.diag(m))
    batch = m.sum(axis=1)  # bytes of each rank's source batch
    d = plan.num_ranks
    return {
        "a2a_sent_max_rank": float(off.sum(axis=1).max()),
        "a2a_sent_mean_rank": float(off.sum(axis=1).mean()),
        "a2a_recv_max_rank": float(off.sum(axis=0).max()),
        "allgather_recv_rank": float((d - 1) * batch.max()),
        "max_batch_bytes": float(batch.max()),
        "mean_batch_bytes": float(batch.mean()),
    }


# -- measured: one launch, world sizes on subgroups ----------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(rank: int, d: int, group, cfg: dict, device: torch.device) -> dict:
    rng = np.random.default_rng([cfg["seed"], d, rank])
    local = sample_lengths(rng, cfg["batch"], cfg["mean_len"])
    rows, src = comm.all_gather_rows(local[:, None], group=group, timeout=TIMEOUT_S)
    lengths = rows[:, 0]
    assignment = balance(lengths, d, "greedy", src=src)
    plan = Rearrangement.from_assignment(src, assignment.dst, num_ranks=d)
    row_bytes = cfg["hidden"] * BYTES_PER_ELEMENT
    x = torch.randn(int(local.sum()), cfg["hidden"], device=device)
    runs = {
        "a2a": lambda: comm.move(plan, x, sizes=lengths, group=group, timeout=TIMEOUT_S),
        "allgather": lambda: comm.all_gather_move(
            plan, x, sizes=lengths, group=group, timeout=TIMEOUT_S
        ),
    }
    outs = {name: fn() for name, fn in runs.items()}  # warm-up, and the results agree
    if not torch.equal(outs["a2a"], outs["allgather"]):
        raise AssertionError(f"d={d} rank {rank}: all-to-all and all-gather results differ")
    out_bytes = outs["a2a"].numel() * BYTES_PER_ELEMENT
    del outs
    rec: dict = {"rank": rank}
    for name, fn in runs.items():
        times = []
        for _ in range(cfg["reps"]):
            dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            out = fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
            del out
        rec[f"{name}_ms"] = 1e3 * float(np.median(times))
        if device.type == "cuda":
            _sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            out = fn()
            _sync(device)
            rec[f"{name}_extra_bytes"] = float(
                torch.cuda.max_memory_allocated(device) - base - out_bytes
            )
            del out
    if device.type != "cuda":
        sched = plan.schedule(rank, sizes=lengths)
        reorder = (sched.send_index is not None) * sched.num_send_rows
        reorder += (sched.recv_index is not None) * sched.num_recv_rows
        max_rows = int(np.bincount(src, weights=lengths, minlength=d).max())
        rec["a2a_extra_bytes"] = float(reorder * row_bytes)
        rec["allgather_extra_bytes"] = float((d + 1) * max_rows * row_bytes)
    rec.update(plan_traffic(plan, lengths, row_bytes))
    rec["imbalance_before"] = assignment.stats["imbalance_before"]
    rec["imbalance_after"] = assignment.stats["imbalance_after"]
    return rec


def _worker(rank: int, world: int, cfg: dict) -> list[dict]:
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    results = []
    for d in cfg["worlds"]:
        group = dist.new_group(list(range(d)))  # every rank joins the creation
        if rank < d:
            results.append(dict(_measure(rank, d, group, cfg, device), world_size=d))
        dist.barrier()
    return results


def run_measured(cfg: dict, backend: str) -> list[list[dict]]:
    """Launch ``max(worlds)`` processes; per-rank lists of per-world-size records."""
    world = max(cfg["worlds"])
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # one per process unless the caller says
    return run_distributed(
        _worker,
        world,
        cfg,
        timeout=TIMEOUT_S,
        env={"OMP_NUM_THREADS": threads},
        backend=backend,
        startup_s=120.0,
    )


def summarize_measured(per_rank: list[list[dict]], cfg: dict, backend: str) -> list[dict]:
    records = []
    for d in cfg["worlds"]:
        recs = [r for rank_recs in per_rank for r in rank_recs if r["world_size"] == d]
        first = recs[0]
        a2a_ms = max(r["a2a_ms"] for r in recs)
        ag_ms = max(r["allgather_ms"] for r in recs)
        a2a_mem = max(r["a2a_extra_bytes"] for r in recs)
        ag_mem = max(r["allgather_extra_bytes"] for r in recs)
        records.append(
            {
                "kind": "measured",
                "backend": backend,
                "world_size": d,
                "hidden": cfg["hidden"],
                "batch": cfg["batch"],
                "mean_len": cfg["mean_len"],
                "a2a_sent_max_rank": first["a2a_sent_max_rank"],
                "a2a_recv_max_rank": first["a2a_recv_max_rank"],
                "allgather_recv_rank": first["allgather_recv_rank"],
                "max_batch_bytes": first["max_batch_bytes"],
                "mean_batch_bytes": first["mean_batch_bytes"],
                "bytes_ratio": first["allgather_recv_rank"]
                / max(first["a2a_recv_max_rank"], first["a2a_sent_max_rank"], 1.0),
                "a2a_extra_bytes_max_rank": a2a_mem,
                "allgather_extra_bytes_max_rank": ag_mem,
                "memory_source": "cuda_max_memory_allocated" if backend == "nccl" else "buffers",
                "a2a_ms": a2a_ms,
                "allgather_ms": ag_ms,
                "time_ratio": ag_ms / a2a_ms if a2a_ms > 0 else float("nan"),
                "imbalance_before": first["imbalance_before"],
                "imbalance_after": first["imbalance_after"],
            }
        )
    return records


# -- simulated: larger d from the plan alone -----------------------------------------------


def run_simulated(cfg: dict) -> list[dict]:
    records = []
    row_bytes = cfg["hidden"] * BYTES_PER_ELEMENT
    for d in cfg["sim_worlds"]:
        acc: dict[str, list[float]] = {}
        for seed in range(cfg["sim_seeds"]):
            rng = np.random.default_rng([cfg["seed"], d, seed, 7])
            lengths = sample_lengths(rng, d * cfg["batch"], cfg["mean_len"])
            src = np.repeat(np.arange(d), cfg["batch"])
            assignment = balance(lengths, d, "greedy", src=src)
            plan = Rearrangement.from_assignment(src, assignment.dst, num_ranks=d)
            for k, v in plan_traffic(plan, lengths, row_bytes).items():
                acc.setdefault(k, []).append(v)
            acc.setdefault("imbalance_before", []).append(assignment.stats["imbalance_before"])
            acc.setdefault("imbalance_after", []).append(assignment.stats["imbalance_after"])
        rec = {k: float(np.mean(v)) for k, v in acc.items()}
        a2a = max(rec["a2a_sent_max_rank"], rec["a2a_recv_max_rank"])
        records.append(
            {
                "kind": "simulated",
                "backend": "none",
                "world_size": d,
                "hidden": cfg["hidden"],
                "batch": cfg["batch"],
                "mean_len": cfg["mean_len"],
                **rec,
                "a2a_over_max_batch": a2a / rec["max_batch_bytes"],
                "a2a_mean_over_mean_batch": rec["a2a_sent_mean_rank"] / rec["mean_batch_bytes"],
                "allgather_over_max_batch": rec["allgather_recv_rank"] / rec["max_batch_bytes"],
                "bytes_ratio": rec["allgather_recv_rank"] / max(a2a, 1.0),
            }
        )
    return records


def choose_backend(requested: str, world: int) -> str:
    if requested != "auto":
        return requested
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= world
    return "nccl" if enough else "gloo"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds")
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL, seed=args.seed)
    backend = choose_backend(args.backend, max(cfg["worlds"]))

    measured = summarize_measured(run_measured(cfg, backend), cfg, backend)
    simulated = run_simulated(cfg)
    mb = 1 / 2**20
    print(
        f"measured ({backend}, hidden {cfg['hidden']} fp32, {cfg['batch']} seqs/rank, "
        f"median length {cfg['mean_len']}); MB per rank, memory: {measured[0]['memory_source']}"
    )
    print(
        f"{'d':>4} {'a2a sent':>9} {'a2a recv':>9} {'AG recv':>9} {'a2a mem':>8} "
        f"{'AG mem':>8} {'a2a ms':>8} {'AG ms':>8} {'AG/a2a t':>9} {'imb before/after':>17}"
    )
    for r in measured:
        print(
            f"{r['world_size']:>4} {r['a2a_sent_max_rank'] * mb:>9.2f} "
            f"{r['a2a_recv_max_rank'] * mb:>9.2f} {r['allgather_recv_rank'] * mb:>9.2f} "
            f"{r['a2a_extra_bytes_max_rank'] * mb:>8.2f} "
            f"{r['allgather_extra_bytes_max_rank'] * mb:>8.2f} {r['a2a_ms']:>8.2f} "
            f"{r['allgather_ms']:>8.2f} {r['time_ratio']:>9.2f} "
            f"{r['imbalance_before']:>8.3f}/{r['imbalance_after']:.3f}"
        )
    print(f"simulated (plan byte counts, mean of {cfg['sim_seeds']} samples); MB per rank")
    print(
        f"{'d':>5} {'a2a sent':>9} {'a2a recv':>9} {'AG recv':>10} {'max batch':>10} "
        f"{'a2a/maxB':>9} {'AG/maxB':>8} {'a2a mean/meanB':>15} {'AG/a2a':>8}"
    )
    for r in simulated:
        print(
            f"{r['world_size']:>5} {r['a2a_sent_max_rank'] * mb:>9.2f} "
            f"{r['a2a_recv_max_rank'] * mb:>9.2f} {r['allgather_recv_rank'] * mb:>10.2f} "
            f"{r['max_batch_bytes'] * mb:>10.2f} {r['a2a_over_max_batch']:>9.2f} "
            f"{r['allgather_over_max_batch']:>8.1f} {r['a2a_mean_over_mean_batch']:>15.2f} "
            f"{r['bytes_ratio']:>8.1f}"
        )
    lo, hi = simulated[0], simulated[-1]
    print(
        f"claim: from d={lo['world_size']} to d={hi['world_size']} the busiest rank's all-to-all "
        f"bytes stay {lo['a2a_over_max_batch']:.2f} -> {hi['a2a_over_max_batch']:.2f} x max "
        f"batch (bound: 1 for sends), all-gather grows {lo['allgather_over_max_batch']:.0f} -> "
        f"{hi['allgather_over_max_batch']:.0f} x max batch (= d-1); average all-to-all traffic "
        f"{lo['a2a_mean_over_mean_batch']:.2f} -> {hi['a2a_mean_over_mean_batch']:.2f} x mean batch"
    )
    records = measured + simulated
    if args.json:
        write_records(args.json, records)
    return records


if __name__ == "__main__":
    main()
