"""The context-parallelism section (``context_parallel_sim.py``): per cluster size, no splitting,
fixed context parallelism and the planner's pieces, each at its largest fitting mini-batch and
all at the smallest of those."""

from __future__ import annotations

from .tables import Records, fmt, table, where

BATCHES = (
    ("largest", "each at its largest mini-batch that fits memory"),
    ("equal", "all at the smallest of those mini-batches"),
)


def _row(r: dict) -> list[str]:
    if not r["examples_per_rank"]:
        return [f"`{r['strategy']}`", "0: none fits"] + ["–"] * 7
    return [
        f"`{r['strategy']}`",
        str(r["examples_per_rank"]),
        fmt(r["step_time_s"], ".2f"),
        fmt(r["tokens_per_s_per_gpu"], ",.0f"),
        fmt(r["mfu"], ".3f"),
        fmt(r["peak_memory_gb"], ".1f"),
        fmt(r["imbalance_llm"], ".2f"),
        fmt(r["context_parallel_ms"], ".0f"),
        fmt(r["items_split"], ",.0f"),
    ]


def context_parallel_sim(recs: Records) -> list[str]:
    r0 = recs[0]
    ranks = sorted({r["ranks"] for r in recs})
    lines = [
        f"`{r0['model']}` on its mix with issue 40's long items (`{r0['workload']}`: "
        f"{r0['long_text_share']:.0%} of the examples a document of 32k-128k tokens, "
        f"log-uniform), context-parallel groups of {r0['group']} ranks (one node), "
        "OrchMLLM's balance (`full`, no node placement) in every row; simulated, no GPU. "
        "`none`: whole examples only; "
        f"`fixed {r0['group']}`: every example cut over its group's ranks (classic context "
        f"parallelism), the examples balanced over the groups; `planned {r0['group']}`: the "
        "planner's pieces, split where that lowers the slowest rank; `memory budget`: also "
        "under `llm_max_load` = the LLM cost of the most tokens a rank's memory holds (a "
        "mini-batch whose plan cannot meet it counts as not fitting: the long items' attention "
        "fills that cost before their rows fill memory). A piece "
        "costs the planner's piece cost (so the simulated compute agrees with the plan's loads "
        "by construction); the home scatters the pieces' rows (one more all-to-all each way); "
        "every layer gathers the keys and values in the group (forward, the recomputed "
        "forward, and a reduce-scatter backward), not overlapped with compute: *K/V ms* is what "
        "that adds to the LLM phase's slowest rank; memory holds the gathered keys and values "
        "(`orchmllm.sim.context_parallel`). Tokens/s counts the LLM's tokens; MFU useful "
        "FLOPs over the H100's dense bf16 peak.",
        "",
    ]
    header = ["strategy", "examples/rank", "step s", "tokens/s per GPU", "MFU", "peak GB",
              "LLM imbalance", "K/V ms", "examples split"]  # fmt: skip
    for d in ranks:
        at = where(recs, ranks=d)
        a = at[0]
        lines += [
            f"**{d:,} GPUs** ({a['steps']} sampled step{'s' if a['steps'] > 1 else ''}; a "
            f"rank's memory holds {a['llm_token_capacity']:,} LLM tokens, the longest sampled "
            f"example has {a['longest_pooled_tokens']:,}, and {a['pooled_over_capacity']} of "
            f"the {a['pooled_examples']:,} sampled examples are longer than a rank holds: "
            "without splitting no mini-batch may include them; the LLM budget is "
            f"{a['llm_budget_ms']:,.0f} ms per rank):",
            "",
        ]
        for kind, what in BATCHES:
            rows = where(at, batch=kind)
            lines += [f"{what.capitalize()}:", ""]
            lines += table(header, [_row(r) for r in rows])
            best = max(
                (r for r in rows if r["examples_per_rank"]), key=lambda r: r["tokens_per_s_per_gpu"]
            )
            lines += [
                f"Most tokens/s per GPU: `{best['strategy']}`, "
                f"{best['tokens_per_s_per_gpu']:,.0f}.",
                "",
            ]
    return lines
