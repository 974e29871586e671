"""Bookings: clash detection over time (weekly repeats, UTC storage), enforcement (holder served
first, borrowed leases recalled with notice), no-show release, ending early, teams, bad input.

Everything runs against a real Redis and a real lease server (or LeaseStore on the same Redis where
a virtual clock is needed to move past a no-show deadline)."""

from __future__ import annotations

import asyncio
import email.utils
import json
import re
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from redis.asyncio import Redis as ARedis

from lease_server import errors, protocol
from lease_server.leasing.bookings import WEEK_MS, Bookings
from lease_server.leasing.inventory import parse_simulate, register
from lease_server.leasing.lease import LeaseStore
from lease_server.request import AcquireRequest
from lease_server.store.engine import Engine
from lease_server.store.keys import Keys
from tests.api_helpers import API, EventWatcher, assert_error, http, unchanged
from tests.conftest import make_settings
from tests.invariants import check_state

HOUR = 3600
# A Monday well in the future, 09:00 UTC: clash tests do not depend on today's date.
MONDAY = datetime(2027, 1, 4, 9, 0, tzinfo=UTC).timestamp()


def book(h, pool="A100-80GB", gpus=1, start=MONDAY, hours=2.0, **kw):
    body = {"pool": pool, "gpus": gpus, "start": start, "end": start + hours * HOUR, **kw}
    return h.post(f"{API}/bookings", json=body)


def test_create_list_get_edit_cancel(server_factory, redis_sync):
    srv = server_factory()
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        resp = book(alice, gpus=2, start=MONDAY, hours=0, note="paper deadline")
        assert_error(resp, 400, "bad_request", "at least 60 s after start")
        resp = alice.post(
            f"{API}/bookings",
            json={"pool": "A100-80GB", "gpus": 2, "start": "2027-01-04T10:00:00+01:00", "end": "2027-01-04T12:00Z"},
        )
        assert resp.status_code == 201, resp.text
        r = resp.json()
        # Stored in UTC: 10:00+01:00 is 09:00 UTC.
        assert r["start"] == MONDAY and r["end"] == MONDAY + 3 * HOUR
        assert r["owner"] == "alice" and r["created_by"] == "alice" and r["mine"] is True
        assert resp.headers["Location"] == f"{API}/bookings/{r['id']}"
        assert r["instances"] == [
            {"k": 0, "start": MONDAY, "end": MONDAY + 3 * HOUR, "state": "upcoming", "used": False}
        ]

        listed = bob.get(f"{API}/bookings", params={"from": MONDAY - HOUR, "to": MONDAY + 5 * HOUR}).json()
        assert [(x["id"], x["owner"], x["mine"]) for x in listed["bookings"]] == [(r["id"], "alice", False)]
        assert (
            bob.get(f"{API}/bookings", params={"pool": "T4-16GB", "from": MONDAY, "to": MONDAY + HOUR}).json()[
                "bookings"
            ]
            == []
        )
        # Outside the window: not listed.
        assert (
            bob.get(f"{API}/bookings", params={"from": MONDAY + 4 * HOUR, "to": MONDAY + 5 * HOUR}).json()["bookings"]
            == []
        )

        assert_error(bob.patch(f"{API}/bookings/{r['id']}", json={"gpus": 1}), 403, "not_owner", "alice")
        assert_error(bob.delete(f"{API}/bookings/{r['id']}"), 403, "not_owner")
        changed = alice.patch(f"{API}/bookings/{r['id']}", json={"gpus": 3, "note": "more"}).json()
        assert changed["gpus"] == 3 and changed["note"] == "more" and changed["rev"] == r["rev"] + 1
        assert changed["start"] == r["start"]

        cancelled = alice.delete(f"{API}/bookings/{r['id']}").json()
        assert cancelled["state"] == "cancelled" and cancelled["cancelled_by"] == "alice"
        assert alice.get(f"{API}/bookings/{r['id']}").json()["state"] == "cancelled"
        assert alice.get(f"{API}/bookings", params={"from": MONDAY, "to": MONDAY + HOUR}).json()["bookings"] == []
        assert_error(alice.get(f"{API}/bookings/r-nosuch"), 404, "no_such_reservation")
    types = [f["type"] for _id, f in redis_sync.xrange(Keys(srv.settings.prefix).events)]
    assert {"reservation_created", "reservation_changed", "reservation_cancelled"} <= set(types)


OLD = f"{API}/reservations"  # the paths of the first releases, deprecated


def _deprecated_for(resp, successor):
    """The RFC 9745 headers of a deprecated path's answer: since when, until when (RFC 8594's
    Sunset, an HTTP-date after the Deprecation date), and the path that replaces it."""
    assert resp.headers["Deprecation"] == f"@{protocol.DEPRECATED_SINCE}", resp.headers
    assert re.fullmatch(r"@-?\d+", resp.headers["Deprecation"])  # a Structured Field Date
    assert resp.headers["Sunset"] == "Mon, 01 Mar 2027 00:00:00 GMT", resp.headers
    sunset = email.utils.parsedate_to_datetime(resp.headers["Sunset"]).timestamp()
    assert sunset == protocol.SUNSET > protocol.DEPRECATED_SINCE
    assert resp.headers["Link"] == f'<{successor}>; rel="successor-version"'


