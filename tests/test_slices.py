"""GPU slices (issue 35, item 1): a lease of part of one GPU's memory, on a GPU other slices share.

A real lease server on a real Redis, simulated GPUs. The referee (tests/invariants.py) checks after
every step that no GPU is ever promised beyond its memory and that a whole-GPU lease is exclusive;
focused tests for each bad input (one line that says what would work, nothing leased or changed)
and for whole GPUs and slices never landing on each other's GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest

from lease_server import errors
from lease_server.cli.events import describe
from lease_server.client import Client, Lease
from lease_server.procs import start_ticks
from lease_server.sizes import GpuMem, parse_gpu_mem
from lease_server.store.keys import Keys
from tests.api_helpers import EventWatcher
from tests.conftest import ServerHandle, make_settings
from tests.invariants import check_event_log, check_state, read_events

A100 = "A100-80GB"
GPU_MB = 80 * 1024
SHARING = {A100: {"share": True, "max_sharers": 3, "slice_unit_mb": 1024}}


@pytest.fixture
def srv(server_factory: Any) -> ServerHandle:
    return server_factory("n1=4xA100-80GB,n2=2xA100-80GB,t1=2xT4-16GB", scheduling=SHARING)  # type: ignore[no-any-return]


def keys_of(srv: ServerHandle) -> Keys:
    return Keys(srv.settings.prefix)


def snapshot(r: Any, k: Keys) -> dict[str, Any]:
    """What a refused request must leave as it was."""
    return {
        name: r.hgetall(getattr(k, name)) for name in ("leases", "holders", "free", "sliced", "held_by", "waiters")
    } | {"slice_fit": r.zrange(k.slice_fit, 0, -1), "queue": r.zrange(k.queue, 0, -1)}


# ---- sizes as people write them ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("10GB", GpuMem(mb=10240)),
        ("10240MB", GpuMem(mb=10240)),
        ("512M", GpuMem(mb=512)),
        ("1.5 GiB", GpuMem(mb=1536)),
        ("0.25", GpuMem(fraction=0.25)),
        (0.5, GpuMem(fraction=0.5)),
        (2048, GpuMem(mb=2048)),
    ],
)
def test_sizes_are_read_as_people_write_them(text: Any, want: GpuMem) -> None:
    assert parse_gpu_mem(text) == want
    assert GpuMem(fraction=0.25).to_mb(GPU_MB) == 20480


@pytest.mark.parametrize("text", ["10 parsecs", "", "GB", "-1GB", "1.5", "0", 0, -5, "0MB", True, "ten GB"])
def test_an_unreadable_size_is_one_line_that_says_what_would_work(text: Any) -> None:
    with pytest.raises(ValueError) as exc:
        parse_gpu_mem(text)
    assert "\n" not in str(exc.value) and ("10GB" in str(exc.value))


# ---- bad input: a 400 with one line, nothing leased or changed ----------------------------------------


def test_what_no_gpu_could_serve_is_said_in_the_flags_a_person_typed(srv: ServerHandle) -> None:
    """gpulease acquire and %%gpu_train say the refusal in their flags, within 80 columns: the
    API's words were MB and field names (--gpu-mem 100GB read 'drop gpu_mem_mb', 151 columns), and
    a pool of one node was told to spread the GPUs over K nodes."""
    from lease_server.client import waited_out

    alice = srv.client("alice")
    with pytest.raises(errors.BadRequest) as exc:
        alice.acquire(1, A100, gpu_mem="100GB")
    said = waited_out(exc.value)
    assert said == f"--gpu-mem 100GB is over a GPU of {A100} (80 GB): drop --gpu-mem for a whole GPU", said
    with pytest.raises(errors.Unsatisfiable) as too_many:
        alice.acquire(99, A100)
    said = waited_out(too_many.value)
    assert said.startswith(f"no node of {A100} has 99 GPUs (the largest has ") and len(said) <= 80, said
    nodes = {n["name"] for n in srv.client("root").cluster()["nodes"] if n["pool"] == A100}
    assert ("--nodes K" in said) == (len(nodes) > 1), (said, nodes)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"gpus": 1, "gpu_mem_mb": 0}, "gpu_mem_mb must be a whole number of MB from 1"),
        ({"gpus": 1, "gpu_mem_mb": -10}, "gpu_mem_mb must be a whole number of MB from 1"),
        ({"gpus": 1, "gpu_mem_mb": 1.5}, "gpu_mem_mb must be a whole number of MB"),
        ({"gpus": 1, "gpu_mem_mb": "10GB"}, "gpu_mem_mb must be a whole number of MB"),
        ({"gpus": 1, "gpu_mem_mb": GPU_MB + 1, "pool": A100}, f"ask for at most {GPU_MB} MB"),
        ({"gpus": 1, "gpu_mem_mb": 1024, "pool": "T4-16GB"}, "does not share its GPUs, so it takes no slice"),
        ({"gpus": 1, "gpu_mem_mb": 1024, "pool": "T4-16GB"}, "set share = true under [scheduling.T4-16GB]"),
        ({"gpus": 2, "nodes": 2, "gpu_mem_mb": 1024, "pool": A100}, "a slice (gpu_mem_mb) is part of one GPU"),
        ({"gpus": 1, "gpus_min": 1, "gpu_mem_mb": 1024, "pool": A100}, "a slice (gpu_mem_mb) is part of one GPU"),
        ({"gpus": 1, "gpu_mem_mb": 1024, "pool": "nope"}, "unknown pool"),
    ],
)
def test_a_bad_slice_request_is_a_400_and_changes_nothing(
    srv: ServerHandle, redis_sync: Any, body: dict[str, Any], says: str
) -> None:
    k = keys_of(srv)
    held = srv.client("bob").acquire(1, A100, gpu_mem="1GB")  # something live to leave alone
    before = snapshot(redis_sync, k)
    resp = httpx.post(f"{srv.url}/api/v1/leases", json=body, headers={"Authorization": f"Bearer {srv.token('alice')}"})
    assert resp.status_code in (400, 404), resp.text
    message = resp.json()["message"]
    assert says in message and "\n" not in message, message
    assert snapshot(redis_sync, k) == before
    srv.client("bob").release(held)
    check_state(redis_sync, k, expect_all_free=True)


def test_the_client_refuses_an_unreadable_size_before_sending(srv: ServerHandle, redis_sync: Any) -> None:
    with srv.client() as c, pytest.raises(ValueError, match="cannot read GPU memory"):
        c.acquire(1, A100, gpu_mem="lots")
    assert redis_sync.hlen(keys_of(srv).leases) == 0


def test_the_api_documents_gpu_mem_mb(srv: ServerHandle) -> None:
    doc = httpx.get(f"{srv.url}/api/v1/openapi.json").json()
    prop = doc["components"]["schemas"]["AcquireRequest"]["properties"]["gpu_mem_mb"]
    assert prop["type"] == ["integer", "null"] and prop["minimum"] == 1
    assert "gpu_mem_mb" in doc["components"]["schemas"]["Lease"]["properties"]


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"share": "yes"}, "share of pool"),
        ({"slice_unit_mb": 0}, "slice_unit_mb of pool"),
        ({"max_sharers": 1.5}, "max_sharers"),
    ],
)
def test_contradictory_sharing_settings_fail_fast(redis_server: Any, table: dict[str, Any], says: str) -> None:
    with pytest.raises(errors.ConfigurationError, match=says):
        make_settings(redis_server.url, "cfg", scheduling={A100: table}).validate()
    assert make_settings(redis_server.url, "cfg").sched_table(A100)["share"] is False  # off by default


# ---- placement -------------------------------------------------------------------------------------


def test_a_size_between_units_is_rounded_up_and_the_grant_says_so(srv: ServerHandle, redis_sync: Any) -> None:
    with srv.client() as c:
        lease = c.acquire(1, A100, gpu_mem=1500)
        assert lease.gpu_mem_mb == 2048 and lease.raw["gpu_total_mb"] == GPU_MB
        quarter = c.acquire(1, A100, gpu_mem=0.25)
        assert quarter.gpu_mem_mb == GPU_MB // 4
        assert (quarter.node, quarter.gpus) == (lease.node, lease.gpus)  # best fit: they share
        check_state(redis_sync, keys_of(srv))
        c.release(lease)
        c.release(quarter)
    check_state(redis_sync, keys_of(srv), expect_all_free=True)


def test_k_slices_take_one_slice_on_each_of_k_gpus_of_one_node(server_factory: Any, redis_sync: Any) -> None:
    """gpus=2 with gpu_mem: a slice on each of two GPUs of one node, sliced GPUs first (best fit),
    then free ones; counted as twice the fraction; every GPU's memory back when it ends. A request
    that no node has k GPUs for is refused; gpus_min or nodes with a slice are 400s."""
    srv = server_factory("n1=4xA100-80GB,n2=2xA100-80GB", scheduling=SHARING)
    k = keys_of(srv)
    with srv.client("alice") as alice, srv.client("bob") as bob:
        one = bob.acquire(1, A100, gpu_mem="60GB")  # a sliced GPU with 20 GB left
        pair = alice.acquire(2, A100, gpu_mem="20GB")
        assert len(pair.gpus) == 2 and pair.gpu_mem_mb == 20480 and pair.raw["gpu_total_mb"] == GPU_MB
        assert pair.node == one.node and one.gpus[0] in pair.gpus  # it joined the sliced GPU first
        for g in pair.gpus:
            ledger = json.loads(redis_sync.hget(k.sliced, f"{pair.node}/{g['index']}"))
            assert ledger["leases"][pair.id] == 20480
        assert redis_sync.hget(k.held_by, f"{A100}|alice|m") == "500"  # 2 x 250 milli-GPUs
        check_state(redis_sync, k)
        four = bob.acquire(4, A100, gpu_mem="70GB")  # only the other node has 4 GPUs with room: whole ones
        assert four.node != pair.node and len(four.gpus) == 4
        check_state(redis_sync, k)
        with pytest.raises(errors.NoCapacity):  # now no node has 2 GPUs with 30 GB free
            bob.acquire(2, A100, gpu_mem="30GB")
        bob.release(four)
        for bad in ({"gpus": 2, "gpus_min": 1}, {"gpus": 2, "nodes": 2}):
            with pytest.raises(errors.BadRequest, match="k slices on k GPUs of one node"):
                alice.request("POST", "/api/v1/leases", json={**bad, "gpu_mem_mb": 1024, "pool": A100})
        alice.release(pair)
        assert redis_sync.hget(k.held_by, f"{A100}|alice|m") in (None, "0")
        check_state(redis_sync, k)
        bob.release(one)
    check_state(redis_sync, k, expect_all_free=True)
    check_event_log(read_events(redis_sync, k))


def test_whole_gpus_never_land_on_a_sliced_gpu_and_slices_never_on_a_leased_one(
    server_factory: Any, redis_sync: Any
) -> None:
    srv = server_factory("box=2xA100-80GB", scheduling=SHARING)
    k = keys_of(srv)
    with srv.client("alice") as alice, srv.client("bob") as bob:
        whole = alice.acquire(1, A100)
        sl = bob.acquire(1, A100, gpu_mem="10GB")
        assert sl.gpus[0]["index"] != whole.gpus[0]["index"]  # not on the GPU leased whole
        with pytest.raises(errors.NoCapacity):  # the other GPU is sliced: not free for a whole lease
            alice.acquire(1, A100)
        more = [bob.acquire(1, A100, gpu_mem="10GB") for _ in range(2)]
        assert {m.gpus[0]["index"] for m in more} == {sl.gpus[0]["index"]}  # packed on the sliced GPU
        with pytest.raises(errors.NoCapacity, match="for a slice"):  # max_sharers 3, the other GPU is whole
            bob.acquire(1, A100, gpu_mem="1GB")
        check_state(redis_sync, k)
        alice.release(whole)
        spill = bob.acquire(1, A100, gpu_mem="70GB")  # too big for what is left: takes the freed GPU
        assert spill.gpus[0]["index"] == whole.gpus[0]["index"]
        board = alice.cluster()
        gpus = {g["index"]: g for g in board["nodes"][0]["gpus"]}
        assert gpus[sl.gpus[0]["index"]]["state"] == "sliced"
        assert len(gpus[sl.gpus[0]["index"]]["slices"]) == 3
        assert gpus[sl.gpus[0]["index"]]["slice_mem"] == {
            "total_mb": GPU_MB,
            "used_mb": 3 * 10240,
            "free_mb": GPU_MB - 3 * 10240,
        }
        assert board["pools"][A100]["sliced"] == 2 and board["pools"][A100]["slices"] == 4
        for lease in [sl, *more]:
            bob.release(lease)
        assert alice.acquire(1, A100).gpus[0]["index"] == sl.gpus[0]["index"]  # whole again once empty
        bob.release(spill)
    check_state(redis_sync, k)
    check_event_log(read_events(redis_sync, k))


def _set_util(srv: ServerHandle, node: str, **gpus: float) -> None:
    """What the simulated GPUs of ``node`` report to its agent from now on (utilisation %)."""
    with srv.client("root", "admin") as admin:
        admin.request("PUT", f"/api/v1/simulate/{node}", json={"gpus": {i: {"util": u} for i, u in gpus.items()}})


def _wait_util(redis_sync: Any, k: Keys, slot: str, busy: bool) -> None:
    """Until the agent's samples made sliced GPU ``slot``'s average utilisation busy (>= 50 %) or not.
    Samples leave no event to wait on: the ledger is read until then (sample_interval 0.05 s)."""
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        raw = redis_sync.hget(k.sliced, slot)
        if raw is not None and (float(json.loads(raw).get("util_avg", 0)) >= 50) == busy:
            return
        time.sleep(0.05)
    raise AssertionError(f"{slot} never {'busy' if busy else 'calm'}: {redis_sync.hget(k.sliced, slot)}")


@pytest.mark.parametrize("busy_pct", [50, 101])
def test_a_slice_goes_where_it_fits_away_from_busy_gpus(server_factory: Any, redis_sync: Any, busy_pct: int) -> None:
    """Best fit by memory first; among the GPUs where a slice fits, one whose recent samples are busy
    is passed over while another fits (a sliced GPU that is not busy, else a free GPU), and taken
    only when nothing else fits. With slice_busy_pct 101 (never busy) placement is by memory alone."""
    table = {A100: {"share": True, "max_sharers": 4, "slice_busy_pct": busy_pct}}
    srv = server_factory("n1=3xA100-80GB", scheduling=table, sample_interval=0.05)
    k = keys_of(srv)
    _set_util(srv, "n1", **{"0": 90, "1": 0, "2": 0})
    with srv.client("alice") as alice:

        def where(lease: Lease) -> int:
            check_state(redis_sync, k)
            return int(lease.gpus[0]["index"])

        first = alice.acquire(1, A100, gpu_mem="10GB")
        g0 = where(first)
        assert g0 == 0, first.gpus  # a free GPU: the node's first
        _wait_util(redis_sync, k, f"n1/{g0}", busy=True)
        second = alice.acquire(1, A100, gpu_mem="10GB")
        if busy_pct > 100:  # never busy: by memory alone, packed beside the busy cell
            assert where(second) == g0
            return
        g1 = where(second)
        assert g1 != g0  # the only sliced GPU is busy: a free GPU instead
        _wait_util(redis_sync, k, f"n1/{g1}", busy=False)
        assert where(alice.acquire(1, A100, gpu_mem="10GB")) == g1  # packed where it is calm
        # Every GPU busy: the last free one is taken whole, then the best fit by memory, busy or not.
        g2 = ({0, 1, 2} - {g0, g1}).pop()
        _set_util(srv, "n1", **{str(g0): 90, str(g1): 95, str(g2): 80})
        _wait_util(redis_sync, k, f"n1/{g1}", busy=True)
        assert where(alice.acquire(1, A100, gpu_mem="10GB")) == g2
        _wait_util(redis_sync, k, f"n1/{g2}", busy=True)
        assert where(alice.acquire(1, A100, gpu_mem="10GB")) == g1  # 60 GB free: the best fit
        # ... and a GPU that calms down is preferred again.
        _set_util(srv, "n1", **{str(g0): 90, str(g1): 95, str(g2): 0})
        _wait_util(redis_sync, k, f"n1/{g2}", busy=False)
        assert where(alice.acquire(1, A100, gpu_mem="10GB")) == g2
    check_event_log(read_events(redis_sync, k))


def test_a_booking_in_force_recalls_the_slices_on_the_gpus_it_needs(server_factory: Any, redis_sync: Any) -> None:
    """A booking of whole GPUs recalls slices as it recalls whole leases: every slice of a GPU it
    needs is recalled together (one alone frees no GPU), with the booking's notice; no new slice joins
    a GPU being emptied meanwhile; once they are gone the holder gets the GPUs whole."""
    import time

    from tests.api_helpers import EventWatcher

    srv = server_factory("box=2xA100-80GB", scheduling=SHARING, borrow_notice=1.0, default_ttl=60)
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("admin", "admin")).start()
    with srv.client("alice") as alice, srv.client("bob") as bob, srv.client("carol") as carol:
        small = [bob.acquire(1, A100, gpu_mem="10GB", ttl=60) for _ in range(2)]
        big = bob.acquire(1, A100, gpu_mem="70GB", ttl=60)  # too big beside the two: the other GPU
        assert {sl.gpus[0]["index"] for sl in small} != {big.gpus[0]["index"]}
        now = time.time()
        booking = alice.request(
            "POST", "/api/v1/bookings", json={"pool": A100, "gpus": 2, "start": now - 60, "end": now + 3600}
        )
        got: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: got.update(lease=alice.acquire(2, A100, wait=30, ttl=60)))
        waiter.start()
        recalled = [
            watcher.wait_for(lambda e, i=sl.id: e["type"] == "borrow_recalled" and e["lease"] == i, 10, sl.id)
            for sl in (*small, big)
        ]
        assert all(e["reservation"] == booking["id"] and e["requested_by"] == "alice" for e in recalled)
        assert bob.get(small[0].id)["recall_at"]
        # While they are being emptied, a new slice finds no room (the free GPUs are owed, the sliced
        # ones are being recalled) rather than landing on one of them.
        with pytest.raises(errors.NoCapacity):
            carol.acquire(1, A100, gpu_mem="1GB")
        check_state(redis_sync, k)
        waiter.join(30)
        lease = got["lease"]
        assert lease.booking == booking["id"] and len(lease.gpus) == 2
        for sl in (*small, big):
            ended = bob.get(sl.id)
            assert ended["state"] == "revoked" and "recalled for alice's booking" in ended["end_reason"], ended
        assert redis_sync.hlen(k.sliced) == 0
        check_state(redis_sync, k)
        alice.release(lease)
    check_event_log(read_events(redis_sync, k))


def test_a_slice_waits_in_the_queue_and_is_granted_when_memory_comes_back(srv: ServerHandle, redis_sync: Any) -> None:
    with srv.client("alice") as alice, srv.client("bob") as bob:
        big = [alice.acquire(1, A100, gpu_mem="60GB") for _ in range(6)]  # every A100 sliced, 20 GB left
        with pytest.raises(errors.NoCapacity):
            bob.acquire(1, A100, gpu_mem="30GB")
        granted: dict[str, Lease] = {}

        def wait() -> None:
            granted["lease"] = bob.acquire(1, A100, gpu_mem="30GB", wait=30)

        t = threading.Thread(target=wait)
        t.start()
        while not bob.queue(A100):
            t.join(0.01)  # until it is queued (the queue is the event: nothing to wait on but it)
        alice.release(big[3])
        t.join(30)
        lease = granted["lease"]
        assert (lease.node, lease.gpus) == (big[3].node, big[3].gpus)
        check_state(redis_sync, keys_of(srv))
        for b in big:
            if b is not big[3]:
                alice.release(b)
        bob.release(lease)
    check_state(redis_sync, keys_of(srv), expect_all_free=True)
    check_event_log(read_events(redis_sync, keys_of(srv)))


def test_the_estimate_answers_for_a_slice_and_counts_sliced_gpus(server_factory: Any) -> None:
    """GET /estimate with gpu_mem_mb (or of a queued slice) says whether the slice fits now and, if
    not, when memory comes back; for whole GPUs a sliced GPU comes back when its slices end, not
    never; a pool that does not share is a 400 that says so."""
    srv = server_factory("box=2xA100-80GB,t1=1xT4-16GB", scheduling=SHARING)
    gb = 1024
    with srv.client("alice") as alice, srv.client("bob") as bob:
        big = alice.acquire(1, A100, gpu_mem="60GB")
        whole = alice.acquire(1, A100)
        assert whole.gpus != big.gpus or whole.node != big.node

        def est(**params: Any) -> dict[str, Any]:
            return bob.request("GET", "/api/v1/estimate", params={"pool": A100, **params})

        small = est(gpu_mem_mb=10 * gb)
        assert (small["estimate_s"], small["free_now"], small["gpu_mem_mb"]) == (0.0, 1, 10 * gb), small
        assert small["text"] == f"a 10 GB slice of {A100} fits now"
        wide = est(gpu_mem_mb=30 * gb)
        assert wide["free_now"] == 0 and 0 < wide["estimate_s"] <= wide["typical_s"], wide
        assert "waiting for memory held by running calls" in wide["text"] and "30 GB slice" in wide["text"]
        # Two whole GPUs: the sliced one comes back when its slice ends (once, not a second round).
        both = est(gpus=2)
        assert both["held_gpus"] == 2 and 0 < both["estimate_s"] <= both["typical_s"], both
        assert "gpu_mem_mb" not in both
        with pytest.raises(errors.BadRequest, match="does not share its GPUs"):
            bob.request("GET", "/api/v1/estimate", params={"pool": "T4-16GB", "gpu_mem_mb": 1024})
        with pytest.raises(errors.BadRequest, match="more than one GPU of pool"):
            est(gpu_mem_mb=81 * gb)

        # A queued slice: its own estimate is of its slice; one behind it counts it as ahead.
        rid = bob.new_request_id()
        answers: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: answers.setdefault(
                "x", _try(lambda: bob.acquire(1, A100, gpu_mem="30GB", wait=30, request_id=rid))
            )
        )
        t.start()
        while not bob.queue(A100):
            t.join(0.01)  # until it is queued (the queue is the event: nothing to wait on but it)
        own = bob.request("GET", "/api/v1/estimate", params={"lease": rid})
        assert (own["gpu_mem_mb"], own["position"], own["queued_ahead"]) == (30 * gb, 1, 0), own
        behind = est(gpu_mem_mb=30 * gb)
        assert behind["queued_ahead"] == 1 and "1 request(s)" in behind["text"], behind
        assert behind["estimate_s"] >= own["estimate_s"] - 1  # (a moment later)
        bob.withdraw(rid)
        t.join(30)
        assert isinstance(answers["x"], errors.Withdrawn)
        for lease in (big, whole):
            alice.release(lease)


def _try(fn: Any) -> Any:
    try:
        return fn()
    except errors.GpuLeaseError as exc:
        return exc


def test_quotas_fair_share_and_the_ledger_count_a_slice_as_its_fraction(server_factory: Any, redis_sync: Any) -> None:
    srv = server_factory("box=2xA100-80GB", scheduling={A100: {**SHARING[A100], "quota": {"*": 1}}})
    k = keys_of(srv)
    with srv.client("alice") as c:
        a = c.acquire(1, A100, gpu_mem="40GB")
        b = c.acquire(1, A100, gpu_mem="40GB")  # a half and a half: within a quota of 1 GPU
        assert not a.raw.get("preemptible") and not b.raw.get("preemptible")
        assert redis_sync.hget(k.held_by, f"{A100}|alice|m") == "1000"
        usage = json.loads(redis_sync.hget(k.usage, f"{A100}|alice"))
        assert usage["r"] == 1
        over = c.acquire(1, A100, gpu_mem="1GB")  # above quota: preemptible, as a whole GPU would be
        assert over.raw.get("preemptible") is True
        check_state(redis_sync, k)
        for lease in (a, b, over):
            c.release(lease)
    assert json.loads(redis_sync.hget(k.usage, f"{A100}|alice"))["r"] == 0
    ledger = [json.loads(f["data"]) for _, f in redis_sync.xrange(k.ledger)]
    assert sorted(e["gpu_mem_mb"] for e in ledger) == [1024, 40960, 40960]
    for e in ledger:
        assert e["gpu_s"] <= e["held_s"] * e["gpu_mem_mb"] / GPU_MB + 1e-6
    check_state(redis_sync, k, expect_all_free=True)


def test_a_slice_is_not_handed_on_or_resized(srv: ServerHandle) -> None:
    with srv.client() as c:
        sl = c.acquire(1, A100, gpu_mem="4GB")
        with pytest.raises(errors.Conflict):
            c.shrink(sl, 1)
        c.release(sl)


# ---- warm slices: kept for the notebook's next cell, lent to whoever waits --------------------------

WARM_SHARING = {A100: {**SHARING[A100], "warm_evict_notice": 0.5}}


def test_a_warm_slice_is_lent_as_memory_to_a_slice_request_that_needs_it(server_factory: Any, redis_sync: Any) -> None:
    """alice's 40 GB slice goes warm beside carol's running 30 GB slice: bob's 20 GB request finds
    10 GB free there, so alice's warm slice (not carol's) is evicted for it, with the warm notice;
    once alice releases, bob gets that GPU. While warm, alice's slice counts its fraction as warm,
    not as use, in fair share and the ledger."""
    from tests.api_helpers import EventWatcher

    srv = server_factory("box=1xA100-80GB", scheduling=WARM_SHARING, default_ttl=60)
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("admin", "admin")).start()
    with srv.client("alice") as alice, srv.client("bob") as bob, srv.client("carol") as carol:
        mine = alice.acquire(1, A100, gpu_mem="40GB")
        theirs = carol.acquire(1, A100, gpu_mem="30GB")
        assert json.loads(redis_sync.hget(k.usage, f"{A100}|alice"))["r"] == 0.5
        rec = alice.warm(mine)
        assert rec["warm_since"] and rec["gpu_mem_mb"] == 40960
        assert json.loads(redis_sync.hget(k.usage, f"{A100}|alice"))["r"] == 0  # warm is not use
        assert redis_sync.hget(k.held_by, f"{A100}|~warm@box") is None  # it lends memory, not a GPU
        check_state(redis_sync, k)
        got: dict[str, Lease] = {}
        t = threading.Thread(target=lambda: got.update(lease=bob.acquire(1, A100, gpu_mem="20GB", wait=30)))
        t.start()
        ev = watcher.wait_for(lambda e: e["type"] == "evicting", 10, "evicting")
        assert (ev["lease"], ev["requested_by"]) == (mine.id, "bob"), ev
        assert "warm lease is lent out" in ev["reason"]
        assert "recall_at" not in carol.get(theirs.id)  # a running slice is never lent
        assert not got
        check_state(redis_sync, k)
        with pytest.raises(errors.Conflict, match="being evicted"):
            alice.warm(mine, on=False)  # its next cell cannot run there any more
        alice.release(mine)
        t.join(30)
        lease = got["lease"]
        assert (lease.node, lease.gpus, lease.gpu_mem_mb) == (mine.node, mine.gpus, 20480)
        check_state(redis_sync, k)
        ended = alice.get(mine.id)
        assert ended["state"] == "released", ended
        bob.release(lease)
        carol.release(theirs)
    check_state(redis_sync, k, expect_all_free=True)
    entry = next(
        json.loads(f["data"]) for _, f in redis_sync.xrange(k.ledger) if json.loads(f["data"])["lease"] == mine.id
    )
    assert entry["warm_gpu_s"] > 0 and entry["recall"] == "evicted"
    # a slice's warm time counts its fraction of the GPU, as its held time does
    assert entry["gpu_s"] + entry["warm_gpu_s"] == pytest.approx(entry["held_s"] / 2, abs=0.01)
    check_event_log(read_events(redis_sync, k))


def test_a_slice_request_evicts_a_whole_warm_lease_when_no_slice_would_make_room(
    server_factory: Any, redis_sync: Any
) -> None:
    from tests.api_helpers import EventWatcher

    srv = server_factory("box=1xA100-80GB", scheduling=WARM_SHARING, default_ttl=60)
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("admin", "admin")).start()
    with srv.client("alice") as alice, srv.client("bob") as bob:
        whole = alice.acquire(1, A100)
        alice.warm(whole)
        got: dict[str, Lease] = {}
        t = threading.Thread(target=lambda: got.update(lease=bob.acquire(1, A100, gpu_mem="10GB", wait=30)))
        t.start()
        ev = watcher.wait_for(lambda e: e["type"] == "evicting", 10, "evicting")
        assert (ev["lease"], ev["requested_by"]) == (whole.id, "bob")
        check_state(redis_sync, k)
        alice.release(whole)
        t.join(30)
        assert got["lease"].gpu_mem_mb == 10240 and got["lease"].gpus == whole.gpus
        check_state(redis_sync, k)
        bob.release(got["lease"])
    check_state(redis_sync, k, expect_all_free=True)
    check_event_log(read_events(redis_sync, k))


def test_a_whole_gpu_request_evicts_a_gpu_whose_slices_are_all_warm_and_none_other(
    server_factory: Any, redis_sync: Any
) -> None:
    """GPU a holds two warm slices, GPU b a warm slice beside a running one: a request for a whole
    GPU evicts both of a's (one alone frees no GPU) and leaves b's alone; it gets a, whole."""
    from tests.api_helpers import EventWatcher

    srv = server_factory("box=2xA100-80GB", scheduling=WARM_SHARING, default_ttl=60)
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("admin", "admin")).start()
    users = ("alice", "dan", "carol", "erin", "bob")
    cs = {u: srv.client(u) for u in users}
    try:
        big = {u: cs[u].acquire(1, A100, gpu_mem="50GB") for u in ("alice", "carol")}  # one on each GPU
        assert big["alice"].gpus != big["carol"].gpus
        small = {u: cs[u].acquire(1, A100, gpu_mem="20GB") for u in ("dan", "erin")}
        by_gpu: dict[int, list[Lease]] = {}
        for lease in (*big.values(), *small.values()):
            by_gpu.setdefault(lease.gpus[0]["index"], []).append(lease)
        # the GPU whose slices all go warm, and the one that keeps a running slice
        warm_gpu = big["alice"].gpus[0]["index"]
        for lease in by_gpu[warm_gpu]:
            cs[lease.user].warm(lease)
        other = [x for x in by_gpu[1 - warm_gpu] if x.user != "carol"]
        for lease in other:
            cs[lease.user].warm(lease)
        check_state(redis_sync, k)
        got: dict[str, Lease] = {}
        t = threading.Thread(target=lambda: got.update(lease=cs["bob"].acquire(1, A100, wait=30)))
        t.start()
        evicted = {
            watcher.wait_for(lambda e, i=x.id: e["type"] == "evicting" and e["lease"] == i, 10, x.id)["lease"]
            for x in by_gpu[warm_gpu]
        }
        assert evicted == {x.id for x in by_gpu[warm_gpu]}
        for x in by_gpu[1 - warm_gpu]:
            assert "recall_at" not in cs[x.user].get(x.id), x.user
        check_state(redis_sync, k)
        for x in by_gpu[warm_gpu]:
            cs[x.user].release(x)
        t.join(30)
        lease = got["lease"]
        assert lease.gpus[0]["index"] == warm_gpu and lease.gpu_mem_mb == 0
        assert sorted(e["lease"] for e in watcher.events if e["type"] == "evicting") == sorted(evicted)
        check_state(redis_sync, k)
        cs["bob"].release(lease)
        for x in by_gpu[1 - warm_gpu]:
            cs[x.user].release(x)
    finally:
        for c in cs.values():
            c.close()
    check_state(redis_sync, k, expect_all_free=True)
    check_event_log(read_events(redis_sync, k))


def test_a_slice_ended_by_the_server_drains_only_its_own_memory(server_factory: Any, redis_sync: Any) -> None:
    """A revoked slice whose holder named a process keeps its memory promised until its drain is
    reported clean; its GPU's other slices are untouched, and the GPU is whole again after."""
    from lease_server.store.scripts import Drained, Procs

    srv = server_factory("n1=4xA100-80GB,n2=2xA100-80GB,t1=2xT4-16GB", scheduling=SHARING, drain_kill_grace_s=600)

    k = keys_of(srv)
    with srv.client("alice") as alice, srv.client("bob") as bob, srv.client("root", "admin") as admin:
        mine = alice.acquire(1, A100, gpu_mem="30GB")
        other = bob.acquire(1, A100, gpu_mem="30GB")
        slot = f"{mine.node}/{mine.gpus[0]['index']}"
        assert slot == f"{other.node}/{other.gpus[0]['index']}"

        async def run(call: Any) -> Any:
            from lease_server.store.engine import Engine, connect

            r = connect(srv.settings.redis_url)
            try:
                return await Engine(r, srv.settings).run(call)
            finally:
                await r.aclose()

        # A process that outlives the drain's SIGTERM (the server's own agent drains this node, with
        # a grace of 600 s before SIGKILL here): the drain stays open until it is reported below,
        # whenever the agent looks at it. (A pid that does not run was found gone, and the drain
        # closed, before this test could look, on a loaded machine.)
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print(flush=True); time.sleep(600)",
            ],
            stdout=subprocess.PIPE,
        )
        assert holder.stdout is not None and holder.stdout.readline()  # SIGTERM is ignored from here on
        procs = [
            {"node": mine.node, "pid": holder.pid, "start": start_ticks(holder.pid), "gpus": [mine.gpus[0]["index"]]}
        ]
        asyncio.run(run(Procs(mine.id, str(mine.token), "alice", json.dumps(procs))))
        admin.revoke(mine.id, "testing a slice's drain")
        ledger = json.loads(redis_sync.hget(k.sliced, slot))
        assert list(ledger["draining"]) == [mine.id] and ledger["used_mb"] == 2 * 30720
        check_state(redis_sync, k)
        drains = admin.draining()
        assert [(d["lease"], d.get("gpu_mem_mb")) for d in drains] == [(mine.id, 30720)]
        assert asyncio.run(run(Drained(mine.node, mine.id, json.dumps([mine.gpus[0]["index"]])))) == 0
        ledger = json.loads(redis_sync.hget(k.sliced, slot))
        assert ledger["draining"] == {} and ledger["used_mb"] == 30720 and list(ledger["leases"]) == [other.id]
        check_state(redis_sync, k)
        bob.release(other)
        holder.kill()
        holder.wait()
    check_state(redis_sync, k, expect_all_free=True)
    check_event_log(read_events(redis_sync, k))


