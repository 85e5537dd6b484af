"""``benchmarks/reproduce_paper.py``'s parts: ``cli`` (the command line and the sections in
order), ``figure8`` (Figures 8 and 9, the workload sensitivity), ``ablations`` (the speed-up at
a fixed mini-batch, Figures 10-13, Table 2, the defaults), ``validation`` (against measured
steps), ``plots``; ``sweep`` is what they share, ``paper`` what the paper states."""
