"""``gpulease events``: the newest entries of the event log, a readable line each; ``--follow`` for
the live stream; ``events export`` for all of it (the policy simulator's input).

The log API (GET /api/v1/events/log) reads newest first (``order=desc``, ``before=``) and filters
by type, user and lease on the server, so the newest N are one request.
"""

from __future__ import annotations

import datetime as dt
import difflib
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import click
from rich.text import Text

from .. import errors, protocol
from ..client import Client
from ..leasing.events import event_of_user
from ..leasing.values import EVENT_LOG_PAGE_CAP
from ..protocol import BOOKING_EVENTS, EventType, escaped
from ..sizes import show_mb
from ._common import console, err_console, fail, gpu_places, index_list, print_error, server_options, span

PAGE = EVENT_LOG_PAGE_CAP  # the most the log API answers in one call
TYPES = sorted(t.value for t in protocol.EventType)
Pos = tuple[int, int]  # a stream entry id: (ms, seq)


# ---- positions in the log ----------------------------------------------------------------------


def position(ev: dict[str, Any]) -> Pos:
    """Where an entry lies in the stream: its id (an event without one: its time, to the ms)."""
    m = re.fullmatch(r"(\d+)-(\d+)", str(ev.get("id", "")))
    if m:
        return int(m[1]), int(m[2])
    return round((ev.get("ts") or 0) * 1000), 0


def _since(pos: Pos | None) -> str:
    return "-" if pos is None else f"{pos[0]}-{pos[1]}"


@dataclass(frozen=True)
class Wanted:
    """What ``gpulease events`` shows: the server filters by type, user and a whole lease id; a
    start of a lease or booking id is matched here."""

    types: frozenset[str] = frozenset()
    user: str | None = None
    lease: str | None = None  # a whole lease id
    prefix: str | None = None  # a start of a lease or booking id

    def ask(self) -> dict[str, Any]:
        return {"lease": self.lease, "types": self.types, "user": self.user}

    def here(self, ev: dict[str, Any]) -> bool:
        if not self.prefix:
            return True
        ids = [str(ev.get("lease") or ""), str(ev.get("reservation") or "")]
        return any(i and (i.startswith(self.prefix) or i.partition("-")[2].startswith(self.prefix)) for i in ids)

    def keeps(self, ev: dict[str, Any]) -> bool:
        """All of it, for what the server did not filter (the live stream)."""
        if self.types and ev.get("type") not in self.types:
            return False
        if self.user and not event_of_user(ev, self.user):
            return False
        if self.lease and ev.get("lease") != self.lease:
            return False
        return self.here(ev)


def read_forward(client: Client, after: Pos | None, wanted: Wanted = Wanted()) -> Iterator[dict[str, Any]]:
    """Every wanted entry after ``after`` (None: from the oldest kept), oldest first, a page at a
    time."""
    while True:
        page = client.events(_since(after), PAGE, **wanted.ask())
        yield from (ev for ev in page if wanted.here(ev))
        if len(page) < PAGE:
            return
        after = position(page[-1])


def newest(
    client: Client, n: int, wanted: Wanted = Wanted(), after: Pos | None = None
) -> tuple[list[dict[str, Any]], bool, Pos | None]:
    """The newest ``n`` wanted entries (after ``after``), oldest first; whether there are earlier
    ones; and the position of the newest entry read (to follow on from).

    One request, newest first, for n + 1 entries (the one more says whether there are earlier ones),
    the server doing the filtering; pages newest first, each from where the last one ended, when
    n is over a page or a start of an id is matched here."""
    found: list[dict[str, Any]] = []
    before: str | None = None
    top: Pos | None = None
    while True:
        want = PAGE if wanted.prefix else min(PAGE, n + 1 - len(found))
        page = client.events(_since(after), want, before=before, newest_first=True, **wanted.ask())
        if page and top is None:
            top = position(page[0])
        found += [ev for ev in page if wanted.here(ev)]
        if len(found) > n or len(page) < want:
            break
        before = page[-1]["id"]
    return found[:n][::-1], len(found) > n, top or after


# ---- one line per event -------------------------------------------------------------------------


def _when(ms: float) -> str:
    return time.strftime("%a %d %b %H:%M", time.localtime(ms / 1000 if ms > 1e11 else ms))


