"""Parts of a chunked extent: the pieces an incremental checkpoint stores a tensor in.

A tensor chunk saved with incremental checkpoints on is cut into fixed-size pieces (the last
one shorter); each is a :class:`Part`: the xxh3-128 of its raw bytes, how it is stored
(``codec``) and where (a data file of this checkpoint, or with ``where`` set, of the sibling
checkpoint of that name, whose bytes the part references instead of storing them again). A
part stored as an XOR delta (:data:`DELTA_CODEC`) names the part it was taken against, which
decodes first (a chain, bounded by :data:`MAX_CHAIN`).

In the record a part is a JSON object::

    {"hash": "xxh3-128:<32 hex>", "raw": int, "codec": str, "file": str, "offset": int,
     "length": int, "in": str (optional), "against": {part} (delta parts only)}

``in`` (absent: the checkpoint whose record holds the extent) is a sibling directory's name:
references never leave the checkpoint's parent directory.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import xxhash

from dcp_plus.format.checksum import checksum_bytes

PART_ALGORITHM = "xxh3-128"
CHUNKED = "chunked"
"""``Extent.codec`` of an extent stored as parts."""
DELTA_CODEC = "xor+zstd+shuffle"
"""A part stored as the XOR of its bytes with its ``against`` part's, byte-shuffled and zstd
compressed (mostly zeros where few bytes changed)."""
PART_CODECS = frozenset({"identity", "zstd", "zstd+shuffle", DELTA_CODEC})
MAX_CHAIN = 128
"""Deepest chain of delta parts a record may hold (``full_every`` bounds it in practice)."""
MAX_PART_BYTES = 64 << 20
"""Largest part (raw bytes): what a reader allocates for one part is bounded by it."""
MAX_CHAIN_BYTES = 1 << 30
"""Largest sum of the stored lengths along one part's delta chain: what a reader holds at
once to rebuild one part (hostile records cannot make it allocate more)."""
MAX_PARTS = 1 << 24
INT64_MAX = (1 << 63) - 1

_HASH = re.compile(rf"^{PART_ALGORITHM}:[0-9a-f]{{32}}$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+@,-]{0,254}$")


def part_hash(data: bytes | memoryview) -> str:
    """The hash a part records of its raw bytes (xxh3-128, ~28 GB/s here)."""
    return f"{PART_ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


class Part(NamedTuple):
    """One piece of a chunked extent: ``raw`` bytes whose hash is ``hash``, stored as
    ``length`` bytes at ``offset`` of ``file`` with ``codec``; ``where``: the sibling
    checkpoint holding that file (None: the one the extent lies in); ``against``: the part
    a delta was taken against."""

    hash: str
    raw: int
    codec: str
    file: str
    offset: int
    length: int
    where: str | None = None
    against: Part | None = None

    def located(self, holder: str) -> Part:
        """This part as a record other than ``holder``'s names it: every part of the chain
        that lies in ``holder`` itself gets ``where=holder``."""
        against = None if self.against is None else self.against.located(holder)
        return self._replace(where=self.where or holder, against=against)


def part_json(p: Part) -> dict[str, Any]:
    out: dict[str, Any] = {"hash": p.hash, "raw": p.raw, "codec": p.codec, "file": p.file,
                           "offset": p.offset, "length": p.length}
    if p.where is not None:
        out["in"] = p.where
    if p.against is not None:
        out["against"] = part_json(p.against)
    return out


def parts_digest(parts: tuple[Part, ...]) -> str:
    """The content checksum of a chunked extent, bound into its extent checksum: the hash
    of its parts' table (each part then vouches for its own bytes)."""
    text = json.dumps([part_json(p) for p in parts], separators=(",", ":"), sort_keys=True)
    return checksum_bytes(text.encode())


def references(parts: tuple[Part, ...]) -> set[str]:
    """The sibling checkpoints ``parts`` read from (delta chains included)."""
    return {q.where for p in parts for q in chain(p) if q.where is not None}


def chain(p: Part) -> list[Part]:
    """``p`` and the parts its delta was taken against, outermost first."""
    out = []
    cur: Part | None = p
    while cur is not None:
        out.append(cur)
        cur = cur.against
    return out


def chain_bytes(p: Part) -> int:
    """The stored bytes of ``p``'s whole chain (what rebuilding it reads)."""
    return sum(q.length for q in chain(p))


def can_extend(p: Part, part_bytes: int) -> bool:
    """Whether a delta of ``part_bytes`` taken against ``p`` stays within the chain limits
    every reader enforces (depth and stored bytes)."""
    return len(chain(p)) < MAX_CHAIN and chain_bytes(p) + part_bytes <= MAX_CHAIN_BYTES


