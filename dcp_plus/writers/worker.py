"""Writer worker process: maps stager slabs, checksums extents (beside the write of the same
bytes), writes (O_DIRECT where it can) and fsyncs files, or uploads them as one object (S3
multipart).

Started as ``python -m dcp_plus.writers.worker FD``. It imports neither torch nor the user's
``__main__`` (unlike multiprocessing's spawn), so it starts in tens of milliseconds and needs
no ``if __name__ == "__main__"`` guard in training scripts. It exits when its parent dies:
the socket reads EOF while idle, ``getppid()`` is checked between write chunks, and a
watchdog thread ends it mid-job (an upload) when the parent is gone.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.shm import SHM_DIR
from dcp_plus.storage.direct import ALIGN, DirectFile
from dcp_plus.storage.fanout import in_streams
from dcp_plus.storage.rate import Bucket, RateLimit

# Only alignment padding (< 4 KiB, zeros in a stager slab) is written between extents: a
# larger gap may hold a tensor this rank does not write, which `verify` would flag as damage.
COALESCE_GAP = 4095
DIRECT_ALIGN = ALIGN
"""O_DIRECT needs buffer address, file offset and length aligned; extents start 4 KiB-aligned
in both the slab and the file, so only each run's tail (< 4 KiB) goes through the page cache."""
PIECE = 8 << 20
"""What one write stream takes at a time (a multiple of :data:`DIRECT_ALIGN`)."""


@dataclass(frozen=True)
class WriteJob:
    """Write ``ranges`` of shared-memory slabs into ``path`` (which exists already).

    Each range is ``(slab name, slab offset, file offset, length)`` and is one extent: its
    checksum is returned in order.
    """

    path: str
    ranges: list[tuple[str, int, int, int]]
    fsync: bool = True
    direct: bool = False
    streams: int = 1
    """Threads writing this file's pieces concurrently (O_DIRECT streams)."""
    drop_cache: bool = False
    """Evict the file from the page cache after the fsync (the buffered tails, fallbacks)."""
    rate: RateLimit | None = None
    """The rank's shared write budget (``max_bytes_per_s``); None: uncapped."""


@dataclass(frozen=True)
class UploadJob:
    """Upload ``ranges`` of shared-memory slabs as the object ``name`` under ``url``.

    Each range is ``(slab name, slab offset, object offset, length)`` and is one extent: its
    checksum is returned in order. The object is ``total`` bytes, zeros between ranges.
    ``storage_options`` and ``config`` (a :class:`~dcp_plus.storage.objectio.StoreConfig`)
    are the writer's; fsspec's instance cache keeps one client per options in this worker.
    """

    url: str
    storage_options: dict[str, Any]
    config: Any
    name: str
    total: int
    ranges: list[tuple[str, int, int, int]]
    rate: RateLimit | None = None
    """As for :class:`WriteJob`."""

    @property
    def path(self) -> str:
        """Where the object goes (for messages)."""
        return f"{self.url.rstrip('/')}/{self.name}"


@dataclass(frozen=True)
class ChunkedJob:
    """``sink`` (a :class:`WriteJob` or :class:`UploadJob`) with its ranges stored as parts
    (an incremental checkpoint): each range is cut, compared with its base and encoded under
    its ``specs`` entry (a :class:`~dcp_plus.writers.chunk_encode.ChunkSpec`), and the
    stored pieces are packed from offset 0 (the ranges' file offsets are not used). Returns
    each range's list of :data:`~dcp_plus.writers.chunk_encode.Outcome`."""

    sink: WriteJob | UploadJob
    specs: list[Any]

    @property
    def path(self) -> str:
        return self.sink.path

    @property
    def rate(self) -> RateLimit | None:
        return self.sink.rate


Job = WriteJob | UploadJob | ChunkedJob


class ParentGone(Exception):
    pass


class _Mappings:
    """Slab mappings kept across jobs; dropped once the creator unlinks the slab."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}

    def get(self, name: str) -> mmap.mmap:
        if "/" in name:
            raise ValueError(f"bad slab name {name!r}")
        hit = self._maps.get(name)
        path = os.path.join(SHM_DIR, name)
        if hit is not None:
            try:
                if os.stat(path).st_ino == hit[1]:
                    return hit[0]
            except FileNotFoundError:
                pass
            self._drop(name)
        fd = os.open(path, os.O_RDONLY)
        try:
            m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        self._maps[name] = (m, ino)
        return m

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` of slab ``name``."""
        return memoryview(self.get(name))[offset : offset + length]

    def old(self, where: tuple[str, int] | None, length: int) -> memoryview | None:
        """Slab bytes of a previous snapshot, or None when that slab is gone or shorter."""
        if where is None:
            return None
        try:
            view = self.view(where[0], where[1], length)
        except (OSError, ValueError):
            return None
        return view if len(view) == length else None

    def checksums(self, ranges: list[tuple[str, int, int, int]]) -> list[str]:
        """The checksum of each job range ``(slab, slab offset, file offset, length)``."""
        return [checksum_bytes(self.view(slab, soff, n)) for slab, soff, _, n in ranges]

    def _drop(self, name: str) -> None:
        m, _ = self._maps.pop(name)
        m.close()

    def prune(self) -> None:
        for name in list(self._maps):
            if not os.path.exists(os.path.join(SHM_DIR, name)):
                self._drop(name)


