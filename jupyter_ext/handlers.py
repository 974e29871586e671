"""The ``/gpulease/`` API that the JupyterLab front end calls.

Every handler is authenticated by jupyter_server (token or login cookie; XSRF checked on cookie
requests that change something) and authorized on the resource ``gpulease``. Each one calls the
lease server with the lease token from the configuration, as the one lease user this Jupyter server
acts for. Errors are JSON ``{"code", "message"}``: the lease server's own status and code for its
errors, 401 when the browser is not logged in to Jupyter, 400 for bad input here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from datetime import datetime
from typing import Any, Protocol

import httpx
import tornado.iostream
import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from lease_server import errors
from lease_server.protocol import BOARD_RELEASE_REASON
from lease_server.request import lone_surrogate
from lease_server.store.keys import NAME_RE

from . import __version__
from .upstream import LeaseApi

log = logging.getLogger(__name__)

NAMESPACE = "gpulease"
# (not "." or "..": httpx would resolve them in the lease server's path, /leases/.. to the API root)
LEASE_ID_RE = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9._-]{1,64}$")
BOOKING_ID_RE = LEASE_ID_RE
POOL_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
USAGE_BY = ("user", "team", "pool")
NUMBER_RE = re.compile(r"^-?\d{1,12}(\.\d{1,6})?$")
# The fields of a booking (POST /bookings; PATCH takes any subset) and the JSON types each one takes.
# Values are checked by the lease server (a pool that exists, start < end, 1..52 occurrences, ...).
TIME = "a time: epoch seconds, or ISO-8601 with an offset like 2026-11-23T09:00:00+01:00"
BOOKING_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "pool": ((str,), "a pool name"),
    "gpus": ((int,), "a whole number of GPUs"),
    "start": ((int, float, str), TIME),
    "end": ((int, float, str), TIME),
    "owner": ((str,), 'a user, or a team as "team:NAME"'),
    "note": ((str,), "text"),
    "repeat": ((str,), '"none" or "weekly"'),
    "occurrences": ((int,), "a whole number of weeks"),
    "colocate": ((bool,), "true or false"),
}
SINCE_RE = re.compile(r"^(-|0|\d{1,20}(-\d{1,20})?)$")
TRUTHY = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
# Query arguments jupyter_server itself reads (authentication), allowed on every endpoint.
AUTH_ARGS = {"token", "_xsrf"}
STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}


class Extension(Protocol):
    """What the handlers read of the extension (``app.GpuLease``, in the tornado settings as
    "gpulease"): the lease server's client and the open event streams. Declared here, so that the
    routes depend on no more than this and ``app.py`` alone imports ``handlers.py``."""

    api: LeaseApi
    streams: set[asyncio.Event]


class GpuLeaseHandler(APIHandler):
    """Base of the /gpulease/ handlers: config through a property, errors as {code, message}."""

    auth_resource = NAMESPACE
    allowed_args: frozenset[str] = frozenset()

    @property
    def ext(self) -> Extension:
        return self.settings["gpulease"]  # type: ignore[no-any-return]

    @property
    def api(self) -> LeaseApi:
        return self.ext.api

    def get_login_url(self) -> str:
        # tornado's @authenticated asks for a login URL when nobody is logged in; an API answers 401.
        raise tornado.web.HTTPError(
            401, "not logged in to Jupyter: reload JupyterLab and log in (or pass the server's token)"
        )

    def check_xsrf_cookie(self) -> None:
        # jupyter_server checks XSRF before @authenticated runs: nobody logged in is a 401, not a 403.
        if hasattr(self, "_jupyter_current_user") and self._jupyter_current_user is None:
            self.get_login_url()
        super().check_xsrf_cookie()

    def check_args(self) -> None:
        # JupyterLab appends a bare timestamp (?1700000000000) to GETs against caches: not an argument.
        given = {k for k, v in self.request.query_arguments.items() if not (k.isdigit() and v == [b""])}
        unknown = given - self.allowed_args - AUTH_ARGS
        if unknown:
            allowed = ", ".join(sorted(self.allowed_args)) or "none"
            raise errors.BadRequest(
                f"unknown query argument(s) {', '.join(sorted(unknown))} on {self.request.path}; allowed: {allowed}"
            )

    def flag(self, name: str, default: bool = False) -> bool:
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        if raw.lower() not in TRUTHY:
            raise errors.BadRequest(f"{name} must be true or false, got {raw!r}")
        return TRUTHY[raw.lower()]

    def time_arg(self, name: str) -> str | None:
        """A query argument that is a time (epoch seconds or ISO-8601 with an offset), as given."""
        raw = self.get_query_argument(name, None)
        if raw is not None and not _is_time(raw):
            raise errors.BadRequest(f"{name} must be {TIME}, got {raw!r}")
        return raw

    def pool_arg(self) -> str | None:
        """The ``pool`` query argument, if given: a pool name in form (the lease server says if it exists)."""
        pool = self.get_query_argument("pool", None)
        if pool is not None and not POOL_RE.match(pool):
            raise errors.BadRequest(f"pool must be a pool name like A100-80GB, got {pool!r}")
        return pool

    def json_object(self) -> dict[str, Any]:
        """The request body: one JSON object, or a 400 that says what is wrong with it."""
        try:
            # strict UTF-8 first: json.loads would take UTF-16 or UTF-32 too, and encoded surrogates
            data = json.loads((self.request.body or b"null").decode("utf-8"))
        except ValueError as exc:
            raise errors.BadRequest(f"the request body must be a JSON object: {exc}") from exc
        if not isinstance(data, dict):
            raise errors.BadRequest(f"the request body must be a JSON object, got {type(data).__name__}")
        lone = lone_surrogate(self.request.body, data)
        if lone is not None:
            raise errors.BadRequest(f"the request body holds a lone UTF-16 surrogate ({lone}); send text as UTF-8")
        return data

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, errors.GpuLeaseError):
            self.set_status(exc.status)
            body = exc.to_json()
        elif isinstance(exc, tornado.web.HTTPError):
            message = exc.log_message or self._reason
            if exc.status_code == 405:
                message = f"{self.request.method} is not supported on {self.request.path}"
            elif exc.status_code == 403 and "xsrf" in message.lower():
                # (tornado's own words name POST whatever the method was)
                message = (
                    f"{self.request.method} {self.request.path}: '_xsrf' missing or wrong: a request "
                    "that changes something must echo the _xsrf cookie in the "
                    "X-XSRFToken header (JupyterLab does), or carry the Jupyter server's token"
                )
            body = {"code": STATUS_CODES.get(exc.status_code, "http_error"), "message": message}
        else:
            body = {"code": "internal", "message": "internal error in the gpulease server extension; see the log"}
        self.finish(json.dumps(body))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, errors.GpuLeaseError):
            if value.status >= 500:
                log.warning("%s %s: %s", self.request.method, self.request.path, value.message)
            return
        super().log_exception(typ, value, tb)


def _public(lease: dict[str, Any]) -> dict[str, Any]:
    # The fencing token is the capability to renew a grant: the page never needs it.
    return {k: v for k, v in lease.items() if k != "token"}


class VersionHandler(GpuLeaseHandler):
    """The handshake: this extension's version, and whether the lease server answers."""

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.check_args()
        self.reply({"version": __version__, "lease_server": await self.api.probe()})


