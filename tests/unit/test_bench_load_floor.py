"""``benchmarks.load_floor``: its floor reads land the files' bytes where it says (moved ones
too), its aligned copy of a state is aligned, and a small run loads bit-exact and reports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import load_floor
from benchmarks.load_floor import PAGE, REQUEST, TORCH_OFFSET, aligned_copy, floor_read
from dcp_plus.cli.bench.models import iter_tensors

MiB = 1 << 20


@pytest.fixture
def files(direct_dir: Path) -> list[str]:
    tmp_path = direct_dir
    out = []
    for name, size in (("a", REQUEST + 5 * MiB), ("b", 3 * PAGE)):
        path = tmp_path / name
        path.write_bytes(os.urandom(size))
        out.append(str(path))
    return out


@pytest.mark.parametrize("move", [False, True])
def test_floor_reads_land_every_byte_where_the_request_says(files: list[str], move: bool):
    reqs = load_floor.requests_of(files)
    assert [(os.path.basename(f), o, n) for f, o, n in reqs] == [
        ("a", 0, REQUEST), ("a", REQUEST, 5 * MiB), ("b", 0, 3 * PAGE)]
    slot = REQUEST + 2 * PAGE
    memory = torch.zeros(len(reqs) * slot + PAGE, dtype=torch.uint8)
    floor_read(reqs, memory, move=move, streams=2, copiers=1)
    base = -memory.data_ptr() % PAGE
    for i, (f, off, n) in enumerate(reqs):
        with open(f, "rb") as fh:
            fh.seek(off)
            want = fh.read(n)
        at = base + i * slot + (TORCH_OFFSET if move else 0)
        assert bytes(memory[at:at + len(want)].numpy()) == want, (f, off)


def test_aligned_copy_has_every_tensor_at_a_page_boundary_with_its_shape_and_dtype():
    sd = {"w": torch.ones(3, 5), "m": {"b": torch.ones(7, dtype=torch.bfloat16)},
          "l": [torch.ones(2, dtype=torch.int64), 4], "t": (torch.ones(3), "x"), "lr": 0.1}
    copy, arena = aligned_copy(sd)
    got = dict(iter_tensors(copy))
    for name, t in iter_tensors(sd):
        c = got[name]
        assert (c.shape, c.dtype) == (t.shape, t.dtype) and not c.any()
        assert c.data_ptr() % PAGE == 0
        assert arena.data_ptr() <= c.data_ptr() < arena.data_ptr() + arena.numel()
    assert copy["lr"] == 0.1 and copy["l"][1] == 4 and copy["t"][1] == "x"


def test_a_small_run_loads_bit_exact_and_writes_every_ratio(direct_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    tmp_path = direct_dir
    monkeypatch.setattr(load_floor, "drop_caches", lambda paths: "none")  # not the machine's
    out = tmp_path / "floor.json"
    load_floor.main(["--size-gib", "0.02", "--rounds", "2", "--settle", "0",
                     "--dir", str(tmp_path), "--json", str(out)])
    rec = json.loads(out.read_text())
    assert set(rec["samples"]) == set(load_floor.CASES)
    assert all(len(x) == 2 and min(x) > 0 for x in rec["samples"].values())
    assert "verified load / + move + hash" in rec["ratios"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("dcpp-floor-")]
