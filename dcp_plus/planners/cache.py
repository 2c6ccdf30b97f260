"""The plan cache of one :class:`~dcp_plus.planners.CachedSavePlanner` and its wire tokens.

Every rank keeps, per planner instance:

* ``seen``: the local-structure digests whose local plan the coordinator holds (an LRU that
  mirrors the coordinator's ``mirror`` of this rank);
* ``finals``: global digest -> (this rank's final plan, the global structure ``Metadata``).

The coordinator also keeps ``mirror[rank]`` (local digest -> local plan) and ``globals``
(global digest -> entry). All of these change only when a save's plan exchange has succeeded
(in ``finish_plan``, which DCP calls on every rank or on none), with the same LRU bound, so the
coordinator knows exactly what every rank holds and can answer a hit with a token.

Caches are found by id in the per-process registry (:mod:`dcp_plus.planners.cache_registry`),
so that a planner pickled into DCP's PROCESS-mode daemon on every save finds the cache it built
there on earlier saves.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan

from dcp_plus.format.record_memo import MEMO_ATTRIBUTE, RecordMemo
from dcp_plus.planners import cache_registry
from dcp_plus.planners._flatten import Flat, Template
from dcp_plus.planners.cache_registry import active_cache, lookup, set_active
from dcp_plus.planners.lru import LRU

log = logging.getLogger(__name__)

HIT = "hit"
FULL = "full"


@dataclass(frozen=True)
class CachePlan(SavePlan):
    """A ``SavePlan`` that also carries cache keys through DCP's plan exchange.

    Upward (rank -> coordinator) ``key`` is the rank's local digest; a ``HIT`` plan has no items
    (the coordinator has them). Downward ``key`` is the global digest; a ``HIT`` reply has no
    items (the rank has its final plan), a ``FULL`` reply has the items and the global
    structure ``metadata`` for the rank to cache. Writers' ``dataclasses.replace(plan,
    storage_data=...)`` keeps these fields.
    """

    key: bytes = b""
    kind: str = FULL
    metadata: Metadata | PickledOnce | None = None

    def structure(self) -> Metadata | None:
        """The structure ``metadata`` of a ``FULL`` reply, however it travelled."""
        md = self.metadata
        return md.value if isinstance(md, PickledOnce) else md

    def received_pickle(self) -> bytes | None:
        """The pickle of this plan's stock part it was unpickled from (a
        :class:`LocalCachePlan` received by DCP's gather, say), else None."""
        data: bytes | None = self.__dict__.get("_pickle")
        return data


@dataclass(frozen=True)
class LocalCachePlan(CachePlan):
    """A rank's ``FULL`` local plan: it travels to the coordinator as its own pickle.

    The coordinator keeps a miss's local plans pickled (its ``mirror``); DCP's gather has just
    unpickled them from the bytes the ranks sent. Pickled, this plan puts its stock
    ``SavePlan`` part (items, planner data; no storage data) into one inner pickle, and the
    unpickled plan keeps those bytes (:meth:`received_pickle`), the exact pickle of what it
    was rebuilt from, so the coordinator stores them instead of pickling every rank's plan
    again (0.2 s per rank at 10,000 items). A copy (``copy``, ``deepcopy``, ``replace``) has
    none, so a copy whose ``items`` someone then edits is never mirrored from stale bytes.
    """

    def __copy__(self) -> LocalCachePlan:
        return dataclasses.replace(self)  # shallow, as for any dataclass, and without the bytes

    def __deepcopy__(self, memo: dict[int, Any]) -> LocalCachePlan:
        return dataclasses.replace(self, **{  # without the bytes, as __copy__
            f.name: copy.deepcopy(getattr(self, f.name), memo) for f in dataclasses.fields(self)
        })

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        inner = pickle.dumps(
            plain_plan(self, storage_data=None), protocol=pickle.HIGHEST_PROTOCOL
        )
        return (_rebuild_local_plan, (inner, self.storage_data, self.key, self.kind))


def _rebuild_local_plan(inner: bytes, storage_data: Any, key: bytes, kind: str) -> LocalCachePlan:
    plan: SavePlan = pickle.loads(inner)
    out = LocalCachePlan(
        plan.items, storage_data=storage_data, planner_data=plan.planner_data,
        usable=plan.usable, key=key, kind=kind,
    )
    object.__setattr__(out, "_pickle", inner)  # the bytes that rebuild exactly this plan
    return out


class PickledOnce:
    """A value that every message carrying it shares one pickle of.

    A miss replies to every rank with its final plan and the same structure ``Metadata``
    (O(tensors x chunks)); DCP's scatter pickles each reply on its own, so without this the
    coordinator would pickle that metadata once per rank. Unpickles as the value itself.
    """

    def __init__(self, value: Any) -> None:
        self.value = value
        self._data: bytes | None = None

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        if self._data is None:
            self._data = pickle.dumps(self.value, protocol=pickle.HIGHEST_PROTOCOL)
        return (_unpickle_shared, (self._data,))


