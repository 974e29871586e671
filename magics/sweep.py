"""Sweeps: one function (or cell) over many configurations, each trial its own lease request.

    from magics import gpu_map, grid, report

    def train(config):
        for epoch in range(10):
            loss = ...
            report(step=epoch, loss=loss)
        return model_summary

    results = gpu_map(train, grid(lr=[1e-3, 3e-3, 1e-2], batch=[32, 64]), gpus=1)
    results.to_pandas()

Every trial is one :func:`magics.runner.run_call` in a thread of its own, and its request waits in
the pool's queue like any cell's: fair share and quotas order it against other users' requests,
so the sweep starts with whatever is free, runs more trials as GPUs come back (the server grants a
queued trial in the same script that releases the last one's GPUs), and never starves another
user's cell. A trial's lease is released, its worker seen gone, the moment it ends; the sweep holds
no GPU between trials. ``max_parallel`` caps the trials queued or running at once.

While it runs, one table updated in place shows each trial (parameters, state, elapsed, last
metrics); a trial's output is kept in its record (``results[i].output``), not printed. Stop
withdraws every queued trial, stops the running ones and raises :class:`SweepStopped` (a
:class:`GpuTrainStopped`) with the records so far (``exc.results``). ``early_stop="median"``
ends a trial whose metric is worse than the median of the others' at the same step (the median
stopping rule), which frees its GPUs.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import statistics
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from lease_server import errors
from lease_server.client import waited_out
from lease_server.sizes import ordinal

from . import cellcode
from .calls import Call, CellValue
from .grant import Cancel
from .options import Options
from .outcomes import Ending, GpuLeaseEnded, GpuTrainError, GpuTrainStopped, Running, Waiting, _first_line
from .relay import Relay
from .runner import parse_duration, parse_gpus, run_call
from .session import Session, session

log = logging.getLogger(__name__)

__all__ = ["MedianStopping", "SweepDisplay", "SweepResults", "Trial", "gpu_map", "render_table", "run_sweep"]

MAX_IN_FLIGHT = 32  # trials queued or running at once when max_parallel is not given
# The most a sweep ever has queued or running, whatever max_parallel says: below the lease server's
# max_queued_per_user (256 by default), so a sweep never meets that limit and the user keeps room
# for other notebooks' requests.
MAX_PARALLEL_CAP = 128
MAX_SPARES = 8  # spare workers per node a sweep has ready for its first trials, which start side by side
TICK_S = 0.25  # the table is redrawn at most this often (and each second, for the elapsed times)
SEND_WAIT_S = 1.0  # at most this long for one trial's request to go out before the next one's
POSITIONS_EVERY_S = 1.0  # how often the queue positions of waiting trials are asked for (one request)
WIDTH = 80

# Requests that every trial would make the same way: the sweep stops at the first.
_REQUEST_ERRORS = (
    errors.BadRequest,
    errors.UnknownPool,
    errors.Unsatisfiable,
    errors.Unauthorized,
    errors.ConfigurationError,
)

# Sweeps running now, so that a kernel shutdown can stop them (magic.close_live_cells).
_LIVE: weakref.WeakSet[Sweep] = weakref.WeakSet()

ACTIVE = ("pending", "queued", "running")


# ---- one trial's record ------------------------------------------------------------------------


@dataclass(eq=False)
class Trial:
    """One configuration's run: its parameters, how it ended, what it returned and reported.

    ``state``: pending (held back by max_parallel) | queued | running | done | stopped early |
    failed | stopped (Stop, while it ran) | withdrawn (Stop, while it waited) | not run."""

    index: int
    params: Any
    state: str = "pending"
    value: Any = None  # what the function returned (a cell: its last expression)
    names: dict[str, Any] = field(default_factory=dict)  # a cell's --out names
    error: BaseException | None = None  # a failed trial's error; str(error) is one line
    metrics: list[dict[str, Any]] = field(default_factory=list)  # {"step": s, name: value, ...} per report
    lease_id: str = ""
    where: str = ""  # "box GPU 2"
    gpus: int = 0
    wait_s: float = 0.0  # in the queue, before the grant
    run_s: float = 0.0  # from the grant to the release
    gpu_seconds: float = 0.0  # gpus x run_s
    verified: bool = False  # its worker was seen gone before the release
    started_at: float | None = None  # time.time() when its GPUs were granted (None: it never ran)
    ended_at: float | None = None  # time.time() when its GPUs were released
    position: int | None = None  # place in the pool's queue while it waits
    _output: list[tuple[str, str]] = field(default_factory=list, repr=False)
    _since: float = 0.0  # monotonic: when the current state began
    _cancel: Cancel = field(default_factory=Cancel, repr=False)
    _early: bool = False
    _sent: bool = False  # its lease request is on its way to the server
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def output(self) -> str:
        """Everything the trial printed (stdout and stderr, in order)."""
        return "".join(text for _, text in self._output)

    @property
    def traceback(self) -> str:
        """A failed trial's remote traceback (or its error in one line); "" otherwise."""
        if self.error is None:
            return ""
        if isinstance(self.error, GpuTrainError):
            return self.error.remote_traceback or self.error.summary
        return f"{type(self.error).__name__}: {self.error}"

    @property
    def last(self) -> dict[str, Any]:
        """The last report's metrics (without its step)."""
        return {k: v for k, v in self.metrics[-1].items() if k != "step"} if self.metrics else {}

    @property
    def ok(self) -> bool:
        return self.state == "done"

    def record(self) -> dict[str, Any]:
        """One flat row: trial, parameters, state, value, last metrics, GPU-seconds, wait."""
        row: dict[str, Any] = {"trial": self.index}
        row.update(self.params if isinstance(self.params, dict) else {"params": self.params})
        row.update(state=self.state, value=self.value)
        for k, v in self.last.items():
            row[k if k not in row else f"metric_{k}"] = v
        row.update(
            steps=len(self.metrics),
            gpu_seconds=round(self.gpu_seconds, 3),
            wait_s=round(self.wait_s, 3),
            run_s=round(self.run_s, 3),
            started_at=self.started_at,
            ended_at=self.ended_at,
            where=self.where,
            error=_first_line(self.error) if self.error is not None else "",
        )
        return row

    def __repr__(self) -> str:
        last = " ".join(f"{k}={_fmt(v)}" for k, v in self.last.items())
        got = f", value={_short(repr(self.value), 40)}" if self.state == "done" else ""
        err = f", error={_short(_first_line(self.error), 60)!r}" if self.error is not None else ""
        return f"Trial({self.index}, {_params(self.params)!r}, {self.state}{got}{err}{', ' + last if last else ''})"