def test_old_reservation_paths_answer_as_before_and_say_they_are_deprecated(server_factory):
    srv = server_factory()
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        body = {"pool": "A100-80GB", "gpus": 2, "start": MONDAY, "end": MONDAY + 2 * HOUR, "note": "old client"}
        resp = alice.post(OLD, json=body)
        assert resp.status_code == 201, resp.text
        made = resp.json()
        assert resp.headers["Location"] == f"{OLD}/{made['id']}"  # where an old client reads it back
        _deprecated_for(resp, f"{API}/bookings")
        new = alice.get(f"{API}/bookings/{made['id']}")
        assert "Deprecation" not in new.headers and "Sunset" not in new.headers and "Link" not in new.headers
        assert made == new.json()

        window = {"from": MONDAY - HOUR, "to": MONDAY + 5 * HOUR}
        listed = bob.get(OLD, params=window)
        _deprecated_for(listed, f"{API}/bookings")
        assert set(listed.json()) == {"reservations", "now", "from", "to"}
        assert [x["id"] for x in listed.json()["reservations"]] == [made["id"]]
        fresh = bob.get(f"{API}/bookings", params=window)
        assert set(fresh.json()) == {"bookings", "now", "from", "to"} and "Deprecation" not in fresh.headers
        assert fresh.json()["bookings"] == listed.json()["reservations"]

        one = f"{OLD}/{made['id']}"
        got = bob.get(one)
        _deprecated_for(got, f"{API}/bookings/{made['id']}")
        assert got.json()["id"] == made["id"] and got.json()["mine"] is False
        changed = alice.patch(one, json={"gpus": 1})
        _deprecated_for(changed, f"{API}/bookings/{made['id']}")
        assert changed.json()["gpus"] == 1
        # Refusals say it too, with the body they always had.
        refused = bob.delete(one)
        assert_error(refused, 403, "not_owner", "not yours")
        _deprecated_for(refused, f"{API}/bookings/{made['id']}")
        missing = alice.get(f"{OLD}/r-nosuch")
        assert_error(missing, 404, "no_such_reservation")
        _deprecated_for(missing, f"{API}/bookings/r-nosuch")
        not_now = alice.post(f"{one}/end")
        assert_error(not_now, 409, "conflict", "not in force")
        _deprecated_for(not_now, f"{API}/bookings/{made['id']}/end")
        cancelled = alice.delete(one)
        _deprecated_for(cancelled, f"{API}/bookings/{made['id']}")
        assert cancelled.json()["state"] == "cancelled"
        anonymous = http(srv).get(OLD)
        assert_error(anonymous, 401, "unauthorized")
        _deprecated_for(anonymous, f"{API}/bookings")

        for path in (f"{API}/bookings", f"{API}/bookings/{made['id']}", f"{API}/bookings/r-nosuch/end"):
            for resp in (alice.get(path), alice.post(path, json={})):
                assert "Deprecation" not in resp.headers and "Sunset" not in resp.headers
                assert "successor-version" not in resp.headers.get("Link", "")


def test_client_methods_of_earlier_releases_warn_and_still_work(server_factory):
    srv = server_factory()
    client = srv.client("alice")
    start = MONDAY + 24 * HOUR
    with pytest.warns(DeprecationWarning, match=r"Client.reserve is deprecated: use Client.book"):
        made = client.reserve("A100-80GB", 1, start, start + HOUR)
    with pytest.warns(DeprecationWarning, match=r"use Client.bookings"):
        assert [b["id"] for b in client.reservations(None, start - HOUR, start + 2 * HOUR)] == [made["id"]]
    with pytest.warns(DeprecationWarning, match=r"use Client.end_booking"), pytest.raises(errors.Conflict):
        client.end_reservation(made["id"])  # not in force yet
    with pytest.warns(DeprecationWarning, match=r"use Client.cancel_booking"):
        assert client.cancel_reservation(made["id"])["state"] == "cancelled"
    with pytest.warns(DeprecationWarning, match=r"errors.ReservationClash is deprecated: use errors.BookingClash"):
        assert errors.ReservationClash is errors.BookingClash  # type: ignore[attr-defined]


def test_clash_names_bookings_and_suggests_nearest_windows(server_factory):
    srv = server_factory()  # A100-80GB: n1 = 4 GPUs, n2 = 2 GPUs
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        a = book(alice, gpus=4, start=MONDAY, hours=2).json()
        resp = book(bob, gpus=3, start=MONDAY + HOUR, hours=2, note="bob's run")
        body = assert_error(resp, 409, "reservation_clash", "alice", "book at most 2")
        d = body["details"]
        assert [c["id"] for c in d["clashes"]] == [a["id"]]
        assert d["capacity"] == 6 and d["reserved"] == 4 and d["max_gpus"] == 2
        # Nearest windows of the same length that fit: right after alice's, or ending as hers begins.
        assert {"start": MONDAY + 2 * HOUR, "end": MONDAY + 4 * HOUR} in d["suggestions"]
        assert {"start": MONDAY - 2 * HOUR, "end": MONDAY} in d["suggestions"]
        # Dry run: says whether it fits and stores nothing.
        assert (
            bob.post(
                f"{API}/bookings?dry_run=true",
                json={"pool": "A100-80GB", "gpus": 2, "start": MONDAY + HOUR, "end": MONDAY + 3 * HOUR},
            ).json()["fits"]
            is True
        )
        assert len(bob.get(f"{API}/bookings", params={"from": MONDAY, "to": MONDAY + 9 * HOUR}).json()["bookings"]) == 1
        # The suggestion fits; back-to-back bookings do not overlap.
        s = d["suggestions"][0]
        assert book(bob, gpus=3, start=s["start"], hours=2).status_code == 201
        assert book(bob, gpus=2, start=MONDAY, hours=2).status_code == 201  # 4 + 2 = 6: exactly full
        assert_error(book(bob, gpus=1, start=MONDAY + 1.5 * HOUR, hours=0.25), 409, "reservation_clash")
        # Editing into a clash is refused and changes nothing.
        assert_error(alice.patch(f"{API}/bookings/{a['id']}", json={"gpus": 5}), 409, "reservation_clash")
        assert alice.get(f"{API}/bookings/{a['id']}").json()["gpus"] == 4
        # More than the pool can ever book: 422, not 409.
        assert_error(book(alice, gpus=7, start=MONDAY + 50 * HOUR), 422, "unsatisfiable", "book at most 6")


