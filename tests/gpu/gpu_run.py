"""The product's main path on a real GPU (issue 36 A.3), driven the way a person drives it: `gpulease
up` on this machine's GPUs (NVML inventory), a notebook run through nbclient on the gpulease kernel,
and another user asking for the GPU in between. tests/gpu/run_all.sh runs it; ``--simulate SPEC``
runs the same steps against simulated GPUs (no CUDA, no NVML: those figures are null, with why).

    PYTHONPATH=. python3 tests/gpu/gpu_run.py --out DIR [--simulate 1xA100-80GB]

Writes DIR/notebook.json (the figures), DIR/notebook.ipynb (the executed notebook) and
DIR/up.log; prints progress and, last, the figures as one JSON line. A failed check is recorded
(``errors``) and the run goes on to the next one.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IDLE = {"sample_interval": 0.5, "idle_timeout": 3.0, "grace": 2.0, "min_age": 0.0}  # the run's short thresholds
BUSY_S = 3.0
T0 = time.monotonic()


def log(*parts: Any) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *parts, flush=True)


def absent(why: str) -> dict[str, str]:
    return {"absent": why}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- NVML, watched from outside the notebook ------------------------------------------------------


class NvmlWatch:
    """Polls NVML's process list of GPU 0 every few ms in a thread: (time.time(), {pid: bytes})."""

    def __init__(self, index: int = 0, every: float = 0.005) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.every = every
        self.polls: list[tuple[float, dict[int, int]]] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def procs(self) -> dict[int, int]:
        return {int(p.pid): int(p.usedGpuMemory or 0) for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.h)}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                seen = self.procs()
            except Exception:  # noqa: BLE001 - a failed read is a gap, not an end
                seen = None
            if seen is not None:
                with self.lock:
                    self.polls.append((time.time(), seen))
                    if len(self.polls) > 200_000:
                        del self.polls[:100_000]
            time.sleep(self.every)

    def between(self, t0: float, t1: float) -> list[tuple[float, dict[int, int]]]:
        with self.lock:
            return [(t, p) for t, p in self.polls if t0 <= t <= t1]

    def max_mem(self, pid: int, t0: float, t1: float) -> int:
        return max((p.get(pid, 0) for _, p in self.between(t0, t1)), default=0)

    def pids_seen(self, t0: float, t1: float) -> set[int]:
        return {pid for _, p in self.between(t0, t1) for pid in p}

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.nv.nvmlShutdown()


class ExitWatch:
    """The moment a local process exits (pidfd), seen from a thread."""

    def __init__(self, pid: int) -> None:
        self.at: float | None = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.at = time.time()
            return

        def wait() -> None:
            select.select([fd], [], [])
            self.at = time.time()
            os.close(fd)

        threading.Thread(target=wait, daemon=True).start()


# ---- the stack ------------------------------------------------------------------------------------


