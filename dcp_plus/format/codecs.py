"""Codecs: how an extent's raw bytes are stored. ``identity``, ``zstd``, ``zstd+shuffle``.

Compressed extents are a small header followed by independent zstd frames, each holding
``frame_size`` raw bytes (the last one fewer), so that frames encode and decode in parallel
(zstandard releases the GIL). Header, little-endian::

    b"DZF1" | u8 shuffle itemsize (1: none) | 3 bytes 0 | u32 frame_size | u32 n_frames
    | n_frames x u32 stored frame sizes

``zstd+shuffle`` first splits each frame's elements into byte planes (all first bytes, then
all second bytes...), which makes float weights compress better. An extent's checksum covers
its *stored* bytes, so corruption is detected before anything is decoded.
"""

from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

MAGIC = b"DZF1"
_HEAD = struct.Struct("<4sB3xII")
DEFAULT_FRAME_SIZE = 4 << 20
MAX_FRAMES = 1 << 24  # 64 TiB of raw bytes at the default frame size: larger is damage


def stored_length(read_at: Callable[[int, int], bytes]) -> int | None:
    """The stored length a compressed extent's header announces (header, frame table and
    frames), ``read_at(offset, n)`` reading the extent's bytes; None without a valid header."""
    head = read_at(0, _HEAD.size)
    if len(head) < _HEAD.size:
        return None
    magic, k, frame_size, n = _HEAD.unpack_from(head)
    if magic != MAGIC or k < 1 or frame_size < 1 or n > MAX_FRAMES:
        return None
    table = read_at(_HEAD.size, 4 * n)
    if len(table) < 4 * n:
        return None
    return _HEAD.size + 4 * n + int(np.frombuffer(table, dtype="<u4").sum(dtype=np.uint64))


class Codec(Protocol):
    name: str

    def encode(self, raw: memoryview, itemsize: int = 1) -> bytes | memoryview: ...

    def decode(self, stored: memoryview, raw_length: int) -> bytes | memoryview: ...

    def decode_into(self, stored: memoryview, out: memoryview) -> None: ...


class IdentityCodec:
    """Stores bytes as they are."""

    name = "identity"

    def encode(self, raw: memoryview, itemsize: int = 1) -> memoryview:
        return raw

    def decode(self, stored: memoryview, raw_length: int) -> memoryview:
        return stored

    def decode_into(self, stored: memoryview, out: memoryview) -> None:
        out[:] = stored


