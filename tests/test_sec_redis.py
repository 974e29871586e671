"""Finding 3 of the security review: any local user became lease admin by writing a token hash into
the Redis of `gpulease up` (no password, its port in `ps`), and JupyterLab's kernels held the admin
token. Against one real `gpulease up` (module-scoped: CI time is short): the Redis refuses a client
without the password, the secrets are files only their owner reads, the password is in no process's
argv and no log, and the lab's environment carries a user token. Then the production ACL user of
docs/deploy.md, read from that page, serves the core lease paths with Redis refusing nothing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis
from redis.exceptions import NoPermissionError

from lease_server import errors
from lease_server.client import Client
from lease_server.node.redis_proc import PASSWORD_FILE, RedisProcess
from lease_server.store.keys import Keys
from lease_server.web.auth import hash_token
from tests.api_helpers import EventWatcher
from tests.conftest import ServerHandle, Up, make_settings

DOCS = Path(__file__).parent.parent / "docs" / "deploy.md"


def _resp(*args: str | bytes) -> bytes:
    """A command in the Redis protocol, as any client (redis-cli, a script) would send it."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def _send(port: int, *commands: bytes) -> bytes:
    """What Redis answers to ``commands`` sent on one fresh connection (no AUTH unless sent)."""
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(b"".join(commands))
        got = b""
        while got.count(b"\r\n") < len(commands):
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        return got


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    home = tmp_path_factory.mktemp("sec") / "home"
    home.mkdir(mode=0o755)  # a data directory from before: readable by all, no password file
    u = Up(home, "--no-ray")
    yield u
    code, out = u.interrupt()
    assert code == 0, out


@pytest.fixture(scope="module")
def redis_port(up: Up) -> int:
    """The port of up's Redis, from its banner (printed once the server is ready)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"redis://127\.0\.0\.1:(\d+)/0", up.log.read_text())
        if found:
            return int(found.group(1))
        time.sleep(0.1)  # the banner comes from a thread of a starting process: nothing to wait on
    raise AssertionError(up.log.read_text())


def _password(up: Up) -> str:
    return (up.data / PASSWORD_FILE).read_text().strip()


def test_a_client_without_the_password_cannot_make_itself_admin(up: Up, redis_port: int) -> None:
    forged = "glt_forged-by-a-local-user"
    record = json.dumps({"user": "mallory", "role": "admin", "created": time.time()})
    tokens = Keys("gpulease").tokens
    answer = _send(redis_port, _resp("HSET", tokens, hash_token(forged), record), _resp("PING"))
    assert answer.startswith(b"-NOAUTH") and answer.count(b"-NOAUTH") == 2, answer
    wrong = _send(redis_port, _resp("AUTH", "guess"), _resp("HSET", tokens, hash_token(forged), record))
    assert wrong.startswith(b"-WRONGPASS") and b"-NOAUTH" in wrong, wrong
    assert httpx.get(f"{up.url}/api/v1/whoami", headers={"Authorization": f"Bearer {forged}"}).status_code == 401

    # The password file's is the right one, and the admin token's hash is in that Redis.
    r = Redis(port=redis_port, password=_password(up), decode_responses=True)
    try:
        admin = (up.data / "token").read_text().strip()
        assert r.hexists(tokens, hash_token(admin)) and not r.hexists(tokens, hash_token(forged))
    finally:
        r.close()


def test_the_secrets_are_files_only_their_owner_reads(up: Up) -> None:
    assert stat.S_IMODE(up.data.stat().st_mode) == 0o700  # it was 0755 before this up
    for name in (PASSWORD_FILE, "token"):
        st = (up.data / name).stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid(), name
    assert len(_password(up)) >= 32


def test_the_password_is_in_no_argv_and_no_log(up: Up, redis_port: int) -> None:
    password = _password(up).encode()
    seen = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes()
        except OSError:  # ended meanwhile
            continue
        seen += 1
        assert password not in argv, f"{cmdline}: {argv!r}"
    assert seen > 2
    # Up's own environment passes nothing secret to its children either (Redis gets it on stdin).
    assert password not in Path(f"/proc/{up.proc.pid}/environ").read_bytes()
    assert f"127.0.0.1:{redis_port}".encode() in up.log.read_bytes()  # the banner is there...
    assert password not in up.log.read_bytes()  # ...without the password
    for f in up.data.rglob("*"):
        if f.is_file() and f.name != PASSWORD_FILE:
            assert password not in f.read_bytes(), f


class _Squatter:
    """A listener on a loopback port, as a local user who read the port off Redis's command line
    would hold it: it records whatever any client sends it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.got = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.settimeout(1)
                    with contextlib.suppress(OSError):
                        while chunk := conn.recv(4096):
                            self.got += chunk


