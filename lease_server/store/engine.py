"""The engine every part of the lease server runs on: one Redis connection, its key schema, its
scripts and the settings, and :meth:`Engine.run` to call a script through its typed wrapper.

``LeaseStore``, ``Bookings``, the ``Reclaimer``, inventory, usage and ``Metrics`` each take an
``Engine``; none of them reaches into another for Redis.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import Connection as AsyncConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..config import Settings
from ..errors import ConfigurationError, ServerUnavailable
from .keys import Keys
from .scripts import Code, Common, R, Samples, ScriptCall, Scripts

log = logging.getLogger(__name__)

# Redis's answers that mean "not now": a failover (READONLY from a demoted primary, MASTERDOWN from a
# replica that lost it, NOREPLICAS while min-replicas-to-write is unmet), an AOF still loading, a
# cluster resharding or missing a slot. Found anywhere in the message: Redis 6 wraps an error raised
# inside a script ("ERR Error running script ... -NOREPLICAS ..."), redis-py a pipeline's.
_NOT_NOW = re.compile(r"\b(NOREPLICAS|READONLY|LOADING|MASTERDOWN|TRYAGAIN|CLUSTERDOWN)\b")


_NOT_NOW_CLASSES = (
    (MasterDownError, "MASTERDOWN"),
    (ClusterDownError, "CLUSTERDOWN"),
    (ReadOnlyError, "READONLY"),
    (TryAgainError, "TRYAGAIN"),
    (RedisClusterException, "CLUSTERDOWN"),  # redis-py's, when the slots it found do not cover all
)


class PrimaryWithoutData(RedisError):
    """The primary the sentinels name holds none of this deployment's data: a replica that was
    restarted without AOF (so empty) and promoted before its first sync ended. Sentinel does that
    (it reads a replica that never synced as one whose link has been down for -1 s). Served, it
    would answer "unknown token" to everyone and count every GPU free while their jobs still run.
    Not a ConnectionError: redis-py would retry it for seconds, and it does not pass by itself."""


def not_now(exc: BaseException | None) -> ServerUnavailable | None:
    """The 503 (retry in a few seconds) that a Redis error means, or None for any other error."""
    if isinstance(exc, PrimaryWithoutData):
        return ServerUnavailable(
            "the lease server's Redis primary lost its data in a failover; nothing was changed. An admin "
            "must restore it (the lease server's log says how); retry later"
        )
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):  # also LOADING (BusyLoadingError)
        what = "still loading its data" if "LOADING" in str(exc) else f"cannot be reached ({type(exc).__name__})"
        return ServerUnavailable(f"the lease server's Redis {what} right now; retry in a few seconds")
    if isinstance(exc, (ResponseError, ClusterError, RedisClusterException)):  # the last: slots not covered
        # redis-py drops the code from the message of the errors it has a class for
        m = _NOT_NOW.search(str(exc))
        known = next((code for cls, code in _NOT_NOW_CLASSES if isinstance(exc, cls)), None)
        if m is None and known is None and isinstance(exc, ResponseError):
            return None
        why = m.group(1) if m else known or type(exc).__name__
        return ServerUnavailable(
            f"the lease server's Redis is not taking this request now ({why}: a failover, a restart or "
            "a cluster change); nothing was changed, retry in a few seconds"
        )
    return None


class _HiredisPack:
    """redis-py's asyncio client packs commands in Python (about 40 us for a script call with 20
    keys and 20 arguments, more than Redis takes to run it); hiredis packs them in C. Commands
    hiredis cannot pack fall back to redis-py."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str) and " " not in args[0]:
            try:
                return [hiredis.pack_command(args)]
            except (TypeError, ValueError):
                pass
        return super().pack_command(*args)  # type: ignore[misc, no-any-return]


class HiredisPackConnection(_HiredisPack, AsyncConnection):
    pass


# The fencing hash {e, n} (lua/_lib_schedule.lua next_token): a higher epoch starts its own count.
RAISE_EPOCH = """
local e = tonumber(redis.call('HGET', KEYS[1], 'e') or '0')
if tonumber(ARGV[1]) > e then redis.call('HSET', KEYS[1], 'e', ARGV[1], 'n', 0) end
return e
"""


_last_data_alarm = 0.0


