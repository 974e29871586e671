"""Warm leases on the lease server: a finished cell's lease kept for its notebook's next cell,
lent out the moment someone waits.

Real lease server and Redis, simulated GPUs, a real process standing in for the warm worker (the
magic's own path, through a kernel and Ray, is in tests/test_warm_cells.py).
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from lease_server import errors
from tests.api_helpers import EventWatcher
from tests.test_drain import GRACE, JITTER_MS, board_states, check_invariants, name, procs  # noqa: F401


@pytest.fixture
def srv(server_factory: Any) -> Any:
    return server_factory(
        simulate="n1=2xA100-80GB",
        drain_kill_grace_s=GRACE,
        drain_interval=0.1,
        scheduling={"A100-80GB": {"warm_evict_notice": 0.5}},
    )


def ledger(redis_sync: Any, srv: Any, lease_id: str) -> dict[str, Any]:
    import json

    from lease_server.store.keys import Keys

    for _, fields in redis_sync.xrange(Keys(srv.settings.prefix).ledger):
        rec = json.loads(fields[b"data"] if b"data" in fields else fields["data"])
        if rec["lease"] == lease_id:
            return rec  # type: ignore[no-any-return]
    raise AssertionError(f"no ledger record of {lease_id}")


def test_warm_then_run_again_keeps_the_gpus_and_charges_warm_time_apart(srv: Any, redis_sync: Any) -> None:
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice = srv.client("alice")
    lease = alice.acquire(1)
    rec = alice.warm(lease)
    assert rec["warm_since"] and rec["warm_until"] - rec["warm_since"] == pytest.approx(1800)
    assert rec["expires_at"] <= rec["warm_until"]
    warm = watcher.wait_for(lambda e: e["type"] == "warm" and e["lease"] == lease.id, 10, "warm")
    assert warm["gpus"] == [lease.gpus[0]["index"]]
    states = board_states(alice, "n1")
    assert states[lease.gpus[0]["index"]] == "warm"
    assert alice.cluster()["pools"]["A100-80GB"]["warm"] == 1
    assert alice.warm(lease)["warm_since"] == rec["warm_since"]  # again: no change
    back = alice.warm(lease, on=False)
    assert "warm_since" not in back and back["state"] == "active"
    watcher.wait_for(lambda e: e["type"] == "resumed" and e["lease"] == lease.id, 10, "resumed")
    assert board_states(alice, "n1")[lease.gpus[0]["index"]] == "leased"
    alice.warm(lease)
    alice.release(lease)
    rec = ledger(redis_sync, srv, lease.id)
    assert rec["warm_gpu_s"] > 0 and rec["gpu_s"] >= 0
    assert rec["gpu_s"] + rec["warm_gpu_s"] == pytest.approx(rec["held_s"], abs=0.01)
    check_invariants(srv, redis_sync)


def test_a_waiter_evicts_a_warm_lease_and_is_granted_when_its_holder_releases(srv: Any, redis_sync: Any) -> None:
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob = srv.client("alice"), srv.client("bob")
    lease = alice.acquire(2)
    alice.warm(lease)
    rid = bob.new_request_id()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(bob.acquire(1, wait=30, request_id=rid)), daemon=True)
    t.start()
    ev = watcher.wait_for(lambda e: e["type"] == "evicting" and e["lease"] == lease.id, 10, "evicting")
    assert ev["requested_by"] == "bob" and ev["recall_at"] > 0
    assert not got  # first in line, but the GPUs are still the warm holder's
    with pytest.raises(errors.Conflict, match="being evicted"):
        alice.warm(lease, on=False)  # the next cell cannot take it back now
    alice.release(lease, verified=True)  # the kernel ended its worker, saw it gone
    t.join(10)
    assert got and got[0].node == "n1"
    ended = alice.get(lease.id)
    assert ended["state"] == "released"
    check_invariants(srv, redis_sync)


def test_gpus_freed_beside_a_warm_lease_let_a_waiter_evict_it_at_once(srv: Any, redis_sync: Any) -> None:
    """Carol waits for 2 GPUs: one is alice's warm lease, the other bob's running one. Evicting
    alice alone would not serve carol, so the eviction finds no node, and the lease server does not
    look again for a second unless GPUs are freed. Bob's release frees one: alice is evicted then,
    not whenever something else happens in the pool (here: her lease's expiry, half an hour on)."""
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob, carol = srv.client("alice"), srv.client("bob"), srv.client("carol")
    warm = alice.acquire(1)
    alice.warm(warm)
    running = bob.acquire(1)
    rid = carol.new_request_id()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(carol.acquire(2, wait=30, request_id=rid)), daemon=True)
    t.start()
    watcher.wait_for(lambda e: e["type"] == "queued" and e["lease"] == rid, 10, "carol queued")
    assert not any(e["type"] == "evicting" for e in watcher.events)  # one warm GPU would not do
    bob.release(running, verified=True)
    ev = watcher.wait_for(lambda e: e["type"] == "evicting" and e["lease"] == warm.id, 10, "evicting")
    assert ev["requested_by"] == "carol"
    alice.release(warm, verified=True)
    t.join(10)
    assert got and len(got[0].gpus) == 2
    check_invariants(srv, redis_sync)


