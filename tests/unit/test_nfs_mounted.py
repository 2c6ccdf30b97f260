"""NFSWriter/NFSReader on a mounted path, and the shared-file-system store underneath.

A kernel NFS mount is impossible on these machines and ESTALE/EIO cannot be produced for real
on a local file system, so the fault tests inject them by wrapping the OS calls
(``os.pwrite``, ``os.fsync``, ``os.preadv``, ``os.link``) for the files under test: the code
sees exactly the errno an NFS client would return. Real NFS traffic is tested against
nfs-ganesha in ``tests/dist/test_nfs_ganesha.py``.
"""

from __future__ import annotations

import errno
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import (
    CheckpointExistsError,
    NFSReader,
    NFSWriter,
    SafeLoadPlanner,
    StorageError,
)
from dcp_plus.readers import latest_committed, list_committed
from dcp_plus.storage.dirstore import FileStore
from dcp_plus.storage.nfs_errors import NFS_ERRORS, is_nfs_retryable
from dcp_plus.storage.nfsio import join_target, split_nfs_url
from dcp_plus.storage.ranged import StoreConfig
from dcp_plus.storage.retry import Retry, RetryPolicy
from tests.conftest import assert_bit_exact, build_state_dict, flip_byte, load_target

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FAST = {"retry_base_delay": 0.0}  # no backoff sleeps in tests


def save(sd: dict[str, Any], path: Path | str, **kw: Any) -> None:
    dcp.save(sd, storage_writer=NFSWriter(path, **{**FAST, **kw}), no_dist=True)


def load(like: dict[str, Any], path: Path | str, **kw: Any) -> dict[str, Any]:
    out = load_target(like)
    dcp.load(out, storage_reader=NFSReader(path, **{**FAST, **kw}), planner=SafeLoadPlanner(),
             no_dist=True)
    return out


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


