"""The memory tier on one rank: keep each snapshot in ``/dev/shm`` under the job's names, with
its record written last; list, restore and remove them.

Own snapshots cost no copy: the stager's slabs already hold the bytes, so the tier hard-links
them under the job's names (a link keeps the memory alive after the stager or the process is
gone) and writes the record. At most the newest complete snapshot and the one being taken are
held: once a record is in place, older records and the links only they used are removed.
"""

from __future__ import annotations

import base64
import io
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import xxhash

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError, UnsafeValueError
from dcp_plus.format.values import byte_view, check_loads_safely
from dcp_plus.memory.slabs import SHM_DIR, registry
from dcp_plus.tiers import names
from dcp_plus.tiers.flat import Flat, flatten, plain
from dcp_plus.tiers.record import DTYPE_NAMES, DTYPES, TensorEntry, TierRecord, read

log = logging.getLogger(__name__)
CHUNK = 1 << 20  # copy and hash in pieces that stay in (L2) cache between the two
EMPTY_DIGEST = xxhash.xxh3_64_hexdigest(b"")


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


def encode_values(values: Mapping[str, Any]) -> bytes:
    """``torch.save`` bytes of the non-tensor values (``io.BytesIO`` as raw bytes), refused
    unless they load with ``weights_only=True``."""
    raw = {k: torch.frombuffer(bytearray(v.getvalue()) or bytearray(1), dtype=torch.uint8)
           [: len(v.getvalue())] for k, v in values.items() if isinstance(v, io.BytesIO)}
    plain_values = {k: v for k, v in values.items() if not isinstance(v, io.BytesIO)}
    buf = io.BytesIO()
    torch.save({"values": plain_values, "bytesio": raw}, buf)
    data = buf.getvalue()
    check_loads_safely(f"memory tier's values {sorted(plain_values)[:4]}", data)
    return data


def decode_values(data: bytes) -> dict[str, Any]:
    body = torch.load(io.BytesIO(data), weights_only=True)
    out = dict(body["values"])
    out.update({k: io.BytesIO(t.numpy().tobytes()) for k, t in body["bytesio"].items()})
    return out


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14


def _map(name: str) -> tuple[mmap.mmap, int]:
    # writable only because torch.frombuffer warns on read-only buffers; nothing writes
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED), size
    finally:
        os.close(fd)


