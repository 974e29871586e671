"""bench/hostile_bench.py runs in its quick mode, and its last line is the JSON object its docstring
documents (every figure named there), with the booking flood stopped at the owner's cap and the
usage summary loop (issue 49) among the hostile clients' answers. No figure is judged: a bench
measures, a test only checks that it runs and says what it says it does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = {
    "hostile_grant_p99_ratio",
    "booked_grant_p99_ratio",
    "quiet_grant_p99_ms",
    "booked_grant_p99_ms",
    "hostile_grant_p99_ms",
    "server_rss_growth_mb",
    "flood_bookings",
    "flood_refusal",
    "flood_s",
    "summary_rows",
}


@pytest.mark.slow  # (it loads the machine on purpose: hundreds of hostile connections)
def test_the_hostile_bench_runs_quick_and_ends_with_its_json_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hostile_bench.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert KEYS <= set(last), f"missing {sorted(KEYS - set(last))}"
    assert next(iter(last)) == "hostile_grant_p99_ratio"  # the target leads
    assert last["quick"] is True and "failed" not in last
    assert last["flood_bookings"] == 200 and last["flood_refusal"] == "403 forbidden"  # booking_max_per_owner
    answers = last["hostile_answers"]
    assert any(k.startswith("usage summary: ") for k in answers), answers
    assert all(isinstance(last[k], int | float) for k in KEYS - {"flood_refusal"})
