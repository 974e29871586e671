"""%%gpu_train at its edges, in a real kernel against `gpulease up` (real Ray, Redis, lease server;
simulated GPUs): Stop while queued or running, a kernel restart while queued, a lease ended by
someone else while the cell runs, typos in the options, and the verified release."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from lease_server.client import Client
from tests.api_helpers import EventWatcher
from tests.conftest import Up
from tests.test_magics import Kernel, _alive, displays, kernel_stack, said_once, status, text

STACK = kernel_stack("box=2xA100-80GB,pair=2xA100-80GB", GPULEASE_BORROW_NOTICE="3")  # conftest's `up`


@pytest.fixture(scope="module")
def stack(up: Up) -> Up:
    return up  # the module's `gpulease up` (conftest's `up` of STACK), by the name its tests use


@pytest.fixture
def kernel(stack: Up) -> Iterator[Kernel]:
    k = Kernel(stack)
    yield k
    k.shutdown()


def admin_token(up: Up) -> str:
    return (up.data / "token").read_text().strip()


def client(up: Up, token: str | None = None) -> Client:
    return Client(up.url, token or admin_token(up))


def free(up: Up) -> int:
    with client(up) as c:
        return int(c.cluster()["pools"]["A100-80GB"]["free"])


@pytest.fixture
def watcher(stack: Up) -> EventWatcher:
    return EventWatcher(stack.url, admin_token(stack)).start()


def events_for(up: Up, request: str) -> list[str]:
    with client(up) as c:
        return [e["type"] for e in c.events(limit=10000) if e.get("lease") == request]


def until_shown(kernel: Kernel, msg: str, fragment: str, timeout: float = 30) -> list[dict[str, Any]]:
    """The cell's outputs up to the moment its status line shows ``fragment``."""
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = kernel.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if m["parent_header"].get("msg_id") != msg or m["msg_type"] == "status":
            continue
        out.append({"type": m["msg_type"], **m["content"]})
        if m["msg_type"] in ("display_data", "update_display_data") and fragment in m["content"]["data"]["text/plain"]:
            return out
    raise AssertionError(f"the status line never showed {fragment!r}: {out}")


def hold_all(up: Up, c: Client) -> list[Any]:
    """Take every GPU of the pool, so that the next request queues."""
    return [c.acquire(2, ttl=60), c.acquire(2, ttl=60)]


def queue_a_cell(up: Up, c: Client, kernel: Kernel, watcher: EventWatcher) -> tuple[list[Any], str, Any, list[Any]]:
    """Hold every GPU, start a 1-GPU cell, and return once its line shows it first in line:
    (holders, the cell's msg id, its queued event, its outputs so far)."""
    holders = hold_all(up, c)
    msg = kernel.start("%%gpu_train --gpus 1\nx = 1")
    queued = watcher.wait_for(lambda e: e["type"] == "queued", 120, "the cell's request queued")
    return holders, msg, queued, until_shown(kernel, msg, "queued for 1 GPU of A100-80GB: 1st in line")


def test_stop_on_a_queued_cell_withdraws_the_request(stack, kernel, watcher):
    with client(stack) as c:
        holders, msg, queued, first = queue_a_cell(stack, c, kernel, watcher)
        kernel.km.interrupt_kernel()
        out, finished = kernel.outputs(msg, timeout=30)
        assert finished
        out = first + out
        # gone from the queue by the Stop itself (its wait is the default hour), not by a clock
        assert c.queue() == []
        gone = watcher.wait_for(lambda e: e["type"] == "wait_cancelled" and e["lease"] == queued["lease"], 10, "gone")
        assert gone["reason"] == "withdrawn: interrupted (Stop or Ctrl-C)", gone  # (not wait_timeout)
        said_once(out, kernel.reply(msg), "GpuTrainStopped")
        assert status(out) == "gpu_train: stopped while queued; the request was withdrawn"
        queued_lines = [t for t in displays(out) if "queued for 1 GPU of A100-80GB: 1st in line, " in t]
        assert queued_lines, out
        # with the server's estimate, in 80 columns (the request is not said twice)
        assert all("; about " in t and len(t.splitlines()[0]) <= 80 for t in queued_lines), queued_lines
        for h in holders:
            c.release(h)
            watcher.wait_for(lambda e, h=h: e["type"] == "released" and e["lease"] == h.id, 10, "holder released")
        assert "grant" not in events_for(stack, queued["lease"])  # never granted to nobody
        assert free(stack) == 4
    assert text(kernel.run("print('usable')")).strip() == "usable"


