"""A ``transformers.Trainer`` script (or TRL's ``SFTTrainer``), balanced by OrchMLLM.

    torchrun --nproc_per_node=2 examples/hf_trainer.py                    # balanced
    torchrun --nproc_per_node=2 examples/hf_trainer.py --balance none     # the plain Trainer
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py --trainer sft
    torchrun --nproc_per_node=2 examples/hf_trainer.py --model qwen2.5-vl  # a VLM, its adapter
    torchrun --nproc_per_node=2 examples/hf_trainer.py --model qwen2.5-vl --trainer sft

The model is a tiny ``LlamaForCausalLM`` with random weights and the tokenizer a word-level one
built here (nothing is downloaded; on CPU the ranks talk gloo, under accelerate too); the
examples have heavy-tailed lengths and the collator pads (transformers'
``DataCollatorForLanguageModeling``, or TRL's). From the plain script to the balanced one, one
line changes (marked ``# orchmllm``)::

    - trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    + trainer = BalancedTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)

plus its import; for TRL, a two-line subclass (``class BalancedSFTTrainer(BalancedTrainerMixin,
SFTTrainer): pass``). The Trainer already normalises the loss by the target tokens of all ranks
and micro-steps, so nothing else changes, and both runs print the same losses.

``--model`` names a vision-language family instead (a tiny model of
``orchmllm.integrations.transformers.tiny.FAMILIES`` and its processor's rows: images, videos
and audio mixed; the collator is ``tiny.collate``). The balanced script also wraps the model in
its adapter, so its towers and language model are balanced phase by phase::

    + model = omt.wrap(model)

With ``--trainer sft`` the rows go to TRL's SFTTrainer as a ``datasets.Dataset``, unprepared
(``VLM_SFT``); TRL asks the model for per-token log-probabilities (its fused LM head), which
the wrapped model computes from its balanced language-model phase.

The plain run sets ``model.accepts_loss_kwargs = True`` (transformers marks Qwen2-VL and
Qwen2.5-VL False, and their plain Trainer would then average each rank's micro-batch mean), so
that it too takes the mean over the targets of all ranks and micro-steps; DDP wraps the model
in both runs.

``--resume-at K`` saves a checkpoint at step K and trains a second Trainer from it: its losses
are the rest of the first run's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from orchmllm.integrations import transformers as omt  # orchmllm (--model: a VLM)
from orchmllm.integrations.trainer import (  # orchmllm
    LOGGED_METRICS,
    BalancedTrainer,
    BalancedTrainerMixin,
)
from orchmllm.integrations.transformers import tiny

VOCAB = 64


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``VOCAB`` words ``w0 w1 ...`` (id 0 pads)."""
    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="w1")


