"""Scheduling: per-pool schedulers, fair share by use over a long simulated period, quotas with
preemptible leases, priority preemption of preemptible victims only, elastic requests, the usage
ledger.

The real Lua scripts on a real Redis, driven through LeaseStore.run with a virtual clock (the
same path the policy simulator uses), so hours of scheduling take a fraction of a second."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections import defaultdict
from typing import Any

import pytest
from redis.asyncio import Redis as ARedis

from lease_server import errors
from lease_server.leasing.inventory import parse_simulate, register
from lease_server.leasing.lease import LeaseStore
from lease_server.store.engine import Engine
from lease_server.store.scripts import Acquire, Code, Release, Warm
from tests.api_helpers import API, assert_error, event_stream, http, next_event, queued, unchanged
from tests.conftest import make_settings

DAY_MS = 86_400_000


class Sim:
    """A LeaseStore on the test's Redis, with nodes that stay up for days of virtual time."""

    def __init__(self, st: LeaseStore, now: int) -> None:
        self.st, self.now, self.seq = st, now, 0

    async def acquire(
        self, user: str, n: int, *, wait_s: float = 0, prio: int = 1, n_min: int | None = None, teams: str = ""
    ) -> tuple[Code, Any, str]:
        self.seq += 1
        lid = f"l-{user}-{self.seq:05d}"
        call = Acquire(lid, user, "A100-80GB", n, 3_600_000, int(wait_s * 1000), "", "", teams, prio, n_min or n)
        code, rest = await self.st.engine.raw(call, now_ms=self.now)
        return code, (json.loads(rest[0]) if code is Code.OK else rest), lid

    async def release(self, lid: str) -> None:
        raw = await self.st.redis.hget(self.st.keys.leases, lid)
        user = json.loads(raw)["user"]
        await self.st.engine.raw(Release(lid, "", user, False, "released", "done", ""), now_ms=self.now)

    async def sweep(self) -> list[int]:
        return await self.st.sweep(now_ms=self.now)

    async def leases(self) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in (await self.st.redis.hgetall(self.st.keys.leases)).items()}

    async def events(self, kind: str) -> list[dict[str, Any]]:
        return [json.loads(f["data"]) for _i, f in await self.st.redis.xrange(self.st.keys.events) if f["type"] == kind]


@pytest.fixture
def sim_factory(redis_server, prefix):
    made: list[ARedis] = []

    async def make(simulate: str = "a=2xA100-80GB", **kw: Any) -> Sim:
        r = ARedis.from_url(redis_server.url, decode_responses=True)
        made.append(r)
        settings = make_settings(
            redis_server.url, f"{prefix}q{len(made)}", heartbeat_timeout=30 * 86400, heartbeat_interval=10, **kw
        )
        st = LeaseStore(Engine(r, settings))
        await st.publish_scheduling()
        for inv in parse_simulate(simulate):
            await register(st.engine, inv)
        return Sim(st, int(time.time() * 1000))

    return make


def test_fair_share_evens_out_gpu_time_over_a_long_period(sim_factory):
    """Two users submit bursts of equal 10-minute cells to 2 GPUs for 3 simulated hours; alice's
    bursts are twice as large and always a minute earlier. Both want more than half the GPUs, so
    fair share gives them equal GPU-time (within 10 %), where first-come-first-served would give
    alice about two thirds."""

    async def main(scheduler: str) -> dict[str, float]:
        sim = await sim_factory("a=2xA100-80GB", scheduling={"A100-80GB": {"scheduler": scheduler}})
        start = sim.now
        ends: dict[str, int] = {}  # lease id -> virtual end
        arrivals = []
        for burst in range(6):
            t = start + burst * 1_800_000
            arrivals += [(t, "alice")] * 8 + [(t + 60_000, "bob")] * 4
        horizon = start + 3 * 3_600_000
        while True:
            sim.now = min([a[0] for a in arrivals] + list(ends.values()) + [horizon])
            if sim.now >= horizon:
                break
            for lid in [lid for lid, e in ends.items() if e <= sim.now]:
                del ends[lid]
                await sim.release(lid)
            while arrivals and arrivals[0][0] <= sim.now:
                _t, user = arrivals.pop(0)
                await sim.acquire(user, 1, wait_s=86400)
            for lid in await sim.leases():
                if lid not in ends:
                    ends[lid] = sim.now + 600_000
        for lid in await sim.leases():  # GPU-time up to the horizon counts too
            await sim.release(lid)
        gpu_s: dict[str, float] = defaultdict(float)
        # GPU-time per user from the usage ledger (one entry per ended lease)
        for _id, f in await sim.st.redis.xrange(sim.st.keys.ledger):
            d = json.loads(f["data"])
            gpu_s[d["user"]] += d["held_s"] * d["gpus"]
        return gpu_s

    fair = asyncio.run(main("fair_share"))
    fifo = asyncio.run(main("fifo"))
    assert fair["alice"] + fair["bob"] == pytest.approx(2 * 3 * 3600)  # the GPUs never idled
    assert abs(fair["alice"] / (fair["alice"] + fair["bob"]) - 0.5) <= 0.05, fair  # within 10 % of equal
    # The same workload first-come-first-served: alice, always first with more, takes far more.
    assert fifo["alice"] / (fifo["alice"] + fifo["bob"]) > 0.6, fifo


