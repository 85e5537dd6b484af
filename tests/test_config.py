"""Run configs: defaults for every key, ``base:`` inheritance, the modality table as encoder
sections, and errors that name the bad key with the closest valid one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchmllm.config import (
    RunConfig,
    VitConfig,
    WhisperConfig,
    load_config,
    read_config,
    run_config,
)
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
    tiny = load_config(ROOT / "configs" / "tiny.yaml")
    assert tiny.model == RunConfig().model
    assert tiny.train == RunConfig().train
    assert tiny.data.scale == 0.1 and tiny.balance.ranks_per_node == 2


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
                "data": {"mix": {"asr": 0.0, "spoken_qa": 0.0}},
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
    assert cfg.data.mix == {**parent.data.mix, "asr": 0.0, "spoken_qa": 0.0}  # merged
    assert cfg.train.steps == 3 and cfg.train.lr == 0.5
    assert cfg.balance == parent.balance  # audio's policy stays, unused
    assert read_config(tmp_path / "grandchild.yaml")["train"] == {"steps": 3, "lr": 0.5}


def test_the_paper_configs_inherit_from_mllm_10b():
    ten = load_config(ROOT / "configs" / "mllm-10b.yaml")
    for name in ("mllm-18b", "mllm-84b"):
        raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
        assert raw["base"] == "mllm-10b.yaml"
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.balance == ten.balance and cfg.data.mix == ten.data.mix
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
        ({"data": []}, "data must be a mapping"),
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
