"""Run configs: defaults for every key, ``base:`` inheritance, the modality table as encoder
sections, and errors that name the bad key with the closest valid one."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import orchmllm
from orchmllm.config import (
    CONFIG_DIR,
    RunConfig,
    VitConfig,
    WhisperConfig,
    config_path,
    load_config,
    packaged_configs,
    read_config,
    run_config,
)
from orchmllm.data.recipe import default_mix
from orchmllm.schema import LLM, Rate

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_defaults_are_the_tiny_model_with_every_modality():
    cfg = RunConfig()
    assert run_config({}) == cfg == run_config(None)
    assert list(cfg.model.encoders) == ["vision", "audio"]
    assert isinstance(cfg.model.encoders["vision"], VitConfig)
    assert isinstance(cfg.model.encoders["audio"], WhisperConfig)
    assert cfg.phases == ("vision", "audio", LLM)
    assert dict(cfg.rates) == {"vision": Rate(1, 4), "audio": Rate(2, 2)}
    assert cfg.model.feature_dims == {"vision": 3 * 14 * 14, "audio": 16}
    assert cfg.balance.policy("vision") == "greedy"
    assert cfg.balance.policy("audio") == "binary_search"
    assert cfg.balance.policy(LLM) == "greedy"


def test_tiny_yaml_spells_out_the_defaults_but_the_data_scale():
    """What the README and the config module say: an empty config is tiny.yaml but for
    these two keys (the mix and policies it spells out are the defaults')."""
    tiny, empty = load_config(ROOT / "configs" / "tiny.yaml"), RunConfig()
    assert tiny.model == empty.model and tiny.train == empty.train
    assert tiny.recipe == empty.recipe
    assert (tiny.data.scale, empty.data.scale) == (0.1, 1.0)
    assert (tiny.balance.ranks_per_node, empty.balance.ranks_per_node) == (2, None)
    assert dataclasses.replace(tiny.data, scale=1.0) == empty.data
    assert tiny.data.task_weights == default_mix()
    for phase in tiny.phases:
        assert tiny.balance.policy(phase) == empty.balance.policy(phase)
    assert tiny.balance.placement == empty.balance.placement


def test_configs_are_packaged_and_found_by_name_from_any_directory(tmp_path, monkeypatch):
    # One source: the checkout's configs/ is the package's directory, not a copy.
    assert (ROOT / "configs").resolve() == Path(CONFIG_DIR).resolve()
    assert Path(CONFIG_DIR).parent == Path(orchmllm.__file__).parent
    assert {"tiny", "mllm-10b", "mllm-18b", "mllm-84b"} <= set(packaged_configs())
    monkeypatch.chdir(tmp_path)
    tiny = Path(CONFIG_DIR) / "tiny.yaml"
    for name in ("tiny", "tiny.yaml", "configs/tiny.yaml"):
        assert Path(config_path(name)) == tiny, name
        assert load_config(name) == load_config(tiny)
    assert load_config("mllm-18b").model.llm.layers == 48  # its base: resolves in the package
    # A file that exists is read, not the packaged config of its name.
    (tmp_path / "tiny.yaml").write_text("train: {steps: 3}\n")
    assert load_config("tiny.yaml").train.steps == 3
    assert load_config("tiny").train.steps == 10


def test_a_missing_config_lists_the_configs_there_and_the_packaged_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "small.yaml").write_text("{}\n")
    with pytest.raises(FileNotFoundError) as err:
        load_config("mine/smal.yaml")
    message = str(err.value)
    assert "config 'mine/smal.yaml': no such file" in message
    assert "did you mean 'mine/small.yaml'?" in message
    assert "configs in mine/: small.yaml" in message
    assert ", ".join(packaged_configs()) in message
    with pytest.raises(FileNotFoundError, match="did you mean 'tiny' \\(a packaged config\\)"):
        load_config("configs/tinny.yaml")
    (tmp_path / "bad.yaml").write_text("data: {scale: [\n")
    with pytest.raises(ValueError, match="bad.yaml' is not valid YAML"):
        load_config("bad.yaml")


