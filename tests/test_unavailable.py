"""Redis saying "not now" is a 503 with Retry-After on every route, never a 500, and changes nothing.

Each condition is made for real on a Redis of the test's own: a demoted primary (READONLY), a
replica cut from its primary that serves no stale data (MASTERDOWN), a primary short of replicas
(NOREPLICAS, min-replicas-to-write), a cluster that lost a slot (CLUSTERDOWN), a connection lost
mid-call. TRYAGAIN only happens in the middle of a slot migration, and LOADING while a Redis reads
its data at start, in windows too coarse to aim at (Redis 6.2 answers between every 2 MB it
loads): those two are driven with the very reply, raised by a real script. (redis-py raises
LOADING as a ConnectionError, the class a lost connection has, which the 503 covers below.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from redis import Redis
from redis.exceptions import RedisError, ResponseError

from lease_server import client as client_module
from lease_server import errors
from lease_server.node.redis_proc import RedisProcess, free_port
from lease_server.store.engine import not_now
from lease_server.store.keys import Keys
from tests.conftest import ServerHandle, make_settings
from tests.redis_cluster import RedisCluster3

API = "/api/v1"


def routes(lease: Any) -> list[tuple[str, str, dict[str, Any] | None, str]]:
    """(method, path, body, whose token) over the API: writes, reads, an agent's."""
    return [
        ("POST", f"{API}/leases", {"gpus": 1}, "alice"),
        ("POST", f"{API}/leases/{lease.id}/renew", {"token": lease.token}, "alice"),
        ("DELETE", f"{API}/leases/{lease.id}", None, "alice"),
        ("POST", f"{API}/nodes/n1/samples", {"gpus": [{"index": 0, "util": 50}]}, "agent"),
        ("POST", f"{API}/nodes/n1/heartbeat", None, "agent"),
        (
            "POST",
            f"{API}/bookings",
            {"pool": "A100-80GB", "gpus": 1, "start": 4070908800, "end": 4070912400},
            "alice",
        ),
    ]


READS = [("GET", f"{API}/cluster", None, "alice"), ("GET", f"{API}/leases", None, "alice")]


def assert_503(
    srv: ServerHandle, calls: list[tuple[str, str, dict[str, Any] | None, str]], says: str | tuple[str, ...]
) -> None:
    """Every call answers 503 "retry", naming one of ``says`` (Redis's reason)."""
    says = (says,) if isinstance(says, str) else says
    for method, path, body, who in calls:
        token = srv.token(who, "agent" if who == "agent" else "user")
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as h:
            resp = h.request(method, path, json=body)
        assert resp.status_code == 503, f"{method} {path}: {resp.status_code} {resp.text}"
        assert resp.json()["code"] == "unavailable" and resp.headers["Retry-After"] == "1", resp.text
        message = resp.json()["message"]
        assert any(why in message for why in says) and "retry in a few seconds" in message, resp.text


@pytest.fixture
def own(tmp_path: Any, prefix: str) -> Iterator[tuple[RedisProcess, ServerHandle, Redis, Any]]:
    """A Redis and a lease server of the test's own, with one live lease of alice's."""
    proc = RedisProcess(tmp_path / "redis").start()
    srv = ServerHandle(make_settings(proc.url, prefix), "n1=2xA100-80GB").start()
    r = Redis.from_url(proc.url, decode_responses=True)
    lease = srv.client("alice").acquire(1)
    for who in ("alice", "agent"):
        srv.token(who, "agent" if who == "agent" else "user")  # made while Redis still takes writes
    yield proc, srv, r, lease
    srv.stop()
    r.close()
    proc.stop()


def snapshot(r: Redis, prefix: str) -> dict[str, Any]:
    k = Keys(prefix)
    return {"leases": r.hgetall(k.leases), "free": r.hgetall(k.free), "holders": r.hgetall(k.holders)}


