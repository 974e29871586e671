"""``unleased_action = "kill"`` on a real GPU: the node agent's NVML sampler sees a CUDA process,
checks it again (``NvmlSampler.has_process``: NVML, and an NVIDIA device open under that pid) and
its ``Enforcer`` SIGTERMs it, or SIGKILLs it after the grace when it ignores SIGTERM. No server:
the answer the lease server would give is written here. Prints what it sees and ends with one JSON
line of figures.

Run from the repository root, where NVML finds a GPU and torch has CUDA:

    PYTHONPATH=. python3 tests/gpu/unleased_kill_check.py

lease_server.node.agent imports redis and hiredis; where hiredis is missing a stub stands in (nothing
here talks to Redis). Not a pytest module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from typing import Any

try:
    import hiredis  # noqa: F401
except ImportError:
    _stub = types.ModuleType("hiredis")
    _stub.__version__ = "0.0"  # type: ignore[attr-defined]  # redis then treats hiredis as missing
    sys.modules["hiredis"] = _stub

from lease_server.node.agent import NvmlSampler  # noqa: E402
from lease_server.node.enforce import Enforcer, uses_gpu_device  # noqa: E402

CUDA_CHILD = (
    "import signal, sys, time, torch\n"
    "if sys.argv[1] == 'ignore':\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "x = torch.ones(1 << 20, device='cuda')\n"
    "torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def log(*parts: Any) -> None:
    print(*parts, flush=True)


def cuda_child(mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", CUDA_CHILD, mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready", "the CUDA child did not start"
    return p


def wait_seen(nvml: NvmlSampler, pid: int, timeout: float = 30) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pid in nvml.sample()[0]["procs"]:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"NVML never reported pid {pid} on GPU 0")


def main() -> None:
    out: dict[str, Any] = {}
    nvml = NvmlSampler()
    sleeper = subprocess.Popen(["sleep", "600"])
    children: list[subprocess.Popen[Any]] = [sleeper]
    try:
        # 1. A process that exits on SIGTERM.
        graceful = cuda_child("default")
        children.append(graceful)
        out["nvml_sees_s"] = round(wait_seen(nvml, graceful.pid), 2)
        assert uses_gpu_device(graceful.pid) and not uses_gpu_device(sleeper.pid)
        assert nvml.has_process(0, graceful.pid) and not nvml.has_process(0, sleeper.pid)
        sample = nvml.sample()
        log("sample:", sample)
        enforcer = Enforcer()
        answer = {"unleased_action": "kill", "unleased_kill_grace_s": 2.0}
        # The sleeper is named but NVML does not report it on the GPU: refused.
        sneaky = [{**sample[0], "procs": [*sample[0]["procs"], sleeper.pid]}]
        named = {"kill": [{"index": 0, "pids": [sleeper.pid]}]}
        assert enforcer.act("gpu-node", sneaky, {**answer, **named}, nvml.has_process) == []
        assert sleeper.poll() is None
        t0 = time.monotonic()
        reports = enforcer.act(
            "gpu-node", sample, {**answer, "kill": [{"index": 0, "pids": [graceful.pid]}]}, nvml.has_process
        )
        log("reports:", reports)
        assert [r["signal"] for r in reports] == ["SIGTERM"] and reports[0]["pid"] == graceful.pid
        assert graceful.wait(30) == -signal.SIGTERM
        out["sigterm_exit_s"] = round(time.monotonic() - t0, 2)
        # 2. A process that ignores SIGTERM: SIGKILL after the grace.
        stubborn = cuda_child("ignore")
        children.append(stubborn)
        wait_seen(nvml, stubborn.pid)
        sample = nvml.sample()
        t0 = time.monotonic()
        reports = enforcer.act(
            "gpu-node", sample, {**answer, "kill": [{"index": 0, "pids": [stubborn.pid]}]}, nvml.has_process
        )
        assert [r["signal"] for r in reports] == ["SIGTERM"]
        killed: list[tuple[str, dict[str, Any]]] = []
        while not killed and time.monotonic() - t0 < 30:
            time.sleep(0.05)
            killed = enforcer.tick()
        log("after the grace:", killed)
        assert killed and killed[0][1]["signal"] == "SIGKILL" and killed[0][1]["pid"] == stubborn.pid
        out["sigkill_after_s"] = round(time.monotonic() - t0, 2)
        assert stubborn.wait(30) == -signal.SIGKILL
        t1 = time.monotonic()
        while stubborn.pid in nvml.sample()[0]["procs"] and time.monotonic() - t1 < 30:
            time.sleep(0.1)
        out["gpu_clear_after_kill_s"] = round(time.monotonic() - t1, 2)
        assert stubborn.pid not in nvml.sample()[0]["procs"]
        out["user"] = reports[0]["user"]
        out["ok"] = True
    finally:
        for p in children:
            if p.poll() is None:
                p.kill()
            p.wait()
        nvml.close()
    log(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    main()
