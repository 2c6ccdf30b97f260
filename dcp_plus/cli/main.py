"""The ``dcp-plus`` command: ``demo``, ``ls ROOT``, ``gc ROOT``, ``inspect PATH``,
``verify PATH``, ``diff A B``, ``convert SRC DST``, ``plan``, ``bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from dcp_plus.cli.options import parse_storage_options
from dcp_plus.cli.verbs import add_checkpoint_verbs
from dcp_plus.errors import DcpPlusError


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

    add_checkpoint_verbs(sub)

    from dcp_plus.cli.convert import add_convert_arguments, cmd_convert

    cv = sub.add_parser("convert", help="a checkpoint to another format: dcp_plus, stock DCP, "
                                         "one torch.save file or safetensors")
    add_convert_arguments(cv)
    cv.set_defaults(func=lambda a: cmd_convert(a, parse_storage_options(a.storage_option)))

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
