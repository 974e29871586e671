"""Helpers of the HTTP API tests: raw httpx clients, error-body checks, Redis state snapshots and
server-sent-event parsing. Nothing here mocks the server; everything talks to a real one."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from redis import Redis

from lease_server.store.keys import Keys

API = "/api/v1"

# Event types that mean a lease (or a waiter) changed: bad input must never add one of these.
LEASE_EVENTS = frozenset(
    {
        "grant",
        "released",
        "revoked",
        "expired",
        "queued",
        "renew_miss",
        "wait_timeout",
        "wait_cancelled",
        "wait_abandoned",
        "reservation_created",
        "reservation_changed",
        "reservation_cancelled",
        "reservation_ended",
        "reservation_no_show",
        "borrow_recalled",
        "grown",
        "shrunk",
        "shrink_notice",
    }
)


def http(server: Any, user: str | None = None, role: str = "user", token: str | None = None) -> httpx.Client:
    """A raw httpx client of ``server``; with ``user`` (or ``token``) it sends that bearer token."""
    headers = {}
    if token is None and user is not None:
        token = server.token(user, role)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=server.url, headers=headers, timeout=httpx.Timeout(10.0, connect=5.0))


def assert_error(resp: httpx.Response, status: int, code: str, *fragments: str) -> dict[str, Any]:
    """The response is ``status`` with a JSON ``{"code", "message"}`` body whose message contains
    every fragment (case-insensitive). Returns the body."""
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text[:500]}"
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers.get("content-type")
    body = resp.json()
    assert isinstance(body, dict), body
    assert isinstance(body.get("code"), str) and isinstance(body.get("message"), str), body
    assert body["code"] == code, f"expected code {code!r}, got {body!r}"
    assert body["message"].strip(), body
    for frag in fragments:
        assert frag.lower() in body["message"].lower(), f"{frag!r} not in message {body['message']!r}"
    return body


class Cases:
    """Runs many small cases against one server and reports every failing one at the end (one
    server per case would make the suite slow for no gain)."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        try:
            yield
        except AssertionError as exc:
            self.failures.append(f"[{name}] {exc}")

    def check(self) -> None:
        assert not self.failures, f"{len(self.failures)} case(s) failed:\n" + "\n\n".join(self.failures)


# ---- state snapshots -------------------------------------------------------------------------


def snapshot(r: Redis, prefix: str) -> dict[str, Any]:
    """Every key of the test's prefix except the event stream and the tokens' last use, with its value.

    ``alive`` holds heartbeat deadlines, which the in-process agent moves forward every
    heartbeat_interval: only whether each node is up (score >= 0) or down (-1) is state that a
    request could change, so that is what is kept of it. The agent's GPU samples (``last``,
    ``busy_at``, ``covered_since``, each GPU's window) come every sample_interval whatever a request
    does: left out too. So are the hourly rollups: the sweep folds the ledger's lines into them
    whenever it runs (store/rollup.py), and the ledger they come from is kept.
    """
    keys = Keys(prefix)
    agent = {keys.last, keys.busy_at, keys.covered_since, keys.rollup, keys.rollup_idx, keys.rollup_at}
    windows = keys.samples("")
    out: dict[str, Any] = {}
    for key in sorted(r.scan_iter(match=keys.pattern(), count=1000)):
        if key in (keys.events, keys.token_used):  # a request, even a refused one, uses its token
            continue
        if key in agent or key.startswith(windows):
            continue
        kind = r.type(key)
        if kind == "hash":
            value: Any = r.hgetall(key)
        elif kind == "zset":
            pairs = r.zrange(key, 0, -1, withscores=True)
            value = {m: (s >= 0) for m, s in pairs} if key == keys.alive else dict(pairs)
        elif kind == "string":
            value = r.get(key)
        elif kind == "list":
            value = r.lrange(key, 0, -1)
        elif kind == "set":
            value = sorted(r.smembers(key))
        elif kind == "stream":
            value = r.xrange(key)
        elif kind == "none":  # deleted between SCAN and TYPE
            continue
        else:
            value = f"<{kind}>"
        out[key] = (kind, value)
    return out


def last_event_id(r: Redis, prefix: str) -> str:
    entries = r.xrevrange(Keys(prefix).events, "+", "-", count=1)
    return entries[0][0] if entries else "0-0"


def event_types_after(r: Redis, prefix: str, since: str) -> list[str]:
    return [f["type"] for _id, f in r.xrange(Keys(prefix).events, f"({since}", "+")]


@contextlib.contextmanager
def unchanged(r: Redis, prefix: str) -> Iterator[None]:
    """Asserts that the block changed no key of ``prefix`` and logged no lease event."""
    before = snapshot(r, prefix)
    since = last_event_id(r, prefix)
    yield
    after = snapshot(r, prefix)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"bad input changed Redis keys {changed}: {[(before.get(k), after.get(k)) for k in changed]}"
    added = [t for t in event_types_after(r, prefix, since) if t in LEASE_EVENTS]
    assert not added, f"bad input logged lease events {added}"


# ---- server-sent events ----------------------------------------------------------------------


