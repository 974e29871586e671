"""Which processes a node agent may end: those that claimed a lease themselves, as the kernel says.

No pid a user sends is ever signalled. A worker bound to a lease (``magics``' GPU worker, before
the cell's code runs) connects to its node agent's unix socket and says which lease it works for,
with its owner's API token and the lease's fencing token. The socket has an abstract address
(``@gpulease-claims/<deployment>/<node>``): no file to get wrong, and private to the host's network
namespace, so a node in a namespace has its own. The kernel tells the agent which process
connected (``SO_PEERCRED``: pid and uid, which the peer cannot choose); the agent reads its start
time, refuses a process it must never end (:func:`refusal`), and has the lease server record the
claim (``procs.lua`` checks that the API token's user holds the lease and its GPUs there). A
process can only ever claim itself: the worst a hostile colleague can do with a claim is have
their own process ended.

When the server ends the lease, its GPUs drain (``drain.py``): the processes to end are exactly
the claimed ones (and, where the agent runs as root, every process in the lease's cgroup, which
the claimer and its children are in), checked again just before any signal: same start time,
same uid, still not one the agent must never end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .. import errors, procs
from ..store.keys import NAME_RE

log = logging.getLogger(__name__)

# as leasing/values.py LEASE_ID_PATTERN (not imported: workers load this)
LEASE_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_MESSAGE = 4096  # one claim: a lease id, two tokens, a user name, a few GPU indexes, a flag
TIMEOUT_S = 5.0  # to read a whole claim, however it trickles in
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5: a pidfd of the connected process
MAX_OPEN_PER_UID = 8  # claim connections one uid may hold open at once (a worker makes one)
MAX_OPEN = 256  # and all uids together: the socket never takes the process's file descriptors


def address(instance: str, node: str) -> str:
    """The abstract unix socket address of ``node``'s agent in deployment ``instance``."""
    return f"\0gpulease-claims/{instance}/{node}"


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a claim, as the kernel and /proc say."""

    pid: int
    uid: int
    start: int  # clock ticks since boot (/proc/PID/stat field 22)


# Services of this host the agent must never end, pid -> (start time, whether their direct children
# are services too): under ``gpulease up``, Redis, JupyterLab and ``ray start`` (whose children are
# Ray's daemons; Ray's workers are the raylet's children, and may be ended).
_PROTECTED: dict[int, tuple[int, bool]] = {}


def protect(pid: int, children: bool = False) -> None:
    """Never end ``pid`` (nor, with ``children``, its direct children) from this process's agent."""
    start = procs.start_ticks(pid)
    if start is not None:
        _PROTECTED[pid] = (start, children)


def _protected(pid: int, rest: list[str]) -> bool:
    mine = _PROTECTED.get(pid)
    if mine is not None and procs.start_ticks(pid) == mine[0]:
        return True
    parent = _PROTECTED.get(int(rest[procs.PPID]))
    return parent is not None and parent[1] and procs.start_ticks(int(rest[procs.PPID])) == parent[0]


def refusal(pid: int, uid: int | None = None) -> str | None:
    """Why this agent must never end process ``pid`` (None: it may). Never: a kernel thread, init,
    the agent itself or any of its ancestors, a service of the host (:func:`protect`: Redis, Ray's
    daemons, JupyterLab), or, for an agent that is not root, another user's process (it could
    not end it anyway)."""
    rest = procs.stat_fields(pid)
    if rest is None:
        return "gone"
    if procs.kernel_thread(rest):
        return "a kernel thread"
    if pid <= 1 or pid in procs.ancestors(os.getpid()):
        return "the node agent or one of its parents"
    if _protected(pid, rest):
        return "a service the node agent started (Redis, Ray, JupyterLab)"
    owner = procs.uid(pid) if uid is None else uid
    if owner is None:
        return "gone"
    if os.geteuid() != 0 and owner != os.geteuid():
        return f"another user's process (uid {owner}); run the agent as root to end it"
    return None


