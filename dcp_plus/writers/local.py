"""LocalWriter: a DCP ``StorageWriter`` for a local (or mounted) directory."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import wait
from typing import Any, cast

from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.codecs import Codec
from dcp_plus.storage.direct import DEFAULT_STREAMS, DirectIO, check_direct_io, use_direct
from dcp_plus.storage.fanout import Threads
from dcp_plus.storage.localfs import LocalFileStore
from dcp_plus.storage.rate import Bucket
from dcp_plus.storage.urls import is_url
from dcp_plus.writers.base import CommittingWriter, Fence, segments_of
from dcp_plus.writers.bounce import write_files
from dcp_plus.writers.chunk_encode import DEFAULT_PART_BYTES
from dcp_plus.writers.layout import FilePlan
from dcp_plus.writers.pool import DEFAULT_NICE
from dcp_plus.writers.worker import Job, WriteJob


class LocalWriter(CommittingWriter):
    """Checksummed, durable, atomically committed checkpoints in a local directory.

    Tensors that live in an :class:`~dcp_plus.stagers.ArenaStager` slab are written by the
    shared worker-process pool from ``(slab, offset, length)`` descriptors, without copying;
    other data goes into ``threads`` files, written by this process: with direct I/O by
    ``streams`` threads (and one filling the next bounce buffer) taking chunks of all files
    from one queue, without it one thread per file straight from tensor memory.

    Args:
        path: checkpoint directory (created if missing).
        overwrite: allow replacing a committed checkpoint; the old one stays loadable until
            the new commit record is in place, then the data files it referenced are removed
            (no other file: files of another save, running or crashed, are left in place).
        workers: size of the shared writer-process pool.
        threads: files for data outside slabs (written in parallel).
        fsync: fsync data files, the commit record and directories (turn off only for
            throwaway checkpoints).
        direct_io: ``"auto"`` (default) or ``True``: write data files with ``O_DIRECT``,
            bypassing the page cache (less CPU taken from training, faster durable saves, no
            checkpoint bytes left competing with training for host memory): stager-slab data
            straight from the slabs, other data through aligned bounce buffers; each file's
            last < 4 KiB is written buffered before the fsync and every file is evicted from
            the page cache after it. Where the file system refuses ``O_DIRECT`` (memory file
            systems such as tmpfs, some network or FUSE ones) the save is written buffered and
            one line says why (INFO for ``"auto"``, WARNING for ``True``); a refusal never
            fails a save. ``False``: plain buffered writes, left in the page cache.
        streams: ``O_DIRECT`` writes kept in flight per rank (default
            :data:`~dcp_plus.storage.direct.DEFAULT_STREAMS`, 4): shared out over the
            ``workers`` slab files (several streams write one file at distinct offsets,
            preallocated with ``fallocate``); the other files' chunks are written by all of
            them, the files in turn (each preallocated).
        worker_nice: CPU niceness of the worker processes (0-19, default 10), so that a
            persist running beside training yields the cores to the training step.
        max_bytes_per_s: cap on the rate at which this rank's data bytes reach storage,
            across its worker processes, threads and streams together (one token bucket they
            share, in 4 MiB grants: over any ``T`` seconds at most ``max_bytes_per_s * T`` +
            4 MiB are sent). ``None`` (default): no cap, no pacing cost. For a per-node cap
            divide the node's budget by its ranks. The commit record and extent tables are
            not paced.
        stagger: seconds between the persists of the ranks of a node: rank ``r`` starts
            writing its data ``LOCAL_RANK * stagger`` seconds after its ``write_data``
            begins (``LOCAL_RANK`` as torchrun sets it; the global rank where it is unset),
            so that the ranks sharing a node's disk or NIC interleave instead of bursting
            together; at most ``(ranks per node - 1) * stagger``. It waits on the persist's
            thread (the background one with ``async_save`` / ``CheckpointManager``; plain
            ``dcp.save`` waits in the caller); planning and the commit are not delayed
            beyond the data write. Default 0.
        codec, codecs: how tensors are stored (default ``"identity"``; ``"zstd"``,
            ``"zstd+shuffle"`` or a ``ZstdCodec``), and per-name overrides
            ``{fnmatch pattern: codec}``. Encoded tensors are written by this process's
            threads rather than from the stager's slabs.
        fence: called by the coordinator before the save writes anything and again just
            before it commits; raising aborts the save on every rank. ``CheckpointManager``
            passes its root lease's check, so a writer that lost its lease never commits.
        base, incremental, part_bytes: incremental checkpoints. ``base``: a committed
            checkpoint in the same directory (its path); every tensor is cut into parts of
            ``part_bytes`` (default 1 MiB, a multiple of 4 KiB) whose xxh3-128 is taken while
            they are written, and a part equal to the base's part of the same tensor is
            recorded as a reference to where the base keeps it instead of being written
            again (a tensor none of whose parts changed references the base's extent
            whole). ``incremental=True`` without a base: a full save whose parts later saves
            can reference. Loading, resharding and ``verify`` follow the references; a
            missing or damaged base fails the load naming the base and the tensor. Keep the
            bases of the checkpoints you keep (``CheckpointManager(incremental=True)`` and
            ``dcp-plus gc`` do, from the records' ``bases``).
        allow_pickle: also store non-tensor values that only load by full unpickling
            (refused by default; ``io.BytesIO`` values are always stored as raw bytes).
            Loading them needs ``allow_pickle=True`` on the reader and a planner that
            unpickles (``DefaultLoadPlanner``): only for checkpoints you will trust.
    """

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, workers: int = 2,
                 threads: int = 2, fsync: bool = True, direct_io: DirectIO = "auto",
                 streams: int = DEFAULT_STREAMS,
                 worker_nice: int = DEFAULT_NICE, max_bytes_per_s: float | None = None,
                 stagger: float = 0.0, codec: str | Codec = "identity",
                 codecs: Mapping[str, str | Codec] | None = None,
                 fence: Fence | None = None,
                 allow_pickle: bool = False,
                 base: str | os.PathLike | None = None, incremental: bool = False,
                 part_bytes: int = DEFAULT_PART_BYTES) -> None:
        super().__init__(path, overwrite=overwrite, codec=codec, codecs=codecs, fence=fence,
                         allow_pickle=allow_pickle, workers=workers, worker_nice=worker_nice,
                         max_bytes_per_s=max_bytes_per_s, stagger=stagger,
                         base=base, incremental=incremental, part_bytes=part_bytes)
        if threads < 1:
            raise ValueError(f"LocalWriter threads must be >= 1, got {threads}")
        if streams < 1:
            raise ValueError(f"LocalWriter streams must be >= 1, got {streams}")
        self.threads = threads
        self.fsync = fsync
        self.direct_io = check_direct_io("LocalWriter", direct_io)
        self.streams = streams
        self._direct = False  # this save's answer to direct_io (probed in _prepare)
        self._bins = threads
        self._slab_parts = workers
        self._threads = Threads(threads, "dcpp-write")
        self._hashers = Threads(threads, "dcpp-hash")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return not is_url(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)  # fenced first
        os.makedirs(self.path, exist_ok=True)

    def _open_store(self) -> LocalFileStore:
        return LocalFileStore(self.path, fsync=self.fsync)

    @property
    def _files(self) -> LocalFileStore:
        return cast(LocalFileStore, self._store)

    def _prepare(self, names: list[str]) -> list[str]:
        created = self._files.create(names)  # exclusively: no file of another save is touched
        self._direct = use_direct(self.path, self.direct_io)
        return created

    def _streams_per_file(self, files: int, parallel: int) -> int:
        """Each file's share of ``streams`` when ``files`` are written ``parallel`` at once."""
        return -(-self.streams // max(1, min(files, parallel))) if self._direct else 1

    def _write_in_process(self, files: list[FilePlan], pace: Bucket | None) -> dict[int, str]:
        # each file's items checksummed on a thread beside the writes of the same bytes
        # (xxh3 and O_DIRECT writes release the GIL; the writes leave the CPU idle): the
        # checksums add no time of their own
        hashed = [self._hashers.submit(lambda fp=fp: {id(r): checksum_bytes(r.data)
                                                      for r, _ in fp.placed})
                  for fp in files]
        try:
            if self.direct_io is False:  # buffered: one file per thread
                list(self._threads.map(lambda fp: self._files.write_file(
                    fp.name, segments_of(fp), fp.size, pace), files))
            elif files:  # one queue of chunks over all files: no stream idles at the end
                write_files([(self._files.location(fp.name), segments_of(fp), fp.size)
                             for fp in files], direct=self._direct,
                            streams=self.streams if self._direct else self.threads,
                            fsync=self.fsync, pace=None if pace is None else pace.take)
        finally:
            wait(hashed)  # the caller may release the items once this returns
        out: dict[int, str] = {}
        for h in hashed:
            out.update(h.result())
        return out

    def _put_table(self, name: str, data: bytes) -> None:
        self._files.put_new(name, data)

    def close(self) -> None:
        self._threads.close()
        self._hashers.close()
        super().close()

    def _worker_jobs(self, files: list[FilePlan], pace: Bucket | None) -> list[Job]:
        streams = self._streams_per_file(len(files), self.workers)
        rate = None if pace is None else pace.limit
        return [WriteJob(os.path.abspath(os.path.join(self.path, fp.name)), fp.slab_ranges(),
                         self.fsync, self._direct, streams, self.direct_io is not False, rate)
                for fp in files]