def test_a_holder_that_misses_the_eviction_notice_loses_the_lease_and_its_worker(
    srv: Any,
    procs: Any,  # noqa: F811 - test_drain's fixture
    redis_sync: Any,
) -> None:
    """The warm worker's kernel is gone quiet: at the deadline the lease is revoked, the node agent
    ends the worker, and only then is the waiter granted."""
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob = srv.client("alice"), srv.client("bob")
    lease = alice.acquire(2)
    worker = procs()
    name(alice, lease, worker)
    alice.warm(lease)
    rid = bob.new_request_id()
    t = threading.Thread(target=lambda: bob.acquire(2, wait=30, request_id=rid), daemon=True)
    t.start()
    drained = watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease.id, 20, "drained")
    exited = worker.wait(5)
    grant = watcher.wait_for(lambda e: e["type"] == "grant" and e["lease"] == rid, 20, "bob's grant")
    assert drained["ended"] == "revoked" and drained["killed"] >= 1
    assert grant["ts"] * 1000 >= exited - JITTER_MS
    ended = alice.get(lease.id)
    assert ended["state"] == "revoked" and ended["end_reason"].startswith("evicted for bob's request")
    t.join(10)
    check_invariants(srv, redis_sync)


def test_warm_max_ends_a_warm_lease(server_factory: Any, redis_sync: Any) -> None:
    srv = server_factory(simulate="n1=1xA100-80GB", scheduling={"A100-80GB": {"warm_max": 0.3}})
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice = srv.client("alice")
    lease = alice.acquire(1, ttl=30)
    alice.warm(lease)
    alice.renew(lease)  # renewing does not keep it past warm_max
    ev = watcher.wait_for(lambda e: e["type"] == "expired" and e["lease"] == lease.id, 20, "expired")
    assert ev["warm"] is True and "warm_max" in ev["reason"]
    check_invariants(srv, redis_sync)


def test_bad_warm_requests_are_refused_and_change_nothing(srv: Any, redis_sync: Any) -> None:
    alice, bob = srv.client("alice"), srv.client("bob")
    lease = alice.acquire(1)
    url = f"{srv.url}/api/v1/leases/{lease.id}/warm"
    auth = {"Authorization": f"Bearer {srv.token('alice')}"}
    for body, says in (
        ({"token": lease.token}, "warm is required"),
        ({"token": lease.token, "warm": "yes"}, "warm"),
        ({"warm": True}, "token is required"),
        ({"token": lease.token, "warm": True, "for": 3}, "for"),
    ):
        r = httpx.post(url, json=body, headers=auth)
        assert r.status_code == 400 and says in r.json()["message"], r.text
    r = httpx.post(url, json={"token": lease.token + 1, "warm": True}, headers=auth)
    assert r.status_code == 409, r.text
    with pytest.raises(errors.NotOwner):
        bob.warm(lease)
    assert "warm_since" not in alice.get(lease.id)
    check_invariants(srv, redis_sync)


def test_an_elastic_lease_cannot_go_warm(srv: Any) -> None:
    alice = srv.client("alice")
    lease = alice.acquire(2, gpus_min=1)
    with pytest.raises(errors.Conflict, match="elastic"):
        alice.warm(lease)
    assert "warm_since" not in alice.get(lease.id)


def test_the_idle_reclaimer_leaves_a_warm_lease_alone(server_factory: Any, redis_sync: Any) -> None:
    """Both GPUs report idle: the reclaimer warns (and reclaims) the plain lease; the warm one is
    lendable, not idle, and keeps its GPU."""
    fast = dict(sample_interval=0.1, idle_timeout=0.6, grace=0.3, min_age=0.0, idle_threshold=5.0)
    srv = server_factory(simulate="n1=2xA100-80GB", **fast)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice = srv.client("alice")
    warm, plain = alice.acquire(1), alice.acquire(1)
    alice.warm(warm)
    watcher.wait_for(lambda e: e["type"] == "revoked" and e["lease"] == plain.id, 30, "the plain lease reclaimed")
    assert not [e for e in watcher.events if e.get("lease") == warm.id and e["type"] in ("idle_warning", "revoked")]
    assert alice.get(warm.id)["state"] == "active"
    check_invariants(srv, redis_sync)