def test_heavy_past_user_waits_behind_a_new_one(sim_factory):
    async def main() -> None:
        sim = await sim_factory("a=1xA100-80GB")
        _c, heavy, lid = await sim.acquire("alice", 1)
        sim.now += 3_600_000
        await sim.release(lid)
        _c, _l, dave = await sim.acquire("dave", 1)
        code, _pos, a2 = await sim.acquire("alice", 1, wait_s=600)
        sim.now += 1000
        code2, _pos, c1 = await sim.acquire("carol", 1, wait_s=600)
        assert code is Code.QUEUED and code2 is Code.QUEUED
        sim.now += 1000
        await sim.release(dave)
        holders = {lease["user"] for lease in (await sim.leases()).values()}
        assert holders == {"carol"}  # queued after alice, served first: alice used an hour recently

    asyncio.run(main())


def test_gpus_held_now_count_from_the_grant(sim_factory):
    """Bob used 1,000 GPU-seconds a while ago; alice was granted a GPU a second ago. Under fair
    share a GPU held now counts as the GPU-time it would add if held on (half-life / ln 2, 5,193
    GPU-s at one hour), so alice's second request waits behind bob's, though her lease has barely
    run yet."""

    async def main() -> None:
        sim = await sim_factory("a=2xA100-80GB")
        t = sim.now
        await sim.st.redis.hset(sim.st.keys.usage, "A100-80GB|bob", json.dumps({"v": 1000, "t": t, "r": 0}))
        _c, _l, other = await sim.acquire("carol", 1)
        await sim.acquire("alice", 1)
        sim.now += 1000
        await sim.acquire("alice", 1, wait_s=600)
        await sim.acquire("bob", 1, wait_s=600)
        await sim.release(other)
        users = sorted(lease["user"] for lease in (await sim.leases()).values())
        assert users == ["alice", "bob"]

    asyncio.run(main())


def test_a_sweeps_queued_trials_do_not_hide_later_requests(sim_factory):
    """A sweep of 70 one-GPU trials queued ahead of bob's request: dispatch ranks at most 4 waiters
    per user, so bob's request is seen (not only the 64 oldest waiters, all the sweep's) and, the
    sweep already holding a GPU, served first; when a whole node frees, the sweep's further trials
    take what is left over, oldest first."""

    async def main() -> None:
        sim = await sim_factory("a=3xA100-80GB,b=8xA100-80GB")
        await sim.acquire("sweep", 1)
        held = [(await sim.acquire("carol", 1))[2] for _ in range(2)]
        big = (await sim.acquire("carol", 8))[2]
        trials = [(await sim.acquire("sweep", 1, wait_s=3600))[2] for _ in range(70)]
        sim.now += 1000
        code, _pos, bob = await sim.acquire("bob", 1, wait_s=3600)
        assert code is Code.QUEUED
        await sim.release(held[0])
        assert bob in await sim.leases()
        # Eight GPUs free at once: the sweep's 4 ranked trials and 4 more of the overflow, oldest first.
        await sim.release(big)
        leases = await sim.leases()
        assert [lid for lid in trials if lid in leases] == trials[:8]

    asyncio.run(main())


def test_fifo_scheduler_serves_in_arrival_order(sim_factory):
    async def main() -> None:
        sim = await sim_factory("a=1xA100-80GB", scheduling={"A100-80GB": {"scheduler": "fifo"}})
        _c, _l, lid = await sim.acquire("alice", 1)
        sim.now += 3_600_000
        await sim.release(lid)
        _c, _l, dave = await sim.acquire("dave", 1)
        await sim.acquire("alice", 1, wait_s=600)
        sim.now += 1000
        await sim.acquire("carol", 1, wait_s=600)
        await sim.release(dave)
        assert {lease["user"] for lease in (await sim.leases()).values()} == {"alice"}

    asyncio.run(main())


def test_priority_scheduler_serves_higher_class_first(sim_factory):
    async def main() -> None:
        sim = await sim_factory("a=1xA100-80GB", scheduling={"A100-80GB": {"scheduler": "priority"}})
        _c, _l, dave = await sim.acquire("dave", 1)
        await sim.acquire("alice", 1, wait_s=600, prio=1)
        sim.now += 1000
        await sim.acquire("carol", 1, wait_s=600, prio=2)
        await sim.release(dave)
        assert {lease["user"] for lease in (await sim.leases()).values()} == {"carol"}

    asyncio.run(main())