@pytest.mark.integration
def test_the_files_a_wheel_ships_find_the_configs_from_any_directory(tmp_path):
    """setuptools' build_py (the Python files and package data a wheel holds), plus the
    compiled core, imported from another directory: the configs are there and found by
    name and by the checkout's path."""
    lib = tmp_path / "lib"
    build = [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)]
    subprocess.run(build, cwd=ROOT, check=True, capture_output=True, timeout=120)
    core = next((ROOT / "orchmllm").glob("_core*"))
    shutil.copy(core, lib / "orchmllm" / core.name)
    code = (
        "import orchmllm; from orchmllm.config import config_path, load_config; "
        "print(orchmllm.__file__, config_path('tiny'), config_path('configs/mllm-10b.yaml'), "
        "load_config('mllm-18b').model.llm.layers, orchmllm.__version__)"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(lib)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    module, tiny, ten, layers, version = out.stdout.split()
    packaged = lib / "orchmllm" / "configs"
    assert module == str(lib / "orchmllm" / "__init__.py")
    assert (tiny, ten) == (str(packaged / "tiny.yaml"), str(packaged / "mllm-10b.yaml"))
    assert (packaged / "tiny.yaml").read_bytes() == (ROOT / "configs" / "tiny.yaml").read_bytes()
    assert layers == "48" and version == orchmllm.__version__


def test_version_is_set_in_one_place():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "orchmllm.__version__" }' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", orchmllm.__version__)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_builds(path):
    cfg = load_config(path)
    assert cfg.phases[-1] == LLM and cfg.model.encoders


def test_a_derived_config_states_only_what_differs(tmp_path):
    """``base:`` merges mappings key by key (relative to the file), ``null`` drops an encoder
    (its phase goes with it), anything else replaces."""
    (tmp_path / "child.yaml").write_text(
        yaml.safe_dump(
            {
                "base": str(ROOT / "configs" / "mllm-10b.yaml"),
                "model": {"encoders": {"audio": None}, "llm": {"layers": 4}},
                "data": {"tasks": {"asr": {"weight": 0.0}, "spoken_qa": None}},
                "train": {"steps": 3},
            }
        )
    )
    (tmp_path / "grandchild.yaml").write_text("base: child.yaml\ntrain: {lr: 0.5}\n")
    parent = load_config(ROOT / "configs" / "mllm-10b.yaml")
    cfg = load_config(tmp_path / "grandchild.yaml")
    assert list(cfg.model.encoders) == ["vision"] and cfg.phases == ("vision", LLM)
    assert cfg.model.encoders["vision"] == parent.model.encoders["vision"]
    assert cfg.model.llm.layers == 4 and cfg.model.llm.hidden == parent.model.llm.hidden
    # merged task by task: asr's weight changed, spoken_qa dropped, the rest inherited
    assert cfg.data.task_weights == {
        **{k: v for k, v in parent.data.task_weights.items() if k != "spoken_qa"},
        "asr": 0.0,
    }
    assert cfg.data.tasks["vqa"] == parent.data.tasks["vqa"]
    assert cfg.train.steps == 3 and cfg.train.lr == 0.5
    assert cfg.balance == parent.balance  # audio's policy stays, unused
    assert read_config(tmp_path / "grandchild.yaml")["train"] == {"steps": 3, "lr": 0.5}


def test_the_paper_configs_inherit_from_mllm_10b():
    ten = load_config(ROOT / "configs" / "mllm-10b.yaml")
    for name in ("mllm-18b", "mllm-84b"):
        raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
        assert raw["base"] == "mllm-10b.yaml"
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.balance == ten.balance and cfg.data.task_weights == ten.data.task_weights
        assert cfg.model.encoders["audio"].n_mels == 128  # inherited


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"modle": {}}, "config has no key 'modle'; did you mean 'model'?"),
        ({"model": {"encoders": {"visoin": {}}}}, "did you mean 'vision'?"),
        ({"model": {"encoders": {"vision": {"hiden": 3}}}}, "vision has no key 'hiden'; did you"),
        ({"model": {"encoders": {"vision": {"arch": "vitt"}}}}, "'vitt' is unknown; did you"),
        ({"model": {"llm": {"heads": 3}}}, "model.llm hidden=64 is not divisible by heads=3"),
        ({"model": {"llm": {"layers": 0}}}, "model.llm.layers must be a positive integer"),
        ({"model": {"vocab": True}}, "model.vocab must be a positive integer"),
        ({"model": {"encoders": {"vision": {"frozen": "yes"}}}}, "frozen must be true or false"),
        ({"train": {"seed": -1}}, "train.seed must be an integer >= 0"),
        ({"train": {"lr": 0}}, "train.lr must be a positive number"),
        ({"balance": {"policies": {"audo": "greedy"}}}, "did you mean 'audio'?"),
        ({"balance": {"policies": {"llm": "gredy"}}}, "'gredy' is no policy; did you mean"),
        ({"balance": {"placement": "autto"}}, "'autto' is no placement; did you mean 'auto'"),
        ({"balance": {"ranks_per_node": 0}}, "balance.ranks_per_node"),
        ({"balance": {"cost": "measurd"}}, "'measurd' is no cost; did you mean 'measured'"),
        ({"balance": {"min_r2": 2}}, "balance.min_r2 must be in"),
        ({"balance": {"context_parallel": 0}}, "balance.context_parallel must be a positive"),
        ({"balance": {"context_parallel": 2}}, "balance.placement must be 'none' with balance"),
        (
            {"balance": {"placement": "none", "max_load": {"llm": 100}}},
            "balance.max_load is a budget for splitting",
        ),
        (
            {"balance": {"placement": "none", "context_parallel": 2, "max_load": {"llm": -1}}},
            "balance.max_load.llm must be a number > 0, got -1",
        ),
        (
            {"balance": {"placement": "none", "context_parallel": 2, "max_load": {"vison": 9}}},
            "balance.max_load has no key 'vison'; did you mean 'vision'",
        ),
        ({"data": {"tasks": {"document": {"min_tokens": 0}}}}, "data.tasks.document.min_tokens"),
        ({"balance": {"costs": {"visoin": {}}}}, "did you mean 'vision'?"),
        ({"balance": {"costs": {"vision": {"gamma": 1}}}}, "balance.costs.vision has no key"),
        ({"balance": {"costs": {"vision": {"alpha": "x"}}}}, "balance.costs.vision"),
        ({"train": {"weight_decay": -0.1}}, "train.weight_decay must be a number >= 0"),
        ({"data": []}, "data must be a mapping"),
        ({"data": {"tasks": {"capton": {}}}}, "data.tasks has no key 'capton'; did you mean"),
        ({"data": {"tasks": {"vqa": {"p_multi": 1}}}}, "data.tasks.vqa has no key 'p_multi'"),
        ({"data": {"tasks": {"vqa": {"p_multi_image": 2}}}}, "data.tasks.vqa.p_multi_image"),
        ({"data": {"tasks": {"asr": {"weight": -1}}}}, "data.tasks.asr.weight must be in"),
        ({"data": {"tasks": {"chat": None}, "scale": 0}}, "data.scale must be a positive"),
        ({"data": {"patch": 16}}, "data.patch is the vision encoder's"),
        ({"plugins": ["orchmllm_no_such_plugin"]}, "plugin 'orchmllm_no_such_plugin': no module"),
    ],
)
def test_a_bad_config_names_the_key(raw, message):
    with pytest.raises(ValueError, match=message.replace("?", "\\?")):
        run_config(raw)


