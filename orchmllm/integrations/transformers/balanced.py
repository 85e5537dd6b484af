"""An HF vision-language model trained as orchmllm phases: :func:`wrap`, :func:`shard`.

:class:`BalancedModel` holds the HF model, its adapter and an ``orchmllm.Orchestrator``; its
``forward`` is one training step's forward: the towers encode their balanced items, the
encoder outputs move to the LLM layout, and the language model runs on this rank's packed
sequences, called the way packing needs (no cache, no attention mask, positions that restart
per sequence, an attention implementation that builds the block-diagonal mask from them). The
loss is normalised by the prediction targets of all ranks, so balancing never changes the
gradient.

The LM head's logits are ``[tokens, vocab]`` (152,064 entries a token for Qwen2.5-VL), the
largest tensor of a step. By default the forward returns them, as an HF model's does; with
``keep_logits=False`` it computes the loss ``loss_chunk`` tokens at a time and keeps none (what
a fused linear-cross-entropy kernel such as Liger's gives a plain HF model, which this
model's own forward bypasses). TRL's trainers ask a model for per-token log-probabilities
instead (their "fused LM head": ``forward(..., fused_lm_head=True)``), which the forward serves
in chunks too.

With ``wrap(model, context_parallel=N, llm_max_load=B)`` the plan may split an example longer
than a rank's budget over up to N ranks; the language model then runs on the pieces, with
their global positions, its attention through :mod:`.split_attention`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers.utils import ModelOutput

import orchmllm
from orchmllm.integrations import hf_compat
from orchmllm.integrations.transformers.adapter import PACKING_ATTENTION, Adapter, adapter_for
from orchmllm.integrations.transformers.split_attention import (
    PREFIX,
    attention_name,
    original_attention,
    pieces_attention,
)
from orchmllm.schema import IGNORE_INDEX, LLM


@dataclass
class BalancedOutput(ModelOutput):
    """What :meth:`BalancedModel.forward` returns (a ``ModelOutput``, as the Trainer expects).

    Attributes:
        loss: this rank's share of the global mean loss (its targets' summed loss over the
            targets of all ranks); multiply by the world size for FSDP2 or DDP, which average
            gradients over ranks.
        logits: ``[1, tokens, vocab]`` over this rank's packed sequences (None with
            ``fused_lm_head`` or ``keep_logits=False``).
        batch: the step's :class:`orchmllm.LLMBatch` (sequence lengths, example ids, the
            phases' statistics).
        log_probs, entropy, is_top1, label_mask: with ``fused_lm_head`` (TRL's protocol),
            ``[1, tokens]`` over this rank's packed sequences: each target's log-probability,
            the next-token entropy, whether the target is the top token, and whether a target
            is there (the others are zero where it is not).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    batch: orchmllm.LLMBatch | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None


class BalancedModel(nn.Module):
    """An HF vision-language model whose step runs balanced, phase by phase.

    Build it with :func:`wrap`; feed it the batches of :meth:`loader`.

    Args:
        model: the HF model (``...ForConditionalGeneration``).
        adapter: how its family runs as phases.
        orchestrator: plans and moves every step (its phases are the adapter's).
        loss_chunk: tokens per chunk of the LM head where it is chunked (``fused_lm_head``,
            or ``keep_logits=False``).
        keep_logits: return the logits (and compute the loss over them, as the HF model
            does); False: the chunked loss, no logits.
        calibrator: times every phase in the first forwards and fits their costs with the
            other ranks (``wrap(model, cost="measured")``); None: the policies' costs.

    Attributes:
        model, adapter, orchestrator, loss_chunk, keep_logits, calibrator: as given.
        loads: phase name (and ``"llm"``) -> the raw rows (encoders) and tokens (LLM) this rank
            computed in the last step, for reporting balance.
        calibration: with a calibrator, its record of the last timed forward (per phase the
            measured imbalance and, when refitted, the coefficients and R^2).
    """

    # The Trainer passes num_items_in_batch to forward (its count over micro-steps and ranks).
    accepts_loss_kwargs = True

    def __init__(
        self,
        model: nn.Module,
        adapter: Adapter,
        orchestrator: orchmllm.Orchestrator,
        *,
        loss_chunk: int = orchmllm.TrainRecipe.loss_chunk,
        keep_logits: bool = True,
        calibrator: orchmllm.Calibrator | None = None,
    ) -> None:
        super().__init__()
        if isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 1:
            raise ValueError(f"loss_chunk must be a positive integer, got {loss_chunk!r}")
        self.model = model
        self.adapter = adapter
        self.orchestrator = orchestrator
        self.loss_chunk = loss_chunk
        self.keep_logits = keep_logits
        self.calibrator = calibrator
        self.calibration: dict[str, dict] = {}
        self.loads: dict[str, int] = {}
        self._loader: orchmllm.BalancedDataLoader | None = None
        self._forwards = 0

    @property
    def config(self) -> Any:
        """The HF model's config (trainers read the model's settings from it)."""
        return self.model.config

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Tags for the HF model's card (TRL's trainers add theirs)."""
        self.model.add_model_tags(tags)

    def activation_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """The HF model's activation checkpointing (a Trainer's ``gradient_checkpointing``,
        the HF model's arguments): its blocks recompute their activations in backward, inside
        the balanced phases."""
        hf_compat.checkpointing(self.model, True, *args, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        hf_compat.checkpointing(self.model, False)

    # the names older Trainers call
    gradient_checkpointing_enable = activation_checkpointing_enable
    gradient_checkpointing_disable = activation_checkpointing_disable

    def loader(
        self,
        dataset: Any,
        *,
        batch_size: int | None = None,
        sampling: orchmllm.SamplingOptions | None = None,
        options: orchmllm.LoaderOptions | None = None,
        **dataloader_kwargs: Any,
    ) -> orchmllm.BalancedDataLoader:
        """The balanced loader over ``dataset``'s processor rows (each turned into orchmllm's
        schema by the adapter): it samples like ``DistributedSampler`` and plans each step
        ahead in a background thread. Iterate it and pass each batch to this model.

        ``dataset`` may be a ``DataLoader`` (a Trainer's): its sampler, batches and workers are
        kept, its collate function is replaced by the adapter's, and ``batch_size`` is None.
        ``DataLoader``'s own keywords (``shuffle=``, ``num_workers=``...) are taken as the
        ``BalancedDataLoader`` takes them."""
        self._loader = orchmllm.orchestrated_loader(
            dataset,
            self.orchestrator,
            batch_size=batch_size,
            to_example=self.adapter.to_example,
            sampling=sampling,
            options=options,
            topology=self.orchestrator.topology,
            **dataloader_kwargs,
        )
        return self._loader

    def forward(
        self,
        batch: orchmllm.PlannedBatch | list,
        *,
        num_items_in_batch: int | torch.Tensor | None = None,
        fused_lm_head: bool = False,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
    ) -> BalancedOutput:
        """One step's forward on this rank.

        A collective on the orchestrator's groups: every rank calls it together.

        Args:
            batch: a batch of :meth:`loader` (planned ahead), or this rank's processor rows
                (planned now; without ``torch.distributed`` the one process plans alone).
            num_items_in_batch: the count of prediction targets the summed loss is divided by
                (None: the step's, over all ranks). A ``transformers.Trainer`` passes its count
                over every rank and micro-step of a gradient accumulation.
            fused_lm_head: TRL's protocol: per-token log-probabilities, entropies and top-1
                flags (:class:`BalancedOutput`) in chunks of ``loss_chunk`` tokens, no logits.
            attention_mask: a Trainer's token count of this rank (TRL counts the tokens it
                trains by it): ones over the packed tokens, checked against them. The packed
                sequences need no mask (their positions say where each starts).
            use_cache: a Trainer's flag; a training step keeps no cache (True is refused).

        Returns:
            The :class:`BalancedOutput`.

        Raises:
            TypeError: ``batch`` is neither (a plain ``DataLoader``'s collated dict, say).
            ValueError: ``use_cache`` is True, ``attention_mask`` does not count this rank's
                packed tokens, a chunked head (``fused_lm_head``, ``keep_logits=False``) on
                an LM head that has a bias, or the step has no prediction target on any rank
                (its loss would be 0/0).
        """
        _check_batch(batch)
        if use_cache:
            raise ValueError("use_cache must be None or False for a training step, got True")
        orch = self.orchestrator
        if isinstance(batch, list):
            local = orchmllm.LocalBatch.from_examples(
                [self.adapter.to_example(r) for r in batch], orch.phases
            )
            plan = assembly = None
            if not orch.topology.distributed:
                src = np.zeros(len(local.metadata), np.int64)
                plan = orch.plan(local.metadata, src)
        else:
            local, plan, assembly = batch.batch, batch.plan, batch.assembly
        model = self.model
        device = model.get_input_embeddings().weight.device
        cal = self.calibrator
        cal = cal if cal is not None and cal.active(self._forwards) else None
        encoders = {p.name: self._encoder(p) for p in orch.phases}
        encoders = cal.encoders(encoders) if cal else encoders
        out = orch.run(local.to(device), encoders, plan=plan, assembly=assembly)
        if out.pieces is not None:
            _check_split_attention(model)
        with cal.timed(LLM, out.lengths) if cal else contextlib.nullcontext():
            embeds = out.assemble(model.get_input_embeddings()(out.input_ids))
            positions = self.adapter.position_ids(out)
            kwargs = self.adapter.language_kwargs(out)
            with pieces_attention(out) as split:
                hidden = self.adapter.language_model(model)(
                    inputs_embeds=embeds[None],
                    position_ids=positions,
                    attention_mask=None,  # the positions say where each packed sequence starts
                    use_cache=False,  # with a cache, transformers would not derive that mask
                    **kwargs,
                    **split,
                ).last_hidden_state
        if cal:
            self._calibrate(cal)
        self._forwards += 1
        tokens = int(out.lengths.sum())
        self.loads["llm"] = tokens
        if attention_mask is not None and attention_mask.numel() != tokens:
            raise ValueError(
                f"attention_mask must count this rank's {tokens} packed tokens, got "
                f"{attention_mask.numel()} entries"
            )
        if num_items_in_batch is None:
            num_items_in_batch = out.num_targets  # over all ranks
        _check_targets(num_items_in_batch)
        head = model.get_output_embeddings()
        if (fused_lm_head or not self.keep_logits) and getattr(head, "bias", None) is not None:
            raise ValueError("the chunked LM head does not add a bias, and this head has one")
        if fused_lm_head:
            scores = orchmllm.token_log_probs(
                hidden[0], head.weight, out.targets, chunk=self.loss_chunk
            )
            loss = -scores.log_probs.sum() / num_items_in_batch
            mask = out.targets != IGNORE_INDEX
            return BalancedOutput(loss, None, out, *(x[None] for x in (*scores, mask)))
        if not self.keep_logits:
            loss = orchmllm.chunked_cross_entropy(
                hidden[0], head.weight, out.targets, chunk=self.loss_chunk,
                denom=float(num_items_in_batch),
            )  # fmt: skip
            return BalancedOutput(loss, None, out)
        logits = head(hidden)
        loss = model.loss_function(
            logits=logits,
            labels=None,
            shift_labels=out.targets[None],  # the orchestrator's targets are shifted already
            vocab_size=logits.shape[-1],
            num_items_in_batch=num_items_in_batch,
        )
        return BalancedOutput(loss, logits, out)

    def _calibrate(self, cal: orchmllm.Calibrator) -> None:
        """Gather this forward's phase times of every rank (a collective) and plan with the
        trusted fits: the loader's steps from one its prefetcher has not begun, and the plans
        made in :meth:`forward` from the next one."""
        report = cal.end_step(self._forwards, timeout=self.orchestrator.topology.timeout)
        self.calibration = report.record()
        costs = report.costs()
        if costs:
            if self._loader is not None:
                self._loader.set_costs(costs)
            self.orchestrator.options = self.orchestrator.options.with_costs(costs)

    def _encoder(self, phase: orchmllm.EncoderPhase) -> Callable[..., orchmllm.Encoded]:
        """``phase``'s encoder for the orchestrator: the adapter's, on a dummy item (of which
        it keeps no token) where this rank has none, so every rank calls every tower."""

        def encode(
            rows: torch.Tensor, lengths: torch.Tensor, meta: dict | None = None
        ) -> orchmllm.Encoded:
            self.loads[phase.name] = int(lengths.sum())
            empty = lengths.numel() == 0
            if empty:
                item = self.adapter.dummy(phase.name)
                rows = torch.as_tensor(item.rows, dtype=rows.dtype, device=rows.device)
                lengths = torch.tensor([rows.shape[0]], device=rows.device)
                meta = {
                    f.name: torch.as_tensor(
                        np.asarray(item.meta[f.name]), dtype=getattr(torch, f.dtype)
                    ).reshape(1, f.width).to(rows.device)
                    for f in phase.fields
                }  # fmt: skip
            out = self.adapter.encode(self.model, phase.name, rows, lengths, meta or {})
            if empty:
                out = orchmllm.Encoded(out.embeds[:0], {k: v[:0] for k, v in out.values.items()})
            return out

        return encode


def _check_batch(batch: Any) -> None:
    """A clear error for what the forward cannot take, before anything runs: it takes the
    planned batches of :meth:`BalancedModel.loader` or a list of processor rows, not the
    collated dict a plain ``DataLoader`` makes (which would fail as "no attribute 'batch'")."""
    if isinstance(batch, list | orchmllm.PlannedBatch):
        return
    what = f"a dict with keys {sorted(batch)}" if isinstance(batch, dict) else type(batch).__name__
    raise TypeError(
        f"batch must be a batch of model.loader(dataset, ...) (an orchmllm.PlannedBatch) or a "
        f"list of this rank's processor rows, got {what}: iterate model.loader(dataset, "
        "batch_size=...) over the processor's rows instead of a plain DataLoader"
    )


def _check_split_attention(model: nn.Module) -> None:
    """A split step needs the attention :func:`wrap` set (another one would attend each piece
    over its own keys only, silently)."""
    attention = model.config.get_text_config()._attn_implementation
    if not str(attention).startswith(PREFIX):
        raise ValueError(
            f"the step split an example over ranks but the language model's attention "
            f"implementation is {attention!r}, not the split attention wrap(context_parallel=N) "
            "sets: do not change it after wrap"
        )


def _check_targets(num_items: int | torch.Tensor) -> None:
    """Refuse a step whose loss would divide by zero targets (a NaN loss otherwise): a plain
    count, as the forward's own, is checked; a Trainer's tensor is left on its device."""
    if not isinstance(num_items, torch.Tensor) and num_items <= 0:
        raise ValueError(
            f"the step has {num_items} prediction targets over all ranks (every label is -100 "
            "or the sequences are one token long), so its loss is 0/0: check the rows' "
            "labels, or skip batches without targets"
        )


def wrap(
    model: nn.Module,
    *,
    mode: str = "full",
    adapter: Adapter | None = None,
    topology: orchmllm.Topology | None = None,
    llm_policy: str = "greedy",
    loss_chunk: int = orchmllm.TrainRecipe.loss_chunk,
    keep_logits: bool = True,
    cost: str = "default",
    calibrate_steps: int = 8,
    context_parallel: int = 1,
    llm_max_load: float | None = None,
) -> BalancedModel:
    """Balance an HF vision-language model: its towers and its language model become phases.

    Args:
        model: an HF model whose class (or a base class) has a registered adapter.
        mode: ``"full"`` balances every phase, ``"llm"`` only the language model, ``"none"``
            moves nothing (``orchmllm.planner.step_options.MODES``).
        adapter: the adapter to use (None: the one registered for the model's class).
        topology: the process groups (None: a topology over the default group).
        llm_policy: the language model's balancing policy.
        loss_chunk: tokens per chunk of the LM head where it is chunked (a trainer asking
            for per-token log-probabilities, TRL's ``fused_lm_head``; ``keep_logits=False``).
        keep_logits: the forward returns the ``[1, tokens, vocab]`` logits (as an HF model
            does); False: it computes the loss in chunks and keeps no logits (the memory of a
            fused linear-cross-entropy kernel).
        cost: ``default``: the policies' costs; ``measured``: every rank times each phase in
            the first ``calibrate_steps`` forwards, and the phases' costs are fitted to the
            times of all ranks and planned with (:class:`orchmllm.Calibrator`; every forward
            is then a collective point where the ranks gather their times).
        calibrate_steps: the forwards timed with ``cost="measured"``.
        context_parallel: ``N`` > 1 lets the plan split an example over up to ``N`` ranks of
            a context-parallel group (``orchmllm.StepOptions``), when it is longer than
            ``llm_max_load`` or where that lowers the slowest rank: each rank runs its pieces
            with their global positions, and the language model's attention implementation
            becomes :func:`.split_attention.attention_name` of its own (the model's text
            config, through ``set_attn_implementation``), which gathers each split sequence's
            keys and values in its group. Needs ``torch.distributed`` initialised (the groups
            are opened here, a collective) and ``llm_policy="greedy"``.
        llm_max_load: the LLM phase's per-rank budget in its cost (tokens for the default
            cost) that splits longer examples; only with ``context_parallel`` > 1.

    Returns:
        The :class:`BalancedModel`; shard it with :func:`shard` (or your own FSDP2 wiring whose
        root is the returned module).

    Raises:
        ValueError: no adapter is registered for the model's class, its language model's
            attention implementation cannot attend within packed sequences, ``loss_chunk``
            is not a positive integer, or ``context_parallel``/``llm_max_load`` are refused
            by ``orchmllm.StepOptions`` or the topology.
    """
    adapter = adapter or adapter_for(model)
    text = model.config.get_text_config()
    attention = original_attention(getattr(text, "_attn_implementation", None) or "eager")
    if attention not in PACKING_ATTENTION:
        raise ValueError(
            f"the language model's attention implementation {attention!r} cannot attend "
            f"within packed sequences; use one of {PACKING_ATTENTION}"
        )
    if cost not in orchmllm.COSTS:
        raise ValueError(f"cost must be one of {orchmllm.COSTS}, got {cost!r}")
    options = orchmllm.StepOptions(
        adapter.phases(), mode=mode, llm_policy=llm_policy, context_parallel=context_parallel,
        llm_max_load=llm_max_load,
    )  # fmt: skip
    orchestrator = orchmllm.Orchestrator(options, topology=topology)
    if context_parallel > 1:
        model.set_attn_implementation({"text_config": attention_name(attention)})
    calibrator = None
    if cost == "measured":
        device = model.get_input_embeddings().weight.device
        calibrator = orchmllm.Calibrator.for_options(
            orchestrator.options, device=device, steps=calibrate_steps
        )
    return BalancedModel(
        model, adapter, orchestrator, loss_chunk=loss_chunk, keep_logits=keep_logits,
        calibrator=calibrator,
    )  # fmt: skip


def shard(model: BalancedModel, *, reduce_unused: bool = False, **fsdp: Any) -> BalancedModel:
    """FSDP2 for a :class:`BalancedModel`: ``fully_shard`` every block of the HF model (its
    ``_no_split_modules`` classes: decoder layers, tower blocks), then the
    :class:`BalancedModel` as the root, so the whole step runs inside the root's hooks.

    A parameter the model never uses (LLaVA's last vision layer: it reads the one before) gets
    no gradient on any rank and keeps ``None``, as in a plain run, so AdamW leaves it alone.
    That needs every rank to reduce the same parameters, which the balanced step gives: a
    tower runs on every rank (on a dummy item where a rank has none) whenever some rank has an
    item of its phase, and on none when no rank has.

    Args:
        model: from :func:`wrap`.
        reduce_unused: reduce-scatter zeros for parameters without a gradient (FSDP2's
            ``set_reduce_scatter_unused_params``). Only for a model whose ranks use different
            parameters for other reasons than items (mixture-of-experts routing): FSDP2 would
            otherwise reduce different tensors on different ranks. It costs exactness: a
            parameter unused on every rank gets a zero gradient, which AdamW applies (weight
            decay, momentum), where a plain run leaves it unchanged.
        fsdp: passed to every ``fully_shard`` call (``mesh``, ``mp_policy``, ...).

    Returns:
        ``model``, sharded in place.
    """
    blocks = set(getattr(model.model, "_no_split_modules", None) or ())
    for module in reversed(list(model.model.modules())):  # inner blocks before outer ones
        if type(module).__name__ in blocks:
            fully_shard(module, **fsdp)
    fully_shard(model, **fsdp)
    if model.calibrator is not None:  # its phases' times less FSDP's all-gather waits
        model.calibrator.watch(model)
    if reduce_unused:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_reduce_scatter_unused_params(True)
    return model
