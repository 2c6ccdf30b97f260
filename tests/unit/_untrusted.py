"""What the untrusted-record tests share: a checkpoint of every kind of entry, and the one
question asked of every damaged copy of it: was it refused clearly, or loaded bit-exact?"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus.errors import DcpPlusError
from tests.conftest import assert_bit_exact, load, save


def rich_state() -> dict[str, Any]:
    """Tensors of several dtypes, shapes and codecs, a 0-dim and an empty one, plain values
    and an ``io.BytesIO``."""
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(64, 32, generator=g),
        "w16": torch.randn(48, 16, generator=g).to(torch.bfloat16),
        "z": torch.randn(4096, generator=g),  # stored zstd-compressed
        "ids": torch.arange(300, dtype=torch.int64),
        "mask": torch.rand(100, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "train": {"step": 7, "name": "run"},
        "blob": io.BytesIO(b"raw bytes \x00\xff"),
    }


def blank(state: dict[str, Any]) -> dict[str, Any]:
    """A load target shaped like ``state``, filled with values no save wrote."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, 0) if v.dtype != torch.bool else torch.ones_like(v)
            if v.is_floating_point():
                out[k].fill_(-3.0)
        elif isinstance(v, io.BytesIO):
            out[k] = io.BytesIO()
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def comparable(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.getvalue() if isinstance(v, io.BytesIO) else v for k, v in state.items()}


def save_rich(path: Path) -> dict[str, Any]:
    state = rich_state()
    save(state, path, codecs={"z": "zstd"})
    return state


def fresh_copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=True)
    return dst


def refusal(e: BaseException, path: Path) -> str | None:
    """Why ``e`` (from a load of ``path``) is a clear refusal, or None if it is not one."""
    causes: list[BaseException] = [e]
    if isinstance(e, CheckpointException):
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    for c in causes:
        text = str(c)
        # our refusal itself, also when read_metadata refused the record (readers/base.py)
        if isinstance(c, DcpPlusError) and str(path) in text:
            continue
        # DCP's own planner checks, naming the state dict key
        if isinstance(c, (ValueError, RuntimeError)) and ("mismatch" in text.lower()
                                                          or "Missing key" in text):
            continue
        return None
    return "; ".join(f"{type(c).__name__}: {str(c)[:300]}" for c in causes)


def load_outcome(path: Path, state: dict[str, Any]) -> tuple[str, str]:
    """``("exact", "")`` if ``path`` loads bit-exact as ``state``; ``("refused", why)`` if it
    is refused clearly; ``("WRONG", what)`` if it loads other data or fails obscurely."""
    target = blank(state)
    try:
        load(target, path)
    except BaseException as e:  # noqa: B036 - DCP's CheckpointException is a BaseException
        why = refusal(e, path)
        if why is None:
            return "WRONG", f"unclear failure {type(e).__name__}: {str(e)[-1500:]}"
        return "refused", why
    try:
        assert_bit_exact(comparable(target), comparable(state))
    except AssertionError as e:
        return "WRONG", f"loaded different data: {e}"
    return "exact", ""


def no_traceback(text: str) -> bool:
    return "Traceback" not in text and os.linesep + "  File " not in text
