"""Rows, ratios and the printed table of ``dcp-plus bench`` (the JSON is :func:`build`'s dict).

Per case, figures are medians over the saves after the first (the first pays one-time costs:
arena allocation, plan building, spawning the PROCESS executor; it is kept as ``first``).
``x limit``: staging / memcpy limit, persist / buffered durable-write limit, load / buffered
cold-read limit. ``x direct``: persist / the O_DIRECT write limit, load / the O_DIRECT read
limit (each the best of 1, 2 and 4 streams). ``x DCP``: the case / stock ``async_save``
default (below 1 is faster than DCP). ``cache %``: the checkpoint's bytes left in the page
cache after the last saves (median) and after the cold load.
"""

from __future__ import annotations

import statistics
from typing import Any

from dcp_plus.cli.bench.cases import DCP_DEFAULT, DCP_TUNED, PLUS
from dcp_plus.cli.bench.config import BenchConfig
from dcp_plus.cli.bench.limits import STREAMS

GB = 1e9
LIMITS = "limits: memcpy shm / buffered pwrite+fsync / buffered cold read"
LIMITS_URL = "limits: memcpy shm / fsspec pipe / fsspec cat"


def direct_row(streams: int, ring: bool = False) -> str:
    """The name of the O_DIRECT limit row with ``streams`` streams, from and into the state's
    4 KiB pages or (``ring``) a huge-page ring per stream (:func:`~dcp_plus.cli.bench.limits.ring_buffers`)."""
    via = ", huge-page rings" if ring else ""
    return f"limit: O_DIRECT {streams} stream{'s' if streams > 1 else ''}{via} " \
        "(write+fsync / cold read)"


DIRECT_VARIANTS = [(k, "") for k in STREAMS] + [(k, "h") for k in STREAMS]
"""``(streams, key suffix)`` of every O_DIRECT limit: ``"h"`` marks the huge-page rings."""
DIRECT_ROWS = [direct_row(k, bool(h)) for k, h in DIRECT_VARIANTS]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def build(cfg: BenchConfig, res: dict[str, Any], timeline: dict[str, Any] | None,
          machine: dict[str, Any]) -> dict[str, Any]:
    """The result dict: config, machine, state, limits, rows (the table), ratios, timeline."""
    nbytes = res["nbytes"]
    lim = dict(res["limits"])
    rows: dict[str, dict[str, Any]] = {LIMITS_URL if cfg.is_url else LIMITS: {
        "kind": "limit", "blocking_ms": None, "staging_s": lim["memcpy_s"],
        "persist_s": lim["write_s"], "load_s": lim["read_s"],
        "save_GBps": nbytes / GB / lim["write_s"], "load_GBps": nbytes / GB / lim["read_s"],
        "x_limit": {"staging": 1.0, "persist": 1.0, "load": 1.0}, "x_dcp": {},
        "peak_extra_MiB": None}}
    if not cfg.is_url:
        rows.update(_direct_rows(lim, nbytes))
        rows[LIMITS]["x_direct"] = _x_direct(rows[LIMITS], lim)
    for name in res["order"]:
        c = res["cases"][name]
        steady = c["saves"][1:] or c["saves"]

        def med(key: str, ss: list[dict[str, float]] = steady) -> float:
            return statistics.median(s[key] for s in ss)

        row = {
            "kind": res["kinds"][name],
            "blocking_ms": 1e3 * med("blocking_s"), "staging_s": med("staging_s"),
            "persist_s": med("persist_s"), "load_s": c["load_s"],
            "save_GBps": nbytes / GB / med("persist_s"), "load_GBps": nbytes / GB / c["load_s"],
            "first": {"blocking_ms": 1e3 * c["saves"][0]["blocking_s"],
                      "staging_s": c["saves"][0]["staging_s"],
                      "persist_s": c["saves"][0]["persist_s"]},
            "saves": c["saves"], "peak_extra_MiB": c["peak_extra_bytes"] / 2**20,
            "load1": c["load1"], "foreign_cores": c["foreign_cores"], "cold": c["cold"],
            "wall_s": c.get("wall_s"),
        }
        row["x_limit"] = {"staging": _ratio(row["staging_s"], lim["memcpy_s"]),
                          "persist": _ratio(row["persist_s"], lim["write_s"]),
                          "load": _ratio(row["load_s"], lim["read_s"])}
        row["x_direct"] = _x_direct(row, lim)
        cache = [s["cache_after_save"] for s in steady if s.get("cache_after_save") is not None]
        row["cache_after_save_pct"] = 100 * statistics.median(cache) if cache else None
        after_load = c.get("cache_after_load")
        row["cache_after_load_pct"] = None if after_load is None else 100 * after_load
        row["cache_method"] = c.get("cache_method")
        rows[name] = row
    ref = rows.get(DCP_DEFAULT)
    for row in rows.values():
        if ref is not None and row["kind"] != "limit":
            row["x_dcp"] = {k: _ratio(row[k], ref[k])
                            for k in ("blocking_ms", "staging_s", "persist_s", "load_s")}
    ratios: dict[str, float | None] = {}
    plus = rows.get(PLUS)
    if plus is not None:
        ratios["dcp_plus staging / memcpy limit"] = plus["x_limit"]["staging"]
        ratios["dcp_plus persist / durable-write limit"] = plus["x_limit"]["persist"]
        ratios["dcp_plus load / cold-read limit"] = plus["x_limit"]["load"]
        if plus.get("x_direct"):
            ratios["dcp_plus persist / O_DIRECT write limit"] = plus["x_direct"]["persist"]
            ratios["dcp_plus load / O_DIRECT read limit"] = plus["x_direct"]["load"]
        for other in (DCP_DEFAULT, DCP_TUNED):
            if other in rows:
                o = rows[other]
                for k, label in (("blocking_ms", "blocking"), ("persist_s", "persist"),
                                 ("load_s", "load")):
                    ratios[f"dcp_plus {label} / {other}"] = _ratio(plus[k], o[k])
        for name, o in rows.items():
            if o["kind"] == "other":
                for k, label in (("blocking_ms", "blocking"), ("persist_s", "persist"),
                                 ("load_s", "load")):
                    ratios[f"dcp_plus {label} / {name}"] = _ratio(plus[k], o[k])
    return {
        "command": "dcp-plus bench",
        "config": cfg.to_dict(), "machine": machine, "ranks": res.get("ranks", cfg.ranks),
        "state": {**res["shape"], "bytes": nbytes, "kind": "GPT-2-like bf16 + AdamW fp32"},
        "fs": res.get("fs"), "limits": lim, "rows": rows, "ratios": ratios,
        "timeline": timeline,
    }


