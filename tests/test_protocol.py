"""lease_server.protocol is the one owner of the HTTP protocol: these tests hold everyone else to it.

Fast and without Redis: they read the sources. Every event type a Lua script or Python module
publishes is in ``EventType``; the labextension's event lists equal protocol's groups; its lease
states equal ``LeaseState``; every route the server mounts, and every path its OpenAPI document
describes, is a protocol path; the clients spell no API path or auth header themselves.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from lease_server import protocol
from lease_server.protocol import EventType, LeaseState
from lease_server.web import auth

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "lease_server" / "store" / "lua"
LAB = ROOT / "labextension" / "src"
PY_SOURCES = [ROOT / "lease_server", ROOT / "magics", ROOT / "jupyter_ext"]

EVENT_TYPES = {e.value for e in EventType}
ENDED = {LeaseState.RELEASED.value, LeaseState.EXPIRED.value, LeaseState.REVOKED.value}


# ---- reading Lua -----------------------------------------------------------------------------------


def lua_code(text: str) -> str:
    """The text without its ``--`` comments (strings kept as they are, so a '--' in one stays)."""
    out, i, quote = [], 0, ""
    while i < len(text):
        c = text[i]
        if quote:
            out.append(c)
            if c == "\\":
                out.append(text[i + 1 : i + 2])
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
            out.append(c)
        elif text.startswith("--", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def call_args(code: str, name: str) -> Iterator[list[str]]:
    """The argument expressions of every call ``name(...)`` (not its definition), split at the
    top-level commas; nested calls, tables and strings are kept whole."""
    for m in re.finditer(rf"(?<![\w.:]){name}\(", code):
        if re.search(r"function\s+$", code[: m.start()]):
            continue
        args, depth, quote, cur = [], 0, "", []
        for c in code[m.end() :]:
            if quote:
                cur.append(c)
                if c == quote:
                    quote = ""
                continue
            if c in "'\"":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    break
                depth -= 1
            elif c == "," and depth == 0:
                args.append(" ".join("".join(cur).split()))
                cur = []
                continue
            cur.append(c)
        args.append(" ".join("".join(cur).split()))
        yield args


def literal(expr: str) -> str | None:
    m = re.fullmatch(r"'(\w+)'|\"(\w+)\"", expr)
    return (m.group(1) or m.group(2)) if m else None


def lua_files() -> dict[str, str]:
    return {p.name: lua_code(p.read_text()) for p in sorted(LUA.glob("*.lua"))}


# ---- what the dynamic emits can be -------------------------------------------------------------------


def recall_kinds(lua: dict[str, str]) -> set[str]:
    """``recall(w, pool, n, only_node, rank, notice_ms, kind, why, extra)`` emits ``kind``."""
    kinds = set()
    helpers = "\n".join(code for name, code in lua.items() if name.startswith("_lib"))
    for args in call_args(helpers, "recall"):
        kind = literal(args[6])
        assert kind, f"recall() called with a kind that is not a literal: {args[6]!r}"
        kinds.add(kind)
    return kinds


def end_states(lua: dict[str, str]) -> set[str]:
    """``end_lease(lease, state, reason, by)`` emits ``state``: a literal, or release.lua's
    ``state`` (ARGV: 'auto', which it turns into 'released' or 'revoked', or what LeaseStore.release
    passes, a LeaseState)."""
    states = set()
    for name, code in lua.items():
        for args in call_args(code, "end_lease"):
            state = literal(args[1])
            if state is None:
                assert (name, args[1]) == ("release.lua", "state"), f"{name}: end_lease() with state {args[1]!r}"
                states |= set(re.findall(r"\bstate\s*(?:,\s*\w+\s*)?=\s*'(\w+)'", code))
            else:
                states.add(state)
    return states


def wait_reasons() -> set[str]:
    """cancel_wait.lua emits ``'wait_' .. reason``: the reasons LeaseStore.cancel_wait is given."""
    reasons: set[str] = set()
    for tree in python_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) and node.name == "cancel_wait":
                args = node.args
                for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
                    if arg.arg == "reason" and isinstance(default, ast.Constant):
                        reasons.add(str(default.value))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "cancel_wait":
                for kw in node.keywords:
                    if kw.arg == "reason":
                        assert isinstance(kw.value, ast.Constant), "cancel_wait(reason=...) must be a literal"
                        reasons.add(str(kw.value.value))
    assert reasons
    return reasons


def emitted_by_lua() -> set[str]:
    lua = lua_files()
    found: set[str] = set()
    for name, code in lua.items():
        for args in call_args(code, "emit"):
            expr = args[0]
            if (kind := literal(expr)) is not None:
                found.add(kind)
            elif (m := re.fullmatch(r"\w+ and '(\w+)' or '(\w+)'", expr)) is not None:
                found |= {m.group(1), m.group(2)}
            elif (name, expr) == ("_lib_recall.lua", "kind"):
                found |= recall_kinds(lua)
            elif (name, expr) == ("_lib_end.lua", "state"):
                found |= end_states(lua)
            elif (name, expr) == ("cancel_wait.lua", "'wait_' .. reason"):
                found |= {f"wait_{r}" for r in wait_reasons()}
            else:
                pytest.fail(f"{name}: emit({expr}, ...): say in tests/test_protocol.py which types it can be")
        # scripts without the _lib prologue XADD to the event stream themselves
        for m in re.finditer(r"'XADD'[^\n]*?'type',\s*([^,\s]+)", code):
            if name == "_lib.lua" and m.group(1) == "kind":
                continue  # emit() itself
            kind = literal(m.group(1))
            assert kind, f"{name}: an XADD of type {m.group(1)!r}: make it a literal"
            found.add(kind)
    return found


def python_trees() -> Iterator[ast.Module]:
    for root in PY_SOURCES:
        for path in sorted(root.rglob("*.py")):
            yield ast.parse(path.read_text(), str(path))


def published_by_python() -> set[str]:
    """The ``type`` of every ``redis.xadd(key, {"type": ..., ...})``."""
    found: set[str] = set()
    for tree in python_trees():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "xadd"):
                continue
            fields = node.args[1] if len(node.args) > 1 else next(k.value for k in node.keywords if k.arg == "fields")
            assert isinstance(fields, ast.Dict), ast.unparse(node)
            for key, value in zip(fields.keys, fields.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "type":
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        found.add(value.value)
                    elif isinstance(value, ast.Attribute) and ast.unparse(value.value).endswith("EventType"):
                        found.add(EventType[value.attr].value)
                    else:
                        pytest.fail(f"xadd of type {ast.unparse(value)}: use a literal or an EventType member")
    return found


def end_causes(lua: dict[str, str]) -> set[str]:
    """The cause codes ``end_lease(lease, state, reason, by, raw, drain, code, why)`` can write: a
    literal; release.lua's ``state`` (its end states); ``expiry_code(lease)`` (the literals it
    returns); a recalled lease's ``recall_code`` (the values of ``RECALL_CODE``)."""
    helpers = "\n".join(code for name, code in lua.items() if name.startswith("_lib"))
    codes = set()
    for name, code in lua.items():
        for args in call_args(code, "end_lease"):
            expr = args[6] if len(args) > 6 else "nil"
            if literal(expr):
                codes.add(literal(expr))
            elif expr == "state":
                assert name == "release.lua", f"{name}: end_lease() with code {expr!r}"
                codes |= set(re.findall(r"\bstate\s*(?:,\s*\w+\s*)?=\s*'(\w+)'", code))
            elif expr == "expiry_code(lease)":
                body = helpers[helpers.index("local function expiry_code") :]
                codes |= set(re.findall(r"return '(\w+)'", body[: body.index("\nend")]))
            elif expr.startswith("lease.recall_code or "):
                table = re.search(r"RECALL_CODE = \{([^}]*)\}", helpers)
                assert table, "RECALL_CODE is gone from _lib.lua"
                codes |= set(re.findall(r"= '(\w+)'", table.group(1))) | {literal(expr.split(" or ")[1]) or ""}
            else:
                pytest.fail(f"{name}: end_lease() with cause code {expr!r}: use a literal (protocol.EndCause)")
    return codes