@contextlib.contextmanager
def event_stream(server: Any, user: str, **kwargs: Any) -> Iterator[Iterator[dict[str, Any]]]:
    """An open SSE stream of ``GET /api/v1/events`` (its opening comment already read), as an
    iterator of event blocks. A read blocks at most 10 s (a bounded wait: the server sends a
    keep-alive comment every 15 s), so a missing event fails the test instead of hanging it."""
    client = httpx.Client(
        base_url=server.url,
        headers={"Authorization": f"Bearer {server.token(user)}"},
        timeout=httpx.Timeout(10.0, connect=5.0),
    )
    with client, client.stream("GET", f"{API}/events", **kwargs) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        blocks = sse_blocks(resp.iter_lines())
        opening = next(blocks)
        assert "gpulease event stream" in opening["comments"]
        yield (b for b in blocks if "event" in b)  # keep-alive comments skipped


def next_event(events: Iterator[dict[str, Any]], kind: str, lease_id: str, limit: int = 50) -> dict[str, Any]:
    """The next ``kind`` event of ``lease_id`` on the stream (other events are skipped)."""
    for _ in range(limit):
        block = next(events)
        if block["event"] == kind and json.loads(block["data"]).get("lease") == lease_id:
            return block
    raise AssertionError(f"no {kind} event of {lease_id} in {limit} events")


def sse_blocks(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Parse an SSE line stream into blocks: {"id", "event", "data", "comments"} per blank line."""
    block: dict[str, Any] = {"comments": []}
    for line in lines:
        if line == "":
            if len(block) > 1 or block["comments"]:
                yield block
            block = {"comments": []}
            continue
        if line.startswith(":"):
            block["comments"].append(line[1:].strip())
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data" and "data" in block:
            block["data"] += "\n" + value
        else:
            block[field] = value


class EventWatcher:
    """Reads the server-sent event stream GET /api/v1/events in a thread; ``wait_for`` blocks on a
    Condition until a matching event arrived. ``start`` returns once the stream is open, which is
    after the server subscribed this client, so no later event can be missed."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.events: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.closed = False
        self._cond = threading.Condition()
        self._open = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sse-watcher", daemon=True)

    def start(self) -> EventWatcher:
        self._thread.start()
        assert self._open.wait(10), "the event stream did not open within 10 s"
        assert self.error is None and not self.closed, f"event stream failed: {self.error!r}"
        return self

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            with (
                httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(60.0, connect=5.0)) as h,
                h.stream("GET", f"{API}/events") as resp,
            ):
                resp.raise_for_status()
                block: dict[str, str] = {}
                for line in resp.iter_lines():
                    if line == "":  # end of a block; the first one is the stream's greeting
                        self._open.set()
                        if "data" in block:
                            with self._cond:
                                self.events.append(json.loads(block["data"]))
                                self._cond.notify_all()
                        block = {}
                    elif not line.startswith(":"):
                        name, _, value = line.partition(":")
                        block[name] = value[1:] if value.startswith(" ") else value
        except BaseException as exc:  # the server went away at teardown, or a real failure
            self.error = exc
        finally:
            with self._cond:
                self.closed = True
                self._cond.notify_all()
            self._open.set()

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((e for e in self.events if pred(e)), None)

        with self._cond:
            self._cond.wait_for(lambda: self.closed or found() is not None, timeout)
            ev = found()
            seen = [e["type"] for e in self.events]
        assert ev is not None, f"no {what} event within {timeout}s (stream error {self.error!r}); saw {seen}"
        return ev


# ---- queued requests ---------------------------------------------------------------------------


class QueuedPost:
    """A ``POST /leases`` with a long wait, run in a thread; ``answered`` is set when it returns."""

    def __init__(self, server: Any, user: str, lease_id: str, wait: float = 30, gpus: int = 1) -> None:
        self.server, self.user, self.lease_id, self.wait, self.gpus = server, user, lease_id, wait, gpus
        self.resp: httpx.Response | None = None
        self.error: BaseException | None = None
        self.answered = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"post-{lease_id}", daemon=True)

    def _run(self) -> None:
        try:
            with http(self.server, self.user) as c:
                self.resp = c.post(
                    f"{API}/leases",
                    timeout=self.wait + 30,
                    json={"gpus": self.gpus, "ttl": 600, "wait": self.wait, "id": self.lease_id},
                )
        except BaseException as exc:  # reported by the test thread
            self.error = exc
        finally:
            self.answered.set()

    def start(self) -> QueuedPost:
        self._thread.start()
        return self

    def result(self, timeout: float) -> httpx.Response:
        assert self.answered.wait(timeout), f"the POST of {self.lease_id} did not answer within {timeout}s"
        assert self.error is None, repr(self.error)
        assert self.resp is not None
        return self.resp


@contextlib.contextmanager
def queued(server: Any, user: str, lease_id: str, gpus: int = 1) -> Iterator[QueuedPost]:
    """``user``'s request ``lease_id`` waiting in the queue (its ``queued`` event seen). On leaving,
    a POST still waiting is withdrawn (DELETE), so a failing test never leaves a thread hanging."""
    post = QueuedPost(server, user, lease_id, gpus=gpus)
    with event_stream(server, "watcher") as events:
        post.start()
        next_event(events, "queued", lease_id)
    try:
        yield post
    finally:
        if not post.answered.is_set():
            with http(server, user) as c:
                c.delete(f"{API}/leases/{lease_id}")
        post.answered.wait(30)
