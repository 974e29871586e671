"""Elastic leases change size while they run: POST /leases/{id}/grow adds GPUs of the lease's node
(the lowest free indexes, all or none) only when that delays no one, POST /leases/{id}/shrink gives
back the highest-indexed ones and serves the queue at once, and a request that finds no GPUs free
asks elastic leases of other users above their minimum to shrink (shrink_notice), which the server
does itself once the notice runs out. The fencing token never changes; the ledger charges each size
for the time the lease had it. Real server, real Redis (and, for exact GPU-time, the real scripts
on a virtual clock)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from redis import Redis
from redis.asyncio import Redis as ARedis

from lease_server.leasing.inventory import parse_simulate, register
from lease_server.leasing.lease import LeaseStore
from lease_server.store.engine import Engine
from lease_server.store.keys import Keys
from lease_server.store.scripts import Acquire, Code, Release, Resize
from tests.api_helpers import API, assert_error, http, queued, unchanged
from tests.conftest import make_settings

FOUR = "a=4xA100-80GB"


def _log(client: httpx.Client, lease: str | None = None) -> list[dict[str, Any]]:
    params = {"limit": "10000", **({"lease": lease} if lease else {})}
    return client.get(f"{API}/events/log", params=params).json()["events"]  # type: ignore[no-any-return]


def _board(client: httpx.Client) -> dict[int, tuple[str, str | None]]:
    """GPU index -> (state, id of the lease holding it) on the cluster view."""
    [node] = client.get(f"{API}/cluster").json()["nodes"]
    return {g["index"]: (g["state"], g.get("lease", {}).get("id")) for g in node["gpus"]}


def _indexes(lease: dict[str, Any]) -> list[int]:
    return [g["index"] for g in lease["gpus"]]


def _acquire(client: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = client.post(f"{API}/leases", json={"ttl": 600, **body})
    assert resp.status_code == 201, resp.text
    return resp.json()  # type: ignore[no-any-return]


def _resize(client: httpx.Client, how: str, lease: dict[str, Any], gpus: Any, **extra: Any) -> httpx.Response:
    return client.post(f"{API}/leases/{lease['id']}/{how}", json={"token": lease["token"], "gpus": gpus, **extra})


def test_grow_takes_the_lowest_free_gpus_of_the_node_and_keeps_the_token(server_factory: Any) -> None:
    server = server_factory(FOUR)
    with http(server, "alice") as alice, http(server, "bob") as bob:
        b = _acquire(bob, gpus=3)
        a = _acquire(alice, gpus=4, gpus_min=1)  # one GPU is free: it gets that one
        assert _indexes(b) == [0, 1, 2] and _indexes(a) == [3] and a["elastic"] == {"min": 1, "max": 4}
        bob.delete(f"{API}/leases/{b['id']}")
        resp = _resize(alice, "grow", a, 2)
        assert resp.status_code == 200, resp.text
        grown = resp.json()
        assert _indexes(grown) == [3, 0, 1] and grown["token"] == a["token"] and grown["id"] == a["id"]
        assert [g["uuid"] for g in grown["gpus"]][:1] == [a["gpus"][0]["uuid"]] and all(
            g["uuid"] for g in grown["gpus"]
        )
        assert _board(alice) == {
            0: ("leased", a["id"]),
            1: ("leased", a["id"]),
            2: ("free", None),
            3: ("leased", a["id"]),
        }
        assert alice.get(f"{API}/leases/{a['id']}").json()["gpus"] == grown["gpus"]
        [ev] = [e for e in _log(alice, a["id"]) if e["type"] == "grown"]
        assert ev["gpus"] == [0, 1] and ev["size"] == 3 and ev["token"] == a["token"] and ev["user"] == "alice"
        # The same token renews it, and releasing it frees all four.
        assert alice.post(f"{API}/leases/{a['id']}/renew", json={"token": a["token"]}).status_code == 200
        assert alice.delete(f"{API}/leases/{a['id']}").json()["state"] == "released"
        assert {state for state, _ in _board(alice).values()} == {"free"}


def test_grow_is_refused_and_nothing_changes(server_factory: Any, redis_sync: Redis) -> None:
    server = server_factory(FOUR)
    prefix = server.settings.prefix
    with http(server, "alice") as alice, http(server, "bob") as bob:
        b1, b2 = _acquire(bob, gpus=1), _acquire(bob, gpus=1)
        a = _acquire(alice, gpus=3, gpus_min=1)
        assert _indexes(a) == [2, 3] and a["elastic"] == {"min": 1, "max": 3}
        with unchanged(redis_sync, prefix):
            assert_error(_resize(alice, "grow", a, 2), 409, "conflict", "above the 3", "nothing changed")
            assert_error(_resize(alice, "grow", a, 1), 409, "conflict", "has 0 free GPU(s)")
        bob.delete(f"{API}/leases/{b1['id']}")  # GPU 0 is free now
        with unchanged(redis_sync, prefix):
            assert_error(_resize(bob, "grow", a, 1), 403, "not_owner")
            stale = {**a, "token": a["token"] + 99}
            assert_error(_resize(alice, "grow", stale, 1), 409, "stale_token")
            assert_error(_resize(bob, "grow", b2, 1), 409, "conflict", "not elastic")
            assert_error(
                alice.post(f"{API}/leases/l-nobody-000001/grow", json={"token": 1, "gpus": 1}), 404, "no_such_lease"
            )
            # Bad input: a 400 naming the field.
            url = f"{API}/leases/{a['id']}/grow"
            assert_error(alice.post(url, json={"gpus": 1}), 400, "bad_request", "token is required")
            assert_error(alice.post(url, json={"token": a["token"]}), 400, "bad_request", "gpus is required")
            assert_error(_resize(alice, "grow", a, 0), 400, "bad_request", "gpus must be at least 1")
            assert_error(_resize(alice, "grow", a, "1"), 400, "bad_request", "gpus")
            assert_error(_resize(alice, "grow", a, 1, ttl=5), 400, "bad_request", "unknown field")
        # carol waits for the whole node (nothing anyone could give back makes 4 on it): growing
        # would take a GPU before her.
        with queued(server, "carol", "carol-whole-0001", gpus=4) as carol, unchanged(redis_sync, prefix):
            assert_error(_resize(alice, "grow", a, 1), 409, "conflict", "waits in the pool")
            assert not carol.answered.is_set()
        assert _resize(alice, "grow", a, 1).json()["gpus"][-1]["index"] == 0  # nobody waits now
        alice.delete(f"{API}/leases/{a['id']}")
        assert_error(_resize(alice, "grow", a, 1), 409, "lease_ended")
        bob.delete(f"{API}/leases/{b2['id']}")


def test_shrink_frees_the_highest_gpus_and_a_waiter_gets_them_at_once(server_factory: Any, redis_sync: Redis) -> None:
    server = server_factory(FOUR)
    with http(server, "alice") as alice, http(server, "bob") as bob:
        a = _acquire(alice, gpus=4)  # not elastic: any lease may give GPUs back
        with queued(server, "bob", "bob-waits-00001") as waiting:
            resp = _resize(alice, "shrink", a, 1)
            assert resp.status_code == 200, resp.text
            assert _indexes(resp.json()) == [0, 1, 2] and resp.json()["token"] == a["token"]
            got = waiting.result(timeout=10)
            assert got.status_code == 201, got.text
            assert _indexes(got.json()) == [3] and got.json()["user"] == "bob"
        [ev] = [e for e in _log(alice, a["id"]) if e["type"] == "shrunk"]
        assert ev["gpus"] == [3] and ev["size"] == 3 and ev["by"] == "alice" and ev["token"] == a["token"]
        assert _board(alice)[3] == ("leased", "bob-waits-00001") and _board(alice)[2] == ("leased", a["id"])
        # At least one GPU stays: giving back all of them is a release.
        with unchanged(redis_sync, server.settings.prefix):
            assert_error(_resize(alice, "shrink", a, 3), 409, "conflict", "release it")
            assert_error(_resize(alice, "shrink", a, 0), 400, "bad_request", "gpus")
            assert_error(_resize(bob, "shrink", a, 1), 403, "not_owner")
        resp = _resize(alice, "shrink", a, 2)
        assert _indexes(resp.json()) == [0]
        assert alice.delete(f"{API}/leases/{a['id']}").json()["state"] == "released"
        bob.delete(f"{API}/leases/bob-waits-00001")
        assert {state for state, _ in _board(alice).values()} == {"free"}
        counts = {k: int(v) for k, v in redis_sync.hgetall(Keys(server.settings.prefix).held_by).items()}
        assert set(counts.values()) <= {0}, counts


def test_the_ledger_charges_each_size_for_the_time_it_was_held(server_factory: Any, redis_sync: Redis) -> None:
    """1 GPU, then 3, then 2: the ledger's gpu_s is the sum of size x time between the events."""
    server = server_factory(FOUR)
    with http(server, "alice") as alice, http(server, "bob") as bob:
        b = _acquire(bob, gpus=3)
        a = _acquire(alice, gpus=3, gpus_min=1)
        bob.delete(f"{API}/leases/{b['id']}")
        assert len(_resize(alice, "grow", a, 2).json()["gpus"]) == 3
        assert len(_resize(alice, "shrink", a, 1).json()["gpus"]) == 2
        alice.delete(f"{API}/leases/{a['id']}")
        ts = {e["type"]: e["ts"] for e in _log(alice, a["id"])}  # the log shows ts in seconds
        [(_id, fields)] = [
            (i, f) for i, f in redis_sync.xrange(Keys(server.settings.prefix).ledger) if a["id"] in f["data"]
        ]
        entry = json.loads(fields["data"])
    expected = (ts["grown"] - ts["grant"]) * 1 + (ts["shrunk"] - ts["grown"]) * 3 + (ts["released"] - ts["shrunk"]) * 2
    assert entry["gpus"] == 2 and entry["gpu_s"] == pytest.approx(expected, abs=1e-6)
    assert entry["held_s"] == pytest.approx(ts["released"] - ts["grant"], abs=1e-6)


