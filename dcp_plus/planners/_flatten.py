"""DCP's ``flatten_state_dict`` in one pass with the structure entries, and its replay.

:func:`flatten_with_entries` flattens a state dict exactly as DCP does and lists each value's
plan inputs (:data:`~dcp_plus.planners._fingerprint.Entry`). It also records the traversal
as a :class:`Template`: the containers' types and keys and each value's flat key and path.

A training job saves the same structure again and again, in new dicts whose keys and values
are where they were last time. :meth:`Template.replay` checks that: container types and key
tuples are compared whole (C-level), values are collected without building a key path or
flat key, and the entries are computed for the recorded paths. It succeeds only when the
entries equal the recorded ones, which (with equal containers) means DCP's flatten would give
the recorded keys and paths for these values. On a plan-cache hit that is about 40 % less
work than the full flatten, most of it memory traffic on caches a training step has evicted.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import eq
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dcp_plus._compat.torch_dcp import dcp_derived_version, dtensor_spec, local_tensor
from dcp_plus.planners._fingerprint import Entry, value_entry

Path = tuple[str | int, ...]


@functools.cache
def pinning_possible() -> bool:
    """Whether any tensor of this process can be page-locked (an accelerator is present).

    Without one ``is_pinned()`` is always False; asking costs 0.2 us per tensor, 10 % of a
    plan-cache hit. Only CPU tensors are ever pinned.
    """
    return bool(torch.accelerator.is_available())


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
# Leaf types that are certainly neither a Mapping nor a list (skips two ABC checks each).
_LEAVES = frozenset({DTensor, _Tensor, _Parameter, int, float, str, bool, bytes, type(None)})


@dataclass(frozen=True, slots=True)
class Node:
    """One container of a flattened state dict, as the flatten walked it."""

    cls: type[Any]
    keys: tuple[str, ...] | int
    """A mapping's keys as DCP names them (``str(key)``), in order, or a list's length."""
    children: tuple[Node | None, ...] | None
    """Per key: the nested container's node, or None for a leaf; None if all are leaves."""

    def collect(self, obj: Any, out: list[Any]) -> bool:
        """Append ``obj``'s leaves to ``out`` in flatten order if it matches this node."""
        if type(obj) is not self.cls:
            return False
        if isinstance(self.keys, int):
            if len(obj) != self.keys:
                return False
            values = obj
        else:
            # DCP's flat keys and paths hold str(key), not the key: 1 and True, an enum and
            # its value, or 0.0 and -0.0 are equal keys with other names. str() of a plain
            # str returns it, so for the usual keys this is one C-level pass.
            if tuple(map(str, obj)) != self.keys:
                return False
            values = obj.values()
        if self.children is None:
            out.extend(values)
            return True
        for value, child in zip(values, self.children, strict=True):
            if child is None:
                out.append(value)
            elif not child.collect(value, out):
                return False
        return True


@dataclass
class Template:
    """How a state dict of one structure flattens (see the module docstring)."""

    root: Node
    mappings: dict[str, Path]
    """Flat key -> object path, in flatten order (DCP's flatten mapping); the template's own."""
    entries: list[Entry]
    fqns: tuple[str, ...] = field(init=False)
    paths: tuple[Path, ...] = field(init=False)

    def __post_init__(self) -> None:
        # As tuples once: every replay zips them with the values.
        self.fqns, self.paths = tuple(self.mappings), tuple(self.mappings.values())

    def replay(self, state_dict: Mapping[str, Any]) -> Flat | None:
        """The flatten of ``state_dict`` if it has this structure, else None."""
        values: list[Any] = []
        if not self.root.collect(state_dict, values):
            return None
        if not all(map(eq, iter_entries(self.fqns, self.paths, values), self.entries)):
            return None
        return Flat(dict(zip(self.fqns, values, strict=True)), dict(self.mappings),
                    self.entries, False, self)


@dataclass
class Flat:
    """A state dict flattened exactly as DCP's ``flatten_state_dict`` does, with its entries."""

    state_dict: dict[str, Any]
    mappings: dict[str, Path]
    entries: list[Entry]
    has_sharded: bool
    template: Template | None = None


