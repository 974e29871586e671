"""Python client of the lease server, used by the CLI, the magic and the Jupyter extension.

    from lease_server.client import Client
    with Client().lease(gpus=2, wait=600) as lease:
        os.environ["CUDA_VISIBLE_DEVICES"] = lease.cuda_visible_devices
        train()

The lease is renewed in the background at a third of its TTL and released when the block ends,
also on exceptions. The server and token come from arguments, else ``GPULEASE_URL`` and
``GPULEASE_TOKEN``, else the files ``gpulease up`` writes (``~/.gpulease/url`` and ``.../token``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import random
import secrets
import socket
import stat
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx

from . import errors, procs, protocol
from .listeners import listeners
from .protocol import GpuJson, LeaseJson, LeaseState
from .request import MAX_TEXT, AcquireRequest
from .sizes import as_option, ordinal, parse_gpu_mem, show_duration, show_mb

log = logging.getLogger(__name__)
DEFAULT_HOME = Path(os.environ.get("GPULEASE_HOME", Path.home() / ".gpulease"))


def discover(url: str | None = None, token: str | None = None, *, notebook: bool = False) -> tuple[str, str]:
    """The server URL and token: arguments, then environment, then the local launcher's files.

    ``notebook``: for a kernel or a Jupyter server, whose code and workers hold their token (Ray
    workers too, where other users may read it): ``gpulease up``'s *user* token
    (``lab_token``) before its admin token (``token``), which is the CLI's."""
    url = url or os.environ.get("GPULEASE_URL")
    token = token or os.environ.get("GPULEASE_TOKEN")
    home = DEFAULT_HOME
    if not url and (home / "url").exists():
        url = (home / "url").read_text().strip()
    ours = not token  # a token of up's own files, for up's own server only
    if not token and notebook and (home / "lab_token").exists():
        token = (home / "lab_token").read_text().strip()
    if not token and (home / "token").exists():
        token = (home / "token").read_text().strip()
    if not url:
        raise errors.ServerUnavailable(
            "no lease server configured: set GPULEASE_URL (and GPULEASE_TOKEN), or start one with 'gpulease up'"
        )
    if ours and token:
        ServerGuard(url, token, ours=True, uds=up_socket(url.rstrip("/"), token)).check()
    return url.rstrip("/"), token or ""


def _up_tokens() -> set[str]:
    """The tokens of ``gpulease up``'s files (its admin token, its user token), those readable."""
    out = set()
    for name in ("token", "lab_token"):
        try:
            out.add((DEFAULT_HOME / name).read_text().strip())
        except OSError:
            pass
    return out - {""}


UP_SOCKET = "api.sock"  # gpulease up's Unix socket, in its data dir (0700)


def up_socket(url: str, token: str) -> str | None:
    """``gpulease up``'s Unix socket, for a client of up's own server: the path that up's
    JupyterLab and kernels are given (``GPULEASE_SOCKET``, with ``GPULEASE_URL``), or, for up's
    own tokens, the one in its data dir; or a deployment's shared socket (``unix_socket``) given
    the same way. No other user may bind a path there, as anyone may bind a TCP port while the
    server is down. None for any other server, or where the socket is neither this user's nor a
    deployment's (up is down, or of an earlier release)."""
    given = os.environ.get("GPULEASE_SOCKET", "")
    if given and os.environ.get("GPULEASE_URL", "").rstrip("/") == url.rstrip("/"):
        path = Path(given)
    else:
        try:
            up_url = (DEFAULT_HOME / "url").read_text().strip().rstrip("/")
        except OSError:
            return None
        if not token or up_url != url.rstrip("/") or token not in _up_tokens():
            return None
        path = DEFAULT_HOME / UP_SOCKET
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    if given and path != DEFAULT_HOME / UP_SOCKET:  # given: whoever's it is, in a folder only they may write
        return str(path) if _deployment_socket(path, st) else None
    return str(path) if st.st_uid == os.geteuid() else None


def _deployment_socket(path: Path, st: os.stat_result) -> bool:
    """Whether ``path``, given as ``GPULEASE_SOCKET``, is safe to send a token to: this user's,
    root's or ``GPULEASE_SERVER_UID``'s (up's socket, a deployment's ``unix_socket``), in a folder
    of theirs that nobody else may write, so that no other account can have put it there."""
    owners = {0, os.geteuid(), _server_uid() or 0}
    try:
        folder = path.parent.stat()
    except OSError:
        return False
    return st.st_uid in owners and folder.st_uid in owners and not folder.st_mode & 0o022


def _local_targets(host: str, port: int) -> set[str]:
    """The addresses of this very host that ``host`` names: where a local user may listen in the
    server's place. Empty for another host (or a name that does not resolve)."""
    if host.rstrip(".") == "localhost":
        return {"127.0.0.1", "::1"}
    try:
        addrs = {str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()
    local = set()
    for addr in addrs:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
        if ip.is_loopback:
            local.add(str(ip))
            continue
        try:  # an address of one of this host's interfaces can be bound here
            with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET) as probe:
                probe.bind((str(ip), 0))
            local.add(str(ip))
        except OSError:
            pass
    return local


def _reaches(listener_addr: str, targets: set[str]) -> bool:
    """Whether a socket listening on ``listener_addr`` may take a connection to one of ``targets``."""
    addr = listener_addr.removeprefix("::ffff:")
    if addr in targets or addr == "::":  # (an IPv6 wildcard takes IPv4 connections too, unless V6ONLY)
        return True
    return addr == "0.0.0.0" and any(":" not in t for t in targets)


