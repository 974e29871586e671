"""GET /cluster at department size: pages of the nodes, and one shared read of the cluster for every
reader of a server (board.ClusterViews), never older than the newest event when a reader asked."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from lease_server.leasing.board import ClusterViews, cluster_view, lease_nodes, node_index
from lease_server.store.engine import Engine, connect
from tests.conftest import ServerHandle

SIMULATE = "a1=2xA100-80GB,a2=2xA100-80GB,a3=2xA100-80GB,t1=2xT4-16GB"


@pytest.fixture
def srv(server_factory: Any) -> ServerHandle:
    return server_factory(SIMULATE)


def test_the_nodes_come_in_pages_and_the_counts_stay_whole(srv: ServerHandle) -> None:
    c = srv.client("alice")
    held = c.acquire(1, "T4-16GB")
    everything = c.cluster()
    assert [n["name"] for n in everything["nodes"]] == ["a1", "a2", "a3", "t1"]
    assert everything["nodes_total"] == 4 and everything["next"] is None
    pages, after = [], None
    while True:
        page = c.cluster(pool="A100-80GB", after=after, limit=2)
        assert page["pools"] == everything["pools"]  # every pool's counts on every page
        assert page["nodes_total"] == 3
        pages.append([n["name"] for n in page["nodes"]])
        after = page["next"]
        if after is None:
            break
    assert pages == [["a1", "a2"], ["a3"]]
    counts = c.cluster(limit=0)
    assert counts["nodes"] == [] and counts["nodes_total"] == 4 and counts["next"] is None
    assert counts["pools"]["T4-16GB"]["leased"] == 1
    t4 = c.cluster(pool="T4-16GB")["nodes"]
    assert [g["lease"]["id"] for g in t4[0]["gpus"] if g.get("lease")] == [held.id]
    assert c.cluster(after="a9")["nodes"][0]["name"] == "t1"  # any name: the nodes sorting after it


@pytest.mark.parametrize(
    "query, says",
    [
        ({"pool": "nope"}, "unknown pool 'nope'; pools: A100-80GB, T4-16GB"),
        ({"limit": "-1"}, "limit must be an integer between 0 and"),
        ({"limit": "many"}, "limit must be an integer between 0 and"),
        ({"after": "bad name!"}, "after"),
    ],
)
def test_a_bad_page_is_a_400_that_says_what_works(srv: ServerHandle, query: dict[str, str], says: str) -> None:
    resp = httpx.get(
        f"{srv.url}/api/v1/cluster", params=query, headers={"Authorization": f"Bearer {srv.token('alice')}"}
    )
    assert resp.status_code == 400, resp.text
    assert says in resp.json()["message"], resp.json()


def test_readers_share_one_read_and_never_see_a_view_older_than_their_request(srv: ServerHandle) -> None:
    c = srv.client("alice")

    async def main() -> None:
        r = connect(srv.settings.redis_url)
        views = ClusterViews(Engine(r, srv.settings), max_age_s=60)  # age never decides here: events do
        try:
            first = await asyncio.gather(*(views.get() for _ in range(50)))
            assert views.reads == 1 and all(s is first[0] for s in first)  # 50 readers, one read
            assert (await views.get()) is first[0]  # nothing happened since: the same one
            for _ in range(5):  # each change is seen by the very next read, by every reader
                lease = await asyncio.to_thread(c.acquire, 1, "A100-80GB")
                got = await asyncio.gather(*(views.get() for _ in range(20)))
                for snap in got:
                    held = [g for n in snap.view["nodes"] for g in n["gpus"] if (g.get("lease") or {}).get("id")]
                    assert lease.id in {g["lease"]["id"] for g in held}
                await asyncio.to_thread(c.release, lease)
                gone = await views.get()
                assert lease.id not in {(g.get("lease") or {}).get("id") for n in gone.view["nodes"] for g in n["gpus"]}
            assert views.reads <= 1 + 5 * 3, views.reads  # a read per change, not per reader
            same = await cluster_view(Engine(r, srv.settings))  # the shared view is what a read of its own says
            mine = (await views.get()).view
            assert [n["gpus"] for n in mine["nodes"]] == [n["gpus"] for n in same["nodes"]]
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_change_reads_again_only_the_nodes_it_touched(server_factory: Any) -> None:
    """Between two reads of the whole cluster, a snapshot is the last one with the nodes that the
    events since name read again (refreshed_view): after every kind of change it equals a whole
    read, the other nodes are the very same objects, and a booking makes the next read whole."""
    srv = server_factory("a1=2xA100-80GB,a2=2xA100-80GB,t1=2xT4-16GB", scheduling={"A100-80GB": {"share": True}})
    alice, bob = srv.client("alice"), srv.client("bob")

    async def main() -> None:
        r = connect(srv.settings.redis_url)
        engine = Engine(r, srv.settings)
        views = ClusterViews(engine, max_age_s=60, whole_every_s=600)  # events alone decide here
        try:
            first = await views.get()
            assert views.whole_reads == 1

            kept: list[Any] = []  # the last snapshot checked, and what it answered then

            async def same_as_a_whole_read(touched: set[str]) -> None:
                snap = await views.get()
                if kept:  # a newer snapshot leaves the older one as it was (readers may still hold it)
                    old, ids, where = kept.pop()
                    assert old is not snap
                    assert {u: old.lease_ids_of(u) for u in ("alice", "bob")} == ids and old.where() == where
                whole = await cluster_view(engine)
                assert snap.view["as_of_event"] == whole["as_of_event"]
                assert [n["gpus"] for n in snap.view["nodes"]] == [n["gpus"] for n in whole["nodes"]]
                assert [n["state"] for n in snap.view["nodes"]] == [n["state"] for n in whole["nodes"]]
                assert snap.view["pools"] == whole["pools"]
                assert snap.where() == lease_nodes(whole) and snap.index() == node_index(whole)
                for before, now in zip(first.view["nodes"], snap.view["nodes"], strict=True):
                    assert (before is now) == (now["name"] not in touched), now["name"]
                for user in ("alice", "bob"):  # the users' leases follow too (GET /leases)
                    found = set()
                    for n in whole["nodes"]:
                        for g in n["gpus"]:
                            if (g.get("lease") or {}).get("user") == user:
                                found.add(g["lease"]["id"])
                            found |= {sl["lease"] for sl in g.get("slices") or () if sl["user"] == user}
                    assert snap.lease_ids_of(user) == sorted(found)
                kept.append((snap, {u: snap.lease_ids_of(u) for u in ("alice", "bob")}, dict(snap.where())))

            t4 = await asyncio.to_thread(alice.acquire, 1, "T4-16GB", ttl=60)
            await same_as_a_whole_read({"t1"})
            await asyncio.to_thread(alice.warm, t4)
            await same_as_a_whole_read({"t1"})
            piece = await asyncio.to_thread(bob.acquire, 1, "A100-80GB", gpu_mem="10GB", ttl=60)
            await same_as_a_whole_read({"t1", piece.node})
            await asyncio.to_thread(alice.release, t4)
            await asyncio.to_thread(bob.release, piece)
            await same_as_a_whole_read({"t1", piece.node})
            assert views.whole_reads == 1 and views.reads > 1
            soon = time.time() + 3600
            await asyncio.to_thread(alice.book, "T4-16GB", 1, soon, soon + 3600)
            await views.get()
            assert views.whole_reads == 2  # reserved marks span a pool: read whole
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_view_is_read_again_once_it_is_older_than_its_age(srv: ServerHandle) -> None:
    """What changes without an event (a GPU's samples, a heartbeat) shows within max_age_s."""

    async def main() -> None:
        r = connect(srv.settings.redis_url)
        views = ClusterViews(Engine(r, srv.settings), max_age_s=0.2)
        try:
            one = current = await views.get()
            deadline = time.monotonic() + 0.25
            while time.monotonic() < deadline:  # the same view until it is 0.2 s old or an event comes
                snap = await views.get()
                if snap is not current:  # (the agent's first heartbeats may still be coming in)
                    newer = snap.view["as_of_event"] != current.view["as_of_event"]
                    assert newer or snap.at - current.at >= 0.2, (snap.at - current.at, snap.view["as_of_event"])
                    current = snap
                await asyncio.sleep(0.02)
            assert (await views.get()).at >= one.at + 0.2  # read again, whatever happened meanwhile
            # its clock goes on: "now" is the server's time at the answer, not at the read
            assert views._snap is not None and views._snap.now() >= float(one.view["now"]) + 0.2
        finally:
            await r.aclose()

    asyncio.run(main())


def test_my_leases_are_found_in_the_shared_view_and_read_fresh(server_factory: Any) -> None:
    """GET /leases (one's own, what every board asks after each event) finds the user's leases in
    the shared view and reads them by id: a whole GPU, a slice and a warm lease are there at once,
    another user's never, a release is gone at once, and a renewal shows its new expiry."""
    srv = server_factory("a1=2xA100-80GB,t1=2xT4-16GB", scheduling={"A100-80GB": {"share": True}})
    alice, bob = srv.client("alice"), srv.client("bob")
    whole = alice.acquire(1, "T4-16GB", ttl=60)
    piece = alice.acquire(1, "A100-80GB", gpu_mem="10GB", ttl=60)
    warm = alice.acquire(1, "T4-16GB", ttl=60)
    alice.warm(warm)
    theirs = bob.acquire(1, "A100-80GB", gpu_mem="10GB", ttl=60)
    assert [x["id"] for x in alice.leases()] == [whole.id, piece.id, warm.id]
    assert [x["id"] for x in bob.leases()] == [theirs.id]
    renewed = alice.renew(whole, ttl=300)
    mine = {x["id"]: x for x in alice.leases()}
    assert mine[whole.id]["expires_at"] == renewed.expires_at
    alice.release(piece)
    assert [x["id"] for x in alice.leases()] == [whole.id, warm.id]
    assert {x["id"] for x in alice.leases(everyone=True)} == {whole.id, warm.id, theirs.id}
