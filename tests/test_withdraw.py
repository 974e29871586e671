"""Withdrawing a queued request: DELETE /leases/{id} of a request that still waits takes it out of
the queue at once, wakes its blocked POST with 410 ``withdrawn``, and it is never granted later,
even when the withdrawal races the release that would have served it. Real server, real Redis."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from lease_server.leasing.lease import WAITER_GRACE_MS
from lease_server.store.engine import Engine
from lease_server.store.keys import Keys
from lease_server.store.scripts import Sweep
from tests.api_helpers import API, QueuedPost, assert_error, event_stream, http, next_event, queued

ONE_GPU = "a=1xA100-80GB"


def _log(client: httpx.Client) -> list[dict[str, Any]]:
    return client.get(f"{API}/events/log", params={"limit": "10000"}).json()["events"]  # type: ignore[no-any-return]


def _all_free(client: httpx.Client) -> bool:
    nodes = client.get(f"{API}/cluster").json()["nodes"]
    return all(g["state"] == "free" for n in nodes for g in n["gpus"])


def _deletes_at_once(*targets: tuple[httpx.Client, str]) -> list[httpx.Response]:
    """DELETE /leases/{id} of every (client, id), each from its own thread, released together by a
    barrier so that the requests reach the server at the same moment."""
    barrier = threading.Barrier(len(targets))
    answers: dict[int, httpx.Response] = {}

    def go(i: int, client: httpx.Client, lid: str) -> None:
        barrier.wait(5)
        answers[i] = client.delete(f"{API}/leases/{lid}")

    threads = [threading.Thread(target=go, args=(i, *t), daemon=True) for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(answers) == len(targets), "a DELETE did not answer within 20 s"
    return [answers[i] for i in range(len(targets))]


def test_withdrawn_request_leaves_the_queue_and_its_post_answers_at_once(server_factory: Any) -> None:
    server = server_factory(ONE_GPU)
    bob_id = "bob-withdraw-0001"
    with http(server, "alice") as alice, http(server, "bob") as bob:
        held = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        with queued(server, "bob", bob_id) as post:
            assert [w["id"] for w in bob.get(f"{API}/queue").json()["waiting"]] == [bob_id]
            resp = bob.delete(f"{API}/leases/{bob_id}")
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert out["id"] == bob_id and out["user"] == "bob" and out["state"] == "withdrawn"
            assert out["changed"] is True and out["position"] == 1 and out["gpus"] == 1
            assert out["ended_by"] == "bob" and "withdrawn" in out["end_reason"]
            # Woken by the withdrawal, not by its 30 s wait running out.
            assert_error(post.result(timeout=20), 410, "withdrawn", bob_id, "withdrawn", "never be granted")
        assert bob.get(f"{API}/queue").json()["waiting"] == []
        # The holder lets go: the GPU stays free, nothing is granted to the withdrawn request.
        alice.delete(f"{API}/leases/{held['id']}")
        assert _all_free(bob)
        assert_error(bob.get(f"{API}/leases/{bob_id}"), 404, "no_such_lease")
        events = [e for e in _log(bob) if e.get("lease") == bob_id]
        assert [e["type"] for e in events] == ["queued", "wait_cancelled"], events
        assert events[1]["reason"] == "withdrawn by its owner" and events[1]["by"] == "bob"
        # A second DELETE finds nothing left to withdraw.
        assert_error(bob.delete(f"{API}/leases/{bob_id}"), 404, "no_such_lease")


def test_only_the_owner_or_an_admin_withdraws_a_queued_request(server_factory: Any) -> None:
    server = server_factory(ONE_GPU)
    bob_id = "bob-withdraw-0002"
    with http(server, "alice") as alice, http(server, "eve") as eve, http(server, "root", "admin") as admin:
        alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        with queued(server, "bob", bob_id) as post:
            assert_error(eve.delete(f"{API}/leases/{bob_id}"), 403, "not_owner", bob_id)
            assert [w["id"] for w in eve.get(f"{API}/queue").json()["waiting"]] == [bob_id]
            assert not post.answered.is_set()
            resp = admin.delete(f"{API}/leases/{bob_id}", params={"reason": "queue cleanup"})
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert (out["state"], out["ended_by"], out["end_reason"]) == ("withdrawn", "root", "queue cleanup")
            assert_error(post.result(timeout=20), 410, "withdrawn")
        assert eve.get(f"{API}/queue").json()["waiting"] == []


def test_withdrawal_racing_the_release_never_leaves_a_gpu_held(server_factory: Any) -> None:
    """50 times: the holder releases and the queued request is withdrawn at the same moment. Either
    the withdrawal wins (never granted), or the grant wins and the DELETE releases it: the GPU is
    free at the end, and a grant of the withdrawn id is always followed by its release, never by
    an expiry."""
    server = server_factory(ONE_GPU)
    outcomes: dict[int, int] = {}
    with http(server, "alice") as alice, http(server, "bob") as bob:
        for i in range(50):
            bob_id = f"bob-race-{i:04d}"
            held = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600})
            assert held.status_code == 201, held.text
            with queued(server, "bob", bob_id) as post:
                release, withdraw = _deletes_at_once((alice, held.json()["id"]), (bob, bob_id))
                assert release.status_code == 200, release.text
                assert withdraw.status_code == 200, withdraw.text
                state = withdraw.json()["state"]
                assert state in ("withdrawn", "released"), withdraw.text
                resp = post.result(timeout=5)
                outcomes[resp.status_code] = outcomes.get(resp.status_code, 0) + 1
                if state == "withdrawn":
                    assert_error(resp, 410, "withdrawn")
                else:  # granted first: the POST saw its lease, or saw it already released
                    assert resp.status_code in (201, 409), resp.text
            assert _all_free(bob), f"round {i}: a GPU is still held"
            types = [e["type"] for e in _log(bob) if e.get("lease") == bob_id]
            if "grant" in types:
                assert types[types.index("grant") + 1 :][:1] == ["released"], (i, types)
            else:
                assert types == ["queued", "wait_cancelled"], (i, types)
            assert "expired" not in types
    assert sum(outcomes.values()) == 50


def test_a_wait_swept_while_its_server_was_starved_answers_as_a_timeout(server_factory: Any) -> None:
    """The sweeper removes a waiter WAITER_GRACE_MS past its own deadline (its server presumed
    dead). A server that is alive but whose loop was starved that long (a loaded two-core host)
    must answer its caller as a timeout, 409 ``no_capacity``, not with 410 ``withdrawn`` and the
    tale of a DELETE that nobody sent (seen in CI under 50 clients)."""
    server = server_factory(ONE_GPU)
    bob_id = "bob-swept-0001"
    with http(server, "alice") as alice, http(server, "bob") as bob:
        held = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        post = QueuedPost(server, "bob", bob_id, wait=0.5)
        with event_stream(server, "watcher") as events:
            post.start()
            next_event(events, "queued", bob_id)
        # Starve the server's loop past the request's deadline, and sweep meanwhile as another
        # server would once the grace had run out.
        starved, resume = threading.Event(), threading.Event()

        async def starve() -> None:
            starved.set()
            resume.wait(30)  # blocks the loop, as a starved one is

        assert server._loop is not None
        asyncio.run_coroutine_threadsafe(starve(), server._loop)
        assert starved.wait(10)
        time.sleep(0.6)  # the time that passes is what is tested: the request's own deadline
        r, keys = Redis.from_url(server.settings.redis_url), Keys(server.settings.prefix)
        deadline_ms = json.loads(r.hget(keys.waiters, bob_id))["deadline"]  # type: ignore[arg-type]
        asyncio.run(_sweep_at(server, deadline_ms + WAITER_GRACE_MS + 1))
        assert not r.hexists(keys.waiters, bob_id)
        resume.set()
        assert_error(post.result(timeout=10), 409, "no_capacity", "within 0.5s", "longer wait")
        alice.delete(f"{API}/leases/{held['id']}")
        assert _all_free(bob)
        types = [e["type"] for e in _log(bob) if e.get("lease") == bob_id]
        assert types == ["queued", "wait_abandoned"], types


async def _sweep_at(server: Any, now_ms: int) -> None:
    """One sweep of ``server``'s state, as if run at ``now_ms``."""
    r = AsyncRedis.from_url(server.settings.redis_url, decode_responses=True)
    try:
        await Engine(r, server.settings).run(Sweep(500, WAITER_GRACE_MS), now_ms)
    finally:
        await r.aclose()
