"""Key-prefix strategies: each rank's objects under a short prefix at the start of the key.

S3 throttles per key prefix (of the order of 3,500 PUT and 5,500 GET per second per
partitioned prefix), so thousands of ranks writing under one checkpoint prefix get
``503 SlowDown``. With a strategy, rank ``r``'s data objects (and its extent table) go to
``<bucket>/<prefix(r)>/<checkpoint key>/``, inside the same bucket; the commit record stays
at ``<bucket>/<checkpoint key>/.metadata``. Prefixes are digit strings written least
significant digit first, so consecutive ranks differ in the key's first character.

A prefix is 1-64 characters of ``[A-Za-z0-9_-]``: never a ``/``, ``.`` or ``..``, so
``<bucket>/<prefix>/<checkpoint key>/`` is always one fixed place below the bucket.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BinaryPrefixes", "HexPrefixes", "KeyPrefixes", "RoundRobinPrefixes",
           "bucket_path", "decode_marker", "encode_marker", "insert_prefix", "parse_key_prefixes",
           "prefix_problem"]

_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")
MARKER_NAME = ".key_prefixes"
"""Beside the record: the strategies a save under this key used, written by the coordinator
before any rank writes data, so that clean-up finds the objects of a save that never
committed."""
MARKER_FORMAT = "dcp_plus-key-prefixes"


def prefix_problem(prefix: object) -> str | None:
    """What makes ``prefix`` unusable as a key prefix, or None."""
    if not isinstance(prefix, str) or _PREFIX.fullmatch(prefix) is None:
        return (f"{str(prefix)[:80]!r} is not a key prefix: 1-64 characters of letters, "
                "digits, '-' and '_'")
    return None


class KeyPrefixes:
    """A key-prefix strategy: the prefix of each rank's objects."""

    def prefix(self, rank: int) -> str:
        """The prefix of rank ``rank``'s objects."""
        raise NotImplementedError

    def all(self) -> tuple[str, ...]:
        """Every prefix this strategy gives some rank."""
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """The strategy as JSON (:func:`encode_marker`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class RoundRobinPrefixes(KeyPrefixes):
    """Rank ``r`` writes under ``prefixes[r % len(prefixes)]`` (at most 65,536 of them)."""

    prefixes: tuple[str, ...]

    def __init__(self, prefixes: Sequence[str]) -> None:
        if isinstance(prefixes, str) or not isinstance(prefixes, Sequence):
            raise ValueError(f"RoundRobinPrefixes takes a list of prefixes, got {prefixes!r}")
        items = tuple(prefixes)
        if not 1 <= len(items) <= 1 << 16 or len(set(items)) != len(items):
            raise ValueError("RoundRobinPrefixes takes 1 to 65,536 distinct prefixes, got "
                             f"{len(items)} ({len(set(items))} distinct)")
        for p in items:
            problem = prefix_problem(p)
            if problem is not None:
                raise ValueError(f"RoundRobinPrefixes: {problem}")
        object.__setattr__(self, "prefixes", items)

    def prefix(self, rank: int) -> str:
        return self.prefixes[rank % len(self.prefixes)]

    def all(self) -> tuple[str, ...]:
        return self.prefixes

    def spec(self) -> dict[str, Any]:
        return {"kind": "round_robin", "prefixes": list(self.prefixes)}


@dataclass(frozen=True)
class _Digits(KeyPrefixes):
    """Rank ``r`` writes under the ``depth`` lowest base-``base`` digits of ``r``, least
    significant first: ``base ** depth`` prefixes, taken in turn by consecutive ranks."""

    depth: int
    base = 2
    max_depth = 16

    def __post_init__(self) -> None:
        if (isinstance(self.depth, bool) or not isinstance(self.depth, int)
                or not 1 <= self.depth <= self.max_depth):
            raise ValueError(f"{type(self).__name__}: depth must be an int in "
                             f"1..{self.max_depth}, got {self.depth!r}")

    def prefix(self, rank: int) -> str:
        digits = "0123456789abcdef"
        return "".join(digits[rank // self.base ** i % self.base] for i in range(self.depth))

    def all(self) -> tuple[str, ...]:
        return tuple(self.prefix(n) for n in range(self.base ** self.depth))

    def spec(self) -> dict[str, Any]:
        return {"kind": "hex" if self.base == 16 else "binary", "depth": self.depth}


@dataclass(frozen=True)
class BinaryPrefixes(_Digits):
    """Binary digits of the rank (``depth`` in 1..16; 8: 256 prefixes ``00000000``...)."""

    depth: int = 8
    base = 2
    max_depth = 16


@dataclass(frozen=True)
class HexPrefixes(_Digits):
    """Hex digits of the rank (``depth`` in 1..4; 2: 256 prefixes ``00``, ``10``...)."""

    depth: int = 2
    base = 16
    max_depth = 4


def parse_key_prefixes(text: str) -> KeyPrefixes | None:
    """``"hex:2"``, ``"binary:8"``, ``"round_robin:a,b,c"``; ``""``: None (no prefixes).

    Raises:
        ValueError: any other text.
    """
    if not text:
        return None
    kind, _, arg = text.partition(":")
    if kind == "round_robin":
        return RoundRobinPrefixes(arg.split(","))
    if kind in ("hex", "binary") and arg.isdigit():
        return (HexPrefixes if kind == "hex" else BinaryPrefixes)(int(arg))
    raise ValueError(f"key prefixes {text!r}: expected 'hex:DEPTH', 'binary:DEPTH' or "
                     "'round_robin:P1,P2,...'")


def _from_spec(spec: Any) -> KeyPrefixes:
    if isinstance(spec, dict) and spec.get("kind") == "round_robin":
        return RoundRobinPrefixes(spec.get("prefixes"))  # type: ignore[arg-type]
    if isinstance(spec, dict) and spec.get("kind") in ("hex", "binary"):
        return (HexPrefixes if spec["kind"] == "hex" else BinaryPrefixes)(spec["depth"])
    raise ValueError(f"unknown key-prefix strategy {str(spec)[:80]}")


def encode_marker(strategies: Iterable[KeyPrefixes]) -> bytes:
    """The marker object's bytes for ``strategies``."""
    return json.dumps({"format": MARKER_FORMAT, "version": 1,
                       "strategies": [s.spec() for s in strategies]}).encode()


