"""The IPython magics. Thin: they parse arguments, call :func:`magics.runner.run_cell` (or
:func:`magics.sweep.run_sweep`), and render its progress as one line per cell that is updated in
place (:class:`CellDisplay`); what a call said while it ran and must outlive it stays under the
closing line."""

from __future__ import annotations

import difflib
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from lease_server import errors
from lease_server.client import waited_out
from lease_server.protocol import LeaseJson
from lease_server.sizes import ordinal, show_mb

from . import cellcode, space
from .elastic import DEFAULT_MIN_EFFICIENCY
from .options import SPARES_MAX
from .outcomes import EXPECTED_ENDS, fit80
from .runner import (
    Ending,
    Options,
    Running,
    Waiting,
    check_elastic,
    check_gang,
    check_slice,
    is_fraction,
    parse_duration,
    parse_gpus,
    plan_call,
    run_cell,
    session,
)
from .sweep import SweepStopped, run_sweep, stop_live_sweeps
from .warm import current as current_warm
from .warm import end_warm

# The cells running or queued right now, so that a kernel shutdown can close their lines.
_LIVE: weakref.WeakSet[CellDisplay] = weakref.WeakSet()


def _duration(text: str | None, flag: str) -> float | None:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


class CellDisplay:
    """The cell's one status line (queued -> running -> released / stopped / revoked), a display
    updated in place; the worker's output streams below it."""

    def __init__(self) -> None:
        self._handle: Any = None
        self.text = ""
        self.state = "new"
        self._running = ""
        # The kernel's shutdown hook (control thread) and the cell's own ending (main thread) can
        # meet: one of them says the last word, and only after the other has decided.
        self._lock = threading.Lock()
        _LIVE.add(self)

    def show(self, text: str) -> None:
        self.text = text
        try:
            from IPython.display import display

            if self._handle is None:
                self._handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._handle.update({"text/plain": text}, raw=True)
        except Exception:  # noqa: BLE001 - no display machinery (plain Python): one line each
            print(text)

    def waiting(self, w: Waiting) -> None:
        with self._lock:
            if self.state == "shut down":
                return
            self.state = "queued"
            where = f"{ordinal(w.position)} in line" if w.position else "being granted"
            pool = f" of {w.pool}" if w.pool else ""
            est = f"; {w.estimate}" if w.estimate and w.position else ""
            gpus = f"a {w.gpus}" if w.gpus.endswith("slice") else f"{w.gpus} GPU{'' if w.gpus == '1' else 's'}"
            self.show(f"gpu_train: queued for {gpus}{pool}: {where}, {w.elapsed_s:.0f}s{est}")

    def running(self, r: Running) -> None:
        waited = f" (waited {r.waited_s:.1f}s)" if r.waited_s >= 1 else ""
        note = f"; {r.note}" if r.note else ""
        with self._lock:
            if self.state == "shut down":
                return
            self.state = "running"
            # within 80 columns: a resumed worker's note names whom its GPU was lent to
            self._running = fit80(f"gpu_train: running on {r.where}{waited}{note}")
            self.show(self._running)

    def notice(self, text: str) -> None:
        with self._lock:
            if self.state != "shut down":
                self.show(f"{self._running}\n  ! {text}")

    def output(self, stream: str, text: str) -> None:
        target = sys.stderr if stream == "stderr" else sys.stdout
        target.write(text)
        target.flush()

    def ended(self, e: Ending) -> None:
        with self._lock:
            if self.state == "shut down":  # the kernel's last word stays
                return
            line = e.line()
            self.text = line  # (before the state: a shutdown that finds the state ended sends this line)
            self.state = e.state
            self.show(line)
        _LIVE.discard(self)

    def kernel_shutdown(self) -> None:
        # Bounded: the main thread holds the lock only while it writes a line, but the interrupt
        # that jupyter_client sends just before a shutdown lands in that thread at any point; the
        # kernel's last word must not wait on it for ever (the kernel would be killed unheard).
        locked = self._lock.acquire(timeout=3)
        try:
            if self.state == "queued":
                self.show("gpu_train: the kernel shut down; the request was withdrawn")
            elif self.state == "running":
                self.show("gpu_train: the kernel shut down; the call was stopped and its GPUs released")
            elif self.text:
                # Ended just now (that interrupt, a Stop): its last line may still be on its way out
                # of the main thread, which a loaded machine can hold up past the kernel's exit.
                # Sent again from here, it goes out with the flush that follows (same line, same
                # display: said twice, shown once).
                self.show(self.text)
            self.state = "shut down"
        finally:
            if locked:
                self._lock.release()