# ---- the randomized referee run --------------------------------------------------------------------


def _size(rng: random.Random) -> str | int | float:
    mb = rng.choice([rng.randint(1, 8192), rng.randint(1, 30000), rng.randint(1, GPU_MB)])
    return rng.choice([mb, f"{mb}MB", f"{max(1, mb // 1024)}GB", round(max(mb, 1) / GPU_MB, 3) or 0.001])


def test_randomized_slices_and_whole_gpus_never_overpromise_a_gpu(srv: ServerHandle, redis_sync: Any) -> None:
    """240 random steps: slices of random sizes (MB, GB, fractions), whole-GPU leases, releases,
    admin revokes, leases left to expire (ttl 1 s, never renewed: the server's sweep ends them),
    leases kept warm and requests that wait a moment (and so may evict warm slices or GPUs, which
    the sweep then revokes), on 6 shared A100s. The referee checks the whole state after every
    step, and the event log at the end: no GPU promised past its memory, no whole GPU shared."""
    rng = random.Random(35)
    k = keys_of(srv)
    users = ["ann", "ben", "cat", "dan"]
    clients = {u: srv.client(u) for u in users}
    admin = srv.client("root", "admin")
    live: list[Lease] = []
    short: list[Lease] = []
    outcomes: dict[str, int] = {}
    try:
        for _ in range(240):
            step = rng.choices(
                ["slice", "whole", "release", "revoke", "expire", "warm", "wait"], [40, 20, 35, 5, 10, 10, 5]
            )[0]
            user = rng.choice(users)
            c = clients[user]
            try:
                if step in ("slice", "expire"):
                    size = _size(rng)
                    k_gpus = rng.choice([1, 1, 1, 2])  # now and then a slice on each of two GPUs
                    lease = c.acquire(k_gpus, A100, ttl=1 if step == "expire" else 60, gpu_mem=size)
                    assert len(lease.gpus) == k_gpus
                    asked = c.gpu_mem_mb(size, A100)
                    assert lease.gpu_mem_mb >= asked and (lease.gpu_mem_mb % 1024 == 0 or lease.gpu_mem_mb == GPU_MB)
                    (short if step == "expire" else live).append(lease)
                elif step == "whole":
                    live.append(c.acquire(rng.choice([1, 1, 2]), A100, ttl=60))
                elif step == "wait":  # queued for a moment: a warm lease may be evicted for it
                    size = rng.choice([_size(rng), None])
                    live.append(c.acquire(rng.choice([1, 1, 2]), A100, ttl=60, gpu_mem=size, wait=0.3))
                elif step == "warm" and live:
                    lease = rng.choice(live)
                    try:
                        clients[lease.user].warm(lease)
                    except errors.Conflict:  # ended meanwhile (evicted, expired) or being evicted
                        live.remove(lease)
                elif live:
                    lease = live.pop(rng.randrange(len(live)))
                    try:
                        if step == "release":
                            clients[lease.user].release(lease)
                        else:
                            admin.revoke(lease.id, "randomized test")
                    except errors.LeaseEnded:  # evicted while warm: the sweep revoked it
                        outcomes["evicted"] = outcomes.get("evicted", 0) + 1
                outcomes[step] = outcomes.get(step, 0) + 1
            except errors.NoCapacity:
                outcomes["busy"] = outcomes.get("busy", 0) + 1
            check_state(redis_sync, k)
        # The short leases end by expiry: wait for each one's expired event (the sweep's), not a clock.
        for lease in short:
            with admin.event_stream(since="0", lease=lease.id) as events:
                for ev in events:
                    if ev["type"] in ("expired", "released", "revoked"):
                        assert ev["type"] == "expired"
                        break
            check_state(redis_sync, k)
        # Whatever the steps left: the pool full and every lease warm, a request that waits evicts.
        while True:
            try:
                live.append(clients["ann"].acquire(1, A100, ttl=60))
            except errors.NoCapacity:
                break
        for lease in list(live):
            try:
                clients[lease.user].warm(lease)
            except errors.Conflict:
                live.remove(lease)
        check_state(redis_sync, k)
        with contextlib.suppress(errors.NoCapacity):
            live.append(clients["ben"].acquire(1, A100, ttl=60, wait=0.3))
        check_state(redis_sync, k)
        for lease in live:
            with contextlib.suppress(errors.LeaseEnded):
                clients[lease.user].release(lease)
    finally:
        for c in [*clients.values(), admin]:
            c.close()
    assert outcomes.get("slice", 0) > 50 and outcomes.get("busy", 0) > 0 and outcomes.get("whole", 0) > 5, outcomes
    check_state(redis_sync, k, expect_all_free=True)
    counts = check_event_log(read_events(redis_sync, k))
    assert counts.get("expired", 0) == len(short) > 5
    assert counts.get("warm", 0) > 5 and counts.get("evicting", 0) > 0, counts  # warm leases were lent


