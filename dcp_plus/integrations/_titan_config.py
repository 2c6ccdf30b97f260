"""``DcpPlusCheckpointManager``'s settings on top of TorchTitan's, and their checks, each
error naming the setting as a TorchTitan user writes it (``checkpoint.<field>``).

Imported only through :mod:`dcp_plus.integrations.torchtitan`, which checks that TorchTitan is
installed first. The manager's nested ``Config`` subclasses :class:`DcpPlusConfig` (TorchTitan
wires ``build()`` to the class that declares the ``Config``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from torchtitan.components.checkpointer import CheckpointManager

from dcp_plus.errors import InvalidOptionError
from dcp_plus.manager.increments import IncrementalOptions
from dcp_plus.stagers.device_copy import check_device_copy
from dcp_plus.storage.direct import DEFAULT_STREAMS
from dcp_plus.storage.rate import shaping_problem
from dcp_plus.storage.urls import is_url
from dcp_plus.tiers import TierOptions
from dcp_plus.tiers.names import check_job_id
from dcp_plus.writers.chunk_encode import part_bytes_problem

CODECS = ("identity", "zstd", "zstd+shuffle")



@dataclass(kw_only=True, slots=True)
class DcpPlusConfig(CheckpointManager.Config):
    """TorchTitan's DCP checkpoint settings and dcp_plus's (``checkpoint.*``)."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
    """Save mode. Both async modes stage into dcp_plus's ArenaStager."""

    async_executor: Literal["thread", "process"] = "thread"
    """Where DCP runs the upload of an async save: a thread of the trainer, or DCP's
    background process (which then also plans; the stager hands it slab names)."""

    stager_buffers: int = 1
    """ArenaStager buffers: 1 waits for the previous persist before a new snapshot; 2 lets
    a snapshot be taken while the previous one persists (twice the shared memory)."""

    stager_max_bytes: int | None = None
    """Upper bound on the stager's shared memory; ``None`` for none."""

    stager_device_copy: str = "auto"
    """GPU-mode snapshots: ``"auto"`` copies into a device buffer first when device memory
    allows (the step after a save then waits for an HBM copy, not the host copy),
    ``"always"``, or ``"never"`` (see ``docs/stager.md``, "GPU mode")."""

    stager_threads: int | None = None
    """CPU copy threads of the stager (default: min(2, cpu count))."""

    planner: Literal["cached", "default"] = "cached"
    """``cached``: CachedSavePlanner (plans once per state-dict structure);
    ``default``: DCP's DefaultSavePlanner."""

    plan_cache_size: int = 4
    """Structures the CachedSavePlanner remembers (full and model-only saves use two)."""

    writer: Literal["auto", "local", "object_store"] = "auto"
    """``auto``: ObjectStoreWriter when the checkpoint folder is a URL (``s3://...``),
    LocalWriter otherwise."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec storage options for ObjectStoreWriter/Reader, passed through untouched."""

    writer_workers: int = 2
    """LocalWriter: size of the shared writer-process pool."""

    writer_threads: int = 2
    """LocalWriter: parallel files for data outside the stager's slabs."""

    fsync: bool = True
    """LocalWriter: fsync data files and directories."""

    writer_direct_io: Literal["auto", "on", "off"] = "auto"
    """LocalWriter: ``O_DIRECT`` data files, no checkpoint bytes left in the page cache
    (``auto``: where the file system takes it, logged once where not; ``on``: the same,
    the fallback a warning; ``off``: buffered writes)."""

    writer_streams: int = DEFAULT_STREAMS
    """LocalWriter: ``O_DIRECT`` writes in flight per rank."""

    writer_max_bytes_per_s: float | None = None
    """Either writer: cap on each rank's data write rate in bytes per second (all of
    its processes and streams together); ``None``: no cap."""

    writer_stagger: float = 0.0
    """Either writer: rank ``LOCAL_RANK`` starts writing its data ``LOCAL_RANK *
    writer_stagger`` seconds into its background persist, so a node's ranks
    interleave."""

    compression: Literal["identity", "zstd", "zstd+shuffle"] = "identity"
    """Codec for every tensor."""

    verify_on_load: bool = True
    """Check every extent's checksum while loading."""

    allow_pickle_on_load: bool = False
    """Also load stock-DCP checkpoints (e.g. an ``initial_load_path`` written by
    TorchTitan's own manager), whose ``.metadata`` is a pickle. Only for trusted
    checkpoints."""

    adaptive_budget: float | None = None
    """Checkpoint when ``dcp_plus.schedule.AdaptiveInterval(p=adaptive_budget)``
    (CheckFreq) says so instead of every ``interval`` steps: it measures the iteration,
    staging and persist times and the exposed checkpoint cost, and picks the interval k
    that keeps the exposed cost under this fraction of training time (0.05 = 5%).
    Rank 0 decides and broadcasts; forced saves (the last step,
    ``enable_first_step_checkpoint``) stay TorchTitan's. ``None``: ``interval``."""

    adaptive_warmup: int = 5
    """With ``adaptive_budget``: iterations measured before the policy's first
    (profiling) checkpoint, counted from the start or resume of the job."""

    incremental: bool = False
    """Incremental checkpoints (``docs/incremental.md``): each save writes only the parts
    that changed since the previous committed one and references the rest; the
    ``keep_latest_k`` purge spares every step folder a kept one references."""

    incremental_full_every: int = 8
    """With ``incremental``: every N-th save (counted from the job's start or resume)
    references nothing, so chains are at most N saves long."""

    incremental_delta: bool = False
    """With ``incremental``: changed parts as XOR deltas against the previous snapshot
    (needs ``stager_buffers=2``, which keeps it)."""

    incremental_part_bytes: int = 1 << 20
    """With ``incremental``: the size of the parts tensors are compared by."""

    memory_tier: bool = False
    """Keep every save's snapshot in ``/dev/shm`` (or ``DCPP_SHM_DIR``), where a restarted
    trainer of the job finds it: resume then restores from memory (survives the trainer's crash or ``kill -9``, not
    the node's loss). Needs the ``thread`` executor; the stager then has two buffers (the
    newest snapshot stays while the next is taken). With ``async_mode="disabled"`` each save
    returns once its snapshot is kept (and replicated, and persisted when due)."""

    durable_every: int = 1
    """With ``memory_tier``: the 1st, (N+1)-th, (2N+1)-th ... save (counted in saves, not
    steps) is also persisted to its ``step-N`` folder; the others live in memory only."""

    peer_tier: bool = False
    """With ``memory_tier``: also replicate each snapshot into a partner rank's shared memory
    (rank + ``ranks_per_node``, mod the world), over gloo; survives the loss of a node."""

    ranks_per_node: int | None = None
    """Ranks per node (failure domain) for ``peer_tier``; default: torchrun's
    ``LOCAL_WORLD_SIZE``."""

    peer_partner: str | None = None
    """For ``peer_tier`` with explicit failure domains: ``"package.module:function"``, a
    function ``partner(rank) -> rank`` naming who holds each rank's replica (a permutation
    with no rank its own partner, checked at start); default: ``rank + ranks_per_node``."""

    job_id: str | None = None
    """Names the job's snapshots in ``/dev/shm`` (1-64 characters of ``A-Za-z0-9_.``);
    default: a hash of the checkpoint folder, so two jobs never share a snapshot."""

    memory_tier_bytes: int | None = None
    """Expected snapshot bytes per rank: when the manager is built, the shared memory the
    tiers need at the peak (2x this, 4x with ``peer_tier``) is checked against ``/dev/shm``
    and MemAvailable (``CapacityError`` names the numbers); ``None``: not checked."""

    def tier_options(self) -> TierOptions:
        """The memory and peer tier settings, as ``dcp_plus.manager.CheckpointManager``
        takes them (raises ``ValueError`` naming a bad one)."""
        return TierOptions(self.memory_tier, self.durable_every, self.job_id, self.peer_tier,
                           self.ranks_per_node, _partner_function(self.peer_partner),
                           self.memory_tier_bytes)

    def __post_init__(self) -> None:
        CheckpointManager.Config.__post_init__(self)
        check_config(self)


