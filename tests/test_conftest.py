"""The ``integration`` marker's guard in tests/conftest.py: a test that starts a process
without the marker fails, so ``pytest -m "not integration"`` stays a single-process loop."""

import multiprocessing
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import no_unmarked_process_starts

pytestmark = pytest.mark.integration  # the guard is checked by starting processes

UNMARKED = SimpleNamespace(nodeid="tests/test_x.py::test_y", get_closest_marker=lambda name: None)
MARKED = SimpleNamespace(nodeid="tests/test_x.py::test_z", get_closest_marker=lambda name: name)


def _subprocess() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)


def _process() -> None:
    p = multiprocessing.get_context("spawn").Process(target=int)
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0


@pytest.mark.parametrize("start", [_subprocess, _process], ids=["subprocess", "multiprocessing"])
def test_an_unmarked_test_that_starts_a_process_fails_and_a_marked_one_passes(start):
    popen_init = subprocess.Popen.__init__
    with (
        pytest.raises(pytest.fail.Exception, match=r"test_y started 1 process.*not marked integ"),
        no_unmarked_process_starts(UNMARKED, "call"),
    ):
        start()
    with no_unmarked_process_starts(MARKED, "call"):
        start()
    with no_unmarked_process_starts(UNMARKED, "call"):
        pass  # no process, no failure
    assert subprocess.Popen.__init__ is popen_init  # the watch is removed after the test
