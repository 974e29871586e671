"""The lease test suite's core against a real Redis Cluster of three primaries on loopback
(tests/redis_cluster.py): acquire, the queue, release, the sweep and bookings, through the
store and through the HTTP server, on ``redis+cluster://``. Every key carries the hash tag
``{prefix}``, so each test's keys, and every script, live in one slot of one primary."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import test_bookings as booking_tests
from tests import test_queue as queue_tests
from tests.conftest import ServerHandle, servers_on
from tests.redis_cluster import RedisCluster3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster3]:
    c = RedisCluster3(Path(tmp_path_factory.mktemp("cluster")))
    yield c
    c.stop()


@pytest.fixture
def cluster_servers(cluster: RedisCluster3, prefix: str) -> Iterator[Callable[..., ServerHandle]]:
    yield from servers_on(cluster.url, prefix)


@pytest.fixture
def cluster_sync(cluster: RedisCluster3) -> Iterator[Any]:
    from redis.cluster import RedisCluster

    r = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, decode_responses=True)
    yield r
    r.close()


def test_keys_of_a_deployment_share_one_slot(cluster: RedisCluster3) -> None:
    from redis.crc import key_slot

    from lease_server.store.keys import Keys

    keys = Keys("gpulease")
    assert len({key_slot(k.encode()) for k in [*keys.all(), keys.samples("n1/0")]}) == 1


QUEUE = [
    queue_tests.test_waiter_is_granted_when_gpus_are_released,
    queue_tests.test_wait_times_out_with_position_and_leaves_queue,
    queue_tests.test_fair_share_serves_the_lighter_user_first,
    queue_tests.test_large_request_is_not_starved_by_small_ones,
    queue_tests.test_unsatisfiable_and_unknown_pool_fail_at_once,
    queue_tests.test_dead_node_is_never_granted_and_comes_back,
]


@pytest.mark.parametrize("case", QUEUE, ids=lambda f: f.__name__.removeprefix("test_"))
def test_queue_on_a_redis_cluster(case: Callable[..., None], cluster: RedisCluster3, prefix: str) -> None:
    case(cluster, prefix)


SERVER = [
    booking_tests.test_clash_names_bookings_and_suggests_nearest_windows,
    booking_tests.test_holder_is_served_first_and_borrowed_leases_are_recalled_with_notice,
    booking_tests.test_board_shows_reserved_and_borrowed_gpus,
    booking_tests.test_end_early_gives_gpus_back,
]


@pytest.mark.parametrize("case", SERVER, ids=lambda f: f.__name__.removeprefix("test_"))
def test_server_on_a_redis_cluster(case: Callable[..., None], cluster_servers: Any) -> None:
    case(cluster_servers)


def test_bookings_and_bad_input_on_a_redis_cluster(cluster_servers: Any, cluster_sync: Any) -> None:
    booking_tests.test_create_list_get_edit_cancel(cluster_servers, cluster_sync)
    booking_tests.test_bad_input_is_refused_and_changes_nothing(cluster_servers, cluster_sync)


def test_two_pools_on_two_primaries_each_in_its_own_slot(
    cluster: RedisCluster3, cluster_sync: Any, prefix: str
) -> None:
    """Past one primary, as docs/scale.md says to shard today: a deployment per pool (or group of
    pools), each under its own prefix, so its own hash tag: every key and every script of a pool in
    one slot, the two slots on different primaries of one Redis Cluster. Grants in both, each
    deployment seeing only its pool."""
    import contextlib

    from redis import Redis
    from redis.crc import key_slot

    from lease_server.store.keys import Keys

    owner: dict[int, str] = {}
    for (lo, hi), node in cluster_sync.cluster_slots().items():
        for slot in range(int(lo), int(hi) + 1):
            owner[slot] = f"{node['primary'][0]}:{node['primary'][1]}"

    def slot_of(p: str) -> int:  # (servers_on puts its first server under the prefix + "s0")
        return key_slot(Keys(f"{p}s0").leases.encode())

    a = f"{prefix}a"
    b = next(f"{prefix}b{i}" for i in range(1000) if owner[slot_of(f"{prefix}b{i}")] != owner[slot_of(a)])
    with contextlib.ExitStack() as stack:
        made = {}
        for p, inventory in ((a, "n1=2xA100-80GB"), (b, "t1=2xT4-16GB")):
            gen = servers_on(cluster.url, p)
            made[p] = next(gen)(inventory)
            stack.callback(next, gen, None)  # (runs its teardown: stops the server)
        for p, pool in ((a, "A100-80GB"), (b, "T4-16GB")):
            with made[p].client("alice") as c:
                lease = c.acquire(2, pool)
                assert len(lease.gpus) == 2
                assert list(c.cluster()["pools"]) == [pool]  # each deployment sees its own pool only
                c.release(lease)
        slots = {}
        for p in (a, b):
            found: set[int] = set()
            for node in cluster.nodes:
                with Redis(port=node.port, decode_responses=True) as r:
                    found |= {key_slot(k.encode()) for k in r.scan_iter(match=Keys(f"{p}s0").pattern(), count=1000)}
            assert found == {slot_of(p)}, f"{p}: keys in slots {found}"
            slots[p] = slot_of(p)
        assert owner[slots[a]] != owner[slots[b]], f"both deployments on {owner[slots[a]]}"