def _server_uid() -> int | None:
    """``GPULEASE_SERVER_UID``: the lease server's user on this host (a uid, or a user name)."""
    named = os.environ.get("GPULEASE_SERVER_UID", "").strip()
    if not named:
        return None
    if named.isdigit():
        return int(named)
    import pwd

    try:
        return pwd.getpwnam(named).pw_uid
    except KeyError:
        raise errors.ConfigurationError(
            f"GPULEASE_SERVER_UID={named!r} is no user of this host: name the lease server's user, or its uid"
        ) from None


def _account(uid: int) -> str:
    """``uid`` as a refusal names it: its user name where the host knows one."""
    name = procs.account_name(uid)
    return f"{name} (uid {uid})" if name else f"uid {uid}"


class ServerGuard:
    """Asked before every request that carries a token to a server on this very host: whose
    process listens there, as the kernel says (:mod:`listeners`). While the lease server is down
    (stopped, died with its terminal), any local user may bind its port and read the token off
    the next request of a client: a JupyterLab tab that reconnects, a kernel's renewals, or any
    CLI command.

    Only the listeners that may take this client's connection count (the URL's addresses, and
    the wildcards): a listener of another user on another address is none of its business. Each
    must be the server's, known before anything is sent, never learnt from whoever listens: root,
    this very user (a token sent to one's own process goes nowhere new: ``gpulease up``'s tokens,
    wherever its data dir is), ``GPULEASE_SERVER_UID`` where it is set (a deployment's server
    user), and ``allowed`` (the users a kernel's guard allowed, handed to its workers). A host
    where the kernel cannot tell passes. Not covered: a listener that binds between this check and
    the connect, where none listened before (a refused connection, microseconds later)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        ours: bool | None = None,
        allowed: Iterable[int] | None = None,
        uds: str | None = None,
    ) -> None:
        self.url = url
        self.uds = uds  # requests go to gpulease up's Unix socket: no listener to ask about
        parts = httpx.URL(url)
        self.targets = _local_targets(parts.host, parts.port or 0) if token and parts.port and not uds else set()
        self.port = parts.port if self.targets else None
        self.allowed: set[int] = {0, os.geteuid()} | set(allowed or ())
        self.named = _server_uid()
        if self.named is not None:
            self.allowed.add(self.named)
        self.ours = ours if ours is not None else (self.port is not None and token in _up_tokens())

    def check(self, *_: object) -> None:
        """Raise :class:`errors.ServerUnavailable`, sending nothing, if another user listens there."""
        if self.port is None:
            return
        found = listeners(self.port) or []
        strangers = {li.uid for li in found if _reaches(li.addr, self.targets)} - self.allowed
        if not strangers:
            return  # the server's (or nobody: the request will not connect), or the kernel cannot tell
        who = _account(min(strangers))
        name = who.split(" ")[0]
        if self.ours:
            fix = "Is your gpulease up down? Start it again with 'gpulease up'"
        elif self.named is not None:
            fix = f"The lease server's user is {_account(self.named)} (GPULEASE_SERVER_UID): is it down?"
        else:
            fix = f"If {name} runs your lease server, set GPULEASE_SERVER_UID={name}"
        raise errors.ServerUnavailable(
            f"{self.url} is another user's ({who} listens there): your token was not sent. {fix}"
        )

    async def acheck(self, *_: object) -> None:
        """:meth:`check` as an httpx.AsyncClient's request hook."""
        self.check()


# A request that got no answer because its connection closed under it: sent once more.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _resendable(method: str, path: str) -> bool:
    """Whether a request whose answer was lost may be sent again without doing twice what it does."""
    if method.upper() != "POST":
        return True
    return path.rstrip("/") == protocol.LEASES or path.endswith(("/renew", "/warm", "/keep"))


def retry_after(resp: httpx.Response) -> float | None:
    """How long to wait before sending again a request answered 503 with Retry-After (capped at
    5 s); None for any other answer."""
    if resp.status_code != 503:
        return None
    try:
        return min(5.0, max(0.05, float(resp.headers.get("Retry-After", ""))))
    except ValueError:
        return None


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)


@dataclass
class Lease:
    """A granted lease as the client sees it."""

    id: str
    token: int
    user: str
    pool: str
    node: str
    gpus: list[GpuJson]
    expires_at: float
    ttl: float
    state: str = LeaseState.ACTIVE.value
    label: str = ""
    booking: str = ""  # the booking it is served from, if any (the lease JSON's "reservation")
    borrowed: bool = False  # taken from booked capacity: recalled with notice when the holder asks
    nodes: list[str] = field(default_factory=list)  # a multi-node gang's nodes (else empty)
    gpu_mem_mb: int = 0  # a slice: MB of each of its GPUs promised to it (0: whole GPUs)
    raw: LeaseJson = field(default_factory=lambda: cast(LeaseJson, {}), repr=False)

    @property
    def reservation(self) -> str:
        """Deprecated: :attr:`booking`."""
        _deprecated("Lease.reservation", "Lease.booking")
        return self.booking

    @classmethod
    def from_json(cls, data: LeaseJson) -> Lease:
        return cls(
            id=data["id"],
            token=int(data.get("token", 0)),
            user=data["user"],
            pool=data["pool"],
            node=data["node"],
            gpus=data["gpus"],
            expires_at=data["expires_at"],
            ttl=data["ttl"],
            state=data.get("state", LeaseState.ACTIVE.value),
            label=data.get("label", ""),
            booking=data.get("reservation", ""),
            borrowed=bool(data.get("borrowed", False)),
            nodes=list(data.get("nodes", [])),
            gpu_mem_mb=int(data.get("gpu_mem_mb", 0)),
            raw=data,
        )

    def parts(self) -> dict[str, list[int]]:
        """node -> the GPU indexes leased on it (one node unless this is a multi-node gang)."""
        out: dict[str, list[int]] = {}
        for g in self.gpus:
            out.setdefault(g.get("node", self.node), []).append(int(g["index"]))
        return out

    @property
    def indexes(self) -> list[int]:
        return [int(g["index"]) for g in self.gpus]

    @property
    def cuda_visible_devices(self) -> str:
        return visible_devices(self.gpus)

    @property
    def uuids(self) -> list[str]:
        return [g.get("uuid", "") for g in self.gpus]


