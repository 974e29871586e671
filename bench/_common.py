"""Helpers shared by the benches of this folder (lease_bench.py, reclaim_bench.py, gpu_train_bench.py).

Every bench has ``--smoke``, the quick mode that tests/test_benches.py runs (every part once, at a
tiny size, in seconds: figures that mean nothing, but every one of them printed).

Percentiles and target verdicts, the printed lines and the JSON last line, per-section failure
records, CPU figures from /proc, stopping a child process's whole session, and the Redis-side set-up
(tokens, settings, simulated nodes) that the benches do straight against their own redis-server.

A bench is run as ``python bench/NAME.py``: it puts this folder first on ``sys.path`` and imports
``_common``; importing it puts the repository root on ``sys.path`` (for ``lease_server``, ``magics``
and ``tests``, imported where they are used, so that a process that needs none of them stays light).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import operator
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lease_server.config import Settings
    from lease_server.leasing.inventory import NodeInventory
    from lease_server.leasing.lease import LeaseStore
    from lease_server.node.redis_proc import RedisProcess

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LONG = 3600  # seconds: node heartbeats and lease ttls that must outlive the run

# ---- figures -----------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a list (NaN if empty)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))
    return xs[k]


_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
}


def verdict(targets: Mapping[str, tuple[str, float]], name: str, value: float) -> str:
    """``(target <= 20) PASS`` or ``... MISS``: figure ``name`` against its ``(op, target)`` in
    ``targets`` (op one of <=, <, >=, >). NaN, a figure that could not be measured, is a MISS.
    A bench binds its own targets: ``verdict = functools.partial(_common.verdict, TARGETS)``."""
    op, target = targets[name]
    ok = value == value and _OPS[op](value, target)
    return f"(target {op} {target:g}) {'PASS' if ok else 'MISS'}"


def load_text(load: Sequence[float]) -> str:
    """Load averages as the benches print them: ``1.52 1.20 0.98``."""
    return " ".join(f"{x:.2f}" for x in load)


# ---- the CI's quick mode -------------------------------------------------------------------------------

SMOKE_HELP = (
    "the quick mode tests/test_benches.py runs: every part once, at a tiny size, in seconds; it checks "
    "that the bench runs and prints every figure, and its figures mean nothing"
)


def add_smoke(ap: argparse.ArgumentParser) -> None:
    """``--smoke``, the quick mode every bench has (tests/test_benches.py runs each in it)."""
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def parse_args(ap: argparse.ArgumentParser, **smoke: Any) -> argparse.Namespace:
    """``ap``'s arguments with ``--smoke`` added; with ``--smoke``, each option of ``smoke`` (its
    dest: a tiny value) that the command line left at its default takes the tiny value."""
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        for dest, value in smoke.items():
            if getattr(args, dest) == ap.get_default(dest):
                setattr(args, dest, value)
    return args


def ray_spares(n: int | None = None) -> int:
    """Started workers per node (GPULEASE_SPARES) for the sessions and kernels of a bench that
    measures warm calls: ``n``, else 2 (the kernel's default), whatever the environment says. Call
    it before importing tests.conftest, which sets 0 for the test stacks where nothing is set."""
    value = 2 if n is None else n
    os.environ["GPULEASE_SPARES"] = str(value)
    return value


# ---- output ------------------------------------------------------------------------------------------


def say(line: str) -> None:
    print(line, flush=True)


def announce(out: dict[str, Any], title: str, quick: bool, redis: RedisProcess, load_figures: int = 3) -> None:
    """The first line of a bench that runs its own redis-server; the 1-minute load average also goes
    to ``out["loadavg_start"]``."""
    assert redis.proc is not None
    load = os.getloadavg()
    say(
        f"{title} ({'quick' if quick else 'full'}): redis-server pid {redis.proc.pid} on {redis.url}, "
        f"{os.cpu_count()} cores, load average {load_text(load[:load_figures])} at start"
    )
    out["loadavg_start"] = round(load[0], 2)


@contextlib.contextmanager
def section(out: dict[str, Any], name: str, timed: bool = False) -> Iterator[None]:
    """Run one part of the bench; a failure is printed and recorded in ``out["failed"]``, and the other
    parts still run. ``timed``: its wall time (s) goes to ``out["section_s"][name]``, failed or not."""
    t0 = time.monotonic()
    try:
        yield
    except Exception as exc:
        say(f"[{name}] FAILED: {type(exc).__name__}: {exc}")
        out.setdefault("failed", []).append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
    if timed:
        out.setdefault("section_s", {})[name] = round(time.monotonic() - t0, 1)


def json_safe(value: Any, digits: int | None = None) -> Any:
    """NaN / inf become null, so that the last line is strict JSON; with ``digits``, every other float
    is rounded to that many significant digits."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}") if digits else value
    if isinstance(value, dict):
        return {k: json_safe(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v, digits) for v in value]
    return value


