"""Columns of a JSON table read as untrusted input: each column a list of the table's length,
checked whole with builtins (types, ranges, lengths: a few C-level passes instead of a Python
loop per entry); a column that fails is then walked to name its first bad entry."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.record_checks import INT64_MAX, MAX_DIMS
from dcp_plus.format.record_fields import MAX_NAME_CHARS, FieldParser
from dcp_plus.format.strict_json import check_text


class Columns:
    """Column access on one table: each column a list of the table's length, checked whole."""

    def __init__(self, p: FieldParser, table: Any, where: str, names: tuple[str, ...]) -> None:
        if type(table) is not dict:
            raise p.fail(where, "expected an object of columns")
        self.p, self.table, self.where = p, table, where
        unknown = set(table) - set(names)
        if unknown:
            raise p.fail(f"{where}.{sorted(unknown)[0]}", "unknown column")
        first = p.get(table, names[0], list, where)
        self.n = len(first)

    def column(self, name: str, optional: bool = False) -> list[Any]:
        if optional and name not in self.table:
            return [None] * self.n
        col = self.p.get(self.table, name, list, self.where)
        if len(col) != self.n:
            raise self.p.fail(f"{self.where}.{name}", f"{len(col)} entries, the "
                                                      f"{self.where} table has {self.n}")
        return col

    def bad(self, name: str, col: list[Any], ok: Callable[[Any], bool], expected: str
            ) -> CheckpointFormatError:
        i = next((i for i, v in enumerate(col) if not ok(v)), 0)
        return self.p.fail(f"{self.where}.{name}[{i}]",
                           f"expected {expected}, got {str(col[i])[:80]!r}")

    def ints(self, name: str, below: int = INT64_MAX + 1) -> list[int]:
        col = self.column(name)
        if col and not (set(map(type, col)) == {int} and min(col) >= 0 and max(col) < below):
            raise self.bad(name, col, lambda v: type(v) is int and 0 <= v < below,
                           f"an integer in [0, {below})")
        return col

    def texts(self, name: str, nullable: bool = False, optional: bool = False) -> list[Any]:
        col = self.column(name, optional)
        strs = [v for v in col if v is not None] if nullable else col
        if not _all_text(strs):
            raise self.bad(name, col, lambda v: (nullable and v is None) or (
                type(v) is str and len(v) <= MAX_NAME_CHARS and check_text(v) is None),
                "a string" + (" or null" if nullable else ""))
        return col

    def offsets(self, name: str) -> list[Any]:
        """A column of dimension lists, counts of zero dimensions or nulls (an extent
        table's ``chunk``)."""
        col = self.column(name)
        counts = [v for v in col if type(v) is int]
        lists = [v for v in col if v is not None and type(v) is not int]
        if (not counts or (min(counts) >= 0 and max(counts) <= MAX_DIMS)) and _all_shapes(lists):
            return col
        raise self.bad(name, col, _is_offsets, f"a list of at most {MAX_DIMS} non-negative "
                       f"int64 integers, a dimension count in [0, {MAX_DIMS}] or null")

    def shapes(self, name: str, allowed: list[bool] | None = None) -> list[Any]:
        """A column of dimension lists or nulls (lists only where ``allowed``)."""
        col = self.column(name)
        lists = [v for v in col if v is not None]
        if _all_shapes(lists) and (allowed is None or len(lists) == 0 or all(
                map(allowed.__getitem__, (r for r, v in enumerate(col) if v is not None)))):
            return col
        for i, v in enumerate(col):
            if v is not None and allowed is not None and not allowed[i]:
                raise self.p.fail(f"{self.where}.{name}[{i}]", "expected null (a value has no "
                                                               "chunk)")
            if v is not None and not _all_shapes([v]):
                break
        raise self.p.fail(f"{self.where}.{name}[{i}]",
                          f"expected a list of at most {MAX_DIMS} non-negative int64 "
                          f"integers, got {str(col[i])[:80]!r}")


def _is_offsets(v: Any) -> bool:
    return v is None or (type(v) is int and 0 <= v <= MAX_DIMS) or (
        type(v) is list and _all_shapes([v]))


def _all_text(strs: list[Any]) -> bool:
    if not strs:
        return True
    if set(map(type, strs)) != {str} or max(map(len, strs)) > MAX_NAME_CHARS:
        return False
    return check_text("".join(strs)) is None


def _all_shapes(lists: list[Any]) -> bool:
    if not lists:
        return True
    if set(map(type, lists)) != {list} or max(map(len, lists)) > MAX_DIMS:
        return False
    flat = list(itertools.chain.from_iterable(lists))
    return not flat or (set(map(type, flat)) == {int} and min(flat) >= 0
                        and max(flat) <= INT64_MAX)