def test_every_end_cause_lua_writes_is_an_end_cause_and_back() -> None:
    codes = end_causes(lua_files())
    assert codes == {c.value for c in protocol.EndCause}, "protocol.EndCause and the Lua's codes differ"


# ---- events ------------------------------------------------------------------------------------------


def test_the_resolvers_find_the_dynamic_event_types() -> None:
    lua = lua_files()
    assert recall_kinds(lua) == {"preempt_notice", "borrow_recalled", "evicting"}
    assert end_states(lua) == ENDED
    assert wait_reasons() == {"timeout", "cancelled"}


def test_every_event_type_lua_emits_is_registered() -> None:
    emitted = emitted_by_lua()
    assert emitted - EVENT_TYPES == set(), "add these to protocol.EventType"
    assert {"grant", "released", "preempt_notice", "borrow_recalled", "wait_timeout", "unleased_use"} <= emitted


def test_every_event_type_python_publishes_is_registered() -> None:
    published = published_by_python()
    assert published - EVENT_TYPES == set(), "add these to protocol.EventType"
    assert "policy_changed" in published


def test_every_registered_event_type_is_published() -> None:
    assert EVENT_TYPES - emitted_by_lua() - published_by_python() == set(), "nothing publishes these"


def test_gpulease_events_describes_every_event_type_in_words() -> None:
    """A new event type gets its own words in ``gpulease events`` (cli/events.py describe), not the
    key=value fallback that an unknown type falls to."""
    from lease_server.cli.events import describe

    fallback = [t.value for t in EventType if "zz_probe=" in describe({"type": t.value, "zz_probe": 1})]
    assert fallback == [], f"gpulease events shows these as key=value: {fallback}"


