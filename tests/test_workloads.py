"""Length samplers: seeded, positive, image patches within the resolution bound."""

import numpy as np
import pytest

from orchmllm.workloads import DISTRIBUTIONS, MAX_IMAGE_SIDE, PATCH, sample_lengths


def test_image_patches_respect_the_resolution_bound():
    patches = sample_lengths("llava_image", 5000, 0)
    grid = -(-MAX_IMAGE_SIDE // PATCH)
    assert patches.min() >= 1 and patches.max() <= grid * grid


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_every_distribution_is_seeded_and_positive(dist):
    a, b = sample_lengths(dist, 500, 3), sample_lengths(dist, 500, 3)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and a.min() >= 1