def sibling_problem(name: object) -> str | None:
    """Why ``name`` cannot name a sibling checkpoint (a single, visible path component), or
    None."""
    if type(name) is not str or not _NAME.match(name):
        return f"{str(name)[:80]!r} is not a sibling checkpoint's name (one path component)"
    return None


def parse_parts(value: Any, fail: Any, where: str, relative_path: Any) -> tuple[Part, ...]:
    """Parts from their JSON (untrusted): ``fail(field, problem)`` makes the error,
    ``relative_path(path, field)`` checks a data-file name."""
    if type(value) is not list or not value or len(value) > MAX_PARTS:
        raise fail(where, f"expected a non-empty list of at most {MAX_PARTS} parts")
    out = []
    for i, v in enumerate(value):
        part = _parse_part(v, fail, f"{where}[{i}]", relative_path, 0)
        chain = chain_bytes(part)
        if chain > MAX_CHAIN_BYTES:
            raise fail(f"{where}[{i}]", f"its delta chain stores {chain} bytes, more than "
                                        f"{MAX_CHAIN_BYTES}")
        out.append(part)
    return tuple(out)


_KEYS = {"hash", "raw", "codec", "file", "offset", "length", "in", "against"}


def _parse_part(v: Any, fail: Any, where: str, relative_path: Any, depth: int) -> Part:
    if type(v) is not dict:
        raise fail(where, "expected a part object")
    unknown = set(v) - _KEYS
    if unknown:
        raise fail(f"{where}.{sorted(unknown)[0]}", "unknown field of a part")
    h, raw, codec, file = v.get("hash"), v.get("raw"), v.get("codec"), v.get("file")
    offset: Any = v.get("offset")
    length: Any = v.get("length")
    raw_n: Any = raw
    if type(h) is not str or not _HASH.match(h):
        raise fail(f"{where}.hash", f"expected a {PART_ALGORITHM} hash")
    for name, n, low, high in (("raw", raw, 1, MAX_PART_BYTES), ("offset", offset, 0, INT64_MAX),
                               ("length", length, 0, MAX_CHAIN_BYTES)):
        if type(n) is not int or not low <= n <= high:
            raise fail(f"{where}.{name}", f"expected an integer in [{low}, {high}]")
    if offset + length > INT64_MAX:
        raise fail(where, "part ends beyond the int64 range")
    if codec not in PART_CODECS:
        raise fail(f"{where}.codec", f"unknown part codec {str(codec)[:80]!r}")
    if codec == "identity" and length != raw:
        raise fail(where, f"uncompressed part with length {length} != raw {raw}")
    if type(file) is not str:
        raise fail(f"{where}.file", "expected a string")
    relative_path(file, f"{where}.file")
    sibling = v.get("in")
    if "in" in v and sibling_problem(sibling) is not None:
        raise fail(f"{where}.in", str(sibling_problem(sibling)))
    against = None
    if codec == DELTA_CODEC:
        if depth >= MAX_CHAIN:
            raise fail(where, f"a chain of more than {MAX_CHAIN} delta parts")
        against = _parse_part(v.get("against"), fail, f"{where}.against", relative_path,
                              depth + 1)
        if against.raw != raw:
            raise fail(f"{where}.against", f"{against.raw} raw bytes, the part has {raw}")
    elif "against" in v:
        raise fail(f"{where}.against", f"only {DELTA_CODEC} parts are taken against another")
    return Part(h, raw_n, codec, file, offset, length, sibling, against)


def own_span(parts: tuple[Part, ...]) -> tuple[str, int, int] | None:
    """``(file, offset, length)`` covering the parts stored in the extent's own checkpoint
    (None: it stores none); raises ``ValueError`` if they lie in more than one file."""
    own = [p for p in parts if p.where is None]
    if not own:
        return None
    files = {p.file for p in own}
    if len(files) > 1:
        raise ValueError(f"its own parts lie in {len(files)} files")
    start = min(p.offset for p in own)
    return own[0].file, start, max(p.offset + p.length for p in own) - start


def spans(ext: Any) -> list[tuple[str | None, str, int]]:
    """``(checkpoint, file, end)`` of every stored byte range an extent needs (checkpoint
    None: the one whose record holds it), references and delta chains included."""
    if ext.parts is None:
        return [(ext.base, ext.file, ext.offset + ext.length)]
    return [(q.where or ext.base, q.file, q.offset + q.length)
            for p in ext.parts for q in chain(p)]
