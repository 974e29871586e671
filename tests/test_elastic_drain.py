"""An elastic job asked to give GPUs back whose ranks never reach ``magics.elastic.step()``: at the
shrink's deadline the server takes the GPUs back, they drain, the node agent ends the ranks on
them (whose pids the driver named before the phase ran), and the waiting request is granted only
after those processes are gone. The job goes on from where it was, on the GPU it kept.

Its own `gpulease up` (three simulated GPUs) with a short notice, so the deadline comes soon.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lease_server.client import Client
from magics.calls import Call
from magics.runner import Options, run_call
from magics.session import Session
from tests.api_helpers import EventWatcher
from tests.conftest import Stack, Up, ray_session
from tests.test_magics import _alive

ray = pytest.importorskip("ray")
POOL = "A100-80GB"
# The loop below travels by value: the workers need not import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def stuck_loop(marks: str) -> Any:
    """The first time, every rank notes its pid and never reaches step(); the next phase, on the GPU
    the job kept, returns once the waiter was granted: had it returned at once, that GPU could be
    free before the other two drained, and the waiter granted it (right, but not what is tested)."""
    import os
    import time

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    first = os.path.join(marks, "phase1")
    if not os.path.exists(first) or len(os.listdir(first)) >= 3:
        if world == 1:
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(marks, "granted")) and time.monotonic() < deadline:
                time.sleep(0.05)  # a file the test's thread writes: no event reaches a rank
            return {"world": world}
    os.makedirs(first, exist_ok=True)
    with open(os.path.join(first, f"{rank}-{os.getpid()}-{os.environ['CUDA_VISIBLE_DEVICES']}"), "w"):
        pass
    while True:  # training that never calls magics.elastic.step()
        time.sleep(0.05)


STACK = Stack.of("box=3xA100-80GB", GPULEASE_DEFAULT_TTL="3", GPULEASE_PREEMPT_NOTICE="1")  # conftest's `up`


@pytest.fixture(scope="module")
def sess(up: Up) -> Iterator[Session]:
    yield from ray_session(up, spares=5)  # as test_elastic's stack: a gang of up to 5 ranks on warm processes


def test_ranks_that_never_step_are_ended_before_their_gpus_go_to_the_waiter(up: Up, sess: Session, tmp_path: Path):
    admin = Client(up.url, sess.defaults.token)
    bob = Client(up.url, admin.request("POST", "/api/v1/tokens", json={"user": "bob"})["token"])
    watcher = EventWatcher(up.url, sess.defaults.token).start()
    marks = tmp_path / "marks"
    got: dict[str, Any] = {}

    def waiter() -> None:
        try:
            watcher.wait_for(lambda e: e["type"] == "grant" and e.get("label") == "stuck", 120, "the job granted")
            first = marks / "phase1"
            deadline = time.monotonic() + 60
            while not (first.exists() and len(os.listdir(first)) == 3):  # every rank runs (no event for that)
                assert time.monotonic() < deadline, "the three ranks did not start"
                time.sleep(0.05)
            lease = bob.acquire(2, POOL, wait=60, ttl=30)
            mine = {int(g["index"]) for g in lease.gpus}
            got["alive_at_grant"] = [pid for pid, gpu in ranks() if gpu in mine and _alive(pid)]
            got["bob_gpus"] = mine
            got["lease"] = lease
            bob.release(lease)
        finally:
            marks.mkdir(parents=True, exist_ok=True)
            (marks / "granted").touch()  # the job's last phase may return now

    def ranks() -> list[tuple[int, int]]:  # (pid, GPU) of each rank of the first phase
        return [(int(n.split("-")[1]), int(n.split("-")[2])) for n in os.listdir(marks / "phase1")]

    t = threading.Thread(target=waiter)
    t.start()
    try:
        out = run_call(
            Call.function(stuck_loop, str(marks)), Options(gpus=3, gpus_min=1, elastic=True, label="stuck"), sess=sess
        )
    finally:
        t.join(120)
    assert "lease" in got, "bob was never granted"
    # the highest indexes: what the shrink took back, while the job still holds the lowest
    told = [(e["type"], e.get("lease"), e.get("gpus"), e.get("draining")) for e in watcher.events]
    assert got["bob_gpus"] == {1, 2}, told
    assert got["alive_at_grant"] == [], f"granted while {got['alive_at_grant']} still ran on bob's GPUs"
    assert out.value == {"world": 1}
    events = watcher.events
    shrunk = next(e for e in events if e["type"] == "shrunk" and e.get("lease") == out.lease_id)
    assert shrunk["by"] == "server" and sorted(shrunk["draining"]) == [1, 2]
    drained = [(k, e) for k, e in enumerate(events) if e["type"] == "drained" and e.get("lease") == out.lease_id]
    assert all(e["ended"] == "shrunk" for _, e in drained)
    assert sorted(i for _, e in drained for i in e["gpus"]) == [1, 2]  # in one report or two
    k_bob = next(k for k, e in enumerate(events) if e["type"] == "grant" and e.get("user") == "bob")
    assert max(k for k, _ in drained) < k_bob
    admin.close()
    bob.close()
