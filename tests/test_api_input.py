"""Bad input to the HTTP API, against a real server and a real Redis.

Every refusal must come with the right 4xx, a JSON ``{"code", "message"}`` body whose message says
what to fix, and no state change at all: every key of the test's prefix (but the event stream) is
dumped before and after and compared, and no lease event may have been logged.

Bodies are sent raw with httpx wherever the Python client would not let us send bad input.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from typing import Any

import httpx
import pytest

from tests.api_helpers import API, Cases, assert_error, event_stream, http, next_event, unchanged

TEN_MB = 10 * 1024 * 1024


@pytest.fixture
def alice_lease(server: Any) -> dict[str, Any]:
    """Alice holds 1 A100 for 10 minutes, so the snapshots cover a live lease too."""
    with http(server, "alice") as c:
        resp = c.post(f"{API}/leases", json={"gpus": 1, "ttl": 600, "label": "held"})
    assert resp.status_code == 201, resp.text
    return resp.json()  # type: ignore[no-any-return]


def _raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


# (id, raw body, status, code, fragments the message must contain)
ACQUIRE_CASES: list[tuple[str, bytes, int, str, tuple[str, ...]]] = [
    ("malformed-json", b'{"gpus": 1', 400, "bad_request", ("not valid JSON", "JSON object")),
    ("not-utf8", b"\xff\xfe\x00", 400, "bad_request", ("not valid JSON",)),
    ("json-array", b'[{"gpus": 1}]', 400, "bad_request", ("must be a JSON object", '"gpus"')),
    ("json-null", b"null", 400, "bad_request", ("must be a JSON object",)),
    # What json.loads raises besides JSONDecodeError: a 400, not a 500 with a traceback in the log
    ("json-deep", b"[" * 30_000, 400, "bad_request", ("nested too deeply", "flat JSON object")),
    ("json-long-int", b'{"gpus": ' + b"9" * 5_000 + b"}", 400, "bad_request", ("number too long",)),
    # JSON's escape of half a UTF-16 pair: no UTF-8 (Redis) can carry it (it was a 500)
    ("lone-surrogate", b'{"gpus": 1, "label": "a\\ud800b"}', 400, "bad_request", ("lone UTF-16 surrogate", "\\ud800")),
    ("lone-surrogate-key", b'{"gpus": 1, "\\udfff": 1}', 400, "bad_request", ("lone UTF-16 surrogate",)),
    # and one encoded as such (no UTF-8), or a body in UTF-16, which json.loads alone would take
    ("encoded-surrogate", b'{"gpus": 1, "label": "a\xed\xa0\x80"}', 400, "bad_request", ("not valid JSON",)),
    ("utf-16-body", '{"gpus": 1}'.encode("utf-16"), 400, "bad_request", ("not valid JSON",)),
    ("gpus-zero", _raw({"gpus": 0}), 400, "bad_request", ("gpus", "at least 1")),
    ("gpus-negative", _raw({"gpus": -1}), 400, "bad_request", ("gpus", "at least 1")),
    ("gpus-string", _raw({"gpus": "two"}), 400, "bad_request", ("gpus", "whole number", "two")),
    ("gpus-fraction", _raw({"gpus": 1.5}), 400, "bad_request", ("gpus", "whole number", "1.5")),
    ("gpus-bool", _raw({"gpus": True}), 400, "bad_request", ("gpus", "whole number")),
    ("gpus-null", _raw({"gpus": None}), 400, "bad_request", ("gpus", "whole number")),
    ("gpus-nan", b'{"gpus": NaN}', 400, "bad_request", ("gpus", "whole number")),
    ("gpus-huge", _raw({"gpus": 10**9}), 400, "bad_request", ("gpus", "at most 1024")),
    ("gpus-missing", _raw({"pool": "A100-80GB"}), 400, "bad_request", ("gpus is required",)),
    ("empty-body", b"", 400, "bad_request", ("gpus is required",)),
    (
        "unknown-field",
        _raw({"gpus": 1, "gpu_count": 2}),
        400,
        "bad_request",
        ("unknown field", "gpu_count", "allowed", "gpus, gpus_min, nodes, pool, ttl, wait, label, session"),
    ),
    (
        "unknown-pool",
        _raw({"gpus": 1, "pool": "H100-80GB"}),
        404,
        "unknown_pool",
        ("H100-80GB", "known pools", "A100-80GB", "T4-16GB"),
    ),
    (
        "pool-bad-chars",
        _raw({"gpus": 1, "pool": "A100 80GB;rm"}),
        400,
        "bad_request",
        ("pool must be a name", "letters, digits"),
    ),
    ("pool-not-string", _raw({"gpus": 1, "pool": 7}), 400, "bad_request", ("pool must be a name",)),
    ("ttl-negative", _raw({"gpus": 1, "ttl": -5}), 400, "bad_request", ("ttl", "between 1 and 3600")),
    ("ttl-zero", _raw({"gpus": 1, "ttl": 0}), 400, "bad_request", ("ttl", "between 1 and 3600")),
    ("ttl-string", _raw({"gpus": 1, "ttl": "x"}), 400, "bad_request", ("ttl", "number of seconds")),
    ("ttl-above-max", _raw({"gpus": 1, "ttl": 3601}), 400, "bad_request", ("ttl", "between 1 and 3600")),
    ("ttl-infinite", b'{"gpus": 1, "ttl": Infinity}', 400, "bad_request", ("ttl",)),
    ("wait-negative", _raw({"gpus": 1, "wait": -1}), 400, "bad_request", ("wait", "between 0 and 3600")),
    ("wait-string", _raw({"gpus": 1, "wait": "soon"}), 400, "bad_request", ("wait", "number of seconds")),
    ("wait-above-max", _raw({"gpus": 1, "wait": 10**6}), 400, "bad_request", ("wait", "between 0 and 3600")),
    ("label-too-long", _raw({"gpus": 1, "label": "x" * 201}), 400, "bad_request", ("label", "at most 200 characters")),
    ("label-not-string", _raw({"gpus": 1, "label": ["a"]}), 400, "bad_request", ("label", "string")),
    (
        "session-too-long",
        _raw({"gpus": 1, "session": "s" * 201}),
        400,
        "bad_request",
        ("session", "at most 200 characters"),
    ),
    ("id-too-short", _raw({"gpus": 1, "id": "abc"}), 400, "bad_request", ("id must be 8 to 64",)),
    ("id-bad-chars", _raw({"gpus": 1, "id": "l-0123456789/x"}), 400, "bad_request", ("id must be 8 to 64",)),
    ("id-not-string", _raw({"gpus": 1, "id": 123456789}), 400, "bad_request", ("id must be 8 to 64",)),
    (
        "body-10MB",
        b'{"gpus": 1, "label": "' + b"x" * TEN_MB + b'"}',
        413,
        "payload_too_large",
        ("larger than 65536 bytes", "small JSON object"),
    ),
    ("more-than-largest-node", _raw({"gpus": 5}), 422, "unsatisfiable", ("A100-80GB", "largest has 4", "at most 4")),
    (
        "more-than-largest-node-waiting",
        _raw({"gpus": 3, "pool": "T4-16GB", "wait": 30}),
        422,
        "unsatisfiable",
        ("T4-16GB", "largest has 2"),
    ),
]


def test_bad_acquire_is_refused_without_state_change(server: Any, redis_sync: Any, alice_lease: dict[str, Any]) -> None:
    """Every case of ACQUIRE_CASES: the right 4xx and message, and no state change."""
    cases = Cases()
    with http(server, "alice") as c:
        for name, body, status, code, fragments in ACQUIRE_CASES:
            with cases.case(name), unchanged(redis_sync, server.settings.prefix):
                resp = c.post(f"{API}/leases", content=body, headers={"Content-Type": "application/json"})
                assert_error(resp, status, code, *fragments)
        # a whole pair, escaped, is one character and fine
        pair = c.post(f"{API}/leases", content=b'{"gpus": 1, "label": "ok \\ud83d\\ude00"}')
        assert pair.status_code == 201 and pair.json()["label"] == "ok \U0001f600", pair.text
    cases.check()


def test_chunked_body_over_the_limit_is_413(server: Any, redis_sync: Any, alice_lease: dict[str, Any]) -> None:
    """No Content-Length (chunked upload): the limit is still enforced on the body read."""

    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"gpus": 1, "label": "'
        for _ in range(10):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    with http(server, "alice") as c, unchanged(redis_sync, server.settings.prefix):
        resp = c.post(f"{API}/leases", content=chunks(), headers={"Content-Type": "application/json"})
        assert_error(resp, 413, "payload_too_large", "larger than 65536 bytes")


def _fill_a100_but_one(server: Any) -> None:
    """Pool A100-80GB: n1 has 4, n2 has 2. Alice takes 4 (n1) and 1 (n2): 1 is free, 2 cannot be had."""
    with http(server, "alice") as c:
        for n in (4, 1):
            assert c.post(f"{API}/leases", json={"gpus": n, "ttl": 600}).status_code == 201


def test_no_capacity_says_how_many_are_free(server: Any, redis_sync: Any) -> None:
    _fill_a100_but_one(server)
    with http(server, "bob") as b:
        resp = b.post(f"{API}/leases", json={"gpus": 2, "wait": 0})
        body = assert_error(resp, 409, "no_capacity", "A100-80GB", "has 2 free", "pass wait")
        # It says how many there are: 1 (which is both the pool's free count and the most on a node).
        assert re.search(r"\b1\b", body["message"]) and "free" in body["message"], body["message"]
        details = body.get("details", {})
        assert details.get("free", details.get("most_free_on_a_node")) == 1, details
        # Omitting wait means wait=0 too.
        assert_error(b.post(f"{API}/leases", json={"gpus": 2}), 409, "no_capacity", "has 2 free")
        # Nothing left behind in the queue, nothing logged.
        assert b.get(f"{API}/queue").json() == {"waiting": []}
        log = b.get(f"{API}/events/log", params={"limit": "10000"}).json()["events"]
        assert not [e for e in log if e.get("user") == "bob"]


def test_no_capacity_changes_no_state(server: Any, redis_sync: Any) -> None:
    _fill_a100_but_one(server)
    with http(server, "bob") as b, unchanged(redis_sync, server.settings.prefix):
        assert_error(b.post(f"{API}/leases", json={"gpus": 2, "wait": 0}), 409, "no_capacity")


def test_unknown_lease_id_is_404_everywhere(server: Any, redis_sync: Any, alice_lease: dict[str, Any]) -> None:
    with (
        http(server, "alice") as c,
        http(server, "root", "admin") as admin,
        unchanged(redis_sync, server.settings.prefix),
    ):
        for resp in (
            c.get(f"{API}/leases/l-doesnotexist"),
            c.delete(f"{API}/leases/l-doesnotexist"),
            c.post(f"{API}/leases/l-doesnotexist/renew", json={"token": alice_lease["token"]}),
            admin.post(f"{API}/leases/l-doesnotexist/revoke", json={}),
            admin.delete(f"{API}/leases/l-doesnotexist"),
        ):
            assert_error(resp, 404, "no_such_lease", "l-doesnotexist", "GET /api/v1/leases")


def test_renew_with_a_stale_token_is_409(server: Any, redis_sync: Any, alice_lease: dict[str, Any]) -> None:
    lid, token = alice_lease["id"], alice_lease["token"]
    with http(server, "alice") as c, unchanged(redis_sync, server.settings.prefix):
        for stale in (token - 1, token + 1, str(token + 100)):
            resp = c.post(f"{API}/leases/{lid}/renew", json={"token": stale})
            assert_error(resp, 409, "stale_token", lid, "not its current fencing token", "acquire a new lease")
        # The same for a release with the wrong token: the lease stays.
        resp = c.delete(f"{API}/leases/{lid}", params={"token": token + 1})
        assert_error(resp, 409, "stale_token", lid)
        resp = c.request("DELETE", f"{API}/leases/{lid}", json={"token": token + 1})
        assert_error(resp, 409, "stale_token", lid)


def test_renew_without_or_with_a_malformed_token_is_400(
    server: Any, redis_sync: Any, alice_lease: dict[str, Any]
) -> None:
    lid, token = alice_lease["id"], alice_lease["token"]
    with http(server, "alice") as c, unchanged(redis_sync, server.settings.prefix):
        assert_error(c.post(f"{API}/leases/{lid}/renew", json={}), 400, "bad_request", "token is required")
        assert_error(c.post(f"{API}/leases/{lid}/renew"), 400, "bad_request", "token is required")
        for bad in ("abc", -1, 1.5, True, [token]):
            resp = c.post(f"{API}/leases/{lid}/renew", json={"token": bad})
            assert_error(resp, 400, "bad_request", "token must be the integer fencing token")
        resp = c.post(f"{API}/leases/{lid}/renew", json={"token": token, "ttl": 10**6})
        assert_error(resp, 400, "bad_request", "ttl", "between 1 and 3600")
        resp = c.post(f"{API}/leases/{lid}/renew", content=b"{oops", headers={"Content-Type": "application/json"})
        assert_error(resp, 400, "bad_request", "not valid JSON")
        resp = c.delete(f"{API}/leases/{lid}", params={"token": "abc"})
        assert_error(resp, 400, "bad_request", "token must be the integer fencing token")
        # A token of thousands of digits (past Python's int limit) is refused as one, and shown cut.
        for bad in ("9" * 5_000, 10**19):
            resp = c.post(f"{API}/leases/{lid}/renew", json={"token": bad})
            assert_error(resp, 400, "bad_request", "token must be the integer fencing token")
            assert len(resp.json()["message"]) < 200
        resp = c.delete(f"{API}/leases/{lid}", params={"token": "9" * 5_000})
        assert_error(resp, 400, "bad_request", "token must be the integer fencing token")
        assert len(resp.json()["message"]) < 200
        resp = c.request("DELETE", f"{API}/leases/{lid}", json={"token": "9" * 5_000})
        assert_error(resp, 400, "bad_request", "token must be the integer fencing token")


def test_renew_or_release_of_someone_elses_lease_is_403(
    server: Any, redis_sync: Any, alice_lease: dict[str, Any]
) -> None:
    lid, token = alice_lease["id"], alice_lease["token"]
    with http(server, "bob") as bob, unchanged(redis_sync, server.settings.prefix):
        # Even with the right fencing token, bob may not touch alice's lease.
        resp = bob.post(f"{API}/leases/{lid}/renew", json={"token": token})
        assert_error(resp, 403, "not_owner", lid, "belongs to another user")
        assert_error(bob.delete(f"{API}/leases/{lid}"), 403, "not_owner", lid, "belongs to another user")
        resp = bob.delete(f"{API}/leases/{lid}", params={"token": token})
        assert_error(resp, 403, "not_owner", lid)
    with http(server, "alice") as c:  # and alice's lease is untouched
        got = c.get(f"{API}/leases/{lid}").json()
        assert got["state"] == "active" and got["renewals"] == 0


def test_revoke_by_a_non_admin_is_403(server: Any, redis_sync: Any, alice_lease: dict[str, Any]) -> None:
    lid = alice_lease["id"]
    with (
        http(server, "bob") as bob,
        http(server, "alice") as alice,
        http(server, "agent1", "agent") as agent,
        unchanged(redis_sync, server.settings.prefix),
    ):
        for who in (bob, alice, agent):  # not even the owner, nor an agent
            resp = who.post(f"{API}/leases/{lid}/revoke", json={"reason": "mine now"})
            assert_error(resp, 403, "forbidden", "only an admin can revoke", "DELETE")


def test_unknown_route_is_a_json_404(server: Any, redis_sync: Any) -> None:
    with http(server, "alice") as c, http(server) as anon, unchanged(redis_sync, server.settings.prefix):
        for client, method, path in (
            (c, "GET", "/api/v1/lease"),
            (c, "POST", "/api/v2/leases"),
            (anon, "GET", "/nope"),
            (anon, "DELETE", "/api/v1/leases/a/b/c"),
            (c, "GET", "/api/v1/leases/has%20space"),
        ):
            resp = client.request(method, path)
            assert_error(resp, 404, "not_found", f"no such endpoint {method}", "/api/v1/openapi.json")


def test_unsupported_method_is_a_json_405_that_says_what_to_use(server: Any, redis_sync: Any) -> None:
    with http(server, "alice") as c, unchanged(redis_sync, server.settings.prefix):
        resp = c.patch(f"{API}/leases", json={"gpus": 1})
        assert resp.status_code == 405
        body = resp.json()
        assert set(body) >= {"code", "message"}
        # Must name the methods that work (or at least point to the API description).
        msg = body["message"]
        assert "GET" in msg and "POST" in msg or "openapi.json" in msg, msg


EVENT_LOG_CASES: list[tuple[str, dict[str, str], tuple[str, ...]]] = [
    ("limit-not-int", {"limit": "x"}, ("limit", "integer between 1 and 10000")),
    ("limit-zero", {"limit": "0"}, ("limit", "between 1 and 10000")),
    ("limit-negative", {"limit": "-3"}, ("limit", "between 1 and 10000")),
    ("limit-too-big", {"limit": "10001"}, ("limit", "between 1 and 10000")),
    ("limit-fraction", {"limit": "1.5"}, ("limit", "integer")),
    ("since-garbage", {"since": "garbage"}, ("since", "event id like", "garbage")),
    ("since-three-parts", {"since": "1-2-3"}, ("since", "event id like")),
    ("since-plus", {"since": "+"}, ("since", "event id like")),
    ("since-negative", {"since": "-1"}, ("since", "event id like")),
    ("before-garbage", {"before": "yesterday"}, ("before", "event id like", "yesterday")),
    ("order-sideways", {"order": "sideways"}, ("order", "sideways")),
    ("type-misspelt", {"type": "grant,relesed"}, ("type", "relesed", "did you mean released")),
    ("type-empty", {"type": ","}, ("type", "an empty name", "comma-separated")),
    ("type-spaced", {"type": "grant, released"}, ("type", "' released'", "did you mean released")),
    ("user-not-a-name", {"user": "alice smith"}, ("user", "letters, digits")),
]


def test_bad_event_log_query_is_400(server: Any, redis_sync: Any) -> None:
    cases = Cases()
    with http(server, "alice") as c:
        for name, params, fragments in EVENT_LOG_CASES:
            with cases.case(name), unchanged(redis_sync, server.settings.prefix):
                assert_error(c.get(f"{API}/events/log", params=params), 400, "bad_request", *fragments)
    cases.check()


def test_event_log_since_the_largest_id_is_400(server: Any, redis_sync: Any) -> None:
    with http(server, "alice") as c, unchanged(redis_sync, server.settings.prefix):
        resp = c.get(f"{API}/events/log", params={"since": "18446744073709551615-18446744073709551615"})
        assert_error(resp, 400, "bad_request", "since")


def test_good_event_log_query_is_200(server: Any, alice_lease: dict[str, Any]) -> None:
    """The counterpart of the 400s: valid since/limit values work and page through the log."""
    with http(server, "alice") as c:
        everything = c.get(f"{API}/events/log", params={"limit": "10000"}).json()["events"]
        grants = [e for e in everything if e["type"] == "grant"]
        assert [g["lease"] for g in grants] == [alice_lease["id"]]
        first = c.get(f"{API}/events/log", params={"limit": "1"}).json()["events"]
        assert first == everything[:1]
        rest = c.get(f"{API}/events/log", params={"since": first[0]["id"], "limit": "10000"}).json()["events"]
        assert rest == everything[1:]


def test_event_log_reads_newest_first_and_filters_on_the_server(server: Any) -> None:
    """order=desc with before= pages back from the newest; type, user and lease filters pass only
    matching entries, and limit counts those."""
    alice, bob = server.client("alice"), server.client("bob")
    for who in (alice, bob, alice):
        who.release(who.acquire(1))
    with http(server, "alice") as c:

        def log(**params: Any) -> list[dict[str, Any]]:
            resp = c.get(f"{API}/events/log", params={"limit": "10000", **params})
            assert resp.status_code == 200, resp.text
            return resp.json()["events"]  # type: ignore[no-any-return]

        everything = log()
        assert log(order="desc") == everything[::-1]
        assert log(order="desc", limit="2") == everything[:-3:-1]
        assert log(order="desc", before=everything[-2]["id"], limit="2") == everything[-3:-5:-1]
        assert log(order="desc", since=everything[-3]["id"]) == everything[:-3:-1]  # down to since
        assert log(before=everything[2]["id"]) == everything[:2]
        grants = [e for e in everything if e["type"] == "grant"]
        assert [e["user"] for e in grants] == ["alice", "bob", "alice"]
        assert log(type="grant") == grants
        assert log(type="grant,released", user="bob") == [e for e in everything if e.get("user") == "bob"]
        assert log(type="grant", order="desc", limit="1") == grants[-1:]
        assert log(lease=grants[1]["lease"], order="desc") == [
            e for e in everything[::-1] if e.get("lease") == grants[1]["lease"]
        ]


def _check_bad_since_refused(server: Any, ids: list[str]) -> None:
    """Each id, as ?since= or Last-Event-ID on the stream and as ?since= on the log: a 400."""
    cases = Cases()
    with http(server, "alice") as c:
        for since in ids:
            for how, kwargs in (
                ("?since=", {"params": {"since": since}}),
                ("Last-Event-ID: ", {"headers": {"Last-Event-ID": since}}),
            ):
                with cases.case(how + since), c.stream("GET", f"{API}/events", **kwargs) as resp:  # type: ignore[arg-type]
                    if resp.status_code == 200:
                        # Read on until the server gives up on the stream, so that it is done with
                        # this request (and its error log) before the test goes on.
                        with contextlib.suppress(httpx.HTTPError):
                            for _chunk in resp.iter_raw():
                                pass
                        raise AssertionError("accepted with 200, and then the stream broke")
                    resp.read()
                    assert_error(resp, 400, "bad_request", "since")
            with cases.case(f"events/log?since={since}"):
                assert_error(c.get(f"{API}/events/log", params={"since": since}), 400, "bad_request", "since")
    cases.check()


def test_event_stream_with_a_malformed_since_is_400_not_a_broken_stream(server: Any) -> None:
    """A bad Last-Event-ID or ?since= must be refused before the stream starts: answering 200 and
    then dropping the connection makes an EventSource reconnect with the same id forever."""
    _check_bad_since_refused(server, ["garbage", "1-2-3", "+", "-1"])


def test_event_stream_with_an_out_of_range_since_is_400_not_a_broken_stream(server: Any) -> None:
    """Ids that look right but that Redis rejects."""
    _check_bad_since_refused(server, ["18446744073709551615-18446744073709551615", "99999999999999999999-0"])


def test_bad_queue_filter_is_400(server: Any, redis_sync: Any) -> None:
    with http(server, "alice") as c, unchanged(redis_sync, server.settings.prefix):
        assert_error(c.get(f"{API}/queue", params={"pool": "a b"}), 400, "bad_request", "pool must be a name")


def test_bad_token_creation_input_is_400(server: Any, redis_sync: Any) -> None:
    with http(server, "root", "admin") as admin, unchanged(redis_sync, server.settings.prefix):
        assert_error(admin.post(f"{API}/tokens", json={}), 400, "bad_request", "user must be a name")
        assert_error(admin.post(f"{API}/tokens", json={"user": "a b"}), 400, "bad_request", "user must be a name")
        assert_error(
            admin.post(f"{API}/tokens", json={"user": "carol", "role": "root"}),
            400,
            "bad_request",
            "role must be one of user, admin, agent",
        )
        assert_error(admin.post(f"{API}/tokens", json=["carol"]), 400, "bad_request", "JSON object")


def test_token_for_a_non_string_user_is_400(server: Any, redis_sync: Any) -> None:
    cases = Cases()
    with http(server, "root", "admin") as admin:
        for user in (5, None, ["carol"], {"name": "carol"}):
            with cases.case(repr(user)), unchanged(redis_sync, server.settings.prefix):
                resp = admin.post(f"{API}/tokens", json={"user": user})
                assert_error(resp, 400, "bad_request", "user must be a name")
    cases.check()


def test_bad_node_inventory_is_400(server: Any, redis_sync: Any) -> None:
    good_gpu = {"index": 0, "uuid": "GPU-x", "model": "L4", "memory_mb": 24576}
    with http(server, "agent1", "agent") as agent:  # x1's agent (its token serves x1 from now on)
        assert agent.put(f"{API}/nodes/x1", json={"pool": "L4-24GB", "gpus": [good_gpu]}).status_code == 200
    with http(server, "agent1", "agent") as agent, unchanged(redis_sync, server.settings.prefix):
        for node, body, fragment in (
            ("x1", {"gpus": [good_gpu]}, "pool must be a name"),
            ("x1", {"pool": "L4-24GB", "gpus": []}, "gpus must be a list of 1"),
            ("x1", {"pool": "L4-24GB", "gpus": [good_gpu, good_gpu]}, "distinct integer"),
            ("x1", {"pool": "L4-24GB", "gpus": [{**good_gpu, "memory_mb": -1}]}, "memory_mb"),
            ("x1", {"pool": "L4-24GB", "gpus": [good_gpu], "source": "magic"}, "source"),
            ("-x1", {"pool": "L4-24GB", "gpus": [good_gpu]}, "node must be a name"),
        ):
            assert_error(agent.put(f"{API}/nodes/{node}", json=body), 400, "bad_request", fragment)
    # (an agent token serves one node: an admin's heartbeat of a node nobody declared)
    with http(server, "root", "admin") as admin, unchanged(redis_sync, server.settings.prefix):
        resp = admin.post(f"{API}/nodes/ghost/heartbeat")
        assert_error(resp, 404, "unknown_node", "ghost", "send its inventory first")


def _post_and_hang_up(server: Any, token: str, body: dict[str, Any]) -> bytes:
    """POST /api/v1/leases on a raw socket, close our side at once, read until the server closes."""
    host, port = server.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /api/v1/leases HTTP/1.1\r\nHost: gpulease\r\nAuthorization: Bearer "
            + token.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(raw)).encode()
            + b"\r\n\r\n"
            + raw
        )
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def test_someone_elses_request_id_is_refused_without_state_change(server: Any, redis_sync: Any) -> None:
    """Reusing another user's lease id, live or queued, as a request id is a 409 and changes nothing."""
    with http(server, "alice") as alice, http(server, "eve") as eve:
        held = alice.post(f"{API}/leases", json={"gpus": 4, "ttl": 600, "id": "alice-req-0001"}).json()
        assert held["id"] == "alice-req-0001"
        with unchanged(redis_sync, server.settings.prefix):
            resp = eve.post(f"{API}/leases", json={"gpus": 1, "id": "alice-req-0001"})
            assert_error(resp, 409, "conflict", "alice-req-0001", "already in use", "new id")
        assert "token" not in eve.get(f"{API}/leases/alice-req-0001").json()