def test_weekly_repeats_clash_in_later_weeks_and_are_stored_in_utc(server_factory):
    srv = server_factory()
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        # Every Monday 09:00-11:00 Berlin winter time (08:00 UTC), 4 times, across the DST change of
        # 2027-03-28: repeats are exactly 168 h apart in UTC.
        a = alice.post(
            f"{API}/bookings",
            json={
                "pool": "A100-80GB",
                "gpus": 4,
                "start": "2027-03-15T09:00:00+01:00",
                "end": "2027-03-15T11:00:00+01:00",
                "repeat": "weekly",
                "occurrences": 4,
            },
        ).json()
        first = datetime(2027, 3, 15, 8, 0, tzinfo=UTC).timestamp()
        assert a["start"] == first and a["repeat"] == "weekly" and a["occurrences"] == 4
        assert [i["start"] - first for i in a["instances"]] == [k * WEEK_MS / 1000 for k in range(4)]
        # Week 3 (after the change) is 08:00-10:00 UTC = 10:00-12:00 Berlin summer time.
        assert_error(
            bob.post(
                f"{API}/bookings",
                json={
                    "pool": "A100-80GB",
                    "gpus": 3,
                    "start": "2027-03-29T11:00:00+02:00",
                    "end": "2027-03-29T13:00:00+02:00",
                },
            ),
            409,
            "reservation_clash",
        )
        # Ending at 08:00 UTC (10:00 summer time) touches it without overlapping.
        assert (
            bob.post(
                f"{API}/bookings",
                json={
                    "pool": "A100-80GB",
                    "gpus": 3,
                    "start": "2027-03-29T08:00:00+02:00",
                    "end": "2027-03-29T10:00:00+02:00",
                },
            ).status_code
            == 201
        )
        # Week 5 is after the last occurrence: free.
        assert book(bob, gpus=6, start=first + 4 * 7 * 24 * HOUR, hours=2).status_code == 201
        # A weekly booking clashing only in its third week is refused, naming alice's booking.
        body = assert_error(
            book(bob, gpus=3, start=first - 2 * 7 * 24 * HOUR, hours=1, repeat="weekly", occurrences=3),
            409,
            "reservation_clash",
        )
        assert [c["id"] for c in body["details"]["clashes"]] == [a["id"]]
        assert body["details"]["clashes"][0]["start"] == first
        # The weekly suggestion keeps the series weekly and fits every week.
        for s in body["details"]["suggestions"]:
            assert s["end"] - s["start"] == HOUR


def test_all_on_one_node_bookings_clash_per_node(server_factory):
    srv = server_factory("n1=4xA100-80GB,n2=4xA100-80GB")
    with http(srv, "alice") as alice:
        x = book(alice, gpus=3, colocate=True).json()
        y = book(alice, gpus=3, colocate=True).json()
        assert {x["node"], y["node"]} == {"n1", "n2"}
        # The pool has 2 GPUs left, but no node has 2 left for one co-located booking.
        body = assert_error(book(alice, gpus=2, colocate=True), 409, "reservation_clash", "one node")
        assert body["details"]["max_gpus"] == 1
        assert book(alice, gpus=2).status_code == 201  # spread over nodes it fits
        assert_error(book(alice, gpus=5, colocate=True, start=MONDAY + 99 * HOUR), 422, "unsatisfiable", "largest")


def test_bad_input_is_refused_and_changes_nothing(server_factory, redis_sync):
    srv = server_factory(teams={"ml": ["alice"]})
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        mine = book(alice, gpus=1).json()
        base = {"pool": "A100-80GB", "gpus": 1, "start": MONDAY, "end": MONDAY + HOUR}
        cases = [
            ({**base, "gpus": -1}, 400, "bad_request", "at least 1"),
            ({**base, "gpus": "2"}, 400, "bad_request", "whole number"),
            ({**base, "start": "2027-01-04T09:00:00"}, 400, "bad_request", "no utc offset"),
            ({**base, "start": "next monday"}, 400, "bad_request", "iso 8601"),
            ({**base, "start": MONDAY * 1000}, 400, "bad_request", "epoch seconds"),
            ({**base, "end": MONDAY - HOUR}, 400, "bad_request", "after start"),
            ({**base, "end": MONDAY + 40 * 24 * HOUR}, 400, "bad_request", "at most 31 days"),
            ({**base, "repeat": "daily"}, 400, "bad_request", "weekly"),
            ({**base, "repeat": "weekly", "occurrences": 0}, 400, "bad_request", "occurrences"),
            ({**base, "occurrences": 3}, 400, "bad_request", "weekly"),
            ({**base, "colocate": "yes"}, 400, "bad_request", "colocate"),
            ({**base, "owner": "carol"}, 403, "forbidden", "admin"),
            ({**base, "owner": "team:ml"}, 403, "forbidden", "not a member"),
            ({**base, "owner": "team:"}, 400, "bad_request", "owner"),
            ({**base, "pool": "H100"}, 404, "unknown_pool", "A100-80GB"),
            ({**base, "start": 1_000_000_000, "end": 1_000_003_600}, 400, "bad_request", "past"),
            ({**base, "room": 5}, 400, "bad_request", "unknown field"),
            ({k: v for k, v in base.items() if k != "end"}, 400, "bad_request", "missing"),
        ]
        for body, status, code, frag in cases:
            with unchanged(redis_sync, srv.settings.prefix):
                assert_error(bob.post(f"{API}/bookings", json=body), status, code, frag)
        with unchanged(redis_sync, srv.settings.prefix):
            assert_error(
                bob.post(f"{API}/bookings", content=b"{not json", headers={"Content-Type": "application/json"}),
                400,
                "bad_request",
                "json",
            )
            assert_error(bob.post(f"{API}/bookings", content=b"[" + b"1," * 40_000 + b"1]"), 413, "payload_too_large")
            assert_error(bob.patch(f"{API}/bookings/{mine['id']}", json={"gpus": 2}), 403, "not_owner")
            assert_error(alice.patch(f"{API}/bookings/{mine['id']}", json={"gpus": 0}), 400, "bad_request")
            assert_error(alice.patch(f"{API}/bookings/{mine['id']}", json={}), 400, "bad_request", "nothing")
            assert_error(alice.post(f"{API}/bookings/{mine['id']}/end"), 409, "conflict", "not in force")
            assert_error(alice.get(f"{API}/bookings", params={"from": "soon"}), 400, "bad_request")
            assert_error(alice.post(f"{API}/bookings?dry_run=maybe", json=base), 400, "bad_request", "true or false")
            assert_error(alice.get(f"{API}/bookings/bad%20id"), 404, "not_found")
            assert_error(http(srv).get(f"{API}/bookings"), 401, "unauthorized")


