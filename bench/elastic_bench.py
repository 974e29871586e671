#!/usr/bin/env python
"""Elastic use of GPUs from notebooks, against its targets, on a simulated `gpulease up`.

    .venv/bin/python bench/elastic_bench.py [--quick | --smoke] [--only SECTION ...]

Starts its own ``gpulease up`` (Redis, lease server, node agent and a Ray head; the GPUs simulated:
``box=8xA100-80GB``) on loopback, joins its Ray cluster as a driver, runs each section, stops every
process it started, and prints one line per figure followed, as the very last line of stdout, by
one JSON object with every figure. Each section is one function in SECTIONS below, with its own
figures and targets; a section that fails is recorded in "failed" and the others still run. The
magics session keeps GPULEASE_SPARES=2 started workers (the kernel's default).

``--smoke`` (what tests/test_benches.py runs): a node of 2 GPUs, 4 trials whose trace durations
are scaled down 50x (at most 0.5 s), an elastic job of 100 samples.

Section "sweep" (issue 13: gpu_map / %%gpu_sweep):
  64 one-GPU trials (--quick: 32) run with magics.gpu_map on the 8 GPUs, each sleeping for a
  duration drawn (seeded) from the cell durations of the NotebookOS trace (the 1-GPU rows of
  sensei_june_60sec.csv in GPULEASE_TRACE_DIR, see lease_server/sim/traces.py; a minute there is a
  second here, longer cells capped at CAP_S). Measured warm: a warm-up sweep first, and the spare
  workers started and answering.

  sweep_makespan_ratio   wall time of the gpu_map call / the makespan of the ideal list schedule
                         of the same durations, in trial order, on 8 GPUs with no overhead,
                         computed in the same run                                (target <= 1.05)
                         Skipped (null, listed in "skipped") when the trace is absent; the sweep
                         then runs on seeded synthetic durations for the figures below.
  trial_dispatch_p50_ms  for each trial granted from the queue: the `released` event (server
                         clock) of the lease whose GPU it got, which the same script granted to
                         it -> its function starting on its worker (time.time())   (target <= 50)
  trial_dispatch_p99_ms, sweep_makespan_s, sweep_ideal_makespan_s, sweep_trials, sweep_max_live
                         (most of the sweep's leases live at once, from the event log),
                         trial_overhead_p50_ms (a trial's grant -> release, less its function's
                         own duration: worker dispatch, kill, verified exit, release),
                         trial_dispatch_split_p50_ms / _p90_ms (release -> grant on the server,
                         grant -> the driver starting the call, -> the function running on its
                         worker: a spare worker's hand-over, or the wait for one still starting),
                         worker_start_cpu_s (CPU-seconds a fresh worker process takes to start:
                         each trial needs one, so a node's cores bound how fast trials can start)
                                                                                   (information)

Section "elastic" (issue 13: --elastic): an elastic job on a synthetic curve (throughput linear in
the ranks up to KNEE, flat after), from an idle pool of the node's GPUs.

  elastic_gpu_s_ratio    the GPU-seconds the lease server charged the job (its size x time, from
                         the grant to the release, every resize's restart included), against the
                         best fixed size chosen in hindsight: the curve's own work / throughput at
                         that size, with no start-up at all                      (target <= 1.15)
  elastic_time_vs_worst  the job's wall time against the slowest fixed size's  (information)
  elastic_sizes          the sizes it took, in order                             (information)

Nothing here asserts: a bench prints.
"""

from __future__ import annotations

import argparse
import csv
import functools
import heapq
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import pct, say, section

from lease_server.sim import traces  # (os and pathlib only)

NODE = "box"
GPUS = 8  # --smoke: 2
TRACE = traces.trace(traces.JUNE)  # in GPULEASE_TRACE_DIR, else shared/traces/notebookos beside the checkout
SEED = 13
CAP_S = 20.0  # a trace cell longer than this many minutes runs for CAP_S seconds
SECONDS_PER_TRACE_MINUTE = 1.0

TARGETS: dict[str, tuple[str, float]] = {
    # section "sweep"
    "sweep_makespan_ratio": ("<=", 1.05),
    "trial_dispatch_p50_ms": ("<=", 50.0),
    # section "elastic"
    "elastic_gpu_s_ratio": ("<=", 1.15),
}
KNEE = 4  # the synthetic scaling curve: throughput linear in the ranks up to KNEE, flat after
STEP_S = 0.05  # one step of one rank below the knee
verdict = functools.partial(_common.verdict, TARGETS)


# ---- functions that run on the Ray workers (pickled by value: this file is __main__) ---------------


def sleep_trial(seconds: float) -> float:
    """One trial: start (time.time(), returned), then hold the GPU for ``seconds``."""
    t0 = time.time()
    time.sleep(seconds)
    return t0