def test_another_user_cannot_cancel_my_queued_request_by_its_id(server: Any, redis_sync: Any) -> None:
    """Bob waits in the queue (his request id is public: GET /queue lists it). Eve POSTs with that
    id and hangs up. Bob must still be served when GPUs free up."""
    bob_id = "bob-request-0001"
    with http(server, "alice") as alice, http(server, "bob") as bob, http(server, "eve") as eve:
        full = [alice.post(f"{API}/leases", json={"gpus": n, "ttl": 600}).json() for n in (4, 2)]
        outcome: dict[str, Any] = {}

        def bob_waits() -> None:
            try:
                outcome["resp"] = bob.post(
                    f"{API}/leases", timeout=30, json={"gpus": 1, "ttl": 600, "wait": 4, "id": bob_id}
                )
            except Exception as exc:  # reported by the main thread
                outcome["error"] = exc

        waiter = threading.Thread(target=bob_waits, name="bob-waits", daemon=True)
        try:
            with event_stream(server, "watcher") as events:
                waiter.start()
                next_event(events, "queued", bob_id)  # bob is in the queue now
            assert [w["id"] for w in eve.get(f"{API}/queue").json()["waiting"]] == [bob_id]

            eve.get(f"{API}/whoami")  # eve's token is known to the server (as for any real client)
            # Whether the server notices the hang-up while the request is in flight is a race of
            # microseconds; each try is an independent chance, so try a number of times.
            for _ in range(20):
                _post_and_hang_up(server, server.token("eve"), {"gpus": 1, "id": bob_id})
            assert [w["id"] for w in eve.get(f"{API}/queue").json()["waiting"]] == [bob_id]
        finally:
            alice.delete(f"{API}/leases/{full[1]['id']}")  # 2 GPUs free up: bob's turn
            if waiter.is_alive() or waiter.ident is not None:
                waiter.join(20)
        assert not waiter.is_alive()
        assert "error" not in outcome, outcome
        resp = outcome["resp"]
        assert resp.status_code == 201, resp.text
        assert resp.json()["id"] == bob_id and resp.json()["user"] == "bob"
        log = eve.get(f"{API}/events/log", params={"limit": "10000"}).json()["events"]
        assert not [e for e in log if e["type"].startswith("wait_") and e["lease"] == bob_id]