def test_a_taken_port_is_never_sent_the_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process listening on the port chosen for Redis (taken between our choosing it and
    Redis binding it) is sent nothing: a port we chose is given up for another; one we were given
    fails the start with a message that says what happened."""
    from lease_server.node import redis_proc

    password = "p" * 32
    squat = _Squatter()
    try:
        given = RedisProcess(tmp_path / "given", port=squat.port, password=password)
        with pytest.raises(errors.ConfigurationError, match="taken by another process"):
            given.start(timeout=10)
        ports = iter([squat.port])
        real = redis_proc.free_port
        monkeypatch.setattr(redis_proc, "free_port", lambda: next(ports, None) or real())
        chosen = RedisProcess(tmp_path / "chosen", password=password)
        assert chosen.port == squat.port
        try:
            chosen.start(timeout=10)
            assert chosen.port != squat.port
            assert Redis.from_url(chosen.url).ping()
        finally:
            chosen.stop()
        assert password.encode() not in squat.got and b"AUTH" not in squat.got, squat.got
    finally:
        squat.sock.close()


def test_the_lab_and_its_kernels_get_a_user_token(up: Up, redis_port: int) -> None:
    from lease_server.cli.service import _lab_command, _local_user, lab_environment

    url = f"redis://:{_password(up)}@127.0.0.1:{redis_port}/0"
    base = {"PATH": os.environ.get("PATH", ""), "GPULEASE_REDIS_URL": url, "GPULEASE_TOKEN": "glt_admin"}
    env = lab_environment(url, "gpulease", up.data, up.url, base=base)
    admin = (up.data / "token").read_text().strip()
    token = env["GPULEASE_TOKEN"]
    assert token != admin and env["GPULEASE_URL"] == up.url and "GPULEASE_REDIS_URL" not in env
    assert stat.S_IMODE((up.data / "lab_token").stat().st_mode) == 0o600
    with Client(up.url, token) as lab:
        me = lab.whoami()
        assert (me["user"], me["role"]) == (_local_user(), "user")
        # What the board and the calendar read answers a user token (jupyter_ext/handlers.py).
        assert lab.cluster()["nodes"] and lab.leases(everyone=True) == [] and lab.queue() == []
        assert lab.bookings() is not None
        lease = lab.acquire(1, ttl=60)
        assert lease.user == _local_user()
        lab.release(lease)
    # ...and nothing an admin may do: a kernel cannot mint tokens or revoke others' leases.
    forbidden = httpx.post(f"{up.url}/api/v1/tokens", json={"user": "x"}, headers={"Authorization": f"Bearer {token}"})
    assert forbidden.status_code == 403, forbidden.text
    # The lab's token is kept: the next up (the next lab) gets the same one, the admin's is unchanged.
    assert lab_environment(url, "gpulease", up.data, up.url, base=base)["GPULEASE_TOKEN"] == token
    assert (up.data / "token").read_text().strip() == admin
    # JupyterLab's login token travels in the environment, not in argv.
    assert env["JUPYTER_TOKEN"] and not any(env["JUPYTER_TOKEN"] in a for a in _lab_command("jupyter", 8888))


def test_a_kernel_started_apart_takes_the_user_token_not_the_admins(up: Up, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel or Jupyter server that ``up`` did not start (no GPULEASE_TOKEN) finds up's files:
    its client takes the user token (its workers hold it, where other users may read it), the CLI
    the admin's. ``up`` writes the user token whether or not it starts a lab."""
    from lease_server import client

    monkeypatch.delenv("GPULEASE_TOKEN", raising=False)
    monkeypatch.delenv("GPULEASE_URL", raising=False)
    monkeypatch.setattr(client, "DEFAULT_HOME", up.data)
    admin = (up.data / "token").read_text().strip()
    user = (up.data / "lab_token").read_text().strip()
    assert user != admin
    assert client.discover(notebook=True) == (up.url, user)
    assert client.discover() == (up.url, admin)
    with Client(notebook=True) as kernel:
        assert kernel.whoami()["role"] == "user"


