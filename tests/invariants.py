"""Invariant checks over the event log and the Redis state of one key prefix."""

from __future__ import annotations

import json
from typing import Any

from redis import Redis

from lease_server.store.keys import Keys
from lease_server.store.layout import booking_index, victim_member

END_TYPES = ("released", "expired", "revoked")


def read_events(r: Redis, keys: Keys) -> list[dict[str, Any]]:
    out = []
    for entry_id, fields in r.xrange(keys.events, "-", "+"):
        out.append({"id": entry_id, "type": fields["type"], **json.loads(fields["data"])})
    return out


def _gpus(ev: dict[str, Any]) -> set[tuple[str, int]]:
    """The (node, index) GPUs an event names: a multi-node gang's come per node in ``parts``."""
    if ev.get("parts"):
        return {(part["node"], int(i)) for part in ev["parts"] for i in (part["gpus"] or [])}
    return {(ev["node"], int(i)) for i in ev["gpus"]}


def check_event_log(events: list[dict[str, Any]]) -> dict[str, int]:
    """Replay grants, resizes and ends in stream order: no GPU granted (or grown into) while held,
    tokens strictly rising and kept by a resize, a shrink gives back only GPUs its lease held, every
    end returns exactly the GPUs its lease held then. A GPU that the server took back (an end or a
    shrink naming it ``draining``) is granted again only after its ``drained`` event. Slices (a
    grant with ``gpu_mem_mb``): no GPU is ever promised beyond its memory to the slices on it, live
    or draining (an end with ``slice_draining`` keeps its memory until its ``drained``), and a GPU
    with slices is never granted whole, nor a slice put on a GPU held whole. Returns counts per
    event type."""
    held: dict[tuple[str, int], str] = {}
    draining: dict[tuple[str, int], str] = {}  # GPU -> the lease whose processes must be gone first
    slices: dict[tuple[str, int], dict[str, int]] = {}  # GPU -> {slice lease: MB}, live and draining
    slice_total: dict[tuple[str, int], int] = {}
    lease_gpus: dict[str, set[tuple[str, int]]] = {}
    lease_token: dict[str, int] = {}
    last_token = 0
    counts: dict[str, int] = {}
    for ev in events:
        counts[ev["type"]] = counts.get(ev["type"], 0) + 1
        if ev["type"] == "grant" and ev.get("gpu_mem_mb"):
            assert ev["token"] > last_token, f"token {ev['token']} after {last_token}: reused or out of order"
            last_token = ev["token"]
            gpus = _gpus(ev)
            # a slice is part of one GPU; k slices of one lease, one on each of k GPUs of one node
            assert gpus and len({node for node, _ in gpus}) == 1, f"slice {ev['lease']} granted on {gpus}"
            for g in gpus:
                assert g not in held, f"slice {ev['lease']} put on {g}, held whole by {held[g]}"
                assert g not in draining, f"slice {ev['lease']} put on {g} before {draining.get(g)} drained from it"
                on = slices.setdefault(g, {})
                slice_total[g] = int(ev["gpu_total_mb"])
                on[ev["lease"]] = int(ev["gpu_mem_mb"])
                total = sum(on.values())
                assert total <= slice_total[g], f"{g} promised {total} of {slice_total[g]} MB: {on}"
            assert ev["lease"] not in lease_gpus, f"lease id {ev['lease']} granted twice"
            lease_gpus[ev["lease"]] = gpus
            lease_token[ev["lease"]] = ev["token"]
        elif ev["type"] == "grant":
            assert ev["token"] > last_token, f"token {ev['token']} after {last_token}: reused or out of order"
            last_token = ev["token"]
            gpus = _gpus(ev)
            for g in gpus:
                assert g not in held, f"double grant: {g} granted to {ev['lease']} while held by {held[g]}"
                assert g not in draining, f"{g} granted to {ev['lease']} before {draining.get(g)} drained from it"
                assert not slices.get(g), f"{g} granted whole to {ev['lease']} while slices hold it: {slices[g]}"
                held[g] = ev["lease"]
            assert ev["lease"] not in lease_gpus, f"lease id {ev['lease']} granted twice"
            lease_gpus[ev["lease"]] = gpus
            lease_token[ev["lease"]] = ev["token"]
        elif ev["type"] == "grown":
            assert ev["token"] == lease_token.get(ev["lease"]), f"grown {ev['lease']} with token {ev['token']}"
            assert lease_gpus.get(ev["lease"]), f"grown {ev['lease']}, which holds nothing"
            for g in _gpus(ev):
                assert not slices.get(g), f"{g} grown into {ev['lease']} while slices hold it"
                assert g not in held, f"double grant: {g} grown into {ev['lease']} while held by {held[g]}"
                assert g not in draining, f"{g} grown into {ev['lease']} before {draining.get(g)} drained from it"
                held[g] = ev["lease"]
                lease_gpus[ev["lease"]].add(g)
            assert len(lease_gpus[ev["lease"]]) == ev["size"], f"grown {ev['lease']}: size {ev['size']}"
        elif ev["type"] == "shrunk":
            assert ev["token"] == lease_token.get(ev["lease"]), f"shrunk {ev['lease']} with token {ev['token']}"
            for g in _gpus(ev):
                assert held.get(g) == ev["lease"], f"shrunk {ev['lease']} gave back {g}, held by {held.get(g)}"
                del held[g]
                lease_gpus[ev["lease"]].discard(g)
            for i in ev.get("draining") or []:
                draining[(ev["node"], int(i))] = ev["lease"]
            assert len(lease_gpus[ev["lease"]]) == ev["size"] >= 1, f"shrunk {ev['lease']}: size {ev['size']}"
        elif ev["type"] == "unleased_held":  # a free GPU a process no lease covers uses: out of the pool
            for i in ev["gpus"]:
                g = (ev["node"], int(i))
                assert g not in held and g not in draining, f"held {g} for unleased use, but it was not free"
                draining[g] = ""
        elif ev["type"] == "drained" and ev.get("gpu_mem_mb"):  # a slice's memory, free again
            for i in ev["gpus"]:
                g = (ev["node"], int(i))
                mb = slices.get(g, {}).pop("~" + ev["lease"], None)
                assert mb == ev["gpu_mem_mb"], f"drained slice {ev['lease']} of {g}, which was not draining"
        elif ev["type"] == "drained":
            for i in ev["gpus"]:
                g = (ev["node"], int(i))
                assert draining.pop(g, None) == ev["lease"], f"drained {g} of {ev['lease']}, which was not draining"
        elif ev["type"] in END_TYPES and ev.get("gpu_mem_mb"):
            gpus = _gpus(ev)
            assert gpus == lease_gpus.get(ev["lease"]), f"{ev['type']} of slice {ev['lease']} returned {gpus}"
            for g in gpus:
                mb = slices.get(g, {}).pop(ev["lease"], None)
                assert mb == ev["gpu_mem_mb"], f"{ev['type']} of slice {ev['lease']}: {g} held {mb} MB for it"
                if ev.get("slice_draining"):  # its memory stays promised until its drained event
                    slices[g]["~" + ev["lease"]] = mb
            lease_gpus[ev["lease"]] = set()
        elif ev["type"] in END_TYPES:
            gpus = _gpus(ev)
            assert gpus == lease_gpus.get(ev["lease"]), f"{ev['type']} of {ev['lease']} returned {gpus}"
            for g in gpus:
                assert held.pop(g) == ev["lease"]
            parts = ev.get("parts") or [{"node": ev["node"], "draining": ev.get("draining")}]
            for part in parts:  # a multi-node gang's draining GPUs come per node
                for i in part.get("draining") or []:
                    draining[(part["node"], int(i))] = ev["lease"]
            lease_gpus[ev["lease"]] = set()
    return counts


