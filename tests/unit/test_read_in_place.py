"""Reads in place (issue 19): O_DIRECT pieces land shifted inside their own unaligned
destinations and are moved down; nothing outside a destination is written, tensors that
share memory are never read that way, and a restore maps no bounce buffer; the parts of
incremental checkpoints likewise.
"""

from __future__ import annotations

import logging
import mmap
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.readers.solo_memory import may_shift_for, solo_spans
from dcp_plus.storage import direct_extents
from dcp_plus.storage.buffers import aligned_buffer
from dcp_plus.storage.direct_extents import PIECE, read_bounce_pool, read_side_pool
from dcp_plus.storage.direct_landing import MIN_IN_PLACE, lay_out
from dcp_plus.storage.direct_read import DIRECT_ALIGN, address
from dcp_plus.storage.direct_store import DirectFileStore
from tests.conftest import (
    assert_bit_exact,
    clone_state,
    flip_byte,
    load,
    load_fails,
    random_tensor,
    read_record_json,
    save,
)

A = DIRECT_ALIGN
GUARD = 0xA5


def _layouts(seed: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Random extents ``(offset, length)`` in one file (4 KiB-aligned like dcp_plus writes
    them, some not, gaps between) and the misalignment of each one's destination."""
    rng = random.Random(seed)
    extents, at = [], rng.choice([0, 4096, 8])
    for _ in range(rng.randint(1, 12)):
        n = rng.choice([1, 4095, 4097, MIN_IN_PLACE - 1, MIN_IN_PLACE, MIN_IN_PLACE + 4093,
                        (1 << 20) + 7, rng.randint(1, 3 << 20)])
        extents.append((at, n))
        at += n + rng.choice([0, 0, 100, 5000])
        if rng.random() < 0.8:
            at = -(-at // A) * A
    return extents, [rng.choice([0, 64, 8, 4032, 1, 2047]) for _ in extents]


def _guarded(lengths: list[int], shifts: list[int]) -> tuple[mmap.mmap, list[memoryview]]:
    """One mapping filled with GUARD, holding a destination per length ``shift`` bytes past a
    page boundary, a page of guard between neighbours."""
    spots, at = [], 0
    for n, s in zip(lengths, shifts, strict=True):
        spots.append(at + s)
        at = -(-(at + s + n) // A) * A + A
    buf = mmap.mmap(-1, at + A)
    buf.write(bytes([GUARD]) * len(buf))
    return buf, [memoryview(buf)[s : s + n] for s, n in zip(spots, lengths, strict=True)]


def _file_and_destinations(tmp_path: Path, seed: int, tail: int = 0) -> tuple[
        list[tuple[int, int]], bytes, mmap.mmap, list[memoryview]]:
    """:func:`_layouts`' extents in a data file ``f.dcpp`` of random bytes (``tail`` more
    after the last), and their guarded destinations."""
    extents, shifts = _layouts(seed)
    data = random.Random(seed).randbytes(max(off + n for off, n in extents) + tail)
    (tmp_path / "f.dcpp").write_bytes(data)
    buf, views = _guarded([n for _, n in extents], shifts)
    return extents, data, buf, views


def _assert_only_destinations_written(buf: mmap.mmap, views: list[memoryview]) -> None:
    guard = bytearray(buf)
    for v in views:
        at = address(v) - address(buf)
        guard[at : at + len(v)] = bytes([GUARD]) * len(v)
    assert guard == bytes([GUARD]) * len(buf), "a read wrote outside its destination"


@pytest.mark.parametrize("seed", range(40))
def test_a_layout_tiles_the_request_with_aligned_segments_each_inside_its_piece(seed):
    extents, shifts = _layouts(seed)
    buf, views = _guarded([n for _, n in extents], shifts)
    start = extents[0][0]
    pieces, at = [], start
    for k, (off, n) in enumerate(extents):
        if off > at:
            pieces.append((-1, 0, off - at))
        pieces.append((k, 0, n))
        at = off + n
    dests = [None if k < 0 else views[k] for k, _, _ in pieces]
    layout = lay_out(start, at - start, pieces, dests, lambda s, e: True)
    assert layout.start == start - start % A
    assert sum(n for _, _, n in layout.segments) == -(-at // A) * A - layout.start
    side = 0
    for i, off, n in layout.segments:
        assert n > 0 and n % A == 0
        if i < 0:
            assert off == side
            side += n
        else:
            land = layout.landings[i]
            assert (address(land.view) + off) % A == 0 and off == land.shift
            assert land.shift + land.body <= land.hi - land.lo  # inside its own destination
    assert side == layout.side_bytes
    in_place = [ld for ld in layout.landings if ld.shift >= 0]
    for ld in layout.landings:
        assert ld.side_at + (ld.hi - ld.lo - ld.body) <= layout.side_bytes
    assert all(ld.hi - ld.lo >= MIN_IN_PLACE for ld in in_place)
    assert buf  # the destinations' mapping lives until here


@pytest.mark.parametrize("seed", range(12))
def test_reads_in_place_are_exact_and_write_nothing_outside_the_destinations(tmp_path, seed):
    extents, data, buf, views = _file_and_destinations(tmp_path, seed, tail=777)
    store = DirectFileStore(str(tmp_path), direct_io=True)
    assert store.uses_direct("f.dcpp")
    sums: dict[int, str | None] = {}
    store.read_direct([("f.dcpp", off, n) for off, n in extents], views.__getitem__,
                      sums.__setitem__, streams=2, hashed=True, may_shift=lambda s, e: True)
    assert store.uses_direct("f.dcpp"), "an iovec was refused: the read fell back"
    store.close()
    for k, (off, n) in enumerate(extents):
        assert bytes(views[k]) == data[off : off + n], k
        assert sums[k] == checksum_bytes(data[off : off + n])
    _assert_only_destinations_written(buf, views)


def _big_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": random_tensor((PIECE + 4097,), torch.uint8, gen),
            "bf16": random_tensor((1031, 1033), torch.bfloat16, gen),
            "f32": random_tensor((3, 5, 70001), torch.float32, gen),
            "c64": random_tensor((MIN_IN_PLACE // 8 + 1,), torch.complex64, gen)}


def _saved_big_state(tmp_path: Path, seed: int) -> tuple[dict[str, torch.Tensor], Path,
                                                          dict[str, Any]]:
    """:func:`_big_state` saved to ``tmp_path/ck``, and the record's extent of ``w``."""
    sd = _big_state(seed)
    ck = tmp_path / "ck"
    save(sd, ck)
    return sd, ck, next(r for r in read_record_json(ck)["extents"] if r["fqn"] == "w")


def test_a_restore_into_torch_tensors_maps_no_bounce_buffer(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dcp_plus.storage.direct_store")
    sd = _big_state()
    save(sd, tmp_path / "ck")
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert any(t.data_ptr() % A for t in target.values())  # torch's own, unaligned
    read_bounce_pool.release_idle()
    load(target, tmp_path / "ck", direct_io=True)
    assert_bit_exact(target, sd)
    assert read_bounce_pool.idle == 0, "a bounce buffer was mapped"
    assert not caplog.records, "the load fell back to the page cache"


def test_views_into_one_buffer_load_exact_and_leave_the_rest_of_it_alone(tmp_path):
    sd = _big_state(1)
    save(sd, tmp_path / "ck")
    sizes = [v.numel() * v.element_size() for v in sd.values()]
    flat = torch.full((sum(sizes) + 64 * len(sizes) + 8,), GUARD, dtype=torch.uint8)
    target, at = {}, 11
    for (k, v), n in zip(sd.items(), sizes, strict=True):
        es = v.element_size()
        at = -(-at // es) * es + (es if (-(-at // es) * es) % A == 0 else 0)  # unaligned
        target[k] = flat[at : at + n].view(v.dtype).reshape(v.shape)
        at += n + 64
    load(target, tmp_path / "ck", direct_io=True)
    assert_bit_exact(target, sd)
    loaded = torch.zeros_like(flat, dtype=torch.bool)
    for t in target.values():
        lo = t.data_ptr() - flat.data_ptr()
        loaded[lo : lo + t.numel() * t.element_size()] = True
    assert bool((flat[~loaded] == GUARD).all()), "a load wrote between its destinations"


def test_tied_and_overlapping_tensors_are_not_read_in_place_and_load_exact(tmp_path):
    gen = torch.Generator().manual_seed(2)
    emb = random_tensor((4099, 257), torch.float32, gen)
    sd = {"emb": emb, "head": emb.clone(), "lo": emb.view(-1)[: 3 << 18].clone(),
          "solo": random_tensor((1 << 20,), torch.float32, gen)}
    save(sd, tmp_path / "ck")
    shared = torch.zeros(4099 * 257, dtype=torch.float32)
    target = {"emb": shared.view(4099, 257), "head": shared.view(4099, 257),
              "lo": shared[: 3 << 18], "solo": torch.zeros(1 << 20)}

    class Spy:
        state_dict = target
    may_shift = may_shift_for(Spy())  # type: ignore[arg-type]
    assert may_shift is not None
    p, n = shared.data_ptr(), shared.numel() * 4
    assert not may_shift(p, p + n) and not may_shift(p + 4096, p + 8192)
    solo = target["solo"]
    assert may_shift(solo.data_ptr(), solo.data_ptr() + (1 << 22))
    assert solo_spans([target]) == [(solo.data_ptr(), solo.data_ptr() + (1 << 22))]
    load(target, tmp_path / "ck", direct_io=True)
    assert_bit_exact({"emb": target["emb"], "solo": target["solo"]},
                     {"emb": sd["head"], "solo": sd["solo"]})


def test_a_flipped_byte_in_a_piece_read_in_place_is_detected_naming_the_tensor(tmp_path):
    sd, ck, row = _saved_big_state(tmp_path, 3)
    for pos in (row["offset"], row["offset"] + PIECE - 1, row["offset"] + row["length"] - 1):
        flip_byte(ck / row["file"], pos)
        try:
            msg = load_fails({k: torch.zeros_like(v) for k, v in sd.items()}, ck,
                             direct_io=True)
            assert "checksum mismatch" in msg and "'w'" in msg, msg
        finally:
            flip_byte(ck / row["file"], pos)


def test_interleaved_strided_views_count_as_sharing_their_memory():
    base = torch.zeros(100, 100)
    left, right, alone = base[:, :50], base[:, 50:], torch.zeros(64, 64)
    end = alone.data_ptr() + alone.numel() * 4
    assert solo_spans([{"l": left, "r": right}, [alone]]) == [(alone.data_ptr(), end)]
    assert solo_spans([base[:50], base[50:]]) == sorted(
        (t.data_ptr(), t.data_ptr() + 50 * 100 * 4) for t in (base[:50], base[50:]))


def test_a_load_with_more_requests_in_flight_than_pooled_buffers_is_exact(tmp_path,
                                                                         monkeypatch):
    """threads=8: 10 requests at once, each with a side buffer, the pool keeping 6; pieces of
    one tensor in several requests on different threads."""
    monkeypatch.setattr(direct_extents, "PIECE", 256 << 10)
    gen = torch.Generator().manual_seed(4)
    sd = {f"t{i}": random_tensor(((1 << 18) + 250,), torch.float32, gen) for i in range(24)}
    save(sd, tmp_path / "ck")
    read_side_pool.release_idle()
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(target, tmp_path / "ck", direct_io=True, threads=8)
    assert_bit_exact(target, sd)
    assert read_side_pool.idle <= read_side_pool.keep


def test_concurrent_reads_of_split_extents_stay_inside_their_destinations(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(direct_extents, "PIECE", 128 << 10)  # extents cut over requests
    extents, data, buf, views = _file_and_destinations(tmp_path, 7)
    store = DirectFileStore(str(tmp_path), direct_io=True)
    with ThreadPoolExecutor(4 + direct_extents.COPIERS) as pool:
        store.read_direct([("f.dcpp", off, n) for off, n in extents], views.__getitem__,
                          lambda k, c: None, pool, streams=4, may_shift=lambda s, e: True)
    store.close()
    for k, (off, n) in enumerate(extents):
        assert bytes(views[k]) == data[off : off + n], k
    _assert_only_destinations_written(buf, views)


def test_a_file_cut_inside_a_body_read_in_place_names_file_and_tensor(tmp_path):
    from tests.unit.test_direct_read import TruncatingPlanner

    sd, ck, row = _saved_big_state(tmp_path, 5)
    planner = TruncatingPlanner(ck / row["file"], row["offset"] + PIECE // 2 + 5)
    msg = load_fails({k: torch.zeros_like(v) for k, v in sd.items()}, ck, planner,
                     direct_io=True)
    assert "truncated file" in msg and "'w'" in msg and str(ck / row["file"]) in msg, msg


def test_side_buffers_are_not_shared_with_a_forked_child():
    mine = aligned_buffer(4096)
    mine[:6] = b"PARENT"
    with read_side_pool.take() as side:
        side[:6] = b"PARENT"
    pid = os.fork()
    if pid == 0:  # the child writes both and exits
        code = 1
        try:
            mine[:5] = b"CHILD"
            code = 0 if read_side_pool.idle == 0 else 2  # none of the parent's kept
            with read_side_pool.take() as side:
                side[:5] = b"CHILD"
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert mine[:6] == b"PARENT", "the child wrote the parent's buffer"
    with read_side_pool.take() as side:
        assert bytes(side[:6]) == b"PARENT"


def test_memory_that_cannot_be_placed_turns_shifting_off():
    from torch.testing._internal.two_tensor import TwoTensor

    plain = torch.zeros(1 << 16)
    assert solo_spans([{"p": plain}]) is not None
    assert solo_spans([{"p": plain, "s": torch.zeros(4, 4).to_sparse()}]) is None
    assert solo_spans([{"p": plain, "w": TwoTensor(torch.zeros(4), torch.zeros(4))}]) is None

    class Holder:
        state_dict = {"p": plain, "s": torch.zeros(4, 4).to_sparse()}
    assert may_shift_for(Holder()) is None  # type: ignore[arg-type]


# -- parts of incremental checkpoints ----------------------------------------------------

MIB = 1 << 20


def _chain(tmp_path: Path) -> dict[str, torch.Tensor]:
    """A full save ``s0`` and an incremental ``s1`` on it in which one part of each tensor
    changed; returns the state ``s1`` holds."""
    gen = torch.Generator().manual_seed(0)
    sd = {"w": random_tensor((5 * MIB // 4 + 3,), torch.float32, gen),
          "bf16": random_tensor((1031, 1033), torch.bfloat16, gen)}
    save(sd, tmp_path / "s0", incremental=True)
    sd["w"][: MIB // 4] += 1.0
    sd["bf16"][700] += 1.0
    save(sd, tmp_path / "s1", base=tmp_path / "s0")
    return clone_state(sd)


def _zeros_as_torch_places(like: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``like``, 64 bytes past a 4 KiB boundary, where torch's allocator
    usually (not always) puts a large tensor: never aligned by chance."""
    n = like.element_size()
    flat = torch.zeros(like.numel() + 2 * A // n, dtype=like.dtype)
    skip = (64 - flat.data_ptr() % A) % A // n
    return flat[skip:skip + like.numel()].view(like.shape)


def test_an_incremental_checkpoint_loads_into_torch_tensors_without_a_bounce_buffer(
        tmp_path, caplog):
    want = _chain(tmp_path)
    referenced = [e for e in read_record_json(tmp_path / "s1")["extents"] if e.get("parts")]
    assert {e["fqn"] for e in referenced} == {"w", "bf16"}  # the parts path is the one read
    target = {k: _zeros_as_torch_places(v) for k, v in want.items()}
    assert all(t.data_ptr() % A == 64 for t in target.values())
    caplog.set_level(logging.INFO, logger="dcp_plus.storage.direct_store")
    read_bounce_pool.release_idle()
    load(target, tmp_path / "s1", direct_io=True)
    assert_bit_exact(target, want)
    assert read_bounce_pool.idle == 0, "a bounce buffer was mapped"
    fell_back = [r for r in caplog.records if r.name == "dcp_plus.storage.direct_store"]
    assert not fell_back, "the load fell back to the page cache"


def test_a_damaged_part_of_the_base_read_in_place_is_caught(tmp_path):
    want = _chain(tmp_path)
    w = next(e for e in read_record_json(tmp_path / "s0")["extents"] if e["fqn"] == "w")
    flip_byte(tmp_path / "s0" / w["file"], w["offset"] + MIB + 12345)  # part 1: unchanged
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    msg = load_fails(target, tmp_path / "s1", direct_io=True)
    assert "checksum mismatch" in msg and "'w'" in msg, msg


def test_parts_of_tied_tensors_load_exact_into_one_shared_destination(tmp_path):
    # two keys, one memory (tied weights): both parts paths deliver into it
    gen = torch.Generator().manual_seed(1)
    w = random_tensor((3 * MIB // 4 + 5,), torch.float32, gen)
    save({"emb": w, "head": w}, tmp_path / "s0", incremental=True)
    w[: MIB // 4] += 1.0
    save({"emb": w, "head": w}, tmp_path / "s1", base=tmp_path / "s0")
    shared = _zeros_as_torch_places(w)
    load({"emb": shared, "head": shared}, tmp_path / "s1", direct_io=True)
    assert torch.equal(shared.view(torch.int32), w.view(torch.int32))
