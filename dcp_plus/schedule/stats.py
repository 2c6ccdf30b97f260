"""What the manager measures around each checkpoint, and the overhead it causes.

Torch-free: policies only see numbers, so they can be driven by a scripted clock in tests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True, slots=True)
class SaveStats:
    """Timings of one checkpoint, in seconds.

    ``blocking_s`` is the time ``save()`` held the training thread, of which ``waited_s`` was
    spent waiting for the previous persist to finish (at most one is in flight).
    ``exposed_staging_s`` is the time the next ``optimizer.step()`` waited for the snapshot
    (the guard). ``staging_s`` (Tc) runs from the start of the save to the complete snapshot,
    ``persist_s`` (Ts) from the complete snapshot to the commit; ``device_copy_s`` below.
    """

    step: int
    blocking_s: float
    waited_s: float
    exposed_staging_s: float
    staging_s: float
    persist_s: float
    ok: bool = True
    device_copy_s: float | None = None
    """GPU-mode snapshot (``ArenaStager(device_copy=...)``): the device -> device copy's time
    (CheckFreq's T_g), after which the guard let training go on; ``None`` for a snapshot
    copied straight to host memory (whose copy time is within ``staging_s``, T_c)."""

    @property
    def exposed_s(self) -> float:
        """Everything this checkpoint cost the training thread (To plus waiting)."""
        return self.blocking_s + self.exposed_staging_s

    @property
    def own_exposed_s(self) -> float:
        """The exposed cost of taking this snapshot alone, without waiting for an older one."""
        return max(0.0, self.blocking_s - self.waited_s) + self.exposed_staging_s


class Window:
    """Running median of the last ``size`` samples (robust to noisy neighbours)."""

    def __init__(self, size: int = 32) -> None:
        self._samples: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._samples.append(value)

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def value(self) -> float | None:
        return median(self._samples) if self._samples else None


class Ewma:
    """Exponentially weighted mean; the first sample initializes it."""

    def __init__(self, alpha: float = 0.6) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


class OverheadMeter:
    """Exposed checkpoint time over training wall time, since the last ``reset()``.

    Each iteration reports its wall time and the part of it that checkpointing held the
    training thread (``save()`` and the guard's wait).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wall_s = 0.0
        self.checkpoint_s = 0.0
        self.iterations = 0

    def add(self, wall_s: float, checkpoint_s: float) -> None:
        self.wall_s += wall_s
        self.checkpoint_s += checkpoint_s
        self.iterations += 1

    @property
    def overhead(self) -> float:
        """Fraction of time checkpointing added to the run: ``exposed / (wall - exposed)``."""
        useful = self.wall_s - self.checkpoint_s
        return self.checkpoint_s / useful if useful > 0 else 0.0
