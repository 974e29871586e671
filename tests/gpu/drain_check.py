"""Draining on a real GPU, through the real server: a Redis, the lease server with its in-process
node agent reading the GPUs through NVML (as ``gpulease up`` without --simulate), and CUDA processes
that hold GPU memory. For each way the server ends a lease (an admin's revoke; the expiry of a
holder frozen with SIGSTOP) while another user waits:

* the GPU shows ``draining`` on the board, not free;
* the agent finds the old process in NVML's process list of that GPU (nothing was named to it) and
  ends it: SIGTERM, ignored here, then SIGKILL after ``drain_kill_grace_s``;
* the waiter is granted only after that process exited (pidfd) and NVML lists no process there;
* the ``drained`` event says how long it took.

Run from the repository root on a machine with an NVIDIA GPU and torch with CUDA, with redis-py,
hiredis, tornado and prometheus-client importable and a redis-server binary:

    GPULEASE_REDIS_SERVER=/path/to/redis-server PYTHONPATH=. python3 tests/gpu/drain_check.py

Prints what it sees and ends with one JSON line of figures. Not a pytest module.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lease_server.client import Client
from lease_server.config import Settings
from lease_server.node.agent import NvmlSampler, nvml_inventory
from lease_server.node.redis_proc import RedisProcess
from lease_server.store.engine import connect
from lease_server.store.keys import Keys
from lease_server.web.auth import create_token
from lease_server.web.server import serve

GRACE = 1.0
JITTER_MS = 5
CUDA_CHILD = (
    "import signal, time, torch\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # only the agent's SIGKILL ends it
    "x = torch.ones(256 << 20, device='cuda')\n"  # 1 GiB
    "torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def log(*parts: Any) -> None:
    print(*parts, flush=True)


class CudaChild:
    def __init__(self, gpu: int) -> None:
        env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu)}
        self.p = subprocess.Popen([sys.executable, "-c", CUDA_CHILD], stdout=subprocess.PIPE, text=True, env=env)
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == "ready"
        self.exited_ms: float | None = None
        fd = os.pidfd_open(self.p.pid)
        self._done = threading.Event()

        def wait() -> None:
            select.select([fd], [], [])
            self.exited_ms = time.time() * 1000
            os.close(fd)
            self._done.set()

        threading.Thread(target=wait, daemon=True).start()

    def wait(self, timeout: float) -> float:
        assert self._done.wait(timeout), f"pid {self.p.pid} still runs"
        self.p.wait()
        assert self.exited_ms is not None
        return self.exited_ms


def events(client: Client, since: str) -> list[dict[str, Any]]:
    return list(client.request("GET", "/api/v1/events/log", params={"since": since, "limit": 1000})["events"])


def wait_event(client: Client, since: str, match: Any, timeout: float = 30) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for ev in events(client, since):
            if match(ev):
                return ev
        time.sleep(0.05)
    raise AssertionError("event not seen")


def board(client: Client) -> dict[int, str]:
    return {g["index"]: g["state"] for n in client.cluster()["nodes"] for g in n["gpus"]}


def scenario(name: str, admin: Client, alice: Client, bob: Client, nvml: NvmlSampler, gpu: int) -> dict[str, Any]:
    mark = events(admin, "0")[-1]["id"]
    child = CudaChild(gpu)  # its CUDA start takes seconds: before the lease, so a short TTL is all lease
    try:
        return _scenario(name, admin, alice, bob, nvml, gpu, mark, child)
    finally:  # a failed check leaves no process holding GPU memory for the next step to find
        if child.p.poll() is None:
            child.p.kill()
            child.p.wait()


def _scenario(
    name: str, admin: Client, alice: Client, bob: Client, nvml: NvmlSampler, gpu: int, mark: str, child: CudaChild
) -> dict[str, Any]:
    lease = alice.acquire(1, ttl=60 if name == "revoke" else 3)
    idx = int(lease.gpus[0]["index"])
    assert idx == gpu
    seen = idx in [g["index"] for g in nvml.sample() if child.p.pid in g["procs"]]
    log(f"[{name}] lease {lease.id} on GPU {idx}; CUDA child {child.p.pid} in NVML's list: {seen}")
    got: list[Any] = []
    rid = Client.new_request_id()
    t = threading.Thread(target=lambda: got.append(bob.acquire(1, wait=60, request_id=rid)), daemon=True)
    t.start()
    wait_event(admin, mark, lambda e: e["type"] == "queued" and e.get("lease") == rid)
    if name == "revoke":
        admin.revoke(lease.id, "drain check")
    else:
        os.kill(child.p.pid, signal.SIGSTOP)  # the holder is frozen: it cannot renew, nor end anything
        wait_event(admin, mark, lambda e: e["type"] == "expired" and e.get("lease") == lease.id)
    states = board(admin)
    log(f"[{name}] board right after the end: GPU {idx} {states[idx]}")
    drained = wait_event(admin, mark, lambda e: e["type"] == "drained" and e.get("lease") == lease.id)
    exited = child.wait(10)
    grant = wait_event(admin, mark, lambda e: e["type"] == "grant" and e.get("lease") == rid)
    t.join(10)
    left = [g["procs"] for g in nvml.sample() if g["index"] == idx][0]
    used = nvml.used_mb(nvml.handles[idx])
    # The grant must not come before the exit. On an NVML node the agent waits for NVML's process
    # list of the GPU to empty (the CUDA context gone), which the driver does as the process exits;
    # the exit time here is taken by a thread of this busy process: a few ms of jitter either way.
    ok = grant["ts"] * 1000 >= exited - JITTER_MS and states[idx] == "draining" and seen and not left
    log(
        f"[{name}] drained after {drained['took_ms']} ms ({drained['killed']} process ended); "
        f"old process exited {exited:.0f}, waiter granted {grant['ts'] * 1000:.0f} "
        f"({grant['ts'] * 1000 - exited:.0f} ms later); NVML now lists {left} on GPU {idx}, {used} MiB used"
    )
    bob.release(got[0])
    return {
        f"{name}_drain_ms": drained["took_ms"],
        f"{name}_grant_after_exit_ms": round(grant["ts"] * 1000 - exited),
        f"{name}_board_draining": states[idx] == "draining",
        f"{name}_seen_by_nvml": seen,
        f"{name}_mem_used_after_mb": used,
        f"{name}_ok": bool(ok),
    }


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    redis = RedisProcess(tmp / "redis").start()
    inv = nvml_inventory(node="gpu-host")
    # GPU samples once a minute: a sample between a check's CUDA child starting and its lease would
    # see a process no lease covers on a free GPU, and hold the GPU out of the pool (unleased use)
    settings = Settings.load(
        None,
        redis_url=redis.url,
        port=0,
        sweep_interval=0.1,
        drain_kill_grace_s=GRACE,
        drain_interval=0.1,
        sample_interval=60,
        idle_timeout=600,
    )
    ready, port, holder = threading.Event(), [], {}

    def run() -> None:
        async def go() -> None:
            holder["stop"], holder["loop"] = asyncio.Event(), asyncio.get_running_loop()
            await serve(
                settings, stop=holder["stop"], on_ready=lambda p: (port.append(p), ready.set()), local_nodes=[inv]
            )

        asyncio.run(go())

    threading.Thread(target=run, daemon=True).start()
    assert ready.wait(30)

    async def tok(user: str, role: str) -> str:
        r = connect(redis.url)
        try:
            return await create_token(r, Keys(settings.prefix), user, role)
        finally:
            await r.aclose()

    url = f"http://127.0.0.1:{port[0]}"
    admin, alice, bob = (
        Client(url, asyncio.run(tok(u, r))) for u, r in (("root", "admin"), ("alice", "user"), ("bob", "user"))
    )
    nvml = NvmlSampler()
    log(f"node {inv.node}: {len(inv.gpus)} GPU(s) {inv.gpus[0].model}, pool {inv.pool} (NVML)")
    figures: dict[str, Any] = {"gpus": len(inv.gpus), "model": inv.gpus[0].model, "grace_s": GRACE}
    for name in ("revoke", "frozen_expiry"):
        figures.update(scenario(name, admin, alice, bob, nvml, 0))
    nvml.close()
    holder["loop"].call_soon_threadsafe(holder["stop"].set)
    redis.stop()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
