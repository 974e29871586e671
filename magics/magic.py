"""The IPython magics. Thin: they parse arguments and call :class:`magics.runner.Session`."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from lease_server import errors

from . import cellcode
from .runner import GpuTrainError, Outcome, check_gang, parse_duration, parse_gpus, session


def show_gpu_train_error(shell: Any, etype: type, value: GpuTrainError, tb: Any, tb_offset: Any = None) -> list[str]:
    """Custom exception display: the remote traceback once, tagged with the node, then a summary.

    IPython ignores a custom handler's return value, so the handler shows the traceback itself
    (in a kernel this sends the cell's error output, with ename GpuTrainError)."""
    stb = [value.render()]
    shell._showtraceback(etype, value, stb)
    return stb


def _duration(text: str | None, flag: str) -> float | None:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


class _Status:
    """One line in the cell output that is updated in place (queue position, elapsed time)."""

    def __init__(self) -> None:
        self._handle: Any = None

    def show(self, text: str) -> None:
        try:
            from IPython.display import display

            if self._handle is None:
                self._handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._handle.update({"text/plain": text}, raw=True)
        except Exception:  # noqa: BLE001 - no display (plain IPython): fall back to stderr
            sys.stderr.write(f"\r{text}")


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

    def _run(self, call: dict[str, Any], args: Any, label: str) -> Outcome:
        status = _Status()
        try:
            gpus_min, gpus = parse_gpus(args.gpus) if args.gpus is not None else (None, None)
            check_gang(gpus_min, gpus, args.nodes)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        gang = args.nodes is not None and args.nodes > 1
        want = args.gpus or session().defaults.gpus
        estimate: dict[str, str] = {}

        def on_queue(position: int | None, elapsed: float) -> None:
            if position and "text" not in estimate:
                # Once, before the wait: how long it may take, and where the GPUs are free now.
                try:
                    est = session().client().estimate(gpus or session().defaults.gpus, args.pool)
                    alts = "; ".join(f"{a['text']} (--pool {a['pool']})" for a in est["alternatives"][:2])
                    estimate["text"] = f" — {est['text']}" + (f"; {alts}" if alts else "")
                except Exception:  # noqa: BLE001 - the estimate is a courtesy
                    estimate["text"] = ""
            where = f"position {position} in the queue" if position else "being granted"
            status.show(f"gpu_train: waiting for {want} GPU(s): {where}, {elapsed:.0f}s{estimate.get('text', '')}")

        def on_granted(held: Any) -> None:
            lease = held.lease
            elastic = gpus_min is not None and gpus_min != gpus
            got = f" ({len(lease.gpus)} of {gpus_min}-{gpus} asked)" if elastic else ""
            note = ""
            if lease.borrowed:
                note = "; borrowed from a booking: recalled with notice if its holder asks"
            elif lease.raw.get("preemptible"):
                note = "; above your quota: preemptible, recalled with notice for someone within theirs"
            if gang:
                where = " + ".join(f"{n} (GPU {','.join(map(str, i))})" for n, i in lease.parts().items())
                status.show(f"gpu_train: granted {len(lease.gpus)} GPUs on {args.nodes} nodes: {where}")
            elif status._handle is not None or got or note:
                status.show(f"gpu_train: granted {held.node} GPU {held.cuda_visible_devices}{got}{note}")

        def on_released(o: Outcome) -> None:
            if o.extra.get("cpu"):
                slot = f" (a CPU slot of {o.node})" if o.lease_id else ""
                print(f"gpu_train: ran on a CPU worker{slot} for {o.held_s:.1f}s", file=sys.stderr)
                return
            mem = f"; peak GPU memory {o.peak_memory / 2**30:.2f} GiB" if o.peak_memory else ""
            gpu_list = ",".join(map(str, o.gpus))
            where = o.extra.get("where") or f"{o.node} (GPU {gpu_list})"
            print(
                f"gpu_train: held {len(o.gpus)} GPU(s) on {where} for {o.held_s:.1f}s, now released{mem}",
                file=sys.stderr,
            )

        def on_output(stream: str, text: str) -> None:
            target = sys.stderr if stream == "stderr" else sys.stdout
            target.write(text)
            target.flush()

        try:
            outcome = session().run(
                call,
                gpus=gpus,
                gpus_min=gpus_min,
                priority=args.priority,
                pool=args.pool,
                timeout=_duration(args.timeout, "--timeout"),
                wait=_duration(args.wait, "--wait"),
                label=label,
                session=_kernel_session(),
                notebook=os.environ.get("JPY_SESSION_NAME", ""),
                cell=hashlib.sha1(call.get("source", "").encode()).hexdigest()[:12] if call.get("source") else "",
                on_queue=on_queue,
                on_output=on_output,
                on_granted=on_granted,
                on_released=on_released,
                nodes=args.nodes,
            )
        except errors.ServerUnavailable as exc:
            raise UsageError(str(exc)) from None
        except (
            errors.BadRequest,
            errors.UnknownPool,
            errors.Unsatisfiable,
            errors.Unauthorized,
            errors.ConfigurationError,
        ) as exc:
            raise UsageError(exc.message) from None
        except errors.NoCapacity as exc:
            raise UsageError(exc.message) from None
        return outcome

    @magic_arguments()
    @argument(
        "--gpus",
        default=None,
        help="GPUs to lease: 2; or 1-4 for as many as are free now, at least 1; 0 for a CPU worker "
        "(default: %%gpu_config's, 1)",
    )
    @argument(
        "--nodes",
        type=int,
        default=None,
        help="Spread --gpus over this many nodes, all or nothing (a multi-node gang for torch.distributed): "
        "one process per GPU with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set; output is "
        "prefixed [rank N]; names come back from rank 0",
    )
    @argument("--pool", default=None, help="Pool to lease from (default: the server's default GPU pool)")
    @argument("--priority", default=None, choices=["low", "normal", "high"], help="Priority class (default: normal)")
    @argument(
        "--resume",
        action="store_true",
        help="Continue from gpu_checkpoint (what magics.on_preempt's hook saved): the cell reads it as resume_state",
    )
    @argument("--timeout", default=None, help="Stop the call after this long, e.g. 30m (default: none)")
    @argument("--wait", default=None, help="Wait this long in the queue for GPUs, e.g. 10m (default: 1h)")
    @argument("--out", default=None, help="Comma-separated names to bring back (default: all the cell assigns)")
    @argument("code", nargs="*", help="Line form: an expression such as fn(x, y) to evaluate on the GPUs")
    @line_cell_magic
    def gpu_train(self, line: str, cell: str | None = None) -> Any:
        """Run this cell (or, as a line magic, one expression) on leased GPUs through Ray.

        Names the cell reads travel to the worker; names it assigns come back (or --out NAMES).
        The GPUs are released the moment the cell ends: return, error, timeout or interrupt.
        """
        args = parse_argstring(self.gpu_train, line)
        source = cell if cell is not None else " ".join(args.code)
        if cell is not None and args.code:
            raise UsageError(f"unexpected arguments {' '.join(args.code)!r} on the %%gpu_train line")
        if not source.strip():
            raise UsageError("nothing to run: %gpu_train fn(args) or a %%gpu_train cell")
        try:
            plan = cellcode.plan_cell(source)
        except SyntaxError as exc:
            raise UsageError(f"the cell does not parse: {exc}") from None
        assert self.shell is not None
        ns = self.shell.user_ns
        explicit = args.out is not None
        outputs = (
            [n.strip() for n in args.out.split(",") if n.strip()] if explicit else cellcode.pick_outputs(plan.assigns)
        )
        if cell is None:
            outputs = []
        if args.resume and "gpu_checkpoint" not in ns:
            raise UsageError(
                "--resume: there is no gpu_checkpoint to resume from; it is set when a call's GPUs are "
                "recalled and its magics.on_preempt hook returns a state"
            )
        extra_ns = {"resume_state": ns["gpu_checkpoint"] if args.resume else ns.get("resume_state")}
        inputs = cellcode.pick_inputs(plan.reads, {**ns, **extra_ns})
        _check_picklable(inputs)
        call = {
            "kind": "cell",
            "source": source,
            "body": plan.body,
            "last_expr": plan.last_expr,
            "inputs": inputs,
            "outputs": outputs,
            "explicit_outputs": explicit,
        }
        label = (cell.strip().splitlines()[0] if cell else source)[:120] if source.strip() else "cell"
        try:
            outcome = self._run(call, args, label)
        finally:
            s = session()
            if s.has_checkpoint:
                ns["gpu_checkpoint"] = s.last_checkpoint
                print(
                    "gpu_train: the checkpoint hook's state is in gpu_checkpoint; continue with "
                    "%%gpu_train --resume (the cell reads it as resume_state)",
                    file=sys.stderr,
                )
        value = outcome.value
        ns.update({k: v for k, v in value["names"].items() if not cellcode.is_module(v)})
        return value["result"]

    @magic_arguments()
    @argument("action", nargs="?", default="show", choices=["show", "release", "keep"])
    @argument("lease_id", nargs="?", default=None, help="With release/keep: one lease id (default: all of mine)")
    @line_magic
    def gpu_lease(self, line: str) -> None:
        """My leases, my place in the queue, free GPUs per pool; `%gpu_lease release [ID]`;
        `%gpu_lease keep [ID]` answers an idle warning with "I'm still using it"."""
        args = parse_argstring(self.gpu_lease, line)
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
                ids = [args.lease_id] if args.lease_id else [lease["id"] for lease in c.leases()]
                for lid in ids:
                    out = c.release(lid)
                    print(f"{lid}: {out['state']}")
                if not ids:
                    print("you hold no lease")
                return
            view = c.cluster()
            mine = c.leases()
            waiting = [w for w in c.queue() if w["user"] == me]
        except errors.GpuLeaseError as exc:
            raise UsageError(exc.message) from None
        now = view["now"]
        print(f"user {me}")
        if mine:
            for lease in mine:
                gpus = ",".join(str(g["index"]) for g in lease["gpus"])
                if lease.get("reclaim_at"):
                    print(
                        f"  ! lease {lease['id']} looks idle: reclaimed in {lease['reclaim_at'] - now:.0f}s "
                        "unless used (%gpu_lease keep)"
                    )
                print(
                    f"  lease {lease['id']}: {lease['node']} GPU {gpus} ({lease['pool']}), held "
                    f"{now - lease['created_at']:.0f}s, label {lease['label']!r}"
                )
        else:
            print("  no lease held")
        for w in waiting:
            print(
                f"  waiting: {w['gpus']} GPU(s) of {w['pool']}, position {w['position']}, "
                f"{now - w['enqueued_at']:.0f}s so far"
            )
        for name, p in sorted(view["pools"].items()):
            default = " (default)" if name == view.get("default_pool") else ""
            print(f"  pool {name}{default}: {p['free']} free of {p['gpus']}")

    @magic_arguments()
    @argument("--gpus", type=int, default=None)
    @argument("--pool", default=None)
    @argument("--timeout", default=None, help="e.g. 2h; 'none' for no timeout")
    @argument("--wait", default=None, help="e.g. 10m")
    @argument("--ttl", default=None, help="Lease TTL, e.g. 30s (renewed in the background)")
    @argument("--url", default=None, help="Lease server URL (default: GPULEASE_URL or gpulease up's)")
    @argument("--token", default=None, help="API token (default: GPULEASE_TOKEN or gpulease up's)")
    @line_magic
    def gpu_config(self, line: str) -> None:
        """Show or set this session's defaults for %%gpu_train."""
        args = parse_argstring(self.gpu_config, line)
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
        if args.url is not None or args.token is not None:
            d.url = args.url or d.url
            d.token = args.token or d.token
            session().reset_client()
        timeout = "none" if d.timeout is None else f"{d.timeout:g}s"
        print(
            f"gpus={d.gpus} pool={d.pool or '(server default)'} timeout={timeout} wait={d.wait:g}s "
            f"ttl={'(server default)' if d.ttl is None else f'{d.ttl:g}s'} "
            f"url={d.url or os.environ.get('GPULEASE_URL') or '(gpulease up)'}"
        )


def _check_picklable(inputs: dict[str, Any]) -> None:
    """Name the variable that cannot travel to the worker, instead of a deep pickling error."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(inputs)
        return
    except Exception:  # noqa: BLE001 - find the culprit below
        pass
    for name, value in inputs.items():
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001
            raise UsageError(
                f"the cell reads {name!r}, which cannot be sent to the GPU worker ({type(exc).__name__}: {exc}); "
                "create it inside the cell instead"
            ) from None


def _kernel_session() -> str:
    try:
        from ipykernel.kernelapp import IPKernelApp

        app = IPKernelApp.instance() if IPKernelApp.initialized() else None
        conn = getattr(app, "connection_file", "") if app else ""
        return os.path.basename(conn).removesuffix(".json") or f"pid-{os.getpid()}"
    except Exception:  # noqa: BLE001
        return f"pid-{os.getpid()}"
