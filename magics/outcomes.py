"""How a call is seen from the notebook: its states (queued, running, ended), the UI that shows
them, and the errors a call can end with, each carrying the call's :class:`Checkpoint` when its
hook saved one. Each is one line for a person; none shows local frames."""

from __future__ import annotations

import math
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from lease_server import protocol
from lease_server.protocol import EndCause, EndCauseJson, LeaseJson
from lease_server.sizes import FIT_MARGIN, as_option, show_duration, show_mb, show_wait


@dataclass(frozen=True)
class Checkpoint:
    """What a call's ``magics.on_preempt`` hook returned last (``state`` may itself be None): the
    notebook keeps it as ``gpu_checkpoint`` for ``--resume``."""

    state: Any


class GpuTrainError(Exception):
    """The call failed on the worker (or the worker died). Shown as the remote traceback, once.
    ``checkpoint``: the call's last checkpoint, if its hook saved one."""

    checkpoint: Checkpoint | None = None
    told = False  # the cell's own closing line already says it: shown nothing more (:func:`said_once`)

    def __init__(
        self,
        summary: str,
        remote_traceback: str = "",
        node: str = "",
        remote_type: str = "",
        rank: int | None = None,
    ) -> None:
        super().__init__(summary)
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.node = node
        self.remote_type = remote_type
        self.rank = rank  # the failing rank of a multi-node gang (None for a one-node call)

    def render(self) -> str:
        if not self.remote_traceback:
            return f"{type(self).__name__}: {self.summary}"
        who = f"rank {self.rank} on node {self.node}" if self.rank is not None else f"the worker on node {self.node}"
        return f"--- traceback from {who} ---\n{self.remote_traceback.rstrip()}"

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead of local frames
        return self.render().splitlines()


class GpuTrainTimeout(GpuTrainError):
    """The call ran past ``--timeout``: it was stopped and its GPUs released."""


class GpuLeaseEnded(GpuTrainError):
    """Someone else ended the lease while the call ran (the board, an admin, the idle reclaimer, a
    preemption). An expected event: one line naming who and why, no traceback."""


class GpuTrainStopped(KeyboardInterrupt):
    """Stop (a kernel interrupt) ended the call: the request was withdrawn or the GPUs released.
    Still a KeyboardInterrupt, so code around the call stops as it would on any interrupt.
    ``checkpoint``: the call's last checkpoint, if its hook saved one."""

    told = False

    def __init__(self, summary: str, checkpoint: Checkpoint | None = None) -> None:
        super().__init__(summary)
        self.summary = summary
        self.checkpoint = checkpoint

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self.summary}"]


# The ends a person expects (Stop, --timeout, a lease ended by someone else): the cell's own
# closing line says each, so the exception under it, which stops the cells queued after it, says
# nothing more.
EXPECTED_ENDS: tuple[type[BaseException], ...] = (GpuLeaseEnded, GpuTrainTimeout, GpuTrainStopped)


def said_once(shell: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: Any = None) -> Any:
    """IPython's handler of :data:`EXPECTED_ENDS` (``shell.set_custom_exc``): one the cell's line
    already told is shown no more (the kernel still answers the cell as failed, so Run All stops
    there); any other is shown as it always was, its one line."""
    if getattr(value, "told", False):
        return None
    stb = value._render_traceback_()  # type: ignore[attr-defined]
    shell._showtraceback(etype, value, stb)
    return stb


@dataclass
class Waiting:
    request: str
    gpus: str  # "2", "1-4"
    pool: str
    position: int | None  # None: leaving the queue (being granted)
    elapsed_s: float
    estimate: str = ""  # the server's latest estimate (waiting_estimate), e.g. "about 40 s more"


@dataclass
class Running:
    lease_id: str
    where: str  # "box GPU 0,1", "n1 GPU 0,1 + n2 GPU 0,1", "a CPU worker"
    gpus: int
    waited_s: float
    note: str = ""  # elastic size, borrowed or preemptible