def test_ups_token_is_never_sent_to_another_users_listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While ``up`` is down, anyone may bind its loopback port: the CLI then finds up's URL and
    admin token in its files, sees the port's listener is another user's (the kernel says whose),
    and sends nothing. A token given explicitly is the caller's choice, and goes."""
    import pwd
    import subprocess

    from lease_server import client

    if os.geteuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root, to listen as another user, and /usr/bin/python3")
    nobody = pwd.getpwnam("nobody")
    code = (
        "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); time.sleep(60)"
    )
    squat = subprocess.Popen(
        ["/usr/bin/python3", "-c", code], user=nobody.pw_uid, group=nobody.pw_gid, stdout=subprocess.PIPE, cwd="/"
    )
    try:
        port = int(squat.stdout.readline())  # type: ignore[union-attr]
        home = tmp_path / "home"
        home.mkdir()
        (home / "url").write_text(f"http://127.0.0.1:{port}\n")
        (home / "token").write_text("glt_admin_of_up\n")
        monkeypatch.setattr(client, "DEFAULT_HOME", home)
        monkeypatch.delenv("GPULEASE_TOKEN", raising=False)
        monkeypatch.delenv("GPULEASE_URL", raising=False)
        with pytest.raises(errors.ServerUnavailable, match="another user's") as exc:
            client.discover()
        assert "gpulease up" in str(exc.value) and "glt_admin" not in str(exc.value)
        assert client.discover(token="glt_mine") == (f"http://127.0.0.1:{port}", "glt_mine")
    finally:
        squat.kill()
        squat.wait()


# ---- production: the ACL user of docs/deploy.md ---------------------------------------------------


def _acl_lines() -> list[str]:
    """The ``user`` lines of the block that follows ``<!-- test_sec_redis: acl -->`` in the docs."""
    text = DOCS.read_text()
    block = text.split("<!-- test_sec_redis: acl -->", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.startswith("user ")]


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A Redis with the documented users (throw-away passwords: a test's may be in argv). Its
    ``default`` user stays on, for the fixture's readiness probe; the server logs in as gpulease."""
    extra: list[str] = []
    for line in _acl_lines():
        words = line.replace("GPULEASE_REDIS_PASSWORD", "gl-pass").replace("ADMIN_PASSWORD", "ad-pass").split()
        if words[1] != "default":
            extra += ["--user", *words[1:]]
    proc = RedisProcess(tmp_path_factory.mktemp("acl"), extra=extra).start()
    yield proc
    proc.stop()


def test_the_documented_acl_user_serves_the_lease_paths(acl_redis: RedisProcess) -> None:
    lines = _acl_lines()
    assert [line.split()[1] for line in lines] == ["default", "admin", "gpulease"]
    assert "-@all" in lines[2] and "~{gpulease}:*" in lines[2] and "+@" not in lines[2]  # commands, not categories
    admin = Redis(port=acl_redis.port, username="admin", password="ad-pass", decode_responses=True)
    admin.execute_command("ACL", "LOG", "RESET")
    url = f"redis://gpulease:gl-pass@127.0.0.1:{acl_redis.port}/0"
    srv = ServerHandle(make_settings(url, "gpulease"), "box=2xA100-80GB").start()
    try:
        watcher = EventWatcher(srv.url, srv.token("watcher")).start()
        alice, bob = srv.client("alice"), srv.client("bob")
        held = alice.acquire(2, ttl=30)
        held = alice.renew(held)
        rid = bob.new_request_id()  # its lease's id: a loaded machine may answer the POST only after the 1 s ttl

        def wait_for_it() -> None:
            with contextlib.suppress(errors.LeaseEnded):  # "granted and then expired": the same path
                bob.acquire(1, wait=20, ttl=1, request_id=rid)

        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        watcher.wait_for(lambda e: e["type"] == "queued" and e.get("user") == "bob", 10, "bob's queued")
        alice.release(held, verified=True)
        waiter.join(20)
        # granted from the queue on alice's release (the grants channel), then expired
        watcher.wait_for(lambda e: e["type"] == "grant" and e.get("lease") == rid, 10, "bob's grant")
        watcher.wait_for(lambda e: e["type"] == "expired" and e.get("lease") == rid, 10, "expired")
        start = time.time() + 86400
        booking = alice.book("A100-80GB", 1, start, start + 3600, note="acl")
        assert any(b["id"] == booking["id"] for b in alice.bookings())
        alice.cancel_booking(booking["id"])
        assert alice.cluster()["nodes"] and alice.queue() == [] and alice.leases(everyone=True) == []
        assert alice.usage()["calls"] >= 0 and alice.events()
        watcher.wait_for(lambda e: e["type"] == "released" and e.get("lease") == held.id, 20, "released")
    finally:
        srv.stop()
    refused = admin.execute_command("ACL", "LOG")
    assert refused == [], f"Redis refused the gpulease user: {refused}"
    # ...and the user is confined to gpulease's keys and commands.
    user = Redis(port=acl_redis.port, username="gpulease", password="gl-pass", decode_responses=True)
    for forbidden in (lambda: user.get("other"), lambda: user.config_get("dir"), lambda: user.flushall()):
        with pytest.raises(NoPermissionError):
            forbidden()
    user.close()
    admin.close()
