"""The Jupyter server extension (jupyter_ext) in a real Jupyter server against a real lease server.

pytest-jupyter's fixtures are imported into this module only (its autouse event loop must not
touch the rest of the suite), so the tests are plain functions that run coroutines on that loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from jupyter_server.auth import Authorizer
from pytest_jupyter.jupyter_server import *  # noqa: F403 - jp_fetch, jp_serverapp and their fixtures
from tornado.httpclient import HTTPResponse

import lease_server
from jupyter_ext.app import GpuLease
from lease_server import errors
from tests.api_helpers import EventWatcher

ENDPOINTS = [
    ("GET", "version"),
    ("GET", "cluster"),
    ("GET", "leases"),
    ("GET", "queue"),
    ("GET", "events"),
    ("DELETE", "leases/l-0123456789abcdef"),
    ("POST", "leases/l-0123456789abcdef/keep"),
    ("GET", "bookings"),
    ("POST", "bookings"),
    ("GET", "bookings/r-0123456789ab"),
    ("PATCH", "bookings/r-0123456789ab"),
    ("DELETE", "bookings/r-0123456789ab"),
    ("POST", "bookings/r-0123456789ab/end"),
    ("GET", "no-such-endpoint"),
]


# ---- configuration of the Jupyter server under test (tests override these by parametrizing) ----


@pytest.fixture
def lease_identity() -> tuple[str, str]:
    """The lease user and role the Jupyter server's configured token belongs to."""
    return ("alice", "user")


@pytest.fixture
def lease_server_settings() -> dict[str, Any]:
    """Settings of the lease server under test (the idle-reclaim tests make it sample fast)."""
    return {}


@pytest.fixture
def server(server_factory: Any, lease_server_settings: dict[str, Any]) -> Any:  # overrides conftest's
    return server_factory(**lease_server_settings)


@pytest.fixture
def lease_url(server: Any) -> str:
    return server.url


@pytest.fixture
def lease_token(server: Any, lease_identity: tuple[str, str]) -> str:
    return server.token(*lease_identity)


@pytest.fixture
def extra_config() -> dict[str, Any]:
    return {}


@pytest.fixture
def jp_server_config(  # type: ignore[no-redef]  # overrides pytest-jupyter's
    lease_url: str, lease_token: str, extra_config: dict[str, Any]
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "ServerApp": {"jpserver_extensions": {"jupyter_ext": True}},
        "GpuLease": {"lease_server_url": lease_url, "lease_server_token": lease_token},
        # A killed kernel is noticed within half a second, not three.
        "KernelRestarter": {"time_to_dead": 0.5},
    }
    for section, values in extra_config.items():
        config.setdefault(section, {}).update(values)
    return config


# ---- helpers -------------------------------------------------------------------------------------


