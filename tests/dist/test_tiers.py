"""Memory and peer tiers across real crashes: SIGKILLed gloo jobs restart from shared memory,
a lost node's ranks from their partners' replicas, bit-exact, never from a torn snapshot."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from dcp_plus.format.piece_digest import PIECE_BYTES
from dcp_plus.tiers import names

pytestmark = pytest.mark.timeout(300)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(tmp_path: Path, spec: dict[str, Any]) -> list[subprocess.Popen[bytes]]:
    spec = {**spec, "port": _port()}
    path = tmp_path / f"spec-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(spec))
    return [subprocess.Popen([sys.executable, "-m", "tests.dist._tier_job", str(path), str(r)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for r in range(spec["world_size"])]


def _run(tmp_path: Path, spec: dict[str, Any]) -> list[int]:
    return [p.wait(timeout=240) for p in _start(tmp_path, spec)]


def _results(tmp_path: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(world)]


@pytest.fixture
def job() -> Any:
    job_id = f"t{uuid.uuid4().hex[:12]}"
    yield job_id
    for f in names.listing(job_id):
        names.unlink(f.name)


def test_a_lost_node_restores_from_its_partners_and_the_other_from_its_own_memory(tmp_path, job):
    base = {"world_size": 4, "ranks_per_node": 2, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out")}
    assert _run(tmp_path, {**base, "mode": "train", "until": 5}) == [-9] * 4
    held = {f.holder for f in names.listing(job)}
    assert held == {0, 1, 2, 3}
    for f in names.listing(job):  # node 1 (ranks 2, 3) lost its memory
        if f.holder in (2, 3):
            names.unlink(f.name)
    assert _run(tmp_path, {**base, "mode": "resume", "keep": True}) == [0] * 4
    res = _results(tmp_path, 4)
    assert [r["step"] for r in res] == [5] * 4  # newer than the durable step 4
    assert res[0]["tiers"] == ["memory", "memory", "peer", "peer"]
    assert all(r["exact"] for r in res)
    # restoring consumed nothing: a second crash right after restores again
    assert _run(tmp_path, {**base, "mode": "resume"}) == [0] * 4
    assert [r["step"] for r in _results(tmp_path, 4)] == [5] * 4
    assert names.listing(job) == []  # close() removed the job's snapshots


def test_a_damaged_replica_is_detected_and_the_job_falls_back_to_durable(tmp_path, job):
    base = {"world_size": 4, "ranks_per_node": 2, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out")}
    assert _run(tmp_path, {**base, "mode": "train", "until": 5}) == [-9] * 4
    for f in names.listing(job):
        if f.holder in (2, 3):  # node 1 lost its memory ...
            names.unlink(f.name)
    (replica,) = [f for f in names.listing(job) if f.kind == "replica" and f.owner == 2
                  and f.step == 5]
    with open(replica.path, "r+b") as fh:  # ... and rank 2's replica on node 0 is damaged
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert _run(tmp_path, {**base, "mode": "resume"}) == [0] * 4
    res = _results(tmp_path, 4)
    # rank 2 cannot restore step 5 from anywhere: everyone agrees on the durable step 4
    assert [r["step"] for r in res] == [4] * 4
    assert res[0]["tiers"] == ["durable"] * 4
    assert all(r["exact"] for r in res)


def test_an_explicit_partner_function_decides_who_holds_each_replica(tmp_path, job):
    base = {"world_size": 4, "ranks_per_node": 2, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out"), "mirrored": True}
    assert _run(tmp_path, {**base, "mode": "train", "until": 2}) == [-9] * 4
    replicas = sorted((f.owner, f.holder) for f in names.listing(job) if f.kind == "record"
                      and f.owner != f.holder)
    assert replicas == [(0, 3), (1, 2), (2, 1), (3, 0)]  # not rank + ranks_per_node
    for f in names.listing(job):  # ranks 1 and 3 lost their memory
        if f.holder in (1, 3):
            names.unlink(f.name)
    assert _run(tmp_path, {**base, "mode": "resume"}) == [0] * 4
    res = _results(tmp_path, 4)
    assert [r["step"] for r in res] == [2] * 4  # step 1 is the durable one
    assert res[0]["tiers"] == ["memory", "peer", "memory", "peer"]
    assert all(r["exact"] for r in res)


@pytest.mark.parametrize("damaged", [None, 0], ids=["intact", "rank0-replica-damaged"])
def test_when_every_node_lost_its_memory_every_rank_restores_from_its_partner(tmp_path, job,
                                                                             damaged):
    """Each rank serves its partner's replica while it fetches its own (the data of both
    directions flows at once); a damaged replica fails its owner's restore and every rank
    then agrees on the durable step."""
    # 17 MiB tensors: two checksum pieces each, the damage in the second
    base = {"world_size": 2, "ranks_per_node": 1, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out"), "big": 17 << 18}
    assert _run(tmp_path, {**base, "mode": "train", "until": 2}) == [-9] * 2
    for f in names.listing(job):
        if f.holder == f.owner:
            names.unlink(f.name)
    if damaged is not None:
        (replica,) = [f for f in names.listing(job) if f.kind == "replica" and
                      f.owner == damaged and f.step == 2]
        with open(replica.path, "r+b") as fh:
            fh.seek(PIECE_BYTES + 4096)
            byte = fh.read(1)
            fh.seek(PIECE_BYTES + 4096)
            fh.write(bytes([byte[0] ^ 0x01]))
    assert _run(tmp_path, {**base, "mode": "resume", "keep": True}) == [0, 0]
    res = _results(tmp_path, 2)
    assert all(r["exact"] for r in res)
    if damaged is None:
        assert [r["step"] for r in res] == [2, 2]  # step 1 is the durable one
        assert res[0]["tiers"] == ["peer", "peer"]
        # restoring consumed no replica: a second restart restores from them again
        assert _run(tmp_path, {**base, "mode": "resume"}) == [0, 0]
        assert [r["step"] for r in _results(tmp_path, 2)] == [2, 2]
    else:
        assert [r["step"] for r in res] == [1, 1]
        assert res[0]["tiers"] == ["durable", "durable"]


@pytest.mark.parametrize("phase", ["memory", "persist", "commit"])
def test_a_kill_during_a_save_resumes_from_the_newest_complete_snapshot(tmp_path, job, phase):
    base = {"world_size": 2, "ranks_per_node": 1, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out")}
    # step 4 is durable: killed in "memory" its record is not written (restore step 3 from
    # memory); killed later its memory record and replica exist (restore step 4)
    assert _run(tmp_path, {**base, "mode": "train", "until": 4, "kill_phase": phase}) == [-9] * 2
    assert _run(tmp_path, {**base, "mode": "resume"}) == [0, 0]
    res = _results(tmp_path, 2)
    want = 3 if phase == "memory" else 4
    assert [r["step"] for r in res] == [want, want]
    assert res[0]["tiers"] == ["memory", "memory"]
    assert all(r["exact"] for r in res)


def test_replicas_are_received_into_the_previous_ones_files_and_restore_bit_exact(tmp_path,
                                                                                   job):
    """Each holder keeps two replica files and receives every replica into the older one
    (new pages cost a fault, an allocation and zeroing each); nothing reads the spare."""
    base = {"world_size": 2, "ranks_per_node": 1, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out"), "big": 1 << 18}
    assert _run(tmp_path, {**base, "mode": "train", "until": 5, "inodes": True}) == [-9] * 2
    for r in range(2):
        ino = {int(k): v for k, v in
               json.loads((tmp_path / f"out.{r}.inodes.json").read_text()).items()}
        assert ino[1] != ino[2] and ino[3] == ino[1] and ino[4] == ino[2] and ino[5] == ino[1]
        held = sorted((f.kind, f.step) for f in names.listing(job, r) if f.owner != r)
        assert held == [("record", 5), ("replica", 4), ("replica", 5)]
    for f in names.listing(job):  # every node lost its own memory
        if f.holder == f.owner:
            names.unlink(f.name)
    assert _run(tmp_path, {**base, "mode": "resume", "keep": True}) == [0, 0]
    res = _results(tmp_path, 2)
    assert [r["step"] for r in res] == [5, 5]
    assert res[0]["tiers"] == ["peer", "peer"]
    assert all(r["exact"] for r in res)
    # the restarted managers removed the spares: each rank holds its partner's step 5 only
    assert sorted((f.holder, f.kind, f.step) for f in names.listing(job)) == \
        [(0, "record", 5), (0, "replica", 5), (1, "record", 5), (1, "replica", 5)]


def test_a_manager_closed_keeping_its_snapshots_removes_its_spare_replica_files(tmp_path,
                                                                                 job):
    base = {"world_size": 2, "ranks_per_node": 1, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out")}
    assert _run(tmp_path, {**base, "mode": "train", "until": 3, "close_keep": True}) == [0, 0]
    for r in range(2):
        held = sorted((f.kind, f.step) for f in names.listing(job, r) if f.owner != r)
        assert held == [("record", 3), ("replica", 3)]  # no spare of step 2
    assert _run(tmp_path, {**base, "mode": "resume"}) == [0, 0]
    res = _results(tmp_path, 2)
    assert [r["step"] for r in res] == [3, 3] and all(r["exact"] for r in res)


def test_without_snapshots_the_restart_loads_the_durable_checkpoint(tmp_path, job):
    base = {"world_size": 2, "ranks_per_node": 1, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out")}
    assert _run(tmp_path, {**base, "mode": "train", "until": 5}) == [-9] * 2
    for f in names.listing(job):
        names.unlink(f.name)
    assert _run(tmp_path, {**base, "mode": "resume"}) == [0, 0]
    res = _results(tmp_path, 2)
    assert [r["step"] for r in res] == [4, 4]
    assert res[0]["tiers"] == ["durable", "durable"]
    assert all(r["exact"] for r in res)
    assert os.path.isdir(base["root"])


@pytest.mark.parametrize("restarts", [pytest.param(4, id="short"),
                                      pytest.param(100, id="soak", marks=pytest.mark.slow)])
def test_restarts_leave_no_shared_memory_beyond_the_current_snapshots(tmp_path, job, restarts):
    base = {"world_size": 2, "ranks_per_node": 1, "root": str(tmp_path / "root"),
            "job_id": job, "out": str(tmp_path / "out")}
    step = 0
    for i in range(restarts):
        # each life restores, then saves two more steps and is SIGKILLed after the second
        spec = {**base, "mode": "train", "until": step + 2, "start": step + 1}
        assert _run(tmp_path, spec) == [-9] * 2
        step += 2
        files = names.listing(job)
        records = [f for f in files if f.kind == "record"]
        # per rank: its own newest record and the replica it holds, nothing more
        assert sorted((f.holder, f.owner) for f in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert {f.step for f in records} == {step}, i
        # and the replica file of the step before, without a record: the spare each holder
        # receives its next replica into (the next life's manager removes it)
        stale = [f for f in files if f.kind != "record" and f.step not in (None, step)
                 and not (f.kind == "replica" and f.step == step - 1)]
        assert stale == [], i
    assert _run(tmp_path, {**base, "mode": "resume"}) == [0, 0]
    assert [r["step"] for r in _results(tmp_path, 2)] == [step, step]
    assert names.listing(job) == []


def _newest_restorable(job: str, world: int, committed: list[int]) -> int | None:
    """What a restart must restore, from the files a killed 2-node job left: the newest step
    each rank has in its own memory, in its partner's replica or durably."""
    own: dict[int, set[int]] = {r: set() for r in range(world)}
    replica: dict[int, set[int]] = {r: set() for r in range(world)}
    for f in names.listing(job):
        if f.kind == "record" and f.step is not None:
            (own if f.holder == f.owner else replica)[f.owner].add(f.step)
    steps = set(committed).union(*own.values(), *replica.values())
    for s in sorted(steps, reverse=True):
        if all(s in own[r] or s in replica[r] or s in committed for r in range(world)):
            return s
    return None


