"""LocalFileStore: a checkpoint directory on a local (or mounted) file system, seen through
the same store operations as an object-store prefix."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence

from dcp_plus.format.layout import MAX_RECORD_BYTES
from dcp_plus.storage.fileio import (
    atomic_create,
    atomic_write,
    fsync_dir,
    naming,
    open_regular,
    pwrite_all,
    read_coalesced,
    read_regular,
)
from dcp_plus.storage.ranged import Segments
from dcp_plus.storage.rate import Bucket


class LocalFileStore:
    """Files directly under ``root``; every read goes through :func:`open_regular` (no
    symbolic link, FIFO or device is followed or read).

    ``fsync``: data files, records and the directory are made durable before the operation
    that wrote them returns (:meth:`put` always: a record is never left undurable).
    ``max_get``: the largest file :meth:`get` reads whole (larger ones are refused unread).
    """

    uploads_from_any_process = True  # a writer worker opens the same path

    def __init__(self, root: str, *, fsync: bool = True, max_get: int = MAX_RECORD_BYTES) -> None:
        self.url = root
        self.root = root
        self.fsync = fsync
        self.max_get = max_get

    def location(self, name: str) -> str:
        return os.path.join(self.root, name)

    def sizes(self, names: Sequence[str]) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for name in names:
            try:
                fd = open_regular(self.root, name)
            except FileNotFoundError:
                out[name] = None
                continue
            try:
                out[name] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        return out

    def get(self, name: str) -> bytes | None:
        try:
            return read_regular(self.root, name, self.max_get)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def put(self, name: str, data: bytes, *, if_absent: bool) -> bool:
        """Atomically in place (tmp + fsync + rename, or a hard link when ``if_absent``)."""
        path, tag = self.location(name), uuid.uuid4().hex[:16]
        if if_absent:
            return atomic_create(path, data, tag)
        atomic_write(path, data, tag)
        return True

    def put_new(self, name: str, data: bytes) -> None:
        """Create ``name`` holding ``data``; an existing ``name`` is an error (never replaced).
        Cheaper than :meth:`put` (no rename): for files no reader trusts before a record
        names them, made durable by ``fsync`` and the directory's fsync in :meth:`create`."""
        fd = os.open(self.location(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pwrite_all(fd, memoryview(data), 0)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def create(self, names: Sequence[str]) -> list[str]:
        """Create empty files ``names`` exclusively (a name already there is an error, so no
        file of another save is ever overwritten); the names it created, in order."""
        os.makedirs(self.root, exist_ok=True)
        created: list[str] = []
        try:
            for name in names:
                os.close(os.open(self.location(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 0o644))
                created.append(name)
        except BaseException:
            self.delete(created)
            raise
        if self.fsync and created:
            fsync_dir(self.root)
        return created

    def upload(self, objects: Sequence[tuple[str, Segments, int]],
               pace: Bucket | None = None) -> None:
        """Write each file's segments at their offsets (files made by :meth:`create` are
        written in place, others created), then fsync it; ``pace``: a rate cap."""
        for name, segments, size in objects:
            self.write_file(name, segments, size, pace)

    def write_file(self, name: str, segments: Segments, size: int,
                   pace: Bucket | None = None) -> None:
        """:meth:`upload` of one file (callable from several threads at once)."""
        fd = os.open(self.location(name), os.O_WRONLY | os.O_CREAT, 0o644)
        take = None if pace is None else pace.take
        try:
            with naming(self.location(name)):
                for offset, data in segments:
                    pwrite_all(fd, data, offset, pace=take)
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                if self.fsync:
                    os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, name: str, reads: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, buffer)``; EOFError when the file ends first."""
        fd = open_regular(self.root, name)
        try:
            read_coalesced(fd, self.location(name), list(reads))
        finally:
            os.close(fd)

    def list(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def delete(self, names: Sequence[str]) -> None:
        """Remove ``names``; already gone ones are no error."""
        for name in names:
            try:
                os.unlink(self.location(name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Nothing is held open between operations."""