def make_dataset(num_examples: int, *, max_len: int, seed: int) -> Dataset:
    """Tokenised examples with heavy-tailed lengths (as chat and code data have), and an ``id``
    column the model does not take (the Trainer's ``remove_unused_columns`` drops it)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.0, 0.8, num_examples), 4, max_len).astype(int)
    ids = [rng.integers(1, VOCAB, n).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": ids, "id": list(range(num_examples))})


def make_model(dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(dtype)


# TRL's SFTTrainer on a VLM's processor rows: no dataset preparation (the rows are tokenised
# already), every column kept for the model (pixels, grids), no truncation; and no bf16
# autocast (SFTConfig's default), which TRL's LM head kernel would apply to float64 weights
# while the model's own layers stay float64. SFTConfig turns gradient checkpointing on; older
# transformers (4.57) make it reentrant by default, which DDP with unused parameters (a tower
# without items on a rank) refuses ("marked ready twice"), in the plain run as in ours.
VLM_SFT = {
    "dataset_kwargs": {"skip_prepare_dataset": True},
    "remove_unused_columns": False,
    "max_length": None,
    "bf16": False,
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
}


def _sft(balanced: bool) -> tuple[type[Trainer], type[TrainingArguments]]:
    """TRL's SFTTrainer (or its balanced subclass) and SFTConfig; imported here, for the sft
    runs only: TRL is optional."""
    from trl import SFTConfig, SFTTrainer

    class BalancedSFTTrainer(BalancedTrainerMixin, SFTTrainer):  # orchmllm
        pass

    return BalancedSFTTrainer if balanced else SFTTrainer, SFTConfig


def make_trainer(args: argparse.Namespace, output_dir: str, *, max_steps: int) -> Trainer:
    balanced = args.balance != "none"
    tok = make_tokenizer()
    common = {
        "output_dir": output_dir,
        "per_device_train_batch_size": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "dataloader_num_workers": args.workers,
        "learning_rate": 1e-3,
        "weight_decay": args.weight_decay,
        "max_steps": max_steps,
        "num_train_epochs": args.epochs,
        "logging_steps": 1,
        "save_strategy": "steps" if args.resume_at else "no",
        "save_steps": args.resume_at or 500,
        "report_to": [],
        "use_cpu": not torch.cuda.is_available(),
        "dataloader_pin_memory": False,
        "data_seed": args.seed,
        "seed": args.seed,
        "disable_tqdm": True,
        # a VLM's plain batches may leave its tower unused on a rank (DDP must allow it)
        "ddp_find_unused_parameters": args.model != "llama",
    }
    dtype = getattr(torch, args.dtype)
    if args.model != "llama":  # a tiny VLM of an adapted family, its processor's rows
        model = tiny.build_model(args.model, seed=args.seed, dtype=dtype)
        rows = tiny.make_rows(
            args.model, model, args.examples, seed=args.seed, text_only=args.text_only
        )
        # transformers marks Qwen2-VL and Qwen2.5-VL accepts_loss_kwargs=False, so the plain
        # Trainer would average each rank's micro-batch mean; this plain run takes the mean
        # over the targets of all ranks and micro-steps, as the balanced Trainer always does.
        model.accepts_loss_kwargs = True
        model = omt.wrap(model) if balanced else model  # orchmllm
        if args.trainer == "sft":  # the processor's rows as they are: no preparation
            cls, config = _sft(balanced)
            sft_args = config(**common, **VLM_SFT)
            keys = sorted({k for r in rows for k in r})  # from_list reads the first row's keys
            dataset = Dataset.from_list([{k: r.get(k) for k in keys} for r in rows])
            return cls(model=model, args=sft_args, train_dataset=dataset, processing_class=tok,
                       data_collator=tiny.collate)  # fmt: skip
        cls = BalancedTrainer if balanced else Trainer  # orchmllm
        train_args = TrainingArguments(**common)
        return cls(model=model, args=train_args, train_dataset=rows, data_collator=tiny.collate)
    model = make_model(dtype, args.seed)
    dataset = make_dataset(args.examples, max_len=args.max_len, seed=args.seed)
    if args.trainer == "sft":
        cls, config = _sft(balanced)
        sft_args = config(**common, max_length=None, packing=False, padding_free=args.padding_free)
        return cls(model=model, args=sft_args, train_dataset=dataset, processing_class=tok)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    cls = BalancedTrainer if balanced else Trainer  # orchmllm
    train_args = TrainingArguments(**common)
    return cls(model=model, args=train_args, train_dataset=dataset, data_collator=collator)


def losses(trainer: Trainer, key: str = "loss") -> list[float]:
    """The per-step values of ``key`` the Trainer logged."""
    return [h[key] for h in trainer.state.log_history if "loss" in h and key in h]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trainer", choices=("trainer", "sft"), default="trainer")
    p.add_argument(
        "--model", choices=("llama", *tiny.FAMILIES), default="llama",
        help="llama: a text model; else a tiny VLM, balanced by its adapter",
    )  # fmt: skip
    p.add_argument("--balance", choices=("auto", "none"), default="auto")
    p.add_argument("--examples", type=int, default=70)
    p.add_argument(
        "--text-only", type=float, default=0.0, help="a VLM's share of rows with no item"
    )
    p.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW's (the Trainer's default)"
    )
    p.add_argument("--max-len", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--workers", type=int, default=0, help="the Trainer's dataloader_num_workers")
    p.add_argument("--padding-free", action="store_true", help="sft: TRL's packed batches")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1, help="-1: --epochs decides")
    p.add_argument("--resume-at", type=int, default=0, help="checkpoint at this step, resume")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="default: a temporary folder")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    # One folder for every rank (the checkpoint is saved there): named by the launch's port.
    run = os.environ.get("MASTER_PORT", str(os.getpid()))
    out = args.output_dir or os.path.join(tempfile.gettempdir(), f"orchmllm_trainer_{run}")
    if dist.is_initialized():  # started inside a process group (orchmllm.testing)
        shared = [out]
        dist.broadcast_object_list(shared, src=0)
        out = shared[0]
    trainer = make_trainer(args, out, max_steps=args.max_steps)
    trainer.train()
    record = {"losses": losses(trainer), "balanced": args.balance != "none"}
    record["total_flos"] = trainer.state.total_flos
    if args.resume_at:
        resumed = make_trainer(args, out, max_steps=args.max_steps)
        resumed.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{args.resume_at}"))
        record["resumed_losses"] = losses(resumed)[args.resume_at :]  # after the restored ones
    loader = trainer.callback_handler.train_dataloader
    record["num_examples"] = trainer.num_examples(loader)
    # accelerate passes the balanced loader through unchanged (it is not a DataLoader)
    record["prepare_keeps_loader"] = trainer.accelerator.prepare(loader) is loader
    for metric in ("num_tokens", "entropy", "mean_token_accuracy"):  # logged by TRL
        record[metric] = losses(trainer, metric) or None
    phase = "" if args.model == "llama" else "llm/"  # a VLM logs each phase's
    for metric in LOGGED_METRICS:  # logged by orchmllm
        values = losses(trainer, f"balance/{phase}{metric}")
        record[f"balance/{metric}"] = sum(values) / len(values) if values else None
    params = torch.cat([q.detach().double().flatten() for q in trainer.model.parameters()])
    record["param_sum"] = float(params.sum())
    record["state"] = final_state(trainer)
    return record


def final_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter and its optimizer state (``param/NAME``, ``exp_avg/NAME``, ``step/NAME``,
    ...), keyed by the HF model's names; a parameter that never had a gradient has no state."""
    model = trainer.model
    inner = model.model if isinstance(model, omt.BalancedModel) else model
    optim = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    out = {}
    for name, p in inner.named_parameters():
        out[f"param/{name}"] = p.detach().clone()
        for key, value in optim.state.get(p, {}).items():
            out[f"{key}/{name}"] = torch.as_tensor(value).detach().clone()
    return out


if __name__ == "__main__":
    result = main(sys.argv[1:])
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "state"}))  # no tensors
