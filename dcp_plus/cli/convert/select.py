"""Which entries a conversion keeps, by DCP's flat names (those ``dcp-plus inspect`` lists)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dcp_plus._compat.torch_dcp import flatten_state_dict, unflatten_state_dict
from dcp_plus.errors import DcpPlusError


@dataclass
class Selection:
    """The kept entries, and the non-tensor values left out for a tensors-only target."""

    state: dict[str, Any]
    skipped_values: list[str] = field(default_factory=list)


def keeps(name: str, prefix: str | None, exclude: Sequence[str]) -> bool:
    """Whether flat name ``name`` is under ``prefix`` and under none of ``exclude``."""
    return not any(name.startswith(p) for p in exclude) and (
        not prefix or name.startswith(prefix))


def nothing_selected(prefix: str | None, exclude: Sequence[str], entries: int,
                     tensors_only: bool = False) -> DcpPlusError:
    """The error for a selection that keeps nothing of ``entries`` entries."""
    what = "no tensor" if tensors_only else "nothing"
    criteria = [f"--prefix {prefix!r}"] * bool(prefix) + [f"--exclude {p!r}" for p in exclude]
    return DcpPlusError(f"{what} to convert: {' and '.join(criteria) or 'the checkpoint'} "
                        f"keeps none of its {entries} entries (`dcp-plus inspect` lists their "
                        "names)")


def select(state: dict[str, Any], *, prefix: str | None, exclude: Sequence[str],
           tensors_only: bool, flat: bool) -> Selection:
    """The entries of ``state`` whose flat name (``model.layers.0.weight``) starts with
    ``prefix`` and with none of ``exclude``.

    With ``flat`` (or a ``prefix``) the result is one flat dict named as DCP names the entries,
    ``prefix`` removed (a model's ``state_dict()`` for ``--prefix model.``); otherwise it keeps
    the nesting it was saved with. ``tensors_only`` leaves non-tensor values out and lists them.

    Raises:
        DcpPlusError: nothing (with ``tensors_only``: no tensor) is selected.
    """
    if not (prefix or exclude or tensors_only or flat):
        return Selection(state)
    entries, mapping = flatten_state_dict(state)
    out = Selection({})
    for name, value in entries.items():
        if not keeps(name, prefix, exclude):
            continue
        if tensors_only and not isinstance(value, torch.Tensor):
            out.skipped_values.append(name)
            continue
        out.state[name] = value
    if not out.state:
        raise nothing_selected(prefix, exclude, len(entries), tensors_only)
    if prefix:
        out.state = {name[len(prefix):]: v for name, v in out.state.items()}
    elif not flat:
        out.state = unflatten_state_dict(out.state, {k: mapping[k] for k in out.state})
    return out
