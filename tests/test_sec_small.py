"""Issue 33 finding 10, the small ones, each tried as a hostile colleague would on a real in-process
lease server and a real Redis, and asserted to fail:

* a label, name or note holding control or bidi characters is refused with a 400 naming the field and
  the code point; one stored before that (an old entry) reaches an admin's terminal escaped, never raw;
* ``gpulease migrate`` on a corrupted store names the bad entry in one line and changes nothing, in
  its dry run and its real run alike; the dry run reads what the real run will; a rerun after the fix
  works;
* no fencing token of another user's lease in the event log or stream;
* every body the OpenAPI document calls invalid is refused (the schemathesis find: a body of
  whitespace taken by ``PUT /policy/{pool}`` as an empty one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from redis import Redis

from lease_server.cli import main
from lease_server.store.keys import Keys
from lease_server.store.layout import LAYOUT
from tests.conftest import ServerHandle

API = "/api/v1"
ESC = "\x1b]0;owned\x07\x1b[2J"  # set the terminal's title, clear the screen
RLO = "\u202e"  # right-to-left override: "exe.txt" reads as "txt.exe"
RAW = ("\x1b", "\x07", "\u202e", "\u2066")


def _call(srv: ServerHandle, who: str, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    role = "admin" if who == "root" else "user"
    headers = {"Authorization": f"Bearer {srv.token(who, role)}"}
    return httpx.request(method, f"{srv.url}{API}{path}", json=body, headers=headers, timeout=10, **kw)


def _refused(r: httpx.Response, field: str, code: str) -> None:
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert field in message and code in message, message


# ---- control and bidi characters --------------------------------------------------------------------


def test_control_and_bidi_characters_are_refused_in_every_label_and_name(server: ServerHandle) -> None:
    srv = server
    lease = _call(srv, "alice", "POST", "/leases", {"gpus": 1, "label": "ok"}).json()
    tok = lease["token"]
    day = 1_900_000_000
    tries: list[tuple[str, str, str, Any, str, dict[str, Any]]] = [
        ("alice", "POST", "/leases", {"gpus": 1, "label": f"train {ESC}"}, "label", {}),
        ("alice", "POST", "/leases", {"gpus": 1, "session": f"k{RLO}"}, "session", {}),
        ("alice", "POST", "/leases", {"gpus": 1, "notebook": "a\u2066b.ipynb"}, "notebook", {}),
        ("alice", "POST", "/leases", {"gpus": 1, "cell": "4\x85"}, "cell", {}),
        ("alice", "POST", "/leases", {"gpus": 1, "pool": "A100\x1b"}, "pool", {}),
        (
            "alice",
            "POST",
            f"/leases/{lease['id']}/renew",
            {"token": tok, "activity": {"source": "\x9b2J"}},
            "source",
            {},
        ),
        ("alice", "DELETE", f"/leases/{lease['id']}", {"token": tok, "reason": f"done{RLO}"}, "reason", {}),
        ("alice", "DELETE", f"/leases/{lease['id']}", None, "reason", {"params": {"reason": "x\x7f"}}),
        ("root", "POST", f"/leases/{lease['id']}/revoke", {"reason": f"\x1b[31m{RLO}"}, "reason", {}),
        (
            "alice",
            "POST",
            "/bookings",
            {"pool": "A100-80GB", "gpus": 1, "start": day, "end": day + 3600, "note": f"standup {ESC}"},
            "note",
            {},
        ),
        ("root", "PUT", "/policy/A100-80GB", {"exempt_users": ["bob\x00"]}, "exempt_users", {}),
        ("root", "POST", "/tokens", {"user": f"eve{RLO}"}, "user", {}),
        ("root", "PUT", "/nodes/n9", {"pool": "p\x1b", "gpus": [{"index": 0}]}, "pool", {}),
        ("root", "PUT", "/nodes/n9", {"pool": "p", "gpus": [{"index": 0, "model": f"A100{ESC}"}]}, "model", {}),
        (
            "root",
            "POST",
            "/nodes/n1/samples",
            {"gpus": [{"index": 0}], "killed": [{"index": 0, "pid": 9, "signal": "SIGTERM", "user": f"u{RLO}"}]},
            "user",
            {},
        ),
    ]
    for who, method, path, body, field, kw in tries:
        r = _call(srv, who, method, path, body, **kw)
        code = next(f"U+{ord(c):04X}" for c in _strings(body or kw) if _unsafe(c))
        _refused(r, field, code)
    # Nothing of the above was stored: the lease lives on, with its label.
    assert _call(srv, "alice", "GET", f"/leases/{lease['id']}").json()["state"] == "active"
    # A name of the route's shape only ever reaches a handler (a path of another shape: 404).
    assert _call(srv, "root", "PUT", "/nodes/n%1B9", {"pool": "p", "gpus": [{"index": 0}]}).status_code == 404


def _strings(value: Any) -> str:
    if isinstance(value, dict):
        return "".join(_strings(v) for v in value.values())
    if isinstance(value, list):
        return "".join(_strings(v) for v in value)
    return value if isinstance(value, str) else ""


def _unsafe(c: str) -> bool:
    o = ord(c)
    return o < 0x20 or 0x7F <= o <= 0x9F or 0x2028 <= o <= 0x202E or 0x2066 <= o <= 0x2069


def test_an_old_entry_reaches_the_terminal_escaped(
    server: ServerHandle, redis_sync: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A label and a name stored before they were refused: gpulease status, leases and events print
    them escaped."""
    from lease_server.cli import _common

    # The CLI's console took its width when this process imported it (COLUMNS then, else 80): as a
    # new `gpulease` process would, it reads the COLUMNS given below instead.
    monkeypatch.setattr(_common.console, "_width", None)
    srv = server
    keys = Keys(srv.settings.prefix)
    lease = _call(srv, "alice", "POST", "/leases", {"gpus": 1, "label": "plain"}).json()
    bad_label = f"{ESC}loss{RLO}gnp.exe"
    rec = json.loads(str(redis_sync.hget(keys.leases, lease["id"])))
    rec["label"] = bad_label
    redis_sync.hset(keys.leases, lease["id"], json.dumps(rec))
    event = {
        "ts": 1_800_000_000_000,
        "user": f"mallory{ESC}",
        "lease": lease["id"],
        "pool": "A100-80GB",
        "gpus": [0],
        "node": "n1",
        "label": bad_label,
    }
    redis_sync.xadd(keys.events, {"type": "grant", "data": json.dumps(event)})
    cli = CliRunner()
    args = ["--url", srv.url, "--token", srv.token("root", "admin")]
    for command in (["status"], ["status", "--wide"], ["leases", "--all"], ["events", "-n", "5"]):
        out = cli.invoke(main, [*command, *args], env={"COLUMNS": "300"})
        assert out.exit_code == 0, out.output
        assert not any(c in out.output for c in RAW), f"gpulease {' '.join(command)}: {out.output!r}"
        assert "\\x1b" in out.output and "\\u202e" in out.output, f"gpulease {' '.join(command)}: {out.output}"