class Stack:
    """`gpulease up` (Redis, lease server, node agent, Ray head; no JupyterLab) as a child process."""

    def __init__(self, out: Path, simulate: str | None) -> None:
        from lease_server.leasing.inventory import parse_simulate

        self.work = Path(tempfile.mkdtemp(prefix="gpulease-gpu-run-"))
        self.home = self.work / "home"
        self.simulate = simulate
        if simulate:
            inv = parse_simulate(simulate)[0]
        else:
            from lease_server.node.agent import nvml_inventory

            inv = nvml_inventory()
        self.node, self.pool = inv.node, inv.pool
        self.gpu_model, self.gpu_mb = inv.gpus[0].model, inv.gpus[0].memory_mb
        self.user = re.sub(r"[^A-Za-z0-9._-]", "-", getpass.getuser()) or "user"
        cfg = self.work / "gpulease.toml"
        # Short idle thresholds for the idle check; the notebook's user is exempt, so that its warm
        # worker is not reclaimed between cells while the run looks at it.
        cfg.write_text(
            "".join(f"{k} = {v}\n" for k, v in IDLE.items())
            + f'\n[policy."{self.pool}"]\nexempt_users = ["{self.user}"]\n'
        )
        from magics.kernel import install

        install(prefix=str(self.work / "prefix"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "GPULEASE_HOME": str(self.home),
            "GPULEASE_WARM": "on",
            "JUPYTER_PATH": str(self.work / "prefix" / "share" / "jupyter"),
        }
        for k in ("GPULEASE_URL", "GPULEASE_TOKEN"):
            self.env.pop(k, None)
        self.log_path = out / "up.log"
        cmd = [sys.executable, "-m", "lease_server.cli", "up", "--no-lab", "--port", str(self.port)]
        cmd += ["--data-dir", str(self.home), "--config", str(cfg)]
        cmd += ["--simulate", simulate] if simulate else []
        log("starting:", " ".join(cmd[1:]))
        with open(self.log_path, "w") as f:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        (out / "up.pid").write_text(f"{self.proc.pid}\n")  # run_all.sh ends it if this process could not
        import httpx

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpulease up exited ({self.proc.returncode}): {self.log_path.read_text()[-2000:]}")
            try:
                if (
                    httpx.get(f"{self.url}/api/v1/health", timeout=1).status_code == 200
                    and (self.home / "token").exists()
                ):
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > 150:
                raise RuntimeError("gpulease up did not answer within 150 s")
            time.sleep(0.2)
        self.up_s = round(time.monotonic() - t0, 1)
        from lease_server.client import Client

        self.admin = Client(self.url, (self.home / "token").read_text().strip())
        log(f"gpulease up answered after {self.up_s}s: node {self.node}, pool {self.pool}, user {self.user}")

    def client_for(self, user: str) -> Any:
        from lease_server.client import Client

        return Client(self.url, self.admin.request("POST", "/api/v1/tokens", json={"user": user})["token"])

    def events(self, since: str = "0") -> list[dict[str, Any]]:
        return list(self.admin.request("GET", "/api/v1/events/log", params={"since": since, "limit": 1000})["events"])

    def mark(self) -> str:
        """The newest event's id: what comes after it is what a check caused."""
        page = self.admin.request("GET", "/api/v1/events/log", params={"order": "desc", "limit": 1})["events"]
        return str(page[0]["id"]) if page else "0"

    def wait_event(self, match: Any, timeout: float, since: str = "0") -> dict[str, Any] | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for ev in self.events(since):
                if match(ev):
                    return ev
            time.sleep(0.05)
        return None

    def keep_ray_logs(self) -> None:
        """The Ray head's session logs (its workers' stderr: where a CUDA error is told) into
        ``home/ray-logs``, each file's last 256 KiB: up removes its Ray directory as it stops."""
        since = self.work.stat().st_mtime - 60
        found = [d for d in Path("/tmp").glob("gpulease-*/ray/session_latest/logs") if d.stat().st_mtime >= since]
        if not found:
            return
        dest = self.home / "ray-logs"
        dest.mkdir(exist_ok=True)
        for f in max(found, key=lambda d: d.stat().st_mtime).iterdir():
            if f.is_file() and f.suffix in (".err", ".out", ".log"):
                with open(f, "rb") as src:
                    src.seek(max(0, f.stat().st_size - 256 * 1024))
                    (dest / f.name).write_bytes(src.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.keep_ray_logs()
            except OSError as exc:
                log("could not keep Ray's logs:", exc)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


# ---- the notebook ---------------------------------------------------------------------------------


class Notebook:
    """A notebook executed cell by cell through nbclient, on the gpulease kernel."""

    def __init__(self, stack: Stack) -> None:
        import nbformat
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager
        from nbclient import NotebookClient

        self.nbformat = nbformat
        self.nb = nbformat.v4.new_notebook()
        self.nb.metadata["kernelspec"] = {
            "name": "gpulease",
            "display_name": "Python 3 (gpulease)",
            "language": "python",
        }
        ksm = KernelSpecManager(kernel_dirs=[stack.env["JUPYTER_PATH"] + "/kernels"])
        self.km = KernelManager(kernel_name="gpulease", kernel_spec_manager=ksm)
        os.environ.update({k: v for k, v in stack.env.items() if k.startswith(("GPULEASE_", "JUPYTER_"))})
        self.client = NotebookClient(self.nb, km=self.km, timeout=180, allow_errors=True)
        self._ctx = self.client.setup_kernel()
        self._ctx.__enter__()
        self.kernel_pid = self.km.provisioner.process.pid if self.km.provisioner else None

    def run(self, source: str) -> tuple[list[dict[str, Any]], float]:
        """Execute one new cell; (its outputs, seconds from the request to the end)."""
        cell = self.nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        t0 = time.perf_counter()
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        return [dict(o) for o in cell.outputs], time.perf_counter() - t0

    def value(self, expr: str) -> Any:
        out, _ = self.run(f"import json as _j\nprint(_j.dumps({expr}, default=str))")
        text = "".join(o.get("text", "") for o in out if o.get("output_type") == "stream").strip()
        if not text:
            raise RuntimeError(f"{expr}: {errors_of(out)}")
        return json.loads(text.splitlines()[-1])

    def started_ms(self, source: str, t_name: str = "t_first") -> tuple[float, list[dict[str, Any]]]:
        """Execute ``source`` (its first line sets ``t_name``): ms from the request to that line."""
        t0 = time.time()
        out, _ = self.run(source)
        if errors_of(out):
            raise RuntimeError(f"the cell failed: {errors_of(out)}")
        return (float(self.value(t_name)) - t0) * 1000, out

    def save(self, path: Path) -> None:
        self.nbformat.write(self.nb, str(path))

    def close(self) -> None:
        if self._ctx is None:
            return
        ctx, self._ctx = self._ctx, None
        try:
            ctx.__exit__(None, None, None)
        except Exception:  # noqa: BLE001
            pass
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)


def errors_of(out: list[dict[str, Any]]) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for o in out if o.get("output_type") == "error"]


