"""A user's extension from one file outside the package (issue 37's acceptance test).

``tests/plugins/imu_plugin.py`` adds a modality (``imu``) with its own encoder architecture
(``imu_conv``) and its own data task (``imu_caption``) through the public registries; no
package file names it. Loaded with ``--plugin``, the trainer trains it on 2 gloo ranks (every
balance mode the same losses), it has its row in the per-phase table, and the simulator plans
a config naming it. Registration is process-wide, so the in-process tests undo it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from orchmllm import schema
from orchmllm.config import TrainRecipe, load_config, packaged_configs, run_config
from orchmllm.data import recipe
from orchmllm.data.recipe import weighted_tasks
from orchmllm.data.synthetic import SyntheticConfig, fingerprint
from orchmllm.models.spec import ARCHS, unregister_architecture
from orchmllm.plugins import load_plugin, load_plugins
from orchmllm.schema import EncodingRates, Rate
from orchmllm.sim import plan_memory
from orchmllm.sim.layout import plan, tailored  # before the plugin: its rows are read at use
from orchmllm.sim.sweep import load_model, run_case, sample_pool
from orchmllm.testing import run_distributed
from orchmllm.train.memory_oracle import against_model, symmetric_batch

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = str(ROOT / "tests" / "plugins" / "imu_plugin.py")
TINY = ROOT / "configs" / "tiny.yaml"


def _imu_config(tmp_path, *, plugins: bool, **data) -> str:
    """tiny.yaml plus the imu encoder and task (and, with ``plugins``, the plugin's path)."""
    raw = {
        "base": str(TINY),
        "model": {"encoders": {"imu": {"arch": "imu_conv", "downsample": 2}}},
        "data": {"tasks": {"imu_caption": {"weight": 0.4}}, **data},
    }
    if plugins:
        raw["plugins"] = [PLUGIN]
    path = os.path.join(tmp_path, f"imu{'-plugins' if plugins else ''}.yaml")
    Path(path).write_text(yaml.safe_dump(raw))
    return path


@contextlib.contextmanager
def _loaded(path: str = PLUGIN):
    """The plugin (or a copy of it) loaded in this process, and undone afterwards."""
    module = load_plugin(path)
    try:
        yield module
    finally:
        recipe.unregister_task("imu_caption")
        unregister_architecture("imu_conv")
        schema.unregister_modality("imu")
        sys.modules.pop(module.__name__)


@pytest.fixture
def imu():
    with _loaded() as module:
        yield module


def test_a_plugin_that_does_not_load_is_named(tmp_path):
    with pytest.raises(ValueError, match="plugin 'no_such_plugin_mod': no module named"):
        load_plugins(["no_such_plugin_mod"])
    with pytest.raises(ValueError, match="plugin 'missing.py': no such file"):
        load_plugin("missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('half-written plugin')\n")
    with pytest.raises(ValueError, match="plugin .*broken.py' failed to load: .*half-written"):
        load_plugin(str(broken))
    with pytest.raises(ValueError, match="plugins must be a list"):
        load_plugins(PLUGIN)
    with pytest.raises(ValueError, match="plugins must be a list"):
        run_config({"plugins": PLUGIN})


def test_the_plugin_registers_once_and_changes_no_existing_config():
    """Loading it again is a no-op; every packaged config is what it was without it (a new
    row is encoded and drawn only where a config names it)."""
    before = {name: load_config(name) for name in packaged_configs()}
    with _loaded() as module:
        assert load_plugin(PLUGIN) is module
        assert {"imu", "imu_conv", "imu_caption"} <= {*schema.MODALITIES, *ARCHS, *recipe.TASKS}
        assert {name: load_config(name) for name in packaged_configs()} == before
    assert "imu" not in schema.MODALITIES


def test_its_encoder_counts_its_parameters_and_encodes_packed_windows(imu):
    cfg = run_config({"model": {"encoders": {"imu": {"arch": "imu_conv"}}}})
    assert cfg.phases == ("vision", "audio", "imu", "llm")
    enc = cfg.model.encoders["imu"]
    module = imu.ImuEncoder(enc, 64)
    assert enc.parameters(64) == sum(p.numel() for p in module.parameters())
    out = module(torch.randn(24, enc.channels), torch.tensor([8, 16]))  # window 2: 4 + 8
    assert out.shape == (12, 64)


def test_the_simulator_plans_a_config_naming_it(tmp_path, imu):
    """The simulator loads the plugin from the config's ``plugins:`` list, draws the task's
    recordings, and every mode plans the imu phase; OrchMLLM's mode balances it."""
    assert tailored()["imu"] == "greedy"  # read when called, after the sim's import
    model = load_model(_imu_config(tmp_path, plugins=True))
    assert list(model.modules) == ["vision", "audio", "imu", "llm"]
    batch = sample_pool(model, 8, 32, seed=0)
    recordings = batch.of("imu")
    assert recordings.raw.size > 30 and (recordings.raw % 2 == 0).all()
    imbalance = {}
    for mode in ("none", "full"):
        layout = plan(batch, mode, config=model.config, modules=model.modules, ranks_per_node=4)
        dst = layout.items["imu"]
        assert dst.shape == recordings.raw.shape
        loads = np.bincount(dst, weights=recordings.raw, minlength=8)
        imbalance[mode] = loads.max() / loads.mean()
    assert imbalance["full"] < imbalance["none"]
    record = run_case(model, 8, "full", examples_per_rank=8, placement="node")
    assert record["compute_imu_s"] > 0 and record["imbalance_imu"] >= 1.0


def test_plan_memory_on_a_config_naming_it(tmp_path, imu):
    config = _imu_config(tmp_path, plugins=True)
    record = plan_memory.main(["--config", config, "--gpus", "2", "--steps", "1"])
    assert record["peaks"]


@pytest.mark.parametrize("world", [2, 8])
def test_the_plugins_architecture_needs_no_memory_code(tmp_path, imu, world):
    """The memory model replays the plugin's packed encoder as every packed one (a linear front
    end over ``stride`` merged rows, packed blocks, the connector) and meets torch's own
    tracker of the plugin's real module (the oracle, on fake tensors) in every phase."""
    config = load_config(_imu_config(tmp_path, plugins=False))
    recipe = TrainRecipe(precision="bf16-mixed", checkpointing=1)
    items = {"vision": (64, 256), "audio": (120, 300), "imu": (400, 900, 200)}
    batch, layout = symmetric_batch(world, items, (90, 110, 60))
    figures = against_model(config.model, recipe, world, batch, layout)
    ratios = {phase: predicted / measured for phase, (measured, predicted) in figures.items()}
    print(ratios)
    assert all(0.99 <= r <= 1.01 for r in ratios.values()), ratios


def test_the_data_cache_key_covers_the_plugins_draw(tmp_path):
    """The synthetic dataset's cache key reads the plugin's file: an edited draw regenerates."""
    copy = tmp_path / "imu_copy.py"
    copy.write_text(Path(PLUGIN).read_text())
    with _loaded(str(copy)):
        cfg = SyntheticConfig(tasks=weighted_tasks({"imu_caption": 1.0}), feature_dims={"imu": 6})
        rates = EncodingRates({"imu": Rate(stride=2)})
        before = fingerprint(cfg, rates)
        assert fingerprint(cfg, rates) == before
        copy.write_text(copy.read_text().replace("integers(8, 60, n)", "integers(8, 61, n)"))
        assert fingerprint(cfg, rates) != before


def _train_worker(rank: int, world: int, config: str, tmp_path: str) -> dict:
    """The trainer's main with ``--plugin``, in two balance modes; rank 0 returns the
    losses and the per-phase table of each."""
    from orchmllm.train import main

    torch.set_num_threads(1)
    out = {}
    for mode in ("none", "full"):
        metrics = os.path.join(tmp_path, f"{mode}.jsonl")
        summary = main(
            ["--plugin", PLUGIN, "--config", config, "--steps", "2", "--balance", mode,
             "--precision", "float64", "--data-dir", os.path.join(tmp_path, "data"),
             "--quiet", "--metrics", metrics]
        )  # fmt: skip
        records = _records(metrics)
        out[mode] = {
            "table": summary.table(),
            "losses": [r["loss"] for r in records],
            "imu_load": sum(r["phases"]["imu"]["load_max_before"] for r in records),
        }
    return out


def _records(path: str) -> list[dict]:
    import json

    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.integration
def test_the_trainer_trains_it_from_the_plugin_flag(tmp_path):
    config = _imu_config(tmp_path, plugins=False, examples_per_rank=3)
    with pytest.raises(ValueError, match="no modality named 'imu'|has no key 'imu'"):
        load_config(config)  # this process has not loaded the plugin: the config needs it
    runs = run_distributed(_train_worker, 2, config, str(tmp_path), timeout=240)[0]
    none, full = runs["none"], runs["full"]
    assert len(none["losses"]) == 2 and np.isfinite(none["losses"]).all()
    np.testing.assert_allclose(full["losses"], none["losses"], rtol=0, atol=1e-5)
    for run in runs.values():
        assert run["imu_load"] > 0  # the steps held recordings: the imu encoder ran
        rows = [line.split()[0] for line in run["table"].splitlines()]
        assert "imu" in rows, run["table"]
