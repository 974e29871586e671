#!/usr/bin/env python
"""Performance figures of the policy simulator (issue 7, Bench section).

    .venv/bin/python bench/sim_bench.py [--quick] [--gpus N]

Loads the NotebookOS June 2021 trace, groups its cells into sessions (default generator
parameters, seed 1), replays it on a cluster of ``--gpus`` GPUs (nodes of 8; default 320, the size
docs/simulation.md uses: the calendar keeps the median time-to-GPU (per cell and per session) under
an hour) under calendar, culler-10m, culler-60m, lease and lease+resv, the two lease policies
through the real Lua scripts on a redis-server of its own (no persistence). Prints one line per figure, then, as the
very last line of stdout, one JSON object with every figure:

sim_hours_per_wall_s   virtual hours of the lease replay (first arrival to last release) per wall
                       second of it (registration and Redis start-up excluded)       (target >= 500)
util_lease, util_calendar, util_culler_60m (and util_culler_10m)
                       GPU-hours used / GPU-hours allocated by the policy
                       (target: util_lease >= 3 x util_calendar and >= 3 x util_culler_60m)
p50_wait_s_lease       median time-to-GPU of a cell under lease                       (target <= 1)

Extras: p95/p99 waits, cells that waited > 1 min, Redis EVALSHA time per call (commandstats), the
replay's script calls and round trips; for lease+resv (4 teams book half the GPUs, see
lease_server/sim/resv.py) its utilization, waits, replay speed, re-runs of recalled cells and the
GPU-hours they lost. ``--quick`` replays the first 7 days only; ``--no-resv`` skips lease+resv.
Nothing asserts.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import say, section

TRACE = Path(os.environ.get("GPULEASE_TRACE", "/work/shared/traces/notebookos/sensei_june_60sec.csv"))
DEFAULT_GPUS = 320

TARGETS: dict[str, tuple[str, float]] = {
    "sim_hours_per_wall_s": (">=", 500.0),
    "util_lease_over_calendar": (">=", 3.0),
    "util_lease_over_culler_60m": (">=", 3.0),
    "p50_wait_s_lease": ("<=", 1.0),
}
verdict = functools.partial(_common.verdict, TARGETS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first 7 days of the trace only")
    ap.add_argument("--gpus", type=int, default=DEFAULT_GPUS)
    ap.add_argument("--no-resv", action="store_true", help="skip the lease+resv policy")
    args = ap.parse_args()

    from redis import Redis

    from lease_server.config import Settings
    from lease_server.sim import policies, replay, report, resv, workload

    out: dict[str, Any] = {}
    with _common.private_redis("gpulease-simbench-") as (redis, _tmp):
        _common.announce(out, "sim bench", args.quick, redis)
        r = Redis.from_url(redis.url)
        r.config_set("appendonly", "no")
        t = time.perf_counter()
        cells = workload.load_trace(TRACE)
        if args.quick:
            cells = [c for c in cells if c.arrival < 7 * 24 * workload.HOUR]
        w = workload.sessionize(cells)
        s = w.summary()
        say(
            f"workload {TRACE.name}: {s['cells']} cells, {s['sessions']} sessions, {s['span_h']:.0f} h, "
            f"{s['gpu_hours_used']:.0f} GPU-h used; loaded and grouped in {time.perf_counter() - t:.2f} s; "
            f"cluster {args.gpus} GPUs (nodes of 8)"
        )
        nodes = replay.cluster(args.gpus)
        out.update(gpus=args.gpus, cells=s["cells"], sessions=s["sessions"], trace_hours=s["span_h"])
        rows: dict[str, dict[str, Any]] = {}
        for name, run in (
            ("calendar", lambda: policies.calendar(w, nodes)),
            ("culler-10m", lambda: policies.culler(w, nodes, 600)),
            ("culler-60m", lambda: policies.culler(w, nodes, 3600)),
        ):
            with section(out, name):
                rows[name] = report.figures(w, run())
        with section(out, "lease"):
            r.config_resetstat()
            setup = replay.ReplaySetup(redis.url, "simbench", Settings(redis_url=redis.url, prefix="simbench"))
            res = replay.lease(w, nodes, setup)
            rows["lease"] = report.figures(w, res)
            stats = r.info("commandstats").get("cmdstat_evalsha", {})
            out["redis_evalsha_us_per_call"] = stats.get("usec_per_call")
            out["redis_evalsha_s"] = round(stats.get("usec", 0) / 1e6, 2)
            out["script_calls"] = res.extra["script_calls"]
            out["round_trips"] = res.extra["round_trips"]
            out["lease_wall_s"] = round(res.wall_s, 2)
            out["sim_hours_per_wall_s"] = res.extra["sim_hours"] / res.wall_s
        if not args.no_resv:
            with section(out, "lease+resv"):
                r.config_resetstat()
                rp = resv.ResvParams()
                rs = Settings(redis_url=redis.url, prefix="simbench-resv", teams=resv.teams_of(w, rp))
                setup = replay.ReplaySetup(redis.url, "simbench-resv", rs)
                books = resv.bookings(w, args.gpus, rp)
                res = replay.lease(w, nodes, setup, policy="lease+resv", bookings=books)
                rows["lease+resv"] = report.figures(w, res)
                stats = r.info("commandstats").get("cmdstat_evalsha", {})
                out["resv_booked_gpus"] = sum(b.gpus for b in books)
                out["resv_redis_evalsha_us_per_call"] = stats.get("usec_per_call")
                out["resv_round_trips"] = res.extra["round_trips"]
                out["resv_lease_wall_s"] = round(res.wall_s, 2)
                out["sim_hours_per_wall_s_resv"] = res.extra["sim_hours"] / res.wall_s
                for k in ("reruns", "lost_gpu_hours", "resv_grants", "borrowed_grants", "sweeps", "no_shows"):
                    out[f"resv_{k}" if not k.startswith("resv") else k] = res.extra[k]
        r.close()

    for name, row in rows.items():
        key = name.replace("-", "_").replace("+", "_")
        out[f"util_{key}"] = row["utilization"]
        out[f"p50_wait_s_{key}"] = row["wait_p50_s"]
        out[f"p95_wait_s_{key}"] = row["wait_p95_s"]
        out[f"p99_wait_s_{key}"] = row["wait_p99_s"]
        out[f"cells_waited_1m_{key}"] = row["cells_waited_1m"]
        say(
            f"{name:<11} utilization {row['utilization']:.3f}  GPU-h held {row['gpu_hours_allocated']:.0f}  "
            f"wait p50 {row['wait_p50_s']:.0f} s p95 {row['wait_p95_s']:.0f} s p99 {row['wait_p99_s']:.0f} s  "
            f"cells waited >1 min {row['cells_waited_1m']}"
        )
    nan = float("nan")
    if "sim_hours_per_wall_s" in out:
        say(
            f"sim_hours_per_wall_s {out['sim_hours_per_wall_s']:.0f} ({out['script_calls']} script calls in "
            f"{out['round_trips']} round trips, {out['lease_wall_s']} s; Redis EVALSHA {out['redis_evalsha_s']} s, "
            f"{out['redis_evalsha_us_per_call']} us per call) "
            + verdict("sim_hours_per_wall_s", out["sim_hours_per_wall_s"])
        )
    if "sim_hours_per_wall_s_resv" in out:
        say(
            f"lease+resv: {out['resv_booked_gpus']} GPUs booked by 4 teams; {out['resv_grants']} grants served "
            f"from a booking, {out['resv_borrowed_grants']} borrowed, {out['resv_reruns']} cells recalled and run "
            f"again ({out['resv_lost_gpu_hours']:.0f} GPU-h lost), {out['resv_no_shows']} booking occurrences "
            f"released unused (no-show); replay {out['sim_hours_per_wall_s_resv']:.0f} "
            f"sim h/s ({out['resv_round_trips']} round trips, {out['resv_lease_wall_s']} s, Redis "
            f"{out['resv_redis_evalsha_us_per_call']} us per EVALSHA)"
        )
    ul = out.get("util_lease", nan)
    for other in ("calendar", "culler_60m"):
        ratio = ul / out.get(f"util_{other}", nan) if out.get(f"util_{other}") else nan
        out[f"util_lease_over_{other}"] = ratio
        say(f"util_lease / util_{other} {ratio:.2f} {verdict(f'util_lease_over_{other}', ratio)}")
    p50 = out.get("p50_wait_s_lease", nan)
    say(f"p50_wait_s_lease {p50:.1f} {verdict('p50_wait_s_lease', p50)}")
    first = ("sim_hours_per_wall_s", "util_lease", "util_calendar", "util_culler_60m", "p50_wait_s_lease")
    say(_common.json_line(out, first, digits=4))


if __name__ == "__main__":
    main()
