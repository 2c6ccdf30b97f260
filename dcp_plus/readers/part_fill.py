"""Filling parts: every read a batch of parts needs is planned first, then issued as one
request list per data file (never two opens of one file at a time: NFSv4 clients serialise
them), then encoded parts are decoded and every part's hash is checked while it is still in
cache. A delta chain is rebuilt in its destination: the innermost part first, then each
delta XORed onto it in turn (each level's hash checked on the way), so a part costs its
destination plus its chain's stored bytes, which the record bounds."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from dcp_plus.errors import CorruptCheckpointError
from dcp_plus.format.codecs import get_codec
from dcp_plus.format.delta import apply_delta
from dcp_plus.format.parts import DELTA_CODEC, Part, part_hash
from dcp_plus.storage.direct_landing import MayShift
from dcp_plus.storage.fanout import fan_out, gather

Source = Callable[[str | None], Any]
"""The reader of a checkpoint by name (None: the one being read)."""


@dataclass(eq=False)
class _Node:
    part: Part
    where: str | None
    out: memoryview
    what: str
    stored: memoryview | None = None
    against: _Node | None = None


@dataclass
class PartBatch:
    """Parts to fill, and the reads they need, grouped by ``(checkpoint, file)``."""

    verify: bool
    may_shift: MayShift | None = None
    """Which destinations reads may pass through shifted (the reader's ``_shift_check``)."""
    nodes: list[_Node] = field(default_factory=list)
    reads: dict[tuple[str | None, str], list[tuple[int, memoryview]]] = field(
        default_factory=lambda: defaultdict(list))
    nbytes: int = 0
    """Bytes of destination and scratch the batch holds."""
    _pending: list[Future[None]] = field(default_factory=list)

    def add(self, part: Part, holder: str | None, out: memoryview, what: str) -> None:
        """Fill ``out`` with ``part`` (of a record whose own parts lie in ``holder``)."""
        self.nodes.append(self._plan(part, holder, out, what))

    def _plan(self, p: Part, holder: str | None, out: memoryview, what: str) -> _Node:
        node = _Node(p, p.where or holder, out, what)
        self.nbytes += p.raw
        target = out
        if p.codec != "identity":
            target = node.stored = memoryview(bytearray(p.length))
            self.nbytes += p.length
            if p.codec == DELTA_CODEC:
                assert p.against is not None  # validated with the record
                node.against = self._plan(p.against, holder, out, what)  # the same bytes
        self.reads[node.where, p.file].append((p.offset, target))
        return node

    def run(self, source: Source, pool: Executor) -> None:
        """Issue the reads (one request list per file), then decode and check every part."""
        self.start(source, pool)
        self.finish(source, pool)

    def start(self, source: Source, pool: Executor) -> None:
        """Issue the reads on ``pool`` (one request list per file) and return: the next
        batch's reads overlap this one's decoding."""
        def read(key: tuple[str | None, str]) -> None:
            reads = sorted(self.reads[key], key=lambda r: r[0])
            source(key[0])._fill(key[1], reads, f"the parts of {self._what(key)}",
                                 self.may_shift)

        self._pending = [pool.submit(read, key) for key in self.reads]

    def finish(self, source: Source, pool: Executor) -> None:
        """Wait for the reads, then decode and check every part (on ``pool``)."""
        gather(self._pending)
        fan_out(lambda n: self._finish(n, source), self.nodes, pool)

    def _what(self, key: tuple[str | None, str]) -> str:
        return next((n.what for n in self.nodes if (n.where, n.part.file) == key),
                    "an extent")

    def _finish(self, n: _Node, source: Source) -> None:
        p = n.part
        where = f"{source(n.where)._location(p.file)}: {n.what}"
        if n.against is not None:
            self._finish(n.against, source)  # n.out holds the bytes the delta was taken against
        if n.stored is not None:
            try:
                if n.against is not None:
                    apply_delta(n.stored, n.out)
                else:
                    get_codec(p.codec).decode_into(n.stored, n.out)
            except ValueError as e:
                raise CorruptCheckpointError(f"{where}: cannot decode the {p.codec} part at "
                                             f"{p.offset}: {e}") from None
        if self.verify and part_hash(n.out) != p.hash:
            raise CorruptCheckpointError(
                f"{where}: checksum mismatch in the part at {p.offset} ({p.raw} bytes): the "
                "stored bytes do not match what the record says; the data file is corrupt")
