"""SIGKILL a trainer driven by CheckpointManager — or one of its writer workers — at random
points of stage, persist, commit and retention; every restart must find a committed,
checksummed, bit-exact latest, and nothing may be left behind (processes, /dev/shm slabs,
uncommitted directories).

The trainer is ``tests.unit._manager_child``: a real process, killed by a real SIGKILL at a
point its ``on_phase`` hook picks (after a random delay). CI runs a few kills; ``-m slow``
runs 50 of each.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dcp_plus.readers.inspect import verify
from dcp_plus.shm import SHM_DIR
from tests.conftest import ROOT, child_env, pid_alive, record_path, wait_until

PHASES = ["stage", "persist", "commit", "retention"]
EVERY = 2


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if record_path(p).exists())


def uncommitted(root: Path) -> list[str]:
    return sorted(str(p) for p in root.glob("step_*") if not record_path(p).exists())


def run_child(work: Path, root: Path, spec: dict[str, Any], i: int) -> tuple[int, dict, Path]:
    spec_path, out = work / f"spec{i}.json", work / f"out{i}.json"
    spec_path.write_text(json.dumps(spec))
    with open(work / f"child{i}.log", "wb") as log:
        rc = subprocess.run([sys.executable, "-m", "tests.unit._manager_child", str(root),
                             str(spec_path), str(out)], cwd=ROOT, env=child_env(),
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            timeout=240, check=False).returncode
    tail = (work / f"child{i}.log").read_text(errors="replace")[-3000:]
    assert out.exists(), f"child {i} (exit {rc}) wrote no report:\n{tail}"
    return rc, json.loads(out.read_text()), out


def check_restart(report: dict, newest: int | None, leftovers: list[str]) -> None:
    """What every restart must find."""
    assert report["resumed"] == newest
    if newest is not None:
        assert report["bit_exact"] is True
        assert report["latest_pointer"] == newest
    assert sorted(report["cleaned"]) == leftovers


def check_storage(root: Path) -> None:
    for step in committed(root):
        rep = verify(str(root / f"step_{step:08d}"))
        assert rep.ok, rep.problems


def no_slabs_of(pids: list[int]) -> bool:
    names = [p.name for p in Path(SHM_DIR).iterdir()]
    return not any(n.startswith(f"dcpp-{pid}-") for pid in pids for n in names)


def trainer_kills(tmp_path: Path, n: int, seed: int,
                  manager: dict[str, Any] | None = None, retention_nth: int = 3) -> None:
    rng = random.Random(seed)
    root = tmp_path / "ckpt"
    phases = [PHASES[i % 4] for i in range(n)]
    rng.shuffle(phases)
    pids: list[int] = []
    for i in range(n + 1):
        newest = max(committed(root), default=None)
        leftovers = uncommitted(root)
        kill = None
        if i < n:
            phase = phases[i]
            kill = {"target": "trainer", "phase": phase,
                    "nth": retention_nth if phase == "retention" else rng.randint(1, 3),
                    "delay_ms": rng.randint(0, 25 if phase == "persist" else 3)}
        spec = {"until": (newest or 0) + 4 * EVERY, "every": EVERY, "keep_last": 2,
                "kills": [kill] if kill else [], "manager": manager or {}}
        rc, report, out = run_child(tmp_path, root, spec, i)
        pids.append(report["pid"])
        check_restart(report, newest, leftovers)
        if kill:
            assert rc == -signal.SIGKILL, f"kill {kill} did not happen (exit {rc})"
            workers = json.loads(Path(str(out) + ".pids").read_text())
            wait_until(lambda ws=workers: not any(pid_alive(w) for w in ws), 30,
                       f"the killed trainer's writer workers {workers} to exit")
        else:
            assert rc == 0 and report["finished"] and all(s["ok"] for s in report["saves"])
        check_storage(root)
    assert committed(root)[-1] == spec["until"] and not uncommitted(root)
    wait_until(lambda: no_slabs_of(pids), 30, "every child's /dev/shm slabs to be gone")


def worker_kills(tmp_path: Path, n: int, per_child: int, seed: int) -> None:
    rng = random.Random(seed)
    root = tmp_path / "ckpt"
    pids: list[int] = []
    fired = 0
    children = -(-n // per_child)
    for i in range(children + 1):
        newest = max(committed(root), default=None)
        leftovers = uncommitted(root)
        count = min(per_child, n - fired) if i < children else 0
        kills = [{"target": "worker", "phase": rng.choice(PHASES), "nth": j + 1,
                  "delay_ms": rng.randint(0, 25)} for j in range(count)]
        until = (newest or 0) + EVERY * (count + 2)
        spec = {"until": until, "every": EVERY, "keep_last": 2, "kills": kills}
        rc, report, _ = run_child(tmp_path, root, spec, i)
        pids.append(report["pid"])
        check_restart(report, newest, leftovers)
        assert rc == 0 and report["finished"], "a worker's death must not kill the trainer"
        killed = [k for k in report["kills"] if k.get("killed")]
        fired += len(report["kills"])
        failed = [s for s in report["saves"] if not s["ok"]]
        assert len(failed) <= len(killed)
        for s in failed:
            assert s["error"].startswith("CheckpointSaveError") and "worker" in s["error"]
        assert report["saves"][-1]["ok"] and committed(root)[-1] == until
        assert report["latest_after"] == until
        check_storage(root)
    assert fired >= n - 2  # a retention-phase kill may not fire when nothing is retired
    wait_until(lambda: no_slabs_of(pids), 30, "every child's /dev/shm slabs to be gone")


def test_trainer_sigkilled_in_each_phase_restarts_from_a_bit_exact_latest(tmp_path):
    trainer_kills(tmp_path, n=4, seed=1)


INCREMENTAL = {"incremental": True, "full_every": 2, "delta": True}
"""Chains of 2 (a run's saves 1 and 3 are full): retention first removes a whole chain at a
run's 4th save, where a retention-phase kill is aimed."""


def test_sigkills_during_incremental_saves_never_damage_a_base_nor_expose_a_child(tmp_path):
    """Each restart resumes bit-exact from the newest committed link; every committed
    checkpoint verifies with its references followed (retention kept every base)."""
    trainer_kills(tmp_path, n=4, seed=5, manager=INCREMENTAL, retention_nth=4)
    rec = json.loads(record_path(tmp_path / "ckpt" / f"step_{committed(tmp_path / 'ckpt')[-1]:08d}")
                     .read_bytes())
    assert rec["version"] == 5


def test_writer_worker_sigkilled_fails_only_that_save_and_training_goes_on(tmp_path):
    worker_kills(tmp_path, n=4, per_child=4, seed=2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fifty_random_trainer_sigkills(tmp_path):
    trainer_kills(tmp_path, n=50, seed=11)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_thirty_random_trainer_sigkills_during_incremental_saves(tmp_path):
    trainer_kills(tmp_path, n=30, seed=13, manager=INCREMENTAL, retention_nth=4)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fifty_random_writer_worker_sigkills(tmp_path):
    worker_kills(tmp_path, n=50, per_child=10, seed=12)
