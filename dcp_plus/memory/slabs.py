"""Named shared-memory slabs, and a registry that maps tensor memory back to them.

A slab is one file in the shared-memory directory (``/dev/shm``, or ``DCPP_SHM_DIR``: see
:mod:`dcp_plus.shm`) mapped once. Stagers allocate a few large slabs; writers look a tensor's
address up in the registry and, when it lives in a slab, hand worker processes a
``(slab name, offset, length)`` descriptor instead of copying the bytes.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import mmap
import os
import threading
import uuid
from dataclasses import dataclass

import torch

from dcp_plus.shm import SHM_DIR as SHM_DIR  # re-exported: the tiers read it from here

PREFIX = "dcpp-"

_unclosed: set[str] = set()
"""Names of the slabs this process created and has not closed."""


def _creator(name: str) -> int | None:
    """The pid a slab name carries (its creator's), or None for a name not made here."""
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX):].split("-", 1)[0])
    except ValueError:
        return None


@atexit.register
def _unlink_unclosed() -> None:
    # Shared memory outlives the process: a script that ends without closing its stager
    # would leave its staging memory (the state's size) in /dev/shm until the next stager on
    # the node removes orphans. A forked child inherits the set; only the creator unlinks.
    pid = os.getpid()
    for name in list(_unclosed):
        if _creator(name) == pid:
            with contextlib.suppress(OSError):
                os.unlink(_slab_path(name))


def _slab_path(name: str) -> str:
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a dcp_plus slab name: {name!r}")
    return os.path.join(SHM_DIR, name)


class Slab:
    """One named shared-memory segment, mapped read-write in this process.

    Args:
        size: bytes to allocate (creates a new segment) — or
        name: attach to an existing segment created by another process.
    """

    def __init__(self, size: int | None = None, *, name: str | None = None) -> None:
        if (size is None) == (name is None):
            raise ValueError("Slab() takes exactly one of size= or name=")
        self.owner = name is None
        self.name = name or f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = _slab_path(self.name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if self.owner else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if self.owner:
                assert size is not None
                os.ftruncate(fd, max(size, 1))
            self.size = os.fstat(fd).st_size if size is None else size
            self._mmap: mmap.mmap | None = mmap.mmap(fd, max(self.size, 1))
        except BaseException:
            os.close(fd)
            if self.owner:
                os.unlink(path)
            raise
        os.close(fd)
        self.address = torch.frombuffer(self._mmap, dtype=torch.uint8).data_ptr()
        if self.owner:
            _unclosed.add(self.name)

    @property
    def buffer(self) -> memoryview:
        """A writable view of the whole slab."""
        if self._mmap is None:
            raise ValueError(f"slab {self.name} is closed")
        return memoryview(self._mmap)[: self.size]

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor aliasing the whole slab."""
        if self._mmap is None:
            raise ValueError(f"slab {self.name} is closed")
        return torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.size)

    def resize(self, size: int) -> None:
        """Change the segment's size before anything views it (creator only).

        ``mremap`` under the hood: pages up to the smaller size keep their contents *and* their
        page-table entries (a fresh mapping would take a minor fault per page), pages past a
        smaller size are given back. The address may change, so no tensor may view it yet.
        """
        if not self.owner or self._mmap is None:
            raise ValueError(f"cannot resize slab {self.name}: not its creator, or closed")
        self._mmap.resize(max(size, 1))  # also truncates the segment (mmap keeps its fd)
        self.size = size
        self.address = torch.frombuffer(self._mmap, dtype=torch.uint8).data_ptr()

    def is_unlinked(self) -> bool:
        """True when the segment's name is gone (its creator freed it)."""
        return not os.path.exists(os.path.join(SHM_DIR, self.name))

    def close(self) -> None:
        """Drop this handle's mapping; the creator also unlinks the name (at the latest when
        its process exits normally). Idempotent.

        The memory itself is unmapped when the last tensor made by :meth:`tensor` is gone
        (``torch.frombuffer`` keeps a reference to the mapping, not a buffer export, so an
        explicit unmap here would leave such tensors dangling).
        """
        self._mmap = None
        if self.owner:
            self.owner = False
            _unclosed.discard(self.name)
            try:
                os.unlink(_slab_path(self.name))
            except FileNotFoundError:
                pass


@dataclass(frozen=True)
class SlabRef:
    """Where some bytes live: a slab name and a byte range inside it."""

    slab: str
    offset: int
    length: int


class SlabRegistry:
    """Thread-safe map from address ranges to the slabs that hold them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._slabs: list[Slab] = []

    def register(self, slab: Slab) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, slab.address)
            self._starts.insert(i, slab.address)
            self._slabs.insert(i, slab)

    def unregister(self, slab: Slab) -> None:
        with self._lock:
            for i, s in enumerate(self._slabs):
                if s is slab:
                    del self._starts[i], self._slabs[i]
                    return

    def by_name(self, name: str) -> Slab | None:
        """The registered slab called ``name`` (mapped in this process), or None."""
        with self._lock:
            return next((s for s in self._slabs if s.name == name), None)

    def lookup(self, tensor: torch.Tensor) -> SlabRef | None:
        """The slab range holding a contiguous CPU tensor's bytes, or None."""
        # is_cpu and nbytes: a save looks up every tensor, and ``device.type`` costs 1 us
        if not tensor.is_cpu or not tensor.is_contiguous():
            return None
        return self.locate(tensor.data_ptr(), tensor.nbytes)

    def locate(self, ptr: int, nbytes: int) -> SlabRef | None:
        """The slab range holding the ``nbytes`` bytes at address ``ptr``, or None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            slab = self._slabs[i]
        if ptr + nbytes > slab.address + slab.size:
            return None
        return SlabRef(slab.name, ptr - slab.address, nbytes)


registry = SlabRegistry()
"""The one process-wide registry: stagers (and slabs mapped by name) fill it, writers consult it.

Process-wide on purpose: a writer gets only tensors from DCP (no link to the stager that staged
them), so it must find the slab behind any address whichever stager or unpickled staged dict in
this process registered it."""


def remove_orphans() -> list[str]:
    """Unlink slabs whose creating process is gone (e.g. a trainer killed with SIGKILL).

    Slab names carry the creator's pid; a live pid (even a reused one) is left alone.
    """
    removed = []
    for name in os.listdir(SHM_DIR):
        pid = _creator(name)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
        except PermissionError:  # alive, owned by someone else
            continue
    return removed
