"""JSON read as untrusted input: UTF-8 only, no duplicate keys, no NaN, bounded nesting and
numbers; every refusal a ``CheckpointFormatError`` naming the source. (Which fields may hold
which types is the schema's business: the record's parser names the field.)"""

from __future__ import annotations

import json
from typing import Any

from dcp_plus.errors import CheckpointFormatError


class _Refused(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dupe = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Refused(f"duplicate key {dupe!r}")
    return obj


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def loads_strict(data: bytes, source: str, what: str) -> Any:
    """Parse ``data`` (the bytes of ``what`` at ``source``) strictly.

    Raises:
        CheckpointFormatError: not UTF-8, not JSON, a duplicate key, NaN/Infinity, an
            integer of over 4,300 digits, or nesting too deep.
    """
    try:
        text = data.decode("utf-8")
        return json.loads(text, object_pairs_hook=_object, parse_constant=_no_constant)
    except _Refused as e:
        raise CheckpointFormatError(f"{source}: not a valid {what}: {e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{source}: not a {what} (not UTF-8: {e})") from None
    except RecursionError:
        raise CheckpointFormatError(f"{source}: not a valid {what}: JSON nested too "
                                    "deeply") from None
    except ValueError as e:  # JSONDecodeError, and int() of a number with too many digits
        raise CheckpointFormatError(f"{source}: not a {what} (invalid JSON: "
                                    f"{str(e)[:200]})") from None


def check_text(value: str) -> str | None:
    """Why ``value`` is not storable text (a lone surrogate from a ``\\ud800`` escape, a NUL),
    or None."""
    if "\x00" in value:
        return "contains a NUL character"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "is not valid Unicode (a lone surrogate)"
    return None
