"""The queue: waiters are woken by grants, fair share by recent GPU-time, no starvation of large
requests, unsatisfiable requests fail at once, dead nodes are not granted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from lease_server import errors
from lease_server.leasing.board import cluster_view
from lease_server.leasing.inventory import parse_simulate, register
from lease_server.leasing.lease import LeaseStore
from lease_server.request import AcquireRequest
from lease_server.store.engine import Engine, connect
from tests.conftest import make_settings


@asynccontextmanager
async def store_for(redis_url: str, prefix: str, simulate: str, **kw: object) -> AsyncIterator[LeaseStore]:
    r = connect(redis_url)  # redis:// or, from tests/test_cluster.py, redis+cluster://
    store = LeaseStore(Engine(r, make_settings(redis_url, prefix, **kw)))
    await store.start()
    for inv in parse_simulate(simulate):
        await register(store.engine, inv)
    try:
        yield store
    finally:
        await store.close()
        await r.aclose()


def test_waiter_is_granted_when_gpus_are_released(redis_server, prefix):
    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=2xA100-80GB") as st:
            first = await st.acquire("alice", AcquireRequest(gpus=2))
            positions: list[int] = []
            waiter = asyncio.create_task(st.acquire("bob", AcquireRequest(gpus=1, wait=30), on_queued=positions.append))
            while not positions:
                await asyncio.sleep(0)  # let the waiter reach the queue (no wall-clock wait)
            assert positions == [1] and not waiter.done()
            await st.release(first["id"], "alice")
            got = await asyncio.wait_for(waiter, 10)
            assert got["user"] == "bob" and got["waited_ms"] >= 0
            assert got["token"] > first["token"]

    asyncio.run(main())


def test_wait_times_out_with_position_and_leaves_queue(redis_server, prefix):
    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=1xA100-80GB") as st:
            await st.acquire("alice", AcquireRequest(gpus=1))
            with pytest.raises(errors.NoCapacity) as exc:
                await st.acquire("bob", AcquireRequest(gpus=1, wait=0.3))
            assert "position 1" in exc.value.message
            assert await st.redis.zcard(st.keys.queue) == 0
            assert await st.redis.hlen(st.keys.waiters) == 0

    asyncio.run(main())


def test_fair_share_serves_the_lighter_user_first(redis_server, prefix):
    """Heavy used GPUs recently; light did not. Heavy queues first, light second: light wins."""

    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=1xA100-80GB") as st:
            # Heavy's history: 10 GPU-hours recorded through the virtual clock of the scripts.
            t = await st.redis.time()
            now = t[0] * 1000 + t[1] // 1000
            await st.redis.hset(st.keys.usage, "A100-80GB|heavy", json.dumps({"v": 36000, "t": now}))
            holder = await st.acquire("other", AcquireRequest(gpus=1))
            queued: list[str] = []
            heavy = asyncio.create_task(
                st.acquire("heavy", AcquireRequest(gpus=1, wait=30), on_queued=lambda p: queued.append("h"))
            )
            while not queued:
                await asyncio.sleep(0)
            light = asyncio.create_task(
                st.acquire("light", AcquireRequest(gpus=1, wait=30), on_queued=lambda p: queued.append("l"))
            )
            while len(queued) < 2:
                await asyncio.sleep(0)
            await st.release(holder["id"], "other")
            done, pending = await asyncio.wait({heavy, light}, return_when=asyncio.FIRST_COMPLETED, timeout=10)
            assert light in done and heavy in pending
            await st.release(light.result()["id"], "light")
            assert (await asyncio.wait_for(heavy, 10))["user"] == "heavy"

    asyncio.run(main())


def test_large_request_is_not_starved_by_small_ones(redis_server, prefix):
    """A 4-GPU request at the head holds back the node it needs; 1-GPU requests that keep coming
    are served on other nodes only, so the 4-GPU request gets its node when it drains."""

    async def main() -> None:
        async with store_for(redis_server.url, prefix, "big=4xA100-80GB,small=1xA100-80GB") as st:
            held = [await st.acquire("u1", AcquireRequest(gpus=1)) for _ in range(2)]  # best fit: 'small' then 'big'
            assert {h["node"] for h in held} == {"big", "small"}
            on_big = next(h for h in held if h["node"] == "big")
            on_small = next(h for h in held if h["node"] == "small")
            q: list[int] = []
            large = asyncio.create_task(st.acquire("u2", AcquireRequest(gpus=4, wait=30), on_queued=q.append))
            while not q:
                await asyncio.sleep(0)
            # A 1-GPU newcomer may not take the 3 free GPUs of 'big' (that would delay the head)...
            with pytest.raises(errors.NoCapacity):
                await st.acquire("u3", AcquireRequest(gpus=1))
            # ...but it may be backfilled on 'small' when that frees up.
            await st.release(on_small["id"], "u1")
            backfilled = await st.acquire("u3", AcquireRequest(gpus=1))
            assert backfilled["node"] == "small" and not large.done()
            await st.release(on_big["id"], "u1")
            got = await asyncio.wait_for(large, 10)
            assert got["node"] == "big" and len(got["gpus"]) == 4

    asyncio.run(main())


def test_unsatisfiable_and_unknown_pool_fail_at_once(redis_server, prefix):
    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=4xA100-80GB,b=2xT4-16GB") as st:
            with pytest.raises(errors.Unsatisfiable) as exc:
                await st.acquire("u", AcquireRequest(gpus=5, wait=60))
            assert "the largest has 4" in exc.value.message
            with pytest.raises(errors.UnknownPool) as exc2:
                await st.acquire("u", AcquireRequest(gpus=1, pool="H100", wait=60))
            assert "A100-80GB" in exc2.value.message and "T4-16GB" in exc2.value.message
            assert await st.redis.zcard(st.keys.queue) == 0

    asyncio.run(main())


def test_dead_node_is_never_granted_and_comes_back(redis_server, prefix):
    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=2xA100-80GB", heartbeat_timeout=3.0) as st:
            t = await st.redis.time()
            now = t[0] * 1000 + t[1] // 1000
            # The agent's heartbeat deadline passes (virtual clock 10 s ahead, inside the scripts).
            expired, down, *_ = await st.sweep(now_ms=now + 10_000)
            assert down == 1
            view = await cluster_view(st.engine)
            assert {g["state"] for g in view["nodes"][0]["gpus"]} == {"down"}
            with pytest.raises(errors.NoCapacity):
                await st.acquire("u", AcquireRequest(gpus=1))
            # A waiter is served as soon as the node's heartbeat returns.
            q: list[int] = []
            waiter = asyncio.create_task(st.acquire("u", AcquireRequest(gpus=2, wait=30), on_queued=q.append))
            while not q:
                await asyncio.sleep(0)
            assert await register(st.engine, None, "a") == "up"
            got = await asyncio.wait_for(waiter, 10)
            assert got["node"] == "a"

    asyncio.run(main())


def test_allocation_skips_a_node_whose_heartbeat_ran_out_before_any_sweep(redis_server, prefix):
    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=1xA100-80GB,b=2xA100-80GB") as st:
            # 'a' is the best fit for 1 GPU, but its heartbeat deadline is in the past.
            await st.redis.zadd(st.keys.alive, {"a": 1})
            got = await st.acquire("u", AcquireRequest(gpus=1))
            assert got["node"] == "b"
            assert (await cluster_view(st.engine))["nodes"][0]["state"] == "down"

    asyncio.run(main())
