"""The data layout has a version: a server meets data of another layout and refuses to start with one
line naming ``gpulease migrate``; ``--dry-run`` lists what changes; after the migration it starts and
reads the old data.

The old data is a real data directory written by the release at commit 77f5c60 (layout 0, before
versions): tests/data/layout0-77f5c60 (its make.py says how), one lease of alice's on 2 GPUs and one
request of bob's in the queue, its Redis killed as in a crash.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from redis import Redis

from lease_server.cli import main
from lease_server.node.redis_proc import RedisProcess
from lease_server.store import layout
from lease_server.store.keys import Keys
from lease_server.store.layout import LAYOUT
from tests.conftest import ServerHandle, make_settings

OLD = Path(__file__).parent / "data" / "layout0-77f5c60"


@pytest.fixture
def old_redis(tmp_path: Path) -> Any:
    shutil.copytree(OLD / "redis", tmp_path / "redis")
    proc = RedisProcess(tmp_path / "redis").start()
    yield proc
    proc.stop()


def test_a_layout_0_data_dir_is_refused_then_migrated_and_read(old_redis: RedisProcess) -> None:
    r = Redis.from_url(old_redis.url, decode_responses=True)
    keys = Keys("gpulease")
    lease_id = (OLD / "lease").read_text().strip()
    assert r.get(keys.layout) is None and r.hexists(keys.leases, lease_id)  # the old release's data
    settings = make_settings(old_redis.url, "gpulease")

    with pytest.raises(RuntimeError) as refused:
        ServerHandle(settings, "box=2xA100-80GB").start()
    said = str(refused.value)
    assert "has layout 0, from an older gpulease" in said and "gpulease migrate --redis-url URL --dry-run" in said

    cli = CliRunner()
    before = {k: r.type(k) for k in r.scan_iter("*")}
    dry = cli.invoke(main, ["migrate", "--redis-url", old_redis.url, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.output.splitlines()[0] == f"would migrate layout 0 -> {LAYOUT}:"
    assert "1 request(s) of 1 user(s)" in dry.output and "(dry run: nothing changed)" in dry.output
    assert {k: r.type(k) for k in r.scan_iter("*")} == before

    done = cli.invoke(main, ["migrate", "--redis-url", old_redis.url])
    assert done.exit_code == 0 and done.output.startswith(f"migrated layout 0 -> {LAYOUT}:"), done.output
    assert r.get(keys.layout) == str(LAYOUT) and r.hgetall(keys.waiting_by) == {"bob": "1"}
    # layout 5: the queued request's deadline indexed for the sweep
    assert "index the deadlines of the queued requests: 1 request(s)" in done.output
    (waiter,) = r.hkeys(keys.waiters)
    assert r.zrange(keys.wait_due, 0, -1, withscores=True) == [
        (waiter, json.loads(r.hget(keys.waiters, waiter))["deadline"])
    ]
    # layout 6: each pool's free GPUs summed from the fit index, as the scripts keep them from now on
    fit: dict[str, int] = {}
    for member in r.zrange(keys.fit, 0, -1):
        pool, count, _node = member.split("|", 2)
        fit[pool] = fit.get(pool, 0) + int(count)
    assert fit and r.hgetall(keys.pool_free) == {pool: str(n) for pool, n in fit.items()}
    assert f"sum each pool's free GPUs from the fit index: {len(fit)} pool(s)" in done.output
    again = cli.invoke(main, ["migrate", "--redis-url", old_redis.url])
    assert again.output.strip() == f"the data has layout {LAYOUT}, this release's: nothing to do"

    srv = ServerHandle(settings, "box=2xA100-80GB").start()
    try:
        admin = srv.client("root", "admin")
        old = admin.get(lease_id)  # the old lease, read (and ended by its TTL long ago, by now)
        assert old["user"] == "alice" and old["label"] == "layout-0 lease" and len(old["gpus"]) == 2
    finally:
        srv.stop()
    r.close()


def test_a_newer_layout_is_refused_and_a_fresh_store_gets_this_one(old_redis: RedisProcess, prefix: str) -> None:
    r = Redis.from_url(old_redis.url, decode_responses=True)
    keys = Keys("gpulease")
    r.set(keys.layout, LAYOUT + 1)
    with pytest.raises(RuntimeError, match=f"has layout {LAYOUT + 1}, written by a newer gpulease"):
        ServerHandle(make_settings(old_redis.url, "gpulease"), "box=2xA100-80GB").start()
    dry = CliRunner().invoke(main, ["migrate", "--redis-url", old_redis.url, "--dry-run"])
    assert dry.exit_code == 1 and "newer than this gpulease's" in dry.output
    # A prefix with no data (a token alone is none): the server writes this layout and starts.
    fresh = Keys(prefix)
    srv = ServerHandle(make_settings(old_redis.url, prefix), "box=2xA100-80GB")
    srv.token("alice")
    srv.start()
    srv.stop()
    assert r.get(fresh.layout) == str(LAYOUT)
    r.close()


def test_layout_1_bookings_move_to_their_new_key_names(redis_server: RedisProcess, prefix: str) -> None:
    """Layouts 0 and 1 kept bookings under resv, resv_idx and resv_due: a layout-1 store with bookings
    (one weekly, one served to a lease now) is refused, migrated, and its bookings read as before."""
    r = Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys(prefix)
    settings = make_settings(redis_server.url, prefix)
    srv = ServerHandle(settings, "box=2xA100-80GB").start()
    try:
        alice = srv.client("alice")
        now = time.time()
        weekly = alice.book("A100-80GB", 1, now + 86_400, now + 90_000, repeat="weekly", occurrences=3, note="w")
        current = alice.book("A100-80GB", 1, now - 60, now + 3600, note="now")
        lease = alice.acquire(1, ttl=600)
        assert lease.booking == current["id"]
        listed = alice.bookings(None, now - 86_400, now + 30 * 86_400)
    finally:
        srv.stop()
    # What a layout-1 release left: the same data under the old names.
    old = {name: f"{{{prefix}}}:{was}" for name, was in layout.RENAMED_IN_2.items()}
    for name, was in old.items():
        r.rename(getattr(keys, name), was)
    r.delete(keys.booking_occ, keys.booking_own)  # (indexes of layout 7)
    r.set(keys.layout, 1)
    stored = {was: r.type(was) for was in old.values()}
    assert stored == {old["bookings"]: "hash", old["booking_idx"]: "zset", old["booking_due"]: "zset"}

    with pytest.raises(RuntimeError, match="has layout 1, from an older gpulease"):
        ServerHandle(settings, "box=2xA100-80GB").start()
    cli, env = CliRunner(), {"GPULEASE_PREFIX": prefix}
    dry = cli.invoke(main, ["migrate", "--redis-url", redis_server.url, "--dry-run"], env=env)
    assert dry.exit_code == 0 and dry.output.splitlines()[0] == f"would migrate layout 1 -> {LAYOUT}:", dry.output
    assert f"{old['bookings']} -> {keys.bookings}" in dry.output and "(2 booking(s))" in dry.output
    assert r.exists(*old.values()) == 3 and not r.exists(keys.bookings, keys.booking_idx, keys.booking_due)

    done = cli.invoke(main, ["migrate", "--redis-url", redis_server.url], env=env)
    assert done.exit_code == 0 and done.output.startswith(f"migrated layout 1 -> {LAYOUT}:"), done.output
    assert r.get(keys.layout) == str(LAYOUT) and not r.exists(*old.values())
    assert r.hlen(keys.bookings) == 2 and r.zcard(keys.booking_idx) == 2 and r.zcard(keys.booking_due) == 2
    assert set(r.hkeys(keys.bookings)) == {weekly["id"], current["id"]}
    # layout 7: the occurrences not yet over indexed (a grant reads the bookings in force there), and
    # each owner's bookings
    assert "index the bookings' occurrences not yet over, and each owner's bookings: 2 booking(s), 4" in done.output
    assert sorted(m.split("|")[3] for m in r.zrange(keys.booking_occ, 0, -1)) == sorted(
        [current["id"]] + [weekly["id"]] * 3
    )
    assert sorted(m.split("|")[2] for m in r.zrange(keys.booking_own, 0, -1)) == sorted([weekly["id"], current["id"]])

    srv = ServerHandle(settings, "box=2xA100-80GB").start()
    try:
        alice = srv.client("alice")
        assert alice.bookings(None, now - 86_400, now + 30 * 86_400) == listed
        assert alice.get(lease.id)["reservation"] == current["id"]  # the lease still names its booking
        alice.release(lease)
        again = alice.acquire(1, ttl=600)  # served from the booking in force, found through the index
        assert again.booking == current["id"]
        alice.release(again)
        assert alice.end_booking(current["id"])["instances"][0]["state"] == "released"
    finally:
        srv.stop()
    r.close()


def test_a_store_with_bookings_under_both_names_stops_the_migration(redis_server: RedisProcess, prefix: str) -> None:
    r = Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys(prefix)
    r.set(keys.layout, 1)
    r.hset(f"{{{prefix}}}:resv", "r-0123456789ab", "{}")
    r.hset(keys.bookings, "r-ba9876543210", "{}")
    done = CliRunner().invoke(main, ["migrate", "--redis-url", redis_server.url], env={"GPULEASE_PREFIX": prefix})
    said = " ".join(done.output.split())
    assert done.exit_code != 0 and "both hold data" in said and "nothing was changed" in said, said
    assert r.get(keys.layout) == "1" and r.hkeys(f"{{{prefix}}}:resv") == ["r-0123456789ab"]
    r.close()


def test_layout_2_leases_get_their_recall_index(redis_server: RedisProcess, prefix: str) -> None:
    """Layout 3 indexes the leases a recall may take back (victims): a layout-2 store with live
    leases, one of them warm, is migrated to exactly the index the scripts keep, and a waiter then
    evicts the warm lease through it."""
    r = Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys(prefix)
    settings = make_settings(redis_server.url, prefix)
    srv = ServerHandle(settings, "box=2xA100-80GB").start()
    try:
        alice = srv.client("alice")
        warm, busy = alice.acquire(1, ttl=600), alice.acquire(1, ttl=600)
        alice.warm(warm)
    finally:
        srv.stop()
    built = r.zrange(keys.victims, 0, -1)
    assert sorted(m.split("|")[1] for m in built) == ["o", "w"]
    r.delete(keys.victims)  # what a layout-2 release left
    r.set(keys.layout, 2)

    with pytest.raises(RuntimeError, match="has layout 2, from an older gpulease"):
        ServerHandle(settings, "box=2xA100-80GB").start()
    cli, env = CliRunner(), {"GPULEASE_PREFIX": prefix}
    dry = cli.invoke(main, ["migrate", "--redis-url", redis_server.url, "--dry-run"], env=env)
    assert dry.exit_code == 0 and "index the live leases a recall may take back: 2 lease(s)" in dry.output, dry.output
    assert not r.exists(keys.victims)
    done = cli.invoke(main, ["migrate", "--redis-url", redis_server.url], env=env)
    assert done.exit_code == 0 and done.output.startswith(f"migrated layout 2 -> {LAYOUT}:"), done.output
    assert r.zrange(keys.victims, 0, -1) == built

    srv = ServerHandle(settings, "box=2xA100-80GB").start()
    try:
        got = srv.client("bob").acquire(1, wait=30)  # only the warm lease's GPU can serve it: evicted
        assert got.indexes == warm.indexes
        kinds = [e["type"] for e in srv.client("root", "admin").events(lease=warm.id)]
        assert "evicting" in kinds, kinds
        alice = srv.client("alice")
        alice.release(busy)
    finally:
        srv.stop()
    r.close()
