"""Running the HTTP server: one process, or several forked processes sharing one listening socket."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import tornado.httpserver
import tornado.netutil
import tornado.process

from ..config import Settings
from ..leasing.inventory import NodeInventory, register
from ..node.agent import heartbeat_local
from .api import Context, make_app

log = logging.getLogger(__name__)


async def serve(
    settings: Settings,
    sockets: list[socket.socket] | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
    local_nodes: list[NodeInventory] | None = None,
    own_process: bool = False,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when run as the main task).

    ``local_nodes``: inventories of this machine, kept alive by an in-process agent (gpulease up).
    ``own_process``: the process is this server's (``gpulease server``, ``gpulease up``): once it
    is ready, what it allocated to start is moved out of the garbage collector's sight
    (:func:`settle_heap`).
    """
    ctx = Context(settings)
    await ctx.redis.ping()
    await ctx.start()
    stop = stop or asyncio.Event()
    agent = None
    if local_nodes:
        for inv in local_nodes:  # before serving, so the first request finds the pools
            await register(ctx.engine, inv)
        agent = asyncio.create_task(heartbeat_local(ctx.engine, local_nodes, stop), name="gpulease-agent")
    app = make_app(ctx)
    # The body limit is enforced with a clear 413 in the handlers; tornado's own limit (which just
    # drops the connection) only guards against absurd uploads.
    http = tornado.httpserver.HTTPServer(app, max_body_size=64 * 1024 * 1024, xheaders=True)
    if sockets is None:
        sockets = tornado.netutil.bind_sockets(settings.port, settings.host)
    http.add_sockets(sockets)
    port = sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError):  # not the main thread
            pass
    if own_process:
        settle_heap()
    log.info("gpulease server listening on http://%s:%d (redis %s)", settings.host, port, safe_url(settings.redis_url))
    if on_ready:
        on_ready(port)
    try:
        await stop.wait()
    finally:
        http.stop()
        if agent is not None:
            await agent
        await http.close_all_connections()
        await ctx.stop()
        log.info("gpulease server on port %d stopped", port)


def settle_heap() -> None:
    """Collect once, then freeze what is left (``gc.freeze``): the modules, the app and the Redis
    pools a server allocates to start are some 10^5 objects that live as long as the process, and
    Python's oldest-generation collection walked them all, a 20 ms pause every few seconds under
    load (the open-loop p99 of bench/lease_bench.py). Frozen, a full collection walks only what
    requests left behind."""
    gc.collect()
    gc.freeze()


def safe_url(url: str) -> str:
    """``url`` without its password (redis://user:secret@host, ?password=secret), for logs."""
    parts = urlsplit(url)
    if parts.password is None and "password" not in dict(parse_qsl(parts.query)):
        return url
    if parts.password is not None:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{hostport}")
    query = [(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return parts._replace(query=urlencode(query, safe="*")).geturl()


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """asyncio.run on uvloop (a faster event loop: about a third less CPU per request here)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def run(settings: Settings, workers: int = 1) -> None:
    """Blocking entry point of ``gpulease server``."""
    sockets = tornado.netutil.bind_sockets(settings.port, settings.host, reuse_port=False)
    if workers > 1:
        tornado.process.fork_processes(workers, max_restarts=100)
    run_loop(serve(settings, sockets, own_process=True))
