"""How much of a checkpoint a save or load left in the page cache.

:func:`residency` counts the resident pages of each file with ``mincore(2)`` over a
``PROT_READ`` shared mapping of it (``fincore``'s method: mapping without touching faults
nothing in, so the count is what the kernel holds). Where ``mincore`` cannot be called (no
libc symbol, or the kernel refuses it), it falls back to how much ``/proc/meminfo``'s
``Cached`` grew since a :func:`cached_now` taken before the save or load: cruder (other
processes move it too), and named as such in :attr:`Residency.method`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dcp_plus.cli.bench.machine import files_under
from dcp_plus.storage.direct import resident_bytes as _resident


@dataclass(frozen=True)
class Residency:
    """Bytes of some files in the page cache, of their total size, and how it was counted."""

    resident: int
    total: int
    method: str  # "mincore" | "meminfo Cached delta"

    @property
    def fraction(self) -> float:
        """``resident / total`` (0 for no bytes)."""
        return self.resident / self.total if self.total else 0.0


def resident_bytes(path: str) -> int:
    """Bytes of file ``path`` in the page cache (``mincore``; OSError where unavailable)."""
    return _resident(path)[0]


def cached_now() -> int:
    """``Cached`` of ``/proc/meminfo`` in bytes: the baseline of :func:`residency`'s fallback."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no Cached line")


def residency(paths: list[str], baseline: int | None = None) -> Residency:
    """How many bytes of the files at/under ``paths`` are in the page cache, of their size.

    ``mincore`` per file; where that fails and ``baseline`` (a :func:`cached_now` from before
    the I/O) is given, the growth of ``Cached`` since then, at most the files' size.
    """
    files = files_under(paths)
    total = sum(os.path.getsize(f) for f in files)
    try:
        return Residency(sum(resident_bytes(f) for f in files), total, "mincore")
    except OSError:
        if baseline is None:
            raise
    return Residency(min(total, max(0, cached_now() - baseline)), total,
                     "meminfo Cached delta")
