"""The HTTP API (tornado): JSON in, JSON out, errors as ``{"code", "message"}`` with a 4xx.

Stateless: every request reads and changes Redis only through :class:`LeaseStore`, so any number
of server processes can serve the same Redis. Each process also runs the sweeper (expiry, dead
nodes); sweeps are atomic scripts, so replicas sweeping at once do no harm.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import functools
import json
import logging
import os
import socket
import time
from dataclasses import asdict, replace
from typing import Any, cast

import tornado.httputil
import tornado.iostream
import tornado.web
from redis.asyncio import Redis
from redis.exceptions import ResponseError as RedisResponseError

from .. import __version__, errors, protocol
from ..config import Settings
from ..leasing import board, events, inventory, params, reclaim, usage, values
from ..leasing import bodies as request_bodies
from ..leasing.bookings import MAX_LIST_SPAN_S, Bookings, public_booking
from ..leasing.lease import WITHDRAWN, LeaseStore, new_lease_id, public_lease, public_withdrawal
from ..leasing.queue import queue_view
from ..leasing.reaper import Reaper
from ..node import drain, memwatch
from ..node.claims import Claim, Peer, peer_of
from ..node.rayauth import info_token
from ..procs import account_name
from ..protocol import LeaseJson
from ..request import AcquireRequest, lone_surrogate
from ..store import layout
from ..store.engine import Engine, connect, not_now
from ..store.scripts import LeaseRecord, lease_record
from . import metrics
from .auth import ACT_AS_HEADER, Authenticator, Identity, create_token, list_tokens, revoke_token, view_token
from .limits import MIN_READ_COST, ReadLimits, hold, read_sliced, token_key
from .openapi import openapi_document

log = logging.getLogger(__name__)
API = "/api/v1"
RETRY_AFTER_S = 1  # a 503's Retry-After: a failover or a restart takes a second or a few


async def dumps_sliced(data: Any, every: int = 20) -> str:
    """``json.dumps(data, separators=(",", ":"))``, with the event loop let go after every ``every``
    items of a long list in it (a large answer is tens of milliseconds to encode at once)."""
    if isinstance(data, dict):
        parts = [f"{json.dumps(str(k))}:{await dumps_sliced(v, every)}" for k, v in data.items()]
        return "{" + ",".join(parts) + "}"
    if isinstance(data, list) and len(data) > every:
        items: list[str] = []
        for i in range(0, len(data), every):
            items.extend(json.dumps(x, separators=(",", ":")) for x in data[i : i + every])
            await asyncio.sleep(0)
        return "[" + ",".join(items) + "]"
    return json.dumps(data, separators=(",", ":"))


def as_lease_error(exc: BaseException | None) -> BaseException | None:
    """Redis down, restarting, loading its AOF or failing over (engine.not_now): 503, never 500."""
    return not_now(exc) or exc


class Context:
    """Everything a handler needs, built once per process and put in the app's settings."""

    def __init__(self, settings: Settings, redis: Redis | None = None) -> None:
        self.settings = settings
        # A pooled connection that Redis dropped (restart, failover) is retried on a fresh one.
        # Every script is safe to resend: a resent acquire finds its own lease id, a resent
        # release finds the lease ended.
        self.redis = redis or connect(settings.redis_url)
        self.engine = Engine(self.redis, settings)
        self.streams: collections.Counter[str] = collections.Counter()  # user, "~token id" -> streams here
        self.store = LeaseStore(self.engine)
        self.bookings = Bookings(self.engine)
        self.auth = Authenticator(self.redis, self.store.keys, self.store.notifier)
        self.hub = events.EventHub(self.redis, self.store.keys.events)
        self.node_watch = events.NodeWatch(self.hub)  # node agents' long-polls of their draining GPUs
        self.cluster = board.ClusterViews(self.engine)  # one read of the inventory for every board here
        # /metrics needs no token: where users may see only their own usage, it names no user
        top = 0 if settings.usage_own_rows_only else settings.metrics_top_users
        self.metrics = metrics.Metrics(self.engine, settings.metrics_cache_s, top_users=top, views=self.cluster)
        self.limits = ReadLimits(settings)
        self.reaper = Reaper(self.store)
        self._tokens: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await layout.check(self.redis, self.engine.keys, " --redis-url URL")  # refuses a layout it does not know
        self.engine.expect_data()  # the layout key is there now: a primary without it lost the data
        await self.store.start()
        self.reaper.start()
        # every change of tokens (here or on another server): open event streams check theirs
        self._tokens = asyncio.create_task(self.auth.follow(), name="gpulease-token-changes")

    async def stop(self) -> None:
        if self._tokens is not None:
            self._tokens.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tokens
        await self.reaper.stop()
        await self.hub.stop()
        await self.store.close()
        await self.redis.aclose()


