"""How a managed save starts: the snapshot, and the persist when this save is durable.

Without tiers every save is ``dcp.async_save`` through the manager's stager. With a memory
tier the manager stages the snapshot itself (the tier keeps it after the persist) and hands
DCP the staged future through :class:`Prestaged`; saves that are not durable persist nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_plus.errors import DcpPlusError
from dcp_plus.planners import CachedSavePlanner
from dcp_plus.stagers import ArenaStager
from dcp_plus.tiers import Tiers
from dcp_plus.tiers.flat import plain

log = logging.getLogger(__name__)


class Prestaged(AsyncStager):
    """An ``AsyncStager`` for one ``async_save`` whose snapshot was staged already."""

    _synchronize_after_execute = False

    def __init__(self, staged: Future[Any]) -> None:
        self._staged = staged

    def stage(self, state_dict: Any, **_: Any) -> Future[Any]:  # type: ignore[override]
        return self._staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Issued:
    """A started save: its snapshot, its persist (done at once when not durable), and what
    the manager's thread does with the snapshot once it is complete."""

    staged: Future[Any]
    upload: Future[Any]
    durable: bool
    keep: Callable[[], None] | None = None
    """The memory tier's capture of the snapshot (None without a tier)."""
    let_go: Callable[[], None] | None = None
    """Frees the snapshot's buffer if the tier did not keep it (after the persist)."""


@dataclass
class Issuer:
    """Starts saves for one manager."""

    stager: Any
    planner: SavePlanner
    """A :class:`~dcp_plus.planners.CachedSavePlanner` (told each save's writer and group)
    or any other DCP save planner."""
    group: Any
    distributed: bool
    tiers: Tiers | None

    def issue(self, step: int, state: Mapping[str, Any],
              writer: Callable[[], Any]) -> Issued:
        """Start save ``step``; ``writer()`` makes its storage writer (called only when the
        save is durable). Raises what staging or DCP raise synchronously."""
        if self.tiers is None:
            return self._plain(state, writer())
        durable = self.tiers.next_is_durable()
        assert isinstance(self.stager, ArenaStager)
        state = plain(state)
        staged = self.stager.stage(state, checksums=True)  # the tier record needs them
        release: Future[None] = Future()
        self.stager.release_when(release)
        tiers = self.tiers
        upload: Future[Any]
        if durable:
            upload = self._async_save(state, writer(), Prestaged(staged)).upload_completion
        else:
            upload = Future()
            upload.set_result(None)
        return Issued(staged, upload, durable,
                      keep=lambda: tiers.capture(step, staged.result(), release),
                      let_go=lambda: tiers.let_go(release))

    def _plain(self, state: Mapping[str, Any], writer: Any) -> Issued:
        resp = self._async_save(state, writer, self.stager)
        if isinstance(resp, AsyncSaveResponse):
            if isinstance(self.stager, ArenaStager):
                self.stager.release_when(resp.upload_completion)  # before our callbacks
            return Issued(resp.staging_completion, resp.upload_completion, True)
        staged: Future[Any] = Future()  # a stager that stages synchronously
        staged.set_result(None)
        return Issued(staged, resp, True)

    def _async_save(self, state: Mapping[str, Any], writer: Any, stager: Any) -> Any:
        # without a process group DCP's upload thread warns (by default once per process)
        # that torch.distributed is disabled: hiding it there takes a process-wide filter
        if isinstance(self.planner, CachedSavePlanner):
            self.planner.set_save_context(storage_writer=writer, process_group=self.group)
        return dcp.async_save(dict(state), storage_writer=writer, planner=self.planner,
                              async_stager=stager, process_group=self.group,
                              no_dist=not self.distributed)


def wait_snapshot(staged: Future[Any], stager: ArenaStager | None) -> None:
    """Unguarded: wait until the live state may change (in GPU mode, once the device copy is
    done, not the copy to host)."""
    if stager is None:
        wait_futures([staged])
        return
    try:
        stager.synchronize_staging()
    except DcpPlusError as e:  # also fails the save's handle
        log.warning("snapshot failed: %s", e)