class ClusterHandler(GpuLeaseHandler):
    """Every node and GPU with its state and holder (the lease server's GET /cluster); ?pool=,
    ?after= and ?limit= ask for a page of the nodes, as there (the lease server checks them)."""

    allowed_args = frozenset({"pool", "after", "limit"})

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.check_args()
        asked = {
            name: self.get_query_argument(name)
            for name in sorted(self.allowed_args)
            if self.get_query_argument(name, None) is not None
        }
        self.reply(await self.api.request("GET", "/cluster", params=asked or None))


class LeasesHandler(GpuLeaseHandler):
    """This Jupyter user's live leases; ?all=true: everyone's."""

    allowed_args = frozenset({"all"})

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.check_args()
        everyone = self.flag("all")
        body = await self.api.request("GET", "/leases", params={"all": "true" if everyone else "false"})
        me = await self.api.whoami()
        self.reply({"user": me.get("user"), "leases": [_public(lease) for lease in body["leases"]]})


class OwnLeaseHandler(GpuLeaseHandler):
    """Base of the handlers that change one of this Jupyter user's own leases."""

    async def own_lease(self, lease_id: str, verb: str) -> dict[str, Any]:
        """The lease, checked: a well-formed id, and the configured lease user owns it.

        Owners only, even when the configured token is an admin's: a button in the page must never
        revoke or keep a colleague's lease (admins use the gpulease CLI for that).
        """
        self.check_args()
        if not LEASE_ID_RE.match(lease_id):
            raise errors.BadRequest(f"lease id must be 1 to 64 letters, digits, '.', '_' or '-', got {lease_id!r}")
        lease: dict[str, Any] = await self.api.request("GET", f"/leases/{lease_id}")
        me = (await self.api.whoami()).get("user")
        if lease["user"] != me:
            raise errors.NotOwner(
                f"lease {lease_id} belongs to {lease['user']}, not to {me}; only its owner can {verb} it"
            )
        return lease