def _gpus(ev: dict[str, Any]) -> str:
    """'2x A100-80GB on box (GPU 0,1)', a gang's parts each with its node."""
    parts = ev.get("parts")
    if isinstance(parts, list) and parts:
        places = {p.get("node", "?"): list(p.get("gpus") or []) for p in parts if isinstance(p, dict)}
        count = sum(len(v) for v in places.values())
        return f"{count}x {ev.get('pool', '')} on {gpu_places(places)}"
    gpus = ev.get("gpus")
    if isinstance(gpus, list):
        idx = [int(g["index"]) if isinstance(g, dict) else int(g) for g in gpus]
        where = f" on {ev['node']}" if ev.get("node") else ""
        return f"{len(idx)}x {ev.get('pool', '')}{where} (GPU {index_list(idx)})"
    if isinstance(gpus, int):
        return f"{gpus}x {ev.get('pool', '')}"
    return str(ev.get("pool", ""))


def _quoted(label: object) -> str:
    return f' "{label}"' if label else ""


def describe(ev: dict[str, Any]) -> str:
    """What happened, in words, without the time, type and user (they have their columns)."""
    t = ev.get("type", "")
    reason = f": {ev['reason']}" if ev.get("reason") else ""
    if t == "grant":
        waited = ev.get("waited_ms") or 0
        return (
            _gpus(ev) + (f" after {span(waited / 1000)} waiting" if waited >= 1000 else "") + _quoted(ev.get("label"))
        )
    if t in ("released", "expired", "revoked", "reclaimed"):
        held = f" after {span(ev['held_s'])}" if ev.get("held_s") is not None else ""
        by = f" by {ev['by']}" if ev.get("by") and ev.get("by") != ev.get("user") else ""
        return _gpus(ev) + held + by + (reason if t != "released" else "") + _quoted(ev.get("label"))
    if t == "queued":
        return f"{ev.get('gpus')}x {ev.get('pool', '')}, position {ev.get('position')}" + _quoted(ev.get("label"))
    if t.startswith("wait_"):
        return f"{ev.get('gpus')}x {ev.get('pool', '')} after {span((ev.get('waited_ms') or 0) / 1000)}{reason}"
    if t == "renew_miss":
        return f"renewed {(ev.get('late_ms') or 0) / 1000:.1f}s after its deadline"
    if t == "warm":
        until = time.strftime("%H:%M", time.localtime((ev.get("warm_until") or 0) / 1000))
        where = f" (GPU {index_list([int(g) for g in ev['gpus']])})" if isinstance(ev.get("gpus"), list) else ""
        return f"on {ev.get('node', '')}{where} until {until}, lendable"
    if t == "resumed":
        return f"on {ev.get('node', '')}: a cell runs, {span(ev.get('warm_s') or 0)} warm"
    if t == "unleased_held":
        return f"{_gpus(ev)} out of the pool: a process no lease covers uses it"
    if t == "drain_abandoned":
        return f"{_gpus(ev)}: agent gave up pid {ev.get('pid')} ({ev.get('why', '')}); gpulease drain list"
    if t in ("suspended", "restored", "suspend_ended"):  # a warm worker's GPU state in host memory
        size = show_mb(int(ev.get("bytes") or 0) / 2**20)
        gpus = ev.get("gpus")
        where = ev.get("node", "") + (f" (GPU {index_list([int(g) for g in gpus])})" if isinstance(gpus, list) else "")
        took = f" in {(ev.get('ms') or 0) / 1000:.1f}s"
        if t == "suspended":
            return f"{size} to host from {where}{took}"
        if t == "restored":  # (how long it was on host: the time between its two lines)
            return f"{size} to {where}{took}"
        return f"{size} on host from {where} dropped after {span(ev.get('suspended_s') or 0)}{reason}"
    if t in ("over_memory_warning", "over_memory"):  # a slice over the memory it was promised
        uses = f"{ev.get('node', '')} GPU {ev.get('gpu')}: slice uses {show_mb(int(ev.get('used_mb') or 0))}"
        asked = f" of {show_mb(int(ev.get('gpu_mem_mb') or 0))}"
        return uses + asked + ("; ended" if t == "over_memory" else "; ended unless it drops")
    if t == "drained":
        killed = int(ev.get("killed") or 0)
        ended = f", {killed} process(es) ended" if killed else ""
        return f"{_gpus(ev)} clean after {(ev.get('took_ms') or 0) / 1000:.1f}s{ended}"
    if t in ("preempt_notice", "borrow_recalled", "evicting"):
        back = time.strftime("%H:%M:%S", time.localtime((ev.get("recall_at") or 0) / 1000))
        return f"on {ev.get('node', '')} for {ev.get('requested_by', '?')}: GPUs back at {back}"
    if t in ("grown", "shrunk"):
        verb = "added" if t == "grown" else "gave back"
        by = f" by {ev['by']}" if ev.get("by") and ev.get("by") != ev.get("user") else ""
        return f"{verb} {_gpus(ev)}{by}: now {ev.get('size')} GPU(s)" + (reason if by else "")
    if t == "shrink_notice":
        back = time.strftime("%H:%M:%S", time.localtime((ev.get("shrink_by") or 0) / 1000))
        return f"on {ev.get('node', '')} for {ev.get('for', '?')}: shrink to {ev.get('shrink_to')} GPU(s) by {back}"
    if t == "idle_warning":
        at = time.strftime("%H:%M:%S", time.localtime(ev.get("reclaim_at") or 0))
        return f"on {ev.get('node', '')} idle: reclaimed at {at} unless kept" + _quoted(ev.get("label"))
    if t == "idle_kept":
        return f"kept, {ev.get('left', 0)} extension(s) left"
    if t == "idle_cleared":
        return str(ev.get("reason", "busy again"))
    if t == "node_registered":
        return f"{ev.get('node')}: {ev.get('gpus')} GPU(s) of {ev.get('pool')} ({ev.get('source', '')})"
    if t in ("node_up", "node_down"):
        return f"{ev.get('node')} ({ev.get('pool')}){reason}"
    if t == "unleased_use":
        pids = ", ".join(str(p) for p in ev.get("pids") or [])
        return f"{ev.get('node')} GPU {ev.get('gpu')}: pids {pids}, no lease holds it"
    if t == "booking_lease_freed":  # its booking's time is over: an ordinary lease now
        above = ", above quota: preemptible" if ev.get("preemptible") else ""
        what = f"{ev.get('gpus')}x {ev.get('pool', '')}"
        return f"{what}: booking {ev.get('reservation')} over, now an ordinary lease{above}"
    if t == "unleased_use_ended":
        return f"{ev.get('node')} GPU {ev.get('gpu')} is clear again"
    if t == "unleased_killed":
        sent = f"{ev.get('signal')} failed: {ev['error']}" if ev.get("error") else f"sent {ev.get('signal')}"
        return f"{ev.get('node')} GPU {ev.get('gpu')}: pid {ev.get('pid')} of {ev.get('user') or '?'}, no lease: {sent}"
    if t in BOOKING_EVENTS:
        text = f"{ev.get('gpus')}x {ev.get('pool', '')}"
        if ev.get("start") and t != EventType.BOOKING_CANCELLED:
            end = time.strftime("%H:%M", time.localtime((ev.get("end") or 0) / 1000))
            text += f" {_when(ev['start'])}-{end}"
        if ev.get("repeat") == "weekly":
            text += f", weekly x{ev.get('occurrences')}"
        if ev.get("by") and ev.get("by") != ev.get("owner"):
            text += f" by {ev['by']}"
        return text
    if t == "policy_changed":
        changes = ev.get("changes") or {}
        return f"{ev.get('pool')}: " + (" ".join(f"{k}={v}" for k, v in changes.items()) or "unchanged")
    if t == "claim_refused":
        account = ev.get("account") or "an unnamed account"
        return f"pid {ev.get('pid')} on {ev.get('node')} runs as {account}, not as its owner"
    skip = {"id", "type", "ts", "user", "lease", "token"}
    return " ".join(f"{k}={v}" for k, v in ev.items() if k not in skip)


