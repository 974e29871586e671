"""Running the HTTP server: one process, or several forked processes sharing one listening socket."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import tornado.httpserver
import tornado.iostream
import tornado.netutil
import tornado.process

from ..config import Settings
from ..errors import ConfigurationError
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
    unix_socket: str | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when run as the main task).

    ``unix_socket``: serve there too (mode 0600), for ``gpulease up``'s own clients: a path in its
    0700 data dir, which no other user may bind, unlike a TCP port once the server is down.

    ``local_nodes``: inventories of this machine, kept alive by an in-process agent (gpulease up).
    ``own_process``: the process is this server's (``gpulease server``, ``gpulease up``): once it
    is ready, what it allocated to start is moved out of the garbage collector's sight
    (:func:`settle_heap`).
    """
    # The sockets first: one that cannot be bound (a taken port, an unsafe unix_socket folder) is
    # refused before any agent or task has started, which would each have to be wound down.
    if sockets is None:
        sockets = tornado.netutil.bind_sockets(settings.port, settings.host)
    if settings.unix_socket and not any(s.family == socket.AF_UNIX for s in sockets):  # (run() binds it before forking)
        sockets = [*sockets, bind_shared_socket(settings.unix_socket, settings.multi_user)]
    ctx = Context(settings)
    await ctx.redis.ping()
    await ctx.start()
    stop = stop or asyncio.Event()
    agent = None
    if local_nodes:
        for inv in local_nodes:  # before serving, so the first request finds the pools
            await register(ctx.engine, inv, quiet=True)  # the agent says it in one line below

        async def whose(token: str, acting_for: str) -> str:
            ident = await ctx.auth.identify(f"Bearer {token}")
            return (await ctx.auth.act_as(ident, acting_for or None)).user

        agent = asyncio.create_task(heartbeat_local(ctx.engine, local_nodes, stop, whose), name="gpulease-agent")
    app = make_app(ctx)
    http = EdgeServer(app, settings)
    http.add_sockets(sockets)
    port = sockets[0].getsockname()[1]
    if unix_socket:
        try:
            http.add_socket(tornado.netutil.bind_unix_socket(unix_socket, mode=0o600))
        except OSError as exc:  # (a path too long for a socket: its clients use TCP)
            log.warning("not serving on %s: %s", unix_socket, exc)
            unix_socket = None
    loop = asyncio.get_running_loop()
    signals = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:
        # its terminal closed: stop as for Ctrl-C, so that gpulease up ends its JupyterLab and Ray
        # too, and leaves no client holding a token for a port anyone may bind (nohup: left alone)
        signals.append(signal.SIGHUP)
    for sig in signals:
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
        if unix_socket:
            with contextlib.suppress(OSError):
                os.unlink(unix_socket)
        log.info("gpulease server on port %d stopped", port)


# A request head (request line and headers) larger than this is refused: a token and a few cookies
# of a browser on the same host fit many times over.
MAX_HEADER_BYTES = 32 * 1024


class EdgeServer(tornado.httpserver.HTTPServer):
    """The HTTP server facing the network: what a client can hold of it is bounded.

    * A request head must arrive whole within ``http_idle_timeout`` of the server's waiting for it
      (the same clock counts a kept-alive connection's idle time), and be at most
      :data:`MAX_HEADER_BYTES`.
    * A request body must arrive within ``http_body_timeout``. Every handler streams its body
      (``BaseHandler``), so a body is read only after its request was authenticated and its
      Content-Length checked, and never beyond ``max_body_bytes``.
    * At most ``max_connections`` connections are open at once; one accepted beyond them is closed
      at once. The first refusal is logged, and how many were refused once the server is under the
      cap again (one line each way, however many there were).

    An event stream is not cut by the idle timeout: that clock runs only while a request head is
    awaited, never while a response is being written.
    """

    def initialize(self, app: Any, settings: Settings) -> None:  # type: ignore[override]
        super().initialize(
            app,
            # Nothing here reads the client's address or scheme; trusting X-Real-Ip and
            # X-Forwarded-For from any client would let a caller name an address of its choosing
            # should something read it later, and parsing them cost every request a getaddrinfo.
            xheaders=False,
            max_header_size=MAX_HEADER_BYTES,
            idle_connection_timeout=settings.http_idle_timeout,
            body_timeout=settings.http_body_timeout,
            # The handlers answer a body over max_body_bytes with a 413, before reading it when its
            # Content-Length says so, else at the first chunk past the limit (nothing is kept of
            # it). Tornado's own limit, which drops the connection with a bare 400, must lie beyond
            # theirs: a chunk's size is checked against it before the handler sees the chunk.
            max_body_size=max(64 * 1024 * 1024, settings.max_body_bytes + 1),
        )
        self.max_connections = settings.max_connections
        self.refused = 0  # connections closed at accept since the cap was last reached

    def handle_stream(self, stream: tornado.iostream.IOStream, address: tuple[Any, ...]) -> None:
        if len(self._connections) >= self.max_connections:
            if not self.refused:
                log.warning(
                    "%d connections open, the most allowed (max_connections): closing new ones at once until some end",
                    len(self._connections),
                )
            self.refused += 1
            stream.close()
            return
        if self.refused:
            log.warning("under max_connections again; %d connections were closed at accept", self.refused)
            self.refused = 0
        super().handle_stream(stream, address)


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


def bind_shared_socket(path: str, multi_user: bool) -> socket.socket:
    """The server's unix socket for every account of the host (``unix_socket``): in a folder of
    root's or this user's that nobody else may write, so that no other account can have bound
    the path first or swap it later. Mode 0666 under multi_user (each account's kernels connect,
    and the kernel names the account of each: web/api.py), else 0600."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise ConfigurationError(f"unix_socket {path}: its folder {folder} cannot be read ({exc.strerror})") from None
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise ConfigurationError(
            f"unix_socket {path}: its folder {folder} may be written by another user; "
            f"use a folder of root's with mode 0755 (install -d -m 0755 {folder})"
        )
    return tornado.netutil.bind_unix_socket(path, mode=0o666 if multi_user else 0o600)


def run(settings: Settings, workers: int = 1) -> None:
    """Blocking entry point of ``gpulease server``."""
    sockets = tornado.netutil.bind_sockets(settings.port, settings.host, reuse_port=False)
    if settings.unix_socket:  # (after the port's: the first socket is the one the banner names)
        sockets.append(bind_shared_socket(settings.unix_socket, settings.multi_user))
    if workers > 1:
        tornado.process.fork_processes(workers, max_restarts=100)
    run_loop(serve(settings, sockets, own_process=True))