def test_above_quota_runs_preemptible_and_is_recalled_for_an_in_quota_request(sim_factory):
    async def main() -> None:
        sim = await sim_factory("a=2xA100-80GB", scheduling={"A100-80GB": {"quota": {"*": 1}, "preempt_notice": 30}})
        _c, first, l1 = await sim.acquire("alice", 1)
        _c, second, l2 = await sim.acquire("alice", 1)
        assert not first.get("preemptible") and second["preemptible"] is True
        code, _pos, b = await sim.acquire("bob", 1, wait_s=600)
        assert code is Code.QUEUED
        [notice] = await sim.events("preempt_notice")
        assert notice["lease"] == l2 and notice["requested_by"] == "bob"
        assert notice["recall_at"] == sim.now + 30_000
        sim.now += 29_000
        await sim.sweep()
        assert l2 in await sim.leases()  # the notice period is honoured
        sim.now += 1_000
        await sim.sweep()
        leases = await sim.leases()
        assert l2 not in leases and leases[b]["user"] == "bob" and not leases[b].get("preemptible")
        assert (await sim.st.get(l2))["state"] == "revoked"
        # A request above quota never preempts: carol (within quota) and alice's in-quota lease stay.
        code, _pos, _a3 = await sim.acquire("alice", 1, wait_s=600)
        assert code is Code.QUEUED and await sim.events("preempt_notice") == [notice]

    asyncio.run(main())


def test_preemption_takes_only_preemptible_victims_fewest_gpu_seconds_first(sim_factory):
    async def main() -> None:
        sim = await sim_factory(
            "a=4xA100-80GB",
            scheduling={"A100-80GB": {"scheduler": "priority", "quota": {"*": 1}, "preempt_notice": 10}},
        )
        _c, _l, kept = await sim.acquire("alice", 1)  # in quota: never a victim
        _c, old, old_id = await sim.acquire("alice", 1)  # preemptible, 1 GPU, will be 300 s old
        sim.now += 250_000
        _c, young, young_id = await sim.acquire("alice", 2)  # preemptible, 2 GPUs, 50 s old: 100 GPU-s
        assert old["preemptible"] and young["preemptible"]
        sim.now += 50_000
        # old: 300 GPU-s of lost work, young: 2 x 50 = 100 GPU-s: young goes, although it has more GPUs.
        code, _pos, bob = await sim.acquire("bob", 1, wait_s=600, prio=2)
        assert code is Code.QUEUED
        victims = [e["lease"] for e in await sim.events("preempt_notice")]
        assert victims == [young_id]
        sim.now += 10_000
        await sim.sweep()
        leases = await sim.leases()
        assert set(leases) == {kept, old_id, bob}
        # A low-priority in-quota request may not preempt a normal-priority preemptible lease.
        code, _pos, _c2 = await sim.acquire("carol", 2, wait_s=600, prio=0)  # 1 free: needs a victim
        assert code is Code.QUEUED and [e["lease"] for e in await sim.events("preempt_notice")] == [young_id]

    asyncio.run(main())


def test_a_warm_eviction_weighs_every_warm_lease_of_a_node_it_considers(sim_factory):
    """A warm eviction reads the newest 16 warm leases of the pool and weighs their nodes. A node
    among those that holds older warm leases too is read whole, so they count: here only all 8 of
    node b's warm leases, 2 of them older than the 16 read, free a node whole as c's 8 do, and b
    comes first by name. Had b's 2 oldest gone uncounted, c's would have been evicted."""

    async def main() -> None:
        sim = await sim_factory(
            "b=8xA100-80GB,c=8xA100-80GB,d=8xA100-80GB", scheduling={"A100-80GB": {"warm_evict_notice": 5}}
        )

        async def lease(user: str, warm: bool) -> str:
            sim.now += 1000  # each newer than the last: the recall index orders warm leases newest first
            code, rec, lid = await sim.acquire(user, 1)
            assert code is Code.OK
            if warm:
                await sim.st.engine.run(Warm(lid, "", user, True), now_ms=sim.now)
            return str(rec["node"])

        # best fit fills b, then c, then d
        on_b = [await lease("ub", True) for _ in range(8)]
        on_c = [await lease("uc", True) for _ in range(8)]
        on_d = [await lease("ud", True) for _ in range(2)] + [await lease("ud2", False) for _ in range(6)]
        assert set(on_b) == {"b"} and set(on_c) == {"c"} and set(on_d) == {"d"}
        sim.now += 1000
        code, _pos, zed = await sim.acquire("zed", 8, wait_s=600)
        assert code is Code.QUEUED
        evicted = await sim.events("evicting")
        assert {e["node"] for e in evicted} == {"b"} and len(evicted) == 8
        leases = await sim.leases()
        assert {e["lease"] for e in evicted} == {lid for lid, rec in leases.items() if rec["user"] == "ub"}
        waiter = json.loads(await sim.st.redis.hget(sim.st.keys.waiters, zed))
        assert waiter["recall_node"] == "b"

    asyncio.run(main())


