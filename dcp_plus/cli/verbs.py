"""The verbs that read checkpoints and roots: ``ls``, ``gc``, ``diff``, ``inspect``,
``verify``; each takes a local path or a URL (``--storage-option`` for its client)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from dcp_plus.cli.options import add_storage_option, parse_storage_options
from dcp_plus.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpPlusError,
)
from dcp_plus.shm import SHM_DIR


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def json_with_rows(info: dict[str, Any], rows: str) -> str:
    """``info`` as indented JSON, but the list ``info[rows]`` one compact row per line: as
    readable, and written by the C encoder (``indent`` runs the pure-Python one: 1 s for a
    checkpoint of 100,000 tensors)."""
    def field(key: str, value: Any) -> str:
        if key == rows and value:
            value = "[\n" + ",\n".join(f"    {json.dumps(r)}" for r in value) + "\n  ]"
        else:
            value = json.dumps(value, indent=2).replace("\n", "\n  ")
        return f"  {json.dumps(key)}: {value}"
    return "{\n" + ",\n".join(field(k, v) for k, v in info.items()) + "\n}"


def cmd_inspect(args: argparse.Namespace) -> int:
    from dcp_plus.readers.inspect import summarize

    options = parse_storage_options(args.storage_option)
    try:
        info = summarize(args.path, options, allow_pickle=args.allow_pickle)
    except CheckpointNotFoundError as e:
        raise root_hint(args.path, options) or e from None
    if args.json:
        print(json_with_rows(info, "items"))
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


def root_hint(path: str, options: dict[str, Any]) -> DcpPlusError | None:
    """If ``path`` is no checkpoint but a root of checkpoints (a manager's, TorchTitan's
    ``checkpoint`` folder), an error that says so and names the commands that help."""
    from dcp_plus.cli.listing import list_root

    try:
        rows = list_root(path, options)["checkpoints"]
    except (DcpPlusError, OSError):
        return None
    committed = [r["name"] for r in rows if r["committed"]]
    if not committed:
        return None
    where = path.rstrip("/")
    return CheckpointNotFoundError(
        f"{path} is a folder of checkpoints, not a checkpoint: it holds "
        f"{_plural(len(committed), 'committed checkpoint')} ({committed[0]} .. "
        f"{committed[-1]}). List them with `dcp-plus ls {where}`, or inspect one: "
        f"`dcp-plus inspect {where}/{committed[-1]}`")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _relative(message: str, path: str) -> str:
    """``message`` with the checkpoint's own path left out of the names of its files."""
    return message.replace(path.rstrip("/") + "/", "")


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0: intact; 1: damage found (in the data, or a record that is there but edited,
    malformed, oversized or not a regular file); 2: no checkpoint at all."""
    from tqdm import tqdm

    from dcp_plus.cli.stray import strays
    from dcp_plus.readers.inspect import load_record, stored_bytes, verify

    options = parse_storage_options(args.storage_option)
    try:
        try:
            record = load_record(args.path, options)  # decoded once: progress total, checks
        except CheckpointNotFoundError as e:
            raise root_hint(args.path, options) or e from None
        with tqdm(total=stored_bytes(record), unit="B", unit_scale=True, desc="verifying",
                  disable=args.json or None, file=sys.stderr) as bar:
            report = verify(args.path, progress=bar.update, record=record,
                            storage_options=options)
        stray, stray_error = strays(args.path, record, options)
    except (CheckpointFormatError, CorruptCheckpointError) as e:  # the record itself is bad
        problems = [_relative(str(e), args.path)]
        if args.json:
            print(json.dumps({"path": args.path, "ok": False, "extents": 0, "bytes": 0,
                              "problems": problems, "stray": [], "stray_error": None},
                             indent=2))
        else:
            print(f"CORRUPT: {problems[0]}")
            print(f"{args.path}: the commit record is not valid: FAILED")
        return 1
    if args.json:
        print(json.dumps({"path": report.path, "ok": report.ok, "extents": report.extents,
                          "bytes": report.bytes, "problems": report.problems,
                          "stray": [{"file": n, "bytes": b} for n, b in stray],
                          "stray_error": stray_error}, indent=2))
    else:
        for p in report.problems:
            print(f"CORRUPT: {p}")
        _print_strays(stray, stray_error)
        verdict = "OK" if report.ok else f"FAILED ({_plural(len(report.problems), 'problem')})"
        print(f"{args.path}: {_plural(report.extents, 'extent')}, {_human(report.bytes)} "
              f"checked: {verdict}")
    return 0 if report.ok else 1


def _print_strays(stray: list[tuple[str, int | None]], error: str | None) -> None:
    """The STRAY lines of :func:`~dcp_plus.cli.stray.strays`, and what they mean (or why
    they could not be told)."""
    if error is not None:
        print(f"could not look for stray files: {error}")
    there = [(n, b) for n, b in stray if b is not None]
    for name, size in there:
        print(f"STRAY: {name} ({_human(size)}): no commit record here or beside reads it")
    if there:
        print(f"{_plural(len(there), 'stray file')}, {_human(sum(b for _, b in there))}: "
              "left by an overwrite save that did not commit, or by one stopped before "
              "removing the files its commit replaced (a save writing here now has such files "
              "too). No load reads them: once no save writes here, they can be removed")


def cmd_ls(args: argparse.Namespace) -> int:
    from dcp_plus.cli.listing import list_root

    info = list_root(args.root, parse_storage_options(args.storage_option))
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


def cmd_gc(args: argparse.Namespace) -> int:
    """Exit 0: done (or, ``--dry-run``, planned); 2: refused, or a removal failed."""
    from dcp_plus.cli.gc import collect

    res = collect(args.root, parse_storage_options(args.storage_option), keep_last=args.keep_last,
                  keep_every=args.keep_every, dry_run=args.dry_run, shm=args.shm,
                  job_id=args.job_id)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        verb = "would remove" if res["dry_run"] else "removed"
        for r in res["remove"]:
            size = "" if r["bytes"] is None else f"  {_human(r['bytes'])}"
            print(f"{verb:<12} {r['name']:<24} {r['why']}{size}")
        for r in res.get("failed", []):
            print(f"{'NOT removed':<12} {r['name']:<24} {r['why']} (see the warning above)")
        for r in res["keep"]:
            mark = "  <- latest" if r["latest"] else ""
            state = "DAMAGED" if r["problem"] else "committed"
            print(f"{'kept':<12} {r['name']:<24} {state}{mark}")
        for name in res.get("shm", []):
            print(f"{verb:<12} {os.path.join(SHM_DIR, name)}  memory-tier file")
        if res["held_by"]:
            print(f"note: a job holds this root ({res['held_by']}): gc would refuse now")
        print(f"{len(res['remove'])} {'to remove (dry run)' if res['dry_run'] else 'removed'}, "
              f"{_human(res['freed_bytes'])} of committed data freed, {len(res['keep'])} kept")
    return 2 if res.get("failed") else 0


def cmd_diff(args: argparse.Namespace) -> int:
    """Exit 0: the same tensors with the same content; 1: they differ."""
    from dcp_plus.cli.diff import diff_checkpoints

    d = diff_checkpoints(args.a, args.b, parse_storage_options(args.storage_option))
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



def _verb(sub: Any, name: str, help: str, func: Any, *positionals: str,
          ) -> argparse.ArgumentParser:
    """A verb taking ``positionals`` (locations), ``--storage-option`` and ``--json``."""
    p = sub.add_parser(name, help=help)
    for positional in positionals:
        p.add_argument(positional)
    add_storage_option(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=func)
    return p


def add_checkpoint_verbs(sub: Any) -> None:
    """Register ``ls``, ``gc``, ``diff``, ``inspect`` and ``verify`` on ``sub`` (the
    subparsers of the ``dcp-plus`` parser)."""
    _verb(sub, "ls", "the checkpoints under a root (a directory or URL)", cmd_ls, "root")
    g = _verb(sub, "gc", "remove a root's uncommitted saves and apply retention (never the "
                         "newest committed checkpoint)", cmd_gc, "root")
    g.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")
    g.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="keep the N newest committed checkpoints (default: all)")
    g.add_argument("--keep-every", type=int, default=None, metavar="K",
                   help="also keep every step that is a multiple of K")
    g.add_argument("--shm", action="store_true",
                   help="also remove the job's memory-tier snapshots on this node")
    g.add_argument("--job-id", default=None, help="the job's job_id, if it set one (--shm)")
    _verb(sub, "diff", "tensors added, removed or changed from checkpoint A to B; exit 1 if "
                       "they differ", cmd_diff, "a", "b")
    i = _verb(sub, "inspect", "list the tensors of a checkpoint (a directory or URL)",
              cmd_inspect, "path")
    i.add_argument("--allow-pickle", action="store_true",
                   help="also list a stock DCP checkpoint, unpickling its record (only for "
                        "checkpoints you trust)")
    _verb(sub, "verify", "re-checksum every extent; exit 1 on damage, 2 if not a checkpoint",
          cmd_verify, "path")