def close_live_cells() -> None:
    """Kernel shutdown or restart: withdraw what waits, release what runs, and say so in each
    cell's line, so that no cell keeps claiming to wait for a kernel that is gone."""
    for cell in list(_LIVE):  # first: the withdrawal below also wakes the cell's own thread
        cell.kernel_shutdown()
    stop_live_sweeps()  # no sweep sends another trial once its queued ones are withdrawn below
    session().release_all()


def _parse(magic: Any, line: str) -> Any:
    """The magic's arguments; a misspelt option gets the nearest one named ("--gpu": did you mean
    --gpus?). Abbreviations are not accepted: a prefix that fits today may fit two options later."""
    try:
        return parse_argstring(magic, line)
    except UsageError as exc:
        said = str(exc)
        if said.startswith("unrecognized arguments:"):
            known = [o for action in magic.parser._actions for o in action.option_strings]
            words = [w.split("=")[0] for w in said.split(":", 1)[1].split() if w.startswith("--")]
            near = [m for w in words for m in difflib.get_close_matches(w, known, n=1)]
            if near:
                raise UsageError(f"{said} (did you mean {', '.join(near)}?)") from None
        raise


# The states whose closing line the cell shows, saying the end once (outcomes.said_once).
TOLD = ("ended", "timeout", "stopped", "withdrawn")

_PARSE_ERRORS = (
    errors.BadRequest,
    errors.Forbidden,  # e.g. --priority high for a user the server's high_priority does not name
    errors.UnknownPool,
    errors.Unsatisfiable,
    errors.Unauthorized,
    errors.ConfigurationError,
    errors.ServerUnavailable,
    errors.NoCapacity,
)


def _lease_arguments(each: str, gpus_help: str, out_help: str) -> Callable[[Any], Any]:
    """The arguments of every magic that leases GPUs (%%gpu_train, %%gpu_sweep), in one place:
    --gpus, --pool, --priority, --timeout, --wait and --out; ``each`` names what one lease runs
    ("the call", "a trial")."""
    group = [
        argument("--gpus", default=None, help=gpus_help),
        argument("--pool", default=None, help="Pool to lease from (default: the server's default GPU pool)"),
        argument(
            "--priority", default=None, choices=["low", "normal", "high"], help="Priority class (default: normal)"
        ),
        argument("--timeout", default=None, help=f"Stop {each} after this long, e.g. 30m (default: none)"),
        argument("--wait", default=None, help=f"How long {each} may wait in the queue, e.g. 10m (default: 1h)"),
        argument("--out", default=None, help=out_help),
    ]

    def apply(fn: Any) -> Any:
        for add in reversed(group):
            fn = add(fn)
        return fn

    return apply