# ---- the stack ---------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """What every section gets: the stack, the magics session joined to it, the run's options."""

    up: Any
    sess: Any
    quick: bool
    work: Path
    smoke: bool = False
    gpus: int = GPUS


def start_stack(home: Path, gpus: int) -> Any:
    from tests.conftest import Up

    up = Up.__new__(Up)
    try:
        Up.__init__(up, home, simulate=f"{NODE}={gpus}xA100-80GB", GPULEASE_DEFAULT_TTL="30")
    except BaseException:
        proc = getattr(up, "proc", None)  # started, but never answered: stop it
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except Exception:  # noqa: BLE001
                proc.kill()
        raise
    return up


def stop_stack(up: Any) -> int | None:
    proc = up.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001 - it did not stop: make sure it is gone
            proc.kill()
            proc.wait(10)
    return proc.returncode  # type: ignore[no-any-return]


def connect(up: Any, gpus: int) -> Any:
    """Join the stack's Ray cluster through a magics session, with a spare worker per GPU."""
    import ray

    from magics.session import Session

    s = Session()
    s.defaults.url, s.defaults.token = up.url, (up.data / "token").read_text().strip()
    deadline = time.monotonic() + 120
    while True:
        try:
            s.connect_ray()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # the Ray head is still starting: nothing to wait on but its answer
    while f"gpulease_node_{NODE}" not in ray.cluster_resources():
        if time.monotonic() > deadline:
            raise TimeoutError("the Ray node's gpulease resource did not show up")
        time.sleep(0.2)
    if not s._pinned:  # connected before the resources showed up: look again
        s._actor_cls = None
        s.connect_ray()
    s.prewarm_to(NODE, gpus)
    spares_ready(s, gpus)
    return s


def worker_start_cpu_s(s: Any) -> float:
    """CPU-seconds a fresh worker process spent from its start until it answered (p50 over the
    node's spares, idle since): what every trial's single-use worker costs the node."""
    with s._lock:
        spares = list(s._spares.get(NODE, ()))
    return pct([_common.proc_cpu_seconds(w.where().pid) for w in spares], 50)


def spares_ready(s: Any, gpus: int, timeout: float = 180) -> None:
    """Every spare of the node started and answering (replacements start in the background)."""
    import ray

    deadline = time.monotonic() + timeout
    while len(s._spares.get(NODE, ())) < min(s.spares_for(NODE), gpus) and time.monotonic() < deadline:
        time.sleep(0.05)  # _replenish runs in threads of its own: nothing to wait on but their result
    with s._lock:
        spares = list(s._spares.get(NODE, ()))
    ray.get([w.ready_ref for w in spares], timeout=timeout)


# ---- section "sweep" -----------------------------------------------------------------------------


def trace_durations(n: int, scale: float = 1.0) -> list[float] | None:
    """``n`` durations (s) drawn with SEED from the trace's 1-GPU cells, times ``scale``; None
    without the trace."""
    if not TRACE.exists():
        return None
    with TRACE.open() as f:
        minutes = [float(r["duration"]) for r in csv.DictReader(f) if r["num_gpu"] == "1"]
    rng = random.Random(SEED)
    return [scale * min(CAP_S, rng.choice(minutes) * SECONDS_PER_TRACE_MINUTE) for _ in range(n)]


def synthetic_durations(n: int, scale: float = 1.0) -> list[float]:
    rng = random.Random(SEED)
    return [scale * round(rng.uniform(1.0, 6.0), 2) for _ in range(n)]


def list_schedule(durations: list[float], machines: int) -> float:
    """Makespan of list scheduling in the given order: each job to the machine free first."""
    free = [0.0] * machines
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def all_events(client: Any) -> list[dict[str, Any]]:
    from lease_server.cli.events import read_forward

    return list(read_forward(client, None))


