"""The event stream at department size (issue 37): a board's stream of changes gets one `changed`
event for many events, and a cell's stream of its lease gets that lease's events, found by id
(events.EventHub), so an event no longer costs a write to every open Lab and a wake-up of every
running cell."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from lease_server.leasing.events import CHANGED, EventHub
from lease_server.store.engine import Engine, connect
from tests.api_helpers import API, event_stream
from tests.conftest import ServerHandle


@pytest.fixture
def srv(server_factory: Any) -> ServerHandle:
    return server_factory("a1=2xA100-80GB")


async def _get(q: asyncio.Queue[Any]) -> Any:
    return await asyncio.wait_for(q.get(), timeout=10)


def test_the_hub_hands_each_follower_what_it_follows_and_changes_one_for_many(srv: ServerHandle) -> None:
    async def main() -> None:
        r = connect(srv.settings.redis_url)
        key = Engine(r, srv.settings).keys.events
        hub = EventHub(r, key, changes_every_s=0.3)
        try:
            everything = await hub.subscribe()
            changes = await hub.subscribe(changes=True)
            mine, other = await hub.subscribe(lease="l-mine"), await hub.subscribe(lease="l-other")
            assert hub.followers == 4

            def entry(kind: str, lease: str) -> dict[str, str]:
                return {"type": kind, "data": json.dumps({"lease": lease, "user": "alice", "ts": 1})}

            a = await r.xadd(key, entry("grant", "l-mine"))
            first = await _get(changes)  # the first event after a quiet spell: at once
            assert (first["type"], first["types"], first["events"], first["id"]) == (CHANGED, ["grant"], 1, a)
            async with r.pipeline(transaction=True) as pipe:  # two more in one read of the hub
                pipe.xadd(key, entry("released", "l-mine"))
                pipe.xadd(key, entry("reservation_created", "l-third"))
                b, c = await pipe.execute()
            assert [(await _get(everything))["id"] for _ in range(3)] == [a, b, c]
            second = await _get(changes)  # both in one, within 0.3 s of the first
            assert (second["types"], second["events"], second["id"]) == (["released", "reservation_created"], 2, c)
            assert [(await _get(mine))["id"] for _ in range(2)] == [a, b]
            d = await r.xadd(key, entry("grant", "l-other"))
            assert (await _get(other))["id"] == d  # and nothing of l-mine's or l-third's before it
            assert mine.empty()
            for q in (everything, changes, mine, other):
                hub.unsubscribe(q)
            assert hub.followers == 0
            await r.xadd(key, entry("grant", "l-mine"))
            assert mine.empty() and changes.empty()
        finally:
            await hub.stop()
            await r.aclose()

    asyncio.run(main())


def test_a_stream_of_changes_names_the_types_and_replays_no_backlog(srv: ServerHandle) -> None:
    c = srv.client("alice")
    old = c.acquire(1)  # in the log before the stream opens: never replayed to it
    with event_stream(srv, "alice", params={"changes": "true", "since": "-"}) as events:
        c.release(old)
        block = next(events)
        assert block["event"] == CHANGED
        data = json.loads(block["data"])
        assert "released" in data["types"] and "grant" not in data["types"], data
        assert data["events"] >= 1 and block["id"] == data["id"]


@pytest.mark.parametrize(
    "query, says",
    [
        ({"changes": "true", "lease": "l-1"}, "changes and lease cannot be combined"),
        ({"changes": "often"}, "changes must be true or false"),
    ],
)
def test_a_bad_stream_of_changes_is_a_400_that_says_what_works(
    srv: ServerHandle, query: dict[str, str], says: str
) -> None:
    resp = httpx.get(f"{srv.url}{API}/events", params=query, headers={"Authorization": f"Bearer {srv.token('alice')}"})
    assert resp.status_code == 400, resp.text
    assert says in resp.json()["message"], resp.json()
