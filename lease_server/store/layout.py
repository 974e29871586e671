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
what they would change, ``gpulease migrate`` changes it. A step reads and checks all it needs
before its first write (a bad entry: one line naming it, nothing changed); its writes are
idempotent.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from ..errors import ConfigurationError
from . import rollup
from .keys import Keys

LAYOUT = 7  # this release's
NOT_DATA = ("tokens", "layout")  # keys that do not make a store "written by some release"


async def stored_version(redis: Redis, keys: Keys) -> int | None:
    """The layout version of the data under ``keys``; 0 for data written before versions; None
    for no data at all. (Tokens alone are no data: ``gpulease token create`` writes them first.)"""
    raw = await redis.get(keys.layout)
    if raw is not None:
        if not str(raw).isdigit():
            raise _bad(keys.layout, f"holds {str(raw)[:40]!r}, not a layout version (a whole number)")
        return int(raw)
    # Tokens (and when each was last used) and the deployment's id are no data either: token
    # create and a node agent may write them before a server's first start.
    ignore = {keys.tokens, keys.token_used, keys.layout, keys.instance, keys.untagged(keys.tokens)}
    for pattern in (keys.pattern(), keys.untagged(keys.pattern())):
        async for key in redis.scan_iter(match=pattern, count=1000):
            if key not in ignore:
                return 0
    return None


def _command(url_hint: str) -> str:
    return f"gpulease migrate{url_hint} --dry-run (to see what changes), then without --dry-run"


def _bad(key: str, problem: str) -> ConfigurationError:
    """The one line a migration stops with, before it changed anything: the entry and what is wrong."""
    return ConfigurationError(
        f"cannot migrate: {key} {problem}; nothing was changed. Fix or delete that entry, then run "
        "gpulease migrate again"
    )


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


# ---- reading before writing ----------------------------------------------------------------------------
#
# Each step is planned first: everything it will read is read, and checked, before anything is
# written, so a bad entry stops it with one line naming the entry, and a store it leaves is the one it
# found (a rerun after the entry is fixed starts from the same place). A dry run is that plan, shown;
# the real run is the same plan, then its writes. The writes are idempotent too: a run cut off
# half-way (Redis gone) is finished by running it again.


async def _typed(redis: Redis, key: str, *kinds: str) -> str:
    """The Redis type of ``key`` ("none" when absent), refused unless one of ``kinds``."""
    kind = str(await redis.type(key))
    if kind != "none" and kind not in kinds:
        raise _bad(key, f"is a {kind}, where this release's data has a {' or a '.join(kinds)}")
    return kind


@dataclass
class Untagging:
    """The keys of a deployment made before keys carried the hash tag, and its fencing counter."""

    renames: list[tuple[str, str]] = field(default_factory=list)  # (old, new): only the old one exists
    kept: list[str] = field(default_factory=list)  # old keys whose tagged name holds data already
    fence: int | None = None  # the string counter's value, to become the {e, n} hash; None: a hash already

    def source(self, key: str) -> str:
        """Where ``key``'s data is now: its old name if it is about to be renamed."""
        return next((old for old, new in self.renames if new == key), key)


async def _plan_untagging(redis: Redis, keys: Keys) -> Untagging:
    plan = Untagging()
    # Untagged, under their names of then: tagged, a key keeps its name until the step that renames it.
    old_keys = [keys.untagged(_before_2(keys, k)) for k in keys.all()]
    async for key in redis.scan_iter(match=keys.untagged(keys.samples("*")), count=1000):
        old_keys.append(key)
    for old in old_keys:
        if not await redis.exists(old):
            continue
        new = "{" + keys.prefix + "}" + old[len(keys.prefix) :]
        if await redis.exists(new):
            plan.kept.append(old)
        else:
            plan.renames.append((old, new))
    fence = plan.source(keys.fence)
    if await _typed(redis, fence, "string", "hash") == "string":
        raw = str(await redis.get(fence))
        if not raw.isdigit():
            raise _bad(fence, f"holds {raw[:40]!r}: the fencing counter must be a whole number of tokens issued")
        plan.fence = int(raw)
    return plan


