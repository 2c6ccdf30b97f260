"""Shared test helpers: state-dict builders, save/load shorthands, shared-memory slabs,
record editing and process polling.

Plain functions are importable (``from tests.conftest import build_state_dict``) by test
modules and by the child processes that crash tests spawn; fixtures are below them. What
benchmarks use too (free ports, worlds, bit-exact equality) lives in :mod:`tools.testkit`;
``assert_bit_exact`` and ``free_port`` are importable from here as well.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_plus.shm import SHM_DIR
from tools.testkit.exact import assert_bit_exact as assert_bit_exact
from tools.testkit.ports import free_port as free_port

ROOT = Path(__file__).resolve().parent.parent
WORKER_MODULE = b"dcp_plus.writers.worker"

# Every dtype the issue names, plus a few more the record must name correctly.
DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.int8, torch.uint8, torch.bool, torch.complex64,
    torch.int16, torch.uint16, torch.complex128, torch.float8_e4m3fn,
]


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    """``tmp_path``, where it takes O_DIRECT (the test is skipped where it does not)."""
    from dcp_plus.cli.bench.limits import direct_refusal
    from dcp_plus.cli.bench.machine import fs_type

    if direct_refusal(str(tmp_path)) is not None:
        pytest.skip(f"{tmp_path} [{fs_type(str(tmp_path))}] refuses O_DIRECT")
    return tmp_path


def pytest_configure(config: pytest.Config) -> None:
    # single-process dcp.save/load(no_dist=True) warns on every call
    config.addinivalue_line(
        "filterwarnings", "ignore:torch.distributed is disabled:UserWarning")


# ---------------------------------------------------------------------------------------------
# State dicts


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of random *bit patterns* (NaN payloads, subnormals, -0.0 included).

    Only bit-exact comparison (:func:`assert_bit_exact`) is meaningful on these.
    """
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def build_state_dict(seed: int = 0) -> dict[str, Any]:
    """Everything a state dict may hold: every dtype, 0-dim, empty, non-contiguous views,
    tensors sharing one storage, nested dicts/lists, and plain Python values."""
    gen = torch.Generator().manual_seed(seed)
    base = random_tensor((6, 8), torch.float32, gen)
    special = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf"), 1e-45, -1e-40,
                            3.4e38, 0.0], dtype=torch.float32)
    return {
        "dtypes": {str(d).removeprefix("torch."): random_tensor((3, 5), d, gen) for d in DTYPES},
        "special_floats": special,
        "param": torch.nn.Parameter(random_tensor((4, 3), torch.float32, gen)),
        "scalar_f32": torch.tensor(3.25),
        "scalar_i64": torch.tensor(-7, dtype=torch.int64),
        "scalar_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "empty_3d": torch.empty(3, 0, 2, dtype=torch.int32),
        "transposed": base.t(),
        "strided": base[:, ::3],
        "expanded": torch.arange(3.0).expand(4, 3),
        "shared": {"whole": base, "row": base[2], "column": base[:, 5], "alias": base},
        "opt": {
            "state": {
                "0": {"step": torch.tensor(11.0), "exp_avg": random_tensor((6, 8), torch.float32, gen)},
                "1": {"step": torch.tensor(11.0), "exp_avg": random_tensor((5,), torch.bfloat16, gen)},
            },
            "param_groups": [{"lr": 0.125, "betas": [0.9, 0.999], "name": "group-0",
                              "params": [0, 1], "amsgrad": False}],
        },
        "list": [random_tensor((2, 2), torch.float16, gen), 17, "x", [torch.tensor([1, 2, 3])]],
        "step": 1234,
        "big_int": 2**62 + 1,
        "negative": -3,
        "lr": 1e-300,
        "name": "héllo ✓ run",
        "flag": True,
        "pair": (1, "a", 2.5),
        "ordered": collections.OrderedDict([("b", 2), ("a", 1)]),
    }


