"""Direct I/O (issue 19) on the NFS export: ``direct_io="auto"`` at a mounted NFS path.

These machines have no kernel NFS client, so the export of the real NFSv4 server
(nfs-ganesha, the ``ganesha`` fixture) is mounted through the kernel's FUSE client, every
operation an NFS call of ``nfs-rs`` (``tools.testkit.nfs_fuse``). What was found, and is
asserted here: that mount takes ``O_DIRECT`` (Linux's FUSE client accepts it and passes the
writes and reads to the file system uncached), so LocalWriter and LocalReader use it and log
no fallback, the direct load leaves nothing in the page cache where a buffered one leaves
it all, and the bytes reach the server: NFSReader over ``nfs://`` (another client) loads them
bit-exact. The refusal path (buffered fallback logged once, naming the path) is tested on
tmpfs and ramfs in ``tests/unit/test_direct_io.py`` and ``test_direct_read.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import LocalWriter, NFSReader, SafeLoadPlanner
from dcp_plus.storage.direct import clear_probe_cache, direct_refusal, fs_type, resident_pages
from tests.conftest import DTYPES, assert_bit_exact, load, load_target, random_tensor
from tests.unit.test_direct_io import save_via
from tools.testkit.ganesha import GaneshaServer
from tools.testkit.nfs_fuse import NfsFuseMount, fuse_problem

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
FALLBACK_LOGS = ("dcp_plus.storage.direct", "dcp_plus.storage.direct_store")
SIZES = {"empty": 0, "one_byte": 1, "page_minus_1": 4095, "page_plus_1": 4097,
         "three_mib_plus_1": (3 << 20) + 1}


@pytest.fixture(scope="module")
def mount(ganesha: GaneshaServer) -> Iterator[tuple[Path, Path]]:
    """(the FUSE mount of an export directory, that directory on the server's disk)."""
    problem = fuse_problem()
    if problem:
        pytest.skip(f"no FUSE mount of the NFS export: {problem}")
    rel = f"fuse-{uuid.uuid4().hex[:12]}"
    Path(ganesha.export_dir, rel).mkdir()
    where = tempfile.mkdtemp(prefix="dcpp-nfs-fuse-", dir="/var/tmp")
    fuse = NfsFuseMount(f"{ganesha.url}/{rel}{ganesha.query()}", os.path.join(where, "mnt"))
    fuse.start()
    try:
        yield Path(fuse.mountpoint), Path(ganesha.export_dir, rel)
    finally:
        fuse.stop()
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_probe() -> Iterator[None]:
    clear_probe_cache()
    yield
    clear_probe_cache()


def odd_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(19)
    sd: dict[str, Any] = {f"u8.{k}": random_tensor((n,), torch.uint8, g)
                          for k, n in SIZES.items()}
    for dt in DTYPES:
        sd[f"dtype.{dt}"] = random_tensor((257, 3), dt, g)
    sd["big"] = torch.randn(5 << 20, generator=g)  # 20 MiB: several 4 MiB direct writes
    sd["step"] = 7
    return sd


def cached_share(ckpt: Path) -> float:
    resident = total = 0
    for f in ckpt.glob("*.dcpp"):
        r, t = resident_pages(str(f))
        resident, total = resident + r, total + t
    assert total, f"{ckpt}: no data pages"
    return resident / total


def fallbacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name in FALLBACK_LOGS]


def test_the_fuse_mounted_export_takes_o_direct(mount: tuple[Path, Path]) -> None:
    mnt, _ = mount
    assert fs_type(str(mnt)) == "fuse"
    assert direct_refusal(str(mnt)) is None


@pytest.mark.parametrize("workers_path", [False, True], ids=["threads", "slab_workers"])
def test_auto_direct_save_and_load_on_the_export_are_bit_exact_and_leave_no_cache(
        mount: tuple[Path, Path], ganesha: GaneshaServer, caplog: pytest.LogCaptureFixture,
        workers_path: bool) -> None:
    mnt, on_server = mount
    caplog.set_level(logging.INFO)
    sd = odd_state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    writer = save_via("arena" if workers_path else "dcp.save", sd, mnt / name,
                      direct_io="auto", streams=2)
    assert writer._direct, "the writer fell back to buffered writes on the FUSE-mounted export"
    # the files are on the server, and another NFS client reads them bit-exact
    assert sorted(os.listdir(on_server / name)) == sorted(os.listdir(mnt / name))
    out = load_target(expected)
    dcp.load(out, storage_reader=NFSReader(f"{ganesha.url}/{on_server.name}/{name}"
                                           f"{ganesha.query()}", retry_base_delay=0.0),
             planner=SafeLoadPlanner(), no_dist=True)
    assert_bit_exact(out, expected)

    assert_bit_exact(load(load_target(expected), mnt / name, direct_io="auto"), expected)
    assert cached_share(mnt / name) < 0.05  # the direct load cached nothing (contrast below)
    assert fallbacks(caplog) == []


def test_a_buffered_load_from_the_export_is_what_fills_the_page_cache(
        mount: tuple[Path, Path]) -> None:
    """The contrast that gives the cache assertion after the direct load its meaning: the
    same checkpoint read with ``direct_io=False`` through the same mount stays in the page
    cache. (Writes are another matter: this FUSE mount keeps no written pages even for
    buffered writes, so after a save only ``writer._direct`` tells the two apart.)"""
    mnt, _ = mount
    sd = odd_state()
    path = mnt / f"buffered-{uuid.uuid4().hex[:8]}"
    dcp.save(sd, storage_writer=LocalWriter(path, direct_io=False), no_dist=True)
    assert cached_share(path) < 0.05  # see above: nothing written is kept, buffered or not
    assert_bit_exact(load(load_target(sd), path, direct_io=False), sd)
    assert cached_share(path) > 0.9
