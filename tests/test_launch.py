"""Launch mistakes: a config typo, a missing config file, a process count the config cannot
split, no launcher. Each prints one block, first and once, naming the fix; real torchrun."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from orchmllm.config import packaged_configs
from orchmllm.testing import torchrun
from orchmllm.train import launch, parse_args, run_config
from orchmllm.train.launch import (
    LAUNCH_ERROR_EXIT,
    LaunchError,
    check_ranks_per_node,
    not_launched,
    preflight,
)

HEAD = "orchmllm.train: cannot start"


def test_a_world_size_the_ranks_per_node_do_not_divide_names_both_fixes():
    check_ranks_per_node(2, 4, configured=True)
    with pytest.raises(LaunchError) as err:
        check_ranks_per_node(2, 3, configured=True)
    message = str(err.value)
    assert "balance.ranks_per_node: 2 (the config) does not divide the world size 3" in message
    assert "--nproc_per_node=2 or 4" in message
    assert "a divisor of 3 (1, 3) or null" in message
    with pytest.raises(LaunchError, match="4 ranks per node \\(the launcher's LOCAL_WORLD_SIZE"):
        check_ranks_per_node(4, 6, configured=False)


def test_no_launcher_names_the_torchrun_command_with_the_arguments_given():
    message = str(not_launched(["--config", "my dir/tiny.yaml", "--steps", "3"]))
    assert (
        "torchrun --nproc_per_node=N -m orchmllm.train --config 'my dir/tiny.yaml' --steps 3"
        in message
    )
    assert "--nproc_per_node=1" in message


def test_a_tracker_that_is_not_installed_is_a_launch_error(monkeypatch):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(["--config", "tiny", "--wandb", "my-project"])
    with pytest.raises(LaunchError, match="--wandb needs the wandb package: pip install wandb"):
        preflight(args, [], run_config)
    args = parse_args(["--config", "tiny"])
    assert preflight(args, [], run_config).balance.ranks_per_node == 2  # the rest passes


def test_the_command_line_is_refused_by_the_first_rank_of_a_node_only(monkeypatch, capsys):
    peer = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    monkeypatch.setattr(launch, "PEER_GRACE_S", 0.0)  # torchrun would have ended it by then
    for env, shown in ((peer, False), ({**peer, "LOCAL_RANK": "0"}, True)):
        with pytest.raises(SystemExit) as end, launch.quiet_peers(env):
            parse_args(["--help"])
        assert end.value.code == 0 and bool(capsys.readouterr().out) == shown
    with pytest.raises(SystemExit) as end, launch.quiet_peers(peer):
        parse_args(["--config", "tiny", "--steps", "x"])
    assert end.value.code == 2  # held, then shown: a rank still running after the grace
    assert capsys.readouterr().err.count("'train.steps' (given 'x') must be an integer") == 1


def _first_lines(log: str, n: int) -> str:
    return "\n".join(log.splitlines()[:n])


@pytest.mark.integration
@pytest.mark.parametrize(
    ("config", "nproc", "fix"),
    [
        ("typo", 2, "did you mean 'examples_per_rank'?"),
        ("configs/tinny.yaml", 2, f"packaged configs, by name from any directory (--config "
         f"tiny): {', '.join(packaged_configs())}"),
        ("tiny", 3, "launch a multiple of 2 processes (--nproc_per_node=2 or 4"),
        ("plugin", 2, "plugin 'no_such_plugin.py': no such file"),
    ],
    ids=["typo", "missing", "nproc3", "plugin"],
)  # fmt: skip
def test_a_launch_mistake_prints_its_fix_first_and_once(tmp_path, repo_env, config, nproc, fix):
    extra = []
    if config == "typo":
        config = str(tmp_path / "typo.yaml")
        (tmp_path / "typo.yaml").write_text("data: {examples_per_rnk: 4}\n")
    if config == "plugin":
        config, extra = "tiny", ["--plugin", "no_such_plugin.py"]
    log = tmp_path / "log"
    proc = torchrun(
        ["-m", "orchmllm.train", "--config", config, *extra], nproc, log=log, env=repo_env,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.wait(timeout=240) != 0
    out = log.read_text()
    assert out.startswith(f"{HEAD} (rank 0):\n"), out[:2000]
    assert fix in _first_lines(out, 5), out[:2000]
    assert out.count(HEAD) == 1 and out.count(fix) == 1, out
    assert f"exitcode  : {LAUNCH_ERROR_EXIT}" in out  # torchrun's own summary, after ours
    assert "orchmllm/" not in out  # no traceback of ours


@pytest.mark.integration
def test_the_trainer_started_without_torchrun_says_how_to_start_it(tmp_path, repo_env):
    env = {k: v for k, v in repo_env.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-m", "orchmllm.train", "--config", "tiny", "--steps", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == LAUNCH_ERROR_EXIT
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert lines[0] == HEAD + ":" and len(lines) == 4, out.stderr
    assert "torchrun --nproc_per_node=N -m orchmllm.train --config tiny --steps 2" in lines[2]
