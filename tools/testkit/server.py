"""What the test-server fixtures share: reading the log's tail and stopping by PID."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time


class ServerProcess:
    """A server started by a fixture: ``proc``, its ``log_path`` and a scratch tree."""

    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""

    def scratch_dir(self) -> str:
        """The temporary tree removed on stop."""
        return ""

    def _answers(self) -> bool:
        """Whether the server answers a request yet."""
        raise NotImplementedError

    def wait_until_up(self, name: str, where: str, timeout: float, poll_s: float) -> None:
        """Wait until :meth:`_answers`; stop it and raise (with the log's tail) if it exits
        first or stays silent for ``timeout`` seconds."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode} at startup; "
                                   f"log:\n{self.tail()}")
            if self._answers():
                return
            time.sleep(poll_s)
        log = self.tail()
        self.stop()
        raise RuntimeError(f"{name} did not answer on {where} within {timeout}s; log:\n{log}")

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