@dataclass
class Ending:
    """How the call ended, once its workers are gone and its lease is released."""

    state: str  # released | failed | timeout | stopped | withdrawn | ended | refused
    where: str = ""
    gpus: int = 0
    held_s: float = 0.0
    verified: bool = False  # every worker process was seen gone before the release
    nvml: bool = False  # and NVML saw none of them on the GPUs
    peak_memory: int | None = None
    why: str = ""  # who ended the lease, and why (state "ended")
    hint: str = ""  # right-sizing advice for next time
    checkpoint: bool = False
    cpu: bool = False
    handed_to: str = ""  # a sweep's: the lease and its worker went on to this next trial
    warm: bool = False  # the worker and its lease were kept warm for the notebook's next cell
    crossed: list[str] = field(default_factory=list)  # names over 100 MB that came back: "m (1.2 GB, 0.9s)"
    notes: list[str] = field(default_factory=list)  # said while it ran and kept under the line ("! ...")
    restored: str = ""  # a worker suspended on eviction ran it: "restored 3.2 GB to box GPU 1 in 0.7s"

    def line(self) -> str:
        """One line for the notebook, at most 80 columns where the names allow."""
        if self.state == "withdrawn":
            return "gpu_train: stopped while queued; the request was withdrawn"
        if self.state == "refused":
            return f"gpu_train: {self.why}"
        big = f"; brought back {', '.join(self.crossed)}" if self.crossed else ""
        # each note under the line, wrapped to 80 columns
        notes = "".join("\n" + fit80(n, "  ! ", "    ") for n in self.notes)
        if self.restored:
            notes = f"\n  {self.restored}{notes}"
        if self.warm:
            lendable = "(lent out if someone waits)"
            mem = f"; peak {_gb(self.peak_memory)}" if self.peak_memory else ""
            if self.state == "failed":
                head, tail = (
                    f"gpu_train: failed after {self.held_s:.1f}s; its worker kept warm on {self.where}",
                    lendable,
                )
            else:
                head, tail = f"gpu_train: ran {self.held_s:.1f}s; kept warm on {self.where}", f"{lendable}{mem}{big}"
            # one line where it fits in 80 columns (a slice's place is longer), else two
            return f"{head} {tail}{notes}" if len(head) + 1 + len(tail) <= 80 else f"{head}\n  {tail}{notes}"
        if self.cpu:
            what = f"ran on {self.where} for {self.held_s:.1f}s"
        else:
            what = f"held {self.where} for {self.held_s:.1f}s"
        freed = "GPU memory freed" if self.verified else "worker not seen to exit"
        if self.handed_to:
            freed = "its worker went on to the next trial"
        released = "released" if self.cpu else f"released; {freed}"
        head = {
            "released": f"gpu_train: {what}",
            "failed": f"gpu_train: failed after {self.held_s:.1f}s on {self.where}",
            # the limit counts the function's run; the time held also counts the worker's start
            "timeout": f"gpu_train: stopped by --timeout {self.why} (held {self.held_s:.1f}s) on {self.where}"
            if self.why
            else f"gpu_train: stopped by --timeout after {self.held_s:.1f}s on {self.where}",
            "stopped": f"gpu_train: stopped after {self.held_s:.1f}s on {self.where}",
            "ended": f"gpu_train: {self.why}",
        }[self.state]
        if self.state == "ended" and "\n" in head:  # the end's own advice goes under the line
            head, more = head.split("\n", 1)
            hint = f"\n{more}" + (f"\n  {self.hint}" if self.hint else "")
        else:
            hint = f"\n  {self.hint}" if self.hint else ""
        tail = "" if self.state == "ended" and self.cpu else f"; {released}"
        mem = f"; peak {_gb(self.peak_memory)}" if self.peak_memory and not self.hint else ""
        saved = " (checkpoint saved: %%gpu_train --resume)" if self.checkpoint else ""
        if self.state == "timeout" and not self.checkpoint and not hint:
            hint = "\n  next: a longer --timeout, or checkpoints (magics.on_preempt) and --resume"
        first = f"{head}{tail}{mem}{big}{saved}"
        if len(first) > 80 and len(head) <= 80:  # what it freed and kept on a line of its own
            first = f"{head}\n" + fit80(f"{tail}{mem}{big}{saved}".removeprefix("; "), "  ")
        return f"{fit80(first + hint)}{notes}"