def test_gpu_time_across_sizes_on_a_virtual_clock(redis_server: Any, prefix: str) -> None:
    """The same on the simulator's clock, exactly: 100 s at 1 GPU, 50 s at 3, 30 s at 2 = 310 GPU-s
    (not 180 s x 2), and fair share was charged the same."""

    async def main() -> None:
        r = ARedis.from_url(redis_server.url, decode_responses=True)
        try:
            settings = make_settings(redis_server.url, f"{prefix}v", heartbeat_timeout=30 * 86400)
            st = LeaseStore(Engine(r, settings))
            await st.publish_scheduling()
            for inv in parse_simulate(FOUR):
                await register(st.engine, inv)
            t = int(time.time() * 1000)
            pool = "A100-80GB"
            code, _ = await st.engine.raw(Acquire("l-bob-0000001", "bob", pool, 3, 3_600_000, 0), now_ms=t)
            assert code is Code.OK
            code, rest = await st.engine.raw(
                Acquire("l-alice-000001", "alice", pool, 3, 3_600_000, 0, gpus_min=1), now_ms=t
            )
            assert code is Code.OK and len(json.loads(rest[0])["gpus"]) == 1
            token = str(json.loads(rest[0])["token"])
            await st.engine.raw(Release("l-bob-0000001", "", "bob", False, "released", "done"), now_ms=t)
            code, _ = await st.engine.raw(Resize("l-alice-000001", token, "alice", 2), now_ms=t + 100_000)
            assert code is Code.OK
            code, _ = await st.engine.raw(Resize("l-alice-000001", token, "alice", -1), now_ms=t + 150_000)
            assert code is Code.OK
            await st.engine.raw(
                Release("l-alice-000001", token, "alice", False, "released", "done"), now_ms=t + 180_000
            )
            entries = [json.loads(f["data"]) for _i, f in await r.xrange(st.keys.ledger)]
            [d] = [d for d in entries if d["user"] == "alice"]
            assert d["gpus"] == 2 and d["held_s"] == 180 and d["gpu_s"] == 310 and d["charged_gpu_s"] == 310
            # Fair share saw the same: 1 GPU running for 100 s, 3 for 50 s, 2 for 30 s (decayed as it went).
            usage = json.loads(await r.hget(st.keys.usage, f"{pool}|alice"))
            decay = 0.5 ** (1 / settings.fair_share_half_life)
            assert usage["r"] == 0
            assert usage["v"] == pytest.approx((100 * decay**50 + 150) * decay**30 + 60, rel=1e-9)
            # A lease past its deadline that the sweep has not reached yet is expired, not grown.
            code, rest = await st.engine.raw(
                Acquire("l-alice-000002", "alice", pool, 4, 1_000, 0, gpus_min=1), now_ms=t + 200_000
            )
            assert code is Code.OK and len(json.loads(rest[0])["gpus"]) == 4
            token = str(json.loads(rest[0])["token"])
            code, rest = await st.engine.raw(Resize("l-alice-000002", token, "alice", -1), now_ms=t + 205_000)
            assert code is Code.EXPIRED and json.loads(rest[0])["state"] == "expired"
            assert not await r.hgetall(st.keys.holders) and await r.zcard(st.keys.elastic) == 0
        finally:
            await r.aclose()

    asyncio.run(main())


