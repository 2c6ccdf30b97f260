"""One writer per checkpoint root, any number of readers: the root's lease, read-only
managers, takeover after a crash and fencing, with real processes beside each other."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import CheckpointManager, LocalReader, SafeLoadPlanner
from dcp_plus.errors import CheckpointSaveError, LeaseHeldError, LeaseLostError, ReadOnlyError
from dcp_plus.manager.lease import LEASE_DIR, Holder, RootLease, gen_name
from dcp_plus.manager.storage import FileLeaseStore
from dcp_plus.readers.inspect import verify
from tests.conftest import ROOT, child_env, record_path, wait_until
from tests.unit._root_child import blank, same, state_at


def _spawn(role: str, root: Path, out: Path, args: dict[str, Any] | None = None,
           prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
    log = open(out.with_suffix(".log"), "wb")  # noqa: SIM115 (closed with the process)
    cmd = [*(prefix or []), sys.executable, "-m", "tests.unit._root_child", role, str(root),
           str(out), json.dumps(args or {})]
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT)


def _report(out: Path, proc: subprocess.Popen[bytes], timeout: float = 240) -> dict[str, Any]:
    rc = proc.wait(timeout=timeout)
    log = out.with_suffix(".log").read_text(errors="replace")[-3000:]
    assert rc == 0 and out.exists(), f"{out.stem} exited {rc}:\n{log}"
    return json.loads(out.read_text())


def _ready(out: Path) -> dict[str, Any] | None:
    return json.loads(out.read_text()) if out.exists() else None


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------------------------------------
# A second writer


def test_a_second_manager_on_a_root_is_refused_naming_the_holder(tmp_path):
    with CheckpointManager(tmp_path / "ckpt") as first:
        first.save(1, state_at(1)).result()
        with pytest.raises(LeaseHeldError) as info:
            CheckpointManager(tmp_path / "ckpt")
        msg = str(info.value)
        assert f"pid {os.getpid()}" in msg and "this very process" in msg, msg
        assert "read_only=True" in msg and "takeover=True" in msg, msg
        with pytest.raises(LeaseHeldError, match="it is alive"):
            CheckpointManager(tmp_path / "ckpt", takeover=True)  # never from a live holder
        first.save(2, state_at(2)).result()
    with CheckpointManager(tmp_path / "ckpt") as again:  # released by close()
        target = blank()
        assert again.load_latest(target) == 2 and same(target, state_at(2))


def test_a_writer_in_another_process_is_refused_until_it_is_dead_then_taken_over(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "hold.json"
    holder = _spawn("hold", root, out, {"lease_timeout": 30})
    try:
        ready = wait_until(lambda: _ready(out), 120, "the holder to save step 1")
        assert ready["first"] == "committed"
        for takeover in (False, True):
            with pytest.raises(LeaseHeldError, match=f"pid {holder.pid} on host") as info:
                CheckpointManager(root, takeover=takeover)
            assert "it is alive" in str(info.value)
        holder.send_signal(signal.SIGKILL)  # a real crash: no close(), no release
        holder.wait()
        with pytest.raises(LeaseHeldError) as info:
            CheckpointManager(root)
        assert "appears dead" in str(info.value) and f"pid {holder.pid} is not running" in \
            str(info.value) and "takeover=True" in str(info.value)
        with CheckpointManager(root, takeover=True) as m:
            assert f"pid {holder.pid}" in (m.took_over or "")
            target = blank()
            assert m.load_latest(target) == 1 and same(target, state_at(1))
            m.save(3, state_at(3)).result()
    finally:
        holder.kill()
        holder.wait()


def test_holder_on_another_host_is_dead_only_once_its_heartbeat_expired(tmp_path):
    store = FileLeaseStore(str(tmp_path / LEASE_DIR))
    now = 1_000_000.0
    elsewhere = Holder(generation=1, holder_id="x", host="other-node", pid=4242, started=now,
                       command="train.py", boot_id="b", pid_ns="n", pid_start=1)
    assert store.create(gen_name(1), elsewhere.encode())
    store.write(gen_name(1) + ".hb", json.dumps({"time": now + 100}).encode())

    fresh = RootLease(store, timeout_s=30, clock=lambda: now + 110)
    with pytest.raises(LeaseHeldError, match="heartbeat is 10.0 s old.*expires 20 s from now"):
        fresh.acquire(takeover=True)
    late = RootLease(store, timeout_s=30, clock=lambda: now + 131)
    late.acquire(takeover=True)
    try:
        assert late.held and late.took_over == elsewhere
        assert sorted(store.list()) == [gen_name(2), gen_name(2) + ".hb"]  # older ones pruned
    finally:
        late.release()
    assert gen_name(2) + ".released" in store.list()


def test_a_holder_is_judged_by_its_own_longer_lease_timeout(tmp_path):
    # a job with lease_timeout=600 heartbeats every 100 s: a taker with the default 30 s
    # (dcp-plus gc, another manager) must not call it dead after 31 s of silence
    store = FileLeaseStore(str(tmp_path / LEASE_DIR))
    now = 1_000_000.0
    patient = Holder(generation=1, holder_id="x", host="other-node", pid=4242, started=now,
                     command="train.py", boot_id="b", pid_ns="n", pid_start=1, timeout_s=600.0)
    assert store.create(gen_name(1), patient.encode())
    store.write(gen_name(1) + ".hb", json.dumps({"time": now}).encode())
    with pytest.raises(LeaseHeldError, match="expires 540 s from now"):
        RootLease(store, timeout_s=30, clock=lambda: now + 60).acquire(takeover=True)
    late = RootLease(store, timeout_s=30, clock=lambda: now + 601)
    late.acquire(takeover=True)
    late.release()
    assert Holder.decode(patient.encode()) == patient  # the timeout is in the record


# ---------------------------------------------------------------------------------------------
# Readers


def test_read_only_manager_neither_writes_nor_deletes_nor_takes_the_lease(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointManager(root, keep_last=None) as writer:
        for step in (1, 2):
            writer.save(step, state_at(step)).result()
        (root / "step_00000003").mkdir()  # a save still running: no record yet
        (root / "step_00000003" / "__0_0.feedfeedfeedfeed.dcpp").write_bytes(b"x" * 100)
        before = _listing(root)

        reader = CheckpointManager(root, read_only=True)  # beside the live writer
        target = blank()
        assert reader.load_latest(target) == 2 and same(target, state_at(2))
        assert [c.step for c in reader.list()] == [1, 2] and reader.latest_step() == 2
        assert reader.cleaned == []
        for call in (lambda: reader.save(4, state_at(4)), lambda: reader.maybe_save(4, {}),
                     lambda: reader.guard(torch.optim.SGD([torch.zeros(1)], lr=0.1))):
            with pytest.raises(ReadOnlyError, match="read-only"):
                call()
        reader.close()

        assert _listing(root) == before
        writer.save(4, state_at(4)).result()  # the writer still holds the root


def test_reader_polling_beside_a_trainer_never_breaks_a_save_or_loads_wrong_data(tmp_path):
    # ~300 saves with retention beside ~200 read-only load_latest calls, in two processes
    root = tmp_path / "ckpt"
    t_out, r_out = tmp_path / "trainer.json", tmp_path / "reader.json"
    trainer = _spawn("trainer", root, t_out, {"saves": 300, "keep_last": 3})
    wait_until(lambda: any(root.glob("step_*/.metadata")), 120, "a first commit")
    reader = _spawn("reader", root, r_out, {"polls": 200})

    results = _report(t_out, trainer)["results"]
    seen = _report(r_out, reader)

    failed = {s: r for s, r in results.items() if r != "committed"}
    assert not failed, failed
    assert seen["wrong"] == [] and seen["loads"] >= 150, seen  # misses: retention raced it
    remaining = sorted(int(p.name[5:]) for p in root.glob("step_*") if record_path(p).exists())
    assert remaining == [298, 299, 300]
    for step in remaining:
        path = root / f"step_{step:08d}"
        assert verify(str(path)).ok
        target = blank()
        dcp.load(target, storage_reader=LocalReader(path), planner=SafeLoadPlanner(),
                 no_dist=True)
        assert same(target, state_at(step))
    assert not [p for p in root.glob("step_*") if not record_path(p).exists()]


# ---------------------------------------------------------------------------------------------
# Fencing


def _usurp(root: Path) -> None:
    """What a takeover by another process does to the lease: a newer generation."""
    store = FileLeaseStore(str(root / LEASE_DIR))
    top = max(int(n[4:]) for n in store.list() if n[4:].isdigit())
    other = Holder(generation=top + 1, holder_id="usurper", host="other-node", pid=1,
                   started=0.0, command="other")
    assert store.create(gen_name(top + 1), other.encode())


def test_fenced_manager_fails_its_next_save_before_writing_anything(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointManager(root, keep_last=1) as m:
        m.save(1, state_at(1)).result()
        _usurp(root)
        before = _listing(root)

        handle = m.save(2, state_at(2))
        with pytest.raises(CheckpointSaveError) as info:
            handle.result()

        assert "LeaseLostError" in str(info.value) and "taken over" in str(info.value)
        assert "other-node" in str(info.value)
        assert _listing(root) == before  # no step 2 directory, retention ran nowhere
        with pytest.raises(CheckpointSaveError, match="LeaseLostError"):
            m.save(3, state_at(3)).result()


def test_fenced_manager_does_not_commit_a_save_in_flight_nor_delete_it(tmp_path, monkeypatch):
    from dcp_plus.writers.base import CommittingWriter

    root = tmp_path / "ckpt"
    finish = CommittingWriter.finish

    def usurp_after_the_data_is_written(self, metadata, results):  # type: ignore[no-untyped-def]
        if "step_00000002" in str(self.path):
            _usurp(root)  # the takeover lands between the data files and the commit
        return finish(self, metadata, results)

    monkeypatch.setattr(CommittingWriter, "finish", usurp_after_the_data_is_written)
    with CheckpointManager(root, keep_last=1) as m:
        m.save(1, state_at(1)).result()
        with pytest.raises(CheckpointSaveError, match="LeaseLostError"):
            m.save(2, state_at(2)).result()

    step2 = root / "step_00000002"
    assert not record_path(step2).exists()
    assert any(step2.glob("__*.dcpp"))  # left for the new holder to clean up
    assert verify(str(root / "step_00000001")).ok  # retention did not run either
    lease = RootLease(FileLeaseStore(str(root / LEASE_DIR)))
    with pytest.raises(LeaseLostError):
        lease.check()  # holds nothing


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root for a second hostname")
def test_a_stalled_writer_on_another_host_is_taken_over_and_fenced(tmp_path):
    # the holder stops (SIGSTOP: a hung node); a job on "another host" (its own UTS
    # namespace and hostname) takes over once the heartbeat expired; the old holder wakes up
    # and its next save fails without writing
    root, a_out, b_out = tmp_path / "ckpt", tmp_path / "a.json", tmp_path / "b.json"
    a = _spawn("hold", root, a_out, {"lease_timeout": 2.0})
    b = None
    try:
        wait_until(lambda: _ready(a_out), 120, "the holder to save step 1")
        a.send_signal(signal.SIGSTOP)
        b = _spawn("take", root, b_out, {"lease_timeout": 2.0, "patience_s": 120},
                   prefix=["unshare", "--uts", "--", "sh", "-c",
                           'hostname dcpp-other-host && exec "$0" "$@"'])
        took = _report(b_out, b)
        assert f"pid {a.pid} on host" in took["took_over"] and took["saved"] == "committed"
        a.send_signal(signal.SIGCONT)
        (tmp_path / "go").write_text("")
        held = wait_until(lambda: (_ready(a_out) or {}).get("second") and _ready(a_out), 120,
                          "the old holder's second save")
        assert a.wait(timeout=60) == 0
    finally:
        for p in (a, b):
            if p is not None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    assert held["second"].startswith("failed") and "LeaseLostError" in held["second"], held
    assert "dcpp-other-host" in held["second"] and held["lease_held"] is False
    assert not (root / "step_00000002").exists()
    target = blank()
    with CheckpointManager(root, read_only=True) as r:
        assert r.load_latest(target) == 100 and same(target, state_at(100))
    assert verify(str(root / "step_00000001")).ok


# ---------------------------------------------------------------------------------------------
# Races and storage failures around the lease


class _Interleaved(FileLeaseStore):
    """A lease store that runs ``before`` once, just before the first create of ``name``."""

    def __init__(self, directory: str, name: str, before: Any) -> None:
        super().__init__(directory)
        self.name, self.before = name, before

    def create(self, name: str, data: bytes) -> bool:
        if name == self.name and self.before is not None:
            before, self.before = self.before, None
            before()
        return super().create(name, data)


def test_a_generation_taken_and_pruned_meanwhile_is_not_acquired(tmp_path):
    # E decides on generation 2; before it creates it, F takes 2 and releases it, H takes 3
    # and prunes 2: E's create of 2 then succeeds, and must not make E a holder
    directory = str(tmp_path / LEASE_DIR)
    first = RootLease(FileLeaseStore(directory))
    first.acquire()
    first.release()
    holders: list[RootLease] = []

    def others() -> None:
        f = RootLease(FileLeaseStore(directory))
        f.acquire()
        f.release()
        h = RootLease(FileLeaseStore(directory))
        h.acquire()
        holders.append(h)

    e = RootLease(_Interleaved(directory, gen_name(2), others))
    try:
        with pytest.raises(LeaseHeldError, match="this very process"):
            e.acquire()
        assert not e.held and holders[0].held
        holders[0].check()
    finally:
        for h in holders:
            h.release()


def test_a_lease_store_failing_with_the_save_still_resolves_the_handle(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", interval=1) as m:
        m.save(1, state_at(1)).result()
        assert m._lease is not None

        def down() -> list[str]:
            raise OSError(5, "Input/output error")
        m._lease.store.list = down  # type: ignore[method-assign]
        with pytest.raises(CheckpointSaveError, match="Input/output error"):
            m.save(2, state_at(2)).result(timeout=60)  # before: never resolved
        m._lease.store.list = FileLeaseStore.list.__get__(m._lease.store)  # type: ignore
        m.save(3, state_at(3)).result(timeout=60)


def test_lease_records_of_a_newer_version_still_name_their_holder(tmp_path):
    mine = Holder.this_process(1)
    data = json.loads(mine.encode())
    data["new_field"] = {"from": "a later dcp_plus"}
    assert Holder.decode(json.dumps(data).encode()) == mine


def test_bad_lease_settings_are_refused_before_anything_is_taken(tmp_path):
    with pytest.raises(ValueError, match="lease_timeout"):
        CheckpointManager(tmp_path / "ckpt", lease_timeout=0)
    assert not (tmp_path / "ckpt" / LEASE_DIR).exists()
