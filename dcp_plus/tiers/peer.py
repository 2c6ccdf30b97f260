"""The peer tier: each rank's snapshot also lives in its partner's shared memory.

Transfers use ``torch.distributed`` point-to-point on a gloo group of the tier's own: a header
(step, metadata length, data length), the metadata (the sender's record and the byte ranges
sent), then the data, straight from the sender's slabs into the receiver's replica file. The
receiver writes the replica's record last and acknowledges it; a snapshot counts as replicated
once the acknowledgement is back.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from dcp_plus.errors import CheckpointFormatError, StorageError
from dcp_plus.memory.slabs import SHM_DIR
from dcp_plus.tiers import names
from dcp_plus.tiers.flat import Flat
from dcp_plus.tiers.memory import read_records
from dcp_plus.tiers.peer_restore import Segment, messages_of, receive_verified
from dcp_plus.tiers.record import TensorEntry, TierRecord, decode
from dcp_plus.tiers.replica_files import ReplicaFiles
from dcp_plus.tiers.shm_files import MappedFiles

log = logging.getLogger(__name__)
Partner = Callable[[int], int]


def default_partner(world_size: int, ranks_per_node: int) -> Partner:
    """``rank + ranks_per_node`` mod the world: the same local rank on the next node."""
    return lambda rank: (rank + ranks_per_node) % world_size


def check_partner(partner: Partner, world_size: int) -> list[int]:
    """``partner`` as a list, checked to be a permutation of the ranks with no rank its own
    partner; raises ``ValueError`` naming the problem."""
    table = [partner(r) for r in range(world_size)]
    for r, p in enumerate(table):
        if type(p) is not int or not 0 <= p < world_size:
            raise ValueError(f"peer tier: partner({r}) = {p!r} is not a rank of 0..{world_size - 1}")
        if p == r:
            raise ValueError(f"peer tier: rank {r} is its own partner; a replica must live in "
                             "another failure domain (ranks_per_node must be below the world "
                             "size, or give partner=)")
    if len(set(table)) != world_size:
        raise ValueError(f"peer tier: partners {table} are not a permutation of the ranks (two "
                         "ranks would send to one)")
    return table


def segments_of(entries: list[TensorEntry]) -> list[Segment]:
    """The byte ranges of each data file that ``entries`` use, one per file."""
    spans: dict[str, list[int]] = {}
    for e in entries:
        if e.nbytes:
            lo_hi = spans.setdefault(e.file, [e.offset, e.offset + e.nbytes])
            lo_hi[0] = min(lo_hi[0], e.offset)
            lo_hi[1] = max(lo_hi[1], e.offset + e.nbytes)
    return [(f, lo, hi - lo) for f, (lo, hi) in spans.items()]


class _Sends:
    """Sends in flight, and the buffers they read (alive until they complete); the data of
    a restore's send may be held back until ``start`` (see :meth:`PeerTier.serve`)."""

    def __init__(self, work: list[Any], buffers: object,
                 later: Callable[[], list[Any]] | None = None,
                 files: MappedFiles | None = None) -> None:
        self.work, self.buffers, self._later, self._files = work, buffers, later, files

    def start(self) -> None:
        """Post the sends held back, if any."""
        later, self._later = self._later, None
        if later is not None:
            self.work += later()

    def wait(self) -> None:
        self.start()
        for w in self.work:
            w.wait()
        files = self._files
        refs = [self.work, self.buffers, files]
        self.work, self.buffers, self._files = [], None, None
        if files is not None and files.maps_files():
            # Unmapping a served replica costs ~0.07 s per GiB of page tables: let it
            # happen off the restore's path (the work objects hold the mapped tensors too).
            threading.Thread(target=refs.clear, name="dcpp-peer-unmap", daemon=True).start()


