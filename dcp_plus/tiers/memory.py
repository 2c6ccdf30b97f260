"""The memory tier on one rank: keep each snapshot in ``/dev/shm`` under the job's names, with
its record written last; list, restore and remove them.

Own snapshots cost no copy: the stager's slabs already hold the bytes, so the tier hard-links
them under the job's names (a link keeps the memory alive after the stager or the process is
gone) and writes the record. At most the newest complete snapshot and the one being taken are
held: once a record is in place, older records and the links only they used are removed.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash

from dcp_plus.errors import CheckpointFormatError, UnsafeValueError
from dcp_plus.format.piece_digest import EMPTY, digest_of
from dcp_plus.format.values import byte_view
from dcp_plus.memory.slabs import SHM_DIR, registry
from dcp_plus.tiers import names
from dcp_plus.tiers.flat import Flat, flatten, plain
from dcp_plus.tiers.record import DTYPE_NAMES, TensorEntry, TierRecord, read
from dcp_plus.tiers.shm_files import SnapshotFiles
from dcp_plus.tiers.values import encode_values
from dcp_plus.tiers.verify import restore_into

log = logging.getLogger(__name__)


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (non-negative strides)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) \
        * t.element_size()


def span_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 tensor over the bytes ``t`` spans (no copy)."""
    out = torch.empty(0, dtype=torch.uint8)
    return out.set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                    (span_bytes(t),), (1,))


class MemoryTier:
    """The own snapshots of rank ``rank`` of job ``job``."""

    def __init__(self, job: str, rank: int, world_size: int) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self._lock = threading.Lock()

    # -- taking ---------------------------------------------------------------------------

    def take(self, step: int, staged: Mapping[str, Any]) -> TierRecord:
        """Record the staged snapshot of ``step`` (already complete in the stager's slabs),
        then drop older snapshots. Returns its record. Checksums the stager took while
        copying (``staged.digests``) are used as they are; other tensors are hashed here."""
        flat = flatten(staged)
        taken: dict[tuple[int, int], str] = getattr(staged, "digests", {})
        entries = []
        linked: set[str] = set()
        for fqn, t in flat.tensors.items():
            dense = t.is_contiguous()  # the common case: skip the span arithmetic
            nbytes = t.numel() * t.element_size() if dense else span_bytes(t)
            file, offset, digest = "", 0, EMPTY
            if nbytes:
                ref = registry.locate(t.data_ptr(), nbytes) if t.device.type == "cpu" else None
                if ref is None:
                    raise UnsafeValueError(
                        f"memory tier: tensor {fqn!r} of step {step} is not in a "
                        "stager slab; the memory tier needs the manager's ArenaStager")
                file, offset = names.link_name(self.job, self.rank, ref.slab), ref.offset
                if ref.slab not in linked:
                    self._link(ref.slab, file)
                    linked.add(ref.slab)
                found = taken.get((t.data_ptr(), nbytes)) if dense else None
                digest = found if found is not None else \
                    digest_of(byte_view(t if dense else span_view(t)))
            dtype = DTYPE_NAMES.get(t.dtype)
            if dtype is None:
                raise UnsafeValueError(f"memory tier: tensor {fqn!r} has dtype {t.dtype}, "
                                       "which a snapshot cannot hold")
            entries.append(TensorEntry(fqn, dtype, list(t.shape),
                                       list(t.stride()), file, offset, nbytes, digest))
        data = encode_values(flat.values)
        record = TierRecord(self.job, step, self.world_size, self.rank, self.rank,
                            flat.fingerprint, entries, base64.b64encode(data).decode("ascii"),
                            xxhash.xxh3_64_hexdigest(data), created=time.time())
        with self._lock:
            record.write()
            self.prune(keep=record)
        return record

    def _link(self, slab: str, link: str) -> None:
        try:
            os.link(os.path.join(SHM_DIR, slab), os.path.join(SHM_DIR, link))
        except FileExistsError:
            pass  # this slab is linked already (an earlier snapshot in the same buffer)

    def prune(self, keep: TierRecord | None) -> None:
        """Remove every own record but ``keep`` (None: all), then every own link no
        remaining record uses."""
        own = [f for f in names.listing(self.job, self.rank) if f.owner == self.rank]
        kept = None if keep is None else names.record_name(self.job, self.rank, self.rank,
                                                           keep.step)
        for f in own:
            if f.kind in ("record", "partial") and f.name != kept:
                names.unlink(f.name)
        used = set() if keep is None else {e.file for e in keep.entries}
        for f in own:
            if f.kind == "link" and f.name not in used:
                names.unlink(f.name)

    # -- reading --------------------------------------------------------------------------

    def records(self) -> list[TierRecord]:
        """This rank's complete own snapshots of this world size, newest first."""
        return [r for r in read_records(self.job, self.rank, owner=self.rank)
                if r.world_size == self.world_size]

    def remove_all(self) -> None:
        """Remove every own snapshot (``CheckpointManager.close()``)."""
        with self._lock:
            self.prune(keep=None)


def read_records(job: str, holder: int, owner: int) -> list[TierRecord]:
    """Valid records of ``owner``'s snapshots held by ``holder``, newest first (a damaged
    one is logged and skipped)."""
    out = []
    for f in names.listing(job, holder):
        if f.kind != "record" or f.owner != owner:
            continue
        try:
            out.append(read(f))
        except (OSError, CheckpointFormatError) as e:
            log.warning("memory tier: ignoring %s: %s", f.name, e)
    return sorted(out, key=lambda r: r.step, reverse=True)


def restore_own(record: TierRecord, flat: Flat) -> dict[str, Any]:
    """Restore from this rank's own snapshot ``record``; returns its non-tensor values."""
    source = f"memory-tier snapshot of rank {record.owner} step {record.step}"
    files = SnapshotFiles(source)
    try:
        return restore_into(record, flat, source, files.fill_for)
    finally:
        files.close()


def remove_files(files: Iterable[names.TierFile]) -> None:
    for f in files:
        names.unlink(f.name)


__all__ = ["MemoryTier", "plain", "read_records", "restore_own"]
