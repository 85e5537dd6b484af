"""``python -m orchmllm.train`` (under ``torchrun``): see :mod:`orchmllm.train.cli`."""

import sys

from orchmllm import compat
from orchmllm.train.cli import main

main(sys.argv[1:])
compat.leave_process(0)  # a finished run must not abort in gloo's exit (see there)
