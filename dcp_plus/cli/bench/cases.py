"""The rows of ``dcp-plus bench``: one way to save and load a state dict each.

Every case saves with ``dcp.async_save`` (or its library's own call) and reports, per save,
the time until the call returned (blocking), until the snapshot was staged, and until the
checkpoint was persisted, all from the call; a load is one ``dcp.load`` into a pre-faulted
destination, checked bit-exact afterwards.

stock DCP   ``async_save`` default (``FileSystemWriter``/``FsspecWriter`` stages in the call,
            THREAD), and ``DefaultStager`` with shared memory + async staging and the PROCESS
            executor + ``DefaultSavePlanner(enable_plan_caching=True)``; loads with
            ``FileSystemReader``/``FsspecReader``
dcp_plus    ``ArenaStager`` + ``CachedSavePlanner`` + ``LocalWriter``/``ObjectStoreWriter``;
            loads with ``LocalReader``/``ObjectStoreReader`` + ``SafeLoadPlanner``
torch_checkpointing  meta-pytorch's ``CheckpointManager`` (when importable; local paths, one
            rank): its own format, written without fsync, so its persist time is not durable
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

DCP_DEFAULT = "dcp: async_save default"
DCP_TUNED = "dcp: DefaultStager shm+async, PROCESS, plan cache"
PLUS = "dcp_plus: ArenaStager+CachedSavePlanner"
TORCH_CKPT = "torch_checkpointing (no fsync)"
SHORT = {DCP_DEFAULT: "dcp default", DCP_TUNED: "dcp shm+PROCESS", PLUS: "dcp_plus",
         TORCH_CKPT: "torch_checkpointing"}


@dataclass
class SaveTiming:
    """Seconds from the save call until it returned, the snapshot was staged, and the
    checkpoint was persisted."""

    blocking_s: float
    staging_s: float
    persist_s: float


class Case:
    """One row: a way to save and load. ``save``/``load`` take a checkpoint path or URL."""

    name: str = ""
    kind: str = ""  # "dcp" | "dcp_plus" | "other"

    def save(self, state: dict[str, Any], path: str) -> SaveTiming:
        raise NotImplementedError

    def load(self, dest: dict[str, Any], path: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def timed_async_save(call: Callable[[], Any]) -> SaveTiming:
    """Run ``call()`` (a ``dcp.async_save``) and wait for its staging and upload futures."""
    done: dict[str, float] = {}

    def stamp(key: str) -> Callable[[Any], None]:
        def cb(_f: Any) -> None:
            done.setdefault(key, time.perf_counter())
        return cb

    t0 = time.perf_counter()
    resp = call()
    t1 = time.perf_counter()
    staged: Future[Any] | None = getattr(resp, "staging_completion", None)
    upload: Future[Any] = getattr(resp, "upload_completion", resp)
    if staged is not None:
        staged.add_done_callback(stamp("staged"))
    upload.add_done_callback(stamp("persisted"))
    if staged is not None:
        staged.result()
    upload.result()
    persisted = done.get("persisted", time.perf_counter())
    return SaveTiming(t1 - t0, done.get("staged", t1) - t0, persisted - t0)


class AsyncSaveCase(Case):
    """``dcp.async_save`` with a given writer, stager, executor and planner."""

    def __init__(self, name: str, kind: str, *, writer: Callable[[str], Any],
                 reader: Callable[[str], Any], stager: Any = None,
                 executor: str = "thread", planner: Callable[[], Any] | None = None,
                 load_planner: Callable[[], Any] | None = None,
                 process_group: Any = None) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.name, self.kind = name, kind
        self.writer, self.reader = writer, reader
        self.stager = stager
        self.executor = (AsyncCheckpointerType.PROCESS if executor == "process"
                         else AsyncCheckpointerType.THREAD)
        self.planner = planner() if planner else None  # one per job: reused across saves
        self.load_planner = load_planner
        self.process_group = process_group

    def save(self, state: dict[str, Any], path: str) -> SaveTiming:
        from dcp_plus.cli.logs import quiet_checkpoint_daemon

        with quiet_checkpoint_daemon():  # the PROCESS daemon, started by a first save
            return timed_async_save(lambda: dcp.async_save(
                state, storage_writer=self.writer(path), planner=self.planner,
                async_stager=self.stager, async_checkpointer_type=self.executor,
                process_group=self.process_group))

    def load(self, dest: dict[str, Any], path: str) -> None:
        dcp.load(dest, storage_reader=self.reader(path),
                 planner=self.load_planner() if self.load_planner else None,
                 process_group=self.process_group)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.executor.value == "process":
            # the PROCESS executor keeps one daemon per trainer; end it with this case
            from dcp_plus._compat.torch_dcp import stop_process_executor

            stop_process_executor()


class TorchCheckpointingCase(Case):
    """meta-pytorch's ``torch_checkpointing.CheckpointManager`` (async save, local files).

    Its default storage (``use_direct_io=True``) opens files with O_DIRECT and then writes
    ``torch.save``'s unaligned buffers through them, which ext4 rejects: the save fails in its
    checkpoint process with ``OSError: [Errno 22] Invalid argument`` (torch_checkpointing
    0.1.1, measured here), so ``direct_io`` defaults to off. It does not fsync what it writes.
    """

    name, kind = TORCH_CKPT, "other"

    def __init__(self, direct_io: bool = False) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.manager = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=direct_io)))

    def save(self, state: dict[str, Any], path: str) -> SaveTiming:
        t0 = time.perf_counter()
        fut = self.manager.save(path, state)
        t1 = time.perf_counter()
        staged = getattr(self.manager, "_staging_future", None)
        staged_at = t1
        if staged is not None:
            staged.result()
            staged_at = time.perf_counter()
        if fut is not None:
            fut.result()
        return SaveTiming(t1 - t0, staged_at - t0, time.perf_counter() - t0)

    def load(self, dest: dict[str, Any], path: str) -> None:
        self.manager.load(path, into=dest)

    def close(self) -> None:
        self.manager.close()


def torch_checkpointing_status() -> str | None:
    """``None`` when ``torch_checkpointing`` imports, else why not."""
    try:
        import torch_checkpointing  # noqa: F401
    except Exception as e:  # an incompatible install fails in many ways
        return f"torch_checkpointing not usable here ({type(e).__name__}: {e})"
    return None


def _dcp_cached_planner() -> Any:
    """``DefaultSavePlanner(enable_plan_caching=True)``. DCP keys its plan cache by class name,
    but with the PROCESS executor the planner is pickled and plans in the checkpoint process,
    which ends with its case (:meth:`AsyncSaveCase.close`): no plan leaks between cases."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return DefaultSavePlanner(enable_plan_caching=True)


