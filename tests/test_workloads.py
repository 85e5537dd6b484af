"""Length samplers: bounds, rounding rules, determinism, and bad input that names the
argument."""

import numpy as np
import pytest

from orchmllm.data.workloads import DISTRIBUTIONS, PATCH, sample_lengths


@pytest.mark.parametrize("side, patch", [(224, PATCH), (448, PATCH), (896, PATCH), (224, 4)])
def test_image_patches_respect_the_resolution_bound(side, patch):
    patches = sample_lengths("llava_image", 5000, 0, max_image_side=side, patch=patch)
    grid = -(-side // patch)
    assert patches.min() >= 1 and patches.max() <= grid * grid


def test_larger_bound_gives_more_patches_and_default_is_448():
    np.testing.assert_array_equal(
        sample_lengths("llava_image", 1000, 7),
        sample_lengths("llava_image", 1000, 7, max_image_side=448),
    )
    small = sample_lengths("llava_image", 5000, 1, max_image_side=224)
    large = sample_lengths("llava_image", 5000, 1, max_image_side=896)
    assert large.mean() > 2 * small.mean()


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_every_distribution_is_seeded_and_positive(dist):
    a, b = sample_lengths(dist, 500, 3), sample_lengths(dist, 500, 3)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and a.min() >= 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dist": "nope", "n": 3}, "dist"),
        ({"dist": "text", "n": -1}, "n must"),
        ({"dist": "llava_image", "n": 3, "max_image_side": 5}, "max_image_side"),
        ({"dist": "llava_image", "n": 3, "patch": 0}, "patch"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_lengths(**kwargs)