def test_a_warm_eviction_never_chooses_a_node_that_is_down(sim_factory):
    """Nodes b and c hold 8 warm leases each: either frees a node whole, and b would come first by
    name. b's agent has gone silent and the sweep has marked it down, so c's are evicted."""

    async def main() -> None:
        sim = await sim_factory("b=8xA100-80GB,c=8xA100-80GB", scheduling={"A100-80GB": {"warm_evict_notice": 5}})
        for user in ["ub"] * 8 + ["uc"] * 8:  # best fit fills b, then c
            sim.now += 1000
            code, _rec, lid = await sim.acquire(user, 1)
            assert code is Code.OK
            await sim.st.engine.run(Warm(lid, "", user, True), now_ms=sim.now)
        await sim.st.redis.zadd(sim.st.keys.alive, {"b": sim.now - 1})  # b's heartbeat ran out
        await sim.sweep()
        assert [e["node"] for e in await sim.events("node_down")] == ["b"]
        code, _pos, _zed = await sim.acquire("zed", 8, wait_s=600)
        assert code is Code.QUEUED
        evicted = await sim.events("evicting")
        assert {e["node"] for e in evicted} == {"c"} and len(evicted) == 8

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(40))
def test_a_warm_eviction_chooses_what_reading_every_candidate_whole_would(sim_factory, seed):
    """The same random pool played twice: where the pool shares, a warm eviction reads each
    candidate node whole (its holders, every lease on it); where it does not, it settles a node from
    the recall index's entries when they are all its warm leases. Every eviction and every node held
    for a waiter must be the same, with more warm leases than the 16 entries read and with leases
    already being recalled. (Of these 40 pools, 6 tell a node settled without all its warm leases
    from one read whole, and 30 miss the GPUs coming free from leases being recalled.)"""

    async def main() -> None:
        rng = random.Random(seed)
        spec = ",".join(f"n{i}=8xA100-80GB" for i in range(rng.randint(3, 6)))
        plays = []
        for share in (True, False):
            sim = await sim_factory(spec, scheduling={"A100-80GB": {"warm_evict_notice": 60, "share": share}})
            plays.append(sim)
        plays[1].now = plays[0].now
        sizes = [rng.choice((1, 1, 1, 1, 2, 2, 4)) for _ in range(60)]
        warm = [rng.random() < 0.7 for _ in sizes]
        asks = [rng.choice((1, 2, 4, 8, 8)) for _ in range(rng.randint(2, 5))]
        seen = []
        for sim in plays:
            got: list[Any] = []
            for i, (n, w) in enumerate(zip(sizes, warm, strict=True)):
                sim.now += 1000
                user = f"u{i % 7}"
                code, _rec, lid = await sim.acquire(user, n)
                got.append(code)
                if code is Code.OK and w:
                    await sim.st.engine.run(Warm(lid, "", user, True), now_ms=sim.now)
            for k, n in enumerate(asks):
                sim.now += 1000
                code, _pos, lid = await sim.acquire(f"w{k}", n, wait_s=600)
                raw = await sim.st.redis.hget(sim.st.keys.waiters, lid)
                got.append((code, json.loads(raw).get("recall_node") if raw else None))
            got.append([(e["lease"], e["node"]) for e in await sim.events("evicting")])
            seen.append(got)
        assert seen[0] == seen[1]

    asyncio.run(main())


def test_elastic_request_gets_what_is_free_between_min_and_max(sim_factory):
    async def main() -> None:
        sim = await sim_factory("a=4xA100-80GB,b=2xA100-80GB")
        _c, _l, big = await sim.acquire("dave", 3)  # a: 1 free, b: 2 free
        code, lease, _id = await sim.acquire("alice", 4, n_min=1)
        assert code is Code.OK and len(lease["gpus"]) == 2 and lease["elastic"] == {"min": 1, "max": 4}
        code, pos, waiting = await sim.acquire("bob", 4, n_min=2, wait_s=600)
        assert code is Code.QUEUED  # 1 GPU free now: below bob's minimum
        await sim.release(big)
        leases = await sim.leases()
        assert len(leases[waiting]["gpus"]) == 4  # node a is whole again
        code, rest, _ = await sim.acquire("carol", 9, n_min=7)
        assert code is Code.UNSATISFIABLE

    asyncio.run(main())


def test_ledger_records_each_call_with_utilization(sim_factory):
    async def main() -> None:
        from lease_server.leasing.reclaim import record_samples

        sim = await sim_factory("a=2xA100-80GB")
        now = sim.now
        args = Acquire("l-ledger-0001", "alice", "A100-80GB", 2, 60_000, 0, "cell:3f2a", "nb/train.ipynb", "ml", 1, 2)
        code, _rest = await sim.st.engine.raw(args, now_ms=now)
        assert code is Code.OK
        for i, util in enumerate([90, 0, 80, 0]):
            await record_samples(
                sim.st.engine,
                "a",
                "A100-80GB",
                [{"index": 0, "util": util, "mem_mb": 1000 + i}, {"index": 1, "util": util, "mem_mb": 500}],
                threshold=5,
                now_ms=now + i * 1000,
            )
        sim.now = now + 100_000
        await sim.release("l-ledger-0001")
        [(_id, f)] = await sim.st.redis.xrange(sim.st.keys.ledger)
        d = json.loads(f["data"])
        assert d["user"] == "alice" and d["teams"] == "ml" and d["session"] == "nb/train.ipynb"
        assert d["label"] == "cell:3f2a" and d["gpus"] == 2 and d["held_s"] == 100
        assert d["util_mean"] == pytest.approx(42.5) and d["busy_frac"] == 0.5 and d["mem_peak_mb"] == 1003
        # half idle at idle_weight 1.5: 200 GPU-s x (0.5 + 1.5 x 0.5) = 250 charged
        assert d["charged_gpu_s"] == pytest.approx(250)

    asyncio.run(main())


