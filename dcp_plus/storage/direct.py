"""Direct I/O building blocks (torch-free: writer workers import this).

- :data:`bounce_pool`: page-aligned memory (:mod:`~dcp_plus.storage.buffers`) for
  ``O_DIRECT`` transfers of data that is not aligned where it lives.
- :func:`use_direct`: whether a directory's file system takes ``O_DIRECT`` (probed once per
  process and file system; a refusal is logged once and never fails a save).
- :class:`DirectFile`: one file written through an ``O_DIRECT`` descriptor where buffer and
  offset allow it and through the page cache otherwise (the < 4 KiB tails, refusing file
  systems), then fsynced and dropped from the page cache.
- :func:`resident_pages`: how much of a file the page cache holds (``mincore``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable
from typing import Literal

from dcp_plus.storage.buffers import ALIGN, BufferPool, transfer_buffer
from dcp_plus.storage.fileio import naming, pwrite_all

log = logging.getLogger(__name__)

DirectIO = bool | Literal["auto"]
"""``True``: O_DIRECT (a refusing file system is warned about and written buffered);
``"auto"``: the same, the fallback logged at INFO; ``False``: buffered."""

DEFAULT_STREAMS = 4
"""O_DIRECT writes a writer keeps in flight per rank by default: on the dev VM as fast as 2
on a slow disk and 12-22 % faster on a fast one (``docs/benchmarks.md``, eighth session)."""

REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})
"""Errnos with which a file system says it does not do O_DIRECT (at open or at write)."""

MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})
"""File systems that keep files in the page cache itself: O_DIRECT bypasses nothing there
(tmpfs takes O_DIRECT opens since Linux 6.6 and copies through its page cache anyway)."""


def direct_io_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a ``direct_io`` setting, or None."""
    if value is True or value is False or value == "auto":
        return None
    return f'must be True, False or "auto", got {value!r}'


def check_direct_io(owner: str, value: object) -> DirectIO:
    """``value`` if it is ``True``, ``False`` or ``"auto"``; ValueError naming ``owner``."""
    problem = direct_io_problem(value)
    if problem is not None:
        raise ValueError(f"{owner} direct_io {problem}")
    return value  # type: ignore[return-value]


BOUNCE_BYTES = 64 << 20
"""Bytes per O_DIRECT write of the bounce path. One 64 MiB ``pwrite`` reaches the device as
16 requests of 4 MiB (its largest) submitted together; 4 MiB ones go one at a time. On the
dev VM (a virtual disk, whose every submission costs the host CPU our copies compete for)
a plain ``dcp.save`` of 8 GiB took 3.00 s instead of 3.26 s, 1.08x the write limit instead
of 1.18x (``benchmarks.bounce_chunks``; ``docs/benchmarks.md``, ninth session)."""
bounce_pool = BufferPool(BOUNCE_BYTES, keep=DEFAULT_STREAMS + 1, idle_s=None,
                         make=functools.partial(transfer_buffer, fault=False))
"""The process's bounce buffers: one per write stream in flight and one being filled, faulted
in as they are filled (a small file maps only what it takes). As many as a rank's default
streams use are kept for the process's life, as the stager keeps its slabs: a process that
saved will save again, and mapping 320 MiB afresh costs each save 0.03 s on the dev VM when
the host still backs the memory and 0.3-0.5 s once the guest has handed it back (free page
reporting)."""


# -- does this file system take O_DIRECT? ---------------------------------------------------


MOUNTINFO = "/proc/self/mountinfo"


def _mount_of(path: str, mountinfo: str = MOUNTINFO) -> tuple[str, list[str]] | None:
    """The type and super options of the file system holding ``path`` (its mount found by
    device number in ``mountinfo``), or None."""
    dev = os.stat(path).st_dev
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open(mountinfo) as f:
            for line in f:
                fields = line.split()
                if len(fields) > 7 and fields[2] == want and "-" in fields:
                    rest = fields[fields.index("-") + 1:]  # type, source, super options
                    return rest[0], rest[2].split(",") if len(rest) > 2 else []
    except OSError:
        pass
    return None


def fs_type(path: str) -> str:
    """The type of the file system holding ``path`` (``/proc/self/mountinfo``), or
    ``"unknown"``."""
    mount = _mount_of(path)
    return "unknown" if mount is None else mount[0]


