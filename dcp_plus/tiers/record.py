"""The record of one memory-tier snapshot: what a restore needs, written last, sealed.

A snapshot is usable only through its record, and the record is written (renamed into place)
after every byte it describes is in shared memory: a snapshot cut by a crash has no record.
The record is read back as untrusted input (shape, types, bounds, seal) before any byte is used.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.strict_json import loads_strict
from dcp_plus.memory.slabs import SHM_DIR
from dcp_plus.tiers import names

FORMAT = "dcpp-tier/2"  # /2: checksums of tensors over 16 MiB are hashes of pieces
MAX_RECORD_BYTES = 256 << 20
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)
}

DTYPE_NAMES = {d: name for name, d in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the snapshot: its bytes are ``nbytes`` at ``offset`` of ``file``
    (laid out with ``stride``), with ``checksum`` (hex, :mod:`~dcp_plus.format.piece_digest`)."""

    fqn: str
    dtype: str
    shape: list[int]
    stride: list[int]
    file: str
    offset: int
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class TierRecord:
    """A complete snapshot of ``owner``'s state at ``step``, held by ``holder``."""

    job: str
    step: int
    world_size: int
    owner: int
    holder: int
    fingerprint: str
    """The structure's fingerprint (:func:`dcp_plus.tiers.flat.fingerprint`)."""
    entries: list[TensorEntry]
    values: str
    """Non-tensor values: base64 of ``torch.save({fqn: value})`` (``weights_only`` safe)."""
    values_checksum: str
    pid: int = field(default_factory=os.getpid)
    created: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def values_bytes(self) -> bytes:
        data = base64.b64decode(self.values.encode("ascii"), validate=True)
        if xxhash.xxh3_64_hexdigest(data) != self.values_checksum:
            raise CheckpointFormatError(
                f"memory-tier record of rank {self.owner} step {self.step}: its values do not "
                "match their checksum")
        return data

    def encode(self) -> bytes:
        body = {"format": FORMAT, **{k: getattr(self, k) for k in _FIELDS}}
        body["entries"] = [{k: getattr(e, k) for k in TensorEntry.__slots__}
                           for e in self.entries]  # asdict's deep copy costs 10x this
        text = json.dumps(body, separators=(",", ":"))
        seal = xxhash.xxh3_64_hexdigest(text.encode("utf-8"))
        return (text[:-1] + f',"record_checksum":"{seal}"}}').encode("utf-8")

    def write(self) -> str:
        """Put the record in place atomically (rename): before it, the snapshot does not
        exist. Returns its file name."""
        name = names.record_name(self.job, self.holder, self.owner, self.step)
        tmp = os.path.join(SHM_DIR, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(self.encode())
        os.replace(tmp, os.path.join(SHM_DIR, name))
        return name


_FIELDS = tuple(TierRecord.__dataclass_fields__)


def _fail(source: str, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{source}: not a valid memory-tier record: {why}")


def _int(v: Any, source: str, what: str, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v < 1 << 62:
        raise _fail(source, f"{what} must be an integer >= {lo}, got {v!r}")
    return v


def _str(v: Any, source: str, what: str) -> str:
    if type(v) is not str or len(v) > 4096 or "\x00" in v:
        raise _fail(source, f"{what} must be a short string")
    return v


def _blob(v: Any, source: str) -> str:
    if type(v) is not str or not v.isascii():
        raise _fail(source, "values must be a base64 string")
    return v


def _ints(v: Any, source: str, what: str) -> list[int]:
    if type(v) is not list or len(v) > 64:
        raise _fail(source, f"{what} must be a list of at most 64 integers")
    return [_int(x, source, what) for x in v]


def _entry(e: Any, source: str, job: str, holder: int) -> TensorEntry:
    if type(e) is not dict or set(e) != set(TensorEntry.__slots__):
        raise _fail(source, f"an entry must have exactly the fields {TensorEntry.__slots__}")
    fqn = _str(e["fqn"], source, "fqn")
    if e["dtype"] not in DTYPES:
        raise _fail(source, f"tensor {fqn!r}: unknown dtype {e['dtype']!r}")
    shape, stride = _ints(e["shape"], source, "shape"), _ints(e["stride"], source, "stride")
    if len(shape) != len(stride):
        raise _fail(source, f"tensor {fqn!r}: shape and stride differ in length")
    nbytes = _int(e["nbytes"], source, "nbytes")
    numel = 1
    for s in shape:
        numel *= s
    reach = sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
    span = 0 if numel == 0 else (1 + reach) * DTYPES[e["dtype"]].itemsize
    if span != nbytes:
        raise _fail(source, f"tensor {fqn!r}: nbytes {nbytes} is not what its shape, stride "
                    f"and dtype span ({span})")
    file = _str(e["file"], source, "file")
    parsed = names.parse(file)
    if nbytes and (parsed is None or parsed.job != job or parsed.holder != holder
                   or parsed.kind in ("record", "partial")):
        raise _fail(source, f"tensor {fqn!r}: {file!r} is not a data file of this job and rank")
    checksum = _str(e["checksum"], source, "checksum")
    return TensorEntry(fqn, e["dtype"], shape, stride, file, _int(e["offset"], source, "offset"),
                       nbytes, checksum)


def read(tier_file: names.TierFile) -> TierRecord:
    """The record at ``tier_file``, validated whole (see :func:`decode`), whose job, holder,
    owner and step must be the ones its name says.

    Raises:
        CheckpointFormatError: damaged, edited, of another format, or not matching its name.
        OSError: it could not be read (e.g. removed meanwhile).
    """
    source = tier_file.path
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_RECORD_BYTES + 1)
    record = decode(data, source)
    if (record.job, record.holder, record.owner, record.step) != (
            tier_file.job, tier_file.holder, tier_file.owner, tier_file.step):
        raise _fail(source, "its job, holder, owner or step is not the one its name says")
    return record


def decode(data: bytes, source: str) -> TierRecord:
    """A record from its bytes (``source`` names where they came from), validated whole.

    Raises:
        CheckpointFormatError: damaged, edited, or of another format.
    """
    if len(data) > MAX_RECORD_BYTES:
        raise _fail(source, f"larger than {MAX_RECORD_BYTES} bytes")
    tail = data.rfind(b',"record_checksum":"')
    if tail < 0 or not data.endswith(b'"}'):
        raise _fail(source, "it has no record_checksum (torn or edited)")
    seal = data[tail + 20:-2].decode("ascii", "replace")
    if xxhash.xxh3_64_hexdigest(data[:tail] + b"}") != seal:
        raise _fail(source, "it does not match its record_checksum (damaged or edited)")
    body = loads_strict(data, source, "memory-tier record")
    if type(body) is not dict or body.get("format") != FORMAT:
        raise _fail(source, f"format is not {FORMAT!r}")
    want = {"format", "record_checksum", *TierRecord.__dataclass_fields__}
    if set(body) != want:
        raise _fail(source, f"fields {sorted(set(body) ^ want)} missing or unexpected")
    job = _str(body["job"], source, "job")
    holder, owner = _int(body["holder"], source, "holder"), _int(body["owner"], source, "owner")
    if type(body["entries"]) is not list:
        raise _fail(source, "entries must be a list")
    entries = [_entry(e, source, job, holder) for e in body["entries"]]
    if type(body["created"]) not in (int, float):
        raise _fail(source, "created must be a number")
    return TierRecord(
        job, _int(body["step"], source, "step"), _int(body["world_size"], source,
                                                       "world_size", 1),
        owner, holder, _str(body["fingerprint"], source, "fingerprint"), entries,
        _blob(body["values"], source), _str(body["values_checksum"], source, "values_checksum"),
        _int(body["pid"], source, "pid"), float(body["created"]))
