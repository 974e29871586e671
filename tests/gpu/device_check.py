"""The real NVML / GPU paths of gpulease, checked on a machine with an NVIDIA GPU, without Ray,
Redis or Jupyter: the node agent's inventory and sampler, a worker call bound to leased GPU 0 the
way a ``%%gpu_train`` call is (``GpuWorker.run`` with ``Grant.env``'s environment, in a child
process), the verified release (``gpu_pids`` / ``verify_gone``), and the idle verdict over real
samples. Prints what it sees and ends with one JSON line of figures.

Run from the repository root, where NVML finds a GPU and torch has CUDA:

    PYTHONPATH=. python3 tests/gpu/device_check.py

lease_server.node.agent imports redis and hiredis (no server is needed). Not a pytest module: pytest
collects ``test_*.py`` only, and nothing here runs at import.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
MIB = 2**20
_KEEP: list[Any] = []  # tensors a worker child holds after its call returned


def log(*parts: Any) -> None:
    print(*parts, flush=True)


def child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT), "PYTHONUNBUFFERED": "1"}


# ---- children ------------------------------------------------------------------------------------


def child_matmul(seconds: float) -> None:
    """Keep the GPU busy with bf16 matrix products for ``seconds``."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for _ in range(20):
            c = a @ b
        torch.cuda.synchronize()
        n += 20
    print(json.dumps({"done": True, "matmuls": n, "c": float(c[0, 0])}), flush=True)


def _alloc(mode: str) -> dict[str, Any]:
    """The call's function, in the worker child: what a %%gpu_train function would see."""
    import pynvml
    import torch

    info: dict[str, Any] = {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER"),
        "device_count": torch.cuda.device_count(),
        "is_available": torch.cuda.is_available(),
    }
    if not info["device_count"]:
        return info
    info["name"] = torch.cuda.get_device_name(0)
    if mode == "burst":  # 4 GiB for a moment, handed back to the driver before the call ends
        tmp = torch.empty(GIB, dtype=torch.float32, device="cuda:0")
        tmp.fill_(1.0)
        torch.cuda.synchronize()
        del tmp
        torch.cuda.empty_cache()
    x = torch.empty(GIB // 4, dtype=torch.float32, device="cuda:0")  # 1 GiB
    x.fill_(1.0)
    torch.cuda.synchronize()
    _KEEP.append(x)
    info["sum"] = float(x.sum())
    info["torch_allocated"] = torch.cuda.memory_allocated(0)
    info["torch_max_allocated"] = torch.cuda.max_memory_allocated(0)
    info["torch_reserved"] = torch.cuda.memory_reserved(0)
    info["torch_max_reserved"] = torch.cuda.max_memory_reserved(0)
    pynvml.nvmlInit()
    seen: dict[str, int] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
            if p.pid == os.getpid():
                seen[str(i)] = int(p.usedGpuMemory or 0)
    pynvml.nvmlShutdown()
    info["nvml_self_used"] = seen
    return info


def child_worker(mode: str, env_json: str, hold: str) -> None:
    """A single-use GpuWorker, as the runner's spare is: imports done and NVML probed first, then
    one call run with the grant's environment applied in-process (``GpuWorker.run``)."""
    import torch  # noqa: F401 - imported before the env is set, as a spare that imported torch would

    from magics.calls import Call
    from magics.worker import GpuWorker

    worker = GpuWorker()
    res = worker.run(Call.function(_alloc, mode), json.loads(env_json), {})
    out = {
        "ok": res.ok,
        "value": res.value,
        "peak_memory": res.peak_memory,
        "pid": res.pid,
        "error": f"{res.error_type}: {res.message}" if not res.ok else "",
        "traceback": res.traceback[-1500:],
    }
    print(json.dumps(out), flush=True)
    if hold == "hang":
        time.sleep(3600)  # holds its GPU memory until killed
    elif hold == "wait":
        sys.stdin.readline()  # holds its GPU memory until told to exit


# ---- the parent ----------------------------------------------------------------------------------


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )


