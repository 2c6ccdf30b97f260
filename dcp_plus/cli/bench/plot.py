"""The PNG of ``dcp-plus bench --plot``: a timeline of training steps with the stage and
persist phases of stock DCP vs dcp_plus, and bar charts of the ratios. Needs matplotlib
(``pip install 'dcp-plus[bench]'``)."""

from __future__ import annotations

from typing import Any

from dcp_plus.errors import DcpPlusError


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(result: dict[str, Any], path: str) -> None:
    """Raises:
        DcpPlusError: matplotlib is not installed (the message says how to get it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise DcpPlusError(f"--plot {path}: matplotlib is not installed; "
                           "pip install 'dcp-plus[bench]' (or matplotlib)") from e

    tl = result.get("timeline")
    fig = plt.figure(figsize=(13, 8.5), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.2, 1])
    ax_t = fig.add_subplot(grid[0, :])
    if tl:
        lanes: list[str] = []
        ticks: list[float] = []
        y = 0.0
        for name, run in tl["runs"].items():
            steps = [(a, b - a) for a, b in run["steps"]]
            ax_t.broken_barh(steps[0::2], (y, 0.8), color="#4c72b0")
            ax_t.broken_barh(steps[1::2], (y, 0.8), color="#8da0cb")
            lanes.append(f"{name}: steps")
            ticks.append(y + 0.4)
            y += 1
            if run["checkpoints"]:
                ck = run["checkpoints"]
                ax_t.broken_barh([(c["call"], c["returned"] - c["call"]) for c in ck],
                                 (y, 0.8), color="#c44e52", label=None)
                ax_t.broken_barh([(c["returned"], max(c["staged"] - c["returned"], 1e-4))
                                  for c in ck], (y, 0.8), color="#dd8452")
                ax_t.broken_barh([(c["staged"], max(c["persisted"] - c["staged"], 1e-4))
                                  for c in ck], (y, 0.8), color="#55a868")
                lanes.append(f"{name}: checkpoint")
                ticks.append(y + 0.4)
                y += 1
            y += 0.4
        ax_t.set_yticks(ticks, lanes)
        ax_t.invert_yaxis()
        ax_t.set_xlabel("seconds since the start of the run")
        from matplotlib.patches import Patch

        ax_t.legend(handles=[Patch(color="#4c72b0", label="training step"),
                             Patch(color="#c44e52", label="blocking (save call)"),
                             Patch(color="#dd8452", label="staging (after return)"),
                             Patch(color="#55a868", label="persist")],
                    loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=4, fontsize=8)
        ax_t.set_title(f"TinyLM d={tl['dim']}, {tl['steps']} steps, a checkpoint every "
                       f"{tl['every']} steps")
    else:
        ax_t.text(0.5, 0.5, "no timeline (--timeline-steps 0)", ha="center")
        ax_t.set_axis_off()

    rows = {n: r for n, r in result["rows"].items() if r["kind"] != "limit"}
    names = list(rows)
    metrics = [("staging", "staging / memcpy"), ("persist", "persist / durable write"),
               ("load", "load / cold read")]
    ax_l = fig.add_subplot(grid[1, 0])
    _bars(ax_l, names, [[rows[n]["x_limit"].get(k) for n in names] for k, _ in metrics],
          [label for _, label in metrics])
    ax_l.axhline(1.0, color="k", lw=0.8)
    ax_l.set_title("x of the physical limit (1 = the limit; lower is better)")
    ax_d = fig.add_subplot(grid[1, 1])
    dm = [("blocking_ms", "blocking"), ("persist_s", "persist"), ("load_s", "load")]
    _bars(ax_d, names, [[rows[n]["x_dcp"].get(k) for n in names] for k, _ in dm],
          [label for _, label in dm])
    ax_d.axhline(1.0, color="k", lw=0.8)
    ax_d.set_yscale("log")
    ax_d.set_title("x of stock async_save default (log; lower is better)")
    st = result["state"]
    fig.suptitle(f"dcp-plus bench: {st['bytes'] / 2**20:.0f} MiB state, "
                 f"{result['ranks']} rank(s), target {result['config']['target']}", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax: Any, names: list[str], series: list[list[float | None]],
          labels: list[str]) -> None:
    n = len(series)
    width = 0.8 / n
    for i, (vals, label) in enumerate(zip(series, labels, strict=True)):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [v if v is not None else float("nan") for v in vals], width, label=label)
    from dcp_plus.cli.bench.cases import SHORT

    ax.set_xticks(range(len(names)), [SHORT.get(n, n) for n in names], fontsize=8)
    ax.legend(fontsize=8)
