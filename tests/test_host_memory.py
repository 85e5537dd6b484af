"""orchmllm.train.host_memory: resident memory by kind, and the bound on torch's native caches."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orchmllm.train.host_memory import NATIVE_CACHES, bound_native_caches, resident_mb


def test_resident_mb_reads_each_kind_in_mb(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmRSS:\t 9000 kB\nRssAnon:\t 2048 kB\nRssFile:\t 512 kB\n")
    assert resident_mb(str(status)) == {"anon": 2.0, "file": 0.5}
    assert resident_mb(str(tmp_path / "absent")) == {}
    if os.path.exists("/proc/self/status"):
        mine = resident_mb()
        assert mine["anon"] > 0 and mine["file"] > 0


def test_bound_native_caches_sets_only_what_the_environment_leaves_open(monkeypatch):
    first, second = NATIVE_CACHES
    monkeypatch.delenv(first, raising=False)
    monkeypatch.setenv(second, "7")
    assert bound_native_caches(32) == {first: "32"}
    assert os.environ[first] == "32" and os.environ[second] == "7"  # the user's setting wins
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        bound_native_caches(0)


# A convolution over 250 lengths, forward and backward (what padded audio batches do): the
# anonymous memory it leaves behind, in MB, with the caches as the environment sets them.
_NEW_SHAPES = """
import torch
from orchmllm.train.host_memory import bound_native_caches, resident_mb
bound_native_caches()
torch.set_num_threads(1)
conv = torch.nn.Conv1d(16, 32, 3, padding=1)
conv(torch.randn(2, 16, 50, requires_grad=True)).sum().backward()
before = resident_mb()["anon"]
for n in range(100, 350):
    conv(torch.randn(2, 16, n, requires_grad=True)).sum().backward()
print(resident_mb()["anon"] - before)
"""


@pytest.mark.integration  # starts processes
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_the_bound_keeps_new_convolution_shapes_from_growing_memory(repo_env):
    """The leak the soak benchmark found: with torch's own caches (1024 entries) every new
    input length keeps ~100 kB of compiled kernels; bounded, the growth stops at the bound."""

    def growth(env: dict[str, str]) -> float:
        proc = subprocess.run([sys.executable, "-c", _NEW_SHAPES], env=env, check=True,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        return float(proc.stdout)

    clean = {k: v for k, v in repo_env.items() if k not in NATIVE_CACHES}
    unbounded = growth({**clean, **dict.fromkeys(NATIVE_CACHES, "1024")})
    bounded = growth(clean)
    assert unbounded > 15, unbounded  # the fault is there to be bounded
    assert bounded < unbounded / 4, (bounded, unbounded)