class SweepResults(list[Trial]):
    """The trials in trial order. ``records()`` (or ``to_pandas()``) has one row per trial,
    ``history()`` one row per report, ready to plot."""

    def records(self) -> list[dict[str, Any]]:
        return [t.record() for t in self]

    def history(self) -> list[dict[str, Any]]:
        """Every report of every trial: trial, parameters, step and the metrics reported."""
        rows = []
        for t in self:
            params = t.params if isinstance(t.params, dict) else {"params": t.params}
            for m in t.metrics:
                rows.append({"trial": t.index, **params, **m})
        return rows

    def to_pandas(self, history: bool = False) -> Any:
        """A pandas DataFrame of :meth:`records` (``history=True``: of :meth:`history`)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("to_pandas() needs pandas: pip install pandas (records() needs nothing)") from None
        return pd.DataFrame(self.history() if history else self.records())

    def best(self, metric: str, mode: str = "min") -> Trial | None:
        """The finished trial with the best last value of ``metric`` (mode "min" or "max")."""
        scored = [(t.last[metric], t) for t in self if t.ok and _number(t.last.get(metric)) is not None]
        if not scored:
            return None
        pick = min if mode == "min" else max
        return pick(scored, key=lambda s: s[0])[1]

    def __repr__(self) -> str:
        return render_table(self, _final_line(self, 0.0, stopped=False))

    # list's own repr would be a wall of records; the table is what a person wants to see
    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


class SweepStopped(GpuTrainStopped):
    """Stop ended the sweep: every queued trial withdrawn, the running ones stopped. ``results``:
    the trials' records so far."""

    def __init__(self, summary: str, results: SweepResults) -> None:
        super().__init__(summary)
        self.results = results


# ---- the median stopping rule --------------------------------------------------------------------


