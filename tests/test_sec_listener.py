"""A token is never sent to another user's listener on a loopback port, at any request (a hostile
review, 2026-11-28): while the lease server is down (stopped, or died with its terminal), any local
user may bind its port. A JupyterLab tab that reconnects, or a kernel's renewals, used to send the
token to whoever listened there then: the check ran once, at start-up, and only for the tokens of
``gpulease up``'s files. Now every request asks the kernel whose the listener is
(``client.ServerGuard``, sock_diag): ``up``'s tokens go to this user's or root's only, a
``GPULEASE_SERVER_UID`` names the deployment's server user, and any other token goes only to the
user that listened at its first request.

The squatter is a real process of user ``nobody`` (root needed to start it) on the very port."""

from __future__ import annotations

import asyncio
import http.server
import os
import pwd
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lease_server import errors, listeners
from lease_server.client import Client, ServerGuard

# Listens on argv[1] (0: any port) as whoever runs it, prints the port, then for each connection
# prints the first bytes it received (repr), so that the test sees what reached it, in order.
SQUAT = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    print(repr(c.recv(64)), flush=True)
    c.close()
"""


def _nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root, to listen as another user, and /usr/bin/python3")
    return pwd.getpwnam("nobody")


class Squatter:
    def __init__(self, port: int) -> None:
        nobody = _nobody()
        self.proc = subprocess.Popen(
            ["/usr/bin/python3", "-c", SQUAT, str(port)],
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.uid = nobody.pw_uid

    def first_bytes(self) -> str:
        """What reached it first: the test's own marker means nothing came before."""
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(b"MARKER")
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def answering(body: bytes) -> type[http.server.BaseHTTPRequestHandler]:
    """A request handler that answers every GET with the JSON ``body``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    return Handler


class Answering:
    """A tiny HTTP server of this user that answers every GET with {} (the lease server, up)."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), answering(b"{}"))
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:  # the lease server goes down: its port is free for anyone
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[Answering]:
    s = Answering()
    yield s
    s.stop()


def test_the_kernel_names_a_listeners_owner_by_netlink_as_by_proc() -> None:
    nobody = Squatter(0)
    try:
        found = [li for port, li in listeners._diag(socket.AF_INET) if port == nobody.port]  # netlink itself
        assert [(li.uid, li.addr) for li in found] == [(nobody.uid, "127.0.0.1")]
        assert listeners.listeners(nobody.port) == found
        by_proc = listeners._from_proc(nobody.port)
        assert by_proc == found
    finally:
        nobody.stop()
    with socket.socket(socket.AF_INET6) as s6:
        s6.bind(("::1", 0))
        s6.listen()
        port = s6.getsockname()[1]
        assert [li.inode for li in listeners.listeners(port) or []] == [os.fstat(s6.fileno()).st_ino]


def test_a_token_goes_to_no_other_user_that_took_the_port_since(server: Answering, monkeypatch) -> None:
    """An explicit token: the listener of its first request is its server's user; once the server
    is down and nobody binds the port, the next request is refused before anything is sent."""
    monkeypatch.delenv("GPULEASE_SERVER_UID", raising=False)
    port = server.port
    with Client(f"http://127.0.0.1:{port}", "glt_secret_of_alice", resend_503_s=0) as c:
        assert c.request("GET", "/api/v1/health") == {}
        server.stop()
        squat = Squatter(port)
        try:
            with pytest.raises(errors.ServerUnavailable, match="another user's") as exc:
                c.request("GET", "/api/v1/health")
            assert f"uid {squat.uid}" in exc.value.message and "glt_secret" not in exc.value.message
            assert squat.first_bytes() == "b'MARKER'"  # nothing of the client's reached it
        finally:
            squat.stop()


