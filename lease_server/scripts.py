"""Loads the Lua scripts and maps their return codes to results or typed errors.

Each script in ``lua/`` is the shared prologue ``_lib.lua`` followed by the script's own body, so
that the lease life cycle (grant, end, dispatch the queue) is written once and every script applies
it atomically. One function per code path turns a script's small integer code into a value or a
:mod:`errors` exception; an unknown code raises, it is never ignored.
"""

from __future__ import annotations

import enum
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from . import errors


class Code(enum.IntEnum):
    OK = 0
    QUEUED = 1
    BUSY = 2
    NO_SUCH = 3
    ENDED = 4
    NOT_OWNER = 5
    STALE = 6
    EXPIRED = 7
    UNKNOWN_POOL = 8
    UNSATISFIABLE = 9
    DUPLICATE = 10
    UNKNOWN_NODE = 11
    REMOVED = 12
    LIMIT = 13
    NOT_DUE = 14
    CLASH = 15


SCRIPT_NAMES = (
    "acquire",
    "cancel_wait",
    "renew",
    "release",
    "sweep",
    "register",
    "idle_warn",
    "keep",
    "reclaim",
    "samples",
    "reserve",
    "unreserve",
)
# Scripts that do not touch lease state: no shared prologue, their own KEYS[] (see their headers).
STANDALONE = ("samples",)


def source(name: str) -> str:
    lua = resources.files(__package__).joinpath("lua")
    body = lua.joinpath(f"{name}.lua").read_text()
    if name in STANDALONE:
        return body
    return lua.joinpath("_lib.lua").read_text() + "\n" + body


class Scripts:
    """The registered scripts of one Redis connection (EVALSHA, re-loaded on NOSCRIPT)."""

    def __init__(self, redis: Redis) -> None:
        self._scripts: dict[str, AsyncScript] = {name: redis.register_script(source(name)) for name in SCRIPT_NAMES}

    async def call(self, name: str, keys: list[str], args: list[Any]) -> tuple[Code, list[Any]]:
        reply = await self._scripts[name](keys=keys, args=args)
        try:
            code = Code(int(reply[0]))
        except (ValueError, IndexError, TypeError) as exc:
            raise errors.GpuLeaseError(f"script {name} returned an unknown reply {reply!r}") from exc
        return code, list(reply[1:])

    async def call_raw(self, name: str, keys: list[str], args: list[Any]) -> list[Any]:
        """A standalone script's plain reply (no return code)."""
        return list(await self._scripts[name](keys=keys, args=args))


def raise_for(code: Code, lease_id: str = "", pool: str = "", extra: Any = None) -> None:
    """Raise the typed error for a refusal code (codes that are not refusals return None)."""
    if code is Code.NO_SUCH:
        raise errors.NoSuchLease(
            f"no lease {lease_id!r}: it never existed or ended long ago; list yours with GET /api/v1/leases"
        )
    if code is Code.NOT_OWNER:
        raise errors.NotOwner(f"lease {lease_id} belongs to another user; only its owner or an admin may change it")
    if code is Code.STALE:
        raise errors.StaleToken(
            f"the token given for lease {lease_id} is not its current fencing token: "
            "you hold an older grant; acquire a new lease"
        )
    if code is Code.UNKNOWN_POOL:
        raise errors.UnknownPool(f"unknown pool {pool!r}", pool=pool)
    if code is Code.UNSATISFIABLE:
        raise errors.Unsatisfiable(
            f"no node in pool {pool!r} has that many GPUs: the largest has {extra}; "
            f"ask for at most {extra} on one node, or spread the GPUs over several nodes, all or nothing "
            f"(%%gpu_train --nodes K, API field nodes: each node gets 1/K of them)",
            pool=pool,
            largest_node=int(extra),
        )
    if code is Code.DUPLICATE:
        raise errors.Conflict(f"lease id {lease_id!r} is already in use")
    if code is Code.CLASH:
        raise errors.ReservationClash(f"booking {lease_id} clashes with others", **(extra or {}))
    if code is Code.UNKNOWN_NODE:
        raise errors.UnknownNode(f"node {lease_id!r} is not registered: send its inventory first")
    raise errors.GpuLeaseError(f"unexpected script code {code!r}")
