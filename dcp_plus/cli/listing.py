"""``dcp-plus ls``: the checkpoints under a root, local or at a URL."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dcp_plus.errors import CheckpointNotFoundError, DcpPlusError
from dcp_plus.format.extent_set import bases_of
from dcp_plus.manager.naming import parse_step
from dcp_plus.manager.root import CheckpointRoot
from dcp_plus.manager.storage import backend_for, split_root
from dcp_plus.readers.base import ExtentReader


def check_root(root: str) -> None:
    """Refuse a local ``root`` (a path or ``file://``) that is missing or a file: a typo is
    not an empty root."""
    scheme, location = split_root(root)
    if scheme in ("", "file") and not os.path.isdir(location):
        what = ("is a file, expected a directory" if os.path.exists(location)
                else "does not exist")
        raise DcpPlusError(f"{root} {what}")


def list_root(root: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every checkpoint folder directly under ``root``: ``step_XXXXXXXX`` folders (a
    manager's) and any other folder holding a commit record, oldest step first.

    Each row: name, path, step (None for other names), committed, latest (the manager's
    ``latest`` pointer names it), tensors and stored bytes (committed ones, from the record,
    validated as untrusted input: a damaged record is reported in ``problem``), and the
    checkpoints it references (``bases``: an incremental checkpoint's; None if unknown).
    """
    check_root(root)
    backend, location = backend_for(root, storage_options)
    croot = CheckpointRoot(backend, location)
    try:
        latest = croot.latest_step()
    except (DcpPlusError, ValueError):
        latest = None
    rows = []
    for name in backend.listdir(location):
        step = parse_step(name)
        path = backend.join(location, name)
        committed = backend.is_committed(path)
        if step is None and not committed:
            continue  # not a checkpoint folder (the pointer, the lease, anything else)
        row: dict[str, Any] = {"name": name, "path": path, "step": step,
                               "committed": committed, "latest": step is not None
                               and step == latest, "tensors": None, "bytes": None,
                               "problem": None, "bases": [] if not committed else None}
        if committed:
            _describe(backend.reader(path, {}), row)
        rows.append(row)
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["name"]))
    return {"root": str(root), "latest": latest, "checkpoints": rows}


def _describe(reader: Any, row: dict[str, Any]) -> None:
    if not isinstance(reader, ExtentReader):
        return
    try:
        md = reader.read_metadata()
    except CheckpointNotFoundError:  # removed between the listing and now
        row["committed"] = False
        return
    except DcpPlusError as e:
        row["problem"] = str(e)
        return
    finally:
        reader.close()
    extents = md.storage_data or {}
    row["tensors"] = len(md.state_dict_metadata)
    row["bytes"] = sum(e.length for e in extents.values() if e.base is None)
    row["bases"] = bases_of(extents) or []
