"""Checked reads of extents: path containment, bounds, coalesced preadv, checksum compare."""

from __future__ import annotations

import os
from collections.abc import Iterable

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.checksum import checksum_bytes, is_supported
from dcp_plus.format.fileio import preadinto_all
from dcp_plus.format.record import Extent

COALESCE_GAP = 64 << 10
MAX_IOV = 512


def resolve_data_path(root: str, name: str) -> str:
    """Absolute path of data file ``name``; refuses anything (e.g. a symlink) leading out."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, name))
    if os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointFormatError(
            f"{os.path.join(root, name)}: data file resolves to {real}, outside the checkpoint "
            f"directory {real_root}; refusing to read it"
        )
    return real


def check_bounds(root: str, extents: Iterable[tuple[str, Extent]]) -> None:
    """Every extent must lie inside its file: names the field, file and tensor otherwise."""
    sizes: dict[str, int] = {}
    for i, (what, e) in enumerate(extents):
        if e.file not in sizes:
            path = resolve_data_path(root, e.file)
            try:
                sizes[e.file] = os.stat(path).st_size
            except FileNotFoundError:
                raise CheckpointFormatError(
                    f"{path}: data file of {what} (extents[{i}].file) is missing"
                ) from None
        if e.length and e.offset + e.length > sizes[e.file]:
            raise CheckpointFormatError(
                f"{os.path.join(root, e.file)}: extents[{i}] of {what} (offset {e.offset}, "
                f"length {e.length}) runs past the end of the file ({sizes[e.file]} bytes): "
                "the file is truncated or the record is corrupt"
            )


def verify_checksum(data: memoryview, ext: Extent, what: str, root: str) -> None:
    """Raise CorruptCheckpointError naming the file and item when ``data`` does not match."""
    if not is_supported(ext.checksum):
        raise CheckpointFormatError(
            f"{os.path.join(root, ext.file)}: {what}: unsupported checksum {ext.checksum!r}"
        )
    actual = checksum_bytes(data)
    if actual != ext.checksum:
        raise CorruptCheckpointError(
            f"{os.path.join(root, ext.file)}: checksum mismatch in {what} (bytes "
            f"{ext.offset}..{ext.offset + ext.length}): recorded {ext.checksum}, read {actual}; "
            "the data file is corrupt"
        )


def read_coalesced(fd: int, path: str, reads: list[tuple[int, memoryview]]) -> None:
    """Fill each ``(offset, buffer)``; neighbours within 64 KiB share one preadv call."""
    reads = sorted(reads, key=lambda r: r[0])
    i = 0
    while i < len(reads):
        start = reads[i][0]
        iov: list[memoryview] = [reads[i][1]]
        end = start + len(reads[i][1])
        j = i + 1
        while j < len(reads) and len(iov) < MAX_IOV - 1:
            off, buf = reads[j]
            gap = off - end
            if gap < 0 or gap > COALESCE_GAP:
                break
            if gap:
                iov.append(memoryview(bytearray(gap)))
            iov.append(buf)
            end = off + len(buf)
            j += 1
        total = end - start
        n = os.preadv(fd, iov, start) if total else 0
        if n < total:  # short read: finish buffer by buffer (raises EOFError at a real end)
            pos = start
            for buf in iov:
                if pos + len(buf) > start + n:
                    skip = max(0, start + n - pos)
                    preadinto_all(fd, buf[skip:], pos + skip, path)
                pos += len(buf)
        i = j
