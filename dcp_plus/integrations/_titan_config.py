"""Checks of ``DcpPlusCheckpointManager.Config``'s fields, each error naming the setting as a
TorchTitan user writes it (``checkpoint.<field>``)."""

from __future__ import annotations

from typing import Any

from dcp_plus.errors import InvalidOptionError
from dcp_plus.manager.increments import IncrementalOptions
from dcp_plus.stagers.device_copy import check_device_copy
from dcp_plus.storage.rate import shaping_problem
from dcp_plus.storage.urls import is_url
from dcp_plus.writers.chunk_encode import part_bytes_problem

CODECS = ("identity", "zstd", "zstd+shuffle")


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
