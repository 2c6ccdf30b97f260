"""Invariant 3: a killed trainer or a killed writer worker never costs the last committed
checkpoint, never exposes a partial one, and leaves no worker process behind.

Both tests freeze the writer workers with SIGSTOP before the save they interrupt, so the kill
provably lands while that save is still writing (no timing assumptions).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus.shm import SHM_DIR
from dcp_plus.writers import pool as pool_module
from tests.conftest import (
    ROOT,
    assert_bit_exact,
    child_env,
    clone_state,
    data_files,
    fill_pattern,
    load,
    load_target,
    pid_alive,
    record_path,
    referenced_files,
    registered_slab,
    save,
    slab_state_dict,
    wait_until,
    worker_pids,
)
from tests.unit import _crash_child
from tests.unit.test_cli_ls_diff import run_process


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@pytest.mark.parametrize("target", ["new_directory", "overwrite"])
def test_trainer_killed_while_writing_keeps_last_checkpoint_and_leaves_no_worker(tmp_path,
                                                                                target):
    old = tmp_path / "step_1"
    new = old if target == "overwrite" else tmp_path / "step_2"
    ready, go = tmp_path / "ready", tmp_path / "go"
    stderr = open(tmp_path / "child.stderr", "wb")  # noqa: SIM115 (closed in finally)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.unit._crash_child", str(old), str(new), str(ready),
         str(go)], cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=stderr)
    workers: list[int] = []

    def child_failed() -> str:
        return (tmp_path / "child.stderr").read_text(errors="replace")[-3000:]

    try:
        wait_until(lambda: ready.exists() or child.poll() is not None, 120, "v1 to commit")
        assert child.poll() is None, child_failed()
        workers = worker_pids(child.pid)
        assert len(workers) == 2, workers
        old_record = record_path(old).read_bytes()
        old_files = data_files(old)

        _signal_all(workers, signal.SIGSTOP)
        go.touch()
        wait_until(lambda: data_files(new) - old_files or child.poll() is not None, 60,
                   "the v2 save to create its data files")
        assert child.poll() is None, child_failed()
        child.kill()
        child.wait(timeout=30)
        _signal_all(workers, signal.SIGCONT)

        wait_until(lambda: not any(pid_alive(w) for w in workers), 30,
                   f"writer workers {workers} to exit after the trainer died")
        assert not (tmp_path / "ready.finished").exists()
        if target == "overwrite":
            assert record_path(old).read_bytes() == old_record
            assert data_files(new) - old_files, "the interrupted save wrote no file"
            # verify names what the killed save left, and still passes the checkpoint
            proc = run_process("verify", str(old), "--json")
            report = json.loads(proc.stdout)
            assert proc.returncode == 0 and report["problems"] == [], proc.stdout
            assert {s["file"] for s in report["stray"]} == data_files(new) - old_files
        else:
            assert not record_path(new).exists()
            assert data_files(new)
        bufs = [torch.empty(_crash_child.SLAB_BYTES, dtype=torch.uint8) for _ in range(2)]
        expected = _crash_child.v1_state(bufs)
        assert_bit_exact(load(load_target(expected), old), expected)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        _signal_all(workers, signal.SIGCONT)
        stderr.close()
        for leaked in glob.glob(f"{SHM_DIR}/dcpp-{child.pid}-*"):  # SIGKILL skips cleanup
            with contextlib.suppress(FileNotFoundError):  # a reaper may be faster
                os.unlink(leaked)


def test_worker_killed_during_save_fails_it_and_the_next_save_replaces_the_worker(
        tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    with registered_slab(1 << 20) as s1, registered_slab(1 << 20) as s2:
        fill_pattern(s1.tensor(), seed=1)
        fill_pattern(s2.tensor(), seed=2)
        a, _ = slab_state_dict(s1)
        b, _ = slab_state_dict(s2)
        sd = {"a": a, "b": b}  # two slabs: two files, one job per worker
        v1 = clone_state(sd)
        save(sd, ckpt)
        old_record = record_path(ckpt).read_bytes()
        workers = worker_pids()
        assert len(workers) == 2

        fill_pattern(s1.tensor(), seed=3)
        fill_pattern(s2.tensor(), seed=4)
        v2 = clone_state(sd)
        taken: list[tuple[int, str]] = []
        real_run = pool_module._Worker.run

        def spy(self: Any, job: Any) -> Any:
            taken.append((self.pid, job.path))
            return real_run(self, job)

        monkeypatch.setattr(pool_module._Worker, "run", spy)
        _signal_all(workers, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as ex:
                attempt = ex.submit(save, sd, ckpt, overwrite=True)
                wait_until(lambda: len(taken) == 2, 30, "both jobs to reach the workers")
                victim, victim_file = taken[0]
                os.kill(victim, signal.SIGKILL)
                _signal_all([w for w in workers if w != victim], signal.SIGCONT)
                error = attempt.exception(timeout=60)
        finally:
            _signal_all(workers, signal.SIGCONT)
        monkeypatch.undo()

        assert isinstance(error, CheckpointException), error
        assert "WorkerError" in str(error)
        assert f"pid {victim}" in str(error) and victim_file in str(error), str(error)
        assert record_path(ckpt).read_bytes() == old_record
        assert_bit_exact(load(load_target(v1), ckpt), v1)

        save(sd, ckpt, overwrite=True)

        replaced = worker_pids()
        assert victim not in replaced and len(replaced) == 2, (victim, replaced)
        assert_bit_exact(load(load_target(v2), ckpt), v2)
        assert data_files(ckpt) == referenced_files(ckpt)
        del a, b, sd