class _Series:
    """One trial's values of the stopping metric by step, with running sums."""

    def __init__(self, sign: float) -> None:
        self.sign = sign  # +1: lower is better; -1: higher is better
        self.steps: list[float] = []
        self.sums: list[float] = []
        self.best = math.inf  # in "lower is better" units

    def add(self, step: float, value: float) -> None:
        v = self.sign * value if value == value else math.inf  # NaN: as bad as it gets
        self.steps.append(step)
        self.sums.append((self.sums[-1] if self.sums else 0.0) + v)
        self.best = min(self.best, v)

    def mean_upto(self, step: float) -> float | None:
        n = bisect.bisect_right(self.steps, step)
        return self.sums[n - 1] / n if n else None


@dataclass
class MedianStopping:
    """The median stopping rule (Golovin et al., Google Vizier): a running trial whose best value
    of ``metric`` so far is worse than the median of the other trials' running averages up to the
    same step is stopped. A trial is judged from its ``min_steps``-th report on, and only against
    at least ``min_trials`` others that reached that step (or finished). Steps must rise."""

    metric: str
    mode: str = "min"  # "min": lower is better; "max": higher is better
    min_steps: int = 3
    min_trials: int = 3

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {self.mode!r}")
        if not self.metric:
            raise ValueError("the median stopping rule needs the name of the metric it compares (metric=...)")

    def should_stop(self, me: int, series: dict[int, _Series], finished: set[int]) -> bool:
        mine = series.get(me)
        if mine is None or len(mine.steps) < self.min_steps:
            return False
        step = mine.steps[-1]
        peers = []
        for i, other in series.items():
            if i == me or not other.steps or (i not in finished and other.steps[-1] < step):
                continue
            mean = other.mean_upto(step)
            if mean is not None:
                peers.append(mean)
        return len(peers) >= self.min_trials and mine.best > statistics.median(peers)