def _wait_event(watcher: EventWatcher, kind: str, timeout: float = 20, **match: object) -> dict:
    return watcher.wait_for(lambda e: e["type"] == kind and all(e.get(k) == v for k, v in match.items()), timeout, kind)


def test_holder_is_served_first_and_borrowed_leases_are_recalled_with_notice(server_factory):
    notice = 1.0
    srv = server_factory("a=2xA100-80GB", borrow_notice=notice, default_ttl=60)
    now = time.time()
    alice_c, bob_c, dave_c = srv.client("alice"), srv.client("bob"), srv.client("dave")
    watcher = EventWatcher(srv.url, srv.token("admin", "admin")).start()
    with http(srv, "alice") as alice:
        resp = book(alice, gpus=2, start=now - 1, hours=1)
        assert resp.status_code == 201, resp.text
        booking = resp.json()
        # Nobody else may take booked GPUs except as borrowed leases.
        b1 = bob_c.acquire(1, ttl=60)
        b2 = bob_c.acquire(1, ttl=60)
        assert b1.borrowed and b2.borrowed and not b1.booking
        # dave queues first; alice, the holder, still goes ahead of him.
        dave_result: dict = {}

        def dave_wait() -> None:
            dave_result["lease"] = dave_c.acquire(1, wait=30, ttl=60)

        t = threading.Thread(target=dave_wait)
        t.start()
        _wait_event(watcher, "queued", user="dave")
        lease = alice_c.acquire(2, wait=20, ttl=60)
        assert lease.booking == booking["id"] and not lease.borrowed
        recalls = [e for e in watcher.events if e["type"] == "borrow_recalled"]
        assert sorted(e["lease"] for e in recalls) == sorted([b1.id, b2.id])
        revokes = [_wait_event(watcher, "revoked", lease=b.id) for b in (b1, b2)]
        grant = _wait_event(watcher, "grant", lease=lease.id)
        # On the server's clock: revoked no sooner than the notice, and alice waited about the notice.
        by_lease = sorted(recalls, key=lambda e: e["lease"])
        for rec, rev in zip(by_lease, sorted(revokes, key=lambda e: e["lease"]), strict=True):
            assert rev["ts"] - rec["ts"] >= notice - 0.001
            assert "recalled for alice's booking" in rev["reason"]
        assert grant["ts"] - recalls[0]["ts"] <= notice + 1.0  # notice + a sweep interval or so
        assert grant["waited_ms"] / 1000 <= notice + 1.0
        assert bob_c.get(b1.id)["state"] == "revoked"
        # dave still waits; when alice releases, he is served.
        assert "lease" not in dave_result
        alice_c.release(lease)
        t.join(20)
        assert dave_result["lease"].user == "dave" and dave_result["lease"].borrowed
        got = alice.get(f"{API}/bookings/{booking['id']}").json()
        assert got["instances"][0]["used"] is True and got["held"] == 0


def test_board_shows_reserved_and_borrowed_gpus(server_factory):
    srv = server_factory("n1=2xA100-80GB,n2=2xA100-80GB")
    with http(srv, "alice") as alice:
        booking = book(alice, gpus=2, start=time.time() - 1, hours=1, colocate=True).json()
        view = alice.get(f"{API}/cluster").json()
        states = {(n["name"], g["index"]): g["state"] for n in view["nodes"] for g in n["gpus"]}
        # The co-located booking's node is held back for it; the other node is free for anyone.
        assert [states[(booking["node"], i)] for i in (0, 1)] == ["reserved", "reserved"]
        assert sorted(states.values()) == ["free", "free", "reserved", "reserved"]
        assert view["pools"]["A100-80GB"]["reserved"] == 2 and view["pools"]["A100-80GB"]["free"] == 2
        bob = srv.client("bob")
        normal = bob.acquire(2)
        borrowed = bob.acquire(1)
        assert not normal.borrowed and borrowed.borrowed
        view = alice.get(f"{API}/cluster").json()
        gpus = [g for n in view["nodes"] for g in n["gpus"]]
        assert sorted(g["state"] for g in gpus) == ["borrowed", "leased", "leased", "reserved"]
        assert next(g for g in gpus if g["state"] == "borrowed")["lease"]["borrowed"] is True
        mine = srv.client("alice").acquire(1)
        assert mine.booking == booking["id"]
        view = alice.get(f"{API}/cluster").json()
        assert view["pools"]["A100-80GB"]["reserved"] == 0  # alice holds 1, bob borrows the other


def test_team_booking_serves_its_members(server_factory):
    srv = server_factory("a=2xA100-80GB", teams={"ml": ["alice", "bob"]})
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        assert bob.get(f"{API}/whoami").json()["teams"] == ["ml"]
        resp = book(alice, gpus=1, start=time.time() - 1, hours=1, owner="team:ml")
        assert resp.status_code == 201, resp.text
        booking = resp.json()
        lease = srv.client("bob").acquire(1)
        assert lease.booking == booking["id"]
        assert not srv.client("carol").acquire(1).borrowed  # the one unbooked GPU
        # a team member may change the team's booking, but not take it from the team
        resp = bob.patch(f"{API}/bookings/{booking['id']}", json={"owner": "bob"})
        assert_error(resp, 403, "forbidden", "team:ml's", "alice", "book your own")
        resp = bob.patch(f"{API}/bookings/{booking['id']}", json={"owner": None})  # (null: the caller)
        assert_error(resp, 403, "forbidden", "team:ml's")
        assert bob.get(f"{API}/bookings/{booking['id']}").json()["owner"] == "team:ml"
        assert bob.patch(f"{API}/bookings/{booking['id']}", json={"note": "standup"}).status_code == 200
        # whoever made it may still give it back to themselves
        assert alice.patch(f"{API}/bookings/{booking['id']}", json={"owner": "alice"}).json()["owner"] == "alice"
        assert alice.patch(f"{API}/bookings/{booking['id']}", json={"owner": "team:ml"}).json()["owner"] == "team:ml"
        # a team member may end the team's booking
        ended = bob.post(f"{API}/bookings/{booking['id']}/end").json()
        assert ended["instances"][0]["state"] == "released"


