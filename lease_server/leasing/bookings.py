"""Bookings: GPUs of a pool booked for a time window, enforced by the lease server.

A booking holds capacity over time: at no instant are more GPUs of a pool booked than the pool has,
minus an on-demand floor. A clash is refused with the clashing bookings and the nearest windows
that fit (``book.lua``, atomic with the write). During its window the holder (a user, or any
member of a ``team:NAME`` owner) is served from it ahead of the queue; others may use the GPUs it
does not use only as *borrowed* leases, which are recalled with notice when the holder asks
(``dispatch`` in ``lua/_lib_schedule.lua``). An occurrence nobody uses within ``no_show_after`` is released.

Times are stored in UTC milliseconds. A weekly booking repeats every 168 hours of UTC: it does not
follow a local clock across a daylight-saving change (the calendar shows it at the shifted local
time).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from .. import errors
from ..store.engine import Engine
from ..store.keys import NAME_RE
from ..store.scripts import Book, Code, Unbook, fmt, span
from .inventory import pool_sizes
from .values import check_gpus, check_name, check_owner, check_text, parse_time

log = logging.getLogger(__name__)

WEEK_MS = 7 * 24 * 3600 * 1000
MAX_OCCURRENCES = 52
MIN_DURATION_S = 60
MAX_LIST_SPAN_S = 366 * 86400
FIELDS = ("pool", "gpus", "start", "end", "owner", "note", "repeat", "occurrences", "colocate")
REPEATS = ("none", "weekly")


def new_booking_id() -> str:
    return "r-" + secrets.token_hex(6)


def occurrences(rec: dict[str, Any], lo_ms: int, hi_ms: int) -> list[tuple[int, int, int]]:
    """(k, start, end) of the booking's occurrences overlapping [lo, hi), ends cut at a release."""
    out = []
    count = rec["occurrences"] if rec.get("repeat") == "weekly" else 1
    first = max(0, (lo_ms - rec["end"]) // WEEK_MS) if count > 1 else 0
    last = min(count - 1, (hi_ms - rec["start"]) // WEEK_MS) if count > 1 else 0
    released = rec.get("released") or {}
    for k in range(int(first), int(last) + 1):
        s, e = rec["start"] + k * WEEK_MS, rec["end"] + k * WEEK_MS
        if str(k) in released:
            e = max(s, min(e, int(released[str(k)])))
        if s < hi_ms and lo_ms < e and s < e or (str(k) in released and s < hi_ms and lo_ms <= s):
            out.append((k, s, e))
    return out


def may_change(rec: dict[str, Any], user: str, *, admin: bool, teams: tuple[str, ...] | list[str]) -> bool:
    owner = rec["owner"]
    return admin or user in (owner, rec.get("created_by")) or (owner.startswith("team:") and owner[5:] in teams)


def public_booking(
    rec: dict[str, Any],
    *,
    user: str = "",
    admin: bool = False,
    teams: tuple[str, ...] | list[str] = (),
    lo_ms: int | None = None,
    hi_ms: int | None = None,
    now_ms: int | None = None,
) -> dict[str, Any]:
    """The API's view of a booking: times in epoch seconds, its occurrences within [lo, hi)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    lo = rec["start"] if lo_ms is None else lo_ms
    hi = rec["end"] + (rec["occurrences"] - 1) * WEEK_MS if hi_ms is None else hi_ms
    released = rec.get("released") or {}
    used = rec.get("used") or {}
    instances = []
    for k, s, e in occurrences(rec, lo, hi):
        nominal_end = rec["end"] + k * WEEK_MS
        if str(k) in released:
            state = "released"
        elif e <= now:
            state = "past"
        elif s <= now:
            state = "active"
        else:
            state = "upcoming"
        inst: dict[str, Any] = {"k": k, "start": s / 1000, "end": nominal_end / 1000, "state": state}
        inst["used"] = bool(used.get(str(k)))
        if str(k) in released:
            inst["released_at"] = int(released[str(k)]) / 1000
        instances.append(inst)
    out: dict[str, Any] = {
        "id": rec["id"],
        "owner": rec["owner"],
        "pool": rec["pool"],
        "gpus": rec["gpus"],
        "start": rec["start"] / 1000,
        "end": rec["end"] / 1000,
        "repeat": rec.get("repeat", "none"),
        "occurrences": rec["occurrences"],
        "colocate": bool(rec.get("colocate")),
        "node": rec.get("node", ""),
        "note": rec.get("note", ""),
        "created_by": rec.get("created_by", ""),
        "created_at": rec.get("created_at", 0) / 1000,
        "state": rec.get("state", "active"),
        "held": int(rec.get("held", 0)),
        "notice": rec.get("notice_ms", 0) / 1000,
        "no_show_after": rec.get("no_show_ms", 0) / 1000,
        "rev": rec.get("rev", 0),
        "mine": may_change(rec, user, admin=admin, teams=teams) if user else False,
        "instances": instances,
    }
    if rec.get("state") == "cancelled":
        out["cancelled_at"] = rec.get("cancelled_at", 0) / 1000
        out["cancelled_by"] = rec.get("cancelled_by", "")
    return out


class Bookings:
    """Create, change, cancel, end and list bookings. One per server process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.settings = engine.settings
        self.keys = engine.keys

    # ---- validation --------------------------------------------------------------------------

    def _spec(self, body: dict[str, Any], base: dict[str, Any] | None, user: str, admin: bool, teams: Any) -> dict:
        if not isinstance(body, dict):
            raise errors.BadRequest("the body must be a JSON object with pool, gpus, start and end")
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise errors.BadRequest(f"unknown field(s) {', '.join(unknown)}; a booking has {', '.join(FIELDS)}")
        rec: dict[str, Any] = dict(base) if base else {}
        if base is None:
            missing = [f for f in ("pool", "gpus", "start", "end") if f not in body]
            if missing:
                raise errors.BadRequest(
                    f"missing field(s) {', '.join(missing)}: a booking needs pool, gpus, start, end"
                )
        if "pool" in body:
            rec["pool"] = check_name("pool", body["pool"])
        if "gpus" in body:
            rec["gpus"] = check_gpus(body["gpus"])
        if "start" in body:
            rec["start"] = parse_time("start", body["start"])
        if "end" in body:
            rec["end"] = parse_time("end", body["end"])
        if "note" in body or base is None:
            rec["note"] = check_text("note", body.get("note"))
        if "repeat" in body or base is None:
            repeat = body.get("repeat") or "none"
            if repeat not in REPEATS:
                raise errors.BadRequest(f'repeat must be "none" or "weekly", got {repeat!r}')
            rec["repeat"] = repeat
        if "occurrences" in body or base is None or "repeat" in body:
            occ = body.get("occurrences", rec.get("occurrences") if rec["repeat"] == "weekly" else None)
            if occ is None:
                occ = 1 if rec["repeat"] == "none" else 4
            if isinstance(occ, bool) or not isinstance(occ, int) or not 1 <= occ <= MAX_OCCURRENCES:
                raise errors.BadRequest(f"occurrences must be a whole number from 1 to {MAX_OCCURRENCES}, got {occ!r}")
            if rec["repeat"] == "none" and occ != 1:
                raise errors.BadRequest('occurrences above 1 need repeat "weekly"')
            rec["occurrences"] = occ
        if "colocate" in body or base is None:
            colocate = body.get("colocate", False)
            if not isinstance(colocate, bool):
                raise errors.BadRequest(f"colocate must be true or false, got {colocate!r}")
            rec["colocate"] = colocate
        if "owner" in body or base is None:
            owner = check_owner(body.get("owner") or user)
            if (
                base is not None
                and owner != base["owner"]
                and not admin
                and user not in (base["owner"], base.get("created_by"))
            ):
                # A team member may change a team's booking (its times, its size), not whose it is:
                # that would take it from the rest of the team.
                maker = f" ({base['created_by']})" if base.get("created_by") else ""
                raise errors.Forbidden(
                    f"booking {base.get('id', '')} is {base['owner']}'s: only whoever made it{maker} or an admin "
                    "may give it to another owner; book your own instead"
                )
            if owner != user and not admin:
                if not owner.startswith("team:"):
                    raise errors.Forbidden(f"only an admin may book for another user ({owner}); book as yourself")
                if owner[5:] not in teams:
                    raise errors.Forbidden(
                        f"you are not a member of {owner}; book as yourself, or ask an admin to add you to the team"
                    )
            rec["owner"] = owner
        duration = (rec["end"] - rec["start"]) / 1000
        if duration < MIN_DURATION_S:
            raise errors.BadRequest(
                f"end ({fmt(rec['end'])}) must be at least {MIN_DURATION_S} s after start ({fmt(rec['start'])})"
            )
        longest = 7 * 86400 if rec["repeat"] == "weekly" else self.settings.max_booking_days * 86400
        if duration > longest:
            raise errors.BadRequest(
                f"a {'weekly ' if rec['repeat'] == 'weekly' else ''}booking lasts at most {longest / 86400:g} days"
            )
        return rec

    # ---- changes -----------------------------------------------------------------------------

    async def create(
        self,
        user: str,
        body: dict[str, Any],
        *,
        admin: bool = False,
        teams: tuple[str, ...] | list[str] = (),
        dry_run: bool = False,
        now_ms: int | None = None,
        booking_id: str | None = None,
    ) -> dict[str, Any]:
        """Book; returns the stored record (or, for ``dry_run``, {"fits", "node", ...})."""
        rec = self._spec(body, None, user, admin, teams)
        now = int(time.time() * 1000) if now_ms is None else now_ms
        last_end = rec["end"] + (rec["occurrences"] - 1) * WEEK_MS
        if last_end <= now:
            raise errors.BadRequest(f"the booking ends in the past ({fmt(last_end)}); book a window that ends later")
        s = self.settings
        rec.update(
            id=booking_id or new_booking_id(),
            created_by=user,
            created_at=now,
            changed_by=user,
            notice_ms=int(s.borrow_notice * 1000),
            no_show_ms=int(s.no_show_after * 1000),
            keep_ms=int(s.booking_history * 1000),
        )
        if dry_run:
            return await self._write("check", rec, "", now_ms, admin)
        made = await self._write("create", rec, "", now_ms, admin)
        log_booking("created", made, user)
        return made

    async def update(
        self,
        booking_id: str,
        user: str,
        body: dict[str, Any],
        *,
        admin: bool = False,
        teams: tuple[str, ...] | list[str] = (),
        dry_run: bool = False,
        now_ms: int | None = None,
    ) -> dict[str, Any]:
        for _ in range(5):
            old = await self.get(booking_id)
            if not may_change(old, user, admin=admin, teams=teams):
                raise errors.NotOwner(f"booking {booking_id} is {old['owner']}'s; only they or an admin may change it")
            if old.get("state") != "active":
                raise errors.Conflict(f"booking {booking_id} was cancelled; make a new one")
            if not body:
                raise errors.BadRequest(f"nothing to change: send any of {', '.join(FIELDS)}")
            rec = self._spec(body, dict(old), user, admin, teams)
            rec["changed_by"] = user
            now = int(time.time() * 1000) if now_ms is None else now_ms
            last_end = rec["end"] + (rec["occurrences"] - 1) * WEEK_MS
            if last_end <= now and any(k in body for k in ("start", "end", "repeat", "occurrences")):
                raise errors.BadRequest(
                    f"the change would end the booking in the past ({fmt(last_end)}); "
                    "give it a window that ends later, or cancel it"
                )
            try:
                out = await self._write("check" if dry_run else "edit", rec, str(old.get("rev", 0)), now_ms, admin)
            except errors.StaleToken:
                continue
            if not dry_run:
                changed = ",".join(f for f in FIELDS if f in body and old.get(f) != out.get(f)) or "nothing"
                log_booking("changed", out, user, f" changed={changed}")
            return out
        raise errors.Conflict(f"booking {booking_id} is being changed by someone else; reload it and retry")

    async def _write(self, mode: str, rec: dict[str, Any], rev: str, now_ms: int | None, admin: bool) -> dict[str, Any]:
        s = self.settings
        # an admin's booking is held to neither the share nor the count
        share = 1.0 if admin else s.booking_share
        max_owned = 0 if admin else s.booking_max_per_owner
        call = Book(
            mode, json.dumps(rec), s.on_demand_floor, rev, share, json.dumps(self._people(rec["owner"])), max_owned
        )
        try:
            out: dict[str, Any] = await self.engine.run(call, now_ms)
        except errors.UnknownPool:
            known = ", ".join(sorted(await pool_sizes(self.engine))) or "none registered"
            raise errors.UnknownPool(f"unknown pool {rec['pool']!r}; known pools: {known}", pool=rec["pool"]) from None
        return out

    def _people(self, owner: str) -> dict[str, list[str]]:
        """The people whose booking_share a booking of ``owner`` counts against, each with the owners
        whose bookings are theirs: a user and their teams; for ``team:NAME``, each member so (a team
        the config does not list, or lists without members: the team alone)."""
        teams = self.settings.teams
        members = teams.get(owner[5:], []) if owner.startswith("team:") else [owner]
        if not members:
            return {owner: [owner]}
        return {m: [m] + [f"team:{t}" for t in self.settings.teams_of(m)] for m in sorted(set(members))}

    async def cancel(self, booking_id: str, user: str, **kw: Any) -> dict[str, Any]:
        return await self._unbook(booking_id, "cancel", user, **kw)

    async def end(self, booking_id: str, user: str, **kw: Any) -> dict[str, Any]:
        """End the occurrence in force now: its GPUs go back to the pool at once."""
        return await self._unbook(booking_id, "end", user, **kw)

    async def _unbook(
        self,
        booking_id: str,
        mode: str,
        user: str,
        *,
        admin: bool = False,
        teams: tuple[str, ...] | list[str] = (),
        now_ms: int | None = None,
    ) -> dict[str, Any]:
        check_id(booking_id)
        keep_ms = int(self.settings.ended_retention * 1000)
        call = Unbook(booking_id, mode, user, admin, ",".join(teams), keep_ms)
        code, rest = await self.engine.raw(call, now_ms)  # the code tells a change from a repeat
        out: dict[str, Any] = call.reply(code, rest)
        if code is Code.OK:
            log_booking("cancelled" if mode == "cancel" else "ended", out, user)
        return out

    # ---- reading -----------------------------------------------------------------------------

    async def get(self, booking_id: str) -> dict[str, Any]:
        check_id(booking_id)
        raw = await self.engine.redis.hget(self.keys.bookings, booking_id)
        if raw is None:
            raise errors.NoSuchBooking(f"no booking {booking_id!r}; list them with GET /api/v1/bookings")
        out: dict[str, Any] = json.loads(raw)
        return out

    async def find(
        self, pool: str | None = None, lo_ms: int | None = None, hi_ms: int | None = None
    ) -> list[dict[str, Any]]:
        """Active bookings (of ``pool``) with an occurrence overlapping [lo, hi), by start."""
        r = self.engine.redis
        members: Any
        if pool:
            members = await r.zrangebylex(self.keys.booking_idx, f"[{pool}|", f"({pool}|~")
        else:
            members = await r.zrange(self.keys.booking_idx, 0, -1)
        ids = [m.split("|", 1)[1] for m in members]
        if not ids:
            return []
        recs = [json.loads(raw) for raw in await r.hmget(self.keys.bookings, ids) if raw]
        lo = lo_ms if lo_ms is not None else -(2**62)
        hi = hi_ms if hi_ms is not None else 2**62
        return sorted((x for x in recs if occurrences(x, lo, hi)), key=lambda x: (x["start"], x["id"]))

    async def in_force(self, now_ms: int) -> dict[str, list[dict[str, Any]]]:
        """pool -> bookings with an occurrence in force at ``now_ms`` (not released)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for rec in await self.find(None, now_ms, now_ms + 1):
            for k, s, e in occurrences(rec, now_ms, now_ms + 1):
                if s <= now_ms < e and str(k) not in (rec.get("released") or {}):
                    out.setdefault(rec["pool"], []).append(rec)
        return out


def log_booking(verb: str, rec: dict[str, Any], by: str, extra: str = "") -> None:
    """One line per change of a booking: ``booking created r-... owner=... pool=... gpus=... by=...``."""
    when = span(rec["start"], rec["end"])
    if rec.get("repeat") == "weekly":
        when += f", weekly x{rec.get('occurrences')}"
    log.info(
        "booking %s %s owner=%s pool=%s gpus=%s by=%s%s (%s)",
        verb,
        rec.get("id"),
        rec.get("owner"),
        rec.get("pool"),
        rec.get("gpus"),
        by,
        extra,
        when,
    )


def check_id(booking_id: object) -> str:
    if not isinstance(booking_id, str) or not NAME_RE.match(booking_id):
        raise errors.BadRequest(f"a booking id looks like r-1a2b3c4d5e6f, got {booking_id!r}")
    return booking_id
