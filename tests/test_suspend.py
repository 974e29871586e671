"""Suspend to host on the lease server and its node agent: a warm lease handed back with its worker
suspended (lua/suspend.lua, lease_server/node/onhost.py), the waiter granted once the agent has it
off the GPU, the worker restored onto its owner's next lease, or ended (warm_max, the node's
host-memory budget).

Real lease server, Redis and in-process node agent on simulated GPUs; a real process stands in for
the warm worker and claims its leases at the agent's socket as a worker does (the magic's own path,
through a kernel and Ray, is in tests/test_warm_cells.py).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

from lease_server import errors
from lease_server.cli.events import describe
from lease_server.sizes import show_mb
from tests.api_helpers import EventWatcher
from tests.test_drain import GRACE, claim_line, procs  # noqa: F401

# A worker: claims what it reads on stdin (claims.claim's arguments, "restore" among them) and
# prints the agent's answer, one JSON object a line.
WORKER = (
    "import json, sys\n"
    "from lease_server.node.claims import ClaimRefused, claim\n"
    "print('up', flush=True)\n"
    "for line in sys.stdin:\n"
    "    try:\n"
    "        print(json.dumps(claim(**json.loads(line))), flush=True)\n"
    "    except (ClaimRefused, OSError) as exc:\n"
    "        print(json.dumps({'refused': str(exc)}), flush=True)\n"
)


def say(proc: Any, line: str) -> dict[str, Any]:
    proc.proc.stdin.write(line + "\n")
    proc.proc.stdin.flush()
    out: dict[str, Any] = json.loads(proc.proc.stdout.readline())
    return out


def claim(client: Any, lease: Any, proc: Any, restore: bool = False) -> dict[str, Any]:
    line = json.loads(claim_line(client, lease, lease.node))
    if restore:
        line["restore"] = True
    return say(proc, json.dumps(line))


def _srv(server_factory: Any, **kw: Any) -> Any:
    return server_factory(
        simulate="n1=1xA100-80GB",
        drain_kill_grace_s=GRACE,
        drain_interval=0.1,
        scheduling={"A100-80GB": {"warm_evict_notice": 5, **kw.pop("sched", {})}},
        **kw,
    )


@pytest.fixture
def srv(server_factory: Any) -> Any:
    return _srv(server_factory)


def warm_claimed(srv: Any, procs: Any) -> tuple[Any, Any, Any]:  # noqa: F811
    alice = srv.client("alice")
    lease = alice.acquire(1)
    worker = procs(WORKER)
    assert claim(alice, lease, worker) == {"ok": True}
    alice.warm(lease)
    return alice, lease, worker


def test_an_evicted_warm_worker_is_suspended_the_waiter_granted_and_the_worker_restored(srv, procs):  # noqa: F811
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, lease, worker = warm_claimed(srv, procs)
    assert srv.client("root").cluster()["nodes"][0]["suspend"] == "simulated"
    bob = srv.client("bob")
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.setdefault("lease", bob.acquire(1, wait=30)))
    t.start()
    watcher.wait_for(lambda e: e["type"] == "evicting" and e["lease"] == lease.id, 10, "evicting")
    ended = alice.suspend(lease)
    assert ended["state"] == "released" and ended["cause"]["code"] == "suspended"
    t.join(30)
    sus = watcher.wait_for(lambda e: e["type"] == "suspended" and e["lease"] == lease.id, 10, "suspended")
    grant = watcher.wait_for(lambda e: e["type"] == "grant" and e["lease"] == got["lease"].id, 10, "grant")
    assert sus["bytes"] > 0 and sus["ms"] >= 0 and sus["gpus"] == [0]  # (its resident memory: the stand-in)
    assert grant["ts"] >= sus["ts"]  # granted only once the worker was off the GPU
    assert worker.proc.poll() is None  # ... and it lives on, holding no lease
    drained = watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease.id, 10, "drained")
    assert drained["ended"] == "suspend" and drained["killed"] == 0
    # bob's lease on the worker's GPU: a restore onto it is refused (it is not the worker's lease)
    refused = claim(bob, got["lease"], worker, restore=True)
    assert "refused" in refused, refused
    bob.release(got["lease"])
    # alice's next lease: the worker claims it and is restored onto its GPU
    again = alice.acquire(1, wait=10)
    answer = claim(alice, again, worker, restore=True)
    assert answer["ok"] and answer["restored"]["bytes"] == sus["bytes"], answer
    ev = watcher.wait_for(lambda e: e["type"] == "restored" and e["lease"] == again.id, 10, "restored")
    assert ev["suspended_lease"] == lease.id and ev["bytes"] == sus["bytes"] and ev["gpus"] == [0]
    # gpulease events reads both in words, not as key=value
    size = show_mb(sus["bytes"] / 2**20)
    assert re.fullmatch(rf"{size} to host from n1 \(GPU 0\) in \d+\.\ds", describe(sus)), describe(sus)
    assert re.fullmatch(rf"{size} to n1 \(GPU 0\) in \d+\.\ds", describe(ev)), describe(ev)
    # restored once: asked again, it is not a suspended worker any more
    assert "not a worker suspended" in claim(alice, again, worker, restore=True)["refused"]
    assert worker.proc.poll() is None


def test_a_lease_released_for_good_still_ends_its_worker(srv, procs):  # noqa: F811
    """The drain of a lease that ends for good (not a suspend) ends its claimed worker, as before."""
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, lease, worker = warm_claimed(srv, procs)
    srv.client("root").request("POST", f"/api/v1/leases/{lease.id}/revoke", json={"reason": "test"})
    watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease.id, 10, "drained")
    worker.wait(10)
    assert not [e for e in watcher.events if e["type"] == "suspended"]


def test_suspend_is_refused_with_what_to_do_and_changes_nothing(srv, procs):  # noqa: F811
    alice = srv.client("alice")
    lease = alice.acquire(1)
    with pytest.raises(errors.Conflict, match="only a warm lease is suspended"):
        alice.suspend(lease)
    alice.warm(lease)
    with pytest.raises(errors.Conflict, match="0 processes claimed it"):
        alice.suspend(lease)  # nobody claimed it: there is no worker to keep
    with pytest.raises(errors.GpuLeaseError):
        srv.client("bob").suspend(lease)
    r = httpx.post(f"{srv.url}/api/v1/leases/{lease.id}/suspend", json={}, headers=alice.headers)
    assert r.status_code == 400 and "token is required" in r.json()["message"], r.text
    assert alice.get(lease.id)["state"] == "active" and alice.get(lease.id)["warm_since"]


def test_over_the_host_memory_budget_the_suspended_worker_is_ended(server_factory, procs):  # noqa: F811
    srv = _srv(server_factory, suspend_host_budget_gb=0.001)  # 1 MB: less than any process
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, lease, worker = warm_claimed(srv, procs)
    alice.suspend(lease)
    ev = watcher.wait_for(lambda e: e["type"] == "suspend_ended" and e["lease"] == lease.id, 10, "suspend_ended")
    assert "host memory for suspended workers on n1 (1 MB) was full" in ev["reason"], ev
    assert " on host from n1 dropped after " in describe(ev) and "was full" in describe(ev), describe(ev)
    worker.wait(10)


def _suspended_worker(srv: Any, procs: Any, watcher: Any, user: str, ballast_mb: int) -> Any:  # noqa: F811
    """A warm worker of ``user`` holding about ``ballast_mb`` MB more than a bare one, suspended."""
    client = srv.client(user)
    lease = client.acquire(1, wait=10)
    worker = procs(f"ballast = b'\\x01' * {ballast_mb << 20}\n" + WORKER)
    assert claim(client, lease, worker) == {"ok": True}
    client.warm(lease)
    client.suspend(lease)
    watcher.wait_for(lambda e: e["type"] == "suspended" and e["lease"] == lease.id, 10, "suspended")
    worker.lease = lease
    return worker


def test_over_the_budget_the_worker_that_did_not_fit_pays_never_another_users(server_factory, procs):  # noqa: F811
    """The budget used to end the oldest suspended worker, whoever pushed it over: a user who
    suspended a big worker ended a colleague's that was there first. Now the newest worker's owner
    loses their own oldest (that worker itself when it is their only one)."""
    srv = _srv(server_factory, suspend_host_budget_gb=0.3)  # 286 MiB: two bare workers (~20 MiB), one of 250
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    bob = _suspended_worker(srv, procs, watcher, "bob", 0)
    alice_old = _suspended_worker(srv, procs, watcher, "alice", 0)
    alice_big = _suspended_worker(srv, procs, watcher, "alice", 230)  # over: alice's oldest pays
    ev = watcher.wait_for(lambda e: e["type"] == "suspend_ended", 10, "suspend_ended")
    assert ev["lease"] == alice_old.lease.id and "was full" in ev["reason"], ev
    alice_old.wait(10)
    carol_huge = _suspended_worker(srv, procs, watcher, "carol", 300)  # fits nowhere: it alone pays
    ev = watcher.wait_for(lambda e: e["type"] == "suspend_ended" and e["lease"] != alice_old.lease.id, 10, "ended")
    assert ev["lease"] == carol_huge.lease.id, ev
    carol_huge.wait(10)
    assert bob.proc.poll() is None and alice_big.proc.poll() is None  # the others' stay suspended
    left = {w["user"] for w in srv.client("root").cluster()["nodes"][0].get("suspended", [])}
    assert left in ({"bob", "alice"}, set()), left  # (where the board lists them)


def test_warm_max_ends_a_suspended_worker(server_factory, procs):  # noqa: F811
    srv = _srv(server_factory, sched={"warm_max": 2})
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, lease, worker = warm_claimed(srv, procs)
    alice.suspend(lease)
    watcher.wait_for(lambda e: e["type"] == "suspended" and e["lease"] == lease.id, 10, "suspended")
    ev = watcher.wait_for(lambda e: e["type"] == "suspend_ended" and e["lease"] == lease.id, 15, "suspend_ended")
    assert "warm_max" in ev["reason"]
    worker.wait(10)


def test_suspend_off_ends_evicted_workers_as_before(server_factory, procs):  # noqa: F811
    srv = _srv(server_factory, suspend="off")
    alice, lease, _worker = warm_claimed(srv, procs)
    assert "suspend" not in srv.client("root").cluster()["nodes"][0]
    with pytest.raises(errors.Conflict, match="cannot suspend GPU state"):
        alice.suspend(lease)


# ---- the suspenders (lease_server/node/suspend.py), where no GPU is needed ----------------------------


def test_a_restore_needs_the_snapshot_plus_a_tenth_free_and_never_guesses() -> None:
    from lease_server.node.suspend import fits

    gib = 2**30
    assert fits(10 * gib, 11 * gib) and not fits(10 * gib, 11 * gib - 1)
    assert not fits(10 * gib, None)  # free memory unknown: never try and see (cuda-checkpoint#44)
    assert fits(0, 0)


def test_the_checkpoint_api_structures_have_the_drivers_layout() -> None:
    import ctypes

    from lease_server.node import suspend

    # cuda.h: each argument struct is 64 bytes; a GPU pair is two 16-byte UUIDs
    for struct in (suspend._LockArgs, suspend._Reserved8, suspend._RestoreArgs):
        assert ctypes.sizeof(struct) == 64, struct
    assert ctypes.sizeof(suspend._GpuPair) == 32
    assert suspend._RestoreArgs.gpuPairsCount.offset == 8 and suspend._RestoreArgs.reserved1.offset == 56
    uuid = "GPU-5b2c9d3e-1f4a-4c8e-9b7d-0a1b2c3d4e5f"
    assert suspend.uuid_bytes(uuid) == bytes.fromhex("5b2c9d3e1f4a4c8e9b7d0a1b2c3d4e5f")
    with pytest.raises(ValueError, match="not a GPU UUID"):
        suspend.uuid_bytes("GPU-1234")
    same, _ = suspend.restore_args([(uuid, uuid)])
    assert same.gpuPairsCount == 0  # onto the GPU it left: no remapping
    other = "GPU-00000000-0000-0000-0000-000000000001"
    moved, keep = suspend.restore_args([(uuid, other)])
    assert moved.gpuPairsCount == 1 and bytes(moved.gpuPairs[0].newUuid.bytes)[-1] == 1


class Driver:
    """libcuda's checkpoint entry points as a table of answers (CUresult per call), recording the calls."""

    def __init__(self, **answers: int) -> None:
        self.calls: list[str] = []
        self.answers = answers

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*_args: Any) -> int:
            self.calls.append(name)
            return self.answers.get(name, 0)

        return call