# ---- a remote agent (gpulease agent, over HTTP) holds its node's slices to their memory ---------------


def test_the_http_agent_ends_only_the_slice_over_its_memory(server_factory: Any, redis_sync: Any) -> None:
    """gpulease agent on its own host (over HTTP, not in the server) measures the processes that
    claimed each slice on its node, warns then ends the one over its memory, and its neighbour on
    the same GPU runs on, measured. Bad reports are 400s that change nothing; another node's agent
    and a user are refused."""
    from lease_server.leasing.inventory import parse_simulate
    from lease_server.node.agent import run_remote
    from tests.api_helpers import EventWatcher
    from tests.test_drain import GRACE, STUBBORN, Watched, name

    srv = server_factory(
        simulate="",  # no agent in the server: r1 is this test's remote agent's
        scheduling={A100: {"share": True, "slice_unit_mb": 256, "max_sharers": 4}},
        slice_check_interval=0.2,
        drain_kill_grace_s=GRACE,
    )
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    stop = threading.Event()
    agent_client = srv.client("agent-r1", "agent")
    agent = threading.Thread(
        target=run_remote,
        args=(agent_client, parse_simulate("r1=1xA100-80GB"), 0.5, stop, 5.0, 0.1, GRACE),
        daemon=True,
    )
    agent.start()
    made: list[Watched] = []
    alice, bob, admin = srv.client("alice"), srv.client("bob"), srv.client("root", "admin")
    try:
        watcher.wait_for(lambda e: e["type"] == "node_registered" and e["node"] == "r1", 10, "r1 declared")
        mem = "/api/v1/nodes/r1/memory"
        assert agent_client.request("GET", mem)["watched"] == []  # nothing claimed: nothing to measure
        hog_lease = alice.acquire(1, A100, gpu_mem="256MB")
        calm_lease = bob.acquire(1, A100, gpu_mem="512MB")
        assert hog_lease.gpus == calm_lease.gpus  # one GPU, shared
        # 600 MB resident (written, so resident) in a 256 MB slice: the simulation's GPU memory
        made.append(Watched("hog = b'x' * (600 * 2**20)\n" + STUBBORN))
        made.append(Watched())
        name(alice, hog_lease, made[0])
        name(bob, calm_lease, made[1])
        warned = watcher.wait_for(lambda e: e["type"] == "over_memory_warning", 20, "the warning")
        ended = watcher.wait_for(lambda e: e["type"] == "over_memory", 20, "the end")
        assert warned["lease"] == ended["lease"] == hog_lease.id
        said = describe(warned), describe(ended)  # gpulease events, in words
        assert all(t.startswith(f"{ended['node']} GPU {ended['gpu']}: slice uses ") for t in said), said
        assert " of 256 MB; ended unless it drops" in said[0] and said[1].endswith(" of 256 MB; ended"), said
        watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == hog_lease.id, 20, "its drain")
        made[0].wait(5)  # the drain ended the hog's process, and nobody else's
        assert made[1].proc.poll() is None
        rec = alice.get(hog_lease.id)
        assert rec["cause"]["code"] == "over_memory" and rec["over_memory"]["peak_mb"] > 256 * 1.05, rec
        assert bob.get(calm_lease.id)["state"] == "active"
        # the neighbour is measured (what it uses now and its peak), as the board shows it
        watched = agent_client.request("GET", mem)["watched"]
        assert [w["lease"] for w in watched] == [calm_lease.id] and watched[0]["limit_mb"] == 512
        # bad reports: a 400 naming what to fix, nothing recorded
        before = redis_sync.hgetall(k.lease_util)
        for bad in (
            {"measured": {calm_lease.id: [1]}},
            {"over": [{"lease": calm_lease.id, "what": "explode", "used_mb": 1}]},
            {"measured": {"not a lease id!": [1, 2]}},
            {"surprise": 1},
        ):
            with pytest.raises(errors.BadRequest):
                agent_client.request("POST", mem, json=bad)
        assert redis_sync.hgetall(k.lease_util) == before
        # a lease with no process claimed on r1 is ignored, and not ended
        got = agent_client.request(
            "POST", mem, json={"over": [{"lease": "l-00000000000000ff", "what": "end", "used_mb": 9999}]}
        )
        assert got["ignored"] == ["l-00000000000000ff"] and got["ended"] == []
        other = srv.client("agent-r2", "agent")
        with pytest.raises(errors.UnknownNode):  # its first node binds its token: r2, not registered
            other.request("GET", "/api/v1/nodes/r2/memory")
        for who in (other, alice):
            with pytest.raises(errors.Forbidden):
                who.request("GET", mem)
            with pytest.raises(errors.Forbidden):
                who.request("POST", mem, json={"measured": {}})
        bob.release(calm_lease)
    finally:
        stop.set()
        agent.join(10)
        for p in made:
            p.kill()
        for c in (agent_client, alice, bob, admin):
            c.close()
    check_event_log(read_events(redis_sync, k))


