"""A manager's chain of incremental checkpoints: which save is full, which base the others
reference, and where the base's snapshot still lies in memory (for XOR deltas)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from dcp_plus.errors import InvalidOptionError
from dcp_plus.storage.location import sibling_name
from dcp_plus.writers.base import CommittingWriter
from dcp_plus.writers.increments import Increments

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class IncrementalOptions:
    """``CheckpointManager(incremental=..., full_every=..., delta=...)``.

    Attributes:
        incremental: durable saves write only the parts that changed since the previous
            committed one (its base) and reference the rest.
        full_every: every ``full_every``-th durable save (counted from the manager's first,
            which is always full) references nothing: chains are at most this long, and
            retention can free the older links.
        delta: changed parts are stored as XOR deltas against the base's snapshot, which a
            second stager buffer keeps in memory (``ArenaStager(buffers=2)``), where that is
            smaller than the part.
    """

    incremental: bool = False
    full_every: int = 8
    delta: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.full_every, int) or isinstance(self.full_every, bool) or \
                not 1 <= self.full_every <= 128:
            raise InvalidOptionError(f"full_every must be an int in 1..128 (a chain of at most "
                                     f"that many saves), got {self.full_every!r}")
        if self.delta and not self.incremental:
            raise InvalidOptionError("delta=True encodes the parts of incremental "
                                     "checkpoints: pass incremental=True too")


class Chain:
    """Decides each durable save's :class:`Increments` (None when incremental is off)."""

    def __init__(self, options: IncrementalOptions, part_bytes: int,
                 key_prefixes: object = None) -> None:
        if options.incremental and key_prefixes is not None:
            raise InvalidOptionError("incremental checkpoints cannot be combined with the "
                                     "writer's key_prefixes yet")
        self.options = options
        self.part_bytes = part_bytes
        self._count = 0
        self._base: tuple[str, CommittingWriter] | None = None
        self.current_base: str | None = None
        """The base of the latest save issued (None: a full one)."""
        self._pending: tuple[str, CommittingWriter, Callable[[], bool]] | None = None

    def writer(self, make: Callable[[], Any], path: str, committed: Callable[[], bool]) -> Any:
        """The writer of the durable save at ``path``, made by ``make()``; ``committed()``,
        asked when the next save starts, says whether this one committed."""
        writer = make()
        if not self.options.incremental:
            return writer
        if not isinstance(writer, CommittingWriter):
            raise InvalidOptionError(f"{path}: incremental checkpoints need a dcp_plus writer, "
                                     f"got {type(writer).__name__}")
        self._settle()
        # a save into its own base's folder (the same step saved again) references nothing
        full = (self._count % self.options.full_every == 0 or self._base is None
                or self._base[0] == path)
        old = None
        if not full and self.options.delta:
            assert self._base is not None
            old = self._base[1].last_slabs
        self.current_base = None if full or self._base is None else self._base[0]
        base = None if self.current_base is None else sibling_name(writer.path,
                                                                    self.current_base)
        known = None if base is None or self._base is None else self._base[1].last_extents
        writer.increments = Increments(base, self.part_bytes, base_required=False, old=old,
                                       keep_replaced=True, known=known)
        self._count += 1
        self._pending = (path, writer, committed)
        return writer

    def _settle(self) -> None:
        """The previous durable save becomes the base if it committed (saves run one at a
        time: it has ended by now)."""
        if self._pending is None:
            return
        path, writer, committed = self._pending
        self._pending = None
        if committed():
            self._base = (path, writer)
        else:
            log.info("incremental checkpoints: %s did not commit; the next save references %s",
                     path, None if self._base is None else self._base[0])
