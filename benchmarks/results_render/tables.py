"""The shared parts of the results renderers: formatting figures, markdown tables, picking
records, a file's records and its provenance line. Standard library only."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
Records = list[dict[str, Any]]


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "–" if x is None else format(x, spec)


def spread(s: dict[str, float] | None, spec: str = ".3g") -> str:
    """A mean over seeds with its min-max (``reproduce_paper``'s spread dicts); None is OOM."""
    if s is None:
        return "OOM"
    return f"{s['mean']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def span(values: Iterable[float], spec: str = ".3g") -> str:
    """``lo-hi`` of the values, or the one value when they are all equal."""
    v = sorted(values)
    lo, hi = format(v[0], spec), format(v[-1], spec)
    return lo if lo == hi else f"{lo}-{hi}"


def verdict(value: float, *, at_most: float | None = None, at_least: float | None = None) -> str:
    """``met`` or ``**NOT met**``: the figure against the benchmark's recorded bound."""
    ok = (at_most is None or value <= at_most) and (at_least is None or value >= at_least)
    return "met" if ok else "**NOT met**"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def target_table(rows: Iterable[Sequence[Any]]) -> list[str]:
    """The targets a section judges: what, the figure, and ``verdict``'s word."""
    return table(["target", "measured", ""], rows)


def where(records: Records, **match: Any) -> Records:
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def one(records: Records, **match: Any) -> dict[str, Any]:
    found = where(records, **match)
    if len(found) != 1:
        raise ValueError(f"expected one record with {match}, found {len(found)}")
    return found[0]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def provenance(records: Records) -> str:
    """Where one file's figures come from: its command, date and machine."""
    r = records[0]
    if "transcribed_from" in r:
        return f"Not written by the command: transcribed from {r['transcribed_from']}."
    if "run_command" not in r:
        return "Its records carry no run details (written before the benchmark recorded them)."
    load = " / ".join(f"{x:g}" for x in r["host_load_avg"])
    gpu = f"GPU {r['host_gpu']}" if r.get("host_gpu") else "no GPU"
    simd = f", widest SIMD `{r['host_simd']}`" if r.get("host_simd") else ""
    if r.get("numpy_disabled_features"):
        simd += f" (numpy's `{r['numpy_disabled_features']}` kernels turned off)"
    date = r["run_date"].replace("T", " ").removesuffix("Z")
    text = (
        f"From `{r['run_command']}`, run {date} UTC on "
        f"{r['host_cpu']}{simd}, {r['host_cores']} usable cores, {gpu}; load average "
        f"{load} (1 / 5 / 15 min) at its end; Python {r['python_version']}, numpy "
        f"{r['numpy_version']}, torch {r['torch_version']}."
    )
    return text + (f" The machine: {r['host_note']}." if r.get("host_note") else "")


# -- sections --------------------------------------------------------------------------------


def read(path: Path) -> Records:
    """One ``--json`` file's records, unedited."""
    return json.loads(path.read_text())
