"""The hand-made cases of a damaged or edited checkpoint that once loaded wrong data, hung,
blew up memory or printed tracebacks: each is now refused, naming the file, the tensor or
the field, at load and by ``dcp-plus verify`` (exit 1 when a record is there but damaged, 2
when there is no checkpoint at all; never a traceback)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_plus.cli.main import main as cli
from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.record import decode_record, seal
from tests.conftest import (
    extent_checksum,
    load_fails,
    read_record_json,
    record_path,
    save,
    seal_record,
    write_record_json,
)
from tests.unit._untrusted import blank, fresh_copy, load_outcome, no_traceback, save_rich


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("untrusted") / "ckpt"
    return path, save_rich(path)


@pytest.fixture
def ckpt(original, tmp_path) -> tuple[Path, dict[str, Any]]:
    return fresh_copy(original[0], tmp_path / "ckpt"), original[1]


def verify_cli(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli(["verify", str(path)])
    out, err = capsys.readouterr()
    assert no_traceback(out + err), out + err
    return rc, out + err


def refused(ckpt: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str],
            *needles: str, rc: int = 1) -> str:
    """Load and verify both refuse ``ckpt``; the load's message has every needle."""
    path, state = ckpt
    kind, why = load_outcome(path, state)
    assert kind == "refused", why
    for needle in needles:
        assert needle in why, (needle, why)
    code, text = verify_cli(capsys, path)
    assert code == rc, text
    return why


def edit(path: Path, fn: Any) -> None:
    rec = read_record_json(path)
    fn(rec)
    write_record_json(path, rec)


def row(rec: dict[str, Any], fqn: str) -> dict[str, Any]:
    return next(e for e in rec["extents"] if e["fqn"] == fqn)


# -- silently wrong data ------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[], [{"offsets": [0, 0], "sizes": [0, 32]}]],
                         ids=["no_chunks", "empty_chunk"])
def test_a_tensor_whose_chunks_do_not_cover_it_is_refused(ckpt, capsys, chunks):
    edit(ckpt[0], lambda r: r["items"]["w"].update(chunks=chunks))
    refused(ckpt, capsys, "items['w'].chunks")


def test_overlapping_chunks_are_refused(ckpt, capsys):
    edit(ckpt[0], lambda r: r["items"]["w"].update(chunks=[
        {"offsets": [0, 0], "sizes": [40, 32]}, {"offsets": [24, 0], "sizes": [40, 32]}]))
    refused(ckpt, capsys, "items['w'].chunks")


def test_an_edited_dtype_is_detected_by_the_bound_checksum(ckpt, capsys):
    # float32 -> int32: same size, so only the checksum's binding to the dtype notices
    edit(ckpt[0], lambda r: r["items"]["w"].update(dtype="int32"))
    path, state = ckpt
    target = blank(state)
    target["w"] = torch.zeros(64, 32, dtype=torch.int32)
    msg = load_fails(target, path)
    assert "checksum mismatch in tensor 'w'" in msg and ".dcpp" in msg, msg
    assert verify_cli(capsys, path)[0] == 1


def test_a_duplicate_key_is_refused(ckpt, capsys):
    body = record_path(ckpt[0]).read_bytes()
    body = body[: body.rindex(b',"record_checksum"')] + b"}"
    dup = body.replace(b'"items":{', b'"items":{"w":{"kind":"bytes"},', 1)
    record_path(ckpt[0]).write_bytes(seal(dup))
    refused(ckpt, capsys, "duplicate key 'w'")


def test_an_extent_given_another_extents_location_and_checksum_is_refused(ckpt, capsys):
    def move(r: dict[str, Any]) -> None:
        row(r, "ids").update({k: row(r, "w")[k] for k in ("file", "offset", "checksum")})
    edit(ckpt[0], move)
    refused(ckpt, capsys, "'ids'", "'w'")  # both claim the same bytes