# ---- a slice's processes, found without a cgroup (issue 49, item 2) -----------------------------------

# A cell's worker: claims the lease it reads on stdin (as a kernel's worker does), then its cell
# starts a daemon the usual way (fork, setsid, fork again, the middle process exits at once), which
# says its pid and, told to (its worker reads no more), holds 600 MB resident (the simulation's GPU
# memory) in a 256 MB slice. It ignores SIGTERM (its worker does not): only the drain's SIGKILL ends it.
ORPHANING_WORKER = (
    "import json, os, signal, sys, time\n"
    "from lease_server.node.claims import claim\n"
    "print('up', flush=True)\n"
    "claim(**json.loads(sys.stdin.readline()))\n"
    "r, w = os.pipe()\n"
    "middle = os.fork()\n"
    "if middle == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "        os.write(w, b'%d\\n' % os.getpid())\n"
    "        sys.stdin.readline()\n"
    "        held = bytearray(600 * 2**20)\n"
    "        for i in range(0, len(held), 4096):\n"
    "            held[i] = 1\n"
    "        time.sleep(600)\n"
    "    os._exit(0)\n"
    "os.waitpid(middle, 0)\n"
    "print(os.read(r, 64).decode().strip(), flush=True)\n"
    "time.sleep(600)\n"
)

