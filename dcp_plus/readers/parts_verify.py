"""``verify`` of incremental checkpoints: the parts a data file scan cannot check by itself.

A file scan (:mod:`~dcp_plus.readers.file_check`) hashes the uncompressed parts stored in the
checkpoint's own files as it reads them, and covers the encoded ones (their padding and tail
are checked like any extent's). What remains is decoded here and checked against its hash:
encoded own parts, and every part a record references in sibling checkpoints (delta chains
included), so that ``verify`` follows every reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.extent import Extent
from dcp_plus.format.parts import Part
from dcp_plus.readers.base import ExtentReader
from dcp_plus.readers.extents import describe
from dcp_plus.readers.file_check import VerifyReport
from dcp_plus.readers.part_fill import PartBatch
from dcp_plus.readers.parts_read import BATCH_BYTES, Siblings, fill_part

Entry = tuple[MetadataIndex, Extent]


def own_entries(index: MetadataIndex, ext: Extent) -> Iterator[Entry]:
    """What a scan of ``ext``'s own file checks: each part it stores itself (an uncompressed
    one with its hash; an encoded one with none: decoded by :func:`verify_decoded`)."""
    assert ext.parts is not None
    for p in ext.parts:
        if p.where is None:
            checksum = p.hash if p.codec == "identity" else ""
            yield index, Extent(p.file, p.offset, p.length, p.raw, p.codec, checksum)


def verify_decoded(reader: ExtentReader, extents: list[Entry], report: VerifyReport,
                   progress: Callable[[int], None] | None = None) -> None:
    """Decode and check what :func:`own_entries` leaves out, in batches read one request
    list per file; a batch that fails is checked again part by part, so that each problem
    line names its checkpoint, file and tensor."""
    siblings = Siblings(reader)
    todo = [(index, ext, p) for index, ext in extents for p in ext.parts or ()
            if not (p.where is None and ext.base is None and p.codec == "identity")]
    try:
        with ThreadPoolExecutor(reader.threads, thread_name_prefix="dcpp-verify") as pool:
            while todo:
                batch, size = [], 0
                while todo and size < BATCH_BYTES:
                    batch.append(todo.pop())
                    size += batch[-1][2].raw
                _check_batch(reader, siblings, batch, report, pool)
                report.extents += len(batch)
                report.bytes += sum(p.length for _, _, p in batch)
                if progress is not None:
                    progress(sum(p.length for _, _, p in batch))
    finally:
        siblings.close()


def _check_batch(reader: ExtentReader, siblings: Siblings,
                 batch: list[tuple[MetadataIndex, Extent, Part]], report: VerifyReport,
                 pool: ThreadPoolExecutor) -> None:
    filler = PartBatch(verify=True)
    for index, ext, p in batch:
        filler.add(p, ext.base, memoryview(bytearray(p.raw)), describe(index))
    try:
        filler.run(siblings.get, pool)
        return
    except _PROBLEMS:
        pass
    for index, ext, p in batch:  # which part, and where
        try:
            fill_part(reader, siblings, p, ext.base, memoryview(bytearray(p.raw)),
                      describe(index))
        except _PROBLEMS as e:
            name = p.where or ext.base
            report.problems.append(f"{p.file}: {e}" if name is None else
                                   f"{siblings.get(name)._location(p.file)} (base checkpoint "
                                   f"{name!r}): {e}")


_PROBLEMS = (CorruptCheckpointError, CheckpointFormatError, OSError, EOFError)