def coalesce(ranges: list[tuple[str, int, int, int]]) -> list[tuple[str, int, int, int]]:
    """Merge ranges adjacent in both slab and file (equal small gaps included)."""
    out: list[tuple[str, int, int, int]] = []
    for slab, soff, foff, n in sorted(ranges, key=lambda r: r[2]):
        if out:
            pslab, psoff, pfoff, pn = out[-1]
            gap = foff - (pfoff + pn)
            if pslab == slab and 0 <= gap <= COALESCE_GAP and soff - (psoff + pn) == gap:
                out[-1] = (pslab, psoff, pfoff, pn + gap + n)
                continue
        out.append((slab, soff, foff, n))
    return out


def upload(job: UploadJob, segments: list[tuple[int, Any]], total: int,
           pace: Bucket | None) -> None:
    from dcp_plus.storage.objectio import open_store  # fsspec/s3fs: only in uploading workers

    store = open_store(job.url, job.storage_options, job.config)
    try:
        store.upload([(job.name, segments, total)], pace)
    finally:
        store.close()


_side: ThreadPoolExecutor | None = None


def _side_thread() -> ThreadPoolExecutor:
    """This process's one thread for checksums taken beside a write (started on first use)."""
    global _side
    if _side is None:
        _side = ThreadPoolExecutor(1, thread_name_prefix="dcpp-hash")
    return _side


def run_job(job: Job, maps: _Mappings, parent: int) -> list[Any]:
    pace = None if job.rate is None else job.rate.open()
    try:
        if isinstance(job, ChunkedJob):
            return run_chunked(job, maps, parent, pace)
        runs = coalesce(job.ranges)
        if isinstance(job, UploadJob):
            sums = maps.checksums(job.ranges)
            upload(job, [(ooff, maps.view(slab, soff, n)) for slab, soff, ooff, n in runs],
                   job.total, pace)
            return sums
        # hashed on a side thread while the same slab bytes are written (xxh3 and pwrite
        # release the GIL; an O_DIRECT write leaves the CPU idle): the extents' checksums
        # cost no time of their own (measured: benchmarks/slab_write_profile.py)
        hashed = _side_thread().submit(maps.checksums, job.ranges)
        try:
            write(job, [(foff, maps.view(slab, soff, n), soff % DIRECT_ALIGN == 0)
                        for slab, soff, foff, n in runs], parent, pace)
        finally:
            wait([hashed])  # the views stay mapped until the hash is done
        return hashed.result()
    finally:
        if pace is not None:
            pace.close()


def run_chunked(job: ChunkedJob, maps: _Mappings, parent: int, pace: Bucket | None
                ) -> list[Any]:
    from dcp_plus.writers.chunk_encode import encode_pieces, pack, segments

    raws = [maps.view(slab, soff, n) for slab, soff, _, n in job.sink.ranges]
    pieces = [encode_pieces(raw, spec, maps.old(spec.old, len(raw)))
              for raw, spec in zip(raws, job.specs, strict=True)]
    outcomes, size = pack(pieces)
    segs = segments(pieces, outcomes, raws)
    if isinstance(job.sink, UploadJob):
        upload(job.sink, segs, size, pace)
    else:
        # slab views start 4 KiB-aligned (as every part of them does); encoded pieces do not
        write(job.sink, [(off, data, isinstance(data, memoryview)) for off, data in segs],
              parent, pace)
    return outcomes


def write(job: WriteJob, segments: list[tuple[int, Any, bool]], parent: int,
          pace: Bucket | None) -> None:
    """Write ``(file offset, bytes, aligned in memory)`` segments into ``job.path`` with
    ``job.streams`` streams, then fsync (``job.fsync``)."""
    def check_parent() -> None:
        if os.getppid() != parent:
            raise ParentGone

    segments = [s for s in segments if len(s[1])]
    f = DirectFile(job.path, direct=job.direct, drop_cache=job.drop_cache,
                   between_chunks=check_parent, pace=None if pace is None else pace.take)
    try:
        if job.streams > 1 and segments:
            f.preallocate(max(off + len(data) for off, data, _ in segments))
        in_streams(job.streams, [partial(f.write, memoryview(data)[i : i + PIECE], off + i,
                                         aligned)
                                 for off, data, aligned in segments
                                 for i in range(0, len(data), PIECE)])
    except BaseException:
        f.close()
        raise
    f.finish(job.fsync)


def _exit_with(parent: int) -> None:
    """Exit as soon as ``parent`` is gone, even in the middle of a job: an upload on s3fs's
    event loop has no place to check between chunks as the file writes do."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def main(fd: int) -> None:
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    conn = Connection(fd)
    maps = _Mappings()
    while True:
        while not conn.poll(0.5):
            if os.getppid() != parent:
                return
        try:
            job = conn.recv()
        except (EOFError, ConnectionResetError):  # the trainer died (e.g. SIGKILL)
            return
        if job is None:
            return
        try:
            conn.send(("ok", run_job(job, maps, parent)))
        except (ParentGone, BrokenPipeError, ConnectionResetError):
            return
        except BaseException as e:  # reported to the parent, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        maps.prune()


if __name__ == "__main__":
    # Run from the imported module, not ``__main__``: unpickled jobs are instances of
    # ``dcp_plus.writers.worker``'s classes, which ``isinstance`` must see.
    from dcp_plus.writers import worker as _worker

    _worker.main(int(sys.argv[1]))
