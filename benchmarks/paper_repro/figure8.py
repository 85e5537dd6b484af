"""Figure 8 decomposed (balancing x the larger mini-batch it allows), Figure 9 from the same
cases, and their sensitivity to the workload, with the length scale that matches Table 2's
forward time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from orchmllm.sim.batch import Batch
from orchmllm.sim.sweep import (
    SimModel,
    audio_share,
    default_steps,
    fitting_minibatches,
    placement_for,
    run_case,
    sample_pool,
    with_workload,
)

from .paper import PAPER
from .sweep import Sweep, fmt_spread, print_table, ratio_or_none, spread

AUDIO_SHARES = (0.1, 0.7)  # beside the config's own (the paper mix: 0.39)
FIG8_STEPS = 3  # sampled steps per seed in Figure 8, at least (see _fig8_steps)


def _fig8_cases(
    sw: Sweep,
    m: SimModel,
    d: int,
    seed: int,
    pools: dict[int, Batch],
    b0: int,
    b1: int,
    *,
    at: str,
    found: dict[str, dict[str, Any]] | None = None,
    figure: str = "fig8_case",
    tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The three cases of one Figure 8 point, none at ``b0``, full at ``b0`` and at ``b1``, on
    one seed's pooled steps (``found``: records the mini-batch search already made), and
    their decomposition: ``balance`` (full/none at ``b0``, the same work) x ``minibatch``
    (full at ``b1`` over full at ``b0``) = ``product`` (the MFU ratio), beside each side's
    LLM tokens per second per GPU (Figure 9). A factor whose cases run out of memory is
    None."""
    found = found or {}

    def run(mode: str, b: int) -> dict[str, Any]:
        return run_case(
            m, d, mode, examples_per_rank=b, placement=placement_for(mode), steps=len(pools),
            pools=pools,
        )  # fmt: skip

    none = found.get("none") or run("none", b0)
    full0 = run("full", b0)
    full = found.get("full") or run("full", b1)
    prefix = "" if at == "own" else f"{at}_"
    for role, rec in (("none@b_none", none), ("full@b_none", full0), ("full@b_full", full)):
        rec.update(figure=figure, seed=seed, role=prefix + role, minibatches=at, **(tags or {}))
        sw.records.append(rec)
    fits = {k: not r["oom"] for k, r in (("none", none), ("full0", full0), ("full", full))}
    ends = fits["none"] and fits["full"]
    out: dict[str, Any] = {"oom": not all(fits.values())}
    out["mfu_none"] = none["mfu"] if fits["none"] else None
    out["mfu_full"] = full["mfu"] if fits["full"] else None
    out["tpt_none"] = none["tokens_per_s_per_gpu"] if fits["none"] else None
    out["tpt_full"] = full["tokens_per_s_per_gpu"] if fits["full"] else None
    out["product"] = full["mfu"] / none["mfu"] if ends else None
    out["tpt_ratio"] = full["tokens_per_s_per_gpu"] / none["tokens_per_s_per_gpu"] if ends else None
    out["balance"] = full0["mfu"] / none["mfu"] if fits["none"] and fits["full0"] else None
    out["minibatch"] = full["mfu"] / full0["mfu"] if fits["full0"] and fits["full"] else None
    return out


