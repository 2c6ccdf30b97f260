"""``dcp-plus bench``: parse, run, print the table, write the JSON and the PNG."""

from __future__ import annotations

import argparse
import json
import sys

from dcp_plus.cli.bench.config import add_bench_arguments, config_from_args

__all__ = ["add_bench_arguments", "cmd_bench"]


def cmd_bench(args: argparse.Namespace) -> int:
    """Exit status 0 on success (also when ``--plot`` was asked for without matplotlib: the
    table and JSON are still written and stderr says why there is no PNG), 2 on bad input,
    found before any work: a bad option, a target that is missing, a file or not writable
    (an S3 target: one small object written and removed), an output file that cannot be
    written."""
    from dcp_plus.cli.bench.preflight import preflight

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"dcp-plus bench: {e}", file=sys.stderr)
        return 2
    preflight(cfg, {"--json": args.json, "--plot": args.plot})  # DcpPlusError: exit 2
    from dcp_plus.cli.bench.plot import have_matplotlib, write_png
    from dcp_plus.cli.bench.report import render
    from dcp_plus.cli.bench.runner import run

    plot = args.plot
    if plot and not have_matplotlib():
        print(f"dcp-plus bench: --plot {plot}: matplotlib is not installed, so no PNG will be "
              "written (pip install 'dcp-plus[bench]'); the table and JSON still are",
              file=sys.stderr)
        plot = None
    result = run(cfg)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if plot:
        write_png(result, plot)
        print(f"wrote {plot}", file=sys.stderr)
    return 0