class Fault:
    """Wrap ``os.<name>``: calls on fds whose path contains ``match`` raise ``OSError(code)``
    for the first ``times`` calls (``times=None``: always); every matching call is counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, match: str, code: int,
                 times: int | None) -> None:
        self.real: Callable[..., Any] = getattr(os, name)
        self.match, self.code, self.times = match, code, times
        self.calls = 0
        monkeypatch.setattr(os, name, self)

    def __call__(self, fd: int, *args: Any) -> Any:
        if self.match in fd_path(fd):
            self.calls += 1
            if self.times is None or self.calls <= self.times:
                raise OSError(self.code, os.strerror(self.code))
        return self.real(fd, *args)


ITEMS = 3  # items of small_state(): each attempt at its data file makes one pwrite per item


def small_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"weights": torch.randn(5000, generator=g), "bias": torch.randn(77, generator=g),
            "step": 3}


def test_round_trip_is_bit_exact_with_one_file_per_rank_and_no_leftovers(tmp_path: Path) -> None:
    sd = build_state_dict()
    save(sd, tmp_path / "ckpt")
    assert_bit_exact(load(sd, tmp_path / "ckpt"), sd)
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names[0] == ".metadata" and len(names) == 2, names
    assert names[1].startswith("__0_0.") and names[1].endswith(".dcpp")


def test_flipped_byte_is_reported_with_tensor_name(tmp_path: Path) -> None:
    sd = {"weights": torch.arange(100_000, dtype=torch.float32)}
    save(sd, tmp_path / "ckpt")
    (data,) = (tmp_path / "ckpt").glob("*.dcpp")
    flip_byte(data, 12345)
    with pytest.raises(BaseException, match=r"checksum mismatch in tensor 'weights'") as e:
        load(sd, tmp_path / "ckpt")
    assert data.name in str(e.value)


def test_estale_on_fsync_rewrites_the_file_whole_and_the_save_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = small_state()
    fsync = Fault(monkeypatch, "fsync", ".dcpp", errno.ESTALE, times=2)
    writes = Fault(monkeypatch, "pwrite", ".dcpp", errno.EIO, times=0)  # counts only
    save(sd, tmp_path / "ckpt", max_retries=3)
    assert fsync.calls == 3
    # after a failed fsync the dirty pages may be gone: every attempt wrote all the bytes
    assert writes.calls == 3 * ITEMS
    assert_bit_exact(load(sd, tmp_path / "ckpt"), sd)


def test_persistent_eio_fails_after_the_bound_leaving_no_record_and_earlier_loadable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = small_state()
    save(old, tmp_path / "step_1")
    new = {k: (v + 1 if isinstance(v, torch.Tensor) else v) for k, v in old.items()}
    fault = Fault(monkeypatch, "pwrite", "step_2", errno.EIO, times=None)
    with pytest.raises(BaseException) as e:
        save(new, tmp_path / "step_2", max_retries=2)
    message = str(e.value)
    assert "failed after 3 attempt(s)" in message and "EIO" in message, message
    assert str(tmp_path / "step_2") in message and ".dcpp" in message, message
    assert fault.calls == 3 * ITEMS  # 1 + max_retries attempts
    monkeypatch.undo()
    assert not (tmp_path / "step_2" / ".metadata").exists()
    assert_bit_exact(load(old, tmp_path / "step_1"), old)
    assert [c.name for c in list_committed(tmp_path)] == ["step_1"]


def test_full_disk_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fault = Fault(monkeypatch, "pwrite", ".dcpp", errno.ENOSPC, times=None)
    with pytest.raises(BaseException, match="No space left"):
        save(small_state(), tmp_path / "ckpt", max_retries=5)
    assert fault.calls == ITEMS  # one attempt
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_estale_on_read_is_retried_then_reported_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = small_state()
    save(sd, tmp_path / "ckpt")
    flaky = Fault(monkeypatch, "preadv", ".dcpp", errno.ESTALE, times=2)
    assert_bit_exact(load(sd, tmp_path / "ckpt", max_retries=2), sd)
    assert flaky.calls >= 3
    monkeypatch.undo()
    broken = Fault(monkeypatch, "preadv", ".dcpp", errno.ESTALE, times=None)
    with pytest.raises(BaseException) as e:
        load(sd, tmp_path / "ckpt", max_retries=1)
    assert "failed after 2 attempt(s)" in str(e.value) and "ESTALE" in str(e.value)
    assert ".dcpp" in str(e.value)
    assert broken.calls >= 2


def test_lost_link_reply_is_verified_by_reading_back_not_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_link = os.link
    calls = []

    def link_then_lose_reply(src: str, dst: str) -> None:
        calls.append(dst)
        real_link(src, dst)
        if len(calls) == 1:
            raise OSError(errno.ETIMEDOUT, "reply lost")  # the server did link it
    monkeypatch.setattr(os, "link", link_then_lose_reply)
    sd = small_state()
    save(sd, tmp_path / "ckpt")
    assert len(calls) == 1  # the retry found our record in place and did not link again
    assert sorted(os.listdir(tmp_path / "ckpt"))[0] == ".metadata"
    assert not [n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".tmp")]
    assert_bit_exact(load(sd, tmp_path / "ckpt"), sd)


def test_commit_is_no_clobber_without_overwrite(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path), StoreConfig(retry=RetryPolicy(0)))
    assert store.put(".metadata", b"first", if_absent=True)
    assert not store.put(".metadata", b"second", if_absent=True)
    assert (tmp_path / ".metadata").read_bytes() == b"first"
    assert store.put(".metadata", b"third", if_absent=False)
    assert (tmp_path / ".metadata").read_bytes() == b"third"
    assert os.listdir(tmp_path) == [".metadata"]  # no temporary files left


def test_existing_checkpoint_is_refused_then_replaced_with_overwrite(tmp_path: Path) -> None:
    old, new = small_state(), small_state()
    new["weights"] = new["weights"] * 2
    save(old, tmp_path / "ckpt")
    (old_file,) = (p.name for p in (tmp_path / "ckpt").glob("*.dcpp"))
    with pytest.raises(CheckpointExistsError):
        NFSWriter(tmp_path / "ckpt").set_up_storage_writer(True)
    save(new, tmp_path / "ckpt", overwrite=True)
    assert_bit_exact(load(new, tmp_path / "ckpt"), new)
    assert old_file not in os.listdir(tmp_path / "ckpt")


def test_list_committed_reads_records_not_directory_times(tmp_path: Path) -> None:
    sd = small_state()
    for step in (2, 10):
        save(sd, tmp_path / f"step_{step}")
    # a save that failed after writing data: newest by mtime, but not committed
    (tmp_path / "step_11").mkdir()
    (tmp_path / "step_11" / "__0_0.abc.dcpp").write_bytes(b"x" * 100)
    # a damaged record, a stray file, and old directory times on the committed ones
    (tmp_path / "step_12").mkdir()
    (tmp_path / "step_12" / ".metadata").write_bytes(b"{not json")
    (tmp_path / "notes.txt").write_text("hello")
    for step in (2, 10):
        os.utime(tmp_path / f"step_{step}", (1, 1))
    found = list_committed(tmp_path)
    assert [c.name for c in found] == ["step_2", "step_10"]
    assert found[-1].path == str(tmp_path / "step_10") and found[-1].tensors == 3
    latest = latest_committed(tmp_path)
    assert latest is not None and latest.name == "step_10"
    assert_bit_exact(load(sd, latest.path), sd)
    assert latest_committed(tmp_path / "nothing-here") is None


def test_retry_classification() -> None:
    for code in (errno.ESTALE, errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET):
        assert is_nfs_retryable(OSError(code, "x")), code
    for code in (errno.ENOENT, errno.EACCES, errno.ENOSPC, errno.EROFS, errno.EEXIST):
        assert not is_nfs_retryable(OSError(code, "x")), code
    assert is_nfs_retryable(ConnectionResetError()) and is_nfs_retryable(TimeoutError())
    assert not is_nfs_retryable(ValueError("x"))
    nfs_rs = pytest.importorskip("nfs_rs")
    assert is_nfs_retryable(nfs_rs.NfsOSError(message="stale", errno=errno.ESTALE))
    assert not is_nfs_retryable(nfs_rs.NfsNotFoundError(message="gone", errno=errno.ENOENT))


def test_retry_io_stops_at_the_bound() -> None:
    attempts = []

    def always_stale(n: int) -> None:
        attempts.append(n)
        raise OSError(errno.ESTALE, "Stale file handle")
    with pytest.raises(StorageError, match=r"read of x failed after 4 attempt\(s\).*ESTALE"):
        Retry(RetryPolicy(3, 0.0), NFS_ERRORS).call(always_stale, "read of x")
    assert attempts == [0, 1, 2, 3]


def test_nfs_url_parsing_and_target_validation() -> None:
    assert split_nfs_url("nfs://h:2049/export/run/step_1?version=4.1") == (
        "nfs://h:2049/export?version=4.1", "run/step_1", "nfs://h:2049/export/run/step_1")
    assert split_nfs_url("nfs://h/a/b/run", export="/a/b") == ("nfs://h/a/b", "run",
                                                                "nfs://h/a/b/run")
    for bad in ("nfs://h/export", "s3://b/k", "nfs:///export/x"):
        with pytest.raises(ValueError):
            split_nfs_url(bad)
    assert join_target("nfs://h/e/run?version=4.1", "step_1") == "nfs://h/e/run/step_1?version=4.1"
    assert NFSWriter.validate_checkpoint_id("/mnt/nfs/ckpt")
    assert NFSWriter.validate_checkpoint_id("nfs://h/export/ckpt")
    assert not NFSWriter.validate_checkpoint_id("s3://bucket/ckpt")
    assert NFSReader.validate_checkpoint_id("nfs://h/export/ckpt")


def test_writer_pickles_without_its_open_store(tmp_path: Path) -> None:
    w = NFSWriter(tmp_path / "ckpt")
    assert w._store is not None
    clone = pickle.loads(pickle.dumps(w))
    assert clone._store_obj is None and clone.url == str(tmp_path / "ckpt")


def test_stock_dcp_checkpoint_needs_allow_pickle(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    sd = {"w": torch.arange(10.0)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    with pytest.raises(BaseException, match=r"NFSReader\(\.\.\., allow_pickle=True\)"):
        load(sd, tmp_path)
    assert_bit_exact(load(sd, tmp_path, allow_pickle=True), sd)
