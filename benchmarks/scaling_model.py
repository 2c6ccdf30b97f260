"""Tables, linear fits and the projection to large worlds of ``benchmarks.scaling`` runs.

The projection of one steady save's fixed costs at ``R`` ranks is

    coordinator CPU (a + b * R, fitted)  +  the four collectives over a stated network

where a gather or scatter costs ``ceil(log2 R)`` hops of ``latency`` (the size exchange
``gather_object`` / ``scatter_object_list`` run first) plus, at the coordinator, ``R``
messages of ``per_message`` each and ``R x payload`` bytes over its link, and the metadata
broadcast ``ceil(log2 R)`` hops (a tree) of ``latency + payload / bandwidth``. Per-rank payloads
are fitted ``a + b * R`` per collective too (DCP's metadata broadcast grows with the world).
What the model leaves out: stragglers and the data bytes themselves (the write overlaps across
ranks), so it is a floor under the fixed costs, not a prediction of a save's wall time.
"""

from __future__ import annotations

import statistics
from typing import Any

from dcp_plus.cli.plan.fixed_costs import DEFAULT_NET, Net, collective_s

PHASES = ("plan_gather", "plan_scatter", "write_gather", "metadata_broadcast")
LABELS = {"dcp_default": "DefaultSavePlanner",
          "dcp_cached": "DefaultSavePlanner(enable_plan_caching=True)",
          "cached_save": "CachedSavePlanner"}
PROJECT_TO = (1856, 16384)
BLOG = ("PyTorch's blog (Llama3-70B, 1,856 H200, TorchTitan + HSDP2): stage-2 time ~436 s "
        "with DCP's defaults, ~67 s with cached plans and the process executor")


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b * x``."""
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def steady(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    """Median of ``rows[i][key]`` (``[sub]``) over saves 2..N."""
    later = rows[1:] or rows
    return statistics.median([r[key] if sub is None else r[key][sub] for r in later])


def network_s(ranks: int, payload: dict[str, float], net: Net) -> float:
    """Seconds of one save's four collectives at ``ranks`` (see the module docstring)."""
    return sum(collective_s(phase, ranks, payload[phase], net) for phase in PHASES)


def fits(configs: list[dict[str, Any]], name: str) -> dict[str, tuple[float, float]]:
    """Per planner: coordinator CPU and each collective's per-rank payload, ``a + b * R``."""
    cs = sorted((c for c in configs if name in c["results"]), key=lambda c: c["ranks"])
    xs = [float(c["ranks"]) for c in cs]
    out = {"cpu_s": fit(xs, [steady(c["results"][name]["saves"], "cpu_s") for c in cs])}
    for phase in PHASES:
        out[phase] = fit(xs, [steady(c["results"][name]["saves"], "per_rank_B", phase)
                              for c in cs])
    return out


def project(f: dict[str, tuple[float, float]], ranks: int, net: Net) -> tuple[float, float]:
    """(coordinator CPU, network) seconds of one steady save at ``ranks``."""
    a, b = f["cpu_s"]
    payload = {p: max(0.0, f[p][0] + f[p][1] * ranks) for p in PHASES}
    return max(0.0, a + b * ranks), network_s(ranks, payload, net)


def _mem_cells(c: dict[str, Any], name: str) -> str:
    m = c["results"][name]["memory"]
    n = c["ranks"] * c["tensors"]
    if not m:
        return "– | – | – | – | –"
    at = m.get("at_record_put", m.get("at_finish", 0))
    held = m.get("held_by_planner")
    return (f"{m['tracemalloc_peak_B'] / 1e6:.1f} ({m['tracemalloc_peak_B'] / n:.0f} B) "
            f"| {m.get('at_finish', 0):,} ({m.get('at_finish', 0) / n:.2f}) "
            f"| {at:,} ({at / n:.2f}) | {m['held_after']:,} "
            f"| {'–' if held is None else f'{held:,} ({held / n:.1f})'}")


def report(configs: list[dict[str, Any]], net: Net = DEFAULT_NET) -> list[str]:
    """Markdown: the table per rank count and planner, the fits, the projection."""
    configs = sorted(configs, key=lambda c: c["ranks"])
    names = [n for n in LABELS if any(n in c["results"] for c in configs)]
    lines = ["### Per rank count", "",
             "Medians of saves 2..N (save 1 is a miss). Wall: the slowest rank (oversubscribed "
             "host). CPU: the coordinator's `process_time`. Bytes: per rank, the four "
             "collectives' largest payloads summed; through the coordinator, their sum. "
             "Memory (one extra save, a hit for the caching planners, on the coordinator): "
             "tracemalloc peak (per tensor of the world), gc-tracked objects alive at "
             "`finish` entry and at the record's put above the count before the save (per "
             "tensor of the world), objects left after it, and what the planner holds "
             "between saves (gc-tracked objects reachable from it and its DCP cache entries; "
             "per tensor of the world).", "",
             "| ranks | planner | hits | wall s | coordinator CPU s | per-rank B | "
             "coordinator B | peak MB (B/tensor) | objects at finish (/tensor) | "
             "objects at record put (/tensor) | objects left | planner holds (/tensor) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        for name in names:
            if name not in c["results"]:
                continue
            rows = c["results"][name]["saves"]
            hits = [r["hit"] for r in rows[1:]]
            hit_s = "–" if any(h is None for h in hits) else f"{sum(hits)}/{len(hits)}"
            per = sum(steady(rows, "per_rank_B", p) for p in PHASES)
            coord = sum(steady(rows, "coord_B", p) for p in PHASES)
            lines.append(f"| {c['ranks']} | {LABELS[name]} | {hit_s} "
                         f"| {steady(rows, 'save_s'):.3f} | {steady(rows, 'cpu_s'):.3f} "
                         f"| {per:,.0f} | {coord:,.0f} | {_mem_cells(c, name)} |")
    all_fits = {name: fits(configs, name) for name in names}
    lines += ["", "### Fits (a + b x ranks, least squares over the rank counts above)", "",
              "| planner | coordinator CPU s | " + " | ".join(f"{p} B/rank" for p in PHASES)
              + " |", "|---|---|" + "---|" * len(PHASES)]
    for name, f in all_fits.items():
        cells = [f"{f[p][0]:,.0f} + {f[p][1]:,.1f} R" for p in PHASES]
        lines.append(f"| {LABELS[name]} | {f['cpu_s'][0]:.4f} + {f['cpu_s'][1] * 1e3:.3f} ms R "
                     "| " + " | ".join(cells) + " |")
    lines += ["", f"### Projection (latency {net.latency_us:g} us/hop, {net.per_message_us:g} us "
              f"per message at the coordinator, its link {net.bandwidth_gbs:g} GB/s; "
              f"{configs[0]['tensors'] if configs else '?':,} tensors per rank)", "",
              "| planner | " + " | ".join(f"{r:,} ranks: CPU + network = total s"
                                         for r in PROJECT_TO) + " |",
              "|---|" + "---|" * len(PROJECT_TO)]
    for name, f in all_fits.items():
        cells = []
        for r in PROJECT_TO:
            cpu, netw = project(f, r, net)
            cells.append(f"{cpu:.2f} + {netw:.3f} = {cpu + netw:.2f}")
        lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    lines += ["", f"For comparison: {BLOG}."]
    return lines
