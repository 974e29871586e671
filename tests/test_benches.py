"""Every bench of bench/ runs in its quick mode, ``--smoke`` (each part once, at a tiny size), and
ends with its JSON line: one object that holds every figure its docstring documents, no part of
it failed. No figure is judged and no time asserted: a bench measures; this test only keeps each
one running and saying what it says it does (issue 51 item 6). bench/hostile_bench.py has a test
of its own (tests/test_hostile_bench.py).

A figure is documented when its docstring names it: a lower-case name with an underscore
(``warm_cell_start_ms``), not in a code span, quotes (a part's name inside a figure), a path or a
call. The names of such a shape that are not figures (a setting, a function, the name a figure
replaced) are listed in NOT_FIGURES.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lease_server.sim import traces

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
OWN_TEST = {"hostile_bench.py": "tests/test_hostile_bench.py"}
HELPERS = {"_common.py"}

# Names of a figure's shape in a bench's docstring that are not figures of its JSON line.
NOT_FIGURES: dict[str, set[str]] = {
    "usage_ledger_bench.py": {"event_log_max"},  # a setting
    "sched_bench.py": {"fair_share"},  # a scheduler
    "sim_bench.py": {"warm_max"},  # a setting
    "lease_bench.py": {"limit_grants_per_s", "script_us_per_call"},  # the terms of a formula
    "reclaim_bench.py": {"busy_at", "idle_timeout", "reclaim_at", "sample_interval"},  # settings, fields
    "ha_bench.py": {"replicas_ack"},  # a setting
    "gpu_train_bench.py": {
        "run_on_gpus",  # the call it measures
        "num_cpus",  # Ray's option
        "handoff_p50_ms",  # the names handoff_verified_p50_ms / _p99_ms replaced
        "handoff_p99_ms",
    },
    "elastic_bench.py": {"gpu_map"},  # the call it measures
}

# What a bench needs that a machine may lack: (missing?, why) at collection.
CHROMIUM = Path("/usr/bin/chromium")
NEEDS: dict[str, tuple[bool, str]] = {
    "sim_bench.py": (
        bool(traces.missing(traces.JUNE) or traces.missing(traces.ADOBE)),
        traces.missing(traces.JUNE) or traces.missing(traces.ADOBE),
    ),
    "usage_page_bench.py": (not CHROMIUM.exists(), f"{CHROMIUM} is missing: apt-get install -y chromium"),
}

FIGURE = re.compile(r"(?<![\w.`/%\"-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w.(/\"-])")


def benches() -> list[str]:
    return sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS and p.name not in OWN_TEST)


def docstring(name: str) -> str:
    return ast.get_docstring(ast.parse((BENCH / name).read_text())) or ""


def documented(name: str) -> set[str]:
    """The figures ``name``'s docstring names."""
    return set(FIGURE.findall(docstring(name))) - NOT_FIGURES.get(name, set())


def skipped(last: dict[str, Any]) -> set[str]:
    """Figures the bench says it skipped (``"skipped": ["NAME: why", ...]``), e.g. without a trace."""
    return {str(entry).split(":", 1)[0] for entry in last.get("skipped") or ()}


def test_every_bench_is_run_here_or_by_a_test_of_its_own() -> None:
    for name, test in OWN_TEST.items():
        assert (BENCH / name).exists() and (ROOT / test).exists(), (name, test)
    assert len(benches()) >= 14  # not an empty glob
    for name in benches():
        assert name.endswith("_bench.py"), f"{name}: a bench is bench/NAME_bench.py (or a helper in HELPERS)"
        assert "--smoke" in docstring(name).split("\n\n")[1], f"{name}: its usage line names its quick mode"
        assert documented(name), f"{name}: its docstring names no figure"
    for name, words in NOT_FIGURES.items():
        named = set(FIGURE.findall(docstring(name)))
        assert words <= named, f"{name}: NOT_FIGURES lists {sorted(words - named)}, which its docstring no longer names"


@pytest.mark.parametrize("name", benches())
def test_the_bench_runs_quick_and_its_last_line_holds_every_figure_it_documents(name: str) -> None:
    missing, why = NEEDS.get(name, (False, ""))
    if missing:
        pytest.skip(why)
    done = subprocess.run(
        [sys.executable, str(BENCH / name), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    said = f"{done.stdout[-3000:]}\n--- stderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, said
    lines = done.stdout.strip().splitlines()
    assert lines, said
    last = json.loads(lines[-1])
    assert isinstance(last, dict), said
    assert not last.get("failed"), f"parts failed: {last['failed']}\n{said}"
    figures = documented(name)
    absent = figures - set(last)
    assert not absent, f"documented, not in the JSON line: {sorted(absent)}\n{said}"
    null = {k for k in figures if last[k] is None} - skipped(last)
    assert not null, f"documented, null (not measured): {sorted(null)}\n{said}"
