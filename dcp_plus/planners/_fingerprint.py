"""Structure fingerprints: a 16-byte digest of everything a DCP save plan depends on.

A save plan (and the global plan and ``Metadata`` built from it) is a function of the state
dict's *structure* only: key paths, tensor dtypes, shapes and properties, DTensor /
ShardedTensor chunk offsets and sizes, the process group, and the storage writer's type and
settings. It does not depend on tensor values.

``dcp_plus.planners._flatten`` flattens a state dict as DCP does and lists those inputs per
value (:data:`Entry`). A planner compares that list with the lists of
structures it has planned before (a C-level comparison, mostly by identity) and hashes it
(:func:`digest_entries`) only when it is new.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dcp_plus._compat.torch_dcp import ShardedTensor, local_tensor

DIGEST_SIZE = 16
"""Bytes in every digest (blake2b-128): collisions are not a practical concern."""

_SIMPLE = (bool, int, float, str, type(None), enum.Enum)
# Writer attributes whose value changes from save to save without changing any plan.
_PER_SAVE_WORDS = frozenset(
    {"path", "paths", "id", "dir", "url", "uri", "prefix", "rank", "coordinator", "checkpoint"}
)


def digest(payload: str | bytes) -> bytes:
    """The :data:`DIGEST_SIZE`-byte blake2b digest of ``payload``."""
    data = payload.encode() if isinstance(payload, str) else payload
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


Entry = tuple[Any, ...]
"""One flattened value's plan inputs: ``(kind, key, ...)`` where ``key`` is its object path
(DCP's flatten mapping) or, without flattening, its fqn. Kinds: ``"D"`` DTensor, ``"T"``
tensor, ``"S"`` ShardedTensor, ``"X"`` a tensor subclass that plans itself, ``"B"`` anything
else (saved as one BYTE_IO item whatever its value or type). Entries hold the objects
themselves (``torch.Size``, dtypes, placements, device meshes), so that comparing two
structures is a C-level list comparison that mostly compares by identity."""


def value_entry(fqn: str, key: Any, obj: Any, grad: bool) -> Entry:
    """What the write items of ``obj`` depend on (never its values); mirrors DCP's
    ``_create_write_items`` and ``create_default_local_save_plan``."""
    if isinstance(obj, DTensor):
        local = local_tensor(obj)
        if not hasattr(local, "__create_write_items__"):
            # DCP: chunk from (global shape, mesh incl. this rank's coordinate, placements);
            # properties from ``to_local()``, which is the local tensor itself under no_grad.
            return ("D", key, obj.shape, local.dtype, local.layout,
                    (obj if grad else local).requires_grad, local.is_pinned(),
                    obj.placements, obj.device_mesh)
    elif isinstance(obj, ShardedTensor):
        shards = tuple(
            (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor.dtype)
            for s in obj.local_shards()
        )
        md = obj.metadata()
        return ("S", key, tuple(md.size), md.tensor_properties, shards)
    elif isinstance(obj, torch.Tensor) and not hasattr(obj, "__create_write_items__"):
        return ("T", key, obj.shape, obj.dtype, obj.layout, obj.requires_grad, obj.is_pinned())
    if hasattr(obj, "__create_write_items__"):
        # An unusual tensor subclass plans itself: fingerprint its items (exact, slower).
        items = obj.__create_write_items__(fqn, obj)
        return ("X", key, tuple((i.index, i.type, repr(i.tensor_data)) for i in items))
    return ("B", key)


def structure_entries(
    state_dict: Mapping[str, Any], mappings: Mapping[str, Any] | None = None
) -> list[Entry]:
    """The entries of an already flattened ``state_dict`` (``mappings``: DCP's flatten map)."""
    grad = torch.is_grad_enabled()
    if mappings:
        return [value_entry(fqn, mappings.get(fqn, fqn), obj, grad) for fqn, obj in state_dict.items()]
    return [value_entry(fqn, fqn, obj, grad) for fqn, obj in state_dict.items()]


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    return (
        tuple(mesh.mesh.shape),
        tuple(mesh.mesh.flatten().tolist()),
        mesh.mesh_dim_names,
        mesh.get_coordinate(),
    )


def digest_entries(entries: list[Entry], context: tuple[Any, ...] = ()) -> bytes:
    """A :data:`DIGEST_SIZE`-byte digest of ``entries`` (equal entries, equal digests).

    Device meshes count by their ranks, dimension names and this rank's coordinate, which
    (with the placements) determine the chunk offsets and sizes. Runs on a miss only.
    """
    meshes: dict[int, tuple[Any, ...]] = {}

    def canonical(e: Entry) -> Entry:
        if e[0] != "D":
            return e
        m = meshes.get(id(e[8]))
        if m is None:
            m = meshes[id(e[8])] = _mesh_key(e[8])
        return (*e[:8], m)

    return digest(repr((context, [canonical(e) for e in entries])))


def structure_digest(
    state_dict: Mapping[str, Any],
    mappings: Mapping[str, Any] | None = None,
    context: tuple[Any, ...] = (),
) -> bytes:
    """Digest of the plan-relevant structure of a flattened ``state_dict``.

    Args:
        state_dict: the flattened state dict the planner plans from.
        mappings: DCP's flatten mapping (fqn -> original key path); part of the metadata.
        context: anything else the plan depends on (writer key, group key, planner settings).

    Returns:
        A :data:`DIGEST_SIZE`-byte digest; equal digests mean equal local save plans.
    """
    return digest_entries(structure_entries(state_dict, mappings), context)


def writer_key(writer: Any) -> str:
    """The part of a storage writer that can change a save plan: its type and settings.

    A writer may define ``plan_cache_key() -> str`` to state this itself. Otherwise public
    attributes with simple values (bool, int, float, str, None, enums) count, except those
    that differ per save (names containing a word such as ``path``, ``id``, ``rank``);
    other public attributes count by their type.
    """
    if writer is None:
        return "writer:unknown"
    name = f"{type(writer).__module__}.{type(writer).__qualname__}"
    custom = getattr(writer, "plan_cache_key", None)
    if callable(custom):
        return f"{name}:{custom()}"
    settings = []
    for attr, value in sorted(vars(writer).items()):
        words = set(attr.lower().strip("_").split("_"))
        if words & _PER_SAVE_WORDS:
            continue
        if isinstance(value, _SIMPLE):
            settings.append((attr, value))
        elif not attr.startswith("_"):
            settings.append((attr, type(value).__qualname__))
    return f"{name}:{settings!r}"


def group_key(process_group: Any = None) -> tuple[Any, ...]:
    """World size, rank, coordinator and member ranks of a save's process group (``None``: the
    default group; without ``torch.distributed`` a world of one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return (1, 0, 0, "default")
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    members: tuple[int, ...] | str = "default"
    if process_group is not None:
        members = tuple(dist.get_process_group_ranks(process_group))
    return (world, rank, 0, members)
