"""CheckpointManager in one process: commit, ``latest``, retention, clean-up on start, resume,
one persist in flight, and storage errors (a full tmpfs, a root the user may not write)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dcp_plus.errors import CheckpointSaveError
from dcp_plus.manager import CheckpointManager
from dcp_plus.manager.retention import to_remove
from dcp_plus.readers.inspect import verify
from tests.conftest import (
    ROOT,
    assert_bit_exact,
    child_env,
    clone_state,
    flip_byte,
    load_target,
    mounted,
    read_record_json,
    record_path,
)


def state(step: int, nbytes: int = 64 << 10) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(nbytes // 4, generator=gen), "b": torch.arange(7) * step,
            "step": step}


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if record_path(p).exists())


def test_save_commits_then_advances_latest_and_resolves_the_handle(tmp_path):
    phases: list[tuple[str, int]] = []
    with CheckpointManager(tmp_path, on_phase=lambda p, s: phases.append((p, s))) as m:
        t0 = time.perf_counter()  # the manager's default clock
        h = m.save(3, state(3))
        stats = h.result(timeout=60)
        wall_s = time.perf_counter() - t0
        assert h.staged.done() and h.staged.exception() is None
        assert stats.ok and stats.step == 3
        # persist (snapshot complete -> commit) was measured, and inside the save's wall time
        assert stats.persist_s > 0 and stats.staging_s + stats.persist_s <= wall_s
        assert m.latest_step() == 3 and [c.step for c in m.list()] == [3]
        assert verify(h.path).ok
    assert phases == [("stage", 3), ("persist", 3), ("commit", 3), ("done", 3)]
    assert json.loads((tmp_path / "latest").read_text())["step"] == 3


def test_retention_keeps_the_last_n_every_kth_and_always_the_newest():
    assert to_remove([1, 2, 3, 4, 5], keep_last=2, keep_every=None) == [1, 2, 3]
    assert to_remove([10, 20, 30, 40, 50], keep_last=1, keep_every=20) == [10, 30]
    assert to_remove([7], keep_last=1, keep_every=None) == []
    assert to_remove([1, 2, 3], keep_last=None, keep_every=None) == []


def test_retention_runs_after_each_commit(tmp_path):
    with CheckpointManager(tmp_path, keep_last=2, keep_every=4) as m:
        for step in range(1, 8):
            m.save(step, state(step)).result(timeout=60)
        assert committed(tmp_path) == [4, 6, 7]
        assert [c.step for c in m.list()] == [4, 6, 7] and m.latest_step() == 7


def test_uncommitted_directories_are_reported_and_removed_on_start(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(2, state(2)).result(timeout=60)
    crashed = tmp_path / "step_00000004"
    crashed.mkdir()
    (crashed / "__0_0.abc.dcpp").write_bytes(b"x" * 100)
    (tmp_path / "latest").write_text(json.dumps({"step": 4}))  # a stale/wrong pointer
    with CheckpointManager(tmp_path) as m:
        assert m.cleaned == [str(crashed)]
        assert not crashed.exists() and committed(tmp_path) == [2]
        assert m.latest_step() == 2


def test_load_latest_returns_none_when_there_is_no_checkpoint(tmp_path):
    with CheckpointManager(tmp_path) as m:
        target = load_target(state(0))
        assert m.load_latest(target) is None


def test_load_latest_loads_the_newest_in_place_bit_exact(tmp_path):
    with CheckpointManager(tmp_path, keep_last=None) as m:
        for step in (1, 2):
            m.save(step, state(step)).result(timeout=60)
    with CheckpointManager(tmp_path) as m:
        target = load_target(state(0))
        assert m.load_latest(target) == 2
        assert_bit_exact(target, state(2))


def test_load_latest_skips_a_corrupted_newest_checkpoint(tmp_path):
    with CheckpointManager(tmp_path, keep_last=None) as m:
        for step in (1, 2):
            m.save(step, state(step)).result(timeout=60)
    newest = tmp_path / "step_00000002"
    ext = max(read_record_json(newest)["extents"], key=lambda e: e["length"])
    flip_byte(newest / ext["file"], ext["offset"] + 5)
    with CheckpointManager(tmp_path) as m:
        target = load_target(state(0))
        assert m.load_latest(target) == 1
        assert_bit_exact(target, state(1))


def test_a_save_issued_while_one_persists_waits_for_it_or_is_skipped(tmp_path):
    release = threading.Event()
    phases: list[tuple[str, int]] = []

    def hook(phase: str, step: int) -> None:
        phases.append((phase, step))
        if (phase, step) == ("persist", 1):
            release.wait(60)

    with CheckpointManager(tmp_path, on_phase=hook) as m:
        first = m.save(1, state(1))
        first.staged.result(timeout=60)
        assert m.save(2, state(2), if_busy="skip") is None
        second: list = []
        t = threading.Thread(target=lambda: second.append(m.save(3, state(3))))
        t.start()
        t.join(0.3)  # had save(3) not waited, it would have staged by now
        release.set()
        t.join(60)
        second[0].result(timeout=60)
    assert phases.index(("done", 1)) < phases.index(("stage", 3))
    assert ("stage", 2) not in phases


def test_the_guard_makes_the_snapshot_complete_before_the_update(tmp_path):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path) as m:
        m.guard(opt)
        expected = clone_state(model.state_dict())
        h = m.save(1, {"model": model.state_dict()})
        model(torch.randn(2, 64)).sum().backward()
        opt.step()  # waits for the snapshot, then changes the weights
        h.result(timeout=60)
        target = {"model": load_target(expected)}
        assert m.load_latest(target) == 1
    assert_bit_exact(target["model"], expected)


@pytest.fixture
def small_tmpfs():
    """An 8 MiB tmpfs (``mount -t tmpfs -o size=8m``): a real file system that fills up."""
    with mounted("tmpfs", "size=8m", prefix="dcpp-full-") as path:
        yield path


def test_a_full_disk_fails_the_handle_training_goes_on_older_checkpoints_stay(small_tmpfs):
    root = small_tmpfs / "ckpt"
    with CheckpointManager(root, keep_last=None) as m:
        for step in (1, 2):
            m.save(step, state(step, 3 << 20)).result(timeout=60)
        h = m.save(3, state(3, 3 << 20))
        with pytest.raises(CheckpointSaveError) as info:
            h.result(timeout=60)
        msg = str(info.value)
        assert "step 3" in msg and str(root) in msg and "file system is full" in msg
        assert committed(root) == [1, 2] and m.latest_step() == 2
        assert not (root / "step_00000003").exists()  # its partial files were removed
        for step in (1, 2):
            assert verify(str(root / f"step_{step:08d}")).ok
        shutil.rmtree(root / "step_00000001")  # space comes back: the next save works
        assert m.save(4, state(4, 3 << 20)).result(timeout=60).ok
        assert committed(root) == [2, 4] and m.latest_step() == 4


def test_permission_denied_fails_the_handle_and_keeps_older_checkpoints(tmp_path):
    # root ignores mode bits; the child runs as root without CAP_DAC_OVERRIDE (setpriv drops
    # it from the bounding set), so a read-only (0o555) root really refuses new directories
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE")
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as m:
        m.save(1, state(1)).result(timeout=60)
    before = record_path(root / "step_00000001").read_bytes()
    out = tmp_path / "out.json"
    root.chmod(0o555)
    try:
        r = subprocess.run([setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner",
                            sys.executable, "-m", "tests.unit._manager_perm_child", str(root),
                            str(out)], cwd=ROOT, env=child_env(), capture_output=True,
                           text=True, timeout=180, check=False)
    finally:
        root.chmod(0o755)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert all(e and e.startswith("CheckpointSaveError") for e in report["errors"])
    assert "permission denied" in report["errors"][0].lower()
    assert "step 5" in report["errors"][0] and str(root) in report["errors"][0]
    assert report["w0"] == 3.0 and report["listed"] == [1]
    assert record_path(root / "step_00000001").read_bytes() == before
    assert verify(str(root / "step_00000001")).ok


def test_history_keeps_only_the_most_recent_saves(tmp_path):
    with CheckpointManager(tmp_path, history_size=4, interval=1) as m:
        for step in range(1, 11):
            m.save(step, state(step, 4096)).result()
        assert [s.step for s in m.history] == [7, 8, 9, 10]
        assert len(m._completed) <= 4  # save() without maybe_save() never drains it
    with pytest.raises(ValueError, match="history_size"):
        CheckpointManager(tmp_path, history_size=0)
