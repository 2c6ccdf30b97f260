"""A replica on its way back to its owner for a restore: each large tensor in a message of its
own, received straight into the owner's state when its layout allows (no buffer to fault in,
no second copy) and hashed while the next messages arrive; small tensors travel in runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.piece_digest import digest_of
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

ALONE = 1 << 20  # a tensor this large is a message of its own; smaller ones share runs
Segment = tuple[str, int, int]  # file, start, length


@dataclass(frozen=True)
class Message:
    """``length`` bytes at ``start`` of ``file``, holding ``entries`` (record indexes)."""

    file: str
    start: int
    length: int
    entries: tuple[int, ...]

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
            out.append(Message(e.file, e.offset, e.nbytes, (i,)))
            continue
        if run and (entries[run[0]].file != e.file or
                    max(hi, e.offset + e.nbytes) - min(lo, e.offset) > ALONE):
            flush()
        lo, hi = (min(lo, e.offset), max(hi, e.offset + e.nbytes)) if run else \
            (e.offset, e.offset + e.nbytes)
        run.append(i)
    flush()
    return out


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
    receives = []
    for m in messages:
        direct = dests is not None and len(m.entries) == 1 and \
            lands_in_place(record.entries[m.entries[0]], dests[m.entries[0]])
        target = dests[m.entries[0]].reshape(-1).view(torch.uint8) \
            if direct and dests is not None else torch.empty(m.length, dtype=torch.uint8)
        work = dist.irecv(target, group_src=src, group=group)
        assert work is not None  # this rank is in the group
        receives.append((m, target, direct, work))
    posted()
    for m, target, direct, work in receives:
        work.wait()  # xxh3 releases the GIL: the next messages arrive meanwhile
        if error is not None or dests is None:
            continue
        try:
            for i in m.entries:
                entry, dest = record.entries[i], dests[i]
                if direct:
                    check_digest(digest_of(byte_view(target)), entry, source)
                else:
                    at = entry.offset - m.start
                    copy_verified(memory_fill(target[at:at + entry.nbytes]), dest, entry,
                                  source)
        except (CheckpointFormatError, CorruptCheckpointError) as bad:
            error = bad
    if error is not None:
        raise error
    assert dests is not None
    for entry, dest in zip(record.entries, dests, strict=True):
        if entry.nbytes == 0:
            check_layout(entry, dest, source)
    return decode_values(record.values_bytes())