def closing_line(out: list[dict[str, Any]]) -> str:
    """The cell's status line as it stands at the end (nbclient applies the display updates)."""
    shown = [
        o["data"]["text/plain"]
        for o in out
        if o.get("output_type") in ("display_data", "update_display_data")
        and str(o.get("data", {}).get("text/plain", "")).startswith("gpu_train:")
    ]
    return shown[-1] if shown else ""


def peak_gb(line: str) -> float | None:
    m = re.search(r"peak (\d+(?:\.\d+)?) GB", line)
    return float(m.group(1)) if m else None


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return round(xs[len(xs) // 2], 2) if xs else None


# ---- the checks -----------------------------------------------------------------------------------

MODEL_CELL = """%%gpu_train --gpus 1 --out model,train_loss,train_device,ptr1,worker_pid,t_first
import time
t_first = time.time()
import os, torch
cuda = torch.cuda.is_available()
dev = "cuda:0" if cuda else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(dev)
opt = torch.optim.Adam(model.parameters(), 1e-2)
Xd, yd = X.to(dev), y.to(dev)
for step in range(300):
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(Xd), yd)
    opt.zero_grad(); loss.backward(); opt.step()
train_loss = float(loss)
train_device = str(next(model.parameters()).device)
ptr1 = model[0].weight.data_ptr()
worker_pid = os.getpid()
del Xd, yd
"""
WARM_CELL = """%%gpu_train --gpus 1 --out t_first,warm_device,same_ptr,same_pid,warm_acc
import time
t_first = time.time()
import os
warm_device = str(model[0].weight.device)
same_ptr = model[0].weight.data_ptr() == ptr1
same_pid = os.getpid() == worker_pid
warm_acc = float(((model(X.to(model[0].weight.device)) > 0).float().cpu() == y).float().mean())
"""
BODY = (
    "import time\nt_first = time.time()\nimport torch\n"
    "m = torch.nn.Linear(64, 64)\nz = float(m(torch.randn(8, 64)).sum())\n"
)
COLD_CUDA = (
    "%%gpu_train --gpus 1 --cold --out t_first,t_cuda\nimport time\nt_first = time.time()\nimport torch\n"
    "t_cuda = None\nif torch.cuda.is_available():\n"
    "    torch.zeros(1, device='cuda:0'); torch.cuda.synchronize(); t_cuda = time.time()\n"
)
HOLD = (
    "%%gpu_train --gpus 1 --cold --out held,cell_pid\nimport os, torch, time\nheld = 0\ncell_pid = os.getpid()\n"
    "if torch.cuda.is_available():\n"
    "    n = int({frac} * torch.cuda.get_device_properties(0).total_memory) if {frac} < 1 else {frac}\n"
    "    buf = torch.empty(n, dtype=torch.uint8, device='cuda:0'); buf.fill_(1); torch.cuda.synchronize()\n"
    "    held = n; time.sleep(0.5)\n"
)
SUSPEND_GIB = 10  # the target: a worker holding 10 GiB suspends in <= 3 s, restores in <= 2 s
CYCLES = 3
SUSPEND_HOLD = (
    "%%gpu_train --gpus 1 --out hold_pid\nimport os, torch\nhold_pid = os.getpid()\n"
    "if torch.cuda.is_available():\n"
    # int64, 8 bytes an element (int32 would wrap past 2**31 elements, and the check below fail)
    "    hold = torch.arange({gib} * 2**27, dtype=torch.int64, device='cuda:0'); torch.cuda.synchronize()\n"
    "else:\n    hold = torch.arange(1024, dtype=torch.int64)\n"
    "hold_ptr = hold.data_ptr()\n"
)
SUSPEND_CHECK = (
    "%%gpu_train --gpus 1 --out same_ptr,intact,same_pid\nimport os, torch\n"
    "same_ptr = hold.data_ptr() == hold_ptr\nsame_pid = os.getpid() == hold_pid\n"
    "intact = bool(hold[-1].item() == hold.numel() - 1 and hold[:1000].sum().item() == 499500)\n"
)
IDLE_CHILD = (
    "import os, sys, time, torch\n"
    "a = torch.randn(4096, 4096, device='cuda'); torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "end = time.time() + float(sys.argv[1])\n"
    "while time.time() < end:\n    a = (a @ a).tanh_()\n    torch.cuda.synchronize()\n"
    "print('idle %.3f' % time.time(), flush=True)\n"
    "time.sleep(600)\n"
)


class Run:
    def __init__(self, out: Path, simulate: str | None) -> None:
        self.out, self.simulate = out, simulate
        self.r: dict[str, Any] = {"mode": "simulate" if simulate else "gpu", "errors": {}}
        self.nvml: NvmlWatch | None = None
        self.no_cuda = "simulated GPUs: no CUDA here" if simulate else ""
        self.no_nvml = "simulated GPUs: no NVML here" if simulate else ""
        self.reps = 3 if simulate else 5  # cells per start figure (the median is reported)

    def step(self, name: str, fn: Any) -> None:
        t0 = time.monotonic()
        log(f"== {name}")
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported, and the next check runs
            self.r["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"{name} FAILED:", traceback.format_exc()[-3000:])
        self.r.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 1)
        self.save()  # a later step killed by run_all.sh's time limit loses only its own figures

    def save(self) -> None:
        self.r["total_s"] = round(time.monotonic() - T0, 1)
        (self.out / "notebook.json").write_text(json.dumps(self.r, indent=1, default=str))

    # -- cell 1, 2: a model trained on cuda:0, kept warm, a CPU copy in the kernel --
    def train_and_warm(self) -> None:
        nb = self.nb
        nb.run(
            "import torch\ntorch.manual_seed(1)\nX = torch.randn(4096, 64)\ny = (X.sum(1, keepdim=True) > 0).float()"
        )
        t_req = time.time()
        out, took = nb.run(MODEL_CELL)
        if errors_of(out):
            raise RuntimeError(f"the training cell failed: {errors_of(out)}")
        line1 = closing_line(out)
        got = nb.value(
            "{'train_device': train_device, 'train_loss': train_loss, 'ptr1': ptr1, 'worker_pid': worker_pid,"
            " 'kernel_device': str(next(model.parameters()).device),"
            " 'kernel_acc': float(((model(X) > 0).float() == y).float().mean()),"
            " 'kernel_cuda_visible': __import__('os').environ.get('CUDA_VISIBLE_DEVICES'),"
            " 'kernel_cuda_initialized': torch.cuda.is_initialized()}"
        )
        self.worker_pid = int(got["worker_pid"])
        out2, _ = nb.run(WARM_CELL)
        if errors_of(out2):
            raise RuntimeError(f"the warm cell failed: {errors_of(out2)}")
        w = nb.value("{'warm_device': warm_device, 'same_ptr': same_ptr, 'same_pid': same_pid, 'warm_acc': warm_acc}")
        cuda = got["train_device"].startswith("cuda")
        self.r["train"] = {
            "trained_on": got["train_device"],
            "trained_on_cuda0": got["train_device"] == "cuda:0" if not self.simulate else absent(self.no_cuda),
            "train_loss": round(got["train_loss"], 4),
            "train_cell_s": round(took, 2),
            "cell1_line": line1,
            "cell2_line": closing_line(out2),
            "cell2_same_worker": w["same_pid"],
            "cell2_device": w["warm_device"],
            "cell2_same_data_ptr": w["same_ptr"] if cuda else absent(self.no_cuda or "trained on the CPU"),
            "cell2_accuracy": round(w["warm_acc"], 4),
            "kernel_copy_device": got["kernel_device"],
            "kernel_copy_usable": got["kernel_device"] == "cpu" and got["kernel_acc"] > 0.6,
            "kernel_accuracy": round(got["kernel_acc"], 4),
            "kernel_cuda_visible_devices": got["kernel_cuda_visible"],
            "kernel_opened_cuda": got["kernel_cuda_initialized"],
        }
        if self.nvml is not None:
            self.r["train"]["worker_on_gpu_mb_nvml"] = self.nvml.max_mem(self.worker_pid, t_req, time.time()) // 2**20
        log(json.dumps(self.r["train"]))

    # -- cell starts: plain, cold (import torch + a CUDA context); before any worker is kept warm --
    def cold_starts(self) -> None:
        nb = self.nb
        plain = [nb.started_ms(BODY)[0] for _ in range(self.reps)]
        cold, cuda_ready = [], []
        # the first pays torch's import in the spare; the second finds it imported (simulate: one, for time)
        for _ in range(1 if self.simulate else 2):
            ms, out = nb.started_ms(COLD_CUDA)
            cold.append(ms)
            t_cuda = nb.value("t_cuda")
            if t_cuda is not None:
                cuda_ready.append(ms + (float(t_cuda) - float(nb.value("t_first"))) * 1000)
        self.r["starts"] = {
            "plain_cell_start_ms": median(plain),
            "cold_cell_start_ms": round(cold[-1], 1),
            "cold_cell_first_ms": round(cold[0], 1),
            "cold_cell_cuda_ready_ms": round(cuda_ready[-1], 1) if cuda_ready else absent(self.no_cuda or "no CUDA"),
            "cold_cell_cuda_context_ms": round(cuda_ready[-1] - cold[-1], 1)
            if cuda_ready
            else absent(self.no_cuda or "no CUDA"),
        }
        log(json.dumps(self.r["starts"]))

    # -- warm cell starts, in the worker that holds the model --
    def warm_starts(self) -> None:
        warm = [self.nb.started_ms(WARM_CELL)[0] for _ in range(self.reps)]
        starts = self.r.setdefault("starts", {})
        starts["warm_cell_start_ms"] = median(warm)
        starts["warm_cell_start_all_ms"] = [round(x, 1) for x in warm]
        log(json.dumps(starts))

    # -- another user's request evicts the warm worker --
    def evict(self) -> None:
        nb, stack = self.nb, self.stack
        nb.run(WARM_CELL)  # warm again (the cold cells above released their own leases only)
        pid = int(nb.value("worker_pid"))
        gone = ExitWatch(pid)
        notebook_pids = self.nvml.pids_seen(0, time.time()) if self.nvml else set()
        mark = stack.mark()
        bob = stack.client_for("bob")
        t0 = time.time()
        lease = bob.acquire(1, wait=30)
        t1 = time.time()
        grant = stack.wait_event(lambda e: e["type"] == "grant" and e.get("lease") == lease.id, 5, mark) or {}
        evicting = stack.wait_event(lambda e: e["type"] == "evicting", 5, mark) or {}
        grant_ts = float(grant.get("ts", t1))
        suspended = stack.wait_event(lambda e: e["type"] == "suspended", 0.5, mark)
        r: dict[str, Any] = {
            "evict_to_grant_ms": round((t1 - t0) * 1000, 1),
            "grant_within_1s": (t1 - t0) <= 1.0,
            "evicting_to_grant_ms": round((grant_ts - evicting["ts"]) * 1000, 1) if evicting else None,
            # suspended to host (its GPU state off the GPU, the process lives on) or ended, before the grant
            "worker_suspended": suspended is not None,
            "worker_off_gpu_before_grant": (suspended is not None and float(suspended["ts"]) <= grant_ts)
            or (gone.at is not None and gone.at <= grant_ts + 0.005),
            "worker_exit_to_grant_ms": round((grant_ts - gone.at) * 1000, 1) if gone.at else None,
            "granted_gpu": [g["index"] for g in lease.gpus],
        }
        if self.nvml is not None:
            polls = self.nvml.between(t0 - 1, grant_ts)
            listed = [t for t, p in polls if set(p) & (notebook_pids | {pid})]
            last = max(listed, default=None)
            clear = [t for t, p in polls if not set(p) & (notebook_pids | {pid}) and (last is None or t > last)]
            r["notebook_pids_on_gpu"] = sorted(notebook_pids | {pid})
            r["nvml_clear_before_grant"] = bool(clear) and max(clear) <= grant_ts
            r["nvml_last_listed_to_grant_ms"] = round((grant_ts - last) * 1000, 1) if last else None
            r["nvml_polls"] = len(polls)
        else:
            r["nvml_clear_before_grant"] = absent(self.no_nvml)
        bob.release(lease)
        self.r["evict"] = r
        log(json.dumps(r))

    # -- suspend to host: a worker holding GPU memory, evicted and restored, a few times --
    def suspend(self) -> None:
        """A worker holding SUSPEND_GIB of GPU memory (simulated: nothing) is evicted by another
        user's request and restored on the notebook's next cell, CYCLES times: each cycle's bytes, ms
        and GB/s of suspend and restore (the node agent's figures), the tensor's data_ptr and contents
        after, NVML listing none of the worker while suspended, and nothing left locked."""
        nb, stack = self.nb, self.stack
        out, _ = nb.run(SUSPEND_HOLD.format(gib=SUSPEND_GIB))
        if errors_of(out):
            raise RuntimeError(f"the holding cell failed: {errors_of(out)}")
        pid = int(nb.value("hold_pid"))
        bob = stack.client_for("bob")
        cycles = []
        for _ in range(CYCLES):
            mark = stack.mark()
            lease = bob.acquire(1, wait=60)
            sus = stack.wait_event(lambda e: e["type"] == "suspended", 5, mark)
            on_gpu = None if self.nvml is None else pid in self.nvml.procs()
            bob.release(lease)
            out, _ = nb.run(SUSPEND_CHECK)
            if errors_of(out):
                raise RuntimeError(f"the restoring cell failed: {errors_of(out)}")
            res = stack.wait_event(lambda e: e["type"] == "restored", 5, mark)
            got = nb.value("{'same_ptr': same_ptr, 'intact': intact, 'same_pid': same_pid}")
            c: dict[str, Any] = {"suspended": sus is not None, "restored": res is not None, **got}
            c["line"] = closing_line(out)
            if self.simulate:
                for k in ("bytes", "suspend_ms", "restore_ms", "suspend_gbps", "restore_gbps", "nvml_empty"):
                    c[k] = absent(self.no_cuda)
            elif sus is not None and res is not None:
                n = int(sus["bytes"])
                c.update(bytes=n, suspend_ms=sus["ms"], restore_ms=res["ms"], nvml_empty=on_gpu is False)
                c["suspend_gbps"] = round(n / 1e9 / max(sus["ms"] / 1000, 1e-6), 2)
                c["restore_gbps"] = round(n / 1e9 / max(res["ms"] / 1000, 1e-6), 2)
            cycles.append(c)
        self.r["suspend"] = {"gib": SUSPEND_GIB, "cycles": cycles, "worker_pid": pid}
        log(json.dumps(self.r["suspend"]))

    # -- the closing line's peak against NVML; the right-size hint --
    def peaks(self) -> None:
        nb = self.nb
        nb.run("%gpu_lease release")  # the suspend step's warm worker (10 GiB) is not this cell's peak
        rows = {}
        for label, frac in (("small_2gib", 2 * 2**30), ("large_30pct", 0.3)):
            t0 = time.time()
            out, _ = nb.run(HOLD.format(frac=frac))
            t1 = time.time()
            if errors_of(out):
                raise RuntimeError(f"{label}: {errors_of(out)}")
            line = closing_line(out)
            row: dict[str, Any] = {"line": line, "line_peak_gb": peak_gb(line), "hint": "would do" in line}
            if self.nvml is not None:
                nv = self.nvml.max_mem(int(nb.value("cell_pid")), t0, t1)  # the cell's worker alone
                row["nvml_peak_gb"] = round(nv / 2**30, 2)
                lp = row["line_peak_gb"]
                row["agrees"] = lp is not None and abs(lp - nv / 2**30) <= max(0.2, 0.05 * nv / 2**30)
            else:
                row["nvml_peak_gb"] = absent(self.no_nvml)
            rows[label] = row
        hint_ok: Any = rows["small_2gib"]["hint"] and not rows["large_30pct"]["hint"]
        self.r["peak"] = {
            **rows,
            "peak_agrees_with_nvml": all(r.get("agrees") for r in rows.values()) if self.nvml else absent(self.no_nvml),
            "right_size_hint_ok": hint_ok if not self.simulate else absent("no measured peak on simulated GPUs"),
        }
        log(json.dumps(self.r["peak"]))

    # -- idle reclaim from the node agent's samples (NVML on a GPU), short thresholds --
    def idle(self) -> None:
        nb, stack = self.nb, self.stack
        nb.run("%gpu_lease release")  # the notebook's warm lease, if any: the GPU is free for the idler
        idler = stack.client_for("idler")
        mark = stack.mark()
        lease = idler.acquire(1, ttl=120, wait=30, label="idle check")
        child = None
        t_lease = time.time()
        if self.simulate:
            stack.admin.request(
                "PUT",
                f"/api/v1/simulate/{lease.node}",
                json={"gpus": {str(lease.gpus[0]["index"]): {"util": 90, "mem_mb": 1000, "procs": []}}},
            )
            time.sleep(BUSY_S)
            stack.admin.request(
                "PUT",
                f"/api/v1/simulate/{lease.node}",
                json={"gpus": {str(lease.gpus[0]["index"]): {"util": 0, "mem_mb": 1000, "procs": []}}},
            )
            t_idle = time.time()
        else:
            env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(lease.gpus[0]["index"])}
            child = subprocess.Popen(
                [sys.executable, "-c", IDLE_CHILD, str(BUSY_S)], stdout=subprocess.PIPE, text=True, env=env
            )
            assert child.stdout is not None
            child.stdout.readline()
            t_idle = float(child.stdout.readline().split()[1])
            exited = ExitWatch(child.pid)
        limit = IDLE["idle_timeout"] + IDLE["grace"] + 15
        warn = stack.wait_event(lambda e: e["type"] == "idle_warning" and e.get("lease") == lease.id, limit, mark)
        rec = stack.wait_event(lambda e: e["type"] == "reclaimed" and e.get("lease") == lease.id, limit, mark)
        drained = None  # simulated: no process to drain
        if not self.simulate:
            drained = stack.wait_event(lambda e: e["type"] == "drained" and e.get("lease") == lease.id, 15, mark)
        r: dict[str, Any] = {
            "thresholds": IDLE,
            "busy_s": BUSY_S,
            "warned": warn is not None,
            "reclaimed": rec is not None,
        }
        if warn:
            r["warned_after_idle_s"] = round(warn["ts"] - t_idle, 2)
            r["not_warned_while_busy"] = warn["ts"] >= t_idle
            window = [s for g in (warn.get("evidence") or {}).get("gpus", {}).values() for s in g]
            r["evidence_samples"] = len(window)
            r["evidence_max_util"] = max((s[1] for s in window), default=None)
            r["evidence_busy_seen"] = any(s[1] >= 50 for s in window if s[0] >= t_lease - 1)
        if rec and warn:
            r["reclaimed_after_warning_s"] = round(rec["ts"] - warn["ts"], 2)
        r["drained_ms"] = drained.get("took_ms") if drained else None
        r["samples_from"] = "simulated" if self.simulate else "nvml"
        if child is not None:
            time.sleep(0.5)
            r["idle_process_ended_by_agent"] = exited.at is not None
            if child.poll() is None:
                child.kill()
        r["ok"] = bool(
            warn and rec and r.get("not_warned_while_busy") and (self.simulate or r.get("evidence_busy_seen"))
        )
        self.r["idle"] = r
        log(json.dumps(r))

    def main(self) -> dict[str, Any]:
        try:
            self.stack = Stack(self.out, self.simulate)
        except Exception as exc:  # noqa: BLE001
            self.r["errors"]["up"] = f"{type(exc).__name__}: {exc}"[:3000]
            return self.r
        st = self.stack
        self.r["stack"] = {"node": st.node, "pool": st.pool, "gpu": st.gpu_model, "gpu_mb": st.gpu_mb, "up_s": st.up_s}
        if not self.simulate:
            try:
                self.nvml = NvmlWatch()
            except Exception as exc:  # noqa: BLE001
                self.r["errors"]["nvml"] = repr(exc)
        try:
            t0 = time.monotonic()
            self.nb = Notebook(st)
            self.r["stack"]["kernel_start_s"] = round(time.monotonic() - t0, 1)
            self.step("cold_starts", self.cold_starts)
            self.step("train_and_warm", self.train_and_warm)
            self.step("warm_starts", self.warm_starts)
            self.step("evict", self.evict)
            self.step("suspend", self.suspend)
            self.step("peaks", self.peaks)
            self.step("idle", self.idle)
        except Exception as exc:  # noqa: BLE001
            self.r["errors"]["notebook"] = f"{type(exc).__name__}: {exc}"[:3000]
            log(traceback.format_exc())
        finally:  # also on SIGTERM (run_all.sh's time limit): nothing of the run is left running
            nb = getattr(self, "nb", None)
            if nb is not None:
                try:
                    nb.save(self.out / "notebook.ipynb")
                finally:
                    nb.close()
            if self.nvml is not None:
                self.nvml.close()
            st.stop()
        return self.r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--simulate", default=None, help="e.g. 1xA100-80GB: simulated GPUs, no CUDA")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run finally blocks: stop what was started
    run = Run(args.out, args.simulate)
    try:
        run.main()
    except SystemExit:  # SIGTERM: what was measured so far is still reported
        run.r["errors"]["interrupted"] = "stopped by run_all.sh's time limit (SIGTERM)"
    finally:
        run.save()
        print(json.dumps(run.r, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
