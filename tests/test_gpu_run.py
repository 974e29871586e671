"""The prepared GPU run (tests/gpu/run_all.sh) in its simulate mode, so that it cannot rot while no
GPU is at hand: `gpulease up --simulate 1xA100-80GB`, a real notebook through nbclient on the
gpulease kernel, another user's eviction, idle reclaim from simulated samples, the checkpoint probe
(which finds no driver here). It runs in this environment (no kit is installed in simulate mode).
The report must have every figure the GPU run reports, CUDA and NVML ones absent with a reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def absent(v: object) -> bool:
    return isinstance(v, dict) and bool(v.get("absent"))


def test_run_all_in_simulate_mode_reports_every_check(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPULEASE_GPU_RUN_PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "tests/gpu/run_all.sh", "--simulate"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert (tmp_path / "report.json").exists(), done.stdout[-4000:] + done.stderr[-2000:]
    r = json.loads((tmp_path / "report.json").read_text())
    assert done.returncode == 0 and r["failed_steps"] == [] and not r["notebook_errors"], done.stdout[-6000:]
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "run_all.log", "notebook.ipynb", "up.log"}
    assert r["mode"] == "simulate" and absent(r["kit_check"]) and absent(r["drain_check"]) and absent(r["slices"])
    probe = r["checkpoint_probe"]
    assert probe["available"] is False and "libcuda" in probe["why"], probe
    nb = r["notebook"]
    assert nb["stack"]["pool"] == "A100-80GB"
    t = nb["train"]
    assert t["trained_on"] == "cpu" and absent(t["trained_on_cuda0"]) and absent(t["cell2_same_data_ptr"])
    assert t["cell2_same_worker"] is True and t["kernel_copy_usable"] is True and t["kernel_opened_cuda"] is False
    assert t["cell1_line"].startswith("gpu_train: ran ") and "kept warm" in t["cell1_line"], t
    s = nb["starts"]
    for key in ("plain_cell_start_ms", "warm_cell_start_ms", "cold_cell_start_ms"):
        assert isinstance(s[key], float) and s[key] > 0, s
    assert s["plain_cell_start_ms"] < s["warm_cell_start_ms"] < s["cold_cell_start_ms"], s
    assert absent(s["cold_cell_cuda_ready_ms"]) and absent(s["cold_cell_cuda_context_ms"])
    e = nb["evict"]
    assert e["grant_within_1s"] is True and e["worker_off_gpu_before_grant"] is True, e
    assert e["worker_suspended"] is True, e  # simulated nodes always suspend
    sus = nb["suspend"]
    assert len(sus["cycles"]) >= 1, sus
    for c in sus["cycles"]:
        assert c["suspended"] and c["restored"] and c["same_ptr"] and c["intact"] and c["same_pid"], c
        assert absent(c["bytes"]) and absent(c["suspend_gbps"]) and absent(c["restore_gbps"]), c
        assert "\n  restored " in c["line"], c
    assert absent(e["nvml_clear_before_grant"])
    p = nb["peak"]
    assert absent(p["peak_agrees_with_nvml"]) and absent(p["right_size_hint_ok"])
    assert p["small_2gib"]["line"].startswith("gpu_train: held ") and absent(p["small_2gib"]["nvml_peak_gb"])
    i = nb["idle"]
    assert i["ok"] is True and i["samples_from"] == "simulated" and i["reclaimed"] is True, i
    assert i["warned_after_idle_s"] >= i["thresholds"]["idle_timeout"] - 0.6, i