def _direct_rows(lim: dict[str, Any], nbytes: int) -> dict[str, dict[str, Any]]:
    """One row per O_DIRECT stream count (or, where refused, rows saying why); adds the best
    of them to ``lim`` as ``direct_write_s`` / ``direct_read_s`` (with their stream counts)."""
    refused = lim.get("direct_refused")
    rows: dict[str, dict[str, Any]] = {}
    for (k, h), name in zip(DIRECT_VARIANTS, DIRECT_ROWS, strict=True):
        w, r = lim.get(f"direct{k}{h}_write_s"), lim.get(f"direct{k}{h}_read_s")
        rows[name] = {"kind": "limit", "streams": k, "huge_pages": bool(h), "blocking_ms": None,
                      "staging_s": None, "persist_s": w, "load_s": r,
                      "save_GBps": _ratio(nbytes / GB, w), "load_GBps": _ratio(nbytes / GB, r),
                      "x_limit": {}, "x_dcp": {}, "peak_extra_MiB": None}
        if refused:
            rows[name]["na"] = f"n/a: {refused}"
    for op in ("write", "read"):
        got = [(lim[f"direct{k}{h}_{op}_s"], k, name)
               for (k, h), name in zip(DIRECT_VARIANTS, DIRECT_ROWS, strict=True)
               if lim.get(f"direct{k}{h}_{op}_s") is not None]
        if got:
            best = min(got)
            lim[f"direct_{op}_s"], lim[f"direct_{op}_streams"], lim[f"direct_{op}_row"] = best
    for row in rows.values():
        row["x_direct"] = _x_direct(row, lim)
    return rows


def _x_direct(row: dict[str, Any], lim: dict[str, Any]) -> dict[str, float | None]:
    if lim.get("direct_write_s") is None:
        return {}
    return {"persist": _ratio(row["persist_s"], lim["direct_write_s"]),
            "load": _ratio(row["load_s"], lim.get("direct_read_s"))}


def _f(v: float | None, spec: str, width: int) -> str:
    return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}}"