def _notices(client: httpx.Client, lease: str) -> list[dict[str, Any]]:
    return [e for e in _log(client, lease) if e["type"] == "shrink_notice"]


def test_a_waiter_asks_an_elastic_lease_to_shrink_and_its_owner_does(server_factory: Any) -> None:
    server = server_factory(FOUR)
    with http(server, "alice") as alice:
        a = _acquire(alice, gpus=8, gpus_min=1)  # as many as the node has, up to 8
        assert len(a["gpus"]) == 4 and a["elastic"] == {"min": 1, "max": 8}
        # A request that does not wait asks nobody to shrink.
        assert_error(alice.post(f"{API}/leases", json={"gpus": 2}), 409, "no_capacity")
        with http(server, "carol") as carol:
            assert_error(carol.post(f"{API}/leases", json={"gpus": 2}), 409, "no_capacity")
        assert _notices(alice, a["id"]) == []
        with queued(server, "bob", "bob-needs-0002", gpus=2) as bob:
            # bob's request found nothing free and asked alice's lease (above its minimum) for 2.
            [notice] = _notices(alice, a["id"])
            assert notice["for"] == "bob" and notice["size"] == 4 and notice["shrink_to"] == 2
            rec = alice.get(f"{API}/leases/{a['id']}").json()
            assert rec["shrink_to"] == 2 and rec["shrink_by"] == pytest.approx(notice["shrink_by"] / 1000)
            assert rec["shrink_by"] - time.time() > 20  # the pool's default notice, 30 s
            assert "bob" in rec["shrink_reason"] and len(rec["gpus"]) == 4
            assert not bob.answered.is_set()
            # A second waiter finds those GPUs already coming: nobody is asked again.
            with queued(server, "carol", "carol-needs-001"):
                assert len(_notices(alice, a["id"])) == 1
            assert_error(_resize(alice, "grow", a, 1), 409, "conflict", "asked to shrink to 2")
            resp = _resize(alice, "shrink", a, 2)
            assert resp.status_code == 200, resp.text
            assert _indexes(resp.json()) == [0, 1] and "shrink_to" not in resp.json()
            got = bob.result(timeout=10)
            assert got.status_code == 201, got.text
            assert _indexes(got.json()) == [2, 3]
        [shrunk] = [e for e in _log(alice, a["id"]) if e["type"] == "shrunk"]
        assert shrunk["by"] == "alice" and shrunk["gpus"] == [2, 3] and shrunk["size"] == 2
        alice.delete(f"{API}/leases/{a['id']}")
        alice.delete(f"{API}/leases/bob-needs-0002")


