"""Who listens on a TCP port of this host, as the kernel says (sock_diag over netlink, else
``/proc/net/tcp`` and ``tcp6``): each listening socket's inode and its owner's uid. A local user
may bind a port that a process of ours is about to use (Redis's, the lease server's) and read
whatever secret is sent to it first; what is about to be sent a password or a token asks this
first. Linux only: elsewhere nothing is known, and the callers say what they then do."""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple


class Listener(NamedTuple):
    inode: int  # the socket's inode: /proc/PID/fd/N of its process links to "socket:[inode]"
    uid: int  # its owner
    addr: str = ""  # the address it is bound to ("0.0.0.0" or "::": every address of its family)


# sock_diag (linux/sock_diag.h, linux/inet_diag.h): a dump of the TCP sockets in state LISTEN only,
# which the kernel filters itself. Cheap enough to ask before every request that carries a token
# (~0.1 ms), where /proc/net/tcp lists every socket of the host (milliseconds on a busy one).
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLM_F_DUMP = 4, 20, 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE, _TCP_LISTEN = 2, 3, 10
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_msg: family, state, timer, retrans, then inet_diag_sockid (sport and dport big-endian,
# src[4], dst[4], if, cookie[2]), then expires, rqueue, wqueue, uid, inode
_DIAG_SPORT, _DIAG_SRC, _DIAG_UID = 4, 8, 4 + 48 + 12


def _diag(family: int) -> list[tuple[int, Listener]]:
    """(port, listener) of every listening TCP socket of ``family``. Raises OSError where the
    kernel has no sock_diag (or it is not allowed here)."""
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN) + bytes(48)
    out: list[tuple[int, Listener]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as s:
        s.settimeout(1.0)
        flags = _NLM_F_REQUEST | _NLM_F_DUMP
        s.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(req), _SOCK_DIAG_BY_FAMILY, flags, 1, 0) + req)
        while True:
            data = s.recv(65536)
            at = 0
            while at + _NLMSGHDR.size <= len(data):
                length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, at)
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR or length < _NLMSGHDR.size:
                    raise OSError("sock_diag refused the dump")
                body = at + _NLMSGHDR.size
                if length >= _NLMSGHDR.size + _DIAG_UID + 8:
                    (port,) = struct.unpack_from(">H", data, body + _DIAG_SPORT)
                    uid, inode = struct.unpack_from("=II", data, body + _DIAG_UID)
                    size = 4 if family == socket.AF_INET else 16
                    src = data[body + _DIAG_SRC : body + _DIAG_SRC + size]
                    out.append((port, Listener(inode, uid, socket.inet_ntop(family, src))))
                at += (length + 3) & ~3
            if not data:
                return out


def listeners(port: int) -> list[Listener] | None:
    """The sockets listening on ``port`` (any local address), None where the kernel cannot tell."""
    try:
        return [li for family in (socket.AF_INET, socket.AF_INET6) for p, li in _diag(family) if p == port]
    except OSError:
        return _from_proc(port)


def _from_proc(port: int) -> list[Listener] | None:
    """:func:`listeners` from /proc/net/tcp and tcp6, where sock_diag is not to be had."""
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
            Listener(int(r[9]), int(r[7]), _proc_addr(r[1].rsplit(":", 1)[0]))
            for r in rows
            if len(r) > 9 and r[3] == "0A" and r[1].rsplit(":", 1)[1] == hex_port
        ]
    return found if readable else None


def _proc_addr(hexed: str) -> str:
    """An address as /proc/net/tcp[6] writes it: 32-bit words in host order (little-endian)."""
    raw = bytes.fromhex(hexed)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)