@tornado.web.stream_request_body
class BaseHandler(tornado.web.RequestHandler):
    """Authenticates, bounds and parses bodies, and turns errors into JSON.

    The body is streamed (``stream_request_body``): tornado calls :meth:`prepare` once the headers
    are in, before reading any of the body, so a Content-Length over ``max_body_bytes`` is a 413 and
    a request without a valid token a 401 with nothing of its body read (the connection is then
    closed); a chunked body is a 413 at its first chunk past the limit. Subclasses that override
    ``on_connection_close`` must call this one's: it ends the wait for a body that will never come.
    """

    identity: Identity  # whom the request acts for
    token_identity: Identity  # its token's own (a proxy's, when it acts for someone)
    public = False  # no token needed (health, metrics, OpenAPI)

    @property
    def ctx(self) -> Context:
        return self.application.settings["gpulease"]  # type: ignore[no-any-return]

    @property
    def store(self) -> LeaseStore:
        return self.ctx.store

    @property
    def engine(self) -> Engine:
        return self.ctx.engine

    @property
    def teams(self) -> tuple[str, ...]:
        return self.ctx.settings.teams_of(self.identity.user)

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.set_header("Cache-Control", "no-store")

    async def prepare(self) -> None:
        self._t0 = time.perf_counter()
        self._chunks: list[bytes] = []
        self._received = 0
        # An answer given here leaves the body unread: the connection is then closed (and says so)
        self._unread_body = has_body(self.request)
        try:
            await self._admit()
        except errors.GpuLeaseError:
            if self._unread_body:  # a body refused unread: only a broken or hostile client sends it again
                await hold(self.gone, self.ctx.settings.refusal_hold_s)
            raise
        self._unread_body = False  # tornado reads it next, before the method runs

    async def _admit(self) -> None:
        length = self.request.headers.get("Content-Length")
        limit = self.ctx.settings.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise errors.PayloadTooLarge(f"request body is larger than {limit} bytes; send a small JSON object")
        if not self.public:
            ident = self.token_identity = await self.ctx.auth.identify(self.request.headers.get("Authorization"))
            if ident.role == "user" and self.ctx.settings.multi_user:
                self._check_account(ident.user)
            self.identity = await self.ctx.auth.act_as(ident, self.request.headers.get(ACT_AS_HEADER))

    def _check_account(self, user: str) -> None:
        """Under multi_user, on the server's unix socket (where the kernel names the peer's uid), a
        user token is taken only from its owner's account: a token read off someone else's worker
        or environment acts for nobody from another account. Root and the server's own user pass
        (an admin's tools, the server's own). Over TCP nothing tells who connected: not checked."""
        sock = getattr(getattr(self.request.connection, "stream", None), "socket", None)
        if sock is None or sock.family != socket.AF_UNIX:
            return
        peer = peer_of(sock)
        uid = peer.uid if peer is not None else -1  # (gone already: it reads no answer; refused anyway)
        if uid in (0, os.geteuid()):
            return
        account, theirs = account_name(uid), self.ctx.settings.account_of(user)
        if account != theirs:
            raise errors.Forbidden(
                f"this token is {user}'s, sent by a process of account {account or f'uid {uid}'}: only "
                f"{theirs}'s processes may use it (multi_user); use your own token"
            )

    def data_received(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._finished:
            return
        limit = self.ctx.settings.max_body_bytes
        if self._received > limit:  # a chunked body (a Content-Length over the limit never gets here)
            self._chunks.clear()
            self._unread_body = True
            too_large = errors.PayloadTooLarge(f"request body is larger than {limit} bytes; send a small JSON object")
            self.send_error(too_large.status, exc_info=(type(too_large), too_large, None))
            return
        self._chunks.append(chunk)

    @functools.cached_property
    def gone(self) -> asyncio.Event:
        """Set once the client has gone away (a throttled read stops waiting then)."""
        return asyncio.Event()

    def on_connection_close(self) -> None:
        super().on_connection_close()
        self.gone.set()

    @property
    def token_key(self) -> str:
        """The request's token as the per-token limits know it."""
        return token_key(self.request.headers.get("Authorization"))

    def body(self, declared: request_bodies.Body | None = None) -> dict[str, Any]:
        """The JSON object sent, checked against its declaration (unknown fields, types, bounds)."""
        data = self._json_body()
        return declared.check(data) if declared is not None else data

    @property
    def bodies(self) -> request_bodies.Bodies:
        return request_bodies.bodies(self.ctx.settings)

    def query(self, param: params.Param, default: Any = None) -> Any:
        """A query parameter (or header) read as declared; ``default`` when absent."""
        raw = (
            self.request.headers.get(param.name)
            if param.where == "header"
            else self.get_query_argument(param.name, None)
        )
        value = param.read(raw)
        return default if value is None else value

    def _json_body(self) -> dict[str, Any]:
        raw = b"".join(self._chunks)
        if len(raw) > self.ctx.settings.max_body_bytes:
            raise errors.PayloadTooLarge(
                f"request body is larger than {self.ctx.settings.max_body_bytes} bytes; send a small JSON object"
            )
        if not raw:  # no body; one of whitespace only is not JSON (the document calls it invalid)
            return {}
        try:
            # strict UTF-8 first: json.loads would take UTF-16 or UTF-32 too, and encoded surrogates
            data = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise errors.BadRequest(f"body is not valid JSON ({exc}); send a JSON object") from exc
        except RecursionError:
            raise errors.BadRequest("body is nested too deeply to read; send a flat JSON object") from None
        except ValueError:  # an integer past Python's digit limit (4,300 digits)
            raise errors.BadRequest("body has a number too long to read; send a JSON object of plain values") from None
        if not isinstance(data, dict):
            raise errors.BadRequest('body must be a JSON object, e.g. {"gpus": 1}')
        lone = lone_surrogate(raw, data)
        if lone is not None:
            raise errors.BadRequest(f"body holds a lone UTF-16 surrogate ({lone}); send text as UTF-8")
        return data

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data, separators=(",", ":")))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, errors.GpuLeaseError) and value.status < 500:
            return
        if not_now(value) is not None:
            log.warning("%s %s: Redis cannot answer now (%s)", self.request.method, self.request.path, value)
            return
        if isinstance(value, errors.ServerUnavailable):  # e.g. the replicas did not acknowledge: retried
            log.warning("%s %s: %s", self.request.method, self.request.path, value)
            return
        super().log_exception(typ, value, tb)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = as_lease_error(kwargs.get("exc_info", (None, None, None))[1])
        if isinstance(exc, errors.GpuLeaseError):
            self.set_status(exc.status)
            body = exc.to_json()
            if exc.status == 503:
                self.set_header("Retry-After", str(RETRY_AFTER_S))
            elif exc.status == 429 and "retry_after" in exc.details:
                self.set_header("Retry-After", str(exc.details["retry_after"]))
        elif isinstance(exc, tornado.web.HTTPError) and exc.status_code == 405:
            allowed = self.allowed_methods()
            # RFC 9110: a 405 names the methods the resource supports.
            self.set_header("Allow", ", ".join(allowed))
            body = {
                "code": "method_not_allowed",
                "message": f"{self.request.method} is not supported on {self.request.path}; "
                f"use {', '.join(allowed) or 'another endpoint'} (see {API}/openapi.json)",
            }
        elif isinstance(exc, tornado.web.HTTPError):
            body = {"code": "http_error", "message": exc.log_message or self._reason}
        else:
            body = {"code": "internal", "message": "internal error; the server log has the details"}
        if getattr(self, "_unread_body", False):  # tornado closes it after the answer: no reuse
            self.set_header("Connection", "close")
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(body))

    @classmethod
    def allowed_methods(cls) -> list[str]:
        """The methods this resource implements (the document declares exactly these)."""
        return [
            m
            for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
            if getattr(cls, m.lower()) is not getattr(tornado.web.RequestHandler, m.lower())
        ]

    def on_finish(self) -> None:
        self.ctx.metrics.observe(self, time.perf_counter() - getattr(self, "_t0", time.perf_counter()))

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        exc = as_lease_error(kwargs.get("exc_info", (None, None, None))[1])
        if isinstance(exc, errors.GpuLeaseError):
            status_code = exc.status
        super().send_error(status_code, **kwargs)


class LeasesHandler(BaseHandler):
    async def post(self) -> None:
        request = AcquireRequest.parse(self._json_body(), self.ctx.settings)
        if request.priority == "high" and not self._may_ask_high():
            allowed = self.ctx.settings.high_priority
            who = "admins only (high_priority names no one)"
            if allowed:
                names = ", ".join(allowed[:3]) + (f" and {len(allowed) - 3} more" if len(allowed) > 3 else "")
                who = f"{names} and admins (high_priority)"
            raise errors.Forbidden(f"priority high is for {who}\n  ask without --priority, or ask an admin to add you")
        if request.id is None:
            request = replace(request, id=new_lease_id())
        self._lease_id = request.id
        rec = await self.store.acquire(self.identity.user, request, teams=self.teams)
        self.set_header("Location", f"{API}/leases/{rec['id']}")
        self.reply(public_lease(rec, with_token=True), 201)

    def _may_ask_high(self) -> bool:
        allowed = self.ctx.settings.high_priority
        return (
            self.identity.role == "admin"
            or self.identity.user in allowed
            or any(f"team:{t}" in allowed for t in self.teams)
        )

    def on_connection_close(self) -> None:
        # The client went away while queued: leave the queue (a grant that won the race is
        # released, since nobody will ever renew or use it).
        super().on_connection_close()
        lid = getattr(self, "_lease_id", None)
        if lid is not None and not self._finished:
            asyncio.ensure_future(self._abandon(lid))

    async def _abandon(self, lid: str) -> None:
        with contextlib.suppress(errors.GpuLeaseError):
            try:
                await self.store.cancel_wait(self.identity.user, lid, reason="cancelled")
            except errors.NoCapacity:
                return
            await self.store.release(lid, self.identity.user, reason="client went away before the grant arrived")

    async def get(self) -> None:
        everyone = self.query(params.ALL, False)
        if everyone:
            leases = await self.store.live_leases()
        else:
            # Every open board asks for its user's leases after each event: found in the shared view
            # of the cluster, then read by id, not by decoding every live lease of the cluster.
            snap = await self.ctx.cluster.get()
            ids = snap.lease_ids_of(self.identity.user)
            raws: Any = await self.ctx.redis.hmget(self.store.keys.leases, ids) if ids else []
            leases = [lease_record(raw) for raw in raws if raw]
        leases.sort(key=lambda rec: rec["created_at"])
        me = self.identity
        self.reply({"leases": [public_lease(rec, with_token=rec["user"] == me.user) for rec in leases]})


