"""A lease user is a unix account (multi_user, issue 52): a token read off someone else's worker
acts for nobody from another account.

Real unix accounts (created here, removed after), real processes running as them, a real lease
server with its in-process node agent on simulated GPUs:

* a node agent records a claim only from a process of the lease owner's account (a colleague who
  read alice's token and fencing token claimed her lease for a process of his: the agent then
  tied his process to her GPUs); the refusal is an event too;
* on the server's unix socket, a user token is taken only from its owner's processes;
* ``POST /tokens`` makes a user token only for a name with an account;
* the [accounts] table maps a lease user to an account of another name.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lease_server import errors
from lease_server.config import Settings
from lease_server.errors import ConfigurationError
from lease_server.store.keys import Keys
from tests.api_helpers import EventWatcher
from tests.conftest import ServerHandle

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"  # (the test's own Python lives under /root, which others cannot enter)

# Claims what argv[1] holds (claims.claim's arguments) as whoever runs it; prints the agent's
# answer or the refusal, as one JSON object.
CLAIM = r"""
import json, sys
from lease_server.node.claims import ClaimRefused, claim
try:
    print(json.dumps(claim(**json.loads(sys.argv[1]))))
except ClaimRefused as exc:
    print(json.dumps({"refused": str(exc)}))
"""

# GET argv[2] on the unix socket argv[1] with the bearer token argv[3]; prints status and body.
GET_ON_SOCKET = r"""
import http.client, json, socket, sys
class Conn(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sys.argv[1])
c = Conn("localhost")
c.request("GET", sys.argv[2], headers={"Authorization": "Bearer " + sys.argv[3]})
r = c.getresponse()
print(json.dumps({"status": r.status, "body": json.loads(r.read() or b"{}")}))
"""


@pytest.fixture(scope="module")
def accounts() -> Iterator[dict[str, int]]:
    """Two unix accounts of this test's own (name -> uid), removed afterwards."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not Path(SYSTEM_PYTHON).exists():
        pytest.skip("needs root, useradd and /usr/bin/python3 to run processes as other accounts")
    tag = secrets.token_hex(3)
    names = [f"gla{tag}", f"glb{tag}"]
    made: dict[str, int] = {}
    try:
        for name in names:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
            import pwd

            made[name] = pwd.getpwnam(name).pw_uid
        yield made
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False)


