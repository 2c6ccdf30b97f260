"""What the test-server fixtures share: reading the log's tail and stopping by PID."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess


class ServerProcess:
    """A server started by a fixture: ``proc``, its ``log_path`` and a scratch tree."""

    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""

    def scratch_dir(self) -> str:
        """The temporary tree removed on stop."""
        return ""

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after 15 s; removes the scratch tree."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self.scratch_dir():
            with contextlib.suppress(OSError):
                shutil.rmtree(self.scratch_dir())
