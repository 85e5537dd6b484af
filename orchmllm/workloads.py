"""Item-length distributions for balancing benchmarks and tests (pure numpy, fast at 10^5 items).

Each sampler returns int64 lengths in the unit the balanced phase pays for. Parameters follow
the published statistics that :mod:`orchmllm.data.synthetic` documents for the paper's data
mix (section 3.1, 8); "assumed" marks a shape chosen by us where no figure is published.

- ``llava_image``: vision-encoder patches per image at dynamic resolution (paper section 8):
  LLaVA-1.5 mix665k sources (Liu et al. 2023, Table 7): long side 640 px (COCO, weight 0.55),
  500 px (VG/GQA, 0.20), 1024 px (TextVQA/OpenImages, 0.15), log-normal around 350 px
  (OCR-VQA covers, 0.10); aspect 4:3, 3:2, 16:9, 1:1, 3:4 (assumed weights .5/.15/.1/.1/.15);
  images above 448 px (MLLM-10B) are downscaled; patches = ceil(w/14) * ceil(h/14) (a partial
  patch at the border counts; the patch side is an argument).
- ``librispeech``: mel frames (100 per second) of LibriSpeech utterances: train-clean-100 has
  28,539 utterances in 100.6 h (mean 12.7 s); 0.8 * Normal(14.5, 2.5) s + 0.2 * U(1.5, 10) s,
  clipped to [1, 24.5] s (mixture shape assumed, mean about 12.8 s).
- ``spoken_qa``: AIR-Bench clips (Yang et al. 2024, up to 30 s): log-normal median 12 s,
  sigma 0.6 (assumed), clipped to [2, 30] s, 100 frames per second.
- ``text``: ShareGPT conversations (the 40K in the LLaVA-1.5 mix): log-normal median 700
  tokens, sigma 0.8 (assumed), clipped to [16, 8192].
- ``pareto``: heavy tail, 64 * (1 + Pareto(1.5)) tokens, capped at 32768.
- ``uniform``: integers uniform in [1, 4096].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

PATCH = 14
MAX_IMAGE_SIDE = 448
FRAMES_PER_S = 100

Sampler = Callable[[np.random.Generator, int], np.ndarray]


def _llava_image(
    rng: np.random.Generator, n: int, max_side: int = MAX_IMAGE_SIDE, patch: int = PATCH
) -> np.ndarray:
    source = rng.choice(4, size=n, p=[0.55, 0.20, 0.15, 0.10])
    long_side = np.array([640.0, 500.0, 1024.0, 0.0])[source]
    covers = source == 3
    long_side[covers] = np.clip(rng.lognormal(np.log(350.0), 0.25, covers.sum()), 150, 800)
    aspect = np.array([4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4])[
        rng.choice(5, size=n, p=[0.5, 0.15, 0.1, 0.1, 0.15])
    ]
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
    seconds = np.where(rng.random(n) < 0.8, rng.normal(14.5, 2.5, n), rng.uniform(1.5, 10.0, n))
    return np.round(np.clip(seconds, 1.0, 24.5) * FRAMES_PER_S).astype(np.int64)


def _spoken_qa(rng: np.random.Generator, n: int) -> np.ndarray:
    seconds = np.clip(rng.lognormal(np.log(12.0), 0.6, n), 2.0, 30.0)
    return np.round(seconds * FRAMES_PER_S).astype(np.int64)


def _text(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(700.0), 0.8, n)), 16, 8192).astype(np.int64)


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
    max_image_side: int = MAX_IMAGE_SIDE,
    patch: int = PATCH,
) -> np.ndarray:
    """``n`` item lengths (int64, >= 1) drawn from distribution ``dist``.

    ``max_image_side`` is the dynamic-resolution bound in pixels for ``llava_image`` (448 for
    MLLM-10B; the larger paper models use 672 and 896) and ``patch`` its patch side in pixels;
    the other distributions ignore both.
    """
    if dist not in SAMPLERS:
        raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")
    if not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    if not isinstance(patch, int | np.integer) or patch < 1:
        raise ValueError(f"patch must be an integer >= 1, got {patch!r}")
    if not isinstance(max_image_side, int | np.integer) or max_image_side < patch:
        raise ValueError(
            f"max_image_side must be an integer >= patch {patch}, got {max_image_side!r}"
        )
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if dist == "llava_image":
        return np.maximum(_llava_image(gen, int(n), int(max_image_side), int(patch)), 1)
    return np.maximum(SAMPLERS[dist](gen, int(n)), 1)
