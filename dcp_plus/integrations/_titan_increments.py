"""Incremental checkpoints in TorchTitan: each save's writer gets its base, and
TorchTitan's ``keep_latest_k`` purge spares every step folder a kept one references."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from dcp_plus.errors import DcpPlusError
from dcp_plus.format.record import RECORD_NAME, record_bases
from dcp_plus.manager.increments import Chain, IncrementalOptions
from dcp_plus.manager.storage import Backend

log = logging.getLogger(__name__)


class TitanIncrements:
    """The chain of one TorchTitan job's saves (see :class:`~dcp_plus.manager.increments.
    Chain`); a save counts as committed once its folder holds a commit record."""

    def __init__(self, options: IncrementalOptions, part_bytes: int) -> None:
        self.chain = Chain(options, part_bytes)
        self._bases: dict[str, list[str]] = {}
        """Each committed folder's ``bases``, read once (a record changes only when its step
        is saved again, which drops it here): the purge runs on the training thread."""

    def writer(self, make: Callable[[], Any], checkpoint_id: str, backend: Backend) -> Any:
        """The writer of the save into ``checkpoint_id``, made by ``make()``."""
        self._bases.pop(checkpoint_id, None)
        return self.chain.writer(make, checkpoint_id,
                                 lambda: backend.is_committed(checkpoint_id))

    def spare(self, kept: list[str], backend: Backend) -> set[str]:
        """The folder names the kept step folders ``kept`` reference, and those of the save
        in flight (its base may not have a record of it yet); a kept folder whose record
        cannot be read spares everything (None of its references are known)."""
        names: set[str] = set()
        for path in kept:
            if path not in self._bases:
                source = backend.join(path, RECORD_NAME)
                try:
                    data = backend.read(source)
                    if data is None:
                        continue  # not committed (the save in flight): its base is the chain's
                    self._bases[path] = record_bases(data, source)
                except (OSError, DcpPlusError) as e:
                    raise _Unknown(source) from e
            names.update(self._bases[path])
        base = self.chain.current_base
        if base is not None:
            names.add(os.path.basename(base.rstrip("/")))
        return names


class _Unknown(Exception):
    """A kept checkpoint's references could not be read."""


def purge_list(to_delete: list[str], kept: list[str], increments: TitanIncrements,
               backend: Backend) -> list[str]:
    """The folders of ``to_delete`` that no kept folder (nor the save in flight) needs."""
    try:
        spared = increments.spare(kept, backend)
    except _Unknown as e:
        log.warning("dcp_plus: keep_latest_k purges nothing this time: the references of %s "
                    "are unknown", e)
        return []
    # newest first: a crash half-way never leaves a folder whose base is gone
    return [p for p in reversed(to_delete) if os.path.basename(p.rstrip("/")) not in spared]