def test_ups_token_and_a_named_server_uid_go_to_that_user_only(monkeypatch) -> None:
    nobody = Squatter(0)
    try:
        url = f"http://127.0.0.1:{nobody.port}"
        monkeypatch.delenv("GPULEASE_SERVER_UID", raising=False)
        with pytest.raises(errors.ServerUnavailable, match="your gpulease up down"):
            ServerGuard(url, "glt_up", ours=True).check()
        monkeypatch.setenv("GPULEASE_SERVER_UID", str(os.geteuid()))
        with pytest.raises(errors.ServerUnavailable, match="GPULEASE_SERVER_UID"):
            ServerGuard(url, "glt_any").check()
        monkeypatch.setenv("GPULEASE_SERVER_UID", str(nobody.uid))
        ServerGuard(url, "glt_any").check()  # the deployment's server user: sent
        monkeypatch.delenv("GPULEASE_SERVER_UID")
        ServerGuard("http://10.0.0.1:8470", "glt_any", ours=True).check()  # not loopback: not asked
        assert nobody.first_bytes() == "b'MARKER'"
    finally:
        nobody.stop()


def test_the_jupyter_extension_sends_nothing_to_a_squatter(server: Answering, monkeypatch) -> None:
    """The extension's client (the board's requests and event stream) asks before each request."""
    from jupyter_ext.upstream import LeaseApi

    monkeypatch.delenv("GPULEASE_SERVER_UID", raising=False)
    port = server.port

    async def run() -> str:
        api = LeaseApi(f"http://127.0.0.1:{port}", "glt_lab_token")
        try:
            assert await api.request("GET", "/health") == {}
            server.stop()
            squat = Squatter(port)
            try:
                with pytest.raises(errors.ServerUnavailable, match="another user's"):
                    await api.request("GET", "/health")
                with pytest.raises(errors.ServerUnavailable, match="another user's"):
                    async with api.events(None):
                        pass
                return squat.first_bytes()
            finally:
                squat.stop()
        finally:
            await api.close()

    assert asyncio.run(run()) == "b'MARKER'"


def test_another_users_listener_on_another_address_stops_no_client(server: Answering, monkeypatch) -> None:
    """Anyone may listen on the same port at 127.0.0.2 or ::1: a client of 127.0.0.1 cannot be
    reached there, and goes on (it used to refuse every request from then on: leases left to
    expire). A client of "localhost", which may connect to either, is refused: two users listen."""
    monkeypatch.delenv("GPULEASE_SERVER_UID", raising=False)
    nobody = _nobody()
    code = (
        "import socket, sys, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('127.0.0.2', {server.port})); s.listen(); "
        f"s6 = socket.socket(socket.AF_INET6); s6.bind(('::1', {server.port})); s6.listen(); "
        "print('up', flush=True); time.sleep(60)"
    )
    beside = subprocess.Popen(
        ["/usr/bin/python3", "-c", code], user=nobody.pw_uid, group=nobody.pw_gid, stdout=subprocess.PIPE, cwd="/"
    )
    try:
        assert beside.stdout is not None and beside.stdout.readline().strip() == b"up"
        with Client(f"http://127.0.0.1:{server.port}", "glt_secret_of_alice", resend_503_s=0) as c:
            assert c.request("GET", "/api/v1/health") == {}
            assert c.request("GET", "/api/v1/health") == {}
        with pytest.raises(errors.ServerUnavailable, match="another user's"):
            Client(f"http://localhost:{server.port}", "glt_secret_of_alice").request("GET", "/api/v1/health")
    finally:
        beside.kill()
        beside.wait()


def test_a_kernels_event_streams_ask_too(server: Answering, monkeypatch) -> None:
    """The event streams of a warm lease and of a call (magics.calls.event_client) share their
    Client's guard, or make one from the token in the headers they are given (any case)."""
    from magics.calls import event_client

    monkeypatch.delenv("GPULEASE_SERVER_UID", raising=False)
    port = server.port
    with Client(f"http://127.0.0.1:{port}", "glt_secret_of_alice", resend_503_s=0) as c:
        shared = event_client(c.url, c.headers, c.guard)
        own = event_client(c.url, c.headers)  # (httpx gives the headers lower-cased)
        assert shared.get("/api/v1/health").json() == {} and own.get("/api/v1/health").json() == {}
        server.stop()
        squat = Squatter(port)
        try:
            for http in (shared, own):
                with pytest.raises(errors.ServerUnavailable, match="another user's"):
                    http.get("/api/v1/health")
            assert squat.first_bytes() == "b'MARKER'"
        finally:
            squat.stop()
            shared.close()
            own.close()


