"""``dcp-plus convert SRC DST``: arguments, the run, what it prints and its exit status."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from typing import Any

from dcp_plus.cli.options import add_storage_option, parse_size

TARGET_CHOICES = ("dcp_plus", "dcp", "torch", "safetensors")
def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``dcp-plus convert``."""
    p.add_argument("src", help="checkpoint to read: a dcp_plus or stock DCP checkpoint "
                               "directory, or a URL the manager takes (s3://...)")
    p.add_argument("dst", help="where to write; must not exist or be empty")
    p.add_argument("--to", choices=TARGET_CHOICES, default=None,
                   help="output format (default: the other DCP layout, dcp_plus <-> dcp)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a stock DCP checkpoint (its .metadata is a pickle, which can run "
                        "code: only for checkpoints you trust), and values that need unpickling")
    p.add_argument("--prefix", default=None, metavar="PREFIX",
                   help="--to torch/safetensors: keep only entries whose name starts with "
                        "PREFIX, and strip it (e.g. 'model.')")
    p.add_argument("--exclude", action="append", default=[], metavar="PREFIX",
                   help="leave out entries whose name starts with PREFIX (repeatable)")
    p.add_argument("--max-file-size", type=parse_size, default=None, metavar="SIZE",
                   help="--to safetensors: start a new file before one passes SIZE (default: "
                        "one file)")
    add_storage_option(p)


def cmd_convert(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    """Exit 0: converted; 1: the source is damaged (nothing written); 2: a user error."""
    from tqdm import tqdm

    from dcp_plus.cli.convert.select import keeps, nothing_selected, select
    from dcp_plus.cli.convert.source import DCP_PLUS, KIND_NAMES, STOCK, load_all, open_source
    from dcp_plus.cli.convert.targets import EXPORTS, check_destination, huggingface_writer, write
    from dcp_plus.errors import (
        CheckpointFormatError,
        CorruptCheckpointError,
        DcpPlusError,
        UnsafeCheckpointError,
        UnsafeValueError,
    )

    started = time.monotonic()
    try:
        source = open_source(args.src, storage_options, args.allow_pickle)
    except (CorruptCheckpointError, CheckpointFormatError) as e:
        return _corrupt(e, args.dst)
    target = args.to or (STOCK if source.kind == DCP_PLUS else DCP_PLUS)
    _check_options(args, target, EXPORTS)
    if target == "safetensors":
        huggingface_writer()  # refuse before reading anything if it cannot be written
    check_destination(args.dst, target, storage_options)
    print(f"{args.src}: {KIND_NAMES[source.kind]}", flush=True)

    names = {n for n in source.metadata.state_dict_metadata
             if keeps(n, args.prefix, args.exclude)}  # only these are read
    if not names:
        raise nothing_selected(args.prefix, args.exclude, len(source.metadata.state_dict_metadata))
    bar = {"total": source.tensor_bytes(names), "unit": "B", "unit_scale": True, "file": sys.stderr,
           "disable": None}  # None: only when stderr is a terminal
    with tqdm(desc="reading", **bar) as reading:
        try:
            state = load_all(source, names, reading.update)
        except (CorruptCheckpointError, CheckpointFormatError) as e:
            return _corrupt(e, args.dst)
        except (UnsafeCheckpointError, UnsafeValueError) as e:  # a value needs unpickling
            raise DcpPlusError(f"{e} (dcp-plus convert: pass --allow-pickle if you trust "
                               "this checkpoint)") from None
    chosen = select(state, prefix=args.prefix, exclude=args.exclude,
                    tensors_only=target == "safetensors", flat=target == "safetensors")
    if chosen.skipped_values:
        skipped = ", ".join(chosen.skipped_values[:5])
        more = len(chosen.skipped_values) - 5
        print(f"dcp-plus convert: note: left out {len(chosen.skipped_values)} non-tensor "
              f"values, which safetensors cannot hold: {skipped}"
              f"{f' and {more} more' if more > 0 else ''}", file=sys.stderr)
    tensors, others, nbytes = _count(chosen.state)
    with tqdm(desc="writing", **{**bar, "total": nbytes}) as writing:
        try:
            write(target, chosen.state, args.dst, storage_options, writing.update,
                  args.max_file_size)
        except UnsafeValueError as e:
            raise DcpPlusError(f"{args.dst}: {e} (dcp-plus convert: a dcp_plus checkpoint "
                               "holds no such value; leave it out with --exclude NAME, or "
                               "convert --to dcp or --to torch); nothing was written") from None
    print(f"wrote {args.dst} ({target}): {tensors} tensors ({nbytes:,} bytes), {others} other "
          f"values in {time.monotonic() - started:.2f} s")
    return 0


def _check_options(args: argparse.Namespace, target: str, exports: tuple[str, ...]) -> None:
    from dcp_plus.errors import DcpPlusError

    if args.prefix and target not in exports:
        raise DcpPlusError(f"--prefix selects what an export keeps (--to torch or --to "
                           f"safetensors); --to {target} converts whole checkpoints "
                           "(--exclude still leaves entries out)")
    if args.max_file_size is not None and target != "safetensors":
        raise DcpPlusError(f"--max-file-size applies to --to safetensors, not --to {target}")


def _corrupt(e: Exception, dst: str) -> int:
    print(f"dcp-plus convert: CORRUPT: {e}; nothing was written to {dst}", file=sys.stderr)
    return 1


def _count(state: dict[str, Any]) -> tuple[int, int, int]:
    """Tensors, other values and tensor bytes of ``state`` (as DCP flattens it)."""
    import torch

    from dcp_plus._compat.torch_dcp import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    tensors = [v for v in flat.values() if isinstance(v, torch.Tensor)]
    return (len(tensors), len(flat) - len(tensors),
            sum(t.numel() * t.element_size() for t in tensors))