class LeaseHandler(OwnLeaseHandler):
    """Read one of this Jupyter user's leases, live or recently ended (the status bar reads whom
    a warm lease was lent to), or release it (idempotent)."""

    @tornado.web.authenticated
    @authorized
    async def get(self, lease_id: str) -> None:
        self.reply(_public(await self.own_lease(lease_id, "read")))

    @tornado.web.authenticated
    @authorized
    async def delete(self, lease_id: str) -> None:
        await self.own_lease(lease_id, "release")
        # The reason lands in the ended record's end_reason (ended_by names the lease user), so
        # "why did my call lose its GPUs" has an answer: someone pressed Release on the board.
        ended = await self.api.request("DELETE", f"/leases/{lease_id}", params={"reason": BOARD_RELEASE_REASON})
        self.log.info("gpulease: %s released from JupyterLab by %s", lease_id, self.current_user.username)
        self.reply(_public(ended))


class KeepHandler(OwnLeaseHandler):
    """ "Still using it": reset the idle clock of one of this Jupyter user's idle-warned leases.

    The lease server limits how often a lease can be kept (409 ``conflict`` once that is used up,
    with a message that says so); its answer, without the fencing token, is passed on.
    """

    @tornado.web.authenticated
    @authorized
    async def post(self, lease_id: str) -> None:
        await self.own_lease(lease_id, "keep")
        kept = await self.api.request("POST", f"/leases/{lease_id}/keep")
        self.log.info(
            "gpulease: %s kept (still in use) from JupyterLab by %s, %s time(s)",
            lease_id,
            self.current_user.username,
            kept.get("extensions", "?"),
        )
        self.reply(_public(kept))


def _is_time(value: str) -> bool:
    if NUMBER_RE.match(value):
        return True
    try:
        return datetime.fromisoformat(value).tzinfo is not None
    except ValueError:
        return False


