"""Typed settings of the writers and readers ``CheckpointManager`` builds for its checkpoints.

Local and mounted roots are written by :class:`~dcp_plus.LocalWriter` and read by
``LocalReader``; object-store URLs by ``ObjectStoreWriter`` / ``ObjectStoreReader``. Each class
here holds the settings of one of them, with its defaults (the manager sets ``overwrite`` and
``fence`` itself; object-store credentials are ``storage_options``). A bad value is refused
when the settings are built, by an ``InvalidOptionError`` naming it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dcp_plus.errors import InvalidOptionError
from dcp_plus.format.codecs import Codec, resolve_codec
from dcp_plus.format.key_prefix import KeyPrefixes
from dcp_plus.storage.direct import DEFAULT_STREAMS, DirectIO, direct_io_problem
from dcp_plus.storage.rate import rate_problem
from dcp_plus.writers.chunk_encode import DEFAULT_PART_BYTES, part_bytes_problem

_T = TypeVar("_T")
_Check = Callable[[Any], str | None]


def _setting(default: Any, *, minimum: float | None = None, maximum: float | None = None,
             check: _Check | None = None) -> Any:
    """A field with ``default``, refused outside ``[minimum, maximum]`` or when ``check``
    returns a problem."""
    return field(default=default, metadata={"range": (minimum, maximum), "check": check})


def _problem(f: dataclasses.Field[Any], value: Any) -> str | None:
    """What is wrong with ``value`` for field ``f`` (typed after its default), or None."""
    kind = type(f.default)
    if kind is bool and not isinstance(value, bool):
        return f"must be True or False, got {value!r}"
    if kind in (int, float):
        allowed = (int, float) if kind is float else (int,)
        if isinstance(value, bool) or not isinstance(value, allowed):
            return f"must be {'a number' if kind is float else 'an int'}, got {value!r}"
        if not math.isfinite(value):
            return f"must be finite, got {value!r}"
        lo, hi = f.metadata.get("range", (None, None))
        if lo is not None and value < lo or hi is not None and value > hi:
            bounds = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            return f"must be {bounds}, got {value!r}"
    check = f.metadata.get("check")
    return check(value) if check is not None else None


def _codec(value: Any) -> str | None:
    try:
        resolve_codec(value)
    except KeyError as e:  # an unknown name; the message lists the known ones
        return str(e.args[0])
    if not isinstance(value, str) and not (hasattr(value, "encode") and hasattr(value, "name")):
        return f"must be a codec name or a codec such as ZstdCodec(level=9), got {value!r}"
    return None


def _codecs(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return f"must be a mapping {{fnmatch pattern: codec}} or None, got {value!r}"
    for pattern, codec in value.items():
        problem = _codec(codec) if isinstance(pattern, str) else "has a pattern that is no str"
        if problem is not None:
            return f"[{pattern!r}] {problem}"
    return None


def _key_prefixes(value: Any) -> str | None:
    if value is None or isinstance(value, KeyPrefixes):
        return None
    return f"must be HexPrefixes, BinaryPrefixes, RoundRobinPrefixes or None, got {value!r}"


def _direct_io(value: Any) -> str | None:
    if value is True or value is False or value == "auto":
        return None
    return f"must be True, False or 'auto', got {value!r}"


@dataclass(frozen=True, kw_only=True)
class _Options:
    """Checks every field when built; ``kwargs()`` are the keywords of the class it is for."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _problem(f, getattr(self, f.name))
            if problem is not None:
                raise InvalidOptionError(f"{type(self).__name__}.{f.name}: {problem}")

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the writer or reader these settings are for."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, kw_only=True)
class _Writing(_Options):
    codec: str | Codec = _setting("identity", check=_codec)
    """How tensors are stored: ``"identity"`` (as they are), ``"zstd"``, ``"zstd+shuffle"``,
    or a codec such as ``ZstdCodec(level=9, threads=8)``."""

    codecs: Mapping[str, str | Codec] | None = _setting(None, check=_codecs)
    """Per tensor-name overrides ``{fnmatch pattern: codec}``; the first matching pattern
    wins, e.g. ``{"*.weight": "zstd+shuffle"}``."""

    workers: int = _setting(2, minimum=1)
    """Size of the shared writer-process pool, which writes (uploads, on S3) the data that
    lies in the stager's slabs."""

    worker_nice: int = _setting(10, minimum=0, maximum=19)
    """CPU niceness of the worker processes, so that a persist running beside training
    yields the cores to the training step."""

    max_bytes_per_s: float | None = _setting(None, check=rate_problem)
    """Cap on the rate at which each rank's data bytes reach storage (all of its processes
    and streams together); ``None``: no cap. A per-node cap: the node's budget / its ranks."""

    stagger: float = _setting(0.0, minimum=0)
    """Seconds between the persists of a node's ranks: rank ``LOCAL_RANK`` starts writing
    ``LOCAL_RANK * stagger`` seconds into its background persist."""

    part_bytes: int = _setting(DEFAULT_PART_BYTES, check=part_bytes_problem)
    """Incremental checkpoints (``CheckpointManager(incremental=True)``): the size of the
    parts each tensor is cut into and compared by (a multiple of 4 KiB)."""