def test_http_acquire_with_priority_and_gpus_min(server_factory, redis_sync):
    srv = server_factory("a=4xA100-80GB", high_priority=["alice", "team:ops"], teams={"ops": ["dan"]})
    # "high" is the requester's own word: only the users and teams the setting names may say it
    with http(srv, "bob") as bob, unchanged(redis_sync, srv.settings.prefix):
        resp = bob.post(f"{API}/leases", json={"gpus": 1, "priority": "high"})
        assert_error(resp, 403, "forbidden", "high_priority", "alice, team:ops and admins", "ask without")
    with http(srv, "dan") as dan:
        resp = dan.post(f"{API}/leases", json={"gpus": 1, "priority": "high"})
        assert resp.status_code == 201 and resp.json()["priority"] == "high", resp.text
        assert dan.delete(f"{API}/leases/{resp.json()['id']}", params={"verified": "true"}).status_code == 200
    with http(srv, "alice") as alice:
        resp = alice.post(f"{API}/leases", json={"gpus": 8, "gpus_min": 2, "priority": "high"})
        assert resp.status_code == 201, resp.text
        lease = resp.json()
        assert len(lease["gpus"]) == 4 and lease["elastic"] == {"min": 2, "max": 8} and lease["priority"] == "high"
        assert_error(alice.post(f"{API}/leases", json={"gpus": 2, "gpus_min": 3}), 400, "bad_request", "gpus_min")
        assert_error(alice.post(f"{API}/leases", json={"gpus": 1, "priority": "urgent"}), 400, "bad_request", "low")
        assert_error(alice.post(f"{API}/leases", json={"gpus": 1, "gpus_min": 0}), 400, "bad_request", "gpus_min")
    with pytest.raises(errors.NoCapacity):
        srv.client("bob").acquire(1)


def test_usage_report_and_time_to_gpu_estimate_over_http(server_factory):
    srv = server_factory("a=2xA100-80GB,t=2xT4-16GB", teams={"ml": ["alice"]})
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        for label in ("cell:aa", "cell:bb"):
            lease = alice.post(f"{API}/leases", json={"gpus": 1, "label": label, "session": "nb/train.ipynb"}).json()
            alice.delete(f"{API}/leases/{lease['id']}")
        lease = bob.post(f"{API}/leases", json={"gpus": 2, "pool": "T4-16GB"}).json()
        bob.delete(f"{API}/leases/{lease['id']}")
        by_user = {r["user"]: r for r in alice.get(f"{API}/usage").json()["rows"]}
        assert by_user["alice"]["calls"] == 2 and by_user["bob"]["calls"] == 1
        by_team = {r["team"]: r for r in alice.get(f"{API}/usage", params={"by": "team"}).json()["rows"]}
        assert by_team["ml"]["calls"] == 2 and by_team["(no team)"]["calls"] == 1
        by_nb = alice.get(f"{API}/usage", params={"by": "notebook", "pool": "A100-80GB"}).json()["rows"]
        assert [(r["notebook"], r["calls"]) for r in by_nb] == [("nb/train.ipynb", 2)]
        # The magic names the notebook and the cell's hash; the ledger keeps both.
        lease = alice.post(f"{API}/leases", json={"gpus": 1, "notebook": "eval.ipynb", "cell": "3f2a9c1b"}).json()
        assert lease["notebook"] == "eval.ipynb" and lease["cell"] == "3f2a9c1b"
        alice.delete(f"{API}/leases/{lease['id']}")
        by_nb = {r["notebook"]: r for r in alice.get(f"{API}/usage", params={"by": "notebook"}).json()["rows"]}
        assert by_nb["eval.ipynb"]["calls"] == 1
        assert_error(alice.post(f"{API}/leases", json={"gpus": 1, "cell": 7}), 400, "bad_request", "cell")
        assert (
            alice.get(f"{API}/usage", params={"from": time.time() + 60, "to": time.time() + 120}).json()["rows"] == []
        )
        assert_error(alice.get(f"{API}/usage", params={"by": "colour"}), 400, "bad_request", "user, team")

        est = alice.get(f"{API}/estimate", params={"pool": "A100-80GB", "gpus": 2}).json()
        assert est["estimate_s"] == 0 and "free now" in est["text"] and est["wait"] == "any moment now"
        held = bob.post(f"{API}/leases", json={"gpus": 2, "pool": "A100-80GB"}).json()
        est = alice.get(f"{API}/estimate", params={"pool": "A100-80GB", "gpus": 1}).json()
        assert est["free_now"] == 0 and est["estimate_s"] > 0 and "typically" in est["text"]
        assert {"pool": "T4-16GB", "free": 2, "text": "2 x T4-16GB free now"} in est["alternatives"]
        bob.delete(f"{API}/leases/{held['id']}")
        assert_error(alice.get(f"{API}/estimate", params={"gpus": "-1"}), 400, "bad_request", "gpus")
        assert_error(alice.get(f"{API}/estimate", params={"pool": "H100"}), 404, "unknown_pool")
        # more than any node has: refused as the acquire refuses it, not an estimate of a wait without end
        too_many = {"pool": "A100-80GB", "gpus": 3}
        assert_error(alice.get(f"{API}/estimate", params=too_many), 422, "unsatisfiable", "the largest has 2")
        # a gang: as many nodes of the pool with gpus / nodes GPUs each, checked as the acquire checks it
        gang = {"pool": "A100-80GB", "gpus": 2, "nodes": 2}
        assert_error(alice.get(f"{API}/estimate", params=gang), 422, "unsatisfiable", "only 1 of its nodes has")
        assert_error(alice.post(f"{API}/leases", json=gang), 422, "unsatisfiable", "only 1 of its nodes has")
        odd = {"pool": "A100-80GB", "gpus": 3, "nodes": 2}
        assert_error(alice.get(f"{API}/estimate", params=odd), 400, "bad_request", "multiple of nodes")
        assert_error(alice.get(f"{API}/estimate", params={"nodes": 0}), 400, "bad_request", "nodes")