def _placeholder(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # zeros_like keeps the strides of dense views: loads into non-contiguous targets too
        return torch.zeros_like(value.detach())
    if isinstance(value, dict):
        return type(value)((k, _placeholder(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_placeholder(v) for v in value]
    return None if not isinstance(value, (int, float, str)) else type(value)()


def load_target(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Same structure as ``state_dict`` with zeroed tensors and blank plain values."""
    return _placeholder(state_dict)


def clone_state(value: Any) -> Any:
    """A deep copy whose tensors own fresh storage (a reference snapshot)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, clone_state(v)) for k, v in value.items())
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Save / load shorthands (single process)


def save(state_dict: dict[str, Any], path: str | os.PathLike, **writer_kwargs: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalWriter

    dcp.save(state_dict, storage_writer=LocalWriter(path, **writer_kwargs), no_dist=True)


def load(state_dict: dict[str, Any], path: str | os.PathLike, planner: Any = None,
         **reader_kwargs: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalReader, SafeLoadPlanner

    dcp.load(state_dict, storage_reader=LocalReader(path, **reader_kwargs),
             planner=planner or SafeLoadPlanner(), no_dist=True)
    return state_dict


def load_fails(state_dict: dict[str, Any], path: str | os.PathLike, planner: Any = None,
               **reader_kwargs: Any) -> str:
    """Load expecting DCP's ``CheckpointException``; returns its message (with the cause)."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as info:
        load(state_dict, path, planner, **reader_kwargs)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# Checkpoint directory inspection and editing


def record_path(ckpt: str | os.PathLike) -> Path:
    return Path(ckpt) / ".metadata"


def read_record_json(ckpt: str | os.PathLike) -> dict[str, Any]:
    return json.loads(record_path(ckpt).read_bytes())


def seal_record(record: dict[str, Any]) -> bytes:
    """``record``'s bytes as a writer would produce them: a version-2 record sealed with its
    record checksum (so that an edit tests the validation behind the checksum)."""
    from dcp_plus.format.record import seal

    body = {k: v for k, v in record.items() if k != "record_checksum"}
    data = json.dumps(body, separators=(",", ":")).encode()
    return data if record.get("version") == 1 else seal(data)


def extent_checksum(record: dict[str, Any], row: dict[str, Any], data: bytes) -> str:
    """The version-2 checksum of extent ``row`` (a JSON row of ``record``) holding ``data``:
    what a writer would record, for tests that craft extents."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from dcp_plus.format.checksum import bind_checksum, checksum_bytes
    from dcp_plus.format.extent import Extent, extent_identity

    item = record["items"][row["fqn"]]
    ext = Extent(row["file"], row["offset"], row["length"], row["raw_length"], row["codec"],
                 "", row.get("value"))
    index = MetadataIndex(row["fqn"], row["chunk"])
    return bind_checksum(checksum_bytes(data), extent_identity(index, item.get("dtype"), ext))


def write_record_json(ckpt: str | os.PathLike, record: dict[str, Any]) -> None:
    """Replace the record of ``ckpt`` by ``record``, resealed (see :func:`seal_record`)."""
    record_path(ckpt).write_bytes(seal_record(record))


def data_files(ckpt: str | os.PathLike) -> set[str]:
    return {p.name for p in Path(ckpt).glob("__*.dcpp")}


def referenced_files(ckpt: str | os.PathLike) -> set[str]:
    return {e["file"] for e in read_record_json(ckpt)["extents"]}


def flip_byte(path: str | os.PathLike, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# ---------------------------------------------------------------------------------------------
# Shared-memory slabs


def fill_pattern(buf: torch.Tensor, seed: int) -> None:
    """Fill a uint8 buffer (e.g. ``slab.tensor()``) with a cheap position-dependent pattern,
    distinct per ``seed``."""
    words = buf.numel() // 4
    t = buf[: words * 4].view(torch.int32)
    torch.arange(seed << 24, (seed << 24) + words, dtype=torch.int32, out=t)


def carve(buf: torch.Tensor, prefix: str, pieces: int) -> dict[str, torch.Tensor]:
    """Split a uint8 buffer into ``pieces`` equal tensors of rotating dtypes."""
    step = buf.numel() // pieces // 8 * 8
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
    return {f"{prefix}{i}": buf[i * step : (i + 1) * step].view(dtypes[i % 4])
            for i in range(pieces)}


def slab_state_dict(slab: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Tensors of several dtypes carved out of ``slab`` (at least 1 MiB) at unaligned offsets,
    two of them overlapping; returns the state dict and each tensor's slab offset."""
    st = slab.tensor()
    layout = [  # name, slab offset, dtype, shape
        ("w_f32", 0, torch.float32, (64, 32)),
        ("w_bf16", 8192 + 8, torch.bfloat16, (300,)),
        ("w_i64", 20480, torch.int64, (7, 9)),
        ("w_u8", 65536 + 3, torch.uint8, (1000,)),
        ("w_c64", 131072, torch.complex64, (33,)),
        ("w_f64_far", (1 << 20) - 4096, torch.float64, (512,)),
    ]
    sd: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}
    for name, off, dtype, shape in layout:
        n = torch.empty(shape, dtype=dtype).nbytes
        sd[name] = st[off : off + n].view(dtype).reshape(shape)
        offsets[name] = off
    # shares the storage (and bytes) of w_f32: rows 10..19
    sd["w_f32_rows"] = sd["w_f32"][10:20]
    offsets["w_f32_rows"] = 10 * 32 * 4
    return sd, offsets


@contextlib.contextmanager
def registered_slab(size: int) -> Iterator[Any]:
    """A registered slab, unregistered and unlinked afterwards even if views survive."""
    from dcp_plus.memory.slabs import Slab, registry

    slab = Slab(size)
    registry.register(slab)
    try:
        yield slab
    finally:
        registry.unregister(slab)
        try:
            slab.close()
        except BufferError:  # a failing test's traceback still holds views
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, slab.name))


# ---------------------------------------------------------------------------------------------
# File systems

@contextlib.contextmanager
def mounted(fstype: str, *options: str, prefix: str = "dcpp-mnt-") -> Iterator[Path]:
    """A fresh ``mount -t FSTYPE [-o OPTIONS]`` on a temporary directory (root only), removed
    afterwards; skips the test where it cannot be mounted."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    opts = ["-o", ",".join(options)] if options else []
    r = subprocess.run(["mount", "-t", fstype, *opts, fstype, str(path)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a {fstype} here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Processes


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[1])


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (zombies count as dead: PID 1 here may not reap them)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def worker_pids(parent: int | None = None) -> list[int]:
    """Live ``dcp_plus.writers.worker`` processes whose parent is ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is None or st[1] != parent or st[0] in ("Z", "X"):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if WORKER_MODULE in cmdline.split(b"\0"):
            found.append(int(entry))
    return sorted(found)


def wait_for_file(path: str | os.PathLike, timeout: float = 120) -> bool:
    """In a test's child process: poll until ``path`` exists; False after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def wait_until(predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str],
               interval: float = 0.01) -> Any:
    """Poll ``predicate`` until truthy; fail the test naming ``what`` after ``timeout`` s
    (a callable ``what`` is asked then, to describe the state that did not come)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for "
                        f"{what() if callable(what) else what}")
        time.sleep(interval)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``dcp-plus ARGV`` run in this process: its exit status, stdout and stderr (log lines
    included) as a subprocess would give them, without a new interpreter's 2-3 s of start-up
    (torch's import). The logging settings the command changes are put back after it.
    ``tests/unit/test_cli_errors.py`` runs the real command in subprocesses."""
    import io
    import logging

    from dcp_plus.cli import logs
    from dcp_plus.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    root, ours = logging.getLogger(), logging.getLogger("dcp_plus")
    saved = (root.level, list(root.filters), ours.level, logs._level)
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter(logs.FORMAT))
    root.addHandler(handler)  # what basicConfig would add in a process of its own
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.filters[:] = saved[1]
        ours.setLevel(saved[2])
        logs._level = saved[3]
    proc = subprocess.CompletedProcess(["dcp-plus", *argv], rc, out.getvalue(), err.getvalue())
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(autouse=True)
def _stop_writer_pool() -> Iterator[None]:
    """Each test starts without writer workers and leaves none behind."""
    from dcp_plus.writers import shutdown_pool

    shutdown_pool()
    yield
    shutdown_pool()


@pytest.fixture
def state_dict() -> dict[str, Any]:
    return build_state_dict()


@pytest.fixture
def slab() -> Iterator[Any]:
    """A registered 1 MiB slab filled with a position-dependent pattern."""
    with registered_slab(1 << 20) as s:
        fill_pattern(s.tensor(), seed=1)
        yield s