def test_the_server_shrinks_a_lease_whose_notice_ran_out(server_factory: Any) -> None:
    server = server_factory(FOUR, scheduling={"A100-80GB": {"preempt_notice": 0.5}})
    with http(server, "alice") as alice, http(server, "bob") as bob:
        a = _acquire(alice, gpus=4, gpus_min=1)
        with queued(server, "bob", "bob-needs-0003", gpus=2) as waiting:
            # alice does nothing: the sweep shrinks her lease when the notice runs out, and bob's
            # blocked POST gets the two GPUs.
            got = waiting.result(timeout=20)
            assert got.status_code == 201, got.text
            assert _indexes(got.json()) == [2, 3]
        [notice] = _notices(alice, a["id"])
        [shrunk] = [e for e in _log(alice, a["id"]) if e["type"] == "shrunk"]
        assert shrunk["by"] == "server" and shrunk["reason"] == "shrink notice ran out"
        assert shrunk["gpus"] == [2, 3] and shrunk["size"] == 2 and shrunk["ts"] >= notice["shrink_by"] / 1000
        rec = alice.get(f"{API}/leases/{a['id']}").json()
        assert _indexes(rec) == [0, 1] and "shrink_to" not in rec and rec["state"] == "active"
        # Her token still holds what is left.
        assert alice.post(f"{API}/leases/{a['id']}/renew", json={"token": a["token"]}).status_code == 200
        alice.delete(f"{API}/leases/{a['id']}")
        bob.delete(f"{API}/leases/bob-needs-0003")
        assert {state for state, _ in _board(alice).values()} == {"free"}


def test_a_resize_that_names_the_size_it_saw_can_be_resent(server_factory: Any, redis_sync: Redis) -> None:
    """A client that lost the answer (a 503 after a failover) sends the same grow or shrink again:
    with ``size`` (what the client always sends) the resend answers as done and changes nothing."""
    server = server_factory(FOUR)
    with http(server, "alice") as alice:
        a = _acquire(alice, gpus=4, gpus_min=1)
        alice.post(f"{API}/leases/{a['id']}/shrink", json={"token": a["token"], "gpus": 3})
        first = _resize(alice, "grow", a, 2, size=1)
        assert first.status_code == 200, first.text
        assert len(first.json()["gpus"]) == 3
        again = _resize(alice, "grow", a, 2, size=1)
        assert again.status_code == 200 and again.json()["gpus"] == first.json()["gpus"]
        with unchanged(redis_sync, server.settings.prefix):
            assert_error(_resize(alice, "grow", a, 1, size=1), 409, "conflict", "holds 3", "not the 1")
            assert_error(_resize(alice, "grow", a, 1, size=0), 400, "bad_request", "size")
        shrunk = _resize(alice, "shrink", a, 2, size=3)
        assert shrunk.status_code == 200 and len(shrunk.json()["gpus"]) == 1
        resent = _resize(alice, "shrink", a, 2, size=3)
        assert resent.status_code == 200 and resent.json()["gpus"] == shrunk.json()["gpus"]
        assert [e["size"] for e in _log(alice, a["id"]) if e["type"] in ("grown", "shrunk")] == [1, 3, 1]
