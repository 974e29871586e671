"""Does the driver's checkpoint API work here, on a torch process, under this machine's settings as
they are (issue 36 item 4)? Never changes a GPU setting (no persistence mode, MIG or compute mode):
it only reads them.

A child process puts a known tensor (1 GiB by default) and a small model on cuda:0 and waits. This
process calls libcuda's cuCheckpointProcessGetState / Lock / Checkpoint / Restore / Unlock on the
child's pid through ctypes (cuInit once, here, as a long-lived helper would), reads NVML between
the steps (is the child still listed on the GPU, how much memory is used), and then asks the child
whether its tensor is intact at the same data_ptr and whether it can still compute. Each call's
CUresult (code and name) and time are reported; a failed step stops the sequence, and whatever was
locked or checkpointed is restored and unlocked before the child is ended.

    PYTHONPATH=. python3 tests/gpu/checkpoint_probe.py [--mib 1024] [--json OUT.json]

The last line of stdout is one JSON object. Without libcuda (no NVIDIA driver) it says so there
and exits 0: "not available" is an answer too. Not a pytest module.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}  # CUprocessState
CHILD = r"""
import json, os, sys, torch
mib = int(sys.argv[1])
x = torch.arange(mib * 2**18, dtype=torch.float32, device="cuda:0")  # mib MiB of 0, 1, 2, ...
model = torch.nn.Linear(256, 256).to("cuda:0")
inp = torch.ones(8, 256, device="cuda:0")
ref = float(model(inp).sum())
torch.cuda.synchronize()
want = float(x[-1])
print(json.dumps({"pid": os.getpid(), "ptr": x.data_ptr(), "last": want}), flush=True)
for line in sys.stdin:
    try:
        torch.cuda.synchronize()
        ok = float(x[-1]) == want and float(x[12345]) == 12345.0
        out = float(model(inp).sum())
        y = (x[:2**20] * 2).sum()
        torch.cuda.synchronize()
        print(json.dumps({"intact": ok, "ptr": x.data_ptr(), "model_same": abs(out - ref) < 1e-3,
                          "computes": float(y) > 0}), flush=True)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


class Args(ctypes.Structure):
    """CUcheckpointLockArgs / CheckpointArgs / RestoreArgs / UnlockArgs: 64 bytes each, the first
    field of the lock args its timeout in ms; zero elsewhere (restore: no GPU remapping)."""

    _fields_ = [("timeout_ms", ctypes.c_uint), ("reserved", ctypes.c_ubyte * 60)]


class Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def name(self, code: int) -> str:
        s = ctypes.c_char_p()
        return s.value.decode() if self.lib.cuGetErrorName(code, ctypes.byref(s)) == 0 and s.value else str(code)

    def call(self, fn: str, *args: Any) -> dict[str, Any]:
        f = getattr(self.lib, fn, None)
        if f is None:
            return {"call": fn, "ok": False, "code": None, "result": "symbol not in libcuda"}
        t0 = time.perf_counter()
        code = f(*args)
        ms = (time.perf_counter() - t0) * 1000
        return {"call": fn, "ok": code == 0, "code": code, "result": self.name(code), "ms": round(ms, 2)}

    def state(self, pid: int) -> dict[str, Any]:
        st = ctypes.c_int(-1)
        r = self.call("cuCheckpointProcessGetState", ctypes.c_int(pid), ctypes.byref(st))
        r["state"] = STATES.get(st.value, st.value) if r["ok"] else None
        return r


