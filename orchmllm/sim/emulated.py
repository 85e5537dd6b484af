"""The set-up ``benchmarks/gpu_step.py`` measures, simulated: data-parallel ranks on one device.

gpu_step runs every emulated rank's step on one device, one rank after another: one copy of
the parameters in the recipe's compute dtype, no optimizer and no FSDP (gradients accumulate in
place), the config's training recipe otherwise (checkpointing, chunked loss), the all-to-alls
estimated from the planned moves at ``link_gbs`` per rank and direction with no per-peer
latency, and the planning time added to the step of every mode that plans (``none`` plans
nothing). This module models that set-up and nothing else, so its prediction can sit beside
each measured figure (gpu_step prints both) and be checked against committed records
(``reproduce_paper.py --gpu-results``). Its memory is the trainer's replayed step
(:mod:`orchmllm.sim.memory`) without FSDP and without an optimizer
(:func:`emulated_memory`); gpu_step's stand-in encoder outputs and upstream gradients are
not in it.

The step is the simulator's (:func:`orchmllm.sim.step.simulate_step`): per phase the slowest
rank's calibrated compute, plus the dispatch. The ideal step gives every phase its mean rank
time, as gpu_step's does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchmllm.config import load_config
from orchmllm.schema import LLM
from orchmllm.sim.batch import Batch
from orchmllm.sim.comm import Network
from orchmllm.sim.compute import submodules
from orchmllm.sim.layout import plan
from orchmllm.sim.memory import MemoryModel
from orchmllm.sim.step import Cluster, simulate_step
from orchmllm.sim.sweep import SimModel, load_model

DEFAULT_RANKS_PER_NODE = 8  # one H100 node, when the config leaves it unset (as gpu_step)


def emulated_memory(device: str) -> MemoryModel:
    """One device holds the whole model in the compute dtype and its gradients; no optimizer
    state, nothing sharded, no previous step held (each emulated rank starts afresh)."""
    return MemoryModel(shard_group=1, device=device, fsdp=False, optimizer=False,
                       previous_batch=False)  # fmt: skip


@dataclass(frozen=True)
class EmulatedSetup:
    """The model, topology and link a gpu_step run emulates; :meth:`predict` simulates it."""

    model: SimModel
    ranks_per_node: int  # the config's (8, one H100 node, when unset), as gpu_step reads it
    policies: Mapping[str, str]  # phase -> balancing policy, from the config
    link_gbs: float  # gpu_step's --link-gbs
    device: str = "cuda"  # where gpu_step ran (its kernels and AdamW-free memory)

    @classmethod
    def load(
        cls,
        config: str | Path,
        *,
        layers: Mapping[str, int],
        link_gbs: float,
        device: str = "cuda",
    ) -> EmulatedSetup:
        """The run config ``config`` with ``layers`` (phase name -> layer count: every
        encoder's and the LLM's) under its training recipe, as gpu_step builds it, on
        ``device`` (``cuda`` or ``cpu``: which kernels its memory counts)."""
        run = load_config(config)
        if set(layers) != set(run.phases):
            raise ValueError(f"layers must name {run.phases}, got {sorted(layers)}")
        if not link_gbs > 0:
            raise ValueError(f"link_gbs must be > 0, got {link_gbs!r}")
        base = load_model(str(config))
        encoders = {
            n: dataclasses.replace(e, layers=int(layers[n]))
            for n, e in base.config.encoders.items()
        }
        llm = dataclasses.replace(base.config.llm, layers=int(layers[LLM]))
        scaled = dataclasses.replace(base.config, encoders=encoders, llm=llm)
        modules = submodules(scaled, checkpointing=base.recipe.checkpointing > 0)
        model = SimModel(base.name, scaled, base.data, modules, base.recipe)
        policies = {p: run.balance.policy(p) for p in run.phases}
        rpn = run.balance.ranks_per_node or DEFAULT_RANKS_PER_NODE
        return cls(model, int(rpn), policies, float(link_gbs), device)

    def cluster(self, num_ranks: int) -> Cluster:
        """gpu_step's all-to-all estimate (``link_gbs`` on every link, no per-peer latency)
        and one device's memory (:func:`emulated_memory`)."""
        link = self.link_gbs * 1e9
        rpn = min(self.ranks_per_node, num_ranks)
        net = Network(ranks_per_node=rpn, bw_intra=link, bw_inter=link, peer_latency_s=0.0)
        return Cluster(net=net, memory=emulated_memory(self.device))

    def predict(
        self, batches: Sequence[Batch], *, modes: Sequence[str] = ("none", "llm", "full")
    ) -> dict[str, dict[str, float]]:
        """Per mode, the simulated figures gpu_step measures, averaged over ``batches`` (one
        per measured step; every mode sees the same batches): ``step_time_s``, ``ideal_step_s``,
        ``step_over_ideal``, ``peak_mem_bytes`` (worst rank of the worst step), per phase
        ``<phase>_max_s`` and ``<phase>_mean_s`` (slowest and mean rank compute, what gpu_step
        times per phase) and, where ``modes`` include the baseline, ``speedup_vs_none`` and
        ``speedup_vs_llm``."""
        if not batches:
            raise ValueError("batches must hold at least one step's batch")
        m = self.model
        cluster = self.cluster(batches[0].num_ranks)
        rpn = cluster.net.ranks_per_node
        out: dict[str, dict[str, float]] = {}
        for mode in modes:
            steps, ideals, peaks, phase = [], [], [], {}
            for batch in batches:
                layout = plan(
                    batch, mode, config=m.config, modules=m.modules, placement="node",
                    ranks_per_node=rpn, policies=self.policies,
                )  # fmt: skip
                res = simulate_step(
                    batch, layout, mode, config=m.config, modules=m.modules,
                    recipe=m.recipe, cluster=cluster,
                )  # fmt: skip
                # gpu_step puts the planning time on the step of every mode that plans
                steps.append(res.step_time_s + (layout.plan_ms * 1e-3 if mode != "none" else 0))
                ideals.append(sum(res.mean_compute_s.values()))
                peaks.append(res.peak_memory_bytes)
                for p, t in res.compute_s.items():
                    phase.setdefault(f"{p}_max_s", []).append(t)
                    phase.setdefault(f"{p}_mean_s", []).append(res.mean_compute_s[p])
            step, ideal = float(np.mean(steps)), float(np.mean(ideals))
            out[mode] = {
                "step_time_s": step,
                "ideal_step_s": ideal,
                "step_over_ideal": step / ideal if ideal > 0 else 1.0,
                "peak_mem_bytes": float(max(peaks)),
                **{k: float(np.mean(v)) for k, v in phase.items()},
            }
        for base in ("none", "llm"):
            if base in out:
                for rec in out.values():
                    rec[f"speedup_vs_{base}"] = out[base]["step_time_s"] / rec["step_time_s"]
        return out