def test_a_demoted_primary_answers_readonly_as_503(own: Any, prefix: str) -> None:
    proc, srv, r, lease = own
    before = snapshot(r, prefix)
    r.replicaof("127.0.0.1", free_port())  # a primary that is not there: the data stays, writes stop
    assert_503(srv, routes(lease), "READONLY")
    r.replicaof("NO", "ONE")
    assert snapshot(r, prefix) == before  # nothing changed
    srv.client("alice").renew(lease)  # and it works again


def test_a_replica_without_its_primary_answers_masterdown_as_503(own: Any) -> None:
    _proc, srv, r, lease = own
    r.config_set("replica-serve-stale-data", "no")
    r.replicaof("127.0.0.1", free_port())
    assert_503(srv, READS, "MASTERDOWN")
    # A function that writes meets the replica's read-only check first on Redis 7 and Valkey (a
    # script sent with EVALSHA on Redis 6 meets MASTERDOWN): either is the same 503.
    assert_503(srv, routes(lease), ("MASTERDOWN", "READONLY"))
    r.replicaof("NO", "ONE")


def test_a_primary_short_of_replicas_answers_noreplicas_as_503(own: Any, prefix: str) -> None:
    _proc, srv, r, lease = own
    before = snapshot(r, prefix)
    r.config_set("min-replicas-to-write", "1")
    writes = [c for c in routes(lease) if c[0] != "POST" or not c[1].endswith("heartbeat")]
    assert_503(srv, writes, "NOREPLICAS")
    r.config_set("min-replicas-to-write", "0")
    assert snapshot(r, prefix) == before


def test_the_client_resends_a_503_until_redis_takes_writes_again(own: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _proc, srv, r, lease = own
    r.config_set("min-replicas-to-write", "1")
    alice = srv.client("alice")
    with pytest.raises(errors.ServerUnavailable):  # resending for a bounded time, then the 503
        type(alice)(srv.url, srv.token("alice"), resend_503_s=0).renew(lease)
    # The request is resent while Redis refuses: let Redis take writes again once one was refused,
    # as the client waits out the 503's Retry-After. (Redis 7 and Valkey refuse a script that writes
    # before running it, so no MONITOR sees the refused call.)
    waits: list[float] = []

    class HealThenSleep:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(seconds)
            r.config_set("min-replicas-to-write", "0")
            time.sleep(seconds)

    monkeypatch.setattr(client_module, "time", HealThenSleep())
    renewed = alice.renew(lease)
    assert waits == [1.0] and renewed.id == lease.id


def test_a_cluster_that_lost_a_slot_answers_clusterdown_as_503(tmp_path: Any, prefix: str) -> None:
    cluster = RedisCluster3(tmp_path, primaries=1)
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes)
    srv = ServerHandle(make_settings(url, prefix), "n1=2xA100-80GB").start()
    try:
        lease = srv.client("alice").acquire(1)
        srv.token("agent", "agent")
        node = Redis(port=cluster.nodes[0].port, decode_responses=True)
        slot = node.cluster("keyslot", Keys(prefix).leases)
        node.execute_command("CLUSTER", "DELSLOTS", slot)
        assert_503(srv, routes(lease)[:3] + READS, "CLUSTERDOWN")
        node.close()
    finally:
        srv.stop()
        cluster.stop()


def test_a_connection_lost_mid_call_is_503(own: Any) -> None:
    proc, srv, _r, lease = own
    proc.kill()
    assert_503(srv, routes(lease) + READS, "cannot be reached")


@pytest.mark.parametrize("code", ["NOREPLICAS", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN"])
def test_every_not_now_reply_of_a_script_is_unavailable(redis_sync: Redis, code: str) -> None:
    """As a script raises it (the form NOREPLICAS took in the Sentinel run that answered 500)."""
    with pytest.raises(RedisError) as got:  # redis-py's class for the code (LOADING: BusyLoadingError)
        redis_sync.eval(f"return redis.error_reply('{code} as Redis says it')", 0)
    assert isinstance(not_now(got.value), errors.ServerUnavailable)
    with pytest.raises(ResponseError) as other:
        redis_sync.eval("return redis.error_reply('ERR a script bug')", 0)
    assert not_now(other.value) is None  # a real bug stays a 500, and is logged with its traceback