def bench_sweep(ctx: Ctx, out: dict[str, Any]) -> None:
    from magics.sweep import SweepDisplay, gpu_map

    gpus = ctx.gpus
    n = 4 if ctx.smoke else 32 if ctx.quick else 64
    scale = 1 / 50 if ctx.smoke else 1.0
    durations = trace_durations(n, scale)
    from_trace = durations is not None
    if durations is None:
        say(f"[sweep] {traces.missing(traces.JUNE)}: sweep_makespan_ratio skipped; synthetic durations for the rest")
        out.setdefault("skipped", []).append("sweep_makespan_ratio: no trace")
        durations = synthetic_durations(n, scale)
    quiet = SweepDisplay(quiet=True)

    # Warm-up: the same code paths once, then every spare started and answering again.
    gpu_map(sleep_trial, [0.05] * gpus, sess=ctx.sess, display=quiet)
    ctx.sess.prewarm_to(NODE, gpus)
    spares_ready(ctx.sess, gpus)
    start_cpu = worker_start_cpu_s(ctx.sess)

    ideal = list_schedule(durations, gpus)
    t0 = time.monotonic()
    results = gpu_map(sleep_trial, durations, gpus=1, sess=ctx.sess, display=quiet)
    took = time.monotonic() - t0
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} trial(s) did not finish: {failed[0]!r}")

    ids = {r.lease_id: r for r in results}
    log = all_events(ctx.sess.client())
    queued = {e["lease"] for e in log if e["type"] == "queued" and e.get("lease") in ids}
    dispatch, live, most = [], 0, 0
    split: dict[str, list[float]] = {"release_to_grant": [], "grant_to_call": [], "call_to_function": []}
    for k, e in enumerate(log):
        if e.get("lease") not in ids:
            continue
        if e["type"] == "grant":
            live += 1
            most = max(most, live)
            before = log[k - 1] if k else {}
            if e["lease"] in queued and before.get("type") == "released" and before.get("ts") == e["ts"]:
                t = ids[e["lease"]]
                dispatch.append((t.value - before["ts"]) * 1000)
                split["release_to_grant"].append((e["ts"] - before["ts"]) * 1000)
                split["grant_to_call"].append((t.started_at - e["ts"]) * 1000)
                split["call_to_function"].append((t.value - t.started_at) * 1000)
        elif e["type"] in ("released", "expired", "revoked"):
            live -= 1
    overhead = [(r.run_s - d) * 1000 for r, d in zip(results, durations, strict=True)]

    out["sweep_trials"] = n
    out["sweep_durations_from"] = str(TRACE) if from_trace else "synthetic"
    out["sweep_makespan_s"] = took
    out["sweep_ideal_makespan_s"] = ideal
    out["sweep_max_live"] = most
    out["sweep_dispatched_from_queue"] = len(dispatch)
    handed = [
        e for e in log if e["type"] == "released" and e.get("lease") in ids and "handed to" in e.get("reason", "")
    ]
    out["sweep_handed_on"] = len(handed)
    out["trial_overhead_p50_ms"] = pct(overhead, 50)
    out["trial_dispatch_split_p50_ms"] = {k: pct(v, 50) for k, v in split.items()}
    out["trial_dispatch_split_p90_ms"] = {k: pct(v, 90) for k, v in split.items()}
    out["worker_start_cpu_s"] = start_cpu
    say(
        f"sweep: {n} trials, {sum(durations):.0f} GPU-s of work on {gpus} GPUs; at most {most} leases live; "
        f"{len(handed)} trials started on the worker of the trial before them"
    )
    say(f"sweep_makespan_s     {took:.2f}  ideal list schedule {ideal:.2f}  (information)")
    if from_trace:
        ratio = took / ideal
        out["sweep_makespan_ratio"] = ratio
        say(f"sweep_makespan_ratio {ratio:.3f}  {verdict('sweep_makespan_ratio', ratio)}")
    p50, p99 = pct(dispatch, 50), pct(dispatch, 99)
    out["trial_dispatch_p50_ms"] = p50
    out["trial_dispatch_p99_ms"] = p99
    say(f"trial_dispatch_p50_ms {p50:.1f}  {verdict('trial_dispatch_p50_ms', p50)}  ({len(dispatch)} trials)")
    say(f"trial_dispatch_p99_ms {p99:.1f}  (information)")
    say(f"trial_overhead_p50_ms {pct(overhead, 50):.1f}  (information: grant -> release, less the trial's sleep)")
    for q in (50, 90):
        parts = ", ".join(f"{k} {v:.1f}" for k, v in out[f"trial_dispatch_split_p{q}_ms"].items())
        say(f"  dispatch split (p{q} ms): {parts}")
    say(
        f"worker_start_cpu_s   {start_cpu:.2f}  (information: CPU-seconds of one fresh worker process until it "
        f"answers; every trial needs one, and {os.cpu_count()} cores start at most "
        f"{(os.cpu_count() or 1) / max(start_cpu, 1e-3):.1f} a second)"
    )


def curve_job(work: int, resume_state: Any = None) -> dict[str, Any]:
    """An elastic loop on the synthetic curve: each rank's step sleeps for its share of a step whose
    throughput is linear in the ranks up to KNEE and flat after; ``work`` samples in all (a rank's
    step is one sample)."""
    import magics

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    state = dict(resume_state) if resume_state else {"samples": 0, "steps": 0}
    magics.on_preempt(lambda: dict(state))
    while state["samples"] < work:
        time.sleep(STEP_S * world / min(world, KNEE))
        state["samples"] += world
        state["steps"] += 1
        magics.elastic.step(samples=1)
    return state if rank == 0 else {}