def _missing(entry: TensorEntry, source: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: data file {entry.file} of tensor {entry.fqn!r} is gone")


def _past_end(entry: TensorEntry, source: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: tensor {entry.fqn!r} lies past the end of {entry.file}")


class MappedFiles:
    """Memory-tier data files by name, as tensors to send (the peer tier's send side).

    An own snapshot's slab that this process's stager holds is used as it is mapped there;
    any other file is mapped once, and each range's page tables are filled just before it is
    handed out (``MADV_POPULATE_READ``), so filling the next range overlaps sending this one
    instead of a whole-file ``MAP_POPULATE`` up front."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[mmap.mmap | None, torch.Tensor]] = {}

    def _base(self, entry: TensorEntry, source: str) -> tuple[mmap.mmap | None, torch.Tensor]:
        base = self._open.get(entry.file)
        if base is not None:
            return base
        slab = registry.by_name(names.slab_of(entry.file) or "")
        try:
            base = None if slab is None else (None, slab.tensor())
        except ValueError:  # closed meanwhile: the link still holds the bytes
            base = None
        if base is None:
            try:
                m, size = _map(entry.file)
            except FileNotFoundError:
                raise _missing(entry, source) from None
            base = (m, torch.frombuffer(m, dtype=torch.uint8, count=size) if size else
                    torch.empty(0, dtype=torch.uint8))
        self._open[entry.file] = base
        return base

    def bytes_of(self, entry: TensorEntry, source: str) -> torch.Tensor:
        if entry.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        m, base = self._base(entry, source)
        if entry.offset + entry.nbytes > base.numel():
            raise _past_end(entry, source)
        if m is not None:
            lo = entry.offset - entry.offset % mmap.PAGESIZE
            try:
                m.madvise(MADV_POPULATE_READ, lo, entry.offset + entry.nbytes - lo)
            except OSError:  # an older kernel: the pages fault in as they are sent
                pass
        return base[entry.offset:entry.offset + entry.nbytes]


Fill = Callable[[memoryview, int], None]
"""``fill(out, at)`` writes an entry's bytes ``[at, at + len(out))`` into ``out``."""


def memory_fill(data: torch.Tensor) -> Fill:
    """A :data:`Fill` over bytes already in this process (a received replica)."""
    view = byte_view(data) if data.numel() else memoryview(bytearray())

    def fill(out: memoryview, at: int) -> None:
        out[:] = view[at:at + len(out)]
    return fill


class SnapshotFiles:
    """Memory-tier data files read by name with ``pread`` (a restore's read side).

    ``pread`` from tmpfs copies page by page in the kernel: cheaper than mapping the
    snapshot into a restarted process (``MAP_POPULATE`` alone costs about a third of a
    copy), and the chunk it leaves in cache is hashed before it is evicted."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._fds: dict[str, tuple[int, int]] = {}  # name -> (fd, size)

    def fill_for(self, entry: TensorEntry) -> Fill:
        if entry.nbytes == 0:
            return memory_fill(torch.empty(0, dtype=torch.uint8))
        opened = self._fds.get(entry.file)
        if opened is None:
            try:
                fd = os.open(os.path.join(SHM_DIR, entry.file), os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise _missing(entry, self.source) from None
            opened = self._fds[entry.file] = (fd, os.fstat(fd).st_size)
        fd, size = opened
        if entry.offset + entry.nbytes > size:
            raise _past_end(entry, self.source)

        def fill(out: memoryview, at: int) -> None:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], entry.offset + at + done)
                if n <= 0:
                    raise _past_end(entry, self.source)
                done += n
        return fill

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def check_layout(entry: TensorEntry, dest: torch.Tensor, source: str) -> None:
    """Raise ``CheckpointFormatError`` unless ``dest`` has ``entry``'s dtype and shape."""
    if dest.dtype != DTYPES[entry.dtype] or list(dest.shape) != entry.shape:
        raise CheckpointFormatError(
            f"{source}: tensor {entry.fqn!r} is {entry.dtype}{entry.shape} in the snapshot "
            f"but {str(dest.dtype).removeprefix('torch.')}{list(dest.shape)} here")


def lands_in_place(entry: TensorEntry, dest: torch.Tensor) -> bool:
    """Whether ``entry``'s bytes can be written straight into ``dest``'s memory."""
    return entry.nbytes > 0 and dest.dtype == DTYPES[entry.dtype] and \
        list(dest.shape) == entry.shape and dest.is_contiguous() and \
        dest.device.type == "cpu" and entry.stride == list(dest.stride())


def check_digest(digest: str, entry: TensorEntry, source: str) -> None:
    if digest != entry.checksum:
        raise CorruptCheckpointError(
            f"{source}: tensor {entry.fqn!r} does not match its checksum in shared memory")


def copy_verified(fill: Fill, dest: torch.Tensor, entry: TensorEntry, source: str) -> None:
    """Copy ``entry``'s bytes (from ``fill``) into ``dest``, checking their checksum in the
    same pass (chunk by chunk while the chunk is in cache, when ``dest`` is contiguous)."""
    check_layout(entry, dest, source)
    h = xxhash.xxh3_64()
    if entry.nbytes == 0:
        pass
    elif lands_in_place(entry, dest):
        out = byte_view(dest)
        for i in range(0, entry.nbytes, CHUNK):
            piece = out[i:i + CHUNK]
            fill(piece, i)
            h.update(piece)
    else:
        bounce = torch.empty(entry.nbytes, dtype=torch.uint8)
        fill(byte_view(bounce), 0)
        h.update(byte_view(bounce))
        typed = bounce.view(DTYPES[entry.dtype]).as_strided(entry.shape, entry.stride)
        with torch.no_grad():
            dest.copy_(typed)
    check_digest(h.hexdigest(), entry, source)


def destinations(record: TierRecord, flat: Flat, source: str) -> list[torch.Tensor]:
    """``flat``'s tensor for each of ``record``'s entries; raises ``CheckpointFormatError``
    when the structures differ."""
    if record.fingerprint != flat.fingerprint:
        raise CheckpointFormatError(
            f"{source}: the snapshot's structure (fingerprint {record.fingerprint}) is not "
            f"this state dict's ({flat.fingerprint})")
    out = []
    for e in record.entries:
        dest = flat.tensors.get(e.fqn)
        if dest is None:
            raise CheckpointFormatError(f"{source}: tensor {e.fqn!r} is not in the state dict")
        out.append(dest)
    return out


def restore_into(record: TierRecord, flat: Flat, source: str,
                 fill_for: Callable[[TensorEntry], Fill]) -> dict[str, Any]:
    """Copy ``record``'s tensors into ``flat``'s (verified); returns its non-tensor values.

    ``fill_for(entry)`` gives the :data:`Fill` of an entry's bytes.
    """
    for e, dest in zip(record.entries, destinations(record, flat, source), strict=True):
        copy_verified(fill_for(e), dest, e, source)
    return decode_values(record.values_bytes())


class MemoryTier:
    """The own snapshots of rank ``rank`` of job ``job``."""

    def __init__(self, job: str, rank: int, world_size: int) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self._lock = threading.Lock()

    # -- taking ---------------------------------------------------------------------------

    def take(self, step: int, staged: Mapping[str, Any]) -> TierRecord:
        """Record the staged snapshot of ``step`` (already complete in the stager's slabs),
        then drop older snapshots. Returns its record."""
        flat = flatten(staged)
        entries = []
        linked: set[str] = set()
        for fqn, t in flat.tensors.items():
            dense = t.is_contiguous()  # the common case: skip the span arithmetic
            nbytes = t.numel() * t.element_size() if dense else span_bytes(t)
            file, offset, digest = "", 0, EMPTY_DIGEST
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
                digest = xxhash.xxh3_64_hexdigest(byte_view(t if dense else span_view(t)))
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
            if f.kind == "record" and f.name != kept:
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


__all__ = ["MemoryTier", "plain", "read_records", "restore_own", "restore_into"]
