"""One copy of a byte count, run on a thread of its own beside a block of work.

Timed around an O_DIRECT limit (:mod:`dcp_plus.cli.bench.limits`) it gives the floor for a save
from, or a load into, memory that O_DIRECT cannot address (torch's CPU tensors are 64-byte
aligned; O_DIRECT wants 512 on the dev VM's ext4) and that must therefore pass once through
aligned buffers: the device's transfers and one copy of every byte, perfectly overlapped. One
thread copies, so it is a floor only while a ``memmove`` outruns the device.
"""

from __future__ import annotations

import mmap
import threading
from types import TracebackType

from dcp_plus.storage.buffers import aligned_buffer, fault_in
from dcp_plus.storage.direct_read import address, copy_bytes

BESIDE = 256 << 20
"""Bytes in each of the two buffers copied round and round: past every cache, as a state's
tensors are."""
STEP = 1 << 20
"""Bytes a ``memmove`` (GIL-free)."""

_BUFFERS: list[mmap.mmap] = []


def beside_buffers() -> tuple[mmap.mmap, mmap.mmap]:
    """The process's two :data:`BESIDE`-byte buffers: anonymous memory in 4 KiB pages (like a
    state's tensors, whatever the THP setting), faulted in; made on first use and kept."""
    while len(_BUFFERS) < 2:
        buf = aligned_buffer(BESIDE)
        buf.madvise(mmap.MADV_NOHUGEPAGE)
        fault_in(buf)
        _BUFFERS.append(buf)
    return _BUFFERS[0], _BUFFERS[1]


class CopyBeside:
    """``with CopyBeside(nbytes):`` ``nbytes`` are copied from the first of ``buffers`` (by
    default :func:`beside_buffers`) to the second, round and round, :data:`STEP` bytes a
    ``memmove``, while the block runs; leaving the block waits for the copy (and stops it if
    the block raised). :attr:`copied` counts the bytes copied. Runs once."""

    def __init__(self, nbytes: int,
                 buffers: tuple[mmap.mmap, mmap.mmap] | None = None) -> None:
        self.nbytes = nbytes
        self.copied = 0
        self._buffers = buffers if buffers is not None else beside_buffers()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        src, dst = (address(memoryview(b)) for b in self._buffers)
        size = min(len(b) for b in self._buffers)
        while self.copied < self.nbytes and not self._stop.is_set():
            at = self.copied % size
            n = min(STEP, self.nbytes - self.copied, size - at)
            copy_bytes(dst + at, src + at, n)
            self.copied += n

    def __enter__(self) -> CopyBeside:
        if self._thread is not None:
            raise RuntimeError("a CopyBeside runs once; make another")
        self._thread = threading.Thread(target=self._run, name="dcpp-copy-beside", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self._stop.set()
        assert self._thread is not None
        self._thread.join()
