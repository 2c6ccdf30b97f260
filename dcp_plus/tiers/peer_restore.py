"""A replica on its way back to its owner for a restore: each large tensor in messages of
:data:`MESSAGE_BYTES` of its own, received straight into the owner's state when its layout allows
(no buffer to fault in, no second copy) and hashed as each message lands, while it is still in
cache and the next messages arrive; small tensors travel in runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.piece_digest import PieceHasher
from dcp_plus.format.values import byte_view
from dcp_plus.tiers.flat import Flat
from dcp_plus.tiers.record import TensorEntry, TierRecord
from dcp_plus.tiers.shm_files import memory_fill
from dcp_plus.tiers.values import decode_values
from dcp_plus.tiers.verify import (
    check_digest,
    check_layout,
    copy_verified,
    destinations,
    lands_in_place,
)

ALONE = 1 << 20  # a tensor this large travels in messages of its own; smaller ones share runs
MESSAGE_BYTES = 4 << 20
"""The largest message: small enough to be hashed from cache as it lands (64 MiB messages,
hashed from DRAM, made a 2 GiB exchange 0.16 s slower here; 4 MiB ones cost nothing)."""
Segment = tuple[str, int, int]  # file, start, length


@dataclass(frozen=True)
class Message:
    """``length`` bytes at ``start`` of ``file``, holding ``entries`` (record indexes); a
    message of one large entry holds its bytes from ``at`` on."""

    file: str
    start: int
    length: int
    entries: tuple[int, ...]
    at: int = 0

    @property
    def segment(self) -> Segment:
        return self.file, self.start, self.length


def messages_of(entries: list[TensorEntry]) -> list[Message]:
    """The messages a replica is sent back in, in order (both sides compute them)."""
    out: list[Message] = []
    run: list[int] = []
    lo = hi = 0

    def flush() -> None:
        if run:
            out.append(Message(entries[run[0]].file, lo, hi - lo, tuple(run)))
            run.clear()

    for i, e in enumerate(entries):
        if e.nbytes == 0:
            continue
        if e.nbytes >= ALONE:
            flush()
            out += [Message(e.file, e.offset + at, min(MESSAGE_BYTES, e.nbytes - at), (i,), at)
                    for at in range(0, e.nbytes, MESSAGE_BYTES)]
            continue
        if run and (entries[run[0]].file != e.file or
                    max(hi, e.offset + e.nbytes) - min(lo, e.offset) > ALONE):
            flush()
        lo, hi = (min(lo, e.offset), max(hi, e.offset + e.nbytes)) if run else \
            (e.offset, e.offset + e.nbytes)
        run.append(i)
    flush()
    return out


class _Landing:
    """Where each message of a restore lands, and the checks once an entry is complete."""

    def __init__(self, record: TierRecord, dests: list[torch.Tensor], source: str) -> None:
        self.record, self.dests, self.source = record, dests, source
        self._hashers: dict[int, PieceHasher] = {}
        self._bounces: dict[int, torch.Tensor] = {}

    def target(self, m: Message) -> tuple[torch.Tensor, bool]:
        """The bytes message ``m`` is received into, and whether they are the state's own."""
        i = m.entries[0]
        entry, dest = self.record.entries[i], self.dests[i]
        if len(m.entries) == 1 and lands_in_place(entry, dest):
            return dest.reshape(-1).view(torch.uint8)[m.at:m.at + m.length], True
        if len(m.entries) == 1:  # a large entry of another layout: gathered, then copied
            if m.at == 0:
                self._bounces[i] = torch.empty(entry.nbytes, dtype=torch.uint8)
            return self._bounces[i][m.at:m.at + m.length], False
        return torch.empty(m.length, dtype=torch.uint8), False

    def landed(self, m: Message, target: torch.Tensor, direct: bool) -> None:
        """Message ``m`` is in ``target``: hash it (in place) or copy it out (verified)."""
        i = m.entries[0]
        entry = self.record.entries[i]
        if direct:
            h = self._hashers.setdefault(i, PieceHasher())
            h.update(byte_view(target))
            if m.at + m.length == entry.nbytes:
                check_digest(self._hashers.pop(i).hexdigest(), entry, self.source)
        elif len(m.entries) == 1:
            if m.at + m.length == entry.nbytes:
                bounce = self._bounces.pop(i)
                copy_verified(memory_fill(bounce), self.dests[i], entry, self.source)
        else:
            for k in m.entries:
                e = self.record.entries[k]
                at = e.offset - m.start
                copy_verified(memory_fill(target[at:at + e.nbytes]), self.dests[k], e,
                              self.source)


def receive_verified(record: TierRecord, segments: list[Segment], flat: Flat, src: int,
                     group: Any, source: str,
                     posted: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Receive ``record``'s bytes (announced as ``segments``) from ``src`` into ``flat``'s
    tensors, verified; returns the non-tensor values. Every announced byte is received even
    when the state does not fit, so the sender is never left waiting; then it raises.
    ``posted()`` is called once every receive is posted."""
    messages = messages_of(record.entries)
    error: Exception | None = None
    dests: list[torch.Tensor] | None = None
    if [m.segment for m in messages] != segments:
        error = CheckpointFormatError(f"{source}: the sent byte ranges are not the record's")
        messages = [Message(f, a, n, ()) for f, a, n in segments]
    else:
        try:
            dests = destinations(record, flat, source)
        except CheckpointFormatError as bad:
            error = bad
    landing = _Landing(record, dests, source) if dests is not None else None
    receives = []
    for m in messages:
        target, direct = landing.target(m) if landing is not None else \
            (torch.empty(m.length, dtype=torch.uint8), False)
        work = dist.irecv(target, group_src=src, group=group)
        assert work is not None  # this rank is in the group
        receives.append((m, target, direct, work))
    posted()
    for m, target, direct, work in receives:
        work.wait()  # xxh3 releases the GIL: the next messages arrive meanwhile
        if error is not None or landing is None:
            continue
        try:
            landing.landed(m, target, direct)
        except (CheckpointFormatError, CorruptCheckpointError) as bad:
            error = bad
    if error is not None:
        raise error
    assert dests is not None
    for entry, dest in zip(record.entries, dests, strict=True):
        if entry.nbytes == 0:
            check_layout(entry, dest, source)
    return decode_values(record.values_bytes())
