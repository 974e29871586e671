"""The ``lease-share`` policy (issue 35 item 7): cells lease slices of their trace memory through the
real Lua, and co-tenants whose utilisations add up past 100 % stretch each other. Hand-made
templates whose outcome is known by hand, and the Adobe template's figures where it is present."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from lease_server.config import Settings
from lease_server.sim import command, report, share, workload
from lease_server.sim.replay import ReplaySetup, cluster
from lease_server.sim.run import simulate
from lease_server.sim.traces import ADOBE as ADOBE_FILE
from lease_server.sim.traces import missing, trace
from lease_server.sim.workload import MIN
from lease_server.store.keys import Keys
from tests.invariants import check_event_log, read_events

ADOBE = trace(ADOBE_FILE)
needs_adobe = pytest.mark.skipif(bool(missing(ADOBE_FILE)), reason=missing(ADOBE_FILE))


def training(start: int, dur: int, gpus: int, util: float, vram_gb: float | None) -> dict[str, Any]:
    """One cell of a template, in ticks (60 s); ``vram_gb`` for all its GPUs together (None: absent)."""
    t: dict[str, Any] = {
        "start_tick": start,
        "duration_in_ticks": dur,
        "end_tick": start + dur,
        "gpus": gpus,
        "gpu_utilizations": [{"utilization": util}] * gpus,
    }
    if vram_gb is not None:
        t["vram"] = vram_gb
    return t


def template(tmp_path: Path, *cells: dict[str, Any]) -> workload.Workload:
    """Each cell its own notebook, open all day."""
    doc = {
        "sessions": [
            {
                "id": f"n{i}",
                "start_tick": 0,
                "stop_tick": 600,
                "max_resource_request": {"gpus": t["gpus"]},
                "trainings": [t],
            }
            for i, t in enumerate(cells)
        ]
    }
    path = tmp_path / "share.json"
    path.write_text(json.dumps(doc))
    return workload.load_sessions(path)


def replay(w: workload.Workload, nodes: list[int], url: str, prefix: str, busy_pct: int = 50, **kw: Any):
    """lease-share kept in Redis, with the referee's view of its event log (``busy_pct``: the pool's
    slice_busy_pct; 101 places slices by memory alone)."""
    settings = dataclasses.replace(
        Settings(), redis_url=url, prefix=prefix, event_log_max=10**6, slice_busy_pct=busy_pct
    )
    r = share.lease_share(w, nodes, ReplaySetup(url, prefix, settings, keep=True), **kw)
    red = Redis.from_url(url, decode_responses=True)
    try:
        events = read_events(red, Keys(prefix))
        counts = check_event_log(events)
    finally:
        red.delete(*Keys(prefix).all())
        red.close()
    return r, events, counts


def minutes(r) -> list[float]:
    return [(int(e) - int(s)) / MIN for s, e in zip(r.start, r.extra["end"], strict=True)]


def test_vram_is_read_per_gpu_in_mb(tmp_path):
    w = template(tmp_path, training(0, 10, 1, 60, 2.0), training(0, 10, 4, 10, 8.0), training(0, 10, 1, 5, None))
    assert w.vram_mb.tolist() == [2048, 2048, 0]  # 8 GB over 4 GPUs; absent: 0
    assert share.slice_plan(w) == [2048, 0, 0]  # several GPUs, or memory unknown: whole GPUs
    assert share.slice_plan(w, "gang") == [2048, 2048, 0]  # one lease: 2 GB of each of its 4 GPUs
    with pytest.raises(ValueError, match="whole, gang"):
        share.slice_plan(w, "slices")  # the older what-if of one lease per slice is gone


def test_two_cells_at_60_percent_on_one_gpu_each_run_1_2_times_longer(tmp_path, redis_server):
    w = template(tmp_path, training(0, 10, 1, 60, 2.0), training(0, 10, 1, 60, 2.0))
    r, events, _ = replay(w, [1], redis_server.url, "share60")
    assert r.wait_ms.tolist() == [0, 0]
    assert minutes(r) == [pytest.approx(12), pytest.approx(12)]
    assert r.extra["slowdown"].tolist() == [pytest.approx(1.2), pytest.approx(1.2)]
    grants = [e for e in events if e["type"] == "grant"]
    assert [(g["node"], g["gpus"], g["gpu_mem_mb"]) for g in grants] == [("n0000", [0], 2048)] * 2
    f = report.figures(w, r)
    assert f["slowdown_p50"] == pytest.approx(1.2) and f["slowdown_p95"] == pytest.approx(1.2)
    assert f["slowed_cells"] == 2 and f["sliced_cells"] == 2


def test_under_100_percent_nobody_is_stretched(tmp_path, redis_server):
    w = template(tmp_path, training(0, 10, 1, 40, 2.0), training(0, 10, 1, 60, 2.0))
    r, _, _ = replay(w, [1], redis_server.url, "share100")
    assert minutes(r) == [10, 10] and r.wait_ms.tolist() == [0, 0]
    assert r.extra["slowdown_p95"] == 1.0 and r.extra["slowed_cells"] == 0


def test_the_stretch_is_recomputed_as_tenants_come_and_go(tmp_path, redis_server):
    # A (60 %) runs alone 0-5 (5 min of work), then beside B (60 %) at 1/1.2 speed: its last 5 min
    # of work take 6, it ends at 11. B does 6/1.2 = 5 min of work by 11, then its last 5 alone: 16.
    w = template(tmp_path, training(0, 10, 1, 60, 2.0), training(5, 10, 1, 60, 2.0))
    r, _, _ = replay(w, [1], redis_server.url, "sharecome")
    assert [int(x) / MIN for x in r.start] == [0, 5]
    assert [int(x) / MIN for x in r.extra["end"]] == [11, 16]
    assert r.extra["slowdown"].tolist() == [pytest.approx(1.1), pytest.approx(1.1)]


def test_a_slice_never_shares_a_gpu_past_its_memory(tmp_path, redis_server):
    # 40 GB GPUs: two 16 GB slices fit one, the third waits until one ends (nobody is stretched:
    # 10 % each), though the pool lets 4 share a GPU.
    w = template(tmp_path, *(training(0, 10, 1, 10, 16.0) for _ in range(3)))
    r, events, counts = replay(w, [1], redis_server.url, "sharemem")
    assert sorted(r.wait_ms.tolist()) == [0, 0, 10 * MIN]
    assert counts["grant"] == 3 and r.extra["peak_sharers"] == 2
    # on two GPUs nobody waits, and the third slice has a GPU of its own
    r2, events2, _ = replay(w, [2], redis_server.url, "sharemem2")
    assert r2.wait_ms.tolist() == [0, 0, 0]
    assert sorted(g["gpus"][0] for g in events2 if g["type"] == "grant") == [0, 0, 1]


def test_cells_on_several_gpus_or_without_memory_take_whole_gpus(tmp_path, redis_server):
    # A 2-GPU cell takes GPUs 0 and 1 whole; the slice cannot share them and waits for them.
    w = template(tmp_path, training(0, 10, 2, 90, 4.0), training(1, 10, 1, 5, 1.0), training(2, 10, 1, 5, None))
    r, events, _ = replay(w, [2], redis_server.url, "sharewhole")
    grants = {e["lease"]: e for e in events if e["type"] == "grant"}
    assert "gpu_mem_mb" not in grants["c0"] and grants["c0"]["gpus"] == [0, 1]
    assert grants["c1"]["gpu_mem_mb"] == 1024 and "gpu_mem_mb" not in grants["c2"]
    assert r.wait_ms.tolist() == [0, 9 * MIN, 8 * MIN]
    assert (r.extra["sliced_cells"], r.extra["whole_cells"]) == (1, 2)
    # away from busy GPUs (the default): a slice keeps GPU 0 90 % busy (the replay samples it, as an
    # agent would), so the next slice takes GPU 1 rather than slow it; by memory alone, it packs
    busy = template(tmp_path, training(0, 10, 1, 90, 4.0), training(1, 10, 1, 5, 1.0))
    for busy_pct, gpu in ((50, 1), (101, 0)):
        rb, eventsb, _ = replay(busy, [2], redis_server.url, f"shareaway{busy_pct}", busy_pct=busy_pct)
        assert [e["gpus"] for e in eventsb if e["type"] == "grant"] == [[0], [gpu]], busy_pct
        assert rb.wait_ms.tolist() == [0, 0] and minutes(rb) == [10, 10]
    # as the server leases it (gang): one lease of a slice on each of GPUs 0 and 1 of the node; the
    # 1-GPU slice shares with it by memory, and the memoryless cell waits for a whole GPU
    r4, events4, counts4 = replay(w, [2], redis_server.url, "sharegang", multi="gang", busy_pct=101)
    grants4 = {e["lease"]: e for e in events4 if e["type"] == "grant"}
    assert grants4["c0"]["gpus"] == [0, 1] and grants4["c0"]["gpu_mem_mb"] == 2048 and "c0.1" not in grants4
    assert r4.wait_ms.tolist()[:2] == [0, 0] and r4.wait_ms.tolist()[2] > 0
    assert counts4["grant"] == 3


@needs_adobe
def test_adobe_share_figures_and_no_gpu_promised_past_its_memory(redis_server):
    """lease-share on the Adobe template at 56 GPUs: multi-GPU cells on whole GPUs, the 1-GPU cells
    on slices; the referee sees every slice within its GPU's memory; waits no worse than lease's."""
    w = workload.load_sessions(ADOBE)
    assert int((w.vram_mb > 0).sum()) == w.n_cells and int(w.vram_mb.max()) <= 5 * 1024
    base = command.baseline(w, 56, redis_url=redis_server.url)
    r, events, counts = replay(w, cluster(56), redis_server.url, "shareadobe")
    f = report.figures(w, r)
    assert (f["sliced_cells"], f["whole_cells"]) == (329, 189)
    assert counts["grant"] == w.n_cells and any(e.get("gpu_mem_mb") for e in events)
    assert 1.0 <= f["slowdown_p50"] <= f["slowdown_p95"] <= f["slowdown_max"]
    assert f["wait_p99_s"] <= base["wait_p99_s"]
    assert (r.start >= r.ready).all() and (r.extra["end"] >= r.start + w.dur).all()
    rows = [report.figures(w, x) for x in simulate(w, cluster(56), ["lease-share"], redis_url=redis_server.url)]
    assert rows[0]["wait_p99_s"] == f["wait_p99_s"]