@magics_class
class GpuMagics(Magics):
    @staticmethod
    def start_prewarm() -> None:
        """Connect to Ray and start spare workers in the background, so the first cell is fast."""

        def warm() -> None:
            try:
                s = session()
                view = s.client().cluster()
                pool = s.defaults.pool or view.get("default_pool")
                nodes = [n["name"] for n in view["nodes"] if n["pool"] == pool and n["state"] == "up"][:8]
                s.prewarm(nodes)
            except Exception:  # noqa: BLE001 - the first call will report the problem clearly
                pass

        threading.Thread(target=warm, name="gpulease-prewarm", daemon=True).start()

    def _cell_number(self) -> str:
        """The running cell's number as the notebook shows it (``In [4]``): the board's tile then
        reads "train.ipynb · cell 4". IPython counts a cell while it runs and moves on after."""
        count = getattr(self.shell, "execution_count", None)
        return str(count) if isinstance(count, int) and count > 0 else ""

    def _options(self, args: Any, label: str, *, warm: bool = True) -> Options:
        """One call's options from a magic's arguments (the shared group of _lease_arguments, and
        those only %%gpu_train takes, absent elsewhere): the one place a magic builds them.
        ``warm``: the call may keep its worker warm (a %%gpu_train cell, not a sweep's trials)."""
        nodes = getattr(args, "nodes", None)
        gpu_mem = getattr(args, "gpu_mem", None)
        try:
            gpus_arg = args.gpus
            if gpus_arg is not None and is_fraction(gpus_arg):  # --gpus 0.25: a quarter of one GPU's memory
                if gpu_mem is not None:
                    raise ValueError(f"--gpus {gpus_arg} already asks for part of one GPU: drop --gpu-mem")
                gpu_mem = float(gpus_arg)
                gpus_arg = None
            gpus_min, gpus = parse_gpus(gpus_arg) if gpus_arg is not None else (None, None)
            check_gang(gpus_min, gpus, nodes)
            elastic_asked = bool(getattr(args, "elastic", False))
            check_slice(gpu_mem, gpus_min, gpus, nodes, elastic_asked)
            elastic = bool(getattr(args, "elastic", False))
            min_eff = getattr(args, "min_efficiency", None)
            if min_eff is not None and not elastic:
                raise ValueError("--min-efficiency goes with --elastic")
            if elastic:
                check_elastic(
                    Options(gpus=gpus, gpus_min=gpus_min, nodes=nodes, min_efficiency=min_eff or 0.5, elastic=True)
                )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        outputs = [n.strip() for n in args.out.split(",") if n.strip()] if args.out is not None else None
        return Options(
            gpus=gpus,
            gpus_min=gpus_min,
            nodes=nodes,
            pool=args.pool,
            priority=args.priority,
            timeout=_duration(args.timeout, "--timeout"),
            wait=_duration(args.wait, "--wait"),
            label=label,
            session=_kernel_session(),
            notebook=os.environ.get("JPY_SESSION_NAME", ""),
            cell=self._cell_number(),
            outputs=outputs,
            resume=bool(getattr(args, "resume", False)),
            elastic=elastic,
            min_efficiency=min_eff if min_eff is not None else DEFAULT_MIN_EFFICIENCY,
            warm=warm and session().defaults.warm and not getattr(args, "cold", False),
            fresh=bool(getattr(args, "fresh", False)),
            gpu_mem=gpu_mem,
        )

    @magic_arguments()
    @_lease_arguments(
        "the call",
        "GPUs to lease: 2; or 1-4 for as many as are free now, at least 1; 0 for a CPU worker; "
        "0.25 for a quarter of one GPU's memory (a slice, as --gpu-mem) (default: %%gpu_config's, 1)",
        "Comma-separated names to bring back (default: all the cell assigns)",
    )
    @argument(
        "--nodes",
        type=int,
        default=None,
        help="Spread --gpus over this many nodes, all or nothing (a multi-node gang for torch.distributed): "
        "one process per GPU with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set; output is "
        "prefixed [rank N]; names come back from rank 0",
    )
    @argument(
        "--elastic",
        action="store_true",
        help="With --gpus MIN-MAX: one rank per GPU, grown while growth pays (--min-efficiency) and "
        "shrunk when others wait; the loop calls magics.elastic.step(samples=n) and checkpoints with "
        "magics.on_preempt",
    )
    @argument(
        "--min-efficiency",
        type=float,
        default=None,
        help="--elastic grows again only while the last GPU added gave at least this fraction of a "
        "GPU's throughput (default: 0.5)",
    )
    @argument(
        "--gpu-mem",
        default=None,
        help="Lease a slice of one GPU instead: this much of its memory, on a GPU other slices share "
        "(10GB, 10240MB; 0.25 for a quarter of it, as --gpus 0.25), in a pool that shares its GPUs; "
        "auto: a whole GPU for the first cell, then the last cell's peak + 20 %%",
    )
    @argument(
        "--resume",
        action="store_true",
        help="Continue from gpu_checkpoint (what magics.on_preempt's hook saved): the cell reads it as resume_state",
    )
    @argument(
        "--fresh",
        action="store_true",
        help="Start on a new worker with every name sent again, not on the last cell's warm worker "
        "(e.g. after changing an object in place in a CPU cell)",
    )
    @argument(
        "--cold",
        action="store_true",
        help="Do not keep this cell's worker warm: its GPUs are released the moment it ends",
    )
    @argument("code", nargs="*", help="Line form: an expression such as fn(x, y) to evaluate on the GPUs")
    @line_cell_magic
    def gpu_train(self, line: str, cell: str | None = None) -> Any:
        """Run this cell (or, as a line magic, one expression) on leased GPUs through Ray.

        Names the cell reads travel to the worker; names it assigns come back (or --out NAMES).
        A one-node cell's worker stays warm for the next cell (its namespace and GPU state kept,
        its GPUs lent out the moment anyone waits; --cold releases them at once). Timeout, Stop
        or a lost lease end the worker and release the GPUs.
        """
        args = _parse(self.gpu_train, line)
        if cell is not None and args.code:
            raise UsageError(f"unexpected arguments {' '.join(args.code)!r} on the %%gpu_train line")
        source = cell if cell is not None else " ".join(args.code)
        label = source.strip().splitlines()[0][:120] if source.strip() else "cell"
        opts = self._options(args, label)
        if cell is None:
            opts.outputs = []  # the line form brings back its value only
        assert self.shell is not None
        ui = CellDisplay()
        try:
            return run_cell(source, self.shell.user_ns, opts, ui).result
        except EXPECTED_ENDS as exc:
            exc.told = ui.state in TOLD  # type: ignore[attr-defined]
            raise
        except SyntaxError as exc:
            raise UsageError(f"the cell does not parse: {exc}") from None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except _PARSE_ERRORS as exc:
            said = waited_out(exc)
            # a wait that ran out: the cell's line says it and what to change; the error, what it was
            raise UsageError(said.splitlines()[0] if ui.state == "refused" else said) from None

    @magic_arguments()
    @argument(
        "--over",
        required=True,
        help='The trials\' parameters: "lr=[1e-3, 3e-3]; batch=[32, 64]" (every combination), Python '
        "values with the notebook's names; with --samples also uniform(a, b), loguniform(a, b), randint(a, b)",
    )
    @argument("--samples", type=int, default=None, help="Draw this many random configurations instead of the grid")
    @argument("--seed", type=int, default=None, help="Seed of --samples' draws")
    @_lease_arguments(
        "a trial",
        "GPUs per trial (default: %%gpu_config's, 1)",
        "Comma-separated names each trial brings back (results[i].names)",
    )
    @argument(
        "--max-parallel", type=int, default=None, help="Trials queued or running at once (default: all, up to 32)"
    )
    @argument("--stop", default=None, choices=["median"], help="Early stopping: the median stopping rule")
    @argument("--metric", default=None, help="The metric --stop compares (a name given to magics.report)")
    @argument("--mode", default="min", choices=["min", "max"], help="Whether --metric is better low or high")
    @argument("--as", dest="name", default="results", help="Name of the results in the notebook (default: results)")
    @cell_magic
    def gpu_sweep(self, line: str, cell: str) -> None:
        """Run this cell once per configuration of --over, each trial on its own leased GPUs.

        The cell reads the trial's parameters as names; its last expression is the trial's value.
        Each trial waits in the pool's queue like any cell and frees its GPUs the moment it ends.
        One table shows every trial; the records land in `results` (--as): results[i].value,
        .metrics (what magics.report sent), .output, .error; results.to_pandas().
        """
        args = _parse(self.gpu_sweep, line)
        assert self.shell is not None
        user_ns = self.shell.user_ns
        if not args.name.isidentifier():
            raise UsageError(f"--as takes a name, not {args.name!r}")
        try:
            axes = space.parse_over(_unquote(args.over), user_ns)
            configs = space.draw(args.samples, axes, args.seed) if args.samples is not None else space.grid(**axes)
            plan = cellcode.plan_cell(cell)
        except SyntaxError as exc:
            raise UsageError(f"the cell does not parse: {exc}") from None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        unread = [name for name in axes if name not in plan.reads]
        if unread:
            raise UsageError(f"--over names {', '.join(unread)}, which the cell never reads")
        label = cell.strip().splitlines()[0][:60] if cell.strip() else "sweep"
        opts = self._options(args, label, warm=False)
        if opts.gpu_mem is not None:
            raise UsageError(f"a sweep's trials lease whole GPUs: give --gpus a count, not {args.gpus}")
        opts.outputs = opts.outputs or []  # a trial brings back its value, and only the names asked for
        try:
            calls = [(c, plan_call(cell, {**user_ns, **c}, opts)) for c in configs]
            user_ns[args.name] = run_sweep(
                calls, opts, args.max_parallel, args.stop, args.metric, args.mode, display=None
            )
        except SweepStopped as exc:
            user_ns[args.name] = exc.results
            raise
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except _PARSE_ERRORS as exc:
            raise UsageError(waited_out(exc)) from None

    @magic_arguments()
    @argument("action", nargs="?", default="show", choices=["show", "release", "keep"])
    @argument("lease_id", nargs="?", default=None, help="With release/keep: one lease id (default: all of mine)")
    @line_magic
    def gpu_lease(self, line: str) -> None:
        """My leases, my place in the queue, free GPUs per pool; `%gpu_lease release [ID]`;
        `%gpu_lease keep [ID]` answers an idle warning with "I'm still using it"."""
        args = _parse(self.gpu_lease, line)
        try:
            c = session().client()
            me = c.whoami()["user"]
            if args.action == "keep":
                mine = [lease for lease in c.leases() if lease.get("reclaim_at")]
                ids = [args.lease_id] if args.lease_id else [lease["id"] for lease in mine]
                for lid in ids:
                    out = c.keep(lid)
                    print(f"{lid}: kept ({out.get('extensions', 0)} extension(s) used)")
                if not ids:
                    print("no lease of yours has an idle warning")
                return
            if args.action == "release":
                warm = current_warm(session())
                ended_warm = warm is not None and args.lease_id in (None, warm.lease.id)
                if warm is not None and ended_warm:
                    end_warm(session(), "released with %gpu_lease release")
                    print(f"{warm.lease.id}: released; its warm worker ended")
                    if args.lease_id:
                        return
                ids = [args.lease_id] if args.lease_id else [lease["id"] for lease in c.leases()]
                for lid in ids:
                    out = c.release(lid)
                    print(f"{lid}: {out['state']}")
                if not ids and not ended_warm:
                    print("you hold no lease")
                return
            view = c.cluster()
            mine = c.leases()
            waiting = [w for w in c.queue() if w["user"] == me]
            try:
                balance = {b["pool"]: b["text"] for b in c.balance()["pools"]}
            except errors.GpuLeaseError:  # a server from before GET /usage/balance: the rest still shows
                balance = {}
        except errors.GpuLeaseError as exc:
            raise UsageError(exc.message) from None
        now = view["now"]
        here = _kernel_session()
        warm = current_warm(session())
        # this notebook's own first (what its next cell finds), then the user's other notebooks'
        ours = [lease for lease in mine if lease.get("session") == here]
        others = [lease for lease in mine if lease.get("session") != here]
        suspended = [
            (node["name"], w) for node in view["nodes"] for w in node.get("suspended") or [] if w.get("user") == me
        ]
        mine_sus = [(n, w) for n, w in suspended if warm is not None and w.get("lease") == warm.lease.id]
        other_sus = [(n, w) for n, w in suspended if (n, w) not in mine_sus]
        print(f"user {me}; this notebook:")
        for lease in ours:
            _print_lease(lease, now, "this notebook's next cell")
        for node, w in mine_sus:
            _print_suspended(node, w, now, "this notebook's next cell restores it")
        if not ours and not mine_sus:
            print("  holds nothing: its next GPU cell starts a worker")
        if others or other_sus:
            print("your other notebooks:")
        for lease in others:
            _print_lease(lease, now, "that notebook's next cell")
        for node, w in other_sus:
            _print_suspended(node, w, now, "that notebook's next cell restores it")
        for w in waiting:
            print(
                f"  waiting: {w['gpus']} GPU(s) of {w['pool']}, position {w['position']}, "
                f"{now - w['enqueued_at']:.0f}s so far"
            )
        for name, p in sorted(view["pools"].items()):
            default = " (default)" if name == view.get("default_pool") else ""
            print(f"  pool {name}{default}: {p['free']} free of {p['gpus']}")
            if name in balance:  # quota used and left, place in fair share, next cell's wait
                print(f"    {balance[name]}")

    @magic_arguments()
    @argument("--gpus", type=int, default=None)
    @argument("--pool", default=None)
    @argument("--timeout", default=None, help="e.g. 2h; 'none' for no timeout")
    @argument("--wait", default=None, help="e.g. 10m")
    @argument("--ttl", default=None, help="Lease TTL, e.g. 30s (renewed in the background)")
    @argument("--url", default=None, help="Lease server URL (default: GPULEASE_URL or gpulease up's)")
    @argument("--token", default=None, help="API token (default: GPULEASE_TOKEN or gpulease up's)")
    @argument(
        "--warm",
        default=None,
        choices=["on", "off"],
        help="Keep a finished cell's worker warm for the next cell (default: on)",
    )
    @argument(
        "--spares",
        type=int,
        default=None,
        help="Started workers kept ready per node, so a cold cell starts no process (0-8; default 2)",
    )
    @line_magic
    def gpu_config(self, line: str) -> None:
        """Show or set this session's defaults for %%gpu_train."""
        args = _parse(self.gpu_config, line)
        d = session().defaults
        if args.gpus is not None:
            if args.gpus < 0:
                raise UsageError("--gpus must be 0 (a CPU worker) or more")
            d.gpus = args.gpus
        if args.pool is not None:
            d.pool = args.pool or None
        if args.timeout is not None:
            d.timeout = None if args.timeout.lower() == "none" else _duration(args.timeout, "--timeout")
        if args.wait is not None:
            d.wait = _duration(args.wait, "--wait") or d.wait
        if args.ttl is not None:
            d.ttl = _duration(args.ttl, "--ttl")
        if args.warm is not None:
            d.warm = args.warm == "on"
            if not d.warm:
                end_warm(session(), "%gpu_config --warm off")
        if args.spares is not None:
            if not 0 <= args.spares <= SPARES_MAX:
                raise UsageError(f"--spares must be from 0 to {SPARES_MAX} (each is a started worker process)")
            d.spares = args.spares
            s = session()
            for node in s.spare_nodes():
                s.set_spares(node, d.spares)
        if args.url is not None or args.token is not None:
            d.url = args.url or d.url
            d.token = args.token or d.token
            session().reset_client()
        timeout = "none" if d.timeout is None else f"{d.timeout:g}s"
        # (two lines, each within 80 columns)
        print(
            f"gpus={d.gpus} pool={d.pool or '(server default)'} timeout={timeout} wait={d.wait:g}s "
            f"ttl={'(server default)' if d.ttl is None else f'{d.ttl:g}s'}"
        )
        print(
            f"warm={'on' if d.warm else 'off'} spares={d.spares} "
            f"url={d.url or os.environ.get('GPULEASE_URL') or '(gpulease up)'}"
        )