def peer_of(sock: socket.socket) -> Peer | None:
    """The connected process (pid, uid from SO_PEERCRED; its start time), None once it is gone."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    start = procs.start_ticks(pid)
    if start is None:
        return None
    return Peer(pid, uid, start)


class Caller:
    """The process at the other end of a claim connection, read when the connection is accepted
    (before its claim, which it may take seconds to send): its pid, uid and start time, and, where
    the kernel gives one (``SO_PEERPIDFD``), a pidfd of that very process (:attr:`held`).

    A pid is only a number. A process that connects, then exits while a child of its keeps the
    connection open, could have its pid reused by another user's process before the claim arrives;
    the claim would then tie that process to the claimer's lease (its cgroup, its drain).
    :meth:`peer` answers only while the connected process is still the one the pid names."""

    def __init__(self, sock: socket.socket) -> None:
        self.first = peer_of(sock)
        self.held: procs.Held | None = None
        if self.first is not None:
            fd: int | None = None
            with contextlib.suppress(OSError):
                fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
            self.held = procs.Held(self.first.pid, fd, self.first.start)

    def peer(self) -> Peer | None:
        p = self.first
        if p is None or self.held is None or self.held.gone():
            return None  # it exited: its pid may name another process now
        if procs.start_ticks(p.pid) != p.start or procs.uid(p.pid) != p.uid:
            return None
        return p

    def close(self) -> None:
        if self.held is not None:
            self.held.close()


class Gate:
    """How many claim connections are open, per uid and in all: one beyond MAX_OPEN_PER_UID for
    its uid, or beyond MAX_OPEN, is closed at once, so that no local user can hold the agent's (or
    ``gpulease up``'s lease server's) file descriptors. One warning per uid while it is over."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[int, int] = {}
        self.warned: set[int] = set()

    def enter(self, uid: int) -> bool:
        with self.lock:
            if self.open.get(uid, 0) >= MAX_OPEN_PER_UID or sum(self.open.values()) >= MAX_OPEN:
                if uid not in self.warned:
                    self.warned.add(uid)
                    log.warning("uid %s holds %d claim connections: closing more at once", uid, self.open.get(uid, 0))
                return False
            self.open[uid] = self.open.get(uid, 0) + 1
            return True

    def leave(self, uid: int) -> None:
        with self.lock:
            self.open[uid] -= 1
            if not self.open[uid]:
                del self.open[uid]
                self.warned.discard(uid)


