"""Names of the memory tier's files in ``/dev/shm``, derived from the job id.

Every file of job ``J`` held by rank ``H`` for the snapshot of rank ``R`` starts with
``dcpp-tier-J-hH-rR-``: a record ``...-sSTEP.json`` and its data, either hard links to the
stager's slabs (``...-d-<slab>``, own snapshots) or one replica file (``...-sSTEP.data``, a
partner's snapshot; the partner also keeps the previous replica's file, without a record, to
receive the next one into). A record being written is ``.<record name>.<pid>.tmp`` (kind
``"partial"``). The holder is part of the name so that losing a node's memory is losing
exactly the files its ranks held.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

from dcp_plus.memory.slabs import SHM_DIR

PREFIX = "dcpp-tier-"
_JOB = re.compile(r"[A-Za-z0-9_.]{1,64}")
_NAME = re.compile(
    r"dcpp-tier-(?P<job>[A-Za-z0-9_.]{1,64})-h(?P<holder>\d{1,9})-r(?P<owner>\d{1,9})-"
    r"(?:s(?P<step>\d{1,19})\.(?P<ext>json|data)|d-(?P<slab>dcpp-[A-Za-z0-9-]{1,80}))"
)


def job_id_for(root: str) -> str:
    """The default job id of a checkpoint root: a hash of its normalized location, so two
    jobs with different roots never share a snapshot name."""
    where = root if "://" in root else os.path.realpath(root)
    return hashlib.sha256(where.encode("utf-8")).hexdigest()[:16]


def check_job_id(job_id: str) -> str:
    """``job_id`` if usable in file names, else ``ValueError`` saying what is allowed."""
    if not _JOB.fullmatch(job_id):
        raise ValueError(f"job_id must be 1-64 characters of A-Z a-z 0-9 _ . , got {job_id!r}")
    return job_id


@dataclass(frozen=True, slots=True)
class TierFile:
    """One parsed memory-tier file name."""

    name: str
    job: str
    holder: int
    owner: int
    step: int | None
    """The snapshot's step (records and replica data), None for slab links."""
    kind: str
    """``"record"``, ``"replica"`` (a partner's data), ``"link"`` (an own slab) or
    ``"partial"`` (a record's temporary file: never read, removed with the stale files)."""

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)


_PARTIAL = re.compile(r"\.(?P<record>dcpp-tier-.+\.json)\.\d{1,10}\.tmp")
"""A record being written (renamed into place once complete), or left by a process killed
while writing it: :meth:`TierRecord.write`'s temporary name."""


def parse(name: str) -> TierFile | None:
    """The parts of a memory-tier file name, or None for any other name."""
    partial = _PARTIAL.fullmatch(name)
    m = _NAME.fullmatch(partial["record"] if partial else name)
    if m is None:
        return None
    step = m["step"]
    kind = "partial" if partial else "link" if m["slab"] else \
        "record" if m["ext"] == "json" else "replica"
    return TierFile(name, m["job"], int(m["holder"]), int(m["owner"]),
                    None if step is None else int(step), kind)


def stem(job: str, holder: int, owner: int) -> str:
    return f"{PREFIX}{job}-h{holder}-r{owner}-"


def record_name(job: str, holder: int, owner: int, step: int) -> str:
    return f"{stem(job, holder, owner)}s{step}.json"


def replica_name(job: str, holder: int, owner: int, step: int) -> str:
    return f"{stem(job, holder, owner)}s{step}.data"


def link_name(job: str, holder: int, slab: str) -> str:
    return f"{stem(job, holder, holder)}d-{slab}"


def slab_of(link: str) -> str | None:
    """The stager slab an own snapshot's link ``link`` names, or None for other names."""
    m = _NAME.fullmatch(link)
    return None if m is None else m["slab"]


def listing(job: str | None = None, holder: int | None = None) -> list[TierFile]:
    """Memory-tier files in ``/dev/shm`` (of ``job`` and ``holder`` when given)."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        f = parse(n) if n.startswith((PREFIX, "." + PREFIX)) else None
        if f is not None and (job is None or f.job == job) and (
                holder is None or f.holder == holder):
            out.append(f)
    return out


def unlink(name: str) -> None:
    """Remove one file of the tier; a missing one is fine (another cleanup got there)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