def test_every_event_type_is_in_exactly_one_group() -> None:
    groups = [protocol.BOARD_EVENTS, protocol.BOOKING_EVENTS, protocol.LOG_ONLY_EVENTS]
    for e in EVENT_TYPES:
        assert sum(e in g for g in groups) == 1, e
    assert set().union(*groups) == EVENT_TYPES
    assert protocol.ENDED_EVENTS == protocol.ENDED_STATES == ENDED
    assert protocol.RECALL_EVENTS <= protocol.BOARD_EVENTS


def test_the_changes_event_is_no_event_of_the_log_and_the_labextension_listens_to_it() -> None:
    assert protocol.CHANGES_EVENT not in EVENT_TYPES
    m = re.search(r"export const CHANGES_EVENT\s*=\s*'([^']*)'", (LAB / "model.ts").read_text())
    assert m and m.group(1) == protocol.CHANGES_EVENT


def ts_array(path: Path, name: str) -> list[str]:
    m = re.search(rf"export const {name}\s*=\s*\[(.*?)\]", path.read_text(), re.S)
    assert m, f"{path.name} has no {name}"
    return re.findall(r"'([^']*)'", m.group(1))


@pytest.mark.parametrize(
    "name, group", [("BOARD_EVENTS", protocol.BOARD_EVENTS), ("BOOKING_EVENTS", protocol.BOOKING_EVENTS)]
)
def test_labextension_event_lists_equal_protocol(name: str, group: frozenset[str]) -> None:
    listed = ts_array(LAB / "model.ts", name)
    assert len(listed) == len(set(listed)), f"{name} lists a type twice"
    assert set(listed) == group


# ---- lease states --------------------------------------------------------------------------------------


def test_labextension_lease_states_equal_protocol() -> None:
    m = re.search(r"export type LeaseState\s*=([^;]*);", (LAB / "api.ts").read_text())
    assert m, "api.ts has no LeaseState"
    assert set(re.findall(r"'([^']*)'", m.group(1))) == {s.value for s in LeaseState}
    # no other list of lease states in the front end: ILease.state is that type
    ilease = re.search(r"^export interface ILease \{$(.*?)^\}$", (LAB / "api.ts").read_text(), re.S | re.M)
    assert ilease and re.search(r"^\s*state: LeaseState;$", ilease.group(1), re.M)