def build_cases(target_is_url: bool, storage_options: dict[str, Any], *,
                with_torch_checkpointing: bool, world: int,
                process_local_store: bool = False) -> list[Case]:
    """The rows to run, stock DCP first (the reference of every ``x DCP`` ratio).

    ``process_local_store``: the target lives in this process only (``memory://``), so the
    PROCESS executor's checkpoint process cannot write it and its row is left out.
    """
    from torch.distributed.checkpoint.staging import StagingOptions

    from dcp_plus._compat.torch_dcp import ReusableDefaultStager
    from dcp_plus.planners import CachedSavePlanner, SafeLoadPlanner
    from dcp_plus.stagers import ArenaStager

    opts = storage_options
    stock_w: Callable[[str], Any]
    stock_r: Callable[[str], Any]
    plus_w: Callable[[str], Any]
    plus_r: Callable[[str], Any]
    if target_is_url:
        from dcp_plus._compat.torch_dcp import fsspec_reader, fsspec_writer
        from dcp_plus.readers import ObjectStoreReader
        from dcp_plus.writers import ObjectStoreWriter

        stock_w = lambda p: fsspec_writer()(p, **opts)  # noqa: E731

        stock_r = lambda p: fsspec_reader()(p, **opts)  # noqa: E731

        plus_w = lambda p: ObjectStoreWriter(p, opts)  # noqa: E731

        plus_r = lambda p: ObjectStoreReader(p, opts)  # noqa: E731
    else:
        from dcp_plus.readers import LocalReader
        from dcp_plus.writers import LocalWriter

        stock_w, stock_r = dcp.FileSystemWriter, dcp.FileSystemReader
        plus_w, plus_r = LocalWriter, LocalReader

    # the async saves run while nothing else uses the default group; its own group anyway,
    # as a training job must (ENVIRONMENT.md: gloo aborts on interleaved collectives)
    pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
    cases: list[Case] = [
        AsyncSaveCase(DCP_DEFAULT, "dcp", writer=stock_w, reader=stock_r, process_group=pg),
    ]
    if not process_local_store:
        cases.append(AsyncSaveCase(
            DCP_TUNED, "dcp", writer=stock_w, reader=stock_r,
            stager=ReusableDefaultStager(StagingOptions(False, True, True, False)),
            executor="process", planner=_dcp_cached_planner, process_group=pg))
    cases += [
        AsyncSaveCase(PLUS, "dcp_plus", writer=plus_w, reader=plus_r, stager=ArenaStager(),
                      planner=CachedSavePlanner, load_planner=SafeLoadPlanner,
                      process_group=pg),
    ]
    if with_torch_checkpointing and not target_is_url and world == 1 \
            and torch_checkpointing_status() is None:
        cases.append(TorchCheckpointingCase())
    return cases