async def _untag(redis: Redis, keys: Keys, plan: Untagging) -> int:
    renamed = 0
    for old, new in plan.renames:
        if await redis.exists(old) and not await redis.exists(new):
            await redis.rename(old, new)
            renamed += 1
    if plan.fence is not None and await redis.type(keys.fence) == "string":
        pipe = redis.pipeline(transaction=True)
        pipe.delete(keys.fence)
        pipe.hset(keys.fence, mapping={"e": 0, "n": plan.fence})
        await pipe.execute()
    return renamed


async def migrate_untagged(redis: Redis, keys: Keys) -> int:
    """Rename the keys of a deployment made before keys carried the hash tag ("gpulease:leases" ->
    "{gpulease}:leases"), and turn its string fencing counter into the {e, n} hash. Idempotent;
    returns how many keys were renamed. A tagged key that already exists is left alone. A fencing
    counter that is no number stops it, with nothing changed (ConfigurationError)."""
    return await _untag(redis, keys, await _plan_untagging(redis, keys))


async def _queued_per_user(redis: Redis, key: str) -> dict[str, int]:
    """How many requests each user has queued, from the waiters hash at ``key``; every entry checked."""
    per_user: dict[str, int] = {}
    if await _typed(redis, key, "hash") == "none":
        return per_user
    for wid, raw in (await redis.hgetall(key)).items():
        try:
            request = json.loads(raw)
        except ValueError:
            raise _bad(f"{key} field {wid!r}", f"is not JSON ({str(raw)[:40]!r})") from None
        user = request.get("user") if isinstance(request, dict) else None
        if not isinstance(user, str) or not user:
            raise _bad(f"{key} field {wid!r}", "is a queued request without a user name")
        per_user[user] = per_user.get(user, 0) + 1
    return per_user


# ---- the steps ---------------------------------------------------------------------------------------


@dataclass
class Step:
    """One step's plan: what it changes, in words, and its writes (not yet done)."""

    changes: list[str]
    write: Callable[[], Awaitable[None]]


async def _to_1(redis: Redis, keys: Keys) -> Step:
    """Layout 0 -> 1: keys carry the deployment's hash tag (and the fencing counter is a hash);
    the queued requests are counted per user (waiting_by)."""
    untag = await _plan_untagging(redis, keys)
    # Read where the data is now, which is where it will be read from once renamed.
    per_user = await _queued_per_user(redis, untag.source(keys.waiters))
    out: list[str] = []
    if untag.renames:
        out.append(f"rename {len(untag.renames)} key(s) to carry the hash tag {{{keys.prefix}}}")
    if untag.kept:
        out.append(
            f"leave {len(untag.kept)} old key(s) as they are, their tagged names holding data already: "
            + ", ".join(untag.kept[:3])
            + (", ..." if len(untag.kept) > 3 else "")
        )
    if untag.fence is not None:
        out.append("turn the fencing counter into its {e, n} hash (tokens keep rising)")
    out.append(f"count the queued requests per user: {sum(per_user.values())} request(s) of {len(per_user)} user(s)")

    async def write() -> None:
        await _untag(redis, keys, untag)
        async with redis.pipeline(transaction=True) as p:
            p.delete(keys.waiting_by)
            if per_user:
                p.hset(keys.waiting_by, mapping=per_user)  # type: ignore[arg-type]
            await p.execute()

    return Step(out, write)


# Layout 2 calls bookings bookings: their three keys had the names below (keys.py property -> the
# name in layouts 0 and 1).
RENAMED_IN_2 = {"bookings": "resv", "booking_idx": "resv_idx", "booking_due": "resv_due"}
_KINDS = {"bookings": "hash", "booking_idx": "zset", "booking_due": "zset"}


def _before_2(keys: Keys, key: str) -> str:
    """``key``'s name in layouts 0 and 1."""
    for name, old in RENAMED_IN_2.items():
        if key == getattr(keys, name):
            return key[: -len(name)] + old
    return key