def huge_pages(path: str, mountinfo: str = MOUNTINFO) -> str | None:
    """The ``huge=`` option of the tmpfs holding ``path`` (``always``, ``within_size``,
    ``advise``): its files get 2 MiB pages (see :mod:`dcp_plus.shm`); None when they get
    4 KiB ones (no option, ``never``, not a tmpfs)."""
    mount = _mount_of(path, mountinfo)
    if mount is None or mount[0] != "tmpfs":
        return None
    huge = [o.split("=", 1)[1] for o in mount[1] if o.startswith("huge=")]
    return huge[0] if huge and huge[0] != "never" else None


_probed: dict[int, str | None] = {}
_logged: set[tuple[int, bool]] = set()
_probe_lock = threading.Lock()


def clear_probe_cache() -> None:
    """Forget what was probed and logged (after a remount; for tests)."""
    with _probe_lock:
        _probed.clear()
        _logged.clear()


def _probe_fd(directory: str) -> int:
    """A writable file in ``directory`` that has no name (nothing is left if we die)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600)
    except OSError:  # no O_TMPFILE here (NFS, FUSE): a name unlinked at once
        path = os.path.join(directory, f".dcpp-direct-probe.{uuid.uuid4().hex[:16]}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        return fd


def _probe(directory: str) -> tuple[str | None, bool]:
    """Why ``directory``'s file system is not written with O_DIRECT (None: it is), and
    whether that answer holds for the file system (False: a passing error, e.g. ENOSPC)."""
    kind = fs_type(directory)
    if kind in MEMORY_FS:
        return (f"O_DIRECT not used on {kind} at {directory}: a memory file system has no "
                "device to bypass the page cache for"), True
    where, fd = "open", _probe_fd(directory)
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT)
        try:
            where = "write"
            with bounce_pool.take() as buf:
                os.pwrite(dfd, buf[:ALIGN], 0)
        finally:
            os.close(dfd)
    except OSError as e:
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        return (f"O_DIRECT refused by {kind} at {directory} ({where}: {name})",
                e.errno in REFUSALS)
    finally:
        os.close(fd)
    return None, True


def direct_refusal(directory: str) -> str | None:
    """Why O_DIRECT is not used for files in ``directory``; None when it is. Probed once per
    process and file system (an aligned 4 KiB write to an unnamed file)."""
    dev = os.stat(directory).st_dev
    with _probe_lock:
        if dev in _probed:
            return _probed[dev]
    try:
        reason, lasting = _probe(directory)
    except OSError as e:  # cannot even make a probe file: the save itself will say why
        reason, lasting = f"O_DIRECT not probed at {directory}: {e}", False
    if lasting:
        with _probe_lock:
            _probed[dev] = reason
    return reason


def use_direct(directory: str, mode: DirectIO) -> bool:
    """Whether files in ``directory`` are written with O_DIRECT under ``mode``. A refusal is
    logged once per process, file system and mode (a WARNING when ``mode`` is True)."""
    if mode is False:
        return False
    reason = direct_refusal(directory)
    if reason is None:
        return True
    key = (os.stat(directory).st_dev, mode is True)
    with _probe_lock:
        first = key not in _logged
        _logged.add(key)
    if first:
        log.log(logging.WARNING if mode is True else logging.INFO, "%s; writing buffered",
                reason)
    return False


# -- writing ---------------------------------------------------------------------------------


class DirectFile:
    """The existing file ``path``, written at offsets from several threads at once.

    ``write(data, offset, aligned=True)`` sends the 4 KiB-aligned head of ``data`` through an
    O_DIRECT descriptor and keeps the tail (< 4 KiB) for :meth:`finish`, which writes it
    buffered (so buffered writes never interleave with direct ones), fsyncs, and with
    ``drop_cache`` evicts the file from the page cache. Without ``direct``, or once the file
    system refuses O_DIRECT (``refused`` says why), everything goes through the page cache.
    ``pace`` (a rate cap's ``Bucket.take``) is called before each write with its length.
    """

    def __init__(self, path: str, *, direct: bool, drop_cache: bool,
                 between_chunks: Callable[[], None] | None = None,
                 pace: Callable[[int], None] | None = None) -> None:
        self.path = path
        self.drop_cache = drop_cache
        self.refused: str | None = None
        self._between = between_chunks
        self._pace = pace
        self._tails: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self.fd = os.open(path, os.O_WRONLY)
        self._dfd: int | None = None
        if direct:
            try:
                self._dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno not in REFUSALS:
                    os.close(self.fd)
                    raise
                self.refused = f"{path}: O_DIRECT open refused ({errno.errorcode[e.errno]})"

    @property
    def direct(self) -> bool:
        return self._dfd is not None and self.refused is None

    def preallocate(self, size: int) -> None:
        """Reserve ``size`` bytes (ext4 then lets aligned O_DIRECT writes of several streams
        run concurrently instead of one at a time on the inode lock). Best effort."""
        if size > 0 and self.direct:
            preallocate(self.fd, size, self.path)

    def write(self, data: memoryview, offset: int, aligned: bool) -> None:
        """Write ``data`` at ``offset``; ``aligned``: its first byte is 4 KiB-aligned in
        memory (slab views, bounce buffers). An error (ENOSPC, EIO) names the file."""
        with naming(self.path):
            self._write(data, offset, aligned)

    def _write(self, data: memoryview, offset: int, aligned: bool) -> None:
        head = 0
        dfd = self._dfd if self.refused is None else None
        if aligned and offset % ALIGN == 0 and dfd is not None:
            head = len(data) - len(data) % ALIGN
            try:
                if head:
                    pwrite_all(dfd, data[:head], offset, self._between, self._pace)
            except OSError as e:
                if e.errno not in REFUSALS:
                    raise
                self.refused = f"{self.path}: O_DIRECT write refused ({errno.errorcode[e.errno]})"
                head = 0
            else:
                if head < len(data):
                    with self._lock:
                        self._tails.append((offset + head, bytes(data[head:])))
                return
        pwrite_all(self.fd, data[head:], offset + head, self._between, self._pace)

    def finish(self, fsync: bool) -> None:
        """Write the kept tails, fsync (``fsync``), drop the cached pages, close. An error
        names the file."""
        try:
            with naming(self.path):
                for offset, tail in self._tails:
                    pwrite_all(self.fd, memoryview(tail), offset, pace=self._pace)
                if fsync:  # O_DIRECT bypasses the page cache, not the device cache or metadata
                    os.fsync(self.fd)
            if self.drop_cache:
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            self.close()

    def close(self) -> None:
        """Close both descriptors once (a second call does nothing, even after a failed
        close: the numbers may belong to another file by then)."""
        fds = [fd for fd in (self.fd, self._dfd) if fd is not None and fd >= 0]
        self.fd, self._dfd = -1, None
        try:
            if fds:
                os.close(fds[0])
        finally:
            if len(fds) > 1:
                os.close(fds[1])


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def preallocate(fd: int, size: int, path: str) -> None:
    """``fallocate(fd, 0, 0, size)``: allocate and set the size. Skipped where the file
    system has no fallocate (never emulated by writing zeros); ENOSPC and others raise."""
    if _libc.fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err not in _NO_FALLOCATE:
            raise OSError(err, f"fallocate of {size} bytes failed: {os.strerror(err)}", path)


# -- page-cache residency --------------------------------------------------------------------

_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int64]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _mincore(path: str) -> tuple[bytes, int]:
    """Per page of ``path``, whether the page cache holds it (bit 0), and the file's size
    (``mincore`` on a mapping, which faults nothing in)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pages = -(-size // mmap.PAGESIZE)
        if pages == 0:
            return b"", 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed", path)
        try:
            return mapped_pages(addr, size, path), size
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


_BIT0 = bytes(i & 1 for i in range(256))


def mapped_pages(address: int, size: int, what: str = "memory") -> bytes:
    """Per page of the mapping ``[address, address + size)`` (page-aligned), 1 where it is in
    memory, else 0 (``mincore``: a file's page cache, an anonymous buffer's faulted-in pages);
    ``what`` names the mapping in the error."""
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    if _libc.mincore(address, size, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed", what)
    return bytes(vec).translate(_BIT0)


def resident_pages(path: str) -> tuple[int, int]:
    """``(resident, total)`` pages of ``path`` in the page cache."""
    vec, _ = _mincore(path)
    return vec.count(1), len(vec)


def resident_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(bytes of the file in the page cache, file size)``: whole pages, a resident last
    page counted up to the file's end."""
    vec, size = _mincore(os.fspath(path))
    if not vec:
        return 0, 0
    slack = len(vec) * mmap.PAGESIZE - size if vec[-1] else 0
    return vec.count(1) * mmap.PAGESIZE - slack, size