def test_stop_racing_a_release_never_leaves_a_gpu_held(stack, kernel, watcher):
    """50 times: the GPUs free up at the same instant as Stop. Either the request is withdrawn
    before its grant, or the grant that won the race is released at once (never left to expire)."""
    raced = 0
    with client(stack) as c:
        for _ in range(50):
            holders = hold_all(stack, c)
            known = {e["lease"] for e in watcher.events if e["type"] == "queued"}
            msg = kernel.start("%%gpu_train --gpus 1\nx = 1")
            queued = watcher.wait_for(lambda e, k=known: e["type"] == "queued" and e["lease"] not in k, 120, "queued")
            go = threading.Barrier(2)

            def release(holders: list[Any] = holders, go: threading.Barrier = go) -> None:
                go.wait()
                for h in holders:
                    c.release(h)

            t = threading.Thread(target=release)
            t.start()
            go.wait()
            kernel.km.interrupt_kernel()
            t.join(10)
            kernel.outputs(msg, timeout=30)
            rid = queued["lease"]
            kinds = events_for(stack, rid)
            if "grant" in kinds:
                raced += 1
                watcher.wait_for(lambda e, rid=rid: e["type"] == "released" and e["lease"] == rid, 10, "race released")
            assert "expired" not in events_for(stack, rid)
            assert c.queue() == []
            assert free(stack) == 4
    print(f"grant won the race in {raced} of 50 rounds; each such grant was released at once")


def test_stop_on_a_running_cell_is_three_lines_at_most(stack, kernel, watcher):
    msg = kernel.start("%%gpu_train\nimport time\nprint('training', flush=True)\ntime.sleep(60)")
    first, _ = kernel.outputs(msg, until="training")
    kernel.km.interrupt_kernel()
    rest, finished = kernel.outputs(msg, timeout=30)
    assert finished
    out = first + rest
    lines = said_once(out, kernel.reply(msg), "GpuTrainStopped")
    assert len(lines) <= 3, lines
    if free(stack) != 4:  # released before its worker was seen gone: the GPU drains first
        watcher.wait_for(lambda e: e["type"] == "drained", 30, "drained")
    assert free(stack) == 4
    assert text(kernel.run("print('usable')")).strip() == "usable"


def test_kernel_restart_while_queued_withdraws_and_closes_the_line(stack, kernel, watcher):
    with client(stack) as c:
        holders, msg, queued, first = queue_a_cell(stack, c, kernel, watcher)
        (display_id,) = {o["transient"]["display_id"] for o in first if o["type"] == "display_data"}
        # jupyter_client SIGTERMs a kernel that has not exited 2.5 s after the shutdown request
        # (half of shutdown_wait_time); on a loaded CI machine that can cut off the old kernel's
        # last messages, so it gets the time a loaded machine needs.
        kernel.km.shutdown_wait_time = 30
        kernel.km.restart_kernel(now=False)
        gone = watcher.wait_for(
            lambda e: e["type"] == "wait_cancelled" and e["lease"] == queued["lease"], 30, "request withdrawn"
        )
        # Found by its display id, as JupyterLab finds it (the shutdown hook runs in the kernel's
        # control thread, under the shutdown request).
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("withdrawn" in t for t in lines):
            try:
                m = kernel.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if m["msg_type"] == "update_display_data" and m["content"]["transient"]["display_id"] == display_id:
                lines.append(m["content"]["data"]["text/plain"])
        # jupyter_client interrupts a kernel before it asks it to shut down, so the cell may end as
        # a Stop; either way the line no longer claims to wait.
        # (who withdrew it says which path ended the cell: the cell's own Stop, or the kernel's
        # shutdown hook; CI's output then tells a lost line of one from one of the other)
        assert lines and lines[-1] in (
            "gpu_train: the kernel shut down; the request was withdrawn",
            "gpu_train: stopped while queued; the request was withdrawn",
        ), (lines, gone.get("reason"))
        assert c.queue() == []
        for h in holders:
            c.release(h)
        assert "grant" not in events_for(stack, queued["lease"])


