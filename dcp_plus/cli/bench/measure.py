"""What one rank measures (the limits, then each case's saves and cold load) and how the
ranks' results merge into one figure per case."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import asdict
from typing import Any

import torch.distributed as dist

from dcp_plus.cli.bench.cases import Case, build_cases
from dcp_plus.cli.bench.config import BenchConfig
from dcp_plus.cli.bench.limits import (
    STREAMS,
    MemcpyLimit,
    dd_read,
    direct_read,
    direct_refusal,
    pwrite_files,
    ring_buffers,
    url_read,
    url_write,
)
from dcp_plus.cli.bench.machine import (
    ForeignCpu,
    PeakMemory,
    drop_caches,
    evict_files,
    fs_type,
    load1,
)
from dcp_plus.cli.bench.models import (
    empty_like_state_dict,
    gpt2_like_state_dict,
    iter_tensors,
    shape_for_size,
    state_dict_nbytes,
    states_equal,
)
from dcp_plus.cli.bench.pagecache import cached_now, residency


class _Storage:
    """Paths under the run's root, local or URL, and how to make a load start cold."""

    def __init__(self, cfg: BenchConfig, root: str) -> None:
        self.cfg, self.root = cfg, root
        self.fs: Any = None
        self.cache_method: str | None = None  # how the last cache_fraction counted
        if cfg.is_url:
            import fsspec

            self.fs, _ = fsspec.core.url_to_fs(root, **cfg.storage_options)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def remove(self, path: str) -> None:
        if self.fs is not None:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        else:
            shutil.rmtree(path, ignore_errors=True)

    def cache_baseline(self) -> int | None:
        """``Cached`` now, for :meth:`cache_fraction`'s fallback (None for object stores)."""
        return None if self.fs is not None else cached_now()

    def cache_fraction(self, path: str, baseline: int | None) -> float | None:
        """The share of checkpoint ``path``'s bytes in the page cache (None for URLs)."""
        if self.fs is not None:
            return None
        r = residency([path], baseline)
        self.cache_method = r.method
        return r.fraction

    def make_cold(self, paths: list[str]) -> str:
        if self.fs is not None:
            return "none (object store)"
        if self.cfg.cold == "global":
            return drop_caches(paths)
        evict_files(paths)
        return "fadvise (this run's files)"


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _local_limits(store: _Storage, buf: memoryview, nbytes: int, d: str,
                  world: int) -> dict[str, Any]:
    """Buffered pwrite + fsync and ``dd`` cold read; then, unless the file system refuses it,
    O_DIRECT writes with each of :data:`STREAMS` streams and O_DIRECT cold reads of the
    widest set of files (written with O_DIRECT: not in the page cache) with each of them,
    into ``buf`` (the 4 KiB-rounded slab the bytes came from)."""
    out: dict[str, Any] = {}
    os.makedirs(os.path.join(d, "buffered"))
    t = time.perf_counter()
    files = pwrite_files(buf, nbytes, os.path.join(d, "buffered"))
    out["write_s"] = time.perf_counter() - t
    store.make_cold(files)
    _barrier(world)
    t = time.perf_counter()
    dd_read(files)
    out["read_s"] = time.perf_counter() - t
    store.remove(os.path.join(d, "buffered"))
    out["direct_refused"] = refused = direct_refusal(d)
    if refused is not None:
        return out
    out.update(_direct_limits(store, nbytes, d, world, buf, None, ""))
    out.update(_direct_limits(store, nbytes, d, world, None, ring_buffers(max(STREAMS)), "h"))
    return out


def _direct_limits(store: _Storage, nbytes: int, d: str, world: int, buf: memoryview | None,
                   rings: list[memoryview] | None, tag: str) -> dict[str, float]:
    """O_DIRECT writes with each of :data:`STREAMS` streams, then cold reads of the widest
    set of files with each, from and into ``buf`` or (``rings``) each stream's huge-page
    ring (:func:`ring_buffers`: the device's best, which 4 KiB pages can cap); timed as
    ``direct{k}{tag}_write_s`` / ``_read_s``."""
    out: dict[str, float] = {}
    for k in STREAMS:
        sub = os.path.join(d, f"direct{k}{tag}")
        os.makedirs(sub)
        _barrier(world)
        t = time.perf_counter()
        files = pwrite_files(buf, nbytes, sub, k, direct=True,
                             rings=None if rings is None else rings[:k])
        out[f"direct{k}{tag}_write_s"] = time.perf_counter() - t
        if k != max(STREAMS):
            store.remove(sub)
    for k in STREAMS:
        store.make_cold(files)
        _barrier(world)
        t = time.perf_counter()
        direct_read(files, k, buf, None if rings is None else rings[:k])
        out[f"direct{k}{tag}_read_s"] = time.perf_counter() - t
    store.remove(sub)
    return out


def measure_limits(store: _Storage, nbytes: int, rank: int, world: int) -> dict[str, Any]:
    """memcpy into a pre-faulted shm buffer; durable write and cold read of this rank's
    bytes, buffered and (local paths) with O_DIRECT by 1, 2 and 4 streams."""
    lim = MemcpyLimit(nbytes)
    try:
        _barrier(world)
        memcpy_s = lim.measure()
        d = store.path("limits", f"rank{rank}")
        buf = lim.slab.buffer
        try:
            _barrier(world)
            if store.fs is not None:
                data = bytes(buf[:nbytes])
                t = time.perf_counter()
                url_write(store.fs, d + ".bin", data)
                write_s = time.perf_counter() - t
                del data
                _barrier(world)
                t = time.perf_counter()
                url_read(store.fs, d + ".bin")
                read_s = time.perf_counter() - t
                store.remove(d + ".bin")
                res: dict[str, Any] = {"write_s": write_s, "read_s": read_s}
            else:
                res = _local_limits(store, buf, nbytes, d, world)
                store.remove(d)
        finally:
            buf.release()
    finally:
        lim.close()
    return {"memcpy_s": memcpy_s, **res}