def who(ev: dict[str, Any]) -> str:
    return str(ev.get("user") or ev.get("owner") or ev.get("by") or "-")


def subject(ev: dict[str, Any]) -> str:
    """The lease (its id's first 8 hex digits: a unique start that release and keep take) or booking
    the event is about."""
    lid = str(ev.get("lease") or "")
    if lid:
        return lid[:10] if re.fullmatch(r"l-[0-9a-f]{16}", lid) else lid[:24]
    return str(ev.get("reservation") or "")


def event_ms(ev: dict[str, Any]) -> float:
    return ev["ts"] * 1000 if ev.get("ts") else float(position(ev)[0])


class Lines:
    """Events as aligned lines that fit the terminal: the description is cut, nothing wraps."""

    STYLES = {
        "grant": "green",
        "released": "cyan",
        "expired": "yellow",
        "revoked": "red",
        "reclaimed": "red",
        "node_down": "bold red",
        "unleased_use": "bold red",
        "unleased_killed": "bold red",
        "idle_warning": "magenta",
        "preempt_notice": "magenta",
        "borrow_recalled": "magenta",
        "shrink_notice": "magenta",
    }

    def __init__(self, sample: list[dict[str, Any]]) -> None:
        # Types up to 12 characters align; a longer one (a booking's reservation_created) pushes its line on.
        self.type_w = min(12, max([8, *(len(ev.get("type", "")) for ev in sample)]))
        self.who_w = min(12, max([5, *(len(who(ev)) for ev in sample)]))
        self.day = time.strftime("%Y-%m-%d")  # a day line comes before the first event of another day

    def print(self, ev: dict[str, Any]) -> None:
        local = time.localtime(event_ms(ev) / 1000)
        day = time.strftime("%Y-%m-%d", local)
        if day != self.day:
            console.print(Text(time.strftime("-- %a %d %b %Y --", local), style="dim"))
            self.day = day
        name = escaped(who(ev))  # stored before control and bidi characters were refused: never raw
        if len(name) > self.who_w:
            name = name[: self.who_w - 1] + "…"
        head = Text(time.strftime("%H:%M:%S", local) + "  ")
        head.append(f"{ev.get('type', ''):<{self.type_w}}", style=self.STYLES.get(ev.get("type", ""), ""))
        head.append(f"  {name:<{self.who_w}}  ")
        ref = escaped(subject(ev))
        tail = f"  {ref}" if ref else ""
        room = console.width - head.cell_len - len(tail)
        what = Text(escaped(" ".join(describe(ev).split())))
        if room < 1:
            what = Text("")
        elif what.cell_len > room:
            what.truncate(room, overflow="ellipsis")
        console.print(head + what + Text(tail, style="dim"), no_wrap=True, crop=True, soft_wrap=False)