def test_openapi_lease_states_equal_protocol() -> None:
    from lease_server.web.openapi import openapi_document

    lease = openapi_document()["components"]["schemas"]["Lease"]
    assert set(lease["properties"]["state"]["enum"]) == {s.value for s in LeaseState}


def test_lease_module_keeps_the_protocol_lease_state() -> None:
    from lease_server.leasing import lease

    assert lease.LeaseState is LeaseState


# ---- paths and headers ---------------------------------------------------------------------------------


def protocol_paths(sample: str = "X") -> set[str]:
    """Every path protocol names, with ``sample`` for each path parameter."""
    out = {v for v in vars(protocol).values() if isinstance(v, str) and v.startswith(protocol.API + "/")}
    for name, fn in inspect.getmembers(protocol, inspect.isfunction):
        if fn.__module__ == protocol.__name__ and not name.startswith("_"):
            path = fn(sample)
            if isinstance(path, str) and path.startswith(protocol.API + "/"):
                out.add(path)
    return out


def mounted_paths() -> list[tuple[str, re.Pattern[str]]]:
    """(path with X for each parameter, its regex) of every API route make_app mounts."""
    from lease_server.web import api

    app = api.make_app(None)  # type: ignore[arg-type]  # the context is only stored
    out = []
    for rule in app.wildcard_router.rules:
        matcher = rule.matcher
        regex = matcher.regex  # type: ignore[attr-defined]
        path = matcher.reverse(*["X"] * regex.groups)
        if path and path.startswith(protocol.API + "/"):
            out.append((path, regex))
    return out


def test_every_mounted_route_is_a_protocol_path() -> None:
    mounted = mounted_paths()
    assert len(mounted) >= 20
    assert {p for p, _ in mounted} - protocol_paths() == set(), "name these routes in protocol.py"


def test_every_protocol_path_is_mounted() -> None:
    regexes = [r for _, r in mounted_paths()]
    for path in protocol_paths("abc-1.2_3"):
        assert any(r.fullmatch(path) for r in regexes), f"protocol names {path}, the server mounts nothing there"


def test_openapi_paths_are_protocol_paths() -> None:
    from lease_server.web.openapi import openapi_document

    documented = {re.sub(r"\{\w+\}", "X", p) for p in openapi_document()["paths"] if p.startswith(protocol.API)}
    assert documented == protocol_paths()


def test_path_parameters_are_escaped() -> None:
    assert protocol.lease("a/b") == f"{protocol.API}/leases/a%2Fb"
    assert protocol.node_samples("gpu 1") == f"{protocol.API}/nodes/gpu%201/samples"


def test_headers_agree() -> None:
    assert auth.ACT_AS_HEADER == protocol.USER_HEADER
    assert protocol.bearer("t") == {"Authorization": "Bearer t"}


# The clients build every path and auth header from protocol.
CLIENTS = [
    "lease_server/client.py",
    "lease_server/node/agent.py",
    "jupyter_ext/upstream.py",
    "magics/worker.py",
    "magics/grant.py",
    "magics/runner.py",
    "magics/session.py",
]


def code_strings(path: Path) -> Iterator[tuple[int, str]]:
    """Every string constant of a module but its docstrings."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


@pytest.mark.parametrize("client", CLIENTS)
def test_clients_spell_no_path_or_header_of_their_own(client: str) -> None:
    for line, s in code_strings(ROOT / client):
        assert "/api/" not in s, f"{client}:{line}: {s!r}: use a lease_server.protocol path"
        assert not re.search(r"\b(Bearer|Last-Event-ID|X-Gpulease-User)\b", s), f"{client}:{line}: {s!r}"
        assert s != protocol.AUTHORIZATION, f"{client}:{line}: use protocol.bearer() or AUTHORIZATION"