def check_bookings(r: Redis, keys: Keys) -> None:
    """The bookings' indexes (one MULTI): the owners' (booking_own) lists exactly the active bookings
    whose last occurrence was not released; the occurrence index (booking_occ) holds only
    occurrences of active bookings that were not released, and every one of them not yet over
    (an ended one may wait there for the next reader of its pool)."""
    with r.pipeline(transaction=True) as p:
        p.hgetall(keys.bookings)
        p.zrange(keys.booking_occ, 0, -1)
        p.zrange(keys.booking_own, 0, -1)
        p.time()
        bookings, occ, own, (seconds, micros) = p.execute()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    want_own: set[str] = set()
    may_occ: set[str] = set()
    must_occ: set[str] = set()
    for raw in bookings.values():
        rec = json.loads(raw)
        every, mine = booking_index(rec, -(2**62))
        may_occ.update(every)
        must_occ.update(booking_index(rec, now_ms)[0])
        want_own.update([mine] if mine else [])
    assert set(own) == want_own, f"booking_own {sorted(own)} != {sorted(want_own)}"
    assert set(occ) <= may_occ, f"booking_occ holds what no booking has: {sorted(set(occ) - may_occ)}"
    assert must_occ <= set(occ), f"booking_occ lacks occurrences not yet over: {sorted(must_occ - set(occ))}"


