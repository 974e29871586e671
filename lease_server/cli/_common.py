"""What every part of the command line shares: the consoles, the server options, error messages
that name CLI commands, and lease / booking ids given by a unique prefix."""

from __future__ import annotations

import re
import sys
import textwrap
import time
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.text import Text

from ..protocol import LeaseJson, escaped
from ..sizes import parse_duration

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # a message is never cut into lines


def server_options(fn: Any) -> Any:
    """--url and --token of the lease server (default: GPULEASE_URL / GPULEASE_TOKEN, else the
    files gpulease up writes)."""
    fn = click.option("--token", envvar="GPULEASE_TOKEN", help="API token")(fn)
    return click.option("--url", envvar="GPULEASE_URL", help="Lease server URL")(fn)


class Duration(click.ParamType):
    """Seconds as people write them: 90, 90s, 10m, 1h30m (as %%gpu_train's --wait takes them)."""

    name = "duration"

    def __init__(self, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            seconds = parse_duration(value, allow_zero=self.allow_zero)
        except ValueError as exc:  # short: click puts "Error: Invalid value for '--wait': " before it
            said = f"{value!r}: write e.g. 90, 90s, 10m or 1h30m" if "cannot read" in str(exc) else str(exc)
            self.fail(said, param, ctx)
        assert seconds is not None
        return seconds


# ---- messages ----------------------------------------------------------------------------------

# The server's messages are written for any client and name HTTP requests in their hints; a CLI
# user gets the command that does the same.
_CLI_HINTS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"DELETE /api/v1/leases/([^\s),;]+)"), r"gpulease release \1"),
    (re.compile(r"GET /api/v1/leases(?![/\w])"), "gpulease leases"),
    (re.compile(r"GET /api/v1/bookings(?![/\w])"), "gpulease bookings"),
    (re.compile(r"GET /api/v1/events(?:/log)?(?![/\w])"), "gpulease events"),
    (re.compile(r"GET /api/v1/(?:cluster|queue)(?![/\w])"), "gpulease status"),
    (re.compile(r"GET /api/v1/usage(?![/\w])"), "gpulease usage"),
    (re.compile(r"GET /api/v1/policy(?![/\w])"), "gpulease policy show"),
    (re.compile(r"PUT /api/v1/policy/([^\s),;]+)"), r"gpulease policy set \1"),
    (re.compile(r"POST /api/v1/tokens(?![/\w])"), "gpulease token create NAME"),
    (re.compile(r"owners release theirs with DELETE\b"), "owners release theirs with gpulease release ID"),
    (re.compile(r"send 'Authorization: Bearer <token>'"), "set GPULEASE_TOKEN or pass --token"),
    (re.compile(r"\(X-Gpulease-User\)"), "(GPULEASE_USER is set)"),
]


def cli_message(message: str) -> str:
    """A server message with its HTTP hints ("list yours with GET /api/v1/leases") turned into the
    gpulease commands that do the same ("list yours with gpulease leases")."""
    for pattern, replacement in _CLI_HINTS:
        message = pattern.sub(replacement, message)
    return message


# "gpulease release l-3f2a" and the like stay on one line when a message is wrapped.
_COMMAND = re.compile(r"gpulease [a-z]+(?: (?:-{1,2}[\w-]+|[lr]-[0-9a-f]+|[A-Z]+))*")
_GLUE = "\x1f"


