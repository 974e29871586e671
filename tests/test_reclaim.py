"""Idle-GPU reclaim against a real server and Redis, with simulated GPUs driven through the API."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

import pytest
from redis.asyncio import Redis

from lease_server import errors
from lease_server.leasing.inventory import parse_simulate, register
from lease_server.leasing.lease import LeaseStore
from lease_server.leasing.reclaim import GpuState, Policy, idle_verdict
from lease_server.request import AcquireRequest
from lease_server.store.engine import Engine
from lease_server.store.keys import Keys
from lease_server.store.scripts import IdleWarn, Keep, Reclaim
from tests.api_helpers import EventWatcher
from tests.conftest import make_settings
from tests.invariants import check_event_log, check_state, read_events

FAST = dict(sample_interval=0.1, idle_timeout=1.0, grace=0.6, min_age=0.0, idle_threshold=5.0)


@pytest.fixture
def fast(server_factory):
    return server_factory(simulate="n1=2xA100-80GB,n2=1xA100-80GB", **FAST)


def set_util(srv, node: str, **gpus: Any) -> None:
    admin = srv.client("root", "admin")
    admin.request("PUT", f"/api/v1/simulate/{node}", json={"gpus": gpus})


def test_idle_lease_is_warned_then_reclaimed_with_its_evidence(fast):
    watcher = EventWatcher(fast.url, fast.token("root", "admin")).start()
    alice = fast.client("alice")
    set_util(fast, "n1", **{"0": {"util": 0}, "1": {"util": 0}})
    lease = alice.acquire(2, label="forgotten notebook")
    warn = watcher.wait_for(lambda e: e["type"] == "idle_warning" and e["lease"] == lease.id, 10, "idle_warning")
    ev = warn["evidence"]
    assert ev["why"] == "idle" and ev["idle_s"] >= FAST["idle_timeout"]
    assert set(ev["gpus"]) == {"0", "1"} and all(s[1] < 5 for s in ev["gpus"]["0"])  # the samples behind it
    assert warn["reclaim_at"] - warn["ts"] == pytest.approx(FAST["grace"], abs=0.01)
    # The owner sees the warning on the lease itself (the notebook and the board read it there).
    assert alice.get(lease.id)["reclaim_at"] == pytest.approx(warn["reclaim_at"])
    done = watcher.wait_for(lambda e: e["type"] == "reclaimed" and e["lease"] == lease.id, 10, "reclaimed")
    assert done["evidence"]["gpus"]["0"] and done["ts"] >= warn["reclaim_at"]
    ended = alice.get(lease.id)
    assert ended["state"] == "revoked" and ended["end_reason"].startswith("reclaimed: its GPUs were idle")
    assert ended["idle_evidence"]["why"] == "idle"  # gpulease reclaim explain reads this
    free = {(n["name"], g["index"]) for n in alice.cluster()["nodes"] for g in n["gpus"] if g["state"] == "free"}
    assert {("n1", 0), ("n1", 1)} <= free
    with pytest.raises(errors.LeaseEnded):
        alice.renew(lease)


def test_busy_lease_with_short_dips_is_never_warned(fast):
    watcher = EventWatcher(fast.url, fast.token("root", "admin")).start()
    set_util(fast, "n2", **{"0": {"util": 90}})
    lease = fast.client("bob").acquire(1, pool="A100-80GB")
    assert lease.node == "n2"  # best fit: the 1-GPU node
    tick = threading.Event()
    # Dips to 0 % shorter than the idle window, for three windows.
    for _ in range(6):
        set_util(fast, "n2", **{"0": {"util": 0}})
        tick.wait(0.4)
        set_util(fast, "n2", **{"0": {"util": 90}})
        tick.wait(0.15)
    assert not [e for e in watcher.events if e["type"] == "idle_warning" and e["lease"] == lease.id]
    assert fast.client("bob").get(lease.id)["state"] == "active"


def test_still_using_it_resets_the_clock_and_its_limit_holds(server_factory):
    srv = server_factory(simulate="n1=1xA100-80GB", **FAST)
    admin = srv.client("root", "admin")
    admin.request("PUT", "/api/v1/policy/A100-80GB", json={"max_extensions": 1, "grace": 2.0})
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice = srv.client("alice")
    lease = alice.acquire(1)
    first = watcher.wait_for(lambda e: e["type"] == "idle_warning" and e["lease"] == lease.id, 10, "warning")
    kept = alice.request("POST", f"/api/v1/leases/{lease.id}/keep")
    assert kept["extensions"] == 1 and "reclaim_at" not in kept
    second = watcher.wait_for(
        lambda e: e["type"] == "idle_warning" and e["lease"] == lease.id and e["id"] != first["id"], 10, "2nd warning"
    )
    # The clock restarted at the keep: a full idle window passed before the second warning.
    kept_event = next(e for e in watcher.events if e["type"] == "idle_kept")
    assert second["ts"] - kept_event["ts"] >= FAST["idle_timeout"]
    with pytest.raises(errors.Conflict) as exc:
        alice.request("POST", f"/api/v1/leases/{lease.id}/keep")
    assert "already kept 1 times" in exc.value.message
    with pytest.raises(errors.NotOwner):
        srv.client("mallory").request("POST", f"/api/v1/leases/{lease.id}/keep")
    watcher.wait_for(lambda e: e["type"] == "reclaimed" and e["lease"] == lease.id, 10, "reclaimed")


def test_policy_changes_are_admin_only_and_checked(fast):
    bob = fast.client("bob")
    with pytest.raises(errors.Forbidden):
        bob.request("PUT", "/api/v1/policy/A100-80GB", json={"idle_timeout": 5})
    admin = fast.client("root", "admin")
    for bad, words in [
        ({"idle_timeout": -1}, "idle_timeout"),
        ({"idle_threshold": 101}, "0 to 100"),
        ({"grace": "soon"}, "must be a number"),
        ({"bogus": 1}, "unknown policy field"),
        ({"exempt_users": "bob"}, "list of names"),
        # a label is the requester's own text: it exempted whoever typed it (use exempt_users)
        ({"exempt_labels": ["ci-nightly"]}, "exempt_users"),
    ]:
        with pytest.raises(errors.BadRequest) as exc:
            admin.request("PUT", "/api/v1/policy/A100-80GB", json=bad)
        assert words in exc.value.message
    with pytest.raises(errors.UnknownPool):
        admin.request("PUT", "/api/v1/policy/H100", json={"grace": 1})
    assert bob.request("GET", "/api/v1/policy/A100-80GB")["grace"] == FAST["grace"]  # unchanged
    out = admin.request("PUT", "/api/v1/policy/A100-80GB", json={"exempt_users": ["bob"], "grace": 30})
    assert out["grace"] == 30 and out["exempt_users"] == ["bob"] and out["idle_timeout"] == FAST["idle_timeout"]
    assert bob.request("GET", "/api/v1/policy")["policies"]["A100-80GB"]["grace"] == 30
    assert any(e["type"] == "policy_changed" for e in bob.events(limit=1000))


def test_exempt_user_is_never_warned(fast):
    admin = fast.client("root", "admin")
    admin.request("PUT", "/api/v1/policy/A100-80GB", json={"exempt_users": ["carol"]})
    watcher = EventWatcher(fast.url, fast.token("root", "admin")).start()
    carol_lease = fast.client("carol").acquire(1)
    dave_lease = fast.client("dave").acquire(1)
    watcher.wait_for(lambda e: e["type"] == "idle_warning" and e["lease"] == dave_lease.id, 10, "dave's warning")
    assert not [e for e in watcher.events if e.get("lease") == carol_lease.id and e["type"] == "idle_warning"]


def test_a_label_exempts_nobody_even_where_an_old_release_stored_exempt_labels(fast):
    """A label is the requester's own text: an exempt_labels a release before this one stored is
    read past, and a lease with that label is warned like any other."""
    import redis as redis_py

    from lease_server.store.keys import Keys

    r = redis_py.Redis.from_url(fast.settings.redis_url, decode_responses=True)
    try:
        r.hset(Keys(fast.settings.prefix).policy, "A100-80GB", json.dumps({"exempt_labels": ["ci-nightly"]}))
    finally:
        r.close()
    admin = fast.client("root", "admin")
    assert "exempt_labels" not in admin.request("GET", "/api/v1/policy/A100-80GB")
    watcher = EventWatcher(fast.url, fast.token("root", "admin")).start()
    eve_lease = fast.client("eve").acquire(1, label="ci-nightly")
    watcher.wait_for(lambda e: e["type"] == "idle_warning" and e["lease"] == eve_lease.id, 10, "eve's warning")
    # and a change now keeps nothing of it
    admin.request("PUT", "/api/v1/policy/A100-80GB", json={"grace": 30})
    r = redis_py.Redis.from_url(fast.settings.redis_url, decode_responses=True)
    try:
        assert json.loads(r.hget(Keys(fast.settings.prefix).policy, "A100-80GB")) == {"grace": 30}
    finally:
        r.close()


def test_unleased_use_is_flagged_and_cleared(fast):
    watcher = EventWatcher(fast.url, fast.token("root", "admin")).start()
    set_util(fast, "n2", **{"0": {"util": 80, "mem_mb": 4000, "procs": [4242]}})
    ev = watcher.wait_for(lambda e: e["type"] == "unleased_use", 10, "unleased_use")
    assert (ev["node"], ev["gpu"], ev["pids"]) == ("n2", 0, [4242])
    gpu = next(g for n in fast.client("x").cluster()["nodes"] if n["name"] == "n2" for g in n["gpus"])
    assert gpu["unleased_use"]["pids"] == [4242] and gpu["sample"]["util"] == 80
    set_util(fast, "n2", **{"0": {"util": 0, "procs": []}})
    watcher.wait_for(lambda e: e["type"] == "unleased_use_ended", 10, "unleased_use_ended")


def test_samples_and_simulate_reject_bad_input(fast):
    admin = fast.client("root", "admin")
    user = fast.client("bob")
    with pytest.raises(errors.Forbidden):
        user.request("PUT", "/api/v1/simulate/n1", json={"gpus": {"0": {"util": 1}}})
    with pytest.raises(errors.Forbidden):
        user.request("POST", "/api/v1/nodes/n1/samples", json={"gpus": [{"index": 0, "util": 1}]})
    for body, words in [
        ({"gpus": {"0": {"util": 300}}}, "between 0 and 100"),
        ({"gpus": {"9": {"util": 1}}}, "no GPU [9]"),
        ({"gpus": {"x": {}}}, "GPU indexes"),
        ({"gpus": {"0": {"procs": ["a"]}}}, "process ids"),
        ({}, "body must be"),
    ]:
        with pytest.raises(errors.BadRequest) as exc:
            admin.request("PUT", "/api/v1/simulate/n1", json=body)
        assert words in exc.value.message
    with pytest.raises(errors.UnknownNode):
        admin.request("POST", "/api/v1/nodes/nope/samples", json={"gpus": [{"index": 0, "util": 1}]})


def test_renew_reports_activity_and_rejects_bad_activity(fast):
    alice = fast.client("alice")
    lease = alice.acquire(1)
    out = alice.request(
        "POST", f"/api/v1/leases/{lease.id}/renew", json={"token": lease.token, "activity": {"executing": True}}
    )
    assert out["activity"] == {"executing": True, "source": ""}
    with pytest.raises(errors.BadRequest):
        alice.request(
            "POST", f"/api/v1/leases/{lease.id}/renew", json={"token": lease.token, "activity": {"executing": "yes"}}
        )


def test_another_users_process_on_a_leased_gpu_is_foreign_once_its_owner_is_named():
    """A process that claimed nothing, seen only on one lease's GPU, was taken for that lease's (a
    child of its worker). When the agent names each process's owner and the lease's claims name
    others, it is another user's process on someone else's GPU: unleased use."""
    from lease_server.leasing.reclaim import foreign_pids

    bob = {"id": "l-bob", "node": "n1", "procs": [{"pid": 100, "start": 1, "uid": 1001}]}
    gpus = [{"index": 0, "procs": [100, 200, 300], "uids": [1001, 1002, 1001]}]
    # 200 is uid 1002's on bob's GPU; 300 is bob's (a child of his worker)
    assert foreign_pids("n1", gpus, ["l-bob"], {"l-bob": bob}) == [[200]]
    # an agent that names no owners (an earlier release), or could not tell: as before
    assert foreign_pids("n1", [{"index": 0, "procs": [100, 200]}], ["l-bob"], {"l-bob": bob}) == [[]]
    unknown = [{"index": 0, "procs": [100, 200], "uids": [1001, -1]}]
    assert foreign_pids("n1", unknown, ["l-bob"], {"l-bob": bob}) == [[]]
    # a lease that claimed nothing on this node has no owner to compare with: as before
    quiet = {"id": "l-q", "node": "n1", "procs": []}
    assert foreign_pids("n1", gpus, ["l-q"], {"l-q": quiet}) == [[]]


def test_on_a_gpu_shared_by_slices_a_process_of_none_of_them_is_foreign():
    from lease_server.leasing.reclaim import Sharers, foreign_pids

    a = {"id": "l-a", "node": "n1", "procs": [{"pid": 100, "start": 1, "uid": 1001}]}
    b = {"id": "l-b", "node": "n1", "procs": [{"pid": 110, "start": 1, "uid": 1003}]}
    shared = [Sharers(frozenset({"l-a", "l-b"}), frozenset({120}))]
    gpus = [{"index": 0, "procs": [100, 110, 120, 130, 200, 210], "uids": [1001, 1003, 1005, 1003, 1002, -1]}]
    # 100 and 110 claimed a slice; 120 is a draining slice's; 130 a child of b's worker (its uid);
    # 200 is uid 1002's, whose no slice is; 210's owner the agent could not tell
    assert foreign_pids("n1", gpus, ["~slices"], {"l-a": a, "l-b": b}, shared) == [[200]]
    # without what the GPU's slices are (an old caller), nothing on it counts, as before
    assert foreign_pids("n1", gpus, ["~slices"], {"l-a": a, "l-b": b}) == [[]]
    # The GPU uses more than its slices are promised (20 GB + 5 %): every process no slice claimed
    # and no draining slice holds is named, whoever owns it (all cells may run as one Ray user)
    promised = [Sharers(frozenset({"l-a", "l-b"}), frozenset({120}), 20_480)]
    within = [{**gpus[0], "mem_mb": 21_000}]
    beyond = [{**gpus[0], "mem_mb": 30_000}]
    assert foreign_pids("n1", within, ["~slices"], {"l-a": a, "l-b": b}, promised) == [[200]]
    assert foreign_pids("n1", beyond, ["~slices"], {"l-a": a, "l-b": b}, promised) == [[130, 200, 210]]


def test_the_agent_names_the_owner_of_each_process_it_can_see():
    import subprocess

    from lease_server.node.agent import name_owners

    child = subprocess.Popen(["sleep", "30"])
    try:
        gpus = name_owners([{"index": 0, "procs": [child.pid, 2**22 + 7]}], real=False)
        assert gpus[0]["uids"] == [os.getuid(), -1]  # (a pid that does not exist: -1)
        # on real GPUs, only a process with an NVIDIA device open here is named (sleep has none)
        assert name_owners([{"index": 0, "procs": [child.pid]}], real=True)[0]["uids"] == [-1]
    finally:
        child.kill()
        child.wait()


def test_a_sample_names_one_owner_per_process(fast):
    admin = fast.client("root", "admin")
    ok = {"gpus": [{"index": 0, "util": 1, "procs": [7, 8], "uids": [1000, -1]}]}
    admin.request("POST", "/api/v1/nodes/n1/samples", json=ok)
    for uids in ([1000], [1000, "x"], [1000, -2]):
        with pytest.raises(errors.BadRequest) as exc:
            admin.request(
                "POST", "/api/v1/nodes/n1/samples", json={"gpus": [{"index": 0, "procs": [7, 8], "uids": uids}]}
            )
        assert "uids" in exc.value.message


# ---- the verdict, directly -------------------------------------------------------------------------


def _lease(**kw: Any) -> dict[str, Any]:
    return {"id": "l-1", "user": "u", "label": "", "created_at": 0, **kw}


def _gpu(covered: float | None = 0, busy: float | None = None, last: float | None = 120, mem: int = 0) -> GpuState:
    return GpuState(covered, busy, last, mem)


def test_verdict_running_cell_with_gpu_memory_is_not_idle():
    pol = Policy(idle_timeout=60, min_age=0)
    idle, ev = idle_verdict(_lease(activity={"executing": True}), {0: _gpu(mem=2048)}, pol, 120_000, 5)
    assert not idle and ev["why"] == "a running cell holds GPU memory"
    idle, ev = idle_verdict(_lease(activity={"executing": False}), {0: _gpu(mem=2048)}, pol, 120_000, 5)
    assert idle and ev["idle_s"] == 120
    assert idle_verdict(_lease(activity={"executing": True}), {0: _gpu(mem=0)}, pol, 120_000, 5)[0]


def test_verdict_needs_continuous_current_samples_and_respects_min_age_and_busy():
    pol = Policy(idle_timeout=60, min_age=100)
    assert not idle_verdict(_lease(), {0: _gpu()}, pol, 120_000, 5)[0]  # younger than min_age + timeout
    pol = Policy(idle_timeout=60, min_age=0)
    idle, ev = idle_verdict(_lease(), {0: _gpu(covered=80)}, pol, 120_000, 5)  # an agent gap 40 s ago
    assert not idle and "not enough samples" in ev["why"]
    idle, ev = idle_verdict(_lease(), {0: _gpu(last=90)}, pol, 120_000, 5)  # no sample for 30 s
    assert not idle and "no current sample" in ev["why"]
    idle, ev = idle_verdict(_lease(), {0: _gpu(), 1: _gpu(busy=70)}, pol, 120_000, 5)  # one GPU busy 50 s ago
    assert not idle and "GPU 1 was busy" in ev["why"]
    idle, ev = idle_verdict(_lease(), {0: _gpu(), 1: _gpu(busy=50)}, pol, 120_000, 5)  # busy before the window
    assert idle and ev["idle_s"] == 70
    # A pool with a timeout far longer than the sample window still gets a verdict.
    long = Policy(idle_timeout=7200, min_age=0)
    assert idle_verdict(_lease(), {0: _gpu(last=8000)}, long, 8_000_000, 5)[0]


# ---- races ---------------------------------------------------------------------------------------


def test_reclaim_racing_release_renew_and_keep_never_double_frees(redis_server, prefix):
    """Many rounds of: a warned lease past its grace, then reclaim, release, renew and keep all at
    once. Exactly one end wins each round; the event log and the state stay consistent."""

    async def main() -> None:
        r = Redis.from_url(redis_server.url, decode_responses=True)
        store = LeaseStore(Engine(r, make_settings(redis_server.url, prefix)))
        for inv in parse_simulate("a=2xA100-80GB"):
            await register(store.engine, inv)
        outcomes: dict[str, int] = {}
        for i in range(150):
            lease = await store.acquire("u", AcquireRequest(gpus=1 + i % 2))
            code, _ = await store.engine.raw(IdleWarn(lease["id"], str(lease["token"]), 0, json.dumps({"idle_s": 1})))
            results = await asyncio.gather(
                store.engine.raw(Reclaim(lease["id"], str(lease["token"]), json.dumps({"idle_s": 1}))),
                store.release(lease["id"], "u", token=lease["token"]),
                store.renew(lease["id"], lease["token"], "u"),
                store.engine.raw(Keep(lease["id"], "u", False, 3)),
                return_exceptions=True,
            )
            reclaimed = results[0][0].name == "OK"  # type: ignore[index,union-attr]
            released = not isinstance(results[1], BaseException) and results[1][1]
            assert reclaimed + released == 1, results
            outcomes["reclaimed" if reclaimed else "released"] = (
                outcomes.get("reclaimed" if reclaimed else "released", 0) + 1
            )
            # Anything else must have been refused cleanly, never half-applied.
            for res in results[2:]:
                if isinstance(res, BaseException):
                    assert isinstance(res, errors.GpuLeaseError), res
        from redis import Redis as SyncRedis

        sync = SyncRedis.from_url(redis_server.url, decode_responses=True)
        counts = check_event_log(read_events(sync, Keys(prefix)))
        check_state(sync, Keys(prefix), expect_all_free=True)
        assert counts["grant"] == 150 == counts.get("released", 0) + counts.get("revoked", 0)
        assert outcomes.get("reclaimed", 0) > 0  # the race really raced both ways over the rounds
        sync.close()
        await r.aclose()

    asyncio.run(main())


def test_warning_lapses_when_the_gpus_get_busy_again(server_factory):
    srv = server_factory(simulate="n1=1xA100-80GB", **{**FAST, "grace": 3.0})
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice = srv.client("alice")
    lease = alice.acquire(1)
    watcher.wait_for(lambda e: e["type"] == "idle_warning" and e["lease"] == lease.id, 10, "warning")
    set_util(srv, "n1", **{"0": {"util": 70}})
    cleared = watcher.wait_for(lambda e: e["type"] == "idle_cleared" and e["lease"] == lease.id, 10, "idle_cleared")
    assert cleared["reason"] == "its GPUs are busy again"
    rec = alice.get(lease.id)
    assert rec["state"] == "active" and "reclaim_at" not in rec and "extensions" not in rec


def test_cli_drives_simulated_gpus_and_explains_a_reclaim(fast):
    import os
    import subprocess
    import sys

    env = {**os.environ, "GPULEASE_URL": fast.url, "GPULEASE_TOKEN": fast.token("root", "admin")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lease_server.cli", *args], env=env, capture_output=True, text=True, timeout=60
        )

    out = cli("simulate", "util", "n1:0=0", "n1:1=0,0")
    assert out.returncode == 0 and "GPU 0 0%" in out.stdout, out.stderr
    bad = cli("simulate", "util", "n1-0=high")
    assert bad.returncode == 2 and "NODE:GPU=UTIL" in bad.stderr
    watcher = EventWatcher(fast.url, fast.token("root", "admin")).start()
    lease = fast.client("root", "admin").acquire(2)
    watcher.wait_for(lambda e: e["type"] == "reclaimed" and e["lease"] == lease.id, 10, "reclaimed")
    explain = cli("reclaim", "explain", lease.id[:10])  # the ended lease's id as gpulease events shows it
    assert explain.returncode == 0, explain.stderr
    assert explain.stdout.startswith(lease.id)
    assert "reclaimed" in explain.stdout and "▁" in explain.stdout and "0 / 0.0 / 0" in explain.stdout
    # Busy GPUs: a lease on them is never judged idle, however long the CLI takes to start (it used
    # to race the 1 s idle timeout, and lose on a loaded machine).
    set_util(fast, "n1", **{"0": {"util": 90}, "1": {"util": 90}})
    set_util(fast, "n2", **{"0": {"util": 90}})
    never = fast.client("root", "admin").acquire(1)
    assert "never judged idle" in cli("reclaim", "explain", never.id).stdout
    shown = cli("policy", "show")
    assert json.loads(shown.stdout)["A100-80GB"]["grace"] == FAST["grace"]
    changed = cli("policy", "set", "A100-80GB", "grace=5", "exempt_users=ann,bo")
    assert json.loads(changed.stdout)["exempt_users"] == ["ann", "bo"], changed.stderr


def test_slices_are_reclaimed_only_when_their_whole_gpu_is_idle(server_factory):
    """A slice's evidence is its GPU's samples: the GPU's utilisation is its slices' together, so
    the slices of an idle GPU are idle, and none of a busy one is judged idle (its idle neighbour
    included: nothing tells whose the work is)."""
    # (two sharers a GPU at most: dan's slice has room only beside carol's, however busy that GPU is)
    sched = {"A100-80GB": {"share": True, "max_sharers": 2}}
    srv = server_factory(simulate="box=2xA100-80GB", scheduling=sched, **FAST)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    set_util(srv, "box", **{"0": {"util": 0}, "1": {"util": 90}})  # GPU 1's work is carol's, or dan's
    idle = [srv.client(u).acquire(1, pool="A100-80GB", gpu_mem="10GB") for u in ("alice", "bob")]
    busy = [srv.client(u).acquire(1, pool="A100-80GB", gpu_mem=mem) for u, mem in (("carol", "75GB"), ("dan", "1GB"))]
    assert {s.gpus[0]["index"] for s in idle} == {0} and {s.gpus[0]["index"] for s in busy} == {1}, (idle, busy)
    for s in idle:
        watcher.wait_for(lambda e, i=s.id: e["type"] == "reclaimed" and e["lease"] == i, 15, f"{s.user} reclaimed")
        assert srv.client(s.user).get(s.id)["state"] == "revoked"
    warned = {e["lease"] for e in watcher.events if e["type"] == "idle_warning"}
    assert not warned & {s.id for s in busy}, warned
    for s in busy:
        assert srv.client(s.user).get(s.id)["state"] == "active"


def test_a_config_file_with_exempt_labels_fails_at_start_saying_what_to_use(tmp_path):
    from lease_server.config import Settings
    from lease_server.errors import ConfigurationError

    path = tmp_path / "gpulease.toml"
    path.write_text('[policy.A100-80GB]\nexempt_labels = ["ci-nightly"]\n')
    with pytest.raises(ConfigurationError, match="exempt_users"):
        Settings.load(path).validate()
