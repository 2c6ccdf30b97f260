"""Free TCP ports on 127.0.0.1 (for gloo rendezvous and test servers)."""

from __future__ import annotations

import socket

# One definition: the bench CLI needs it at run time and the library cannot import test code.
from dcp_plus.cli.bench.world import free_port

__all__ = ["free_port", "free_ports"]


def free_ports(n: int, *, also_free_at: int = 0) -> list[int]:
    """``n`` distinct ports that were free a moment ago; with ``also_free_at=k``, port p + k of
    each was free too (SeaweedFS puts a gRPC port at +10000). Held together while chosen, so
    they differ."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
            if also_free_at:
                if p + also_free_at > 65535:
                    continue
                g = socket.socket()
                socks.append(g)
                try:
                    g.bind(("127.0.0.1", p + also_free_at))
                except OSError:
                    continue
            ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports
