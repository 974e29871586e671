"""API tokens: per-user bearer tokens with a role and a life cycle, stored only as SHA-256 hashes.

Tokens are 256 random bits, so a fast hash is the right tool (as for GitHub or PyPI tokens): a slow
password hash would only add latency to every request without making a random token harder to
guess.

A token's record (``tokens`` hash, sha256 -> JSON) holds its user, role and creation time, and
may hold:

* ``expires``: epoch seconds after which it is refused (401 naming the time);
* ``acts_for`` (proxy tokens): whom it may act for, a comma-separated list of names and globs
  (``alice,bob``, ``lab-*``, ``*``) or one regular expression written ``re:PATTERN``; absent: ``*``.
  Whatever the rule, a proxy never acts for a name that holds an admin, agent or proxy token;
* ``node`` (agent tokens): the one node whose routes (``/nodes/{node}/...``) it may use. An agent
  token made without one is bound to the first node it serves (so tokens stored before nodes were
  scoped keep working for the node that uses them).

Its **id** is the first 12 hex digits of the stored hash: short, not secret (the token cannot be
derived from it), the same for tokens stored before ids existed; ``gpulease token list`` shows it
and ``gpulease token revoke ID`` takes it. Its **last use** is written to ``token_used`` at most
once a minute per token and server process, so authenticating stays one cached lookup.

Lookups are cached per process for ``CACHE_SECONDS``; creating, revoking or binding a token
publishes :data:`TOKENS_CHANGED` on the grants channel and every server process drops its cache on
its next request (the revoking process at once), so a revoked token is refused on the next request.
A request that stays open (an event stream) asks again (:meth:`Authenticator.check_token`) at
every change of tokens, which :meth:`Authenticator.follow` hears and passes on to the callbacks
of :meth:`Authenticator.on_change`, and at each of its keep-alives: a revoked or expired token's
stream ends.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import WatchError

from .. import errors
from ..leasing.bodies import ACTS_FOR_PATTERN
from ..protocol import ROLES
from ..store.keys import NAME_RE, Keys

log = logging.getLogger(__name__)

ACT_AS_HEADER = "X-Gpulease-User"
CACHE_SECONDS = 5.0
TOKEN_PREFIX = "glt_"
ID_DIGITS = 12
USED_EVERY_S = 60.0  # last-used time written at most this often per token (and server process)
MAX_EXPIRES_S = 10 * 365 * 86400.0
PRIVILEGED = ("admin", "agent", "proxy")  # roles whose names no proxy token acts for
# Published on the grants channel (waiter ids never start with "~") when a token is created,
# revoked or bound: every server process drops its token cache.
TOKENS_CHANGED = "~tokens"
MAX_ACTS_FOR = 1024


class Notifier(Protocol):
    """What the authenticator needs of leasing.queue.GrantNotifier (one subscription per process)."""

    def expect(self, waiter_id: str) -> asyncio.Event: ...

    def forget(self, waiter_id: str, ev: asyncio.Event) -> None: ...


@dataclass(frozen=True)
class Identity:
    user: str
    role: str
    token: str = ""  # the id of the token the request came with (the proxy's own, when acting)
    node: str | None = None  # an agent token's node (None: bound to the first node it serves)
    acts_for: str | None = None  # a proxy token's rule (None: "*")
    expires: float | None = None
    digest: str = field(default="", repr=False, compare=False)

    @property
    def admin(self) -> bool:
        return self.role == "admin"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_id(digest: str) -> str:
    """The short, public id of the token whose hash is ``digest``."""
    return digest[:ID_DIGITS]


def check_acts_for(rule: object) -> str:
    """A proxy token's ``acts_for`` rule, checked: names and globs separated by commas, or
    ``re:PATTERN`` (matched against the whole name)."""
    if not isinstance(rule, str) or len(rule) > MAX_ACTS_FOR or not re.search(ACTS_FOR_PATTERN, rule):
        raise errors.BadRequest(
            f"acts_for must say whom the proxy token may act for (at most {MAX_ACTS_FOR} characters): user names "
            "and globs of them (letters, digits, '.', '_', '-', * ? [...]) separated by commas, no spaces "
            f"('alice,bob', 'lab-*', '*'), or one regular expression as 're:PATTERN'; got {rule!r}"
        )
    if rule.startswith("re:"):
        try:
            re.compile(rule[3:])
        except re.error as exc:
            raise errors.BadRequest(f"acts_for {rule!r} is not a regular expression: {exc}") from exc
    return rule


def acts_for_permits(rule: str | None, user: str) -> bool:
    """Whether a proxy token's ``acts_for`` rule names ``user`` (no rule: anyone)."""
    if rule is None:
        return True
    if rule.startswith("re:"):
        return re.fullmatch(rule[3:], user) is not None
    return any(fnmatch.fnmatchcase(user, entry) for entry in rule.split(","))


