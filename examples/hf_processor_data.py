"""Real records through real processors: LLaVA-style conversations with image and audio files.

    torchrun --nproc_per_node=2 examples/hf_processor_data.py                 # balanced
    torchrun --nproc_per_node=2 examples/hf_processor_data.py --balance none  # plain

The script writes a small data set to ``--data`` (PNG images of many sizes, one WAV clip, and
LLaVA-style records: ``{"id", "images", "audios", "conversations": [{"from": "human", "value":
"<image>\\n..."}, {"from": "gpt", ...}]}``), builds a processor with nothing downloaded (a
byte-level BPE tokenizer trained here, Qwen2-VL's image processor and Whisper's feature
extractor from their default constructors) and a tiny random Qwen2.5-Omni thinker whose towers
take those processors' patches and mel frames.

Each example's token count is computed before anything is decoded, from the file headers
(``orchmllm.integrations.transformers.lengths``, mapped over the records with ``datasets``); the
balanced loader plans on those counts, and each rank decodes and processes only the examples
it is given, in DataLoader workers. The training loop checks that every example's planned
count equals its processed ``input_ids`` length, and that the planned vision rows and audio
frames equal the processed patches and frames. ``--balance none`` is the plain
``DataLoader`` + ``DistributedSampler`` pipeline: both print the same losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import wave
from datetime import timedelta
from pathlib import Path

import datasets
import numpy as np
import torch
import torch.distributed as dist
import transformers
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import orchmllm
from orchmllm.integrations import hf_compat
from orchmllm.integrations.hf_compat import pil_image_processor, rope_config
from orchmllm.integrations.transformers import lengths as omlen
from orchmllm.integrations.transformers import tiny
from orchmllm.schema import IGNORE_INDEX

# Qwen2.5-Omni's markers; "<image>" and "<audio>" in a record's text stand for its files.
MARKS = {
    "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_bos|>", "<|vision_eos|>"]
SPECIALS += ["<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
WORDS = "a cat dog on the mat red blue what is in this picture describe it sound says hello"
SAMPLING_RATE = 16000


def write_records(folder: Path, num_examples: int, *, seed: int) -> list[dict]:
    """Images of random sizes, one clip, and LLaVA-style records naming them (written as
    ``records.json``)."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    clip = folder / "clip.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(SAMPLING_RATE)
        w.writeframes((rng.standard_normal(24000) * 3000).astype(np.int16).tobytes())
    records = []
    for i in range(num_examples):
        images = []
        for k in range(int(rng.integers(0, 3))):
            w, h = (int(v) for v in np.clip(rng.lognormal(4.3, 0.6, 2), 16, 320))
            path = folder / "images" / f"{i}_{k}.png"
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
            images.append(str(path))
        audios = [str(clip)] if i == 1 else []
        question = " ".join(rng.choice(WORDS.split(), int(rng.integers(3, 30))))
        answer = " ".join(rng.choice(WORDS.split(), int(np.clip(rng.lognormal(2.5, 0.8), 2, 120))))
        human = "<image>\n" * len(images) + "<audio>\n" * len(audios) + question
        turns = [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]
        records.append({"id": i, "images": images, "audios": audios, "conversations": turns})
    (folder / "records.json").write_text(json.dumps(records))
    return records


def render(record: dict) -> str:
    """The conversation as the model's text, one marker per file; the answer follows the
    last ``<|im_start|>`` (the only text with labels)."""
    human, answer = (t["value"] for t in record["conversations"])
    for kind, mark in MARKS.items():
        human = human.replace(f"<{kind}>", mark)
    return f"<|im_start|>user\n{human}<|im_end|>\n<|im_start|>{answer}<|im_end|>"


