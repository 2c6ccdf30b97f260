"""Incremental saves on the writer's side: what each extent is compared with, and the extents
made of what the writes found.

Every tensor extent of an incremental save is stored as parts
(:mod:`dcp_plus.format.parts`). With a base (a committed checkpoint beside this one), each
part whose hash equals the base's part of the same extent is recorded as a reference to
where the base keeps it and not written; an extent none of whose parts changed becomes a
whole reference to the base's extent. With ``old`` slabs (the previous snapshot, still in
shared memory) changed parts may be stored as XOR deltas.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_plus.errors import CheckpointFormatError, CheckpointNotFoundError, InvalidOptionError
from dcp_plus.format.checksum import bind_checksum, checksum_bytes
from dcp_plus.format.extent import Extent, identity_of
from dcp_plus.format.extent_set import bases_of
from dcp_plus.format.parts import (
    CHUNKED,
    DELTA_CODEC,
    PART_CODECS,
    Part,
    can_extend,
    own_span,
    parts_digest,
)
from dcp_plus.format.record import RECORD_NAME, decode_record, dtype_name
from dcp_plus.memory.slabs import SlabRef, registry
from dcp_plus.storage.location import StoreClient
from dcp_plus.writers.chunk_encode import (
    DEFAULT_PART_BYTES,
    ChunkSpec,
    Outcome,
    encode_pieces,
    pack,
    part_bounds,
    part_bytes_problem,
)
from dcp_plus.writers.codec_choice import CodecChoice
from dcp_plus.writers.items import ResolvedItem
from dcp_plus.writers.layout import FilePlan

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BaseExtents:
    """A base checkpoint's extents (of some items) and its tensors' dtypes."""

    extents: Mapping[MetadataIndex, Extent]
    dtypes: Mapping[str, torch.dtype]


@dataclasses.dataclass(frozen=True)
class Increments:
    """A writer's incremental settings (see ``LocalWriter(base=..., part_bytes=...)``).

    Attributes:
        base: the name of the base checkpoint beside this one (None: a full save whose parts
            later saves can reference).
        part_bytes: raw bytes per part.
        base_required: a missing base fails the save (a user's explicit ``base=``) instead of
            making it a full one (``CheckpointManager``, whose base may have failed).
        old: where each item's bytes of the base's snapshot are still in shared memory (XOR
            deltas; ``CheckpointManager(delta=True)``).
    """

    base: str | None = None
    part_bytes: int = DEFAULT_PART_BYTES
    base_required: bool = True
    old: Mapping[MetadataIndex, SlabRef] | None = None
    keep_replaced: bool = False
    """An overwrite keeps the replaced record's data files (a sibling may reference them):
    set by the manager and TorchTitan, which re-save a step only rarely."""
    known: BaseExtents | None = None
    """The base's extents of this rank's items as this rank's writer of the base built them
    (the manager's chain): the base's commit record, as large as the world's, is then not
    read by every rank at every save."""


    def __post_init__(self) -> None:
        problem = part_bytes_problem(self.part_bytes)
        if problem is not None:
            raise InvalidOptionError(f"part_bytes {problem}")


@dataclasses.dataclass
class Chunking:
    """One save's plan: a :class:`ChunkSpec` per tensor item and the base's extents."""

    specs: dict[int, ChunkSpec]
    """By ``id(item)``: every tensor item's (empty ones included)."""
    base_name: str | None
    base_extents: Mapping[MetadataIndex, Extent]

    def extent(self, r: ResolvedItem, file: str, outcomes: list[Outcome]) -> Extent:
        """The extent of item ``r`` written into ``file`` with ``outcomes`` (one per part)."""
        index = r.item.index
        td = r.item.tensor_data
        dname = None if td is None else dtype_name(td.properties.dtype)
        raw_length = len(r.data)
        if not outcomes:  # an empty tensor: nothing stored
            identity = identity_of(index.fqn, index.offset, dname, 0, 0, "identity", None)
            return Extent(file, 0, 0, 0, "identity",
                          bind_checksum(checksum_bytes(b""), identity))
        base = self.base_extents.get(index) if self.specs[id(r)].base is not None else None
        if base is not None and all(o[1] is None for o in outcomes):
            return base._replace(base=base.base or self.base_name)
        holder = None if base is None else base.base or self.base_name
        parts = []
        for k, ((a, b), (h, codec, off, length)) in enumerate(zip(
                part_bounds(raw_length, self.specs[id(r)].part_bytes), outcomes, strict=True)):
            old = None if base is None or base.parts is None else base.parts[k]
            if codec is None:
                assert old is not None and holder is not None
                parts.append(old.located(holder))
                continue
            against = None
            if codec == DELTA_CODEC:
                assert old is not None and holder is not None
                against = old.located(holder)
            parts.append(Part(h, b - a, codec, file, off, length, None, against))
        span = own_span(tuple(parts))
        assert span is not None  # some part changed: stored here
        identity = identity_of(index.fqn, index.offset, dname, raw_length, span[2], CHUNKED,
                               None)
        return Extent(span[0], span[1], span[2], raw_length, CHUNKED,
                      bind_checksum(parts_digest(tuple(parts)), identity),
                      parts=tuple(parts))


def plan_chunking(writer: StoreClient, inc: Increments, items: list[ResolvedItem],
                  codecs: CodecChoice) -> Chunking:
    """This rank's :class:`Chunking`: the base's record read (if there is one) and each
    tensor item compared with the base's extent of the same index."""
    found = None if inc.base is None else inc.known or _read_base(writer, inc)
    if found is not None and _own_name(writer) in (bases_of(found.extents) or ()):
        # the base references the checkpoint this save replaces: referencing its bytes
        # in turn would point this record at files the overwrite removes
        log.warning("%s: base %s references the checkpoint this save replaces; this save is a "
                    "full one", writer.path, inc.base)
        found = None
    extents = {} if found is None else found.extents
    dtypes = {} if found is None else found.dtypes
    specs = {}
    for r in items:
        td = r.item.tensor_data
        if td is None:
            continue
        codec = codecs.codec_for(r.fqn).name
        if codec not in PART_CODECS:
            raise CheckpointFormatError(f"tensor {r.fqn!r}: codec {codec!r} cannot store the "
                                        "parts of an incremental checkpoint (use identity, "
                                        "zstd or zstd+shuffle)")
        index = r.item.index
        base = extents.get(index)
        hashes = None
        if (base is not None and base.parts is not None
                and dtypes.get(index.fqn) == td.properties.dtype
                and [p.raw for p in base.parts]
                == [b - a for a, b in part_bounds(len(r.data), inc.part_bytes)]):
            hashes = tuple(p.hash for p in base.parts)
        old = None if inc.old is None or hashes is None else inc.old.get(index)
        if old is not None and base is not None and base.parts is not None and not all(
                can_extend(p, inc.part_bytes) for p in base.parts):
            old = None  # one more delta would pass the chain limits readers enforce
        if old is not None and (old.length != len(r.data) or (r.slab is not None and (
                old.slab, old.offset) == (r.slab.slab, r.slab.offset))):
            old = None  # one buffer for both snapshots: the old bytes are gone
        specs[id(r)] = ChunkSpec(inc.part_bytes, hashes, codec, td.properties.dtype.itemsize,
                                 None if old is None else (old.slab, old.offset))
    return Chunking(specs, None if found is None else inc.base, extents)


def own_extents(items: list[ResolvedItem], extents: list[tuple[MetadataIndex, Extent]]
                ) -> BaseExtents:
    """What this rank's save is, as a later save's base (:attr:`Increments.known`)."""
    return BaseExtents(dict(extents), {r.fqn: r.item.tensor_data.properties.dtype
                                       for r in items if r.item.tensor_data is not None})


def _own_name(writer: StoreClient) -> str:
    return writer.path.partition("?")[0].rstrip("/").rpartition("/")[2]


def _read_base(writer: StoreClient, inc: Increments) -> BaseExtents | None:
    if inc.base is None:
        return None
    other = writer.sibling(inc.base)
    try:
        data = other._store.get(RECORD_NAME)
        if data is None:
            if inc.base_required:
                raise CheckpointNotFoundError(
                    f"{other.path}: the base of incremental checkpoint {writer.path} has no "
                    f"commit record {RECORD_NAME}: pass a committed checkpoint as base")
            log.warning("%s: base %s is not committed; this save is a full one", writer.path,
                        other.path)
            return None
        md = decode_record(data, f"{other.path}/{RECORD_NAME}")
    finally:
        other._close_store()
    return BaseExtents(md.storage_data, {
        fqn: item.properties.dtype for fqn, item in md.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)})


def chunked_file(fp: FilePlan, specs: Mapping[int, ChunkSpec]) -> bool:
    """Whether ``fp`` holds extents stored as parts (files never mix them with others)."""
    return any(id(r) in specs for r, _ in fp.placed)


def encode_files(files: list[FilePlan], specs: Mapping[int, ChunkSpec]
                 ) -> tuple[list[FilePlan], dict[int, list[Outcome]]]:
    """In this process: the chunked files of ``files`` replaced by files of their stored
    pieces (packed), and each chunked item's outcomes by ``id(item)``."""
    out, outcomes = [], {}
    for fp in files:
        if not chunked_file(fp, specs):
            out.append(fp)
            continue
        pieces = [encode_pieces(r.data, specs[id(r)], _old_bytes(specs[id(r)], len(r.data)))
                  for r, _ in fp.placed]
        rows, _ = pack(pieces)
        packed = FilePlan(fp.name)
        for (r, _), ps, os_ in zip(fp.placed, pieces, rows, strict=True):
            outcomes[id(r)] = os_
            packed.placed += [(ResolvedItem(r.item, memoryview(p.data), None), o[2])
                              for p, o in zip(ps, os_, strict=True) if p.data is not None]
        out.append(packed)
    return out, outcomes


def _old_bytes(spec: ChunkSpec, n: int) -> memoryview | None:
    """The previous snapshot's bytes at ``spec.old``, from its slab mapped in this process
    (None when that slab is gone): what the worker processes read, for writers without them."""
    if spec.old is None:
        return None
    slab = registry.by_name(spec.old[0])
    try:
        view = None if slab is None else slab.buffer[spec.old[1] : spec.old[1] + n]
    except ValueError:  # closed meanwhile
        return None
    return view if view is not None and len(view) == n else None


def stored_bytes(files: list[FilePlan], specs: Mapping[int, ChunkSpec],
                 sums: Mapping[int, object]) -> int:
    """The bytes the save's data files hold: planned sizes, or for files of parts, the
    pieces stored in them."""
    total = 0
    for fp in files:
        if not chunked_file(fp, specs):
            total += fp.size
            continue
        total += sum(o[3] for r, _ in fp.placed for o in sums[id(r)])  # type: ignore[attr-defined]
    return total