class ZstdCodec:
    """zstd in independent frames of ``frame_size`` raw bytes.

    Args:
        level: zstd compression level (1 fast .. 19 small; negative: faster still).
        threads: frames compressed or decompressed in parallel.
        shuffle: split elements into byte planes before compressing (``zstd+shuffle``).
        frame_size: raw bytes per frame (a multiple of 16, so every dtype's elements fit).
    """

    def __init__(self, level: int = 1, threads: int = 4, *, shuffle: bool = False,
                 frame_size: int = DEFAULT_FRAME_SIZE) -> None:
        if threads < 1 or frame_size < 16 or frame_size % 16:
            raise ValueError(f"ZstdCodec needs threads >= 1 and a frame_size that is a "
                             f"positive multiple of 16, got threads={threads}, "
                             f"frame_size={frame_size}")
        self.level = level
        self.threads = threads
        self.shuffle = shuffle
        self.frame_size = frame_size
        self.name = "zstd+shuffle" if shuffle else "zstd"
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_pool=None, _lock=None, _local=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"ZstdCodec(level={self.level}, threads={self.threads}, shuffle={self.shuffle})"

    def _map(self, fn: Any, args: list[Any]) -> list[Any]:
        if self.threads == 1 or len(args) <= 1:
            return [fn(a) for a in args]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dcpp-zstd")
        return list(self._pool.map(fn, args))

    def _compressor(self) -> Any:
        import zstandard

        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self.level)
        return c

    def encode(self, raw: memoryview, itemsize: int = 1) -> bytes:
        raw = raw.cast("B") if raw.format != "B" or raw.ndim != 1 else raw
        k = itemsize if self.shuffle and itemsize > 1 and len(raw) % itemsize == 0 else 1
        bounds = [(a, min(a + self.frame_size, len(raw)))
                  for a in range(0, len(raw), self.frame_size)]

        def frame(b: tuple[int, int]) -> bytes:
            chunk: Any = raw[b[0] : b[1]]
            if k > 1:  # byte planes: all first bytes, then all second bytes...
                chunk = np.ascontiguousarray(np.frombuffer(chunk, dtype=np.uint8)
                                             .reshape(-1, k).T)
            return self._compressor().compress(chunk)

        frames = self._map(frame, bounds)
        head = _HEAD.pack(MAGIC, k, self.frame_size, len(frames))
        sizes = struct.pack(f"<{len(frames)}I", *(len(f) for f in frames))
        return b"".join([head, sizes, *frames])

    def decode(self, stored: memoryview, raw_length: int) -> bytes:
        out = bytearray(raw_length)
        self.decode_into(stored, memoryview(out))
        return bytes(out)

    def decode_into(self, stored: memoryview, out: memoryview) -> None:
        """Decode ``stored`` into ``out`` (exactly ``raw_length`` bytes), frames in parallel.

        Raises:
            ValueError: the header or a frame does not match ``out``'s length.
        """
        import zstandard

        stored = stored.cast("B") if stored.format != "B" or stored.ndim != 1 else stored
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if len(stored) < _HEAD.size:
            raise ValueError("compressed extent is shorter than its header")
        magic, k, frame_size, n = _HEAD.unpack_from(stored)
        if magic != MAGIC or k < 1 or frame_size < 1:
            raise ValueError(f"not a {self.name} extent (bad header)")
        if n != -(-len(out) // frame_size):
            raise ValueError(f"header announces {n} frames of {frame_size} bytes, but the "
                             f"extent decodes to {len(out)} bytes")
        if _HEAD.size + 4 * n > len(stored):
            raise ValueError(f"header announces {n} frames, more than the extent's "
                             f"{len(stored)} bytes can hold")
        sizes = struct.unpack_from(f"<{n}I", stored, _HEAD.size)
        pos = _HEAD.size + 4 * n
        jobs = []
        for i, size in enumerate(sizes):
            a, b = i * frame_size, min((i + 1) * frame_size, len(out))
            jobs.append((stored[pos : pos + size], out[a:b]))
            pos += size
        if pos != len(stored):
            raise ValueError(f"frame sizes add up to {pos} bytes, the extent holds "
                             f"{len(stored)}")

        def frame(job: tuple[memoryview, memoryview]) -> None:
            src, dst = job
            try:
                data = zstandard.ZstdDecompressor().decompress(src, max_output_size=len(dst))
            except zstandard.ZstdError as e:
                raise ValueError(f"a frame does not decode: {e}") from None
            if len(data) != len(dst):
                raise ValueError(f"a frame decoded to {len(data)} bytes, expected {len(dst)}")
            if k > 1:
                _unshuffle_into(np.frombuffer(data, dtype=np.uint8).reshape(k, -1), dst, k)
            else:
                dst[:] = data

        self._map(frame, jobs)


_WIDE = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _unshuffle_into(planes: np.ndarray, dst: memoryview, k: int) -> None:
    """Interleave ``k`` byte planes back into elements of ``dst``: on a little-endian
    machine as ``k``-byte integers built from shifted planes (4x faster here than a strided
    transposed copy, which is the fallback)."""
    out = np.frombuffer(dst, dtype=np.uint8)
    wide = _WIDE.get(k) if sys.byteorder == "little" else None
    if wide is None:
        out.reshape(-1, k)[:] = planes.T
        return
    d = out.view(wide)
    d[:] = planes[0]
    tmp = np.empty(len(d), dtype=wide)
    for i in range(1, k):
        np.left_shift(planes[i], 8 * i, out=tmp, dtype=wide)
        np.bitwise_or(d, tmp, out=d)


IDENTITY = IdentityCodec()
_CODECS: dict[str, Codec] = {
    IDENTITY.name: IDENTITY,
    "zstd": ZstdCodec(),
    "zstd+shuffle": ZstdCodec(shuffle=True),
}


def register_codec(codec: Codec) -> None:
    _CODECS[codec.name] = codec


def get_codec(name: str) -> Codec:
    try:
        return _CODECS[name]
    except KeyError:
        raise KeyError(f"unknown codec {name!r}; known: {sorted(_CODECS)}") from None


def known_codec(name: str) -> bool:
    return name in _CODECS


def resolve_codec(codec: str | Codec) -> Codec:
    """A codec given by name (registered) or as an instance (e.g. ``ZstdCodec(level=9)``)."""
    return get_codec(codec) if isinstance(codec, str) else codec
