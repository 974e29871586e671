#!/usr/bin/env python
"""The Usage tab's load against the board's, for 30 days of a 50-user, 64-GPU team (issue 38).

    nice -n 10 .venv/bin/python bench/usage_page_bench.py [--days 30] [--users 50] [--gpus 64] [--repeat 5] [--smoke]

It plays the days into its own Redis through the real scripts (the simulator's replay, policy
lease-warm, its virtual clock set so that the days end now), starts a lease server on that data and
a JupyterLab (with the extension as built in this tree, as tests/test_ui.py does) as one of the
users, and in Debian's Chromium opens the GPU Leases panel and times, from a tab's click to
everything on it drawn:

usage_page_ms   the Usage tab switched to its 30-day range: both summary answers in, a row a day in
                its tables and every chart drawn (target <= 1000), the median of --repeat
usage_open_ms   (no target) the tab's click to its default range (7 days) drawn
board_page_ms   the Board tab: a tile for every GPU of the inventory (the baseline, the same run)
usage_fetch_ms  (no target) the tab's own figure for its two summary requests (its data-load-ms)
summary_ms      (no target) GET /usage/summary of the 30 days over HTTP, without a browser
rollup_rows     (no target) the rollup rows of those days (what a summary reads)

Nothing here asserts: a bench prints. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import _common  # noqa: E402
from bench._common import json_line, private_redis, say  # noqa: E402

DAY_MS = 86_400_000
TARGET_MS = 1000.0


def workload(days: int, users: int, seed: int = 11) -> Any:
    """``days`` of notebook sessions of ``users`` people: one or two a working day each, 3 to 8
    cells of 5 to 90 minutes on 1, 2 or 4 GPUs, a few minutes of thought between them."""
    from lease_server.sim import workload as wl

    rng = random.Random(seed)
    cells = []
    for day in range(days):
        for u in range(users):
            for k in range(rng.choice((1, 1, 2))):
                t = day * DAY_MS + rng.randint(7, 17) * 3_600_000 + rng.randint(0, 59) * 60_000
                gpus = rng.choice((1, 1, 2, 4))
                for c in range(rng.randint(3, 8)):
                    dur = rng.randint(5, 90) * 60_000
                    label = f"u{u:02d}-{day}-{k}-{c}"
                    cells.append(wl.Cell(t, dur, gpus, label, f"u{u:02d}", f"u{u:02d}-{day}-{k}"))
                    t += dur + rng.randint(1, 20) * 60_000
    return wl.from_cells(cells, "usage-bench")


def play(redis_url: str, prefix: str, days: int, users: int, gpus: int) -> int:
    """The workload through the real scripts, ending now; returns the ledger lines it wrote."""
    from redis import Redis

    from lease_server.config import Settings
    from lease_server.sim import replay
    from lease_server.store import layout
    from lease_server.store.keys import Keys

    # the replay's virtual clock: its first day begins ``days`` + 1 days ago (UTC midnight)
    today = int(time.time() * 1000) // DAY_MS * DAY_MS
    replay.EPOCH_MS = today - days * DAY_MS
    setup = replay.ReplaySetup(redis_url, prefix, Settings(redis_url=redis_url, prefix=prefix), keep=True)
    replay.lease(workload(days, users), [8] * (gpus // 8), setup, policy="lease-warm")
    r = Redis.from_url(redis_url, decode_responses=True)
    try:
        r.set(Keys(prefix).layout, layout.LAYOUT)
        return int(r.xlen(Keys(prefix).ledger))
    finally:
        r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--gpus", type=int, default=64, help="GPUs, 8 per node")
    ap.add_argument("--repeat", type=int, default=5, help="opens of each tab timed (the median is the figure)")
    args = _common.parse_args(ap, users=2, gpus=8, repeat=1)

    from tests.conftest import ServerHandle, make_settings
    from tests.test_ui import CHROMIUM, CHROMIUM_ARGS, TIME_ZONE, Lab, palette_item

    out: dict[str, Any] = {"days": args.days, "users": args.users, "gpus": args.gpus}
    with private_redis("usage-page-bench-") as (redis, tmpdir):
        prefix = "upb"
        t0 = time.monotonic()
        out["ledger_lines"] = play(redis.url, prefix, args.days, args.users, args.gpus)
        out["replay_s"] = round(time.monotonic() - t0, 1)
        say(f"  replayed {out['ledger_lines']} leases of {args.days} days in {out['replay_s']} s")
        settings = make_settings(redis.url, prefix, reclaim_enabled=False)
        server = ServerHandle(settings, "").start()  # the replay's nodes (pool "sim") are the inventory
        lab = None
        try:
            user = "u00"
            client = server.client(user)
            lo = (int(time.time() * 1000) // DAY_MS - args.days + 1) * DAY_MS
            times = []
            for _ in range(args.repeat):
                s0 = time.perf_counter()
                summary = client.request("GET", "/api/v1/usage/summary", params={"from": lo // 1000, "by": "user"})
                times.append((time.perf_counter() - s0) * 1000)
            out["summary_ms"] = round(statistics.median(times), 1)
            out["summary_groups"] = len(summary["groups"])
            from redis import Redis

            from lease_server.store import rollup
            from lease_server.store.keys import Keys

            r = Redis.from_url(redis.url, decode_responses=True)
            lo_h = lo // rollup.HOUR_MS
            out["rollup_rows"] = len(r.zrangebylex(Keys(prefix).rollup_idx, f"[{rollup.hour_name(lo_h)}|", "+"))
            r.close()

            lab = Lab(Path(tempfile.mkdtemp(dir=tmpdir)) / "lab", server.url, server.token(user))
            out.update(browse(lab, args.gpus, args.days, args.repeat, CHROMIUM, CHROMIUM_ARGS, TIME_ZONE, palette_item))
        finally:
            if lab is not None:
                lab.stop()
            server.stop()
    usage, board = out.get("usage_page_ms"), out.get("board_page_ms")
    say(f"usage_page_ms  {usage} (target <= {TARGET_MS:g})  board_page_ms {board}  (median of {args.repeat})")
    if usage and board:
        out["usage_over_board"] = round(usage / board, 2)
    print(json_line(out, first=("usage_page_ms", "board_page_ms", "usage_over_board")))


def browse(
    lab: Any, gpus: int, days: int, repeat: int, chromium: str, chromium_args: list[str], tz: str, palette: Any
) -> dict[str, Any]:
    """Open the panel, then time ``repeat`` clicks of each tab to everything on it drawn."""
    from playwright.sync_api import expect, sync_playwright

    usage_ms: list[float] = []
    board_ms: list[float] = []
    fetch_ms: list[float] = []
    open_ms: list[float] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=chromium_args)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 900}, timezone_id=tz).new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{lab.url}lab?reset&token={lab.token}")
            expect(page.locator(".jp-LauncherCard", has_text="GPU Leases")).to_be_visible()
            palette(page, "GPU Leases").click()
            expect(page.get_by_role("heading", name="GPU Leases")).to_be_visible()
            usage_tab, board_tab = page.get_by_role("tab", name="Usage"), page.get_by_role("tab", name="Board")
            panel = page.get_by_role("tabpanel", name="Usage")
            loaded = panel.locator(".jp-GpuLease-usage[data-load-ms]")
            charts = panel.locator(".jp-GpuLease-chart > figure > svg, .jp-GpuLease-chart > svg")
            split = re.compile(r"^What the GPU-(hours|minutes|seconds) were")  # its unit follows the figures
            per_day = panel.get_by_role("table", name=split).locator("tbody tr")
            board = page.get_by_role("region", name="GPU board")
            tiles = board.get_by_role("cell", name=re.compile(r" GPU \d+: "))
            # the first open of each tab warms the page's code: not timed
            usage_tab.click()
            expect(loaded).to_have_count(1)
            n_charts = charts.count()
            board_tab.click()
            expect(tiles).to_have_count(gpus)
            for _ in range(repeat):
                t0 = time.perf_counter()
                usage_tab.click()  # it mounts again, on its default range (7 days), and draws it
                expect(loaded).to_have_count(1)
                expect(per_day).to_have_count(7)
                expect(charts).to_have_count(n_charts)
                open_ms.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                panel.get_by_role("radiogroup", name="Range").get_by_role("radio", name="30 days").click()
                expect(per_day).to_have_count(days)
                expect(loaded).to_have_count(1)
                expect(charts).to_have_count(n_charts)
                usage_ms.append((time.perf_counter() - t0) * 1000)
                fetch_ms.append(float(loaded.get_attribute("data-load-ms") or "nan"))
                t0 = time.perf_counter()
                board_tab.click()
                expect(tiles).to_have_count(gpus)
                board_ms.append((time.perf_counter() - t0) * 1000)
        except Exception:
            page.screenshot(path="/tmp/usage_page_bench_fail.png")
            raise
        finally:
            browser.close()
    return {
        "usage_page_ms": round(statistics.median(usage_ms), 1),
        "board_page_ms": round(statistics.median(board_ms), 1),
        "usage_fetch_ms": round(statistics.median(fetch_ms), 1),
        "usage_open_ms": round(statistics.median(open_ms), 1),
        "usage_charts": n_charts,
    }


if __name__ == "__main__":
    main()
