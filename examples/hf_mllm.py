"""The OrchMLLM orchestrator driving a Hugging Face multimodal model: one balanced layout per phase.

    torchrun --nproc_per_node=2 examples/hf_mllm.py                          # Qwen2-VL, balanced
    torchrun --nproc_per_node=2 examples/hf_mllm.py --model qwen2.5-omni     # vision + audio
    torchrun --nproc_per_node=2 examples/hf_mllm.py --balance none           # the HF forward

The model is a ``transformers`` Qwen2-VL (``Qwen2VLForConditionalGeneration``) or the thinker
of Qwen2.5-Omni (``Qwen2_5OmniThinkerForConditionalGeneration``: a vision *and* an audio
encoder, the paper's setting), built from a tiny config with random weights (nothing is
downloaded), sharded with FSDP2.

``--balance full`` runs each part of the model as its own phase of ``orchmllm.Orchestrator``:
the vision tower over images balanced by patches, the audio tower over clips balanced by
frames, and the language model over whole interleaved sequences, packed (positions restart per
sequence, so ``transformers`` builds the block-diagonal mask). Encoder outputs go straight
from the encoder layout to the LLM layout in one all-to-all. ``--balance llm`` balances only
the LLM phase. ``--balance none`` is the plain HF pipeline: ``DataLoader`` +
``DistributedSampler``, padded batches, the model's own ``forward``. All three see the same
global batch each step, so they print the same losses.

Two things the split needs, both handled here:

- An image's patch grid ``(t, h, w)``: the vision tower needs it (rotary positions, attention
  per image) and so does the LLM (M-RoPE gives image tokens 3-D positions). The grid travels
  with the image as three extra columns on every patch row; the vision phase reads it and
  appends each output token's M-RoPE offsets ``(dt, dh, dw)`` and the image's position extent
  as four columns, which travel with the tokens to the LLM layout, where each packed sequence's
  positions are rebuilt exactly as ``get_rope_index`` builds them (audio tokens count like
  text, as in Qwen2.5-Omni).
- FSDP2: every rank calls every sharded encoder every step, on a one-item dummy input when it
  holds no item of that phase, and the whole step runs inside one call of the FSDP root.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import orchmllm
from orchmllm.compat import leave_process
from orchmllm.progress import PROGRESS, StepProgress

IGNORE_INDEX = -100
TEXT, IMAGE, AUDIO = 0, 1, 2  # orchmllm's segment kinds (the example schema of orchmllm.schema)
HIDDEN, VOCAB, MERGE = 32, 256, 2  # LLM width, vocabulary, vision spatial merge (2x2 patches)
PATCH = 3 * 2 * 2 * 2  # channels * temporal patch * patch * patch: one row of pixel_values
N_MELS, AUDIO_STRIDE = 16, 4  # the audio tower halves the frames twice (conv, then pooling)
GRID = 3  # extra columns on every patch row: the image's (t, h, w)
ROPE = 4  # extra columns on every encoder output token: (dt, dh, dw, extent)
# Special tokens at the top of the vocabulary; text is drawn below them.
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 250, 251, 252, 253
AUDIO_TOKEN, AUDIO_START, AUDIO_END = 247, 248, 249
BOS, EOS = 254, 255
TEXT_VOCAB = 240


# -- model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parts:
    """Where the phases live in the HF model."""

    visual: nn.Module
    audio: nn.Module | None
    language_model: nn.Module


def build_model(name: str, *, seed: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A tiny Qwen2-VL or Qwen2.5-Omni thinker with random weights, equal on every rank."""
    text = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,  # sharp attention, so positions (M-RoPE) matter to the loss
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 100.0,
            "mrope_section": [2, 1, 1],
        },
        "use_cache": False,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    }
    vision = {
        "depth": 2,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 2,
        "temporal_patch_size": 2,
        "spatial_merge_size": MERGE,
    }
    torch.manual_seed(seed)
    if name == "qwen2-vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        config = Qwen2VLConfig(
            text_config=text,
            vision_config={**vision, "embed_dim": 16, "hidden_size": HIDDEN, "mlp_ratio": 2},
            image_token_id=IMAGE_TOKEN,
            video_token_id=VIDEO_TOKEN,
            vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END,
        )
        model = Qwen2VLForConditionalGeneration(config)
    else:
        from transformers import (
            Qwen2_5OmniThinkerConfig,
            Qwen2_5OmniThinkerForConditionalGeneration,
        )

        config = Qwen2_5OmniThinkerConfig(
            text_config=text,
            vision_config={
                **vision,
                "hidden_size": 16,
                "intermediate_size": 32,
                "out_hidden_size": HIDDEN,
                "window_size": 8,
                "fullatt_block_indexes": [1],
            },
            audio_config={
                "num_mel_bins": N_MELS,
                "encoder_layers": 2,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 32,
                "d_model": 16,
                "output_dim": HIDDEN,
                "n_window": 16,
                "max_source_positions": 256,
            },
            image_token_index=IMAGE_TOKEN,
            video_token_index=VIDEO_TOKEN,
            audio_token_index=AUDIO_TOKEN,
            vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END,
            audio_start_token_id=AUDIO_START,
            audio_end_token_id=AUDIO_END,
        )
        model = Qwen2_5OmniThinkerForConditionalGeneration(config)
    return model.to(device=device, dtype=dtype)


