"""Session-level workloads (the NotebookOS template format): hand-made traces whose outcome is
known by hand for the session and culler policies, the search for the smallest cluster, the
command line, and the Adobe 1-2 June 2021 template's own figures (where the trace is present)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lease_server.client import Client
from lease_server.sim import command, policies, report, workload
from lease_server.sim.replay import cluster
from lease_server.sim.run import simulate
from lease_server.sim.traces import ADOBE as ADOBE_FILE
from lease_server.sim.traces import missing, trace
from lease_server.sim.workload import MIN

ADOBE = trace(ADOBE_FILE)  # GPULEASE_TRACE_DIR, else shared/traces/notebookos beside the checkout
needs_adobe = pytest.mark.skipif(bool(missing(ADOBE_FILE)), reason=missing(ADOBE_FILE))


def training(start: int, dur: int, gpus: int, util: float = 50.0) -> dict[str, Any]:
    """One cell of a template, in ticks (60 s)."""
    return {
        "start_tick": start,
        "duration_in_ticks": dur,
        "end_tick": start + dur,
        "gpus": gpus,
        "gpu_utilizations": [{"utilization": util}] * gpus,
    }


def template(tmp_path: Path, *sessions: tuple[str, int, int, int, list[dict[str, Any]]]) -> Path:
    """A template file: sessions as (id, start tick, stop tick, GPUs asked for, trainings)."""
    doc = {
        "workloadTitle": "hand-made",
        "sessions": [
            {
                "id": sid,
                "start_tick": a,
                "stop_tick": b,
                "max_resource_request": {"gpus": g, "cpus": 1},
                "trainings": ts,
            }
            for sid, a, b, g, ts in sessions
        ],
    }
    path = tmp_path / "sessions.json"
    path.write_text(json.dumps(doc))
    return path


def held_min(r) -> float:
    return float(((r.alloc_end - r.alloc_start) * r.alloc_gpus).sum()) / MIN


# Alice's notebook holds the whole 4-GPU node from 0:00 to 1:40; Bob opens his at 0:20 asking for 2.
# Under `session` Bob's pod is pending until 1:40, so his whole session moves 80 min later; his cell
# (nominally at 0:30) waits 80 min. Per-cell leases: nobody waits, and only the cells' time is held.
TWO_NOTEBOOKS = (
    ("alice", 0, 100, 4, [training(10, 5, 4), training(20, 5, 0)]),
    ("bob", 20, 60, 2, [training(30, 10, 2)]),
    ("carol", 5, 50, 0, [training(6, 3, 0)]),  # never uses a GPU: left out
)


def test_session_policy_holds_a_notebook_for_its_life_and_pending_pods_move_it(tmp_path):
    w = workload.load_sessions(template(tmp_path, *TWO_NOTEBOOKS))
    assert (w.n_sessions, w.n_cells, w.dropped) == (2, 2, 1)
    assert w.open.tolist() == [0, 20 * MIN] and w.stop.tolist() == [100 * MIN, 60 * MIN]
    r = policies.session(w, [4])
    alice, bob = 0, 1
    assert r.start[alice] == 10 * MIN and r.wait_ms[alice] == 0
    assert r.start[bob] == 110 * MIN and r.wait_ms[bob] == 80 * MIN
    assert sorted(zip(r.alloc_start.tolist(), r.alloc_end.tolist(), r.alloc_gpus.tolist(), strict=True)) == [
        (0, 100 * MIN, 4),
        (100 * MIN, 140 * MIN, 2),
    ]
    f = report.figures(w, r)
    assert f["gpu_hours_allocated"] == pytest.approx((4 * 100 + 2 * 40) / 60)
    assert f["peak_gpus"] == 4 and f["cells_waited_1m"] == 1
    # on two nodes Bob's pod starts at once
    r2 = policies.session(w, [4, 4])
    assert r2.wait_ms.tolist() == [0, 0] and report.figures(w, r2)["peak_gpus"] == 6


def test_lease_on_real_sessions_holds_only_the_cells(tmp_path, redis_server):
    w = workload.load_sessions(template(tmp_path, *TWO_NOTEBOOKS))
    rows = [report.figures(w, r) for r in simulate(w, [4], ["session", "lease"], redis_url=redis_server.url)]
    report.add_savings(rows)
    session, lease = rows
    assert lease["gpu_hours_allocated"] == pytest.approx((4 * 5 + 2 * 10) / 60)
    assert lease["wait_p99_s"] == 0 and lease["utilization"] == pytest.approx(1.0)
    # saved in the first 17.5 h: everything the session policy held beyond the cells
    assert lease["saved_gpu_hours"] == pytest.approx(session["gpu_hours_allocated"] - lease["gpu_hours_allocated"])
    # the cells' own NVML utilization (50 %) over what each policy held
    assert lease["busy_util"] == pytest.approx(0.5)
    assert session["busy_util"] == pytest.approx(0.5 * 40 / (4 * 100 + 2 * 40))


# One 1-GPU notebook, 0:00 to 2:30: GPU cells at 0:10 (5 min), 0:50 (5) and 2:00 (5), a CPU-only cell
# at 0:30 (5). The culler sees every cell.
#   10 min: hold 0:10, idle from 0:15, culled 0:25 (the CPU cell at 0:30 finds a new kernel: felt);
#           hold 0:50, idle from 0:55, culled 1:05 (felt); hold 2:00, idle from 2:05, culled 2:15
#           before the notebook stops (nothing follows: not felt). 45 min held, 3 culls, 2 felt.
#   60 min: hold 0:10, busy again at 0:30 and 0:50, idle from 0:55, culled 1:55 (felt); hold 2:00,
#           the notebook stops at 2:30 before 60 idle minutes: 105 + 30 min held, 1 cull, felt.
ONE_NOTEBOOK = (("dana", 0, 150, 1, [training(10, 5, 1), training(30, 5, 0), training(50, 5, 1), training(120, 5, 1)]),)


@pytest.mark.parametrize(("idle_min", "held", "culls", "felt"), [(10, 45, 3, 2), (60, 135, 1, 1)])
def test_culler_on_a_real_session_culls_in_the_middle_and_counts_lost_kernels(tmp_path, idle_min, held, culls, felt):
    w = workload.load_sessions(template(tmp_path, *ONE_NOTEBOOK))
    assert w.n_cells == 3 and w.cpu == [[(15 * MIN, 5 * MIN)], [], []]
    r = policies.culler(w, [1], idle_min * 60)
    assert held_min(r) == pytest.approx(held)
    assert (r.extra["culls"], r.extra["culls_felt"]) == (culls, felt)
    assert r.wait_ms.tolist() == [0, 0, 0]
    f = report.figures(w, r)
    assert (f["culls"], f["culls_felt"]) == (culls, felt)


def test_a_culled_notebook_waits_for_its_gpus_again(tmp_path):
    # Erin holds the only GPU from 0:10; culled at 0:25 (10 min), so Finn's cell at 0:20 waits 5 min,
    # and Erin's next cell (0:30) waits for Finn's notebook: its cell runs 0:25 to 0:45, then it holds
    # the GPU until culled at 0:55 (its notebook stops only at 1:00): 25 min.
    w = workload.load_sessions(
        template(
            tmp_path,
            ("erin", 0, 100, 1, [training(10, 5, 1), training(30, 5, 1)]),
            ("finn", 15, 60, 1, [training(20, 20, 1)]),
        )
    )
    r = policies.culler(w, [1], 600)
    erin0, erin1, finn = 0, 1, 2
    assert r.wait_ms[finn] == 5 * MIN and r.start[finn] == 25 * MIN
    assert r.wait_ms[erin1] == 25 * MIN and r.wait_ms[erin0] == 0


def test_find_min_nodes_searches_full_replays(tmp_path, redis_server):
    # Four 8-GPU notebooks open all day; each runs one 8-GPU cell, at 1:00, 2:00, 3:00 and 4:00.
    sessions = [(f"n{i}", 0, 600, 8, [training(60 * (i + 1), 30, 8)]) for i in range(4)]
    w = workload.load_sessions(template(tmp_path, *sessions))
    s = command.find_min_nodes(w, "session", redis_url=redis_server.url)
    lease = command.find_min_nodes(w, "lease", redis_url=redis_server.url)
    assert (s.nodes, s.gpus) == (4, 32)  # every notebook needs a node of its own all day
    assert (lease.nodes, lease.gpus) == (1, 8)  # the cells never overlap
    assert lease.row["wait_p95_s"] == 0 and lease.probes == 1


def test_cli_reads_a_session_workload_and_finds_the_smallest_cluster(tmp_path, redis_server):
    from click.testing import CliRunner

    from lease_server.cli import main

    trace = template(tmp_path, *TWO_NOTEBOOKS, *ONE_NOTEBOOK)
    common = ["simulate", "--trace", str(trace), "--redis-url", redis_server.url]
    res = CliRunner().invoke(main, [*common, "--gpus", "8", "--out", str(tmp_path / "res")], terminal_width=80)
    assert res.exit_code == 0, res.output
    assert "3 real sessions (1 without GPU cells left out)" in res.output.replace("\n", " ")
    head = next(line for line in res.output.splitlines() if "session" in line and "lease+booking" in line)
    assert head.split() == ["session", "culler-10m", "culler-60m", "lease", "lease+booking"]
    assert "culled kernels" in res.output and "GPU-h saved" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    assert (tmp_path / "res.png").stat().st_size > 1000
    found = CliRunner().invoke(main, [*common, "--find-min-gpus", "--policies", "session,lease"], terminal_width=80)
    assert found.exit_code == 0, found.output
    rows = {ws[0]: ws for ws in map(str.split, found.output.splitlines()) if ws[:1] in (["session"], ["lease"])}
    assert rows["session"][1:3] == ["1", "8"] and rows["lease"][1:3] == ["1", "8"]
    bad = CliRunner().invoke(main, [*common, "--find-min-gpus", "--max-cell-hours", "1"])
    assert bad.exit_code == 2 and "a session trace is replayed whole" in " ".join(bad.output.split())


@needs_adobe
def test_adobe_template_figures_as_its_source_states(redis_server):
    """SOURCE.md: 59 sessions (8 without GPUs), 518 GPU cells; held for their whole life 5,070 GPU-h,
    used 1,304, peak 142 held and 64 busy; in the first 17.5 h held 1,493, used 319."""
    w = workload.load_sessions(ADOBE)
    assert (w.n_sessions + w.dropped, w.dropped, w.n_cells) == (59, 8, 518)
    assert w.used_gpu_ms() / workload.HOUR == pytest.approx(1304.25)
    rows = [report.figures(w, r) for r in simulate(w, cluster(144), ["session", "lease"], redis_url=redis_server.url)]
    report.add_savings(rows)
    session, lease = rows
    assert session["gpu_hours_allocated"] == pytest.approx(5070.3, abs=0.1) and session["peak_gpus"] == 142
    assert session["gpu_hours_window"] == pytest.approx(1493, abs=1)
    assert lease["peak_gpus"] == 64 and lease["wait_p99_s"] == 0
    assert lease["saved_gpu_hours"] == pytest.approx(1493 - 319, abs=1.5)


SPEED = 120  # the live replay runs 120x faster than the trace: one simulated minute is half a second


@needs_adobe
@pytest.mark.timeout(600)  # two hours of trace at 120x, and a stack to start
def test_simulator_and_a_live_stack_agree_on_the_first_two_hours(tmp_path_factory, redis_server, ray_head):
    """The template's first 2 hours, 120x faster, played live through ``run_call`` (what
    ``run_on_gpus`` and ``%%gpu_train`` run) against ``gpulease up --simulate`` with one 8-GPU node:
    real lease server, real Ray workers, cells that sleep, one user per notebook, each notebook a
    thread. The simulation of the same slice grants in the same order. Its waits differ from the live
    ones by what a live cell costs beyond the trace's duration (a Ray worker's start and end); so the
    simulator is also fed what the live run measured (each request's time and each lease's held
    time, from the server's event log) and must then give every wait within 1 simulated second."""
    ray = pytest.importorskip("ray")
    from magics.calls import Call
    from magics.outcomes import RecordingUI
    from magics.runner import Options, run_call
    from magics.session import Session
    from tests.conftest import Up

    w = workload.window(workload.load_sessions(ADOBE), 2.0)
    (sim,) = simulate(w, [8], ["lease"], redis_url=redis_server.url)
    assert sim.wait_ms.max() > 0, "the slice should make someone wait on one node"

    # On the tests' one Ray head (its node "box"), as the other Ray modules: a head of its own cost
    # 20-40 s more on two cores.
    joins = ("--ray-address", ray_head.address, "--ray-token-file", str(ray_head.token))
    stack = Up(tmp_path_factory.mktemp("adobe-live"), *joins, simulate="box=8xA100-80GB")
    failures: list[BaseException] = []
    try:
        admin = Client(stack.url, (stack.data / "token").read_text().strip())
        tokens = {u: admin.request("POST", "/api/v1/tokens", json={"user": u})["token"] for u in w.users}
        t0 = time.monotonic() + 3.0

        def play(s: int) -> None:
            sess = Session()
            sess.defaults.url, sess.defaults.token = stack.url, tokens[w.users[int(w.user[s])]]
            try:
                at = t0 + int(w.start[s]) / 1000 / SPEED
                for c in range(int(w.first[s]), int(w.first[s] + w.count[s])):
                    if c > w.first[s]:
                        at = time.monotonic() + int(w.gap[c]) / 1000 / SPEED
                    time.sleep(max(0.0, at - time.monotonic()))  # the person's think time
                    seconds = int(w.dur[c]) / 1000 / SPEED
                    opts = Options(gpus=int(w.gpus[s]), label=w.label[c], wait=600)
                    run_call(Call.function(time.sleep, seconds), opts, RecordingUI(), sess)
            except BaseException as exc:  # surfaced below
                failures.append(exc)
            finally:
                sess.release_all()

        threads = [threading.Thread(target=play, args=(s,)) for s in range(w.n_sessions)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)
        assert not failures, failures
        events = admin.events("-", 1000)
        admin.close()
    finally:
        ray.shutdown()
        stack.interrupt()

    grants = [e for e in events if e["type"] == "grant"]
    ended = {e["lease"]: e["ts"] for e in events if e["type"] in ("released", "expired", "revoked")}
    assert [g["label"] for g in grants] == [w.label[c] for c in sim.order]
    # the simulator fed the live run's own request and held times: every wait within 1 simulated s
    base = min(g["ts"] - g["waited_ms"] / 1000 for g in grants)
    by_label = {w.label[c]: c for c in range(w.n_cells)}
    fed = workload.from_cells(
        workload.Cell(
            round((g["ts"] - g["waited_ms"] / 1000 - base) * 1000 * SPEED),
            round((ended[g["lease"]] - g["ts"]) * 1000 * SPEED),
            int(w.cell_gpus[by_label[g["label"]]]),
            g["label"],
            g["user"],
            g["label"],  # each cell its own session: its request time is the live one
        )
        for g in grants
    )
    (again,) = simulate(fed, [8], ["lease"], redis_url=redis_server.url)
    live_wait = {g["label"]: g["waited_ms"] * SPEED for g in grants}
    trace_wait = {w.label[c]: int(sim.wait_ms[c]) for c in range(w.n_cells)}
    print("simulated ms waited, trace vs live:", {k: (trace_wait[k], live_wait[k]) for k in live_wait if live_wait[k]})
    for c in range(fed.n_cells):
        assert abs(int(again.wait_ms[c]) - live_wait[fed.label[c]]) <= 1000, fed.label[c]
    assert [fed.label[c] for c in again.order] == [g["label"] for g in grants]


@needs_adobe
def test_lease_warm_keeps_most_cells_warm_and_lends_the_rest(redis_server):
    """lease-warm through the real warm.lua on the Adobe template at 64 GPUs: most GPU cells start on
    their notebook's warm lease, warm leases are evicted for whoever waits, use is charged as under
    lease (warm time apart), and the event log holds no GPU granted twice."""
    import dataclasses

    from redis import Redis

    from lease_server.config import Settings
    from lease_server.sim import replay
    from lease_server.store.keys import Keys
    from tests.invariants import check_event_log, read_events

    w = workload.load_sessions(ADOBE)
    rows = [report.figures(w, r) for r in simulate(w, cluster(64), ["lease"], redis_url=redis_server.url)]
    settings = dataclasses.replace(Settings(), redis_url=redis_server.url, prefix="warmsim", event_log_max=10**7)
    warm = replay.lease(
        w, cluster(64), replay.ReplaySetup(redis_server.url, "warmsim", settings, keep=True), policy="lease-warm"
    )
    r = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        counts = check_event_log(read_events(r, Keys("warmsim")))
    finally:
        r.delete(*Keys("warmsim").all())
        r.close()
    lease, fig = rows[0], report.figures(w, warm)
    assert counts["warm"] >= fig["warm_starts"] > 0 and counts["evicting"] == fig["evictions"] > 0
    assert fig["warm_start_share"] >= 0.7
    assert fig["gpu_hours_allocated"] == pytest.approx(lease["gpu_hours_allocated"])  # charged: the cells' own time
    assert fig["warm_gpu_hours"] > 0
    assert (warm.start >= warm.ready).all()


@needs_adobe
def test_lease_warm_suspends_evicted_workers_and_restores_them_on_their_node(redis_server):
    """Suspend to host in lease-warm (issue 36 item 7): an evicted warm worker is suspended (one GPU,
    as the server does; any size in the what-if), its session's next cell of that size on its node
    restores it, and the state kept counts warm starts and restores; without suspend it is warm
    starts alone."""
    w = workload.load_sessions(ADOBE)
    nodes, url = cluster(64), redis_server.url
    (none,) = simulate(w, nodes, ["lease-warm"], redis_url=url, suspend_gpus=0)
    (one,) = simulate(w, nodes, ["lease-warm"], redis_url=url)
    (multi,) = simulate(w, nodes, ["lease-warm"], redis_url=url, suspend_gpus=8)
    assert none.extra["suspends"] == 0 and none.extra["state_kept_share"] == none.extra["warm_start_share"]
    assert one.extra["suspends"] <= one.extra["evictions"]
    x = multi.extra
    assert x["suspends"] == x["evictions"] > 0  # every evicted worker, whatever its size
    assert 0 < x["restores"] and x["restores"] + x["suspend_lost"] <= x["suspends"]
    assert x["state_kept_share"] == pytest.approx(x["warm_start_share"] + x["restores"] / w.n_cells)
    assert x["restore_gpu_hours"] > 0  # a restore holds its new GPU before the cell runs
    assert (multi.start >= multi.ready).all()