def test_one_owner_books_at_most_its_share_of_a_pool(server_factory, redis_sync):
    """booking_share 0.5 of the 6 GPUs of A100-80GB: 3 at any instant per person (as themselves and
    as any team of theirs), every week of a weekly booking counted; other people and admins are not
    held to it, and a refusal changes nothing."""
    srv = server_factory(booking_share=0.5, teams={"ml": ["alice"]})
    with http(srv, "alice") as alice, http(srv, "bob") as bob, http(srv, "root", "admin") as root:
        first = book(alice, gpus=2, start=MONDAY, hours=4)
        assert first.status_code == 201, first.text
        with unchanged(redis_sync, srv):
            resp = book(alice, gpus=2, start=MONDAY + HOUR, hours=1)
            body = assert_error(resp, 403, "forbidden", "alice may have at most 3 GPU(s)", "has 2 booked", "at most 1")
            assert body["details"] == {"limit": 3, "booked": 2}
            # a weekly booking clear of the first week's but over it in no later week is fine;
            # one whose second week lands on alice's other booking is refused
            too_many = book(alice, gpus=4, start=MONDAY - WEEK_MS / 1000, hours=1)
            assert_error(too_many, 403, "forbidden", "at most 3 GPU(s)", "book at most 3, or ask an admin")
            weekly = book(alice, gpus=2, start=MONDAY - WEEK_MS / 1000, hours=2, repeat="weekly", occurrences=2)
            assert_error(weekly, 403, "forbidden", "has 2 booked")
        assert book(alice, gpus=1, start=MONDAY + HOUR, hours=1).status_code == 201  # up to 3
        assert book(alice, gpus=3, start=MONDAY + 4 * HOUR, hours=1).status_code == 201  # back to back
        # a team's booking counts against its members' share: not while alice has 3 booked, then fine
        assert_error(book(alice, gpus=1, owner="team:ml", start=MONDAY + HOUR, hours=1), 403, "forbidden", "alice may")
        assert book(alice, gpus=3, owner="team:ml", start=MONDAY + 6 * HOUR, hours=1).status_code == 201
        # growing one's own booking past the share is refused too; another owner, or an admin, is not held
        mine = first.json()["id"]
        assert_error(alice.patch(f"{API}/bookings/{mine}", json={"gpus": 3}), 403, "forbidden", "at most 3")
        # an owner over the share (an admin booked for them) may still shrink it, or change its note
        over = book(root, gpus=4, owner="carol", start=MONDAY + 10 * HOUR, hours=1).json()["id"]
        with http(srv, "carol") as carol:
            assert carol.patch(f"{API}/bookings/{over}", json={"note": "demo"}).status_code == 200
            moved = {"start": MONDAY + 11 * HOUR, "end": MONDAY + 12 * HOUR}  # (still 4 GPUs: over it)
            assert_error(carol.patch(f"{API}/bookings/{over}", json=moved), 403, "forbidden", "at most 3")
            assert carol.patch(f"{API}/bookings/{over}", json={"gpus": 3}).json()["gpus"] == 3
        assert_error(book(bob, gpus=4, start=MONDAY + 8 * HOUR, hours=1), 403, "forbidden", "bob may have at most 3")
        assert book(root, gpus=4, owner="bob", start=MONDAY + 8 * HOUR, hours=1).status_code == 201


@pytest.fixture
def store_factory(redis_server, prefix):
    made: list[tuple[LeaseStore, ARedis]] = []

    async def make(simulate: str, **kw: object) -> LeaseStore:
        r = ARedis.from_url(redis_server.url, decode_responses=True)
        st = LeaseStore(Engine(r, make_settings(redis_server.url, f"{prefix}v{len(made)}", **kw)))
        for inv in parse_simulate(simulate):
            await register(st.engine, inv)
        made.append((st, r))
        return st

    yield make


async def _read(st: LeaseStore) -> list[tuple[str, dict]]:
    return [(f["type"], json.loads(f["data"])) for _id, f in await st.redis.xrange(st.keys.events)]


def test_no_show_releases_the_booking_and_tells_the_owner(store_factory):
    async def main() -> None:
        st = await store_factory("a=2xA100-80GB", no_show_after=900)
        b = Bookings(st.engine)
        now = int(time.time() * 1000)
        unused = await b.create(
            "alice", {"pool": "A100-80GB", "gpus": 1, "start": now / 1000, "end": now / 1000 + 3600}
        )
        used = await b.create("bob", {"pool": "A100-80GB", "gpus": 1, "start": now / 1000, "end": now / 1000 + 3600})
        lease = await st.acquire("bob", AcquireRequest(gpus=1))
        assert lease["resv"] == used["id"]
        await st.release(lease["id"], "bob")
        # Before the deadline nothing happens; after it, only the unused booking is released.
        await st.sweep(now_ms=now + 899_000)
        assert not [e for e in await _read(st) if e[0] == "reservation_no_show"]
        await st.sweep(now_ms=now + 901_000)
        shows = [d for t, d in await _read(st) if t == "reservation_no_show"]
        assert [(d["id"], d["owner"]) for d in shows] == [(unused["id"], "alice")]
        again = await b.get(unused["id"])
        assert "0" in again["released"] and "0" not in (await b.get(used["id"])).get("released", {})
        # Released capacity is no longer owed: a lease taking it is not borrowed.
        in_force = await b.in_force(now + 902_000)
        assert [r["id"] for r in in_force.get("A100-80GB", [])] == [used["id"]]

    asyncio.run(main())