def test_a_failed_checkpoint_unlocks_the_worker_so_that_the_drain_can_end_it() -> None:
    from lease_server.node.suspend import CudaCheckpoint, SuspendFailed

    ok = Driver()
    snap = CudaCheckpoint(ok).suspend(4242, 7 * 2**30)
    assert ok.calls == ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint"] and snap.bytes == 7 * 2**30
    CudaCheckpoint(ok).restore(4242, [])
    assert ok.calls[2:] == ["cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]
    failing = Driver(cuCheckpointProcessCheckpoint=2)  # CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(SuspendFailed, match="cuCheckpointProcessCheckpoint.4242. answered CUresult 2"):
        CudaCheckpoint(failing).suspend(4242, 0)
    assert failing.calls[-1] == "cuCheckpointProcessUnlock"
    locked_out = Driver(cuCheckpointProcessLock=1)
    with pytest.raises(SuspendFailed):
        CudaCheckpoint(locked_out).suspend(4242, 0)
    assert locked_out.calls == ["cuCheckpointProcessLock"]  # never checkpointed what it could not lock


def test_without_a_driver_the_node_says_why_it_does_not_suspend() -> None:
    from lease_server.node.suspend import CudaCheckpoint, Simulated, detect

    assert "no CUDA driver" in str(CudaCheckpoint.probe("libcuda-that-is-not-here.so"))
    assert isinstance(detect("auto", nvml_node=False), Simulated)
    assert detect("off", nvml_node=False) == "off (suspend = off)"


def test_a_request_takes_its_preferred_node_where_it_has_the_gpus_free(server_factory: Any) -> None:
    """prefer_node (what the magic sends for a suspended worker's next cell, which can be restored
    only on its own node): taken where it has the GPUs free, else best fit as for anyone, in the
    queue too; never for a gang or a slice (400, nothing changed)."""
    srv = server_factory(simulate="a1=2xA100-80GB,a2=4xA100-80GB,t1=1xT4-16GB")
    alice = srv.client("alice")
    assert alice.acquire(1, "A100-80GB", ttl=60).node == "a1"  # best fit: the smaller node
    there = alice.acquire(1, "A100-80GB", ttl=60, prefer_node="a2")
    assert there.node == "a2"  # a1 has one free, and best fit would put it there
    too_few = alice.acquire(3, "A100-80GB", ttl=60, prefer_node="a1")  # a1 has 0 free now: best fit
    assert too_few.node == "a2"
    other_pool = alice.acquire(1, "T4-16GB", ttl=60, prefer_node="a1")  # a node of another pool: no matter
    assert other_pool.node == "t1"
    assert alice.acquire(1, "A100-80GB", ttl=60, prefer_node="gone").node == "a1"  # no such node: best fit
    for body in ({"gpus": 2, "nodes": 2, "prefer_node": "a2"}, {"gpus": 1, "gpu_mem_mb": 1024, "prefer_node": "a2"}):
        resp = httpx.post(
            f"{srv.url}/api/v1/leases", json=body, headers={"Authorization": f"Bearer {srv.token('alice')}"}
        )
        assert resp.status_code == 400 and "prefer_node names one node" in resp.json()["message"], resp.text
    for bad in ("no such node!", "x" * 300):
        resp = httpx.post(
            f"{srv.url}/api/v1/leases",
            json={"gpus": 1, "prefer_node": bad},
            headers={"Authorization": f"Bearer {srv.token('alice')}"},
        )
        assert resp.status_code == 400 and "prefer_node" in resp.json()["message"], resp.text
    assert len(alice.leases()) == 5  # the refused requests changed nothing
