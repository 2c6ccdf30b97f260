"""`dcp-plus ls`, `dcp-plus diff` and `--version`: in this process (:func:`run`), and as the real
command in a subprocess (:func:`run_process`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import dcp_plus
from dcp_plus.manager import CheckpointManager
from tests.conftest import ROOT, child_env, record_path, run_cli, save


def run_process(*argv: str) -> subprocess.CompletedProcess[str]:
    """The real ``dcp-plus`` command, in a subprocess."""
    proc = subprocess.run([sys.executable, "-m", "dcp_plus", *argv], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


run = run_cli


@pytest.fixture
def root(tmp_path):
    """A manager root: steps 1 and 2 committed (2 is latest), step 3 a crashed save."""
    path = tmp_path / "root"
    with CheckpointManager(str(path), interval=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((256,), float(step)), "step": step})
            mgr.wait()
    crashed = path / "step_00000003"
    crashed.mkdir()
    (crashed / "__0_0.deadbeef.dcpp").write_bytes(b"partial")
    return path


def test_ls_lists_committed_uncommitted_and_latest(root):
    proc = run_process("ls", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    rows = {r["step"]: r for r in info["checkpoints"]}
    assert sorted(rows) == [1, 2, 3] and info["latest"] == 2
    assert rows[1]["committed"] and rows[2]["committed"] and not rows[3]["committed"]
    assert [s for s, r in rows.items() if r["latest"]] == [2]
    assert rows[2]["tensors"] == 2 and rows[2]["bytes"] >= 256 * 4
    assert rows[3]["tensors"] is None and rows[3]["problem"] is None

    text = run("ls", str(root)).stdout
    assert "<- latest" in text.splitlines()[2] and "uncommitted" in text
    assert text.rstrip().endswith("3 checkpoint folders, 2 committed")


def test_ls_reports_a_damaged_record_without_failing(root):
    record_path(root / "step_00000001").write_bytes(b'{"format": "dcp_plus", broken')
    proc = run("ls", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in json.loads(proc.stdout)["checkpoints"] if r["step"] == 1)
    assert row["problem"] and "step_00000001" in row["problem"]
    assert "DAMAGED" in run("ls", str(root)).stdout


def test_ls_of_an_empty_root_says_so_and_a_missing_one_is_an_error(tmp_path):
    proc = run("ls", str(tmp_path))
    assert proc.returncode == 0 and "no checkpoints" in proc.stdout
    proc = run("ls", str(tmp_path / "nothing"))  # a typo, not an empty root
    assert proc.returncode == 2 and "nothing does not exist" in proc.stderr


def test_ls_refuses_an_unknown_scheme_and_a_bad_storage_option(tmp_path):
    proc = run("ls", "nosuch://bucket/x")
    assert proc.returncode == 2 and "no checkpoint backend for nosuch://" in proc.stderr
    proc = run("ls", str(tmp_path), "--storage-option", "novalue")
    assert proc.returncode == 2 and "expected KEY=VALUE" in proc.stderr


def test_diff_names_added_removed_and_changed_tensors(tmp_path):
    a = {"same": torch.arange(10.0), "content": torch.zeros(8), "dtype": torch.zeros(4),
         "shape": torch.zeros(4), "gone": torch.ones(3), "step": 1}
    b = {"same": torch.arange(10.0), "content": torch.ones(8),
         "dtype": torch.zeros(4, dtype=torch.float64), "shape": torch.zeros(2), "new": torch.ones(2),
         "step": 1}
    save(a, tmp_path / "a")
    save(b, tmp_path / "b")

    proc = run("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert proc.returncode == 1, proc.stderr
    d = json.loads(proc.stdout)
    assert d["added"] == ["new"] and d["removed"] == ["gone"] and d["same"] == 2
    changed = {c["name"]: c["changed"] for c in d["changed"]}
    assert changed == {"content": ["content"], "dtype": ["dtype", "bytes"],
                       "shape": ["shape", "bytes"]}

    text = run("diff", str(tmp_path / "a"), str(tmp_path / "b")).stdout
    assert "+ new" in text and "- gone" in text and "~ content: content" in text
    assert text.rstrip().endswith("1 added, 1 removed, 3 changed, 2 the same")


def test_diff_of_a_checkpoint_with_itself_is_empty_and_exits_0(tmp_path):
    save({"w": torch.randn(64)}, tmp_path / "a")
    proc = run("diff", str(tmp_path / "a"), str(tmp_path / "a"))
    assert proc.returncode == 0 and "0 added, 0 removed, 0 changed, 1 the same" in proc.stdout


def test_diff_of_something_that_is_no_checkpoint_exits_2(tmp_path):
    save({"w": torch.randn(4)}, tmp_path / "a")
    proc = run("diff", str(tmp_path / "a"), str(tmp_path))
    assert proc.returncode == 2 and "no commit record" in proc.stderr


def test_version_and_python_dash_m():
    proc = run_process("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"dcp-plus {dcp_plus.__version__}"
