"""Teams and their bookings for the ``lease+booking`` policy (gpulease + bookings).

The traces have users but no teams, so the users are dealt into ``teams`` teams in rank order
(user k joins team ``k % teams``: with Zipf-weighted users every team gets one heavy user and a
tail of light ones). Together the teams book ``share`` of the pool's GPUs, split between them in
proportion to the GPU-time their cells use (largest remainder, whole GPUs), as weekly repeating
bookings of the window ``[window_h[0], window_h[1])`` hours after the start of each week of the
workload (the default, 0-168, books the whole week: the June trace is as busy at night and on
weekends as by day). The bookings are made through ``lease_server.leasing.bookings.Bookings`` before
the first cell, so the capacity check and everything after it is the server's own code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .workload import HOUR, Workload

WEEK_MS = 7 * 24 * HOUR
MAX_WEEKS = 52  # the most occurrences a weekly booking may have


@dataclass(frozen=True)
class BookingParams:
    teams: int = 4
    share: float = 0.5  # of the pool's GPUs booked by all teams together
    window_h: tuple[float, float] = (0.0, 168.0)  # booked hours of each week, from the workload's start


@dataclass(frozen=True)
class Booking:
    team: str
    gpus: int
    start_ms: int  # virtual ms from the workload's start (occurrence 0)
    end_ms: int
    occurrences: int


def teams_of(w: Workload, params: BookingParams) -> dict[str, list[str]]:
    """team -> members: users dealt round-robin in rank order."""
    n = max(1, min(params.teams, len(w.users)))
    out: dict[str, list[str]] = {f"team{k}": [] for k in range(n)}
    for k, u in enumerate(w.users):
        out[f"team{k % n}"].append(u)
    return out


def bookings(w: Workload, gpus: int, params: BookingParams) -> list[Booking]:
    """One weekly booking per team, covering the workload (see the module's docstring)."""
    if not 0 <= params.share <= 1:
        raise ValueError(f"the booked share must be between 0 and 1, got {params.share}")
    lo, hi = params.window_h
    if not 0 <= lo < hi <= 168:
        raise ValueError(f"the weekly window must lie within 0-168 h, got {lo}-{hi}")
    teams = teams_of(w, params)
    index = {u: k for k, u in enumerate(w.users)}
    per_user = np.bincount(w.cell_user, weights=w.dur.astype(np.float64) * w.cell_gpus, minlength=len(w.users))
    demand = np.array([sum(per_user[index[u]] for u in members) for members in teams.values()])
    total = int(params.share * gpus)
    if total == 0 or demand.sum() == 0:
        return []
    exact = demand / demand.sum() * total
    got = np.floor(exact).astype(int)
    for k in np.argsort(-(exact - got), kind="stable")[: total - int(got.sum())]:
        got[k] += 1
    t0 = int(w.start.min()) if w.n_sessions else 0
    weeks = min(MAX_WEEKS, max(1, -(-(w.span_ms() - t0) // WEEK_MS) + 1))  # +1: cells delayed past the end
    start, end = t0 + int(lo * HOUR), t0 + int(hi * HOUR)
    return [
        Booking(team, int(g), start, end, int(weeks))
        for team, g in zip(teams, got.tolist(), strict=True)
        if g > 0 and teams[team]
    ]
