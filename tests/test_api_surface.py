"""The API's surface: the OpenAPI document against the route table, Prometheus metrics, and the
server-sent event stream (live and resumed with Last-Event-ID). Real server, real Redis."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
import tornado.web
from openapi_spec_validator import validate
from prometheus_client.parser import text_string_to_metric_families

from lease_server.config import Settings
from lease_server.leasing import events
from lease_server.web.api import Context, make_app
from tests.api_helpers import API, assert_error, event_stream, http, next_event

METHODS = ("get", "post", "put", "delete", "patch")


def _route_table() -> list[tuple[str, type[tornado.web.RequestHandler]]]:
    """(path regex, handler) of every route make_app serves (the app is built, never started)."""
    ctx = Context(Settings())
    try:
        app = make_app(ctx)
        return [(rule.matcher.regex.pattern, rule.target) for rule in app.wildcard_router.rules]
    finally:
        asyncio.run(ctx.redis.aclose())


def _normalise_route(pattern: str) -> str:
    """'/api/v1/leases/([A-Za-z0-9._-]{1,64})/renew$' -> '/api/v1/leases/{}/renew'."""
    return re.sub(r"\([^)]*\)", "{}", pattern.removesuffix("$")).replace("\\", "")


def _normalise_path(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "{}", path)


def _implemented(handler: type[tornado.web.RequestHandler]) -> set[str]:
    return {m for m in METHODS if getattr(handler, m) is not getattr(tornado.web.RequestHandler, m)}


# ---- OpenAPI ---------------------------------------------------------------------------------


@pytest.fixture
def openapi(server: Any) -> dict[str, Any]:
    with http(server) as anon:
        resp = anon.get(f"{API}/openapi.json")
    assert resp.status_code == 200
    return resp.json()  # type: ignore[no-any-return]


def test_openapi_document_is_valid(openapi: dict[str, Any]) -> None:
    validate(openapi)  # raises on an invalid OpenAPI 3.1 document
    assert openapi["openapi"].startswith("3.1")


def test_every_route_is_documented(openapi: dict[str, Any]) -> None:
    documented = {_normalise_path(p) for p in openapi["paths"]}
    routes = _route_table()
    assert len(routes) >= 16
    missing = [pattern for pattern, _h in routes if _normalise_route(pattern) not in documented]
    assert not missing, f"routes missing from the OpenAPI paths: {missing}"


def test_every_documented_operation_is_implemented(openapi: dict[str, Any]) -> None:
    served = {_normalise_route(p): _implemented(h) for p, h in _route_table()}
    for path, item in openapi["paths"].items():
        ops = {m for m in item if m in METHODS}
        assert ops, path
        key = _normalise_path(path)
        assert key in served, f"documented path {path} is not routed"
        assert ops <= served[key], f"{path}: documented {sorted(ops)}, implemented {sorted(served[key])}"


def test_every_implemented_operation_is_documented(openapi: dict[str, Any]) -> None:
    docs = {_normalise_path(p): {m for m in item if m in METHODS} for p, item in openapi["paths"].items()}
    extra = [
        f"{m.upper()} {_normalise_route(p)}"
        for p, h in _route_table()
        for m in sorted(_implemented(h))
        if m not in docs.get(_normalise_route(p), set())
    ]
    assert not extra, f"served but undocumented operations: {extra}"


def test_every_documented_operation_answers(server: Any, openapi: dict[str, Any]) -> None:
    """No documented (path, method) falls through to the 'no such endpoint' handler."""
    with http(server, "root", "admin") as admin:
        for path, item in openapi["paths"].items():
            url = (
                path.replace("{lease_id}", "l-0123456789abcdef")
                .replace("{node}", "n1")
                .replace("{pool}", "A100-80GB")
                .replace("{booking_id}", "r-0123456789ab")
                .replace("{reservation_id}", "r-0123456789ab")
                .replace("{token_id}", "0123456789ab")
            )
            for method in (m for m in item if m in METHODS):
                kwargs: dict[str, Any] = {"json": {}} if method in ("post", "put") else {}
                with admin.stream(method.upper(), url, **kwargs) as resp:
                    if resp.headers.get("content-type", "").startswith("text/event-stream"):
                        assert resp.status_code == 200
                        continue  # a live stream: the status is the answer
                    resp.read()
                assert resp.status_code != 405, f"{method.upper()} {path}: 405"
                if resp.status_code == 404:
                    body = resp.json()
                    assert body["code"] != "not_found" and "no such endpoint" not in body["message"], (
                        f"{method.upper()} {path} is documented but not served: {body}"
                    )


# ---- metrics ---------------------------------------------------------------------------------


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_report_gpu_states_and_requests(server: Any) -> None:
    with http(server, "alice") as alice, http(server) as anon:
        lease = alice.post(f"{API}/leases", json={"gpus": 2, "ttl": 600}).json()
        alice.post(f"{API}/leases", json={"gpus": 1, "pool": "nope"})  # a 404, counted too
        resp = anon.get("/metrics")
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain")
        text = resp.text
        assert 'gpulease_gpus{pool="A100-80GB",state="free"} 4.0' in text
        samples = _samples(text)

        def gpus(pool: str, state: str) -> float:
            return samples[("gpulease_gpus", (("pool", pool), ("state", state)))]

        assert gpus("A100-80GB", "free") == 4 and gpus("A100-80GB", "leased") == 2
        assert gpus("A100-80GB", "down") == 0
        assert gpus("T4-16GB", "free") == 2 and gpus("T4-16GB", "leased") == 0
        assert "gpulease_http_requests" in text
        posts = {
            labels: v
            for (name, labels), v in samples.items()
            if name == "gpulease_http_requests_total" and ("method", "POST") in labels
        }
        assert posts[(("method", "POST"), ("route", "leases"), ("status", "201"))] == 1
        assert posts[(("method", "POST"), ("route", "leases"), ("status", "404"))] == 1

        # After the release, the gauges follow.
        alice.delete(f"{API}/leases/{lease['id']}")
        samples = _samples(anon.get("/metrics").text)
        assert gpus("A100-80GB", "free") == 6 and gpus("A100-80GB", "leased") == 0


# ---- server-sent events ----------------------------------------------------------------------

ID_RE = re.compile(r"^\d+-\d+$")


def _sid(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def test_event_stream_delivers_a_grant_live(server: Any) -> None:
    with event_stream(server, "watcher") as events, http(server, "bob") as bob:
        # The stream is open (its first bytes arrived): whatever happens now must be delivered.
        lease = bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 600, "label": "live"}).json()
        block = next_event(events, "grant", lease["id"])
    assert ID_RE.match(block["id"]), block
    data = json.loads(block["data"])
    assert data["id"] == block["id"] and data["type"] == "grant"
    assert data["user"] == "bob" and data["label"] == "live" and data["node"] == lease["node"]
    assert data["gpus"] == [g["index"] for g in lease["gpus"]]
    assert "token" not in data  # bob's fencing token is bob's: the watcher never sees it


def test_event_stream_resumes_after_last_event_id(server: Any) -> None:
    with http(server, "bob") as bob:
        first = bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        log = bob.get(f"{API}/events/log", params={"limit": "10000"}).json()["events"]
        grant_id = next(e["id"] for e in log if e["type"] == "grant" and e["lease"] == first["id"])
        # What happens while nobody is listening: a release and another grant.
        bob.delete(f"{API}/leases/{first['id']}")
        second = bob.post(f"{API}/leases", json={"gpus": 2, "ttl": 600}).json()
        missed = bob.get(f"{API}/events/log", params={"since": grant_id}).json()["events"]
        assert [(e["type"], e["lease"]) for e in missed] == [("released", first["id"]), ("grant", second["id"])]

        for how in ({"headers": {"Last-Event-ID": grant_id}}, {"params": {"since": grant_id}}):
            with event_stream(server, "watcher", **how) as events:
                replayed = [next(events) for _ in missed]
                assert [b["id"] for b in replayed] == [e["id"] for e in missed]
                assert [b["event"] for b in replayed] == [e["type"] for e in missed]
                assert [json.loads(b["data"])["lease"] for b in replayed] == [e["lease"] for e in missed]
                assert grant_id not in [b["id"] for b in replayed]
                # ... and then live events, none repeated: the next one is new.
                bob.delete(f"{API}/leases/{second['id']}")
                nxt = next(events)
                assert nxt["event"] == "released" and json.loads(nxt["data"])["lease"] == second["id"]
                assert _sid(nxt["id"]) > _sid(missed[-1]["id"])
            second = bob.post(f"{API}/leases", json={"gpus": 2, "ttl": 600}).json()
            # The next round replays from the same id: now one more release and grant.
            missed = bob.get(f"{API}/events/log", params={"since": grant_id}).json()["events"]


def test_event_stream_needs_a_token(server: Any) -> None:
    with http(server) as anon:
        assert_error(anon.get(f"{API}/events"), 401, "unauthorized", "Authorization: Bearer")


def test_event_log_and_stream_filter_by_lease(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """?lease=ID keeps only the events of that lease, in the log (up to `limit` of them, however
    many other events lie between: pages of 3 here, so the filter must read on) and on the stream."""
    monkeypatch.setattr(events, "FILTER_PAGE", 3)
    with http(server, "bob") as bob:
        first = bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        others = [bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json() for _ in range(3)]
        for other in others:
            bob.delete(f"{API}/leases/{other['id']}")
        bob.delete(f"{API}/leases/{first['id']}")

        def log(**params: str) -> list[dict[str, Any]]:
            resp = bob.get(f"{API}/events/log", params={"lease": first["id"], **params})
            assert resp.status_code == 200, resp.text
            return resp.json()["events"]  # type: ignore[no-any-return]

        mine = log()
        assert [(e["type"], e["lease"]) for e in mine] == [("grant", first["id"]), ("released", first["id"])]
        assert [e["type"] for e in log(limit="1")] == ["grant"]
        assert [e["type"] for e in log(since=mine[0]["id"])] == ["released"]
        assert log(lease="l-nobody-has-this") == []

        # The stream: the backlog after `since`, then live events, only this lease's.
        second = bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
        with event_stream(server, "watcher", params={"lease": second["id"], "since": mine[0]["id"]}) as stream:
            grant = next(stream)
            assert (grant["event"], json.loads(grant["data"])["lease"]) == ("grant", second["id"])
            noise = bob.post(f"{API}/leases", json={"gpus": 1, "ttl": 600}).json()
            bob.delete(f"{API}/leases/{noise['id']}")
            bob.delete(f"{API}/leases/{second['id']}")
            released = next(stream)
            assert (released["event"], json.loads(released["data"])["lease"]) == ("released", second["id"])

        for path in ("events/log", "events"):
            for bad in ("bad id!", "x" * 65, ""):
                resp = bob.get(f"{API}/{path}", params={"lease": bad})
                assert_error(resp, 400, "bad_request", "lease must be", "letters, digits")


# ---- the board's answer against its schema ---------------------------------------------------


def _undeclared(doc: dict[str, Any], schema: dict[str, Any], value: Any, where: str) -> list[str]:
    """Every field of ``value`` that ``schema`` (resolved through its $refs) does not declare."""
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    out: list[str] = []
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, v in value.items():
            if props is not None and key in props:
                out += _undeclared(doc, props[key], v, f"{where}.{key}")
            elif isinstance(extra, dict):
                out += _undeclared(doc, extra, v, f"{where}[{key}]")
            else:
                out.append(f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            out += _undeclared(doc, schema["items"], v, f"{where}[{i}]")
    return out


def test_the_board_answers_only_declared_fields_slices_included(server_factory: Any, redis_sync: Any) -> None:
    """GET /cluster with every kind of GPU the slices added (a sliced GPU with two slices, their
    memory as the node agent measured it, a pool that shares) beside a whole lease:
    every field it answers is declared in the OpenAPI document, all the way down."""
    from lease_server.store.engine import Engine, connect
    from lease_server.store.scripts import MemPeaks

    srv = server_factory(scheduling={"A100-80GB": {"share": True, "slice_unit_mb": 1024}})
    with http(srv, "alice") as alice, http(srv, "root", "admin") as root, http(srv) as anon:
        doc = anon.get(f"{API}/openapi.json").json()
        slices = [
            alice.post(f"{API}/leases", json={"gpus": 1, "gpu_mem_mb": mb, "ttl": 600}).json() for mb in (10240, 20480)
        ]
        gone = alice.post(f"{API}/leases", json={"gpus": 1, "gpu_mem_mb": 4096, "ttl": 600}).json()
        whole = alice.post(f"{API}/leases", json={"gpus": 1, "ttl": 600, "label": "whole"}).json()
        assert all(r.get("gpu_mem_mb") for r in (*slices, gone)), slices
        assert len({(r["node"], r["gpus"][0]["index"]) for r in (*slices, gone)}) == 1  # packed on one GPU

        async def measured() -> None:  # what the node agent's memory watch reports (node/memwatch.py)
            r = connect(srv.settings.redis_url)
            try:
                await Engine(r, srv.settings).run(
                    MemPeaks(json.dumps({slices[0]["id"]: [3000, 4000], whole["id"]: [1, 2]}))
                )
            finally:
                await r.aclose()

        asyncio.run(measured())
        # one slice kept warm (its notebook's next cell): the board says since when
        warm = alice.post(f"{API}/leases/{slices[1]['id']}/warm", json={"token": slices[1]["token"], "warm": True})
        assert warm.status_code == 200, warm.text
        # A revoked slice that named no process frees its memory at once: the board counts it out.
        root.delete(f"{API}/leases/{gone['id']}")
        view = alice.get(f"{API}/cluster").json()
    sliced = [g for n in view["nodes"] for g in n["gpus"] if g["state"] == "sliced"]
    assert len(sliced) == 1 and len(sliced[0]["slices"]) == 2, sliced
    assert sliced[0]["slice_mem"] == {"total_mb": 81920, "used_mb": 30720, "free_mb": 51200}
    mine = {s["lease"]: s for s in sliced[0]["slices"]}
    assert (mine[slices[0]["id"]]["mem_used_mb"], mine[slices[0]["id"]]["mem_peak_mb"]) == (3000, 4000)
    assert "warm_since" in mine[slices[1]["id"]] and "warm_since" not in mine[slices[0]["id"]]
    assert view["pools"]["A100-80GB"]["share"] is True and view["pools"]["A100-80GB"]["slices"] == 2
    assert view["pools"]["A100-80GB"]["unpromised_mb"] == 51200  # what a slice may still take, in the counts
    assert _undeclared(doc, doc["components"]["schemas"]["Cluster"], view, "cluster") == []
    with http(srv) as anon:
        samples = _samples(anon.get("/metrics").text)
    a100 = (("pool", "A100-80GB"),)
    assert samples[("gpulease_slices", a100)] == 2
    assert samples[("gpulease_gpus", (*a100, ("state", "sliced")))] == 1
    assert samples[("gpulease_gpus", (*a100, ("state", "leased")))] == 1
    memory = {
        state: samples[("gpulease_slice_memory_mb", (*a100, ("state", state)))]
        for state in ("leased", "draining", "free")
    }
    assert memory == {"leased": 30720, "draining": 0, "free": 51200}
    assert samples[("gpulease_slices", (("pool", "T4-16GB"),))] == 0
    # ... and the check bites: a field the document does not declare is named.
    sliced[0]["slices"][0]["surprise"] = 1
    missing = _undeclared(doc, doc["components"]["schemas"]["Cluster"], view, "cluster")
    assert len(missing) == 1 and missing[0].endswith("].slices[0].surprise"), missing