# ---- the command -------------------------------------------------------------------------------


def parse_since(text: str, now: float | None = None) -> Pos:
    """An event id (1700000000000-0), an age (90s, 10m, 2h, 3d), a time today (14:05, 14:05:30)
    or a date and time (2026-11-22, 2026-11-22T14:05, with or without an offset)."""
    now = time.time() if now is None else now
    if re.fullmatch(r"\d{10,}(-\d+)?", text):
        ms, _, seq = text.partition("-")
        return int(ms), int(seq or 0)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", text)
    if m:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[m[2]]
        return int((now - float(m[1]) * unit) * 1000), 0
    m = re.fullmatch(r"(\d{1,2}):(\d{2})(?::(\d{2}))?", text)
    try:
        if m:
            today = dt.datetime.fromtimestamp(now)
            moment = today.replace(hour=int(m[1]), minute=int(m[2]), second=int(m[3] or 0), microsecond=0)
            if moment.timestamp() > now:  # 23:50 just after midnight: yesterday's
                moment -= dt.timedelta(days=1)
        else:
            moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None:
        fail(
            f"--since {text!r}: give an age (10m, 2h, 3d), a time today (14:05), a date (2026-11-22T14:05) "
            "or an event id (1700000000000-0)"
        )
    return int(moment.timestamp() * 1000), 0


def _types(given: tuple[str, ...]) -> set[str]:
    out = {t.strip() for g in given for t in g.split(",") if t.strip()}
    for name in sorted(out - set(TYPES)):
        close = difflib.get_close_matches(name, TYPES, n=3)
        # Only those about as close as the best: "grnat" is grant, not grant or grown.
        score = {t: difflib.SequenceMatcher(None, name, t).ratio() for t in close}
        close = [t for t in close if score[t] >= score[close[0]] - 0.1]
        hint = f"did you mean {' or '.join(close)}?" if close else "gpulease events --help lists them"
        raise click.BadParameter(f"no event type {name!r}; {hint}", param_hint="--type")
    return out


