"""Items longer than a rank, on the simulator: no splitting, fixed context parallelism, and the
planner's pieces (issue 40, item 5). No GPU needed.

The workload is the model's mix with issue 40's long items
(:func:`orchmllm.sim.sweep.long_item_mix`: 5% of the examples a document of 32k-128k tokens, the
rest the config's mix). Per cluster size, on the same sampled steps, each strategy gets the
largest mini-batch whose every rank fits memory (the paper's rule,
:func:`orchmllm.sim.sweep.largest_minibatch`; ``0``: not even one example per rank fits), then
every strategy is also run at the smallest of those (equal mini-batch). All balance with
OrchMLLM (``full`` mode, no node placement: the planner's pieces take none); the LLM phase:

- ``none``: whole examples only (the paper's OrchMLLM);
- ``fixed N``: classic context parallelism: every example cut over the ``N`` ranks of its group,
  the examples balanced over the groups (:func:`orchmllm.sim.context_parallel.fixed_layout`);
- ``planned N``: the planner cuts an example into at most ``N`` pieces where that lowers the
  slowest rank (``context_parallel=N``, no budget);
- ``planned N, memory budget``: the same under ``llm_max_load`` set from memory
  (:func:`orchmllm.sim.sweep.memory_budget_ms`: the cost of the most tokens a rank holds); a
  mini-batch whose plan cannot meet it does not fit.

How pieces are modelled (compute from the planner's piece cost, so it agrees with the plan by
construction; the home's row scatter; the keys' and values' gathers per layer, not overlapped
with compute; the gathered keys and values in memory) is :mod:`orchmllm.sim.context_parallel`.

    python benchmarks/context_parallel_sim.py [--quick] [--json PATH]

``--quick`` runs 16 ranks and one step (the test's path); the default 64 and 2,560 ranks, with
:func:`orchmllm.sim.sweep.default_steps` sampled steps per size (4 at 64 ranks, 1 at 2,560).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from orchmllm.provenance import write_records
from orchmllm.schema import LLM
from orchmllm.sim.batch import Batch
from orchmllm.sim.context_parallel import ContextParallel
from orchmllm.sim.sweep import (
    SimModel,
    default_steps,
    largest_minibatch,
    llm_token_capacity,
    load_model,
    long_item_mix,
    memory_budget_ms,
    run_case,
    step_pools,
)

RANKS = (64, 2560)
QUICK_RANKS = (16,)
MODE = "full"
FIELDS = (
    "step_time_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "peak_memory_gb",
    "forward_memory_gb",
    "backward_memory_gb",
    "compute_llm_s",
    "imbalance_llm",
    "context_parallel_ms",
    "dispatch_fwd_ms",
    "dispatch_bwd_ms",
    "items_split",
    "pieces",
    "memory_budget_gb",
)


def strategies(group: int, budget_ms: float) -> dict[str, ContextParallel]:
    return {
        "none": ContextParallel(),
        f"fixed {group}": ContextParallel(group, fixed=True),
        f"planned {group}": ContextParallel(group),
        f"planned {group}, memory budget": ContextParallel(group, max_load_ms=budget_ms),
    }


def largest(
    model: SimModel, d: int, cases: dict[str, ContextParallel], *, seed: int, steps: int
) -> tuple[dict[int, Batch], dict[str, int]]:
    """Each strategy's largest fitting mini-batch on one seed's steps, growing the sampled
    steps until some mini-batch does not fit (as ``fitting_minibatches`` does)."""
    per_rank = 64
    while True:
        pools = step_pools(model, d, per_rank, seed, steps)
        try:
            found = {
                name: largest_minibatch(model, d, MODE, pools=pools, context_parallel=c)[0]
                for name, c in cases.items()
            }
        except ValueError:  # every pooled mini-batch fits: sample larger steps
            per_rank = int(1.5 * per_rank) + 1
            continue
        return pools, found


def _record(
    model: SimModel,
    d: int,
    name: str,
    c: ContextParallel,
    b: int,
    pools: dict[int, Batch],
    batch: str,
) -> dict[str, Any]:
    rec: dict[str, Any] = {"strategy": name, "batch": batch, "ranks": d, "examples_per_rank": b}
    if b == 0:
        return {**rec, "fits": False, **{k: None for k in FIELDS}}
    r = run_case(
        model, d, MODE, examples_per_rank=b, steps=len(pools), pools=pools, context_parallel=c
    )
    return {**rec, "fits": not r["oom"], **{k: r[k] for k in FIELDS}}


def run(model: SimModel, d: int, *, group: int, seed: int, steps: int) -> list[dict[str, Any]]:
    """Every strategy at ``d`` ranks, at its largest mini-batch and at the smallest one."""
    budget = memory_budget_ms(model, d)
    cases = strategies(group, budget)
    pools, found = largest(model, d, cases, seed=seed, steps=steps)
    lengths = np.concatenate([p.llm_lengths(model.config) for p in pools.values()])
    capacity = llm_token_capacity(model, d)
    common = {
        "model": model.name,
        "workload": "long_item_mix",
        "long_text_share": _document_share(model),
        "group": group,
        "steps": len(pools),
        "seed": seed,
        "llm_budget_ms": budget,
        "llm_token_capacity": capacity,
        "longest_pooled_tokens": int(lengths.max()),
        # examples no rank can hold whole: without splitting no mini-batch may include them
        "pooled_over_capacity": int(np.sum(lengths > capacity)),
        "pooled_examples": int(lengths.size),
        "llm_cost_alpha_ms": model.modules[LLM].cost.alpha,
        "llm_cost_beta_ms": model.modules[LLM].cost.beta,
    }
    out = [
        {**common, **_record(model, d, name, cases[name], b, pools, "largest")}
        for name, b in found.items()
    ]
    equal = min((b for b in found.values() if b > 0), default=0)
    out += [
        {**common, **_record(model, d, name, c, equal, pools, "equal")} for name, c in cases.items()
    ]
    return out


def _fmt(x: Any, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _document_share(model) -> float:  # noqa: ANN001
    """The share of the mix's weight on the recipe's long documents."""
    weights = model.data.task_weights
    return weights.get("document", 0.0) / sum(weights.values())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 ranks, one step")
    ap.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    ap.add_argument("--model", default="mllm-10b", help="a config under configs/")
    ap.add_argument("--group", type=int, default=8, help="context-parallel group size N")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model = long_item_mix(load_model(args.model))
    ranks = QUICK_RANKS if args.quick else RANKS
    records = []
    print(
        f"{'ranks':>5} {'batch':>7} {'strategy':>26} {'b':>3} {'step s':>7} {'tok/s/GPU':>9} "
        f"{'MFU':>5} {'peak GB':>7} {'imb':>5} {'KV ms':>6} {'split':>6}"
    )
    for d in ranks:
        steps = 1 if args.quick else default_steps(d)
        for r in run(model, d, group=args.group, seed=args.seed, steps=steps):
            records.append(r)
            print(
                f"{d:>5} {r['batch']:>7} {r['strategy']:>26} {r['examples_per_rank']:>3} "
                f"{_fmt(r['step_time_s'], '7.2f')} {_fmt(r['tokens_per_s_per_gpu'], '9.0f')} "
                f"{_fmt(r['mfu'], '5.3f')} {_fmt(r['peak_memory_gb'], '7.1f')} "
                f"{_fmt(r['imbalance_llm'], '5.2f')} {_fmt(r['context_parallel_ms'], '6.0f')} "
                f"{_fmt(r['items_split'], '6.0f')}"
            )
    if args.json:
        write_records(args.json, records)
    return records


if __name__ == "__main__":
    main()
