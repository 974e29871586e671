"""The engine every part of the lease server runs on: one Redis connection, its key schema, its
scripts and the settings, and :meth:`Engine.run` to call a script through its typed wrapper.

``LeaseStore``, ``Bookings``, the ``Reclaimer``, inventory, usage and ``Metrics`` each take an
``Engine``; none of them reaches into another for Redis.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from .config import Settings
from .keys import Keys
from .scripts import Code, Common, Samples, ScriptCall, Scripts


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