class LeaseHandler(BaseHandler):
    async def get(self, lease_id: str) -> None:
        rec = await self.store.get(lease_id)
        self.reply(public_lease(rec, with_token=rec["user"] == self.identity.user, detail=True))

    async def delete(self, lease_id: str) -> None:
        body = self.body(self.bodies.release)
        token = body.get("token", self.query(params.TOKEN_ARG))
        reason = body.get("reason", self.query(params.REASON_ARG, ""))  # e.g. "kernel shut down"
        verified = bool(body.get("verified", self.query(params.VERIFIED_ARG, False)))
        me = self.identity
        ended, changed = await self.store.release(
            lease_id, me.user, admin=me.admin, token=token, revoke=None, reason=reason, verified=verified
        )
        self.reply(_ended_view(ended, changed, with_token=ended["user"] == me.user))


def _ended_view(rec: LeaseRecord | dict[str, Any], changed: bool, *, with_token: bool) -> LeaseJson | dict[str, Any]:
    """The answer of a DELETE or revoke: the ended lease, or the request it withdrew from the queue."""
    if rec.get("state") == WITHDRAWN:
        return {**public_withdrawal(dict(rec)), "changed": changed}
    out = public_lease(cast(LeaseRecord, rec), with_token=with_token)
    out["changed"] = changed
    return out


class RenewHandler(BaseHandler):
    async def post(self, lease_id: str) -> None:
        body = self.body(self.bodies.renew)
        me = self.identity
        rec = await self.store.renew(
            lease_id, body.get("token"), me.user, admin=me.admin, ttl=body.get("ttl"), activity=body.get("activity")
        )
        self.reply(public_lease(rec, with_token=rec["user"] == me.user))


class HandoffHandler(BaseHandler):
    """The owner ends a lease and its GPUs go, in the same step, to the owner's next queued request."""

    async def post(self, lease_id: str) -> None:
        body = self.body(self.bodies.handoff)
        me = self.identity
        got = await self.store.handoff(lease_id, me.user, body.get("token"), body["to"])
        self.reply(
            {"ended": public_lease(got.ended, with_token=True), "lease": public_lease(got.lease, with_token=True)}
        )


class ResizeHandler(BaseHandler):
    """The owner grows an elastic lease on its node, when that delays no one (``grow``), or gives
    back some of a lease's GPUs, the queue served at once."""

    def initialize(self, grow: bool) -> None:  # type: ignore[override]
        self.grow = grow

    async def post(self, lease_id: str) -> None:
        body = self.body(self.bodies.grow if self.grow else self.bodies.shrink)
        rec = await self.store.resize(
            lease_id, self.identity.user, body["token"], body["gpus"], body.get("size"), grow=self.grow
        )
        self.reply(public_lease(rec, with_token=True))


class WarmHandler(BaseHandler):
    """The owner keeps a finished cell's lease warm (its worker stays for the next cell; its GPUs
    are lent to whoever would otherwise wait), or runs a cell on it again."""

    async def post(self, lease_id: str) -> None:
        body = self.body(self.bodies.warm)
        rec = await self.store.warm(lease_id, self.identity.user, body["token"], body["warm"])
        self.reply(public_lease(rec, with_token=True))


class SuspendHandler(BaseHandler):
    """The owner hands back a warm one-GPU lease with its worker suspended to host memory: the GPU
    is free once the node agent has it off the GPU; the next cell restores it under a new lease."""

    async def post(self, lease_id: str) -> None:
        body = self.body(self.bodies.suspend)
        rec = await self.store.suspend(lease_id, self.identity.user, body["token"])
        self.reply(public_lease(rec, with_token=False))


class RevokeHandler(BaseHandler):
    async def post(self, lease_id: str) -> None:
        me = self.identity
        if not me.admin:
            raise errors.Forbidden("only an admin can revoke a lease; owners release theirs with DELETE")
        body = self.body(self.bodies.revoke)
        reason = body.get("reason") or f"revoked by admin {me.user}"
        ended, changed = await self.store.release(lease_id, me.user, admin=True, revoke=True, reason=reason)
        self.reply(_ended_view(ended, changed, with_token=False))


class BookingsHandler(BaseHandler):
    """POST /bookings: book; GET /bookings: everyone's bookings in a window."""

    collection = protocol.BOOKINGS  # where a new booking is (its Location)
    listed_as = "bookings"  # the field of GET's answer that lists them

    async def post(self) -> None:
        me = self.identity
        dry = self.query(params.DRY_RUN, False)
        body = self.body(self.bodies.booking)
        rec = await self.ctx.bookings.create(me.user, body, admin=me.admin, teams=self.teams, dry_run=dry)
        if dry:
            self.reply(rec)
            return
        self.set_header("Location", f"{self.collection}/{rec['id']}")
        self.reply(public_booking(rec, user=me.user, admin=me.admin, teams=self.teams), 201)

    async def get(self) -> None:
        pool = self.query(params.POOL)
        now = int(time.time() * 1000)
        lo = self.query(params.FROM, now - 86_400_000)
        hi = self.query(params.TO, now + 14 * 86_400_000)
        if hi <= lo or hi - lo > MAX_LIST_SPAN_S * 1000:
            raise errors.BadRequest("to must be after from, and at most 366 days later")
        me = self.identity
        recs = await self.ctx.bookings.find(pool, lo, hi)
        self.reply(
            {
                self.listed_as: [
                    public_booking(r, user=me.user, admin=me.admin, teams=self.teams, lo_ms=lo, hi_ms=hi, now_ms=now)
                    for r in recs
                ],
                "now": now / 1000,
                "from": lo / 1000,
                "to": hi / 1000,
            }
        )


class BookingHandler(BaseHandler):
    async def get(self, booking_id: str) -> None:
        me = self.identity
        rec = await self.ctx.bookings.get(booking_id)
        self.reply(public_booking(rec, user=me.user, admin=me.admin, teams=self.teams))

    async def patch(self, booking_id: str) -> None:
        me = self.identity
        dry = self.query(params.DRY_RUN, False)
        body = self.body(self.bodies.booking_change)
        rec = await self.ctx.bookings.update(booking_id, me.user, body, admin=me.admin, teams=self.teams, dry_run=dry)
        self.reply(rec if dry else public_booking(rec, user=me.user, admin=me.admin, teams=self.teams))

    async def delete(self, booking_id: str) -> None:
        me = self.identity
        rec = await self.ctx.bookings.cancel(booking_id, me.user, admin=me.admin, teams=self.teams)
        self.reply(public_booking(rec, user=me.user, admin=me.admin, teams=self.teams))


class BookingEndHandler(BaseHandler):
    async def post(self, booking_id: str) -> None:
        me = self.identity
        rec = await self.ctx.bookings.end(booking_id, me.user, admin=me.admin, teams=self.teams)
        self.reply(public_booking(rec, user=me.user, admin=me.admin, teams=self.teams))


class Deprecated(BaseHandler):
    """A path of the first releases, /reservations[/{id}[/end]], served as before until release
    ``protocol.REMOVED_IN``, with its successor under /bookings named in every answer (errors too:
    tornado sets the default headers again before an error's body), as RFC 9745 has it:
    ``Deprecation`` holds the date from which it is deprecated as a Structured Field Date (``@``
    and epoch seconds), ``Sunset`` (RFC 8594, an HTTP-date) when it stops answering, and a ``Link``
    with ``rel="successor-version"`` names the path that replaces it."""

    def set_default_headers(self) -> None:
        super().set_default_headers()
        self.set_header("Deprecation", f"@{protocol.DEPRECATED_SINCE}")
        self.set_header("Sunset", email.utils.formatdate(protocol.SUNSET, usegmt=True))
        old = protocol.DEPRECATED_RESERVATIONS
        successor = protocol.BOOKINGS + self.request.path[len(old) :]  # the route matched old + [/id[/end]]
        self.set_header("Link", f'<{successor}>; rel="successor-version"')


