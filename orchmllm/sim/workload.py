"""Global batches of the paper's data mix as lengths only (10^5 examples in well under a second).

Item lengths come from :mod:`orchmllm.workloads` (LLaVA-1.5 images, LibriSpeech, spoken QA,
ShareGPT text). That module samples items, not examples, so the composition of an example per
task (which items it holds and its text around them) follows the documented recipe of
:mod:`orchmllm.data.synthetic`, vectorised:

- ``caption``: one image; prompt U[4, 10) + U[8, 21) tokens; answer log-normal median 13
  (w.p. 0.6) or 110.
- ``vqa``: one image (a second w.p. ``P_MULTI_IMAGE``, 2-4 more prompt tokens); 1 + Poisson(2.5)
  turns (at most 10) of a question (median 12; the first one spoken w.p. ``P_SPOKEN_QUESTION``,
  a 2-8 s clip) and an answer of 1-4 tokens (w.p. 0.7 per example) or median 60.
- ``asr``: one LibriSpeech clip; prompt U[6, 15); transcript ``seconds * 2.73 words/s * 1.3
  tokens/word * LogNormal(0, 0.15)``: text correlates with audio.
- ``spoken_qa``: one AIR-Bench clip; prompt U[4, 10) + question median 30 + answer 1-3 tokens
  (w.p. 0.75) or median 40: long audio, short text.
- ``chat``: ShareGPT text plus a U[6, 20) prefix.

The task mix, image-size bound, audio bound, text cap and ``scale`` come from the run config's
``data:`` section. Image patches are rounded down to a multiple of the vision downsample and
frames to a multiple of the audio frames per token, as the generator does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from orchmllm import workloads
from orchmllm.config import ModelConfig
from orchmllm.schema import TASKS
from orchmllm.sim.batch import Batch

P_MULTI_IMAGE = 0.1
P_SPOKEN_QUESTION = 0.1


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    return median * np.exp(sigma * rng.standard_normal(n))


def sample_batch(
    data: Mapping[str, Any],
    config: ModelConfig,
    *,
    num_ranks: int,
    examples_per_rank: int,
    seed: int,
) -> Batch:
    """One step's global batch: ``examples_per_rank`` i.i.d. examples on each of ``num_ranks``."""
    if num_ranks < 1 or examples_per_rank < 1:
        raise ValueError(
            f"num_ranks and examples_per_rank must be >= 1, got {num_ranks}, {examples_per_rank}"
        )
    mix = data["mix"]
    unknown = set(mix) - set(TASKS)
    if unknown:
        raise ValueError(f"data.mix has unknown tasks {sorted(unknown)}; known: {TASKS}")
    weights = np.array([float(mix.get(t, 0.0)) for t in TASKS])
    if not (weights >= 0).all() or weights.sum() <= 0:
        raise ValueError(f"data.mix must be >= 0 with a positive sum, got {dict(mix)!r}")
    scale = float(data.get("scale", 1.0))
    rng = np.random.default_rng(seed)
    n = num_ranks * examples_per_rank
    task = rng.choice(len(TASKS), size=n, p=weights / weights.sum())
    is_ = {name: np.flatnonzero(task == k) for k, name in enumerate(TASKS)}
    text = np.zeros(n)

    # images: one per caption/vqa example, a second for some vqa examples
    second = is_["vqa"][rng.random(is_["vqa"].size) < P_MULTI_IMAGE]
    img_owner = np.sort(np.concatenate([is_["caption"], is_["vqa"], second]))
    patches = workloads.sample_lengths(
        "llava_image", img_owner.size, rng, max_image_side=int(data["max_image_side"])
    )
    ds = config.vision.downsample
    patches = np.maximum(ds, (patches * scale).astype(np.int64) // ds * ds)

    # audio: LibriSpeech for asr, AIR-Bench for spoken_qa, a short spoken question for some vqa
    spoken = is_["vqa"][rng.random(is_["vqa"].size) < P_SPOKEN_QUESTION]
    asr_frames = workloads.sample_lengths("librispeech", is_["asr"].size, rng)
    qa_frames = workloads.sample_lengths("spoken_qa", is_["spoken_qa"].size, rng)
    question_frames = np.round(rng.uniform(2.0, 8.0, spoken.size) * 100).astype(np.int64)
    aud_owner = np.concatenate([is_["asr"], is_["spoken_qa"], spoken])
    frames = np.concatenate([asr_frames, qa_frames, question_frames])
    frames = np.minimum(frames, int(data["max_audio_s"] * 100))
    order = np.argsort(aud_owner, kind="stable")
    aud_owner, frames = aud_owner[order], frames[order]
    step = config.audio.frames_per_token
    frames = np.maximum(step, (frames * scale).astype(np.int64) // step * step)

    # text
    k = is_["caption"]
    brief = rng.random(k.size) < 0.6
    answer = np.where(brief, _lognormal(rng, 13, 0.3, k.size), _lognormal(rng, 110, 0.4, k.size))
    text[k] = rng.integers(4, 10, k.size) + rng.integers(8, 21, k.size) + answer
    k = is_["vqa"]
    turns = 1 + np.minimum(9, rng.poisson(2.5, k.size))
    short = rng.random(k.size) < 0.7
    questions = _lognormal(rng, 12, 0.4, (k.size, 10))
    questions[:, 0] *= ~np.isin(k, spoken)  # a spoken first question has no text
    answers = np.where(
        short[:, None], rng.integers(1, 5, (k.size, 10)), _lognormal(rng, 60, 0.5, (k.size, 10))
    )
    used = np.arange(10)[None, :] < turns[:, None]
    text[k] = rng.integers(4, 10, k.size) + ((questions + answers) * used).sum(axis=1)
    text[second] += rng.integers(2, 5, second.size)
    k = is_["asr"]
    seconds = asr_frames / 100.0
    text[k] = rng.integers(6, 15, k.size) + seconds * 2.73 * 1.3 * np.exp(
        0.15 * rng.standard_normal(k.size)
    )
    k = is_["spoken_qa"]
    short = rng.random(k.size) < 0.75
    text[k] = (
        rng.integers(4, 10, k.size)
        + _lognormal(rng, 30, 0.4, k.size)
        + np.where(short, rng.integers(1, 4, k.size), _lognormal(rng, 40, 0.5, k.size))
    )
    k = is_["chat"]
    text[k] = rng.integers(6, 20, k.size) + workloads.sample_lengths("text", k.size, rng)
    cap = int(data["max_text_tokens"])
    text = np.clip(np.round(text * scale), 1, cap).astype(np.int64)
    return Batch(num_ranks, text, img_owner, patches, aud_owner, frames)
