"""NFSWriter/NFSReader over nfs:// (user-space client nfs-rs) against a real NFSv4 server,
nfs-ganesha with the VFS FSAL, started once per session. The export directory is also
inspected and damaged from the server side, as another client of the same files would.

The one fault test injects ESTALE into the glue's write call (a real stale handle needs a
server-side file-handle change that ganesha's VFS FSAL does not produce on demand).
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import CheckpointExistsError, NFSReader, NFSWriter, SafeLoadPlanner
from dcp_plus.readers import latest_committed, list_committed
from dcp_plus.storage.nfsio import NfsStore
from tests.conftest import assert_bit_exact, build_state_dict, flip_byte, load_target
from tools.testkit.ganesha import GaneshaServer
from tools.testkit.world import assert_case_ok, run_world

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
FAST = {"retry_base_delay": 0.0}


@pytest.fixture
def run(ganesha: GaneshaServer) -> str:
    """A fresh directory name inside the export."""
    return f"t/{uuid.uuid4().hex[:12]}"


def url(server: GaneshaServer, rel: str) -> str:
    return f"{server.url}/{rel}{server.query()}"


def save(sd: dict[str, Any], target: str, **kw: Any) -> None:
    dcp.save(sd, storage_writer=NFSWriter(target, **{**FAST, **kw}), no_dist=True)


def load(like: dict[str, Any], target: str, **kw: Any) -> dict[str, Any]:
    out = load_target(like)
    dcp.load(out, storage_reader=NFSReader(target, **{**FAST, **kw}),
             planner=SafeLoadPlanner(), no_dist=True)
    return out


def test_round_trip_over_nfs_is_bit_exact_and_committed_on_the_server(
        ganesha: GaneshaServer, run: str) -> None:
    sd = build_state_dict()
    sd["big"] = torch.randn(5 << 20, generator=torch.Generator().manual_seed(1))  # 20 MiB
    save(sd, url(ganesha, f"{run}/step_1"))
    on_server = sorted(os.listdir(Path(ganesha.export_dir, run, "step_1")))
    assert on_server[0] == ".metadata" and len(on_server) == 2, on_server
    assert on_server[1].startswith("__0_0.") and on_server[1].endswith(".dcpp")
    assert_bit_exact(load(sd, url(ganesha, f"{run}/step_1")), sd)


def test_flipped_byte_on_the_server_is_reported_with_tensor_name(
        ganesha: GaneshaServer, run: str) -> None:
    sd = {"weights": torch.arange(100_000, dtype=torch.float32)}
    save(sd, url(ganesha, run))
    (data,) = Path(ganesha.export_dir, run).glob("*.dcpp")
    flip_byte(data, 12345)
    with pytest.raises(BaseException, match=r"checksum mismatch in tensor 'weights'") as e:
        load(sd, url(ganesha, run))
    assert data.name in str(e.value)


class _Unsafe:
    pass


def test_failed_save_leaves_no_record_and_earlier_checkpoints_load(
        ganesha: GaneshaServer, run: str) -> None:
    old = {"w": torch.randn(1000), "step": 1}
    save(old, url(ganesha, f"{run}/step_1"))
    with pytest.raises(BaseException, match="weights_only"):
        save({"w": torch.randn(1000), "bad": _Unsafe()}, url(ganesha, f"{run}/step_2"))
    assert not Path(ganesha.export_dir, run, "step_2", ".metadata").exists()
    found = list_committed(url(ganesha, run))
    assert [c.name for c in found] == ["step_1"]
    assert_bit_exact(load(old, found[0].path), old)


def test_commit_refuses_an_existing_checkpoint_unless_overwrite(
        ganesha: GaneshaServer, run: str) -> None:
    first, second = {"w": torch.zeros(100)}, {"w": torch.ones(100)}
    save(first, url(ganesha, run))
    with pytest.raises(BaseException, match="already holds a committed checkpoint"):
        save(second, url(ganesha, run))
    assert_bit_exact(load(first, url(ganesha, run)), first)
    save(second, url(ganesha, run), overwrite=True)
    assert_bit_exact(load(second, url(ganesha, run)), second)
    left = os.listdir(Path(ganesha.export_dir, run))
    assert len([n for n in left if n.endswith(".dcpp")]) == 1, left  # old data removed
    assert not [n for n in left if n.endswith(".tmp")], left
    with pytest.raises(CheckpointExistsError):
        NFSWriter(url(ganesha, run)).set_up_storage_writer(True)


def test_list_committed_over_nfs_finds_a_checkpoint_committed_by_another_client(
        ganesha: GaneshaServer, run: str) -> None:
    sd = {"w": torch.randn(10)}
    assert latest_committed(url(ganesha, run)) is None
    save(sd, url(ganesha, f"{run}/step_9"))
    # another client (here: the server's own file system) commits step_10 afterwards
    Path(ganesha.export_dir, run, "step_10").mkdir()
    for name in os.listdir(Path(ganesha.export_dir, run, "step_9")):
        Path(ganesha.export_dir, run, "step_10", name).write_bytes(
            Path(ganesha.export_dir, run, "step_9", name).read_bytes())
    Path(ganesha.export_dir, run, "step_11").mkdir()  # started, never committed
    latest = latest_committed(url(ganesha, run))
    assert latest is not None and latest.name == "step_10"
    assert_bit_exact(load(sd, latest.path), sd)


def test_estale_from_the_server_is_retried_then_fails_clearly(
        ganesha: GaneshaServer, run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import nfs_rs

    real = NfsStore._write_at
    calls: list[int] = []

    def stale_twice(self: NfsStore, handle: Any, data: memoryview, offset: int) -> None:
        calls.append(offset)
        if len(calls) <= 2:
            raise nfs_rs.NfsOSError(message="stale file handle", errno=errno.ESTALE)
        real(self, handle, data, offset)
    monkeypatch.setattr(NfsStore, "_write_at", stale_twice)
    sd = {"w": torch.randn(4096)}
    save(sd, url(ganesha, f"{run}/ok"), max_retries=2)
    assert_bit_exact(load(sd, url(ganesha, f"{run}/ok")), sd)

    def always_stale(self: NfsStore, handle: Any, data: memoryview, offset: int) -> None:
        raise nfs_rs.NfsOSError(message="stale file handle", errno=errno.ESTALE)
    monkeypatch.setattr(NfsStore, "_write_at", always_stale)
    with pytest.raises(BaseException) as e:
        save(sd, url(ganesha, f"{run}/bad"), max_retries=1)
    assert "failed after 2 attempt(s)" in str(e.value) and "ESTALE" in str(e.value)
    assert f"{run}/bad/__0_0." in str(e.value)
    assert not Path(ganesha.export_dir, run, "bad", ".metadata").exists()


# -- two ranks --------------------------------------------------------------------------------


def save_and_load_two_ranks(rank: int, world: int, target: str) -> list[str]:
    """Case run in a 2-rank gloo world: each rank saves its own tensors, then loads them."""
    g = torch.Generator().manual_seed(rank)
    sd = {f"rank{rank}.w": torch.randn(3000, generator=g), "shared": torch.arange(10.0)}
    dcp.save(sd, storage_writer=NFSWriter(target, **FAST))
    out = load_target(sd)
    dcp.load(out, storage_reader=NFSReader(target, **FAST), planner=SafeLoadPlanner())
    assert_bit_exact(out, sd)
    return sorted(os.listdir(os.environ["DCPP_NFS_EXPORT"] + "/" + target.split("/export/")[1]
                             .split("?")[0]))


def test_two_ranks_write_their_own_files_and_one_record(ganesha: GaneshaServer, run: str,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPP_NFS_EXPORT", ganesha.export_dir)
    results = run_world(2, [("tests.dist.test_nfs_ganesha:save_and_load_two_ranks",
                             {"target": url(ganesha, run)})], tmp_path)
    listing = assert_case_ok(results, "save_and_load_two_ranks")[0]
    assert listing[0] == ".metadata"
    data = listing[1:]
    assert len(data) == 2 and data[0].startswith("__0_0.") and data[1].startswith("__1_0."), data
