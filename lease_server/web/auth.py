"""API tokens: per-user bearer tokens with a role, stored only as SHA-256 hashes.

Tokens are 256 random bits, so a fast hash is the right tool (as for GitHub or PyPI tokens): a slow
password hash would only add latency to every request without making a random token harder to
guess. Lookups are cached per process for a few seconds; a deleted token stops working within
``CACHE_SECONDS``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from .. import errors
from ..protocol import ROLES
from ..store.keys import NAME_RE, Keys

log = logging.getLogger(__name__)

ACT_AS_HEADER = "X-Gpulease-User"
CACHE_SECONDS = 5.0
TOKEN_PREFIX = "glt_"


@dataclass(frozen=True)
class Identity:
    user: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def create_token(redis: Redis, keys: Keys, user: str, role: str = "user") -> str:
    """Create a token for ``user`` and return it; only its hash is stored."""
    if not isinstance(user, str) or not NAME_RE.match(user):
        raise errors.BadRequest(f"user must be a name of letters, digits, '.', '_' or '-', got {user!r}")
    if role not in ROLES:
        raise errors.BadRequest(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    record = {"user": user, "role": role, "created": time.time()}
    await redis.hset(keys.tokens, hash_token(token), json.dumps(record))
    log.info("token created user=%s role=%s", user, role)  # never the token
    return token


def act_as(ident: Identity, user: str | None) -> Identity:
    """The identity a request acts with: a proxy token may name the user it acts for, and must.

    A proxy token never acts as itself: a kernel under JupyterHub that lacks GPULEASE_USER would
    otherwise lease GPUs as the proxy, which no Hub user could see as theirs or release."""
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
            "create one with: gpulease token create NAME --proxy"
        )
    if not NAME_RE.match(user):
        raise errors.BadRequest(f"{ACT_AS_HEADER} must be a user name of letters, digits, '.', '_' or '-'")
    return Identity(user, "user")


class Authenticator:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._cache: dict[str, tuple[float, Identity | None]] = {}

    async def identify(self, authorization: str | None) -> Identity:
        if not authorization:
            raise errors.Unauthorized(
                "no API token: send 'Authorization: Bearer <token>' (gpulease token create NAME makes one; "
                "gpulease up prints one and writes it to <data-dir>/token)"
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthorized("Authorization header must be 'Bearer <token>'")
        digest = hash_token(token.strip())
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is None or hit[0] < now:
            raw = await self.redis.hget(self.keys.tokens, digest)
            ident = None
            if raw:
                rec = json.loads(raw)
                ident = Identity(rec["user"], rec["role"])
            if len(self._cache) > 10_000:
                self._cache.clear()
            hit = (now + CACHE_SECONDS, ident)
            self._cache[digest] = hit
        if hit[1] is None:
            raise errors.Unauthorized("unknown or deleted API token: ask an admin for a new one")
        return hit[1]
