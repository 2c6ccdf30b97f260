"""Checks ``dcp-plus bench`` makes before any work: the target is usable and the output
files can be written, so that a typo fails in a second, not after the whole run."""

from __future__ import annotations

import os
import uuid
from typing import Any

from dcp_plus.cli.bench.config import BenchConfig
from dcp_plus.errors import DcpPlusError

PROBE_CONNECT_TIMEOUT_S = 5
"""Seconds the S3 probe waits for a connection; botocore tries twice and s3fs twice, then
it gives up."""


def check_output(flag: str, path: str) -> None:
    """``path`` (given as ``flag``) can be created or overwritten as a file.

    Raises:
        DcpPlusError: it is a directory, or its directory is missing or not writable.
    """
    if os.path.isdir(path):
        raise DcpPlusError(f"{flag} {path} is a directory, expected a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DcpPlusError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise DcpPlusError(f"{flag} {path}: not writable")


def check_local_target(target: str) -> None:
    """A local ``--target`` must be an existing, writable directory: the benchmark measures
    the disk that holds it, and a misspelt path created silently would measure another.

    Raises:
        DcpPlusError: it does not exist, is not a directory, or is not writable.
    """
    path = target
    if not os.path.exists(path):
        raise DcpPlusError(f"--target {target} does not exist (create it on the disk to "
                           "measure, or pass an existing directory)")
    if not os.path.isdir(path):
        raise DcpPlusError(f"--target {target} is a file, expected a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise DcpPlusError(f"--target {target}: the directory is not writable")


def _probe_options(target: str, options: dict[str, Any]) -> dict[str, Any]:
    """The user's options, with bounded retries and timeouts for S3 unless they set their
    own (s3fs and botocore retry a refused connection for well over ten seconds)."""
    out = {**options, "skip_instance_cache": True}  # the bounded client is not reused
    if not target.startswith(("s3://", "s3a://")):
        return out
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("connect_timeout", PROBE_CONNECT_TIMEOUT_S)
    config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
    out["config_kwargs"] = config
    return out


def check_url_target(target: str, options: dict[str, Any]) -> None:
    """Write and remove one small object under a URL ``--target``: credentials, endpoint,
    bucket and permissions, tried once with bounded retries.

    Raises:
        DcpPlusError: the object could not be written or removed (the reason in one line).
    """
    import fsspec

    probe = target.rstrip("/") + f"/.dcpp-bench-probe-{uuid.uuid4().hex[:8]}"
    try:
        fs, path = fsspec.core.url_to_fs(probe, **_probe_options(target, options))
        if "retries" in type(fs).__dict__ and "retries" not in options:
            fs.retries = 2  # s3fs's own retry loop, on top of botocore's (an attribute)
        fs.pipe_file(path, b"dcp-plus bench probe")
        fs.rm_file(path)
    except ImportError as e:
        raise DcpPlusError(f"--target {target}: {e}") from None
    except Exception as e:  # credentials, endpoint, bucket, permission: all one answer
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DcpPlusError(f"--target {target}: cannot write there ({type(e).__name__}: "
                           f"{reason}); check the endpoint, the credentials and the bucket "
                           "(--storage-option endpoint_url=... key=... secret=...)") from None


def preflight(cfg: BenchConfig, outputs: dict[str, str | None]) -> None:
    """Every check above for one run; ``outputs`` maps flags to their file (or None).

    Raises:
        DcpPlusError: the first problem found.
    """
    for flag, path in outputs.items():
        if path:
            check_output(flag, path)
    if cfg.is_url:
        check_url_target(cfg.target, cfg.storage_options)
    else:
        check_local_target(cfg.target)