def iter_entries(
    fqns: Sequence[str], paths: Sequence[Path], values: Sequence[Any]
) -> Iterator[Entry]:
    """The entries of flattened values, one at a time.

    Plain DTensors and tensors inline (the hot path); others through ``value_entry``. A mapping or
    a list DCP would flatten further gets an entry no leaf has, so a replay that finds one
    where a leaf was fails. A generator, so that a replay compares each entry and drops it:
    10,000 live tuples would set off a few young-generation garbage collections per save.
    """
    grad = torch.is_grad_enabled()
    pin = pinning_possible()
    Tensor, Parameter, DT, local_of, spec_of = _Tensor, _Parameter, DTensor, local_tensor, dtensor_spec
    for fqn, path, v in zip(fqns, paths, values, strict=True):
        tv = type(v)
        if tv is DT:
            local = local_of(v)
            if type(local) is Tensor:
                spec = spec_of(v)
                yield ("D", path, v.shape, local.dtype, local.layout,
                       (v if grad else local).requires_grad,
                       pin and local.is_cpu and local.is_pinned(),
                       spec.placements, spec.mesh)
                continue
        elif tv is Tensor or tv is Parameter:
            yield ("T", path, v.shape, v.dtype, v.layout, v.requires_grad,
                   pin and v.is_cpu and v.is_pinned())
            continue
        elif flattens_further(v):
            yield ("N", path)
            continue
        yield value_entry(fqn, path, v, grad)


def flatten_with_entries(state_dict: Mapping[str, Any]) -> Flat | None:
    """DCP's ``flatten_state_dict``, the entries of its values and its :class:`Template`.

    Same keys, order, object paths and duplicate-key error as DCP's flatten (nested mappings,
    lists that hold tensors or mappings; other lists, tuples and values are leaves). Returns
    None where DCP would use its pre-2.4 traversal (``_version._derived_version == "2_3"``).
    :class:`~dcp_plus.planners.CachedSavePlanner` checks the result against DCP's own
    flatten whenever it meets a structure it has not seen before.
    """
    if dcp_derived_version() == "2_3":
        return None
    flat: dict[str, Any] = {}
    mappings: dict[str, Path] = {}
    leaves = _LEAVES

    def walk(prefix: str, path: Path, container: Any) -> Node:
        is_list = isinstance(container, list)
        items = enumerate(container) if is_list else container.items()
        children: list[Node | None] = []
        child = children.append
        for k, v in items:
            sk = k if type(k) is str else str(k)
            p = (*path, k if is_list else sk)
            tv = type(v)
            if tv is dict or (tv not in leaves and flattens_further(v)):
                child(walk(prefix + sk + ".", p, v))
                continue
            fqn = prefix + sk
            if fqn in flat:
                raise ValueError(f"duplicated flatten key {fqn}")
            flat[fqn] = v
            mappings[fqn] = p
            child(None)
        keys = len(container) if is_list else tuple(map(str, container))
        all_leaves = children.count(None) == len(children)
        return Node(type(container), keys, None if all_leaves else tuple(children))

    root = walk("", (), state_dict)
    entries = list(iter_entries(tuple(flat), tuple(mappings.values()), list(flat.values())))
    sharded = any(e[0] == "S" for e in entries)
    template = None if sharded else Template(root, dict(mappings), entries)
    return Flat(flat, mappings, entries, sharded, template)


def flattens_further(value: Any) -> bool:
    """Whether DCP's flatten descends into ``value`` (a mapping, or a list that holds a
    tensor, a mapping or such a list) instead of keeping it as one value."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, list) and not is_terminal_list(value)


def is_terminal_list(value: list[Any]) -> bool:
    """DCP's ``_is_terminal`` for a list: no tensor, no mapping, no non-terminal list inside."""
    for entry in value:
        if isinstance(entry, Mapping):
            return False
        if isinstance(entry, list) and not is_terminal_list(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True