# ---- gpulease migrate -------------------------------------------------------------------------------


def _snapshot(r: Redis, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pattern in (f"{prefix}:*", f"{{{prefix}}}:*"):
        for key in r.scan_iter(pattern):
            kind = r.type(key)
            out[key] = (kind, r.get(key) if kind == "string" else r.hgetall(key) if kind == "hash" else None)
    return out


def test_migrate_names_a_bad_entry_changes_nothing_and_reruns(redis_sync: Redis, prefix: str, tmp_path: Path) -> None:
    r, keys = redis_sync, Keys(prefix)
    # A layout-0 store from before keys carried the hash tag, with one queued request corrupted.
    lease = {"id": "l-1", "user": "alice", "pool": "A100-80GB", "node": "box", "created_at": 1, "gpus": [{"index": 0}]}
    r.hset(f"{prefix}:leases", "l-1", json.dumps(lease))
    r.set(f"{prefix}:fence", "17")
    r.hset(f"{prefix}:waiters", mapping={"w-ok": json.dumps({"user": "bob"}), "w-bad": '{"user": "carol"'})
    config = tmp_path / "gpulease.toml"
    config.write_text(f'[server]\nprefix = "{prefix}"\n')
    cli = CliRunner()
    url = str(r.connection_pool.connection_kwargs.get("host", "127.0.0.1"))
    url = f"redis://{url}:{r.connection_pool.connection_kwargs['port']}"

    def migrate(*extra: str) -> Any:
        return cli.invoke(main, ["migrate", "--redis-url", url, "--config", str(config), *extra])

    before = _snapshot(r, prefix)
    for extra in (("--dry-run",), ()):  # the dry run finds what the real run would stop at
        out = migrate(*extra)
        said = " ".join(out.output.split())
        assert out.exit_code == 1 and "Traceback" not in out.output, out.output
        assert f"{prefix}:waiters field 'w-bad' is not JSON" in said and "nothing was changed" in said, said
        assert _snapshot(r, prefix) == before

    for corrupt, expect in (
        (lambda: r.set(f"{prefix}:fence", "seventeen"), f"{prefix}:fence holds 'seventeen'"),
        (lambda: (r.delete(f"{prefix}:fence"), r.rpush(f"{prefix}:fence", "17")), f"{prefix}:fence is a list"),
        (lambda: r.set(keys.layout, "one"), f"{keys.layout} holds 'one'"),
    ):
        r.hset(f"{prefix}:waiters", "w-bad", json.dumps({"user": "carol"}))
        corrupt()
        snap = _snapshot(r, prefix)
        out = migrate()
        assert out.exit_code == 1 and expect in " ".join(out.output.split()), out.output
        assert _snapshot(r, prefix) == snap
        r.delete(f"{prefix}:fence", keys.layout)
        r.set(f"{prefix}:fence", "17")

    before = _snapshot(r, prefix)
    dry = migrate("--dry-run")
    assert dry.exit_code == 0, dry.output
    assert _snapshot(r, prefix) == before
    # It read the queued requests where they are (under their old name), as the real run will.
    assert "2 request(s) of 2 user(s)" in dry.output and "rename 3 key(s)" in dry.output, dry.output
    done = migrate()
    assert done.exit_code == 0, done.output
    assert done.output.splitlines()[1:] == dry.output.splitlines()[1:-1]  # the same changes, done
    assert r.get(keys.layout) == str(LAYOUT) and r.hgetall(keys.waiting_by) == {"bob": "1", "carol": "1"}
    assert r.hgetall(keys.fence) == {"e": "0", "n": "17"} and r.hexists(keys.leases, "l-1")
    assert "nothing to do" in migrate().output


# ---- fencing tokens in events -----------------------------------------------------------------------


def test_no_fencing_token_in_others_events(server: ServerHandle) -> None:
    srv = server
    mine = _call(srv, "alice", "POST", "/leases", {"gpus": 1}).json()
    _call(srv, "alice", "DELETE", f"/leases/{mine['id']}", {"token": mine["token"]})

    def log(who: str) -> list[dict[str, Any]]:
        r = _call(srv, who, "GET", "/events/log", params={"lease": mine["id"]})
        assert r.status_code == 200, r.text
        return [ev for ev in r.json()["events"] if ev["type"] in ("grant", "released")]

    assert [ev["token"] for ev in log("alice")] == [mine["token"]] * 2
    assert [ev["token"] for ev in log("root")] == [mine["token"]] * 2  # an admin sees all
    seen = log("bob")
    assert len(seen) == 2 and not any("token" in ev for ev in seen), seen

    # The stream's backlog and its live events alike.
    theirs = _call(srv, "alice", "POST", "/leases", {"gpus": 1}).json()
    headers = {"Authorization": f"Bearer {srv.token('bob')}"}
    got: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{srv.url}{API}/events", params={"since": "-"}, headers=headers, timeout=10) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                got.append(ev)
                if ev.get("lease") == theirs["id"] and ev["type"] == "grant":
                    break
    grants = [ev for ev in got if ev["type"] in ("grant", "released") and ev.get("user") == "alice"]
    assert len(grants) == 3 and not any("token" in ev for ev in grants), grants


# ---- the OpenAPI document and the body checks -----------------------------------------------------------


def _wrong(schema: dict[str, Any]) -> list[Any]:
    """Values of a property that its schema refuses, whatever else it allows."""
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    out: list[Any] = [{"nested": True}] if "object" not in kinds else [[1, 2]]
    if "pattern" in schema:
        out.append("a\x1bb")
    return out


def test_every_body_the_document_calls_invalid_is_refused(server: ServerHandle) -> None:
    """Each operation with a JSON body gets bodies its schema refuses (checked by a JSON Schema
    validator first: each really is invalid), at a path that names real things (a live lease, a
    booking, a pool, a node), as an admin: every one is a 4xx, none changes anything."""
    jsonschema = pytest.importorskip("jsonschema")
    srv = server
    doc = httpx.get(f"{srv.url}{API}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    lease = _call(srv, "root", "POST", "/leases", {"gpus": 1}).json()
    day = 1_900_000_000
    booking = _call(srv, "root", "POST", "/bookings", {"pool": "T4-16GB", "gpus": 1, "start": day, "end": day + 3600})
    one = booking.json()["id"]
    values = {"lease_id": lease["id"], "booking_id": one, "reservation_id": one, "pool": "A100-80GB", "node": "n1"}
    policy = _call(srv, "root", "GET", "/policy/A100-80GB").json()
    headers = {"Authorization": f"Bearer {srv.token('root', 'admin')}", "Content-Type": "application/json"}
    http = httpx.Client(base_url=f"{srv.url}{API}", headers=headers, timeout=10)  # one connection for all
    tried: set[str] = set()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {}).get("application/json")
            if not content:
                continue
            schema = schemas[content["schema"]["$ref"].rsplit("/", 1)[1]]
            validator = jsonschema.Draft202012Validator(schema)
            bodies: list[Any] = [[], {"no_such_field": 1}]
            bodies += [{name: bad} for name, prop in schema["properties"].items() for bad in _wrong(prop)]
            raw = [b" \n", b"null", b"{"]  # no JSON object at all (whitespace: the schemathesis find)
            raw += [json.dumps(body).encode() for body in bodies if not validator.is_valid(body)]
            for content_bytes in raw:
                r = http.request(method.upper(), path.removeprefix(API).format_map(values), content=content_bytes)
                tried.add(f"{method.upper()} {path}")
                assert 400 <= r.status_code < 500, (
                    f"{method.upper()} {path} took {content_bytes!r}: {r.status_code} {r.text}"
                )
    http.close()
    assert len(tried) >= 15, sorted(tried)
    assert _call(srv, "root", "GET", f"/leases/{lease['id']}").json()["state"] == "active"
    assert _call(srv, "root", "GET", "/policy/A100-80GB").json() == policy
