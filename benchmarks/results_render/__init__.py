"""What ``benchmarks/results_doc.py`` renders, by kind of benchmark: ``document`` (the sections,
their files and the README's blocks; the command line), ``runtime``, ``balancing``,
``placement``, ``paper`` and ``paper_summary``, ``gpu``; ``tables`` is what they share."""
