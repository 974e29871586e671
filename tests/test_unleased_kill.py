"""``unleased_action`` per pool: "flag" (the default) leaves a process on a GPU no live lease
covers alone and flags it; "kill" has its node agent SIGTERM it, then SIGKILL it after the grace.

Real processes started by the test, reported through simulated GPUs (``PUT /simulate/NODE``), a
real server and Redis; the in-process agent (``gpulease up``'s) and the HTTP agent
(``gpulease agent``) both act."""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lease_server import errors
from lease_server.config import Settings
from lease_server.leasing.inventory import parse_simulate
from lease_server.node.agent import run_remote
from lease_server.node.enforce import Enforcer
from tests.api_helpers import EventWatcher

GRACE = 1.0
SETTINGS: dict[str, Any] = dict(
    sample_interval=0.1,
    # A100 pools kill after a 1 s grace; T4 keeps the default, "flag".
    policy_overrides={
        "A100-80GB": {"unleased_action": "kill", "unleased_kill_grace_s": GRACE},
        "H100-80GB": {"unleased_action": "kill", "unleased_kill_grace_s": GRACE},
    },
)
ME = pwd.getpwuid(os.getuid()).pw_name
# Exits with 3 from its SIGTERM handler: an exit code that only the graceful path gives.
GRACEFUL = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)
STUBBORN = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(600)\n"
)


