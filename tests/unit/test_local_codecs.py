"""LocalWriter with codecs: compressed extents round trip, verify, and name corruption; every
writer stores tensors as they are unless a codec is asked for."""

from __future__ import annotations

import inspect
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import LocalWriter, NFSWriter, ObjectStoreReader, ObjectStoreWriter
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


@pytest.mark.parametrize("writer", [LocalWriter, ObjectStoreWriter, NFSWriter])
def test_default_codec_is_identity(writer: Any) -> None:
    # compression is opt-in: on local disk zstd encodes slower than the disk writes
    # (docs/benchmarks.md, "Compression on real weights")
    params = inspect.signature(writer).parameters
    assert params["codec"].default == "identity" and params["codecs"].default is None
    w = writer("memory://dcpp-tests/x" if writer is ObjectStoreWriter else "/nonexistent")
    assert w.codecs.default.name == "identity" and w.codecs.patterns == {}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_default_saves_store_every_extent_as_identity(tmp_path: Path) -> None:
    sd = build_state_dict(seed=7)
    save(sd, tmp_path / "local")
    assert {e["codec"] for e in read_record_json(tmp_path / "local")["extents"]} == {"identity"}
    dcp.save(sd, storage_writer=NFSWriter(tmp_path / "nfs"), no_dist=True)
    assert {r["codec"] for r in summarize(str(tmp_path / "nfs"))["items"]} == {"identity"}
    url = f"memory://dcpp-tests/{uuid.uuid4().hex[:12]}"
    dcp.save(sd, storage_writer=ObjectStoreWriter(url), no_dist=True)
    md = ObjectStoreReader(url).read_metadata()
    assert {e.codec for e in md.storage_data.values()} == {"identity"}