def _check_new(user: object, role: str, expires_in: object, acts_for: object, node: object) -> None:
    if not isinstance(user, str) or not NAME_RE.match(user):
        raise errors.BadRequest(f"user must be a name of letters, digits, '.', '_' or '-', got {user!r}")
    if role not in ROLES:
        raise errors.BadRequest(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if expires_in is not None and (
        isinstance(expires_in, bool) or not isinstance(expires_in, (int, float)) or not 0 < expires_in <= MAX_EXPIRES_S
    ):
        raise errors.BadRequest(
            f"expires_in must be seconds from now, above 0 and at most 10 years, got {expires_in!r}"
        )
    if acts_for is not None and role != "proxy":
        raise errors.BadRequest("acts_for is for proxy tokens only (role proxy)")
    if node is not None and (role != "agent" or not isinstance(node, str) or not NAME_RE.match(node)):
        raise errors.BadRequest("node is for agent tokens only (role agent), and must be a node name")


async def create_token(
    redis: Redis,
    keys: Keys,
    user: str,
    role: str = "user",
    *,
    expires_in: float | None = None,
    acts_for: str | None = None,
    node: str | None = None,
) -> str:
    """Create a token for ``user`` and return it; only its hash is stored. ``expires_in``: seconds
    it is valid (None: until revoked); ``acts_for``: a proxy token's rule (None: anyone who holds no
    admin, agent or proxy token); ``node``: an agent token's node (None: the first it serves)."""
    _check_new(user, role, expires_in, acts_for, node)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = time.time()
    record: dict[str, Any] = {"user": user, "role": role, "created": now}
    if expires_in is not None:
        record["expires"] = now + float(expires_in)
    if acts_for is not None:
        record["acts_for"] = check_acts_for(acts_for)
    if node is not None:
        record["node"] = node
    digest = hash_token(token)
    await redis.hset(keys.tokens, digest, json.dumps(record))
    await redis.publish(keys.grants, TOKENS_CHANGED)
    log.info("token created id=%s user=%s role=%s", token_id(digest), user, role)  # never the token
    return token


def _view(digest: str, rec: dict[str, Any], used: str | None) -> dict[str, Any]:
    """What the API shows of a token (protocol.TokenJson): never its hash."""
    out: dict[str, Any] = {
        "id": token_id(digest),
        "user": rec["user"],
        "role": rec["role"],
        "created": float(rec.get("created") or 0),
    }
    if rec.get("expires") is not None:
        out["expires"] = float(rec["expires"])
    if used:
        out["last_used"] = float(used)
    if rec["role"] == "proxy":
        out["acts_for"] = rec.get("acts_for") or "*"
    if rec["role"] == "agent" and rec.get("node"):
        out["node"] = rec["node"]
    return out


async def list_tokens(redis: Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every token (oldest first), with its id, user, role, times and scope."""
    records: dict[str, str] = await redis.hgetall(keys.tokens)  # type: ignore[assignment]
    used: dict[str, str] = await redis.hgetall(keys.token_used)  # type: ignore[assignment]
    orphans = [d for d in used if d not in records]  # a last use written as the token was revoked
    if orphans:
        await redis.hdel(keys.token_used, *orphans)
    out = [_view(d, json.loads(raw), used.get(d)) for d, raw in records.items()]
    return sorted(out, key=lambda t: (t["created"], t["id"]))


async def view_token(redis: Redis, keys: Keys, token: str) -> dict[str, Any]:
    """The view of a token just made (its id, expiry and scope, as a list shows them)."""
    digest = hash_token(token)
    raw = await redis.hget(keys.tokens, digest)
    if raw is None:
        raise errors.NoSuchToken("the token was revoked as it was made")
    return _view(digest, json.loads(raw), None)


async def revoke_token(redis: Redis, keys: Keys, tid: str) -> dict[str, Any]:
    """Delete the token whose id is ``tid``; it is refused from the next request on."""
    if not re.fullmatch(rf"[0-9a-f]{{{ID_DIGITS}}}", tid or ""):
        raise errors.BadRequest(f"a token id is {ID_DIGITS} hex digits (gpulease token list shows them), got {tid!r}")
    records: dict[str, str] = await redis.hgetall(keys.tokens)  # type: ignore[assignment]
    found = [d for d in records if token_id(d) == tid]
    if not found:
        raise errors.NoSuchToken(f"no token with id {tid} (gpulease token list shows the ids)")
    (digest,) = found[:1]
    view = _view(digest, json.loads(records[digest]), None)
    await redis.hdel(keys.tokens, digest)
    await redis.hdel(keys.token_used, digest)
    await redis.publish(keys.grants, TOKENS_CHANGED)
    log.info("token revoked id=%s user=%s role=%s", tid, view["user"], view["role"])
    return view


def _check_expiry(ident: Identity) -> None:
    """401 for a token past its expiry (the server's clock), naming when it expired."""
    if ident.expires is not None and time.time() >= ident.expires:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ident.expires))
        raise errors.Unauthorized(
            f"API token {ident.token} of {ident.user} expired at {when}: ask an admin for a new one"
        )


class Authenticator:
    """Who a request's token is, and whom it may act for; cached per process (see the module)."""

    def __init__(self, redis: Redis, keys: Keys, notifier: Notifier | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self._notifier = notifier
        self._changed: asyncio.Event | None = None
        self._cache: dict[str, tuple[float, Identity | None]] = {}
        self._privileged: tuple[float, dict[str, str]] | None = None
        self._used: dict[str, float] = {}  # digest -> when this process last wrote its last use
        self._generation = 0  # counts forget(): a read begun before one is not cached after it
        self._reads: dict[str, asyncio.Future[Identity | None]] = {}  # digest -> its read under way
        self._on_change: set[Callable[[], None]] = set()

    def forget(self) -> None:
        """Drop what is cached: the next request reads its token from Redis."""
        self._cache.clear()
        self._privileged = None
        self._generation += 1
        self._reads.clear()  # (begun before the change: never shared with a reader after it)

    def changed(self) -> None:
        """Tokens changed (in this process, or published by another): drop the cache and call the
        :meth:`on_change` callbacks (each open event stream checks its token again)."""
        self.forget()
        for callback in list(self._on_change):
            callback()

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (synchronously, cheaply) at every change of tokens from now on."""
        self._on_change.add(callback)

    def off_change(self, callback: Callable[[], None]) -> None:
        self._on_change.discard(callback)

    async def follow(self) -> None:
        """Until cancelled: at every change of tokens published on the grants channel (by any server
        process; or after the channel's subscription was lost, which may have lost one) call
        :meth:`changed`. Nothing is awaited between a wake-up and the next ``expect``, so no change
        published meanwhile is missed."""
        if self._notifier is None:
            return
        while True:
            changed = self._notifier.expect(TOKENS_CHANGED)
            try:
                await changed.wait()
            finally:
                self._notifier.forget(TOKENS_CHANGED, changed)
            self.changed()

    async def check_token(self, ident: Identity) -> None:
        """Raise :class:`errors.Unauthorized` if the token ``ident`` was read from (identify's
        answer, not a proxy's act_as) is revoked or expired now; through the cache, which every
        change of tokens drops, and one read of Redis for all who ask about the same token at once
        (3,000 open streams behind one proxy token ask together after each change)."""
        self._follow_changes()
        hit = self._cache.get(ident.digest)
        if hit is not None and hit[0] >= time.monotonic():
            current = hit[1]
        else:
            digest = ident.digest
            read = self._reads.get(digest)
            if read is None:
                read = self._reads[digest] = asyncio.ensure_future(self._read(digest, token_id(digest)))
                read.add_done_callback(functools.partial(self._read_done, digest))
            current = await asyncio.shield(read)
        if current is None:
            raise errors.Unauthorized(
                f"API token {ident.token} of {ident.user} was revoked: ask an admin for a new one"
            )
        _check_expiry(current)

    def _read_done(self, digest: str, done: asyncio.Future[Identity | None]) -> None:
        if self._reads.get(digest) is done:
            del self._reads[digest]
        if not done.cancelled():
            done.exception()  # (retrieved: a failed read is each asker's own error)

    async def _read(self, digest: str, tid: str) -> Identity | None:
        """The token whose hash is ``digest``, read from Redis (None: no such token) and cached,
        unless the tokens changed while it was read."""
        generation = self._generation
        raw = await self.redis.hget(self.keys.tokens, digest)
        ident = None
        if raw:
            rec = json.loads(raw)
            ident = Identity(
                rec["user"],
                rec["role"],
                token=tid,
                node=rec.get("node"),
                acts_for=rec.get("acts_for"),
                expires=rec.get("expires"),
                digest=digest,
            )
        if generation == self._generation:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (time.monotonic() + CACHE_SECONDS, ident)
        return ident

    def _follow_changes(self) -> None:
        # A change published after expect() sets the new event; one published before it is covered
        # by the forget() that follows (Redis has the change by the time it is published).
        if self._notifier is None or (self._changed is not None and not self._changed.is_set()):
            return
        new = self._notifier.expect(TOKENS_CHANGED)
        if self._changed is not None:
            self._notifier.forget(TOKENS_CHANGED, self._changed)
        self._changed = new
        self.forget()

    async def identify(self, authorization: str | None) -> Identity:
        if not authorization:
            raise errors.Unauthorized(
                "no API token: send 'Authorization: Bearer <token>' (gpulease token create NAME makes one; "
                "gpulease up prints one and writes it to <data-dir>/token)"
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthorized("Authorization header must be 'Bearer <token>'")
        self._follow_changes()
        digest = hash_token(token.strip())
        hit = self._cache.get(digest)
        ident = hit[1] if hit is not None and hit[0] >= time.monotonic() else await self._read(digest, token_id(digest))
        if ident is None:
            raise errors.Unauthorized(
                "unknown or deleted API token (a revoked one is deleted): ask an admin for a new one"
            )
        _check_expiry(ident)
        wall = time.time()
        if wall - self._used.get(digest, 0.0) >= USED_EVERY_S:
            if len(self._used) > 10_000:
                self._used.clear()
            self._used[digest] = wall
            await self.redis.hset(self.keys.token_used, digest, str(int(wall)))
        return ident

    async def act_as(self, ident: Identity, user: str | None) -> Identity:
        """The identity a request acts with: a proxy token may name the user it acts for, and must.

        A proxy token never acts as itself: a kernel under JupyterHub that lacks GPULEASE_USER would
        otherwise lease GPUs as the proxy, which no Hub user could see as theirs or release. It acts
        only for the names its rule permits, and never for a name that holds an admin, agent or
        proxy token (it could otherwise end an admin's leases, or act as another proxy's users)."""
        if user is None:
            if ident.role == "proxy":
                raise errors.Forbidden(
                    f"a proxy token acts only for the user it names in {ACT_AS_HEADER}: set GPULEASE_USER "
                    "(or c.GpuLease.act_as_user) to the user it acts for"
                )
            return ident
        if ident.role != "proxy":
            raise errors.Forbidden(
                f"only a proxy token may act for another user ({ACT_AS_HEADER}); "
                "create one with: gpulease token create NAME --proxy --acts-for USERS"
            )
        if not NAME_RE.match(user):
            raise errors.BadRequest(f"{ACT_AS_HEADER} must be a user name of letters, digits, '.', '_' or '-'")
        if not acts_for_permits(ident.acts_for, user):
            raise errors.Forbidden(
                f"proxy token {ident.token} ({ident.user}) acts only for {ident.acts_for!r}, not for {user!r}: "
                "an admin makes a proxy token for more users (gpulease token create NAME --proxy --acts-for ...)"
            )
        role = (await self._privileged_names()).get(user)
        if role is not None:
            raise errors.Forbidden(
                f"a proxy token never acts for {user!r}: that name holds an {role} token (a proxy acts only for "
                "plain users; use that token itself)"
            )
        return Identity(user, "user", token=ident.token)

    async def _privileged_names(self) -> dict[str, str]:
        """Names that hold an admin, agent or proxy token -> that role (an expired one too: its
        leases are still that name's)."""
        self._follow_changes()
        now = time.monotonic()
        if self._privileged is None or self._privileged[0] < now:
            names: dict[str, str] = {}
            for raw in (await self.redis.hgetall(self.keys.tokens)).values():
                rec = json.loads(raw)
                if rec.get("role") in PRIVILEGED:
                    names.setdefault(rec["user"], rec["role"])
            self._privileged = (now + CACHE_SECONDS, names)
        return self._privileged[1]

    async def check_node(self, ident: Identity, node: str) -> None:
        """An agent token serves one node: refuse ``node`` unless it is that one. A token made
        without a node is bound to ``node`` here, the first node it serves."""
        if ident.role != "agent" or not NAME_RE.match(node):
            return
        bound = ident.node or await self._bind(ident, node)
        if bound != node:
            raise errors.Forbidden(
                f"agent token {ident.token} ({ident.user}) serves node {bound!r}, not {node!r}: every node's agent "
                f"needs its own token (gpulease token create NAME --agent --node {node})"
            )

    async def _bind(self, ident: Identity, node: str) -> str:
        """Bind an unbound agent token to ``node`` unless a concurrent request bound it first;
        the node it is bound to. WATCH makes a revoke in between abort the write (never resurrect)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self.keys.tokens)
                    raw = await pipe.hget(self.keys.tokens, ident.digest)
                    if raw is None:
                        raise errors.Unauthorized(
                            "unknown or deleted API token (a revoked one is deleted): ask an admin for a new one"
                        )
                    rec = json.loads(raw)
                    if rec.get("node"):
                        await pipe.unwatch()
                        return str(rec["node"])
                    rec["node"] = node
                    pipe.multi()
                    pipe.hset(self.keys.tokens, ident.digest, json.dumps(rec))
                    pipe.publish(self.keys.grants, TOKENS_CHANGED)
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        self._cache.pop(ident.digest, None)
        log.info("agent token id=%s user=%s bound to node %s (the first it served)", ident.token, ident.user, node)
        return node