def _in_flags(exc: errors.GpuLeaseError) -> str:
    """The refusals a person meets most, in the flags they typed (the API's speak of fields)."""
    d = exc.details
    largest_mb, mem = d.get("largest_mb"), d.get("gpu_mem_mb")
    if isinstance(largest_mb, int) and isinstance(mem, int):
        over = f"--gpu-mem {as_option(mem)} is over a GPU of {d.get('pool')} ({show_mb(largest_mb)})"
        return f"{over}: drop --gpu-mem for a whole GPU"
    largest, gpus = d.get("largest_node"), d.get("gpus")
    if isinstance(largest, int) and isinstance(gpus, int):
        nodes = d.get("nodes")
        gang = ", or --nodes K" if not isinstance(nodes, int) or nodes > 1 else ""
        return f"no node of {d.get('pool')} has {gpus} GPUs (the largest has {largest}): ask --gpus {largest}{gang}"
    return exc.message


def waited_out(exc: errors.GpuLeaseError, flag: str = "--wait") -> str:
    """A :class:`errors.NoCapacity` as a client whose ``flag`` takes a duration (``10m``) says it: the
    API's words ask for a ``wait`` in seconds. A request that waited out its wait says how long and
    where it stood; one refused at once names the flag that queues it. A request no GPU could
    ever serve is said in the flags of ``gpulease acquire`` and ``%%gpu_train`` (``--gpu-mem``,
    ``--gpus``, ``--nodes``), not the API's fields. Any other error: its message."""
    if not isinstance(exc, errors.NoCapacity):
        return _in_flags(exc)
    d = exc.details
    position, wait_s, gpus = d.get("position"), d.get("wait_s"), d.get("gpus")
    if isinstance(wait_s, (int, float)) and wait_s > 0 and isinstance(gpus, int):
        place = f", still {ordinal(position)} in line" if isinstance(position, int) and position > 0 else ""
        return (
            f"gave up after {flag} {show_duration(wait_s)}{place} for {gpus} GPU{'s' if gpus != 1 else ''} "
            f"of {d.get('pool')}\n  a longer {flag} waits more, or ask for fewer GPUs"
        )
    return exc.message.replace("pass wait (seconds)", f"pass {flag} (e.g. {flag} 10m)").replace(
        "pass wait (",
        f"pass {flag} (",  # "(at least the booking's recall notice)"
    )