def nvml_view(pid: int) -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = {int(p.pid): int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        used = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        pynvml.nvmlShutdown()
        return {"child_listed": pid in procs, "child_mib": procs.get(pid, 0) // 2**20, "used_mib": used // 2**20}
    except Exception as exc:  # noqa: BLE001
        return {"error": repr(exc)}


def settings_read() -> dict[str, Any]:
    """What the GPU's settings are (read only)."""
    out: dict[str, Any] = {"euid": os.geteuid()}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        out["gpu"] = name.decode() if isinstance(name, bytes) else name
        drv = pynvml.nvmlSystemGetDriverVersion()
        out["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        for key, fn in (
            ("persistence_mode", "nvmlDeviceGetPersistenceMode"),
            ("compute_mode", "nvmlDeviceGetComputeMode"),
            ("mig_mode", "nvmlDeviceGetMigMode"),
        ):
            try:
                out[key] = getattr(pynvml, fn)(h)
            except Exception as exc:  # noqa: BLE001
                out[key] = f"unreadable: {type(exc).__name__}"
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001
        out["nvml"] = repr(exc)
    try:
        import cuda.bindings as cb
        from cuda.bindings import driver as cbd  # noqa: F401 - is it there, and does it expose the API?

        out["cuda_bindings"] = getattr(cb, "__version__", "?")
        out["cuda_bindings_has_checkpoint_api"] = all(
            hasattr(cbd, f"cuCheckpointProcess{n}") for n in ("Lock", "Checkpoint", "Restore", "Unlock", "GetState")
        )
    except Exception as exc:  # noqa: BLE001
        out["cuda_bindings"] = f"not importable: {type(exc).__name__}"
    return out


def answer(child: subprocess.Popen[str], within: float = 20.0) -> str:
    """The child's next line, or "" if none comes within ``within`` s (a child that hangs after its
    restore is one of the ways the API can fail: the probe says so rather than wait forever)."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], within)
    return child.stdout.readline() if ready else ""


def probe(mib: int, report: dict[str, Any]) -> dict[str, Any]:
    """Fills ``report`` as it goes (what main writes, also when the step's time limit stops it)."""
    report.update({"available": False, "settings": settings_read(), "steps": []})
    try:
        drv = Driver()
    except OSError as exc:
        report["why"] = f"libcuda.so.1 not loadable: {exc}"
        return report
    init = drv.call("cuInit", ctypes.c_uint(0))
    version = ctypes.c_int(0)
    drv.lib.cuDriverGetVersion(ctypes.byref(version))
    report["cuda_driver_version"] = version.value
    report["steps"].append(init)
    if not init["ok"]:
        report["why"] = f"cuInit failed: {init['result']}"
        return report
    missing = [
        f
        for f in ("Lock", "Checkpoint", "Restore", "Unlock", "GetState")
        if getattr(drv.lib, f"cuCheckpointProcess{f}", None) is None
    ]
    if missing:
        report["why"] = f"libcuda has no cuCheckpointProcess{'/'.join(missing)}"
        return report
    report["available"] = True  # the symbols are there; whether they work is below
    t0 = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(mib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    )
    assert child.stdin is not None and child.stdout is not None
    line = answer(child, 120)  # torch's import and CUDA's start on a cold machine
    if not line.startswith("{"):
        child.kill()
        report["why"] = f"the torch child did not start: {child.stderr.read()[-1500:] if child.stderr else ''}"
        return report
    start = json.loads(line)
    pid = start["pid"]
    report["child"] = {"pid": pid, "mib": mib, "start_s": round(time.perf_counter() - t0, 2), "ptr": start["ptr"]}
    report["nvml_before"] = nvml_view(pid)
    held = report["nvml_before"].get("child_mib") or mib
    phase = "running"
    try:
        report["steps"].append(drv.state(pid))
        lock = Args(timeout_ms=5000)
        for fn, args, after in (
            ("cuCheckpointProcessLock", lock, "locked"),
            ("cuCheckpointProcessCheckpoint", Args(), "checkpointed"),
            ("cuCheckpointProcessRestore", Args(), "restored"),
            ("cuCheckpointProcessUnlock", Args(), "running"),
        ):
            step = drv.call(fn, ctypes.c_int(pid), ctypes.byref(args))
            step["state_after"] = drv.state(pid)["state"]
            step["nvml_after"] = nvml_view(pid)
            report["steps"].append(step)
            if not step["ok"]:
                report["why"] = f"{fn} answered {step['result']} (state {step['state_after']})"
                break
            phase = after
        else:
            ck = next(s for s in report["steps"] if s["call"] == "cuCheckpointProcessCheckpoint")
            rs = next(s for s in report["steps"] if s["call"] == "cuCheckpointProcessRestore")
            report["checkpoint_gb_s"] = round(held * 2**20 / 1e9 / (ck["ms"] / 1000), 2) if ck["ms"] else None
            report["restore_gb_s"] = round(held * 2**20 / 1e9 / (rs["ms"] / 1000), 2) if rs["ms"] else None
            # held is NVML's figure for the process (its CUDA context's memory too); the tensor's alone:
            report["checkpoint_tensor_gb_s"] = round(mib * 2**20 / 1e9 / (ck["ms"] / 1000), 2) if ck["ms"] else None
            report["restore_tensor_gb_s"] = round(mib * 2**20 / 1e9 / (rs["ms"] / 1000), 2) if rs["ms"] else None
            report["gpu_empty_while_checkpointed"] = not ck["nvml_after"].get("child_listed", True)
    finally:
        # leave nothing locked or checkpointed behind
        if phase == "checkpointed":
            report["cleanup_restore"] = drv.call("cuCheckpointProcessRestore", ctypes.c_int(pid), ctypes.byref(Args()))
            phase = "restored"
        if phase in ("locked", "restored"):
            report["cleanup_unlock"] = drv.call("cuCheckpointProcessUnlock", ctypes.c_int(pid), ctypes.byref(Args()))
        report["final_state"] = drv.state(pid)["state"]
    if report["final_state"] == "running":
        child.stdin.write("check\n")
        child.stdin.flush()
        got = answer(child)
        report["child_after"] = json.loads(got) if got.startswith("{") else {"error": got or "no answer"}
        report["child_after"]["same_ptr"] = report["child_after"].get("ptr") == start["ptr"]
    child.kill()
    child.wait(10)
    report["works"] = bool(
        report["available"]
        and all(s.get("ok") for s in report["steps"])
        and report.get("child_after", {}).get("intact")
        and report["child_after"].get("same_ptr")
    )
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024, help="GPU memory the torch child holds")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    report: dict[str, Any] = {}

    def write() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)

    def stopped(*_: Any) -> None:  # run_all.sh's time limit: what was seen so far is still reported
        report["why"] = report.get("why") or "stopped by run_all.sh's time limit (SIGTERM)"
        write()
        os._exit(124)

    signal.signal(signal.SIGTERM, stopped)
    probe(args.mib, report)
    for s in report["steps"]:
        print(f"  {s['call']}: {s['result']} {s.get('ms', '')} ms -> {s.get('state_after', s.get('state', ''))}")
    write()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
