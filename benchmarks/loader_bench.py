"""Prefetching loader: how much planning is hidden behind the step, and bytes per mode.

Each rank (gloo processes) trains on a simulated step of ``step_s`` seconds (``sleep``, or
a ``matmul`` calibrated to that duration; then a small all-reduce on the training group
keeps the ranks in lockstep, as gradient synchronisation does) while BalancedDataLoader
prepares the next steps in its background thread: load the examples, all-gather their
metadata, plan (``--policy``), move the examples (``move`` mode) and collate.

Per case it prints the time per step the background work takes (``plan_s``: gather + plan;
``prep_s``: everything), the time the loop still waited for a batch (``wait_s``), the
fraction of the preparation hidden behind the step (``hidden_fraction = 1 - wait/prep``
summed over the steps after the first), and the bytes each rank sent per step: ``index``
mode exchanges dataset indices and lengths only, ``move`` mode also ships every moved
example. ``prefetch=0`` is the synchronous baseline (nothing hidden).

    python benchmarks/loader_bench.py [--quick] [--json PATH] [--work sleep|matmul]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

from orchmllm.provenance import write_records
from orchmllm.testing import run_distributed


def _dataset(n: int, seed: int, median: int):
    """Text examples with log-normal lengths (token ids as payload, like a text LLM)."""
    import datasets

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.9, n), 8, 16 * median).astype(np.int64)
    return datasets.Dataset.from_dict(
        {
            "input_ids": [rng.integers(4, 32000, size=k).tolist() for k in lengths],
            "n_tokens": lengths.tolist(),
        }
    ).with_format("numpy")


def _pack(examples: list) -> dict[str, torch.Tensor]:
    """Packed batch: all tokens concatenated, plus lengths (what a varlen model takes)."""
    ids = [torch.as_tensor(e["input_ids"]) for e in examples]
    return {
        "input_ids": torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long),
        "lengths": torch.tensor([len(t) for t in ids], dtype=torch.long),
    }


class _Work:
    """The simulated training step: sleep, or matmuls sized to take ``seconds``."""

    def __init__(self, kind: str, seconds: float) -> None:
        self.kind, self.seconds = kind, seconds
        self.a = torch.randn(256, 256)
        self.reps = 0
        if kind == "matmul" and seconds > 0:
            t0 = time.perf_counter()
            for _ in range(20):
                self.a @ self.a
            per = (time.perf_counter() - t0) / 20
            self.reps = max(1, round(seconds / per))

    def __call__(self) -> None:
        if self.kind == "sleep":
            time.sleep(self.seconds)
        else:
            for _ in range(self.reps):
                self.a @ self.a


def _case(ds, cfg: dict, topology) -> dict:
    from orchmllm.data.loader import BalancedDataLoader
    from orchmllm.data.options import LoaderOptions, PlanningOptions

    loader = BalancedDataLoader(
        ds,
        batch_size=cfg["items_per_rank"],
        length_column="n_tokens",
        collate_fn=_pack,
        mode=cfg["mode"],
        planning=PlanningOptions(policy=cfg["policy"]),
        options=LoaderOptions(prefetch=cfg["prefetch"]),
        topology=topology,
    )
    work = _Work(cfg["work"], cfg["step_s"])
    grad = torch.zeros(1024)
    waits, infos, steps_s = [], [], []
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        batch = next(it, None)
        waits.append(time.perf_counter() - t0)
        if batch is None:
            break
        infos.append(loader.last_step)
        t1 = time.perf_counter()
        work()
        dist.all_reduce(grad)  # ends like a DP step: ranks in lockstep, as with real gradients
        steps_s.append(time.perf_counter() - t1)
    loader.close()
    keep = slice(1, None)  # the first batch cannot be prefetched
    return {
        "wait_s": float(np.sum(waits[keep][: len(infos) - 1])),
        "prep_s": float(np.sum([i.prep_s for i in infos[keep]])),
        "plan_s": float(np.mean([i.plan_s for i in infos])),
        "prep_mean_s": float(np.mean([i.prep_s for i in infos])),
        "step_measured_s": float(np.mean(steps_s)),
        "bytes_meta": float(np.mean([i.bytes_meta for i in infos])),
        "bytes_payload": float(np.mean([i.bytes_payload for i in infos])),
        "steps": len(infos),
    }


def _cases(rank: int, world: int, data: dict, cfgs: list[dict]) -> list[dict]:
    """All cases in one set of processes (start-up is not what is measured), one after
    another on one topology (one gloo group for all the loaders)."""
    from orchmllm.dist.topology import Topology

    torch.set_num_threads(1)
    ds = _dataset(data["items_per_rank"] * world * data["steps"], data["seed"], data["median"])
    with Topology.build(timeout=120.0) as topology:
        return [_case(ds, cfg, topology) for cfg in cfgs]


def summarize(cfg: dict, per_rank: list[dict], world: int) -> dict:
    wait = float(np.mean([r["wait_s"] for r in per_rank]))
    prep = float(np.mean([r["prep_s"] for r in per_rank]))
    hidden = 0.0 if prep <= 0 else float(np.clip(1.0 - wait / prep, 0.0, 1.0))
    meta = float(np.mean([r["bytes_meta"] for r in per_rank]))
    payload = float(np.mean([r["bytes_payload"] for r in per_rank]))
    return {
        "mode": cfg["mode"],
        "prefetch": cfg["prefetch"],
        "work": cfg["work"],
        "policy": cfg["policy"],
        "world_size": world,
        "items_per_rank": cfg["items_per_rank"],
        "steps": per_rank[0]["steps"],
        "step_s": cfg["step_s"],
        "step_measured_s": float(np.mean([r["step_measured_s"] for r in per_rank])),
        "plan_s": float(np.mean([r["plan_s"] for r in per_rank])),
        "prep_s": float(np.mean([r["prep_mean_s"] for r in per_rank])),
        "wait_s": wait / max(per_rank[0]["steps"] - 1, 1),
        "hidden_fraction": hidden,
        "bytes_sent": meta + payload,
        "bytes_meta": meta,
        "bytes_payload": payload,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 ranks, small batches, few steps")
    ap.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    ap.add_argument("--work", choices=("sleep", "matmul"), default="sleep")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--items-per-rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--step-ms", help="simulated step durations, comma-separated (default 0,50,200; quick 0,40)"
    )
    ap.add_argument("--policy", default="kk", help="balancing policy (kk: heavier planning)")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--median", type=int, default=512, help="median example length (tokens)")
    args = ap.parse_args()
    if args.quick:
        args.items_per_rank, args.steps, args.median = 16, 5, 128
    args.step_ms = args.step_ms or ("0,40" if args.quick else "0,50,200")
    data = {
        "items_per_rank": args.items_per_rank,
        "steps": args.steps,
        "median": args.median,
        "seed": 0,
    }
    cfgs = [
        {
            "mode": mode,
            "prefetch": prefetch,
            "work": args.work,
            "policy": args.policy,
            "step_s": float(step_ms) / 1000.0,
            **data,
        }
        for step_ms in args.step_ms.split(",")
        for mode in ("index", "move")
        for prefetch in (0, args.prefetch)
    ]
    per_rank = run_distributed(_cases, args.world_size, data, cfgs, timeout=600)
    records = []
    for k, cfg in enumerate(cfgs):
        rec = summarize(cfg, [r[k] for r in per_rank], args.world_size)
        records.append(rec)
        print(
            f"{rec['mode']:5s} prefetch={rec['prefetch']} step={rec['step_s'] * 1e3:6.1f} ms  "
            f"plan={rec['plan_s'] * 1e3:7.2f} ms  prep={rec['prep_s'] * 1e3:7.2f} ms  "
            f"wait={rec['wait_s'] * 1e3:7.2f} ms  hidden={rec['hidden_fraction']:5.2f}  "
            f"bytes/rank/step={rec['bytes_sent']:10.0f} "
            f"(meta {rec['bytes_meta']:.0f}, payload {rec['bytes_payload']:.0f})"
        )
    by_mode = {
        m: np.mean([r["bytes_sent"] for r in records if r["mode"] == m]) for m in ("index", "move")
    }
    saved = 1.0 - by_mode["index"] / by_mode["move"] if by_mode["move"] else 0.0
    for r in records:
        r["bytes_saved_vs_move"] = saved if r["mode"] == "index" else 0.0
    print(
        f"index mode sends {by_mode['index']:.0f} B/rank/step vs {by_mode['move']:.0f} in "
        f"move mode: {saved:.1%} fewer bytes"
    )
    if args.json:
        write_records(args.json, records)


if __name__ == "__main__":
    main()