def render(result: dict[str, Any]) -> str:
    """The table (plain text, fixed width) and the ratios."""
    st, cfg = result["state"], result["config"]
    out = [f"state: {st['kind']}, d_model={st['d_model']} layers={st['layers']}, "
           f"{st['tensors']} tensors per rank, {st['bytes'] / 2**20:.0f} MiB over {result['ranks']} "
           f"rank(s); target {cfg['target']} [{result['fs']}]; {cfg['saves']} saves per case "
           f"(medians of saves 2+); load avg {result['load1']['start']:.2f} at start"]
    mach = result.get("machine", {})
    if "shm_dir" in mach:  # where the slabs are, and their pages: O_DIRECT follows them
        huge = mach["shm_huge"]
        out.append(f"shared memory: {mach['shm_dir']} "
                   f"({'4 KiB pages' if huge is None else 'huge=' + huge})")
    w = max(len(n) for n in result["rows"])
    out.append(f"{'case':<{w}}  {'blocking':>8} {'staging':>7} {'persist':>7} {'load':>6} "
               f"{'save':>5} {'load':>5}  {'x limit':^17}  {'x direct':^11}  {'x DCP':^17}  "
               f"{'peak +RSS':>9}  {'cache %':^11}")
    out.append(f"{'':<{w}}  {'ms':>8} {'s':>7} {'s':>7} {'s':>6} {'GB/s':>5} {'GB/s':>5}  "
               f"{'stage persi load':^17}  {'persi load':^11}  {'block persi load':^17}  "
               f"{'MiB':>9}  {'save  load':^11}")
    for name, r in result["rows"].items():
        if "na" in r:
            out.append(f"{name:<{w}}  {r['na']}")
            continue
        xl, xd, xo = r["x_limit"], r["x_dcp"], r.get("x_direct", {})
        out.append(
            f"{name:<{w}}  {_f(r['blocking_ms'], '.1f', 8)} {_f(r['staging_s'], '.3f', 7)} "
            f"{_f(r['persist_s'], '.3f', 7)} {_f(r['load_s'], '.3f', 6)} "
            f"{_f(r['save_GBps'], '.2f', 5)} {_f(r['load_GBps'], '.2f', 5)}  "
            f"{_f(xl.get('staging'), '.1f', 5)} {_f(xl.get('persist'), '.1f', 5)} "
            f"{_f(xl.get('load'), '.1f', 5)}  {_f(xo.get('persist'), '.1f', 5)} "
            f"{_f(xo.get('load'), '.1f', 5)}  {_f(xd.get('blocking_ms'), '.3f', 5)} "
            f"{_f(xd.get('persist_s'), '.2f', 5)} {_f(xd.get('load_s'), '.2f', 5)}  "
            f"{_f(r['peak_extra_MiB'], '.0f', 9)}  {_f(r.get('cache_after_save_pct'), '.1f', 5)} "
            f"{_f(r.get('cache_after_load_pct'), '.1f', 5)}")
    lim = result["limits"]
    if lim.get("direct_write_s") is not None:
        out.append(f"O_DIRECT limits (x direct, the best row of each): write "
                   f"{lim['direct_write_s']:.3f} s ({lim['direct_write_row']}), read "
                   f"{lim['direct_read_s']:.3f} s ({lim['direct_read_row']})")
    methods = sorted({r["cache_method"] for r in result["rows"].values()
                      if r.get("cache_method")})
    if methods:
        out.append(f"cache %: the checkpoint's bytes in the page cache after a save / the load "
                   f"({', '.join(methods)})")
    out.append("ratios (below 1: dcp_plus is faster):")
    for k, v in result["ratios"].items():
        out.append(f"  {k:<64} {_f(v, '.3f', 7)}")
    tl = result.get("timeline")
    if tl:
        out.append(f"timeline: TinyLM d={tl['dim']} x{tl['layers']} layers, {tl['steps']} steps, "
                   f"a checkpoint every {tl['every']}:")
        for name, r in tl["runs"].items():
            ov = r["overhead"]
            blk = [c["returned"] - c["call"] for c in r["checkpoints"]]
            blk_s = f", mean blocking {1e3 * sum(blk) / len(blk):.1f} ms" if blk else ""
            out.append(f"  {name:<28} wall {r['wall_s']:6.2f} s, overhead "
                       f"{'-' if ov is None else f'{100 * ov:+.1f}%'}{blk_s}")
    for n in result.get("notes", []):
        out.append(f"note: {n}")
    return "\n".join(out)