def booking_fields(data: dict[str, Any], *, partial: bool) -> dict[str, Any]:
    """The fields of a booking from the page, checked for names and JSON types (400 otherwise).

    The lease server checks the values themselves and says what to fix; here only what would
    make no sense to pass on: an unknown field (a typo would silently be ignored), a wrong type,
    a time without an offset (its meaning depends on a clock's zone), a missing pool/gpus/start/end.
    """
    unknown = sorted(set(data) - set(BOOKING_FIELDS))
    if unknown:
        raise errors.BadRequest(
            f"unknown booking field(s) {', '.join(unknown)}; a booking has {', '.join(BOOKING_FIELDS)}"
        )
    if not partial:
        missing = [f for f in ("pool", "gpus", "start", "end") if f not in data]
        if missing:
            raise errors.BadRequest(f"a booking needs {', '.join(missing)}")
    elif not data:
        raise errors.BadRequest(f"nothing to change: give any of {', '.join(BOOKING_FIELDS)}")
    for name, value in data.items():
        types, what = BOOKING_FIELDS[name]
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if isinstance(value, float) and not math.isfinite(value):
            wrong = True
        if isinstance(value, str) and name in ("start", "end") and not _is_time(value):
            wrong = True
        if wrong:
            raise errors.BadRequest(f"{name} must be {what}, got {json.dumps(value)[:80]}")
    return data


