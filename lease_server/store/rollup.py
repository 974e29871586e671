"""The hourly usage rollups: one row per (hour, pool, user), summed from the ledger lines of the
leases held in that hour: each lease's GPU-seconds spread evenly over the hours it was held (at
most :data:`SPLIT_HOURS`; a longer lease puts its earlier share in the first of them), the lease
itself, its wait and its warm cells counted in the hour it was granted. A row is written after its
lease ends: a lease still held is in no row yet.

``lua/_lib_end.lua`` (``fold_rollups``) adds the ledger lines written since the last fold to their
rows, in batches: from each sweep (every half second) and from a reader before it reads
(``leasing/usage.py`` ``fold_pending``), so a reader sees every lease that has ended, and the
release that writes a line does not pay for its rows. :func:`fold` is the same sum in Python, by
which ``gpulease migrate`` builds the rows of an older store from its ledger (layout 4), and
:func:`quantile` reads the wait sketch. Keys: ``keys.py`` ``rollup`` (the rows), ``rollup_idx``
(their names in order, so a range of hours is one range read) and ``rollup_at`` (the last ledger
line folded).

A row (JSON) holds, for the leases held in its hour (shares: of each lease's time, in that hour):

``n``          leases granted in that hour (each one's first cell)
``held``       GPU-seconds held, warm time excluded (its share of the ledger's ``gpu_s``)
``sampled``    of those, GPU-seconds of leases the node agent sampled
``used``       GPU-seconds busy by the samples (``gpu_s`` x ``busy_frac``, the ledger's estimate)
``warm``       warm GPU-seconds (kept warm, lendable: not use)
``wait_ms``    the sum of the waits of the leases granted in that hour, ms
``wh``         the waits as a sketch {bucket: count}: "0" for no wait (under 1 ms), bucket k >= 1
               for waits in (G^(k-2), G^(k-1)] ms with G = 1.02, so a percentile read back is
               within 1 % of the exact one
``reclaimed``  GPU-seconds (held + warm) of leases taken back in use: idle reclaim, a booking's
               recall, preemption (or under such a recall when they ended)
``evicted``    GPU-seconds (held + warm) of warm leases lent out to a waiting request
``warm_cells`` cells that started on a warm worker (a warm lease run again)
``teams``      the user's teams, as the latest line said

Bounds: rows are kept :data:`KEEP_DAYS` days (each row written removes up to 4 older than that, so
expired rows never pile up: at most one row is made per write), and an hour has at most
:data:`ROWS_PER_HOUR` rows (a user past that is summed into ``~other`` of the pool).
"""

from __future__ import annotations

import math
from typing import Any

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
KEEP_DAYS = 400
ROWS_PER_HOUR = 5000
SPLIT_HOURS = 336  # a lease held longer puts its earlier share in the first of these (lua: the same)
GAMMA = 1.02  # the wait sketch's bucket ratio: relative error (G - 1) / (G + 1) < 1 %
OTHER = "~other"
TOTAL = "~total"  # the field prefix of a pool's running totals (total_field)
FIGURES = ("n", "held", "sampled", "used", "warm", "wait_ms", "reclaimed", "evicted", "warm_cells")
TAKEN = {
    "evicted": "evicted",
    "suspended": "evicted",
    "reclaimed": "reclaimed",
    "recalled": "reclaimed",
    "preempted": "reclaimed",
}


def hour_name(hour: int) -> str:
    """An hour (since the epoch) as row names write it: zero-padded, so names sort by time."""
    return f"{hour:07d}"


def field(hour: int, pool: str, user: str) -> str:
    return f"{hour_name(hour)}|{pool}|{user}"


def parse_field(name: str) -> tuple[int, str, str]:
    """(hour, pool, user) of a row's name."""
    hour, pool, user = name.split("|", 2)
    return int(hour), pool, user


def wait_bucket(ms: float) -> str:
    """The sketch bucket of a wait of ``ms`` (as add_rollup computes it)."""
    if ms < 1:
        return "0"
    return str(math.ceil(math.log(ms) / math.log(GAMMA) - 1e-9) + 1)