def check_state(r: Redis, keys: Keys, *, expect_all_free: bool = False) -> None:
    """One consistent snapshot (MULTI): holders, leases, free lists and the fit index agree; the
    quota counts (held_by) are the GPUs the live leases hold; the elastic index lists exactly the
    live elastic leases, the shrink deadlines exactly those asked to shrink, and the recall index
    (victims) exactly the leases a recall may take back, each in its class. Then the bookings'
    indexes (check_bookings)."""
    check_bookings(r, keys)
    with r.pipeline(transaction=True) as p:
        p.hgetall(keys.nodes)
        p.hgetall(keys.free)
        p.hgetall(keys.holders)
        p.hgetall(keys.leases)
        p.zrange(keys.fit, 0, -1)
        p.zrange(keys.deadlines, 0, -1)
        p.hgetall(keys.held_by)
        p.zrange(keys.elastic, 0, -1)
        p.zrange(keys.shrink_due, 0, -1)
        p.hgetall(keys.draining)
        p.hgetall(keys.waiters)
        p.zrange(keys.wait_due, 0, -1, withscores=True)
        p.hgetall(keys.waiting_by)
        p.hgetall(keys.sliced)
        p.zrange(keys.slice_fit, 0, -1)
        p.zrange(keys.victims, 0, -1)
        p.hgetall(keys.pool_free)
        (
            nodes,
            free,
            holders,
            leases,
            fit,
            deadlines,
            held_by,
            elastic,
            shrink_due,
            draining,
            waiters,
            wait_due,
            waiting_by,
            sliced,
            slice_fit,
            victims,
            pool_free,
        ) = p.execute()
    per_user: dict[str, int] = {}
    for raw in waiters.values():
        u = json.loads(raw)["user"]
        per_user[u] = per_user.get(u, 0) + 1
    assert {u: int(n) for u, n in waiting_by.items()} == per_user, f"queued per user {waiting_by} != {per_user}"
    # the sweep's index of the queued requests' deadlines: exactly the waiters, each at its deadline
    want_due = {wid: float(json.loads(raw)["deadline"]) for wid, raw in waiters.items()}
    assert dict(wait_due) == want_due, f"wait_due {dict(wait_due)} != the waiters' deadlines {want_due}"
    leases = {k: json.loads(v) for k, v in leases.items()}
    assert set(deadlines) == set(leases), "deadline index and live leases differ"
    assert set(elastic) == {f"{v['pool']}|{k}" for k, v in leases.items() if v.get("elastic")}, "elastic index"
    assert set(shrink_due) == {k for k, v in leases.items() if v.get("shrink_to")}, "shrink deadlines"
    # the recall index lists exactly the live leases a recall may take back, each in its class
    want_victims = {m for m in (victim_member(v) for v in leases.values()) if m is not None}
    assert set(victims) == want_victims, f"recall index {sorted(victims)} != {sorted(want_victims)}"
    for lease in leases.values():
        if lease.get("shrink_to"):
            assert lease["elastic"]["min"] <= lease["shrink_to"] < len(lease["gpus"]), lease
    counted: dict[str, int] = {}
    for lease in leases.values():
        if lease.get("warm_since"):  # warm leases per pool (dispatch: whom it may evict), GPUs per node (the fit)
            counted[f"{lease['pool']}|~warm"] = counted.get(f"{lease['pool']}|~warm", 0) + 1
            if not lease.get("gpu_mem_mb"):  # a warm slice lends memory, not a whole GPU: not in the fit
                on = f"{lease['pool']}|~warm@{lease['node']}"
                counted[on] = counted.get(on, 0) + len(lease["gpus"])
        if lease.get("preemptible"):
            counted[f"{lease['pool']}|~preemptible"] = counted.get(f"{lease['pool']}|~preemptible", 0) + 1
        elif not lease.get("resv"):
            # a slice counts its fraction of the GPU, in milli-GPUs ("|m"), whole leases their GPUs
            size, suffix = len(lease["gpus"]), ""
            if lease.get("gpu_mem_mb"):
                milli = max(1, int(lease["gpu_mem_mb"] * 1000 / lease["gpu_total_mb"] + 0.5))
                size, suffix = milli * len(lease["gpus"]), "|m"
            for who in [lease["user"], *(f"team:{t}" for t in (lease.get("teams") or "").split(",") if t)]:
                field = f"{lease['pool']}|{who}{suffix}"
                counted[field] = counted.get(field, 0) + size
    nonzero = {k: int(v) for k, v in held_by.items() if int(v) != 0}
    assert nonzero == counted, f"quota counts {nonzero} but the live leases hold {counted}"
    drain_marks = {slot for slot, lid in holders.items() if lid == "~"}
    assert drain_marks == set(draining), f"draining GPUs {sorted(draining)} but drain marks {sorted(drain_marks)}"
    check_slices(sliced, slice_fit, holders, leases)
    for slot, lid in holders.items():
        node, idx = slot.split("/")
        if lid in ("~", "~slices"):
            continue  # draining, or shared by slices (check_slices): held by no one lease, not free
        assert lid in leases, f"{slot} held by {lid}, which is not live"
        mine = [(g.get("node", leases[lid]["node"]), g["index"]) for g in leases[lid]["gpus"]]
        assert (node, int(idx)) in mine, f"{slot} held by {lid}, which does not list it"
    for lid, lease in leases.items():
        for g in lease["gpus"]:
            slot = f"{g.get('node', lease['node'])}/{g['index']}"
            want = "~slices" if lease.get("gpu_mem_mb") else lid
            assert holders.get(slot) == want, f"{lid} lost its holder entry {slot}"
    fit_by_node = {m.split("|", 2)[2]: int(m.split("|", 2)[1]) for m in fit}
    fit_by_pool: dict[str, int] = {}
    for m in fit:
        fit_by_pool[m.split("|", 1)[0]] = fit_by_pool.get(m.split("|", 1)[0], 0) + int(m.split("|", 2)[1])
    kept = {pool: int(n) for pool, n in pool_free.items() if int(n)}
    assert kept == {pool: n for pool, n in fit_by_pool.items() if n}, f"pool_free {pool_free} != fit {fit_by_pool}"
    for node, raw in nodes.items():
        inv = json.loads(raw)
        free_idx = json.loads(free.get(node, "[]")) or []
        all_idx = {g["index"] for g in inv["gpus"]}
        held_idx = {int(s.split("/")[1]) for s in holders if s.split("/")[0] == node}
        assert not (set(free_idx) & held_idx), f"{node}: a GPU is both free and held"
        assert set(free_idx) | held_idx == all_idx, f"{node}: a GPU is neither free nor held"
        if node in fit_by_node:
            assert fit_by_node[node] == len(free_idx), f"{node}: fit index says {fit_by_node[node]} free"
        if expect_all_free:
            assert set(free_idx) == all_idx, f"{node}: GPUs still held at the end"
    if expect_all_free:
        assert not leases and not holders and not draining and not sliced and not slice_fit


