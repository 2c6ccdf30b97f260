"""A real NFSv4 server for tests: nfs-ganesha with the VFS FSAL (Debian ``nfs-ganesha`` +
``nfs-ganesha-vfs``).

NFSv4 only (no rpcbind, NLM or RQUOTA), bound to 127.0.0.1 on a free port, exporting a
fresh directory on the ext4 root file system (not tmpfs: the VFS FSAL needs file handles
by name) as ``/export`` to 127.0.0.1 only. Its recovery directory, log and PID file live in
the same temporary tree, so concurrent test sessions do not share state. Stopped by PID
(SIGTERM, then SIGKILL) when the fixture ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

from tools.testkit.ports import free_port
from tools.testkit.server import ServerProcess

PSEUDO = "export"
START_TIMEOUT_S = 30.0


def ganesha_binary() -> str | None:
    return shutil.which("ganesha.nfsd") or next(
        (p for p in ("/usr/bin/ganesha.nfsd", "/usr/sbin/ganesha.nfsd") if os.access(p, os.X_OK)),
        None)


CONFIG = """
NFS_CORE_PARAM {{ Protocols = 4; Bind_addr = 127.0.0.1; NFS_Port = {port};
                 Enable_NLM = false; Enable_RQUOTA = false; }}
NFSV4 {{ Graceless = true; RecoveryBackend = fs; RecoveryRoot = "{recovery}"; }}
NFS_KRB5 {{ Active_krb5 = false; }}
EXPORT {{ Export_Id = 1; Path = "{export}"; Pseudo = /{pseudo}; Protocols = 4;
         Transports = TCP; Access_Type = RW; Squash = No_Root_Squash; FSAL {{ Name = VFS; }}
         CLIENT {{ Clients = 127.0.0.1; Access_Type = RW; }} }}
"""


@dataclass
class GaneshaServer(ServerProcess):
    """One ``ganesha.nfsd`` process; ``export_dir`` is the server-side directory it exports."""

    binary: str
    base_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="dcpp-ganesha-",
                                                                   dir="/var/tmp"))
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def export_dir(self) -> str:
        return os.path.join(self.base_dir, "export")

    @property
    def url(self) -> str:
        """``nfs://`` URL of the export root (NFSv4.1, unprivileged source port)."""
        return f"nfs://127.0.0.1:{self.port}/{PSEUDO}"

    @staticmethod
    def query() -> str:
        return "?version=4.1&noresvport=true"

    def scratch_dir(self) -> str:
        return self.base_dir

    def start(self) -> None:
        self.port = free_port()
        recovery = os.path.join(self.base_dir, "recovery")
        os.makedirs(self.export_dir)
        os.makedirs(recovery)
        conf = os.path.join(self.base_dir, "ganesha.conf")
        with open(conf, "w") as f:
            f.write(CONFIG.format(port=self.port, recovery=recovery, export=self.export_dir,
                                  pseudo=PSEUDO))
        self.log_path = os.path.join(self.base_dir, "ganesha.log")
        pidfile = os.path.join(self.base_dir, "ganesha.pid")
        args = [self.binary, "-F", "-L", self.log_path, "-f", conf, "-p", pidfile,
                "-N", "NIV_EVENT"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=self.base_dir)
        self.wait_until_up("ganesha.nfsd", f"127.0.0.1:{self.port}", START_TIMEOUT_S, 0.05)

    def _answers(self) -> bool:
        try:
            import nfs_rs
        except ImportError:  # the fixture checks for the client first
            return False
        try:
            with nfs_rs.Client.connect(self.url + self.query(), connect_timeout=2,
                                       operation_timeout=5) as client:
                client.exists(".ganesha-probe")
            return True
        except (OSError, nfs_rs.NfsError):
            return False