def _read_claim(sock: socket.socket, deadline: float) -> bytes:
    """One line of at most MAX_MESSAGE bytes, all of it by ``deadline`` (one trickled byte at a
    time keeps no connection open past it)."""
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < MAX_MESSAGE:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the claim did not arrive in time")
        sock.settimeout(left)
        chunk = sock.recv(MAX_MESSAGE - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


@dataclass(frozen=True)
class Claim:
    """What a worker says: the lease it works for, proven by its owner's API token."""

    node: str
    lease: str
    fence: int
    token: str  # the owner's API token (never logged, never stored)
    user: str  # the user a proxy token acts for ("" otherwise)
    gpus: tuple[int, ...]  # the lease's GPUs of this node the process uses
    # the claimer is a worker suspended at this agent (onhost.py) and asks to be restored onto them
    restore: bool = False

    @classmethod
    def parse(cls, raw: bytes) -> Claim:
        try:
            d = json.loads(raw)
        except ValueError as exc:
            raise ValueError("a claim is one JSON object on one line") from exc
        if not isinstance(d, dict):
            raise ValueError("a claim is one JSON object on one line")
        node, lease, fence = d.get("node"), d.get("lease"), d.get("fence")
        token, user, gpus = d.get("token"), d.get("user") or "", d.get("gpus") or []
        if not isinstance(node, str) or not NAME_RE.match(node):
            raise ValueError("node must be the node's name")
        if not isinstance(lease, str) or not LEASE_ID_RE.match(lease):
            raise ValueError("lease must be a lease id")
        if not isinstance(fence, int) or isinstance(fence, bool) or fence < 0:
            raise ValueError("fence must be the lease's fencing token (an integer)")
        if not isinstance(token, str) or not 0 < len(token) <= 200:
            raise ValueError("token must be the lease owner's API token")
        if not isinstance(user, str) or (user and not NAME_RE.match(user)):
            raise ValueError("user must be a user name")
        if not isinstance(gpus, list) or len(gpus) > 64 or not all(type(g) is int and 0 <= g < 4096 for g in gpus):
            raise ValueError("gpus must be a list of GPU indexes")
        restore = d.get("restore", False)
        if not isinstance(restore, bool):
            raise ValueError("restore must be true or false")
        return cls(node, lease, fence, token, user, tuple(gpus), restore)


# What records a verified claim in the lease server; raises GpuLeaseError (its message is the answer).
# What it returns (a restore's figures) is added to the answer.
Record = Callable[[Claim, Peer], Awaitable[dict[str, Any] | None]]


async def answer(peer: Peer | None, raw: bytes, nodes: set[str], record: Record) -> dict[str, Any]:
    """The agent's answer to one claim: ``{"ok": true}`` or ``{"error": "..."}``."""
    if peer is None:
        return {"error": "the claiming process is gone"}
    try:
        claim = Claim.parse(raw)
    except ValueError as exc:
        return {"error": str(exc)}
    if claim.node not in nodes:
        return {"error": f"this agent serves {', '.join(sorted(nodes))}, not {claim.node}"}
    why = refusal(peer.pid, peer.uid)
    if why is not None:
        log.warning("claim of lease %s by pid %s refused: %s", claim.lease, peer.pid, why)
        return {"error": f"pid {peer.pid} cannot be tied to a lease: {why}"}
    try:
        extra = await record(claim, peer)
    except errors.GpuLeaseError as exc:
        return {"error": str(exc)}
    log.info("pid %s (uid %s) claimed lease %s on %s", peer.pid, peer.uid, claim.lease, claim.node)
    return {**(extra or {}), "ok": True}


def holder(addr: str) -> tuple[int, int] | None:
    """(pid, uid) of a process holding the abstract unix socket ``addr`` (where this agent may
    look: as root, any), from /proc/net/unix and each process's descriptors; None if none found."""
    name = "@" + addr.lstrip("\0")
    inodes = set()
    try:
        with open("/proc/net/unix") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if len(parts) >= 8 and parts[7] == name:
                    inodes.add(f"socket:[{parts[6]}]")
    except OSError:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        uid = procs.uid(int(pid))
                        return int(pid), -1 if uid is None else uid
    return None


class Missing:
    """The nodes whose claim socket this agent has not bound yet. Its address is abstract: any
    account of the host may bind it first (while the agent restarts, say), and workers would then
    run unclaimed, neither drained nor measured. Such a node takes no lease (its agent sends no
    heartbeat for it, :meth:`serving`) until the agent has bound it: it tries again every
    second, and says once which process holds it."""

    def __init__(self, instance: str, nodes: set[str]) -> None:
        self.instance, self.todo = instance, set(nodes)
        self.said: set[str] = set()
        self.next_try = 0.0

    def due(self) -> list[str]:
        if not self.todo or time.monotonic() < self.next_try:
            return []
        self.next_try = time.monotonic() + 1.0
        return sorted(self.todo)

    def failed(self, node: str, exc: OSError) -> None:
        if node in self.said:
            return
        self.said.add(node)
        held = holder(address(self.instance, node))
        who = f" by pid {held[0]} (uid {held[1]})" if held else ""
        log.error(
            "claim socket of %s is taken%s (%s): %s takes no lease until this agent can bind it; retrying",
            node, who, exc.strerror or exc, node,
        )  # fmt: skip

    def bound(self, node: str) -> None:
        self.todo.discard(node)
        if node in self.said:
            log.warning("claim socket of %s bound at last: %s takes leases again", node, node)
        self.said.discard(node)

    def serving(self, node: str) -> bool:
        """Whether ``node`` may heartbeat: its claim socket is this agent's."""
        return node not in self.todo


class AsyncClaims:
    """The claim socket of the in-process agent (``gpulease up``): one listener per node."""

    def __init__(self, instance: str, nodes: list[str], record: Record) -> None:
        self.instance, self.nodes, self.record = instance, set(nodes), record
        self.servers: list[asyncio.AbstractServer] = []
        self.gate = Gate()
        self.missing = Missing(instance, self.nodes)

    async def start(self) -> None:
        """Bind the claim socket of each node not yet bound (called again while some are not)."""
        for node in self.missing.due():
            try:
                server = await asyncio.start_unix_server(self._serve, path=address(self.instance, node))
            except OSError as exc:
                self.missing.failed(node, exc)
                continue
            self.missing.bound(node)
            self.servers.append(server)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        caller = Caller(sock) if sock is not None else None
        uid = caller.first.uid if caller is not None and caller.first is not None else -1
        if not self.gate.enter(uid):
            if caller is not None:
                caller.close()
            writer.close()
            return
        try:
            raw = await asyncio.wait_for(reader.readline(), TIMEOUT_S)
            peer = caller.peer() if caller is not None else None
            reply = await answer(peer, raw[:MAX_MESSAGE], self.nodes, self.record)
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, OSError, ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            self.gate.leave(uid)
            if caller is not None:
                caller.close()
            writer.close()

    async def close(self) -> None:
        for server in self.servers:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self.servers.clear()


class ThreadClaims:
    """The claim socket of ``gpulease agent`` (a thread per connection; ``record`` runs on an
    event loop of its own)."""

    def __init__(self, instance: str, nodes: list[str], record: Record) -> None:
        self.instance, self.nodes, self.record = instance, set(nodes), record
        self.servers: list[socketserver.ThreadingUnixStreamServer] = []
        self.gate = Gate()
        self.missing = Missing(instance, self.nodes)

    def start(self) -> None:
        """Bind the claim socket of each node not yet bound (called again while some are not)."""
        outer = self

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

            def process_request(self, request: Any, client_address: Any) -> None:
                # in the accepting thread, in the order connections came: the gate's count is
                # settled before a thread is started (a refused one costs no thread), and the
                # caller is read at accept; both reach the handler as its client_address
                deadline = time.monotonic() + TIMEOUT_S
                caller = Caller(request)
                uid = caller.first.uid if caller.first is not None else -1
                if not outer.gate.enter(uid):
                    caller.close()
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, (caller, uid, deadline))
                except BaseException:  # no thread to serve it (the host's thread limit): let it go
                    outer.gate.leave(uid)
                    caller.close()
                    raise

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                caller, uid, deadline = self.client_address
                try:
                    with contextlib.suppress(OSError, ValueError):
                        raw = _read_claim(sock, deadline)
                        reply = asyncio.run(answer(caller.peer(), raw, outer.nodes, outer.record))
                        sock.settimeout(TIMEOUT_S)
                        sock.sendall(json.dumps(reply).encode() + b"\n")
                finally:
                    outer.gate.leave(uid)
                    caller.close()

        for node in self.missing.due():
            try:
                server = Server(address(self.instance, node), Handler)
            except OSError as exc:
                self.missing.failed(node, exc)
                continue
            self.missing.bound(node)
            threading.Thread(target=server.serve_forever, name=f"gpulease-claims-{node}", daemon=True).start()
            self.servers.append(server)

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
        self.servers.clear()


