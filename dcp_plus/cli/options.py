"""Arguments several verbs share: ``--storage-option KEY=VALUE`` (a URL's client settings)
and byte sizes."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from dcp_plus.errors import InvalidOptionError

_CREDENTIAL = re.compile(r"key|secret|token|password|session", re.IGNORECASE)


def add_storage_option(p: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--storage-option KEY=VALUE`` to ``p``."""
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="for an s3:// (fsspec) or nfs:// location: a client option, e.g. "
                        "endpoint_url=http://127.0.0.1:8333 (repeatable)")


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as a dict; a value that parses as JSON (numbers, ``true``,
    objects) is taken as such, any other stays a string, and so do credentials (keys naming
    a key, secret, token, password or session).

    Raises:
        InvalidOptionError: a pair without ``=`` or key.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidOptionError(f"--storage-option {pair!r}: expected KEY=VALUE")
        if _CREDENTIAL.search(key):  # a secret that looks like 1234 or true stays a string
            out[key] = value
            continue
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


_BYTE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6,
               "mib": 1 << 20, "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12,
               "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"256MiB"``, ``"1.5GB"``, ``"64m"`` -> bytes (a bare number is bytes).

    Raises:
        ValueError: not a positive size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    if not m or m[2] not in _BYTE_UNITS or float(m[1]) <= 0:
        raise ValueError(f"not a size: {text!r} (try 64MiB, 2GiB or 1.5GB)")
    return int(float(m[1]) * _BYTE_UNITS[m[2]])
