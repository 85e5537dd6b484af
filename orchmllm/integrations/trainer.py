"""A ``transformers.Trainer`` (or TRL's ``SFTTrainer``) whose training batches are balanced.

A Trainer script becomes balanced by its import and its class (``pip install -e ".[trainer]"``)::

    from orchmllm.integrations.trainer import BalancedTrainer

    trainer = BalancedTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)

and a TRL script by a two-line subclass::

    from orchmllm.integrations.trainer import BalancedTrainerMixin

    class BalancedSFTTrainer(BalancedTrainerMixin, SFTTrainer): pass

A vision-language model goes in through its adapter, its towers and language model balanced
phase by phase (``orchmllm.integrations.transformers``)::

    trainer = BalancedTrainer(model=omt.wrap(model), args=args, train_dataset=rows, ...)

What the mixin keeps of the Trainer, and why it is exact:

- The Trainer's own loader is wrapped, not replaced (:meth:`get_train_dataloader`): its
  sampler, data seed, workers, pinning, ``drop_last``, column removal and collator stay as the
  Trainer built them, and so do its epoch semantics (accelerate shards the batches and, with
  ``even_batches``, wraps the last ones around). Each micro-batch is then balanced before it is
  collated; gradient accumulation pulls balanced micro-batches one by one, so each of them is
  balanced on its own and every rank runs the same number.
- The loss: with ``average_tokens_across_devices`` (the default) and a model that takes
  ``num_items_in_batch`` (every causal LM in transformers; or a ``compute_loss_func``), the
  Trainer divides the summed loss by the count of target tokens over all ranks and all
  micro-steps of the step, a count that balancing does not change, so the gradients equal an
  unbalanced run's. Do not add the README's ``global_num_items`` lines to a Trainer: it already
  normalises. Otherwise each rank averages its own tokens and balancing would reweight them;
  the mixin warns (:class:`LossNormalisationWarning`).
- Resuming from a checkpoint: the Trainer skips the batches an interrupted epoch trained
  through accelerate's ``skip_first_batches``, which needs a ``DataLoader``; for a balanced
  loader it resumes through :meth:`~orchmllm.BalancedDataLoader.load_state_dict` instead, which
  skips the sampled batches without loading them (installed once, by the first mixin built:
  :func:`install_resume`).
- The policy follows the collator's layout when ``planning`` is not given: padded batches
  (transformers' padding collators, TRL's collator) ``padded_cost``, packed ones
  (``DataCollatorWithFlattening``, TRL's ``padding_free=True``) ``greedy``.
- An adapted VLM (a ``BalancedModel``, from ``omt.wrap``): the Trainer's loader is wrapped by
  the model's own (:meth:`~orchmllm.integrations.transformers.BalancedModel.loader`: the
  adapter collates the processor's rows and every phase's plan is made ahead), each
  micro-batch reaches the model as ``{"batch": planned}`` through the Trainer's own
  ``compute_loss``, and ``num_items_in_batch`` is the plans' target count summed over the
  step's micro-batches: the plain Trainer's count of shifted labels over all ranks, known
  without a collective. The model divides by it and the Trainer scales by the world size
  (``average_tokens_across_devices``, required), so the gradients are a plain run's under
  DDP, which the Trainer wraps the model in as usual. Column removal keeps the HF model's
  inputs. transformers marks some VLMs (Qwen2-VL, Qwen2.5-VL) ``accepts_loss_kwargs=False``:
  their plain Trainer averages each rank's micro-batch mean, which balancing would reweight,
  so a balanced run equals their plain run with ``model.accepts_loss_kwargs = True`` (the
  mixin warns).
- An adapted VLM in TRL's ``SFTTrainer``: TRL patches the model's forward with its fused LM
  head (per-token log-probabilities computed from the HF backbone, which would run
  unbalanced); the mixin takes the patch off, and the wrapped model serves the same protocol
  from its balanced language-model phase (``forward(..., fused_lm_head=True)``). Each
  micro-batch also carries an ``attention_mask`` of ones over the rank's packed tokens, by
  which TRL counts the tokens it trains.
- Each logged step also logs the micro-batches' mean imbalance (max over mean rank cost, under
  the policy's cost model) and slowest rank's cost as sampled and as balanced since the
  previous log, per phase for a VLM (:func:`log_key`), so the Trainer's reporters show what
  balancing does. Under padding read the slowest rank's cost: a plan that removes padding
  lowers the mean, so the ratio can rise while every step got faster
  (:mod:`orchmllm.data.stats`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers.trainer as hf_trainer
from accelerate.data_loader import DataLoaderDispatcher
from transformers import Trainer

from orchmllm import (
    BalancedDataLoader,
    LoaderOptions,
    Orchestrator,
    PlannedBatch,
    PlanningOptions,
    SamplingOptions,
    Topology,
    collate_layout,
)
from orchmllm.integrations.transformers import BalancedModel

# The policy for each batch layout of the collator (module docstring); None: cannot tell.
POLICY_FOR_LAYOUT = {"padded": "padded_cost", "packed": "greedy", None: "greedy"}
# The loader's step statistics (``<phase>/<metric>``) each logged step averages (module
# docstring): the max/mean ratios and the slowest rank's cost, which the ratio alone misreads
# under padding (orchmllm.data.stats).
LOGGED_METRICS = ("imbalance_before", "imbalance_after", "load_max_before", "load_max_after")
TEXT_PHASE = "batch"  # the text loader's one phase, logged without its name


class LossNormalisationWarning(UserWarning):
    """The Trainer averages the loss per rank, so balancing changes each example's weight."""


