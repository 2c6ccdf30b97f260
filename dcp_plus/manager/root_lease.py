"""The root's lease as a job takes it: rank 0 acquires it, every rank hears the answer; and the
check a holder makes before it changes the root."""

from __future__ import annotations

import logging

from dcp_plus.errors import LeaseHeldError, LeaseLostError
from dcp_plus.manager.control import ControlGroup
from dcp_plus.manager.lease import LEASE_DIR, RootLease
from dcp_plus.manager.storage import Backend

log = logging.getLogger(__name__)


def acquire_for_job(backend: Backend, root: str, *, coordinator: bool,
                    ctl: ControlGroup | None, takeover: bool,
                    timeout_s: float) -> RootLease | None:
    """The root's lease, held by the coordinator (None elsewhere); every rank raises if it
    is refused."""
    lease, error = None, None
    if coordinator:
        try:  # whatever fails here, the other ranks must hear of it (not hang)
            lease = RootLease(backend.lease_store(backend.join(root, LEASE_DIR)),
                              timeout_s=timeout_s)
            lease.acquire(takeover=takeover)
        except Exception as e:
            error = e
    if ctl is not None:
        said = ctl.rank0_says(None if error is None else str(error))
        if said is not None and error is None:
            error = LeaseHeldError(f"rank 0 of this job could not take the lease of "
                                   f"{root}: {said}")
    if error is not None:
        raise error
    return lease


def still_held(lease: RootLease | None, root: str) -> bool:
    """Whether the holder of ``lease`` may still change ``root`` (checks the store; a lost
    lease or an unreachable store is logged and answers False)."""
    if lease is None:
        return False
    try:
        lease.check()
        return True
    except LeaseLostError as e:
        log.error("%s", e)
    except Exception as e:  # the lease store is unreachable: change nothing
        log.warning("%s: cannot check the root's lease (%s); leaving the root as it is",
                    root, e)
    return False