def test_weekly_no_show_checks_every_occurrence(store_factory):
    async def main() -> None:
        st = await store_factory("a=2xA100-80GB", no_show_after=600)
        b = Bookings(st.engine)
        now = int(time.time() * 1000)
        r = await b.create(
            "alice",
            {
                "pool": "A100-80GB",
                "gpus": 2,
                "start": now / 1000 + 60,
                "end": now / 1000 + 3660,
                "repeat": "weekly",
                "occurrences": 3,
            },
        )
        for week in range(3):
            await st.sweep(now_ms=now + week * WEEK_MS + 60_000 + 601_000)
        rec = await b.get(r["id"])
        assert sorted(rec["released"]) == ["0", "1", "2"]
        # Past its last occurrence (and the history kept), the booking is removed.
        await st.sweep(now_ms=now + 2 * WEEK_MS + 3_660_000 + int(st.settings.booking_history * 1000) + 1)
        assert await st.redis.hget(st.keys.bookings, r["id"]) is None
        assert await st.redis.zcard(st.keys.booking_idx) == 0

    asyncio.run(main())


def test_end_early_gives_gpus_back(server_factory):
    srv = server_factory("a=1xA100-80GB")
    with http(srv, "alice") as alice:
        booking = book(alice, gpus=1, start=time.time() - 1, hours=1).json()
        assert srv.client("bob").acquire(1).borrowed
        out = alice.post(f"{API}/bookings/{booking['id']}/end").json()
        assert out["instances"][0]["state"] == "released"
        assert_error(alice.post(f"{API}/bookings/{booking['id']}/end"), 409, "conflict", "not in force")
        # ending is not cancelling: the booking is still listed, its occurrence released
        listed = alice.get(f"{API}/bookings").json()["bookings"]
        assert [x["id"] for x in listed] == [booking["id"]]


def test_booking_with_datetime_offsets_round_trip():
    from lease_server.leasing.bookings import parse_time

    berlin_winter = parse_time("start", "2027-01-04T10:00:00+01:00")
    assert berlin_winter == parse_time("start", "2027-01-04T09:00:00Z") == int(MONDAY * 1000)
    assert parse_time("start", MONDAY) == int(MONDAY * 1000)
    assert (datetime.fromtimestamp(MONDAY, UTC) + timedelta(weeks=1)).timestamp() * 1000 == MONDAY * 1000 + WEEK_MS


def test_a_borrowed_gang_is_recalled_for_the_holder(server_factory):
    srv = server_factory("n1=2xA100-80GB,n2=2xA100-80GB", borrow_notice=0.5, default_ttl=60)
    watcher = EventWatcher(srv.url, srv.token("admin", "admin")).start()
    with http(srv, "alice") as alice:
        booking = book(alice, gpus=2, start=time.time() - 1, hours=1).json()
        gang = srv.client("bob").acquire(4, nodes=2, ttl=60)
        assert gang.borrowed and sorted(gang.nodes) == ["n1", "n2"]
        lease = srv.client("alice").acquire(2, wait=20, ttl=60)
        assert lease.booking == booking["id"]
        recall = _wait_event(watcher, "borrow_recalled", lease=gang.id)
        revoked = _wait_event(watcher, "revoked", lease=gang.id)
        assert revoked["ts"] - recall["ts"] >= 0.5 - 0.001
        # every node of the gang got its GPUs back, not only the one alice was served on
        assert sorted((p["node"], sorted(p["gpus"])) for p in revoked["parts"]) == [("n1", [0, 1]), ("n2", [0, 1])]


def test_a_bookings_leases_go_on_as_ordinary_ones_once_its_time_is_over(server_factory, redis_sync):
    """Alice's lease served from her booking kept its GPUs past the booking's end, from Bob's
    booking that followed it too: a booking's lease was never recalled. Now, once her occurrence
    is over (or she ends it, or cancels), her lease is an ordinary one: counted against quota and
    recalled, with notice, for Bob's booking."""
    srv = server_factory("a=2xA100-80GB", borrow_notice=1.0, default_ttl=120)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    now = time.time()
    with http(srv, "alice") as alice, http(srv, "bob") as bob:
        mine = alice.post(f"{API}/bookings", json={"pool": "A100-80GB", "gpus": 2, "start": now - 60, "end": now + 3})
        assert mine.status_code == 201, mine.text
        theirs = bob.post(f"{API}/bookings", json={"pool": "A100-80GB", "gpus": 2, "start": now + 3, "end": now + 3600})
        assert theirs.status_code == 201, theirs.text
        held = srv.client("alice").acquire(2, ttl=120)
        assert held.raw.get("reservation") == mine.json()["id"]
        freed = watcher.wait_for(lambda e: e["type"] == "booking_lease_freed" and e["lease"] == held.id, 30, "freed")
        assert freed["reservation"] == mine.json()["id"] and freed["user"] == "alice"
        got = srv.client("bob").acquire(2, wait=30, ttl=60)  # recalled from alice, after its notice
        assert got.raw.get("reservation") == theirs.json()["id"]
        ended = srv.client("alice").get(held.id)
        assert ended["state"] == "revoked" and "recalled for bob's booking" in ended["end_reason"], ended
    check_state(redis_sync, Keys(srv.settings.prefix))