def log_key(stat: str) -> str | None:
    """The Trainer's log key of a loader statistic ``<phase>/<metric>``: ``balance/<metric>``
    for the text loader's batch, ``balance/<phase>/<metric>`` for an adapted VLM's phases
    (``vision``, ``audio``, ``llm``...); None for a statistic that is not logged."""
    phase, _, metric = stat.rpartition("/")
    if metric not in LOGGED_METRICS or not phase:
        return None
    return f"balance/{metric}" if phase == TEXT_PHASE else f"balance/{phase}/{metric}"


def input_length(example: dict) -> int:
    """The default length of a training example: its ``input_ids`` count."""
    return len(example["input_ids"])


def collator_layout(collator: Any) -> str | None:
    """``"padded"``, ``"packed"`` or None for a Trainer's collator: the one the Trainer wraps
    to remove columns, TRL's language-modelling collator by its ``padding_free`` flag, else
    :func:`orchmllm.collate_layout`."""
    collator = getattr(collator, "data_collator", collator)  # transformers' RemoveColumnsCollator
    if type(collator).__module__.startswith("trl.") and hasattr(collator, "padding_free"):
        return "packed" if collator.padding_free else "padded"
    return collate_layout(collator)


class _Recording:
    """An epoch iterator that keeps each micro-batch's statistics as the Trainer pulls it."""

    def __init__(self, it: Iterator[Any], loader: BalancedDataLoader, sink: list[dict]) -> None:
        self.it, self.loader, self.sink = it, loader, sink

    def __iter__(self) -> _Recording:
        return self

    def __next__(self) -> Any:
        batch = next(self.it)
        self.sink.append(self.loader.last_stats)
        return batch


class _Resumed:
    """What the Trainer gets from ``skip_first_batches`` for a balanced loader: the loader,
    resumed ``skip`` batches into whichever epoch the Trainer sets next."""

    def __init__(self, loader: BalancedDataLoader, skip: int) -> None:
        self.loader, self.skip = loader, skip
        self.set_epoch(loader.epoch)

    def set_epoch(self, epoch: int) -> None:
        state = {"epoch": epoch, "step": self.skip, "seed": self.loader.sampling.seed}
        self.loader.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def install_resume() -> None:
    """Let the Trainer's resume skip a balanced loader's batches (module docstring): its
    ``skip_first_batches`` is wrapped once; any other loader goes to accelerate's as before."""
    original = hf_trainer.skip_first_batches
    if getattr(original, "balanced_resume", False):
        return

    @functools.wraps(original)
    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, BalancedDataLoader):
            return _Resumed(dataloader, num_batches)
        return original(dataloader, num_batches)

    skip_first_batches.balanced_resume = True
    hf_trainer.skip_first_batches = skip_first_batches


def _fuses_lm_head(trainer_class: type) -> bool:
    """Whether ``trainer_class`` is TRL's SFTTrainer or a subclass, which patches the model's
    forward with its fused LM head (read from its classes' names, so that TRL stays
    optional)."""
    classes = trainer_class.__mro__
    return any(c.__name__ == "SFTTrainer" and c.__module__.startswith("trl.") for c in classes)


