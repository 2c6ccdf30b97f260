"""A TCP proxy in front of an HTTP server that injects faults, one decision per request.

It rewrites each request to ``Connection: close`` so that every request arrives on a fresh
connection, then resets the connection after reading the request head (``reset_fraction`` of
requests) or answers ``503 SlowDown`` itself (``error_fraction``); other requests are piped
to the server untouched. Faults are spread evenly over the request sequence (deterministic,
so a test always sees both kinds and never a long run of failures). ``set_down(True)`` closes the listening
socket (connection refused, as for a server that is down) until ``set_down(False)``.
``hold(marker)`` parks every later request whose head contains ``marker`` (``held`` is set
when the first one is parked) until ``release()``: a client provably in the middle of an
upload, for a test to kill.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import threading

_ERROR_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
               b"<Message>Please reduce your request rate.</Message></Error>")
_ERROR = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
          b"Content-Length: " + str(len(_ERROR_BODY)).encode() + b"\r\n\r\n" + _ERROR_BODY)


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream``, injecting faults per request."""

    def __init__(self, upstream: tuple[str, int], *, reset_fraction: float = 0.0,
                 error_fraction: float = 0.0) -> None:
        self.upstream = upstream
        self.reset_fraction = reset_fraction
        self.error_fraction = error_fraction
        self._lock = threading.Lock()
        self.requests = self.resets = self.errors = 0
        self.port = 0
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._hold_marker: bytes | None = None
        self._released = threading.Event()
        self.held = threading.Event()
        self._listen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(128)
        self.port = s.getsockname()[1]
        self._listener = s
        t = threading.Thread(target=self._accept, args=(s,), daemon=True)
        t.start()
        self._threads.append(t)

    def set_down(self, down: bool) -> None:
        """Refuse connections (``True``) or accept them again on the same port."""
        if down and self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        elif not down and self._listener is None:
            self._listen()

    def hold(self, marker: bytes) -> None:
        """Park the requests whose head contains ``marker`` from now on (see the module doc)."""
        self._released.clear()
        self.held.clear()
        self._hold_marker = marker

    def release(self) -> None:
        """Forward the parked requests and stop holding."""
        self._hold_marker = None
        self._released.set()

    def close(self) -> None:
        self.release()
        self.set_down(True)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _decide(self) -> str:
        with self._lock:
            n = self.requests
            self.requests += 1
            if _hits(n, self.reset_fraction, 0.0):
                self.resets += 1
                return "reset"
            if _hits(n, self.error_fraction, 0.5):
                self.errors += 1
                return "error"
            return "pass"

    def _serve(self, client: socket.socket) -> None:
        try:
            head, rest = _read_head(client)
            if head is None:
                client.close()
                return
            marker = self._hold_marker
            if marker is not None and marker in head:
                self.held.set()
                self._released.wait()
            action = self._decide()
            if action == "reset":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # RST: the client sees "connection reset by peer"
                return
            if action == "error":
                _drain_body(client, head, rest)
                client.sendall(_ERROR)
                client.shutdown(socket.SHUT_WR)
                client.close()
                return
            upstream = socket.create_connection(self.upstream)
            upstream.sendall(_close_after(head) + rest)
            _pipe_both(client, upstream)
        except OSError:
            client.close()


def _hits(n: int, fraction: float, phase: float) -> bool:
    """Whether request ``n`` is one of an evenly spread ``fraction`` (shifted by ``phase``)."""
    if fraction <= 0:
        return False
    shift = phase / fraction
    return math.floor((n + 1 + shift) * fraction) > math.floor((n + shift) * fraction)


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _headers(head: bytes) -> dict[bytes, bytes]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


def _drain_body(sock: socket.socket, head: bytes, rest: bytes) -> None:
    """Read the request body (if the client sends it now) so that the reply is not lost."""
    h = _headers(head)
    if h.get(b"expect", b"").lower() == b"100-continue":
        return
    remaining = int(h.get(b"content-length", b"0")) - len(rest)
    while remaining > 0:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            return
        remaining -= len(chunk)


def _close_after(head: bytes) -> bytes:
    lines = [ln for ln in head[:-4].split(b"\r\n")
             if not ln.lower().startswith((b"connection:", b"keep-alive:"))]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _pipe_both(a: socket.socket, b: socket.socket) -> None:
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=pump, args=(b, a), daemon=True)
    t.start()
    pump(a, b)
    t.join()
    a.close()
    b.close()