def test_ending_or_cancelling_a_booking_lets_its_leases_go_as_ordinary_ones(server_factory, redis_sync):
    srv = server_factory("a=2xA100-80GB", borrow_notice=1.0, default_ttl=120)
    now = time.time()
    with http(srv, "alice") as alice:
        for how in ("end", "cancel"):
            r = alice.post(
                f"{API}/bookings", json={"pool": "A100-80GB", "gpus": 2, "start": now - 60, "end": now + 3600}
            )
            assert r.status_code == 201, r.text
            booking = r.json()["id"]
            held = srv.client("alice").acquire(2, ttl=120)
            assert held.raw.get("reservation") == booking
            done = (
                alice.post(f"{API}/bookings/{booking}/end")
                if how == "end"
                else alice.delete(f"{API}/bookings/{booking}")
            )
            assert done.status_code == 200, done.text
            assert done.json()["held"] == 0, done.json()
            lease = srv.client("alice").get(held.id)
            assert lease["state"] == "active" and not lease.get("reservation"), (how, lease)
            srv.client("alice").release(held)
    check_state(redis_sync, Keys(srv.settings.prefix))


def test_moving_a_booking_to_another_pool_counts_as_new_and_lets_its_leases_go(server_factory, redis_sync):
    """A booking moved to another pool was held to no share there (it did not "grow"), and kept
    counting the old pool's leases as held, so its owner could not use the new pool's GPUs."""
    srv = server_factory("a=4xA100-80GB,t=2xT4-16GB", booking_share=0.5, borrow_notice=1.0, default_ttl=120)
    now = time.time()
    with http(srv, "alice") as alice:
        r = alice.post(f"{API}/bookings", json={"pool": "A100-80GB", "gpus": 2, "start": now - 60, "end": now + 3600})
        assert r.status_code == 201, r.text
        booking = r.json()["id"]
        with unchanged(redis_sync, srv):  # 2 of the T4 pool's 2 is over its share (1)
            moved = alice.patch(f"{API}/bookings/{booking}", json={"pool": "T4-16GB"})
            assert_error(moved, 403, "forbidden", "at most 1 GPU(s)")
        held = srv.client("alice").acquire(2, pool="A100-80GB", ttl=120)
        assert held.raw.get("reservation") == booking
        moved = alice.patch(f"{API}/bookings/{booking}", json={"pool": "T4-16GB", "gpus": 1})
        assert moved.status_code == 200 and moved.json()["held"] == 0, moved.text
        assert not srv.client("alice").get(held.id).get("reservation")  # an ordinary A100 lease now
        t4 = srv.client("alice").acquire(1, pool="T4-16GB", ttl=120)
        assert t4.raw.get("reservation") == booking
    check_state(redis_sync, Keys(srv.settings.prefix))


def test_a_change_that_ends_a_booking_in_the_past_is_refused(server_factory, redis_sync):
    """As a new booking that ends in the past is (a weekly series under way set to "does not
    repeat" from the form left one occurrence, in the past, and dropped every later week)."""
    srv = server_factory()
    now = time.time()
    with http(srv, "alice") as alice:
        weekly = book(alice, gpus=1, start=now - 8 * 24 * HOUR, hours=1, repeat="weekly", occurrences=4)
        assert weekly.status_code == 201, weekly.text
        booking = weekly.json()["id"]
        with unchanged(redis_sync, srv):
            once = alice.patch(f"{API}/bookings/{booking}", json={"repeat": "none"})
            assert_error(once, 400, "bad_request", "end the booking in the past", "or cancel it")
            past = alice.patch(f"{API}/bookings/{booking}", json={"start": 978_307_200, "end": 978_310_800})
            assert_error(past, 400, "bad_request", "in the past")
        assert alice.patch(f"{API}/bookings/{booking}", json={"note": "kept"}).status_code == 200


def test_a_team_booking_counts_against_each_members_share(server_factory, redis_sync):
    """booking_share 0.5 of 8 GPUs: 4 at any instant per person, as themselves and as any team of
    theirs together. alice, holding half the pool for a year of Mondays, cannot book the other half
    as team:ml (nor can bob for the team while alice holds hers); bob may book his own half, and a
    refusal names the member whose share it would pass and the setting, and changes nothing."""
    srv = server_factory("a=8xA100-80GB", booking_share=0.5, teams={"ml": ["alice", "bob"], "cv": ["alice"]})
    with http(srv, "alice") as alice, http(srv, "bob") as bob, http(srv, "root", "admin") as root:
        weekly = {"repeat": "weekly", "occurrences": 52}
        mine = book(alice, gpus=4, start=MONDAY, hours=8, **weekly)
        assert mine.status_code == 201, mine.text
        with unchanged(redis_sync, srv):
            resp = book(alice, gpus=4, owner="team:ml", start=MONDAY, hours=8, **weekly)
            body = assert_error(
                resp,
                403,
                "forbidden",
                "team:ml's booking counts against the share of each member",
                "alice may have at most 4 GPU(s)",
                "as themselves and as team:cv, team:ml",
                "booking_share 0.5",
                "has 4 booked",
                "book at most 0",
            )
            assert body["details"] == {"limit": 4, "booked": 4}
            # its last week only, or bob for the team: alice's share all the same
            late = book(alice, gpus=1, owner="team:ml", start=MONDAY + 51 * WEEK_MS / 1000 + HOUR, hours=1)
            assert_error(late, 403, "forbidden", "alice may have at most 4")
            assert_error(book(bob, gpus=1, owner="team:ml", start=MONDAY, hours=1), 403, "forbidden", "alice may")
            # another team of alice's counts too
            assert_error(book(alice, gpus=1, owner="team:cv", start=MONDAY, hours=1), 403, "forbidden", "alice may")
        # bob holds his own half; then no team of his may book at that time either
        assert book(bob, gpus=4, start=MONDAY, hours=8).status_code == 201
        assert_error(
            book(bob, gpus=1, owner="team:ml", start=MONDAY + 7 * HOUR, hours=2), 403, "forbidden", "at most 4"
        )
        # outside alice's Mondays the team may book up to the share, and then holds its members' shares
        team = book(bob, gpus=4, owner="team:ml", start=MONDAY + 10 * HOUR, hours=2)
        assert team.status_code == 201, team.text
        assert_error(book(alice, gpus=1, start=MONDAY + 11 * HOUR, hours=1), 403, "forbidden", "team:ml")
        assert_error(book(bob, gpus=1, start=MONDAY + 11 * HOUR, hours=1), 403, "forbidden", "bob may")
        # carol, in no team, is held to her own share alone; an admin is held to none
        with http(srv, "carol") as carol:
            assert book(carol, gpus=4, start=MONDAY + 11 * HOUR, hours=1).status_code == 201
        assert book(root, gpus=4, owner="team:ml", start=MONDAY + 13 * HOUR, hours=1).status_code == 201
    check_state(redis_sync, Keys(srv.settings.prefix))


