"""Stand-ins for DCP's stock classes, built on dcp_plus, and the monkeypatch that installs them.

Each stand-in accepts the stock class's constructor signature and maps what it can onto the
dcp_plus class; what dcp_plus cannot honour raises ``NotImplementedError`` (never silently
ignored, so a test that depends on it fails visibly).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.staging import StagingOptions

from dcp_plus import ArenaStager, CachedSavePlanner, LocalReader, LocalWriter, SafeLoadPlanner

__all__ = [
    "CompatFileSystemReader",
    "CompatFileSystemWriter",
    "CompatSavePlanner",
    "CompatStager",
    "apply",
    "is_applied",
    "unapply",
]

# dcp_plus modules that bind stock names at import time are imported before patching, so that
# they keep DCP's own classes (LocalReader falls back to the stock reader, the planners
# subclass the stock ones).
_BIND_EARLY = ("dcp_plus.planners.cached_save", "dcp_plus.planners.safe_load",
               "dcp_plus.readers.local", "dcp_plus.readers.nfs")
for _name in _BIND_EARLY:
    importlib.import_module(_name)

PKG = "torch.distributed.checkpoint"
STAGER_MODES = ("saver", "all", "none")


def _trace(event: str) -> None:
    """Append ``pid event`` to $TORCH_DCP_COMPAT_TRACE (to check that children are patched)."""
    path = os.environ.get("TORCH_DCP_COMPAT_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {event}\n")


class CompatFileSystemWriter(LocalWriter):
    """``dcp_plus.LocalWriter`` behind ``FileSystemWriter``'s constructor.

    ``overwrite`` (stock default True), ``sync_files`` -> ``fsync`` and ``thread_count`` ->
    ``threads`` are mapped; ``_extensions=[ZStandard()]`` -> ``codec="zstd"``. The layout
    options (``single_file_per_rank``, ``per_thread_copy_ahead``, ``cache_staged_state_dict``)
    have no dcp_plus equivalent and are only recorded as attributes.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[StreamTransformExtension] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise NotImplementedError(f"FileSystemWriter compat: unsupported {sorted(kwargs)}")
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise NotImplementedError(
                f"FileSystemWriter compat: serialization_format={serialization_format}")
        codec = "identity"
        for ext in _extensions or ():
            if isinstance(ext, ZStandard):
                codec = "zstd"
            else:
                raise NotImplementedError(
                    f"FileSystemWriter compat: stream extension {type(ext).__name__} has no "
                    "dcp_plus equivalent")
        super().__init__(path, overwrite=overwrite, threads=max(1, thread_count),
                         fsync=sync_files, codec=codec)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        _trace(f"writer {self.path}")


class CompatFileSystemReader(LocalReader):
    """``dcp_plus.LocalReader`` behind ``FileSystemReader``'s constructor.

    ``allow_pickle=True`` because the stock reader also loads stock checkpoints (written by
    writers the patch does not replace); ``_extension_registry`` is not needed, dcp_plus
    codecs are named in the record.
    """

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None) -> None:
        super().__init__(path, allow_pickle=True)
        _trace(f"reader {self.path}")


class CompatSavePlanner(CachedSavePlanner):
    """``CachedSavePlanner`` behind ``DefaultSavePlanner``'s constructor.

    ``dedup_replicated_tensors`` is deprecated (and ignored) in DCP too; ``enable_plan_caching``
    is moot, the planner always caches.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank)


class CompatStager(ArenaStager):
    """``ArenaStager`` behind ``DefaultStager(StagingOptions)``; the options are CUDA-only
    tuning (pinned memory, non-blocking copies) and are ignored."""

    def __init__(self, config: StagingOptions = StagingOptions()) -> None:  # noqa: B008
        super().__init__()
        self._config = config


# name -> (replacement, modules under torch.distributed.checkpoint that bind it)
_SITES: dict[str, tuple[type, tuple[str, ...]]] = {
    "FileSystemWriter": (CompatFileSystemWriter,
                         ("", ".filesystem", "._storage_utils", ".format_utils")),
    "FileSystemReader": (CompatFileSystemReader,
                         ("", ".filesystem", "._storage_utils", ".format_utils")),
    "DefaultSavePlanner": (CompatSavePlanner,
                           ("", ".default_planner", ".state_dict_saver")),
    "DefaultLoadPlanner": (SafeLoadPlanner,
                           ("", ".default_planner", ".state_dict_loader", ".format_utils")),
}
_STAGER_SITES = {"saver": (".state_dict_saver",),
                 "all": (".state_dict_saver", ".staging"),
                 "none": ()}

_lock = threading.Lock()
_saved: list[tuple[Any, str, Any]] = []


def apply(stager: str = "saver") -> None:
    """Install the stand-ins (idempotent).

    Args:
        stager: ``"saver"`` replaces the ``DefaultStager`` that ``async_save`` creates for
            itself; ``"all"`` also ``torch.distributed.checkpoint.staging.DefaultStager``
            (what tests construct directly); ``"none"`` leaves staging stock.
    """
    if stager not in STAGER_MODES:
        raise ValueError(f"stager must be one of {STAGER_MODES}, got {stager!r}")
    sites = dict(_SITES)
    sites["DefaultStager"] = (CompatStager, _STAGER_SITES[stager])
    with _lock:
        if _saved:
            return
        for name, (new, modules) in sites.items():
            for suffix in modules:
                mod = importlib.import_module(PKG + suffix) if suffix else dcp
                _saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, new)
        _trace(f"applied stager={stager}")


def unapply() -> None:
    """Put DCP's own classes back."""
    with _lock:
        while _saved:
            mod, name, old = _saved.pop()
            setattr(mod, name, old)


def is_applied() -> bool:
    return bool(_saved)
