"""`dcp-plus gc`: uncommitted saves and retention, under the root's lease; run as the real
command in a subprocess, beside a live (then SIGKILLed) trainer process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dcp_plus.manager import CheckpointManager
from tests.conftest import ROOT, assert_bit_exact, child_env
from tests.unit.test_cli_ls_diff import run

STEPS = (1, 2, 3, 4)


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), float(step))}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1-4 committed (4 latest), step 5 a crashed save."""
    path = tmp_path / "root"
    with CheckpointManager(str(path), interval=1, keep_last=None) as mgr:
        for step in STEPS:
            mgr.save(step, state(step))
            mgr.wait()
    crashed = path / "step_00000005"
    crashed.mkdir()
    (crashed / "__0_0.deadbeef.dcpp").write_bytes(b"partial")
    return path


def steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


def test_dry_run_lists_and_keeps_everything(root: Path) -> None:
    proc = run("gc", str(root), "--dry-run", "--keep-last", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert sorted(r["name"] for r in res["remove"]) == [
        "step_00000001", "step_00000002", "step_00000005"]
    assert {r["name"]: r["why"] for r in res["remove"]}["step_00000005"] == "uncommitted"
    assert [r["name"] for r in res["keep"]] == ["step_00000003", "step_00000004"]
    assert len(steps(root)) == 5  # nothing removed
    text = run("gc", str(root), "--dry-run", "--keep-last", "2").stdout
    assert "would remove" in text and "3 to remove (dry run)" in text


def test_gc_removes_uncommitted_and_retention_and_the_latest_still_loads(root: Path) -> None:
    proc = run("gc", str(root), "--keep-last", "2")
    assert proc.returncode == 0, proc.stderr
    assert "3 removed" in proc.stdout
    assert steps(root) == ["step_00000003", "step_00000004"]
    with CheckpointManager(str(root), read_only=True) as mgr:
        out = {"w": torch.zeros(256)}
        assert mgr.load_latest(out) == 4
    assert_bit_exact(out, state(4))


def test_without_keep_last_only_uncommitted_saves_go(root: Path) -> None:
    assert run("gc", str(root)).returncode == 0
    assert steps(root) == [f"step_{s:08d}" for s in STEPS]


def test_keep_last_one_never_removes_the_newest_committed(root: Path) -> None:
    (root / "step_00000004" / ".metadata").unlink()  # now uncommitted: 3 is the newest
    assert run("gc", str(root), "--keep-last", "1").returncode == 0
    assert steps(root) == ["step_00000003"]
    with CheckpointManager(str(root), read_only=True) as mgr:
        assert mgr.latest_step() == 3  # the pointer was repaired


def test_a_damaged_newest_record_never_pushes_the_loadable_checkpoints_out(root: Path) -> None:
    (root / "step_00000004" / ".metadata").write_bytes(b"{garbage")
    proc = run("gc", str(root), "--keep-last", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    # retention counts only loadable checkpoints: 3 is the newest, the damaged 4 stays
    assert steps(root) == ["step_00000003", "step_00000004"]
    assert {r["name"] for r in res["remove"]} == {"step_00000001", "step_00000002",
                                                  "step_00000005"}
    with CheckpointManager(str(root), read_only=True) as mgr:
        assert mgr.latest_step() == 3  # the pointer names a loadable checkpoint
        out = {"w": torch.zeros(256)}
        assert mgr.load_latest(out) == 3
    assert_bit_exact(out, state(3))


@pytest.mark.parametrize("argv, needle", [
    (["--keep-last", "0"], "keep at least 1"),
    (["--keep-every", "-3"], "--keep-every -3"),
    (["--keep-every", "10"], "only adds to what --keep-last keeps"),
])
def test_bad_retention_values_are_refused(root: Path, argv: list[str], needle: str) -> None:
    proc = run("gc", str(root), *argv)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert len(steps(root)) == 5


def test_a_missing_root_or_a_file_is_an_input_error(tmp_path: Path) -> None:
    missing = run("gc", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "f").write_text("x")
    file = run("gc", str(tmp_path / "f"))
    assert file.returncode == 2 and "is a file, expected a directory" in file.stderr


TRAINER = textwrap.dedent("""
    import sys, time, torch
    from dcp_plus.manager import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], interval=1, keep_last=None)
    mgr.save(6, {"w": torch.full((256,), 6.0)}); mgr.wait()
    print("ready", flush=True)
    time.sleep(600)
""")


def test_gc_refuses_beside_a_live_trainer_and_takes_over_once_it_is_killed(root: Path) -> None:
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(root)], cwd=ROOT,
                               env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "ready"
        # the trainer's own start removed the crashed step 5; make a new one mid-"save"
        crashed = root / "step_00000007"
        crashed.mkdir()
        (crashed / "__0_0.cafe.dcpp").write_bytes(b"in flight")
        live = run("gc", str(root), "--keep-last", "1")
        assert live.returncode == 2, live.stdout + live.stderr
        assert f"pid {trainer.pid}" in live.stderr and "in use" in live.stderr, live.stderr
        assert crashed.exists() and len(steps(root)) == 6
        dry = run("gc", str(root), "--dry-run")
        assert dry.returncode == 0 and "gc would refuse now" in dry.stdout, dry.stdout
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
    proc = run("gc", str(root), "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert steps(root) == ["step_00000006"]
