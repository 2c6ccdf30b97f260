"""LocalWriter's direct I/O (issue 19): O_DIRECT from the slabs and through bounce buffers,
bit-exact at odd sizes and every dtype, the buffered fallback logged once, no checkpoint
bytes left in the page cache, crashes and corruption handled as with buffered writes."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from dcp_plus import LocalWriter
from dcp_plus.cli.bench.machine import evict_files
from dcp_plus.errors import InvalidOptionError
from dcp_plus.format.values import byte_view
from dcp_plus.manager.options import LocalWriterOptions
from dcp_plus.stagers import ArenaStager
from dcp_plus.storage.buffers import ALIGN, aligned_buffer
from dcp_plus.storage.direct import (
    BOUNCE_BYTES,
    DirectFile,
    bounce_pool,
    clear_probe_cache,
    direct_refusal,
    mapped_pages,
    resident_pages,
    use_direct,
)
from dcp_plus.writers.bounce import RAMP, chunk_plan, write_files
from tests.conftest import (
    DTYPES,
    ROOT,
    assert_bit_exact,
    child_env,
    data_files,
    flip_byte,
    load,
    load_fails,
    load_target,
    random_tensor,
    read_record_json,
    record_path,
    referenced_files,
    wait_until,
)
from tests.unit import _direct_crash_child

SIZES = {"one_byte": 1, "page_minus_1": 4095, "page_plus_1": 4097,
         "three_mib_plus_1": (3 << 20) + 1}


def odd_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Byte lengths 1, 4095, 4097, 3 MiB + 1, empty tensors, and one tensor of every dtype
    the suite stores (``tests.conftest.DTYPES``)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {f"u8_{k}": random_tensor((n,), torch.uint8, gen) for k, n in SIZES.items()}
    sd["empty_f32"] = torch.empty(0)
    sd["empty_2d_bf16"] = torch.empty(3, 0, dtype=torch.bfloat16)
    for dtype in DTYPES:
        sd[f"d_{dtype}"] = random_tensor((7, 149), dtype, gen)  # odd byte lengths
    return sd


def probe_ok(directory: Path) -> None:
    if direct_refusal(str(directory)) is not None:
        pytest.skip(f"{directory}: {direct_refusal(str(directory))}")


def cached_fraction(ckpt: Path) -> float:
    resident = total = 0
    for name in data_files(ckpt):
        r, t = resident_pages(str(ckpt / name))
        resident, total = resident + r, total + t
    assert total, f"{ckpt}: no data pages"
    return resident / total


def save_via(how: str, sd: dict[str, Any], path: Path, **kwargs: Any) -> LocalWriter:
    """Save ``sd`` to ``path`` with ``dcp.save`` or ``async_save`` and an ``"arena"`` or a
    DCP stager; the writer used."""
    writer = LocalWriter(path, **kwargs)
    if how == "dcp.save":
        dcp.save(sd, storage_writer=writer, no_dist=True)
        return writer
    stager: Any = (ArenaStager() if how == "arena" else
                   DefaultStager(StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)))
    try:
        resp = dcp.async_save(sd, storage_writer=writer, async_stager=stager, no_dist=True)
        resp.staging_completion.result()
        resp.upload_completion.result()
    finally:
        stager.close()
    return writer


@pytest.fixture(autouse=True)
def _fresh_probe() -> Iterator[None]:
    clear_probe_cache()
    yield
    clear_probe_cache()


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="dcpp-test-direct-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dcp.save", "default_stager", "arena"])
@pytest.mark.parametrize("streams", [1, 4])
def test_direct_round_trip_is_bit_exact_and_leaves_the_page_cache_clean(tmp_path, how, streams):
    probe_ok(tmp_path)
    sd = odd_state()
    expected = {k: v.clone() for k, v in sd.items()}
    ckpt = tmp_path / "ckpt"

    save_via(how, sd, ckpt, direct_io=True, streams=streams)

    assert cached_fraction(ckpt) < 0.05
    assert_bit_exact(load(load_target(expected), ckpt), expected)
    ends = {}
    for e in read_record_json(ckpt)["extents"]:
        ends[e["file"]] = max(ends.get(e["file"], 0), e["offset"] + e["length"])
    for name, end in ends.items():  # no padding after the last extent
        assert (ckpt / name).stat().st_size == end, name


@pytest.mark.parametrize("how", ["dcp.save", "arena"])
def test_a_large_direct_save_leaves_under_5_percent_of_its_bytes_cached(tmp_path, how):
    probe_ok(tmp_path)
    gen = torch.Generator().manual_seed(3)
    sd = {f"w{i}": random_tensor(((9 << 20) + 4097 * i,), torch.uint8, gen) for i in range(6)}
    expected = {k: v.clone() for k, v in sd.items()}
    ckpt = tmp_path / "ckpt"

    save_via(how, sd, ckpt)  # direct_io="auto", streams=2

    assert cached_fraction(ckpt) < 0.05
    assert_bit_exact(load(load_target(expected), ckpt), expected)


def test_direct_io_false_writes_through_the_page_cache(tmp_path, caplog):
    sd = odd_state()
    expected = {k: v.clone() for k, v in sd.items()}
    caplog.set_level(logging.INFO, logger="dcp_plus.storage.direct")

    save_via("dcp.save", sd, tmp_path / "ckpt", direct_io=False)

    assert cached_fraction(tmp_path / "ckpt") > 0.5  # buffered pages stay cached
    assert not caplog.records  # nothing probed, nothing to say
    assert_bit_exact(load(load_target(expected), tmp_path / "ckpt"), expected)


def test_resident_pages_counts_what_the_page_cache_holds(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * ALIGN + 5))
    assert resident_pages(str(path)) == (65, 65)  # just written: cached
    evict_files([str(path)])
    assert resident_pages(str(path)) == (0, 65)
    empty = tmp_path / "empty"
    empty.touch()
    assert resident_pages(str(empty)) == (0, 0)


# -- the fallback ----------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "level"), [("auto", logging.INFO), (True, logging.WARNING)])
@pytest.mark.parametrize("how", ["dcp.save", "arena"])
def test_tmpfs_saves_buffered_and_says_so_once(shm_dir, caplog, mode, level, how):
    caplog.set_level(logging.INFO, logger="dcp_plus.storage.direct")
    sd = odd_state(seed=1)
    expected = {k: v.clone() for k, v in sd.items()}

    for step in range(2):
        save_via(how, sd, shm_dir / f"step_{step}", direct_io=mode)

    lines = [r for r in caplog.records if r.name == "dcp_plus.storage.direct"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == level
    assert "tmpfs" in lines[0].getMessage() and "writing buffered" in lines[0].getMessage()
    assert str(shm_dir) in lines[0].getMessage()
    for step in range(2):
        assert_bit_exact(load(load_target(expected), shm_dir / f"step_{step}"), expected)


def test_probe_takes_ext4_and_names_the_reason_for_tmpfs(tmp_path, shm_dir):
    assert direct_refusal(str(tmp_path)) is None  # this VM's /tmp is ext4
    reason = direct_refusal(str(shm_dir))
    assert reason is not None and "tmpfs" in reason and str(shm_dir) in reason
    assert use_direct(str(tmp_path), "auto") and not use_direct(str(shm_dir), "auto")
    assert not use_direct(str(tmp_path), False)
    assert os.listdir(tmp_path) == [] and os.listdir(shm_dir) == []  # no probe file left


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path):
    """An unaligned buffer makes ext4 refuse the O_DIRECT write (EINVAL), as a refusing file
    system would: the bytes still land, buffered, and ``refused`` says why."""
    probe_ok(tmp_path)
    path = tmp_path / "f"
    path.touch()
    buf = aligned_buffer(4 * ALIGN)
    buf[:] = os.urandom(4 * ALIGN)
    ok = DirectFile(str(path), direct=True, drop_cache=True)
    ok.write(memoryview(buf)[: 2 * ALIGN + 5], 0, aligned=True)
    ok.finish(fsync=True)
    assert ok.refused is None and path.read_bytes() == bytes(buf[: 2 * ALIGN + 5])
    os.truncate(path, 0)

    view = memoryview(buf)[1 : 1 + 2 * ALIGN]  # misaligned in memory
    f = DirectFile(str(path), direct=True, drop_cache=True)
    f.write(view, 0, aligned=True)
    f.write(memoryview(buf)[: ALIGN + 3], 2 * ALIGN, aligned=True)  # after the refusal
    f.finish(fsync=True)

    assert f.refused is not None and "EINVAL" in f.refused and str(path) in f.refused
    data = path.read_bytes()
    assert data[: 2 * ALIGN] == bytes(view) and data[2 * ALIGN :] == bytes(buf[: ALIGN + 3])
    view.release()


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_direct_io_takes_only_true_false_or_auto(tmp_path, bad):
    with pytest.raises(ValueError, match='direct_io must be True, False or "auto"'):
        LocalWriter(tmp_path, direct_io=bad)
    with pytest.raises(InvalidOptionError, match="LocalWriterOptions.direct_io"):
        LocalWriterOptions(direct_io=bad)
    with pytest.raises(ValueError, match="streams must be >= 1"):
        LocalWriter(tmp_path, streams=0)
    assert LocalWriterOptions().kwargs()["direct_io"] == "auto"
    assert LocalWriter(tmp_path, **LocalWriterOptions(streams=3).kwargs()).streams == 3


# -- corruption and crashes ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dcp.save", "arena"])
def test_a_flipped_byte_in_a_direct_file_is_detected_by_load_and_verify(tmp_path, how):
    probe_ok(tmp_path)
    sd = odd_state(seed=2)
    expected = {k: v.clone() for k, v in sd.items()}
    ckpt = tmp_path / "ckpt"
    save_via(how, sd, ckpt, direct_io=True)
    row = next(e for e in read_record_json(ckpt)["extents"] if e["length"] > 2 * ALIGN)
    flip_byte(ckpt / row["file"], row["offset"] + ALIGN + 7)  # inside the O_DIRECT part

    assert row["file"] in load_fails(load_target(expected), ckpt)
    proc = subprocess.run([sys.executable, "-m", "dcp_plus", "verify", str(ckpt)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert row["file"] in proc.stdout


def test_kill_9_mid_direct_write_keeps_the_committed_checkpoint(tmp_path):
    """A child overwrites one checkpoint again and again with direct I/O (bounce path); it is
    frozen while a save is writing files the record does not name yet, then SIGKILLed. The
    committed checkpoint still loads bit-exact (its step says which state it holds)."""
    probe_ok(tmp_path)
    ckpt = tmp_path / "ckpt"
    stderr = open(tmp_path / "child.stderr", "wb")  # noqa: SIM115 (closed in finally)
    child = subprocess.Popen([sys.executable, "-m", "tests.unit._direct_crash_child", str(ckpt)],
                             cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=stderr)

    def in_flight() -> bool:
        try:
            return bool(data_files(ckpt) - referenced_files(ckpt))
        except (FileNotFoundError, ValueError):
            return False

    def writing() -> bool:
        if child.poll() is not None:
            pytest.fail((tmp_path / "child.stderr").read_text(errors="replace")[-3000:])
        if not in_flight():
            return False
        os.kill(child.pid, signal.SIGSTOP)  # frozen, then check it is still mid-save
        if in_flight():
            return True
        os.kill(child.pid, signal.SIGCONT)
        return False

    try:
        wait_until(writing, 180, "the child to be caught writing a save")
        before = record_path(ckpt).read_bytes()
        child.kill()
        child.wait(timeout=30)
        assert record_path(ckpt).read_bytes() == before
        assert data_files(ckpt) - referenced_files(ckpt), "the interrupted save left no file"
        expected = _direct_crash_child.state(_committed_step(ckpt))
        assert_bit_exact(load(load_target(expected), ckpt), expected)
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.wait()
        stderr.close()


def _committed_step(ckpt: Path) -> int:
    probe = {"step": torch.zeros((), dtype=torch.int64)}
    load(probe, ckpt)
    return int(probe["step"])


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root to mount a small tmpfs")
@pytest.mark.parametrize("mode", ["plain", "buffered", "slab"])
def test_a_full_disk_fails_the_save_naming_the_file_and_leaves_nothing_behind(tmp_path, mode):
    """A real ENOSPC (a 12 MiB tmpfs in a mount namespace of its own): the error names the
    data file and the device's complaint, the failed save's files are gone (their space
    freed), and the checkpoint saved before it loads bit-exact."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    script = ('mount -t tmpfs -o size=12m tmpfs "$0" && exec "$1" -m tests.unit._full_disk_child '
              '"$0" "$2"')
    out = subprocess.run(["unshare", "-m", "sh", "-c", script, str(mnt), sys.executable, mode],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "No space left on device" in got["error"]
    assert re.search(rf"{re.escape(str(mnt))}/full/__0_\d+\.[0-9a-f]+\.dcpp", got["error"])
    assert got["left"] == []


@pytest.mark.parametrize("streams", [1, 3])
def test_bounce_chunks_assemble_tensor_and_bytes_items_across_chunk_boundaries(tmp_path,
                                                                              streams):
    """Tensor memory and read-only bytes, each cut by a bounce-buffer boundary, with gaps of
    zeros between them and an unaligned end, land in the files as they were placed (two
    files written from one queue of chunks, a small one between them)."""
    probe_ok(tmp_path)
    gen = torch.Generator().manual_seed(5)
    big = random_tensor((BOUNCE_BYTES + 12345,), torch.uint8, gen)
    ro = bytes(random_tensor((9000,), torch.uint8, gen).tolist())
    size = 2 * BOUNCE_BYTES + 7001
    layouts = [
        (size, [(0, memoryview(ro)), (10_000, byte_view(big)),
                (2 * BOUNCE_BYTES - 4000, memoryview(ro)), (size - 1, memoryview(b"\x07"))]),
        (5000, [(3, memoryview(ro[:4000]))]),
        (size - 8191, [(4096, byte_view(big)), (size - 8192 - len(ro), memoryview(ro))]),
    ]
    files = []
    for i, (n, segments) in enumerate(layouts):
        path = tmp_path / f"f{i}.bin"
        path.touch()
        files.append((str(path), segments, n))
    write_files(files, direct=True, streams=streams, fsync=True)
    for path, segments, n in files:
        expected = bytearray(n)
        for off, data in segments:
            expected[off:off + len(data)] = data
        assert Path(path).read_bytes() == bytes(expected), path


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("sizes", [[0], [5000], [3 << 20, 0, 1 << 30], [(2 << 30) + 7, 77 << 20]])
def test_bounce_chunks_cover_each_file_once_ramping_up_and_down(sizes, streams):
    """Chunks cover every byte of every file once, each file in order, the files in turn;
    they start 4 KiB-aligned, never span two files, ramp up from RAMP[0] per stream, and end
    on RAMP[0]-sized chunks."""
    plan = chunk_plan(sizes, streams)
    for i, size in enumerate(sizes):
        mine = [(s, e) for f, s, e in plan if f == i]
        assert [s for s, _ in mine] == [0, *[e for _, e in mine]][:len(mine)]
        assert (mine[-1][1] if mine else 0) == size
        assert all(s % 4096 == 0 and e > s for s, e in mine)
    live = [i for i, n in enumerate(sizes) if n]
    assert [f for f, _, _ in plan][:len(live)] == live  # in turn
    lengths = [e - s for _, s, e in plan]
    assert all(n <= BOUNCE_BYTES for n in lengths)
    assert all(n <= RAMP[0] for n in lengths[:streams])
    if sum(sizes) >= 1 << 30:
        assert BOUNCE_BYTES in lengths
        if streams > 1:  # the streams end within a short chunk of each other
            assert max(lengths[-streams:]) <= RAMP[0]


def test_a_small_bounce_write_maps_only_the_bounce_memory_it_fills(tmp_path):
    """Bounce buffers are large (one request per 64 MiB): a file of a few KiB must not fault
    in all of one (that would be the buffer's size per stream for every small save)."""
    probe_ok(tmp_path)
    bounce_pool.release_idle()
    path = tmp_path / "small.bin"
    path.touch()
    data = aligned_buffer(3 * ALIGN)
    data[:] = os.urandom(len(data))
    write_files([(str(path), [(0, memoryview(data))], len(data))], direct=True, streams=1,
                fsync=True)
    assert path.read_bytes() == bytes(data)
    assert bounce_pool.idle == 1
    with bounce_pool.take() as view:  # the buffer that write used
        assert len(view) == BOUNCE_BYTES
        at = ctypes.addressof(ctypes.c_char.from_buffer(view))
        assert mapped_pages(at, len(view)).count(1) * ALIGN <= 2 << 20  # one huge page at most
