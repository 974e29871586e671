"""Per-token limits on the expensive reads of the API: event log pages, the usage ledger (``GET
/usage``) and its hourly rollups (``GET /usage/summary``: a row costs what a log entry does), and
event streams.

One user's reads must not slow everyone's grants (issue 33, finding 7: four connections reading
10,000-entry pages took another user's ``/whoami`` from 4 ms to 187 ms). A log entry costs the
server's one event loop some 20 us to read, parse and encode, so a page of 1,000 is tens of
milliseconds that every other request would wait behind. Three things bound it, per API token:

* **reads at once** (``log_reads_at_once``): more in flight is a 429 at once;
* **entries read per second** (a bucket of ``log_read_burst`` refilled at ``log_read_rate``): a
  read starting on an empty bucket is a 429 whose Retry-After says when it refills; a read that
  runs past the bucket is slowed to the refill rate, not cut (a long filtered scan still ends);
* **event stream connections per second** (``stream_connect_burst``, ``stream_connect_rate``): a
  reconnect storm gets 429s, each with the wait to honour.

A refused request is answered after a hold of :data:`REFUSAL_HOLD_S` (or when its client goes
away): a client that asks again at once, as a reconnect loop does, then asks once a second per
connection, and its refusals cost the server next to nothing.

And every read is done in slices of :data:`SLICE` entries with the loop let go between them
(:func:`read_sliced`), so a request that arrives during a page waits for a slice, not a page.

Limits are per process (each server replica keeps its own), in memory, and keyed by a digest of
the token: a proxy token's users share its limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import tornado.iostream
from redis.asyncio import Redis

from .. import errors
from ..config import Settings
from ..leasing import events
from .auth import hash_token

SLICE = 100  # entries read and encoded between two returns to the event loop
MIN_READ_COST = 100  # a read counts as at least this many entries: its request costs too
MAX_KEYS = 10_000  # buckets kept; full ones are dropped first when there are more
REFUSAL_HOLD_S = 1.0  # seconds a 429 of these limits waits before it is sent
LOG_HINT = "since=, type=, lease=, a smaller limit"  # how a 429 says to read less of the event log


def token_key(authorization: str | None) -> str:
    """The key of a request's token in the limits: its digest, as the token store keeps it (read as
    the authenticator reads it, so that spelling the header otherwise does not make a new key)."""
    return hash_token((authorization or "").partition(" ")[2].strip())


class Bucket:
    """Token buckets, one per key: each holds at most ``burst`` units and gains ``rate`` a second."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._state: dict[str, tuple[float, float]] = {}  # key -> (units, at)

    def level(self, key: str) -> float:
        """Units ``key`` holds now (below zero after a charge past the bucket)."""
        units, at = self._state.get(key, (self.burst, self.clock()))
        return min(self.burst, units + (self.clock() - at) * self.rate)

    def wait(self, key: str, units: float = 1.0) -> float:
        """Seconds until ``key`` holds ``units`` (0 if it does now)."""
        return max(0.0, (units - self.level(key)) / self.rate)

    def charge(self, key: str, units: float) -> None:
        """Take ``units`` from ``key``'s bucket, below zero if need be (a cost known after the fact)."""
        if len(self._state) >= MAX_KEYS and key not in self._state:
            self._prune()
        self._state[key] = (self.level(key) - units, self.clock())

    def take(self, key: str, units: float = 1.0) -> float:
        """Take ``units`` if ``key`` holds them and return 0; else take nothing and return the
        seconds until it will."""
        wait = self.wait(key, units)
        if wait == 0:
            self.charge(key, units)
        return wait

    def _prune(self) -> None:
        for key in [k for k in self._state if self.level(k) >= self.burst]:
            del self._state[key]
        while len(self._state) >= MAX_KEYS:  # all in use: forget the oldest (they refill meanwhile)
            del self._state[next(iter(self._state))]


def too_many(message: str, retry_after: float, **details: Any) -> errors.TooMany:
    """A 429 whose Retry-After (whole seconds, at least 1) the API sends as a header too."""
    seconds = max(1, math.ceil(retry_after))
    return errors.TooMany(message.format(seconds=seconds), retry_after=seconds, **details)