@pytest.fixture
def run(jp_asyncio_loop: asyncio.AbstractEventLoop) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Run a coroutine on the Jupyter server's loop (the server makes progress only meanwhile)."""

    def call(coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        # server.token() runs asyncio.run, which leaves this thread without a current loop.
        asyncio.set_event_loop(jp_asyncio_loop)
        return jp_asyncio_loop.run_until_complete(asyncio.wait_for(coro, timeout))

    return call


@pytest.fixture
def afetch(jp_fetch: Any) -> Callable[..., Any]:
    """``await afetch("gpulease", "cluster")``: the response, also for 4xx/5xx (no exception)."""

    def call(*parts: str, method: str = "GET", **kw: Any) -> Any:
        kw.setdefault("raise_error", False)
        if method in ("POST", "PUT", "PATCH"):
            kw.setdefault("body", b"{}")
        return jp_fetch(*parts, method=method, **kw)

    return call


@pytest.fixture
def fetch(afetch: Any, run: Any) -> Callable[..., HTTPResponse]:
    """``fetch("gpulease", "cluster")``: afetch, run to completion."""

    async def go(*parts: str, **kw: Any) -> HTTPResponse:
        return await afetch(*parts, **kw)  # type: ignore[no-any-return]

    return lambda *parts, **kw: run(go(*parts, **kw))


@pytest.fixture
def ext(jp_serverapp: Any) -> GpuLease:
    return jp_serverapp.web_app.settings["gpulease"]  # type: ignore[no-any-return]


@pytest.fixture
def base(jp_serverapp: Any, http_server_client: Any, jp_base_url: str) -> str:
    """The Jupyter server's URL, for clients other than jp_fetch (which also starts the server)."""
    return str(http_server_client.get_url(jp_base_url))


def body(resp: HTTPResponse) -> Any:
    return json.loads(resp.body)


def error(resp: HTTPResponse, status: int, code: str) -> str:
    """Assert a JSON error answer and return its message."""
    data = body(resp)
    assert (resp.code, data["code"]) == (status, code), (resp.code, data)
    assert data["message"], data
    return str(data["message"])


def auth(jp_serverapp: Any) -> dict[str, str]:
    return {"Authorization": f"token {jp_serverapp.identity_provider.token}"}


async def read_until(lines: Any, want: Callable[[str], bool]) -> list[str]:
    """Lines of an SSE stream up to and including the first one that ``want`` accepts."""
    seen = []
    async for line in lines:
        seen.append(line)
        if want(line):
            return seen
    raise AssertionError(f"stream ended before the expected line; saw {seen}")


# ---- the handshake and the read endpoints ------------------------------------------------------------


def test_version_handshake_names_the_lease_user(fetch: Any, server: Any) -> None:
    resp = fetch("gpulease", "version")
    assert resp.code == 200
    data = body(resp)
    assert data["version"] == lease_server.__version__
    assert data["lease_server"] == {
        "url": server.url,
        "reachable": True,
        "version": lease_server.__version__,
        "user": "alice",
        "role": "user",
    }


def test_the_labextension_has_the_server_extensions_version() -> None:
    # The front end compares the two in the handshake: keep them released together.
    package = json.loads((Path(__file__).parents[1] / "labextension" / "package.json").read_text())
    assert package["version"] == lease_server.__version__


def test_cluster_and_leases_show_holders_but_no_tokens(fetch: Any, server: Any) -> None:
    mine = server.client("alice").acquire(gpus=2, pool="A100-80GB", label="sweep", session="s1")
    theirs = server.client("bob").acquire(gpus=1, pool="T4-16GB")

    cluster = body(fetch("gpulease", "cluster"))
    cells = {(n["name"], g["index"]): g for n in cluster["nodes"] for g in n["gpus"]}
    assert len(cells) == 8
    held = {k: g["lease"]["user"] for k, g in cells.items() if g["state"] == "leased"}
    assert sorted(held.values()) == ["alice", "alice", "bob"]
    assert {(mine.node, i) for i in mine.indexes} <= set(held)
    assert cluster["pools"]["A100-80GB"]["free"] == 4
    # a page of the nodes, as the board asks for it: the counts stay every pool's
    page = body(fetch("gpulease", "cluster", params={"pool": "A100-80GB", "limit": "1"}))
    assert [n["name"] for n in page["nodes"]] == ["n1"] and page["next"] == "n1" and page["nodes_total"] == 2
    assert page["pools"] == cluster["pools"]
    assert [n["name"] for n in body(fetch("gpulease", "cluster", params={"after": "n1"}))["nodes"]] == ["n2", "t1"]

    leases = body(fetch("gpulease", "leases"))
    assert leases["user"] == "alice"
    assert [lease["id"] for lease in leases["leases"]] == [mine.id]
    assert leases["leases"][0]["label"] == "sweep" and leases["leases"][0]["session"] == "s1"
    everyone = body(fetch("gpulease", "leases", params={"all": "true"}))
    assert {lease["id"] for lease in everyone["leases"]} == {mine.id, theirs.id}
    assert all("token" not in lease for lease in leases["leases"] + everyone["leases"])


def test_release_is_owner_only_idempotent_and_clear_about_unknown_leases(fetch: Any, server: Any) -> None:
    mine = server.client("alice").acquire(gpus=1)
    theirs = server.client("bob").acquire(gpus=1)

    resp = fetch("gpulease", "leases", mine.id, method="DELETE")
    assert resp.code == 200, resp.body
    assert body(resp)["state"] == "released" and "token" not in body(resp)
    ended = server.client("alice").get(mine.id)
    # The ended record says where the release came from and who pressed the button.
    assert (ended["state"], ended["end_reason"], ended["ended_by"]) == ("released", "released from the board", "alice")
    again = fetch("gpulease", "leases", mine.id, method="DELETE")
    assert (again.code, body(again)["changed"]) == (200, False)
    # Read back, ended (the status bar reads whom an evicted warm lease went to): mine only, no token
    read = body(fetch("gpulease", "leases", mine.id))
    assert (read["id"], read["state"]) == (mine.id, "released") and "token" not in read
    assert "only its owner can read it" in error(fetch("gpulease", "leases", theirs.id), 403, "not_owner")

    msg = error(fetch("gpulease", "leases", theirs.id, method="DELETE"), 403, "not_owner")
    assert "bob" in msg
    assert server.client("bob").get(theirs.id)["state"] == "active"

    error(fetch("gpulease", "leases", "l-0123456789abcdef", method="DELETE"), 404, "no_such_lease")
    msg = error(fetch("gpulease", "leases", "bad id!", method="DELETE"), 400, "bad_request")
    assert "lease id" in msg
    # "." and "..": the lease server's client would resolve them (DELETE /leases/.. is the API root)
    for dots in (".", ".."):
        assert "lease id" in error(fetch("gpulease", "leases", dots, method="DELETE"), 400, "bad_request")
        assert "booking id" in error(fetch("gpulease", "bookings", dots, method="DELETE"), 400, "bad_request")


@pytest.mark.parametrize("lease_identity", [("root", "admin")])
def test_release_never_revokes_a_colleagues_lease_even_with_an_admin_token(fetch: Any, server: Any) -> None:
    theirs = server.client("bob").acquire(gpus=1)
    msg = error(fetch("gpulease", "leases", theirs.id, method="DELETE"), 403, "not_owner")
    assert "belongs to bob" in msg
    assert server.client("bob").get(theirs.id)["state"] == "active"
    msg = error(fetch("gpulease", "leases", theirs.id, "keep", method="POST"), 403, "not_owner")
    assert "belongs to bob" in msg and "keep" in msg
    assert "extensions" not in server.client("bob").get(theirs.id)


# ---- "Still using it": keeping an idle-warned lease ----------------------------------------------------

# Samples every 0.2 s and a 1 s idle window: an unused (0 % busy) simulated GPU is warned within
# about a second and a half, then reclaimed 30 s later unless kept.
FAST_RECLAIM = {"sample_interval": 0.2, "idle_timeout": 1.0, "grace": 30, "min_age": 0}


def set_policy(server: Any, pool: str, **changes: Any) -> None:
    server.client("root", "admin").request("PUT", f"/api/v1/policy/{pool}", json=changes)


def warned_cell(cluster: dict[str, Any], lease_id: str) -> dict[str, Any]:
    return next(g["lease"] for n in cluster["nodes"] for g in n["gpus"] if g.get("lease", {}).get("id") == lease_id)


@pytest.mark.parametrize("lease_server_settings", [FAST_RECLAIM])
def test_still_using_it_keeps_an_idle_warned_lease(fetch: Any, server: Any) -> None:
    watcher = EventWatcher(server.url, server.token("root", "admin")).start()
    alice = server.client("alice")
    lease = alice.acquire(gpus=1, pool="A100-80GB", label="notebook")
    warning = watcher.wait_for(lambda e: e["type"] == "idle_warning" and e["lease"] == lease.id, 15, "idle_warning")
    # Both views the page reads show the warning and when the GPUs go back.
    mine = body(fetch("gpulease", "leases"))["leases"]
    assert [(m["id"], m["reclaim_at"]) for m in mine] == [(lease.id, pytest.approx(warning["reclaim_at"]))]
    cell = warned_cell(body(fetch("gpulease", "cluster")), lease.id)
    assert cell["idle_warning"] is True and cell["reclaim_at"] == pytest.approx(warning["reclaim_at"])
    # Nobody uses the GPU after the keep either: a long idle window, so no second warning races the checks.
    set_policy(server, "A100-80GB", idle_timeout=600)

    resp = fetch("gpulease", "leases", lease.id, "keep", method="POST")
    assert resp.code == 200, resp.body
    kept = body(resp)
    assert (kept["id"], kept["state"], kept["extensions"]) == (lease.id, "active", 1)
    assert "reclaim_at" not in kept and "token" not in kept
    watcher.wait_for(lambda e: e["type"] == "idle_kept" and e["lease"] == lease.id, 10, "idle_kept")
    mine = body(fetch("gpulease", "leases"))["leases"]
    assert [m["id"] for m in mine] == [lease.id] and "reclaim_at" not in mine[0]
    cell = warned_cell(body(fetch("gpulease", "cluster")), lease.id)
    assert "idle_warning" not in cell and "reclaim_at" not in cell
    assert alice.get(lease.id)["state"] == "active"


def test_still_using_it_is_refused_with_the_servers_message_once_the_limit_is_used_up(fetch: Any, server: Any) -> None:
    set_policy(server, "A100-80GB", max_extensions=1)
    alice = server.client("alice")
    lease = alice.acquire(gpus=1, pool="A100-80GB")
    assert fetch("gpulease", "leases", lease.id, "keep", method="POST").code == 200

    msg = error(fetch("gpulease", "leases", lease.id, "keep", method="POST"), 409, "conflict")
    with pytest.raises(errors.Conflict) as direct:  # what the lease server itself says
        alice.keep(lease.id)
    assert msg == direct.value.message
    assert f"lease {lease.id} was already kept 1 times" in msg and "release them" in msg
    assert alice.get(lease.id)["state"] == "active" and alice.get(lease.id)["extensions"] == 1


def test_still_using_it_is_owner_only_and_clear_about_unknown_or_ended_leases(fetch: Any, server: Any) -> None:
    theirs = server.client("bob").acquire(gpus=1)
    msg = error(fetch("gpulease", "leases", theirs.id, "keep", method="POST"), 403, "not_owner")
    assert "belongs to bob" in msg
    assert "extensions" not in server.client("bob").get(theirs.id)

    msg = error(fetch("gpulease", "leases", "l-0123456789abcdef", "keep", method="POST"), 404, "no_such_lease")
    assert "l-0123456789abcdef" in msg
    assert "lease id" in error(fetch("gpulease", "leases", "bad id!", "keep", method="POST"), 400, "bad_request")

    ended = server.client("alice").acquire(gpus=1)
    server.client("alice").release(ended)
    msg = error(fetch("gpulease", "leases", ended.id, "keep", method="POST"), 409, "lease_ended")
    assert ended.id in msg and "ended" in msg


def test_still_using_it_needs_a_jupyter_login(fetch: Any, server: Any) -> None:
    lease = server.client("alice").acquire(gpus=1)
    for headers in ({"Authorization": ""}, {"Authorization": "token not-the-token"}):
        resp = fetch("gpulease", "leases", lease.id, "keep", method="POST", headers=headers)
        assert "log in" in error(resp, 401, "unauthorized")
    assert "extensions" not in server.client("alice").get(lease.id)


def test_queue_shows_waiters_and_checks_the_pool(fetch: Any, afetch: Any, server: Any, run: Any) -> None:
    alice, bob = server.client("alice"), server.client("bob")
    held = alice.acquire(gpus=2, pool="T4-16GB")

    async def scenario() -> None:
        waiter = asyncio.ensure_future(asyncio.to_thread(bob.acquire, gpus=1, pool="T4-16GB", wait=20, label="next"))
        while not (await asyncio.to_thread(bob.queue, "T4-16GB")):  # the waiter is in the queue
            await asyncio.sleep(0.02)
        data = json.loads((await afetch("gpulease", "queue", params={"pool": "T4-16GB"})).body)
        assert [(w["user"], w["position"], w["label"]) for w in data["waiting"]] == [("bob", 1, "next")]
        granted = await asyncio.to_thread(alice.release, held)
        assert granted["state"] == "released"
        assert (await waiter).pool == "T4-16GB"

    run(scenario())
    assert body(fetch("gpulease", "queue"))["waiting"] == []
    msg = error(fetch("gpulease", "queue", params={"pool": "no pool!"}), 400, "bad_request")
    assert "pool" in msg


# ---- bookings --------------------------------------------------------------------------------------------

HOUR = 3600


def window(days: float = 2, hour: int = 10, hours: float = 2) -> tuple[float, float]:
    """A window some days ahead, on the hour (UTC): no test depends on today's date or the clock's zone."""
    start = (int(time.time() // 86400) + int(days)) * 86400 + hour * HOUR
    return float(start), start + hours * HOUR


def post_json(fetch: Any, *parts: str, data: Any, method: str = "POST", **kw: Any) -> HTTPResponse:
    return fetch(*parts, method=method, body=json.dumps(data), **kw)  # type: ignore[no-any-return]


def test_bookings_are_listed_made_checked_changed_and_cancelled_through_the_proxy(fetch: Any, server: Any) -> None:
    start, end = window()
    theirs = server.client("bob").request(
        "POST", "/api/v1/bookings", json={"pool": "A100-80GB", "gpus": 1, "start": start, "end": end}
    )
    booking = {"pool": "A100-80GB", "gpus": 2, "start": start, "end": end, "note": "paper deadline"}

    # A dry run answers whether it fits and stores nothing.
    resp = post_json(fetch, "gpulease", "bookings", data=booking, params={"dry_run": "true"})
    assert (resp.code, body(resp)["fits"]) == (200, True), resp.body
    listed = body(fetch("gpulease", "bookings", params={"pool": "A100-80GB"}))
    assert [r["id"] for r in listed["bookings"]] == [theirs["id"]]

    resp = post_json(fetch, "gpulease", "bookings", data=booking)
    assert resp.code == 201, resp.body
    mine = body(resp)
    assert (mine["owner"], mine["gpus"], mine["start"], mine["end"], mine["mine"]) == ("alice", 2, start, end, True)
    assert mine["note"] == "paper deadline" and mine["instances"][0]["state"] == "upcoming"

    # Everyone's bookings of the pool in a window, each saying whether this page may change it.
    listed = body(fetch("gpulease", "bookings", params={"pool": "A100-80GB", "from": start - HOUR, "to": end}))
    assert {(r["id"], r["owner"], r["gpus"], r["mine"]) for r in listed["bookings"]} == {
        (theirs["id"], "bob", 1, False),
        (mine["id"], "alice", 2, True),
    }
    assert listed["now"] == pytest.approx(time.time(), abs=5)
    iso = {"from": "2000-01-01T00:00:00+00:00", "to": "2000-01-02T00:00:00Z"}
    assert body(fetch("gpulease", "bookings", params=iso))["bookings"] == []
    assert body(fetch("gpulease", "bookings", params={"pool": "T4-16GB"}))["bookings"] == []
    assert body(fetch("gpulease", "bookings", mine["id"]))["note"] == "paper deadline"

    # A change: checked first (dry run: nothing changes), then made.
    resp = post_json(
        fetch, "gpulease", "bookings", mine["id"], data={"gpus": 3}, method="PATCH", params={"dry_run": "1"}
    )
    assert (resp.code, body(resp)["fits"]) == (200, True), resp.body
    assert server.client("alice").request("GET", f"/api/v1/bookings/{mine['id']}")["gpus"] == 2
    resp = post_json(fetch, "gpulease", "bookings", mine["id"], data={"gpus": 3, "note": "more"}, method="PATCH")
    assert resp.code == 200, resp.body
    assert (body(resp)["gpus"], body(resp)["note"], body(resp)["mine"]) == (3, "more", True)

    resp = fetch("gpulease", "bookings", mine["id"], method="DELETE")
    assert (resp.code, body(resp)["state"]) == (200, "cancelled"), resp.body
    assert server.client("alice").request("GET", f"/api/v1/bookings/{mine['id']}")["state"] == "cancelled"
    listed = body(fetch("gpulease", "bookings", params={"pool": "A100-80GB"}))
    assert [r["id"] for r in listed["bookings"]] == [theirs["id"]]
    error(fetch("gpulease", "bookings", "r-0123456789ab"), 404, "no_such_reservation")


def test_ending_a_booking_now_releases_its_current_occurrence(fetch: Any, server: Any) -> None:
    now = time.time()
    booking = {"pool": "T4-16GB", "gpus": 1, "start": now - 60, "end": now + HOUR, "note": "running"}
    resp = post_json(fetch, "gpulease", "bookings", data=booking)
    assert resp.code == 201, resp.body
    made = body(resp)
    assert made["instances"][0]["state"] == "active"

    resp = fetch("gpulease", "bookings", made["id"], "end", method="POST")
    assert resp.code == 200, resp.body
    ended = body(resp)
    assert ended["mine"] is True and ended["instances"][0]["state"] == "released"


def test_a_clash_is_passed_on_with_the_clashing_bookings_and_the_windows_that_fit(fetch: Any, server: Any) -> None:
    start, end = window()
    full = server.client("bob").request(
        "POST", "/api/v1/bookings", json={"pool": "A100-80GB", "gpus": 6, "start": start, "end": end}
    )
    booking = {"pool": "A100-80GB", "gpus": 1, "start": start + HOUR, "end": end + HOUR}
    for params in ({"dry_run": "true"}, None):
        resp = post_json(fetch, "gpulease", "bookings", data=booking, params=params)
        data = body(resp)
        assert (resp.code, data["code"]) == (409, "reservation_clash"), data
        assert "bob" in data["message"]
        details = data["details"]
        assert [(c["id"], c["owner"], c["gpus"]) for c in details["clashes"]] == [(full["id"], "bob", 6)]
        assert (details["capacity"], details["max_gpus"]) == (6, 0)
        assert details["suggestions"], details
        for s in details["suggestions"]:  # same length, clear of bob's window
            assert s["end"] - s["start"] == 2 * HOUR and (s["end"] <= start or s["start"] >= end)
    listed = body(fetch("gpulease", "bookings", params={"pool": "A100-80GB"}))
    assert [r["id"] for r in listed["bookings"]] == [full["id"]]

    # A suggested window is booked as it is.
    suggestion = details["suggestions"][0]
    resp = post_json(fetch, "gpulease", "bookings", data={**booking, **suggestion})
    assert resp.code == 201, resp.body

    # A change that would clash is refused the same way, and changes nothing.
    mine = body(resp)
    moved = {"start": start, "end": end}
    resp = post_json(fetch, "gpulease", "bookings", mine["id"], data=moved, method="PATCH")
    assert (resp.code, body(resp)["code"]) == (409, "reservation_clash")
    assert body(resp)["details"]["clashes"][0]["id"] == full["id"]
    assert body(fetch("gpulease", "bookings", mine["id"]))["start"] == suggestion["start"]


@pytest.mark.parametrize("lease_identity", [("alice", "user"), ("root", "admin")])
def test_a_colleagues_booking_can_be_seen_but_not_changed_even_with_an_admin_token(
    fetch: Any, server: Any, lease_identity: tuple[str, str]
) -> None:
    start, end = window()
    theirs = server.client("bob").request(
        "POST", "/api/v1/bookings", json={"pool": "T4-16GB", "gpus": 1, "start": start, "end": end}
    )
    seen = body(fetch("gpulease", "bookings", theirs["id"]))
    assert (seen["owner"], seen["mine"]) == ("bob", False)
    assert [r["mine"] for r in body(fetch("gpulease", "bookings"))["bookings"]] == [False]
    for method, path, data in (
        ("PATCH", [theirs["id"]], {"gpus": 2}),
        ("DELETE", [theirs["id"]], None),
        ("POST", [theirs["id"], "end"], None),
    ):
        kw = {"body": json.dumps(data)} if data is not None else {}
        msg = error(fetch("gpulease", "bookings", *path, method=method, **kw), 403, "not_owner")
        assert f"belongs to bob, not to {lease_identity[0]}" in msg
    after = server.client("bob").request("GET", f"/api/v1/bookings/{theirs['id']}")
    assert (after["state"], after["gpus"]) == ("active", 1)


BAD_BOOKINGS = [
    (b"not json", "must be a JSON object"),
    (b"[1, 2]", "must be a JSON object, got list"),
    (b'{"pool": "A100-80GB", "gpus": 1, "start": 2000000000}', "a booking needs end"),
    (b'{"pool": "A100-80GB", "gpus": 1, "start": 2000000000, "end": 2000003600, "size": 1}', "unknown booking field"),
    (b'{"pool": "A100-80GB", "gpus": "2", "start": 2000000000, "end": 2000003600}', "gpus must be a whole number"),
    (b'{"pool": "A100-80GB", "gpus": true, "start": 2000000000, "end": 2000003600}', "gpus must be a whole number"),
    (b'{"pool": "A100-80GB", "gpus": 1, "start": "2033-05-18T10:00", "end": 2000003600}', "with an offset"),
    (b'{"pool": "A100-80GB", "gpus": 1, "start": NaN, "end": 2000003600}', "start must be a time"),
    (b'{"pool": "A100-80GB", "gpus": 1, "start": 2000000000, "end": 2000003600, "colocate": 1}', "true or false"),
    # half a UTF-16 pair, which no UTF-8 carries to the lease server (it was a 500)
    (b'{"pool": "A100-80GB", "gpus": 1, "start": 2000000000, "end": 2000003600, "note": "\\ud800"}', "surrogate"),
]


@pytest.mark.parametrize(("data", "says"), BAD_BOOKINGS)
def test_a_bad_booking_is_refused_here_with_a_message(fetch: Any, server: Any, data: bytes, says: str) -> None:
    assert says in error(fetch("gpulease", "bookings", method="POST", body=data), 400, "bad_request")
    assert server.client("alice").request("GET", "/api/v1/bookings")["bookings"] == []


def test_the_lease_servers_own_refusals_of_a_booking_are_passed_on(fetch: Any, server: Any) -> None:
    start, end = window()
    cases = [
        ({"pool": "A100-80GB", "gpus": 0, "start": start, "end": end}, 400, "gpus"),
        ({"pool": "A100-80GB", "gpus": 1, "start": end, "end": start}, 400, "start"),
        ({"pool": "A100-80GB", "gpus": 1, "start": start, "end": end, "repeat": "daily"}, 400, "weekly"),
        (
            {"pool": "A100-80GB", "gpus": 1, "start": start, "end": end, "repeat": "weekly", "occurrences": 99},
            400,
            "52",
        ),
        ({"pool": "H100-80GB", "gpus": 1, "start": start, "end": end}, 404, "H100-80GB"),
    ]
    for data, status, says in cases:
        resp = post_json(fetch, "gpulease", "bookings", data=data)
        assert resp.code == status and says in body(resp)["message"], (data, resp.code, body(resp))
    assert server.client("alice").request("GET", "/api/v1/bookings")["bookings"] == []


@pytest.mark.parametrize(
    ("method", "path", "params", "says"),
    [
        ("GET", "bookings", {"from": "yesterday"}, "from must be a time"),
        ("GET", "bookings", {"to": "2026-11-23T09:00:00"}, "to must be a time"),
        ("GET", "bookings", {"pool": "no pool!"}, "pool must be a pool name"),
        ("GET", "bookings", {"dry_run": "true"}, "unknown query argument(s) dry_run"),
        ("POST", "bookings", {"dry_run": "maybe"}, "dry_run must be true or false"),
        ("POST", "bookings", {"pool": "A100-80GB"}, "unknown query argument(s) pool"),
        ("GET", "bookings/bad id!", {}, "booking id"),
        ("DELETE", "bookings/bad id!", {}, "booking id"),
        ("POST", "bookings/bad id!/end", {}, "booking id"),
        ("PATCH", "bookings/r-0123456789ab", {}, "nothing to change"),
        ("DELETE", "bookings/r-0123456789ab", {"dry_run": "true"}, "unknown query argument(s) dry_run"),
    ],
)
def test_bad_booking_arguments_are_refused_with_a_message(
    fetch: Any, method: str, path: str, params: dict[str, str], says: str
) -> None:
    resp = fetch("gpulease", *path.split("/"), method=method, params=params)
    assert says in error(resp, 400, "bad_request")


# ---- the event stream -----------------------------------------------------------------------------------


def test_events_stream_live_and_resume_after_last_event_id(
    jp_serverapp: Any, base: str, server: Any, ext: GpuLease, run: Any
) -> None:
    alice = server.client("alice")

    async def scenario() -> None:
        async with httpx.AsyncClient(headers=auth(jp_serverapp), timeout=10) as http:
            async with http.stream("GET", base + "gpulease/events") as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                lines = resp.aiter_lines()
                await read_until(lines, lambda line: line.startswith(": gpulease event stream"))
                assert len(ext.streams) == 1
                lease = await asyncio.to_thread(alice.acquire, gpus=1, label="live")
                seen = await read_until(lines, lambda line: line.startswith("data:") and lease.id in line)
                assert seen[-2] == "event: grant"
                grant_id = seen[-3].removeprefix("id: ")
                data = json.loads(seen[-1].removeprefix("data: "))
                assert (data["lease"], data["user"], data["node"]) == (lease.id, "alice", lease.node)
                await asyncio.to_thread(alice.release, lease)
                seen = await read_until(lines, lambda line: line.startswith("event: "))
                assert seen[-1] == "event: released"
            # The browser went away: the proxy drops its upstream stream.
            while ext.streams:
                await asyncio.sleep(0.01)

            # A reconnecting EventSource sends Last-Event-ID: what it missed is replayed first.
            headers = {"Last-Event-ID": grant_id}
            async with http.stream("GET", base + "gpulease/events", headers=headers) as resp:
                seen = await read_until(resp.aiter_lines(), lambda line: line.startswith("event: "))
                assert seen[-1] == "event: released"

            resp = await http.get(base + "gpulease/events", params={"since": "yesterday"})
            assert (resp.status_code, resp.json()["code"]) == (400, "bad_request")
            assert "event id" in resp.json()["message"]

            # What the board asks for: one `changed` for many events, with their types, no backlog.
            params = {"changes": "true"}
            async with http.stream("GET", base + "gpulease/events", headers=headers, params=params) as resp:
                lines = resp.aiter_lines()
                await read_until(lines, lambda line: line.startswith(": gpulease event stream"))
                lease = await asyncio.to_thread(alice.acquire, gpus=1, label="changes")
                seen = await read_until(lines, lambda line: line.startswith("data:"))
                assert seen[-2] == "event: changed"  # not the replayed `released` of the Last-Event-ID
                assert "grant" in json.loads(seen[-1].removeprefix("data: "))["types"]
                await asyncio.to_thread(alice.release, lease)
            resp = await http.get(base + "gpulease/events", params={"changes": "maybe"})
            assert resp.status_code == 400 and "changes must be true or false" in resp.json()["message"]

    run(scenario())


# ---- authentication, authorization, XSRF, bad input ---------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_every_endpoint_needs_a_jupyter_login(fetch: Any, method: str, path: str) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "token not-the-token"}):
        resp = fetch("gpulease", *path.split("/"), method=method, headers=headers)
        msg = error(resp, 401, "unauthorized")
        assert "log in" in msg


class DenyGpuLease(Authorizer):
    """An authorizer that lets a user do anything in Jupyter but touch GPU leases."""

    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        return resource != "gpulease"


@pytest.mark.parametrize("extra_config", [{"ServerApp": {"authorizer_class": DenyGpuLease}}])
@pytest.mark.parametrize(("method", "path"), ENDPOINTS[:-1])
def test_every_endpoint_asks_the_authorizer(fetch: Any, method: str, path: str) -> None:
    msg = error(fetch("gpulease", *path.split("/"), method=method), 403, "forbidden")
    assert "gpulease" in msg


def test_a_cookie_login_must_echo_the_xsrf_cookie(jp_serverapp: Any, base: str, server: Any, run: Any) -> None:
    lease = server.client("alice").acquire(gpus=1)

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            # Log in the way a browser does: the token once in the URL, then the login cookie.
            token = jp_serverapp.identity_provider.token
            first = await http.get(base + "gpulease/version", params={"token": token})
            assert first.status_code == 200 and http.cookies, first.headers
            assert (await http.get(base + "gpulease/leases")).status_code == 200

            url = base + f"gpulease/leases/{lease.id}"
            resp = await http.delete(url)
            assert (resp.status_code, resp.json()["code"]) == (403, "forbidden")
            assert "X-XSRFToken" in resp.json()["message"]
            assert resp.json()["message"].startswith(f"DELETE {urlparse(url).path}: ")  # not "POST"
            assert server.client("alice").get(lease.id)["state"] == "active"

            resp = await http.post(url + "/keep")
            assert (resp.status_code, resp.json()["code"]) == (403, "forbidden")
            assert "X-XSRFToken" in resp.json()["message"]

            xsrf = os.urandom(16).hex()
            http.cookies.set("_xsrf", xsrf)
            resp = await http.post(url + "/keep", headers={"X-XSRFToken": xsrf})
            assert (resp.status_code, resp.json()["extensions"]) == (200, 1)
            resp = await http.delete(url, headers={"X-XSRFToken": xsrf})
            assert (resp.status_code, resp.json()["state"]) == (200, "released")

    run(scenario())


def test_booking_from_a_cookie_login_must_echo_the_xsrf_cookie(
    jp_serverapp: Any, base: str, server: Any, run: Any
) -> None:
    start, end = window()
    booking = {"pool": "T4-16GB", "gpus": 1, "start": start, "end": end}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            token = jp_serverapp.identity_provider.token
            assert (await http.get(base + "gpulease/version", params={"token": token})).status_code == 200
            assert (await http.get(base + "gpulease/bookings")).status_code == 200
            resp = await http.post(base + "gpulease/bookings", json=booking)
            assert (resp.status_code, resp.json()["code"]) == (403, "forbidden")
            assert "X-XSRFToken" in resp.json()["message"]

            xsrf = os.urandom(16).hex()
            http.cookies.set("_xsrf", xsrf)
            resp = await http.post(base + "gpulease/bookings", json=booking, headers={"X-XSRFToken": xsrf})
            assert resp.status_code == 201, resp.text
            url = base + f"gpulease/bookings/{resp.json()['id']}"
            for method in ("PATCH", "DELETE"):
                resp = await http.request(method, url, json={"note": "x"} if method == "PATCH" else None)
                assert (resp.status_code, resp.json()["code"]) == (403, "forbidden")
            resp = await http.post(url + "/end")
            assert (resp.status_code, resp.json()["code"]) == (403, "forbidden")
            resp = await http.delete(url, headers={"X-XSRFToken": xsrf})
            assert (resp.status_code, resp.json()["state"]) == (200, "cancelled")

    run(scenario())


@pytest.mark.parametrize(
    ("path", "params", "status", "code", "says"),
    [
        ("leases", {"all": "maybe"}, 400, "bad_request", "all must be true or false"),
        ("cluster", {"verbose": "1"}, 400, "bad_request", "unknown query argument(s) verbose"),
        ("cluster", {"pool": "H100"}, 400, "bad_request", "unknown pool 'H100'; pools: A100-80GB, T4-16GB"),
        ("no/such/thing", {}, 404, "not_found", "no such endpoint"),
    ],
)
def test_bad_input_is_refused_with_a_message(
    fetch: Any, path: str, params: dict[str, str], status: int, code: str, says: str
) -> None:
    assert says in error(fetch("gpulease", *path.split("/"), params=params), status, code)


def test_wrong_methods_get_a_json_405(fetch: Any) -> None:
    assert "POST is not supported" in error(fetch("gpulease", "leases", method="POST"), 405, "method_not_allowed")
    assert "DELETE" in error(fetch("gpulease", "cluster", method="DELETE"), 405, "method_not_allowed")


# ---- a lease server that is missing, down, or refuses our token --------------------------------------


@pytest.mark.parametrize(("lease_url", "says"), [("", "no lease server configured"), ("ftp://x", "http(s) URL")])
def test_an_unconfigured_lease_server_is_named_in_every_answer(fetch: Any, says: str) -> None:
    version = body(fetch("gpulease", "version"))
    assert version["lease_server"]["reachable"] is False and says in version["lease_server"]["error"]
    for path in ("cluster", "leases", "events"):
        assert says in error(fetch("gpulease", path), 503, "unavailable")


DEAD_URL = "http://127.0.0.1:1"  # nothing listens on port 1: connection refused


@pytest.mark.parametrize("lease_url", [DEAD_URL])
def test_a_lease_server_that_is_down_gives_503_with_its_address(fetch: Any) -> None:
    version = body(fetch("gpulease", "version"))
    assert version["lease_server"]["reachable"] is False
    assert "is it running?" in version["lease_server"]["error"]
    for path in ("cluster", "events"):
        msg = error(fetch("gpulease", path), 503, "unavailable")
        assert DEAD_URL in msg and "is it running?" in msg


@pytest.mark.parametrize("lease_token", ["glt_not-a-token"])
def test_a_refused_lease_token_is_a_configuration_error_not_a_401(fetch: Any) -> None:
    lease = body(fetch("gpulease", "version"))["lease_server"]
    assert lease["reachable"] is True and lease["code"] == "lease_server_auth"
    msg = error(fetch("gpulease", "cluster"), 502, "lease_server_auth")
    assert "lease token" in msg and "GPULEASE_TOKEN" in msg


# ---- kernels' leases end with their kernel ---------------------------------------------------------------


async def released(ext: GpuLease, kernel_id: str) -> tuple[str, list[str]]:
    """Wait for the extension to have released kernel_id's leases; returns (why, lease ids)."""
    cond = ext.releaser.changed
    async with cond:
        await cond.wait_for(lambda: any(k == kernel_id for k, _, _ in ext.releaser.history))
    return next((why, ids) for k, why, ids in ext.releaser.history if k == kernel_id)


def _start_kernel(fetch: Any) -> str:
    resp = fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    assert resp.code == 201, resp.body
    return str(body(resp)["id"])


def test_shutting_down_a_kernel_releases_its_leases_only(fetch: Any, server: Any, ext: GpuLease, run: Any) -> None:
    kid = _start_kernel(fetch)
    alice = server.client("alice")
    doomed = alice.acquire(gpus=2, session=f"kernel-{kid}")
    other = alice.acquire(gpus=1, session="kernel-some-other-kernel")
    assert fetch("api", "kernels", kid, method="DELETE").code == 204

    why, ids = run(released(ext, kid))
    assert (why, ids) == ("the kernel shut down", [doomed.id])
    assert alice.get(doomed.id)["state"] == "released"
    assert alice.get(other.id)["state"] == "active"


def test_a_killed_kernel_is_restarted_and_its_old_leases_released(
    jp_serverapp: Any, fetch: Any, server: Any, ext: GpuLease, run: Any
) -> None:
    kid = _start_kernel(fetch)
    lease = server.client("alice").acquire(gpus=1, session=f"kernel-{kid}")
    km = jp_serverapp.kernel_manager.get_kernel(kid)
    os.kill(km.provisioner.process.pid, signal.SIGKILL)

    why, ids = run(released(ext, kid))
    assert (why, ids) == ("the kernel restarted", [lease.id])
    assert server.client("alice").get(lease.id)["state"] == "released"


@pytest.mark.parametrize("extra_config", [{"KernelRestarter": {"restart_limit": 0}}])
def test_a_kernel_that_dies_for_good_releases_its_leases(
    jp_serverapp: Any, fetch: Any, server: Any, ext: GpuLease, run: Any
) -> None:
    kid = _start_kernel(fetch)
    lease = server.client("alice").acquire(gpus=1, session=f"kernel-{kid}")
    km = jp_serverapp.kernel_manager.get_kernel(kid)
    os.kill(km.provisioner.process.pid, signal.SIGKILL)

    why, ids = run(released(ext, kid))
    assert (why, ids) == ("the kernel died", [lease.id])


def test_stopping_the_jupyter_server_releases_its_kernels_leases(
    jp_serverapp: Any, fetch: Any, server: Any, ext: GpuLease, run: Any
) -> None:
    kid = _start_kernel(fetch)
    lease = server.client("alice").acquire(gpus=1, session=f"kernel-{kid}")
    run(ext.stop_extension())
    assert server.client("alice").get(lease.id)["state"] == "released"
    assert ext.releaser.history[-1] == (kid, "the Jupyter server is stopping", [lease.id])


# ---- JupyterHub: one proxy token, each server acting for its Hub user ------------------------------


@pytest.fixture
def hub_user(monkeypatch: pytest.MonkeyPatch) -> str:
    """A JupyterHub single-user server's environment (set before the Jupyter server starts)."""
    monkeypatch.setenv("JUPYTERHUB_USER", "ann")
    return "ann"


@pytest.mark.parametrize("lease_identity", [("hub", "proxy")])
@pytest.mark.parametrize("extra_config", [{"GpuLease": {"act_as_user": "carl"}}])
def test_proxy_token_acts_for_the_configured_user(fetch: Any, server: Any) -> None:
    assert body(fetch("gpulease", "version"))["lease_server"]["user"] == "carl"
    lease = server.client("carl").acquire(1)
    mine = body(fetch("gpulease", "leases"))["leases"]
    assert [x["id"] for x in mine] == [lease.id]
    resp = fetch("gpulease", "leases", lease.id, method="DELETE")
    assert resp.code == 200 and body(resp)["state"] == "released"


@pytest.mark.parametrize("lease_identity", [("hub", "proxy")])
def test_proxy_token_acts_for_the_jupyterhub_user(hub_user: str, fetch: Any) -> None:
    assert body(fetch("gpulease", "version"))["lease_server"]["user"] == hub_user


def test_a_users_own_token_ignores_the_jupyterhub_user(hub_user: str, fetch: Any) -> None:
    assert body(fetch("gpulease", "version"))["lease_server"]["user"] == "alice"