# A worker that claims its lease, then has 256 more processes claim it (forked children, one after
# the other), then, told to, holds 600 MB resident in a 256 MB slice.
CLAIMED_OVER_WORKER = (
    "import json, os, sys, time\n"
    "from lease_server.node.claims import claim\n"
    "print('up', flush=True)\n"
    "args = json.loads(sys.stdin.readline())\n"
    "claim(**args)\n"
    "for _ in range(256):\n"
    "    kid = os.fork()\n"
    "    if kid == 0:\n"
    "        try:\n"
    "            claim(**args)\n"
    "            os._exit(0)\n"
    "        except BaseException:\n"
    "            os._exit(1)\n"
    "    assert os.waitpid(kid, 0)[1] == 0, 'a claim was refused'\n"
    "print('claimed', flush=True)\n"
    "sys.stdin.readline()\n"
    "held = bytearray(600 * 2**20)\n"
    "for i in range(0, len(held), 4096):\n"
    "    held[i] = 1\n"
    "print('holding', flush=True)\n"
    "time.sleep(600)\n"
)


def _one_slice_box(server_factory: Any) -> ServerHandle:
    """A server whose own agent measures its simulated GPU's slices every 0.1 s (no cgroups: the
    tests do not run as root)."""
    return server_factory(  # type: ignore[no-any-return]
        "box=1xA100-80GB",
        scheduling={A100: {"share": True, "slice_unit_mb": 256, "max_sharers": 4}},
        slice_check_interval=0.1,
        slice_over_s=0.3,
        drain_kill_grace_s=0.5,
        drain_interval=0.1,
    )