@pytest.fixture
def procs() -> Iterator[Any]:
    """Start test processes (``sleep 600``, or Python code that says ready); all killed at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(code: str | None = None) -> subprocess.Popen[str]:
        if code is None:
            p = subprocess.Popen(["sleep", "600"], text=True)
        else:
            p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.fixture
def srv(server_factory: Any) -> Any:
    return server_factory(simulate="n1=2xA100-80GB,t1=1xT4-16GB", **SETTINGS)


def report(srv: Any, node: str, **gpus: list[int]) -> None:
    """What the simulated GPUs of ``node`` report: GPU index -> pids on it."""
    sampled = {i: {"util": 50 if pids else 0, "mem_mb": 1000 if pids else 0, "procs": pids} for i, pids in gpus.items()}
    body = {"gpus": sampled}
    srv.client("root", "admin").request("PUT", f"/api/v1/simulate/{node}", json=body)


def kills(watcher: EventWatcher, pid: int) -> list[dict[str, Any]]:
    return [e for e in watcher.events if e["type"] == "unleased_killed" and e["pid"] == pid]


def test_flag_pool_flags_and_leaves_the_process_alone(srv, procs):
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    sleeper = procs()
    report(srv, "t1", **{"0": [sleeper.pid]})
    ev = watcher.wait_for(lambda e: e["type"] == "unleased_use" and e["node"] == "t1", 10, "unleased_use")
    assert ev["pids"] == [sleeper.pid]
    time.sleep(10 * SETTINGS["sample_interval"] + GRACE)  # ten samples and a grace: nothing may happen
    assert sleeper.poll() is None and not kills(watcher, sleeper.pid)
    pol = srv.client("bob").request("GET", "/api/v1/policy/T4-16GB")
    assert pol["unleased_action"] == "flag" and pol["unleased_kill_grace_s"] == 10.0


def test_kill_pool_sigterms_and_a_graceful_process_exits(srv, procs):
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    graceful = procs(GRACEFUL)
    report(srv, "n1", **{"1": [graceful.pid]})
    ev = watcher.wait_for(lambda e: e["type"] == "unleased_killed" and e["pid"] == graceful.pid, 10, "SIGTERM")
    assert (ev["node"], ev["gpu"], ev["user"], ev["signal"], ev["grace_s"]) == ("n1", 1, ME, "SIGTERM", GRACE)
    assert ev["pool"] == "A100-80GB" and "error" not in ev
    assert graceful.wait(10) == 3  # its SIGTERM handler ran
    time.sleep(GRACE + 0.5)
    assert [e["signal"] for e in kills(watcher, graceful.pid)] == ["SIGTERM"]  # no SIGKILL, no second SIGTERM


def test_kill_pool_sigkills_a_process_that_ignores_sigterm(srv, procs):
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    stubborn = procs(STUBBORN)
    report(srv, "n1", **{"0": [stubborn.pid]})
    term = watcher.wait_for(lambda e: e["type"] == "unleased_killed" and e["pid"] == stubborn.pid, 10, "SIGTERM")
    assert term["signal"] == "SIGTERM" and stubborn.poll() is None
    killed = watcher.wait_for(
        lambda e: e["type"] == "unleased_killed" and e["pid"] == stubborn.pid and e["signal"] == "SIGKILL",
        10,
        "SIGKILL",
    )
    assert (killed["node"], killed["gpu"], killed["user"]) == ("n1", 0, ME)
    assert killed["ts"] - term["ts"] >= GRACE - 0.05
    assert stubborn.wait(10) == -signal.SIGKILL


def test_a_process_a_live_lease_covers_is_never_killed(srv, procs):
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice = srv.client("alice")
    lease = alice.acquire(1, pool="A100-80GB")
    held = lease.gpus[0]["index"]
    other = 1 - held
    mine, both = procs(), procs()
    # ``mine`` runs on the leased GPU only: covered. ``both`` also on the other GPU, which no lease
    # holds (a cell that rewrote CUDA_VISIBLE_DEVICES): covered only on its lease's GPU, foreign on
    # the other, where the kill pool ends it (security review, finding 4).
    report(srv, "n1", **{str(held): [mine.pid, both.pid], str(other): [both.pid]})
    ev = watcher.wait_for(lambda e: e["type"] == "unleased_use" and e["node"] == "n1", 10, "unleased_use")
    assert ev["gpu"] == other and ev["pids"] == [both.pid]
    ev = watcher.wait_for(lambda e: e["type"] == "unleased_killed" and e["pid"] == both.pid, 10, "SIGTERM")
    assert ev["gpu"] == other and both.wait(10) == -signal.SIGTERM
    assert mine.poll() is None
    # The lease was what protected ``mine``: once it ends, it is unleased and killed.
    alice.release(lease)
    ev = watcher.wait_for(lambda e: e["type"] == "unleased_killed" and e["pid"] == mine.pid, 10, "SIGTERM")
    assert ev["signal"] == "SIGTERM" and mine.wait(10) == -signal.SIGTERM


def test_a_worker_that_reaches_a_gpu_leased_to_someone_else_is_ended_there(srv):
    """Security review, finding 4: a one-GPU cell that rewrites CUDA_VISIBLE_DEVICES and opens
    another user's GPU used to be covered on every GPU of the node by its own lease. Its worker
    claimed its own lease (as every worker does): it is covered on that lease's GPU only, foreign
    on bob's, where the kill pool ends it; bob's GPU's own process is left alone."""
    from tests.test_drain import Watched, name

    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    mallory, bob = srv.client("mallory"), srv.client("bob")
    mine = mallory.acquire(1, pool="A100-80GB")
    theirs = bob.acquire(1, pool="A100-80GB")
    worker = Watched()  # ignores SIGTERM: the kill pool's SIGKILL ends it
    bobs = Watched()
    try:
        name(mallory, mine, worker)
        name(bob, theirs, bobs)
        m, b = mine.gpus[0]["index"], theirs.gpus[0]["index"]
        report(srv, "n1", **{str(m): [worker.pid], str(b): [bobs.pid, worker.pid]})
        ev = watcher.wait_for(lambda e: e["type"] == "unleased_use" and e["gpu"] == b, 10, "unleased_use")
        assert ev["pids"] == [worker.pid] and ev["lease"] == theirs.id
        worker.wait(10)
        assert {(e["gpu"], e["pid"]) for e in watcher.events if e["type"] == "unleased_killed"} == {(b, worker.pid)}
        assert bobs.proc.poll() is None
    finally:
        worker.kill()
        bobs.kill()


def test_a_free_gpu_someone_uses_is_not_granted_until_it_is_clean(srv):
    """Finding 4's other half: a GPU that a process no lease covers uses is held out of the pool,
    even in a pool that only flags (T4 here): nobody is granted a GPU that someone already uses. A
    waiter gets it once a sample shows it clean, in the same step that frees it."""
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice = srv.client("alice")
    report(srv, "t1", **{"0": [4242]})
    held = watcher.wait_for(lambda e: e["type"] == "unleased_held" and e["node"] == "t1", 10, "held")
    assert held["gpus"] == [0]
    with pytest.raises(errors.NoCapacity):
        alice.acquire(1, pool="T4-16GB")
    rid = alice.new_request_id()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(alice.acquire(1, pool="T4-16GB", wait=30, request_id=rid)))
    t.start()
    watcher.wait_for(lambda e: e["type"] == "queued" and e["lease"] == rid, 10, "queued")
    report(srv, "t1", **{"0": []})
    t.join(30)
    assert got and got[0].node == "t1"
    watcher.wait_for(lambda e: e["type"] == "grant" and e["lease"] == rid, 10, "the waiter's grant")
    types = [e["type"] for e in watcher.events if e.get("node") == "t1" or e.get("lease") == rid]
    assert types.index("drained") < types.index("grant")
    assert not [e for e in watcher.events if e["type"] == "unleased_killed"]  # a flag pool ends nothing


