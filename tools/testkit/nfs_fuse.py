"""An NFS export mounted through the kernel's FUSE client, for tests.

These machines have no kernel NFS client (``mount -t nfs4``: "No such device"), so a path on
an NFS export is made the one other way the kernel allows: a FUSE file system whose every
operation is an NFS call of the user-space client ``nfs-rs`` to the real server (nfs-ganesha).
The kernel then treats opens, ``O_DIRECT`` included, as it treats any FUSE file system, and
every byte written reaches the server's export directory over NFS.

Run as ``python -m tools.testkit.nfs_fuse NFS_URL MOUNTPOINT`` (foreground, single-threaded;
needs root, ``/dev/fuse``, libfuse 3 and ``mfusepy``); :class:`NfsFuseMount` starts and stops
it. Test support only: no caching, no locking, no permissions beyond what the server checks.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
MOUNT_TIMEOUT_S = 20.0


def fuse_problem() -> str | None:
    """Why a FUSE mount cannot be made here, or None."""
    if os.geteuid() != 0:
        return "FUSE mounts need root here"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: no libfuse shared library
        return f"mfusepy/libfuse 3 not usable ({e}): apt-get install fuse3; pip install mfusepy"
    return None


def _ops_class() -> type:
    """The FUSE operations class (built late: importing mfusepy needs libfuse)."""
    import mfusepy
    import nfs_rs

    def call(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except nfs_rs.NfsError as e:
            code = getattr(e, "errno", None)
            raise mfusepy.FuseOSError(code if isinstance(code, int) else errno.EIO) from e

    class NfsOps(mfusepy.Operations):  # type: ignore[misc]
        use_ns = True

        def __init__(self, url: str) -> None:
            from dcp_plus.storage.nfsio import split_nfs_url

            client_url, self.rel, _ = split_nfs_url(url)
            self.client = nfs_rs.Client.connect(client_url)
            self.handles: dict[int, Any] = {}
            self.next_fh = 1

        def _p(self, path: str) -> str:
            return f"{self.rel}/{path.lstrip('/')}".rstrip("/")

        def _keep(self, handle: Any) -> int:
            fh, self.next_fh = self.next_fh, self.next_fh + 1
            self.handles[fh] = handle
            return fh

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = call(lambda: self.client.stat(self._p(path)))
            kind = stat.S_IFDIR if st.type.value == "directory" else stat.S_IFREG
            return {"st_mode": kind | st.mode, "st_nlink": st.nlink, "st_size": st.size,
                    "st_uid": st.uid, "st_gid": st.gid, "st_ino": st.fileid,
                    "st_blocks": -(-st.used // 512), "st_atime": st.atime,
                    "st_mtime": st.mtime, "st_ctime": st.ctime}

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *call(lambda: list(self.client.listdir(self._p(path))))]

        def mkdir(self, path: str, mode: int) -> int:
            call(lambda: self.client.mkdir(self._p(path)))
            return 0

        def rmdir(self, path: str) -> int:
            call(lambda: self.client.rmdir(self._p(path)))
            return 0

        def unlink(self, path: str) -> int:
            call(lambda: self.client.unlink(self._p(path)))
            return 0

        def rename(self, old: str, new: str) -> int:
            call(lambda: self.client.rename(self._p(old), self._p(new)))
            return 0

        def link(self, target: str, source: str) -> int:
            call(lambda: self.client.link(self._p(source), self._p(target)))
            return 0

        def create(self, path: str, mode: int, flags: int) -> int:
            if flags & os.O_EXCL and call(lambda: self.client.exists(self._p(path))):
                raise mfusepy.FuseOSError(errno.EEXIST)
            return self._keep(call(lambda: self.client.open(self._p(path), "w+b")))

        def open(self, path: str, flags: int) -> int:
            mode = "rb" if flags & os.O_ACCMODE == os.O_RDONLY else "r+b"
            return self._keep(call(lambda: self.client.open(self._p(path), mode)))

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return bytes(call(lambda: self.handles[fh].read_at(offset, size)))

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            return int(call(lambda: self.handles[fh].write_at(data, offset)))

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            if fh is not None and fh in self.handles:
                call(lambda: self.handles[fh].truncate(length))
            else:
                call(lambda: self.client.truncate(self._p(path), length))
            return 0

        def release(self, path: str, fh: int) -> int:
            handle = self.handles.pop(fh, None)
            if handle is not None:
                call(handle.close)
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            return 0  # nfs-rs returns from a write once the server has it stably

        def chmod(self, path: str, mode: int) -> int:
            call(lambda: self.client.chmod(self._p(path), mode & 0o7777))
            return 0

        def utimens(self, path: str, times: Any = None) -> int:
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1 << 30,
                    "f_bfree": 1 << 29, "f_bavail": 1 << 29, "f_namemax": 255}

        def destroy(self, path: str) -> None:
            self.client.close()

    return NfsOps


@dataclass
class NfsFuseMount:
    """``url`` (an ``nfs://`` export directory) mounted at ``mountpoint`` by a child process."""

    url: str
    mountpoint: str
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = field(default="")

    def start(self) -> None:
        os.makedirs(self.mountpoint, exist_ok=True)
        self.log_path = self.mountpoint.rstrip("/") + ".log"
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.testkit.nfs_fuse", self.url, self.mountpoint],
                cwd=root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not self.mounted():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(self.log_path) as f:
                    raise RuntimeError(f"FUSE mount of {self.url} at {self.mountpoint} did "
                                       f"not come up: {f.read()[-2000:]}")
            time.sleep(0.05)

    def mounted(self) -> bool:
        """Whether the kernel lists the mount (``ismount`` would stat it: a call into us)."""
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == self.mountpoint for line in f)

    def stop(self) -> None:
        if self.mounted():
            subprocess.run(["umount", self.mountpoint], check=False)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def main() -> None:
    import mfusepy

    url, mountpoint = sys.argv[1], sys.argv[2]
    mfusepy.FUSE(_ops_class()(url), mountpoint, foreground=True, nothreads=True,
                 fsname="nfs-rs-fuse", kernel_cache=True)


if __name__ == "__main__":
    main()