async def _to_2(redis: Redis, keys: Keys) -> Step:
    """Layout 1 -> 2: the bookings' keys are named for bookings (resv -> bookings, resv_idx ->
    booking_idx, resv_due -> booking_due). What they hold is unchanged."""
    renames: list[tuple[str, str]] = []
    bookings = 0
    for name in RENAMED_IN_2:
        new = getattr(keys, name)
        old = _before_2(keys, new)
        # Where the data is now: a dry run from layout 0 finds it still untagged (step 1 tags it).
        now = old if await redis.exists(old) else keys.untagged(old)
        if await _typed(redis, now, _KINDS[name]) == "none":
            continue  # no booking ever made, or renamed already by a run cut off half-way
        if await _typed(redis, new, _KINDS[name]) != "none":
            raise _bad(now, f"and {new} both hold data: a layout-1 store has only the first (delete one)")
        renames.append((old, new))
        if name == "bookings":
            bookings = int(await redis.hlen(now))
    out = []
    if renames:
        out.append(
            f"rename the bookings' key(s) {', '.join(f'{o} -> {n}' for o, n in renames)} ({bookings} booking(s))"
        )

    async def write() -> None:
        async with redis.pipeline(transaction=True) as p:  # all of a deployment's keys share one slot
            for old, new in renames:
                p.rename(old, new)
            await p.execute()

    return Step(out, write)


def victim_member(lease: dict[str, Any]) -> str | None:
    """The lease's entry in the recall index (keys.py ``victims``), as lua/_lib.lua victim_member
    writes it; None for a lease no recall takes back (a slice that is not warm, or is being evicted;
    a booking's lease that is not warm). A warm slice is class "v"."""
    if lease.get("gpu_mem_mb"):
        if not lease.get("warm_since") or lease.get("recall_at"):
            return None
        c = "v"
    elif lease.get("recall_at"):
        c = "r"
    elif lease.get("warm_since"):
        c = "w"
    elif lease.get("resv"):
        return None
    elif lease.get("preemptible"):
        c = "p"
    elif lease.get("borrowed"):
        c = "b"
    else:
        c = "o"
    r = f"{9999999999999 - int(lease['created_at']):013d}"
    if c == "w":  # a warm lease loses no work when evicted: the largest first
        r = f"{999 - len(lease['gpus']):03d}{r}"
    return f"{lease['pool']}|{c}|{r}|{lease['node']}|{lease['id']}"


async def _to_3(redis: Redis, keys: Keys) -> Step:
    """Layout 2 -> 3: the recall index (victims), built from the live leases, so that a recall
    reads a few candidates of each class instead of every lease."""
    leases = keys.leases if await redis.exists(keys.leases) else keys.untagged(keys.leases)
    members: list[str] = []
    if await _typed(redis, leases, "hash") != "none":
        for lid, raw in (await redis.hgetall(leases)).items():
            try:
                lease = json.loads(raw)
                member = victim_member(lease)
            except (ValueError, KeyError, TypeError):
                problem = "is not a lease record (JSON with pool, node, created_at)"
                raise _bad(f"{leases} field {lid!r}", problem) from None
            if member is not None:
                members.append(member)

    async def write() -> None:
        async with redis.pipeline(transaction=True) as p:
            p.delete(keys.victims)
            if members:
                p.zadd(keys.victims, dict.fromkeys(members, 0))
            await p.execute()

    return Step([f"index the live leases a recall may take back: {len(members)} lease(s)"], write)


