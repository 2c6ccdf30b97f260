"""The memory and peer tiers of a TorchTitan job (``checkpoint.memory_tier``).

Every save's snapshot is kept in shared memory (and a partner's), and every
``durable_every``-th is also persisted to its ``step-N`` folder; resume restores the newest
step every rank can restore, from the fastest tier that has it. The work is the manager's:
:class:`~dcp_plus.manager.issuing.Issuer` starts a save,
:func:`~dcp_plus.manager.saving.keep_and_persist` completes it and
:func:`~dcp_plus.manager.resume.restore_from_tiers` restores, over :mod:`dcp_plus.tiers`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcp_plus.manager.control import ControlGroup
from dcp_plus.manager.issuing import Issued, Issuer
from dcp_plus.manager.resume import restore_from_tiers, tiers_for
from dcp_plus.manager.saving import keep_and_persist
from dcp_plus.stagers import ArenaStager
from dcp_plus.tiers import Restore, TierOptions, Tiers

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierSave:
    """A started save: its snapshot, its completion, and whether it is persisted too."""

    staged: Future[Any]
    done: Future[None]
    """Resolved once the memory record (and the partner's replica) is complete and, for a
    durable save, the step folder is committed; fails with the first error."""
    durable: bool


class TitanTiers:
    """The tiers of one rank: saves through them, and the restore."""

    def __init__(self, options: TierOptions, folder: str, stager: ArenaStager,
                 planner: SavePlanner, group: Any, ctl: ControlGroup | None) -> None:
        """``folder``: the checkpoint folder (the default job id is derived from it);
        ``group``: the process group of the durable persists; ``ctl``: the group on which
        the ranks agree at restore (None for a single process)."""
        distributed = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        try:
            tiers = tiers_for(options, folder, rank, world, stager, None)
        except ValueError as e:
            raise ValueError(f"checkpoint.peer_tier on {world} rank(s): {e}") from e
        assert tiers is not None
        self.tiers: Tiers = tiers
        self._ctl = ctl
        self._issuer = Issuer(stager, planner, group, distributed, tiers)
        self._post = ThreadPoolExecutor(1, thread_name_prefix="dcpp-titan-tiers")

    def save(self, step: int, states: Mapping[str, Any],
             writer: Callable[[], StorageWriter]) -> TierSave:
        """Snapshot ``states`` as ``step``; ``writer()`` makes the step folder's writer when
        this save is durable. Raises what staging or DCP raise synchronously."""
        issued = self._issuer.issue(step, states, writer)
        return TierSave(issued.staged, self._post.submit(_settle, issued), issued.durable)

    def restore(self, states: dict[str, Any], durable: list[int], path: Callable[[int], str],
                reader: Callable[[str], StorageReader]) -> Restore | None:
        """Agree across ranks and restore ``states`` in place from the fastest tier (see
        :func:`~dcp_plus.manager.resume.restore_from_tiers`; an all-durable choice is
        returned, not loaded)."""
        return restore_from_tiers(self.tiers, states, durable, path=path, reader=reader,
                                  ctl=self._ctl)

    def close(self, remove: bool) -> None:
        """Wait for the save in flight and free the held buffer; with ``remove``, also delete
        this rank's snapshots and the replica it holds."""
        self._post.shutdown(wait=True)
        self.tiers.close(remove=remove)


def _settle(issued: Issued) -> None:
    """The background half of a tier save; raises the persist's error, else the tier's."""
    kept_error, failure = keep_and_persist(issued, lambda _: None)
    if failure is not None:
        raise failure
    if kept_error is not None:
        raise kept_error
