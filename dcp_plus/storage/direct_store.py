"""DirectFileStore: a :class:`~dcp_plus.storage.localfs.LocalFileStore` whose data reads
bypass the page cache with ``O_DIRECT`` where the file system allows it.

Whether it can is decided once per store, on the first data file read: ``direct_io=False``
never tries; ``"auto"`` does not on file systems whose files live in memory anyway (tmpfs,
ramfs); where the file system refuses O_DIRECT (EINVAL on the ``fcntl`` or on a read) reads
go through the page cache from then on. Either way one log line says why, and no read fails
for it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from dcp_plus.storage.direct import DirectIO
from dcp_plus.storage.direct_extents import DirectRead, Done, read_bounce_pool
from dcp_plus.storage.direct_landing import MayShift
from dcp_plus.storage.direct_read import memory_fs, set_direct
from dcp_plus.storage.fileio import open_regular
from dcp_plus.storage.localfs import LocalFileStore

log = logging.getLogger(__name__)


class DirectFileStore(LocalFileStore):
    """Files directly under ``root``, read with O_DIRECT when ``direct_io`` allows it (see
    the module docstring); everything but reading is :class:`LocalFileStore`'s."""

    def __init__(self, root: str, *, direct_io: DirectIO = "auto") -> None:
        super().__init__(root)
        self.direct_io = direct_io
        self._direct: bool | None = None if direct_io is not False else False
        self._lock = threading.Lock()

    def uses_direct(self, name: str) -> bool:
        """Whether reads bypass the page cache; decided (and a fallback logged) on the first
        call, by data file ``name``."""
        if self._direct is None:
            fd = open_regular(self.root, name)
            try:
                fs = memory_fs(fd) if self.direct_io == "auto" else None
                refusal = None if fs else set_direct(fd)
            finally:
                os.close(fd)
            if fs:
                self._fall_back(name, f"its files live in memory ({fs}), so O_DIRECT would "
                                      "bypass no cache")
            elif refusal is not None:
                self._refused(name, refusal)
            else:
                self._direct = True
        return bool(self._direct)

    def _refused(self, name: str, error: OSError) -> None:
        self._fall_back(name, f"the file system refuses O_DIRECT "
                              f"({os.strerror(error.errno or 0)})")

    def _fall_back(self, name: str, why: str) -> None:
        with self._lock:
            if self._direct is False:
                return
            self._direct = False
        level = logging.WARNING if self.direct_io is True else logging.INFO
        log.log(level, "%s: reading through the page cache: %s", self.location(name), why)

    def _open_direct(self, name: str) -> int:
        fd = open_regular(self.root, name)
        refusal = set_direct(fd)
        if refusal is not None:  # another file system below root: buffered reads of it
            self._refused(name, refusal)
        return fd

    def read(self, name: str, reads: Sequence[tuple[int, memoryview]],
             may_shift: MayShift | None = None) -> None:
        """Fill each ``(offset, buffer)``; EOFError when the file ends first. ``may_shift``:
        as for :meth:`read_direct`."""
        if not self.uses_direct(name):
            super().read(name, reads)
            return
        self.read_direct([(name, off, len(buf)) for off, buf in reads],
                         lambda k: reads[k][1], lambda k, checksum: None, may_shift=may_shift)

    def read_direct(self, extents: Sequence[tuple[str, int, int]],
                    open_extent: Callable[[int], memoryview], done: Done,
                    executor: Executor | None = None, *, streams: int = 1,
                    hashed: bool = False, may_shift: MayShift | None = None) -> None:
        """:meth:`DirectRead.run <dcp_plus.storage.direct_extents.DirectRead.run>` on this
        store's files (call it after :meth:`uses_direct` said True); ``may_shift``: which
        unaligned destinations may be read in place (none without it)."""
        reader = DirectRead(self._open_direct, self.location, read_bounce_pool,
                            self._refused, streams, may_shift=may_shift)
        reader.run(extents, open_extent, done, executor, hashed=hashed)