def test_estimate_counts_only_the_requests_ahead_of_the_asking_one(server_factory):
    """The first request in the queue, behind nothing but running leases, is not told that one
    request is ahead of it (itself): it hears what it really waits for."""
    srv = server_factory("a=2xA100-80GB")
    with http(srv, "bob") as bob, http(srv, "alice") as alice:
        bob.post(f"{API}/leases", json={"gpus": 2, "ttl": 600}).json()
        with queued(srv, "alice", "alice-est-0001"), queued(srv, "carol", "carol-est-0001"):
            est = alice.get(f"{API}/estimate", params={"lease": "alice-est-0001"}).json()
            assert (est["position"], est["queued_ahead"], est["queued_gpus_ahead"]) == (1, 0, 0), est
            assert est["pool"] == "A100-80GB" and est["gpus"] == 1  # the request's own pool and size
            assert "request(s)" not in est["text"], est["text"]
            assert "nothing queued ahead" in est["text"] and "held by running calls" in est["text"], est["text"]
            assert est["held_gpus"] == 2 and est["estimate_s"] > 0
            # Carol, behind alice, counts alice only; ?id= is the same as ?lease=.
            est = alice.get(f"{API}/estimate", params={"id": "carol-est-0001"}).json()
            assert (est["position"], est["queued_ahead"], est["queued_gpus_ahead"]) == (2, 1, 1), est
            assert "1 request(s) (1 GPUs) ahead" in est["text"]
            # Asked for a request not yet queued: everyone queued is ahead of it.
            est = alice.get(f"{API}/estimate", params={"pool": "A100-80GB", "gpus": 1}).json()
            assert (est["position"], est["queued_ahead"]) == (None, 2)
            for bad in ({"lease": "bad id!"}, {"id": "x" * 65}, {"lease": "alice-est-0001", "id": "carol-est-0001"}):
                assert_error(alice.get(f"{API}/estimate", params=bad), 400, "bad_request")
        # (leaving the blocks withdraws both waiting requests)


def test_estimate_names_when_a_lease_with_a_fixed_end_frees_the_gpus(server_factory):
    """An idle-warned lease ends at its reclaim time: the first waiter is told so, in seconds."""
    srv = server_factory("a=1xA100-80GB", sample_interval=0.1, idle_timeout=1.0, min_age=0.0, idle_threshold=5.0)
    srv.client("root", "admin").request("PUT", "/api/v1/policy/A100-80GB", json={"grace": 60.0})
    with http(srv, "bob") as bob, http(srv, "alice") as alice:
        held = bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        with event_stream(srv, "watcher", params={"lease": held["id"]}) as events:
            next_event(events, "idle_warning", held["id"])  # its simulated GPU sits idle
        with queued(srv, "alice", "alice-est-0002"):
            est = alice.get(f"{API}/estimate", params={"lease": "alice-est-0002"}).json()
            assert est["queued_ahead"] == 0 and 0 < est["estimate_s"] <= 60, est
            assert "waiting for a running lease to end (the soonest ends in about" in est["text"], est["text"]


