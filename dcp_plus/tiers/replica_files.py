"""The files a partner receives replicas into: two per source, reused and kept mapped, as a
stager keeps its two slabs.

Once a replica's record is in place, the older replica's record goes and its file stays,
without a record (nothing reads it), to receive the next replica, renamed and resized. A new
file's pages cost a fault, an allocation and zeroing each as the bytes arrive (on this VM
also a host fault: memory freed goes back to the host within seconds), and a file mapped
afresh a fault per 4 KiB page. Measured with ``benchmarks.tiers --gib 1 --saves 6``, saves
3-6 with the peer tier: 2.3-6.8 s with a new file each time, 1.1-1.4 s reusing the files,
0.62-0.82 s reusing them and keeping them mapped. A mapping keeps its inode alive,
so the inode number cannot name another file while it is kept.
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
        self._maps: dict[tuple[int, int], torch.Tensor] = {}  # (dev, inode) -> whole file

    def take(self, name: str, size: int, owner: int) -> torch.Tensor:
        """The replica file ``name`` of ``size`` bytes, mapped writable: ``owner``'s spare
        file renamed to it when there is one, else a new file."""
        spare = self.spare(owner, name)
        path = os.path.join(SHM_DIR, name)
        if spare != name:
            names.unlink(name)  # a re-sent step's older copy, its record already gone
            if spare is not None:
                try:
                    os.rename(os.path.join(SHM_DIR, spare), path)
                except OSError:  # removed meanwhile (dcp-plus gc), or not renamable
                    spare = None
        flags = os.O_RDWR | os.O_NOFOLLOW | (0 if spare else os.O_CREAT | os.O_EXCL)
        fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            whole = self._maps.get(key)
            if whole is None or whole.numel() < size:
                m = mmap.mmap(fd, max(size, 1))
                whole = self._maps[key] = torch.frombuffer(m, dtype=torch.uint8,
                                                           count=max(size, 1))
        finally:
            os.close(fd)
        return whole[:size]

    def spare(self, owner: int, name: str | None = None) -> str | None:
        """A replica file of ``owner``'s held here that no record names: ``name`` itself if
        it is one (a re-sent step), else the newest; None if there is none."""
        files = [f for f in names.listing(self.job, self.holder) if f.owner == owner]
        recorded = {f.step for f in files if f.kind == "record"}
        unused = [f for f in files if f.kind == "replica" and f.step not in recorded]
        if any(f.name == name for f in unused):
            return name
        return max(unused, key=lambda f: f.step or 0).name if unused else None

    def prune(self, owner: int, keep: int) -> None:
        """Remove ``owner``'s files held here but those of step ``keep``, except the newest
        older replica file, the spare the next replica is received into."""
        files = [f for f in names.listing(self.job, self.holder) if f.owner == owner]
        older = [f for f in files if f.step != keep]
        spare = max((f for f in older if f.kind == "replica"), key=lambda f: f.step or 0,
                    default=None)
        for f in sorted(older, key=lambda f: f.kind != "record"):  # records first
            if f != spare:
                names.unlink(f.name)
        self._keep_mapped([f for f in files if f.kind == "replica" and f.step == keep] +
                          ([spare] if spare is not None else []))

    def unmap_removed(self) -> None:
        """Unmap the files whose names are gone (their memory is freed once unmapped)."""
        self._keep_mapped([f for f in names.listing(self.job, self.holder)
                           if f.kind == "replica"])

    def _keep_mapped(self, files: list[names.TierFile]) -> None:
        """Keep the mappings of ``files`` only."""
        live: set[tuple[int, int]] = set()
        for f in files:
            try:
                st = os.stat(f.path)
            except FileNotFoundError:
                continue
            live.add((st.st_dev, st.st_ino))
        for key in [k for k in self._maps if k not in live]:
            del self._maps[key]

    def close(self) -> None:
        """Unmap every file."""
        self._maps.clear()
