"""The version of the data layout in Redis, and ``gpulease migrate``.

Redis holds ``{prefix}:layout`` = the layout version that wrote the data. A server meets one of:

* no data at all (a fresh prefix): it writes :data:`LAYOUT` and starts;
* data of :data:`LAYOUT`: it starts;
* data without a version (written before versions existed: layout 0) or of another version:
  it refuses to start, with one line naming ``gpulease migrate`` (or, for a newer layout, the
  upgrade to install), instead of reading keys it could misunderstand.

A remote node agent never reads Redis: it compares :data:`LAYOUT` with what ``GET /api/v1/info``
says the server runs, and refuses the same way.

Each step of :data:`STEPS` moves the data one version up; ``gpulease migrate --dry-run`` lists
what they would change, ``gpulease migrate`` changes it. Steps are idempotent.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from ..errors import ConfigurationError
from .keys import Keys

LAYOUT = 1  # this release's
NOT_DATA = ("tokens", "layout")  # keys that do not make a store "written by some release"


async def stored_version(redis: Redis, keys: Keys) -> int | None:
    """The layout version of the data under ``keys``; 0 for data written before versions; None
    for no data at all. (Tokens alone are no data: ``gpulease token create`` writes them first.)"""
    raw = await redis.get(keys.layout)
    if raw is not None:
        return int(raw)
    ignore = {keys.tokens, keys.layout, keys.untagged(keys.tokens)}
    for pattern in (keys.pattern(), keys.untagged(keys.pattern())):
        async for key in redis.scan_iter(match=pattern, count=1000):
            if key not in ignore:
                return 0
    return None


def _command(url_hint: str) -> str:
    return f"gpulease migrate{url_hint} --dry-run (to see what changes), then without --dry-run"


async def check(redis: Redis, keys: Keys, url_hint: str = "") -> None:
    """Start on this layout, or raise ConfigurationError with the one line that says what to run.
    Writes the version into a store that holds no data yet."""
    found = await stored_version(redis, keys)
    if found is None:
        await redis.set(keys.layout, LAYOUT, nx=True)
        return
    if found == LAYOUT:
        return
    if found > LAYOUT:
        raise ConfigurationError(
            f"the data in Redis (prefix {keys.prefix!r}) has layout {found}, written by a newer gpulease; this "
            f"one reads layout {LAYOUT}: install the newer release (pip install -U gpulease)"
        )
    raise ConfigurationError(
        f"the data in Redis (prefix {keys.prefix!r}) has layout {found}, from an older gpulease; this one "
        f"reads layout {LAYOUT}. Run: {_command(url_hint)}"
    )


async def migrate_untagged(redis: Redis, keys: Keys) -> int:
    """Rename the keys of a deployment made before keys carried the hash tag ("gpulease:leases" ->
    "{gpulease}:leases"), and turn its string fencing counter into the {e, n} hash. Idempotent;
    returns how many keys were renamed. A tagged key that already exists is left alone."""
    renamed = 0
    old_keys = [keys.untagged(k) for k in keys.all()]
    async for key in redis.scan_iter(match=keys.untagged(keys.samples("*")), count=1000):
        old_keys.append(key)
    for old in old_keys:
        new = "{" + keys.prefix + "}" + old[len(keys.prefix) :]
        if await redis.exists(old) and not await redis.exists(new):
            await redis.rename(old, new)
            renamed += 1
    if await redis.type(keys.fence) == "string":
        n = int(await redis.get(keys.fence) or 0)
        pipe = redis.pipeline(transaction=True)
        pipe.delete(keys.fence)
        pipe.hset(keys.fence, mapping={"e": 0, "n": n})
        await pipe.execute()
    return renamed


# ---- the steps ---------------------------------------------------------------------------------------


async def _to_1(redis: Redis, keys: Keys, apply: bool) -> list[str]:
    """Layout 0 -> 1: keys carry the deployment's hash tag (and the fencing counter is a hash);
    the queued requests are counted per user (waiting_by); draining GPUs start empty."""
    out: list[str] = []
    untagged = [keys.untagged(k) for k in keys.all()]
    old = [k for k in untagged if await redis.exists(k)]
    if old:
        out.append(f"rename {len(old)} key(s) to carry the hash tag {{{keys.prefix}}}")
    if await redis.type(keys.fence) == "string":
        out.append("turn the fencing counter into its {e, n} hash (tokens keep rising)")
    if apply:
        await migrate_untagged(redis, keys)
    per_user: dict[str, int] = {}
    for raw in (await redis.hgetall(keys.waiters)).values():
        user = str(json.loads(raw)["user"])
        per_user[user] = per_user.get(user, 0) + 1
    out.append(f"count the queued requests per user: {sum(per_user.values())} request(s) of {len(per_user)} user(s)")
    if apply:
        async with redis.pipeline(transaction=True) as p:
            p.delete(keys.waiting_by)
            if per_user:
                p.hset(keys.waiting_by, mapping=per_user)  # type: ignore[arg-type]
            await p.execute()
    return out


STEPS: dict[int, Callable[[Redis, Keys, bool], Awaitable[list[str]]]] = {1: _to_1}


async def migrate(redis: Redis, keys: Keys, dry_run: bool) -> tuple[int | None, list[str]]:
    """Move the data to :data:`LAYOUT`, step by step; returns the version found and what changes
    (changed, unless ``dry_run``)."""
    found = await stored_version(redis, keys)
    if found is None:
        return None, []
    if found > LAYOUT:
        raise ConfigurationError(
            f"the data has layout {found}, newer than this gpulease's {LAYOUT}: install the newer release"
        )
    out: list[str] = []
    for version in range(found + 1, LAYOUT + 1):
        changes = await STEPS[version](redis, keys, not dry_run)
        out += [f"layout {version - 1} -> {version}: {c}" for c in changes]
        if not dry_run:
            await redis.set(keys.layout, version)
    return found, out


def describe(found: int | None, changes: list[str], dry_run: bool) -> list[str]:
    """The lines ``gpulease migrate`` prints."""
    if found is None:
        return [f"no gpulease data here: nothing to migrate (a server writes layout {LAYOUT} at its first start)"]
    if not changes:
        return [f"the data has layout {found}, this release's: nothing to do"]
    head = f"would migrate layout {found} -> {LAYOUT}:" if dry_run else f"migrated layout {found} -> {LAYOUT}:"
    return [head, *(f"  {c}" for c in changes)] + (["(dry run: nothing changed)"] if dry_run else [])


def info() -> dict[str, Any]:
    return {"layout": LAYOUT}