def print_error(message: str, prefix: str = "error") -> None:
    """One error on stderr, worded for the CLI, wrapped at spaces to the terminal's width (a
    command it names kept whole; a word longer than a line stays whole too). A line break in the
    message starts an indented line of its own (what to do next, under what went wrong)."""
    head = f"{prefix}: " if prefix else ""
    body = _COMMAND.sub(lambda m: m[0].replace(" ", _GLUE), cli_message(message))
    wrapped = [
        line
        for k, part in enumerate(body.split("\n"))
        for line in textwrap.wrap(
            head + part if k == 0 else part.strip(),
            width=max(40, err_console.width),
            initial_indent="" if k == 0 else "  ",
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    ]
    for i, line in enumerate(wrapped or [head]):
        text = Text(line.replace(_GLUE, " "))
        if i == 0 and head:
            text.stylize("bold red", 0, len(prefix))
        err_console.print(text)


def fail(message: str, code: int = 2, prefix: str = "error") -> NoReturn:
    print_error(message, prefix)
    sys.exit(code)


# ---- ids by prefix -----------------------------------------------------------------------------


def resolve_id(given: str, candidates: dict[str, str], what: str, list_command: str) -> str:
    """The one id in ``candidates`` (id -> a line describing it) that ``given`` names: itself, or a
    unique prefix of it, with or without the ``l-`` / ``r-`` in front. Several matches: the matches
    are listed and the command exits 2. None: ``given`` unchanged, for the server to answer (an
    ended lease, someone else's booking)."""
    if given in candidates:
        return given
    matches = [i for i in candidates if i.startswith(given) or i.partition("-")[2].startswith(given)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        print_error(f"{given!r} is the start of {len(matches)} {what} ids; give more of it:")
        for i in sorted(matches):
            err_console.print(Text(f"  {i}  {candidates[i]}"), soft_wrap=True, no_wrap=True, overflow="ellipsis")
        err_console.print(Text(f"({list_command} lists them)"))
        sys.exit(2)
    return given


def resolve_lease(client: Any, given: str) -> str:
    """A lease or queued request id from a unique prefix of it, among everyone's live leases and
    queued requests (the server then decides whether this user may act on it)."""
    if re.fullmatch(r"l-[0-9a-f]{16}", given):
        return given  # a whole id: nothing to look up
    candidates: dict[str, str] = {}
    for lease in client.leases(everyone=True):
        candidates[lease["id"]] = f"{lease['user']}  {gpu_places(lease_parts(lease))}  {lease.get('label', '')}"
    for w in client.queue():
        candidates.setdefault(w["id"], f"{w['user']}  queued for {w['gpus']}x {w['pool']}  {w['label']}")
    return resolve_id(given, candidates, "lease", "gpulease leases --all")


def resolve_past_lease(client: Any, given: str) -> str:
    """:func:`resolve_lease`, and then among the leases the newest page of the event log names: the
    short id ``gpulease events`` shows of a lease that has ended since (a reclaimed one)."""
    found = resolve_lease(client, given)
    if found != given or re.fullmatch(r"l-[0-9a-f]{16}", given):
        return found
    candidates: dict[str, str] = {}
    for ev in client.events(limit=1000, newest_first=True):
        lid = ev.get("lease")
        if isinstance(lid, str) and re.fullmatch(r"l-[0-9a-f]{16}", lid):
            candidates.setdefault(lid, f"{ev.get('user') or '-'}  {ev.get('type', '')} (its newest event)")
    return resolve_id(given, candidates, "lease", "gpulease events")


def resolve_booking(client: Any, given: str) -> str:
    """A booking id from a unique prefix of it, among the bookings listed from a day ago to a year
    ahead (the server's longest listing span)."""
    if re.fullmatch(r"r-[0-9a-f]{12}", given):
        return given
    now = time.time()
    candidates = {
        r["id"]: f"{r['owner']}  {r['gpus']}x {r['pool']}  {r.get('note', '')}"
        for r in client.bookings(None, now - 86_400, now + 365 * 86_400)
    }
    return resolve_id(given, candidates, "booking", "gpulease bookings")


# ---- formatting --------------------------------------------------------------------------------


def ago(ts: float | None, now: float) -> str:
    """How long since ``ts``: 4m05s, 2h07m, 3d04h."""
    if not ts:
        return ""
    return span(now - ts)


def span(seconds: float) -> str:
    secs = max(0, int(seconds))
    if secs >= 86400:
        return f"{secs // 86400}d{secs % 86400 // 3600:02d}h"
    if secs >= 3600:
        return f"{secs // 3600}h{secs % 3600 // 60:02d}m"
    return f"{secs // 60}m{secs % 60:02d}s"


def gpu_places(parts: dict[str, list[int]]) -> str:
    """Where a lease's GPUs are: "box GPU 0,1", or "n1 GPU 0-3 + n2 GPU 0,1" for a gang."""
    return " + ".join(f"{node} GPU {index_list(ix)}" for node, ix in parts.items())


def index_list(indexes: list[int]) -> str:
    """0,1 or 0-3 (a run of three or more written as a range)."""
    ix = sorted(set(indexes))
    out: list[str] = []
    i = 0
    while i < len(ix):
        j = i
        while j + 1 < len(ix) and ix[j + 1] == ix[j] + 1:
            j += 1
        out.append(f"{ix[i]}-{ix[j]}" if j - i >= 2 else ",".join(str(v) for v in ix[i : j + 1]))
        i = j + 1
    return ",".join(out)


def lease_parts(lease: LeaseJson | dict[str, Any]) -> dict[str, list[int]]:
    """node -> GPU indexes of a lease record (a gang's GPUs carry their node)."""
    parts: dict[str, list[int]] = {}
    for g in lease.get("gpus", []):
        if isinstance(g, dict):
            parts.setdefault(g.get("node") or lease.get("node", "?"), []).append(int(g["index"]))
        else:
            parts.setdefault(lease.get("node", "?"), []).append(int(g))
    return parts


def one_line(text: str, style: str = "") -> Text:
    """A table cell that never wraps: cut with an ellipsis when its column is narrowed. (Put in a
    column that may shrink, i.e. one without no_wrap, so the table fits the terminal.) A control or
    bidi character stored before the server refused them is shown escaped, never sent raw."""
    return Text(escaped(" ".join(text.split())), style=style, no_wrap=True, overflow="ellipsis")


LABEL_MOST = 40  # a label where nothing else cuts it (--wide): its start, enough to know it by


def short_label(text: str, most: int = LABEL_MOST) -> Text:
    """A lease's label as :func:`one_line` shows it, and at most ``most`` columns wherever it is
    shown (cut with an ellipsis): a label may hold a cell's whole code line, which would make a
    ``--wide`` table 190 columns wide."""
    cell = one_line(text)
    cell.truncate(most, overflow="ellipsis")
    return cell


def shown(text: object, style: str = "") -> Text:
    """Stored text as a table cell or line: as it is (no markup read from it), control and bidi
    characters escaped."""
    return Text(escaped(text), style=style)