def may_change(booking: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the page may change a booking: its owner, who made it, or a member of its team.

    The lease server's ``mine`` is also true for every booking when the token is an admin's; the
    page never changes a colleague's booking (admins use the gpulease CLI for that), as with leases.
    """
    user, owner = me.get("user"), str(booking.get("owner", ""))
    own = user in (owner, booking.get("created_by")) or (
        owner.startswith("team:") and owner[5:] in (me.get("teams") or [])
    )
    return bool(booking.get("mine")) and own


class BookingBase(GpuLeaseHandler):
    """Base of the booking handlers: ``mine`` in every answer says what this page may change."""

    async def as_mine(self, answer: dict[str, Any]) -> dict[str, Any]:
        me = await self.api.whoami()
        if "bookings" in answer:
            return {**answer, "bookings": [{**b, "mine": may_change(b, me)} for b in answer["bookings"]]}
        if "id" in answer and "owner" in answer:
            return {**answer, "mine": may_change(answer, me)}
        return answer  # a dry run's {"fits", "node"}

    def checked_id(self, booking_id: str) -> str:
        self.check_args()
        if not BOOKING_ID_RE.match(booking_id):
            raise errors.BadRequest(f"booking id must be 1 to 64 letters, digits, '.', '_' or '-', got {booking_id!r}")
        return booking_id

    async def own_booking(self, booking_id: str, verb: str) -> dict[str, Any]:
        """The booking, checked: a well-formed id, and this page may change it (see may_change)."""
        booking: dict[str, Any] = await self.api.request("GET", f"/bookings/{self.checked_id(booking_id)}")
        me = await self.api.whoami()
        if not may_change(booking, me):
            raise errors.NotOwner(
                f"booking {booking_id} belongs to {booking.get('owner')}, not to {me.get('user')}; "
                f"only its owner can {verb} it"
            )
        return booking


class BookingsHandler(BookingBase):
    """Everyone's bookings (GET ?pool=&from=&to=), and booking GPUs (POST; ?dry_run=true only checks).

    A booking that does not fit is the lease server's 409 ``reservation_clash``, passed on with its
    details: the clashing bookings, how many GPUs would fit, and the nearest windows that do.
    """

    @property
    def allowed_args(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({"pool", "from", "to"} if self.request.method == "GET" else {"dry_run"})

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.check_args()
        params = {}
        pool = self.pool_arg()
        if pool is not None:
            params["pool"] = pool
        for name in ("from", "to"):
            value = self.time_arg(name)
            if value is not None:
                params[name] = value
        self.reply(await self.as_mine(await self.api.request("GET", "/bookings", params=params or None)))

    @tornado.web.authenticated
    @authorized
    async def post(self) -> None:
        self.check_args()
        dry_run = self.flag("dry_run")
        booking = booking_fields(self.json_object(), partial=False)
        params = {"dry_run": "true"} if dry_run else None
        answer = await self.api.request("POST", "/bookings", params=params, json=booking)
        if not dry_run:
            self.log.info(
                "gpulease: %s booked from JupyterLab by %s: %s GPU(s) of %s",
                answer.get("id"),
                self.current_user.username,
                answer.get("gpus"),
                answer.get("pool"),
            )
        self.reply(await self.as_mine(answer), 200 if dry_run else 201)


class BookingHandler(BookingBase):
    """One booking: read it (anyone), change it (PATCH, any subset of the fields; ?dry_run=true only
    checks that the change fits) or cancel it (DELETE)."""

    @property
    def allowed_args(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({"dry_run"} if self.request.method == "PATCH" else ())

    @tornado.web.authenticated
    @authorized
    async def get(self, booking_id: str) -> None:
        self.reply(await self.as_mine(await self.api.request("GET", f"/bookings/{self.checked_id(booking_id)}")))

    @tornado.web.authenticated
    @authorized
    async def patch(self, booking_id: str) -> None:
        self.check_args()
        dry_run = self.flag("dry_run")
        changes = booking_fields(self.json_object(), partial=True)
        await self.own_booking(booking_id, "change")
        params = {"dry_run": "true"} if dry_run else None
        changed = await self.api.request("PATCH", f"/bookings/{booking_id}", params=params, json=changes)
        if not dry_run:
            self.log.info(
                "gpulease: %s changed from JupyterLab by %s: %s",
                booking_id,
                self.current_user.username,
                ", ".join(sorted(changes)),
            )
        self.reply(await self.as_mine(changed))

    @tornado.web.authenticated
    @authorized
    async def delete(self, booking_id: str) -> None:
        await self.own_booking(booking_id, "cancel")
        cancelled = await self.api.request("DELETE", f"/bookings/{booking_id}")
        self.log.info("gpulease: %s cancelled from JupyterLab by %s", booking_id, self.current_user.username)
        self.reply(await self.as_mine(cancelled))


class BookingEndHandler(BookingBase):
    """ "I'm done": end the current occurrence of one of my bookings early; its GPUs go back to the pool."""

    @tornado.web.authenticated
    @authorized
    async def post(self, booking_id: str) -> None:
        await self.own_booking(booking_id, "end")
        ended = await self.api.request("POST", f"/bookings/{booking_id}/end")
        self.log.info("gpulease: %s ended early from JupyterLab by %s", booking_id, self.current_user.username)
        self.reply(await self.as_mine(ended))


class QueueHandler(GpuLeaseHandler):
    """Requests waiting for GPUs, with their positions (?pool= for one pool)."""

    allowed_args = frozenset({"pool"})

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.check_args()
        pool = self.get_query_argument("pool", None)
        self.reply(await self.api.request("GET", "/queue", params={"pool": pool} if pool is not None else None))


class UsageSummaryHandler(GpuLeaseHandler):
    """Per-day GPU use from the lease server's hourly rollups (its GET /usage/summary), for the Usage tab.

    The lease server decides what this Jupyter server's lease user may see (with
    ``usage_own_rows_only``, only their own rows): the arguments are checked for form and passed on,
    never widened. Its 400s (a range over 400 days, ``to`` before ``from``, an unknown pool or user)
    come back as they are, with its message that says what would work.
    """

    allowed_args = frozenset({"from", "to", "by", "also_by", "pool", "user"})

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.check_args()
        params: dict[str, str] = {}
        for name in ("from", "to"):
            value = self.time_arg(name)
            if value is not None:
                params[name] = value
        for name in ("by", "also_by"):
            by = self.get_query_argument(name, None)
            if by is not None:
                if by not in USAGE_BY:
                    raise errors.BadRequest(f"{name} must be one of {', '.join(USAGE_BY)}, got {by!r}")
                params[name] = by
        pool = self.pool_arg()
        if pool is not None:
            params["pool"] = pool
        user = self.get_query_argument("user", None)
        if user is not None:
            if not NAME_RE.match(user):
                raise errors.BadRequest(
                    f"user must be a lease user name (a letter or digit, then letters, digits, '.', '_', '-'), "
                    f"got {user!r}"
                )
            params["user"] = user
        self.reply(await self.api.request("GET", "/usage/summary", params=params or None))


class UsageBalanceHandler(GpuLeaseHandler):
    """This Jupyter server's lease user's balance (quota left, place in fair share, next wait), per
    pool or ``?pool=``: the lease server's GET /usage/balance, which answers only for the caller."""

    allowed_args = frozenset({"pool"})

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.check_args()
        pool = self.pool_arg()
        self.reply(await self.api.request("GET", "/usage/balance", params={"pool": pool} if pool is not None else None))


