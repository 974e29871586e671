"""Who listens on a TCP port of this host, as the kernel says (``/proc/net/tcp`` and ``tcp6``):
each listening socket's inode and its owner's uid. A local user may bind a port that a process of
ours is about to use (Redis's, the lease server's) and read whatever secret is sent to it first;
what is about to be sent a password or a token asks this first. Linux only: elsewhere nothing is
known, and the callers say what they then do."""

from __future__ import annotations

from typing import NamedTuple


class Listener(NamedTuple):
    inode: int  # the socket's inode: /proc/PID/fd/N of its process links to "socket:[inode]"
    uid: int  # its owner


def listeners(port: int) -> list[Listener] | None:
    """The sockets listening on ``port`` (any local address), None where /proc cannot tell."""
    found: list[Listener] = []
    readable = False
    hex_port = f"{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [r.split() for r in f.read().splitlines()[1:]]
        except OSError:
            continue
        readable = True
        # local_address "ADDR:PORT" in hex; st 0A: LISTEN; then tx:rx, tr:when, retrnsmt, uid, timeout, inode
        found += [
            Listener(int(r[9]), int(r[7]))
            for r in rows
            if len(r) > 9 and r[3] == "0A" and r[1].rsplit(":", 1)[1] == hex_port
        ]
    return found if readable else None