def parts(model: nn.Module) -> Parts:
    inner = model.model
    return Parts(inner.visual, getattr(inner, "audio_tower", None), inner.language_model)


class Step(nn.Module):
    """FSDP2 root whose forward runs ``step(model)``.

    The orchestrated step calls the towers, the embedding, the decoder and the head one by one;
    run inside one root call, FSDP2's root hooks (lazy init, the final backward callback) wrap
    the whole step, as for the model's own ``forward``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, step):
        return step(self.model)


def shard(model: nn.Module) -> Step:
    """``fully_shard`` every block, each tower, the token embedding (the orchestrated step calls
    it on its own), then the root (LM head, final norm)."""
    p = parts(model)
    for tower in (p.visual, p.audio):
        if tower is not None:
            for block in getattr(tower, "blocks", None) or tower.layers:
                fully_shard(block)
            fully_shard(tower)
    for layer in p.language_model.layers:
        fully_shard(layer)
    fully_shard(p.language_model.embed_tokens)
    root = fully_shard(Step(model))
    root.set_reduce_scatter_unused_params(True)
    return root


# -- data -------------------------------------------------------------------------------


def make_dataset(num_examples: int, *, audio: bool, seed: int) -> list[dict]:
    """Interleaved examples in orchmllm's schema (``segments``, ``input_ids``, ``loss_mask``,
    ``image_patches``, ``audio_mels``): a prompt, one or two images (with ``audio``: and one
    or two clips) of heavy-tailed sizes in random order, each wrapped in its start and end
    tokens, and an answer, the only text with loss. Every example has every modality, so the
    plain HF forward calls every tower on every rank (FSDP2 needs that; the orchestrated path
    does not)."""
    rng = np.random.default_rng(seed)

    def text(n: int) -> list[int]:
        return rng.integers(0, TEXT_VOCAB, max(int(n), 1)).tolist()

    def length(mean: float, lo: int, hi: int) -> int:
        return int(np.clip(rng.lognormal(np.log(mean), 0.7), lo, hi))

    rows = []
    for i in range(num_examples):
        items = [IMAGE] * int(rng.integers(1, 3))
        if audio:
            items += [AUDIO] * int(rng.integers(1, 3))
            rng.shuffle(items)
        segments, ids, images, clips, pending = [], [], [], [], text(length(12, 2, 64))
        for kind in items:
            start, end = (VISION_START, VISION_END) if kind == IMAGE else (AUDIO_START, AUDIO_END)
            segments.append([TEXT, len(pending) + 1])
            ids += pending + [start]
            if kind == IMAGE:
                h, w = (MERGE * length(3, 1, 8) for _ in range(2))
                patches = rng.standard_normal((h * w, PATCH + GRID)).astype(np.float32)
                patches[:, PATCH:] = (1, h, w)  # the grid travels with the image
                images.append(patches)
                segments.append([IMAGE, h * w])
            else:
                frames = AUDIO_STRIDE * length(10, 1, 40)
                clips.append(rng.standard_normal((frames, N_MELS)).astype(np.float32))
                segments.append([AUDIO, frames])
            pending = [end] + text(length(4, 1, 16))
        answer = text(length(16, 2, 96))
        segments.append([TEXT, len(pending) + len(answer)])
        ids += pending + answer
        mask = [0] * (len(ids) - len(answer)) + [1] * len(answer)
        rows.append(
            {
                "id": i,
                "task": "spoken_qa" if AUDIO in items else "vqa",
                "segments": segments,
                "input_ids": np.asarray(ids, dtype=np.int64),
                "loss_mask": np.asarray(mask, dtype=np.int64),
                "image_patches": images,
                "audio_mels": clips,
            }
        )
    return rows


def hf_inputs(examples: list[dict]) -> dict[str, torch.Tensor]:
    """The plain pipeline's collate: what the HF processor would give, right-padded."""
    seqs, labels = [], []
    for ex in examples:
        ids, mask = [], []
        text = iter(zip(ex["input_ids"].tolist(), ex["loss_mask"].tolist(), strict=True))
        for kind, count in ex["segments"]:
            if kind == TEXT:
                for tok, m in (next(text) for _ in range(count)):
                    ids.append(tok)
                    mask.append(tok if m else IGNORE_INDEX)
            else:
                n = count // (MERGE * MERGE if kind == IMAGE else AUDIO_STRIDE)
                ids += [IMAGE_TOKEN if kind == IMAGE else AUDIO_TOKEN] * n
                mask += [IGNORE_INDEX] * n
        seqs.append(ids)
        labels.append(mask)
    width = max(len(s) for s in seqs)

    def pad(rows: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)

    images = [p for ex in examples for p in ex["image_patches"]]
    out = {
        "input_ids": pad(seqs, 0),
        "attention_mask": pad([[1] * len(s) for s in seqs], 0),
        "labels": pad(labels, IGNORE_INDEX),
        "pixel_values": torch.from_numpy(np.concatenate(images)[:, :PATCH]),
        "image_grid_thw": torch.from_numpy(np.stack([p[0, PATCH:] for p in images])).long(),
    }
    clips = [c for ex in examples for c in ex["audio_mels"]]
    if clips:
        frames = max(len(c) for c in clips)
        feats = torch.zeros(len(clips), N_MELS, frames)
        fmask = torch.zeros(len(clips), frames, dtype=torch.long)
        for i, c in enumerate(clips):
            feats[i, :, : len(c)] = torch.from_numpy(c.T)
            fmask[i, : len(c)] = 1
        out["input_features"], out["feature_attention_mask"] = feats, fmask
    return out