def json_line(
    out: Mapping[str, Any], first: Iterable[str] = (), digits: int | None = None, compact: bool = True
) -> str:
    """The last line of a bench: one JSON object with every figure, the keys of ``first`` (its targets)
    leading, null where the part that measures them failed."""
    ordered = {k: out.get(k) for k in first}
    ordered.update({k: v for k, v in out.items() if k not in ordered})
    return json.dumps(json_safe(ordered, digits), separators=(",", ":") if compact else None)


# ---- CPU from /proc ------------------------------------------------------------------------------------


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of one process from /proc (0 if it is gone)."""
    fields = proc_stat(pid)
    if fields is None:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU-seconds all cores of the machine spent busy since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def group_pids(pgid: int) -> list[int]:
    """Every live process of a process group (a child started in its own session, and its forks)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = proc_stat(int(entry))
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":  # a zombie only waits to be reaped
            out.append(int(entry))
    return out


# ---- child processes -----------------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """This environment without any GPULEASE_* setting of the caller, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEASE_")}
    env.update(extra)
    return env


def stop_session(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Stop a child started with ``start_new_session=True`` and every process of its group (forked
    workers too: a parent need not pass SIGTERM on): SIGTERM to the group, up to ``timeout`` s for
    the child and as long again for the rest of the group, then SIGKILL to whatever is left."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    deadline = time.monotonic() + timeout
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_pids(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def private_redis(tmp_prefix: str) -> Iterator[tuple[RedisProcess, Path]]:
    """A temporary directory and a redis-server of our own with its data in it (stopped, and the
    directory removed, on the way out); yields both."""
    from lease_server.node.redis_proc import RedisProcess

    tmp = tempfile.TemporaryDirectory(prefix=tmp_prefix)
    tmpdir = Path(tmp.name)
    redis = RedisProcess(tmpdir / "redis")
    try:
        redis.start()
        yield redis, tmpdir
    finally:
        redis.stop()
        tmp.cleanup()


# ---- straight into Redis ---------------------------------------------------------------------------------


def settings_for(redis_url: str, prefix: str, **kw: Any) -> Settings:
    from lease_server.config import Settings

    return Settings(redis_url=redis_url, prefix=prefix, **kw).validate()


async def make_tokens(redis_url: str, prefix: str, users: Mapping[str, str]) -> dict[str, str]:
    """{user: role} -> {user: API token}."""
    from lease_server.store.engine import connect
    from lease_server.store.keys import Keys
    from lease_server.web.auth import create_token

    r = connect(redis_url)  # redis:// or redis+sentinel://
    try:
        return {u: await create_token(r, Keys(prefix), u, role) for u, role in users.items()}
    finally:
        await r.aclose()


async def register_all(store: LeaseStore, spec: str, alive_s: float = LONG) -> list[NodeInventory]:
    """Declare the simulated nodes of ``spec`` (``NAME=8xA100-80GB,...``) straight into Redis, alive
    for ``alive_s`` (no agent needed); returns their inventories."""
    from lease_server.leasing.inventory import parse_simulate, register
    from lease_server.store.layout import check

    await check(store.engine.redis, store.engine.keys)  # what a server's first start writes: it starts on this data
    nodes = parse_simulate(spec)
    for inv in nodes:
        await register(store.engine, inv, alive_s=alive_s)
    return nodes


SCRIPT_COMMANDS = ("cmdstat_fcall", "cmdstat_evalsha")  # the scripts as functions, or with EVALSHA (Redis 6)


def script_stats(stats: dict[str, Any]) -> dict[str, float]:
    """Redis's time in the lease scripts, from ``INFO commandstats``: {calls, usec, usec_per_call},
    FCALL and EVALSHA together (the server uses whichever the Redis has)."""
    calls = sum(float(stats.get(k, {}).get("calls", 0)) for k in SCRIPT_COMMANDS)
    usec = sum(float(stats.get(k, {}).get("usec", 0)) for k in SCRIPT_COMMANDS)
    return {"calls": calls, "usec": usec, "usec_per_call": usec / calls if calls else float("nan")}
