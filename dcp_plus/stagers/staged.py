"""The staged state dict, and how it crosses into DCP's checkpoint process without a copy.

:class:`StagedStateDict` is what ``ArenaStager.stage()`` resolves to. Two properties matter:

* Its lifetime marks the end of a persist. DCP drops the staged dict when ``save`` returns (the
  thread executor's work item, or the process executor's request, goes away), which fires a
  ``weakref.finalize`` that hands the arena buffer back to the stager.
* It pickles by reference. ``AsyncCheckpointerType.PROCESS`` sends the staged dict to a daemon
  process with ``torch.multiprocessing``; torch's own tensor reducer would copy every
  slab-backed tensor into a fresh torch shared-memory segment (and dup one fd per tensor).
  ``__reduce__`` instead sends ``(slab name, offset, dtype, shape)`` for every tensor that lives
  in a registered slab; the receiving process maps each slab once by name, registers it in its
  own :data:`~dcp_plus.memory.slabs.registry` (so dcp_plus writers running there hand out descriptors
  too) and builds views. Mappings are cached per process and dropped once the creator has
  unlinked the slab.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dcp_plus.errors import StagingError
from dcp_plus.memory.skipped import stale_views
from dcp_plus.memory.slabs import Slab, registry


class StagedStateDict(dict):
    """A ``dict`` of staged values; see the module docstring. Valid until its save persists.

    ``owner`` names the arena buffer it lives in ("" if none); ``on_pickle``, if given, is
    called whenever the dict is pickled (it is crossing into another process). ``digests``:
    the checksums taken during the copy (``stage(..., checksums=True)``), by staged tensor
    ``(data_ptr, nbytes)``; not pickled.
    """

    __slots__ = ("__weakref__", "digests", "on_pickle", "owner")

    def __init__(
        self, *args: Any, owner: str = "", on_pickle: Callable[[], None] | None = None,
        digests: dict[tuple[int, int], str] | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.owner = owner
        self.on_pickle = on_pickle
        self.digests = digests or {}

    def __reduce__(self) -> tuple[Any, ...]:
        on_pickle = getattr(self, "on_pickle", None)
        if on_pickle is not None:
            on_pickle()
        entry = stale_views.get(getattr(self, "owner", ""))
        if entry is not None:
            # ArenaStager only skips tensors when async_save runs the THREAD executor; the
            # check that no stale view is written lives in this process, not in DCP's daemon.
            raise StagingError(
                f"this staged dict has {len(entry.views)} tensor(s) that ArenaStager("
                "skip_unwritten=...) did not copy, and it is being pickled (DCP's PROCESS "
                "executor?): the skip works with the THREAD executor only; stage again "
                "without skip_unwritten, or pass ArenaStager(executor=\"process\")"
            )
        return (_rebuild, (_encode(dict(self)),))


@dataclass(frozen=True, slots=True)
class SlabTensorRef:
    """A picklable pointer to a tensor stored in a named slab."""

    slab: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _walk(value: Any, leaf: Callable[[Any], Any], is_map: Callable[[Any], bool]) -> Any:
    """``value`` with its dicts (``is_map``), lists and tuples rebuilt and ``leaf`` applied
    to everything else."""
    if is_map(value):
        return {k: _walk(v, leaf, is_map) for k, v in value.items()}
    if type(value) is list:
        return [_walk(v, leaf, is_map) for v in value]
    if type(value) is tuple:
        return tuple(_walk(v, leaf, is_map) for v in value)
    return leaf(value)


def _encode_leaf(value: Any) -> Any:
    if type(value) is torch.Tensor:
        ref = registry.lookup(value)
        if ref is not None:
            return SlabTensorRef(ref.slab, ref.offset, value.dtype, tuple(value.shape))
    return value


def _encode(value: Any) -> Any:
    return _walk(value, _encode_leaf, lambda v: isinstance(v, Mapping))


# The process-wide map of slabs this process has mapped by name. Process-wide because the
# unpickling that maps them (in DCP's daemon, or any receiving process) has no object to keep
# it on, and every staged dict of one slab must share one mapping and one registry entry.
_attach_lock = threading.Lock()
_attached: dict[str, tuple[Slab, torch.Tensor]] = {}


def _attach(name: str) -> torch.Tensor:
    """A uint8 tensor over slab ``name``, mapped once per process and registered."""
    with _attach_lock:
        # Forget slabs whose creator has freed them (their mapping lives on in any views).
        for stale in [n for n, (s, _) in _attached.items() if n != name and s.is_unlinked()]:
            slab, _ = _attached.pop(stale)
            registry.unregister(slab)
        hit = _attached.get(name)
        if hit is None:
            slab = Slab(name=name)
            registry.register(slab)
            hit = (slab, slab.tensor())
            _attached[name] = hit
        return hit[1]


def attached_slab_names() -> list[str]:
    """Slabs this process has mapped by name (diagnostics and tests)."""
    with _attach_lock:
        return list(_attached)


def _decode_leaf(value: Any) -> Any:
    if not isinstance(value, SlabTensorRef):
        return value
    base = _attach(value.slab)
    numel = 1
    for d in value.shape:
        numel *= d
    nbytes = numel * value.dtype.itemsize
    return base[value.offset : value.offset + nbytes].view(value.dtype).view(value.shape)


def _decode(value: Any) -> Any:
    return _walk(value, _decode_leaf, lambda v: type(v) is dict)


def _rebuild(encoded: dict[str, Any]) -> dict[str, Any]:
    return _decode(encoded)