def test_reusing_a_queued_request_id_does_not_delay_its_grant(server: Any, redis_sync: Any) -> None:
    """Eve's refused request (409) reusing Bob's queued id must not unhook Bob's wake-up: when the
    GPUs free up, the grant reaches Bob's waiting request at once (the server's safety-net poll
    would take 5 s; the bounded wait below is 3 s)."""
    bob_id = "bob-request-0002"
    with http(server, "alice") as alice, http(server, "bob") as bob, http(server, "eve") as eve:
        full = [alice.post(f"{API}/leases", json={"gpus": n, "ttl": 600}).json() for n in (4, 2)]
        outcome: dict[str, Any] = {}
        answered = threading.Event()

        def bob_waits() -> None:
            try:
                outcome["resp"] = bob.post(
                    f"{API}/leases", timeout=60, json={"gpus": 1, "ttl": 600, "wait": 30, "id": bob_id}
                )
            except Exception as exc:  # reported by the main thread
                outcome["error"] = exc
            finally:
                answered.set()

        waiter = threading.Thread(target=bob_waits, name="bob-waits", daemon=True)
        try:
            with event_stream(server, "watcher") as events:
                waiter.start()
                next_event(events, "queued", bob_id)
                resp = eve.post(f"{API}/leases", json={"gpus": 1, "wait": 10, "id": bob_id})
                assert_error(resp, 409, "conflict", bob_id, "already in use")
                alice.delete(f"{API}/leases/{full[1]['id']}")
                next_event(events, "grant", bob_id)  # granted in Redis
            assert answered.wait(20), "the grant did not wake bob's waiting request"
        finally:
            answered.wait(30)
        assert "error" not in outcome, outcome
        assert outcome["resp"].status_code == 201 and outcome["resp"].json()["id"] == bob_id