def test_the_server_names_only_uncovered_processes_of_kill_pools(server_factory):
    """The samples answer, straight from the API, for a node that no agent of the server samples."""
    srv = server_factory(simulate="t1=1xT4-16GB", **SETTINGS)
    agent = srv.client("agent-h1", "agent")
    agent.request("PUT", "/api/v1/nodes/h1", json={"pool": "H100-80GB", "gpus": [{"index": 0}, {"index": 1}]})
    lease = srv.client("alice").acquire(1, pool="H100-80GB")
    held = lease.gpus[0]["index"]
    other = 1 - held
    gpus = [{"index": held, "procs": [4001, 4002]}, {"index": other, "procs": [4002, 4003]}]
    answer = agent.request("POST", "/api/v1/nodes/h1/samples", json={"gpus": gpus})
    assert answer["unleased"] == 1 and answer["unleased_action"] == "kill" and answer["unleased_kill_grace_s"] == GRACE
    # 4001 runs on the leased GPU only: covered there; 4002 is alice's there, foreign on the free GPU
    assert answer["kill"] == [{"index": other, "pids": [4002, 4003]}]
    # Once bob holds the other GPU, 4002 runs on two leases' GPUs and claimed neither: foreign on
    # both (a cell that reached a GPU leased to someone else is never covered by that lease); 4003,
    # seen on bob's GPU only, is bob's.
    # (the free GPU is held out of the pool while they use it: a clean sample gives it back)
    with pytest.raises(errors.NoCapacity):
        srv.client("bob").acquire(1, pool="H100-80GB")
    clean = [{"index": held, "procs": [4001, 4002]}, {"index": other, "procs": []}]
    agent.request("POST", "/api/v1/nodes/h1/samples", json={"gpus": clean})
    srv.client("bob").acquire(1, pool="H100-80GB")
    answer = agent.request("POST", "/api/v1/nodes/h1/samples", json={"gpus": gpus})
    assert sorted((k["index"], k["pids"]) for k in answer["kill"]) == sorted([(held, [4002]), (other, [4002])])
    flagged = srv.client("agent-t1", "agent").request(
        "POST", "/api/v1/nodes/t1/samples", json={"gpus": [{"index": 0, "procs": [4004]}]}
    )
    assert flagged["unleased"] == 1 and flagged["unleased_action"] == "flag" and flagged["kill"] == []
    for bad in (
        {"index": 0, "pid": 1, "signal": "SIGTERM"},
        {"index": 0, "pid": 4003, "signal": "SIGHUP"},
        {"index": 0, "pid": 4003},
    ):
        with pytest.raises(errors.BadRequest):
            agent.request("POST", "/api/v1/nodes/h1/samples", json={"gpus": gpus, "killed": [bad]})


def test_the_http_agent_kills_and_reports(server_factory, procs):
    srv = server_factory(simulate="", **SETTINGS)  # no agent in the server: gpulease agent's loop below
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    stop = threading.Event()
    client = srv.client("agent-r1", "agent")
    agent = threading.Thread(
        target=run_remote, args=(client, parse_simulate("r1=1xA100-80GB"), 0.5, stop, 0.1), daemon=True
    )
    agent.start()
    try:
        watcher.wait_for(lambda e: e["type"] == "node_registered" and e["node"] == "r1", 10, "r1 declared")
        stubborn = procs(STUBBORN)
        report(srv, "r1", **{"0": [stubborn.pid]})
        term = watcher.wait_for(lambda e: e["type"] == "unleased_killed" and e["pid"] == stubborn.pid, 10, "SIGTERM")
        assert (term["node"], term["gpu"], term["user"], term["signal"]) == ("r1", 0, ME, "SIGTERM")
        killed = watcher.wait_for(
            lambda e: e["type"] == "unleased_killed" and e["pid"] == stubborn.pid and e["signal"] == "SIGKILL",
            10,
            "SIGKILL",
        )
        assert killed["gpu"] == 0 and killed["user"] == ME
        assert stubborn.wait(10) == -signal.SIGKILL
    finally:
        stop.set()
        agent.join(10)
        client.close()


