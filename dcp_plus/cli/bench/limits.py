"""Physical limits a checkpoint cannot beat on this machine.

- memcpy: one ``copy_`` of the state's byte count into a pre-faulted shared-memory buffer
  (what staging costs at best);
- durable write: the same bytes from warm memory, one ``pwrite`` stream + ``fsync``
  (what a durable save costs at best) — for URLs, one object ``pipe`` through fsspec;
- cold read: ``dd`` of the written file from a cold page cache (what a load costs at best) —
  for URLs, one object ``cat``.

Shared by ``benchmarks/save_load.py``, ``benchmarks/staging.py`` and ``dcp-plus bench``.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dcp_plus.memory.slabs import Slab

CHUNK = 64 << 20


class MemcpyLimit:
    """One ``copy_`` of ``nbytes`` into a pre-faulted shared buffer (kept for re-measuring)."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8)
        self.src.fill_(1)
        self.slab = Slab(nbytes)
        self.dst = self.slab.tensor()
        self.dst.zero_()  # pre-fault

    def measure(self, repeats: int = 3) -> float:
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            self.dst.copy_(self.src)
            best = min(best, time.perf_counter() - t)
        return best

    def close(self) -> None:
        del self.dst, self.src
        self.slab.close()


def pwrite_files(buf: memoryview, nbytes: int, d: str, streams: int = 1,
                 direct: bool = False) -> list[str]:
    """Write ``buf[:nbytes]`` into ``streams`` files ``d/pwrite{i}.bin`` + ``fsync`` each.

    ``direct``: O_DIRECT for the 4 KiB-aligned body of each file (the page cache is bypassed;
    the sub-4 KiB tail goes through it), then fsync as usual. ``buf`` must be page-aligned
    for ``direct``. Returns the files written.
    """
    per = nbytes // streams // 4096 * 4096
    bounds = [(i * per, (i + 1) * per if i < streams - 1 else nbytes) for i in range(streams)]
    paths = [os.path.join(d, f"pwrite{i}.bin") for i in range(streams)]

    def one(i: int, lo: int, hi: int) -> None:
        path = paths[i]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        dfd = os.open(path, os.O_WRONLY | os.O_DIRECT) if direct else fd
        try:
            body = lo + (hi - lo) // 4096 * 4096 if direct else hi
            for start, end, f in ((lo, body, dfd), (body, hi, fd)):
                done = start
                while done < end:
                    done += os.pwrite(f, buf[done:min(done + CHUNK, end)], done - lo)
            os.fsync(fd)
        finally:
            if dfd != fd:
                os.close(dfd)
            os.close(fd)

    with ThreadPoolExecutor(streams) as ex:
        for f in [ex.submit(one, i, lo, hi) for i, (lo, hi) in enumerate(bounds)]:
            f.result()
    return paths


def dd_read(files: list[str], parallel: bool = False, direct: bool = False) -> None:
    """``dd if=F of=/dev/null bs=64M`` over ``files``, one after another or all at once."""
    flag = ["iflag=direct"] if direct else []
    cmds = [["dd", f"if={f}", "of=/dev/null", "bs=64M", "status=none", *flag] for f in files]
    if parallel:
        procs = [subprocess.Popen(c) for c in cmds]
        for p in procs:
            if p.wait():
                raise RuntimeError(f"dd failed: {' '.join(p.args)}")  # type: ignore[arg-type]
    else:
        for c in cmds:
            subprocess.run(c, check=True)


def url_write(fs: Any, url: str, data: bytes) -> None:
    """One object holding ``data``, through fsspec (the client stack's floor for a save)."""
    fs.pipe_file(url, data)


def url_read(fs: Any, url: str) -> int:
    """Read one object back through fsspec; returns its length."""
    return len(fs.cat_file(url))