def test_estimate_counts_on_a_deadline_not_renewed_a_declared_end_and_a_bookings_end(server_factory):
    """The estimate uses the holders' known ends, not the pool's typical cell (600 s with no
    history): a lease its holder no longer renews ends at its deadline, a --timeout declared at
    the acquire (ends_within) ends it by then, a GPU reserved for a booking is back at the booking's
    end; and it says who holds what, the soonest known end first, the asker's own marked."""
    srv = server_factory("a=3xA100-80GB")
    with http(srv, "bob") as bob, http(srv, "carol") as carol, http(srv, "alice") as alice:
        short = bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 4}).json()  # never renewed
        timed = carol.post(f"{API}/leases", json={"gpus": 1, "ttl": 600, "ends_within": 40}).json()
        assert 39 <= timed["ends_by"] - timed["created_at"] <= 40.5, timed
        mine = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 4}).json()  # renewed
        est = alice.get(f"{API}/estimate", params={"gpus": 1}).json()
        # Bob's lease is young: nothing says yet that it is not renewed. Carol's ends within 40 s.
        assert 30 <= est["estimate_s"] <= 40.5, est
        by_user = {h["user"]: h for h in est["holders"]}
        assert by_user["carol"]["end"] == "timeout" and 30 <= by_user["carol"]["ends_in"] <= 40.5, est
        assert "ends_in" not in by_user["bob"] and by_user["bob"]["gpus"] == 1, est
        assert by_user["alice"].get("mine") is True and "mine" not in by_user["carol"], est
        assert est["holders"][0]["user"] == "carol"  # the soonest known end first
        # Past half its TTL without a renewal, bob's lease ends by its deadline: that is the wait.
        time.sleep(max(0.0, short["expires_at"] - 1.8 - time.time()))
        alice.post(f"{API}/leases/{mine['id']}/renew", json={"token": mine["token"]}).raise_for_status()
        est = alice.get(f"{API}/estimate", params={"gpus": 1}).json()
        assert est["estimate_s"] <= 2.0, est
        first = est["holders"][0]
        assert (first["user"], first["end"]) == ("bob", "expiry") and first["ends_in"] <= 2.0, est
        assert "the soonest ends in about" in est["text"], est["text"]
        assert "ends_in" not in {h["user"]: h for h in est["holders"]}["alice"], est  # renewed: no end
        alice.delete(f"{API}/leases/{mine['id']}")
        bob.delete(f"{API}/leases/{short['id']}")
    # A GPU reserved for a booking in force is back at the booking's end.
    with http(srv, "dana") as dana, http(srv, "erin") as erin:
        now = time.time()
        booking = {"pool": "A100-80GB", "gpus": 1, "start": now - 60, "end": now + 120}
        dana.post(f"{API}/bookings", json=booking).raise_for_status()
        erin_lease = erin.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()  # the one left free
        est = erin.get(f"{API}/estimate", params={"gpus": 1}).json()
        by_user = {h["user"]: h for h in est["holders"]}
        assert by_user["dana"]["booked"] == 1 and by_user["dana"]["end"] == "booking", est
        assert 100 <= by_user["dana"]["ends_in"] <= 121, est
        assert [h["user"] for h in est["holders"]] == ["carol", "dana", "erin"], est  # known ends first
        erin.delete(f"{API}/leases/{erin_lease['id']}")


def test_multi_node_gang_is_all_or_nothing(sim_factory):
    async def main() -> None:
        sim = await sim_factory("a=4xA100-80GB,b=4xA100-80GB,c=2xA100-80GB")
        _c, _l, other = await sim.acquire("dave", 2)  # c (best fit) is now full
        _c, blocker, b_id = await sim.acquire("dave", 2)  # a or b now has only 2 free
        args = Acquire("l-gang-00001", "alice", "A100-80GB", 8, 60_000, 600_000, "", "", "", 1, 8, 2)
        code, rest = await sim.st.engine.raw(args, now_ms=sim.now)
        assert code is Code.QUEUED  # 4 + 2 free on two nodes: nothing is granted, not even half
        assert all(len(lease["gpus"]) == 2 for lease in (await sim.leases()).values())
        await sim.release(b_id)
        leases = await sim.leases()
        gang = leases["l-gang-00001"]
        assert sorted(gang["nodes"]) == ["a", "b"] and len(gang["gpus"]) == 8
        assert sorted((g["node"], g["index"]) for g in gang["gpus"]) == [(n, i) for n in "ab" for i in range(4)]
        await sim.release("l-gang-00001")
        view = await sim.st.redis.hgetall(sim.st.keys.free)
        assert json.loads(view["a"]) == [0, 1, 2, 3] and json.loads(view["b"]) == [0, 1, 2, 3]
        assert await sim.st.redis.hlen(sim.st.keys.holders) == 2  # only dave's other lease, on c
        # 3 nodes with 3 GPUs each do not exist: refused at once
        args = dataclasses.replace(args, id="l-gang-00002", gpus=9, gpus_min=9, nodes=3)
        code, rest = await sim.st.engine.raw(args, now_ms=sim.now)
        assert code is Code.UNSATISFIABLE and int(rest[1]) == 2
        assert other

    asyncio.run(main())


def test_gang_over_http_and_its_bad_input(server_factory):
    srv = server_factory("a=2xA100-80GB,b=2xA100-80GB")
    with http(srv, "alice") as alice:
        lease = alice.post(f"{API}/leases", json={"gpus": 4, "nodes": 2}).json()
        assert sorted(lease["nodes"]) == ["a", "b"] and {g["node"] for g in lease["gpus"]} == {"a", "b"}
        view = alice.get(f"{API}/cluster").json()
        assert view["pools"]["A100-80GB"]["leased"] == 4
        assert alice.delete(f"{API}/leases/{lease['id']}").json()["state"] == "released"
        assert alice.get(f"{API}/cluster").json()["pools"]["A100-80GB"]["free"] == 4
        assert_error(alice.post(f"{API}/leases", json={"gpus": 3, "nodes": 2}), 400, "bad_request", "multiple")
        assert_error(
            alice.post(f"{API}/leases", json={"gpus": 4, "gpus_min": 2, "nodes": 2}),
            400,
            "bad_request",
            "all or nothing",
        )
        assert_error(alice.post(f"{API}/leases", json={"gpus": 6, "nodes": 3}), 422, "unsatisfiable", "only 2")
        assert_error(alice.post(f"{API}/leases", json={"gpus": 2, "nodes": 0}), 400, "bad_request", "nodes")