@click.group(invoke_without_command=True)
@click.option("--since", help="Only events after this: an age (10m, 2h, 3d), a time (14:05), a date or an event id")
@click.option("--type", "types", multiple=True, metavar="TYPE[,TYPE]", help=f"Only these types: {', '.join(TYPES)}")
@click.option("--user", help="Only events of this user (holder, booking owner or the one who acted)")
@click.option("--lease", "lease_id", help="Only events of this lease, request or booking (any unique start of its id)")
@click.option("-n", "--limit", default=50, show_default=True, type=click.IntRange(min=0), help="The newest N (0: all)")
@click.option("-f", "--follow", is_flag=True, help="Then print events as they happen (Ctrl-C ends)")
@click.option("--json", "as_json", is_flag=True, help="The raw records, a JSON line each")
@server_options
@click.pass_context
def events(
    ctx: click.Context,
    since: str | None,
    types: tuple[str, ...],
    user: str | None,
    lease_id: str | None,
    limit: int,
    follow: bool,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    """The newest events of the log (oldest first), a line each: time, type, who, what, lease.

    \b
    gpulease events --since 1h --user alice
    gpulease events --type grant,released -f
    gpulease events export -o trace.jsonl    (all of it, for simulate --trace)
    """
    if ctx.invoked_subcommand is not None:
        return
    after = parse_since(since) if since else None
    # A whole lease id is filtered by the server; a start of one (or a booking id) here.
    whole = lease_id if lease_id and re.fullmatch(r"l-[0-9a-f]{16}", lease_id) else None
    wanted = Wanted(frozenset(_types(types)), user, whole, None if whole else lease_id)
    with Client(url, token) as c:
        if limit == 0:
            shown = list(read_forward(c, after, wanted))
            more, last = False, max((position(ev) for ev in shown), default=after)
        else:
            shown, more, last = newest(c, limit, wanted, after)
        lines = None if as_json else Lines(shown)

        def emit(ev: dict[str, Any]) -> None:
            if lines is None:
                click.echo(json.dumps(ev))
            else:
                lines.print(ev)

        for ev in shown:
            emit(ev)
        if not shown and not as_json and not follow:
            console.print("no events" + (" match" if wanted != Wanted() or since else ""))
        if more and len(shown) == limit and not as_json:
            err_console.print(Text(f"(the newest {limit}; -n N shows more, --since an earlier start)", style="dim"))
        if follow:
            try:
                _follow(c, last, wanted, emit)
            except KeyboardInterrupt:
                sys.exit(0)


def _follow(c: Client, after: Pos | None, wanted: Wanted, emit: Callable[[dict[str, Any]], None]) -> None:
    """Print events as they come, from the live stream; on a lost stream, reconnect and catch up
    from the log (subscribed first, then the gap read, so nothing falls in between)."""
    while True:
        try:
            with c.event_stream(lease=wanted.lease) as stream:
                for ev in read_forward(c, after, wanted):
                    after = position(ev)
                    emit(ev)
                for ev in stream:
                    if after is not None and position(ev) <= after:
                        continue  # read from the log already
                    after = position(ev)
                    if wanted.keeps(ev):
                        emit(ev)
            reason = "the server closed the event stream"
        except errors.ServerUnavailable as exc:
            reason = str(exc)
        print_error(f"{reason}; reconnecting in 2s", prefix="events")
        time.sleep(2)


@events.command("export")
@click.option("-o", "--out", type=click.Path(dir_okay=False, writable=True), help="File to write (default: stdout)")
@click.option("--since", default=None, help="Only events after this (as for gpulease events)")
@server_options
def events_export(out: str | None, since: str | None, url: str | None, token: str | None) -> None:
    """Write every event kept in the log as JSON lines: the input of gpulease simulate --trace."""
    n = 0
    after = parse_since(since) if since else None
    with Client(url, token) as c, click.open_file(out or "-", "w") as f:
        for ev in read_forward(c, after):
            f.write(json.dumps(ev) + "\n")
            n += 1
    if out:
        err_console.print(f"{n} events written to {out}")
