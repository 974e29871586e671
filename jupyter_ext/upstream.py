"""The lease server as the Jupyter server talks to it: async HTTP, one connection pool, typed errors.

The Jupyter server must never block its event loop on the lease server, so this is an async
sibling of :class:`lease_server.client.Client` (which is synchronous, for scripts and kernels).
Error bodies become the same typed errors (``lease_server.errors``), so the handlers can answer
with the lease server's status and ``{"code", "message"}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx

from lease_server import errors, protocol
from lease_server.client import ServerGuard, retry_after, up_socket

log = logging.getLogger(__name__)

CONFIG_HINT = "set c.GpuLease.lease_server_url / lease_server_token, or GPULEASE_URL / GPULEASE_TOKEN"
# An SSE stream carries a keep-alive comment every 15 s; a silence 4x longer means a hung upstream.
STREAM_READ_TIMEOUT = 60.0
RESEND_503_S = 10.0  # how long a request answered 503 (the lease server's Redis away) is sent again


class LeaseServerAuth(errors.GpuLeaseError):
    """The lease server refused the Jupyter server's own token.

    Not passed on as 401: a 401 from /gpulease/ means "you are not logged in to Jupyter", which a
    browser fixes by logging in; this one is fixed in the Jupyter server's configuration.
    """

    code = "lease_server_auth"
    status = 502


def config_problem(url: str) -> str:
    """What is wrong with a configured lease server URL, or "" if it is usable."""
    if not url:
        return f"no lease server configured: {CONFIG_HINT} (or start one with 'gpulease up')"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"lease_server_url must be an http(s) URL like http://127.0.0.1:8470, got {url!r}; {CONFIG_HINT}"
    return ""


def _api_path(path: str) -> str:
    """A protocol path as it is; a path relative to the API (``"/leases"``) under it."""
    return path if path.startswith(protocol.API + "/") else protocol.API + path


class LeaseApi:
    """Async client of the lease API, with the Jupyter server's lease token."""

    def __init__(self, url: str, token: str, timeout: float = 10.0, act_as: str = "", hub_user: str = "") -> None:
        """``act_as``: the lease user every call acts for (the token must have the proxy role).
        ``hub_user``: JupyterHub's user of this single-user server; acted for only if the token
        turns out to be a proxy token (a user's own token is used as it is)."""
        self.url = url.rstrip("/")
        self.problem = config_problem(self.url)
        self.timeout = timeout
        self._me: dict[str, Any] | None = None
        self._hub_user = "" if act_as else hub_user
        self._resolved = not self._hub_user
        # before each request (the board's reconnects, a kernel's release): its token goes to no
        # other user's listener on a loopback port (lease_server/client.py)
        self.guard = ServerGuard(self.url, token, uds=up_socket(self.url, token) if not self.problem else None)
        self._http = httpx.AsyncClient(
            base_url=self.url if not self.problem else "http://unconfigured.invalid",
            timeout=httpx.Timeout(timeout, connect=5.0),
            headers=protocol.bearer(token) if token else {},
            event_hooks={"request": [self.guard.acheck]},
            transport=httpx.AsyncHTTPTransport(uds=self.guard.uds) if self.guard.uds else None,
        )
        if act_as:
            self._http.headers[protocol.USER_HEADER] = act_as

    async def _resolve(self) -> None:
        """Under JupyterHub with a shared proxy token: act for the Hub user of this server.

        Asks whoami as the Hub user: a proxy token may (and must) name it; a user's own token is
        refused that (403 forbidden) and then acts as itself."""
        if self._resolved:
            return
        self._resolved = True
        try:
            resp = await self._http.get(protocol.WHOAMI, headers={protocol.USER_HEADER: self._hub_user})
            if resp.status_code == 200:
                self._http.headers[protocol.USER_HEADER] = self._hub_user
                log.info("gpulease: acting for JupyterHub user %s with a proxy token", self._hub_user)
            elif resp.status_code == 400:  # not a lease user name
                log.warning("gpulease: %s; set c.GpuLease.act_as_user", resp.json().get("message", resp.text))
            elif resp.status_code >= 500:
                self._resolved = False  # the lease server's trouble, not the token's: ask again next call
        except (httpx.HTTPError, ValueError):
            self._resolved = False  # try again with the next call
        except errors.GpuLeaseError:  # refused before sending (ServerGuard): ask again next call
            self._resolved = False
            raise

    async def close(self) -> None:
        await self._http.aclose()

    def _check(self) -> None:
        if self.problem:
            raise errors.ServerUnavailable(self.problem)

    def _unreachable(self, exc: httpx.TransportError) -> errors.ServerUnavailable:
        return errors.ServerUnavailable(
            f"cannot reach the lease server at {self.url} ({type(exc).__name__}: {exc or 'no answer'}); "
            f"is it running? (gpulease up; {CONFIG_HINT})"
        )

    @staticmethod
    def _error(status: int, body: Any, text: str) -> errors.GpuLeaseError:
        if not isinstance(body, dict) or "message" not in body:
            body = {"code": "http_error", "message": f"the lease server answered HTTP {status}: {text[:200]}"}
        err = errors.from_json(status, body)
        if status == 401:
            return LeaseServerAuth(
                f"the lease server refused the Jupyter server's lease token ({err.message}); {CONFIG_HINT}"
            )
        return err

    async def request(self, method: str, path: str, *, params: dict[str, str] | None = None, json: Any = None) -> Any:
        """One API call (``json``: the request body); returns the JSON body or raises the typed error of the answer.

        ``path``: a :mod:`lease_server.protocol` path (``protocol.lease(id)``), or the part after
        ``protocol.API`` (``"/leases"``), as the handlers have long passed it.

        An error's ``details`` (e.g. the clashing bookings and the windows that fit, of a 409
        ``reservation_clash``) travel on the typed error, so the handlers pass them on intact.
        """
        self._check()
        await self._resolve()
        give_up = time.monotonic() + RESEND_503_S
        while True:
            try:
                resp = await self._http.request(method, _api_path(path), params=params, json=json)
            except httpx.TransportError as exc:
                raise self._unreachable(exc) from exc
            # 503 with Retry-After: the lease server's Redis fails over or restarts; nothing
            # changed, and every request is safe to send again.
            wait = retry_after(resp)
            if wait is None or time.monotonic() + wait > give_up:
                break
            await asyncio.sleep(wait)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            raise self._error(resp.status_code, body, resp.text)
        if body is None:
            raise errors.ServerUnavailable(
                f"the lease server answered {method} {path} with something not JSON: {resp.text[:200]}"
            )
        return body

    async def whoami(self) -> dict[str, Any]:
        """The lease user this Jupyter server acts as (a token's identity never changes: cached)."""
        if self._me is None:
            self._me = await self.request("GET", protocol.WHOAMI)
        return self._me

    async def probe(self) -> dict[str, Any]:
        """For the version handshake: is the lease server there, and who are we to it?"""
        out: dict[str, Any] = {"url": self.url or None, "reachable": False}
        try:
            health = await self.request("GET", protocol.HEALTH)
            out.update(reachable=True, version=health.get("version"))
            me = await self.whoami()
            out.update(user=me.get("user"), role=me.get("role"))
        except errors.GpuLeaseError as exc:
            out.update(code=exc.code, error=exc.message)
        return out

    @asynccontextmanager
    async def events(self, since: str | None, changes: str | None = None) -> AsyncIterator[AsyncIterator[bytes]]:
        """The lease server's event stream (server-sent events), as raw chunks to pass on as they are;
        ``changes``: the stream of changes (GET /events?changes=), as the page asked.

        Errors before the stream starts (bad ``since``, bad token, server away) raise the typed error.
        """
        self._check()
        await self._resolve()
        headers = {"Accept": "text/event-stream"}
        if since:
            headers[protocol.LAST_EVENT_ID] = since
        timeout = httpx.Timeout(self.timeout, connect=5.0, read=STREAM_READ_TIMEOUT)
        try:
            params = {"changes": changes} if changes is not None else None
            async with self._http.stream(
                "GET", protocol.EVENTS, headers=headers, params=params, timeout=timeout
            ) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")
                    try:
                        body = resp.json()
                    except ValueError:
                        body = None
                    raise self._error(resp.status_code, body, text)
                yield resp.aiter_raw()
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
