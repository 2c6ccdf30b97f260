"""What one ``dcp-plus bench`` run measures: :class:`BenchConfig` and its command-line form."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from typing import Any

from dcp_plus.cli.options import add_storage_option, parse_size, parse_storage_options
from dcp_plus.storage.urls import is_url


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """One benchmark run."""

    size: int = 2 << 30
    """State-dict bytes (GPT-2-like model + AdamW), summed over ranks."""
    target: str = field(default_factory=tempfile.gettempdir)
    """A directory on the disk under test, or an fsspec URL (``s3://bucket/prefix``)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for a URL target, passed through untouched."""
    ranks: int = 1
    """Processes in a gloo world; each holds ``size / ranks`` bytes and all save together."""
    saves: int = 4
    """Saves per case; the first pays one-time costs and is reported apart."""
    cold: str = "files"
    """How loads start cold: ``files`` evicts only the checkpoint's files from the page
    cache (polite on a shared machine), ``global`` syncs and drops the whole page cache."""
    timeline_steps: int = 60
    """Training steps per timeline run (0: no timeline)."""
    timeline_every: int = 10
    """Checkpoint every this many steps in the timeline."""
    timeline_dim: int = 512
    """Width of the timeline's TinyLM (4 layers)."""
    torch_checkpointing: bool = True
    """Add a row for meta-pytorch's ``torch_checkpointing`` when it is importable."""
    quick: bool = False

    @property
    def is_url(self) -> bool:
        return is_url(self.target) and not self.target.startswith("file://")

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]
        d["storage_options"] = sorted(self.storage_options)  # keys only: may hold secrets
        return d


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The ``dcp-plus bench`` options."""
    p.add_argument("--size", default=None,
                   help="state-dict size, e.g. 256MiB, 2GiB (default 2GiB; 256MiB with --quick)")
    p.add_argument("--target", default=tempfile.gettempdir(),
                   help="an existing directory on the disk under test (a temporary "
                        "subdirectory is made and removed) or an fsspec URL such as "
                        "s3://bucket/prefix (default: %(default)s)")
    add_storage_option(p)
    p.add_argument("--ranks", type=int, default=1, help="processes in a gloo world (default 1)")
    p.add_argument("--saves", type=int, default=None,
                   help="saves per case (default 4; 3 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="256MiB, 3 saves per case, a short timeline: about half a minute")
    p.add_argument("--cold", choices=("files", "global"), default="files",
                   help="files: evict only the checkpoint's files before a load (default); "
                        "global: sync + drop the whole page cache (root; disturbs other jobs)")
    p.add_argument("--timeline-steps", type=int, default=None,
                   help="training steps per timeline run (default 60; 24 with --quick; 0: none)")
    p.add_argument("--no-torch-checkpointing", action="store_true",
                   help="skip the torch_checkpointing row even if it is installed")
    p.add_argument("--json", metavar="FILE", help="write every row, ratio and timeline here")
    p.add_argument("--plot", metavar="FILE",
                   help="write a PNG (timeline + ratio bars); needs matplotlib: "
                        "pip install 'dcp-plus[bench]'")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    """Raises ValueError on a bad size, storage option or count."""
    if a.ranks < 1:
        raise ValueError(f"--ranks must be at least 1, got {a.ranks}")
    if a.saves is not None and a.saves < 1:
        raise ValueError(f"--saves must be at least 1, got {a.saves}")
    if a.timeline_steps is not None and a.timeline_steps < 0:
        raise ValueError(f"--timeline-steps must be 0 (no timeline) or more, got "
                         f"{a.timeline_steps}")
    quick = bool(a.quick)
    steps = a.timeline_steps if a.timeline_steps is not None else (24 if quick else 60)
    return BenchConfig(
        size=parse_size(a.size) if a.size else (256 << 20 if quick else 2 << 30),
        target=a.target.removeprefix("file://"), storage_options=parse_storage_options(a.storage_option),
        ranks=a.ranks, saves=a.saves or (3 if quick else 4), cold=a.cold,
        timeline_steps=steps, timeline_every=6 if quick else 10,
        timeline_dim=256 if quick else 512,
        torch_checkpointing=not a.no_torch_checkpointing, quick=quick)