def check_config(cfg: Any) -> None:
    """Raise ``ValueError`` naming the first bad field of ``cfg``."""
    if cfg.stager_buffers not in (1, 2):
        raise ValueError(f"checkpoint.stager_buffers must be 1 or 2, got {cfg.stager_buffers}")
    check_device_copy(cfg.stager_device_copy, "checkpoint.stager_device_copy")
    if cfg.plan_cache_size < 1:
        raise ValueError(f"checkpoint.plan_cache_size must be >= 1, got {cfg.plan_cache_size}")
    if cfg.compression not in CODECS:
        raise ValueError(f"checkpoint.compression must be one of {CODECS}, got "
                         f"{cfg.compression!r}")
    if cfg.adaptive_budget is not None and not 0 < cfg.adaptive_budget < 1:
        raise ValueError(f"checkpoint.adaptive_budget must be in (0, 1), got "
                         f"{cfg.adaptive_budget}")
    if cfg.adaptive_warmup < 1:
        raise ValueError(f"checkpoint.adaptive_warmup must be >= 1, got {cfg.adaptive_warmup}")
    bad = shaping_problem(cfg.writer_max_bytes_per_s, cfg.writer_stagger)
    if bad is not None:
        raise ValueError(f"checkpoint.writer_{bad[0]} {bad[1]}")
    if cfg.writer == "local" and is_url(cfg.folder):
        raise ValueError(f"checkpoint.writer='local' cannot write to the URL {cfg.folder!r}; "
                         "use writer='object_store' or 'auto'")
    _check_incremental(cfg)
    _check_tiers(cfg)