def run_case(case: Case, store: _Storage, state: dict[str, Any], dest: dict[str, Any],
             saves: int, rank: int, world: int, tick: Any) -> dict[str, Any]:
    """``saves`` saves (each into a fresh checkpoint), then one cold load of the last."""
    slug = "".join(c if c.isalnum() else "_" for c in case.name)[:40]
    started = time.perf_counter()
    timings = []
    l1 = load1()
    with PeakMemory() as mem, ForeignCpu() as fc:
        path = ""
        for i in range(saves):
            prev, path = path, store.path(slug, f"save{i}")
            _barrier(world)
            base = store.cache_baseline()
            timing = asdict(case.save(state, path))
            _barrier(world)
            timings.append({**timing, "cache_after_save": store.cache_fraction(path, base)})
            if prev and rank == 0:
                store.remove(prev)
            tick()
        cold = store.make_cold([path])
        for _, t in iter_tensors(dest):
            t.zero_()
        _barrier(world)
        base = store.cache_baseline()
        t0 = time.perf_counter()
        case.load(dest, path)
        load_s = time.perf_counter() - t0
        cache_after_load = store.cache_fraction(path, base)
        tick()
    if not states_equal(dest, state):
        raise AssertionError(f"{case.name}: the loaded state differs from the saved one "
                             f"({path})")
    _barrier(world)
    if rank == 0:
        store.remove(store.path(slug))
    return {"saves": timings, "load_s": load_s, "cache_after_load": cache_after_load,
            "cache_method": store.cache_method, "peak_extra_bytes": mem.extra,
            "load1": round(l1, 2), "foreign_cores": fc.cores, "cold": cold,
            "wall_s": round(time.perf_counter() - started, 2)}


def measure(cfg: BenchConfig, rank: int = 0, world: int = 1,
            log: Any = None) -> dict[str, Any]:
    """Everything one rank measures; with ``world > 1`` the process group must be up."""
    from tqdm import tqdm

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    shape = shape_for_size(cfg.size / world)
    sd = gpt2_like_state_dict(shape, seed=rank)
    state = {f"rank{rank}": sd} if world > 1 else sd
    dest = empty_like_state_dict(state)
    nbytes = state_dict_nbytes(state)
    root = cfg.target.rstrip("/") + f"/dcpp-bench-{uuid.uuid4().hex[:8]}" if cfg.is_url else ""
    if not cfg.is_url:
        if rank == 0:  # the target exists: the CLI checked (preflight)
            root = tempfile.mkdtemp(prefix="dcpp-bench-", dir=cfg.target)
        if world > 1:
            box = [root]
            dist.broadcast_object_list(box, src=0)
            root = box[0]
    elif world > 1:
        box = [root]
        dist.broadcast_object_list(box, src=0)
        root = box[0]
    store = _Storage(cfg, root)
    cases = build_cases(cfg.is_url, cfg.storage_options,
                        with_torch_checkpointing=cfg.torch_checkpointing, world=world,
                        process_local_store=cfg.target.startswith("memory://"))
    bar = tqdm(total=1 + len(cases) * (cfg.saves + 1), desc="bench", unit="step",
               file=sys.stderr, disable=rank != 0 or None, dynamic_ncols=True, leave=False)
    out: dict[str, Any] = {"nbytes": nbytes, "cases": {}, "order": [c.name for c in cases],
                           "kinds": {c.name: c.kind for c in cases},
                           "shape": {"d_model": shape.d_model, "layers": shape.layers,
                                     "params": shape.num_params, "tensors": shape.num_tensors},
                           "fs": "url" if cfg.is_url else fs_type(root)}
    try:
        bar.set_postfix_str("limits")
        out["limits"] = measure_limits(store, nbytes, rank, world)
        bar.update()
        for case in cases:
            bar.set_postfix_str(case.name)
            try:
                out["cases"][case.name] = run_case(case, store, state, dest, cfg.saves, rank,
                                                   world, bar.update)
            finally:
                case.close()
    finally:
        bar.close()
        if rank == 0:
            store.remove(root)
        from dcp_plus.writers.pool import shutdown_pool

        shutdown_pool()
    return out


def _most(values: list[Any]) -> Any:
    """The largest of the ranks' figures; a None or a text (no figure, a reason) stays."""
    if any(v is None or isinstance(v, str) for v in values):
        return values[0]
    return max(values)


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One figure per case: the slowest rank's times (and the largest page-cache share), the
    sum of the ranks' bytes/memory."""
    first = per_rank[0]
    out = dict(first)
    out["nbytes"] = sum(r["nbytes"] for r in per_rank)
    out["limits"] = {k: _most([r["limits"].get(k) for r in per_rank]) for k in first["limits"]}
    out["cases"] = {}
    for name in first["cases"]:
        rows = [r["cases"][name] for r in per_rank]
        saves = [{k: _most([r["saves"][i][k] for r in rows]) for k in rows[0]["saves"][i]}
                 for i in range(len(rows[0]["saves"]))]
        out["cases"][name] = {**rows[0], "saves": saves,
                              "load_s": max(r["load_s"] for r in rows),
                              "cache_after_load": _most([r.get("cache_after_load")
                                                         for r in rows]),
                              "peak_extra_bytes": sum(r["peak_extra_bytes"] for r in rows)}
    out["ranks"] = len(per_rank)
    return out
