"""``dcp-plus inspect`` / ``verify`` given a folder of checkpoints, and stock DCP steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import CheckpointManager
from tests.unit.test_cli_ls_diff import run


@pytest.fixture
def manager_root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    with CheckpointManager(str(path), interval=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((64,), float(step))})
            mgr.wait()
    return path


@pytest.fixture
def titan_folder(tmp_path: Path) -> Path:
    """What stock TorchTitan leaves: ``checkpoint/step-N`` folders of stock DCP saves."""
    folder = tmp_path / "dump" / "checkpoint"
    for step in (5, 10):
        sd = {"model.w": torch.arange(12.0).reshape(3, 4) * step, "step": torch.tensor(step)}
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(folder / f"step-{step}")),
                 no_dist=True)
    return folder


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_a_manager_root_is_named_as_such_with_the_commands_that_help(verb, manager_root):
    proc = run(verb, str(manager_root))
    assert proc.returncode == 2
    err = proc.stderr
    assert "is a folder of checkpoints, not a checkpoint" in err
    assert "2 committed checkpoints (step_00000001 .. step_00000002)" in err
    assert f"dcp-plus ls {manager_root}" in err
    assert f"dcp-plus inspect {manager_root}/step_00000002" in err


def test_a_torchtitan_checkpoint_folder_points_at_ls_and_its_steps(titan_folder):
    proc = run("inspect", str(titan_folder))
    assert proc.returncode == 2
    assert "folder of checkpoints" in proc.stderr and "step-10" in proc.stderr


def test_a_stock_step_is_listed_only_with_allow_pickle(titan_folder):
    step = titan_folder / "step-10"
    refused = run("inspect", str(step))
    assert refused.returncode == 2
    assert "--allow-pickle" in refused.stderr and "arbitrary code" in refused.stderr

    listed = run("inspect", "--allow-pickle", "--json", str(step))
    assert listed.returncode == 0, listed.stderr
    info = json.loads(listed.stdout)
    rows = {r["name"]: r for r in info["items"]}
    assert rows["model.w"]["dtype"] == "float32" and rows["model.w"]["shape"] == [3, 4]
    assert rows["model.w"]["bytes"] == 48 and rows["model.w"]["codec"] == "stock"
    assert info["totals"]["tensors"] == 2

    text = run("inspect", "--allow-pickle", str(step))
    assert text.returncode == 0 and "model.w" in text.stdout


def test_an_empty_folder_still_says_there_is_no_commit_record(tmp_path):
    proc = run("inspect", str(tmp_path))
    assert proc.returncode == 2
    assert "no commit record" in proc.stderr and "folder of checkpoints" not in proc.stderr