def check_slices(
    sliced: dict[str, str], slice_fit: list[str], holders: dict[str, str], leases: dict[str, dict[str, Any]]
) -> None:
    """The GPUs shared by slices: no GPU promised beyond its memory (its ledger's used_mb is what its
    live and draining slices hold, at most total_mb), never more sharers than its pool allows, every
    live slice in the ledger of its GPU and nowhere else, a GPU is sliced exactly when its holders
    entry says "~slices", and the best-fit index lists exactly the sliced GPUs with room left."""
    assert {slot for slot, h in holders.items() if h == "~slices"} == set(sliced), "sliced GPUs and their marks"
    want_fit = set()
    in_ledgers: dict[str, set[str]] = {}
    for slot, raw in sliced.items():
        s = json.loads(raw)
        mine = {lid: int(mb) for lid, mb in (s["leases"] or {}).items()}
        drains = {lid: int(d["mb"]) for lid, d in (s["draining"] or {}).items()}
        used = sum(mine.values()) + sum(drains.values())
        assert used == s["used_mb"], f"{slot}: ledger says {s['used_mb']} MB used, its slices hold {used}"
        assert 0 < used <= s["total_mb"], f"{slot}: promised {used} of {s['total_mb']} MB"
        assert len(mine) + len(drains) <= s["max"], f"{slot}: {len(mine) + len(drains)} sharers, max {s['max']}"
        for lid, mb in mine.items():
            lease = leases.get(lid)
            assert lease is not None, f"{slot}: slice of {lid}, which is not live"
            assert lease.get("gpu_mem_mb") == mb and lease["gpu_total_mb"] == s["total_mb"], (slot, lid, lease)
            mine_slots = {f"{lease['node']}/{g['index']}" for g in lease["gpus"]}
            assert slot in mine_slots, f"{lid} is in the ledger of {slot}"
            in_ledgers.setdefault(lid, set()).add(slot)
        if len(mine) + len(drains) < s["max"] and used < s["total_mb"]:
            want_fit.add(f"{s['pool']}|{s['total_mb'] - used:08d}|{slot}")
    assert set(slice_fit) == want_fit, f"slice fit index {sorted(slice_fit)} != {sorted(want_fit)}"
    live_slices = {lid for lid, lease in leases.items() if lease.get("gpu_mem_mb")}
    assert live_slices == set(in_ledgers), f"live slices {sorted(live_slices)} vs ledgers {sorted(in_ledgers)}"
    for lid, slots in in_ledgers.items():  # k slices of a lease: one in the ledger of each of its k GPUs
        lease = leases[lid]
        assert slots == {f"{lease['node']}/{g['index']}" for g in lease["gpus"]}, f"{lid} in ledgers {slots}"