# ---- the table -----------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _params(p: Any) -> str:
    if isinstance(p, dict):
        return " ".join(f"{k}={_fmt(v)}" for k, v in p.items())
    return _fmt(p) if isinstance(p, float) else repr(p)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _clock(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _state_text(t: Trial) -> str:
    if t.state == "queued":
        return f"queued, {ordinal(t.position)}" if t.position else "queued"
    if t.state == "running":
        return f"running {t.where}" if t.where else "running"
    if t.state == "failed" and isinstance(t.error, errors.NoCapacity):
        return "gave up waiting"  # its --wait ran out in the queue
    if t.state == "failed" and t.error is not None:
        kind = t.error.remote_type if isinstance(t.error, GpuTrainError) and t.error.remote_type else ""
        return f"failed: {kind or type(t.error).__name__}"
    return t.state


def _why(exc: BaseException) -> str:
    """A failed trial's reason, one line; a refusal in the words of the cell's own flags."""
    return waited_out(exc).splitlines()[0] if isinstance(exc, errors.GpuLeaseError) else _first_line(exc)


def _elapsed(t: Trial, now: float) -> str:
    if t.state in ("queued", "running"):
        return _clock(now - t._since)
    if t.run_s:
        return _clock(t.run_s)
    return "-"


def _metrics_text(t: Trial) -> str:
    if not t.metrics:
        return ""
    m = t.metrics[-1]
    step = f"step {_fmt(m['step'])} " if m.get("step") is not None else ""
    return step + " ".join(f"{k}={_fmt(v)}" for k, v in m.items() if k != "step")


def render_table(trials: Iterable[Trial], head: str, now: float | None = None, width: int = WIDTH) -> str:
    """The sweep's table as text, no line wider than ``width``: trial, parameters, state,
    elapsed, last metrics; failures named below it."""
    now = time.monotonic() if now is None else now
    rows = [(str(t.index), _params(t.params), _state_text(t), _elapsed(t, now), _metrics_text(t)) for t in trials]
    lines = [_short(h, width) for h in head.splitlines()]
    if rows:
        wi = max(1, *(len(r[0]) for r in rows))
        ws = min(22, max(5, *(len(r[2]) for r in rows)))
        we = 7
        room = width - (2 + wi + 2 + 2 + ws + 2 + we + 2)  # for the parameters and the metrics
        wp = max(10, *(len(r[1]) for r in rows))
        wm = max(12, *(len(r[4]) for r in rows))
        if wp + wm > room:  # the parameters give way first, down to 16 columns; the metrics take the rest
            wp = max(min(wp, 16), room - wm)
            wm = room - wp
        lines.append(
            _short(f"  {'#':>{wi}}  {'parameters':<{wp}}  {'state':<{ws}}  {'elapsed':>{we}}  last metrics", width)
        )
        for i, p, s, e, m in rows:
            line = f"  {i:>{wi}}  {_short(p, wp):<{wp}}  {_short(s, ws):<{ws}}  {e:>{we}}  {_short(m, wm)}"
            lines.append(_short(line.rstrip(), width))
    failed = [t for t in trials if t.state == "failed" and t.error is not None]
    for t in failed[:5]:
        lines.append(_short(f"  trial {t.index}: {_why(t.error)}", width))  # type: ignore[arg-type]
    if len(failed) > 5:
        lines.append(f"  ... and {len(failed) - 5} more failed trials")
    return "\n".join(lines)


def _counts(trials: Iterable[Trial]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trials:
        out[t.state] = out.get(t.state, 0) + 1
    return out


def _final_line(trials: list[Trial], seconds: float, stopped: bool) -> str:
    c = _counts(trials)
    order = ["done", "stopped early", "failed", "stopped", "withdrawn", "not run", "running", "queued", "pending"]
    parts = ", ".join(f"{c[s]} {s}" for s in order if c.get(s))
    gpu_s = sum(t.gpu_seconds for t in trials)
    took = f" in {_clock(seconds)}" if seconds else ""
    unverified = sum(1 for t in trials if t.run_s and not t.verified)
    tail = "every lease released" + (f" ({unverified} worker(s) not seen to exit)" if unverified else "")
    verb = "stopped" if stopped else f"{len(trials)} trials{took}"
    return f"gpu_sweep: {verb}: {parts}; {gpu_s:.1f} GPU-s; {tail}"


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:
        return False
    return ip is not None and getattr(ip, "kernel", None) is not None


class SweepDisplay:
    """The sweep's one table. In a kernel: a display updated in place. Elsewhere (a script, a
    test): one line to stderr as each trial ends, and the final table to stdout; ``quiet``:
    nothing (``text`` still holds the table)."""

    def __init__(self, live: bool | None = None, quiet: bool = False) -> None:
        self.live = False if quiet else _in_kernel() if live is None else live
        self.quiet = quiet
        self._handle: Any = None
        self.text = ""

    def show(self, text: str, final: bool = False) -> None:
        self.text = text
        if not self.live:
            if final and not self.quiet:
                print(text, flush=True)
            return
        try:
            from IPython.display import display

            if self._handle is None:
                self._handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._handle.update({"text/plain": text}, raw=True)
        except Exception:  # noqa: BLE001 - no display machinery after all: the final table only
            self.live = False
            if final:
                print(text, flush=True)

    def trial_ended(self, t: Trial) -> None:
        if not self.live and not self.quiet:
            extra = f" ({_why(t.error)})" if t.error is not None and t.state == "failed" else ""
            sys.stderr.write(f"gpu_sweep: trial {t.index} {_params(t.params)}: {t.state}{extra}\n")


# ---- the sweep -----------------------------------------------------------------------------------


class _TrialUI:
    """What one trial's call reports, folded into its record under the sweep's lock."""

    def __init__(self, sweep: Sweep, t: Trial) -> None:
        self.sweep, self.t = sweep, t

    def waiting(self, w: Waiting) -> None:
        with self.sweep._cond:
            self.t.state, self.t._since, self.t._sent = "queued", time.monotonic(), True
            self.sweep._rids[w.request] = self.t
            self.sweep._dirty = True
            self.sweep._cond.notify_all()

    def running(self, r: Running) -> None:
        with self.sweep._cond:
            t = self.t
            t.state, t._since, t.position = "running", time.monotonic(), None
            t.where, t.lease_id, t.gpus, t.wait_s = r.where, r.lease_id, r.gpus, r.waited_s
            t.started_at = time.time()
            self.sweep._dirty = True

    def notice(self, text: str) -> None:
        self.output("stderr", f"gpu_train: {text}\n")

    def output(self, stream: str, text: str) -> None:
        with self.sweep._cond:
            self.t._output.append((stream, text))

    def metrics(self, record: dict[str, Any]) -> None:
        self.sweep._report(self.t, record)

    def ended(self, e: Ending) -> None:
        with self.sweep._cond:
            t = self.t
            t.run_s = e.held_s if e.state not in ("withdrawn", "refused") else 0.0
            t.gpu_seconds = t.run_s * e.gpus
            t.verified = e.verified
            if t.started_at is not None:
                t.ended_at = time.time()


class Sweep:
    """Runs ``calls`` (one per trial), each through :func:`run_call` in its own thread, at most
    ``max_parallel`` queued or running at once; shows the table; handles Stop. See the module."""

    def __init__(
        self,
        calls: list[tuple[Any, Call]],
        options: Options,
        max_parallel: int | None = None,
        stopping: MedianStopping | None = None,
        sess: Session | None = None,
        display: SweepDisplay | None = None,
    ) -> None:
        if not calls:
            raise ValueError("nothing to sweep: no configurations")
        if max_parallel is not None and (isinstance(max_parallel, bool) or max_parallel < 1):
            raise ValueError(f"max_parallel must be a whole number >= 1, got {max_parallel!r}")
        self.calls = [c for _, c in calls]
        self.trials = SweepResults(Trial(i, p) for i, (p, _) in enumerate(calls))
        self.options = options
        self.max_parallel = min(max_parallel or min(len(calls), MAX_IN_FLIGHT), MAX_PARALLEL_CAP)
        self.stopping = stopping
        self.sess = sess or session()
        self.display = display or SweepDisplay()
        self.pool = ""
        self._cond = threading.Condition()
        self._dirty = True
        self._stopping = False
        self._fatal: BaseException | None = None
        self._rids: dict[str, Trial] = {}
        self._series: dict[int, _Series] = {}
        self._finished: set[int] = set()
        self._t0 = time.monotonic()
        # A trial that ends hands its GPUs and its worker to the oldest queued trial when nobody
        # else waits for them (magics.relay.Relay): that trial starts at once, on a warm process.
        self._relay = Relay(self.sess, self._next_requests)

    # -- the main loop, in the calling thread ----------------------------------------------------

    def run(self) -> SweepResults:
        self.sess.connect_ray()  # in this (the main) thread: Ray installs signal handlers there
        opts = self.options.resolved(self.sess.defaults)
        self.options = opts
        view = self.sess.client().cluster()
        self.pool = opts.pool or view.get("default_pool") or ""
        _LIVE.add(self)
        self._t0 = time.monotonic()
        try:
            try:
                self._more_spares(view, opts.gpus or 0)
                self._loop()
            except KeyboardInterrupt:
                self._stop()
                self._drain()
                line = _final_line(self.trials, 0.0, stopped=True)
                self.display.show(self._table(line), final=True)
                raise SweepStopped(line, self.trials) from None
        finally:
            _LIVE.discard(self)
            self._relay.close()
        if self._fatal is not None:
            self.display.show(self._table(_final_line(self.trials, time.monotonic() - self._t0, False)), final=True)
            raise self._fatal
        line = _final_line(self.trials, time.monotonic() - self._t0, stopped=False)
        self.display.show(self._table(line), final=True)
        return self.trials

    def _loop(self) -> None:
        pending = deque(self.trials)
        drawn = asked = 0.0
        while True:
            with self._cond:
                busy = sum(1 for t in self.trials if t._thread is not None and t.state in ACTIVE)
                while pending and busy < self.max_parallel and not self._stopping:
                    t = pending.popleft()
                    self._start(t)
                    busy += 1
                    # The next trial's request goes out after this one's, so that the pool's queue
                    # holds them in trial order (each is sent from its own thread).
                    self._cond.wait_for(functools.partial(_sent, t), SEND_WAIT_S)
                if busy == 0 and (not pending or self._stopping):
                    for t in pending:
                        t.state = "not run"
                    return
                self._cond.wait(TICK_S)
                now = time.monotonic()
                if not (self._dirty or now - drawn >= 1.0):
                    continue
                self._dirty = False
                table = self._table()
                queued = any(t.state == "queued" for t in self.trials)
            if queued and now - asked >= POSITIONS_EVERY_S:
                asked = now
                self._positions()
            drawn = now
            self.display.show(table)

    def _drain(self) -> None:
        """Wait until no trial's thread still runs (each withdraws or stops its own call once
        cancelled), redrawing; a second Stop press does not cut this short."""
        while True:
            try:
                with self._cond:
                    if not any(t.state in ACTIVE and t._thread and t._thread.is_alive() for t in self.trials):
                        for t in self.trials:
                            if t.state in ACTIVE:  # never started (Stop came first)
                                t.state = "not run"
                        return
                    self._cond.wait(TICK_S)
                    table = self._table("gpu_sweep: stopping: withdrawing queued trials, stopping running ones")
                self.display.show(table)
            except KeyboardInterrupt:
                continue

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            for t in self.trials:
                if t.state in ACTIVE:
                    t._cancel.request()
            self._cond.notify_all()

    def _table(self, head: str | None = None) -> str:
        if head is None:
            c = _counts(self.trials)
            order = ["running", "queued", "pending", "done", "stopped early", "failed"]
            parts = ", ".join(f"{c[s]} {s}" for s in order if c.get(s))
            gpus = self.options.gpus or 0
            what = f"{gpus} GPU{'s' if gpus != 1 else ''}" + (f" of {self.pool}" if self.pool else "")
            head = f"gpu_sweep: {len(self.trials)} trials x {what} - {_clock(time.monotonic() - self._t0)}"
            head += f": {parts}" if len(head) + len(parts) + 2 <= WIDTH else f":\n  {parts}"
        return render_table(self.trials, head)

    def _positions(self) -> None:
        try:
            waiting = self.sess.client().queue(self.pool or None)
        except errors.GpuLeaseError:
            return
        where = {w["id"]: w.get("position") for w in waiting}
        with self._cond:
            for rid, t in self._rids.items():
                if t.state == "queued":
                    t.position = where.get(rid)

    def _more_spares(self, view: dict[str, Any], gpus: int) -> None:
        """The first trials start side by side: have as many spares on each node of the pool as
        trials can run there at once (at most MAX_SPARES) when the sweep starts. Later trials run on
        the workers handed on by the trials before them, so the session does not keep replacing
        spares beyond its usual count (that would only take CPU from the node)."""
        if gpus <= 0:
            return
        nodes = [n for n in view.get("nodes", []) if n.get("pool") == self.pool and n.get("state") == "up"][:8]
        for n in nodes:
            want = min(len(n.get("gpus", [])) // gpus, self.max_parallel, MAX_SPARES)
            try:
                self.sess.prewarm_to(n["name"], want)
            except Exception as exc:  # noqa: BLE001 - trials then start their own workers
                log.warning("could not start spare workers on %s: %s", n["name"], exc)

    # -- one trial, in its own thread ------------------------------------------------------------

    def _start(self, t: Trial) -> None:
        """Called with the lock held. A trial is in flight from here until its thread sets its
        final state; one whose thread never started (Stop came in between) is found by _drain."""
        t.state, t._since = "queued", time.monotonic()
        n = len(self.trials)
        label = f"{self.options.label or 'sweep'} {t.index + 1}/{n}: {_params(t.params)}"
        opts = replace(self.options, label=label[:120])
        t._thread = threading.Thread(
            target=self._run_trial, args=(t, self.calls[t.index], opts), name=f"gpulease-trial-{t.index}", daemon=True
        )
        t._thread.start()

    def _run_trial(self, t: Trial, call: Call, opts: Options) -> None:
        ui = _TrialUI(self, t)
        state, value, names = "failed", None, {}
        error: BaseException | None = None
        try:
            out = run_call(call, opts, ui, self.sess, cancel=t._cancel, relay=self._relay)
            if isinstance(out.value, CellValue):
                value = out.value.result
                names = {k: v for k, v in out.value.names.items() if not cellcode.is_module(v)}
            else:
                value = out.value
            state = "done"
        except GpuTrainStopped:
            state = "stopped early" if t._early else "withdrawn" if t.state == "queued" else "stopped"
        except GpuLeaseEnded as exc:
            stopped = self._stopping and t.state == "queued"  # withdrawn by a kernel shutdown
            state, error = ("withdrawn", None) if stopped else ("failed", exc)
        except _REQUEST_ERRORS as exc:
            error = exc
            with self._cond:
                if self._fatal is None:
                    self._fatal = exc
            self._stop()
        except BaseException as exc:  # noqa: BLE001 - a trial's failure is its record's, never the sweep's
            error = exc
        with self._cond:
            t.state, t.value, t.names, t.error = state, value, names, error
            t.position = None
            if state == "done":
                self._finished.add(t.index)
            self._dirty = True
            self._cond.notify_all()
        self.display.trial_ended(t)

    def _next_requests(self, lease_id: str) -> list[str]:
        """The requests a trial's ending lease may go to: the trials still queued, oldest first."""
        with self._cond:
            if self._stopping:
                return []
            queued = sorted(
                (t.index, rid) for rid, t in self._rids.items() if t.state == "queued" and not t._cancel.requested
            )
            return [rid for _, rid in queued]

    def _report(self, t: Trial, record: dict[str, Any]) -> None:
        """A trial's magics.report(): keep it, and apply the stopping rule."""
        entry = {"step": record.get("step"), **record.get("metrics", {})}
        with self._cond:
            t.metrics.append(entry)
            self._dirty = True
            rule = self.stopping
            if rule is None or t._early:
                return
            value = _number(entry.get(rule.metric))
            step = _number(entry.get("step"))
            if value is None or step is None:
                return
            series = self._series.setdefault(t.index, _Series(1.0 if rule.mode == "min" else -1.0))
            series.add(step, value)
            if t.state == "running" and rule.should_stop(t.index, self._series, self._finished):
                t._early = True
                t._cancel.request()


def _sent(t: Trial) -> bool:
    return t._sent or t.state != "queued"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _check_picklable(fn: Any, configs: list[Any]) -> None:
    """Say which part cannot travel to the workers before any trial is queued."""
    from ray import cloudpickle

    for what, value in (("the function", fn), ("the configurations", configs)):
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - named below
            raise ValueError(
                f"{what} cannot be sent to the GPU workers ({type(exc).__name__}: {exc}); "
                "create what it needs inside the function instead"
            ) from None


def stop_live_sweeps() -> None:
    """Kernel shutdown: every running sweep withdraws its queued trials and stops its running ones."""
    for sweep in list(_LIVE):
        sweep._stop()


# ---- entry points --------------------------------------------------------------------------------


def run_sweep(
    calls: list[tuple[Any, Call]],
    options: Options,
    max_parallel: int | None = None,
    early_stop: str | None = None,
    metric: str | None = None,
    mode: str = "min",
    min_steps: int = 3,
    sess: Session | None = None,
    display: SweepDisplay | None = None,
) -> SweepResults:
    """Run one prepared :class:`Call` per trial (``calls``: (parameters, call) pairs) with
    ``options``; what :func:`gpu_map` and ``%%gpu_sweep`` share."""
    stopping = None
    if early_stop is not None:
        if early_stop != "median":
            raise ValueError(f"early_stop must be 'median' (the median stopping rule), not {early_stop!r}")
        if not metric:
            raise ValueError("early_stop='median' needs metric=NAME, the metric reported with magics.report()")
        stopping = MedianStopping(metric, mode, min_steps)
    elif metric and mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
    return Sweep(calls, options, max_parallel, stopping, sess, display).run()


def gpu_map(
    fn: Callable[[Any], Any],
    configs: Iterable[Any],
    gpus: int | str = 1,
    max_parallel: int | None = None,
    pool: str | None = None,
    timeout: str | float | None = None,
    *,
    early_stop: str | None = None,
    metric: str | None = None,
    mode: str = "min",
    min_steps: int = 3,
    wait: str | float | None = None,
    priority: str | None = None,
    label: str = "",
    sess: Session | None = None,
    display: SweepDisplay | None = None,
) -> SweepResults:
    """Call ``fn(config)`` for every config of ``configs``, each call a trial on its own ``gpus``
    leased GPUs, and return the trials' records in order (:class:`SweepResults`).

    Each trial is its own request in the pool's queue (fair share holds between users); at most
    ``max_parallel`` trials are queued or running at once (default: all, up to 32). A trial's
    GPUs go back the moment it ends; ``timeout`` bounds each trial. A failing trial does not stop
    the others: its record holds the remote traceback. Inside ``fn``, ``magics.report(step=...,
    **metrics)`` streams metrics; ``early_stop="median"`` with ``metric=NAME`` (``mode`` "min" or
    "max") stops trials that fall behind the median of the others. Stop withdraws every queued
    trial, stops the running ones and raises :class:`SweepStopped`, a :class:`GpuTrainStopped`
    (``exc.results``: the records so far)."""
    lo, hi = parse_gpus(gpus)
    opts = Options(
        gpus=hi,
        gpus_min=lo,
        pool=pool,
        priority=priority,
        timeout=parse_duration(timeout),
        wait=parse_duration(wait),
        label=label or getattr(fn, "__name__", "sweep"),
    )
    configs = list(configs)
    _check_picklable(fn, configs)
    calls = [(c, Call.function(fn, c)) for c in configs]
    return run_sweep(calls, opts, max_parallel, early_stop, metric, mode, min_steps, sess, display)
