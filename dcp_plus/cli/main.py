"""The ``dcp-plus`` command: ``demo``, ``ls ROOT``, ``inspect PATH``, ``verify PATH``,
``diff A B``, ``plan``, ``bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError, DcpPlusError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_inspect(args: argparse.Namespace) -> int:
    from dcp_plus.readers.inspect import summarize

    info = summarize(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{'name':<48} {'dtype':<10} {'shape':<20} {'bytes':>12} {'codec':<9} file")
    for r in info["items"]:
        shape = "x".join(map(str, r["shape"])) if r["shape"] is not None else "-"
        print(f"{r['name']:<48} {r['dtype'] or 'bytes':<10} {shape or '()':<20} "
              f"{r['bytes']:>12} {r['codec']:<9} {r['file']}")
    t = info["totals"]
    print(f"{t['items']} items ({t['tensors']} tensors), {t['extents']} extents in "
          f"{t['files']} files, {_human(t['bytes'])} raw, {_human(t['stored_bytes'])} stored "
          f"(ratio {t['ratio']:.2f})")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0: intact; 1: damage found (in the data, or a record that is there but edited,
    malformed, oversized or not a regular file); 2: no checkpoint at all."""
    from tqdm import tqdm

    from dcp_plus.readers.inspect import load_record, stored_bytes, verify

    try:
        record = load_record(args.path)  # decoded once: progress total and verification
        with tqdm(total=stored_bytes(record), unit="B", unit_scale=True, desc="verifying",
                  disable=args.json or None, file=sys.stderr) as bar:
            report = verify(args.path, progress=bar.update, record=record)
    except (CheckpointFormatError, CorruptCheckpointError) as e:  # the record itself is bad
        problems = [str(e)]
        if args.json:
            print(json.dumps({"path": args.path, "ok": False, "extents": 0, "bytes": 0,
                              "problems": problems}, indent=2))
        else:
            print(f"CORRUPT: {e}")
            print(f"{args.path}: the commit record is not valid: FAILED")
        return 1
    if args.json:
        print(json.dumps({"path": report.path, "ok": report.ok, "extents": report.extents,
                          "bytes": report.bytes, "problems": report.problems}, indent=2))
    else:
        for p in report.problems:
            print(f"CORRUPT: {p}")
        verdict = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
        print(f"{args.path}: {report.extents} extents, {_human(report.bytes)} checked: {verdict}")
    return 0 if report.ok else 1


def _storage_options(pairs: list[str]) -> dict[str, Any]:
    """``K=V`` pairs; a value that parses as JSON (numbers, true, objects) is taken as such."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DcpPlusError(f"--storage-option {pair!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    from dcp_plus.cli.listing import list_root

    info = list_root(args.root, _storage_options(args.storage_option))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = info["checkpoints"]
    if not rows:
        print(f"{args.root}: no checkpoints")
        return 0
    print(f"{'checkpoint':<24} {'step':>10} {'state':<12} {'tensors':>8} {'stored':>12}")
    for r in rows:
        state = "committed" if r["committed"] else "uncommitted"
        state = "DAMAGED" if r["problem"] else state
        step = "-" if r["step"] is None else str(r["step"])
        size = "-" if r["bytes"] is None else _human(r["bytes"])
        tensors = "-" if r["tensors"] is None else str(r["tensors"])
        mark = "  <- latest" if r["latest"] else ""
        print(f"{r['name']:<24} {step:>10} {state:<12} {tensors:>8} {size:>12}{mark}")
        if r["problem"]:
            print(f"  {r['problem']}")
    committed = sum(r["committed"] and not r["problem"] for r in rows)
    print(f"{len(rows)} checkpoint folders, {committed} committed")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """Exit 0: the same tensors with the same content; 1: they differ."""
    from dcp_plus.cli.diff import diff_checkpoints

    d = diff_checkpoints(args.a, args.b)
    differ = bool(d["added"] or d["removed"] or d["changed"])
    if args.json:
        print(json.dumps(d, indent=2))
        return 1 if differ else 0
    for name in d["added"]:
        print(f"+ {name}")
    for name in d["removed"]:
        print(f"- {name}")
    for c in d["changed"]:
        detail = ", ".join(f"{k} {c['a'].get(k)} -> {c['b'].get(k)}" if k != "content"
                           else "content" for k in c["changed"])
        print(f"~ {c['name']}: {detail}")
    print(f"{len(d['added'])} added, {len(d['removed'])} removed, {len(d['changed'])} changed, "
          f"{d['same']} the same")
    return 1 if differ else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dcp_plus.cli.demo import run

    return 0 if run(args.path, steps=args.steps, seed=args.seed) else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from dcp_plus.cli.plan import plan_capacity, render_text
    from dcp_plus.cli.plan.args import inputs_from_args

    plan = plan_capacity(inputs_from_args(args))
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render_text(plan))
    return 0


def _version() -> str:
    from dcp_plus import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcp-plus", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train on CPU with CheckpointManager, crash, resume, check")
    d.add_argument("path", nargs="?", default="./checkpoints", help="checkpoint root")
    d.add_argument("--steps", type=int, default=150)
    d.add_argument("--seed", type=int, default=None, help="seed of the random kill step")
    d.set_defaults(func=cmd_demo)

    ls = sub.add_parser("ls", help="the checkpoints under a root (a directory or URL)")
    ls.add_argument("root")
    ls.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to fsspec for a URL root (repeatable)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    df = sub.add_parser("diff", help="tensors added, removed or changed from checkpoint A to "
                                     "B; exit 1 if they differ")
    df.add_argument("a")
    df.add_argument("b")
    df.add_argument("--json", action="store_true")
    df.set_defaults(func=cmd_diff)

    i = sub.add_parser("inspect", help="list the tensors of a checkpoint")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="re-checksum every extent; exit 1 on damage, 2 if not a "
                                      "checkpoint")
    v.add_argument("path")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)

    from dcp_plus.cli.plan.args import add_plan_arguments

    pl = sub.add_parser("plan", help="checkpoint cost, intervals, memory and goodput for a job")
    add_plan_arguments(pl)
    pl.set_defaults(func=cmd_plan)

    from dcp_plus.cli.bench.cli import add_bench_arguments, cmd_bench

    b = sub.add_parser("bench", help="limits, stock DCP and dcp_plus side by side: a table, "
                                     "JSON and a PNG")
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one verb. Exit status: 0 success, 1 what the verb reports (``verify``: damage
    found), 2 a user error (bad arguments, not a checkpoint, unreadable, internal error);
    never a Python traceback unless ``-v``."""
    for stream in (sys.stdout, sys.stderr):  # names with undecodable bytes still print
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    from dcp_plus.cli import logs

    logs.configure(args.verbose)
    rc = 0  # what a verb cut short by a closed pipe reports: the reader stopped reading
    try:
        with logs.bars_safe():
            rc = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return rc
    except BrokenPipeError:  # `dcp-plus inspect DIR | head -1`
        # what is left in the buffer would fail again at exit: send it to /dev/null
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return rc
    except KeyboardInterrupt:
        print(f"dcp-plus {args.command}: interrupted", file=sys.stderr)
        return 130
    except DcpPlusError as e:
        print(f"dcp-plus {args.command}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dcp-plus {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: say so, in one line
        print(f"dcp-plus {args.command}: internal error: {type(e).__name__}: {e} (rerun with "
              "-v for the traceback, and please report it)", file=sys.stderr)
        if args.verbose:
            traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
