"""Per-user limits: requests waiting in the queue, event streams open. Over a limit: 429 with the
count and what to do, and nothing changes."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from lease_server import errors
from lease_server.store.keys import Keys
from tests.api_helpers import EventWatcher
from tests.invariants import check_state

API = "/api/v1"


def test_a_user_may_queue_only_so_many_requests(server_factory: Any, redis_sync: Any) -> None:
    srv = server_factory(simulate="n1=1xA100-80GB", max_queued_per_user=2)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob = srv.client("alice"), srv.client("bob")
    holder = bob.acquire(1)
    rids = [alice.new_request_id() for _ in range(2)]
    threads = []
    for rid in rids:
        t = threading.Thread(target=_wait_quietly, args=(alice, rid), daemon=True)
        t.start()
        threads.append(t)
        watcher.wait_for(lambda e, rid=rid: e["type"] == "queued" and e["lease"] == rid, 10, "queued")
    with pytest.raises(errors.TooMany) as got:
        alice.acquire(1, wait=30)
    assert got.value.status == 429 and "already has 2 requests waiting" in got.value.message
    assert "gpulease release ID" in got.value.message
    with pytest.raises(errors.NoCapacity):  # a request that does not wait is not held to it
        alice.acquire(1, wait=0)
    # Another user is not held back by alice's queue.
    carol_rid = bob.new_request_id()
    t = threading.Thread(target=_wait_quietly, args=(srv.client("carol"), carol_rid), daemon=True)
    t.start()
    watcher.wait_for(lambda e: e["type"] == "queued" and e["lease"] == carol_rid, 10, "carol queued")
    check_state(redis_sync, Keys(srv.settings.prefix))
    # One of alice's requests leaves the queue: she may queue another.
    alice.withdraw(rids[0])
    rid = alice.new_request_id()
    t2 = threading.Thread(target=_wait_quietly, args=(alice, rid), daemon=True)
    t2.start()
    watcher.wait_for(lambda e: e["type"] == "queued" and e["lease"] == rid, 10, "queued again")
    for r in (rids[1], rid):
        alice.withdraw(r)
    srv.client("carol").withdraw(carol_rid)
    bob.release(holder)
    check_state(redis_sync, Keys(srv.settings.prefix), expect_all_free=True)


def _wait_quietly(client: Any, rid: str) -> None:
    try:
        lease = client.acquire(1, wait=30, request_id=rid)
        client.release(lease)
    except errors.GpuLeaseError:
        pass  # withdrawn: what the test does to it


def test_a_user_may_open_only_so_many_event_streams(server_factory: Any) -> None:
    srv = server_factory(simulate="n1=1xA100-80GB", max_streams_per_user=2)
    headers = {"Authorization": f"Bearer {srv.token('alice')}"}
    with httpx.Client(base_url=srv.url, headers=headers, timeout=10) as h:
        with h.stream("GET", f"{API}/events") as one, h.stream("GET", f"{API}/events") as two:
            assert one.status_code == two.status_code == 200
            # Both open on the server (the line iterators are kept: one dropped closes its stream).
            lines = [one.iter_lines(), two.iter_lines()]
            assert [next(it) for it in lines] == [": gpulease event stream"] * 2
            third = h.get(f"{API}/events")
            assert third.status_code == 429, third.text
            body = third.json()
            assert body["code"] == "too_many" and "2 event streams open" in body["message"]
            assert body["details"] == {"streams": 2, "limit": 2}
            bob = httpx.get(f"{srv.url}{API}/events/log", headers={"Authorization": f"Bearer {srv.token('bob')}"})
            assert bob.status_code == 200
            del lines
        # Both closed: the server ends them as the connections close, and a stream opens again. (It
        # learns of a close from its event loop: the first try may still find them open.)
        for _ in range(100):
            with h.stream("GET", f"{API}/events") as again:
                if again.status_code == 200:
                    break
            threading.Event().wait(0.05)
        assert again.status_code == 200
