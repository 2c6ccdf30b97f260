"""The XOR delta of a part against the part it replaces (``xor+zstd+shuffle``).

Where few elements of a piece changed (sparse embedding rows, a few weights), the XOR of new
and old bytes is zero almost everywhere, and the high bytes of changed floats mostly agree:
byte planes (shuffle) of the XOR compress to a small fraction of the piece (taken only where
many bytes changed: the frame header says whether they were). The stored form
is a :class:`~dcp_plus.format.codecs.ZstdCodec` extent of the XOR, so decoding is "decode the
frames, XOR with the old bytes"; lossless for every dtype.
"""

from __future__ import annotations

import threading
from functools import cache

import numpy as np

from dcp_plus.format.codecs import ZstdCodec

SHUFFLE_ABOVE = 8
"""Byte planes are taken only when more than 1 / SHUFFLE_ABOVE of the XOR's bytes are set."""


@cache
def _codec(level: int) -> ZstdCodec:
    return ZstdCodec(level=level, threads=1, shuffle=True)


def _u8(data: memoryview | bytes | bytearray) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def xor_into(out: memoryview, other: memoryview | bytes | bytearray) -> None:
    """``out ^= other`` bytewise (8 bytes at a time where the lengths allow)."""
    a, b = np.frombuffer(out, dtype=np.uint8), _u8(other)
    if len(a) != len(b):
        raise ValueError(f"XOR of {len(a)} bytes with {len(b)}")
    n8 = len(a) - len(a) % 8
    if n8:
        np.bitwise_xor(a[:n8].view(np.uint64), b[:n8].view(np.uint64), out=a[:n8].view(np.uint64))
    if n8 < len(a):
        np.bitwise_xor(a[n8:], b[n8:], out=a[n8:])


def encode_delta(new: memoryview, old: memoryview | bytes | bytearray, itemsize: int,
                 level: int = 1) -> bytes:
    """The stored form of ``new`` taken against ``old`` (same length); ``itemsize``: the
    tensor's element size (the shuffle's plane count)."""
    x = bytearray(new)
    xor_into(memoryview(x), old)
    # byte planes cost more time than they save where few bytes changed (sparse rows: 6x
    # slower for 15 % less); where most did (dense optimizer moments) they save 15 %
    dense = np.count_nonzero(np.frombuffer(x, dtype=np.uint8)) * SHUFFLE_ABOVE > len(x)
    return _codec(level).encode(memoryview(x), itemsize if dense else 1)


def apply_delta(stored: memoryview, out: memoryview) -> None:
    """Turn ``out`` (the old bytes) into the new ones :func:`encode_delta` stored.

    Raises:
        ValueError: the frames do not decode to ``len(out)`` bytes.
    """
    change = _scratch(len(out))
    _codec(1).decode_into(stored, change)
    xor_into(out, change)


_local = threading.local()


def _scratch(n: int) -> memoryview:
    """``n`` bytes of this thread's reused buffer (fresh memory is slow to touch here)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = bytearray(n)
    return memoryview(buf)[:n]
