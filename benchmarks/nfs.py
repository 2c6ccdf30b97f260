"""NFSWriter/NFSReader over nfs:// against the raw nfs-rs client, in the same run.

Starts nfs-ganesha (as the tests do), then per repeat: the raw client writes one file of
the same bytes with ``write_at`` (durable on return) and reads it back with
``readinto_at``; dcp.save/dcp.load with NFSWriter/NFSReader write and read the checkpoint.

    python -m benchmarks.nfs --mib 256 --repeats 3
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    import nfs_rs

    from dcp_plus import NFSReader, NFSWriter, SafeLoadPlanner
    from tools.testkit.exact import assert_bit_exact
    from tools.testkit.ganesha import GaneshaServer, ganesha_binary

    binary = ganesha_binary()
    if binary is None:
        raise SystemExit("needs ganesha.nfsd: apt-get install -y nfs-ganesha nfs-ganesha-vfs")
    per = args.mib * (1 << 20) // args.tensors // 4
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(per, generator=g) for i in range(args.tensors)}
    nbytes = sum(t.nbytes for t in sd.values())
    blob = memoryview(torch.cat(list(sd.values())).view(torch.uint8).numpy())
    server = GaneshaServer(binary)
    server.start()
    rows: dict[str, list[float]] = {k: [] for k in ("raw write", "raw read", "NFSWriter save",
                                                    "NFSReader load")}
    try:
        client = nfs_rs.Client.connect(server.url + server.query())
        client.mkdir("bench", exist_ok=True)
        buf = bytearray(nbytes)
        for r in range(args.repeats):
            t = time.perf_counter()
            with client.open(f"bench/raw{r}.bin", "wb") as f:
                f.write_at(blob, 0)
            rows["raw write"].append(nbytes / (time.perf_counter() - t) / 1e6)
            t = time.perf_counter()
            with client.open(f"bench/raw{r}.bin", "rb") as f:
                assert f.readinto_at(buf, 0) == nbytes
            rows["raw read"].append(nbytes / (time.perf_counter() - t) / 1e6)
            target = f"{server.url}/bench/ckpt{r}{server.query()}"
            t = time.perf_counter()
            dcp.save(sd, storage_writer=NFSWriter(target), no_dist=True)
            rows["NFSWriter save"].append(nbytes / (time.perf_counter() - t) / 1e6)
            out = {k: torch.empty_like(v) for k, v in sd.items()}
            t = time.perf_counter()
            dcp.load(out, storage_reader=NFSReader(target), planner=SafeLoadPlanner(),
                     no_dist=True)
            rows["NFSReader load"].append(nbytes / (time.perf_counter() - t) / 1e6)
            assert_bit_exact(out, sd)
        client.close()
    finally:
        server.stop()
    print(f"{nbytes / 2**20:.0f} MiB in {args.tensors} tensors, MB/s per repeat:")
    for k, v in rows.items():
        print(f"  {k:16s} " + ", ".join(f"{x:7.1f}" for x in v))


if __name__ == "__main__":
    main()