class PeerTier:
    """Replicas between rank ``rank`` and its partners, over ``group`` (gloo)."""

    def __init__(self, job: str, rank: int, world_size: int, group: Any,
                 partner: Partner) -> None:
        table = check_partner(partner, world_size)
        self.job, self.rank, self.world_size, self.group = job, rank, world_size, group
        self.partners = table
        self.partner = table[rank]
        """Who holds this rank's replica."""
        self.source = table.index(rank)
        """Whose replica this rank holds."""
        self._lock = threading.Lock()
        self._held_back: list[_Sends] = []
        self._files = ReplicaFiles(job, rank)

    # -- replicating ----------------------------------------------------------------------

    def exchange(self, record: TierRecord | None, step: int) -> TierRecord | None:
        """Send ``record``'s snapshot (None: this rank has none for ``step``, it still takes
        part) to the partner and take the source's; returns the replica written here, if any.
        Returns once the partner acknowledged ours.

        Raises:
            StorageError: the partner could not keep this rank's replica (after the
                exchange completed on both sides).
        """
        sends = self._send(record, self.partner, step,
                           segments_of(record.entries) if record is not None else [])
        replica = None
        try:
            replica = self._receive_replica()
        finally:
            ack_out = torch.tensor([replica.step if replica else -1], dtype=torch.int64)
            ack_in = torch.zeros(1, dtype=torch.int64)
            work = [dist.isend(ack_out, group_dst=self.source, group=self.group),
                    dist.irecv(ack_in, group_src=self.partner, group=self.group)]
            for w in [*sends, *work]:
                if w is not None:
                    w.wait()
        if record is not None and int(ack_in.item()) != step:
            raise StorageError(f"peer tier: rank {self.partner} did not keep the replica of "
                               f"rank {self.rank}'s step {step} (see its log)")
        return replica

    def _send(self, record: TierRecord | None, dst: int, step: int,
              segments: list[Segment], hold_data: bool = False) -> list[_Sends]:
        """Send the header, the metadata, then ``segments`` of ``record``'s files, each a
        message (a replica's files for a copy, a tensor or run of them for a restore); with
        ``hold_data``, the segments only once the returned sends are started."""
        if record is None:  # nothing to send, but the receiver waits for a header
            header = torch.tensor([step, 0, 0], dtype=torch.int64)
            return [_Sends([dist.isend(header, group_dst=dst, group=self.group)], header)]
        meta = json.dumps({"record": record.encode().decode("utf-8"),
                           "segments": segments}).encode("utf-8")
        files = MappedFiles()
        parts = [torch.frombuffer(bytearray(meta), dtype=torch.uint8)]
        for f, start, length in segments:
            probe = TensorEntry("", "uint8", [length], [1], f, start, length, "")
            parts.append(files.bytes_of(probe, f"peer send of step {record.step}"))
        header = torch.tensor([record.step, len(meta), sum(s[2] for s in segments)],
                              dtype=torch.int64)
        work = [dist.isend(p, group_dst=dst, group=self.group) for p in (header, parts[0])]

        def data() -> list[Any]:
            return [dist.isend(p, group_dst=dst, group=self.group) for p in parts[1:]
                    if p.numel()]
        sends = _Sends(work, (header, parts), data, files)
        if not hold_data:
            sends.start()
        return [sends]

    def _receive_meta(self, src: int) -> tuple[int, TierRecord | None, list[Segment]]:
        header = torch.zeros(3, dtype=torch.int64)
        dist.recv(header, group_src=src, group=self.group)
        step, meta_len, data_len = (int(x) for x in header.tolist())
        if meta_len == 0:
            log.warning("peer tier: rank %d has no snapshot of step %d to send", src, step)
            return 0, None, []
        meta = torch.empty(meta_len, dtype=torch.uint8)
        dist.recv(meta, group_src=src, group=self.group)
        body = json.loads(meta.numpy().tobytes())
        source = f"peer tier: snapshot of rank {src} step {step}"
        record = decode(body["record"].encode("utf-8"), source)
        segments = [(str(f), int(a), int(n)) for f, a, n in body["segments"]]
        if record.step != step or sum(n for *_, n in segments) != data_len:
            raise CheckpointFormatError(f"{source}: header and record disagree")
        return data_len, record, segments

    def _receive_into(self, src: int, buf: torch.Tensor,
                      segments: list[Segment]) -> dict[str, int]:
        """Receive ``segments`` back to back into ``buf``; returns each file's shift."""
        base: dict[str, int] = {}
        at = 0
        for f, start, length in segments:
            dist.recv(buf[at:at + length], group_src=src, group=self.group)
            base[f] = at - start
            at += length
        return base

    def _receive_replica(self) -> TierRecord | None:
        src = self.source
        data_len, sent, segments = self._receive_meta(src)
        if sent is None:
            return None
        step = sent.step
        data_name = names.replica_name(self.job, self.rank, src, step)
        names.unlink(names.record_name(self.job, self.rank, src, step))  # a re-sent step
        try:
            buf, kept = self._files.take(data_name, data_len, src), True
        except OSError as e:  # still take the bytes, or the stream would be out of step
            log.error("peer tier: cannot keep rank %d's step %d (%d bytes) in %s: %s",
                      src, step, data_len, SHM_DIR, e)
            names.unlink(data_name)  # whatever part of it was made
            self._files.unmap_removed()
            buf, kept = torch.empty(data_len, dtype=torch.uint8), False
        base = self._receive_into(src, buf, segments)
        if not kept:
            return None
        entries = [replace(e, file=data_name if e.nbytes else "",
                           offset=e.offset + base[e.file] if e.nbytes else 0)
                   for e in sent.entries]
        replica = replace(sent, holder=self.rank, entries=entries)
        with self._lock:
            replica.write()
            self._files.prune(src, keep=step)
        return replica

    # -- recovering -----------------------------------------------------------------------

    def held(self) -> list[TierRecord]:
        """Complete replicas held here (of the source's snapshots), newest first."""
        return [r for r in read_records(self.job, self.rank, owner=self.source)
                if r.world_size == self.world_size]

    def serve(self, record: TierRecord, to: int, after_fetch: bool = False) -> list[_Sends]:
        """Start sending the replica ``record`` back to its owner ``to``. With
        ``after_fetch`` (this rank restores from its own partner too), only the header and
        metadata go now and the data once :meth:`fetch` has posted its receives: posted
        before, the two transfers can run one after the other instead of together."""
        segments = [m.segment for m in messages_of(record.entries)]
        sends = self._send(record, to, record.step, segments, hold_data=after_fetch)
        if after_fetch:
            self._held_back += sends
        return sends

    def fetch(self, flat: Flat) -> tuple[TierRecord, dict[str, Any]]:
        """Receive this rank's replica from its partner into ``flat`` (verified); returns
        the replica's record and its non-tensor values."""
        try:
            _, rec, segments = self._receive_meta(self.partner)
            if rec is None:
                raise CheckpointFormatError(f"peer tier: rank {self.partner} sent no replica")
            source = f"peer replica of rank {self.rank} step {rec.step} (held by rank " \
                f"{self.partner})"
            return rec, receive_verified(rec, segments, flat, self.partner, self.group, source,
                                         posted=self._start_held_back)
        finally:
            self._start_held_back()

    def _start_held_back(self) -> None:
        held, self._held_back = self._held_back, []
        for sends in held:
            sends.start()

    def remove_all(self) -> None:
        """Remove every replica held here."""
        with self._lock:
            for f in names.listing(self.job, self.rank):
                if f.owner != self.rank:
                    names.unlink(f.name)

    def unmap(self) -> None:
        """Drop this process's mappings of the replica files (a closing manager)."""
        self._files.close()
