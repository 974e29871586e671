"""The HTTP edge holds under abuse (issue 33, item 5; findings 5 and 7): each attack reproduced on a
real in-process lease server, and shown to fail.

Finding 5: tornado read bodies up to 64 MiB before auth and the 413 check, with no body timeout,
and kept connections with unfinished headers for an hour. Finding 7: 10,000-entry event log
pages on a few connections slowed everyone, and ``/metrics`` read the whole cluster from Redis on
every call. Timeouts are set short here (they are settings) so that the module stays quick; every
wait is on an event (the server's answer, or its closing the connection), none on a clock.
"""

from __future__ import annotations

import json
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from lease_server.config import Settings
from lease_server.store.keys import Keys
from lease_server.web import limits
from lease_server.web.metrics import FRESH_BURST
from tests.api_helpers import API, assert_error, event_stream, http

WAIT = 20.0  # seconds a socket read may block before the test fails instead of hanging


def connect(server: Any) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=WAIT)
    return s


def head(method: str, path: str, token: str | None = None, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gpulease"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_answer(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer read off ``s``: status, headers (lower-case names), body (by Content-Length)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before an answer: {raw!r}"
        raw += chunk
    top, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = s.recv(65536)
        assert chunk, "connection closed inside the answer's body"
        rest += chunk
    return int(status_line.split()[1]), headers, rest[:length]


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closes ``s`` (reads until EOF or a reset; a silent socket fails the test
    after WAIT seconds with socket.timeout)."""
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def seed_log(redis_sync: Any, prefix: str, n: int) -> list[str]:
    """``n`` grant entries added straight to the event log; their ids."""
    key = Keys(prefix).events
    pipe = redis_sync.pipeline(transaction=False)
    for i in range(n):
        data = {"ts": 1_700_000_000_000 + i, "lease": f"l-seed{i:06d}", "user": "seed", "pool": "A100-80GB"}
        pipe.xadd(key, {"type": "grant", "data": json.dumps(data)})
    return list(pipe.execute())


# ---- finding 5: bodies, timeouts, connections ----------------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_read(server: Any) -> None:
    """A 60 MB Content-Length with a valid token: the 413 comes before a byte of the body is sent,
    so nothing of it was read, and the connection is closed (it says so)."""
    with connect(server) as s:
        s.sendall(head("POST", f"{API}/leases", server.token("alice"), Content_Length=str(60_000_000)))
        status, headers, body = read_answer(s)
        assert status == 413, body
        assert headers.get("connection") == "close"
        err = json.loads(body)
        assert err["code"] == "payload_too_large" and "65536 bytes" in err["message"], err
        assert closed_by_server(s)


def test_an_unauthenticated_body_is_401_before_it_is_read(server: Any) -> None:
    """No token, or an unknown one, with a body under the limit: 401 before the body is sent."""
    for token in (None, "glt_not-a-token"):
        with connect(server) as s:
            s.sendall(head("POST", f"{API}/leases", token, Content_Length="60000", Content_Type="application/json"))
            status, headers, body = read_answer(s)
            assert status == 401, body
            assert json.loads(body)["code"] == "unauthorized"
            assert headers.get("connection") == "close"
            assert closed_by_server(s)


def test_a_request_without_a_body_keeps_its_connection_after_an_error(server: Any) -> None:
    """A 401 or 404 to a request that has no body leaves the kept-alive connection open."""
    with connect(server) as s:
        for path, status in ((f"{API}/whoami", 401), ("/nope", 404), (f"{API}/health", 200)):
            s.sendall(head("GET", path))
            got, headers, _ = read_answer(s)
            assert got == status and headers.get("connection") != "close"


def test_a_chunked_body_past_the_limit_is_413(server: Any) -> None:
    with connect(server) as s:
        s.sendall(head("POST", f"{API}/leases", server.token("alice"), Transfer_Encoding="chunked"))
        chunk = b"x" * 65536
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2)
        status, headers, body = read_answer(s)
        assert status == 413 and json.loads(body)["code"] == "payload_too_large"
        assert closed_by_server(s)


@pytest.fixture
def quick(server_factory: Any) -> Any:
    """A server with short timeouts and small caps, so that the attacks below end quickly."""
    return server_factory(http_body_timeout=0.3, http_idle_timeout=0.5, max_connections=8)


def test_a_slow_body_is_cut_by_the_body_timeout(quick: Any) -> None:
    """A body that trickles (here: 10 of its 1,000 bytes, then nothing) is dropped at the body
    timeout, chunked or not."""
    with connect(quick) as s:
        s.sendall(head("POST", f"{API}/leases", quick.token("alice"), Content_Length="1000") + b'{"gpus": 1,')
        assert closed_by_server(s)
    with connect(quick) as s:
        s.sendall(head("POST", f"{API}/leases", quick.token("alice"), Transfer_Encoding="chunked") + b"a\r\n{")
        assert closed_by_server(s)


def test_unfinished_headers_are_closed_by_the_idle_timeout(quick: Any) -> None:
    with connect(quick) as s:
        s.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: gpulease\r\nX-Slow: 1")
        assert closed_by_server(s)
    with connect(quick) as s:  # a connection that never sends anything
        assert closed_by_server(s)


def test_an_event_stream_outlives_the_idle_timeout(quick: Any) -> None:
    """The idle clock runs only while a request head is awaited: a stream open past it still
    delivers (an idle connection opened after the stream, closed by the server, shows the timeout
    has passed)."""
    with event_stream(quick, "watcher") as events, http(quick, "bob") as bob:
        with connect(quick) as idle:
            assert closed_by_server(idle)
        lease = bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        assert any(json.loads(b["data"]).get("lease") == lease["id"] for b in (next(events) for _ in range(5)))


def test_connections_beyond_the_cap_are_closed_at_once(quick: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lease_server.web.server")
    held = []
    try:
        for _ in range(8):  # the cap; each answered, so each is open on the server's side
            s = connect(quick)
            s.sendall(head("GET", f"{API}/health"))
            assert read_answer(s)[0] == 200
            held.append(s)
        for _ in range(3):
            with connect(quick) as extra:
                extra.sendall(head("GET", f"{API}/health"))
                assert closed_by_server(extra)
        refusals = [r for r in caplog.records if "max_connections" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in refusals]  # logged once, not per connection
    finally:
        for s in held:
            s.close()


# ---- finding 7: expensive reads ------------------------------------------------------------------


def test_a_page_is_capped_near_a_thousand_and_says_so(server: Any, redis_sync: Any) -> None:
    seed_log(redis_sync, server.settings.prefix, 1200)
    with http(server, "alice") as c:
        page = c.get(f"{API}/events/log", params={"limit": "10000"}).json()
        assert len(page["events"]) == 1000 and page["limit"] == 1000
        assert "page cap of 1000" in page["note"] and "since=" in page["note"]
        rest = c.get(f"{API}/events/log", params={"since": page["events"][-1]["id"], "limit": "1000"}).json()
        assert "note" not in rest and len(page["events"]) + len(rest["events"]) >= 1200
        assert_error(c.get(f"{API}/events/log", params={"limit": "10001"}), 400, "bad_request", "limit")
        doc = c.get(f"{API}/openapi.json").json()["paths"]["/api/v1/events/log"]["get"]
        limit = next(p for p in doc["parameters"] if p["name"] == "limit")
        assert "page cap" in limit["description"] and "429" in doc["responses"]
        assert {"limit", "note"} <= set(doc["responses"]["200"]["content"]["application/json"]["schema"]["properties"])


def test_expensive_reads_are_limited_per_token(server_factory: Any, redis_sync: Any) -> None:
    """One token: a read while another is in flight is a 429; a read on an emptied bucket is a 429
    with Retry-After; another token reads meanwhile."""
    srv = server_factory(log_reads_at_once=1, log_read_rate=20, log_read_burst=200)
    ids = seed_log(redis_sync, srv.settings.prefix, 1000)
    # Alice's stream sends a backlog of 1,000 entries: 200 at once, the rest at 20 a second, and it
    # holds her one read in flight while it does.
    with event_stream(srv, "alice", headers={"Last-Event-ID": ids[0]}) as backlog, http(srv, "alice") as alice:
        next(backlog)  # the backlog has begun
        resp = alice.get(f"{API}/events/log")
        assert_error(resp, 429, "too_many", "in flight", "the most one token may")
        assert int(resp.headers["Retry-After"]) >= 1
        with http(srv, "carol") as carol:  # her token has its own limits
            assert len(carol.get(f"{API}/events/log", params={"limit": "50"}).json()["events"]) == 50
    with http(srv, "dave") as dave:
        # 210 entries: the bucket's 200, then 10 more at 20 a second; the next read would need 100
        # more (a read costs at least that), five seconds away.
        assert len(dave.get(f"{API}/events/log", params={"limit": "210"}).json()["events"]) == 210
        resp = dave.get(f"{API}/events/log", params={"limit": "1"})
        assert_error(resp, 429, "too_many", "entries", "retry in", "since=")
        assert int(resp.headers["Retry-After"]) >= 2


def test_a_stream_reconnect_storm_gets_429s(server_factory: Any) -> None:
    srv = server_factory(stream_connect_rate=0.01, stream_connect_burst=3)
    for _ in range(3):
        with event_stream(srv, "bob"):
            pass
    with http(srv, "bob") as bob:
        for _ in range(2):  # each held a second (REFUSAL_HOLD_S) before it is sent
            resp = bob.get(f"{API}/events")
            assert_error(resp, 429, "too_many", "reconnect in", "Last-Event-ID")
            assert int(resp.headers["Retry-After"]) >= 60
    with event_stream(srv, "carol"):  # another token connects
        pass


def test_metrics_under_a_flood_share_one_render(server_factory: Any) -> None:
    """After a few fresh renders, requests wait for the next render (metrics_cache_s later) and all
    get that one page: one Redis read however many ask. The pages are the same bytes though each
    request is counted."""
    srv = server_factory(metrics_cache_s=2)
    with httpx.Client(base_url=srv.url, timeout=WAIT) as anon, http(srv, "alice") as alice:
        pages = [anon.get("/metrics").text for _ in range(FRESH_BURST)]
        assert len(set(pages)) == FRESH_BURST  # fresh: each counts the one before
        alice.post(f"{API}/leases", json={"gpus": 2, "ttl": 600})
        with ThreadPoolExecutor(8) as pool:
            flood = list(pool.map(lambda _: httpx.get(f"{srv.url}/metrics", timeout=WAIT).text, range(8)))
        # One render for the flood (two if a request came only after the first one: not a clock test)
        assert len(set(flood)) <= 2, "each request of the flood rendered its own page"
        assert 'gpulease_gpus{pool="A100-80GB",state="leased"} 2.0' in flood[0]  # the render after the wait


# ---- the limits themselves, on a clock of their own --------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bucket_refills_at_its_rate_and_holds_its_burst() -> None:
    clock = Clock()
    b = limits.Bucket(rate=2.0, burst=4, clock=clock)
    assert [b.take("k") for _ in range(4)] == [0.0] * 4
    assert b.take("k") == pytest.approx(0.5)
    clock.now += 0.5
    assert b.take("k") == 0.0
    clock.now += 100
    assert b.level("k") == 4  # never more than the burst
    b.charge("k", 10)  # a cost known after the fact: below zero
    assert b.wait("k") == pytest.approx(3.5)
    assert b.take("other") == 0.0


def test_read_limits_count_reads_in_flight() -> None:
    settings = Settings(log_reads_at_once=2)
    lim = limits.ReadLimits(settings, Clock())
    with lim.reading("k", "x"), lim.reading("k", "x"):
        with pytest.raises(Exception, match="in flight") as info:
            with lim.reading("k", "x"):
                pass
        assert getattr(info.value, "status", None) == 429
        with lim.reading("other", "x"):
            pass
    with lim.reading("k", "x"):  # both ended: free again
        pass
    assert not lim._in_flight
