"""CachedSavePlanner: DCP's default save planning, done once per state-dict structure."""

from __future__ import annotations

import dataclasses
import logging
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    STATE_DICT_TYPE,
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import SavePlan

from dcp_plus._compat.torch_dcp import flatten_state_dict
from dcp_plus.errors import PlanCacheError
from dcp_plus.format.storage_meta import JsonRecordStorageMeta
from dcp_plus.planners._fingerprint import (
    Entry,
    digest,
    digest_entries,
    group_key,
    structure_entries,
    writer_key,
)
from dcp_plus.planners._flatten import flatten_with_entries
from dcp_plus.planners.cache import (
    FULL,
    HIT,
    CachedMetadata,
    CachePlan,
    GlobalEntry,
    LocalCachePlan,
    Pending,
    PickledOnce,
    PlanCache,
    plain_plan,
    register,
    set_active,
    structure_metadata,
)
from dcp_plus.planners.direct_lookup import DirectLookupPlanner
from dcp_plus.planners.write_set import WriteSetRecorder, records_write_set

log = logging.getLogger(__name__)

# Per-save state that must never travel into DCP's PROCESS-mode daemon.
_TRANSIENT = ("state_dict", "plan", "global_plan", "_metadata_ref", "_cache", "_local_key",
              "_structure_key", "_write_set")