def read_json_line(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        line = line.strip()
        if line.startswith("{"):
            return dict(json.loads(line))
    err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
    raise RuntimeError(f"child {proc.pid} gave no JSON line (rc={proc.poll()}): {err[-3000:]}")


class Nvml:
    """Direct NVML readings of GPU 0 for the parent's own measurements (kept initialised)."""

    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def procs(self) -> dict[int, int]:
        return {int(p.pid): int(p.usedGpuMemory or 0) for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.h)}

    def used_mb(self) -> int:
        return int(self.nv.nvmlDeviceGetMemoryInfo(self.h).used // MIB)

    def mem_v2(self) -> dict[str, int]:
        m = self.nv.nvmlDeviceGetMemoryInfo(self.h, version=self.nv.nvmlMemory_v2)
        return {k: int(getattr(m, k)) // MIB for k in ("total", "reserved", "free", "used")}


def time_until_gone(nv: Nvml, pid: int, base_mb: int, timeout: float = 10.0) -> dict[str, Any]:
    """From now (the process has just exited): ms until NVML stops listing ``pid``, and until
    memory used is back within 64 MiB of ``base_mb``."""
    t0 = time.monotonic()
    gone_ms = mem_ms = None
    polls = 0
    while time.monotonic() - t0 < timeout and (gone_ms is None or mem_ms is None):
        polls += 1
        now_ms = (time.monotonic() - t0) * 1000
        if gone_ms is None and pid not in nv.procs():
            gone_ms = now_ms
        if mem_ms is None and nv.used_mb() <= base_mb + 64:
            mem_ms = now_ms
    return {"pid_gone_ms": gone_ms, "mem_back_ms": mem_ms, "polls": polls, "used_mb_after": nv.used_mb()}


def wait_pidfd(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def idle_series(sampler: Any, n: int, every: float) -> list[tuple[float, dict[str, Any]]]:
    out = []
    for _ in range(n):
        out.append((time.time(), sampler.sample()[0]))
        time.sleep(every)
    return out


def gpu_state(series: list[tuple[float, dict[str, Any]]], threshold: float) -> Any:
    """What lua/samples.lua would hold for GPU 0 after these samples (no gap in them)."""
    from lease_server.leasing.reclaim import GpuState

    busy = [t for t, s in series if s["util"] >= threshold]
    window = [(t, float(s["util"]), int(s["mem_mb"])) for t, s in series]
    return GpuState(series[0][0], max(busy) if busy else None, series[-1][0], series[-1][1]["mem_mb"], window)


def main() -> int:
    import pynvml

    figures: dict[str, Any] = {}
    log("== environment")
    pynvml.nvmlInit()
    drv = pynvml.nvmlSystemGetDriverVersion()
    figures["driver"] = drv.decode() if isinstance(drv, bytes) else drv
    figures["nvidia_ml_py"] = getattr(pynvml, "__version__", None) or _dist_version("nvidia-ml-py")
    raw_name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    figures["raw_name_type"] = type(raw_name).__name__
    pynvml.nvmlShutdown()
    figures["parent_pid"] = os.getpid()
    try:
        figures["pid_ns"] = os.readlink("/proc/self/ns/pid")
    except OSError as exc:
        figures["pid_ns"] = str(exc)
    log(json.dumps({k: figures[k] for k in ("driver", "nvidia_ml_py", "raw_name_type", "parent_pid", "pid_ns")}))

    # ---- a. inventory ----
    log("\n== a. nvml_inventory()")
    from lease_server.node.agent import NvmlSampler, nvml_inventory, pool_name

    t0 = time.perf_counter()
    inv = nvml_inventory()
    figures["inventory_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    g0 = inv.gpus[0]
    log(f"node={inv.node} pool={inv.pool} source={inv.source} gpus={len(inv.gpus)}")
    for g in inv.gpus:
        log(f"  index={g.index} model={g.model!r} memory_mb={g.memory_mb} uuid={g.uuid}")
    figures["inventory"] = {
        "node": inv.node,
        "pool": inv.pool,
        "source": inv.source,
        "model": g0.model,
        "memory_mb": g0.memory_mb,
        "uuid": g0.uuid,
        "count": len(inv.gpus),
    }
    figures["pool_name_of_model"] = pool_name(g0.model, g0.memory_mb)
    uuid = g0.uuid

    # ---- b. sampler ----
    log("\n== b. NvmlSampler.sample(): idle, then under a matmul child")
    sampler = NvmlSampler()
    nv = Nvml()
    times = []
    for _ in range(200):
        t = time.perf_counter()
        sampler.sample()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    figures["sample_ms"] = {"median": round(times[100], 3), "p95": round(times[190], 3), "max": round(times[-1], 3)}
    idle = idle_series(sampler, 8, 0.25)
    base_mb = nv.used_mb()
    figures["idle"] = {"samples": [s for _, s in idle[-3:]], "mem_v1_used_mb": base_mb, "mem_v2_mb": nv.mem_v2()}
    log("idle:", json.dumps(figures["idle"]))
    log("sample() ms:", figures["sample_ms"])

    mm = spawn("matmul", "6")
    ready = read_json_line(mm)
    busy = idle_series(sampler, 12, 0.25)
    procs_now = nv.procs()
    utils = [s["util"] for _, s in busy]
    figures["busy"] = {
        "popen_pid": mm.pid,
        "child_own_pid": ready["pid"],
        "utils": utils,
        "mem_mb": [s["mem_mb"] for _, s in busy][-1],
        "procs_last": busy[-1][1]["procs"],
        "child_pid_in_sample": any(mm.pid in s["procs"] for _, s in busy),
        "child_used_mb_nvml": procs_now.get(mm.pid, 0) // MIB,
        "mem_v2_mb": nv.mem_v2(),
    }
    log("busy:", json.dumps(figures["busy"]))
    fd = os.pidfd_open(mm.pid)
    wait_pidfd(fd, 30)
    figures["busy"]["after_exit"] = time_until_gone(nv, mm.pid, base_mb)
    os.close(fd)
    mm.wait(30)
    log("matmul child:", mm.stdout.read().strip() if mm.stdout else "", "after exit:", figures["busy"]["after_exit"])

    # ---- c. the worker binding, without Ray ----
    log("\n== c. GpuWorker.run with Grant.env for leased GPU 0 (in a child process)")
    from magics.grant import Grant

    node = inv.node
    lease = SimpleNamespace(id="L-device-check", node=node, gpus=[{"index": 0, "uuid": uuid, "node": node}])
    env = Grant.env(SimpleNamespace(lease=lease, cpu=False), node)  # type: ignore[arg-type]
    cpu_env = Grant.env(SimpleNamespace(lease=None, cpu=False), node)  # type: ignore[arg-type]
    log("env:", env)
    figures["env"] = env

    runs: dict[str, Any] = {}
    for mode in ("plain", "burst"):
        w = spawn("worker", mode, json.dumps(env), "wait")
        res = read_json_line(w)
        val = res.get("value") or {}
        procs_now = nv.procs()
        runs[mode] = {
            "ok": res["ok"],
            "error": res["error"],
            "pid": res["pid"],
            "popen_pid": w.pid,
            "device_count": val.get("device_count"),
            "name": val.get("name"),
            "peak_memory_mb": None if res["peak_memory"] is None else round(res["peak_memory"] / MIB, 1),
            "nvml_self_used_mb": {k: v // MIB for k, v in (val.get("nvml_self_used") or {}).items()},
            "nvml_parent_sees_mb": procs_now.get(w.pid, 0) // MIB,
            "torch_max_allocated_mb": (val.get("torch_max_allocated") or 0) // MIB,
            "torch_max_reserved_mb": (val.get("torch_max_reserved") or 0) // MIB,
            "torch_reserved_mb": (val.get("torch_reserved") or 0) // MIB,
            "device_used_mb": nv.used_mb(),
        }
        if res["traceback"]:
            log(res["traceback"])
        log(f"{mode}:", json.dumps(runs[mode]))
        # ---- d. the memory really freed ----
        assert w.stdin is not None
        if mode == "plain":  # exit, then time NVML's view of it from the exit itself
            fd = os.pidfd_open(w.pid)
            w.stdin.write("exit\n")
            w.stdin.flush()
            wait_pidfd(fd, 30)
            runs[mode]["after_exit"] = time_until_gone(nv, w.pid, base_mb)
            os.close(fd)
            runs[mode]["gpu_pids_after"] = sorted(pynvml_pids(uuid))
            runs[mode]["verify_gone"] = _verify(w.pid, uuid)
        else:  # what the driver does: tell it to go and verify_gone at once (not reaped: as for Ray)
            t = time.monotonic()
            w.stdin.write("exit\n")
            w.stdin.flush()
            runs[mode]["verify_gone"] = _verify(w.pid, uuid)
            runs[mode]["verify_gone_wall_ms"] = round((time.monotonic() - t) * 1000, 1)
            runs[mode]["used_mb_after"] = nv.used_mb()
        w.wait(30)
        log(f"{mode} after exit:", json.dumps({k: v for k, v in runs[mode].items() if k not in ("name",)}))

    # A worker that does not exit: verify_gone SIGKILLs it after KILL_AFTER_S.
    w = spawn("worker", "plain", json.dumps(env), "hang")
    res = read_json_line(w)
    held = nv.procs().get(w.pid, 0) // MIB
    v = _verify(w.pid, uuid)
    runs["hang"] = {"ok": res["ok"], "held_mb": held, "verify_gone": v, "used_mb_after": nv.used_mb()}
    w.wait(30)
    runs["hang"]["returncode"] = w.returncode
    log("hang (SIGKILL path):", json.dumps(runs["hang"]))

    for label, e in (("missing_index_7", {**env, "CUDA_VISIBLE_DEVICES": "7"}), ("cpu_grant", cpu_env)):
        w = spawn("worker", "plain", json.dumps(e), "none")
        res = read_json_line(w)
        w.wait(60)
        val = res.get("value") or {}
        runs[label] = {
            "ok": res["ok"],
            "env": e,
            "device_count": val.get("device_count"),
            "is_available": val.get("is_available"),
            "peak_memory": res["peak_memory"],
            "error": res["error"],
        }
        log(f"{label}:", json.dumps(runs[label]))
    figures["worker"] = runs

    # gpu_pids / nvmlInit cost (verify_gone polls gpu_pids, which inits NVML each time)
    from magics.worker import gpu_pids

    ts = []
    for _ in range(20):
        t = time.perf_counter()
        gpu_pids([uuid], [0])
        ts.append((time.perf_counter() - t) * 1000)
    ts.sort()
    figures["gpu_pids_ms"] = {"median": round(ts[10], 2), "max": round(ts[-1], 2)}
    figures["gpu_pids_by_index_only"] = sorted(gpu_pids([], [0]) or [])
    log("gpu_pids ms:", figures["gpu_pids_ms"])

    # ---- e. the idle verdict over real samples ----
    log("\n== e. reclaim.idle_verdict over real samples")
    from lease_server.leasing.reclaim import Policy, check_gpu_sample, idle_verdict

    for _, s in idle + busy:
        check_gpu_sample(s)  # what the server checks of an agent's POST .../samples
    verdicts: dict[str, Any] = {}
    pol = Policy(idle_threshold=5.0, idle_timeout=1.5, grace=1.0, min_age=0.0)
    for label, series in (("idle", idle), ("busy", busy)):
        st = gpu_state(series, pol.idle_threshold)
        now_ms = int(series[-1][0] * 1000) + 10
        for executing in (False, True):
            lease_rec = {"created_at": 0, "user": "alice", "activity": {"executing": executing}}
            ok, ev = idle_verdict(lease_rec, {0: st}, pol, now_ms, 0.25)
            verdicts[f"{label}/executing={executing}"] = {"idle": ok, "why": ev["why"], "last_mem_mb": st.last_mem_mb}
    figures["verdicts"] = verdicts
    for k, v in verdicts.items():
        log(f"  {k}: {v}")
    sampler.close()
    log("\nFIGURES " + json.dumps(figures, default=str))
    return 0


def pynvml_pids(uuid: str) -> set[int]:
    from magics.worker import gpu_pids

    return gpu_pids([uuid], [0]) or set()


def _verify(pid: int, uuid: str) -> dict[str, Any]:
    from magics.worker import verify_gone

    out = verify_gone(pid, [uuid], [0])
    out["ms"] = round(out["ms"], 1)
    return out


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind = sys.argv[2]
        if kind == "matmul":
            child_matmul(float(sys.argv[3]))
        else:
            child_worker(sys.argv[3], sys.argv[4], sys.argv[5])
        sys.exit(0)
    sys.exit(main())