# A typo such as --gpu is an error, not a silent --gpus (argparse's prefix matching).
for _magic in (GpuMagics.gpu_train, GpuMagics.gpu_sweep, GpuMagics.gpu_config, GpuMagics.gpu_lease):
    _magic.parser.allow_abbrev = False  # type: ignore[attr-defined]


def _unquote(text: str) -> str:
    """IPython's argument splitting keeps the quotes around a quoted argument."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _print_lease(lease: LeaseJson, now: float, whose: str) -> None:
    """A lease in %gpu_lease: where, for how long, and, kept warm, whose next cell it is for."""
    gpus = ",".join(str(g["index"]) for g in lease["gpus"])
    if lease.get("reclaim_at"):
        print(f"  ! lease {lease['id']} looks idle: reclaimed in {lease['reclaim_at'] - now:.0f}s")
        print("    unless used (%gpu_lease keep)")
    # (two short lines rather than one past 80 columns)
    where = f"  lease {lease['id']}: {lease['node']} GPU {gpus} ({lease['pool']})"
    notebook = os.path.basename(str(lease.get("notebook") or ""))
    if lease.get("warm_since"):
        print(f"{where}, kept warm {now - lease['warm_since']:.0f}s")
        print(f"    for {whose} (lent out if someone waits)")
    else:
        print(f"{where}, held {now - lease['created_at']:.0f}s")
    named = notebook or " ".join(str(lease.get("label") or "").split())
    if notebook or (named and not lease.get("warm_since")):  # its notebook, else a held lease's label
        what = "notebook" if notebook else "label"
        print(f"    {what} {named if len(named) <= 66 else named[:65] + '…'}")


def _print_suspended(node: str, w: dict[str, Any], now: float, what: str) -> None:
    """A worker evicted to host memory, in %gpu_lease."""
    size = show_mb(w["bytes"] / 2**20)
    print(f"  suspended · on host ({size}, {now - w['since']:.0f}s): worker from {node}")
    print(f"    {what}")


def _kernel_session() -> str:
    try:
        from ipykernel.kernelapp import IPKernelApp

        app = IPKernelApp.instance() if IPKernelApp.initialized() else None
        conn = getattr(app, "connection_file", "") if app else ""
        return os.path.basename(conn).removesuffix(".json") or f"pid-{os.getpid()}"
    except Exception:  # noqa: BLE001
        return f"pid-{os.getpid()}"
