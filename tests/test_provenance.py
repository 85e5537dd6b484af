"""orchmllm.provenance: every --json record says when, how and where it was measured."""

import json
import math
import os
import sys

from orchmllm.provenance import command, run_info, write_records


def test_records_carry_the_run_and_stay_strict_json(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHMLLM_HOST_NOTE", "shared VM")
    monkeypatch.setenv("NPY_DISABLE_CPU_FEATURES", "X86_V4")
    path = tmp_path / "out.json"
    records = [{"case": 1, "ms": 2.5}, {"case": 2, "ms": math.nan, "bad": -math.inf}]
    write_records(path, records, command_line="python benchmarks/x.py --json out.json")
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert len(text.splitlines()) == 2 + len(records)  # brackets, then one record per line
    out = json.loads(text)
    assert [r["case"] for r in out] == [1, 2] and out[0]["ms"] == 2.5
    assert out[1]["ms"] is None and out[1]["bad"] is None
    assert records[1]["ms"] != records[1]["ms"]  # the caller's records are left as they were
    for r in out:
        assert r["run_command"] == "python benchmarks/x.py --json out.json"
        assert r["host_note"] == "shared VM" and r["host_cores"] >= 1
        assert r["numpy_disabled_features"] == "X86_V4"
        assert len(r["host_load_avg"]) == 3 and r["run_date"].endswith("Z")
        assert r["numpy_version"] and r["python_version"].count(".") == 2


def test_the_command_names_the_script_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "benchmarks" / "x.py"
    assert (
        command([str(script), "--json", "a b.json"]) == "python benchmarks/x.py --json 'a b.json'"
    )
    elsewhere = os.path.join(os.sep, "opt", "y.py")
    assert command([elsewhere, "--quick"]) == f"python {elsewhere} --quick"


def test_no_gpu_is_named_without_torch_imported_by_the_caller(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert run_info()["host_gpu"] is None