def _fig8_point(
    sw: Sweep,
    m: SimModel,
    d: int,
    seed: int,
    prev: dict[str, int] | None,
    *,
    steps: int,
    figure: str = "fig8_case",
    tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One seed of one Figure 8 point, at the largest mini-batches that fit (``own``: from
    the memory model under the config's training recipe, by ``fitting_minibatches``, the
    search ``python -m orchmllm.sim.plan_memory`` runs, so the two print the same mini-batches)
    and at the paper's (``paper``), on the same ``steps`` pooled steps.

    ``prev`` (this seed's mini-batches at the previous scale) only sets where the searches
    start."""
    guesses = {"none": prev["b_none"], "full": prev["b_full"]} if prev else None
    pools, found = fitting_minibatches(
        m, d, ("none", "full"), seed=seed, steps=steps, guesses=guesses
    )
    (b0, none), (b1, full) = found["none"], found["full"]
    out: dict[str, Any] = {"b_none": b0, "b_full": b1, "steps": len(pools)}
    if none is None or full is None:
        out["own"] = None  # not even one example per rank fits
    else:
        out["own"] = _fig8_cases(
            sw, m, d, seed, pools, b0, b1, at="own", found={"none": none, "full": full},
            figure=figure, tags=tags,
        )  # fmt: skip
    p0, p1 = PAPER["minibatch_none"][m.name], PAPER["minibatch_full"][m.name]
    out["paper"] = _fig8_cases(sw, m, d, seed, pools, p0, p1, at="paper", figure=figure, tags=tags)
    return out


def _fig8_steps(ranks: int, override: int | None) -> int:
    """Sampled steps per seed in Figure 8: at least ``FIG8_STEPS`` (one step at 16,384
    GPUs would make each seed's figure a single draw)."""
    return override or max(FIG8_STEPS, default_steps(ranks))


FACTORS = ("balance", "minibatch", "product", "mfu_none", "mfu_full")
TPT = ("tpt_none", "tpt_full", "tpt_ratio")


def _summary(points: Sequence[dict[str, Any] | None], keys: Sequence[str]) -> dict[str, Any]:
    """Each key's spread over the seeds where it has a value (None where none has)."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [p[key] for p in points if p is not None and p[key] is not None]
        out[key] = spread(values) if values else None
    return out


def figure8(sw: Sweep, ranks: Sequence[int]) -> None:
    rows, paper_rows, tpt_rows, headline = [], [], [], ""
    for model in sw.models:
        prev: dict[int, dict[str, int] | None] = dict.fromkeys(sw.seeds)
        for d in ranks:
            points = {}
            for seed in sw.seeds:
                points[seed] = _fig8_point(
                    sw, sw.models[model], d, seed, prev[seed],
                    steps=_fig8_steps(d, sw.steps_override),
                )  # fmt: skip
                p = points[seed]
                prev[seed] = p if p["b_none"] and p["b_full"] else None
            own = [p["own"] for p in points.values()]
            paper = [p["paper"] for p in points.values()]
            rec: dict[str, Any] = {
                "figure": "fig8",
                "model": model,
                "ranks": d,
                "seeds": len(sw.seeds),
                "steps": points[sw.seeds[0]]["steps"],
                "oom_seeds": sum(o is None or o["oom"] for o in own),
                "b_none": spread([p["b_none"] for p in points.values()]),
                "b_full": spread([p["b_full"] for p in points.values()]),
                "paper_b_none": PAPER["minibatch_none"][model],
                "paper_b_full": PAPER["minibatch_full"][model],
                "paper_mfu_ratio": PAPER["fig8_mfu_ratio"].get(model),
                "paper_mfu_ratio_range": list(PAPER["fig8_mfu_ratio_range"]),
                **_summary(own, FACTORS + TPT),
                "at_paper_oom_seeds": sum(p["oom"] for p in paper),
                **{f"at_paper_{k}": v for k, v in _summary(paper, FACTORS + TPT).items()},
            }
            rec["balance_factor"], rec["minibatch_factor"] = rec["balance"], rec["minibatch"]
            sw.records.append(rec)
            ratio = rec["paper_mfu_ratio"]
            if model == "mllm-84b" and d == 2560 and rec["mfu_full"]:
                ref = PAPER["fig8_mfu_full_84b_2560"]
                rec["paper_mfu_full"] = ref
                headline = (
                    f"MLLM-84B, 2560 GPUs, full at its own mini-batch: MFU "
                    f"{fmt_spread(rec['mfu_full'])} vs the paper's {ref} (sim/paper "
                    f"{rec['mfu_full']['mean'] / ref:.2f})"
                )
            paper_x = ratio if ratio else "1.5-2.0"
            rows.append(
                [model, d, fmt_spread(rec["b_none"]), fmt_spread(rec["b_full"])]
                + [fmt_spread(rec[k]) for k in ("balance", "minibatch", "product")]
                + [
                    paper_x,
                    ratio_or_none(rec["product"]["mean"], ratio) if rec["product"] else None,
                ]
                + [fmt_spread(rec["mfu_none"]), fmt_spread(rec["mfu_full"])]
            )
            paper_rows.append(
                [model, d, f"{rec['paper_b_none']}->{rec['paper_b_full']}"]
                + [fmt_spread(rec[f"at_paper_{k}"]) for k in ("balance", "minibatch", "product")]
                + [
                    paper_x,
                    ratio_or_none(rec["at_paper_product"]["mean"], ratio)
                    if rec["at_paper_product"]
                    else None,
                ]
                + [fmt_spread(rec[f"at_paper_{k}"]) for k in ("mfu_none", "mfu_full")]
            )
            lo, hi = PAPER["fig9_tpt_ratio_range"]
            fig9 = {
                "figure": "fig9",
                "model": model,
                "ranks": d,
                "seeds": len(sw.seeds),
                "paper_tpt_ratio_range": [lo, hi],
                **{k: rec[k] for k in TPT},
                **{f"at_paper_{k}": rec[f"at_paper_{k}"] for k in TPT},
            }
            sw.records.append(fig9)
            tpt_rows.append(
                [model, d]
                + [fmt_spread(fig9[k]) for k in TPT]
                + [fmt_spread(fig9[f"at_paper_{k}"]) for k in TPT]
                + [f"{lo}-{hi}"]
            )
    seeds = len(sw.seeds)
    print_table(
        "Figure 8 decomposed, at the largest mini-batch per rank the memory model lets run "
        "(none, full): speed-up of balancing at the none mini-batch x speed-up of full's larger "
        f"mini-batch = MFU ratio full/none; mean (min-max) over {seeds} seeds; OOM: not even a "
        "balanced step at the none mini-batch fits",
        ["model", "GPUs", "b none", "b full", "balance x", "mini-batch x", "product x",
         "paper x", "sim/paper", "MFU none", "MFU full"],
        rows,
    )  # fmt: skip
    print_table(
        "Figure 8 decomposed, at the paper's mini-batches (none -> full, section 8.1), on the "
        f"same sampled steps; mean (min-max) over {seeds} seeds; OOM: the simulator's memory "
        "model does not fit that mini-batch",
        ["model", "GPUs", "paper b", "balance x", "mini-batch x", "product x", "paper x",
         "sim/paper", "MFU none", "MFU full"],
        paper_rows,
    )  # fmt: skip
    print_table(
        "Figure 9: LLM tokens per second per GPU (the paper's TPT), none and full and their "
        f"ratio, at the largest fitting mini-batches and at the paper's; mean (min-max) over "
        f"{seeds} seeds; the paper's full/none ratio from its text. Megatron-LM: not simulated "
        "(see the notes)",
        ["model", "GPUs", "none", "full", "full/none", "none@paper b", "full@paper b",
         "full/none@paper b", "paper full/none"],
        tpt_rows,
    )  # fmt: skip
    if headline:
        print(headline)


def table2_scale(sw: Sweep, d: int, *, lo: float = 0.5, hi: float = 4.0) -> dict[str, Any]:
    """The length scale (:func:`orchmllm.sim.sweep.with_workload`) at which the simulated
    forward time of Table 2's set-up (MLLM-10B, mini-batch 60, full + node-wise, the first
    seed's step) equals the paper's at ``d`` GPUs, by bisection on ``log(scale)`` in
    ``[lo, hi]`` to 1% (the forward time grows with every length). A derived figure: how much
    heavier the paper's examples would have to be; never used as the workload. ``scale`` is
    None when the paper's time lies outside the forward times at ``lo`` and ``hi``."""
    model, b = "mllm-10b", PAPER["table2_minibatch"]
    base, seed, target = sw.models[model], sw.seeds[0], PAPER["table2"][d][1]

    def forward(scale: float) -> dict[str, Any]:
        m = with_workload(base, scale=scale)
        pools = {0: sample_pool(m, d, b, (seed, 0))}  # Table 2's first step at this scale
        return run_case(m, d, "full", examples_per_rank=b, placement="node", pools=pools)

    at = {lo: forward(lo), hi: forward(hi)}
    rec: dict[str, Any] = {
        "figure": "table2_scale", "model": model, "ranks": d, "examples_per_rank": b,
        "seed": seed, "paper_forward_s": target, "forward_s_at_1": forward(1.0)["forward_s"],
        "searched": [lo, hi], "scale": None,
    }  # fmt: skip
    if at[lo]["forward_s"] <= target <= at[hi]["forward_s"]:
        while hi / lo > 1.01:
            mid = float(np.sqrt(lo * hi))
            at[mid] = forward(mid)
            lo, hi = (mid, hi) if at[mid]["forward_s"] < target else (lo, mid)
        scale = float(np.sqrt(lo * hi))
        match = forward(scale)
        rec.update(scale=scale, forward_s=match["forward_s"], oom=match["oom"],
                   peak_memory_gb=match["peak_memory_gb"])  # fmt: skip
    sw.records.append(rec)
    return rec


SENSITIVITY_KEYS = ("balance", "minibatch", "product")


def sensitivity(sw: Sweep, d: int, scales: Sequence[float], table2_ranks: Sequence[int]) -> None:
    """Figure 8 (both mini-batch settings) as the workload changes: every length times a
    scale, and the audio tasks' share of the image-or-audio tasks (at scale 1), on the first
    seed's steps at ``d`` GPUs; then the scale at which Table 2's forward time is the
    paper's. The shipped workload is scale 1 with the config's mix."""
    seed, rows = sw.seeds[0], []
    for model, base in sw.models.items():
        own = audio_share(base)
        variants = [(s, None) for s in scales] + [(1.0, a) for a in AUDIO_SHARES if a != own]
        for scale, share in variants:
            m = with_workload(base, scale=scale, audio_share=share)
            tags = {
                "length_scale": scale,
                "audio_share": audio_share(m),
                "varied": "scale" if share is None else "mix",
            }
            p = _fig8_point(
                sw, m, d, seed, None, steps=default_steps(d), figure="sensitivity_case", tags=tags
            )
            rec = {
                "figure": "sensitivity", "model": model, "ranks": d, "seed": seed, **tags,
                "b_none": p["b_none"], "b_full": p["b_full"],
                "paper_b_none": PAPER["minibatch_none"][model],
                "paper_b_full": PAPER["minibatch_full"][model],
                "paper_mfu_ratio": PAPER["fig8_mfu_ratio"].get(model),
                **{k: (p["own"] or {}).get(k) for k in SENSITIVITY_KEYS},
                **{f"at_paper_{k}": p["paper"][k] for k in SENSITIVITY_KEYS},
                "at_paper_oom": p["paper"]["oom"],
            }  # fmt: skip
            sw.records.append(rec)
            rows.append(
                [model, scale, f"{rec['audio_share']:.2f}", rec["b_none"], rec["b_full"],
                 f"{rec['paper_b_none']}->{rec['paper_b_full']}"]
                + [rec[k] for k in SENSITIVITY_KEYS]
                + ["OOM" if rec["at_paper_oom"] else "ok"]
                + [rec[f"at_paper_{k}"] for k in SENSITIVITY_KEYS]
            )  # fmt: skip
    print_table(
        f"Sensitivity of Figure 8 to the workload ({d} GPUs, hybrid-shard group "
        f"{min(d, 256)}; seed {seed}, {default_steps(d)} step(s)): every "
        "length times a scale, and the audio tasks' share of the tasks with an image or a clip "
        "(at scale 1); the largest fitting mini-batches and their factors, then the factors at "
        "the paper's mini-batches (OOM: the memory model does not fit them)",
        ["model", "scale", "audio share", "b none", "b full", "paper b", "balance x",
         "mini-batch x", "product x", "paper b mem", "balance x", "mini-batch x", "product x"],
        rows,
    )  # fmt: skip
    if "mllm-10b" not in sw.models:
        return
    rows = []
    for r in (table2_scale(sw, t) for t in table2_ranks):
        rows.append([r["ranks"], r["forward_s_at_1"], r["paper_forward_s"], r["scale"],
                     r.get("forward_s"), "OOM" if r.get("oom") else "ok"])  # fmt: skip
    print_table(
        "Derived, not used: the length scale at which Table 2's forward time (MLLM-10B, "
        "mini-batch 60, full) equals the paper's ('-': outside the scales searched)",
        ["GPUs", "forward s at 1", "paper", "scale", "forward s there", "mem"],
        rows,
    )