def _packed_mask(planned: PlannedBatch) -> torch.Tensor:
    """Ones over this rank's packed LLM tokens of a planned batch (``[1, tokens]``)."""
    return torch.ones(1, int(planned.assembly.lengths.sum()), dtype=torch.int64)


class BalancedTrainerMixin:
    """Mix in before a ``transformers.Trainer`` class (``Trainer``, TRL's ``SFTTrainer``...):
    its training batches are balanced across data-parallel ranks (module docstring).

    Args (keyword-only, before the Trainer's own):
        length_fn: ``length_fn(example) -> int``, an example's cost unit (tokens), read from the
            dataset rows the Trainer's loader yields (after column removal). Default:
            :func:`input_length`.
        planning: an ``orchmllm.PlanningOptions`` (None: the policy for the collator's
            layout, :data:`POLICY_FOR_LAYOUT`).
        loader_options: an ``orchmllm.LoaderOptions`` (prefetch, metrics...); the workers
            are the Trainer's (``dataloader_num_workers``).
    """

    def __init__(
        self,
        *args: Any,
        length_fn: Callable[[Any], int] = input_length,
        planning: PlanningOptions | None = None,
        loader_options: LoaderOptions | None = None,
        **kwargs: Any,
    ) -> None:
        # Prefixed: a Trainer subclass has many attributes of its own.
        self.balance_length_fn = length_fn
        self.balance_planning = planning
        self.balance_loader_options = loader_options
        self._balanced: BalancedDataLoader | None = None  # the training loader, once built
        self._balance_stats: list[dict] = []  # the micro-batches' statistics since the last log
        super().__init__(*args, **kwargs)
        install_resume()
        vlm = self._adapted_model()
        # TRL patched the model's forward with its fused LM head, which would run the HF
        # backbone unbalanced; the balanced model serves the same per-token outputs from its
        # own phases (forward(..., fused_lm_head=True)), so the patch comes off. An older TRL
        # patches nothing and reads the labels before the forward: it cannot serve.
        fuses = vlm is not None and _fuses_lm_head(type(self))
        if fuses and vars(vlm).pop("forward", None) is None:
            raise ValueError(
                f"{type(self).__name__}: this TRL's SFTTrainer does not ask the model for "
                "per-token log-probabilities (its fused LM head, TRL's add_fused_lm_head): it "
                "reads the batch's labels before the forward, and an adapted VLM's targets "
                "exist only after balancing. Use BalancedTrainer, or a TRL with "
                "trl.trainer.add_fused_lm_head"
            )

    def get_train_dataloader(self) -> BalancedDataLoader:
        """The Trainer's own training loader, its batches balanced before collation."""
        vlm = self._adapted_model()
        if vlm is not None:
            self._prepare_adapted(vlm)
        loader = super().get_train_dataloader()
        if isinstance(loader, DataLoaderDispatcher):  # rank 0 reads, the others receive
            raise ValueError(
                "train_dataset is iterable, and accelerate dispatches its batches from rank 0, "
                "so every rank would read the whole stream: set TrainingArguments("
                "accelerator_config={'dispatch_batches': False}) (each rank reads its shard), "
                "or pass a map-style dataset"
            )
        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        sampling = SamplingOptions(seed=seed, drop_last=args.dataloader_drop_last)
        if vlm is not None:  # the adapter collates; every phase is planned ahead
            self._balanced = vlm.loader(
                loader, sampling=sampling, options=self.balance_loader_options
            )
            return self._balanced
        self._check_loss_normalisation()
        planning = self.balance_planning or PlanningOptions(
            policy=POLICY_FOR_LAYOUT[collator_layout(loader.collate_fn)]
        )
        self._balanced = BalancedDataLoader(
            loader,
            length_fn=self.balance_length_fn,
            planning=planning,
            sampling=sampling,
            options=self.balance_loader_options,
        )
        return self._balanced

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int, device: Any):
        """The Trainer's micro-batches of one step, their balance statistics kept for
        :meth:`log`."""
        if self._balanced is not None:
            epoch_iterator = _Recording(epoch_iterator, self._balanced, self._balance_stats)
        if self._adapted_model() is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        # An adapted VLM's planned batches: the count of their targets over every rank and
        # micro-step is in their plans (the plain Trainer's count of shifted labels).
        planned = list(itertools.islice(epoch_iterator, num_batches))
        targets = sum(p.plan.num_targets for p in planned)
        num_items = torch.tensor(targets, device=device) if planned else None
        # the mask counts this rank's packed tokens, as TRL counts the tokens it trains
        return [{"batch": p, "attention_mask": _packed_mask(p)} for p in planned], num_items

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's FLOPs estimate (6 x tokens x non-embedding parameters) for an adapted
        VLM's planned batch: the tokens are this rank's LLM sequences after balancing (the
        plain Trainer counts its padded ``input_ids``, so a balanced run reports no more)."""
        vlm = self._adapted_model()
        planned = inputs.get("batch") if vlm is not None else None
        if not isinstance(planned, PlannedBatch) or planned.assembly is None:
            return super().floating_point_ops(inputs)
        tokens = int(planned.assembly.lengths.sum())
        return 6 * tokens * vlm.model.num_parameters(exclude_embeddings=True)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the micro-batches' mean imbalance since the last one."""
        stats, self._balance_stats = self._balance_stats, []
        if "loss" in logs and stats:
            for stat in dict.fromkeys(k for s in stats for k in s):
                key = log_key(stat)
                if key is not None:
                    values = [s[stat] for s in stats if stat in s]
                    logs[key] = sum(values) / len(values)
        super().log(logs, *args, **kwargs)

    def num_examples(self, dataloader: Any) -> int:
        """The examples of the dataset under a balanced loader (the Trainer's count)."""
        while isinstance(dataloader, _Resumed | BalancedDataLoader):
            resumed = isinstance(dataloader, _Resumed)
            dataloader = dataloader.loader if resumed else dataloader.source
        return super().num_examples(dataloader)

    def _adapted_model(self) -> BalancedModel | None:
        """The Trainer's model when it is an adapted VLM (``omt.wrap(model)``), else None."""
        return self.model if isinstance(self.model, BalancedModel) else None

    def _prepare_adapted(self, vlm: BalancedModel) -> None:
        """Column removal and the loss checks for an adapted VLM (module docstring); its
        orchestrator's groups rebuilt if it was wrapped before ``TrainingArguments`` started
        ``torch.distributed`` (its topology then has no groups of its own)."""
        topology = vlm.orchestrator.topology
        if topology.distributed and topology.meta_group is None:
            topology = Topology.build(
                ranks_per_node=topology.ranks_per_node, timeout=topology.timeout
            )
            vlm.orchestrator = Orchestrator(vlm.orchestrator.options, topology=topology)
        if self._signature_columns is None:
            # column removal keeps what the HF model takes, not what the wrapper's forward does
            params = inspect.signature(vlm.model.forward).parameters
            self._signature_columns = [*params, "label", "label_ids", *self.label_names]
        if not self.args.average_tokens_across_devices:
            raise ValueError(
                "an adapted model divides its loss by the targets of all ranks, so the Trainer "
                "must scale it by the world size: set average_tokens_across_devices=True, got "
                "False"
            )
        if not getattr(vlm.model, "accepts_loss_kwargs", True):
            warnings.warn(
                f"{type(vlm.model).__name__} sets accepts_loss_kwargs=False, so a plain Trainer "
                "averages each rank's micro-batch mean; balanced, the loss is the mean over the "
                "targets of all ranks and micro-steps, as a plain Trainer's is with "
                "model.accepts_loss_kwargs = True",
                LossNormalisationWarning,
                stacklevel=3,
            )

    def _check_loss_normalisation(self) -> None:
        if self.args.average_tokens_across_devices and (
            self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        ):
            return
        warnings.warn(
            "the Trainer averages the loss over each rank's own tokens (average_tokens_across_"
            f"devices={self.args.average_tokens_across_devices}, model takes num_items_in_batch: "
            f"{self.model_accepts_loss_kwargs}), so balancing changes the examples' weights: "
            "set average_tokens_across_devices=True and use a model whose forward takes "
            "num_items_in_batch, or pass a compute_loss_func",
            LossNormalisationWarning,
            stacklevel=3,
        )


class BalancedTrainer(BalancedTrainerMixin, Trainer):
    """``transformers.Trainer`` with balanced training batches (:class:`BalancedTrainerMixin`)."""
