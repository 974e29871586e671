"""Fair share as users feel it: each user's GPU-time against a max-min fair division, window by window.

A whole-day comparison (each user's GPU-time over the day against a whole-day max-min share) ignores
when demand arrives: a user who ran a 16-GPU sweep in the morning and a user who queued all
afternoon can both come out "fair" over the day. :func:`windowed_fairness` compares instead, in each
window (10 minutes by default):

* a user's **demand**: the GPU-seconds they could have used in the window -- the GPUs of each of
  their requests, running or still queued, times the part of the window the request was running
  or queued (a queued request counts all that time, as a scheduler sees it, even if its work
  would have taken less);
* what the user **received**: the GPU-seconds their running requests held in the window;
* their **fair** share: the max-min fair (water-filling) division of the GPU-time delivered in the
  window among the users with demand in it, nobody's share above their own demand.

The GPU-time divided is the GPU-time actually *delivered* in the window (the sum of what users
received), not the pool's capacity x the window's length: GPUs left idle because nobody asked
for them are nobody's loss, and would otherwise show as unfairness. (GPUs left idle while someone
waited, a packing loss, are another figure: utilization, not fairness.)

The deviation is the GPU-time-weighted mean of ``|received - fair| / fair`` over users and windows,
each term weighted by its fair share: ``sum |received - fair| / sum fair``. Within a window the
shares add up to what was delivered, so this is twice the fraction of the delivered GPU-time that
went to a user beyond their fair share (0: every window divided max-min fairly; 0.2: a tenth of the
GPU-time went to someone who already had their share).

Without preemption a grant holds its GPUs until the request ends, so part of the deviation can be
beyond any scheduler's reach: a request that runs through a whole window gives its user its GPUs
for all of it, however small their fair share there. :attr:`WindowedFairness.locked_deviation` is
that part -- the GPU-time users got from grants spanning a whole window beyond their fair share,
counted as the deviation counts it -- which no decision taken during the window could have undone.

Times and GPU counts are plain numbers in any one unit (ms or s); nothing here touches Redis.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Span = tuple[str, float, float, float]
"""``(user, start, end, gpus)``: ``gpus`` GPUs over ``[start, end)``."""


def max_min_fair(demand: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: every user gets ``min(demand, level)``, the level set so the shares add up to
    ``capacity`` (or every user gets their whole demand, if it adds up to less)."""
    share: dict[str, float] = {}
    left, users = capacity, sorted(demand, key=lambda u: demand[u])
    while users:
        level = left / len(users)
        u = users[0]
        if demand[u] <= level:
            share[u] = demand[u]
            left -= demand[u]
            users.pop(0)
        else:
            for v in users:
                share[v] = level
            break
    return share


@dataclass
class Window:
    """One window: its start, and per user the GPU-time demanded, received and fair (same unit as
    the spans: GPU-ms for spans in ms)."""

    start: float
    demand: dict[str, float]
    received: dict[str, float]
    fair: dict[str, float]
    spanning: dict[str, float] = field(default_factory=dict)  # received from grants spanning the window

    @property
    def delivered(self) -> float:
        return sum(self.received.values())

    @property
    def misallocated(self) -> float:
        """``sum |received - fair|`` over the users of the window."""
        users = set(self.fair) | set(self.received)
        return sum(abs(self.received.get(u, 0.0) - self.fair.get(u, 0.0)) for u in users)

    @property
    def deviation(self) -> float:
        """This window's ``sum |received - fair| / sum fair`` (NaN if nothing was delivered)."""
        fair = sum(self.fair.values())
        return self.misallocated / fair if fair > 0 else math.nan

    @property
    def locked(self) -> float:
        """``sum max(0, spanning - fair)``: GPU-time beyond their fair share that users got from grants
        running through the whole window (half of the misallocation it forces: as much is missing
        from someone else's share)."""
        return sum(max(0.0, v - self.fair.get(u, 0.0)) for u, v in self.spanning.items())


