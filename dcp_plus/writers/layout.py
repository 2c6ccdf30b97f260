"""Assign resolved items to data files and 4 KiB-aligned offsets."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcp_plus.format.layout import ALIGNMENT, align_up, data_file_name
from dcp_plus.writers.items import ResolvedItem


@dataclass
class FilePlan:
    """One data file: its name and the items placed in it, with their offsets."""

    name: str
    placed: list[tuple[ResolvedItem, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(len(r.data) for r, _ in self.placed)

    @property
    def size(self) -> int:
        """The file's (or object's) length: the end of its last item."""
        return max((off + len(r.data) for r, off in self.placed), default=0)

    def slab_ranges(self) -> list[tuple[str, int, int, int]]:
        """``(slab, slab offset, file offset, length)`` of its slab-backed items: the ranges
        of a writer worker's job, whose checksums come back in this order."""
        return [(r.slab.slab, r.slab.offset, off, r.slab.length)
                for r, off in self.placed if r.slab]


def checksums_by_item(files: list[FilePlan], job_sums: list[list[str]]) -> dict[int, str]:
    """``{id(item): checksum}`` from one worker job per slab-backed file, in file order."""
    return {id(r): c for fp, sums in zip(files, job_sums, strict=True)
            for (r, _), c in zip(fp.placed, sums, strict=True)}


def plan_files(items: list[ResolvedItem], rank: int, save_id: str, bins: int,
               slab_parts: int = 1, first: int = 0) -> tuple[list[FilePlan], list[FilePlan]]:
    """Split items into slab-backed files and in-process files.

    Slab-backed items get files whose offsets mirror the slab offsets, so the files are the
    slab's byte image and adjacent extents coalesce into few large writes; runs of items this
    rank does not write (e.g. an HSDP replica's share) are closed up. A large slab is cut into
    up to ``slab_parts`` contiguous files (>= 64 MiB each) so that parallel writers never
    share a file (concurrent pwrites to one ext4 file serialise on its inode lock: 2-3x
    slower here). Other items are spread over ``bins`` files of similar size. Files are
    numbered from ``first``.
    """
    counter = iter(range(first, 1 << 30))
    by_slab: dict[str, list[ResolvedItem]] = {}
    local: list[ResolvedItem] = []
    for r in items:
        (by_slab.setdefault(r.slab.slab, []) if r.slab else local).append(r)

    slab_files = []
    for group in by_slab.values():
        group.sort(key=lambda r: r.slab.offset if r.slab else 0)
        for part in _contiguous_parts(group, slab_parts):
            fp = FilePlan(data_file_name(rank, next(counter), save_id))
            fp.placed = _mirror_slab(part)
            slab_files.append(fp)

    local_files: list[FilePlan] = []
    if local:
        n = max(1, min(bins, len(local)))
        sizes = [0] * n
        members: list[list[ResolvedItem]] = [[] for _ in range(n)]
        for r in sorted(local, key=lambda r: len(r.data), reverse=True):
            i = sizes.index(min(sizes))
            members[i].append(r)
            sizes[i] += align_up(len(r.data))
        for group in members:
            if not group:
                continue
            fp = FilePlan(data_file_name(rank, next(counter), save_id))
            offset = 0
            for r in group:
                fp.placed.append((r, offset))
                offset = align_up(offset + len(r.data))
            local_files.append(fp)
    return slab_files, local_files


def _mirror_slab(group: list[ResolvedItem]) -> list[tuple[ResolvedItem, int]]:
    """4 KiB-aligned file offsets that repeat the slab's deltas across alignment padding (so
    a stager slab's neighbours coalesce into one write) and close larger gaps, which hold
    items written by another rank."""
    placed: list[tuple[ResolvedItem, int]] = []
    slab_end = file_end = 0
    for r in group:
        assert r.slab is not None
        gap = r.slab.offset - slab_end
        mirrored = file_end + gap
        offset = (mirrored if placed and 0 <= gap < ALIGNMENT and mirrored % ALIGNMENT == 0
                  else align_up(file_end))
        placed.append((r, offset))
        slab_end, file_end = r.slab.offset + r.slab.length, offset + r.slab.length
    return placed


SPLIT_BYTES = 64 << 20


def _contiguous_parts(group: list[ResolvedItem], parts: int) -> list[list[ResolvedItem]]:
    """``group`` cut into at most ``parts`` runs of similar byte size (>= 64 MiB each)."""
    total = sum(len(r.data) for r in group)
    parts = max(1, min(parts, total // SPLIT_BYTES))
    out: list[list[ResolvedItem]] = [[]]
    acc = 0
    for r in group:
        if out[-1] and len(out) < parts and acc >= total * len(out) / parts:
            out.append([])
        out[-1].append(r)
        acc += len(r.data)
    return out