def test_a_daemon_that_left_its_workers_tree_is_held_to_its_slice(server_factory: Any, redis_sync: Any) -> None:
    """A cell's daemon (double fork, new session) that held 600 MB of a 256 MB slice was adopted by
    init, so the agent, which keeps no cgroup here, never measured it, and it outlived the lease.
    The worker now keeps it below itself (a subreaper): it is measured with the slice, which is
    ended for it, and the drain ends it with the worker, and waits for it when it outlives it."""
    from lease_server.procs import stat_fields
    from tests.test_drain import claim_line

    srv = _one_slice_box(server_factory)
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    worker = subprocess.Popen(
        [sys.executable, "-c", ORPHANING_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    daemon_fd: int | None = None
    daemon = 0
    try:
        assert worker.stdin is not None and worker.stdout is not None and worker.stdout.readline().strip() == "up"
        with srv.client("alice") as alice:
            lease = alice.acquire(1, A100, gpu_mem="256MB")
            worker.stdin.write(claim_line(alice, lease, lease.node) + "\n")
            worker.stdin.flush()
            daemon = int(worker.stdout.readline())
            daemon_fd = os.pidfd_open(daemon)
            rest = stat_fields(daemon)
            assert rest is not None and int(rest[1]) == worker.pid  # its parent gone, its worker adopted it
            worker.stdin.write("hold\n")
            worker.stdin.flush()
            ended = watcher.wait_for(lambda e: e["type"] == "over_memory" and e["lease"] == lease.id, 30, "the end")
            assert ended["used_mb"] > 256 * 1.05, ended
            watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease.id, 30, "its drain")
            # the drain ended the daemon too, not only the worker that claimed, and said the slice
            # clean only once it was gone (its worker, which adopted it, went first, at SIGTERM)
            assert select.select([daemon_fd], [], [], 0)[0], "the slice was drained with its daemon still there"
            assert worker.wait(10) is not None
    finally:
        if daemon_fd is not None:
            if not select.select([daemon_fd], [], [], 0)[0]:
                signal.pidfd_send_signal(daemon_fd, signal.SIGKILL)
            os.close(daemon_fd)
        if worker.poll() is None:
            worker.kill()
        worker.wait()
    check_state(redis_sync, k, expect_all_free=True)
    check_event_log(read_events(redis_sync, k))


def test_a_worker_stays_in_its_leases_record_whatever_else_claims_it(server_factory: Any, redis_sync: Any) -> None:
    """256 more claims of a lease pushed its worker out of the lease's record (a list of at most
    256): the worker was then neither measured nor drained. The record keeps its first claimer;
    the worker, over its slice after them, is ended."""
    from tests.test_drain import claim_line

    srv = _one_slice_box(server_factory)
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    worker = subprocess.Popen(
        [sys.executable, "-c", CLAIMED_OVER_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdin is not None and worker.stdout is not None and worker.stdout.readline().strip() == "up"
        with srv.client("alice") as alice:
            lease = alice.acquire(1, A100, gpu_mem="256MB", ttl=120)
            worker.stdin.write(claim_line(alice, lease, lease.node) + "\n")
            worker.stdin.flush()
            assert worker.stdout.readline().strip() == "claimed"
            procs = [p["pid"] for p in json.loads(redis_sync.hget(k.leases, lease.id))["procs"]]
            assert len(procs) == 256 and procs[0] == worker.pid, (len(procs), procs[:3], worker.pid)
            worker.stdin.write("hold\n")
            worker.stdin.flush()
            ended = watcher.wait_for(lambda e: e["type"] == "over_memory" and e["lease"] == lease.id, 30, "the end")
            assert ended["used_mb"] > 256 * 1.05, ended
            watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease.id, 30, "its drain")
            worker.wait(10)
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()
    check_state(redis_sync, k, expect_all_free=True)
    check_event_log(read_events(redis_sync, k))


def test_a_sliced_gpu_with_memory_no_slice_answers_for_takes_no_new_slice(server_factory: Any, redis_sync: Any) -> None:
    """A GPU shared by slices whose samples use more memory than its slices are promised, with a
    process on it that none of them claimed (a cell's daemon that outlived its lease), holds memory
    nobody is measured for: the next slice goes elsewhere, not where the ledger says it fits. Once a
    sample shows it gone, the GPU takes slices again. Through the server's own agent, which samples
    the simulated GPUs as an admin sets them (gpulease simulate)."""
    srv = server_factory(simulate="box=2xA100-80GB", scheduling=SHARING, sample_interval=0.1)
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    stray = subprocess.Popen(["sleep", "120"])  # the daemon: a real process of nobody's slice
    try:
        with srv.client("alice") as alice, srv.client("bob") as bob, srv.client("root", "admin") as admin:
            mine = alice.acquire(1, A100, gpu_mem="10GB")
            slot = f"{mine.node}/{mine.gpus[0]['index']}"
            assert slot == "box/0"
            sample = {"util": 0, "mem_mb": 40_000, "procs": [stray.pid]}  # 10 GB promised, 39 GB in use
            admin.request("PUT", "/api/v1/simulate/box", json={"gpus": {"0": sample}})
            ev = watcher.wait_for(lambda e: e["type"] == "unleased_use", 10, "unleased_use")
            assert (ev["gpu"], ev["pids"]) == (0, [stray.pid])
            assert json.loads(redis_sync.hget(k.sliced, slot))["unclaimed_mb"] == 40_000 - 10_240
            theirs = bob.acquire(1, A100, gpu_mem="10GB")  # fits box/0 by its ledger: placed on box/1
            assert theirs.gpus[0]["index"] == 1, theirs.gpus
            with pytest.raises(errors.NoCapacity):  # a slice on each of the two GPUs: box/0 is not one to take
                bob.acquire(2, A100, gpu_mem="10GB")
            check_state(redis_sync, k)
            admin.request("PUT", "/api/v1/simulate/box", json={"gpus": {"0": {"util": 0, "mem_mb": 9000, "procs": []}}})
            watcher.wait_for(lambda e: e["type"] == "unleased_use_ended", 10, "unleased_use_ended")
            assert "unclaimed_mb" not in json.loads(redis_sync.hget(k.sliced, slot))
            again = bob.acquire(1, A100, gpu_mem="10GB")  # the best fit again (box/0 first of two equal)
            assert again.gpus[0]["index"] == 0, again.gpus
            for lease, who in ((mine, alice), (theirs, bob), (again, bob)):
                who.release(lease)
    finally:
        stray.kill()
        stray.wait()
    check_state(redis_sync, k, expect_all_free=True)
    check_event_log(read_events(redis_sync, k))


# ---- 200 slice cells with real processes: only the ones over their memory are ended -----------------

# A worker: claims the lease it is told (as a kernel's worker does), holds that much resident memory
# (written, so resident: the simulation's GPU memory), frees it, and claims the next one.
SLICE_WORKER = (
    "import json, sys\n"
    "from lease_server.node.claims import claim\n"
    "held = None\n"
    "print('up', flush=True)\n"
    "for line in sys.stdin:\n"
    "    cmd = json.loads(line)\n"
    "    if 'claim' in cmd:\n"
    "        claim(**cmd['claim'])\n"
    "    elif 'hold' in cmd:\n"
    "        held = bytearray(cmd['hold'] * 2**20)\n"
    "        for i in range(0, len(held), 4096):\n"
    "            held[i] = 1\n"
    "    else:\n"
    "        held = None\n"
    "    print('ok', flush=True)\n"
)


@pytest.mark.slow  # it loads the machine (200 processes' claims and memory): never beside a timing-sensitive test
def test_200_random_slice_cells_only_the_offenders_are_ended(server_factory: Any, redis_sync: Any) -> None:
    """200 slice cells of random sizes, each run by a real process that claims its lease at the node
    agent and holds memory (resident memory: the simulation's GPU memory), a fifth of them past their
    slice. The referee never sees a GPU promised past its memory; every cell over its slice, and no
    other, is ended for it, within 2 s of going over (as the agent measured it); every process the
    agent ended was an offender's."""
    from tests.api_helpers import EventWatcher
    from tests.test_drain import claim_line

    srv = server_factory(
        "box=4xA100-80GB",
        scheduling={A100: {"share": True, "slice_unit_mb": 64, "max_sharers": 8}},
        slice_check_interval=0.1,
        slice_over_s=0.3,
        drain_kill_grace_s=0.5,
        drain_interval=0.1,
    )
    k = keys_of(srv)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    rng = random.Random(200)
    # small slices (a worker's own resident memory is ~30 MB), and an offender 1.5x over: light
    # enough not to starve the timing-sensitive tests that run beside it on a 2-core machine
    cells = [(rng.choice([96, 128, 160]), rng.random() < 0.2) for _ in range(200)]
    offenders: set[str] = set()
    innocents: set[str] = set()
    killed_innocents: list[str] = []
    errors_seen: list[str] = []
    lock = threading.Lock()

    def run(share: list[tuple[int, bool]], user: str) -> None:
        c = srv.client(user)
        worker: subprocess.Popen[str] | None = None

        def ask(cmd: dict[str, Any], may_die: bool = False) -> str:
            assert worker is not None and worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(json.dumps(cmd) + "\n")
            worker.stdin.flush()
            got = worker.stdout.readline().strip()
            if not got and not may_die:  # it died: say how, and on which step
                worker.wait(10)
                assert worker.stderr is not None
                raise AssertionError(f"{list(cmd)} killed ({worker.returncode}): {worker.stderr.read()[-2000:]}")
            return got

        try:
            for mb, offends in share:
                if worker is None or worker.poll() is not None:
                    worker = subprocess.Popen(
                        [sys.executable, "-c", SLICE_WORKER],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    assert worker.stdout is not None and worker.stdout.readline().strip() == "up"
                lease = c.acquire(1, A100, gpu_mem=f"{mb}MB", wait=60, ttl=60)
                with lock:
                    (offenders if offends else innocents).add(lease.id)
                assert ask({"claim": json.loads(claim_line(c, lease, lease.node))}) == "ok"
                # (an offender may be ended before it says so, on a loaded machine)
                said = ask({"hold": int(mb * 1.5) if offends else mb // 4}, may_die=offends)
                assert said == "ok" or (offends and said == ""), said
                if offends:  # ended by the agent, its process with it
                    watcher.wait_for(lambda e, i=lease.id: e["type"] == "drained" and e["lease"] == i, 30, lease.id)
                    worker.wait(10)
                else:  # a short cell, measured a few times, then done: its worker freed and still there
                    stop = threading.Event()
                    stop.wait(rng.uniform(0.2, 0.5))  # (the cell's own run time, not a wait on anything)
                    assert ask({"free": True}) == "ok"
                    if worker.poll() is not None:
                        killed_innocents.append(lease.id)
                    c.release(lease, verified=True)  # its worker lives on for the next cell
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors_seen.append(f"{user}: {exc!r}")
        finally:
            if worker is not None and worker.poll() is None:
                worker.kill()
                worker.wait()
            c.close()

    threads = [threading.Thread(target=run, args=(cells[i::4], f"u{i}"), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads) and not errors_seen, errors_seen
    assert not killed_innocents, killed_innocents
    events = read_events(redis_sync, k)
    ended = {e["lease"]: e for e in events if e["type"] == "over_memory"}
    assert set(ended) == offenders and len(offenders) > 20, (sorted(ended), sorted(offenders))
    with srv.client("root", "admin") as admin:  # how long each was over when its agent ended it
        over_s = [admin.get(lid)["over_memory"]["over_s"] for lid in ended]
    assert max(over_s) <= 2.0, over_s
    # every process the agent ended (drained, killed) was an offender's
    killers = {e["lease"] for e in events if e["type"] == "drained" and e.get("killed")}
    assert killers <= offenders, killers - offenders
    check_state(redis_sync, k, expect_all_free=True)
    check_event_log(events)


@pytest.mark.parametrize(
    ("other_uid", "mem_mb"),
    [
        # a process that claimed none of the slices, whose owner is none of their claimers
        (1, None),
        # every cell may run as one Ray user, so an owner tells nothing; but the slices are held
        # to their memory, so a GPU using more than they are promised has a process none of them
        # answers for, and what claimed none of them is named
        (0, 30_000),
    ],
    ids=["another-user", "same-user-beyond-the-promises"],
)
def test_a_process_no_slice_claimed_on_a_sliced_gpu_is_unleased_use(
    srv: ServerHandle, other_uid: int, mem_mb: int | None
) -> None:
    """A GPU shared by slices: such a process is unleased use there (flagged, named in its event),
    while a slice's own processes are not."""
    alice_token = srv.token("alice")
    lease = Client(srv.url, alice_token).acquire(1, A100, gpu_mem="10GB")
    idx = lease.gpus[0]["index"]
    worker = subprocess.Popen(["sleep", "60"])
    try:
        agent = srv.client(f"agent-{lease.node}", "agent")
        claim = {
            "lease": lease.id,
            "fence": lease.token,
            "token": alice_token,
            "pid": worker.pid,
            "start": start_ticks(worker.pid),
            "uid": os.getuid(),
            "gpus": [idx],
        }
        agent.request("POST", f"/api/v1/nodes/{lease.node}/procs", json=claim)
        watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
        sample = {"index": idx, "util": 50, "procs": [worker.pid, 4242], "uids": [os.getuid(), os.getuid() + other_uid]}
        if mem_mb is not None:
            sample["mem_mb"] = mem_mb
        agent.request("POST", f"/api/v1/nodes/{lease.node}/samples", json={"gpus": [sample]})
        ev = watcher.wait_for(lambda e: e["type"] == "unleased_use", 10, "unleased_use")
        assert (ev["node"], ev["gpu"], ev["pids"]) == (lease.node, idx, [4242]) and "lease" not in ev
    finally:
        worker.kill()
        worker.wait()