# The deprecated routes' handlers keep their old class names: the metrics' route label is the
# name (reservations, reservation, reservationend), so their traffic reads as it did.


class ReservationsHandler(Deprecated, BookingsHandler):
    collection = protocol.DEPRECATED_RESERVATIONS
    listed_as = "reservations"


class ReservationHandler(Deprecated, BookingHandler):
    pass


class ReservationEndHandler(Deprecated, BookingEndHandler):
    pass


class UsageHandler(BaseHandler):
    async def get(self) -> None:
        by = self.query(params.BY, "user")
        pool = self.query(params.POOL)
        now = int(time.time() * 1000)
        lo = self.query(params.FROM, now - 7 * 86_400_000)
        hi = self.query(params.TO, now + 1)
        if hi <= lo:
            raise errors.BadRequest("to must be after from")
        # Read a slice at a time, counted against the token's read budget as the event log is:
        # a week of a department's ledger is up to event_log_max lines, which must neither hold this
        # server's loop nor be one token's to read as often as it likes.
        key = self.token_key
        # As /usage/summary: with usage_own_rows_only, a user who is not an admin sums only their
        # own leases (whatever `by`: their notebooks' names, their pools), never the team's.
        own = self.ctx.settings.usage_own_rows_only and self.identity.role != "admin"
        with await self.ctx.limits.admit(key, "GET /usage", self.gone):
            try:
                acc = await usage.summarize_ledger(
                    self.engine,
                    lo,
                    hi,
                    by,
                    pool,
                    lambda n: self.ctx.limits.charge(key, n, self.gone),
                    user=self.identity.user if own else None,
                )
            except tornado.iostream.StreamClosedError:  # the client went away during a throttled read
                return
        self.reply(
            {
                "by": by,
                "from": lo / 1000,
                "to": hi / 1000,
                "calls": acc.calls,
                "rows": acc.rows(),
                "scope": "own" if own else "all",
            }
        )


class UsageSummaryHandler(BaseHandler):
    """Per-day series and totals of the hourly rollups (docs/usage.md): the usage page and
    ``gpulease report``. Reads the rows of the window's hours, never the ledger lines, a slice at a
    time and counted against the token's read budget as GET /usage is (a department's week is
    ~100,000 rows: 1.7 s of this server's loop read at once). With ``usage_own_rows_only`` a user
    who is not an admin sees, and reads, only their own rows."""

    async def get(self) -> None:
        by = self.query(params.SUMMARY_BY, "user")
        also_by = self.query(params.SUMMARY_ALSO_BY)
        pool = self.query(params.POOL)
        user = self.query(params.SUMMARY_USER)
        lo, hi = usage.summary_window(self.query(params.FROM), self.query(params.TO), int(time.time() * 1000))
        me = self.identity.user
        own = self.ctx.settings.usage_own_rows_only and self.identity.role != "admin"
        if own and user not in (None, me):
            raise errors.Forbidden(
                f"this server shows a user only their own usage (usage_own_rows_only): ask for user={me}, "
                "or ask an admin for the team's"
            )
        key, limits = self.token_key, self.ctx.limits
        hint = "a shorter window (from=, to=), one pool (pool=)"
        read = 0

        # An admin's read is not held to the budget (a department's week over 100k rows took 40 s
        # at its rate): admins are trusted, and the slices keep the loop served meanwhile.
        admin = self.identity.role == "admin"

        async def charge(n: int) -> None:
            nonlocal read
            read += n
            if not admin:
                await limits.charge(key, n, self.gone)

        by_day: usage.DaySums = {}
        users: set[str] = set()
        pools: set[str] = set()
        with await limits.admit(key, "GET /usage/summary", self.gone, hint):
            try:
                # Own rows: only the caller's are read (their names are known), never another's.
                async for part in usage.rollup_slices(
                    self.engine,
                    lo,
                    hi,
                    user=me if own else None,
                    pools={pool} if own and pool is not None else None,
                    on_read=charge,
                ):
                    users.update(r[2] for r in part)
                    pools.update(r[1] for r in part)
                    usage.sum_days(
                        [r for r in part if (pool is None or r[1] == pool) and (user is None or r[2] == user)], by_day
                    )
                if read < MIN_READ_COST and not admin:  # the request costs too, however few rows it read
                    await limits.charge(key, MIN_READ_COST - read, self.gone)
            except tornado.iostream.StreamClosedError:  # the client went away during a throttled read
                return
        if pool is not None:
            pools |= set(await self.store.pool_sizes())
            if pool not in pools:
                raise errors.BadRequest(f"unknown pool {pool!r}: the pools are {_names(pools)}")
        if own:
            user = me
        elif user is not None and user != me and user not in users:
            # Known: a user with usage in the window, oneself, or (to an admin) a user with a token;
            # whether a name holds a token is not a user's business.
            admin = self.identity.role == "admin"
            if not admin or user not in {t["user"] for t in await list_tokens(self.ctx.redis, self.store.keys)}:
                raise errors.BadRequest(
                    f"unknown user {user!r}: no usage from {usage.iso(lo)} to {usage.iso(hi)}; "
                    f"users with usage then: {_names(users)} (or widen from/to)"
                )
        out = await usage.summarize_days_sliced(by_day, lo, hi, by, self.ctx.settings.teams_of, also_by=also_by)
        # (a department's week by user is ~2 MB of JSON: encoded a few groups at a time too)
        self.finish(await dumps_sliced({**out, "pool": pool, "user": user, "scope": "own" if own else "all"}))


class UsageBalanceHandler(BaseHandler):
    """The calling user's quota used and left, fair-share place and next wait, per pool (all pools,
    or ``?pool=``): what %gpu_lease shows. Only one's own: no parameter names another user."""

    async def get(self) -> None:
        pool = self.query(params.POOL)
        pools = sorted(await self.store.pool_sizes())
        if pool is not None:
            if pool not in pools:
                raise errors.BadRequest(f"unknown pool {pool!r}: the pools are {_names(set(pools))}")
            pools = [pool]
        now = int(time.time() * 1000)
        self.reply(await usage.balance(self.engine, self.identity.user, self.teams, pools, now))


def _names(names: set[str], most: int = 10) -> str:
    """A few names for a message: sorted, at most ``most``, "none" for none."""
    if not names:
        return "none"
    shown = sorted(names)[:most]
    return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "")