class CachedSavePlanner(DirectLookupPlanner):
    """A ``DefaultSavePlanner`` that plans once per state-dict structure and then reuses it.

    Same deduplication and resharding semantics as DCP's ``DefaultSavePlanner`` (it calls its
    planning code on a miss). Each rank fingerprints its flattened state dict (key paths,
    dtypes, shapes, DTensor / ShardedTensor chunks, process group, writer type and settings);
    when every rank's fingerprint matches an earlier save, the plan exchange and DCP's final
    metadata broadcast carry a 16-byte key per rank instead of the plans, and no plan is
    rebuilt. Any change on any rank replans on all ranks.

    The cache belongs to this instance (two planners never share entries), holds
    ``cache_size`` structures (least recently used evicted), and survives DCP's PROCESS
    executor, which pickles the planner into its daemon on every save.

    Use one instance per job (or per kind of save) and do not run two saves with the same
    instance concurrently.

    Args:
        flatten_state_dict: as in ``DefaultSavePlanner``.
        flatten_sharded_tensors: as in ``DefaultSavePlanner``.
        dedup_save_to_lowest_rank: as in ``DefaultSavePlanner``.
        cache_size: structures remembered (>= 1); 2 covers alternating full / model-only saves.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_save_to_lowest_rank: bool = False,
        *,
        cache_size: int = 4,
    ) -> None:
        super().__init__(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=False,
        )
        if cache_size < 1:
            raise ValueError(f"CachedSavePlanner cache_size must be >= 1, got {cache_size}")
        self.cache_size = cache_size
        self._cache_id = uuid.uuid4().hex
        self._cache: PlanCache = register(self._cache_id, cache_size, pin=False)
        self._local_key = b""
        self._structure_key = b""
        self._fast_flatten = True
        self._write_set = WriteSetRecorder()
        self._writer_key = writer_key(None)
        self._group_key: tuple[Any, ...] | None = None
        self._json_record = False  # this save's writer never pickles the Metadata

    def set_save_context(
        self, storage_writer: Any = None, process_group: dist.ProcessGroup | None = None
    ) -> None:
        """Name the storage writer and process group of the saves that follow.

        DCP hands a planner neither, yet both can change a save plan, so they are part of its
        cache key. Without this call a change of the writer's type or settings between saves
        is not seen (a change of any rank's structure, or of the world size, still replans),
        and the process group counts as the default one. ``CheckpointManager`` calls it
        before each save; with ``dcp.save`` call it whenever the writer or group changes.
        """
        self._writer_key = writer_key(storage_writer)
        self._group_key = group_key(process_group)

    # -- pickling (DCP's PROCESS executor) -------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in _TRANSIENT}
        state["mappings"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._write_set = WriteSetRecorder()
        self._local_key = b""
        self._structure_key = b""
        # In DCP's daemon this object lives for one save; its cache must live on.
        self._cache = register(self._cache_id, self.cache_size, pin=True)

    # -- introspection ---------------------------------------------------------------------

    @property  # type: ignore[override]  # DCP's is a plain attribute, never None
    def metadata(self) -> Metadata | None:
        """The coordinator's ``Metadata`` of the save in flight, held weakly.

        DCP and then the caller of ``dcp.save`` own it; a strong reference here would make
        the next save's planning pay for freeing this one's write results (one object graph
        per item, several milliseconds per 10,000 items).
        """
        ref = self.__dict__.get("_metadata_ref")
        return None if ref is None else ref()

    @metadata.setter
    def metadata(self, md: Metadata | None) -> None:
        self._metadata_ref = None if md is None else weakref.ref(md)

    @property
    def cache(self) -> PlanCache:
        """This planner's cache in this process (hit/miss counters, entries)."""
        return self._cache

    @property
    def last_was_hit(self) -> bool:
        """Whether the last save's plan came from the cache on every rank."""
        return self._cache.last_hit

    def unwritten_tensor_fqns(self, fqns: Sequence[str]) -> frozenset[str]:
        """The tensor fqns this rank's last save did not write (another replica did), or an
        empty set if ``fqns`` differs from that save's tensor keys (``ArenaStager``'s
        ``skip_unwritten``; see ``dcp_plus/planners/write_set.py``)."""
        return self._write_set.unwritten(fqns)

    # -- SavePlanner protocol --------------------------------------------------------------

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Flatten ``state_dict`` as DCP does and fingerprint it.

        A structure seen before is recognised by replaying how it flattened (no key paths
        built); otherwise one pass flattens and lists the entries. Also drops the cache if
        the last save's planning failed.
        """
        cache = self._cache
        if cache.in_flight:
            log.warning(
                "the previous save with this CachedSavePlanner failed during planning; "
                "dropping its plan cache on this rank (all ranks do the same)"
            )
            cache.clear()
        cache.in_flight = True
        cache.pending = None
        set_active(cache)
        self.is_coordinator = is_coordinator
        self._json_record = isinstance(storage_meta, JsonRecordStorageMeta)
        if self.flatten_state_dict and self._fast_flatten and self._fast_set_up(state_dict):
            return
        # DCP's own flatten (and ShardedTensor flattening), then the entries in a second pass.
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        entries = structure_entries(
            self.state_dict, self.mappings if self.flatten_state_dict else None
        )
        self._structure_key = self._structure_digest(entries)

    def _fast_set_up(self, state_dict: STATE_DICT_TYPE) -> bool:
        """Set up from a template replay or the one-pass flatten; False: use DCP's flatten."""
        cache = self._cache
        known = cache.replay(state_dict)
        if known is not None:
            replayed, self._structure_key = known
            self.state_dict, self.mappings = replayed.state_dict, replayed.mappings
            return True
        flat = flatten_with_entries(state_dict)
        if flat is None or flat.has_sharded:
            return False
        key = cache.structure_key(flat.entries, flat.template)
        if key is None:
            # A structure not seen before: check the one-pass flatten against DCP's own,
            # which stays the reference (this save replans anyway).
            sd, mappings = flatten_state_dict(state_dict)
            ours = flat.state_dict
            if not (
                list(sd) == list(ours)
                and mappings == flat.mappings
                and all(a is b for a, b in zip(sd.values(), ours.values(), strict=True))
            ):
                log.warning(
                    "CachedSavePlanner's one-pass flatten differs from DCP's "
                    "flatten_state_dict for this state dict; using DCP's from now on"
                )
                self._fast_flatten = False
                return False
            key = digest_entries(flat.entries)
            cache.remember_structure(flat.entries, key, flat.template)
        self.state_dict, self.mappings = flat.state_dict, flat.mappings
        self._structure_key = key
        return True

    def _structure_digest(self, entries: list[Entry]) -> bytes:
        """The digest of ``entries``, from the cache when this structure was seen before."""
        key = self._cache.structure_key(entries)
        if key is None:
            key = digest_entries(entries)
            self._cache.remember_structure(entries, key)
        return key

    def _context(self) -> tuple[Any, ...]:
        return (
            self._writer_key,
            self._group_key if self._group_key is not None else group_key(),
            self.is_coordinator,
            self.flatten_state_dict,
            self.flatten_sharded_tensors,
            self.dedup_save_to_lowest_rank,
            torch.__version__,
        )

    def create_local_plan(self) -> SavePlan:
        """A ``HIT`` token if the coordinator already holds this structure's local plan."""
        key = digest(repr(self._context()).encode() + self._structure_key)
        self._local_key = key
        self._cache.pending = Pending(local_key=key)
        if key in self._cache.seen:
            plan: SavePlan = CachePlan([], key=key, kind=HIT)
        else:
            local = super().create_local_plan()
            plan = LocalCachePlan(
                local.items, planner_data=local.planner_data, key=key, kind=FULL
            )
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Answer with tokens when the combination is cached; otherwise plan as DCP does."""
        cache = self._cache
        pending = cache.pending
        if pending is None:  # called without create_local_plan on this rank: plan uncached
            pending = cache.pending = Pending(local_key=b"")
        cacheable = all(isinstance(p, CachePlan) and p.key for p in all_plans)
        if not cacheable:
            log.warning("a local plan lost its cache key (writer rebuilt it?): not caching")
            return self._plan_uncached(all_plans)

        plans = [p for p in all_plans if isinstance(p, CachePlan)]
        keys = tuple(p.key for p in plans)
        token_once = self._json_record and len(plans) > 1  # see CachedMetadata
        global_key = digest(b"".join(keys) + len(keys).to_bytes(4, "little"))
        pending.global_key = global_key
        entry = cache.globals.peek(global_key)
        pending.mirror = [(r, p.key, None) for r, p in enumerate(plans) if p.kind == HIT]

        if entry is not None and entry.local_keys == keys and all(p.kind == HIT for p in plans):
            replies: list[SavePlan] = [
                CachePlan([], storage_data=p.storage_data, key=global_key, kind=HIT)
                for p in plans
            ]
            md = CachedMetadata.for_save(entry.metadata, global_key, token_once,
                                         entry.record_memo)
            self.global_plan, self.metadata = replies, md
            return replies, md

        local_plans = []
        for rank, p in enumerate(plans):
            if p.kind == HIT:
                known = cache.mirrored_plan(rank, p.key)
                if known is None:
                    raise PlanCacheError(
                        f"rank {rank} sent plan-cache key {p.key.hex()} that the coordinator "
                        "does not hold; every rank drops its plan cache, save again"
                    )
                local_plans.append(dataclasses.replace(known, storage_data=p.storage_data))
            else:
                local_plans.append(plain_plan(p))
                mirrored = p.received_pickle() or plain_plan(p, storage_data=None)
                pending.mirror.append((rank, p.key, mirrored))

        global_plan, metadata = self._create_global_plan(local_plans)
        struct = structure_metadata(metadata)
        pending.global_entry = GlobalEntry(keys, struct)
        shared = PickledOnce(struct)
        replies = [
            CachePlan(
                g.items,
                storage_data=g.storage_data,
                planner_data=g.planner_data,
                key=global_key,
                kind=FULL,
                # The coordinator's own reply goes through DCP's scatter too: it keeps
                # ``struct`` instead of unpickling a copy.
                metadata=None if p.key == pending.local_key else shared,
            )
            for g, p in zip(global_plan, plans, strict=True)
        ]
        md = CachedMetadata.for_save(struct, global_key, token_once,
                                     pending.global_entry.record_memo)
        # DCP's plans, not the replies: those hold the metadata's pickle (MBs) once sent.
        self.global_plan, self.metadata = global_plan, md
        return replies, md

    def _plan_uncached(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if any(isinstance(p, CachePlan) and p.kind == HIT for p in all_plans):
            raise PlanCacheError(
                "a rank sent a plan-cache token but another rank's plan has no cache key; "
                "every rank drops its plan cache, save again"
            )
        global_plan, metadata = self._create_global_plan([plain_plan(p) for p in all_plans])
        self.global_plan = [plain_plan(p) for p in global_plan]
        self.metadata = metadata
        return self.global_plan, metadata

    @records_write_set
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Expand a ``HIT`` reply from the cache; record a ``FULL`` reply for next time."""
        cache = self._cache
        cache.in_flight = False
        pending = cache.pending
        if pending is None or not isinstance(new_plan, CachePlan) or not new_plan.key:
            cache.pending = None
            self.plan = plain_plan(new_plan) if isinstance(new_plan, CachePlan) else new_plan
            return self.plan
        pending.global_key = new_plan.key
        if new_plan.kind == HIT:
            entry = cache.finals.peek(new_plan.key)
            if entry is None:
                cache.clear()
                raise PlanCacheError(
                    f"the coordinator answered with plan-cache key {new_plan.key.hex()} that "
                    "this rank does not hold; its cache is dropped, save again"
                )
            plan = dataclasses.replace(entry[0], storage_data=new_plan.storage_data)
            cache.hits += 1
            cache.last_hit = True
        else:
            plan = plain_plan(new_plan)
            structure = new_plan.structure()
            if structure is None and pending.global_entry is not None:
                structure = pending.global_entry.metadata  # the coordinator's own reply
            if structure is not None:
                pending.final = (plan, structure)
            cache.misses += 1
            cache.last_hit = False
        cache.commit()
        self.plan = plan
        return plan