def bucket_value(bucket: str) -> float:
    """The wait a bucket stands for: within 1 % of every wait in it."""
    k = int(bucket)
    return 0.0 if k == 0 else 2 * GAMMA ** (k - 1) / (GAMMA + 1)


def quantile(sketch: dict[str, int], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of the waits in ``sketch``: the wait of rank ceil(q * count)
    in order, within 1 %; None for no waits."""
    count = sum(sketch.values())
    if not count:
        return None
    rank = max(1, math.ceil(q * count - 1e-9))
    seen = 0
    for bucket in sorted(sketch, key=int):
        seen += sketch[bucket]
        if seen >= rank:
            return bucket_value(bucket)
    return None  # (unreachable: the ranks add up to count)


def taken(line: dict[str, Any]) -> str | None:
    """ "reclaimed", "evicted" or None: whether the server took the ledger line's lease back."""
    return TAKEN.get(line.get("recall") or line.get("cause") or line.get("state") or "")


def empty() -> dict[str, Any]:
    return {**dict.fromkeys(FIGURES, 0), "wh": {}}


def spread(line: dict[str, Any]) -> list[tuple[int, float]]:
    """The hours ledger line ``line``'s lease was held, each with its share of the time (as
    add_rollup spreads it): the first of them is where the lease itself is counted."""
    last = int(line["end"]) // HOUR_MS
    begin = min(int(line.get("start", line["end"])), int(line["end"]))
    first = max(begin // HOUR_MS, last - SPLIT_HOURS + 1)
    span = int(line["end"]) - begin
    if span <= 0:
        return [(last, 1.0)]
    out = []
    for hour in range(first, last + 1):
        lo = begin if hour == first else hour * HOUR_MS
        hi = int(line["end"]) if hour == last else (hour + 1) * HOUR_MS
        out.append((hour, (hi - lo) / span))
    return out


def total_field(pool: str) -> str:
    """The field of ``pool``'s running totals in the rollup hash (every lease ended, whole, as it
    ended; not in the index, so no range of rows includes it): /metrics' counters read it."""
    return f"{TOTAL}|{pool}"


def _add_line(row: dict[str, Any], line: dict[str, Any], share: float, first: bool) -> None:
    gpu_s = float(line.get("gpu_s", line["held_s"] * line["gpus"]))
    warm = float(line.get("warm_gpu_s") or 0)
    how = taken(line)
    row["held"] += gpu_s * share
    if line.get("busy_frac") is not None:
        row["sampled"] += gpu_s * share
        row["used"] += gpu_s * share * line["busy_frac"]
    row["warm"] += warm * share
    if how:
        row[how] += (gpu_s + warm) * share
    if first:
        row["n"] += 1
        ms = float(line.get("waited_s") or 0) * 1000
        row["wait_ms"] += ms
        b = wait_bucket(ms)
        row["wh"][b] = row["wh"].get(b, 0) + 1
        row["warm_cells"] += int(line.get("warm_cells") or 0)


def fold(rows: dict[str, dict[str, Any]], line: dict[str, Any], per_hour: dict[int, int]) -> None:
    """Add ledger line ``line`` to its rows of ``rows`` (name -> row) and to its pool's totals, as
    add_rollup does in Lua; ``per_hour`` counts the rows of each hour (for the bound), kept here."""
    for k, (hour, share) in enumerate(spread(line)):
        name = field(hour, line["pool"], line["user"])
        if name not in rows and per_hour.get(hour, 0) >= ROWS_PER_HOUR:
            name = field(hour, line["pool"], OTHER)
        if name not in rows:
            rows[name] = empty()
            per_hour[hour] = per_hour.get(hour, 0) + 1
        _add_line(rows[name], line, share, k == 0)
        rows[name]["teams"] = line.get("teams") or ""
    _add_line(rows.setdefault(total_field(line["pool"]), empty()), line, 1.0, True)


def add(into: dict[str, Any], row: dict[str, Any]) -> None:
    """Sum ``row`` into ``into`` (figures and sketch)."""
    for f in FIGURES:
        into[f] += row.get(f, 0)
    for b, c in (row.get("wh") or {}).items():
        into["wh"][b] = into["wh"].get(b, 0) + c
