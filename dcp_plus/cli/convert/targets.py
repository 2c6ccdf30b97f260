"""Writing a loaded state dict through one format's own writer.

``dcp_plus``: the dcp_plus writer for the location (``LocalWriter``, ``ObjectStoreWriter``);
``dcp``: torch's ``FileSystemWriter``; ``torch``: one ``torch.save`` file; ``safetensors``:
torch's ``HuggingFaceStorageWriter``. Local outputs are written into a hidden sibling of the
destination and renamed into place when complete, so a failed conversion leaves nothing that
looks like a result; a URL destination (``dcp_plus`` only) is committed by its record and
removed again on failure.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import StorageWriter

from dcp_plus.cli.convert.source import Progress, backend_for_source, first_cause
from dcp_plus.errors import DcpPlusError
from dcp_plus.format.values import tensors_in
from dcp_plus.manager.control import quiet_if_alone
from dcp_plus.storage.urls import is_url

TARGETS = ("dcp_plus", "dcp", "torch", "safetensors")
EXPORTS = ("torch", "safetensors")


def check_destination(dst: str, target: str, storage_options: Mapping[str, Any]) -> None:
    """Refuse a destination that holds anything, or that this target cannot write.

    Raises:
        DcpPlusError: naming the destination and what to do.
    """
    if is_url(dst):
        if target != "dcp_plus":
            raise DcpPlusError(f"{dst}: --to {target} writes local paths only; convert to a "
                               "local path and copy it, or use --to dcp_plus for a URL")
        backend, location = backend_for_source(dst, storage_options)
        if backend.listdir(location):
            raise DcpPlusError(f"{dst} exists and is not empty; remove it or choose another "
                               "destination (convert never overwrites)")
        return
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise DcpPlusError(f"{dst}: its parent directory {parent} does not exist")
    if os.path.isdir(dst) and target == "torch":  # its result is one file
        raise DcpPlusError(f"{dst} is a directory, but --to torch writes one file: name the "
                           "file, e.g. {dst}/model.pt".replace("{dst}", dst.rstrip("/")))
    if os.path.isdir(dst) and not os.listdir(dst):
        return
    if os.path.isfile(dst) and not os.path.islink(dst) and os.path.getsize(dst) == 0:
        return
    if os.path.lexists(dst):
        raise DcpPlusError(f"{dst} exists and is not empty; remove it or choose another "
                           "destination (convert never overwrites)")


@contextmanager
def _staged(dst: str) -> Iterator[str]:
    """A hidden sibling path of ``dst`` to write into: renamed to ``dst`` when the block
    completes (replacing an empty file or directory), removed when it raises."""
    parent, name = os.path.split(os.path.abspath(dst))
    tmp = os.path.join(parent, f".{name}.converting-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if os.path.isdir(tmp) and os.path.isfile(dst):
            os.unlink(dst)  # an empty file stood there (checked): a directory replaces it
        os.replace(tmp, dst)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _counting_planner(progress: Progress) -> DefaultSavePlanner:
    class Counting(DefaultSavePlanner):
        def resolve_data(self, write_item: WriteItem) -> Any:
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor):
                progress(data.numel() * data.element_size())
            return data
    return Counting()


def _save(state: dict[str, Any], writer: StorageWriter, progress: Progress) -> None:
    with quiet_if_alone(True):
        try:
            dcp.save(state, storage_writer=writer, planner=_counting_planner(progress),
                     no_dist=True)
        except CheckpointException as e:
            raise first_cause(e) from None


def write(target: str, state: dict[str, Any], dst: str, storage_options: Mapping[str, Any],
          progress: Progress, shard_bytes: int | None = None) -> None:
    """Write ``state`` to ``dst`` as ``target`` (one of :data:`TARGETS`)."""
    if target == "dcp_plus" and is_url(dst):
        backend, location = backend_for_source(dst, storage_options)
        try:
            _save(state, backend.writer(location, {"overwrite": False}), progress)
        except BaseException:
            backend.remove_tree(location)
            raise
        return
    with _staged(dst) as tmp:
        _WRITERS[target](state, tmp, progress, shard_bytes)


def _write_dcp_plus(state: dict[str, Any], path: str, progress: Progress,
                    shard_bytes: int | None) -> None:
    from dcp_plus.writers import LocalWriter

    _save(state, LocalWriter(path), progress)


def _write_dcp(state: dict[str, Any], path: str, progress: Progress,
               shard_bytes: int | None) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    _save(state, FileSystemWriter(path), progress)


def _write_torch(state: dict[str, Any], path: str, progress: Progress,
                 shard_bytes: int | None) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    progress(sum(t.numel() * t.element_size() for t in tensors_in(state)))


def _write_safetensors(state: dict[str, Any], path: str, progress: Progress,
                       shard_bytes: int | None) -> None:
    writer_class = huggingface_writer()
    _check_dtypes(state)
    mapping = None if shard_bytes is None else shard_files(state, shard_bytes)
    _save(state, writer_class(path, fqn_to_index_mapping=mapping), progress)


def huggingface_writer() -> Any:
    """torch's ``HuggingFaceStorageWriter``, once it and ``safetensors`` are importable.

    Raises:
        DcpPlusError: saying what to install.
    """
    try:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    except ImportError:
        raise DcpPlusError(
            f"--to safetensors needs torch.distributed.checkpoint.hf_storage, which torch "
            f"{torch.__version__} does not have; upgrade torch") from None
    try:
        import safetensors.torch  # noqa: F401  (the writer imports it only while writing)
    except ImportError:
        raise DcpPlusError("--to safetensors needs the safetensors package: pip install "
                           "safetensors (or pip install 'dcp-plus[convert]')") from None
    return HuggingFaceStorageWriter


def _check_dtypes(state: dict[str, Any]) -> None:
    """Refuse tensors of a dtype safetensors has no name for (complex128, ...), by name."""
    import safetensors.torch

    known = getattr(safetensors.torch, "_SIZE", None)  # what its save() can write
    if not known:
        return
    bad = [f"{name!r} ({t.dtype})" for name, t in state.items() if t.dtype not in known]
    if bad:
        raise DcpPlusError(f"safetensors cannot store {len(bad)} tensors of these dtypes: "
                           f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; leave them "
                           "out with --exclude NAME, or convert --to torch")


def shard_files(state: dict[str, Any], shard_bytes: int) -> dict[str, int]:
    """Names to file numbers 1..N, in order, starting a new file before one would pass
    ``shard_bytes`` (a larger tensor gets a file of its own)."""
    mapping: dict[str, int] = {}
    index, used = 1, 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if used and used + size > shard_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


_WRITERS: dict[str, Callable[[dict[str, Any], str, Progress, int | None], None]] = {
    "dcp_plus": _write_dcp_plus, "dcp": _write_dcp, "torch": _write_torch,
    "safetensors": _write_safetensors,
}