@pytest.mark.parametrize("trials", [pytest.param(3, id="short"),
                                    pytest.param(30, id="soak", marks=pytest.mark.slow)])
def test_kills_at_random_times_resume_from_the_newest_complete_snapshot(tmp_path, job, trials):
    """SIGKILL lands wherever the job is: staging, the record, the peer send, a persist."""
    from dcp_plus.manager.root import CheckpointRoot
    from dcp_plus.manager.storage import LocalBackend

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for trial in range(trials):
        root = tmp_path / f"root{trial}"
        base = {"world_size": 2, "ranks_per_node": 1, "root": str(root), "job_id": job,
                "out": str(tmp_path / f"out{trial}"), "big": 1 << 20}  # 4 MiB a rank
        procs = _start(tmp_path, {**base, "mode": "train", "until": 0})
        deadline = time.monotonic() + 120
        while len({f.holder for f in names.listing(job) if f.kind == "record"}) < 2:
            assert time.monotonic() < deadline, "no snapshot within 120 s"
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 2.0))  # where the kill lands: the point of the test
        for p in procs:
            p.send_signal(signal.SIGKILL)
        assert [p.wait(timeout=60) for p in procs] == [-9, -9]
        committed = CheckpointRoot(LocalBackend(), str(root)).committed()
        want = _newest_restorable(job, 2, committed)
        assert want is not None, f"seed {seed} trial {trial}: nothing to restore"
        assert _run(tmp_path, {**base, "out": str(tmp_path / f"out{trial}"),
                               "mode": "resume"}) == [0, 0]
        res = [json.loads((tmp_path / f"out{trial}.{r}.json").read_text()) for r in range(2)]
        assert [r["step"] for r in res] == [want, want], (seed, trial, res, committed)
        assert all(r["exact"] for r in res), (seed, trial, res)
        assert names.listing(job) == [], (seed, trial)