def test_ups_clients_talk_over_its_unix_socket_whoever_holds_its_port(tmp_path, monkeypatch) -> None:
    """gpulease up serves its own clients on a Unix socket in its data dir (0700): no other user
    may bind that path, as anyone may bind its TCP port once it is down. A client of up's URL with
    up's token (from its files, or as up's JupyterLab and kernels get them) goes there; here the
    TCP port is a squatter's, which receives nothing."""
    import socketserver

    from jupyter_ext.upstream import LeaseApi
    from lease_server import client as client_module
    from magics.calls import event_client

    home = tmp_path / "home"
    home.mkdir(mode=0o700)

    sock_path = str(home / client_module.UP_SOCKET)
    uds = socketserver.ThreadingUnixStreamServer(sock_path, answering(b'{"via": "uds"}'))
    threading.Thread(target=uds.serve_forever, daemon=True).start()
    squat = Squatter(0)
    try:
        url = f"http://127.0.0.1:{squat.port}"
        (home / "url").write_text(url + "\n")
        (home / "lab_token").write_text("glt_lab_of_up\n")
        monkeypatch.setattr(client_module, "DEFAULT_HOME", home)
        for name in ("GPULEASE_URL", "GPULEASE_TOKEN", "GPULEASE_SOCKET", "GPULEASE_SERVER_UID"):
            monkeypatch.delenv(name, raising=False)
        with Client(notebook=True, resend_503_s=0) as c:  # up's files: its URL and its user token
            assert c.guard.uds == sock_path
            assert c.request("GET", "/api/v1/health") == {"via": "uds"}
            with event_client(c.url, c.headers, c.guard) as http_:
                assert http_.get("/api/v1/health").json() == {"via": "uds"}
        # up's JupyterLab and its kernels: given the socket with the URL and the token
        monkeypatch.setenv("GPULEASE_URL", url)
        monkeypatch.setenv("GPULEASE_SOCKET", sock_path)

        async def lab() -> Any:
            api = LeaseApi(url, "glt_lab_of_up")
            try:
                return await api.request("GET", "/health")
            finally:
                await api.close()

        assert asyncio.run(lab()) == {"via": "uds"}
        assert squat.first_bytes() == "b'MARKER'"
        # another server's URL is never sent to up's socket
        assert client_module.up_socket("http://127.0.0.1:1", "glt_lab_of_up") is None
    finally:
        squat.stop()
        uds.shutdown()
        uds.server_close()


def test_a_first_request_sends_nothing_to_a_squatter_either(tmp_path, monkeypatch) -> None:
    """Every CLI command is a first request: the guard used to take whoever listened then for the
    server, so while the server was down `gpulease status` sent alice's token to another account's
    listener on its port, and `up --data-dir D`'s admin token went the same way (up's tokens were
    known only under ~/.gpulease). Now only root, this user, and GPULEASE_SERVER_UID are the
    server, from the first request on; the refusal is one line that names the listener's owner
    and what to do."""
    import sys

    monkeypatch.delenv("GPULEASE_SERVER_UID", raising=False)
    squat = Squatter(0)
    try:
        url = f"http://127.0.0.1:{squat.port}"
        with Client(url, "glt_secret_of_alice", resend_503_s=0) as c:
            with pytest.raises(errors.ServerUnavailable, match="another user's") as exc:
                c.request("GET", "/api/v1/whoami")
        assert "nobody (uid" in exc.value.message and "GPULEASE_SERVER_UID=nobody" in exc.value.message
        home = tmp_path / "elsewhere"  # up --data-dir D: its admin token, not under ~/.gpulease
        home.mkdir(mode=0o700)
        (home / "token").write_text("glt_admin_of_up\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEASE_")}
        env |= {"GPULEASE_URL": url, "GPULEASE_TOKEN": "glt_admin_of_up", "COLUMNS": "80"}
        out = subprocess.run(
            [sys.executable, "-m", "lease_server.cli", "status"], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode != 0 and "your token was not sent" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert squat.first_bytes() == "b'MARKER'"  # nothing of either client reached it
        monkeypatch.setenv("GPULEASE_SERVER_UID", "nobody")  # the deployment names its server's user
        ServerGuard(url, "glt_any").check()
    finally:
        squat.stop()