def visible_devices(gpus: Iterable[Mapping[str, Any]]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for leased GPUs: their NVML indexes, and a MIG instance by its UUID
    (``MIG-...``: CUDA knows an instance only by that)."""
    return ",".join(str(g["uuid"]) if str(g.get("uuid", "")).startswith("MIG-") else str(g["index"]) for g in gpus)


class Client:
    """A thin, thread-safe HTTP client of the lease API that raises the typed errors of errors.py."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 10.0,
        act_as: str | None = None,
        resend_503_s: float = 15.0,
        notebook: bool = False,
    ) -> None:
        """``act_as`` (default: GPULEASE_USER): the user a proxy token acts for (JupyterHub).
        ``resend_503_s``: how long a request answered 503 (Redis failing over, restarting,
        loading) is sent again before :class:`errors.ServerUnavailable` is raised (0: never).
        ``notebook``: a kernel's client, which takes ``gpulease up``'s user token (:func:`discover`)."""
        self.url, self.token = discover(url, token, notebook=notebook)
        self.timeout = timeout
        self.resend_503_s = resend_503_s
        headers = protocol.bearer(self.token) if self.token else {}
        act_as = act_as if act_as is not None else os.environ.get("GPULEASE_USER", "")
        if act_as:
            headers[protocol.USER_HEADER] = act_as
        # up's own server over its Unix socket, else, before each request, who listens there
        self.guard = ServerGuard(self.url, self.token, uds=up_socket(self.url, self.token))
        self._http = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=5.0),
            headers=headers,
            event_hooks={"request": [self.guard.check]},
            transport=httpx.HTTPTransport(uds=self.guard.uds) if self.guard.uds else None,
        )

    @property
    def headers(self) -> dict[str, str]:
        """What every request carries (the token, and the user a proxy token acts for)."""
        return dict(self._http.headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One API call: its answer, a JSON object (every endpoint answers one), or the typed error
        of errors.py that the server's error body names. A 503 is resent after its Retry-After."""
        give_up = time.monotonic() + self.resend_503_s
        dropped = 0
        while True:
            try:
                resp = self._http.request(
                    method,
                    path,
                    json=json,
                    params=params,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except DROPPED as exc:
                # The connection closed under the request with no answer: most often a kept-alive
                # connection the server closed (idle) just as this request went out. Sent once more
                # on a new connection, as browsers and curl do, if sending it twice changes nothing
                # more than once: GET, PUT, DELETE (a release finds the lease ended), an acquire
                # (found again by its id), a renew. A POST that makes something (a booking, a
                # token) is not: the server may have made it before the connection closed.
                dropped += 1
                why = f"({exc.__class__.__name__}: {exc})"
                if not _resendable(method, path):
                    raise errors.ServerUnavailable(
                        f"the lease server at {self.url} closed the connection without an answer {why}: "
                        f"{method} {path} may have been done; look before sending it again (gpulease status)"
                    ) from exc
                if dropped > 1:
                    raise errors.ServerUnavailable(
                        f"the lease server at {self.url} closed the connection twice without an answer {why}; "
                        "is it overloaded or restarting? (gpulease status)"
                    ) from exc
                continue
            except httpx.TransportError as exc:
                raise errors.ServerUnavailable(
                    f"cannot reach the lease server at {self.url} ({exc.__class__.__name__}: {exc}); "
                    "is it running? (gpulease up, or check GPULEASE_URL)"
                ) from exc
            # 503: Redis fails over, restarts or loads; nothing changed and every request is safe to
            # send again (a resent acquire finds its own id): resend after Retry-After while it lasts.
            wait = retry_after(resp)
            if wait is None or time.monotonic() + wait > give_up:
                break
            time.sleep(wait)
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = {"code": "http_error", "message": f"HTTP {resp.status_code}: {resp.text[:200]}"}
            raise errors.from_json(resp.status_code, body)
        got = resp.json()
        if not isinstance(got, dict):
            raise errors.GpuLeaseError(f"{method} {path} answered a JSON {type(got).__name__}, not an object")
        return got

    # ---- leases ------------------------------------------------------------------------------

    def acquire(
        self,
        gpus: int = 1,
        pool: str | None = None,
        ttl: float | None = None,
        wait: float = 0,
        label: str = "",
        session: str = "",
        progress: Callable[[int | None, float], None] | None = None,
        *,
        gpus_min: int | None = None,
        priority: str | None = None,
        nodes: int | None = None,
        notebook: str = "",
        cell: str = "",
        request_id: str | None = None,
        gpu_mem: str | int | float | None = None,
        prefer_node: str | None = None,
        ends_within: float | None = None,
    ) -> Lease:
        """Lease ``gpus`` GPUs, waiting up to ``wait`` seconds in the queue.

        ``gpu_mem`` leases a slice of one GPU instead (with ``gpus`` k > 1, one such slice on each of k
        GPUs of one node): "10GB", "10240MB", an int of
        MB, or a fraction of one GPU of the pool such as 0.25 (in a pool that shares its GPUs;
        rounded up to the pool's unit: the lease's ``gpu_mem_mb`` says the size it got). A size
        it cannot read raises ValueError before anything is sent.

        ``gpus_min`` makes the request elastic: granted as many as one node has free, between
        gpus_min and gpus. ``priority`` is a class: "low", "normal" or "high".

        ``progress(position, elapsed_s)`` is called about once a second while the request waits
        (position None once it has left the queue), so a caller can show where it stands.
        Any exception or interrupt while queued withdraws the request (``DELETE`` of its id): no
        request is left queued, and a grant that raced ahead is released. ``request_id`` names the
        request (default: a fresh one), e.g. to ask ``estimate`` about it while it waits.
        ``prefer_node``: take the GPUs on that node if it has them free when they are granted (whole
        GPUs on one node; the node of a suspended worker), else wherever best fit puts them.
        ``ends_within``: seconds after the grant by which you mean to end the lease (a cell's
        --timeout): not enforced, but the wait estimates of those queued behind you count on it.
        """
        lid = request_id or self.new_request_id()
        mem_mb = None if gpu_mem is None else self.gpu_mem_mb(gpu_mem, pool)
        body = AcquireRequest(
            id=lid,
            gpus=gpus,
            gpus_min=None if gpus_min == gpus else gpus_min,
            nodes=nodes if nodes and nodes > 1 else 1,
            pool=pool or None,
            ttl=ttl or None,
            wait=wait,
            label=label,
            session=session,
            notebook=notebook[:MAX_TEXT],
            cell=cell[:MAX_TEXT],
            priority=priority or "normal",
            gpu_mem_mb=mem_mb,
            prefer_node=prefer_node or None,
            ends_within=ends_within or None,
        ).json()
        outcome: dict[str, Any] = {}  # "lease": Lease | "error": BaseException

        def post() -> None:
            try:
                outcome["lease"] = self._lease_call("POST", protocol.LEASES, json=body, timeout=wait + self.timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                outcome["error"] = exc

        if wait <= 0:
            post()
        else:
            # The long poll runs in a helper thread so that this thread stays interruptible and can
            # report progress; whatever stops this thread (Stop, an error in ``progress``) withdraws
            # the request, which also ends the long poll at once.
            t0 = time.monotonic()
            poller = threading.Thread(target=post, name=f"gpulease-acquire-{lid}")
            poller.start()
            tick = 0.05  # a request still waiting after this shows its place in the queue at once
            try:
                while True:
                    poller.join(tick if progress is not None else 5.0)
                    tick = 1.0
                    if not poller.is_alive():
                        break
                    if progress is not None:
                        try:
                            position = next((w["position"] for w in self.queue(pool) if w["id"] == lid), None)
                        except errors.GpuLeaseError:
                            position = None
                        progress(position, time.monotonic() - t0)
            except BaseException as exc:
                # the event log's words: a person's Stop or Ctrl-C, or the caller's own error
                why = "the caller stopped waiting"
                if isinstance(exc, KeyboardInterrupt):
                    why = "interrupted (Stop or Ctrl-C)"
                self.withdraw(lid, reason=f"withdrawn: {why}")
                poller.join(self.timeout)
                raise
        if "error" in outcome:
            raise outcome["error"]
        lease: Lease = outcome["lease"]
        return lease

    def gpu_mem_mb(self, gpu_mem: str | int | float, pool: str | None = None) -> int:
        """``gpu_mem`` as the API takes it, in whole MB: a fraction is of one GPU of ``pool`` (default:
        the server's default pool), read from the board (GET /cluster) only then."""
        size = parse_gpu_mem(gpu_mem)
        if size.fraction is None:
            return size.to_mb(0)
        view = self.cluster()
        name = pool or view.get("default_pool")
        gpu_mb = max(
            (int(g.get("memory_mb") or 0) for n in view["nodes"] if n["pool"] == name for g in n["gpus"]), default=0
        )
        if gpu_mb <= 0:
            raise ValueError(
                f"pool {name!r} lists no GPU memory, so a fraction ({gpu_mem}) cannot be sized: give a size such "
                "as 10GB"
            )
        return size.to_mb(gpu_mb)

    @staticmethod
    def new_request_id() -> str:
        """A fresh id for a lease request (the lease keeps it once granted)."""
        return "l-" + secrets.token_hex(8)

    def withdraw(self, request_id: str, reason: str = "withdrawn") -> dict[str, Any] | None:
        """Give up a request: leave the queue if it waits, release it if it was granted in between.
        Never raises for a request that is already gone; returns the server's answer (or None)."""
        try:
            return self.request("DELETE", protocol.lease(request_id), params={"reason": reason}, timeout=self.timeout)
        except errors.NoSuchLease:
            return None
        except errors.GpuLeaseError as exc:
            log.warning("could not withdraw %s: %s", request_id, exc)
            return None

    def renew(
        self,
        lease: Lease | str,
        token: int | None = None,
        ttl: float | None = None,
        activity: dict[str, Any] | None = None,
    ) -> Lease:
        """Extend a lease. ``activity`` ({"executing": bool}) tells the idle-GPU reclaimer what the
        holder is doing."""
        lid, tok = (lease.id, lease.token) if isinstance(lease, Lease) else (lease, token)
        body: dict[str, Any] = {"token": tok}
        if ttl:
            body["ttl"] = ttl
        if activity is not None:
            body["activity"] = activity
        return self._lease_call("POST", protocol.lease_renew(lid), json=body)

    def handoff(self, lease: Lease, to: list[str]) -> Lease:
        """End ``lease`` and grant its GPUs in one step to the pool's oldest waiter, which must be
        one of your queued requests ``to`` (its blocked acquire returns the new lease).
        :class:`errors.Conflict` (nothing changed) unless releasing could not have given them to
        anyone else."""
        body = {"token": lease.token, "to": to}
        reply = self.request("POST", protocol.lease_handoff(lease.id), json=body)
        return Lease.from_json(cast(LeaseJson, reply["lease"]))

    def grow(self, lease: Lease, gpus: int) -> Lease:
        """Add ``gpus`` GPUs to your elastic lease, on its node, all or none; returns the lease with
        its new GPUs (same token). :class:`errors.Conflict` (nothing changed) says why not: someone
        waits in the pool, the node lacks them, the elastic maximum, ..."""
        body = {"token": lease.token, "gpus": gpus, "size": len(lease.gpus)}  # a resend is then harmless
        return self._lease_call("POST", protocol.lease_grow(lease.id), json=body)

    def shrink(self, lease: Lease, gpus: int) -> Lease:
        """Give back ``gpus`` GPUs of your lease (its highest-indexed ones; at least one stays);
        returns the lease with the GPUs it kept (same token)."""
        body = {"token": lease.token, "gpus": gpus, "size": len(lease.gpus)}  # a resend is then harmless
        return self._lease_call("POST", protocol.lease_shrink(lease.id), json=body)

    def draining(self) -> list[dict[str, Any]]:
        """Every draining GPU of the cluster, with the processes its agent gave up (admin)."""
        return list(self.request("GET", protocol.DRAINING)["draining"])

    def clear_drain(self, node: str, gpus: list[int]) -> int:
        """Declare draining ``gpus`` of ``node`` clean (admin): they turn free. Returns GPUs freed."""
        body = {"lease": "", "gpus": gpus}
        return int(self.request("POST", protocol.node_drained(node), json=body)["freed"])

    def suspend(self, lease: Lease) -> dict[str, Any]:
        """Hand back your warm one-GPU lease with its worker suspended to host memory (its node's
        agent moves it off the GPU before the GPU is lent). Raises Conflict where it cannot be."""
        return self.request("POST", protocol.lease_suspend(lease.id), json={"token": lease.token})

    def warm(self, lease: Lease, on: bool = True) -> dict[str, Any]:
        """Keep your one-node lease warm between cells (``on``): your worker stays, its GPUs are lent
        to whoever would otherwise wait (event ``evicting``, then revoked after the pool's notice);
        or run a cell on it again (not ``on``): :class:`errors.Conflict` once it is being evicted."""
        body = {"token": lease.token, "warm": on}
        return self.request("POST", protocol.lease_warm(lease.id), json=body)

    def keep(self, lease_id: str) -> dict[str, Any]:
        """ "I'm still using it": reset the idle clock of a warned lease."""
        return self.request("POST", protocol.lease_keep(lease_id))

    def release(self, lease: Lease | str, token: int | None = None, verified: bool = False) -> dict[str, Any]:
        """Release (idempotent). ``verified``: you saw every process that claimed the lease gone
        (``lease_server.node.claims``); without it the GPUs on which one did drain before they are free."""
        lid, tok = (lease.id, lease.token) if isinstance(lease, Lease) else (lease, token)
        params: dict[str, Any] = {"token": tok} if tok else {}
        if verified:
            params["verified"] = "true"
        return self.request("DELETE", protocol.lease(lid), params=params or None)

    def revoke(self, lease_id: str, reason: str = "") -> dict[str, Any]:
        return self.request("POST", protocol.lease_revoke(lease_id), json={"reason": reason})

    def create_token(
        self,
        user: str,
        role: str = "user",
        *,
        expires_in: float | None = None,
        acts_for: str | None = None,
        node: str | None = None,
    ) -> dict[str, Any]:
        """Make an API token (admin): its id, scope and expiry, and its secret (``token``), shown once."""
        body: dict[str, Any] = {"user": user, "role": role}
        for key, value in (("expires_in", expires_in), ("acts_for", acts_for), ("node", node)):
            if value is not None:
                body[key] = value
        return self.request("POST", protocol.TOKENS, json=body)

    def tokens(self) -> list[dict[str, Any]]:
        """Every API token (admin): id, user, role, created, expires, last_used, acts_for / node."""
        return list(self.request("GET", protocol.TOKENS)["tokens"])

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        """Revoke an API token by its id (admin): refused from the next request on."""
        return self.request("DELETE", protocol.token(token_id))

    def get(self, lease_id: str) -> LeaseJson:
        return cast(LeaseJson, self.request("GET", protocol.lease(lease_id)))

    def _lease_call(self, method: str, path: str, **kw: Any) -> Lease:
        """A call that answers a lease record (:class:`protocol.LeaseJson`, the one declaration of
        its fields that the server's answer and the OpenAPI document share)."""
        return Lease.from_json(cast(LeaseJson, self.request(method, path, **kw)))

    def leases(self, everyone: bool = False) -> list[LeaseJson]:
        got = self.request("GET", protocol.LEASES, params={"all": "true" if everyone else "false"})
        return cast(list[LeaseJson], got["leases"])

    def cluster(self, pool: str | None = None, after: str | None = None, limit: int | None = None) -> dict[str, Any]:
        """The board's view: every pool's counts and its nodes (``pool``: only that pool's; ``after``
        and ``limit``: a page of them, whose ``next`` is the next page's ``after``; limit 0: the
        counts only)."""
        asked = {"pool": pool, "after": after, "limit": None if limit is None else str(limit)}
        return self.request("GET", protocol.CLUSTER, params={k: v for k, v in asked.items() if v is not None} or None)

    def queue(self, pool: str | None = None) -> list[dict[str, Any]]:
        return cast(
            list[dict[str, Any]],
            self.request("GET", protocol.QUEUE, params={"pool": pool} if pool else None)["waiting"],
        )

    def events(
        self,
        since: str = "-",
        limit: int = 100,
        *,
        lease: str | None = None,
        before: str | None = None,
        newest_first: bool = False,
        types: Iterable[str] = (),
        user: str | None = None,
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` entries of the event log after ``since``, oldest first; ``newest_first``:
        the newest ones (before ``before``, if given) first. The server keeps only ``lease``'s,
        those of ``types`` and those of ``user``."""
        params: dict[str, Any] = {"since": since, "limit": limit}
        if lease:
            params["lease"] = lease
        if before:
            params["before"] = before
        if newest_first:
            params["order"] = "desc"
        if types:
            params["type"] = ",".join(sorted(types))
        if user:
            params["user"] = user
        return cast(list[dict[str, Any]], self.request("GET", protocol.EVENT_LOG, params=params)["events"])

    @contextmanager
    def event_stream(self, since: str | None = None, lease: str | None = None) -> Iterator[Iterator[dict[str, Any]]]:
        """The live event stream (``GET /api/v1/events``, server-sent events) as an iterator of
        events, open when this returns: the server has subscribed this client by then, so no event
        added after it is missed. ``since``: first the entries after this id; ``lease``: only that
        lease's. The server sends a keep-alive every 15 s, so a read waits at most a minute; a lost
        connection raises :class:`errors.ServerUnavailable`."""
        headers = {"Accept": "text/event-stream"}
        if since:
            headers[protocol.LAST_EVENT_ID] = since
        timeout = httpx.Timeout(self.timeout, connect=5.0, read=60.0)
        params = {"lease": lease} if lease else None
        try:
            with self._http.stream("GET", protocol.EVENTS, headers=headers, params=params, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    try:
                        body = resp.json()
                    except ValueError:
                        body = {"code": "http_error", "message": f"HTTP {resp.status_code}: {resp.text[:200]}"}
                    raise errors.from_json(resp.status_code, body)
                lines = resp.iter_lines()
                for line in lines:  # the stream's opening comment: sent once this client is subscribed
                    if line == "":
                        break
                yield _sse_events(lines)
        except httpx.TransportError as exc:
            raise errors.ServerUnavailable(
                f"lost the event stream of {self.url} ({exc.__class__.__name__}: {exc})"
            ) from exc

    def estimate(
        self,
        gpus: int = 1,
        pool: str | None = None,
        request: str | None = None,
        gpu_mem_mb: int | None = None,
        nodes: int = 1,
    ) -> dict[str, Any]:
        """How long ``gpus`` GPUs of ``pool`` would take, and other pools with them free now.
        ``request``: the id of a queued request, so that only what is queued ahead of it counts.
        ``gpu_mem_mb``: slices of that much memory instead of whole GPUs. ``nodes``: a gang of
        ``gpus`` / ``nodes`` GPUs on each of that many nodes (refused when the pool cannot hold it)."""
        params: dict[str, Any] = {"gpus": gpus, **({"pool": pool} if pool else {})}
        if request:
            params["lease"] = request
        if gpu_mem_mb:
            params["gpu_mem_mb"] = gpu_mem_mb
        if nodes > 1:
            params["nodes"] = nodes
        return self.request("GET", protocol.ESTIMATE, params=params)

    def usage(self, by: str = "user", start: float | None = None, end: float | None = None) -> dict[str, Any]:
        params = {k: v for k, v in (("by", by), ("from", start), ("to", end)) if v is not None}
        return self.request("GET", protocol.USAGE, params=params)

    def usage_summary(
        self,
        by: str = "user",
        start: float | str | None = None,
        end: float | str | None = None,
        pool: str | None = None,
        user: str | None = None,
        also_by: str | None = None,
    ) -> dict[str, Any]:
        """Per-day series and totals of GPU use from the hourly rollups (GET /usage/summary; the
        answer's shape is the OpenAPI document's UsageSummary, docs/usage.md). ``also_by``: the same
        rows grouped a second way too, in the answer's ``also``."""
        given = (("by", by), ("also_by", also_by), ("from", start), ("to", end), ("pool", pool), ("user", user))
        return self.request("GET", protocol.USAGE_SUMMARY, params={k: v for k, v in given if v is not None})

    def balance(self, pool: str | None = None) -> dict[str, Any]:
        """Your quota used and left, fair-share place and next wait, per pool (GET /usage/balance)."""
        return self.request("GET", protocol.USAGE_BALANCE, params={"pool": pool} if pool else None)

    # ---- bookings --------------------------------------------------------------------------------

    def book(
        self, pool: str, gpus: int, start: float | str, end: float | str, *, dry_run: bool = False, **extra: Any
    ) -> dict[str, Any]:
        """Book ``gpus`` GPUs of ``pool`` from ``start`` to ``end`` (epoch seconds or ISO 8601 with an
        offset). ``extra``: owner, note, repeat="weekly", occurrences, colocate. A clash raises
        :class:`errors.BookingClash` whose ``details`` name the clashing bookings and suggestions."""
        body = {"pool": pool, "gpus": gpus, "start": start, "end": end, **extra}
        params = {"dry_run": "true"} if dry_run else None
        return self.request("POST", protocol.BOOKINGS, json=body, params=params)

    def bookings(
        self, pool: str | None = None, start: float | None = None, end: float | None = None
    ) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("pool", pool), ("from", start), ("to", end)) if v is not None}
        return cast(list[dict[str, Any]], self.request("GET", protocol.BOOKINGS, params=params)["bookings"])

    def cancel_booking(self, booking_id: str) -> dict[str, Any]:
        return self.request("DELETE", protocol.booking(booking_id))

    def end_booking(self, booking_id: str) -> dict[str, Any]:
        """End the booking's occurrence in force now: its GPUs go back to the pool."""
        return self.request("POST", protocol.booking_end(booking_id))

    # The names before bookings were called bookings everywhere, kept for one release for code
    # outside this repository: each warns (DeprecationWarning) and calls its successor.

    def reserve(
        self, pool: str, gpus: int, start: float | str, end: float | str, *, dry_run: bool = False, **extra: Any
    ) -> dict[str, Any]:
        """Deprecated: :meth:`book`."""
        _deprecated("Client.reserve", "Client.book")
        return self.book(pool, gpus, start, end, dry_run=dry_run, **extra)

    def reservations(
        self, pool: str | None = None, start: float | None = None, end: float | None = None
    ) -> list[dict[str, Any]]:
        """Deprecated: :meth:`bookings`."""
        _deprecated("Client.reservations", "Client.bookings")
        return self.bookings(pool, start, end)

    def cancel_reservation(self, booking_id: str) -> dict[str, Any]:
        """Deprecated: :meth:`cancel_booking`."""
        _deprecated("Client.cancel_reservation", "Client.cancel_booking")
        return self.cancel_booking(booking_id)

    def end_reservation(self, booking_id: str) -> dict[str, Any]:
        """Deprecated: :meth:`end_booking`."""
        _deprecated("Client.end_reservation", "Client.end_booking")
        return self.end_booking(booking_id)

    def whoami(self) -> dict[str, Any]:
        return self.request("GET", protocol.WHOAMI)

    def health(self) -> dict[str, Any]:
        return self.request("GET", protocol.HEALTH)

    @contextmanager
    def lease(
        self,
        gpus: int = 1,
        pool: str | None = None,
        ttl: float | None = None,
        wait: float = 0,
        label: str = "",
        session: str = "",
        progress: Callable[[int | None, float], None] | None = None,
        gpu_mem: str | int | float | None = None,
    ) -> Iterator[HeldLease]:
        """Hold a lease for the ``with`` block: renewed in the background, released on exit
        (``gpu_mem``: a slice of one GPU, as :meth:`acquire` takes it)."""
        held = HeldLease(self, self.acquire(gpus, pool, ttl, wait, label, session, progress, gpu_mem=gpu_mem))
        try:
            yield held
        finally:
            held.release()


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The events of a server-sent event stream: each block's ``data`` as JSON (comments such as
    the keep-alives skipped)."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield json.loads("\n".join(data))
            data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)


class HeldLease:
    """A lease plus its renewal thread. The thread keeps only a weak reference to this object and
    stops on an Event, so a forgotten HeldLease never keeps renewing (the TTL then frees the GPUs)."""

    def __init__(self, client: Client, lease: Lease) -> None:
        self.client = client
        self.lease = lease
        self.lost: errors.GpuLeaseError | None = None  # set if a renewal was refused
        self.unreleased = ""  # why release() could not release it (it then expires with its TTL)
        self.activity: dict[str, Any] | None = None  # sent with each renewal (idle-reclaim signal)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_renew_loop,
            args=(weakref.ref(self), self._stop, lease.ttl),
            name=f"gpulease-renew-{lease.id}",
            daemon=True,
        )
        self._thread.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lease, name)

    def renew_once(self) -> None:
        try:
            self.lease = self.client.renew(self.lease, activity=self.activity)
        except (errors.LeaseEnded, errors.StaleToken, errors.NoSuchLease, errors.NotOwner) as exc:
            self.lost = exc
            self._stop.set()
            # (info: its holder says it, in its own words: the CLI's closing line, the cell's)
            log.info("lease %s lost: %s", self.lease.id, exc)

    def grow(self, gpus: int) -> Lease:
        """Add GPUs to this elastic lease (:meth:`Client.grow`); the renewals go on."""
        self.lease = self.client.grow(self.lease, gpus)
        return self.lease

    def shrink(self, gpus: int) -> Lease:
        """Give back some of this lease's GPUs (:meth:`Client.shrink`); the renewals go on."""
        self.lease = self.client.shrink(self.lease, gpus)
        return self.lease

    def hand_off(self, to: list[str]) -> Lease:
        """Stop renewing, then hand this lease's GPUs in one step to the oldest of the queued
        requests ``to`` (:meth:`Client.handoff`). On :class:`errors.Conflict` the lease is still held: release it."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        return self.client.handoff(self.lease, to)

    def suspend(self) -> dict[str, Any]:
        """Hand this warm lease back with its worker suspended (:meth:`Client.suspend`); the
        renewals stop once the server took it. Raises Conflict where it cannot be (they go on)."""
        ended = self.client.suspend(self.lease)
        self._stop.set()
        return ended

    def release(self, verified: bool = False) -> str | None:
        """Release the lease: None, or, if it had ended already (released from elsewhere, expired,
        revoked, reclaimed: its GPUs are back, nothing to do), how it ended, in one line."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            ended = self.client.release(self.lease, verified=verified)
        except (errors.LeaseEnded, errors.NoSuchLease, errors.StaleToken, errors.NotOwner) as exc:
            log.info("release of %s: %s", self.lease.id, exc)
            return exc.message
        except errors.GpuLeaseError as exc:  # not released (the server away): its TTL frees it
            log.warning("release of %s failed: %s", self.lease.id, exc)
            self.unreleased = exc.message
            return None
        if ended.get("changed", True):
            return None
        by = f" by {ended['ended_by']}" if ended.get("ended_by") else ""
        reason = f": {ended['end_reason']}" if ended.get("end_reason") else ""
        return f"{ended.get('state', 'ended')}{by}{reason}"


def _renew_loop(ref: weakref.ref[HeldLease], stop: threading.Event, ttl: float) -> None:
    # Every ttl/3 while renewals land. After one failed (the server restarting, Redis failing over),
    # every quarter of that, with jitter: a lease whose server is back 5 s into a 6 s ttl is renewed
    # in time instead of waiting out a whole interval, and many clients do not come back in step.
    interval = max(ttl / 3, 0.2)
    wait = interval
    while not stop.wait(wait):
        held = ref()
        if held is None:
            return
        failed = wait != interval  # the last try failed: say so once, not at every retry
        wait = max(interval / 4, 0.2) * random.uniform(0.8, 1.2)
        try:
            held.renew_once()
            wait = interval
        except errors.GpuLeaseError as exc:
            if exc.status < 500:  # refused for good (renew_once handles the usual ones)
                held.lost = exc
                return
            # server or Redis away: the TTL decides
            log.log(logging.DEBUG if failed else logging.WARNING, "renewal failed, retrying: %s", exc)
        except Exception as exc:  # never let the renewal thread die silently
            log.log(logging.DEBUG if failed else logging.WARNING, "renewal failed, retrying: %s", exc)
        del held