async def _to_4(redis: Redis, keys: Keys) -> Step:
    """Layout 3 -> 4: the hourly usage rollups (rollup, rollup_idx), summed from the lines still in
    the ledger (its length is capped at event_log_max) as the scripts sum each new line
    (store/rollup.py): those of the rollup.KEEP_DAYS days up to the newest line, the rows the
    scripts would hold had they written these lines."""
    ledger = keys.ledger if await redis.exists(keys.ledger) else keys.untagged(keys.ledger)
    lines: list[dict[str, Any]] = []
    last_id = ""
    if await _typed(redis, ledger, "stream") != "none":
        start = "-"
        while True:
            page: Any = await redis.xrange(ledger, start, "+", count=5000)
            for entry_id, fields in page:
                try:
                    line = json.loads(fields["data"])
                    int(line["end"]), str(line["pool"]), str(line["user"])
                except (ValueError, KeyError, TypeError):
                    problem = "is not a ledger line (JSON with end, pool, user, ...)"
                    raise _bad(f"{ledger} entry {entry_id}", problem) from None
                lines.append(line)
                last_id = str(entry_id)
            if len(page) < 5000:
                break
            start = "(" + str(page[-1][0])
    rows: dict[str, dict[str, Any]] = {}
    per_hour: dict[int, int] = {}
    if lines:
        newest = max(int(line["end"]) for line in lines) // rollup.HOUR_MS
        for line in lines:
            if int(line["end"]) // rollup.HOUR_MS >= newest - rollup.KEEP_DAYS * 24:
                try:
                    rollup.fold(rows, line, per_hour)
                except (ValueError, KeyError, TypeError):
                    raise _bad(
                        f"{ledger} line of lease {line.get('lease')!r}", "lacks held_s, gpus or waited_s"
                    ) from None

    async def write() -> None:
        async with redis.pipeline(transaction=True) as p:
            p.delete(keys.rollup, keys.rollup_idx)
            if rows:
                p.hset(keys.rollup, mapping={k: json.dumps(v) for k, v in rows.items()})
                p.zadd(keys.rollup_idx, dict.fromkeys((k for k in rows if not k.startswith(rollup.TOTAL)), 0))
            if last_id:  # every line is in the rows: the scripts' fold starts after the last one
                p.set(keys.rollup_at, last_id)
            await p.execute()

    return Step([f"sum the usage ledger into hourly rollups: {len(lines)} line(s) -> {len(rows)} row(s)"], write)


async def _to_5(redis: Redis, keys: Keys) -> Step:
    """Layout 4 -> 5: each queued request's deadline indexed (wait_due), so that the sweep finds the
    waiters whose server went away by range instead of reading the whole queue. A request without
    a deadline (from before requests had one) is indexed as due at once: its server, stopped for
    the migration, waits for it no more, and the first sweep takes it out of the queue."""
    due: dict[str, int] = {}
    # (read where they are: a dry run from an older layout has not moved them under the tag yet)
    waiters = keys.waiters if await redis.exists(keys.waiters) else keys.untagged(keys.waiters)
    if await _typed(redis, waiters, "hash") != "none":
        for wid, raw in (await redis.hgetall(waiters)).items():
            try:
                request = json.loads(raw)
                due[str(wid)] = int(request.get("deadline") or 0)
            except (ValueError, TypeError, AttributeError):
                problem = "is not a queued request (a JSON object, with its deadline)"
                raise _bad(f"{waiters} field {wid!r}", problem) from None
    await _typed(redis, keys.wait_due, "zset")

    async def write() -> None:
        async with redis.pipeline(transaction=True) as p:
            p.delete(keys.wait_due)
            if due:
                p.zadd(keys.wait_due, due)
            await p.execute()

    return Step([f"index the deadlines of the queued requests: {len(due)} request(s)"], write)


