"""LocalReader with O_DIRECT (issue 19): bit-exact loads of odd sizes and every dtype into
aligned destinations (read straight into them) and unaligned or non-contiguous ones (through
bounce buffers), resharding, compressed extents, the fallback where O_DIRECT bypasses nothing
(tmpfs) or is refused (ramfs), corruption and truncation, and a page cache left cold.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from dcp_plus import LocalReader, SafeLoadPlanner
from dcp_plus.cli.bench.machine import evict_files
from dcp_plus.errors import InvalidOptionError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.manager.options import LocalReaderOptions
from dcp_plus.storage import direct_extents
from dcp_plus.storage.direct_extents import PIECE, ExtentEOFError
from dcp_plus.storage.direct_read import DIRECT_ALIGN, address, resident_bytes
from dcp_plus.storage.direct_store import DirectFileStore
from tests.conftest import (
    DTYPES,
    assert_bit_exact,
    flip_byte,
    load,
    load_fails,
    load_target,
    random_tensor,
    read_record_json,
    save,
)
from tools.testkit.world import assert_case_ok, run_world

THIS = "tests.unit.test_direct_read"
STORE_LOG = "dcp_plus.storage.direct_store"
SIZES = {"one": 1, "page_less_1": 4095, "page_plus_1": 4097, "empty": 0,
         "three_mib_plus_1": (3 << 20) + 1, "pieces": 2 * PIECE + 4097}
"""Byte sizes of uint8 tensors; ``pieces`` spans three O_DIRECT requests."""


def odd_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sd = {f"u8_{name}": random_tensor((n,), torch.uint8, gen) for name, n in SIZES.items()}
    for d in DTYPES:
        sd[str(d).removeprefix("torch.")] = random_tensor((7, 13), d, gen)
    sd["bf16_big"] = random_tensor((1023, 1031), torch.bfloat16, gen)  # ~2 MiB, odd length
    sd["bool_big"] = random_tensor((3, 4099), torch.bool, gen)
    sd["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    return sd


_KEEP: list[mmap.mmap] = []


def aligned(like: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """A zeroed contiguous tensor shaped like ``like`` whose data starts ``shift`` bytes past
    a page boundary (0: an O_DIRECT target)."""
    nbytes = like.numel() * like.element_size()
    buf = mmap.mmap(-1, nbytes + shift + 1)
    _KEEP.append(buf)
    raw = torch.frombuffer(buf, dtype=torch.uint8)[shift : shift + nbytes]
    out = raw.view(like.dtype).reshape(like.shape)
    assert nbytes == 0 or (out.data_ptr() % DIRECT_ALIGN == 0) == (shift == 0)
    return out


def targets(sd: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    if kind == "aligned":
        return {k: aligned(v) for k, v in sd.items()}
    if kind == "unaligned":
        return {k: aligned(v, shift=64) for k, v in sd.items()}
    # non-contiguous: the transpose of a zeroed (cols, rows) tensor
    return {k: torch.zeros(v.shape[::-1], dtype=v.dtype).t() if v.dim() == 2 else
            torch.zeros(2 * v.numel(), dtype=v.dtype)[::2].reshape(v.shape)
            for k, v in sd.items()}


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = odd_state()
    path = tmp_path_factory.mktemp("odd") / "ckpt"
    save(sd, path, threads=2)
    return path, sd


def drop_from_cache(path: Path) -> list[Path]:
    files = sorted(path.glob("*.dcpp"))
    evict_files([str(f) for f in files])
    return files


def cached(files: list[Path]) -> int:
    return sum(resident_bytes(f)[0] for f in files)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="dcpp-direct-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ramfs_dir(tmp_path) -> Iterator[Path]:
    """A ramfs mount (a real file system that refuses O_DIRECT); needs root."""
    d = tmp_path / "ramfs"
    d.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount ramfs here (needs root)")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


# ---------------------------------------------------------------------------------------------
# Bit-exact loads


@pytest.mark.parametrize("kind", ["aligned", "unaligned", "non_contiguous"])
@pytest.mark.parametrize("verify", [True, False])
def test_odd_sizes_and_every_dtype_load_bit_exact(odd, kind, verify):
    path, sd = odd
    out = load(targets(sd, kind), path, direct_io=True, verify=verify)
    assert_bit_exact(out, sd)


def test_direct_load_fills_the_given_storage_of_aligned_destinations(odd):
    path, sd = odd
    dest = targets(sd, "aligned")
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    out = load(dest, path, direct_io=True)
    assert {k: v.data_ptr() for k, v in out.items()} == ptrs
    assert_bit_exact(out, sd)


def test_every_kind_of_value_loads_bit_exact_with_direct_io(tmp_path, state_dict):
    save(state_dict, tmp_path / "ckpt")
    assert_bit_exact(load(load_target(state_dict), tmp_path / "ckpt", direct_io=True),
                     state_dict)


def test_compressed_extents_load_bit_exact_and_a_flip_is_detected(tmp_path):
    sd = odd_state(seed=1)
    sd["zeros"] = torch.zeros(1 << 20)  # compresses well: short stored extents
    save(sd, tmp_path / "ckpt", codec="zstd")
    rows = read_record_json(tmp_path / "ckpt")["extents"]
    assert {r["codec"] for r in rows if r["fqn"] == "zeros"} == {"zstd"}
    for kind in ("aligned", "unaligned"):
        assert_bit_exact(load(targets(sd, kind), tmp_path / "ckpt", direct_io=True), sd)

    row = next(r for r in rows if r["fqn"] == "zeros")
    flip_byte(tmp_path / "ckpt" / row["file"], row["offset"] + row["length"] - 1)
    msg = load_fails(targets(sd, "aligned"), tmp_path / "ckpt", direct_io=True)
    assert "checksum mismatch" in msg and "'zeros'" in msg and row["file"] in msg, msg


# ---------------------------------------------------------------------------------------------
# Resharding: 2 chunks loaded whole, a whole tensor loaded as 2 chunks


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {"w": random_tensor((2 * 1024 + 3, 517), torch.float32, gen),
            "b": random_tensor((4097,), torch.bfloat16, gen),
            "m": random_tensor((9, 3), torch.bool, gen)}


def save_two_chunks(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_plus import LocalWriter

    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full().items()}
    dcp.save(sd, storage_writer=LocalWriter(path))


def load_whole_as_two_chunks(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    dest = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1 if v.dim() > 1 else 0)])
            for k, v in full.items()}
    dcp.load(dest, storage_reader=LocalReader(path, direct_io=True), planner=SafeLoadPlanner())
    for k, v in full.items():
        assert_bit_exact(dest[k].full_tensor(), v, k)


def test_resharding_loads_are_bit_exact_with_direct_io(tmp_path):
    whole = tmp_path / "whole"
    save(_full(), whole)
    results = run_world(2, [(f"{THIS}:save_two_chunks", {"path": str(tmp_path / "chunks")}),
                            (f"{THIS}:load_whole_as_two_chunks", {"path": str(whole)})],
                        tmp_path / "world")
    assert_case_ok(results, "save_two_chunks")
    assert_case_ok(results, "load_whole_as_two_chunks")
    rows = read_record_json(tmp_path / "chunks")["extents"]
    assert sum(r["fqn"] == "w" for r in rows) == 2
    for kind in ("aligned", "unaligned"):
        out = load(targets(_full(), kind), tmp_path / "chunks", direct_io=True)
        assert_bit_exact(out, _full())


# ---------------------------------------------------------------------------------------------
# Where O_DIRECT bypasses nothing, or is refused


def _fallbacks(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == STORE_LOG]


def test_tmpfs_checkpoint_loads_bit_exact_through_the_page_cache_logging_once(
        odd, shm_dir, caplog):
    path, sd = odd
    ckpt = copy_checkpoint(path, shm_dir / "ckpt")
    assert len(list(ckpt.glob("*.dcpp"))) > 1
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    assert_bit_exact(load(targets(sd, "unaligned"), ckpt), sd)
    (line,) = _fallbacks(caplog)
    assert "tmpfs" in line.getMessage() and str(ckpt) in line.getMessage()
    # O_DIRECT asked for: used where this kernel's tmpfs takes it, else refused; never fails
    assert_bit_exact(load(targets(sd, "aligned"), ckpt, direct_io=True), sd)


@pytest.mark.parametrize("mode", [True, "auto"])
def test_a_file_system_refusing_o_direct_loads_bit_exact_logging_once(
        odd, ramfs_dir, caplog, mode):
    path, sd = odd
    ckpt = copy_checkpoint(path, ramfs_dir / "ckpt")
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    assert_bit_exact(load(targets(sd, "aligned"), ckpt, direct_io=mode), sd)
    (line,) = _fallbacks(caplog)
    why = "refuses O_DIRECT (Invalid argument)" if mode is True else "ramfs"
    assert why in line.getMessage() and str(ckpt) in line.getMessage(), line.getMessage()
    assert line.levelno == (logging.WARNING if mode is True else logging.INFO)


def test_an_ext4_load_logs_no_fallback(odd, caplog):
    path, sd = odd
    caplog.set_level(logging.INFO, logger=STORE_LOG)
    assert_bit_exact(load(targets(sd, "unaligned"), path), sd)
    assert not _fallbacks(caplog)


# ---------------------------------------------------------------------------------------------
# Corruption, truncation


def test_a_flipped_byte_is_detected_naming_file_and_tensor(odd):
    path, sd = odd
    row = next(r for r in read_record_json(path)["extents"] if r["fqn"] == "u8_pieces")
    for pos in (row["offset"], row["offset"] + PIECE + 5, row["offset"] + row["length"] - 1):
        flip_byte(path / row["file"], pos)
        try:
            for kind in ("aligned", "unaligned"):
                msg = load_fails(targets(sd, kind), path, direct_io=True)
                assert "CorruptCheckpointError" in msg and "checksum mismatch" in msg, msg
                assert "'u8_pieces'" in msg and str(path / row["file"]) in msg, msg
        finally:
            flip_byte(path / row["file"], pos)


class TruncatingPlanner(DefaultLoadPlanner):
    """Cuts a data file after the reader checked its bounds, before any data is read."""

    def __init__(self, file: Path, size: int) -> None:
        super().__init__()
        self.file, self.size = file, size

    def create_local_plan(self) -> Any:
        os.truncate(self.file, self.size)
        return super().create_local_plan()


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("cut", ["inside", "before"])
def test_a_file_truncated_while_loading_names_file_and_tensor(tmp_path, odd, direct_io, cut):
    path, sd = odd
    ckpt = copy_checkpoint(path, tmp_path / "ckpt")
    row = next(r for r in read_record_json(ckpt)["extents"] if r["fqn"] == "u8_pieces")
    size = row["offset"] + (row["length"] - 3 if cut == "inside" else 0)
    msg = load_fails(targets(sd, "unaligned"), ckpt, TruncatingPlanner(ckpt / row["file"], size),
                     direct_io=direct_io)
    assert "CorruptCheckpointError" in msg and "truncated file" in msg, msg
    assert str(ckpt / row["file"]) in msg and "'u8_pieces'" in msg, msg


# ---------------------------------------------------------------------------------------------
# The page cache


def test_a_direct_load_leaves_cold_files_out_of_the_page_cache(tmp_path, odd):
    path, sd = odd
    ckpt = copy_checkpoint(path, tmp_path / "ckpt")
    os.sync()  # DONTNEED drops clean pages only
    files = drop_from_cache(ckpt)
    assert cached(files) == 0
    for kind in ("aligned", "unaligned", "non_contiguous"):
        assert_bit_exact(load(targets(sd, kind), ckpt), sd)
        assert cached(files) == 0, kind
    # the measurement sees a buffered load's pages
    assert_bit_exact(load(targets(sd, "unaligned"), ckpt, direct_io=False), sd)
    assert cached(files) > 0.9 * sum(f.stat().st_size for f in files)


def test_verify_reads_directly_too(tmp_path, odd):
    from dcp_plus.readers.inspect import verify

    path, _ = odd
    ckpt = copy_checkpoint(path, tmp_path / "ckpt")
    os.sync()
    files = drop_from_cache(ckpt)
    assert verify(str(ckpt)).ok and cached(files) == 0
    row = next(r for r in read_record_json(ckpt)["extents"] if r["fqn"] == "u8_page_plus_1")
    flip_byte(ckpt / row["file"], row["offset"] + 4096)
    report = verify(str(ckpt))
    assert any("'u8_page_plus_1'" in p and "checksum mismatch" in p for p in report.problems)


# ---------------------------------------------------------------------------------------------
# The store's reads, piece by piece


@pytest.fixture
def data_file(tmp_path) -> tuple[Path, bytes]:
    data = os.urandom(PIECE + 3 * 4096 + 123)
    (tmp_path / "f.dcpp").write_bytes(data)
    return tmp_path, data


def _buffers(spec: list[tuple[int, int, int]]) -> list[memoryview]:
    """A buffer per ``(offset, length, shift)``, ``shift`` bytes past a page boundary."""
    out = []
    for _, n, shift in spec:
        m = mmap.mmap(-1, n + shift + 1)
        _KEEP.append(m)
        out.append(memoryview(m)[shift : shift + n])
    return out


READS = [(0, 4096, 0), (4096, 8192, 0), (3 * 4096, PIECE, 0), (4096, 100, 0),
         (0, PIECE + 3 * 4096 + 123, 0), (5, 4096, 0), (8192, 5000, 8),
         (PIECE + 3 * 4096, 123, 0), (PIECE, 3 * 4096 + 123, 24)]


@pytest.mark.parametrize("spec", [READS[k : k + 1] for k in range(len(READS))] + [READS[2:4]])
def test_store_reads_any_range_into_any_buffer_with_its_checksum(data_file, spec):
    root, data = data_file
    store = DirectFileStore(str(root), direct_io=True)
    assert store.uses_direct("f.dcpp")
    bufs = _buffers(spec)
    sums: dict[int, str | None] = {}
    store.read_direct([("f.dcpp", off, n) for off, n, _ in spec], lambda k: bufs[k],
                      sums.__setitem__, hashed=True)
    for k, (off, n, _) in enumerate(spec):
        assert bytes(bufs[k]) == data[off : off + n]
        assert sums[k] == checksum_bytes(data[off : off + n])
    store.close()


def test_a_request_outgrowing_the_bounce_buffers_is_refused_not_truncated(data_file,
                                                                          monkeypatch):
    root, _ = data_file
    monkeypatch.setattr(direct_extents, "PIECE", 2 * PIECE)  # the buffers stay PIECE bytes
    store = DirectFileStore(str(root), direct_io=True)
    bufs = _buffers([(8, PIECE + 4096, 8)])  # unaligned: through a bounce buffer
    with pytest.raises(RuntimeError, match="does not fit"):
        store.read_direct([("f.dcpp", 8, PIECE + 4096)], lambda k: bufs[k], lambda k, s: None)
    store.close()


def test_store_read_past_the_end_names_the_extent_cut(data_file):
    root, data = data_file
    store = DirectFileStore(str(root), direct_io=True)
    assert store.uses_direct("f.dcpp")
    bufs = _buffers([(0, 4096, 0), (0, 300, 0)])
    with pytest.raises(ExtentEOFError) as info:
        store.read_direct([("f.dcpp", 0, 4096), ("f.dcpp", len(data) - 200, 300)],
                          lambda k: bufs[k], lambda k, s: None)
    assert info.value.extent == 1 and str(root / "f.dcpp") in str(info.value)
    assert f"byte {len(data)}" in str(info.value)
    with pytest.raises(EOFError):
        store.read("f.dcpp", [(len(data) - 10, memoryview(bytearray(11)))])


def test_bounce_buffers_are_page_aligned():
    from dcp_plus.storage.buffers import BufferPool

    pool = BufferPool(3 * 4096)
    with pool.take_addressed() as (a, at), pool.take_addressed() as (b, bt):
        assert at % mmap.PAGESIZE == 0 and bt % mmap.PAGESIZE == 0 and at != bt
        assert address(a) == at and len(b) == 3 * 4096
    pool.close()


# ---------------------------------------------------------------------------------------------
# Settings


def test_direct_io_setting_is_checked():
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidOptionError, match="direct_io"):
            LocalReader("/nowhere", direct_io=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidOptionError, match=r"LocalReaderOptions\.direct_io"):
            LocalReaderOptions(direct_io=bad)  # type: ignore[arg-type]
    assert LocalReaderOptions(direct_io=False).kwargs()["direct_io"] is False
