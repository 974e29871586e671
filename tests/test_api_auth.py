"""Authentication and authorisation of the HTTP API, against a real server and a real Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from lease_server.store.keys import Keys
from tests.api_helpers import API, Cases, assert_error, http, unchanged

REPO = Path(__file__).resolve().parent.parent


def _acquire(client: httpx.Client, gpus: int = 1, **kw: Any) -> dict[str, Any]:
    resp = client.post(f"{API}/leases", json={"gpus": gpus, "ttl": 600, **kw})
    assert resp.status_code == 201, resp.text
    return resp.json()  # type: ignore[no-any-return]


PROTECTED = [
    ("GET", f"{API}/leases"),
    ("POST", f"{API}/leases"),
    ("GET", f"{API}/leases/l-0123456789abcdef"),
    ("DELETE", f"{API}/leases/l-0123456789abcdef"),
    ("POST", f"{API}/leases/l-0123456789abcdef/renew"),
    ("POST", f"{API}/leases/l-0123456789abcdef/revoke"),
    ("GET", f"{API}/cluster"),
    ("GET", f"{API}/queue"),
    ("GET", f"{API}/events"),
    ("GET", f"{API}/events/log"),
    ("PUT", f"{API}/nodes/n9"),
    ("POST", f"{API}/nodes/n1/heartbeat"),
    ("POST", f"{API}/tokens"),
    ("GET", f"{API}/whoami"),
    ("GET", f"{API}/info"),
]


def test_no_token_is_401_with_how_to_get_one(server: Any, redis_sync: Any) -> None:
    cases = Cases()
    with http(server) as anon:
        for method, path in PROTECTED:
            with cases.case(f"{method} {path}"), unchanged(redis_sync, server.settings.prefix):
                resp = anon.request(method, path, json={"gpus": 1} if method in ("POST", "PUT") else None)
                assert_error(resp, 401, "unauthorized", "Authorization: Bearer", "token create")
    cases.check()


WRONG_SCHEMES = ["Basic YWxpY2U6c2VjcmV0", "Token glt_whatever", "Bearer", "glt_no_scheme_at_all"]


def test_wrong_scheme_is_401(server: Any, redis_sync: Any) -> None:
    cases = Cases()
    with http(server) as anon:
        for header in WRONG_SCHEMES:
            with cases.case(header), unchanged(redis_sync, server.settings.prefix):
                resp = anon.post(f"{API}/leases", json={"gpus": 1}, headers={"Authorization": header})
                assert_error(resp, 401, "unauthorized", "Bearer <token>")
    cases.check()


def test_unknown_token_is_401(server: Any, redis_sync: Any) -> None:
    with http(server, token="glt_" + "x" * 43) as anon, unchanged(redis_sync, server.settings.prefix):
        assert_error(
            anon.post(f"{API}/leases", json={"gpus": 1}),
            401,
            "unauthorized",
            "unknown or deleted API token",
            "ask an admin",
        )
        assert_error(anon.get(f"{API}/whoami"), 401, "unauthorized", "unknown or deleted API token")
    # A real token with a lower-case scheme still works (the scheme is case-insensitive).
    with http(server) as anon:
        resp = anon.get(f"{API}/whoami", headers={"Authorization": f"bearer {server.token('alice')}"})
        assert resp.status_code == 200 and resp.json() == {"user": "alice", "role": "user", "teams": []}


def test_admin_revokes_another_users_lease(server: Any, redis_sync: Any) -> None:
    with http(server, "bob") as bob, http(server, "root", "admin") as admin:
        lease = _acquire(bob, 2, label="bob's")
        resp = admin.post(f"{API}/leases/{lease['id']}/revoke", json={"reason": "maintenance on n1"})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["state"] == "revoked" and out["changed"] is True
        assert out["end_reason"] == "maintenance on n1" and out["ended_by"] == "root"
        assert "token" not in out  # the admin is not the owner
        # The event log says so, with the GPUs given back.
        log = admin.get(f"{API}/events/log", params={"limit": "10000"}).json()["events"]
        revoked = [e for e in log if e["type"] == "revoked" and e["lease"] == lease["id"]]
        assert (
            len(revoked) == 1
            and revoked[0]["by"] == "root"
            and sorted(revoked[0]["gpus"]) == sorted(g["index"] for g in lease["gpus"])
        )
        # The owner sees it revoked and cannot renew it back to life.
        assert bob.get(f"{API}/leases/{lease['id']}").json()["state"] == "revoked"
        resp = bob.post(f"{API}/leases/{lease['id']}/renew", json={"token": lease["token"]})
        assert_error(resp, 409, "lease_ended", "revoked", "acquire a new lease")
        # Revoking again changes nothing.
        again = admin.post(f"{API}/leases/{lease['id']}/revoke", json={}).json()
        assert again["state"] == "revoked" and again["changed"] is False
        # All 6 A100 GPUs are free again.
        assert admin.get(f"{API}/cluster").json()["pools"]["A100-80GB"]["free"] == 6


def test_admin_delete_of_another_users_lease_revokes_it(server: Any, redis_sync: Any) -> None:
    with http(server, "bob") as bob, http(server, "root", "admin") as admin:
        theirs = _acquire(bob)
        mine = _acquire(admin)
        out = admin.delete(f"{API}/leases/{theirs['id']}").json()
        assert out["state"] == "revoked" and out["changed"] is True and out["ended_by"] == "root"
        assert "revoked by admin root" in out["end_reason"]
        assert out["cause"] == {"code": "revoked", "by": "root", "why": ""}  # no reason given
        assert "token" not in out
        # The admin's own lease is released, not revoked.
        own = admin.delete(f"{API}/leases/{mine['id']}", params={"reason": "done early"}).json()
        assert own["state"] == "released" and own["token"] == mine["token"]
        assert own["cause"] == {"code": "released", "by": "root", "why": "done early"}
        types = {
            e["lease"]: e["type"]
            for e in admin.get(f"{API}/events/log", params={"limit": "10000"}).json()["events"]
            if e["type"] in ("revoked", "released")
        }
        assert types == {theirs["id"]: "revoked", mine["id"]: "released"}


def test_tokens_are_shown_only_to_the_owner(server: Any) -> None:
    with http(server, "alice") as alice, http(server, "bob") as bob, http(server, "root", "admin") as admin:
        a = _acquire(alice)
        b = _acquire(bob)
        assert alice.get(f"{API}/leases/{a['id']}").json()["token"] == a["token"]
        theirs = alice.get(f"{API}/leases/{b['id']}")
        assert theirs.status_code == 200 and theirs.json()["user"] == "bob" and "token" not in theirs.json()
        assert "token" not in admin.get(f"{API}/leases/{b['id']}").json()  # not even to an admin

        mine = alice.get(f"{API}/leases").json()["leases"]
        assert [(rec["id"], rec["token"]) for rec in mine] == [(a["id"], a["token"])]
        everyone = alice.get(f"{API}/leases", params={"all": "true"}).json()["leases"]
        by_id = {rec["id"]: rec for rec in everyone}
        assert set(by_id) == {a["id"], b["id"]}
        assert by_id[a["id"]]["token"] == a["token"]
        assert "token" not in by_id[b["id"]] and by_id[b["id"]]["user"] == "bob"
        for rec in admin.get(f"{API}/leases", params={"all": "true"}).json()["leases"]:
            assert "token" not in rec
        # Ended leases: the same rule.
        alice.delete(f"{API}/leases/{a['id']}")
        assert "token" not in bob.get(f"{API}/leases/{a['id']}").json()
        assert alice.get(f"{API}/leases/{a['id']}").json()["token"] == a["token"]


def test_the_live_event_stream_shows_a_grants_token_only_to_its_owner_and_an_admin(server: Any) -> None:
    """The hub hands one event object to every stream and makes its text once per form: with the
    fencing token for its owner (and an admin), without it for anyone else."""
    from tests.api_helpers import EventWatcher

    watchers = {who: EventWatcher(server.url, server.token(who, role)).start() for who, role in
                (("alice", "user"), ("bob", "user"), ("root", "admin"))}  # fmt: skip
    with http(server, "alice") as alice:
        a = _acquire(alice)
    seen = {
        who: w.wait_for(lambda e: e["type"] == "grant" and e["lease"] == a["id"], 10, "the grant")
        for who, w in watchers.items()
    }
    assert seen["alice"]["token"] == a["token"] and seen["root"]["token"] == a["token"]
    assert "token" not in seen["bob"] and seen["bob"]["user"] == "alice"


def test_only_an_admin_creates_tokens(server: Any, redis_sync: Any) -> None:
    tokens_key = Keys(server.settings.prefix).tokens
    server.token("root", "admin")
    with (
        http(server, "alice") as alice,
        http(server, "agent1", "agent") as agent,
        unchanged(redis_sync, server.settings.prefix),
    ):
        for who in (alice, agent):
            resp = who.post(f"{API}/tokens", json={"user": "mallory", "role": "admin"})
            assert_error(resp, 403, "forbidden", "only an admin can create tokens")
    before = redis_sync.hlen(tokens_key)
    with http(server, "root", "admin") as admin:
        resp = admin.post(f"{API}/tokens", json={"user": "carol"})
        assert resp.status_code == 201, resp.text
        made = resp.json()
        assert made["user"] == "carol" and made["role"] == "user" and made["token"].startswith("glt_")
        agent_tok = admin.post(f"{API}/tokens", json={"user": "rack7", "role": "agent"}).json()["token"]
    assert redis_sync.hlen(tokens_key) == before + 2
    assert made["token"] not in str(redis_sync.hgetall(tokens_key))  # only the hash is stored
    with http(server, token=made["token"]) as carol:
        assert carol.get(f"{API}/whoami").json() == {"user": "carol", "role": "user", "teams": []}
        lease = _acquire(carol)
        assert lease["user"] == "carol"
        assert_error(carol.post(f"{API}/tokens", json={"user": "x"}), 403, "forbidden")
    with http(server, token=agent_tok) as rack7:
        assert rack7.get(f"{API}/whoami").json() == {"user": "rack7", "role": "agent", "teams": []}


def test_agent_token_registers_nodes_but_a_user_token_cannot(server: Any, redis_sync: Any) -> None:
    inventory = {
        "pool": "L4-24GB",
        "source": "simulated",
        "gpus": [{"index": i, "uuid": f"GPU-l4-{i}", "model": "L4", "memory_mb": 24576} for i in range(2)],
    }
    with http(server, "alice") as alice, unchanged(redis_sync, server.settings.prefix):
        assert_error(alice.put(f"{API}/nodes/l4-a", json=inventory), 403, "forbidden", "agent or admin")
        assert_error(alice.post(f"{API}/nodes/n1/heartbeat"), 403, "forbidden", "agent or admin")
    with http(server, "agent1", "agent") as agent, http(server, "alice") as alice:
        resp = agent.put(f"{API}/nodes/l4-a", json=inventory)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"node": "l4-a", "status": "registered"}
        assert agent.post(f"{API}/nodes/l4-a/heartbeat").json() == {"node": "l4-a", "status": "alive"}
        nodes = {n["name"]: n for n in alice.get(f"{API}/cluster").json()["nodes"]}
        assert nodes["l4-a"]["pool"] == "L4-24GB" and len(nodes["l4-a"]["gpus"]) == 2
        # The new pool is usable at once.
        assert _acquire(alice, 2, pool="L4-24GB")["node"] == "l4-a"
        # An agent is no admin: it cannot revoke, nor create tokens.
        assert_error(agent.post(f"{API}/tokens", json={"user": "x"}), 403, "forbidden")


def test_public_endpoints_need_no_token(server: Any) -> None:
    with http(server) as anon:
        for path in (f"{API}/health", "/metrics", f"{API}/openapi.json"):
            resp = anon.get(path)
            assert resp.status_code == 200, (path, resp.text)
            # ... and an unknown token does not break them either.
            assert anon.get(path, headers={"Authorization": "Bearer glt_bogus"}).status_code == 200, path
            if path.endswith("health"):
                assert resp.json()["status"] == "ok" and resp.json()["redis"] == "ok"
            elif path.endswith("openapi.json"):
                assert resp.json()["openapi"].startswith("3.")
            else:
                assert "gpulease_gpus" in resp.text


def test_proxy_token_acts_for_the_user_it_names(server: Any, redis_sync: Any) -> None:
    """The Jupyter extension under JupyterHub holds one proxy token and names the Hub user per request."""
    with http(server, "hub", "proxy") as hub, http(server, "alice") as alice:
        who = hub.get(f"{API}/whoami", headers={"X-Gpulease-User": "ann"}).json()
        assert who == {"user": "ann", "role": "user", "teams": []}
        lease = hub.post(f"{API}/leases", json={"gpus": 1}, headers={"X-Gpulease-User": "ann"}).json()
        assert lease["user"] == "ann"
        # ann's lease is hers, not the proxy's nor another user's
        assert_error(hub.delete(f"{API}/leases/{lease['id']}", headers={"X-Gpulease-User": "bob"}), 403, "not_owner")
        with unchanged(redis_sync, server.settings.prefix):
            assert_error(
                alice.get(f"{API}/whoami", headers={"X-Gpulease-User": "ann"}), 403, "forbidden", "proxy token"
            )
            assert_error(
                hub.post(f"{API}/leases", json={"gpus": 1}, headers={"X-Gpulease-User": "ann smith"}),
                400,
                "bad_request",
                "X-Gpulease-User",
            )
            # A proxy token never acts as itself: it leases for a user it names, or not at all.
            assert_error(hub.post(f"{API}/leases", json={"gpus": 1}), 403, "forbidden", "GPULEASE_USER")
            assert_error(hub.get(f"{API}/whoami"), 403, "forbidden", "acts only for the user it names")


def test_a_workers_watchdog_acting_through_a_proxy_token_sees_its_lease_end(server: Any, tmp_path: Path) -> None:
    """Under JupyterHub a kernel's token is the hub's proxy token, acting for GPULEASE_USER: the
    worker's watchdog must name that user too, or the server refuses it (403) and it never sees its
    lease end. The watchdog runs as in a worker (its own process) and exits once the lease is released."""
    from lease_server.client import Client

    with Client(server.url, server.token("hub", "proxy"), act_as="ann") as ann:
        lease = ann.acquire(1, ttl=60)
        watch = {"url": server.url, "token": server.token("hub", "proxy"), "id": lease.id, "user": "ann"}
        code = "import json, sys; from magics.worker import _watchdog; _watchdog(json.loads(sys.argv[1]))"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(watch)], stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        try:
            ann.release(lease)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert f"lease {lease.id} is released; stopping this worker" in err, err
