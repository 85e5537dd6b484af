"""What a new padded shape costs the audio encoder, and whether padding to buckets pays.

A padded encoder (the Whisper-style one) meets a new input shape whenever a batch's longest clip
has a length it has not run before, and a kernel's set-up for a shape (oneDNN's primitives on
CPU, cuDNN's algorithm choice on a GPU) is paid then. Padding a batch to the next multiple of
``bucket`` frames (``model.encoders.audio.bucket``) meets fewer shapes but pays the extra padding
at every step. Per bucket, in a fresh process each (no shape cache carried over), the tiny
config's audio encoder runs forward and backward over the same ``--steps`` batches twice: the
first pass meets every shape new, the second runs them warm (the repeat of identical work is
the self-check: its spread says how far to trust a difference). From these:

- ``new_shape_s``: (first pass - warm pass) / distinct shapes, the set-up of one new shape;
- ``warm_step_s``: a warm step's mean time, which the padding raises;
- ``break_even_steps``: the run length below which the bucket is faster than none, since a run
  meets each possible longest length at most once (``max_frames / bucket`` shapes in all) but
  pays the padding at every step.

    python benchmarks/shape_buckets.py [--quick] [--json PATH] [--buckets 1,8,32,128]
        [--steps N] [--clips N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from orchmllm.config import load_config
from orchmllm.data.workloads import sample_lengths
from orchmllm.provenance import write_records

CONFIG = "tiny"


def _lengths(steps: int, clips: int, divisor: int, scale: float, seed: int) -> np.ndarray:
    """``steps x clips`` clip lengths in frames: LibriSpeech's at the config's scale, whole
    multiples of the encoder's divisor."""
    frames = sample_lengths("librispeech", steps * clips, seed) * scale
    return (np.maximum(np.ceil(frames / divisor), 1) * divisor).astype(np.int64).reshape(steps, -1)


def _timed_pass(encoder, batches, n_mels: int, device: str) -> list[float]:
    import torch

    times = []
    for lengths in batches:
        mels = torch.randn(int(lengths.sum()), n_mels, device=device)
        t = torch.as_tensor(lengths, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        encoder(mels, t).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def one_bucket(bucket: int, steps: int, clips: int, device: str, seed: int) -> dict:
    """The record of one bucket, measured in this process (which must not have run the encoder
    before: its shape caches would be warm)."""
    import torch

    from orchmllm.models.whisper.module import AudioEncoder

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    cfg = load_config(CONFIG)
    audio = dataclasses.replace(cfg.model.encoders["audio"], bucket=bucket)
    encoder = AudioEncoder(audio, cfg.model.llm.hidden).to(device)
    batches = _lengths(steps, clips, audio.rate.divisor, cfg.data.scale, seed)
    # the process's own first-run costs (allocator, autograd) on a shape the batches never meet
    beyond = np.full((1, clips), -(-2 * batches.max() // bucket) * bucket, dtype=np.int64)
    _timed_pass(encoder, beyond, audio.n_mels, device)
    first = _timed_pass(encoder, batches, audio.n_mels, device)
    warm = _timed_pass(encoder, batches, audio.n_mels, device)
    again = _timed_pass(encoder, batches, audio.n_mels, device)  # identical work: the self-check
    longest = batches.max(axis=1)
    shapes = -(-longest // bucket) * bucket
    distinct = int(np.unique(shapes).size)
    return {
        "figure": "shape_buckets",
        "bucket": bucket,
        "device": device,
        "steps": steps,
        "clips": clips,
        "distinct_shapes": distinct,
        "padding_over_frames": float((shapes * clips).sum() / batches.sum()),
        "first_pass_s": float(sum(first)),
        "warm_pass_s": float(sum(warm)),
        "repeat_spread": float(abs(sum(again) - sum(warm)) / sum(warm)),
        "new_shape_s": float((sum(first) - sum(warm)) / distinct),
        "warm_step_s": float(np.mean(warm)),
        "max_frames": int(batches.max()),
    }


def _in_fresh_process(bucket: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--one", str(bucket), "--steps", str(args.steps),
           "--clips", str(args.clips), "--device", args.device,
           "--seed", str(args.seed)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def with_break_even(records: list[dict]) -> list[dict]:
    """Each bucket's run length below which it beats no bucket (``bucket`` 1): a run meets at
    most ``max_frames / bucket`` shapes, one set-up each, and pays its warm step every step.
    0: never faster (no set-up saved); None: faster at any length (no padding cost seen)."""
    base = next(r for r in records if r["bucket"] == 1)
    max_frames = max(r["max_frames"] for r in records)
    for r in records:
        saved = (max_frames - max_frames / r["bucket"]) * max(base["new_shape_s"], 0.0)
        extra = r["warm_step_s"] - base["warm_step_s"]
        r["break_even_steps"] = 0.0 if saved <= 0 else (saved / extra if extra > 0 else None)
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="few steps, seconds")
    p.add_argument("--json", type=Path, help="write the records here")
    p.add_argument("--buckets", default="1,8,32,128", help="comma-separated frame counts")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--clips", type=int, default=8, help="clips per batch")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a fresh process's one bucket
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one_bucket(args.one, args.steps, args.clips, args.device, args.seed)))
        return []
    if args.quick:
        args.steps, args.buckets = 6, "1,32"
    buckets = sorted({int(b) for b in args.buckets.split(",")} | {1})
    records = with_break_even([_in_fresh_process(b, args) for b in buckets])
    print(f"{'bucket':>6} {'shapes':>6} {'padding':>8} {'new shape ms':>12} {'warm step ms':>12} "
          f"{'repeat':>7} {'break-even steps':>16}")  # fmt: skip
    for r in records:
        even = r["break_even_steps"]
        even = "always" if even is None else "never" if even == 0 else f"{even:.0f}"
        print(f"{r['bucket']:>6} {r['distinct_shapes']:>6} {r['padding_over_frames']:>8.3f} "
              f"{r['new_shape_s'] * 1e3:>12.2f} {r['warm_step_s'] * 1e3:>12.2f} "
              f"{r['repeat_spread']:>7.1%} {even:>16}")  # fmt: skip
    if args.json:
        write_records(args.json, records)
    return records


if __name__ == "__main__":
    main()