def test_one_owner_has_at_most_booking_max_per_owner_bookings_not_yet_over(server_factory, redis_sync):
    """booking_max_per_owner 3: alice's fourth booking not yet over is refused (403 naming the
    setting and her count), a change of one she has is not; one ended early or cancelled counts no
    more; bob's and a team's are counted apart, and an admin is not held to it."""
    srv = server_factory("a=8xA100-80GB", booking_max_per_owner=3, teams={"ml": ["alice"]})
    with http(srv, "alice") as alice, http(srv, "bob") as bob, http(srv, "root", "admin") as root:
        current = book(alice, gpus=1, start=time.time() - 60, hours=1).json()
        ahead = [book(alice, gpus=1, start=MONDAY + i * HOUR, hours=1).json() for i in range(2)]
        with unchanged(redis_sync, srv):
            body = assert_error(
                book(alice, gpus=1, start=MONDAY + 5 * HOUR, hours=1),
                403,
                "forbidden",
                "alice has 3 booking(s) not yet over",
                "booking_max_per_owner 3",
                "cancel or end one first",
            )
            assert body["details"] == {"limit": 3, "bookings": 3}
            weekly = {"repeat": "weekly", "occurrences": 4}
            assert_error(book(alice, gpus=1, start=MONDAY + 5 * HOUR, hours=1, **weekly), 403, "forbidden", "3 booking")
            window = {"pool": "A100-80GB", "gpus": 1, "start": MONDAY + 5 * HOUR, "end": MONDAY + 6 * HOUR}
            dry = alice.post(f"{API}/bookings", params={"dry_run": "true"}, json=window)
            assert_error(dry, 403, "forbidden", "booking_max_per_owner")
        moved = alice.patch(
            f"{API}/bookings/{ahead[1]['id']}", json={"gpus": 2, "start": MONDAY + 3 * HOUR, "end": MONDAY + 4 * HOUR}
        )
        assert moved.status_code == 200, moved.text
        assert book(bob, gpus=1, start=MONDAY + 5 * HOUR, hours=1).status_code == 201
        assert book(alice, gpus=1, owner="team:ml", start=MONDAY + 5 * HOUR, hours=1).status_code == 201
        # ending the one in force, or cancelling one ahead, makes room for one more each
        assert alice.post(f"{API}/bookings/{current['id']}/end").status_code == 200
        assert book(alice, gpus=1, start=MONDAY + 7 * HOUR, hours=1).status_code == 201
        assert_error(book(alice, gpus=1, start=MONDAY + 8 * HOUR, hours=1), 403, "forbidden", "booking_max_per_owner")
        assert alice.delete(f"{API}/bookings/{ahead[0]['id']}").status_code == 200
        assert book(alice, gpus=1, start=MONDAY + 8 * HOUR, hours=1).status_code == 201
        # an admin is not held to it
        assert book(root, gpus=1, owner="alice", start=MONDAY + 9 * HOUR, hours=1).status_code == 201
    check_state(redis_sync, Keys(srv.settings.prefix))


def test_booking_max_per_owner_must_be_a_whole_number_from_1(redis_server, prefix):
    for bad in (0, -1, 200_000):
        with pytest.raises(errors.ConfigurationError, match="booking_max_per_owner must be a whole number from 1"):
            make_settings(redis_server.url, prefix, booking_max_per_owner=bad)


def test_a_grant_reads_the_bookings_in_force_not_every_booking_of_its_pool(store_factory):
    """bob's 151 bookings (100 one-minute ones over, one in force, 50 ahead; made before they began)
    cost a grant in their pool no work: it reads the occurrences that started (booking_occ),
    counted as the HGETs Redis runs for one acquire + release (INFO commandstats counts a script's
    commands). The booking in force is served first, and the reader drops the ended ones from the
    index."""

    async def hgets(st: LeaseStore) -> int:
        return int((await st.redis.info("commandstats")).get("cmdstat_hget", {}).get("calls", 0))

    async def main() -> None:
        st = await store_factory("a=4xA100-80GB")
        b = Bookings(st.engine)
        now = int(time.time() * 1000)
        made = now - 100 * 120_000 - 61_000  # (a virtual clock: when bob made them)

        async def bob_books(start_ms: int, end_ms: int) -> dict:
            window = {"pool": "A100-80GB", "gpus": 1, "start": start_ms / 1000, "end": end_ms / 1000}
            return await b.create("bob", window, now_ms=made)

        for i in range(100):
            await bob_books(made + 1000 + i * 120_000, made + 61_000 + i * 120_000)
        held = await bob_books(now - 60_000, now + 900_000)
        for i in range(50):
            await bob_books(now + 3_600_000 + i * 120_000, now + 3_660_000 + i * 120_000)

        before = await hgets(st)
        lease = await st.acquire("bob", AcquireRequest(gpus=1, ttl=60))
        await st.release(lease["id"], "bob", token=lease["token"], verified=True)
        read = await hgets(st) - before
        assert lease["resv"] == held["id"]
        assert read < 40, f"one acquire + release ran {read} HGETs with 151 bookings in the pool"
        left = await st.redis.zrange(st.keys.booking_occ, 0, -1)
        assert len(left) == 51 and all(int(m.split("|")[2]) > now for m in left), left[:3]

    asyncio.run(main())