def run_until_training(kernel: Kernel, code: str) -> str:
    msg = kernel.start(code)
    kernel.outputs(msg, until="training")
    return msg


SLEEPER = "%%gpu_train\nimport time\nprint('training', flush=True)\ntime.sleep(120)"


def test_released_from_the_board_while_running_says_so(stack, kernel, watcher):
    msg = run_until_training(kernel, SLEEPER)
    with client(stack) as c:
        (lease,) = c.leases()
        # What the GPU board's Release button sends (jupyter_ext LeaseHandler.delete), as the owner.
        c.request("DELETE", f"/api/v1/leases/{lease['id']}", params={"reason": "released from the board"})
    out, finished = kernel.outputs(msg, timeout=30)
    assert finished
    err = kernel.reply(msg)
    said_once(out, err, "GpuLeaseEnded")
    assert err["evalue"] == "released from the board by you", err
    assert status(out).startswith("gpu_train: released from the board by you; released; GPU memory freed")
    assert not any(w in text(out) + status(out) for w in ("worker died", "Ray", "OOM", "SIGSEGV"))
    # Released without the worker seen gone: its GPUs drained, free once the agent saw it gone.
    watcher.wait_for(lambda e: e["type"] == "drained" and e.get("lease") == lease["id"], 30, "drained")
    assert free(stack) == 4


def test_preempted_for_a_booking_while_running_names_the_booking(stack, kernel):
    admin = admin_token(stack)
    bob = client(stack).request("POST", "/api/v1/tokens", json={"user": "bob"})["token"]
    now = time.time()
    with client(stack, bob) as b:
        booking = b.book("A100-80GB", 4, now - 1, now + 3600)
        try:
            code = (
                "%%gpu_train --gpus 2\nimport time, magics\nmagics.on_preempt(lambda: {'step': 7})\n"
                "print('training', flush=True)\ntime.sleep(120)"
            )
            with client(stack) as mine:
                older = mine.acquire(2, ttl=120)  # the other node, borrowed first: more work to lose
            msg = run_until_training(kernel, code)  # the youngest borrower: recalled first
            asker = threading.Thread(target=lambda: b.acquire(2, wait=30, ttl=30))
            asker.start()
            try:
                out, finished = kernel.outputs(msg, timeout=60)
            except AssertionError:
                for e in b.events(limit=10000)[-15:]:
                    print("EV", {k: e.get(k) for k in ("type", "lease", "user", "reason", "by", "gpus", "node")})
                raise
            asker.join(30)
            assert finished
            err = kernel.reply(msg)
            said_once(out, err, "GpuLeaseEnded")
            assert err["evalue"].startswith("preempted for bob's booking"), err
            assert "(checkpoint saved" in status(out)
            assert text(kernel.run("print(gpu_checkpoint)")).strip() == "{'step': 7}"
            for lease in b.leases():
                b.release(lease["id"])
            with client(stack) as mine:
                mine.release(older)
        finally:
            b.cancel_booking(booking["id"])
    assert admin


