"""The Lua calling convention has one owner (lease_server/store/scripts.py): every script's header
against its wrapper, the Lua code table against ``Code``, and each script carrying only the keys
and helpers it uses."""

from __future__ import annotations

import dataclasses
import re
from importlib import resources

import pytest

from lease_server.store import scripts as S
from lease_server.store.keys import Keys

LUA = resources.files("lease_server.store").joinpath("lua")
_HEADER_ARG = re.compile(r"ARGV\[(\d+)\]")


def header(name: str) -> str:
    """The script's leading comment block."""
    lines = []
    for line in LUA.joinpath(f"{name}.lua").read_text().splitlines():
        if not line.startswith("--"):
            break
        lines.append(line)
    return "\n".join(lines)


def body_args(name: str) -> set[int]:
    return {int(i) for i in _HEADER_ARG.findall(S._code_only(LUA.joinpath(f"{name}.lua").read_text()))}


@pytest.mark.parametrize("call", S.CALLS, ids=lambda c: c.script)
def test_header_argv_matches_the_wrapper(call: type[S.ScriptCall]) -> None:
    documented = sorted({int(i) for i in _HEADER_ARG.findall(header(call.script))})
    fields = dataclasses.fields(call)  # type: ignore[arg-type]
    # ARGV[1..5] are the common five (Common); the script's own start at 6, one per wrapper field.
    assert documented == list(range(6, 6 + len(fields))), (documented, [f.name for f in fields])
    assert body_args(call.script) <= set(range(1, 6 + len(fields))), "the body reads an ARGV nobody sends"
    assert len(_dummy(call).argv()) == len(fields)
    assert len(S.Common(None, 1, 1.0, 1).argv()) == 5


def _sample(f: dataclasses.Field[object]) -> object:
    t = str(f.type)
    if "int" in t or "float" in t:
        return 1
    if t == "bool":
        return False
    return '{"id": "x", "pool": "p", "gpus": 1}' if f.name == "booking" else "x"


@pytest.mark.parametrize("call", S.CALLS, ids=lambda c: c.script)
def test_each_script_gets_exactly_the_keys_it_uses(call: type[S.ScriptCall]) -> None:
    declared = S.declared_keys(call.script)
    assert len(set(declared)) == len(declared)
    assert S.used_keys(call.script) == set(declared)  # no key missing (nil in Lua), none to spare
    keys = Keys("t")
    for name in declared:
        assert getattr(keys, name) == f"{{t}}:{name}"  # built by keys.py, under the hash tag


def test_a_small_script_carries_only_the_helpers_it_calls() -> None:
    keep = S.source("keep")
    assert "local function emit" in keep and "local function dispatch" not in keep
    assert "local function dispatch" in S.source("release")
    # Helpers come in the library's order (a Lua local must be defined before its caller).
    _, chunks = S._library()
    order = [name for name, _ in chunks]
    used = S._helpers_for(LUA.joinpath("sweep.lua").read_text())
    assert used == sorted(used, key=order.index)


def test_lua_code_table_matches_code() -> None:
    lib = LUA.joinpath("_lib.lua").read_text()
    table: dict[str, int] = {}
    for names, values in re.findall(r"^local ([A-Z_, ]+) = ([\d, ]+)$", lib, re.M):
        for n, v in zip(names.split(","), values.split(","), strict=True):
            table[n.strip()] = int(v)
    table.pop("WEEK_MS", None)
    assert table == {c.name: c.value for c in S.Code}


def test_every_code_a_script_returns_is_one_its_wrapper_reads() -> None:
    """A code a script can answer that its wrapper does not handle would surface as a 500."""
    for call in S.CALLS:
        text = S._code_only(LUA.joinpath(f"{call.script}.lua").read_text())
        returned = set(re.findall(r"return \{([A-Z_]+)", text))
        for code in returned:
            try:
                call.reply(_dummy(call), S.Code[code], ['{"state": "released", "pool": "p"}', "1", "{}"])
            except S.errors.GpuLeaseError as exc:
                assert "unexpected reply" not in str(exc), (call.script, code)
            except (KeyError, ValueError, TypeError):
                pass  # the sample reply does not fit this code's payload; the code is still handled


def _dummy(call: type[S.ScriptCall]) -> S.ScriptCall:
    return call(**{f.name: _sample(f) for f in dataclasses.fields(call)})  # type: ignore[arg-type]


def test_the_acquire_request_and_its_wrapper_agree() -> None:
    """A field of the HTTP request (request.AcquireRequest, the one declaration from which the
    OpenAPI schema is made) is a field of the Acquire wrapper, and the free-text fields pass through
    by name."""
    from lease_server.request import AcquireRequest

    request = {f.name for f in dataclasses.fields(AcquireRequest)}
    wrapper = {f.name for f in dataclasses.fields(S.Acquire)}
    renamed = {"ttl": "ttl_ms", "wait": "wait_ms", "ends_within": "ends_within_ms"}  # seconds in the API, ms in Lua
    assert {renamed.get(n, n) for n in request} <= wrapper, request
    assert set(S.Acquire.TEXT) <= request


def _lua_lease_fields() -> set[str]:
    """Every field the scripts write on a lease record: the grant's table (``local lease = {...}``
    in _lib_schedule.lua) and each assignment to ``lease.X`` / ``l.X``."""
    fields: set[str] = set()
    for path in LUA.iterdir():
        if not path.name.endswith(".lua"):
            continue
        code = S._code_only(path.read_text())
        table = re.search(r"local lease = \{(.*?)\n  \}", code, re.S)
        if table:
            fields |= set(re.findall(r"\b(\w+) = ", table.group(1)))
        # a statement's targets: at a line's start or after then / do / else, before a single "="
        for lhs in re.findall(r"(?:^|\bthen\b|\bdo\b|\belse\b)\s*([\w.,\s]+?)\s*=(?!=)", code, re.M):
            fields |= set(re.findall(r"\b(?:lease|l)\.(\w+)", lhs))
    return fields


def test_the_lease_record_declares_every_field_the_lua_writes_and_no_other() -> None:
    declared = set(S.LeaseRecord.__annotations__)
    written = _lua_lease_fields()
    assert {"id", "token", "waited_ms", "recall_code", "cause", "warm_since"} <= written  # the reader works
    assert written - declared == set(), "declare these in store/scripts.py LeaseRecord"
    assert declared - written == set(), "no script writes these: drop them from LeaseRecord"