def as_account(uid: int, code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", code, *args],
        user=uid,
        group=uid,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def claim_args(srv: ServerHandle, client: Any, lease: Any) -> str:
    instance = client.request("GET", "/api/v1/info")["instance"]
    gpus = [int(g["index"]) for g in lease.gpus]
    return json.dumps(
        {
            "instance": instance,
            "node": lease.node,
            "lease": lease.id,
            "fence": lease.token,
            "token": client.token,
            "gpus": gpus,
        }
    )


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A folder of root's, mode 0755, for the server's shared socket (pytest's tmp dirs are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="gl-sock-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def procs_of(redis_sync: Any, srv: ServerHandle, lease_id: str) -> list[dict[str, Any]]:
    """The processes tied to a lease (its record in Redis: no view shows them)."""
    return list(json.loads(redis_sync.hget(Keys(srv.settings.prefix).leases, lease_id)).get("procs") or [])


def test_a_claim_is_taken_only_from_a_process_of_the_lease_owners_account(server_factory, accounts, redis_sync):
    alice, bob = accounts
    srv = server_factory(simulate="n1=1xA100-80GB", multi_user=True)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    mine = srv.client(alice)
    lease = mine.acquire(1)
    # bob read alice's API token and her lease's fencing token (off her worker): his process
    # claims her lease with them, and is refused
    said = as_account(accounts[bob], CLAIM, claim_args(srv, mine, lease))
    assert f"runs as account {bob}, not as {alice}" in said.get("refused", ""), said
    ev = watcher.wait_for(lambda e: e["type"] == "claim_refused", 10, "claim_refused")
    assert ev["lease"] == lease.id and ev["user"] == alice and ev["account"] == bob, ev
    assert procs_of(redis_sync, srv, lease.id) == [], "nothing of bob's was tied to her lease"
    # alice's own process claims it
    assert as_account(accounts[alice], CLAIM, claim_args(srv, mine, lease)) == {"ok": True}
    (proc,) = procs_of(redis_sync, srv, lease.id)
    assert proc["uid"] == accounts[alice]
    mine.release(lease)


def test_an_accounts_table_maps_a_lease_user_to_an_account_of_another_name(server_factory, accounts):
    alice, bob = accounts
    srv = server_factory(simulate="n1=1xA100-80GB", multi_user=True, accounts={"ann": alice})
    ann = srv.client("ann")
    lease = ann.acquire(1)
    assert "not as " + alice in as_account(accounts[bob], CLAIM, claim_args(srv, ann, lease))["refused"]
    assert as_account(accounts[alice], CLAIM, claim_args(srv, ann, lease)) == {"ok": True}
    ann.release(lease)


def test_without_multi_user_a_claim_from_any_account_is_taken_as_before(server_factory, accounts):
    """gpulease up is one person's: every cell runs as its user, whoever the lease's user is."""
    alice, bob = accounts
    srv = server_factory(simulate="n1=1xA100-80GB")
    mine = srv.client(alice)
    lease = mine.acquire(1)
    assert as_account(accounts[bob], CLAIM, claim_args(srv, mine, lease)) == {"ok": True}
    mine.release(lease)


def test_on_the_servers_socket_a_user_token_is_taken_only_from_its_owners_processes(server_factory, accounts, sock_dir):
    alice, bob = accounts
    path = str(sock_dir / "api.sock")
    srv = server_factory(simulate="n1=1xA100-80GB", multi_user=True, unix_socket=path)
    assert os.stat(path).st_mode & 0o777 == 0o666
    token = srv.token(alice)
    got = as_account(accounts[alice], GET_ON_SOCKET, path, "/api/v1/whoami", token)
    assert got["status"] == 200 and got["body"]["user"] == alice, got
    stolen = as_account(accounts[bob], GET_ON_SOCKET, path, "/api/v1/whoami", token)
    assert stolen["status"] == 403, stolen
    message = stolen["body"]["message"]
    assert f"{alice}'s, sent by a process of account {bob}" in message and "use your own token" in message
    # bob's own token works for him there; root's tools pass
    assert as_account(accounts[bob], GET_ON_SOCKET, path, "/api/v1/whoami", srv.token(bob))["status"] == 200
    # over TCP the server cannot tell who connected: the token alone decides, as before
    assert httpx.get(f"{srv.url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_the_shared_socket_is_refused_in_a_folder_others_may_write(server_factory, sock_dir):
    sock_dir.chmod(0o777)
    with pytest.raises(RuntimeError, match="may be written by another user"):
        server_factory(simulate="n1=1xA100-80GB", multi_user=True, unix_socket=str(sock_dir / "api.sock"))


def test_a_user_token_is_made_only_for_a_name_with_an_account(server_factory, accounts):
    alice, _bob = accounts
    srv = server_factory(simulate="n1=1xA100-80GB", multi_user=True, accounts={"ann": alice, "zed": "nosuchacct"})
    admin = srv.client("root", "admin")
    before = len(admin.request("GET", "/api/v1/tokens")["tokens"])
    for name, says in [
        ("nosuchuser", "nosuchuser has no unix account nosuchuser on this host"),
        ("zed", "zed has no unix account nosuchacct (the account [accounts] maps zed to)"),
    ]:
        with pytest.raises(errors.BadRequest, match="useradd") as exc:
            admin.request("POST", "/api/v1/tokens", json={"user": name})
        assert says in exc.value.message, exc.value.message
    assert len(admin.request("GET", "/api/v1/tokens")["tokens"]) == before  # nothing made
    assert admin.request("POST", "/api/v1/tokens", json={"user": alice})["token"]
    assert admin.request("POST", "/api/v1/tokens", json={"user": "ann"})["token"]
    # agents and proxies are not people: no account needed
    assert admin.request("POST", "/api/v1/tokens", json={"user": "gpu-07", "role": "agent", "node": "n1"})["token"]


def test_the_accounts_table_takes_account_names_only(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[server]\nmulti_user = true\n[accounts]\nalice = "asmith"\n')
    s = Settings.load(good)
    assert s.multi_user and s.account_of("alice") == "asmith" and s.account_of("bob") == "bob"
    bad = tmp_path / "bad.toml"
    bad.write_text('[accounts]\nalice = "a smith; rm"\n')
    with pytest.raises(ConfigurationError, match=r"\[accounts\] .* must map lease users to unix account names"):
        Settings.load(bad)


# ---- a squatted claim socket (issue 52, item 3) ------------------------------------------------------

# Binds the abstract claim address argv[1] (as whoever runs it), says so, and holds it until stdin closes.
SQUAT_CLAIMS = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1].replace("@", "\0", 1))
s.listen()
print("bound", flush=True)
sys.stdin.read()
"""


def squat(address: str, uid: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", SQUAT_CLAIMS, "@" + address.lstrip("\0")],
        user=uid, group=uid, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "bound"
    return proc


def test_a_node_whose_claim_socket_another_account_holds_takes_no_lease_until_it_is_free(server_factory, accounts):
    """Its address is abstract: any account may bind it while the agent restarts. Workers there
    then ran unclaimed for the agent's life (never drained, never held to a slice). Now the agent
    sends no heartbeat for that node until it has bound the socket (so the node goes down and
    takes no lease), retrying every second, and the node comes back once it is free."""
    from lease_server.node.claims import address

    _alice, bob = accounts
    first = server_factory(simulate="n1=1xA100-80GB")
    instance = first.client("root", "admin").request("GET", "/api/v1/info")["instance"]
    first.stop()  # the agent restarts: meanwhile bob binds its claim socket
    squatter = squat(address(instance, "n1"), accounts[bob])
    try:
        again = ServerHandle(first.settings, "n1=1xA100-80GB").start()
        try:
            watcher = EventWatcher(again.url, again.token("root", "admin")).start()
            watcher.wait_for(lambda e: e["type"] == "node_down" and e.get("node") == "n1", 30, "node_down")
            with pytest.raises(errors.GpuLeaseError):
                again.client("alice").acquire(1)  # nothing of the node is lent while it is taken
            squatter.stdin.close()  # type: ignore[union-attr]
            squatter.wait(10)
            watcher.wait_for(lambda e: e["type"] == "node_up" and e.get("node") == "n1", 30, "node_up")
            again.client("alice").release(again.client("alice").acquire(1, wait=10))
        finally:
            again.stop()
    finally:
        squatter.kill()
        squatter.wait()


def test_a_worker_refuses_to_run_where_another_account_holds_the_claim_socket(accounts, monkeypatch):
    """The worker's side: a claim socket held by another account gets nothing of the worker's
    (its token is not sent), and the cell does not run untied, in one line that says what to check."""
    from magics import worker

    _alice, bob = accounts
    instance = f"t{secrets.token_hex(4)}"
    squatter = squat(f"\0gpulease-claims/{instance}/n1", accounts[bob])
    try:
        watch = {"instance": instance, "id": "l-abc", "fence": 3, "token": "glt_secret"}
        env = {"GPULEASE_NODE": "n1", "GPULEASE_GPU_INDEXES": "0"}
        with pytest.raises(worker.Unclaimed, match=r"^not run: the node agent of n1 did not tie this worker") as exc:
            worker._claim(watch, env)
        assert f"uid {accounts[bob]}" in str(exc.value) and "glt_secret" not in str(exc.value)
        assert "check that the agent of n1 runs (as root)" in str(exc.value)
    finally:
        squatter.kill()
        squatter.wait()


def test_a_slice_whose_agent_does_not_answer_does_not_run():
    from magics import slices, worker

    watch = {"instance": f"t{secrets.token_hex(4)}", "id": "l-abc", "fence": 3, "token": "glt_x"}
    env = {"GPULEASE_NODE": "n1", "GPULEASE_GPU_INDEXES": "0", slices.MEM_ENV: "1024"}
    with pytest.raises(worker.Unclaimed, match="a slice is held to its memory by the node agent of n1"):
        worker._claim(watch, env)
    del env[slices.MEM_ENV]
    assert worker._claim(watch, env) is None  # a whole GPU: runs, its watchdog the backstop (as before)


def test_clients_given_the_shared_socket_use_it(server_factory, sock_dir, monkeypatch):
    """GPULEASE_SOCKET with GPULEASE_URL (what a Hub gives its single-user servers and kernels)
    sends a client's requests to the deployment's socket, so the server names their account; a
    socket in a folder that others may write is never used."""
    from lease_server.client import Client

    path = str(sock_dir / "api.sock")
    srv = server_factory(simulate="n1=1xA100-80GB", multi_user=True, unix_socket=path)
    monkeypatch.setenv("GPULEASE_URL", srv.url)
    monkeypatch.setenv("GPULEASE_SOCKET", path)
    with Client(srv.url, srv.token("root", "admin")) as c:
        assert c.guard.uds == path and c.whoami()["user"] == "root"
    sock_dir.chmod(0o777)  # anyone could have put a socket there: TCP, and the listener check
    with Client(srv.url, srv.token("root", "admin")) as c:
        assert c.guard.uds is None and c.whoami()["user"] == "root"
