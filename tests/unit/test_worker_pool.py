"""The writer worker-process pool: started once, reused, torch-free, errors name pid and file."""

from __future__ import annotations

import pytest

from dcp_plus._worker import WriteJob, coalesce
from dcp_plus.errors import ClosedError, WorkerError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.writers import shutdown_pool
from dcp_plus.writers.pool import WorkerPool
from tests.conftest import pid_alive, save, slab_state_dict, worker_pids


def test_workers_start_with_the_first_slab_save_and_do_not_import_torch(tmp_path, slab):
    sd, _ = slab_state_dict(slab)
    save({"plain_only": sd["w_f32"].clone()}, tmp_path / "plain")
    assert worker_pids() == []  # tensors outside slabs are written in-process

    save(sd, tmp_path / "ckpt")

    pids = worker_pids()
    assert len(pids) == 2
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read(), f"worker {pid} loaded torch"


def test_shutdown_pool_stops_every_worker(tmp_path, slab):
    sd, _ = slab_state_dict(slab)
    save(sd, tmp_path / "ckpt")
    pids = worker_pids()

    shutdown_pool()

    assert pids and not any(pid_alive(p) for p in pids)
    assert worker_pids() == []


def test_writes_slab_ranges_and_returns_their_checksums(tmp_path, slab):
    target = tmp_path / "f.dcpp"
    target.touch()
    buf = slab.buffer
    pool = WorkerPool(1)
    try:
        (sums,) = pool.run([WriteJob(str(target), [(slab.name, 4096, 0, 100),
                                                   (slab.name, 8192, 200, 50)], fsync=False)])
    finally:
        pool.close()

    data = target.read_bytes()
    assert data[:100] == bytes(buf[4096:4196]) and data[200:250] == bytes(buf[8192:8242])
    assert data[100:200] == bytes(100)
    assert sums == [checksum_bytes(buf[4096:4196]), checksum_bytes(buf[8192:8242])]
    del buf


@pytest.mark.parametrize("problem", ["missing_file", "bad_slab_name", "missing_slab"])
def test_failed_job_names_pid_and_file_and_the_worker_keeps_serving(tmp_path, slab, problem):
    target = tmp_path / "f.dcpp"
    target.touch()
    bad = {
        "missing_file": WriteJob(str(tmp_path / "nope" / "f.dcpp"), [(slab.name, 0, 0, 16)]),
        "bad_slab_name": WriteJob(str(target), [("../../etc/passwd", 0, 0, 16)]),
        "missing_slab": WriteJob(str(target), [("dcpp-0-gone", 0, 0, 16)]),
    }[problem]
    pool = WorkerPool(1)
    try:
        (pid,) = pool.pids
        with pytest.raises(WorkerError) as info:
            pool.run([bad])
        assert f"pid {pid}" in str(info.value) and bad.path in str(info.value)

        pool.run([WriteJob(str(target), [(slab.name, 0, 0, 16)], fsync=False)])
        assert pool.pids == [pid] and target.read_bytes() == bytes(slab.buffer[:16])
    finally:
        pool.close()


def test_closed_pool_refuses_jobs(tmp_path):
    pool = WorkerPool(1)
    (pid,) = pool.pids
    pool.close()

    with pytest.raises(ClosedError):
        pool.run([WriteJob(str(tmp_path / "f"), [])])
    assert not pid_alive(pid)


def test_pool_size_must_be_positive():
    with pytest.raises(ValueError, match="size"):
        WorkerPool(0)


def test_coalesce_merges_only_ranges_adjacent_in_both_slab_and_file():
    ranges = [
        ("s", 10, 10, 5),       # follows the next one (unsorted input)
        ("s", 0, 0, 10),
        ("s", 100, 100, 4),     # same 85-byte gap in slab and file: merged with the gap
        ("t", 104, 104, 4),     # another slab
        ("s", 200, 300, 4),     # gaps differ (slab 92, file 192): separate
        ("s", 400, 1 << 20, 8),  # gap larger than 64 KiB: separate
    ]

    assert coalesce(ranges) == [("s", 0, 0, 104), ("t", 104, 104, 4), ("s", 200, 300, 4),
                                ("s", 400, 1 << 20, 8)]