def test_two_extents_swapping_locations_and_checksums_are_refused(ckpt, capsys):
    def swap(r: dict[str, Any]) -> None:
        a, b = row(r, "w"), row(r, "ids")
        for k in ("file", "offset", "checksum", "length", "raw_length"):
            a[k], b[k] = b[k], a[k]
    edit(ckpt[0], swap)
    refused(ckpt, capsys, "'w'")


# -- hangs ----------------------------------------------------------------------------------


def _fifo_refused(path: Path, make: Path, capsys: pytest.CaptureFixture[str],
                  state: dict[str, Any]) -> str:
    make.unlink()
    os.mkfifo(make)
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(out=load_outcome(path, state)),
                         daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), f"load of {path} hangs on the FIFO {make}"
    kind, why = result["out"]
    assert kind == "refused" and "FIFO" in why and make.name in why, why
    return why


def test_a_data_file_replaced_by_a_fifo_is_refused_without_blocking(ckpt, capsys):
    path, state = ckpt
    name = row(read_record_json(path), "w")["file"]
    _fifo_refused(path, path / name, capsys, state)
    rc, text = verify_cli(capsys, path)
    assert rc == 1 and "FIFO" in text


def test_a_record_replaced_by_a_fifo_is_refused_without_blocking(ckpt, capsys):
    path, state = ckpt
    _fifo_refused(path, record_path(path), capsys, state)
    rc, text = verify_cli(capsys, path)
    assert rc == 1 and "FIFO" in text  # a record is there, and damaged


# -- memory ----------------------------------------------------------------------------------


def test_a_record_linked_to_dev_zero_is_refused(ckpt, capsys):
    record_path(ckpt[0]).unlink()
    os.symlink("/dev/zero", record_path(ckpt[0]))
    why = refused(ckpt, capsys, "symbolic link")
    assert ".metadata" in why


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_record_that_is_a_device_is_refused(ckpt, capsys):
    record_path(ckpt[0]).unlink()
    os.mknod(record_path(ckpt[0]), stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
    refused(ckpt, capsys, "character device")


def test_an_oversized_record_is_refused_before_it_is_read(ckpt, capsys):
    with open(record_path(ckpt[0]), "r+b") as f:
        f.truncate(3 << 30)  # sparse: nothing is allocated, nothing may be read
    refused(ckpt, capsys, "more than")


@pytest.mark.parametrize("raw_length", [2**31, 2**40])
def test_a_compressed_extent_claiming_a_huge_raw_length_is_refused(ckpt, capsys, raw_length):
    edit(ckpt[0], lambda r: row(r, "z").update(raw_length=raw_length))
    refused(ckpt, capsys, "'z'", "raw_length")


def test_a_record_nested_too_deeply_is_refused(ckpt, capsys):
    record_path(ckpt[0]).write_bytes(seal(b'{"format":"dcp_plus","x":' + b"[" * 200_000
                                          + b"]" * 200_000 + b"}"))
    refused(ckpt, capsys, "nested too deeply")


def test_a_number_with_too_many_digits_is_refused(ckpt, capsys):
    body = record_path(ckpt[0]).read_bytes()
    body = body[: body.rindex(b',"record_checksum"')] + b"}"
    record_path(ckpt[0]).write_bytes(seal(body.replace(b'"version":2', b'"version":'
                                                       + b"9" * 5000, 1)))
    refused(ckpt, capsys, "invalid JSON")


# -- unclear errors ---------------------------------------------------------------------------


def test_a_record_that_is_a_directory_is_refused(ckpt, capsys):
    record_path(ckpt[0]).unlink()
    record_path(ckpt[0]).mkdir()
    refused(ckpt, capsys, ".metadata: is a directory")


def test_a_file_given_as_the_checkpoint_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes").write_text("hello")
    rc, text = verify_cli(capsys, tmp_path / "notes")
    assert rc == 2 and "not a directory" in text
    rc, text = verify_cli(capsys, tmp_path / "missing")
    assert rc == 2 and "no commit record" in text


def test_a_lone_surrogate_in_a_name_is_refused_and_printable(ckpt, capsys):
    body = record_path(ckpt[0]).read_bytes()
    body = body[: body.rindex(b',"record_checksum"')] + b"}"
    record_path(ckpt[0]).write_bytes(seal(body.replace(b'"fqn":"w"', b'"fqn":"w\\ud800"')))
    why = refused(ckpt, capsys, "lone surrogate")
    assert "extents[" in why


@pytest.mark.parametrize("offsets", [[2**64, 0], [2**63, 0]])
def test_chunk_offsets_beyond_int64_are_refused(ckpt, capsys, offsets):
    edit(ckpt[0], lambda r: r["items"]["w"]["chunks"][0].update(offsets=offsets))
    refused(ckpt, capsys, "items['w'].chunks[0]")


@pytest.mark.parametrize("dtype", ["qint32", "quint8", "float128"])
def test_dtypes_the_writer_never_writes_are_refused(ckpt, capsys, dtype):
    edit(ckpt[0], lambda r: r["items"]["w"].update(dtype=dtype))
    refused(ckpt, capsys, "items['w'].dtype", f"'{dtype}'")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_a_quantized_tensor_is_refused_at_save_naming_it(tmp_path):
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint32)
    with pytest.raises(BaseException, match="'q'.*qint32"):
        save({"q": q}, tmp_path / "ckpt")


