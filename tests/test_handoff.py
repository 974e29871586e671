"""Handing a lease's GPUs to the owner's next queued request in one step (a sweep's next trial
keeps the worker process already on them). POST /leases/{id}/handoff ends the lease and grants the
request exactly its GPUs, only when releasing could not have given them to anyone else; otherwise
it answers 409 and changes nothing. Real server, real Redis."""

from __future__ import annotations

from typing import Any

import httpx

from tests.api_helpers import API, assert_error, http, queued

TWO_GPUS = "a=2xA100-80GB"


def _log(client: httpx.Client) -> list[dict[str, Any]]:
    return client.get(f"{API}/events/log", params={"limit": "10000"}).json()["events"]  # type: ignore[no-any-return]


def _cluster(client: httpx.Client) -> list[tuple[int, str]]:
    nodes = client.get(f"{API}/cluster").json()["nodes"]
    return [(g["index"], g["state"]) for n in nodes for g in n["gpus"]]


def test_a_lease_goes_to_the_owners_next_request_on_the_same_gpu(server_factory: Any) -> None:
    server = server_factory(TWO_GPUS)
    with http(server, "alice") as alice:
        first = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        other = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        nxt = "alice-trial-0002"
        with queued(server, "alice", nxt) as post:
            resp = alice.post(f"{API}/leases/{first['id']}/handoff", json={"token": first["token"], "to": [nxt]})
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert out["ended"]["id"] == first["id"] and out["ended"]["state"] == "released"
            assert "handed to " + nxt in out["ended"]["end_reason"]
            lease = out["lease"]
            assert lease["id"] == nxt and lease["user"] == "alice" and lease["node"] == first["node"]
            assert [g["index"] for g in lease["gpus"]] == [g["index"] for g in first["gpus"]]
            assert lease["token"] > first["token"] > 0
            # The request's blocked POST gets the same grant at once.
            granted = post.result(timeout=5)
            assert granted.status_code == 201, granted.text
            assert granted.json()["id"] == nxt and granted.json()["token"] == lease["token"]
        assert alice.get(f"{API}/queue").json()["waiting"] == []
        types = [(e["type"], e.get("lease")) for e in _log(alice) if e.get("lease") in (first["id"], nxt)]
        assert types[-2:] == [("released", first["id"]), ("grant", nxt)], types
        # The old token is spent: handing the ended lease again says it ended.
        again = alice.post(f"{API}/leases/{first['id']}/handoff", json={"token": first["token"], "to": [nxt]})
        assert_error(again, 409, "lease_ended")
        alice.delete(f"{API}/leases/{nxt}")
        alice.delete(f"{API}/leases/{other['id']}")
        assert all(state == "free" for _, state in _cluster(alice))


def test_no_handoff_while_another_user_waits_and_nothing_changes(server_factory: Any) -> None:
    server = server_factory(TWO_GPUS)
    with http(server, "alice") as alice, http(server, "bob") as bob:
        a1 = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        a2 = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        with queued(server, "alice", "alice-trial-0003") as mine, queued(server, "bob", "bob-cell-00001") as his:
            before = _cluster(alice)
            resp = alice.post(
                f"{API}/leases/{a1['id']}/handoff", json={"token": a1["token"], "to": ["alice-trial-0003"]}
            )
            assert_error(resp, 409, "conflict", "another user waits", "release it instead")
            assert _cluster(alice) == before
            assert alice.get(f"{API}/leases/{a1['id']}").json()["state"] == "active"
            assert not mine.answered.is_set() and not his.answered.is_set()
            # Released instead: fair share serves bob, who has used nothing yet.
            alice.delete(f"{API}/leases/{a1['id']}")
            assert his.result(timeout=5).json()["user"] == "bob"
            assert not mine.answered.is_set()
        alice.delete(f"{API}/leases/{a2['id']}")
        bob.delete(f"{API}/leases/bob-cell-00001")


def test_handoff_refuses_what_is_not_the_owners_to_give(server_factory: Any) -> None:
    server = server_factory(TWO_GPUS)
    with http(server, "alice") as alice, http(server, "bob") as bob:
        a1 = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        a2 = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        with queued(server, "alice", "alice-big-00001", gpus=2), queued(server, "alice", "alice-next-0001"):
            before = _cluster(alice)
            url = f"{API}/leases/{a1['id']}/handoff"
            # Bad input: a clear 400 naming the field.
            nxt, big = ["alice-next-0001"], ["alice-big-00001"]
            assert_error(alice.post(url, json={"to": nxt}), 400, "bad_request", "token is required")
            assert_error(alice.post(url, json={"token": a1["token"]}), 400, "bad_request", "to is required")
            assert_error(alice.post(url, json={"token": a1["token"], "to": ["x"]}), 400, "bad_request", "8 to 64")
            assert_error(alice.post(url, json={"token": a1["token"], "to": []}), 400, "bad_request", "to")
            # Someone else's lease, a stale token, a request that is not queued.
            assert_error(bob.post(url, json={"token": a1["token"], "to": nxt}), 403, "not_owner")
            stale = {"token": a1["token"] + 99, "to": nxt}
            assert_error(alice.post(url, json=stale), 409, "stale_token")
            nobody = {"token": a1["token"], "to": ["nobody-queued-1"]}
            assert_error(alice.post(url, json=nobody), 409, "conflict", "oldest request", "not one of those")
            # The pool's oldest waiter needs more GPUs than the lease has; or it is not named.
            assert_error(alice.post(url, json={"token": a1["token"], "to": big + nxt}), 409, "conflict", "fit")
            assert_error(alice.post(url, json={"token": a1["token"], "to": nxt}), 409, "conflict", "not one of")
            assert _cluster(alice) == before
            assert alice.get(f"{API}/leases/{a1['id']}").json()["state"] == "active"
            alice.delete(f"{API}/leases/{a2['id']}")
            alice.delete(f"{API}/leases/{a1['id']}")
