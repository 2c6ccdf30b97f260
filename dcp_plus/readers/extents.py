"""Checked reads of extents: path containment, bounds, coalesced preadv, checksum compare."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

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


def check_extent_bounds(extents: Iterable[tuple[str, Extent]],
                        size_of: Callable[[str], int | None],
                        location: Callable[[str], str]) -> None:
    """Every extent must lie inside its data file or object (``size_of`` is None if missing).

    Raises:
        CheckpointFormatError: naming the field, the file and the tensor.
    """
    sizes: dict[str, int | None] = {}
    for i, (what, e) in enumerate(extents):
        if e.file not in sizes:
            sizes[e.file] = size_of(e.file)
        size = sizes[e.file]
        if size is None:
            raise CheckpointFormatError(
                f"{location(e.file)}: data file of {what} (extents[{i}].file) is missing"
            )
        if e.length and e.offset + e.length > size:
            raise CheckpointFormatError(
                f"{location(e.file)}: extents[{i}] of {what} (offset {e.offset}, "
                f"length {e.length}) runs past the end of the file ({size} bytes): "
                "the file is truncated or the record is corrupt"
            )


def check_bounds(root: str, extents: Iterable[tuple[str, Extent]]) -> None:
    """:func:`check_extent_bounds` for data files under the directory ``root``."""
    def size_of(name: str) -> int | None:
        try:
            return os.stat(resolve_data_path(root, name)).st_size
        except FileNotFoundError:
            return None

    check_extent_bounds(extents, size_of, lambda name: os.path.join(root, name))


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