_FLAG_VALUE = re.compile(r"(--[a-z][a-z-]*) (?=[^\s-])")


def fit80(text: str, first: str = "", rest: str = "  ") -> str:
    """``text`` (lines of it) within 80 columns, a flag never parted from its value (``--gpu-mem
    3GB`` stays one piece, ready to copy); the first line's continuations indented by ``rest``, each
    later line's by its own indent and two more."""
    out = []
    for i, line in enumerate(text.splitlines()):
        lead = first if i == 0 else ""
        if len(lead) + len(line) <= 80:
            out.append(lead + line)
            continue
        glued = _FLAG_VALUE.sub(lambda m: m[1] + "\0", line)
        wrapped = textwrap.fill(
            glued,
            80,
            initial_indent=lead,
            subsequent_indent=rest if i == 0 else line[: len(line) - len(line.lstrip())] + "  ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        out.append(wrapped.replace("\0", " "))
    return "\n".join(out)


class UI(Protocol):
    """Where a call reports its progress. Each method is called from the calling thread."""

    def waiting(self, w: Waiting) -> None: ...
    def running(self, r: Running) -> None: ...
    def notice(self, text: str) -> None: ...
    def output(self, stream: str, text: str) -> None: ...
    def ended(self, e: Ending) -> None: ...


class RecordingUI:
    """A UI that keeps everything a call reported, in order: for scripts that want the states
    after the fact, and for tests. ``states`` holds Waiting / Running / notices / the Ending."""

    def __init__(self) -> None:
        self.states: list[Any] = []
        self.out: list[tuple[str, str]] = []

    def waiting(self, w: Waiting) -> None:
        self.states.append(w)

    def running(self, r: Running) -> None:
        self.states.append(r)

    def notice(self, text: str) -> None:
        self.states.append(text)

    def output(self, stream: str, text: str) -> None:
        self.out.append((stream, text))

    def ended(self, e: Ending) -> None:
        self.states.append(e)

    @property
    def ending(self) -> Ending:
        (e,) = [s for s in self.states if isinstance(s, Ending)]
        return e


class StreamUI:
    """For scripts (:func:`run_on_gpus`): the worker's output to this process's streams, the
    ending line and notices to stderr; no queue progress."""

    def __init__(self, quiet: bool = True) -> None:
        self.quiet = quiet

    def waiting(self, w: Waiting) -> None:
        pass

    def running(self, r: Running) -> None:
        pass

    def notice(self, text: str) -> None:
        sys.stderr.write(f"gpu_train: {text}\n")

    def output(self, stream: str, text: str) -> None:
        target = sys.stderr if stream == "stderr" else sys.stdout
        target.write(text)
        target.flush()

    def ended(self, e: Ending) -> None:
        if not self.quiet:
            sys.stderr.write(e.line() + "\n")


@dataclass(frozen=True)
class Lent:
    """A notebook's warm GPU lent out (its worker evicted for another user's request): to whom and
    when (epoch seconds), as the notebook's next cell says it. ``mine``: to another notebook of the
    same user."""

    user: str
    at: float
    mine: bool = False

    def clock(self) -> str:
        return time.strftime("%H:%M", time.localtime(self.at))

    def line(self) -> str:
        """ "your warm GPU was lent to bob at 14:02" """
        who = "your other notebook" if self.mine else self.user
        return f"your warm GPU was lent to {who} at {self.clock()}"


def about(seconds: float) -> str:
    """A wait or an end in a few words, as the server's estimate says it: "~12 s", "~4 min", "~1.5 h"."""
    return f"~{show_wait(seconds)}"


def _holder_end(h: dict[str, Any], since_s: float) -> str:
    """When a holder's soonest known end comes, counted down since the estimate was read."""
    left = float(h["ends_in"]) - since_s
    if left < 1:
        return "ending now"
    if h.get("end") == "expiry":  # its holder stopped renewing it: its deadline
        return f"expires in {about(left)}"
    return f"ends in {about(left)}"


def _holder(h: dict[str, Any], since_s: float) -> str:
    """One holder as the waiting line names it: "bob (ends in ~40 s)", "dana (booked, ends in
    ~2 min)", "you (2 GPUs)", "carol"."""
    name = "you" if h.get("mine") else str(h["user"])
    parts = []
    if h.get("booked") and not (h.get("gpus") or h.get("slices")):
        parts.append("booked")
    elif int(h.get("gpus") or 0) > 1:
        parts.append(f"{h['gpus']} GPUs")
    if h.get("ends_in") is not None:
        parts.append(_holder_end(h, since_s))
    return f"{name} ({', '.join(parts)})" if parts else name


def holders_line(est: dict[str, Any], since_s: float = 0.0, lent: Lent | None = None) -> str:
    """Why a queued cell waits, in lines of at most 80 columns (indented two): who holds the pool's
    GPUs and when each ends where that is known (the estimate's ``holders``, soonest first, counted
    down ``since_s`` seconds since it was read), as many as fit on one line; with ``lent``, first a
    line of whom this notebook's warm GPU was lent to and when their lease ends, then the others
    ("also held by"). "" when there is nothing to say."""
    holders = [h for h in est.get("holders") or [] if h.get("user")]
    lines = []
    prefix = "  held by "
    if lent is not None:
        head = lent.line()
        theirs = next((h for h in holders if h["user"] == lent.user), None)
        whose = "the lease" if lent.mine else f"{lent.user}'s lease"
        if theirs is not None and theirs.get("ends_in") is not None:
            end = _holder_end(theirs, since_s)
            head += f"; {whose} {'is ' if end == 'ending now' else ''}{end}"
        elif theirs is not None:
            head += f"; {whose} has no known end"
        lines.append(fit80(head, "  ", "    "))
        holders = [h for h in holders if h is not theirs]
        prefix = "  also held by "
    names = [_holder(h, since_s) for h in holders]
    line, shown = "", 0
    for i, name in enumerate(names):
        more = len(names) - i - 1
        candidate = (line + ", " if shown else prefix) + name
        # the first holder named whatever its length, the others where they fit
        if shown and len(candidate + (f", +{more} more" if more else "")) > 80:
            break
        line, shown = candidate, shown + 1
    if 0 < shown < len(names):
        line += f", +{len(names) - shown} more"
    if line:
        lines.append(line if len(line) <= 80 else fit80(line[2:], "  ", "    "))
    return "\n".join(lines)


def waiting_estimate(
    est: dict[str, Any],
    waited_s: float = 0.0,
    wait_s: float | None = None,
    since_s: float = 0.0,
    lent: Lent | None = None,
) -> str:
    """The lease server's estimate (``GET /estimate``) as the end of a queued cell's line: "about
    40 s more", the requests ahead, why it waits (:func:`holders_line`: who holds the GPUs and when
    they end, or whom the notebook's warm GPU was ``lent`` to) and a pool with the GPUs free now, each
    on a line of its own. The server's ``text`` repeats the request and the reasoning, which the
    line already shows. ``since_s``: seconds since the estimate was read (the line counts down).
    With the cell's ``--wait`` (``wait_s``, of which ``waited_s`` had been spent when the estimate
    was read): a line when the estimate runs past it, since the cell gives up first."""
    wait = est.get("wait")
    more = est.get("estimate_s")
    if wait is None:
        text = "no GPU of the pool is up"
    elif isinstance(more, (int, float)) and since_s > 0:
        left = more - since_s
        text = "any moment now" if left < 1 else f"about {about(left)[1:]} more"
    else:
        text = f"{wait} more" if str(wait).startswith("about ") else str(wait)
    ahead = int(est.get("queued_ahead") or 0)
    if ahead:
        text += f" ({ahead} request{'s' if ahead != 1 else ''} ahead)"
    why = holders_line(est, since_s, lent) if wait is not None else ""
    if why:
        text += f"\n{why}"
    if wait_s is not None and isinstance(more, (int, float)) and waited_s + more > wait_s:
        enough = math.ceil((waited_s + more) * 1.25 / 60) * 60  # the estimate and a margin, in minutes
        past, longer = show_duration(wait_s), show_duration(enough)
        text += f"\n  past --wait {past}: the cell gives up first; --wait {longer} waits it out"
    alternatives = est.get("alternatives") or []
    if alternatives:
        alt = alternatives[0]
        text += f"\n  {alt['free']} x {alt['pool']} free now: --pool {alt['pool']}"
    return text


def describe_end(rec: LeaseJson, me: str) -> str | None:
    """One line of who ended a lease and why, from its ended record's structured ``cause``; None
    while it is live. A record without one (ended by an older server) reads as its state, who and
    its ``end_reason``."""
    state = rec.get("state")
    if state not in protocol.ENDED_STATES:
        return None
    cause = rec.get("cause") or EndCauseJson(
        code=EndCause(state), by=rec.get("ended_by") or "", why=rec.get("end_reason") or ""
    )
    over = rec.get("over_memory")
    if cause["code"] == EndCause.OVER_MEMORY and over:
        # one line as the others; under it what it used, and next the --gpu-mem that would have
        # fit (Ending.line keeps those lines under the closing one)
        used = f"used {show_mb(over.get('used_mb', 0))} for {over.get('over_s', 0):.1f}s"
        fit_mb, total = int(over.get("fit_mb") or 0), int(rec.get("gpu_total_mb") or 0)
        if fit_mb and total and fit_mb >= total:  # more than its GPU has: a whole one
            used += "\n  next: a whole GPU (drop --gpu-mem)"
        elif fit_mb:
            margin = f"{FIT_MARGIN * 100:.0f} %"
            why = f" (its {show_mb(over['peak_mb'])} peak + {margin}, rounded up)" if over.get("peak_mb") else ""
            used += f"\n  next: --gpu-mem {as_option(fit_mb)}{why}"
        return f"stopped: over its {show_mb(over.get('limit_mb', 0))} slice\n  {used}"
    return describe_cause(cause, me)


def describe_cause(cause: EndCauseJson, me: str) -> str:
    """One line of who ended a lease and why (:class:`protocol.EndCause`), "you" for ``me``."""
    code, by, why = cause["code"], cause["by"], cause["why"]
    who = "you" if by == me else by
    if code == EndCause.RELEASED and why == protocol.BOARD_RELEASE_REASON:
        return f"released from the board by {who}"
    if code == EndCause.RELEASED and not why:
        return f"released by {who} (gpulease release or %gpu_lease release)"
    if code in (EndCause.RELEASED, EndCause.HANDED):
        return f"released by {who}: {why}"
    if code in (EndCause.EXPIRED, EndCause.WARM_MAX):
        return f"expired: {why} (was the kernel paused or cut off?)"
    if code == EndCause.RECLAIMED:
        return f"reclaimed: {why} after a warning"
    if code == EndCause.RECALLED:
        return why.replace("recalled for", "preempted for", 1)
    if code in (EndCause.PREEMPTED, EndCause.EVICTED):
        return why
    if code == EndCause.OVER_MEMORY:
        return f"stopped by the node agent: {why}" if why else "stopped by the node agent: over its slice's memory"
    return f"revoked by {who}: {why}" if why else f"revoked by {who}"


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _gb(n: int | None) -> str:
    """Bytes in GB of 1024 MB, as every size gpulease shows (sizes.show_mb, --gpu-mem)."""
    return f"{(n or 0) / 2**30:.1f} GB"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
