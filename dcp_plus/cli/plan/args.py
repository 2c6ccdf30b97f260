"""Command-line arguments of ``dcp-plus plan`` and their conversion to
:class:`~dcp_plus.cli.plan.model.CapacityInputs`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

from dcp_plus.cli.plan.inputs import CapacityInputError, CapacityInputs
from dcp_plus.cli.plan.units import parse_count, parse_duration, parse_fraction


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


def _sharding(text: str) -> int | None:
    t = text.strip().lower()
    if t == "fsdp":
        return None
    if t == "ddp":
        return 1
    try:
        degree = int(t.removeprefix("hsdp:"))
    except ValueError:
        raise ValueError(f"not a sharding: {text!r} (fsdp, ddp, hsdp:N or N)") from None
    if degree < 1:
        raise ValueError(f"shard degree must be at least 1, got {text!r}")
    return degree


def _closed_fraction(text: str) -> float:
    return parse_fraction(text, closed=True)


_FLAGS = {"params": "--params", "bytes_per_param": "--bytes-per-param", "ranks": "--ranks",
          "gpus_per_node": "--gpus-per-node", "shard_degree": "--sharding",
          "d2h_gbps": "--d2h-gbps", "storage_gbps": "--storage-gbps",
          "storage_read_gbps": "--storage-read-gbps", "client_gbps": "--client-gbps",
          "peer_gbps": "--peer-gbps", "iteration_s": "--iteration-s",
          "weight_update_s": "--tw", "mtbf_s": "--mtbf-h", "overhead_budget": "--budget",
          "stage_hidden_fraction": "--stage-hidden", "restart_s": "--restart-s",
          "interval_s": "--interval", "tensors_per_rank": "--tensors-per-rank"}
"""The :class:`CapacityInputs` field behind each option."""

_duration = _arg(parse_duration)


def _one_line_errors(p: argparse.ArgumentParser) -> None:
    """Usage errors as one line naming the option, not the whole usage block."""
    def error(message: str) -> NoReturn:
        p.exit(2, f"{p.prog}: {message} (see {p.prog} --help)\n")

    setattr(p, "error", error)  # noqa: B010 (mypy refuses assigning to a method)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Add the planner's options to ``p`` (sizes and counts accept 405B, 1.5T, 405e9)."""
    _one_line_errors(p)
    p.add_argument("--params", type=_arg(parse_count), required=True, metavar="N",
                   help="parameter count: 405B, 70e9, 1.5T")
    p.add_argument("--bytes-per-param", type=float, required=True, metavar="B",
                   help="checkpointed bytes per parameter, model + optimizer state "
                        "(bf16 weights + fp32 master + Adam moments: 14)")
    p.add_argument("--ranks", type=int, required=True, metavar="N", help="GPUs (ranks) in the job")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N")
    p.add_argument("--sharding", type=_arg(_sharding), default=None, dest="shard_degree",
                   metavar="{fsdp,ddp,hsdp:N,N}",
                   help="fsdp (state split over all ranks, default), ddp (replicated), "
                        "hsdp:N or N (split over groups of N ranks)")
    p.add_argument("--d2h-gbps", type=float, default=25.0, metavar="GBPS",
                   help="device-to-host GB/s per GPU (default 25)")
    p.add_argument("--storage-gbps", type=float, required=True, metavar="GBPS",
                   help="aggregate storage write GB/s for the job")
    p.add_argument("--storage-read-gbps", type=float, default=None, metavar="GBPS",
                   help="aggregate read GB/s on restart (default: --storage-gbps)")
    p.add_argument("--client-gbps", type=float, default=None, metavar="GBPS",
                   help="storage GB/s of one client (node): writes and reads go at most at "
                        "nodes x this (default: no bound)")
    p.add_argument("--peer-gbps", type=float, default=25.0, metavar="GBPS",
                   help="per-GPU network GB/s to the peer node (tiered mode, default 25)")
    p.add_argument("--iteration-s", type=_duration, required=True, metavar="S",
                   help="seconds per training step (units allowed: 2.5s, 1.5min)")
    p.add_argument("--tw", type=_duration, default=None, dest="weight_update_s", metavar="S",
                   help="weight-update time within a step (CheckFreq's Tw): the snapshot "
                        "overlaps the next step's forward/backward and blocks for "
                        "max(0, stage - (iteration - Tw)); instead of --stage-hidden")
    p.add_argument("--mtbf-h", type=_arg(lambda t: parse_duration(t, unit_s=3600.0)),
                   required=True, dest="mtbf_s", metavar="H",
                   help="job mean time between failures in hours (or 90min, 2d)")
    p.add_argument("--budget", type=_arg(parse_fraction), default=0.05, dest="overhead_budget",
                   metavar="P",
                   help="CheckFreq overhead budget p: 5%% or 0.05 (default 5%%)")
    p.add_argument("--stage-hidden", type=_arg(_closed_fraction), default=0.0,
                   dest="stage_hidden_fraction", metavar="F",
                   help="fraction of the D2H copy hidden behind compute (default 0)")
    p.add_argument("--restart-s", type=float, default=0.0, metavar="S",
                   help="restart cost besides loading state, seconds (default 0)")
    p.add_argument("--interval", type=_duration, default=None, dest="interval_s", metavar="S",
                   help="also evaluate checkpointing every S of training (units allowed: "
                        "20min, 1h), next to the best interval")
    p.add_argument("--tensors-per-rank", type=int, default=None, metavar="N",
                   help="state-dict tensors each rank saves: adds the projected planning and "
                        "commit time of a CachedSavePlanner save at --ranks (constants "
                        "measured in docs/benchmarks.md) to the persist time")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def inputs_from_args(args: argparse.Namespace) -> CapacityInputs:
    """Build the inputs from parsed arguments.

    Raises:
        CapacityInputError: the values are inconsistent (e.g. a shard degree not dividing
            the ranks); the message starts with the option to fix.
    """
    try:
        return CapacityInputs(**{f: getattr(args, f) for f in _FLAGS})
    except CapacityInputError as e:
        if e.field not in _FLAGS:
            raise
        raise CapacityInputError(f"{_FLAGS[e.field]}: {e}", field=e.field) from None
    except TypeError as e:  # a field missing from args: a programming error, but say which
        raise CapacityInputError(str(e)) from e
