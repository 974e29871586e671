"""Run several policies on one workload and one cluster, with a progress bar."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..config import Settings
from . import bookings, policies, replay, share
from .result import Result
from .workload import Workload

POLICIES = ("session", "calendar", "culler-10m", "culler-60m", "lease", "lease+booking", "lease-warm", "lease-share")
LUA_POLICIES = ("lease", "lease+booking", "lease-warm", "lease-share")
RENAMED = {"lease+resv": "lease+booking"}  # policy names of earlier releases, still accepted


def parse_policies(text: str) -> list[str]:
    names = [RENAMED.get(p.strip(), p.strip()) for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ValueError(f"unknown policy {', '.join(bad) or '(none)'}: choose from {', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server of our own for the replay, without persistence (nothing here must survive)."""
    from redis import Redis

    from ..node.redis_proc import RedisProcess

    with tempfile.TemporaryDirectory(prefix="gpulease-sim-") as tmp:
        # A password too: any local user can reach its port, and the results must be the replay's.
        proc = RedisProcess(Path(tmp) / "redis", password=secrets.token_urlsafe(32)).start()
        try:
            r = Redis.from_url(proc.url)
            r.config_set("appendonly", "no")
            r.close()
            yield proc.url
        finally:
            proc.stop()


Tick = Callable[[str, int], None]  # (policy, virtual ms reached)


def simulate(
    w: Workload,
    nodes: Sequence[int],
    names: Sequence[str],
    *,
    redis_url: str | None = None,
    settings: Settings | None = None,
    tick: Tick | None = None,
    booking_params: bookings.BookingParams | None = None,
    share_multi: str = "whole",
    suspend_gpus: int = 1,
    suspend_keep_s: float = 0.0,
) -> list[Result]:
    """Replay ``w`` on a cluster of ``nodes`` (GPUs per node) under each policy in ``names``.

    The lease policies need a Redis: ``redis_url`` (a key prefix of their own is used and removed
    afterwards), else a private redis-server is started for the run. ``lease+booking`` books
    ``booking_params`` (default: 4 teams booking half the GPUs, see ``bookings``). ``lease-share``
    leases each cell a slice of its trace memory (``share``; ``share_multi``: what a cell on several
    GPUs leases, "whole" GPUs or, "gang", a slice of each in one lease) in a pool that shares by ``settings``'
    ``slice_unit_mb`` and ``max_sharers``. ``lease-warm`` suspends evicted warm workers of at most
    ``suspend_gpus`` GPUs to host (1: what the server does; 0: none, they are ended; more: a what-if);
    ``suspend_keep_s`` (a what-if; 0: warm_max ends them, as the server does) suspends a warm worker at
    warm_max too and keeps it until that long after its last cell.
    """
    biggest = int(w.gpus.max()) if w.n_sessions else 0
    if biggest > max(nodes):
        raise ValueError(f"the workload asks for {biggest} GPUs on one node; the largest node has {max(nodes)}")
    out: list[Result] = []
    with contextlib.ExitStack() as stack:
        url = redis_url
        if url is None and any(n in LUA_POLICIES for n in names):
            url = stack.enter_context(private_redis())
        for name in names:
            progress = (lambda t, _n=name: tick(_n, t)) if tick else None
            if name == "session":
                r = policies.session(w, nodes, progress=progress)
            elif name == "calendar":
                r = policies.calendar(w, nodes, progress=progress)
            elif name.startswith("culler-"):
                r = policies.culler(w, nodes, int(name[7:-1]) * 60, progress=progress)
            elif name in LUA_POLICIES:
                assert url is not None
                prefix = f"gpulease-sim-{os.getpid()}-{secrets.token_hex(3)}"
                base = settings or Settings()
                s = dataclasses.replace(base, redis_url=url, prefix=prefix)
                books: list[bookings.Booking] = []
                if name == "lease+booking":
                    rp = booking_params or bookings.BookingParams()
                    s = dataclasses.replace(s, teams=bookings.teams_of(w, rp))
                    books = bookings.bookings(w, int(sum(nodes)), rp)
                setup = replay.ReplaySetup(url, prefix, s)
                if name == "lease-share":
                    out.append(share.lease_share(w, nodes, setup, progress=progress, multi=share_multi))
                    if tick:
                        tick(name, -1)
                    continue
                r = replay.lease(
                    w, nodes, setup, progress=progress, policy=name, bookings=books, suspend_gpus=suspend_gpus,
                    suspend_keep_s=suspend_keep_s,
                )  # fmt: skip
            else:
                raise ValueError(f"unknown policy {name!r}")
            if tick:
                tick(name, -1)
            out.append(r)
    return out