async def _to_6(redis: Redis, keys: Keys) -> Step:
    """Layout 5 -> 6: each pool's free GPUs on its alive nodes (pool_free), summed from the fit
    index as the scripts keep it from now on (fit_put/fit_drop in _lib.lua), so that a grant while
    a booking is in force reads one field instead of every node of the pool."""
    fit = keys.fit if await redis.exists(keys.fit) else keys.untagged(keys.fit)
    free: dict[str, int] = {}
    if await _typed(redis, fit, "zset") != "none":
        for member in await redis.zrange(fit, 0, -1):
            parts = str(member).split("|", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                raise _bad(f"{fit} member {member!r}", "is not a fit entry (pool|free count|node)")
            free[parts[0]] = free.get(parts[0], 0) + int(parts[1])
    await _typed(redis, keys.pool_free, "hash")

    async def write() -> None:
        async with redis.pipeline(transaction=True) as p:
            p.delete(keys.pool_free)
            if free:
                p.hset(keys.pool_free, mapping={pool: str(n) for pool, n in free.items()})
            await p.execute()

    return Step([f"sum each pool's free GPUs from the fit index: {len(free)} pool(s)"], write)


WEEK_MS = 7 * 24 * 3600 * 1000


def booking_index(rec: dict[str, Any], now_ms: int) -> tuple[list[str], str | None]:
    """The booking's entries in the occurrence index and its owner's (keys.py ``booking_occ``,
    ``booking_own``), as lua/_lib_bookings.lua index_booking writes them: each occurrence neither
    released nor over by ``now_ms``; the owner's entry unless its last occurrence was released.
    None and [] for a booking that is not active."""
    if rec.get("state", "active") != "active":
        return [], None
    start, end, count = int(rec["start"]), int(rec["end"]), int(rec.get("occurrences") or 1)
    released = rec.get("released") or {}
    occ = [
        f"{rec['pool']}|{start + k * WEEK_MS:015d}|{end + k * WEEK_MS:015d}|{rec['id']}|{k}"
        for k in range(count)
        if str(k) not in released and end + k * WEEK_MS > now_ms
    ]
    own = None if str(count - 1) in released else f"{rec['owner']}|{end + (count - 1) * WEEK_MS:015d}|{rec['id']}"
    return occ, own


async def _to_7(redis: Redis, keys: Keys) -> Step:
    """Layout 6 -> 7: the bookings' occurrences not yet over indexed by start (booking_occ), so that
    a grant reads the bookings in force from the occurrences that started instead of decoding every
    booking of its pool; and each owner's bookings by the end of their last occurrence
    (booking_own), which booking_max_per_owner counts."""
    # (read where they are: a dry run from an older layout has not renamed nor tagged them yet)
    bookings = keys.bookings
    for where in (
        keys.untagged(keys.bookings),
        _before_2(keys, keys.bookings),
        keys.untagged(_before_2(keys, keys.bookings)),
    ):
        if not await redis.exists(bookings) and await redis.exists(where):
            bookings = where
    seconds, micros = await redis.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    occ: list[str] = []
    own: list[str] = []
    if await _typed(redis, bookings, "hash") != "none":
        for bid, raw in (await redis.hgetall(bookings)).items():
            try:
                rec = json.loads(raw)
                o, w = booking_index(rec, now_ms)
            except (ValueError, KeyError, TypeError, AttributeError):
                problem = "is not a booking (JSON with id, owner, pool, start, end, occurrences)"
                raise _bad(f"{bookings} field {bid!r}", problem) from None
            occ += o
            own += [w] if w else []
    await _typed(redis, keys.booking_occ, "zset")
    await _typed(redis, keys.booking_own, "zset")

    async def write() -> None:
        async with redis.pipeline(transaction=True) as p:
            p.delete(keys.booking_occ, keys.booking_own)
            if occ:
                p.zadd(keys.booking_occ, dict.fromkeys(occ, 0))
            if own:
                p.zadd(keys.booking_own, dict.fromkeys(own, 0))
            await p.execute()

    return Step(
        [
            f"index the bookings' occurrences not yet over, and each owner's bookings: {len(own)} booking(s), "
            f"{len(occ)} occurrence(s)"
        ],
        write,
    )


STEPS: dict[int, Callable[[Redis, Keys], Awaitable[Step]]] = {
    1: _to_1,
    2: _to_2,
    3: _to_3,
    4: _to_4,
    5: _to_5,
    6: _to_6,
    7: _to_7,
}


async def migrate(redis: Redis, keys: Keys, dry_run: bool) -> tuple[int | None, list[str]]:
    """Move the data to :data:`LAYOUT`, step by step; returns the version found and what changes
    (changed, unless ``dry_run``). A dry run and a real one read and check the same, the same way;
    only the real one then writes. Each step reads and checks everything before its first write,
    and the version is written after the step's writes: a failed run leaves the layout it found."""
    found = await stored_version(redis, keys)
    if found is None:
        return None, []
    if found > LAYOUT:
        raise ConfigurationError(
            f"the data has layout {found}, newer than this gpulease's {LAYOUT}: install the newer release"
        )
    out: list[str] = []
    for version in range(found + 1, LAYOUT + 1):
        step = await STEPS[version](redis, keys)
        out += [f"layout {version - 1} -> {version}: {c}" for c in step.changes]
        if not dry_run:
            await step.write()
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
