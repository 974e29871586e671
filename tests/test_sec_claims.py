"""The claim socket against a hostile local user (a hostile review, 2026-11-28): a claim binds the
process that connected, not whatever process holds its pid when the claim arrives; a connection
that trickles its claim is closed at the deadline; and no uid holds more than a few connections
open, so the socket never takes the agent's (or ``gpulease up``'s server's) file descriptors.

Real sockets, real processes; the pid reuse is made with the kernel's own ``ns_last_pid`` (root)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lease_server import procs
from lease_server.node import claims
from lease_server.node.claims import MAX_OPEN_PER_UID, Caller, Claim, Peer, ThreadClaims

# Connects to the abstract address in argv[1], then forks: the child keeps the connection open and
# sleeps; the parent (the connector) prints its pid and exits when its stdin closes.
CONNECT_THEN_LEAVE = r"""
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1].replace("@", "\0", 1))
if os.fork() == 0:
    sys.stdin.close()
    time.sleep(60)
    os._exit(0)
print(os.getpid(), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def listener() -> Iterator[tuple[str, socket.socket]]:
    name = f"@gpulease-test-claims/{uuid.uuid4().hex}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name.replace("@", "\0", 1))
    srv.listen(64)
    try:
        yield name, srv
    finally:
        srv.close()


def _take_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A new ``sleep`` under exactly ``pid`` (the kernel hands out ns_last_pid + 1 next), or None."""
    path = Path("/proc/sys/kernel/ns_last_pid")
    for _ in range(20):
        try:
            path.write_text(str(pid - 1))
        except OSError:
            return None
        p = subprocess.Popen(["sleep", "60"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def test_a_claim_binds_the_process_that_connected_not_one_that_took_its_pid_since(listener) -> None:
    name, srv = listener
    connector = subprocess.Popen(
        [sys.executable, "-c", CONNECT_THEN_LEAVE, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    conn, _ = srv.accept()
    impostor = None
    try:
        caller = Caller(conn)  # read at accept, as the agent does
        pid = int(connector.stdout.readline())  # type: ignore[union-attr]
        assert caller.first is not None and caller.first.pid == pid
        assert caller.peer() == caller.first  # still the process that connected
        connector.stdin.close()  # type: ignore[union-attr]
        connector.wait()  # gone, and reaped: its pid is free; its child still holds the connection
        assert caller.peer() is None
        impostor = _take_pid(pid)
        if impostor is None:
            pytest.skip("could not have the kernel reuse the pid (needs root's ns_last_pid)")
        # another process under the connector's pid: the claim is not its to make
        assert procs.start_ticks(pid) is not None
        assert caller.peer() is None
        got = asyncio.run(claims.answer(caller.peer(), b"{}\n", {"n1"}, _never))
        assert got == {"error": "the claiming process is gone"}
        caller.close()
    finally:
        conn.close()
        if impostor is not None:
            impostor.kill()
            impostor.wait()
        with contextlib.suppress(Exception):
            connector.kill()
        # the forked holder sleeps on; its connection is closed: end it by its parentless pid
        subprocess.run(["pkill", "-f", "gpulease-test-claims"], check=False)


async def _never(claim: Claim, peer: Peer) -> dict[str, Any] | None:
    raise AssertionError(f"nothing may be recorded for {peer}")


@pytest.fixture
def thread_claims() -> Iterator[tuple[str, list[tuple[Claim, Peer]]]]:
    recorded: list[tuple[Claim, Peer]] = []

    async def record(claim: Claim, peer: Peer) -> dict[str, Any] | None:
        recorded.append((claim, peer))
        return None

    instance = uuid.uuid4().hex[:12]
    server = ThreadClaims(instance, ["n1"], record)
    server.start()
    try:
        yield claims.address(instance, "n1"), recorded
    finally:
        server.close()


def _closed(s: socket.socket, within: float) -> bool:
    """Whether the agent closed ``s`` (recv returns b"") within ``within`` seconds."""
    s.settimeout(within)
    try:
        return s.recv(64) == b""
    except TimeoutError:
        return False


def test_no_uid_holds_more_than_a_few_claim_connections(thread_claims, monkeypatch) -> None:
    address, recorded = thread_claims
    # the claim deadline (5 s from accept) is another test's: on a loaded machine the steps below
    # may take longer, and the connections within the share must still be open when they speak
    monkeypatch.setattr(claims, "TIMEOUT_S", 120.0)
    held = []
    try:
        for _ in range(MAX_OPEN_PER_UID):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(address)
            held.append(s)
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        extra.connect(address)
        held.append(extra)
        assert _closed(extra, 10)  # one more than its share: closed without a word
        # those within the share are still served: one sends a (bad) claim and gets its answer
        held[0].sendall(b'{"node": "n1"}\n')
        held[0].settimeout(10)
        assert b"error" in held[0].recv(4096)
    finally:
        for s in held:
            s.close()
    assert recorded == []
    # and once they are closed, a new connection is served again
    deadline = time.monotonic() + 10
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(address)
            s.sendall(b'{"node": "n1"}\n')
            s.settimeout(10)
            if b"error" in s.recv(4096):
                break
        assert time.monotonic() < deadline, "the agent never served a connection again"
        time.sleep(0.05)  # the closed ones are counted out by the agent's threads: no event to wait on


def test_a_trickled_claim_is_cut_at_the_deadline(thread_claims) -> None:
    address, _ = thread_claims
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(address)
        closed = False
        # one byte every 0.5 s would keep a per-read timeout of 5 s waiting for ever (tried for up
        # to six times the deadline: a loaded machine may be slow to close it, never too quick)
        for _ in range(int(claims.TIMEOUT_S / 0.5) * 6):
            try:
                s.sendall(b" ")
            except OSError:
                closed = True
                break
            s.settimeout(0.5)
            try:
                if s.recv(64) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
        assert closed, "the agent kept a trickling connection open past its deadline"


def test_the_peer_pidfd_names_the_connected_process(listener) -> None:
    name, srv = listener
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(name.replace("@", "\0", 1))
        conn, _ = srv.accept()
        with conn:
            caller = Caller(conn)
            assert caller.first is not None and caller.first.pid == os.getpid()
            if caller.held is None or caller.held.fd is None:
                pytest.skip("this kernel has no SO_PEERPIDFD (Linux < 6.5): the start time alone decides")
            assert caller.peer() == caller.first
            caller.close()


def test_a_released_cell_never_kills_a_process_that_took_its_workers_pid() -> None:
    """The driver checks that a worker is gone (verify_gone, wait_exit: SIGKILL after a grace) by
    its pid and start time: a worker that died while warm may have its pid taken by anyone's
    process since, which it then SIGKILLed (a hostile review)."""
    from magics.worker import verify_gone, wait_exit

    worker = subprocess.Popen(["sleep", "60"])
    started = procs.start_ticks(worker.pid)
    assert started is not None
    worker.kill()
    worker.wait()
    # a process is known by its pid and start time, in clock ticks: one started in the same tick as
    # the worker would pass for it (a pid is not reused that fast outside a test)
    hz = os.sysconf("SC_CLK_TCK")
    while float(Path("/proc/uptime").read_text().split()[0]) * hz < started + 2:
        time.sleep(0.005)
    other = _take_pid(worker.pid)
    if other is None:
        pytest.skip("cannot choose the next pid here (needs root and /proc/sys/kernel/ns_last_pid)")
    try:
        assert verify_gone(worker.pid, [], [], started)["gone"]  # at once: the worker is gone
        assert other.poll() is None  # and the process under its pid now was never signalled
        # the same call on the process it names (pid and start time) ends it after the grace
        assert wait_exit(other.pid, timeout=10, kill_after=0.1, start=procs.start_ticks(other.pid) or 0)
        assert other.wait(10) == -9
    finally:
        other.kill()
        other.wait()
