"""The per-window fairness measure of lease_server/sim/fairness.py, on cases computed by hand."""

from __future__ import annotations

import math

import pytest

from lease_server.sim.fairness import max_min_fair, windowed_fairness

W = 600.0  # one 10-minute window, in seconds


def test_max_min_fair_water_fills():
    assert max_min_fair({"a": 10, "b": 10}, 10) == {"a": 5, "b": 5}
    # a asks for less than an equal split: it gets all it asked, b the rest
    assert max_min_fair({"a": 2, "b": 10}, 10) == {"a": 2, "b": 8}
    # three levels: c is capped at 1, then a and b split what is left
    assert max_min_fair({"a": 9, "b": 9, "c": 1}, 7) == {"a": 3, "b": 3, "c": 1}
    # more capacity than demand: everyone gets their demand
    assert max_min_fair({"a": 1, "b": 2}, 10) == {"a": 1, "b": 2}
    assert max_min_fair({}, 10) == {}


def test_two_users_equal_demand_equal_share():
    # One GPU all window long. a runs the whole window; b queued the whole window for one GPU.
    # Fair: 300 GPU-s each of the 600 delivered. |600-300| + |0-300| over 600 = 1.
    demand = [("a", 0, W, 1), ("b", 0, W, 1)]
    received = [("a", 0, W, 1)]
    f = windowed_fairness(demand, received, 0, W, W)
    (win,) = f.windows
    assert win.fair == {"a": 300, "b": 300}
    assert win.received == {"a": 600}
    assert f.deviation == pytest.approx(1.0)
    # Each holding the GPU half the window (a then b): exactly fair.
    f = windowed_fairness(demand, [("a", 0, W / 2, 1), ("b", W / 2, W, 1)], 0, W, W)
    assert f.deviation == 0


def test_a_user_only_queued_gets_credit_for_its_demand():
    # Two GPUs. a holds both for the whole window; b queued one GPU for the last 120 s only.
    # Demand a 1200, b 120; delivered 1200; fair: b its whole 120, a the other 1080.
    demand = [("a", 0, W, 2), ("b", 480, W, 1)]
    received = [("a", 0, W, 2)]
    (win,) = windowed_fairness(demand, received, 0, W, W).windows
    assert win.demand == {"a": 1200, "b": 120}
    assert win.fair == {"a": 1080, "b": 120}
    assert win.misallocated == 240
    assert win.deviation == pytest.approx(240 / 1200)


def test_a_user_capped_by_small_demand_leaves_the_rest_to_the_other():
    # Four GPUs. a asks for one GPU all window; b for four. a gets 1, b 3: max-min fair although
    # b gets three times as much.
    demand = [("a", 0, W, 1), ("b", 0, W, 4)]
    received = [("a", 0, W, 1), ("b", 0, W, 3)]
    f = windowed_fairness(demand, received, 0, W, W)
    assert f.windows[0].fair == {"a": 600, "b": 1800}
    assert f.deviation == 0
    # Giving a a second GPU it did not ask for is impossible; giving b all four while a waits is not
    # fair: a is owed 600 it did not get, b got 600 beyond its 1800.
    f = windowed_fairness(demand, [("b", 0, W, 4)], 0, W, W)
    assert f.deviation == pytest.approx(1200 / 2400)


def test_only_delivered_gpu_time_is_divided():
    # Eight GPUs, one user running one of them: nobody else asked, so the idle seven are no unfairness.
    f = windowed_fairness([("a", 0, W, 1)], [("a", 0, W, 1)], 0, W, W)
    assert f.windows[0].fair == {"a": 600}
    assert f.deviation == 0


def test_windows_weighted_by_gpu_time():
    # Window 0: 1 GPU, a holds it while b waits (deviation 1, 600 GPU-s delivered).
    # Window 1: a, b and c each ask for one GPU and each hold one: fair 600 each, deviation 0
    # (1800 GPU-s delivered).
    # Weighted: (600 + 0) / (600 + 1800) = 0.25, not the unweighted mean of the windows, 0.5.
    demand = [("a", 0, 2 * W, 1), ("b", 0, 2 * W, 1), ("c", W, 2 * W, 1)]
    received = [("a", 0, 2 * W, 1), ("b", W, 2 * W, 1), ("c", W, 2 * W, 1)]
    f = windowed_fairness(demand, received, 0, 2 * W, W)
    assert [w.deviation for w in f.windows] == [pytest.approx(1.0), 0]
    assert f.deviation == pytest.approx(600 / 2400)
    assert f.by_user() == {"a": (1200, 900), "b": (600, 900), "c": (600, 600)}


def test_spans_are_cut_at_window_edges_and_the_horizon():
    # A span from -100 to 1500 over [0, 1000) with windows of 400: 400, 400, 200 (the last window is
    # short); what lies outside [0, 1000) is not counted. Windows with nothing delivered are left out.
    f = windowed_fairness([("a", -100, 1500, 2), ("b", 0, 1000, 1)], [("a", -100, 1500, 2)], 0, 1000, 400)
    assert [w.start for w in f.windows] == [0, 400, 800]
    assert [w.received["a"] for w in f.windows] == [800, 800, 400]
    assert [w.demand["b"] for w in f.windows] == [400, 400, 200]
    f = windowed_fairness([("a", 0, 300, 1)], [("a", 0, 300, 1)], 0, 1000, 400)
    assert len(f.windows) == 1


def test_nothing_delivered_is_nan_and_bad_windows_are_refused():
    assert math.isnan(windowed_fairness([("a", 0, W, 1)], [], 0, W, W).deviation)
    with pytest.raises(ValueError):
        windowed_fairness([], [], 0, W, 0)


def test_locked_part_counts_grants_spanning_a_whole_window():
    # One GPU, windows of 600. a's grant runs 0..900 (spans window 0 whole), b's 900..1200.
    # Both ask from 0. Window 0: a 600, b 0, fair 300 each: a's 300 beyond its share is locked (no
    # decision inside the window could change it): locked 300, misallocated 600.
    # Window 1: a 300, b 300, fair 300 each: nothing misallocated; a's grant does not span it.
    demand = [("a", 0, 900, 1), ("b", 0, 1200, 1)]
    received = [("a", 0, 900, 1), ("b", 900, 1200, 1)]
    f = windowed_fairness(demand, received, 0, 1200, 600)
    assert [w.spanning for w in f.windows] == [{"a": 600}, {}]
    assert [w.locked for w in f.windows] == [300, 0]
    assert f.deviation == pytest.approx(600 / 1200)
    assert f.locked_deviation == pytest.approx(2 * 300 / 1200)  # here all of it