def bench_elastic(ctx: Ctx, out: dict[str, Any]) -> None:
    """Section "elastic" (its figures: the module's docstring)."""
    from magics.calls import Call
    from magics.runner import Options, run_call

    gpus = ctx.gpus
    work = 100 if ctx.smoke else 2000 if ctx.quick else 6000
    ctx.sess.prewarm_to(NODE, gpus)  # measured warm, as the sweep: a process per rank ready
    spares_ready(ctx.sess, gpus)
    rate = {n: min(n, KNEE) / STEP_S for n in range(1, gpus + 1)}  # samples/s at each fixed size
    gpu_s_fixed = {n: n * work / rate[n] for n in rate}
    best = min(gpu_s_fixed.values())
    worst_time = max(work / rate[n] for n in rate)
    t0 = time.monotonic()
    res = run_call(Call.function(curve_job, work), Options(gpus=gpus, gpus_min=1, elastic=True), sess=ctx.sess)
    took = time.monotonic() - t0
    log = all_events(ctx.sess.client())
    size, since, gpu_s = 0, 0.0, 0.0
    for e in log:
        if e.get("lease") != res.lease_id:
            continue
        if e["type"] == "grant":
            size, since = len(e["gpus"]), e["ts"]
        elif e["type"] in ("grown", "shrunk", "released"):
            gpu_s += size * (e["ts"] - since)
            size, since = e.get("size", 0), e["ts"]
    ratio = gpu_s / best
    out["elastic_gpu_s"] = gpu_s
    out["elastic_gpu_s_best_fixed"] = best
    out["elastic_gpu_s_ratio"] = ratio
    out["elastic_time_s"] = took
    out["elastic_time_vs_worst"] = took / worst_time
    out["elastic_sizes"] = [p["size"] for p in res.elastic]
    out["elastic_phases"] = [
        {k: (round(v, 3) if isinstance(v, float) else v) for k, v in p.items() if k != "why"} for p in res.elastic
    ]
    say(f"elastic: {work} samples on a curve linear to {KNEE} GPUs, flat after; sizes {out['elastic_sizes']}")
    say(f"elastic_gpu_s_ratio  {ratio:.3f}  {verdict('elastic_gpu_s_ratio', ratio)}  ({gpu_s:.0f} vs {best:.0f} GPU-s)")
    say(f"elastic_time_vs_worst {took / worst_time:.3f}  (information: {took:.1f}s vs {worst_time:.1f}s at 1 GPU)")


# Sections in the order they run; each fills its own figures (TARGETS says which have targets).
SECTIONS: dict[str, Callable[[Ctx, dict[str, Any]], None]] = {
    "sweep": bench_sweep,
    "elastic": bench_elastic,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs (the sweep: 32 trials)")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections")
    args = _common.parse_args(ap)
    _common.ray_spares()  # before tests.conftest, which would set 0
    gpus = 2 if args.smoke else GPUS
    started = time.monotonic()
    results: dict[str, Any] = {"loadavg_start": round(os.getloadavg()[0], 2), "smoke": args.smoke}
    say(
        f"elastic_bench ({'smoke' if args.smoke else 'quick' if args.quick else 'full'}): {NODE}={gpus}xA100-80GB, "
        f"{os.cpu_count()} cores, "
        f"load average {_common.load_text(os.getloadavg())} at start"
    )
    work = Path(tempfile.mkdtemp(prefix="gpulease-elastic-"))
    up = None
    try:
        with section(results, "stack", timed=True):
            up = start_stack(work / "home", gpus)
            sess = connect(up, gpus)
        if up is not None and "failed" not in results:
            ctx = Ctx(up, sess, args.quick, work, args.smoke, gpus)
            for name, run in SECTIONS.items():
                if args.only and name not in args.only:
                    continue
                with section(results, name, timed=True):
                    run(ctx, results)
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        if up is not None:
            code = stop_stack(up)
            if code not in (0, -signal.SIGINT, 130):
                say(f"gpulease up exited with {code}")
        shutil.rmtree(work, ignore_errors=True)
    results["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["seconds"] = round(time.monotonic() - started, 1)
    for key in TARGETS:
        results.setdefault(key, None)
    met = {k: results[k] is not None and verdict(k, results[k]).endswith("PASS") for k in TARGETS}
    results["targets_met"] = met
    say("targets:")
    for k, ok in met.items():
        value = "not measured" if results[k] is None else f"{results[k]:.4g}"
        say(f"  {k:<24} {value:>12}  {TARGETS[k][0]} {TARGETS[k][1]:g}  {'met' if ok else 'NOT MET'}")
    if "failed" in results:  # listed after the run's figures
        results["failed"] = results.pop("failed")
    say(f"done in {results['seconds']}s; load average at end {results['load_avg_end'][0]:.2f}")
    say(_common.json_line(results, first=TARGETS, digits=4))


if __name__ == "__main__":
    main()
