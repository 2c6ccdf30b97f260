"""The writer worker-process pool: started once, reused, torch-free, errors name pid and file."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from dcp_plus.errors import ClosedError, WorkerError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.shm import SHM_DIR
from dcp_plus.storage.direct import resident_pages
from dcp_plus.writers import shutdown_pool
from dcp_plus.writers.pool import WorkerPool
from dcp_plus.writers.worker import WriteJob, coalesce
from tests.conftest import (
    assert_bit_exact,
    clone_state,
    fill_pattern,
    load,
    load_target,
    pid_alive,
    registered_slab,
    save,
    slab_state_dict,
    wait_until,
    worker_pids,
)


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


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_direct_io_writes_aligned_runs_and_tails_exactly(tmp_path, slab, where, streams):
    """O_DIRECT for the 4 KiB-aligned part of each run, the page cache for the tail (then
    evicted); on tmpfs O_DIRECT copies through memory anyway. Either way the file is the
    slab's bytes, with 1 or several write streams (the file preallocated for them)."""
    base = tmp_path if where == "disk" else Path(tempfile.mkdtemp(dir="/dev/shm"))
    target = base / "f.dcpp"
    target.touch()
    buf = slab.buffer
    ranges = [(slab.name, 0, 0, 3 * 4096 + 17), (slab.name, 4 * 4096, 4 * 4096, 4096),
              (slab.name, 8 * 4096, 12 * 4096, 100)]
    pool = WorkerPool(1)
    try:
        (sums,) = pool.run([WriteJob(str(target), ranges, fsync=True, direct=True,
                                     streams=streams, drop_cache=True)])
    finally:
        pool.close()
    if where == "disk":  # nothing of it left in the page cache
        assert resident_pages(str(target)) == (0, 13)
    data = target.read_bytes()
    for _, soff, foff, n in ranges:
        assert data[foff : foff + n] == bytes(buf[soff : soff + n])
    assert len(data) == 12 * 4096 + 100
    assert sums == [checksum_bytes(buf[s : s + n]) for _, s, _, n in ranges]
    if where == "tmpfs":
        shutil.rmtree(base)
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


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


def test_workers_run_at_the_writers_niceness_and_a_new_one_restarts_them(tmp_path, slab):
    sd, _ = slab_state_dict(slab)
    base = os.nice(0)
    save(sd, tmp_path / "default")
    assert [_niceness(p) for p in worker_pids()] == [min(19, base + 10)] * 2
    save(sd, tmp_path / "zero", worker_nice=0)
    assert [_niceness(p) for p in worker_pids()] == [base] * 2
    assert_bit_exact(sd, load(load_target(clone_state(sd)), tmp_path / "zero"))


def test_worker_niceness_out_of_range_is_refused(tmp_path):
    from dcp_plus import LocalWriter

    with pytest.raises(ValueError, match="worker_nice must be in 0..19, got 20"):
        LocalWriter(tmp_path, worker_nice=20)
    with pytest.raises(ValueError, match="nice must be in 0..19, got -1"):
        WorkerPool(1, nice=-1)


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


def _two_slab_state(s1, s2) -> dict:
    a, _ = slab_state_dict(s1)
    b, _ = slab_state_dict(s2)
    return {"a": a, "b": b}  # two slabs: two files, one job per worker


def test_worker_killed_between_saves_is_replaced_and_the_next_save_succeeds(tmp_path):
    with registered_slab(1 << 20) as s1, registered_slab(1 << 20) as s2:
        fill_pattern(s1.tensor(), seed=1)
        fill_pattern(s2.tensor(), seed=2)
        sd = _two_slab_state(s1, s2)
        save(sd, tmp_path / "a")
        victim = worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        # waitable at last (as the pool's poll() sees it): a killed process shows as a zombie
        # while its other threads still exit, and worker_pids() drops it earlier still (its
        # cmdline empties before it has closed its socket): the pool could hand it a job then
        wait_until(lambda: os.waitid(os.P_PID, victim, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                   is not None, 10, f"worker {victim} to die")

        save(sd, tmp_path / "b")

        pids = worker_pids()
        assert victim not in pids and len(pids) == 2
        assert_bit_exact(load(load_target(sd), tmp_path / "b"), clone_state(sd))
        del sd


def test_repeated_saves_leave_threads_fds_workers_and_slabs_flat(tmp_path, slab):
    # invariant 6, short form
    sd, _ = slab_state_dict(slab)
    sd = {**sd, "plain": torch.randn(1000), "step": 3}
    shm_prefix = f"dcpp-{os.getpid()}-"

    def resources() -> tuple[int, int, int, int]:
        gc.collect()
        return (threading.active_count(), len(os.listdir("/proc/self/fd")), len(worker_pids()),
                sum(n.startswith(shm_prefix) for n in os.listdir(SHM_DIR)))

    for i in range(3):  # the steady state: every buffer pool (and its idle timer) in use
        save(sd, tmp_path / f"warm{i}", fsync=False)
        load(load_target(sd), tmp_path / f"warm{i}")
    before, fds_before = resources(), _fd_targets()
    threads_before = sorted(t.name for t in threading.enumerate())
    for i in range(30):
        save(sd, tmp_path / f"s{i}", fsync=False)
        load(load_target(sd), tmp_path / f"s{i}")
    # a thread pool collected just now (a reader's, an idle timer's) may still be ending its
    # threads: give them a moment; a leaked thread, fd or segment stays
    wait_until(lambda: all(a <= b for a, b in zip(resources(), before, strict=True)), 10,
               lambda: (f"threads, fds, workers, segments back to {before}: {resources()}; "
                        f"new fds {_fd_targets() - fds_before}; threads {threads_before} -> "
                        f"{sorted(t.name for t in threading.enumerate())}"), interval=0.05)


def _fd_targets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # closed meanwhile
            pass
    return out


def test_relative_checkpoint_path_is_written_where_the_caller_means_after_a_chdir(
        tmp_path, slab, monkeypatch):
    sd, _ = slab_state_dict(slab)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    monkeypatch.chdir(tmp_path / "one")
    save(sd, "ckpt")  # workers start here, with this cwd
    monkeypatch.chdir(tmp_path / "two")

    save(sd, "ckpt")

    assert_bit_exact(load(load_target(sd), tmp_path / "two" / "ckpt"), clone_state(sd))