@dataclass(frozen=True, kw_only=True)
class _Requests(_Options):
    concurrency: int = _setting(8, minimum=1)
    """Requests in flight per rank."""

    max_retries: int = _setting(5, minimum=0)
    """Retries per request on throttling, 5xx and connection failures."""

    retry_base_delay: float = _setting(0.2, minimum=0)
    """First backoff in seconds; doubles per retry, fully jittered..."""

    retry_max_delay: float = _setting(10.0, minimum=0)
    """...up to this cap (seconds)."""


@dataclass(frozen=True, kw_only=True)
class _Reading(_Options):
    verify: bool = True
    """Check every extent's checksum while loading."""

    threads: int = _setting(4, minimum=1)
    """Threads reading (and decoding) data in parallel."""


@dataclass(frozen=True, kw_only=True)
class LocalWriterOptions(_Writing):
    """Settings of the :class:`~dcp_plus.LocalWriter` of a local or mounted root."""

    threads: int = _setting(2, minimum=1)
    """Parallel files for data outside the stager's slabs (and for encoded tensors)."""

    fsync: bool = True
    """fsync data files and directories (turn off only for throwaway checkpoints)."""

    direct_io: bool | str = _setting("auto", check=_direct_io)
    """``"auto"`` or ``True``: write data files with ``O_DIRECT`` and leave none of their
    bytes in the page cache; a file system that refuses it (tmpfs, some network or FUSE file
    systems) is written buffered and logged once (WARNING for ``True``). ``False``: buffered."""

    streams: int = _setting(DEFAULT_STREAMS, minimum=1)
    """``O_DIRECT`` writes in flight per rank (several per file when fewer files than
    streams are written at once)."""


@dataclass(frozen=True, kw_only=True)
class ObjectStoreWriterOptions(_Writing, _Requests):
    """Settings of the :class:`~dcp_plus.ObjectStoreWriter` of an object-store root."""

    part_size: int = _setting(32 << 20, minimum=1)
    """Multipart part size in bytes (S3 needs >= 5 MiB); upload memory is bounded by
    ``concurrency * part_size``."""

    key_prefixes: KeyPrefixes | None = _setting(None, check=_key_prefixes)
    """Spread the ranks' objects over key prefixes of the bucket (S3 throttles per prefix):
    ``HexPrefixes(depth)``, ``BinaryPrefixes(depth)``, ``RoundRobinPrefixes([...])``;
    retention and clean-up remove the prefixed objects too. None: all under the checkpoint."""


@dataclass(frozen=True, kw_only=True)
class LocalReaderOptions(_Reading):
    """Settings of the :class:`~dcp_plus.LocalReader` of a local or mounted root."""

    direct_io: DirectIO = _setting("auto", check=direct_io_problem)
    """Read data files with ``O_DIRECT`` (bypassing the page cache: cold files stay cold):
    ``"auto"`` where it helps (not on tmpfs), ``True`` wherever allowed, ``False`` never; a
    file system that refuses it gets buffered reads."""


@dataclass(frozen=True, kw_only=True)
class ObjectStoreReaderOptions(_Reading, _Requests):
    """Settings of the :class:`~dcp_plus.ObjectStoreReader` of an object-store root."""

    coalesce_gap: int = _setting(1 << 20, minimum=0)
    """Ranged reads of extents at most this many bytes apart are merged into one request."""

    range_size: int = _setting(32 << 20, minimum=1)
    """The largest single ranged GET in bytes; longer runs are split and read in parallel."""


WriterOptions = LocalWriterOptions | ObjectStoreWriterOptions
ReaderOptions = LocalReaderOptions | ObjectStoreReaderOptions


def options_for(given: object, expected: type[_T], what: str, root: str) -> _T:
    """``given``, or ``expected()`` when None; refuses settings of another writer or reader
    (or a dict), naming ``what``."""
    if given is None:
        return expected()
    if not isinstance(given, expected):
        built = expected.__name__.removesuffix("Options")
        raise InvalidOptionError(f"{what}: checkpoints under {root} use a {built}; pass "
                                 f"{expected.__name__}(...), got {given!r}")
    return given


def check_limits(keep_last: int | None, history_size: int, lease_timeout: float) -> None:
    """``CheckpointManager``'s bounds: ``ValueError`` naming the one out of range."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if history_size < 1:
        raise ValueError(f"history_size must be >= 1, got {history_size}")
    if not lease_timeout > 0:
        raise ValueError(f"lease_timeout must be > 0 seconds, got {lease_timeout}")
