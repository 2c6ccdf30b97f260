"""Parts of incremental checkpoints read in place (issue 19): O_DIRECT reads land in torch's
unaligned tensors, shifted inside each part's own destination, with no bounce buffer; the
load is exact and a damaged part is still caught."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dcp_plus.storage.direct_extents import read_bounce_pool
from dcp_plus.storage.direct_read import DIRECT_ALIGN
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


def test_an_incremental_checkpoint_loads_into_torch_tensors_without_a_bounce_buffer(
        tmp_path, caplog):
    want = _chain(tmp_path)
    referenced = [e for e in read_record_json(tmp_path / "s1")["extents"] if e.get("parts")]
    assert {e["fqn"] for e in referenced} == {"w", "bf16"}  # the parts path is the one read
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    assert all(t.data_ptr() % DIRECT_ALIGN for t in target.values())  # torch's own
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
    shared = torch.zeros_like(w)
    assert shared.data_ptr() % DIRECT_ALIGN
    load({"emb": shared, "head": shared}, tmp_path / "s1", direct_io=True)
    assert torch.equal(shared.view(torch.int32), w.view(torch.int32))