def test_the_agent_acts_only_on_what_it_reported_itself(procs):
    sleeper = procs()
    enforcer = Enforcer()
    order = {"unleased_action": "kill", "unleased_kill_grace_s": 0.0}
    # Not in its own sample of that GPU (a server, or another node's report, naming it): refused.
    sample = [{"index": 0, "procs": []}, {"index": 1, "procs": [sleeper.pid]}]
    assert enforcer.act("n", sample, {**order, "kill": [{"index": 0, "pids": [sleeper.pid]}]}) == []
    # pid 1 and the agent itself: never.
    own = [{"index": 0, "procs": [1, os.getpid()]}]
    assert enforcer.act("n", own, {**order, "kill": [{"index": 0, "pids": [1, os.getpid()]}]}) == []
    # A flag pool: nothing. NVML says it left the GPU meanwhile: nothing.
    named = {"kill": [{"index": 1, "pids": [sleeper.pid]}]}
    assert enforcer.act("n", sample, {"unleased_action": "flag", **named}) == []
    assert enforcer.act("n", sample, {**order, **named}, still_on_gpu=lambda i, p: False) == []
    assert sleeper.poll() is None
    # What it did report, on a kill pool: SIGTERM (sleep dies of it; grace 0: tick finds it gone).
    done = enforcer.act("n", sample, {**order, **named})
    assert done == [{"index": 1, "pid": sleeper.pid, "user": ME, "signal": "SIGTERM", "grace_s": 0.0}]
    assert sleeper.wait(10) == -signal.SIGTERM
    assert enforcer.tick() == [] and enforcer.pending == {}
    enforcer.close()


def test_unleased_action_is_checked(server_factory):
    with pytest.raises(errors.ConfigurationError, match="unleased_action"):
        Settings.load(None, unleased_action="nuke")
    with pytest.raises(errors.ConfigurationError, match="unleased_kill_grace_s"):
        Settings.load(None, unleased_kill_grace_s=-1)
    srv = server_factory(simulate="t1=1xT4-16GB", sample_interval=0.1)
    admin = srv.client("root", "admin")
    for bad in ({"unleased_action": "nuke"}, {"unleased_action": 1}, {"unleased_kill_grace_s": -1}):
        with pytest.raises(errors.BadRequest):
            admin.request("PUT", "/api/v1/policy/T4-16GB", json=bad)
    out = admin.request("PUT", "/api/v1/policy/T4-16GB", json={"unleased_action": "kill", "unleased_kill_grace_s": 3})
    assert out["unleased_action"] == "kill" and out["unleased_kill_grace_s"] == 3
    answer = srv.client("a", "agent").request("POST", "/api/v1/nodes/t1/samples", json={"gpus": [{"index": 0}]})
    assert answer["unleased_action"] == "kill" and answer["unleased_kill_grace_s"] == 3


def test_a_gpu_is_known_by_its_device_number_not_its_path(tmp_path) -> None:
    """A process that opened the GPU under a path of its own (``/dev`` bind-mounted elsewhere, then
    a chroot) is still seen to use it: the open file's device number decides, not its name. Here
    /dev/null (a character device, major 1) stands in for a GPU: its path is no NVIDIA path, as a
    GPU's is not when opened through a bind mount."""
    from lease_server.node.enforce import nvidia_majors, uses_gpu_device

    null_major = os.major(os.stat("/dev/null").st_rdev)
    assert 195 in nvidia_majors()
    holder = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pipes = subprocess.Popen(["sleep", "30"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        links = set()
        for fd in os.listdir(f"/proc/{holder.pid}/fd"):  # (a descriptor of the fork may close at its exec)
            with contextlib.suppress(FileNotFoundError):
                links.add(os.readlink(f"/proc/{holder.pid}/fd/{fd}"))
        assert "/dev/null" in links  # (the path is no NVIDIA path: the old check said no)
        assert uses_gpu_device(holder.pid, frozenset({null_major}))
        assert not uses_gpu_device(holder.pid, frozenset({195}))
        assert not uses_gpu_device(pipes.pid, frozenset({null_major}))
    finally:
        for p in (holder, pipes):
            p.kill()
            p.wait()