class ReadLimits:
    """The per-token limits of one server process (see the module's docstring)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.at_once = settings.log_reads_at_once
        self.reads = Bucket(settings.log_read_rate, settings.log_read_burst, clock)
        self.connects = Bucket(settings.stream_connect_rate, settings.stream_connect_burst, clock)
        self.hold_s = settings.refusal_hold_s
        self._in_flight: dict[str, int] = {}

    @contextlib.contextmanager
    def reading(self, key: str, what: str, hint: str = LOG_HINT) -> Iterator[None]:
        """One expensive read by ``key``'s token (``what``: how the message names it; ``hint``: how
        to ask for less), refused with a 429 when the token has ``log_reads_at_once`` in flight or
        an empty bucket."""
        held = self._in_flight.get(key, 0)
        if held >= self.at_once:
            raise too_many(
                f"this token has {held} event log reads in flight, the most one token may ({self.at_once}); "
                "wait for them to finish before starting another (one at a time is as fast), and retry in "
                "{seconds} s",
                1,
                reads=held,
                limit=self.at_once,
            )
        wait = self.reads.wait(key, MIN_READ_COST)
        if wait > 0:
            raise too_many(
                f"{what}: this token read more of the event log than it may per second "
                f"({self.reads.rate:g} entries, in bursts of {self.reads.burst:g}); retry in "
                f"{{seconds}} s, and ask only for what you need ({hint})",
                wait,
            )
        self._in_flight[key] = held + 1
        try:
            yield
        finally:
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]

    async def admit(self, key: str, what: str, gone: asyncio.Event, hint: str = LOG_HINT) -> contextlib.ExitStack:
        """:meth:`reading` entered (the caller's ``with`` leaves it), or its 429 after the hold."""
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.reading(key, what, hint))
        except errors.TooMany:
            await hold(gone, self.hold_s)
            raise
        return stack

    async def charge(self, key: str, entries: int, gone: asyncio.Event) -> None:
        """Count ``entries`` read against ``key``'s bucket; past its empty bottom, wait as long as
        they take to refill (a read beyond the budget goes on at the budget's rate), unless the
        client goes away meanwhile (``gone``): then StreamClosedError, and the read ends there."""
        self.reads.charge(key, entries)
        debt = -self.reads.level(key)
        if debt > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), debt / self.reads.rate)
        if gone.is_set():
            raise tornado.iostream.StreamClosedError()

    async def connect(self, key: str, gone: asyncio.Event) -> None:
        """An event stream connection by ``key``'s token: a 429 (after the hold) when its bucket is
        empty."""
        wait = self.connects.take(key)
        if wait > 0:
            await hold(gone, self.hold_s)
            raise too_many(
                f"this token opened event streams faster than it may ({self.connects.rate:g} a second, in "
                f"bursts of {self.connects.burst:g}); reconnect in {{seconds}} s, with Last-Event-ID to "
                "miss nothing (an EventSource does both by itself when told retry:)",
                wait,
            )


async def hold(gone: asyncio.Event, seconds: float = REFUSAL_HOLD_S) -> None:
    """Wait ``seconds`` (the setting refusal_hold_s), or until the client goes away."""
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), seconds)


async def read_sliced(
    redis: Redis, key: str, q: events.LogQuery, on_read: Callable[[int], Awaitable[None]] | None = None
) -> AsyncIterator[list[dict[str, Any]]]:
    """The entries ``q`` asks for, in its order, as slices of at most :data:`SLICE`: each slice a
    read of its own from where the last one ended, so the loop serves other requests between
    them. ``on_read(n)`` is awaited after every Redis page of ``n`` entries read (filters included),
    to count them."""
    left = q.limit
    while left > 0:
        part = dataclasses.replace(q, limit=min(SLICE, left))
        got = await events.read_log(redis, key, part, on_page=on_read)
        if got:
            yield got
        if len(got) < part.limit:
            return
        left -= len(got)
        q = dataclasses.replace(q, before=got[-1]["id"]) if q.desc else dataclasses.replace(q, since=got[-1]["id"])