def test_errors_name_the_file_and_base_cycles_are_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {stepz: 3}\n")
    with pytest.raises(ValueError, match=f"config '{bad}': train has no key 'stepz'"):
        load_config(bad)
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match="base cycle"):
        load_config(tmp_path / "a.yaml")


def test_overrides_lay_on_the_config_file_and_the_config_checks_them():
    cfg = load_config(
        "tiny",
        {"train.steps": 3, "model.llm.layers": 3, "model.encoders.audio": None,
         "balance.policies.llm": "kk", "data.tasks": {"vqa": {"weight": 1.0}}},
    )  # fmt: skip
    base = load_config("tiny")
    assert (cfg.train.steps, cfg.model.llm.layers) == (3, 3)
    assert cfg.balance.policies == {**base.balance.policies, "llm": "kk"}  # merged key by key
    assert list(cfg.model.encoders) == ["vision"]
    assert cfg.data.tasks.keys() == base.data.tasks.keys()  # a mapping merges, as under base:
    assert cfg.data.tasks["vqa"].weight == 1.0
    assert cfg.model.llm.hidden == base.model.llm.hidden  # the rest of the section stays
    with pytest.raises(ValueError, match=r"with --train.steps=0: train.steps must be a positive"):
        load_config("tiny", {"train.steps": 0})
    with pytest.raises(ValueError, match="model.encoders.vision has no key 'n_mels'"):
        load_config("tiny", {"model.encoders.vision.n_mels": 8})  # whisper's, not the vit's


@pytest.mark.parametrize(
    "key, place",
    [
        ("mix", "data.tasks.<task>.weight"),
        ("max_image_side", "data.tasks.caption.max_image_side"),
        ("max_audio_s", "data.tasks.<asr, spoken_qa, vqa>.max_audio_s"),
        ("p_multi_image", "data.tasks.vqa.p_multi_image"),
        ("p_spoken_question", "data.tasks.vqa.p_spoken_question"),
    ],
)
def test_a_data_key_that_moved_into_its_task_names_its_new_place(key, place):
    with pytest.raises(ValueError, match=f"data.{key} moved to {re.escape(place)}"):
        run_config({"data": {key: 1}})


def test_a_task_section_is_laid_on_its_defaults_and_the_patch_is_the_encoders():
    cfg = run_config(
        {
            "model": {"encoders": {"vision": {"patch": 16}}},
            "data": {"tasks": {"vqa": {"p_multi_image": 0.5}, "chat": {}}},
        }
    )
    assert list(cfg.data.tasks) == ["vqa", "chat"]  # a task left out is not drawn
    assert cfg.data.tasks["vqa"].p_multi_image == 0.5
    assert cfg.data.tasks["vqa"].weight == default_mix()["vqa"]  # its default weight
    assert cfg.data.patch == 16
