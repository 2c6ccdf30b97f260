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


def plan_files(items: list[ResolvedItem], rank: int, save_id: str,
               bins: int) -> tuple[list[FilePlan], list[FilePlan]]:
    """Split items into slab-backed files and in-process files.

    Slab-backed items get one file per slab whose offsets mirror the slab offsets, so the
    file is the slab's byte image and adjacent extents coalesce into few large writes.
    Other items are spread over ``bins`` files of similar size, written in parallel.
    """
    counter = iter(range(1 << 30))
    by_slab: dict[str, list[ResolvedItem]] = {}
    local: list[ResolvedItem] = []
    for r in items:
        (by_slab.setdefault(r.slab.slab, []) if r.slab else local).append(r)

    slab_files = []
    for group in by_slab.values():
        group.sort(key=lambda r: r.slab.offset if r.slab else 0)
        base = group[0].slab.offset // ALIGNMENT * ALIGNMENT if group[0].slab else 0
        fp = FilePlan(data_file_name(rank, next(counter), save_id))
        fp.placed = [(r, r.slab.offset - base) for r in group if r.slab]
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
