"""A record's ``planner_data``: DefaultSavePlanner's flatten mapping (flattened key -> path of
keys and list indices), stored as JSON and checked as untrusted input.

Row-form records store it as an object. A columnar record whose mapping has exactly its
items' keys stores ``planner_paths`` instead: one path per item, null for the path ``[fqn]``
of a key that was never nested (most of them), so the keys are not written twice.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping
from typing import Any

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.record_fields import FieldParser
from dcp_plus.format.strict_json import check_text

PlannerData = dict[str, tuple[Any, ...]]


def encode_planner_data(planner_data: Any) -> dict[str, list[Any]] | None:
    """The object form; only a mapping of paths is stored."""
    if planner_data is None:
        return None
    if not isinstance(planner_data, Mapping):
        raise CheckpointFormatError(
            f"planner_data of type {type(planner_data).__name__} cannot be stored as JSON; "
            "dcp_plus records only DefaultSavePlanner's flatten mapping"
        )
    return {k: list(v) for k, v in planner_data.items()}


def planner_paths(planner_data: Any, fqns: list[str]) -> list[list[Any] | None] | None:
    """The ``planner_paths`` column for items ``fqns``, or None where the mapping's keys are
    not exactly those (then the object form is stored)."""
    if not isinstance(planner_data, Mapping) or len(planner_data) != len(fqns) or \
            planner_data.keys() != set(fqns):
        return None
    out: list[list[Any] | None] = []
    for fqn in fqns:
        path = list(planner_data[fqn])
        out.append(None if path == [fqn] else path)
    return out


def decode_planner_data(p: FieldParser, root: dict[str, Any], fqns: list[str] | None
                        ) -> PlannerData | None:
    """The mapping of a record's ``planner_data``, or of its ``planner_paths`` (columnar
    records: ``fqns`` are its items)."""
    planner_data = root.get("planner_data")
    if fqns is not None and "planner_paths" in root:
        paths = p.get(root, "planner_paths", list, "")
        if planner_data is not None or len(paths) != len(fqns):
            raise p.fail("planner_paths", f"expected one path or null per item ({len(fqns)}), "
                                          "and planner_data null")
        if not _key_paths([v for v in paths if v is not None]):
            raise p.fail("planner_paths", "expected a list of key paths or nulls")
        out = dict(zip(fqns, zip(fqns), strict=True))  # (fqn,): the path of a top-level key
        for i in itertools.compress(range(len(paths)), map(operator.is_not, paths,
                                                           itertools.repeat(None))):
            out[fqns[i]] = tuple(paths[i])
        return out
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict) or not _key_paths(list(planner_data.values())):
        raise p.fail("planner_data", "expected an object of key paths")
    return {k: tuple(v) for k, v in planner_data.items()}


def _key_paths(paths: list[Any]) -> bool:
    """Every path a list of strings (storable text) and integers."""
    if not paths:
        return True
    if set(map(type, paths)) != {list}:
        return False
    steps = list(itertools.chain.from_iterable(paths))
    if not set(map(type, steps)) <= {str, int}:
        return False
    return check_text("\x01".join(s for s in steps if type(s) is str)) is None