def test_an_edited_record_is_refused_by_its_checksum(ckpt, capsys):
    data = record_path(ckpt[0]).read_bytes()  # edited, still valid JSON, not resealed
    record_path(ckpt[0]).write_bytes(data.replace(b'"requires_grad":false',
                                                  b'"requires_grad":true', 1))
    why = refused(ckpt, capsys, "record_checksum")
    assert "damaged or edited" in why


def test_version_1_records_still_load(ckpt, capsys):
    # what dcp_plus 0.1 wrote: no record checksum, extent checksums of the bytes alone
    path, state = ckpt
    rec = read_record_json(path)
    rec["version"] = 1
    for e in rec["extents"]:
        with open(path / e["file"], "rb") as f:
            f.seek(e["offset"])
            e["checksum"] = checksum_bytes(f.read(e["length"]))
    record_path(path).write_bytes(seal_record(rec))
    assert b"record_checksum" not in record_path(path).read_bytes()

    assert load_outcome(path, state) == ("exact", "")
    assert verify_cli(capsys, path)[0] == 0
    rec["extents"][0]["checksum"] = extent_checksum(rec, rec["extents"][0], b"")
    with pytest.raises(CheckpointFormatError, match="version-1 extent checksum"):
        decode_record(seal_record(rec), "x")


def test_chunk_grids_are_checked_in_near_linear_time_and_irregular_floods_refused():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as C

    from dcp_plus.format.record_checks import check_tiling

    def fail(field: str, problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{field}: {problem}")

    grid = [C(torch.Size([i, j]), torch.Size([1, 1])) for i in range(300) for j in range(300)]
    check_tiling(torch.Size([300, 300]), grid, "g", fail)  # 90,000 chunks: a grid, accepted
    small = [C(torch.Size([0, 0]), torch.Size([1, 2])), C(torch.Size([1, 0]), torch.Size([1, 1])),
             C(torch.Size([1, 1]), torch.Size([1, 1]))]
    check_tiling(torch.Size([2, 2]), small, "s", fail)  # irregular but small: swept, accepted
    k = 300  # bricks: every other row shifted by one column, so no grid
    bricks = []
    for i in range(k):
        if i % 2 == 0:
            bricks += [C(torch.Size([i, 2 * j]), torch.Size([1, 2])) for j in range(k)]
        else:
            bricks += [C(torch.Size([i, 0]), torch.Size([1, 1])),
                       C(torch.Size([i, 2 * k - 1]), torch.Size([1, 1]))]
            bricks += [C(torch.Size([i, 2 * j + 1]), torch.Size([1, 2])) for j in range(k - 1)]
    with pytest.raises(CheckpointFormatError, match="irregular layout"):
        check_tiling(torch.Size([k, 2 * k]), bricks, "b", fail)