def test_option_typos_and_impossible_sizes_are_one_clear_line(stack, kernel):
    for line, expect in [
        ("%%gpu_train --gpu 2\nx = 1", "unrecognized arguments: --gpu (did you mean --gpus?)"),
        ("%%gpu_train --gpus 99\nx = 1", "(the largest has 2): ask --gpus 2, or --nodes K"),
        ("%%gpu_train --gpus 98 --nodes 2\nx = 1", "a gang of 49 GPUs on each of 2 nodes cannot fit"),
    ]:
        out = text(kernel.run(line))
        assert out.startswith("UsageError: ") and expect in out and "not supported" not in out, (line, out)
        assert len(out.strip().splitlines()) == 1
    assert free(stack) == 4


def test_the_next_waiter_is_granted_only_after_the_old_worker_is_gone(stack, kernel):
    """Verified release: when the waiter's grant arrives, the previous holder's process has exited."""
    msg = kernel.start(
        "%%gpu_train --gpus 2\nimport os, time\nprint('training pid', os.getpid(), flush=True)\ntime.sleep(1.5)"
    )
    first, _ = kernel.outputs(msg, until="training")
    pid = int(text(first).split("pid")[1].split()[0])
    with client(stack) as c:
        other = c.acquire(2, ttl=60)  # the other node, so that the waiter needs box
        try:
            lease = c.acquire(2, wait=60, ttl=30)  # queued behind the cell; granted when it ends
            gone_at_grant = not _alive(pid)
            c.release(lease)
        finally:
            c.release(other)
    assert gone_at_grant, "the next holder was granted while the old worker process still ran"
    out, finished = kernel.outputs(msg, timeout=30)
    assert finished and "GPU memory freed" in status(first + out)


def test_the_watchdog_follows_its_own_lease_only(stack):
    """GET /api/v1/events?lease=ID: the worker's watchdog reads its lease's events, not everyone's."""
    with client(stack) as c:
        mine = c.acquire(1, ttl=30)
        other = c.acquire(1, ttl=30)
        headers = {"Authorization": f"Bearer {admin_token(stack)}"}
        got: list[str] = []
        with httpx.stream(
            "GET", f"{stack.url}/api/v1/events", params={"lease": mine.id}, headers=headers, timeout=10
        ) as s:
            lines = s.iter_lines()
            next(lines)
            c.release(other)
            c.release(mine)
            for line in lines:
                if line.startswith("data:"):
                    got.append(line)
                    break
        assert got and mine.id in got[0] and other.id not in got[0]


def test_a_frozen_kernels_worker_is_ended_before_its_gpus_are_granted_again(stack, kernel, watcher):
    """The kernel is frozen (SIGSTOP) while its cell trains, and an admin revokes the lease: the
    kernel can neither end its worker nor release. The GPUs drain: the node agent ends the worker
    whose pid the kernel named before the call ran, and the waiter is granted only after it is gone."""
    msg = kernel.start(
        "%%gpu_train --gpus 2\nimport os, time\nprint('training pid', os.getpid(), flush=True)\ntime.sleep(120)"
    )
    first, _ = kernel.outputs(msg, until="training")
    pid = int(text(first).split("pid")[1].split()[0])
    kernel_pid = kernel.km.provisioner.pid
    with client(stack) as c:
        other = c.acquire(2, ttl=60)  # the other node, so that the waiter needs the cell's
        (cell,) = [
            x for x in c.request("GET", "/api/v1/leases", params={"all": "true"})["leases"] if x["id"] != other.id
        ]
        os.kill(kernel_pid, signal.SIGSTOP)
        try:
            c.revoke(cell["id"], "maintenance")
            lease = c.acquire(2, wait=60, ttl=30)  # granted once the GPUs drained
            gone_at_grant = not _alive(pid)
            c.release(lease)
        finally:
            os.kill(kernel_pid, signal.SIGCONT)
            c.release(other)
    drained = watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == cell["id"], 30, "drained")
    assert gone_at_grant, "the next holder was granted while the frozen kernel's worker still ran"
    assert drained["ended"] == "revoked" and sorted(drained["gpus"]) == sorted(g["index"] for g in cell["gpus"])
    out, finished = kernel.outputs(msg, timeout=30)
    assert finished and status(first + out).startswith("gpu_train: revoked by"), status(first + out)
