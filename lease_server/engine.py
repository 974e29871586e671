"""The engine every part of the lease server runs on: one Redis connection, its key schema, its
scripts and the settings, and :meth:`Engine.run` to call a script through its typed wrapper.

``LeaseStore``, ``Bookings``, the ``Reclaimer``, inventory, usage and ``Metrics`` each take an
``Engine``; none of them reaches into another for Redis.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection as AsyncConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .config import Settings
from .keys import Keys
from .scripts import Code, Common, Samples, ScriptCall, Scripts


class HiredisPackConnection(AsyncConnection):
    """redis-py's asyncio client packs commands in Python (about 40 us for a script call with 20
    keys and 20 arguments, more than Redis takes to run it); hiredis packs them in C. Commands
    hiredis cannot pack fall back to redis-py."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str) and " " not in args[0]:
            try:
                return [hiredis.pack_command(args)]
            except (TypeError, ValueError):
                pass
        return super().pack_command(*args)  # type: ignore[no-any-return]


def connect(url: str, **kw: Any) -> Redis:
    """The lease server's Redis client: hiredis packing, and a pooled connection that Redis
    dropped (restart, failover) retried on a fresh one. Every script is safe to resend: a resent
    acquire finds its own lease id, a resent release finds the lease ended."""
    options: dict[str, Any] = {
        "decode_responses": True,
        "health_check_interval": 30,
        "max_connections": 256,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=3),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "connection_class": HiredisPackConnection,
    }
    return Redis.from_url(url, **{**options, **kw})


class Engine:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self.scripts = Scripts(redis, self.keys)

    def common(self, now_ms: int | None = None) -> Common:
        s = self.settings
        return Common(now_ms, s.event_log_max, s.fair_share_half_life, int(s.ended_retention * 1000))

    async def run(self, call: ScriptCall, now_ms: int | None = None) -> Any:
        """Run a lifecycle script; ``now_ms`` is a virtual clock (the simulator), else Redis TIME.
        Returns the wrapper's typed reply, or raises its typed error."""
        return await self.scripts.call(call, self.common(now_ms))

    async def raw(self, call: ScriptCall, now_ms: int | None = None) -> tuple[Code, list[Any]]:
        """The script's code and undecoded reply, for callers that look at codes: tests, benches,
        ``Bookings`` (telling a change from a repeat). ``call.reply(code, rest)`` decodes it."""
        return await self.scripts.raw(call, self.common(now_ms))

    async def samples(self, call: Samples) -> tuple[int, int]:
        return await self.scripts.samples(call)
