"""One writer per checkpoint root: a lease with generations, a heartbeat and fencing.

The lease lives in ``ROOT/.dcpp-lease/``. Holding it means having created the newest
generation record ``gen-NNNNNNNN`` (an exclusive create: a hard link on file systems, a
conditional PUT on object stores) and not having released it (``gen-NNNNNNNN.released``).
The holder rewrites ``gen-NNNNNNNN.hb`` every ``heartbeat_s`` seconds.

A holder is *dead* when it ran on this host (same hostname, boot and pid namespace) and its
pid is gone or now belongs to another process, or when its last heartbeat is older than
``timeout_s``. Taking over creates the next generation, which fences the old holder:
:meth:`RootLease.check` (run by the manager's writer before a save starts and again just
before it commits, and by the heartbeat thread) fails once a newer generation exists, and a
fenced holder never heartbeats, commits or deletes again. Generation records are written
once and never edited; the new holder removes the older generations' files.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Protocol

from dcp_plus.errors import LeaseHeldError, LeaseLostError

log = logging.getLogger(__name__)

LEASE_DIR = ".dcpp-lease"
LEASE_FORMAT = "dcp_plus-lease"
DEFAULT_TIMEOUT_S = 30.0
_GEN = re.compile(r"^gen-(\d{8,})$")
MAX_LEASE_RECORD_BYTES = 64 << 10
"""Lease records are tiny; stores read at most this much of one."""


class LeaseStore(Protocol):
    """The five operations a lease needs from the place it lives in."""

    location: str
    """How messages name the lease's folder or prefix."""

    def create(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` atomically, only if absent; False if it exists."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Create or replace ``name`` atomically."""
        ...

    def read(self, name: str) -> bytes | None: ...

    def list(self) -> list[str]: ...

    def delete(self, names: Sequence[str]) -> None:
        """Remove ``names``; missing ones are not an error."""
        ...


def gen_name(generation: int) -> str:
    return f"gen-{generation:08d}"


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> int | None:
    """The start time (clock ticks after boot) of running process ``pid``; None if it is not
    running (zombies count as not running)."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        if sys.platform.startswith("linux"):
            return None
        try:  # no procfs: existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    fields = stat.rsplit(")", 1)[-1].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19]) if len(fields) > 19 else 0


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a generation of the lease."""

    generation: int
    holder_id: str
    host: str
    pid: int
    started: float
    command: str
    boot_id: str | None = None
    pid_ns: str | None = None
    pid_start: int | None = None
    timeout_s: float | None = None
    """The holder's own lease timeout: another process never judges it dead sooner."""

    @classmethod
    def this_process(cls, generation: int, timeout_s: float | None = None) -> Holder:
        return cls(generation=generation, holder_id=uuid.uuid4().hex, host=socket.gethostname(),
                   pid=os.getpid(), started=time.time(),
                   command=" ".join(sys.argv)[:200] or sys.executable,
                   boot_id=_read_text("/proc/sys/kernel/random/boot_id"),
                   pid_ns=_pid_namespace(), pid_start=_proc_start(os.getpid()),
                   timeout_s=timeout_s)

    def encode(self) -> bytes:
        return json.dumps({"format": LEASE_FORMAT, **asdict(self)}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Holder | None:
        """The holder in a generation record, or None if it is not a valid one."""
        try:
            obj = json.loads(data)
            if not isinstance(obj, dict) or obj.pop("format", None) != LEASE_FORMAT:
                return None
            # fields a newer version adds are ignored: its holder must stay recognisable
            holder = cls(**{k: v for k, v in obj.items() if k in _HOLDER_FIELDS})
        except (ValueError, TypeError):
            return None
        ok = (isinstance(holder.generation, int) and isinstance(holder.pid, int)
              and isinstance(holder.host, str) and isinstance(holder.started, (int, float))
              and (holder.timeout_s is None or isinstance(holder.timeout_s, (int, float))))
        return holder if ok else None

    def on_this_host(self) -> bool:
        return (self.host == socket.gethostname()
                and self.boot_id == _read_text("/proc/sys/kernel/random/boot_id")
                and self.pid_ns == _pid_namespace())

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host} ({self.command!r}), holding it since {since}"


_HOLDER_FIELDS = frozenset(f.name for f in fields(Holder))


class RootLease:
    """The lease of one checkpoint root, held by at most one writer at a time.

    Args:
        store: where the lease's records live (``ROOT/.dcpp-lease``).
        timeout_s: a holder on another host whose heartbeat is older than this is dead.
        heartbeat_s: how often the holder refreshes its heartbeat (default ``timeout_s / 6``).
        clock: wall-clock time in seconds (heartbeats compare across hosts: keep clocks
            synchronised to well within ``timeout_s``).
    """

    def __init__(self, store: LeaseStore, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 heartbeat_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if timeout_s <= 0:
            raise ValueError(f"lease timeout must be > 0 s, got {timeout_s}")
        self.store = store
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else timeout_s / 6
        if not 0 < self.heartbeat_s < timeout_s:
            raise ValueError(f"heartbeat interval must be in (0, {timeout_s}) s, got "
                             f"{self.heartbeat_s}")
        self.clock = clock
        self.holder: Holder | None = None
        self.took_over: Holder | None = None
        """The dead holder this lease was taken from, if any."""
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- acquiring --------------------------------------------------------------------------

    def acquire(self, *, takeover: bool = False) -> None:
        """Become the holder, or raise ``LeaseHeldError`` naming the holder.

        With ``takeover=True`` a dead holder's lease is taken over (a live one never is).
        """
        for _ in range(16):  # each pass ends in a create; losing it to another acquirer repeats
            top = max(self._generations(), default=0)
            if top and self.store.read(gen_name(top) + ".released") is None:
                self._may_take(top, takeover)
            mine = Holder.this_process(top + 1, self.timeout_s)
            if not self.store.create(gen_name(mine.generation), mine.encode()):
                continue
            if max(self._generations(), default=0) > mine.generation:
                # that number had been taken, released and pruned meanwhile: a newer
                # generation holds the root, and the next pass decides against it
                continue
            self._became(mine)
            return
        raise LeaseHeldError(f"{self.store.location}: could not acquire the lease; other "
                             "processes kept acquiring it first")

    def current(self) -> tuple[Holder | None, bool, str] | None:
        """Who holds the lease now, without taking it: ``(holder, alive, why)``, or None when
        nobody does (``holder`` is None when its record is unreadable)."""
        top = max(self._generations(), default=0)
        if not top or self.store.read(gen_name(top) + ".released") is not None:
            return None
        data = self.store.read(gen_name(top))
        holder = Holder.decode(data) if data is not None else None
        if holder is None:
            return None, False, f"its lease record {gen_name(top)} is unreadable"
        return (holder, *self.assess(holder))

    def _may_take(self, generation: int, takeover: bool) -> None:
        """Return if generation ``generation``'s holder may be displaced, else raise."""
        data = self.store.read(gen_name(generation))
        current = Holder.decode(data) if data is not None else None
        if current is None:
            if takeover:
                log.warning("%s: lease record %s is unreadable; taking the lease over",
                            self.store.location, gen_name(generation))
                return
            raise LeaseHeldError(
                f"{self.store.location}/{gen_name(generation)}: the lease record is unreadable, "
                "so this root's writer is unknown. If no other process writes checkpoints "
                "here, pass takeover=True; to only load, use read_only=True")
        alive, why = self.assess(current)
        if not alive and takeover:
            log.warning("%s: taking the lease over from %s: %s", self.store.location,
                        current.describe(), why)
            self.took_over = current
            return
        advice = ("Stop that process first; to only load checkpoints from this root, use "
                  "CheckpointManager(root, read_only=True). takeover=True takes a lease over "
                  "only from a dead holder" if alive else
                  "Pass takeover=True to take the lease over (fencing that holder off should "
                  "it still be running)")
        state = "it is alive" if alive else "it appears dead"
        raise LeaseHeldError(
            f"checkpoint root {self.store.location.removesuffix('/' + LEASE_DIR)} has a "
            f"writer already: {current.describe()}; {state} ({why}). Two writers on one root "
            f"destroy each other's checkpoints. {advice}.")

    def assess(self, holder: Holder) -> tuple[bool, str]:
        """``(alive, why)`` for ``holder``."""
        if holder.on_this_host():
            start = _proc_start(holder.pid)
            if start is None:
                return False, f"pid {holder.pid} is not running on this host"
            if holder.pid_start is not None and start != holder.pid_start:
                return False, f"pid {holder.pid} now belongs to another process"
            if holder.pid == os.getpid():
                return True, ("that is this very process: close() its other CheckpointManager "
                              "on this root first")
            return True, f"pid {holder.pid} is running on this host"
        beat = self._last_heartbeat(holder)
        age = self.clock() - beat
        timeout = max(self.timeout_s, holder.timeout_s or 0.0)  # the holder's, if longer
        if age > timeout:
            return False, (f"its last heartbeat is {age:.0f} s old, beyond the lease timeout "
                           f"of {timeout:.0f} s")
        return True, (f"its last heartbeat is {age:.1f} s old; should it be dead, the lease "
                      f"expires {timeout - age:.0f} s from now")

    def _last_heartbeat(self, holder: Holder) -> float:
        data = self.store.read(gen_name(holder.generation) + ".hb")
        try:
            beat = float(json.loads(data)["time"]) if data is not None else holder.started
        except (ValueError, TypeError, KeyError):
            beat = holder.started
        return max(beat, holder.started)

    def _became(self, mine: Holder) -> None:
        self.holder = mine
        self._lost = None
        try:
            self._write_heartbeat()
            self.store.delete([n for n in self.store.list()
                               if (g := _generation_of(n)) is not None and g < mine.generation])
        except Exception as e:  # the record is ours; the heartbeat thread tries again
            log.warning("%s: lease taken, but its first heartbeat or clean-up failed: %s",
                        self.store.location, e)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="dcpp-lease", daemon=True)
        self._thread.start()
        _live.add(self)

    # -- holding ----------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        return self.holder is not None and self._lost is None

    def check(self) -> None:
        """Raise ``LeaseLostError`` unless this process still holds the lease.

        Reads the lease folder each time (one listing), so it sees a takeover by another
        process at once; after a first failure it fails without reading.
        """
        if self.holder is None:
            raise LeaseLostError(f"{self.store.location}: this writer holds no lease (it was "
                                 "released by close())")
        if self._lost is not None:
            raise LeaseLostError(self._lost)
        gens = self._generations()
        mine = self.holder.generation
        newer = max((g for g in gens if g > mine), default=None)
        if newer is None and mine in gens:
            return
        by = ""
        if newer is not None:
            data = self.store.read(gen_name(newer))
            other = Holder.decode(data) if data is not None else None
            by = f" by {other.describe()}" if other is not None else " by another process"
        self._lost = (f"checkpoint root {self.store.location.removesuffix('/' + LEASE_DIR)}: "
                      f"this process's lease (generation {mine}) was taken over{by}; it no "
                      "longer writes, commits or deletes anything there. Restart it with "
                      "takeover=True once the other writer is gone")
        self._stop.set()
        raise LeaseLostError(self._lost)

    def _write_heartbeat(self) -> None:
        assert self.holder is not None
        self.store.write(gen_name(self.holder.generation) + ".hb",
                         json.dumps({"time": self.clock(),
                                     "holder_id": self.holder.holder_id}).encode())

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.check()
                self._write_heartbeat()
            except LeaseLostError as e:
                log.error("%s", e)
                return
            except Exception as e:  # storage hiccup: the next beat tries again
                log.warning("%s: lease heartbeat failed: %s", self.store.location, e)

    def release(self) -> None:
        """Give the lease up (a no-op once fenced or released)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        _live.discard(self)
        holder, self.holder = self.holder, None
        if holder is None or self._lost is not None or holder.pid != os.getpid():
            return
        try:
            if max(self._generations(), default=0) == holder.generation:
                self.store.create(gen_name(holder.generation) + ".released", b"{}")
        except Exception as e:  # the next writer will find a dead holder instead
            log.warning("%s: could not release the lease: %s", self.store.location, e)

    def _generations(self) -> list[int]:
        return sorted(g for n in self.store.list() if (g := _parse_gen(n)) is not None)


def _generation_of(name: str) -> int | None:
    """The generation a lease file belongs to (its record, heartbeat or release mark)."""
    return _parse_gen(name.split(".", 1)[0])


def _parse_gen(name: str) -> int | None:
    m = _GEN.match(name)
    return int(m.group(1)) if m else None


_live: weakref.WeakSet[RootLease] = weakref.WeakSet()
"""Every lease this process holds: the one process-wide registry, because its only reader is
the process's exit (``atexit``), which no owner object outlives; weak, so that it never keeps
a lease alive."""


@atexit.register
def _release_at_exit() -> None:
    # a script that never calls close() must not leave its root looking taken
    for lease in list(_live):
        lease.release()