def decode_marker(data: bytes, source: str) -> list[KeyPrefixes]:
    """The strategies of a marker (untrusted: every prefix is validated).

    Raises:
        ValueError: naming ``source``, for anything but a marker.
    """
    try:
        root = json.loads(data)
        if root.get("format") != MARKER_FORMAT or root.get("version") != 1:
            raise ValueError("not a key-prefix marker")
        return [_from_spec(s) for s in root["strategies"]]
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise ValueError(f"{source}: {e!s:.200}") from None


def _split(path: str) -> tuple[str, str, str]:
    """``(everything up to the bucket, bucket, key)`` of ``path``."""
    scheme, sep, rest = path.partition("://")
    if not sep:
        scheme, rest = "", path
    body = rest.lstrip("/")
    bucket, _, key = body.rstrip("/").partition("/")
    if not bucket or not key.strip("/"):
        raise ValueError(f"{path!r}: key prefixes need a checkpoint key below the bucket "
                         "(e.g. s3://bucket/run/step_100)")
    return f"{scheme}{sep}{rest[:len(rest) - len(body)]}", bucket, key


def bucket_path(path: str) -> str:
    """The bucket of ``path`` (a path with a key below it, as :func:`insert_prefix` takes)."""
    head, bucket, _ = _split(path)
    return f"{head}{bucket}"


def insert_prefix(path: str, prefix: str) -> str:
    """``path`` (``s3://bucket/key``, ``/bucket/key`` or ``bucket/key``) with ``prefix``
    after the bucket: ``s3://bucket/<prefix>/key``.

    Raises:
        ValueError: an unsafe prefix, or a path with no key below its bucket.
    """
    problem = prefix_problem(prefix)
    if problem is not None:
        raise ValueError(problem)
    head, bucket, key = _split(path)
    return f"{head}{bucket}/{prefix}/{key}"