def _unpickle_shared(data: bytes) -> Any:
    # Bytes of the coordinator's PickledOnce, inside the payload DCP's scatter unpickles.
    return pickle.loads(data)


def plain_plan(plan: SavePlan, **changes: Any) -> SavePlan:
    """``plan`` as a stock ``SavePlan`` (cache fields dropped), with ``changes`` applied."""
    fields = {
        "items": plan.items,
        "storage_data": plan.storage_data,
        "planner_data": plan.planner_data,
        "usable": plan.usable,
    }
    fields.update(changes)
    return SavePlan(**fields)


def structure_metadata(md: Metadata) -> Metadata:
    """A shallow copy of ``md`` with only the structure (no storage data, meta or version)."""
    return Metadata(
        state_dict_metadata=dict(md.state_dict_metadata),
        planner_data=md.planner_data,
    )


class CachedMetadata(Metadata):
    """The coordinator's ``Metadata`` for one save, sent as a token in DCP's final broadcast.

    A reducer cannot tell who pickles it, so the planner says, per save, whether the first
    pickle of this object is DCP's broadcast (``token_once``): the save's writer never
    pickles the ``Metadata`` (a dcp_plus writer, whose commit record is JSON) and the world
    has more than one rank (with one, DCP's broadcast pickles nothing or sends it nowhere).
    Only that first pickle is the token; every other one (a stock writer pickling its commit
    record, DCP's PROCESS daemon returning the result, the caller) is a plain stock
    ``Metadata``, loadable without dcp_plus. Copies are plain ``Metadata`` and leave the token
    in place.
    """

    _global_key: bytes
    _token_once = False

    @classmethod
    def for_save(
        cls, md: Metadata, global_key: bytes, token_once: bool = False,
        memo: RecordMemo | None = None,
    ) -> CachedMetadata:
        """A fresh per-save copy of the cached structure ``md`` (writers mutate it); its first
        pickle is the broadcast token if ``token_once``; ``memo``: the structure's
        :class:`~dcp_plus.format.record_memo.RecordMemo` (never pickled)."""
        out = cls(
            state_dict_metadata=dict(md.state_dict_metadata),
            planner_data=md.planner_data,
        )
        out._global_key = global_key
        out._token_once = token_once
        if memo is not None:
            setattr(out, MEMO_ATTRIBUTE, memo)
        return out

    def plain(self) -> Metadata:
        """This metadata as a stock ``Metadata``."""
        return Metadata(
            state_dict_metadata=self.state_dict_metadata,
            planner_data=self.planner_data,
            storage_data=self.storage_data,
            storage_meta=self.storage_meta,
            version=self.version,
        )

    def __copy__(self) -> Metadata:
        return self.plain()

    def __deepcopy__(self, memo: dict[int, Any]) -> Metadata:
        return copy.deepcopy(self.plain(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._token_once:
            self._token_once = False
            return (_expand_metadata, (self._global_key, self.storage_meta, self.version))
        return (
            Metadata,
            (
                self.state_dict_metadata,
                self.planner_data,
                self.storage_data,
                self.storage_meta,
                self.version,
            ),
        )


def _expand_metadata(
    global_key: bytes, storage_meta: StorageMeta | None, version: str | None
) -> Metadata:
    """Unpickle a broadcast token into the receiving rank's cached structure metadata.

    The receiving thread is the one running the save, so its planner's cache is the one that
    :func:`~dcp_plus.planners.cache_registry.set_active` recorded in ``set_up_planner``.
    """
    cache: PlanCache | None = active_cache()
    entry = cache.finals.peek(global_key) if cache is not None else None
    if entry is None:
        log.warning(
            "no plan-cache entry %s on this rank: the Metadata dcp.save returns here is empty "
            "(the committed checkpoint is not affected)",
            global_key.hex(),
        )
        return Metadata({}, storage_meta=storage_meta, version=version)
    md = entry[1]
    return Metadata(
        state_dict_metadata=md.state_dict_metadata,
        planner_data=md.planner_data,
        storage_meta=storage_meta,
        version=version,
    )


@dataclass
class GlobalEntry:
    """The coordinator's record of one planned combination of local structures."""

    local_keys: tuple[bytes, ...]
    metadata: Metadata
    record_memo: RecordMemo = field(default_factory=RecordMemo)
    """What a dcp_plus writer's commit record of this structure can reuse at the next save."""


@dataclass
class Pending:
    """Cache updates of the save in flight, applied by ``commit`` once planning succeeded."""

    local_key: bytes
    global_key: bytes = b""
    final: tuple[SavePlan, Metadata] | None = None
    mirror: list[tuple[int, bytes, SavePlan | bytes | None]] = field(default_factory=list)
    """(rank, local digest, local plan to store (or its pickle), or None to mark it recently
    used)."""
    global_entry: GlobalEntry | None = None


class PlanCache:
    """Cache state of one planner instance in one process (see the module docstring)."""

    def __init__(self, cache_id: str, capacity: int) -> None:
        self.cache_id = cache_id
        self.capacity = capacity
        self.seen: LRU[bytes, bool] = LRU(capacity)
        self.finals: LRU[bytes, tuple[SavePlan, Metadata]] = LRU(capacity)
        self.mirror: dict[int, LRU[bytes, bytes]] = {}
        """Per rank: local digest -> that rank's local plan, pickled. Read only when some
        rank's structure changed; as live dataclasses it would be several GC-tracked
        objects per item and rank, traversed by every full collection of the trainer."""
        self.globals: LRU[bytes, GlobalEntry] = LRU(capacity)
        self.structures: list[tuple[list[Any], bytes, Template | None]] = []
        """(structure entries, their digest, how such a state dict flattens), most recently
        used first; local to this rank."""
        self.pending: Pending | None = None
        self.in_flight = False
        self.hits = 0
        self.misses = 0
        self.replays = 0
        """Saves whose flatten was a template replay (see ``_flatten.py``)."""
        self.last_hit = False

    def clear(self) -> None:
        """Forget everything (after a save whose plan exchange failed)."""
        self.seen.clear()
        self.finals.clear()
        self.mirror.clear()
        self.globals.clear()
        self.structures.clear()
        self.pending = None

    def replay(self, state_dict: Mapping[str, Any]) -> tuple[Flat, bytes] | None:
        """The flatten of ``state_dict`` and its structure digest, if it has a structure seen
        before (:meth:`Template.replay`, most recently used first), else None."""
        for i, (_, key, template) in enumerate(self.structures):
            flat = None if template is None else template.replay(state_dict)
            if flat is not None:
                if i:
                    self.structures.insert(0, self.structures.pop(i))
                self.replays += 1
                return flat, key
        return None

    def structure_key(self, entries: list[Any], template: Template | None = None) -> bytes | None:
        """The digest of a structure equal to ``entries`` seen before, or None.

        Compares the lists themselves (C-level, mostly identity checks; lists of different
        lengths differ at once), so no per-value hashing happens on a hit. A ``template``
        replaces the structure's recorded one (its containers changed type, say).
        """
        for i, (known, key, old) in enumerate(self.structures):
            if known == entries:
                del self.structures[i]
                self.structures.insert(0, (known, key, template or old))
                return key
        return None

    def remember_structure(
        self, entries: list[Any], key: bytes, template: Template | None = None
    ) -> None:
        """Record ``entries``, their digest and template (at most ``capacity`` structures)."""
        self.structures.insert(0, (entries, key, template))
        del self.structures[self.capacity:]

    def mirrored_plan(self, rank: int, key: bytes) -> SavePlan | None:
        """The local plan ``rank`` sent under ``key``, if the coordinator holds it."""
        data = self.mirror_of(rank).peek(key)
        # Pickled by commit() here, or the bytes of that rank's plan that DCP's gather
        # unpickled already (the process group is trusted the same way): never other data.
        return None if data is None else pickle.loads(data)

    def mirror_of(self, rank: int) -> LRU[bytes, bytes]:
        """The coordinator's copy of what ``rank`` has sent."""
        m = self.mirror.get(rank)
        if m is None:
            m = self.mirror[rank] = LRU(self.capacity)
        return m

    def commit(self) -> None:
        """Apply the pending updates of a save whose plan exchange succeeded."""
        p = self.pending
        self.pending = None
        if p is None:
            return
        if not p.global_key:
            return
        self.seen.put(p.local_key, True)
        if p.final is not None:
            self.finals.put(p.global_key, p.final)
        else:
            self.finals.get(p.global_key)
        for rank, key, plan in p.mirror:
            m = self.mirror_of(rank)
            if isinstance(plan, bytes):
                m.put(key, plan)
            elif plan is not None:
                m.put(key, pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
            else:
                m.get(key)
        if p.global_entry is not None:
            self.globals.put(p.global_key, p.global_entry)
        else:
            self.globals.get(p.global_key)


def register(cache_id: str, capacity: int, pin: bool) -> PlanCache:
    """The :class:`PlanCache` with this id in this process, created if needed; ``pin`` keeps
    it alive after its planner is gone (see :func:`cache_registry.register`)."""
    cache: PlanCache = cache_registry.register(cache_id, lambda: PlanCache(cache_id, capacity),
                                               pin)
    return cache


__all__ = [
    "FULL",
    "HIT",
    "CachePlan",
    "CachedMetadata",
    "LRU",
    "PlanCache",
    "lookup",
    "register",
    "set_active",
]
