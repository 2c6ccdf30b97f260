"""``dcp-plus gc ROOT``: remove a manager root's uncommitted saves and apply retention,
without a training job, under the root's lease (so never beside a live writer)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dcp_plus.cli.listing import check_root, list_root
from dcp_plus.errors import DcpPlusError
from dcp_plus.manager.lease import LEASE_DIR, RootLease
from dcp_plus.manager.retention import References, to_remove
from dcp_plus.manager.root import CheckpointRoot
from dcp_plus.manager.storage import Backend, backend_for

log = logging.getLogger(__name__)


def collect(root: str, storage_options: Mapping[str, Any] | None = None, *,
            keep_last: int | None = None, keep_every: int | None = None,
            dry_run: bool = False, shm: bool = False,
            job_id: str | None = None) -> dict[str, Any]:
    """What gc removes (or, with ``dry_run``, would remove) under ``root``: uncommitted step
    folders, and the committed steps retention drops (``keep_last`` newest and multiples of
    ``keep_every`` kept, counting only checkpoints whose record validates; the newest of
    those always; every checkpoint a kept incremental one references). Damaged checkpoints
    are listed and kept. With ``shm``, also the job's memory-tier snapshots on this node
    (``job_id``: default derived from the root), only when no live job holds the root.
    JSON-ready."""
    res = _collect(root, storage_options, keep_last, keep_every, dry_run)
    if shm:
        res["shm"] = _shm_files(root, job_id, remove=not dry_run)
    return res


def _shm_files(root: str, job_id: str | None, *, remove: bool) -> list[str]:
    """The job's memory-tier files in ``/dev/shm`` (removed when ``remove``)."""
    from dcp_plus.tiers import names

    files = names.listing(names.check_job_id(job_id or names.job_id_for(root)))
    if remove:
        for f in files:
            names.unlink(f.name)
    return sorted(f.name for f in files)


def _collect(root: str, storage_options: Mapping[str, Any] | None, keep_last: int | None,
             keep_every: int | None, dry_run: bool) -> dict[str, Any]:
    if keep_last is not None and keep_last < 1:
        raise DcpPlusError(f"--keep-last {keep_last}: keep at least 1 checkpoint (gc never "
                           "removes the newest committed one)")
    if keep_every is not None and keep_every < 1:
        raise DcpPlusError(f"--keep-every {keep_every}: expected a step multiple >= 1")
    if keep_every is not None and keep_last is None:
        raise DcpPlusError("--keep-every only adds to what --keep-last keeps: without "
                           "--keep-last every committed checkpoint is kept anyway")
    check_root(root)
    backend, location = backend_for(root, storage_options)
    if not backend.listdir(location):  # nothing there: no lease left behind in a typo'd prefix
        return {"root": root, "dry_run": dry_run, "held_by": None, "remove": [], "keep": [],
                "newest_loadable": None, "freed_bytes": 0, "failed": []}
    lease = RootLease(backend.lease_store(backend.join(location, LEASE_DIR)))
    holder = lease.current()
    if holder is not None and (holder[1] or holder[0] is None):
        who = holder[0].describe() if holder[0] else "an unknown writer"
        if not dry_run:
            raise DcpPlusError(f"{root} is in use by {who} ({holder[2]}): gc changes a root "
                               "only while no job writes to it; stop the job first (--dry-run "
                               "shows what gc would remove)")
    if dry_run:
        return _plan(root, storage_options, keep_last, keep_every,
                     holder=holder[2] if holder else None)
    lease.acquire(takeover=True)  # a dead holder's lease only: a live one refuses
    try:
        return _apply(root, storage_options, backend, location, keep_last, keep_every)
    finally:
        lease.release()


def _plan(root: str, storage_options: Mapping[str, Any] | None, keep_last: int | None,
          keep_every: int | None, *, holder: str | None) -> dict[str, Any]:
    listed = list_root(root, storage_options)["checkpoints"]
    rows = [r for r in listed if r["step"] is not None]
    # retention counts only checkpoints whose record validates: a damaged newest one must not
    # push the loadable ones out (resume skips it and falls back to them); damaged ones stay
    loadable = [r["step"] for r in rows if r["committed"] and not r["problem"]]
    dropped = set(to_remove(loadable, keep_last, keep_every, _references(rows)))
    # other checkpoints beside the steps (copied in by hand) keep the steps they reference
    step_of = {r["name"]: r["step"] for r in rows}
    dropped -= {step_of.get(n) for r in listed if r["step"] is None for n in r["bases"] or ()}
    remove: list[dict[str, Any]] = []
    keep: list[dict[str, Any]] = []
    for r in rows:
        why = ("uncommitted" if not r["committed"] else
               "retention" if r["step"] in dropped and not r["problem"] else None)
        (remove if why else keep).append({**r, "why": why})
    return {"root": root, "dry_run": True, "held_by": holder, "remove": remove, "keep": keep,
            "newest_loadable": max(loadable, default=None), "freed_bytes": _bytes(remove)}


def _references(rows: list[dict[str, Any]]) -> References:
    """The steps each listed checkpoint's record references (incremental bases)."""
    step_of = {r["name"]: r["step"] for r in rows}
    bases = {r["step"]: r["bases"] for r in rows}

    def references(step: int) -> set[int] | None:
        names = bases.get(step)
        return None if names is None else {
            s for s in map(step_of.get, names) if s is not None}
    return references


def _bytes(rows: list[dict[str, Any]]) -> int:
    return sum(int(r["bytes"] or 0) for r in rows)


def _apply(root: str, storage_options: Mapping[str, Any] | None, backend: Backend,
           location: str, keep_last: int | None, keep_every: int | None) -> dict[str, Any]:
    """Carry out :func:`_plan` (under the lease): a retained checkpoint loses its record
    first, so an interrupted gc never leaves a partial folder that looks committed."""
    planned = _plan(root, storage_options, keep_last, keep_every, holder=None)
    removed: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for r in reversed(planned["remove"]):  # newest first: an incremental one before its base
        try:
            if r["why"] == "retention":
                backend.uncommit(r["path"])
            elif backend.is_committed(r["path"]):  # committed since it was listed: keep it
                continue
            backend.remove_tree(r["path"])
            removed.append(r)
        except OSError as e:
            log.warning("gc could not remove %s: %s", r["path"], e)
            failed.append({**r, "error": str(e)})
    croot = CheckpointRoot(backend, location)
    newest = planned["newest_loadable"]
    if newest is not None and croot.latest_step() != newest:
        croot.write_pointer(newest)  # never at a damaged checkpoint
    removed.reverse()  # listed oldest first, as planned
    failed.reverse()
    return {**planned, "dry_run": False, "remove": removed, "failed": failed,
            "freed_bytes": _bytes(removed)}
