#!/usr/bin/env python
"""Warm cells: how soon a notebook's next GPU cell runs, and how soon a warm lease is lent out.

    .venv/bin/python bench/warm_bench.py [--quick | --smoke]

Starts its own ``gpulease up`` (simulated ``box=2xA100-80GB``), a kernel of the gpulease
kernelspec (GPULEASE_SPARES=2 started workers, its default; --smoke: 1), and measures through the
kernel protocol. The cell imports torch (when installed) and
runs a small model, as the issue's measure does. A cell's start is the time from the execute request
(time.time() here) to its first line running (time.time() there, on the same machine).

plain_cell_start_ms   the same code in a plain cell of the kernel (baseline, same run)
plain_cell_total_ms   a trivial plain cell (y = x + 1): from the execute request until the kernel
                      is idle again (baseline, same run)
warm_cell_total_ms    the same trivial cell as %%gpu_train in the warm worker, execute to idle:
                      its start, the run, and the closing that keeps the worker warm
                                                                                  (target p50 <= 60)
cold_cell_start_ms    %%gpu_train --cold: a lease, a pre-started spare (which has preloaded what
                      earlier cells imported), then released                     (information)
warm_cell_start_ms    %%gpu_train after a cell that ended less than a minute ago, nobody waiting:
                      the warm worker runs it at once                            (target p50 <= 30)
evict_to_grant_ms     another user asks for both GPUs while the kernel keeps one warm: from the
                      request until its grant (the kernel ends the worker, sees it gone and
                      releases)                                                   (target p50 <= 1000)
server_handoff_ms     baseline for it, same run: a holder's release until a queued waiter's grant,
                      two plain clients (no Ray, no kernel)

The last line of stdout is one JSON object with every figure. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _common (which adds the repo root)

import _common
from _common import pct, say, section

TARGETS = {
    "warm_cell_start_ms": ("<=", 30.0),
    "warm_cell_total_ms": ("<=", 60.0),
    "evict_to_grant_ms": ("<=", 1000.0),
}
verdict = functools.partial(_common.verdict, TARGETS)

try:
    import torch  # noqa: F401

    MODEL = "import torch\nm = torch.nn.Linear(64, 64)\ny = float(m(torch.randn(8, 64)).sum())\n"
except ImportError:
    MODEL = "y = sum(i * i for i in range(10000))\n"
BODY = "import time\nt_first = time.time()\n" + MODEL


def started_ms(kernel: Any, code: str) -> float:
    """Execute ``code`` (which sets t_first on its first line); ms from the request to that line."""
    t0 = time.time()
    out = kernel.run(code)
    if any(o["type"] == "error" for o in out):
        raise RuntimeError(f"the cell failed: {out}")
    (first,) = [o["text"] for o in kernel.run("print(repr(t_first))") if o["type"] == "stream"]
    return (float(first) - t0) * 1000


def total_ms(kernel: Any, code: str) -> float:
    """Execute ``code``; ms from the request until the kernel is idle again."""
    t0 = time.perf_counter()
    out = kernel.run(code)
    took = (time.perf_counter() - t0) * 1000
    if any(o["type"] == "error" for o in out):
        raise RuntimeError(f"the cell failed: {out}")
    return took


def bench_totals(kernel: Any, n: int) -> dict[str, list[float]]:
    """A trivial cell, plain and warm, from the execute request to idle."""
    kernel.run("x = 1")
    got: dict[str, list[float]] = {"plain": [], "warm": []}
    total_ms(kernel, "%%gpu_train --gpus 1\ny = x + 1")  # the warm worker (it may start cold)
    for _ in range(n):
        got["plain"].append(total_ms(kernel, "y = x + 1"))
        got["warm"].append(total_ms(kernel, "%%gpu_train --gpus 1\ny = x + 1"))
    return got


def bench_cells(kernel: Any, n: int) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
    started_ms(kernel, f"%%gpu_train --gpus 1 --cold\n{BODY}")  # warm-up: torch in the spares too
    for _ in range(n):
        got["plain"].append(started_ms(kernel, BODY))
        got["cold"].append(started_ms(kernel, f"%%gpu_train --gpus 1 --cold\n{BODY}"))
    started_ms(kernel, f"%%gpu_train --gpus 1\n{BODY}")  # the first warm cell starts cold
    for _ in range(n):
        got["warm"].append(started_ms(kernel, f"%%gpu_train --gpus 1\n{BODY}"))
    return got


def bench_evict(stack: Any, kernel: Any, n: int) -> tuple[list[float], list[float]]:
    from lease_server.client import Client

    admin = Client(stack.url, (stack.data / "token").read_text().strip())
    bob = Client(stack.url, admin.request("POST", "/api/v1/tokens", json={"user": "bob"})["token"])
    carol = Client(stack.url, admin.request("POST", "/api/v1/tokens", json={"user": "carol"})["token"])
    evict, base = [], []
    for _ in range(n):
        started_ms(kernel, f"%%gpu_train --gpus 1\n{BODY}")  # kept warm on one GPU; the other is free
        t0 = time.perf_counter()
        lease = bob.acquire(2, wait=60)
        evict.append((time.perf_counter() - t0) * 1000)
        # The baseline: carol waits for the GPUs bob holds; bob releases.
        got: list[float] = []
        t = threading.Thread(target=_wait_and_release, args=(carol, got), daemon=True)
        t.start()
        while not [w for w in admin.queue() if w["user"] == "carol"]:
            time.sleep(0.005)
        t0 = time.perf_counter()
        bob.release(lease)
        t.join(60)
        base.append((got[0] - t0) * 1000)
    return evict, base


def _wait_and_release(client: Any, got: list[float]) -> None:
    lease = client.acquire(2, wait=60)
    got.append(time.perf_counter())
    client.release(lease)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    args = _common.parse_args(ap)
    n = 1 if args.smoke else 5 if args.quick else 15
    spares = _common.ray_spares(1 if args.smoke else None)  # before tests.conftest, which would set 0
    results: dict[str, Any] = {
        "quick": args.quick,
        "smoke": args.smoke,
        "spares": spares,
        "cpus": os.cpu_count(),
        "torch": "torch" in MODEL,
    }
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    say(f"warm cells bench ({mode}): {n} rounds per figure")
    work = Path(tempfile.mkdtemp(prefix="gpulease-warm-bench-"))
    from magics.kernel import install
    from tests.conftest import Up
    from tests.test_magics import Kernel

    install(prefix=str(work / "prefix"))
    stack = Up(work / "home", simulate="box=2xA100-80GB", GPULEASE_DEFAULT_TTL="30")
    stack.env["JUPYTER_PATH"] = str(work / "prefix" / "share" / "jupyter")
    kernel = Kernel(stack)
    try:
        with section(results, "cells", timed=True):
            got = bench_cells(kernel, n)
            for kind in ("plain", "cold", "warm"):
                results[f"{kind}_cell_start_ms"] = pct(got[kind], 50)
                results[f"{kind}_cell_start_p99_ms"] = pct(got[kind], 99)
                say(f"{kind}_cell_start_ms {pct(got[kind], 50):9.2f}  p99 {pct(got[kind], 99):.2f}")
            results["warm_over_plain"] = results["warm_cell_start_ms"] / max(results["plain_cell_start_ms"], 1e-3)
            say(f"  warm {verdict('warm_cell_start_ms', results['warm_cell_start_ms'])}")
            totals = bench_totals(kernel, 2 * n)
            for kind in ("plain", "warm"):
                results[f"{kind}_cell_total_ms"] = pct(totals[kind], 50)
                results[f"{kind}_cell_total_p99_ms"] = pct(totals[kind], 99)
                say(f"{kind}_cell_total_ms {pct(totals[kind], 50):9.2f}  p99 {pct(totals[kind], 99):.2f}")
            results["warm_total_over_plain"] = results["warm_cell_total_ms"] / max(results["plain_cell_total_ms"], 1e-3)
            say(f"  warm total {verdict('warm_cell_total_ms', results['warm_cell_total_ms'])}")
        with section(results, "evict", timed=True):
            evict, base = bench_evict(stack, kernel, n)
            results["evict_to_grant_ms"] = pct(evict, 50)
            results["evict_to_grant_p99_ms"] = pct(evict, 99)
            results["server_handoff_ms"] = pct(base, 50)
            p50 = pct(evict, 50)
            say(f"evict_to_grant_ms  {p50:9.2f}  p99 {pct(evict, 99):.2f}  {verdict('evict_to_grant_ms', p50)}")
            say(f"server_handoff_ms  {pct(base, 50):9.2f}  (baseline)")
    finally:
        kernel.shutdown()
        stack.interrupt()
        shutil.rmtree(work, ignore_errors=True)
    for key in TARGETS:
        results.setdefault(key, None)
    results["targets_met"] = {k: results[k] is not None and verdict(k, results[k]).endswith("PASS") for k in TARGETS}
    say(_common.json_line(results, first=TARGETS, digits=4))


if __name__ == "__main__":
    main()
