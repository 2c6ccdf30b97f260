"""``verify`` of incremental checkpoints: the parts a data file scan cannot check by itself.

A file scan (:mod:`~dcp_plus.readers.file_check`) hashes the uncompressed parts stored in the
checkpoint's own files as it reads them, and covers the encoded ones (their padding and tail
are checked like any extent's). What remains is decoded here and checked against its hash:
encoded own parts, and everything a record references in sibling checkpoints (whole extents
and parts, delta chains included), so that ``verify`` follows every reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.extent import Extent, extent_identity
from dcp_plus.format.parts import Part
from dcp_plus.readers.base import ExtentReader, describe
from dcp_plus.readers.extents import digest_matches
from dcp_plus.readers.file_check import VerifyReport
from dcp_plus.readers.parts_read import Siblings, fill_part

Entry = tuple[MetadataIndex, Extent]


def own_entries(index: MetadataIndex, ext: Extent) -> Iterator[Entry]:
    """What a scan of ``ext``'s own file checks: each part it stores itself (an uncompressed
    one with its hash; an encoded one with none: decoded by :func:`verify_decoded`)."""
    assert ext.parts is not None
    for p in ext.parts:
        if p.where is None:
            checksum = p.hash if p.codec == "identity" else ""
            yield index, Extent(p.file, p.offset, p.length, p.raw, p.codec, checksum)


def verify_decoded(reader: ExtentReader, extents: list[Entry],
                   dtype_of: Callable[[MetadataIndex], str | None], report: VerifyReport,
                   progress: Callable[[int], None] | None = None) -> None:
    """Decode and check what :func:`own_entries` leaves out; one problem line per part or
    extent that fails, naming its checkpoint, file and tensor."""
    siblings = Siblings(reader)
    try:
        for index, ext in extents:
            if ext.parts is None:
                _check_whole(siblings, index, ext, dtype_of(index), report)
                continue
            for p in ext.parts:
                if p.where is None and ext.base is None and p.codec == "identity":
                    continue  # checked by the file scan
                _check_part(reader, siblings, index, ext, p, report)
                if progress is not None:
                    progress(p.length)
    finally:
        siblings.close()


def _check_part(reader: ExtentReader, siblings: Siblings, index: MetadataIndex, ext: Extent,
                p: Part, report: VerifyReport) -> None:
    out = bytearray(p.raw)
    try:
        fill_part(reader, siblings, p, ext.base, memoryview(out), describe(index))
    except (CorruptCheckpointError, CheckpointFormatError, OSError, EOFError) as e:
        report.problems.append(_where(siblings, p.where or ext.base, p.file, e))
    report.extents += 1
    report.bytes += p.length


def _check_whole(siblings: Siblings, index: MetadataIndex, ext: Extent, dtype: str | None,
                 report: VerifyReport) -> None:
    other = siblings.get(ext.base)
    buf = bytearray(ext.length)
    try:
        other._fill(ext.file, [(ext.offset, memoryview(buf))], describe(index))
        if not digest_matches(checksum_bytes(memoryview(buf)), ext, extent_identity(index, dtype, ext)):
            raise CorruptCheckpointError(f"checksum mismatch in {describe(index)} (bytes "
                                         f"{ext.offset}..{ext.offset + ext.length})")
    except (CorruptCheckpointError, CheckpointFormatError, OSError, EOFError) as e:
        report.problems.append(_where(siblings, ext.base, ext.file, e))
    report.extents += 1
    report.bytes += ext.length


def _where(siblings: Siblings, name: str | None, file: str, e: Exception) -> str:
    if name is None:
        return f"{file}: {e}"
    return f"{siblings.get(name)._location(file)} (base checkpoint {name!r}): {e}"
