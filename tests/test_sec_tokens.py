"""Tokens with a life cycle (issue 33, findings 6, 8 and the agent half of 9), each attack tried
against a real lease server on a real Redis and refused:

* a revoked token is refused on the next request, on another server replica too; an expired one is
  refused; tokens stored before ids existed work, are listed and can be revoked;
* a proxy token acts for no name that holds an admin, agent or proxy token (it used to release the
  admin's lease), and only for the names its allow-list or pattern permits;
* names a proxy token invents do not multiply the per-user cap on event streams;
* an agent token serves one node: node A's token is refused on node B's heartbeat, samples,
  draining and drained routes;
* ``gpulease token create / list / revoke``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from lease_server import errors
from lease_server.cli import main
from lease_server.client import Client
from lease_server.store.keys import Keys
from lease_server.web.auth import hash_token, token_id
from tests.api_helpers import API, assert_error, event_stream, next_event, sse_blocks
from tests.conftest import ServerHandle

USER = "X-Gpulease-User"


def _new(admin: Client, user: str, role: str = "user", **kw: Any) -> tuple[str, str]:
    """A token made through the API: (secret, id)."""
    made = admin.create_token(user, role, **kw)
    assert made["user"] == user and made["role"] == role and made["token"].startswith("glt_")
    assert made["id"] == token_id(hash_token(made["token"]))
    return made["token"], made["id"]


def _raw(server: ServerHandle, token: str, act_as: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"}
    if act_as is not None:
        headers[USER] = act_as
    # A connection per request: the server may close one after refusing a request in its prepare step.
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(base_url=server.url, headers=headers, timeout=10, limits=limits)


def test_a_revoked_token_is_refused_at_once_on_every_replica(server: ServerHandle) -> None:
    admin = server.client("root", "admin")
    secret, tid = _new(admin, "carol")
    # A second server process on the same Redis and prefix (a replica behind the same proxy).
    replica = ServerHandle(server.settings, "").start()
    try:
        with _raw(server, secret) as here, _raw(replica, secret) as there:
            assert here.get(f"{API}/whoami").json()["user"] == "carol"
            assert there.get(f"{API}/whoami").json()["user"] == "carol"  # now in the replica's cache
            (listed,) = [t for t in admin.tokens() if t["id"] == tid]
            assert listed["user"] == "carol" and listed["role"] == "user" and "expires" not in listed
            assert time.time() - listed["last_used"] < 60 and time.time() - listed["created"] < 60
            gone = admin.revoke_token(tid)
            assert gone["id"] == tid and gone["user"] == "carol" and gone["revoked"] is True
            for where in (here, there):
                assert_error(where.get(f"{API}/whoami"), 401, "unauthorized", "revoked")
                assert_error(where.post(f"{API}/leases", json={"gpus": 1}), 401, "unauthorized")
    finally:
        replica.stop()
    assert tid not in {t["id"] for t in admin.tokens()}
    with pytest.raises(errors.NotFound, match=f"no token with id {tid}"):
        admin.revoke_token(tid)
    with pytest.raises(errors.Forbidden, match="only an admin"):
        server.client("dave").revoke_token(admin.tokens()[0]["id"])
    with pytest.raises(errors.Forbidden, match="only an admin"):
        server.client("dave").tokens()


def test_an_expired_token_is_refused(server: ServerHandle) -> None:
    admin = server.client("root", "admin")
    # 2 s: 0.5 s ran out before the first request on a loaded machine (a fresh-clone run)
    secret, tid = _new(admin, "erin", expires_in=2)
    (listed,) = [t for t in admin.tokens() if t["id"] == tid]
    assert 0 < listed["expires"] - listed["created"] <= 2.1
    with _raw(server, secret) as erin:
        assert erin.get(f"{API}/whoami").status_code == 200  # cached from here on
        time.sleep(max(0.0, listed["expires"] - time.time()) + 0.1)  # a clock, not an event: its expiry
        assert_error(erin.get(f"{API}/whoami"), 401, "unauthorized", f"token {tid} of erin expired at")
    with pytest.raises(errors.BadRequest, match="expires_in"):
        admin.create_token("erin", expires_in=-5)


@contextlib.contextmanager
def _events(server: ServerHandle, token: str) -> Iterator[Iterator[dict[str, Any]]]:
    """An open GET /events stream of ``token`` as SSE blocks (its opening comment read). A read
    waits at most 10 s: a safety net, so a stream that never ends fails the test."""
    with _raw(server, token) as c, c.stream("GET", f"{API}/events") as resp:
        assert resp.status_code == 200, resp.read()
        blocks = sse_blocks(resp.iter_lines())
        assert "gpulease event stream" in next(blocks)["comments"]
        yield blocks


def _closing(blocks: list[dict[str, Any]]) -> str:
    """The comment a stream that the server ended says why with."""
    said = [c for b in blocks for c in b["comments"] if c.startswith("closed:")]
    assert len(said) == 1, blocks
    return said[0]


def test_a_revoked_token_s_event_stream_ends_and_sends_nothing_after(server: ServerHandle) -> None:
    """Issue 49 (5): GET /events checked its token once, so a revoked token's stream went on
    delivering every user's events. Now the revoke ends it, before any event produced after it; the
    streams of other tokens go on."""
    admin, bob = server.client("root", "admin"), server.client("bob")
    secret, tid = _new(admin, "carol")
    with _events(server, secret) as carol, event_stream(server, "dave") as dave:
        before = bob.acquire(1, ttl=60)
        next_event((b for b in carol if "event" in b), "grant", before.id)  # it delivers others' events
        admin.revoke_token(tid)
        after = bob.acquire(1, ttl=60)
        next_event(dave, "grant", after.id)  # produced, and sent to a valid token's stream
        rest = list(carol)  # to its end (a stream that goes on fails at the 10 s read timeout)
    assert not [b for b in rest if after.id in b.get("data", "")], rest
    assert f"API token {tid} of carol was revoked" in _closing(rest)
    with _raw(server, secret) as c:  # and it cannot come back
        assert_error(c.get(f"{API}/events"), 401, "unauthorized", "revoked")
    bob.release(before)
    bob.release(after)


def test_a_token_revoked_on_another_replica_ends_its_event_stream_here(server: ServerHandle) -> None:
    """The revoke is heard by every server process on the same Redis (the tokens' change published
    on the grants channel), which ends its streams of that token."""
    admin = server.client("root", "admin")
    secret, tid = _new(admin, "carol")
    replica = ServerHandle(server.settings, "").start()
    try:
        with _events(replica, secret) as carol:
            admin.revoke_token(tid)  # on the first server
            rest = list(carol)
        assert f"API token {tid} of carol was revoked" in _closing(rest)
    finally:
        replica.stop()


def test_an_expired_token_s_event_stream_ends_at_its_expiry(server: ServerHandle) -> None:
    """A stream waits for its next event at most until its token expires, and ends then."""
    admin = server.client("root", "admin")
    secret, tid = _new(admin, "erin", expires_in=3)
    with _events(server, secret) as erin:
        rest = list(erin)  # ends at the expiry (3 s), well before a keep-alive (15 s) or the net (10 s)
    assert f"API token {tid} of erin expired at" in _closing(rest)


def test_a_token_stored_before_ids_keeps_working_and_can_be_revoked(server: ServerHandle, redis_sync: Any) -> None:
    old = "glt_made-by-an-older-release"
    digest = hash_token(old)
    redis_sync.hset(Keys(server.settings.prefix).tokens, digest, json.dumps({"user": "olga", "role": "user"}))
    admin = server.client("root", "admin")
    with _raw(server, old) as olga:
        assert olga.get(f"{API}/whoami").json() == {"user": "olga", "role": "user", "teams": []}
        (listed,) = [t for t in admin.tokens() if t["user"] == "olga"]
        assert listed["id"] == token_id(digest) and "expires" not in listed
        admin.revoke_token(listed["id"])
        assert_error(olga.get(f"{API}/whoami"), 401, "unauthorized")


def test_a_proxy_token_never_acts_for_an_admin_agent_or_proxy(server: ServerHandle) -> None:
    """It used to: a proxy token acting for the admin's name released the admin's lease."""
    admin = server.client("root", "admin")
    lease = admin.acquire(1, ttl=60)
    server.token("rack1", "agent")
    hub, _ = _new(admin, "hub", "proxy", acts_for="*")
    other, _ = _new(admin, "hub2", "proxy", acts_for="*")
    with _raw(server, hub, "root") as as_root:
        resp = as_root.delete(f"{API}/leases/{lease.id}", params={"token": lease.token})
        assert_error(resp, 403, "forbidden", "never acts for 'root'", "admin token")
        assert_error(as_root.get(f"{API}/whoami"), 403, "forbidden", "admin token")
    assert admin.get(lease.id)["state"] == "active"
    for name, role in (("rack1", "agent"), ("hub2", "proxy"), ("hub", "proxy")):
        with _raw(server, other if name == "hub" else hub, name) as c:
            assert_error(c.get(f"{API}/whoami"), 403, "forbidden", f"holds an {role} token")
    # ... while it still acts for plain users, as under JupyterHub.
    with _raw(server, hub, "ann") as ann:
        assert ann.get(f"{API}/whoami").json() == {"user": "ann", "role": "user", "teams": []}
    # A name that becomes an admin's is refused from the next request on.
    with _raw(server, hub, "zoe") as zoe:
        assert zoe.get(f"{API}/whoami").status_code == 200
        _new(admin, "zoe", "admin")
        assert_error(zoe.get(f"{API}/whoami"), 403, "forbidden", "holds an admin token")
    admin.release(lease)


def test_a_proxy_token_acts_only_for_the_users_it_is_allowed(server: ServerHandle) -> None:
    admin = server.client("root", "admin")
    listed, _ = _new(admin, "lab-hub", "proxy", acts_for="alice,lab-*")
    pattern, _ = _new(admin, "class-hub", "proxy", acts_for="re:s[0-9]{3}")
    for token, user in ((listed, "alice"), (listed, "lab-7"), (pattern, "s042")):
        with _raw(server, token, user) as c:
            assert c.get(f"{API}/whoami").json()["user"] == user
    for token, user in ((listed, "mallory"), (listed, "alice2"), (pattern, "s0421"), (pattern, "bob")):
        with _raw(server, token, user) as c:
            assert_error(c.post(f"{API}/leases", json={"gpus": 1}), 403, "forbidden", f"not for '{user}'")
    assert [t["acts_for"] for t in admin.tokens() if t["role"] == "proxy"] == ["alice,lab-*", "re:s[0-9]{3}"]
    with pytest.raises(errors.BadRequest, match="not a regular expression"):
        admin.create_token("bad", "proxy", acts_for="re:([")
    with pytest.raises(errors.BadRequest, match="acts_for is for proxy tokens only"):
        admin.create_token("bad", "user", acts_for="*")


@contextlib.contextmanager
def _stream(server: ServerHandle, token: str, user: str | None) -> Iterator[httpx.Response]:
    with _raw(server, token, user) as c, c.stream("GET", f"{API}/events") as resp:
        lines = resp.iter_lines()  # kept while the stream is held: dropping it would end the stream
        if resp.status_code == 200:
            next(lines)  # the stream's opening comment: it counts from here
        else:
            resp.read()
        yield resp
        del lines


def test_invented_names_do_not_multiply_the_stream_cap(server_factory: Any) -> None:
    """A proxy token naming a new user per stream used to open 300 more after the per-user 429."""
    srv = server_factory(simulate="n1=1xA100-80GB", max_streams_per_user=1, max_streams_per_token=3)
    admin = srv.client("root", "admin")
    hub, hub_id = _new(admin, "hub", "proxy", acts_for="*")
    with contextlib.ExitStack() as held:
        for i in range(3):
            assert held.enter_context(_stream(srv, hub, f"u{i}")).status_code == 200
        with _stream(srv, hub, "u0") as again:  # the per-user cap, as before
            assert again.status_code == 429 and "u0 has 1 event streams" in again.json()["message"]
        with _stream(srv, hub, "invented") as fresh:  # a fresh name: the token's cap holds
            assert fresh.status_code == 429 and fresh.json()["code"] == "too_many"
            assert f"token {hub_id} has 3 event streams" in fresh.json()["message"]
        # Another token's users are not held back by this one.
        with _stream(srv, srv.token("vic"), None) as own:
            assert own.status_code == 200
    with _stream(srv, hub, "invented") as later:  # the streams ended: the count went down
        assert later.status_code == 200


AGENT_ROUTES = (
    ("POST", "heartbeat", None),
    ("POST", "samples", {"gpus": [{"index": 0, "util": 0}]}),
    ("GET", "draining", None),
    ("POST", "drained", {"lease": "x", "gpus": [0]}),
)


def test_an_agent_token_serves_only_its_node(server: ServerHandle) -> None:
    """Node A's token used to send idle samples (others' leases reclaimed) or 'drained' (GPUs freed
    under running processes) for any node."""
    admin = server.client("root", "admin")
    scoped, scoped_id = _new(admin, "rack-n1", "agent", node="n1")
    with _raw(server, scoped) as agent:
        assert agent.post(f"{API}/nodes/n1/heartbeat").json() == {"node": "n1", "status": "alive"}
        assert agent.get(f"{API}/nodes/n1/draining").status_code == 200
        for method, route, body in AGENT_ROUTES:
            resp = agent.request(method, f"{API}/nodes/n2/{route}", json=body)
            assert_error(resp, 403, "forbidden", "serves node 'n1', not 'n2'")
        assert_error(agent.put(f"{API}/nodes/n2", json={"pool": "x", "gpus": []}), 403, "forbidden", "'n1'")
    # A token made without a node (as before nodes were scoped) is bound to the first it serves.
    unbound, unbound_id = _new(admin, "rack-any", "agent")
    with _raw(server, unbound) as agent:
        assert agent.post(f"{API}/nodes/n2/heartbeat").status_code == 200
        for method, route, body in AGENT_ROUTES:
            resp = agent.request(method, f"{API}/nodes/n1/{route}", json=body)
            assert_error(resp, 403, "forbidden", "serves node 'n2', not 'n1'")
    nodes = {t["id"]: t.get("node") for t in admin.tokens()}
    assert nodes[scoped_id] == "n1" and nodes[unbound_id] == "n2"
    # An admin token still serves every node.
    with _raw(server, server.token("root")) as root:
        assert root.post(f"{API}/nodes/n2/heartbeat").status_code == 200


def test_token_create_list_and_revoke_through_the_cli(server: ServerHandle) -> None:
    cli = CliRunner()
    env = {"GPULEASE_URL": server.url, "GPULEASE_TOKEN": server.token("root", "admin")}

    def run(*args: str) -> Any:
        return cli.invoke(main, ["token", *args], env=env)

    made = run("create", "fay", "--expires", "30d")
    assert made.exit_code == 0, made.output
    fay = made.output.strip()
    refused = run("create", "hub", "--proxy")
    assert refused.exit_code == 2 and "needs --acts-for" in refused.output
    assert run("create", "a-very-long-user-name-x", "--proxy", "--acts-for", "lab-*,alice,bob").exit_code == 0
    assert run("create", "rack-n1", "--agent", "--node", "n1").exit_code == 0

    listed = run("list")
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["ID", "USER", "ROLE", "CREATED", "EXPIRES", "LAST", "USED", "SCOPE"]
    assert all(len(line) <= 80 for line in lines), lines
    fay_id = token_id(hash_token(fay))
    (row,) = [line for line in lines if line.startswith(fay_id)]
    expires = time.strftime("%Y-%m-%d", time.localtime(time.time() + 30 * 86400))
    assert row.split()[1:3] == ["fay", "user"] and expires in row and "never" in row
    assert any("node n1" in line for line in lines) and any("for lab-*,alice" in line for line in lines)

    as_json = json.loads(run("list", "--json").output)
    (entry,) = [t for t in as_json if t["id"] == fay_id]
    assert entry["user"] == "fay" and abs(entry["expires"] - entry["created"] - 30 * 86400) < 5
    assert "token" not in entry and all("token" not in t for t in as_json)  # never a secret

    with _raw(server, fay) as c:
        assert c.get(f"{API}/whoami").status_code == 200
        revoked = run("revoke", fay_id)
        assert revoked.exit_code == 0 and revoked.output.strip() == f"revoked token {fay_id} of fay (user)"
        assert_error(c.get(f"{API}/whoami"), 401, "unauthorized")
    assert fay_id not in run("list").output
    gone = run("revoke", fay_id)
    assert gone.exit_code != 0 and f"no token with id {fay_id}" in gone.output