# -- the orchestrated step ----------------------------------------------------------------


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lengths, 0) - lengths


def image_rope(grid: torch.Tensor) -> torch.Tensor:
    """Per output token of each image: M-RoPE offsets (dt, dh, dw) from the image's first
    position, and the image's extent max(h, w) (the position after it), in merged units."""
    rows = []
    for t, h, w in (grid // torch.tensor([1, MERGE, MERGE], device=grid.device)).tolist():
        dt, dh, dw = torch.meshgrid(
            torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"
        )
        extent = torch.full_like(dt, max(h, w))
        rows.append(torch.stack([dt, dh, dw, extent], -1).reshape(-1, ROPE))
    return torch.cat(rows).to(grid.device)


def audio_rope(tokens: torch.Tensor) -> torch.Tensor:
    """Audio tokens take consecutive positions, like text: offsets (k, k, k), extent n."""
    rows = []
    for n in tokens.tolist():
        k = torch.arange(n)
        rows.append(torch.stack([k, k, k, torch.full_like(k, n)], -1))
    return torch.cat(rows).to(tokens.device)


def encoders(model: nn.Module, loads: dict[str, float]) -> dict:
    """The phases' encoder callables: ``(raw rows, raw lengths) -> [tokens, HIDDEN + ROPE]``.

    Each runs on every rank; with no item it encodes a one-item dummy and returns no row
    (FSDP2 needs every rank to call every sharded module)."""
    p = parts(model)

    def vision(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        loads["vision"] = float(lengths.sum())
        empty = lengths.numel() == 0
        if empty:
            x = torch.zeros(MERGE * MERGE, PATCH + GRID, dtype=x.dtype, device=x.device)
            x[:, PATCH:] = torch.tensor([1, MERGE, MERGE], dtype=x.dtype)
            lengths = torch.tensor([MERGE * MERGE], device=x.device)
        grid = x[_starts(lengths), PATCH:].long()
        out = p.visual(x[:, :PATCH], grid_thw=grid).pooler_output
        out = torch.cat([out, image_rope(grid).to(out.dtype)], 1)
        return out[:0] if empty else out

    def audio(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        loads["audio"] = float(lengths.sum())
        empty = lengths.numel() == 0
        if empty:
            x = torch.zeros(AUDIO_STRIDE, N_MELS, dtype=x.dtype, device=x.device)
            lengths = torch.tensor([AUDIO_STRIDE], device=x.device)
        after_cnn = (lengths - 1) // 2 + 1
        out = p.audio(x.T, feature_lens=lengths, aftercnn_lens=after_cnn).last_hidden_state
        out = torch.cat([out, audio_rope(lengths // AUDIO_STRIDE).to(out.dtype)], 1)
        return out[:0] if empty else out

    return {"vision": vision, "audio": audio} if p.audio is not None else {"vision": vision}


def mrope_position_ids(rope: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[4, 1, tokens]`` position ids of packed sequences, as ``get_rope_index`` gives them.

    ``rope``: per token (dt, dh, dw, extent), -1 for text. Row 0 restarts at 0 per sequence (HF
    reads it to build the block-diagonal mask); rows 1-3 are M-RoPE's t, h, w: a text token
    takes the next position, an encoder item starts there, its tokens add their offsets, and
    the next position is its start plus its extent.
    """
    total = int(lengths.sum())
    device = rope.device
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    seq_start = _starts(lengths)[seq]
    is_item = rope[:, 3] >= 0
    offsets = torch.where(is_item[:, None], rope[:, :3], 0).long()
    item_start = is_item & (offsets == 0).all(1)  # an item's first token has offsets (0, 0, 0)
    index = torch.arange(total, device=device)
    nxt = (index + 1).clamp(max=total - 1)
    ends = (index == total - 1) | (seq[nxt] != seq) | ~is_item[nxt] | item_start[nxt]
    last = is_item & ends  # the last token of an item: the next one is not part of it
    step = torch.where(is_item, torch.where(last, rope[:, 3].long(), 0), 1)
    before = torch.cumsum(step, 0) - step  # exclusive, over the whole pack
    base = before - before[seq_start]  # ... restarted per sequence
    pos = base[:, None] + offsets
    text_pos = index - seq_start
    return torch.cat([text_pos[None], pos.T])[:, None, :]


def orchestrated_loss(orch, planned, world: int, loads: dict[str, float], device: torch.device):
    """The step function: the orchestrator moves and encodes, the LLM runs on packed sequences.

    Returns this rank's share of the global mean loss, times the world size (FSDP2 averages
    gradients over ranks)."""
    batch = planned.batch.to(device)

    def step(model: nn.Module) -> torch.Tensor:
        p = parts(model)
        out = orch.run(batch, encoders(model, loads), plan=planned.plan, assembly=planned.assembly)
        embeds = p.language_model.embed_tokens(out.input_ids)
        marks = embeds.new_full((embeds.shape[0], ROPE), -1.0)  # text tokens have no offsets
        seq = out.assemble(torch.cat([embeds, marks], 1))
        position_ids = mrope_position_ids(seq[:, HIDDEN:], out.lengths)
        hidden = p.language_model(
            inputs_embeds=seq[None, :, :HIDDEN], position_ids=position_ids, use_cache=False
        ).last_hidden_state
        loads["llm"] = float(out.lengths.sum())
        return (
            model.loss_function(
                logits=model.lm_head(hidden),
                labels=None,
                shift_labels=out.targets[None],  # the orchestrator's targets are already shifted
                vocab_size=VOCAB,
                num_items_in_batch=out.num_targets,  # global: = orchmllm.global_num_items(local)
            )
            * world
        )

    return step


def plain_loss(inputs: dict[str, torch.Tensor], world: int, loads: dict[str, float], model: str):
    """The step function of the plain pipeline: the HF model's own forward on padded batches."""
    n = orchmllm.global_num_items((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
    loads["vision"] = float(inputs["pixel_values"].shape[0])
    loads["audio"] = (
        float(inputs["feature_attention_mask"].sum()) if "input_features" in inputs else 0.0
    )
    loads["llm"] = float(inputs["attention_mask"].sum())

    if model == "qwen2-vl":  # it finds images by token type (Qwen2.5-Omni by start tokens)
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_TOKEN).int()

    def step(model: nn.Module) -> torch.Tensor:
        return model(**inputs, num_items_in_batch=n, use_cache=False).loss * world

    return step


# -- training -----------------------------------------------------------------------------


def train(args: argparse.Namespace) -> list[dict]:
    """Train; returns per-step records (global loss; per-rank loads per phase), equal on all
    ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    omni = args.model == "qwen2.5-omni"
    dataset = make_dataset(args.examples, audio=omni, seed=args.seed)
    model = shard(
        build_model(args.model, seed=args.seed, dtype=getattr(torch, args.dtype), device=device)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    phases_names = ["vision", "audio", "llm"] if omni else ["vision", "llm"]
    if args.balance == "none":
        sampler = DistributedSampler(dataset, seed=args.seed)
        loader = DataLoader(
            dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=hf_inputs
        )
    else:
        phases = [
            orchmllm.EncoderPhase("vision", IMAGE, "image_patches", MERGE * MERGE, PATCH + GRID)
        ]
        if omni:
            phases.append(orchmllm.EncoderPhase("audio", AUDIO, "audio_mels", AUDIO_STRIDE, N_MELS))
        topology = orchmllm.Topology.build(timeout=args.timeout)  # the loader shares it
        orch = orchmllm.Orchestrator(
            orchmllm.StepOptions(phases, mode=args.balance), topology=topology
        )
        loader = orchmllm.orchestrated_loader(
            dataset,
            orch,
            batch_size=args.batch_size,
            sampling=orchmllm.SamplingOptions(seed=args.seed),
            topology=topology,
        )
        sampler = loader
    records = []
    progress = StepProgress(total=len(loader) * args.epochs, rank=rank, mode=args.progress)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            loads: dict[str, float] = {}
            if args.balance == "none":
                inputs = {k: v.to(device) for k, v in batch.items()}
                step = plain_loss(inputs, world, loads, args.model)
            else:
                step = orchestrated_loss(orch, batch, world, loads, device)
            loss = model(step)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            row = torch.zeros(1 + world * len(phases_names), dtype=torch.float64, device=device)
            row[0] = loss.item() / world
            for i, name in enumerate(phases_names):
                row[1 + i * world + rank] = loads.get(name, 0.0)
            dist.all_reduce(row)
            per_rank = row[1:].cpu().numpy().reshape(len(phases_names), world)
            records.append(
                {
                    "loss": float(row[0]),
                    "loads": {n: per_rank[i].tolist() for i, n in enumerate(phases_names)},
                    "imbalance": {n: _imbalance(per_rank[i]) for i, n in enumerate(phases_names)},
                }
            )
            r = records[-1]
            imb = "  ".join(f"{n} {v:.3f}" for n, v in r["imbalance"].items())
            progress.step(
                f"step {len(records) - 1:3d}  loss {r['loss']:.6f}  imbalance {imb}",
                loss=f"{r['loss']:.4f}",
                imbalance=f"{r['imbalance']['llm']:.3f}",
            )
    progress.close()
    if rank == 0:
        mean = {n: np.mean([r["imbalance"][n] for r in records]) for n in phases_names}
        print(
            f"{args.model} balance={args.balance}: mean imbalance (max/mean per rank) "
            + "  ".join(f"{n} {v:.3f}" for n, v in mean.items())
        )
    return records


def _imbalance(loads: np.ndarray) -> float:
    return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("qwen2-vl", "qwen2.5-omni"), default="qwen2-vl")
    p.add_argument("--balance", choices=("none", "llm", "full"), default="full")
    p.add_argument("--examples", type=int, default=128, help="dataset size")
    p.add_argument("--batch-size", type=int, default=8, help="examples per rank per step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    p.add_argument("--progress", choices=PROGRESS, default="auto", help="rank 0's per-step report")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Entry point; also runs inside an existing process group (the tests)."""
    args = parse_args(argv)
    created = not dist.is_initialized()
    if created:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        return train(args)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    # Not part of balancing: a process that used gloo can abort at exit after finishing.
    leave_process(0)
