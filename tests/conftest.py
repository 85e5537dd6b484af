"""Shared fixtures. Multi-process helpers live in ``tests/multiproc.py``."""

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator, so a failing case can be replayed."""
    return np.random.default_rng(12345)
