"""orchmllm.train.report on metrics files built from the training metrics schema."""

import json
import subprocess
import sys

import matplotlib.image as mpimg
import numpy as np
import pytest

from orchmllm.train import report

PHASES = ("vision", "audio", "llm")


def _records(rng: np.random.Generator, *, steps: int = 5, world: int = 4) -> list[dict]:
    """Metrics as orchmllm.train writes them: random per-rank loads, a balanced 'after'."""
    out = []
    for s in range(steps):
        phases = {}
        for name in PHASES:
            before = rng.uniform(10.0, 100.0, size=world)
            after = np.full(world, before.sum() / world) * rng.uniform(0.98, 1.02, size=world)
            phases[name] = {
                "imbalance_before": float(before.max() / before.mean()),
                "imbalance_after": float(after.max() / after.mean()),
                "loads_before": before.tolist(),
                "loads_after": after.tolist(),
                "bytes_intra": int(rng.integers(0, 10**6)),
                "bytes_inter": int(rng.integers(0, 10**6)),
                "plan_ms": float(rng.uniform(0.1, 2.0)),
            }
        out.append(
            {
                "step": s + 1,
                "loss": float(5.0 - 0.1 * s),
                "step_time_s": float(rng.uniform(0.5, 1.5)),
                "tokens_per_s": float(rng.uniform(1e3, 2e3)),
                "balance": "full",
                "world_size": world,
                "phases": phases,
                "rss_anon_mb_max": 500.0 + rng.uniform(-5, 5),
                "rss_file_mb_max": 200.0 + 50.0 * s,
            }
        )
    return out


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_writes_nontrivial_pngs_and_summary(tmp_path, rng):
    records = _records(rng)
    result = report.write_report(_write(tmp_path / "m.jsonl", records), tmp_path / "out")
    for name in ("loads", "step_time", "imbalance", "memory"):
        png = tmp_path / "out" / f"{name}.png"
        assert png.stat().st_size > 5000, name
        img = mpimg.imread(png)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300, name
        # A real plot has many distinct colours; a blank canvas has one.
        assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 20, name
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "balance=full" in text and all(p in text for p in PHASES)
    assert result["files"]["loads"].endswith("loads.png")


def test_summary_equals_values_recomputed_from_records(rng):
    records = _records(rng, steps=6, world=3)
    s = report.summarize(records)
    timed = records[1:]  # first step is warm-up
    assert s["steps"] == 6 and s["timed_steps"] == 5 and s["world_size"] == 3
    assert s["step_time_mean_s"] == pytest.approx(sum(r["step_time_s"] for r in timed) / 5)
    assert s["tokens_per_s_mean"] == pytest.approx(sum(r["tokens_per_s"] for r in timed) / 5)
    assert s["loss_first"] == 5.0 and s["loss_last"] == pytest.approx(4.5)
    for name in PHASES:
        phs = [r["phases"][name] for r in records]
        assert s[f"{name}_imbalance_before_mean"] == pytest.approx(
            np.mean([p["imbalance_before"] for p in phs])
        )
        assert s[f"{name}_imbalance_after_mean"] == pytest.approx(
            np.mean([p["imbalance_after"] for p in phs])
        )
        ratio = np.mean([max(p["loads_before"]) / max(p["loads_after"]) for p in phs])
        assert s[f"{name}_max_load_ratio_mean"] == pytest.approx(ratio)
        assert s[f"{name}_bytes_inter_total"] == sum(p["bytes_inter"] for p in phs)
        assert s[f"{name}_plan_ms_mean"] == pytest.approx(np.mean([p["plan_ms"] for p in phs[1:]]))


def test_single_step_is_its_own_mean_and_phases_may_be_missing(tmp_path, rng):
    records = _records(rng, steps=2)
    del records[1]["phases"]["audio"]  # a model without audio in some step
    s = report.summarize(records[:1])
    assert s["timed_steps"] == 1 and s["step_time_mean_s"] == records[0]["step_time_s"]
    assert report.phase_names(records) == ["vision", "audio", "llm"]
    report.write_report(_write(tmp_path / "m.jsonl", records), tmp_path / "o", step=1)
    assert (tmp_path / "o" / "loads.png").stat().st_size > 5000


@pytest.mark.parametrize(
    "content, needle",
    [
        ("", "no metrics records"),
        ("\n\n", "no metrics records"),
        ("{not json\n", "line 1: not valid JSON"),
        ("[1, 2]\n", "expected a JSON object"),
        ('{"step": 1}\n', "missing field"),
    ],
)
def test_malformed_files_raise_value_error_naming_file(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle) as e:
        report.load_metrics(path)
    assert "bad.jsonl" in str(e.value)


def test_inconsistent_records_raise(tmp_path, rng):
    rec = _records(rng, steps=1, world=4)[0]
    rec["phases"]["llm"]["loads_after"] = [1.0, 2.0]
    with pytest.raises(ValueError, match="expected 4 per-rank loads"):
        report.load_metrics(_write(tmp_path / "a.jsonl", [rec]))
    rec = _records(rng, steps=1)[0]
    rec["step_time_s"] = "fast"
    with pytest.raises(ValueError, match="step_time_s"):
        report.load_metrics(_write(tmp_path / "b.jsonl", [rec]))
    two = _records(rng, steps=2, world=2)
    two[1]["world_size"] = 3
    two[1]["phases"] = _records(rng, steps=1, world=3)[0]["phases"]
    with pytest.raises(ValueError, match="differs between steps"):
        report.load_metrics(_write(tmp_path / "c.jsonl", two))
    with pytest.raises(ValueError, match="step=99"):
        report.write_report(_write(tmp_path / "d.jsonl", two[:1]), tmp_path / "o", step=99)


@pytest.mark.integration
def test_missing_file_and_cli(tmp_path, rng, capsys):
    assert report.main([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    metrics = _write(tmp_path / "m.jsonl", _records(rng, steps=3))
    proc = subprocess.run(
        [sys.executable, "-m", "orchmllm.train.report", metrics, "--out", str(tmp_path / "cli")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "imb before" in proc.stdout and "loads.png" in proc.stdout
    assert (tmp_path / "cli" / "imbalance.png").is_file()


def test_records_without_per_rank_loads(tmp_path, rng):
    """What train writes without --metrics-per-rank: the slowest rank's loads, no arrays.
    The summary is the same; loads.png (which needs every rank's load) is skipped, and so is
    memory.png for records without the memory fields."""
    records = _records(rng, steps=4)
    slim = json.loads(json.dumps(records))
    for r in slim:
        for ph in r["phases"].values():
            ph["load_max_before"] = max(ph.pop("loads_before"))
            ph["load_max_after"] = max(ph.pop("loads_after"))
        del r["rss_file_mb_max"]  # metrics of a trainer that did not record memory
    assert report.summarize(slim) == report.summarize(records)
    result = report.write_report(_write(tmp_path / "m.jsonl", slim), tmp_path / "o")
    assert "loads" not in result["files"] and not (tmp_path / "o" / "loads.png").exists()
    assert "memory" not in result["files"] and not (tmp_path / "o" / "memory.png").exists()
    assert (tmp_path / "o" / "imbalance.png").stat().st_size > 5000
    del slim[2]["phases"]["llm"]["load_max_after"]
    with pytest.raises(ValueError, match="line 3 phase 'llm': missing field.*load_max_after"):
        report.load_metrics(_write(tmp_path / "bad.jsonl", slim))
