"""The policy simulator: hand-made traces whose outcome is known by hand for every policy, the
replay through the real scripts agrees with a live lease server, and the command line end to end."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from lease_server.sim import bookings, policies, replay, report, workload
from lease_server.sim.traces import JUNE, missing, trace
from lease_server.sim.workload import MIN, Cell, from_cells
from tests.conftest import make_settings

TRACE = trace(JUNE)  # GPULEASE_TRACE_DIR, else shared/traces/notebookos beside the checkout


def lease_run(w: workload.Workload, nodes: list[int], redis_server, prefix: str, **kw):
    setup = replay.ReplaySetup(redis_server.url, prefix, make_settings(redis_server.url, prefix), **kw)
    return replay.lease(w, nodes, setup)


def util(w: workload.Workload, r) -> float:
    return report.figures(w, r)["utilization"]


# Two people, one GPU: alice's 30-min cell at 0:00, bob's 30-min cell at 0:10.
TWO_ON_ONE = [Cell(0, 30 * MIN, 1, "a", "alice", "sa"), Cell(10 * MIN, 30 * MIN, 1, "b", "bob", "sb")]


def test_calendar_two_cells_on_one_gpu():
    w = from_cells(TWO_ON_ONE)
    r = policies.calendar(w, [1])
    # alice books 0:00-1:00; bob's hour is taken, so he books 1:00-2:00 and waits 50 minutes
    assert list(r.start) == [0, 60 * MIN]
    assert list(r.wait_ms) == [0, 50 * MIN]
    assert report.figures(w, r)["gpu_hours_allocated"] == pytest.approx(2.0)
    assert util(w, r) == pytest.approx(0.5)


@pytest.mark.parametrize(("idle_min", "bob_start", "held_min"), [(10, 40, 40 + 40), (60, 90, 90 + 90)])
def test_culler_two_cells_on_one_gpu(idle_min, bob_start, held_min):
    w = from_cells(TWO_ON_ONE)
    r = policies.culler(w, [1], idle_min * 60)
    # alice's notebook holds the GPU until it has been idle for idle_min after her cell ended
    assert list(r.start) == [0, bob_start * MIN]
    assert list(r.wait_ms) == [0, (bob_start - 10) * MIN]
    assert report.figures(w, r)["gpu_hours_allocated"] == pytest.approx(held_min / 60)
    assert r.policy == f"culler-{idle_min}m"


def test_lease_two_cells_on_one_gpu(redis_server, prefix):
    w = from_cells(TWO_ON_ONE)
    r = lease_run(w, [1], redis_server, prefix)
    # bob queues at 0:10 and is granted by alice's release at 0:30: GPUs held only while cells run
    assert list(r.start) == [0, 30 * MIN]
    assert list(r.wait_ms) == [0, 20 * MIN]
    assert util(w, r) == pytest.approx(1.0)
    assert list(r.order) == [0, 1]


# One notebook: a 10-min cell, 20 min of thinking, another 10-min cell. Nobody else.
THINK = [Cell(0, 10 * MIN, 2, "1", "alice", "s"), Cell(30 * MIN, 10 * MIN, 2, "2", "alice", "s")]


def test_think_time_under_every_policy(redis_server, prefix):
    w = from_cells(THINK)
    assert list(w.gap) == [0, 20 * MIN]
    cal = policies.calendar(w, [2])
    c10 = policies.culler(w, [2], 600)
    c60 = policies.culler(w, [2], 3600)
    lease = lease_run(w, [2], redis_server, prefix)
    for r in (cal, c10, c60, lease):
        assert list(r.start) == [0, 30 * MIN] and not r.wait_ms.any()
    # calendar: one 1-hour block of 2 GPUs; culler-10m: culled at 0:20, takes them again at 0:30
    # until 0:50; culler-60m: held until 1:40; lease: 2 x 10 min
    assert report.figures(w, cal)["gpu_hours_allocated"] == pytest.approx(2.0)
    assert report.figures(w, c10)["gpu_hours_allocated"] == pytest.approx(2 * 40 / 60)
    assert report.figures(w, c60)["gpu_hours_allocated"] == pytest.approx(2 * 100 / 60)
    assert report.figures(w, lease)["gpu_hours_allocated"] == pytest.approx(2 * 20 / 60)
    assert [round(util(w, r), 3) for r in (cal, c10, c60, lease)] == [round(1 / 3, 3), 0.5, 0.2, 1.0]


def test_a_wait_delays_the_rest_of_the_session(redis_server, prefix):
    # bob's two cells (10 min think time between them) queue behind alice's 30-min cell
    cells = [
        Cell(0, 30 * MIN, 1, "a", "alice", "sa"),
        Cell(10 * MIN, 5 * MIN, 1, "b1", "bob", "sb"),
        Cell(25 * MIN, 5 * MIN, 1, "b2", "bob", "sb"),
    ]
    w = from_cells(cells)
    r = lease_run(w, [1], redis_server, prefix)
    # b1 waits 20 min (granted at 0:30), so b2 is ready 10 min after b1 ended, at 0:45
    assert list(r.start) == [0, 30 * MIN, 45 * MIN]
    assert list(r.ready) == [0, 10 * MIN, 45 * MIN]


def test_gang_requests_and_best_fit_calendar():
    # two nodes of 4; a 4-GPU session must wait for a whole node although 4 GPUs are free in total
    cells = [
        Cell(0, 50 * MIN, 2, "x", "u1", "x"),
        Cell(0, 50 * MIN, 2, "y", "u2", "y"),
        Cell(5 * MIN, 30 * MIN, 4, "big", "u3", "big"),
    ]
    w = from_cells(cells)
    cal = policies.calendar(w, [4, 4])
    c10 = policies.culler(w, [4, 4], 600)
    # best fit puts x and y on one node: the 4-GPU session gets the other one at once
    assert not cal.wait_ms.any() and not c10.wait_ms.any()


def test_fair_share_order_through_the_real_queue(redis_server, prefix):
    # alice holds the only node; bob, then alice, then carol queue. The dispatch serves the least
    # recent GPU-time first: bob and carol (none) before alice (her first cell's 2 GPUs x 20 min).
    cells = [
        Cell(0, 20 * MIN, 2, "a1", "alice", "a1"),
        Cell(1 * MIN, 5 * MIN, 2, "b", "bob", "b"),
        Cell(2 * MIN, 5 * MIN, 2, "a2", "alice", "a2"),
        Cell(3 * MIN, 5 * MIN, 2, "c", "carol", "c"),
    ]
    w = from_cells(cells)
    r = lease_run(w, [2], redis_server, prefix)
    labels = [w.label[c] for c in r.order]
    assert labels == ["a1", "b", "c", "a2"]
    assert list(r.start[r.order]) == sorted(r.start)


def test_lease_booking_recalls_a_borrowed_gpu_for_the_booking_team(redis_server, prefix):
    # One GPU, booked by team A for the week. bob (team B) borrows it at 0:00 for a 60-min cell;
    # alice (team A) asks at 0:10 for 20 min: bob's lease is recalled with 30 s of notice, revoked
    # by the sweeper at 0:10:30, alice gets the GPU then; bob runs his cell again when she is done.
    cells = [Cell(0, 60 * MIN, 1, "b", "bob", "sb"), Cell(10 * MIN, 20 * MIN, 1, "a", "alice", "sa")]
    w = from_cells(cells)
    settings = make_settings(redis_server.url, prefix, teams={"A": ["alice"], "B": ["bob"]}, borrow_notice=30.0)
    setup = replay.ReplaySetup(redis_server.url, prefix, settings)
    r = replay.lease(w, [1], setup, policy="lease+booking", bookings=[bookings.Booking("A", 1, 0, bookings.WEEK_MS, 1)])
    b, a = w.label.index("b"), w.label.index("a")
    half = MIN // 2
    assert r.start[a] == 10 * MIN + half and r.ready[a] == 10 * MIN  # served 30 s after asking
    assert r.start[b] == 30 * MIN + half and r.ready[b] == 0  # bob's cell ran again after alice's
    assert [w.label[c] for c in r.order] == ["a", "b"]  # by final grant: alice's, then bob's re-run
    assert r.extra["reruns"] == 1 and r.extra["booking_grants"] == 1
    # 3 acquires (bob's twice), 2 releases (bob's revoked run is never released), 2 sweeps: the
    # recall due at 0:10:30 and the booking's no-show check at 0:15 (used: nothing released)
    assert r.extra["script_calls"] == 7 and r.extra["sweeps"] == 2 and r.extra["no_shows"] == 0
    assert r.extra["lost_gpu_hours"] == pytest.approx((10 * MIN + half) / workload.HOUR)
    f = report.figures(w, r)
    # held: bob's lost 10.5 min + alice's 20 + bob's 60; used: 80 min
    assert f["gpu_hours_allocated"] == pytest.approx(90.5 / 60)
    assert f["utilization"] == pytest.approx(80 / 90.5)


def test_booking_teams_and_bookings_follow_demand():
    cells = [Cell(0, 60 * MIN, 1, "1", "u00", "s1"), Cell(0, 20 * MIN, 1, "2", "u01", "s2")]
    cells += [Cell(0, 20 * MIN, 1, "3", "u02", "s3")]
    w = from_cells(cells)
    p = bookings.BookingParams(teams=2, share=0.5)
    assert bookings.teams_of(w, p) == {"team0": ["u00", "u02"], "team1": ["u01"]}
    # 4 of 8 GPUs booked, 80 : 20 GPU-minutes -> 3.2 : 0.8 -> 3 : 1 (largest remainder)
    books = bookings.bookings(w, 8, p)
    assert [(b.team, b.gpus, b.start_ms, b.end_ms) for b in books] == [
        ("team0", 3, 0, bookings.WEEK_MS),
        ("team1", 1, 0, bookings.WEEK_MS),
    ]


# The same small trace, replayed live against a running lease server in real time, and simulated.
# Times in ms. alice's 2-GPU cell holds the 2-GPU node; bob (1 GPU), carol (2) and alice (1) queue.
# When it ends, carol (waited longest x most GPUs) goes first, then bob and alice together, bob
# first (alice has recent GPU-time). The margins between the fair-share keys are hundreds of ms.
LIVE = [
    Cell(0, 1800, 2, "A", "alice", "A"),
    Cell(450, 900, 1, "B", "bob", "B"),
    Cell(900, 900, 2, "C", "carol", "C"),
    Cell(1350, 900, 1, "D", "alice", "D"),
]


def test_live_server_and_simulation_grant_in_the_same_order(server_factory, redis_server, prefix):
    w = from_cells(LIVE)
    sim = lease_run(w, [2], redis_server, prefix + "sim")
    sim_order = [w.label[c] for c in sim.order]

    handle = server_factory(simulate="n1=2xA100-80GB")
    t0 = time.monotonic() + 0.3
    failures: list[BaseException] = []

    def run(cell: Cell) -> None:
        try:
            with handle.client(cell.user) as c:
                time.sleep(max(0.0, t0 + cell.arrival / 1000 - time.monotonic()))  # the trace's arrival time
                lease = c.acquire(gpus=cell.gpus, wait=30, ttl=30, label=cell.label)
                time.sleep(cell.dur / 1000)  # the cell's GPU-busy time
                c.release(lease)
        except BaseException as exc:  # surfaced below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(cell,)) for cell in LIVE]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not failures, failures
    with handle.client("root", "admin") as admin:
        grants = [e["label"] for e in admin.events("-", 1000) if e["type"] == "grant"]
    assert grants == sim_order == ["A", "C", "B", "D"]


def test_sessionize_keeps_the_trace_and_is_seeded():
    cells = [Cell(i * 7 * MIN, (1 + i % 5) * MIN, 1 + 3 * (i % 2), str(i)) for i in range(200)]
    a = workload.sessionize(cells, workload.SessionParams(seed=3))
    b = workload.sessionize(cells, workload.SessionParams(seed=3))
    assert a.n_cells == 200 and sorted(a.label, key=int) == [str(i) for i in range(200)]
    assert np.array_equal(a.session, b.session) and np.array_equal(a.user, b.user)
    # with no waiting, the closed loop reproduces every arrival of the trace
    arrival = {c.label: c.arrival for c in cells}
    assert [arrival[x] for x in a.label] == list(a.nominal_ready())
    # sessions never mix GPU counts and their cells never overlap
    for s in range(a.n_sessions):
        f, n = a.first[s], a.count[s]
        assert (a.gap[f + 1 : f + n] >= 0).all()


@pytest.mark.skipif(bool(missing(JUNE)), reason=missing(JUNE))
def test_generator_fitted_to_a_workload():
    cells = workload.load_trace(TRACE)[:3000]
    w = workload.sessionize(cells)
    f = workload.fit(w)
    g = workload.generate(f, days=3, seed=5)
    assert g.n_sessions > 0
    assert set(np.unique(g.gpus)) <= set(np.unique(w.gpus))
    assert set(np.unique(g.dur)) <= set(np.unique(w.dur))
    assert np.array_equal(g.dur, workload.generate(f, days=3, seed=5).dur)


def test_events_export_is_a_workload(tmp_path):
    lines = [
        {"type": "grant", "lease": "l1", "user": "ann", "gpus": [0, 1], "ts": 100.0, "waited_ms": 0, "session": "k"},
        {"type": "grant", "lease": "l2", "user": "ben", "gpus": [2], "ts": 130.0, "waited_ms": 10000},
        {"type": "released", "lease": "l1", "ts": 160.0},
        {"type": "expired", "lease": "l2", "ts": 190.0},
        {"type": "grant", "lease": "l3", "user": "ann", "gpus": [0, 1], "ts": 200.0, "waited_ms": 0, "session": "k"},
        {"type": "released", "lease": "l3", "ts": 230.0},
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = workload.sessionize(workload.load(path))
    assert w.users == ["ann", "ben"] and w.n_cells == 3
    assert sorted(w.dur.tolist()) == [30_000, 60_000, 60_000]
    ann = w.session[w.label.index("l1")]
    assert w.session[w.label.index("l3")] == ann and w.count[ann] == 2  # same notebook session
    assert w.gap[w.label.index("l3")] == 40_000


def test_cli_simulate_writes_table_csv_and_figure(tmp_path, redis_server):
    from click.testing import CliRunner

    from lease_server.cli import main

    trace = tmp_path / "t.csv"
    rows = ["job_id,num_gpu,submit_time,iterations,model_name,duration,interval"]
    rows += [f"{i},{[1, 4, 8][i % 3]},{i * 3},0,m,{1 + (i * 7) % 40},0" for i in range(60)]
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "res"
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--trace",
            str(trace),
            "--gpus",
            "16",
            "--redis-url",
            redis_server.url,
            "--out",
            str(out),
            "--policies",
            "calendar,culler-10m,culler-60m,lease,lease+booking",
        ],
    )
    assert result.exit_code == 0, result.output
    for name in ("calendar", "culler-10m", "culler-60m", "lease", "lease+booking"):
        assert name in result.output
    csv_text = (tmp_path / "res.csv").read_text().splitlines()
    assert csv_text[0].startswith("policy,gpus,gpu_hours_allocated") and len(csv_text) == 6
    assert (tmp_path / "res-users.csv").exists() and (tmp_path / "res.png").stat().st_size > 1000
    bad = CliRunner().invoke(main, ["simulate", "--trace", str(trace), "--gpus", "4"])
    assert bad.exit_code == 2 and "8 GPUs on one node" in bad.output
