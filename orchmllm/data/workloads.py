"""Item-length distributions for balancing benchmarks and tests (pure numpy, fast at 10^5 items).

Each sampler returns int64 lengths in the unit the balanced phase pays for. The paper mix's
samplers draw with the numbers of :data:`orchmllm.data.workload_facts.FACTS` (each with its
source or "assumed"), summarised here:

- ``llava_image``: vision-encoder patches per image at dynamic resolution (paper section 8):
  the LLaVA-1.5 mix665k sources (COCO, VG/GQA, TextVQA/OpenImages, OCR-VQA covers) at their
  native sizes and common aspects, downscaled to ``max_image_side``; patches =
  ``ceil(w / patch) * ceil(h / patch)`` (a partial patch at the border counts).
- ``librispeech``: mel frames (100 per second) of LibriSpeech utterances: a mixture around
  the corpus's mode and a tail of short ones, clipped.
- ``spoken_qa``: AIR-Bench clips, log-normal, clipped to the benchmark's 30 s.
- ``text``: ShareGPT conversations (the 40K in the LLaVA-1.5 mix), log-normal, clipped.
- ``pareto``: heavy tail, 64 * (1 + Pareto(1.5)) tokens, capped at 32768.
- ``uniform``: integers uniform in [1, 4096].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from orchmllm.data.workload_facts import fact

PATCH = int(fact("image.patch_px"))
MAX_IMAGE_SIDE = int(fact("image.max_side_px"))
FRAMES_PER_S = int(fact("audio.frames_per_s"))

Sampler = Callable[[np.random.Generator, int], np.ndarray]


def _llava_image(
    rng: np.random.Generator,
    n: int,
    max_side: int | np.ndarray = MAX_IMAGE_SIDE,
    patch: int = PATCH,
) -> np.ndarray:
    weights = fact("image.source_weights")
    source = rng.choice(len(weights), size=n, p=list(weights))
    long_side = np.array([*fact("image.long_side_px"), 0.0])[source]
    covers = source == len(weights) - 1  # the last source: OCR-VQA covers, sized apart
    cover = rng.lognormal(
        np.log(fact("image.cover_median_px")), fact("image.cover_sigma"), covers.sum()
    )
    long_side[covers] = np.clip(cover, *fact("image.cover_clip_px"))
    aspects, shares = fact("image.aspects"), fact("image.aspect_weights")
    aspect = np.array(aspects)[rng.choice(len(aspects), size=n, p=list(shares))]
    wide = aspect >= 1
    width = np.where(wide, long_side, long_side * aspect)
    height = np.where(wide, long_side / aspect, long_side)
    shrink = np.minimum(1.0, max_side / np.maximum(width, height))
    # a resized image has whole pixels; without rounding, 640 * (448 / 640) = 448.00000000000006
    # would count a 33rd patch column on a 448-pixel bound
    cols = np.ceil(np.round(width * shrink) / patch)
    rows = np.ceil(np.round(height * shrink) / patch)
    return (cols * rows).astype(np.int64)


def _librispeech(rng: np.random.Generator, n: int) -> np.ndarray:
    main = rng.random(n) < fact("librispeech.main_share")
    long = rng.normal(fact("librispeech.main_mean_s"), fact("librispeech.main_sd_s"), n)
    seconds = np.where(main, long, rng.uniform(*fact("librispeech.short_s"), n))
    return np.round(np.clip(seconds, *fact("librispeech.clip_s")) * FRAMES_PER_S).astype(np.int64)


def _spoken_qa(rng: np.random.Generator, n: int) -> np.ndarray:
    seconds = rng.lognormal(np.log(fact("spoken_qa.median_s")), fact("spoken_qa.sigma"), n)
    return np.round(np.clip(seconds, *fact("spoken_qa.clip_s")) * FRAMES_PER_S).astype(np.int64)


def _text(rng: np.random.Generator, n: int) -> np.ndarray:
    tokens = rng.lognormal(np.log(fact("sharegpt.median_tokens")), fact("sharegpt.sigma"), n)
    return np.clip(np.round(tokens), *fact("sharegpt.clip_tokens")).astype(np.int64)


def _pareto(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.minimum(np.round(64 * (1 + rng.pareto(1.5, n))), 32768).astype(np.int64)


def _uniform(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, 4097, size=n, dtype=np.int64)


SAMPLERS: dict[str, Sampler] = {
    "llava_image": _llava_image,
    "librispeech": _librispeech,
    "spoken_qa": _spoken_qa,
    "text": _text,
    "pareto": _pareto,
    "uniform": _uniform,
}
DISTRIBUTIONS = tuple(SAMPLERS)


def sample_lengths(
    dist: str,
    n: int,
    rng: np.random.Generator | int = 0,
    *,
    max_image_side: int | np.ndarray = MAX_IMAGE_SIDE,
    patch: int = PATCH,
) -> np.ndarray:
    """``n`` item lengths (int64, >= 1) drawn from distribution ``dist``.

    ``max_image_side`` is the dynamic-resolution bound in pixels for ``llava_image`` (448 for
    MLLM-10B; the larger paper models use 672 and 896; or one bound per image, when the images
    of several tasks are drawn together) and ``patch`` its patch side in pixels;
    the other distributions ignore both.
    """
    if dist not in SAMPLERS:
        raise ValueError(f"dist must be one of {tuple(SAMPLERS)}, got {dist!r}")
    if not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    if not isinstance(patch, int | np.integer) or patch < 1:
        raise ValueError(f"patch must be an integer >= 1, got {patch!r}")
    sides = np.asarray(max_image_side)
    if sides.dtype.kind not in "iu" or sides.shape not in ((), (n,)) or np.any(sides < patch):
        raise ValueError(
            f"max_image_side must be an integer >= patch {patch} (or one per image), got "
            f"{max_image_side!r}"
        )
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if dist == "llava_image":
        return np.maximum(_llava_image(gen, int(n), sides, int(patch)), 1)
    return np.maximum(SAMPLERS[dist](gen, int(n)), 1)