def test_cpu_pool_is_leased_but_never_the_default_gpu_pool(server_factory):
    srv = server_factory("a=2xA100-80GB,c=8xCPU")
    with http(srv, "alice") as alice:
        info = alice.get(f"{API}/info").json()
        assert info["default_pool"] == "A100-80GB" and info["cpu_pool"] == "CPU"  # although CPU is larger
        view = alice.get(f"{API}/cluster").json()
        assert view["cpu_pool"] == "CPU" and view["pools"]["CPU"]["kind"] == "cpu"
        assert view["pools"]["A100-80GB"]["kind"] == "gpu"
        lease = alice.post(f"{API}/leases", json={"gpus": 1}).json()
        assert lease["pool"] == "A100-80GB"
        slot = alice.post(f"{API}/leases", json={"gpus": 1, "pool": "CPU"}).json()
        assert slot["pool"] == "CPU" and slot["node"] == "c"
        # CPU slots report no utilization: idle reclaim is off there (on for GPUs)
        pols = alice.get(f"{API}/policy").json()["policies"]
        assert pols["CPU"]["enabled"] is False and pols["A100-80GB"]["enabled"] is True
    only_cpu = server_factory("c=8xCPU")
    with http(only_cpu, "alice") as alice:
        assert alice.get(f"{API}/info").json()["default_pool"] is None
        assert_error(alice.post(f"{API}/leases", json={"gpus": 1}), 404, "unknown_pool", "only CPU slots")


def test_a_queue_found_blocked_is_not_ordered_again_until_gpus_that_fit_come_free(sim_factory):
    """dispatch remembers a queue it found blocked (every waiter read, none served: the smallest
    needs 4), so that a release that frees GPUs no waiter could use, and a small newcomer that fits
    beside the node held for the head, cost no reading of the queue. Neither may change who is
    served: the newcomer is backfilled as dispatch would, and the waiter is granted by the release
    that makes 4 GPUs free on one node."""

    async def main() -> None:
        sim = await sim_factory("a=4xA100-80GB,b=4xA100-80GB,c=4xA100-80GB")
        memo = "A100-80GB|~blocked"
        on: dict[str, list[str]] = defaultdict(list)
        for _ in range(12):
            _code, lease, lid = await sim.acquire("filler", 1)
            on[lease["node"]].append(lid)
        await sim.release(on["a"].pop())
        await sim.release(on["b"].pop())
        code, _rest, big = await sim.acquire("alice", 4, wait_s=3600)
        assert code is Code.QUEUED
        assert (await sim.st.redis.hget(sim.st.keys.evict_miss, memo) or "").startswith("4|")
        # A one-GPU newcomer fits beside the node held for alice's head: granted at once, there.
        held = (await sim.st.redis.hget(sim.st.keys.evict_miss, memo)).split("|")[1]
        code, lease, _lid = await sim.acquire("bob", 1)
        assert code is Code.OK and lease["node"] != held and lease["node"] in ("a", "b")
        # One GPU free on c reaches no waiter's need: the memo stays, alice waits.
        await sim.release(on["c"].pop())
        assert await sim.st.redis.hget(sim.st.keys.evict_miss, memo) and big not in await sim.leases()
        # Four free on one node: the release forgets the memo and its dispatch grants alice there.
        target = "a" if lease["node"] != "a" else "b"
        for lid in on[target]:
            await sim.release(lid)
        got = (await sim.leases())[big]
        assert got["node"] == target and len(got["gpus"]) == 4
        assert not await sim.st.redis.hget(sim.st.keys.evict_miss, memo)

    asyncio.run(main())


def test_a_blocked_head_that_leaves_frees_its_held_node_for_the_next_waiter(sim_factory):
    """The node held for a blocked head is offered to the next waiter as soon as the head leaves
    the queue (withdrawn here), not when the memo of the blocked queue runs out."""

    async def main() -> None:
        sim = await sim_factory("a=4xA100-80GB,b=4xA100-80GB")
        on: dict[str, list[str]] = defaultdict(list)
        for _ in range(8):
            _code, lease, lid = await sim.acquire("filler", 1)
            on[lease["node"]].append(lid)
        for lid in on["a"][:2]:
            await sim.release(lid)  # a: 2 free, b: none
        code, _rest, head = await sim.acquire("alice", 4, wait_s=3600)
        assert code is Code.QUEUED
        code, _rest, second = await sim.acquire("carol", 2, wait_s=3600)
        assert code is Code.QUEUED  # a's 2 free GPUs are held for alice's head
        withdraw = Release(head, "", "alice", False, "released", "done", "")
        code, _rest = await sim.st.engine.raw(withdraw, now_ms=sim.now)
        assert code is Code.REMOVED
        got = (await sim.leases()).get(second)
        assert got is not None and got["node"] == "a" and len(got["gpus"]) == 2

    asyncio.run(main())