class ClaimRefused(Exception):
    """The agent did not tie this process to the lease (the reason is the message)."""


def claim(
    instance: str,
    node: str,
    lease: str,
    fence: int,
    token: str,
    user: str = "",
    gpus: list[int] | None = None,
    timeout: float = TIMEOUT_S,
    restore: bool = False,
) -> dict[str, Any]:
    """Tie this very process to ``lease`` at ``node``'s agent (run by the process that uses the
    lease's GPUs, before it touches them). ``restore``: this process was suspended there (its
    GPU state on host) and asks to be restored onto the lease's GPU first. Returns the agent's
    answer (a restore's ``{"restored": {bytes, ms}}``). Raises ClaimRefused, or OSError when no
    agent answers."""
    msg: dict[str, Any] = {"node": node, "lease": lease, "fence": int(fence), "token": token, "user": user}
    msg["gpus"] = gpus or []
    if restore:
        msg["restore"] = True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(address(instance, node))
        # An abstract address has no owner: whoever binds it first answers. The API token goes only
        # to a listener that runs as root (an agent on a shared host) or as this very user (gpulease up).
        _pid, uid, _gid = struct.unpack(
            "3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        if uid not in (0, os.geteuid()):
            raise ClaimRefused(f"the claim socket of {node} is held by uid {uid}, not by a node agent: not claiming")
        s.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    try:
        reply = json.loads(buf or b"{}")
    except ValueError:
        reply = {}
    if not reply.get("ok"):
        raise ClaimRefused(str(reply.get("error") or "the node agent gave no answer"))
    keep_orphans()
    return dict(reply)


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def keep_orphans() -> bool:
    """Keep this process's descendants in its tree, however they leave their parent: made a child
    subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), it, not init, adopts every orphan below it. A
    claimer calls it once claimed, so that :func:`procs.descendants` of the claimed process finds all
    that a cell started, which the agent measures against its slice and its drain ends, where it
    keeps no cgroup too (an agent that is not root, a simulated node): a daemon's double fork (a
    real cell's did, and held 1.4 GB unmeasured past its lease) stays under its worker.

    Why not its session or process group: a daemon calls ``setsid()`` as it forks, and any
    process may leave either, so neither says where it came from; an environment
    mark may be cleared or forged. Being adopted is the kernel's doing: nothing below the claimer
    leaves its tree while it runs. What it costs: an adopted orphan that exits is a zombie of the
    claimer until the claimer exits (it holds no memory; SIGCHLD is left as it is, so the cell's own
    ``subprocess`` return codes are untouched). Kept across ``exec`` (claimexec's command), not
    passed to children. Returns whether the kernel agreed (False off Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
