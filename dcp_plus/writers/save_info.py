"""What a save tells its ranks (``RankInfo``, the save id) and what a rank's persist took."""

from __future__ import annotations

import dataclasses
import uuid


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Set on each rank's plan by the coordinator: its rank and the world size.

    It carries no save id: DCP's plan caching reuses a cached final plan (and this) without
    calling ``prepare_global_plan``, so each rank picks its save's id itself, every save.
    """

    rank: int
    world: int = 1


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclasses.dataclass(frozen=True)
class PersistTiming:
    """When this rank's last ``write_data`` ran (``time.time()`` seconds) and what it wrote.

    Attributes:
        started: ``write_data`` was called.
        writing: the data write began (after the stagger): its first file was created.
        write_s: how long writing every data file of the rank took (and fsyncing them,
            where the writer does), on the monotonic clock.
        data_bytes: the sizes of the rank's data files together.
    """

    started: float
    writing: float
    write_s: float
    data_bytes: int

    @property
    def bytes_per_s(self) -> float:
        """The rank's data write rate (what ``max_bytes_per_s`` bounds)."""
        return self.data_bytes / max(self.write_s, 1e-9)