class HiredisSentinelConnection(_HiredisPack, SentinelManagedConnection):
    """A connection to the primary the sentinels name, that checks it is one. Right after a
    failover a sentinel that has not caught up can still name the old primary's address, where a
    restarted instance may already run as an empty replica: its reads would answer from stale or no
    data (an API token "unknown"). ``ROLE`` on connect refuses it, and the retry asks again."""

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        # redis-py 8's commands reconnect through here, to the address the connection had: after a
        # failover that is the old primary. Ask the sentinels first, as connect() does.
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health, retry_socket_connect)

    async def on_connect_check_health(self, check_health: bool = True) -> None:
        await super().on_connect_check_health(check_health)
        if self.connection_pool.is_master:
            await self.send_command("ROLE", check_health=False)
            role = await self.read_response()
            if not role or str(role[0]) != "master":
                await self.disconnect()
                what = role[0] if role else "?"
                raise RedisConnectionError(f"{self.host}:{self.port} is a {what} now, not the primary")
            await self._check_data()
            await self._raise_fencing_epoch()

    async def _check_data(self) -> None:
        """Refuse a primary without the deployment's layout key (once the server has seen it
        there): see PrimaryWithoutData."""
        key = getattr(self.connection_pool, "layout_key", None)
        if not key:
            return
        await self.send_command("GET", key, check_health=False)
        if await self.read_response() is not None:
            return
        await self.disconnect()
        why = (
            f"{self.host}:{self.port} is the Redis primary now but holds no gpulease data ({key} is missing): "
            "a replica restarted without AOF and promoted before its first sync? Refused, rather than "
            "grant GPUs whose jobs still run. Restore the data (docs/deploy.md, 'A primary without its "
            "data'), then restart the lease servers"
        )
        global _last_data_alarm
        if time.monotonic() - _last_data_alarm > 10.0:  # each request retries the connect: say it once a while
            _last_data_alarm = time.monotonic()
            log.error("%s", why)
        raise PrimaryWithoutData(why)

    async def _raise_fencing_epoch(self) -> None:
        """Before this connection carries anything, move the primary's fencing epoch up to the one
        the sentinels gave with its address. A request whose arguments were built before the
        failover (and are resent as they are) then still gets a token of the new epoch."""
        pool = self.connection_pool
        fence = getattr(pool, "fence_key", None)
        epoch = (
            pool.sentinel_manager.epochs.get(pool.service_name, 0)
            if isinstance(pool.sentinel_manager, FencingSentinel)
            else 0
        )
        if fence and epoch:
            await self.send_command("EVAL", RAISE_EPOCH, 1, fence, epoch, check_health=False)
            await self.read_response()


class FencingSentinel(Sentinel):
    """Sentinel that also keeps, per service, the highest config epoch the sentinels reported with
    the primary's address. Sentinel raises that epoch for every failover before it hands out the new
    primary's address, so it is the fencing epoch (lua/_lib_schedule.lua next_token argues why it suffices)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.epochs: dict[str, int] = {}

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        problems = []
        for i, sentinel in enumerate(self.sentinels):
            try:
                masters = await sentinel.sentinel_masters()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                problems.append(f"{sentinel}: {exc!r}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]  # ask this one first next time
                epoch = int(state.get("config-epoch") or 0)
                self.epochs[service_name] = max(epoch, self.epochs.get(service_name, 0))
                return state["ip"], int(state["port"])
        raise MasterNotFoundError(f"no primary for {service_name!r} known to any sentinel: {'; '.join(problems)}")


@dataclass(frozen=True)
class SentinelUrl:
    """``redis+sentinel://[[user]:password@]host:port,host:port/SERVICE[/DB][?sentinel_password=X]``."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None
    sentinel_password: str | None

    @classmethod
    def parse(cls, url: str) -> SentinelUrl:
        parts = urlsplit(url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        user, _, password = userinfo.partition(":")
        sentinels = []
        for host in hosts.split(","):
            name, _, port = host.strip().rpartition(":") if ":" in host else (host.strip(), "", "26379")
            if not name or not port.isdigit():
                raise ConfigurationError(
                    f"{url!r}: each sentinel is host:port, e.g. redis+sentinel://h1:26379,h2:26379/mymaster/0"
                )
            sentinels.append((name.strip("[]"), int(port)))
        path = [p for p in parts.path.split("/") if p]
        if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise ConfigurationError(f"{url!r}: name the Sentinel service and the database, e.g. .../mymaster/0")
        query = dict(parse_qsl(parts.query))
        return cls(
            tuple(sentinels),
            path[0],
            int(path[1]) if len(path) == 2 else 0,
            unquote(user) or None,
            unquote(password) or None,
            query.get("sentinel_password"),
        )


POOL_WAIT_S = 10.0  # how long a command waits for a connection of the pool (256) when all are busy


def connect(url: str, **kw: Any) -> Redis:
    """The lease server's Redis client: hiredis packing, and a pooled connection that Redis
    dropped (restart, failover) retried on a fresh one. Every script is safe to resend: a resent
    acquire finds its own lease id, a resent release finds the lease ended.

    ``redis://`` / ``rediss://`` / ``unix://``: one Redis. ``redis+sentinel://h1:26379,h2:26379/mymaster/0``:
    the primary that the sentinels name, found again after a failover (a connection to a demoted
    primary fails with READONLY and is retried on the new one, for up to about 15 s)."""
    options: dict[str, Any] = {
        "decode_responses": True,
        "health_check_interval": 30,
        "max_connections": 256,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=3),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "connection_class": HiredisPackConnection,
    }
    if url.startswith("redis+cluster://"):
        return _cluster(url, **kw)
    if not url.startswith("redis+sentinel://"):
        # A burst beyond the pool (3,000 event streams opening at once after a restart, every
        # agent's heartbeat in one second) waits up to POOL_WAIT_S for a connection instead of
        # failing at once with "too many connections" (a 503). bench/fanout_bench.py found it.
        opts = {**options, **kw}
        opts.setdefault("timeout", POOL_WAIT_S)
        client = Redis(connection_pool=BlockingConnectionPool.from_url(url, **opts))
        client.auto_close_connection_pool = True
        return client
    u = SentinelUrl.parse(url)
    sentinel_kwargs = {"password": u.sentinel_password, "socket_timeout": 1.0, "socket_connect_timeout": 1.0}
    options.update(
        # A failover takes Sentinel's down-after-milliseconds plus a second or two: keep retrying
        # that long before the request fails (503, "retry in a few seconds").
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=20),
        connection_class=HiredisSentinelConnection,
        db=u.db,
        username=u.username,
        password=u.password,
        socket_timeout=5.0,
        socket_connect_timeout=1.0,
    )
    options.update(kw)
    sentinel = FencingSentinel(list(u.sentinels), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(u.service, redis_class=Redis, **options)  # type: ignore[no-any-return]


def _cluster(url: str, **kw: Any) -> Redis:
    """``redis+cluster://[[user]:password@]host:port[,host:port...]``: a Redis Cluster. Every key of
    a deployment carries one hash tag, so all of them (and every script) live in one slot."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    nodes = []
    for host in hosts.split(","):
        name, _, port = host.strip().rpartition(":")
        if not name or not port.isdigit():
            raise ConfigurationError(f"{url!r}: each cluster node is host:port, e.g. redis+cluster://h1:7000,h2:7000")
        nodes.append(ClusterNode(name.strip("[]"), int(port)))
    options: dict[str, Any] = {
        "decode_responses": True,
        "username": unquote(user) or None,
        "password": unquote(password) or None,
        "max_connections": 256,
    }
    return RedisCluster(startup_nodes=nodes, **{**options, **kw})  # type: ignore[return-value]


def resolve_primary(url: str) -> str:
    """A ``redis://`` URL of the primary that a ``redis+sentinel://`` URL names now (other URLs as
    they are): for tools that hold one plain connection, such as the simulator's replay."""
    if not url.startswith("redis+sentinel://"):
        return url
    from redis.sentinel import Sentinel as SyncSentinel

    u = SentinelUrl.parse(url)
    sentinel = SyncSentinel(list(u.sentinels), sentinel_kwargs={"password": u.sentinel_password, "socket_timeout": 1.0})
    host, port = sentinel.discover_master(u.service)
    auth = ""
    if u.password:
        auth = f"{quote(u.username or '')}:{quote(u.password)}@"
    return f"redis://{auth}{host}:{port}/{u.db}"