@dataclass
class WindowedFairness:
    """The windows of a day and the weighted deviation over all of them."""

    window: float
    windows: list[Window] = field(default_factory=list)

    @property
    def deviation(self) -> float:
        """``sum |received - fair| / sum fair`` over all users and windows (NaN if nothing was
        delivered)."""
        fair = sum(sum(w.fair.values()) for w in self.windows)
        return sum(w.misallocated for w in self.windows) / fair if fair > 0 else math.nan

    @property
    def locked_deviation(self) -> float:
        """The part of :attr:`deviation` forced by grants that span whole windows (``2 * sum locked /
        sum fair``): a floor for any scheduler that kept those grants, though not for one that had
        placed them otherwise."""
        fair = sum(sum(w.fair.values()) for w in self.windows)
        return 2 * sum(w.locked for w in self.windows) / fair if fair > 0 else math.nan

    def by_user(self) -> dict[str, tuple[float, float]]:
        """Per user, ``(received, fair)`` summed over the windows."""
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for w in self.windows:
            for u, r in w.received.items():
                out[u][0] += r
            for u, f in w.fair.items():
                out[u][1] += f
        return {u: (r, f) for u, (r, f) in out.items()}


def _per_window(
    spans: Iterable[Span], t0: float, t1: float, window: float, n: int
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """GPU-time of the spans in each of the ``n`` windows ``[t0 + i * window, ...)``, per user (the
    parts of spans outside ``[t0, t1)`` are not counted); and that of the spans that cover the whole
    window."""
    out: list[dict[str, float]] = [defaultdict(float) for _ in range(n)]
    whole: list[dict[str, float]] = [defaultdict(float) for _ in range(n)]
    for user, start, end, gpus in spans:
        lo, hi = max(start, t0), min(end, t1)
        if hi <= lo or gpus <= 0:
            continue
        first = int((lo - t0) // window)
        last = min(n - 1, int(math.ceil((hi - t0) / window)) - 1)
        for i in range(first, last + 1):
            w_lo = t0 + i * window
            w_hi = min(w_lo + window, t1)
            overlap = min(hi, w_hi) - max(lo, w_lo)
            if overlap > 0:
                out[i][user] += overlap * gpus
                if start <= w_lo and end >= w_hi:
                    whole[i][user] += overlap * gpus
    return out, whole


def windowed_fairness(
    demand: Iterable[Span], received: Iterable[Span], t0: float, t1: float, window: float
) -> WindowedFairness:
    """Per-window max-min fairness of ``received`` GPU-time against ``demand`` over ``[t0, t1)``.

    ``demand``: one span per request, from when it was asked for until it ended (its run included,
    so a request that is running counts in its user's demand too; one never granted: until it was
    given up, or ``t1``); ``received``: one span per grant, from the grant to the release. The last
    window may be shorter than ``window``. Each window's delivered GPU-time (the sum received in it)
    is divided max-min fairly among the users with demand in it, capped by that demand; a window in
    which nothing was delivered is left out. See the module's docstring for the deviation.
    """
    if window <= 0 or t1 <= t0:
        raise ValueError(f"need window > 0 and t1 > t0 (got window={window}, t0={t0}, t1={t1})")
    n = int(math.ceil((t1 - t0) / window))
    dem, _ = _per_window(demand, t0, t1, window, n)
    got, spanning = _per_window(received, t0, t1, window, n)
    out = WindowedFairness(window=window)
    for i in range(n):
        delivered = sum(got[i].values())
        if delivered <= 0:
            continue
        # Received GPU-time is demanded GPU-time; should a caller's demand miss some, the user is
        # still entitled to what they were seen to use.
        d = {u: max(dem[i].get(u, 0.0), got[i].get(u, 0.0)) for u in set(dem[i]) | set(got[i])}
        d = {u: v for u, v in d.items() if v > 0}
        out.windows.append(
            Window(
                start=t0 + i * window,
                demand=d,
                received=dict(got[i]),
                fair=max_min_fair(d, delivered),
                spanning=dict(spanning[i]),
            )
        )
    return out
