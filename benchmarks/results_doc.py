"""Writes docs/results.md from the benchmarks' committed ``--json`` files: no figure is typed.

    python benchmarks/results_doc.py            # rewrite docs/results.md from benchmarks/results/
    python benchmarks/results_doc.py --check    # exit 1 if docs/results.md is not what they give

Each benchmark's ``--json PATH`` output goes unedited into ``benchmarks/results/``, one file per
run, named as its section in ``results_render/document.py`` says. Every figure in the document is
read or computed from those records. Each section names the command that wrote its file, the date
and the machine (the ``orchmllm.provenance`` fields every record carries), and judges a target
met or NOT met from the figure and the bound the benchmark recorded beside it (``target_max_*`` /
``target_min_*``). A section whose file is absent says so and which command writes it.
``tests/test_results_doc.py`` fails when the committed document is not what the committed
files give. Standard library only, so it runs anywhere in a second. The renderers are in
``benchmarks/results_render/``, one module per kind of benchmark.
"""

import sys

from results_render.document import main

if __name__ == "__main__":
    sys.exit(main())
