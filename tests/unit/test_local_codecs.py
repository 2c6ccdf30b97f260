"""LocalWriter with codecs: compressed extents round trip, verify, and name corruption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_plus.readers.inspect import summarize, verify
from tests.conftest import (
    assert_bit_exact,
    build_state_dict,
    clone_state,
    flip_byte,
    load,
    load_fails,
    load_target,
    read_record_json,
    save,
    slab_state_dict,
)


@pytest.mark.parametrize("codec", ["zstd", "zstd+shuffle"])
def test_every_dtype_round_trips_compressed(tmp_path: Path, codec: str) -> None:
    sd = build_state_dict(seed=5)
    save(sd, tmp_path / "c", codec=codec)
    assert_bit_exact(load(load_target(sd), tmp_path / "c"), sd)
    codecs = {e["codec"] for e in read_record_json(tmp_path / "c")["extents"]}
    assert codec in codecs and codecs <= {codec, "identity"}
    assert verify(str(tmp_path / "c")).ok


def test_slab_tensors_are_encoded_per_pattern(tmp_path: Path, slab: Any) -> None:
    sd, _ = slab_state_dict(slab)
    expected = clone_state(sd)
    save(sd, tmp_path / "c", codecs={"w_f32*": "zstd+shuffle", "w_u8": "zstd"})
    rows = {r["name"]: r for r in summarize(str(tmp_path / "c"))["items"]}
    assert rows["w_f32"]["codec"] == "zstd+shuffle" and rows["w_u8"]["codec"] == "zstd"
    assert rows["w_i64"]["codec"] == "identity"  # still written from the slab
    assert_bit_exact(load(load_target(expected), tmp_path / "c"), expected)


def test_flipped_byte_in_compressed_file_names_the_tensor(tmp_path: Path) -> None:
    sd = {"only": torch.randn(100_000)}
    save(sd, tmp_path / "c", codec="zstd")
    (entry,) = read_record_json(tmp_path / "c")["extents"]
    flip_byte(tmp_path / "c" / entry["file"], entry["offset"] + entry["length"] // 2)
    message = load_fails(load_target(sd), tmp_path / "c")
    assert "checksum mismatch in tensor 'only'" in str(message)
    assert not verify(str(tmp_path / "c")).ok