def incremental_options(cfg: Any) -> IncrementalOptions:
    """The manager's options for ``cfg``'s ``incremental*`` fields."""
    try:
        return IncrementalOptions(cfg.incremental, cfg.incremental_full_every,
                                  cfg.incremental_delta)
    except InvalidOptionError as e:
        raise ValueError(f"checkpoint.incremental: {e}") from None


def _check_incremental(cfg: Any) -> None:
    incremental_options(cfg)
    problem = part_bytes_problem(cfg.incremental_part_bytes)
    if problem is not None:
        raise ValueError(f"checkpoint.incremental_part_bytes {problem}")
    if cfg.incremental_delta and (cfg.stager_buffers != 2 or cfg.async_mode == "disabled"):
        raise ValueError("checkpoint.incremental_delta takes XOR deltas against the previous "
                         "snapshot, which the stager keeps only with "
                         "checkpoint.stager_buffers=2 and an async_mode")


def _partner_function(path: str | None) -> Callable[[int], int] | None:
    """The function ``checkpoint.peer_partner`` names, imported (``ValueError`` naming the
    path when it cannot be)."""
    if path is None:
        return None
    module, sep, name = path.partition(":")
    if not (module and sep and name):
        raise ValueError(f"peer_partner={path!r} is not 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"peer_partner={path!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ValueError(f"peer_partner={path!r} is a {type(fn).__name__}, not a function")
    return cast(Callable[[int], int], fn)


def _check_tiers(cfg: Any) -> None:
    if cfg.peer_partner is not None and not cfg.peer_tier:
        raise ValueError(f"checkpoint.peer_partner={cfg.peer_partner!r} needs "
                         "checkpoint.peer_tier=True")
    try:
        cfg.tier_options()
        if cfg.job_id is not None:
            check_job_id(cfg.job_id)
    except ValueError as e:
        raise ValueError(f"checkpoint.{e}") from e
    if cfg.memory_tier_bytes is not None and cfg.memory_tier_bytes < 1:
        raise ValueError("checkpoint.memory_tier_bytes must be >= 1 or None, got "
                         f"{cfg.memory_tier_bytes}")
    if not cfg.memory_tier:
        if cfg.durable_every != 1:
            raise ValueError(f"checkpoint.durable_every={cfg.durable_every} needs "
                             "checkpoint.memory_tier=True: without the memory tier every save "
                             "is persisted")
        return
    if cfg.async_executor != "thread":
        raise ValueError("checkpoint.memory_tier=True needs checkpoint.async_executor='thread' "
                         f"(the tier hands DCP its snapshot), got {cfg.async_executor!r}")