class Processor:
    """The processor, built locally: it decodes a record's files and returns its model row."""

    def __init__(self, texts: list[str]) -> None:
        self.tokenizer = tiny.train_tokenizer(texts, specials=SPECIALS)
        self.image_processor = pil_image_processor("Qwen2VL")()
        self.feature_extractor = transformers.WhisperFeatureExtractor()
        self.image_token, self.video_token, self.audio_token = "<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"
        self.lengths = omlen.lengths_for(self, family="qwen2.5-omni")

    def __call__(self, record: dict) -> dict[str, torch.Tensor]:
        text, row = render(record), {}
        counts = {}
        if record["images"]:
            images = [Image.open(p).convert("RGB") for p in record["images"]]
            out = self.image_processor(images=images, return_tensors="np")
            row |= {k: out[k] for k in ("pixel_values", "image_grid_thw")}
            merge = self.image_processor.merge_size**2
            counts[self.image_token] = [int(g.prod()) // merge for g in out["image_grid_thw"]]
        if record["audios"]:
            clips = [_read_wav(p) for p in record["audios"]]
            out = self.feature_extractor(
                clips, sampling_rate=SAMPLING_RATE, return_attention_mask=True, return_tensors="np"
            )
            row["input_features"] = out["input_features"]
            row["feature_attention_mask"] = out["attention_mask"]
            frames = out["attention_mask"].sum(-1)
            counts[self.audio_token] = [int(((n - 1) // 2 + 1 - 2) // 2 + 1) for n in frames]
        for token, ns in counts.items():  # expand each marker to its item's tokens, in order
            parts = text.split(token)
            text = parts[0] + "".join(token * n + p for n, p in zip(ns, parts[1:], strict=True))
        ids = np.asarray(self.tokenizer(text)["input_ids"])
        start = np.flatnonzero(ids == self.tokenizer.convert_tokens_to_ids("<|im_start|>"))[-1]
        labels = np.where(np.arange(ids.size) > start, ids, IGNORE_INDEX)
        row |= {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}
        row["index"] = np.array([record["id"]])  # which example (the loop checks its counts)
        return {k: torch.from_numpy(np.asarray(v)) for k, v in row.items()}


def _read_wav(path: str) -> np.ndarray:
    with wave.open(path, "rb") as w:
        data = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    return data.astype(np.float32) / 32768.0


class Records(Dataset):
    """Map-style: ``dataset[i]`` decodes record ``i``'s files (in a DataLoader worker)."""

    def __init__(self, records: list[dict], processor: Processor) -> None:
        self.records, self.processor = records, processor

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.processor(self.records[i])


def metadata_counts(records: list[dict], processor: Processor) -> datasets.Dataset:
    """Every record's token counts from its text and its files' headers (no decoding)."""
    rows = [{"text": render(r), "images": r["images"], "audios": r["audios"]} for r in records]
    return datasets.Dataset.from_list(rows).map(processor.lengths, desc="token counts")


def build_model(tokenizer: transformers.PreTrainedTokenizerFast, image, audio, *, seed: int):
    """A tiny random Qwen2.5-Omni thinker that takes these processors' patches and frames."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    vision = {**tiny.QWEN_VISION, "hidden_size": 16, "intermediate_size": 32}
    vision.update(patch_size=image.patch_size, temporal_patch_size=image.temporal_patch_size)
    vision.update(spatial_merge_size=image.merge_size, out_hidden_size=tiny.HIDDEN)
    vision.update(window_size=4 * image.patch_size * image.merge_size, fullatt_block_indexes=[1])
    audio_config = {"num_mel_bins": audio.feature_size, "encoder_layers": 2, "d_model": 16}
    audio_config.update(encoder_attention_heads=2, encoder_ffn_dim=32, output_dim=tiny.HIDDEN)
    text = tiny._text_config(vocab_size=len(tokenizer), **rope_config(100.0, **tiny.MROPE))
    text.update(bos_token_id=None, eos_token_id=ids["<|im_end|>"])
    config = transformers.Qwen2_5OmniThinkerConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio_config,
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_token_index=ids["<|AUDIO|>"],
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
    )
    torch.manual_seed(seed)
    return transformers.Qwen2_5OmniThinkerForConditionalGeneration(config)


def train(args: argparse.Namespace) -> list[dict]:
    """Train; per-step records (global loss, every rank's tokens, the count checks), equal on
    every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(args.data)
    if rank == 0:
        write_records(folder, args.examples, seed=args.seed)
    dist.barrier()
    records = json.loads((folder / "records.json").read_text())
    processor = Processor([render(r) for r in records])
    counts = metadata_counts(records, processor)
    planned = {k: np.asarray(counts[k]) for k in ("num_tokens", "vision_rows", "audio_rows")}
    dataset = Records(records, processor)
    model = build_model(
        processor.tokenizer,
        processor.image_processor,
        processor.feature_extractor,
        seed=args.seed,
    ).to(getattr(torch, args.dtype))
    model = DDP(model, find_unused_parameters=True)
    if args.balance == "none":
        sampler = DistributedSampler(dataset, seed=args.seed)
        loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=sampler,
            collate_fn=tiny.collate,
            num_workers=args.workers,
        )
    else:
        loader = sampler = orchmllm.BalancedDataLoader(
            dataset,
            batch_size=args.batch_size,
            lengths=planned["num_tokens"],  # from metadata: nothing decoded to plan
            collate_fn=tiny.collate,
            sampling=orchmllm.SamplingOptions(seed=args.seed),
            options=orchmllm.LoaderOptions(num_workers=args.workers),
        )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    out = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            index = batch.pop("index").numpy()
            got = {
                "num_tokens": batch["attention_mask"].sum(1).numpy(),
                "vision_rows": batch.get("pixel_values", torch.zeros(0)).shape[0],
                "audio_rows": int(batch.get("feature_attention_mask", torch.zeros(0)).sum()),
            }
            mismatches = int((got["num_tokens"] != planned["num_tokens"][index]).sum())
            mismatches += int(got["vision_rows"] != planned["vision_rows"][index].sum())
            mismatches += int(got["audio_rows"] != planned["audio_rows"][index].sum())
            batch = {
                k: v.to(model.module.dtype) if v.is_floating_point() else v
                for k, v in batch.items()
            }
            n = orchmllm.global_num_items((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            loss = hf_compat.plain_loss(model, batch, n) * world  # its own loss, all targets
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            out.append(_record(loss, int(got["num_tokens"].sum()), mismatches, len(index), world))
            if rank == 0 and args.progress != "off":
                r = out[-1]
                print(
                    f"step {len(out) - 1:3d}  loss {r['loss']:.6f}  tokens per rank {r['tokens']}"
                    f"  count mismatches {r['mismatches']} of {r['checked']} examples",
                    flush=True,
                )
    return out


def _record(loss: torch.Tensor, tokens: int, mismatches: int, checked: int, world: int) -> dict:
    row = torch.zeros(3 + world, dtype=torch.float64)
    row[0], row[1], row[2] = loss.item() / world, mismatches, checked
    row[3 + dist.get_rank()] = tokens
    dist.all_reduce(row)
    return {
        "loss": float(row[0]),
        "mismatches": int(row[1]),
        "checked": int(row[2]),
        "tokens": [int(t) for t in row[3:]],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="/tmp/orchmllm_records", help="folder the data is written to")
    p.add_argument("--balance", choices=("none", "greedy"), default="greedy")
    p.add_argument("--examples", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4, help="examples per rank per step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers that decode")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    p.add_argument("--progress", choices=("on", "off"), default="on")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Entry point; also runs inside an existing (gloo) process group (the tests)."""
    args = parse_args(argv)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        return train(args)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])  # the library closes its loaders and groups at exit: nothing to call