def fencing_epoch(redis: Redis) -> int:
    """The fencing epoch for the primary ``redis`` talks to: Sentinel's config epoch (0 without
    Sentinel: one Redis has no failover, and its fencing counter survives restarts with AOF)."""
    pool = getattr(redis, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool) and isinstance(pool.sentinel_manager, FencingSentinel):
        return pool.sentinel_manager.epochs.get(pool.service_name, 0)
    return 0


class Engine:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self.scripts = Scripts(redis, self.keys, settings.replicas_ack, settings.replicas_ack_timeout)
        pool = getattr(redis, "connection_pool", None)  # a RedisCluster has one per node
        if isinstance(pool, SentinelConnectionPool):
            pool.fence_key = self.keys.fence  # type: ignore[attr-defined]

    def expect_data(self) -> None:
        """From now on a connection refuses a primary that lacks this deployment's layout key (call
        once the layout is checked, so it is there): a failover onto an empty replica is a 503."""
        pool = getattr(self.redis, "connection_pool", None)
        if isinstance(pool, SentinelConnectionPool):
            pool.layout_key = self.keys.layout  # type: ignore[attr-defined]

    def common(self, now_ms: int | None = None) -> Common:
        s = self.settings
        epoch = fencing_epoch(self.redis)
        return Common(now_ms, s.event_log_max, s.fair_share_half_life, int(s.ended_retention * 1000), epoch)

    async def instance(self) -> str:
        """This deployment's id (random, set once): node agents name their claim socket with it."""
        import secrets

        if not getattr(self, "_instance", None):
            await self.redis.set(self.keys.instance, secrets.token_hex(8), nx=True)
            self._instance = str(await self.redis.get(self.keys.instance))
        return self._instance

    async def run(self, call: ScriptCall[R], now_ms: int | None = None) -> R:
        """Run a lifecycle script; ``now_ms`` is a virtual clock (the simulator), else Redis TIME.
        Returns the wrapper's typed reply, or raises its typed error."""
        return await self.scripts.call(call, self.common(now_ms))

    async def raw(self, call: ScriptCall, now_ms: int | None = None) -> tuple[Code, list[Any]]:
        """The script's code and undecoded reply, for callers that look at codes: tests, benches,
        ``Bookings`` (telling a change from a repeat). ``call.reply(code, rest)`` decodes it."""
        return await self.scripts.raw(call, self.common(now_ms))

    async def samples(self, call: Samples) -> tuple[int, int]:
        return await self.scripts.samples(call)