class EstimateHandler(BaseHandler):
    """Time to GPUs. ``?lease=ID`` (or ``?id=``) names the asking request when it already waits:
    then only the requests ahead of it count, and its own pool and size are the defaults."""

    async def get(self) -> None:
        lease = self.query(params.EST_LEASE)
        alias = self.query(params.EST_ID)
        if alias is not None and lease is not None and alias != lease:
            raise errors.BadRequest(f"id ({alias!r}) and lease ({lease!r}) name different requests; pass one")
        pool = self.query(params.EST_POOL)
        gpus = self.query(params.EST_GPUS)
        lease = lease or alias
        waiter: dict[str, Any] = {}
        if lease is not None:
            raw_w = await self.ctx.redis.hget(self.store.keys.waiters, lease)
            waiter = json.loads(raw_w) if raw_w else {}
        pool_s = pool or waiter.get("pool") or await self.store.default_pool()
        n = gpus if gpus is not None else int(waiter.get("gpus", 1))
        mem = self.query(params.EST_GPU_MEM)
        mem = mem if mem is not None else int(waiter.get("gpu_mem_mb") or 0)
        pools = await self.store.pool_sizes()
        if pool_s not in pools:  # in the acquire's words (the magic asks here before it ends a warm worker)
            known = ", ".join(sorted(pools)) or "none registered"
            raise errors.UnknownPool(f"unknown pool {pool_s!r}; known pools: {known}", pool=pool_s)
        if mem and not self.ctx.settings.sched_table(pool_s)["share"]:
            raise errors.no_slices(pool_s)
        nodes = self.query(params.EST_NODES)
        k = nodes if nodes is not None else int(waiter.get("nodes") or 1)
        AcquireRequest(gpus=n, nodes=k, gpu_mem_mb=mem or None).rules()  # its shape, as the acquire's is checked
        view = await self.ctx.cluster.view()
        sizes = [len(node["gpus"]) for node in view["nodes"] if node["pool"] == pool_s]
        # As the acquire itself answers: no wait would ever end, so none is estimated.
        able = sum(size >= n // k for size in sizes)
        if k > 1 and sizes and able < k:
            raise errors.Unsatisfiable.gang(pool_s, k, n // k, able)
        if not mem and k == 1 and 0 < max(sizes, default=0) < n:
            raise errors.Unsatisfiable.one_node(pool_s, n, max(sizes), len(sizes))
        now_ms, me = int(time.time() * 1000), self.identity.user
        self.reply(await usage.estimate(self.engine, pool_s, n, now_ms, lease, mem, view=view, asker=me))


class AgentHandler(BaseHandler):
    """Node agents' endpoints (the node is the route's first part): an agent or admin token is
    required, and an agent token serves only its own node (403 on another's)."""

    async def prepare(self) -> None:
        await super().prepare()
        if self.path_args:
            self._unread_body = has_body(self.request)  # a refusal here also answers before the body
            await self.ctx.auth.check_node(self.identity, self.path_args[0])
            self._unread_body = False

    def _check_role(self) -> None:
        if self.identity.role not in ("admin", "agent"):
            raise errors.Forbidden(
                f"{self.request.method} {self.request.path} is for node agents: only an agent or admin token may"
            )


class NodeHandler(AgentHandler):
    """An agent declares its node's GPUs."""

    async def put(self, node: str) -> None:
        self._check_role()
        values.check_name("node", node)
        inv = inventory.NodeInventory.from_body(node, self.body(self.bodies.inventory))
        status = await inventory.register(self.engine, inv)
        self.reply({"node": node, "status": status})


class HeartbeatHandler(AgentHandler):
    """An agent's heartbeat: the node stays up."""

    async def post(self, node: str) -> None:
        self._check_role()
        values.check_name("node", node)
        status = await inventory.register(self.engine, None, node)
        self.reply({"node": node, "status": status})


class KeepHandler(BaseHandler):
    """ "I'm still using it": reset the idle clock of a lease (owner or admin; limited)."""

    async def post(self, lease_id: str) -> None:
        me = self.identity
        rec = await reclaim.keep(self.engine, lease_id, me.user, me.admin)
        self.reply(public_lease(rec, with_token=rec["user"] == me.user))


class PoliciesHandler(BaseHandler):
    async def get(self) -> None:
        pols = await reclaim.policies(self.engine)
        self.reply({"policies": {name: asdict(p) for name, p in pols.items()}})


class PolicyHandler(BaseHandler):
    async def get(self, pool: str) -> None:
        pols = await reclaim.policies(self.engine)
        if pool not in pols:
            raise errors.UnknownPool(f"unknown pool {pool!r}; known pools: {', '.join(sorted(pols))}")
        self.reply({"pool": pool, **asdict(pols[pool])})

    async def put(self, pool: str) -> None:
        if not self.identity.admin:
            raise errors.Forbidden("only an admin can change the reclaim policy")
        values.check_name("pool", pool)
        new = await reclaim.set_policy(self.engine, pool, self.body(self.bodies.policy), self.identity.user)
        self.reply({"pool": pool, **asdict(new)})


class SamplesHandler(AgentHandler):
    """A node agent's GPU samples (utilization, memory, processes)."""

    async def post(self, node: str) -> None:
        self._check_role()
        values.check_name("node", node)
        body = self.body(self.bodies.samples)
        gpus = reclaim.check_samples_body(body)
        raw = await self.ctx.redis.hget(self.store.keys.nodes, node)
        if raw is None:
            raise errors.UnknownNode(f"node {node!r} is not registered: PUT {API}/nodes/{node} first")
        pool = json.loads(raw)["pool"]
        answer = await reclaim.agent_samples(self.engine, node, pool, gpus, body.get("killed"))
        self.reply({"node": node, **answer})


async def _first_of(flags: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Wait until one of ``flags`` is set, or ``timeout`` seconds."""
    waits = [asyncio.ensure_future(f.wait()) for f in flags]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class DrainingHandler(AgentHandler):
    """A node's draining GPUs: the server ended their lease; its agent ends what remains of it."""

    async def get(self, node: str) -> None:
        self._check_role()
        raw = await self.ctx.redis.hget(self.store.keys.nodes, values.check_name("node", node))
        if raw is None:
            raise errors.UnknownNode(f"node {node!r} is not registered: PUT {API}/nodes/{node} first")
        indexes = [int(g["index"]) for g in json.loads(raw)["gpus"]]
        wait = min(self.query(params.DRAIN_WAIT, 0), self.ctx.settings.max_wait)  # (max_wait bounds every wait)
        if not wait:
            entries = await drain.draining_of(self.engine, node, indexes)
            self.reply({"node": node, "draining": [e.to_json() for e in entries]})
            return
        # A long-poll: an idle agent asks once per `wait` seconds instead of polling, and a drain
        # still reaches it at once. Watched before the first read, so a drain that starts in
        # between wakes it; every wake-up (an event naming the node) re-reads the drains.
        watch = self.ctx.node_watch
        woken = await watch.watch(node)
        try:
            deadline = time.monotonic() + wait
            while True:
                woken.clear()  # before the read: a change after it wakes the wait below
                entries = await drain.draining_of(self.engine, node, indexes)
                left = deadline - time.monotonic()
                if entries or left <= 0 or self.gone.is_set():
                    break
                await _first_of((woken, self.gone), left)
        finally:
            watch.unwatch(node, woken)
        self.reply({"node": node, "draining": [e.to_json() for e in entries]})


class DrainedHandler(AgentHandler):
    """The node agent reports GPUs clean of a lease's processes: they turn free (an admin's
    ``gpulease drain clear`` too, with lease ""). With ``abandoned`` ({pid, why}) the agent gives up
    a process it cannot end instead: the GPUs stay out of service, flagged for an admin."""

    async def post(self, node: str) -> None:
        self._check_role()
        values.check_name("node", node)
        body = self.body(self.bodies.drained)
        gone = body.get("abandoned")
        if gone:
            flagged = await drain.abandon(self.engine, node, body["lease"], body["gpus"], gone["pid"], gone["why"])
            self.reply({"node": node, "flagged": flagged})
            return
        freed = await drain.drained(self.engine, node, body["lease"], body["gpus"], body.get("killed") or 0)
        if self.identity.admin and freed:
            log.warning("admin %s cleared draining GPUs %s of %s", self.identity.user, body["gpus"], node)
        self.reply({"node": node, "freed": freed})


class ClaimHandler(AgentHandler):
    """A node agent records a process that claimed a lease through its claim socket (the kernel
    named the process to the agent: lease_server/node/claims.py). The claim's API token names the
    user, who must hold the lease and the GPUs named."""

    async def post(self, node: str) -> None:
        if self.identity.role != "agent":
            raise errors.Forbidden("only a node agent records claims: a worker claims its lease through its agent")
        values.check_name("node", node)
        body = self.body(self.bodies.procs)
        ident = await self.ctx.auth.act_as(await self.ctx.auth.identify(f"Bearer {body['token']}"), body.get("user"))
        claim = Claim(node, body["lease"], int(body["fence"]), body["token"], ident.user, tuple(body.get("gpus") or ()))
        peer = Peer(pid=int(body["pid"]), uid=int(body["uid"]), start=int(body["start"]))
        rec = await drain.record_claim(self.engine, claim, ident.user, peer, body.get("account"))
        self.reply({"node": node, "lease": rec["id"], "pid": body["pid"]})


class MemoryHandler(AgentHandler):
    """A remote node agent holds its node's slices to their memory (the agent inside the server
    reads Redis: node/memwatch.py): GET what to measure, POST what it measured."""

    async def get(self, node: str) -> None:
        self._check_role()
        values.check_name("node", node)
        pool, watched = await memwatch.node_watch(self.engine, node)
        s = self.ctx.settings
        self.reply(
            {
                "node": node,
                "pool": pool,
                "check_interval_s": s.slice_check_interval,
                "over_pct": s.slice_over_pct,
                "over_s": s.slice_over_s,
                "watched": [memwatch.watched_json(w) for w in watched],
            }
        )

    async def post(self, node: str) -> None:
        self._check_role()
        values.check_name("node", node)
        body = self.body(self.bodies.memory)
        self.reply(await memwatch.agent_report(self.engine, node, body))


class DrainsHandler(BaseHandler):
    """Every draining GPU of the cluster, and those whose agent gave up a process (admin)."""

    async def get(self) -> None:
        if not self.identity.admin:
            raise errors.Forbidden("only an admin lists draining GPUs; gpulease status shows which GPUs drain")
        self.reply({"draining": await drain.all_draining(self.engine)})


class SimulateHandler(AgentHandler):
    """What a simulated node's GPUs report: set by an admin, read by its agent."""

    async def get(self, node: str) -> None:
        self._check_role()
        raw = await self.ctx.redis.hget(self.store.keys.nodes, values.check_name("node", node))
        if raw is None:
            raise errors.UnknownNode(f"node {node!r} is not registered")
        indexes = [g["index"] for g in json.loads(raw)["gpus"]]
        self.reply({"node": node, "gpus": await reclaim.simulated_sample(self.engine, node, indexes)})

    async def put(self, node: str) -> None:
        if not self.identity.admin:
            raise errors.Forbidden("only an admin can set what simulated GPUs report")
        values.check_name("node", node)
        gpus = self.body(self.bodies.simulate)["gpus"]
        parsed: dict[int, dict[str, Any]] = {}
        for key, value in gpus.items():
            g = values.check_gpu_sample(value, int(key))
            parsed[int(key)] = {"util": g["util"], "mem_mb": g["mem_mb"], "procs": g["procs"]}
        await reclaim.set_simulated(self.engine, node, parsed)
        self.reply({"node": node, "gpus": {str(i): v for i, v in parsed.items()}})


class ClusterHandler(BaseHandler):
    """The board's view: the shared snapshot of this process (board.ClusterViews), a page of it."""

    async def get(self) -> None:
        pool = self.query(params.CLUSTER_POOL)
        after = self.query(params.CLUSTER_AFTER)
        limit = self.query(params.CLUSTER_LIMIT)
        snap = await self.ctx.cluster.get()
        if pool is not None and pool not in snap.view["pools"]:
            known = ", ".join(sorted(snap.view["pools"])) or "none registered yet"
            raise errors.BadRequest(f"unknown pool {pool!r}; pools: {known} (or leave pool out for every node)")
        text = snap.page(pool, after, limit, default_pool=await self._default_pool())
        self.set_header("Content-Type", "application/json")
        self.finish(text)

    async def _default_pool(self) -> str | None:
        try:
            return await self.store.default_pool()
        except errors.UnknownPool:
            return None


class QueueHandler(BaseHandler):
    async def get(self) -> None:
        self.reply({"waiting": await queue_view(self.ctx.redis, self.store.keys, self.query(params.POOL))})


def _has_account(settings: Settings, user: str) -> None:
    """Under multi_user a lease user is a unix account (on every host, this one too): a token for a
    name with none would run nobody's cells. A 400 that says what to do."""
    import pwd

    account = settings.account_of(user)
    try:
        pwd.getpwnam(account)
    except KeyError:
        mapped = f" (the account [accounts] maps {user} to)" if account != user else ""
        raise errors.BadRequest(
            f"{user} has no unix account {account}{mapped} on this host, and under multi_user each person's "
            f"cells run as their account: create it (useradd {account}), or map {user} to theirs under "
            "[accounts] in the server's config"
        ) from None


class TokensHandler(BaseHandler):
    """API tokens (admin): list them, or create one (its secret is in this answer only)."""

    async def get(self) -> None:
        if not self.identity.admin:
            raise errors.Forbidden("only an admin can list tokens")
        self.reply({"tokens": await list_tokens(self.ctx.redis, self.store.keys)})

    async def post(self) -> None:
        if not self.identity.admin:
            raise errors.Forbidden("only an admin can create tokens")
        body = self.body(self.bodies.token)
        role = body.get("role", "user")
        if role == "user" and self.ctx.settings.multi_user:
            _has_account(self.ctx.settings, body.get("user", ""))
        token = await create_token(
            self.ctx.redis,
            self.store.keys,
            body.get("user", ""),
            role,
            expires_in=body.get("expires_in"),
            acts_for=body.get("acts_for"),
            node=body.get("node"),
        )
        self.ctx.auth.changed()  # (its open event streams check their tokens at once)
        self.reply({**await view_token(self.ctx.redis, self.store.keys, token), "token": token}, 201)


class TokenHandler(BaseHandler):
    async def delete(self, tid: str) -> None:
        """Revoke a token (admin): refused from the next request on, on every server."""
        if not self.identity.admin:
            raise errors.Forbidden("only an admin can revoke tokens")
        gone = await revoke_token(self.ctx.redis, self.store.keys, tid)
        self.ctx.auth.changed()  # (its open event streams check their tokens at once)
        self.reply({**gone, "revoked": True})


class InfoHandler(BaseHandler):
    async def get(self) -> None:
        s = self.ctx.settings
        try:
            default_pool: str | None = await self.store.default_pool()
        except errors.UnknownPool:
            default_pool = None
        pools = await self.store.pool_sizes()
        self.reply(
            {
                "version": __version__,
                "layout": layout.LAYOUT,  # of the data in Redis: a remote agent checks it is its own
                "instance": await self.engine.instance(),  # names the node agents' claim sockets
                "multi_user": s.multi_user,  # a lease user is a unix account (docs/security.md)
                "ray_address": s.ray_address,
                **info_token(s, self.identity.role),
                "default_pool": default_pool,
                "default_ttl": s.default_ttl,
                "max_ttl": s.max_ttl,
                "max_wait": s.max_wait,
                "pools": pools,
                "cpu_pool": s.cpu_pool if s.cpu_pool in pools else None,
            }
        )


class WhoAmIHandler(BaseHandler):
    async def get(self) -> None:
        self.reply({"user": self.identity.user, "role": self.identity.role, "teams": list(self.teams)})


class EventLogHandler(BaseHandler):
    """A page of the event log: at most ``EVENT_LOG_PAGE_CAP`` entries (a larger ``limit`` is served
    as the cap, and the answer's ``limit`` and ``note`` say so), read and encoded a slice at a time
    under the token's read limits (web/limits.py)."""

    async def get(self) -> None:
        asked = self.query(params.LIMIT, 100)
        cap = values.EVENT_LOG_PAGE_CAP
        q = events.LogQuery(
            since=self.query(params.SINCE, "-"),
            limit=min(asked, cap),
            lease=self.query(params.LEASE),  # only the events whose `lease` field is this id
            before=self.query(params.BEFORE),
            desc=self.query(params.ORDER, "asc") == "desc",
            types=self.query(params.EVENT_TYPES, frozenset()),
            user=self.query(params.EVENT_USER),
        )
        key = self.token_key
        parts: list[str] = []  # the page's slices, each encoded as it is read
        with await self.ctx.limits.admit(key, "GET /events/log", self.gone):
            try:
                async for part in read_sliced(
                    self.ctx.redis, self.store.keys.events, q, lambda n: self.ctx.limits.charge(key, n, self.gone)
                ):
                    mine = [events.for_reader(ev, self.identity.user, self.identity.admin) for ev in part]
                    parts.append(json.dumps(mine, separators=(",", ":"))[1:-1])
            except tornado.iostream.StreamClosedError:  # the client went away during a throttled read
                return
            except RedisResponseError as exc:  # a well-formed id Redis still rejects
                if not_now(exc) is not None:
                    raise
                raise errors.BadRequest(
                    f"since {q.since!r} or before {q.before!r} is not a usable event id: {exc}"
                ) from exc
        tail = f',"limit":{q.limit}'
        if asked > cap:
            note = (
                f"limit {asked} is over the page cap of {cap}: a page has at most {cap} entries; "
                "read on from the last one's id (since=, or before= with order=desc)"
            )
            tail += f',"note":{json.dumps(note)}'
        self.finish(f'{{"events":[{",".join(parts)}]{tail}}}')


class EventStreamHandler(BaseHandler):
    """Server-sent events: the backlog after Last-Event-ID (or ?since=), then live entries; with
    ?lease=ID only the events of that lease (or queued request); with ?changes=true one ``changed``
    event for many, and no backlog (events.EventHub)."""

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Accel-Buffering", "no")

    async def get(self) -> None:
        hub = self.ctx.hub
        await self.ctx.limits.connect(self.token_key, self.gone)
        user, cap = self.identity.user, self.ctx.settings.max_streams_per_user
        # Per token as well: a proxy token's invented names must not multiply the per-user cap.
        tok, tcap = "~" + self.identity.token, self.ctx.settings.max_streams_per_token
        if self.ctx.streams[user] >= cap:
            raise errors.TooMany(
                f"{user} has {self.ctx.streams[user]} event streams open on this server, the most one user "
                f"may ({cap}); close some (browser tabs with the GPU board, notebooks whose kernels are "
                "gone: restart them) and connect again",
                streams=self.ctx.streams[user],
                limit=cap,
            )
        if self.ctx.streams[tok] >= tcap:
            raise errors.TooMany(
                f"token {self.identity.token} has {self.ctx.streams[tok]} event streams open on this server, the most "
                f"one token may ({tcap}); close some and connect again",
                streams=self.ctx.streams[tok],
                limit=tcap,
            )
        self.ctx.streams[user] += 1
        self.ctx.streams[tok] += 1
        try:
            await self._stream(hub)
        finally:
            for held in (user, tok):
                self.ctx.streams[held] -= 1
                if self.ctx.streams[held] <= 0:
                    del self.ctx.streams[held]

    _queue: asyncio.Queue[dict[str, Any] | None] | None = None
    _recheck = False  # the tokens changed: check this stream's before it sends anything more

    def on_connection_close(self) -> None:
        """The client went away: end the stream now (and free its place under the user's limit),
        not at its next write."""
        super().on_connection_close()
        if self._queue is not None:
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(None)

    def _tokens_changed(self) -> None:
        """A token was created, revoked or bound (auth.Authenticator.on_change): wake the stream,
        which checks its token before it sends anything queued after this."""
        self._recheck = True
        if self._queue is not None:
            with contextlib.suppress(asyncio.QueueFull):  # (full: the hub drops it)
                self._queue.put_nowait(_RECHECK)

    def _wait_s(self) -> float:
        """How long an idle stream waits for an event: a keep-alive's interval, or less, to its
        token's expiry."""
        expires = self.token_identity.expires
        return KEEP_ALIVE_S if expires is None else max(0.0, min(KEEP_ALIVE_S, expires - time.time()))

    async def _token_ok(self, at_once: bool = False) -> bool:
        """Whether the stream's token is still valid (always at a keep-alive, ``at_once``; else when
        the tokens changed since the last check, or its expiry has come). If not, the stream ends
        with a comment that says why, and sends nothing more."""
        expires = self.token_identity.expires
        due = self._recheck or (expires is not None and time.time() >= expires)
        if not (at_once or due):
            return True
        self._recheck = False  # (before the read: a change during it asks again)
        try:
            await self.ctx.auth.check_token(self.token_identity)
            return True
        except errors.Unauthorized as exc:
            why = exc.message
        except Exception as exc:  # Redis away: whether the token still holds is not known
            if not due:
                return True  # a keep-alive's check only: the next one asks again
            why = (
                f"this server cannot check the stream's API token now ({as_lease_error(exc)}): reconnect, "
                "with Last-Event-ID to miss nothing"
            )
        log.info("event stream of %s (token %s) closed: %s", self.identity.user, self.token_identity.token, why)
        self.write(": closed: " + why.replace("\n", " ").replace("\r", " ") + "\n\n")
        await self.flush()
        return False

    async def _stream(self, hub: Any) -> None:
        # Read before the stream starts, so a bad id is a plain 400.
        resume_after, since = self.query(params.LAST_EVENT_ID), self.query(params.SINCE)
        since = resume_after or since
        lease, changes = self.query(params.LEASE), self.query(params.CHANGES, False)
        if changes and lease is not None:
            raise errors.BadRequest(
                "changes and lease cannot be combined: follow one lease's events (lease=ID), or changes "
                "of the whole cluster (changes=true)"
            )
        if changes:
            since = None  # a view of changes refetches when it (re)connects: no backlog to replay
        key, limits = self.token_key, self.ctx.limits
        # The backlog is an expensive read: refused (429) before the stream starts, and its place
        # under the token's reads at once held only while it is sent.
        backlog_read = contextlib.ExitStack()
        if since:
            backlog_read.enter_context(
                await limits.admit(key, "the backlog of GET /events (since=, Last-Event-ID)", self.gone)
            )
        # A revoked or expired token's stream ends (issue 49: it went on delivering every user's
        # events): told of every change of tokens from here on, and checked once now for a change
        # between the request's check and this.
        auth = self.ctx.auth
        auth.on_change(self._tokens_changed)
        try:
            await auth.check_token(self.token_identity)
        except BaseException:
            auth.off_change(self._tokens_changed)
            raise
        # before the backlog read, so nothing falls in between
        queue = self._queue = await hub.subscribe(lease=lease, changes=changes)
        sent_up_to = ""
        ev: dict[str, Any] | None
        try:
            self.write(": gpulease event stream\nretry: 2000\n\n")
            await self.flush()
            if since:
                backlog = events.LogQuery(since=since, limit=values.EVENT_LOG_PAGE_CAP, lease=lease)
                async for part in read_sliced(
                    self.ctx.redis, self.store.keys.events, backlog, lambda n: limits.charge(key, n, self.gone)
                ):
                    if not await self._token_ok():
                        return
                    for ev in part:
                        self._send(ev)
                        sent_up_to = ev["id"]
                    await self.flush()
            backlog_read.close()
            ended = False
            while not ended and hub.is_subscribed(queue):
                # What is queued now is written together and flushed once; an idle stream waits
                # (asyncio.timeout: no task per wait, which 3,000 streams felt: bench/fanout_bench.py)
                try:
                    batch = [queue.get_nowait()]
                except asyncio.QueueEmpty:
                    try:
                        async with asyncio.timeout(self._wait_s()):
                            batch = [await queue.get()]
                    except TimeoutError:
                        if not await self._token_ok(at_once=True):
                            return
                        self.write(": keep-alive\n\n")
                        await self.flush()
                        continue
                while len(batch) < 64 and not queue.empty():
                    batch.append(queue.get_nowait())
                if not await self._token_ok():
                    return
                wrote = False
                for ev in batch:
                    if ev is None:
                        ended = True
                        break
                    if ev is _RECHECK:
                        continue
                    if sent_up_to and _stream_id(ev["id"]) <= _stream_id(sent_up_to):
                        continue
                    if lease is not None and ev.get("lease") != lease:
                        continue
                    self._send(ev)
                    wrote = True
                if wrote:
                    await self.flush()
        except tornado.iostream.StreamClosedError:
            pass
        finally:
            auth.off_change(self._tokens_changed)
            backlog_read.close()
            hub.unsubscribe(queue)

    def _send(self, ev: dict[str, Any]) -> None:
        if isinstance(ev, events.Fanned):  # a live event: its text made once for all its followers
            full = events.full_for(ev, self.identity.user, self.identity.admin)
            self.write(ev.wire(full, _sse))
            return
        self.write(_sse(events.for_reader(ev, self.identity.user, self.identity.admin)))  # others' tokens: never


KEEP_ALIVE_S = 15.0  # an idle event stream's comment: proxies keep it open, and its token is checked
_RECHECK: dict[str, Any] = {}  # queued to an event stream when the tokens changed (only its identity counts)


def _sse(ev: dict[str, Any]) -> str:
    """One event as server-sent events text."""
    return f"id: {ev['id']}\nevent: {ev['type']}\ndata: {json.dumps(ev)}\n\n"


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class HealthHandler(BaseHandler):
    public = True

    async def get(self) -> None:
        try:
            await self.ctx.redis.ping()
        except Exception as exc:
            raise errors.ServerUnavailable(f"Redis is not reachable: {exc}") from exc
        self.reply({"status": "ok", "version": __version__, "redis": "ok"})


class OpenApiHandler(BaseHandler):
    public = True

    async def get(self) -> None:
        self.reply(openapi_document(self.ctx.settings))


class MetricsHandler(BaseHandler):
    public = True

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", metrics.CONTENT_TYPE)

    async def get(self) -> None:
        self.finish(await self.ctx.metrics.rendered())


class NotFoundHandler(BaseHandler):
    public = True

    async def prepare(self) -> None:
        self._unread_body = has_body(self.request)  # answered before its body: the answer says close
        raise errors.NotFound(f"no such endpoint {self.request.method} {self.request.path}; see {API}/openapi.json")


def has_body(request: tornado.httputil.HTTPServerRequest) -> bool:
    """Whether a request comes with a body (chunked, or a Content-Length other than 0)."""
    length = request.headers.get("Content-Length")
    return "Transfer-Encoding" in request.headers or (length is not None and length.strip() != "0")


_UNSTREAMED: dict[type[tornado.web.RequestHandler], type[tornado.web.RequestHandler]] = {}


def _unstreamed(handler: type[tornado.web.RequestHandler]) -> type[tornado.web.RequestHandler]:
    """``handler``'s twin that reads its (empty) body before ``prepare``, made once per class."""
    twin = _UNSTREAMED.get(handler)
    if twin is None:
        attrs = {"_stream_request_body": False, "__module__": handler.__module__}
        twin = _UNSTREAMED[handler] = type(handler.__name__, (handler,), attrs)
    return twin


class Application(tornado.web.Application):
    """The API's application: a request without a body is served by a twin of its handler that
    does not stream it. A streamed request answered in ``prepare`` (a 401, a 404, a 429) has its
    body unread, and tornado closes its connection after the answer; with no body to read there is
    no reason to, and the client's kept-alive connection stays open."""

    def get_handler_delegate(
        self,
        request: tornado.httputil.HTTPServerRequest,
        target_class: type[tornado.web.RequestHandler],
        target_kwargs: dict[str, Any] | None = None,
        path_args: list[bytes] | None = None,
        path_kwargs: dict[str, bytes] | None = None,
    ) -> Any:
        if issubclass(target_class, BaseHandler) and not has_body(request):
            target_class = _unstreamed(target_class)
        return super().get_handler_delegate(request, target_class, target_kwargs, path_args, path_kwargs)


def make_app(ctx: Context) -> tornado.web.Application:
    lease_id = r"([A-Za-z0-9._-]{1,64})"
    routes: list[Any] = [
        (rf"{API}/leases", LeasesHandler),
        (rf"{API}/leases/{lease_id}", LeaseHandler),
        (rf"{API}/leases/{lease_id}/renew", RenewHandler),
        (rf"{API}/leases/{lease_id}/revoke", RevokeHandler),
        (rf"{API}/leases/{lease_id}/handoff", HandoffHandler),
        (rf"{API}/leases/{lease_id}/grow", ResizeHandler, {"grow": True}),
        (rf"{API}/leases/{lease_id}/shrink", ResizeHandler, {"grow": False}),
        (rf"{API}/leases/{lease_id}/keep", KeepHandler),
        (rf"{API}/leases/{lease_id}/warm", WarmHandler),
        (rf"{API}/leases/{lease_id}/suspend", SuspendHandler),
        (rf"{API}/bookings", BookingsHandler),
        (rf"{API}/bookings/{lease_id}", BookingHandler),
        (rf"{API}/bookings/{lease_id}/end", BookingEndHandler),
        # deprecated: the same, under the name of the first releases (Deprecation and Link headers)
        (rf"{API}/reservations", ReservationsHandler),
        (rf"{API}/reservations/{lease_id}", ReservationHandler),
        (rf"{API}/reservations/{lease_id}/end", ReservationEndHandler),
        (rf"{API}/usage", UsageHandler),
        (rf"{API}/usage/summary", UsageSummaryHandler),
        (rf"{API}/usage/balance", UsageBalanceHandler),
        (rf"{API}/estimate", EstimateHandler),
        (rf"{API}/policy", PoliciesHandler),
        (rf"{API}/policy/{lease_id}", PolicyHandler),
        (rf"{API}/nodes/{lease_id}/samples", SamplesHandler),
        (rf"{API}/simulate/{lease_id}", SimulateHandler),
        (rf"{API}/cluster", ClusterHandler),
        (rf"{API}/queue", QueueHandler),
        (rf"{API}/events", EventStreamHandler),
        (rf"{API}/events/log", EventLogHandler),
        (rf"{API}/nodes/{lease_id}", NodeHandler),
        (rf"{API}/nodes/{lease_id}/heartbeat", HeartbeatHandler),
        (rf"{API}/nodes/{lease_id}/draining", DrainingHandler),
        (rf"{API}/nodes/{lease_id}/drained", DrainedHandler),
        (rf"{API}/nodes/{lease_id}/procs", ClaimHandler),
        (rf"{API}/nodes/{lease_id}/memory", MemoryHandler),
        (rf"{API}/draining", DrainsHandler),
        (rf"{API}/tokens", TokensHandler),
        (rf"{API}/tokens/{lease_id}", TokenHandler),
        (rf"{API}/whoami", WhoAmIHandler),
        (rf"{API}/info", InfoHandler),
        (rf"{API}/health", HealthHandler),
        (rf"{API}/openapi.json", OpenApiHandler),
        (r"/metrics", MetricsHandler),
    ]
    return Application(
        routes,
        gpulease=ctx,
        default_handler_class=NotFoundHandler,
        log_function=lambda handler: None,
    )