class EventsHandler(GpuLeaseHandler):
    """The lease server's event stream, passed through as server-sent events.

    The browser's EventSource sends Last-Event-ID when it reconnects; it is passed on, so the lease
    server replays what the page missed. The stream ends when the browser goes away, the lease
    server ends it, or the Jupyter server stops; EventSource then reconnects by itself.
    """

    allowed_args = frozenset({"since", "changes"})

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.check_args()
        since = self.request.headers.get("Last-Event-ID") or self.get_query_argument("since", None)
        if since is not None and not SINCE_RE.match(since):
            raise errors.BadRequest(f"since (or Last-Event-ID) must be an event id like 1700000000000-0, got {since!r}")
        changes = self.get_query_argument("changes", None)  # (the lease server checks it)
        self._gone = asyncio.Event()
        async with self.api.events(since, changes) as chunks:  # errors before the first byte are plain JSON
            self.set_header("Content-Type", "text/event-stream")
            self.set_header("Cache-Control", "no-store")
            self.set_header("X-Accel-Buffering", "no")  # a proxy in front must not buffer the stream
            self.ext.streams.add(self._gone)
            pump = asyncio.ensure_future(self._pump(chunks))
            gone = asyncio.ensure_future(self._gone.wait())
            try:
                await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.ext.streams.discard(self._gone)
                for task in (pump, gone):
                    task.cancel()
                await asyncio.gather(pump, gone, return_exceptions=True)
        self.finish(set_content_type="text/event-stream")

    async def _pump(self, chunks: Any) -> None:
        try:
            async for chunk in chunks:
                self.write(chunk)
                await self.flush()
        except tornado.iostream.StreamClosedError:
            self._gone.set()
        except httpx.HTTPError as exc:  # the lease server went away mid-stream
            log.info("gpulease: the lease server's event stream ended: %s: %s", type(exc).__name__, exc)

    def on_connection_close(self) -> None:
        gone = getattr(self, "_gone", None)
        if gone is not None:
            gone.set()


class NotFoundHandler(GpuLeaseHandler):
    """Any other path under /gpulease/: a JSON 404 that lists what exists."""

    async def prepare(self) -> None:  # type: ignore[override]
        await super().prepare()
        if not self.current_user:
            self.get_login_url()  # raises 401, as @authenticated would
        raise errors.NotFound(
            f"no such endpoint {self.request.method} {self.request.path}; the gpulease API has "
            "GET version, cluster, leases, leases/<id>, queue, events, bookings, bookings/<id>, usage/summary, "
            "usage/balance, DELETE leases/<id>, "
            "POST leases/<id>/keep, POST bookings, PATCH and DELETE bookings/<id>, "
            "POST bookings/<id>/end"
        )


def routes(base_url: str) -> list[tuple[str, type[GpuLeaseHandler]]]:
    def at(*parts: str) -> str:
        return url_path_join(base_url, NAMESPACE, *parts)

    return [
        (at("version"), VersionHandler),
        (at("cluster"), ClusterHandler),
        (at("leases"), LeasesHandler),
        (at("leases", "([^/]+)"), LeaseHandler),
        (at("leases", "([^/]+)", "keep"), KeepHandler),
        (at("bookings"), BookingsHandler),
        (at("bookings", "([^/]+)"), BookingHandler),
        (at("bookings", "([^/]+)", "end"), BookingEndHandler),
        (at("queue"), QueueHandler),
        (at("usage", "summary"), UsageSummaryHandler),
        (at("usage", "balance"), UsageBalanceHandler),
        (at("events"), EventsHandler),
        (at("(.*)"), NotFoundHandler),
    ]
