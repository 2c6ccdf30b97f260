"""The files a partner receives replicas into: two per source, reused and kept mapped, as a
stager keeps its two slabs.

Once a replica's record is in place, the older replica's record goes and its file stays,
without a record (nothing reads it), to receive the next replica, renamed and resized. A new
file's pages cost a fault, an allocation and zeroing each as the bytes arrive (on this VM
also a host fault: memory freed goes back to the host within seconds). Measured with
``benchmarks.tiers --gib 1 --saves 6``: a save with the peer tier took 3.7-6.4 s with a new
file each time, 1.1-1.3 s reusing them. Each file also stays mapped in the holder's process
(a mapping keeps its inode alive, so the inode number cannot name another file meanwhile):
mapping it again would fault every 4 KiB page in anew.
"""

from __future__ import annotations

import mmap
import os

import torch

from dcp_plus.memory.slabs import SHM_DIR
from dcp_plus.tiers import names


class ReplicaFiles:
    """Replica files held by rank ``holder`` of job ``job``."""

    def __init__(self, job: str, holder: int) -> None:
        self.job, self.holder = job, holder
        self._maps: dict[int, torch.Tensor] = {}  # inode -> the file mapped, whole

    def open(self, name: str, size: int, owner: int) -> torch.Tensor:
        """The replica file ``name`` of ``size`` bytes, mapped writable: ``owner``'s spare
        file renamed to it when there is one, else a new file."""
        spare = self.spare(owner)
        if spare != name:
            names.unlink(name)  # a re-sent step's older copy
        path = os.path.join(SHM_DIR, name)
        if spare is not None and spare != name:
            try:
                os.rename(os.path.join(SHM_DIR, spare), path)
            except FileNotFoundError:  # removed meanwhile (dcp-plus gc): take a new file
                spare = None
        flags = os.O_RDWR | os.O_NOFOLLOW | (0 if spare else os.O_CREAT | os.O_EXCL)
        fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            ino = os.fstat(fd).st_ino
            whole = self._maps.get(ino)
            if whole is None or whole.numel() < size:
                m = mmap.mmap(fd, max(size, 1))
                whole = self._maps[ino] = torch.frombuffer(m, dtype=torch.uint8,
                                                           count=max(size, 1))
        finally:
            os.close(fd)
        return whole[:size]

    def spare(self, owner: int) -> str | None:
        """A replica file of ``owner``'s held here that no record names, if any."""
        files = [f for f in names.listing(self.job, self.holder) if f.owner == owner]
        recorded = {f.step for f in files if f.kind == "record"}
        unused = [f.name for f in files if f.kind == "replica" and f.step not in recorded]
        return max(unused) if unused else None

    def prune(self, owner: int, keep: int | None) -> None:
        """Remove ``owner``'s files held here but those of step ``keep`` (None: all), except
        the newest older replica file, the spare the next replica is received into."""
        older = [f for f in names.listing(self.job, self.holder)
                 if f.owner == owner and f.owner != self.holder and f.step != keep]
        data = [f for f in older if f.kind == "replica" and f.step is not None]
        spare = max(data, key=lambda f: f.step or 0) if data and keep is not None else None
        for f in sorted(older, key=lambda f: f.kind != "record"):  # records first
            if f != spare:
                names.unlink(f.name)
        self._unmap_removed()

    def _unmap_removed(self) -> None:
        live = set()
        for f in names.listing(self.job, self.holder):
            if f.kind == "replica":
                try:
                    live.add(os.stat(f.path).st_ino)
                except FileNotFoundError:
                    pass
        for ino in [i for i in self._maps if i not in live]:
            del self._maps[ino]

    def close(self) -> None:
        """Unmap every file (a removed file's memory is freed once unmapped)."""
        self._maps.clear()
