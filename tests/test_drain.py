"""Draining: whoever ends a lease, its GPUs are granted again only after its processes are gone.

Real lease server and Redis, simulated GPUs, real processes: each process claims its lease at the
node agent's socket, as the magic's worker does (the kernel names it to the agent: no pid a user
sends is ever signalled); the server ends the lease in each of the ways
it can (admin revoke, expiry of a frozen holder, idle reclaim, preemption, a booking's recall, an
elastic shrink past its deadline); a waiter is granted the GPUs. The node agent ends the old
process, and the waiter's grant is later than the old process's exit, as the event log (grant
time) and the process table (exit time, from a pidfd) show.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from click.testing import CliRunner

from lease_server import errors
from lease_server.cli import main
from lease_server.procs import start_ticks
from tests.api_helpers import EventWatcher
from tests.invariants import check_event_log, check_state, read_events

# A process that ignores SIGTERM, so only the agent's SIGKILL (after drain_kill_grace_s) ends it:
# the GPUs are then draining for at least that long, whatever the machine's speed. It claims the
# leases it reads on stdin (one JSON object a line: claims.claim's arguments), as a worker does.
CLAIMS = (
    "import json, sys\n"
    "from lease_server.node.claims import ClaimRefused, claim\n"
    "for line in sys.stdin:\n"
    "    try:\n"
    "        claim(**json.loads(line))\n"
    "        print('claimed', flush=True)\n"
    "    except (ClaimRefused, OSError) as exc:\n"
    "        print(f'refused: {exc}', flush=True)\n"
)
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True)\n"
    + CLAIMS
    + "time.sleep(600)\n"
)
GRACE = 1.0
# The exit time comes from a thread of this process woken by a pidfd, the grant time from Redis:
# a few ms of jitter either way. A grant that did not wait for the exit would come about GRACE
# (the SIGKILL's delay) before it, far outside this.
JITTER_MS = 20


class Watched:
    """A child process whose exit time (epoch ms) a thread takes from a pidfd the moment it exits."""

    def __init__(self, code: str = STUBBORN) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "up"
        self.pid = self.proc.pid
        self.start = start_ticks(self.pid) or 0
        self.exited_ms: float | None = None
        self._fd = os.pidfd_open(self.pid)
        self._done = threading.Event()
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        select.select([self._fd], [], [])
        self.exited_ms = time.time() * 1000
        os.close(self._fd)
        self._done.set()

    def wait(self, timeout: float) -> float:
        assert self._done.wait(timeout), f"process {self.pid} still runs after {timeout} s"
        self.proc.wait()
        assert self.exited_ms is not None
        return self.exited_ms

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def procs() -> Any:
    made: list[Watched] = []

    def make(code: str = STUBBORN) -> Watched:
        made.append(Watched(code))
        return made[-1]

    yield make
    for p in made:
        p.kill()


def claim_line(client: Any, lease: Any, node: str, gpus: list[int] | None = None) -> str:
    """What a process sends its node agent to claim ``lease`` there (claims.claim's arguments)."""
    if gpus is None:
        gpus = [int(g["index"]) for g in lease.gpus if g.get("node", lease.node) == node]
    instance = client.request("GET", "/api/v1/info")["instance"]
    args = {"instance": instance, "node": node, "lease": lease.id, "fence": lease.token, "token": client.token}
    return json.dumps({**args, "gpus": gpus})


def name(client: Any, lease: Any, proc: Watched, gpus: list[int] | None = None, says: str = "claimed") -> str:
    """``proc`` claims ``lease`` at its node agent, as a worker does; returns the agent's answer."""
    assert proc.proc.stdin is not None and proc.proc.stdout is not None
    proc.proc.stdin.write(claim_line(client, lease, lease.node, gpus) + "\n")
    proc.proc.stdin.flush()
    answer = proc.proc.stdout.readline().strip()
    assert answer.startswith(says), answer
    return answer


def board_states(client: Any, node: str) -> dict[int, str]:
    return {g["index"]: g["state"] for n in client.cluster()["nodes"] if n["name"] == node for g in n["gpus"]}


def assert_drained_then_granted(
    srv: Any, watcher: EventWatcher, old: Any, proc: Watched, waiter: str, how: str
) -> dict[str, Any]:
    """The old lease ended as ``how``, its GPUs drained (the agent had to SIGKILL the process), and
    the waiter's grant came after the process exited."""
    drained = watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == old.id, 20, "drained")
    exited = proc.wait(5)
    grant = watcher.wait_for(lambda e: e["type"] == "grant" and e["lease"] == waiter, 20, "the waiter's grant")
    assert drained["ended"] == how and drained["killed"] >= 1 and drained["took_ms"] >= GRACE * 1000 * 0.9
    assert grant["ts"] * 1000 >= exited - JITTER_MS, f"granted at {grant['ts'] * 1000:.0f}, exited at {exited:.0f}"
    ev_ids = [e["id"] for e in watcher.events]
    assert ev_ids.index(drained["id"]) < ev_ids.index(grant["id"])
    return drained


def check_invariants(srv: Any, redis_sync: Any) -> None:
    from lease_server.store.keys import Keys

    keys = Keys(srv.settings.prefix)
    check_event_log(read_events(redis_sync, keys))
    check_state(redis_sync, keys)


@pytest.fixture
def srv(server_factory: Any) -> Any:
    return server_factory(simulate="n1=2xA100-80GB", drain_kill_grace_s=GRACE, drain_interval=0.1)


def test_admin_revoke_drains_before_the_waiter_is_granted(srv: Any, procs: Any, redis_sync: Any) -> None:
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob, admin = srv.client("alice"), srv.client("bob"), srv.client("root", "admin")
    lease = alice.acquire(2)
    proc = procs()
    name(alice, lease, proc)
    rid = bob.new_request_id()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(bob.acquire(2, wait=30, request_id=rid)), daemon=True)
    t.start()
    watcher.wait_for(lambda e: e["type"] == "queued" and e["lease"] == rid, 10, "bob queued")
    admin.revoke(lease.id, "maintenance")
    # Until the agent's SIGKILL (GRACE after its SIGTERM, which the process ignores): draining.
    assert board_states(admin, "n1") == {0: "draining", 1: "draining"}
    gpu = next(g for n in admin.cluster()["nodes"] for g in n["gpus"] if g["index"] == 0)
    assert gpu["draining"]["lease"] == lease.id and gpu["draining"]["user"] == "alice"
    assert admin.cluster()["pools"]["A100-80GB"]["draining"] == 2
    shown = CliRunner().invoke(main, ["status", "--url", srv.url, "--token", srv.token("root", "admin")])
    lines = [ln for ln in shown.output.splitlines() if ln.startswith("draining: ")]
    assert len(lines) == 1 and lines[0].startswith("draining: n1 GPU 0,1: alice's lease revoked "), shown.output
    assert lines[0].endswith(" ago, free once clean") and len(lines[0]) <= 80
    assert_drained_then_granted(srv, watcher, lease, proc, rid, "revoked")
    t.join(10)
    assert got and got[0].node == "n1"
    assert alice.get(lease.id)["state"] == "revoked"  # the owner's line: who and why, as before
    check_invariants(srv, redis_sync)


def test_a_frozen_holder_that_stops_renewing_expires_and_drains(srv: Any, procs: Any, redis_sync: Any) -> None:
    """The holder (a kernel) is frozen with SIGSTOP: it cannot renew, nor end its worker."""
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob = srv.client("alice"), srv.client("bob")
    holder = procs(
        "import os, sys, time\n"
        "from lease_server.client import Client\n"
        f"c = Client({srv.url!r}, {srv.token('alice')!r})\n"
        "lease = c.acquire(1, ttl=2)\n"
        "from lease_server.node.claims import claim\n"
        "instance = c.request('GET', '/api/v1/info')['instance']\n"
        "claim(instance, lease.node, lease.id, lease.token, c.token, gpus=[lease.gpus[0]['index']])\n"
        "print('up', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.5); c.renew(lease)\n"
    )
    lease_id = holder_lease(watcher, "alice")
    os.kill(holder.pid, signal.SIGSTOP)
    rid = bob.new_request_id()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(bob.acquire(2, wait=30, request_id=rid)), daemon=True)
    t.start()
    drained = watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease_id, 30, "drained")
    exited = holder.wait(5)
    grant = watcher.wait_for(lambda e: e["type"] == "grant" and e["lease"] == rid, 20, "bob's grant")
    assert drained["ended"] == "expired" and drained["killed"] == 1
    assert grant["ts"] * 1000 >= exited - JITTER_MS
    t.join(10)
    assert alice.get(lease_id)["state"] == "expired"
    check_invariants(srv, redis_sync)


def holder_lease(watcher: EventWatcher, user: str) -> str:
    ev = watcher.wait_for(lambda e: e["type"] == "grant" and e.get("user") == user, 20, f"{user}'s grant")
    return str(ev["lease"])


def test_idle_reclaim_drains(server_factory: Any, procs: Any, redis_sync: Any) -> None:
    fast = dict(sample_interval=0.1, idle_timeout=0.6, grace=0.3, min_age=0.0, idle_threshold=5.0)
    srv = server_factory(simulate="n1=1xA100-80GB", drain_kill_grace_s=GRACE, drain_interval=0.1, **fast)
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob = srv.client("alice"), srv.client("bob")
    lease = alice.acquire(1)
    proc = procs()
    name(alice, lease, proc)
    rid = bob.new_request_id()
    t = threading.Thread(target=lambda: bob.acquire(1, wait=30, request_id=rid), daemon=True)
    t.start()
    assert_drained_then_granted(srv, watcher, lease, proc, rid, "revoked")
    assert alice.get(lease.id)["end_reason"].startswith("reclaimed")
    t.join(10)
    check_invariants(srv, redis_sync)


def test_preemption_drains(server_factory: Any, procs: Any, redis_sync: Any) -> None:
    srv = server_factory(
        simulate="n1=2xA100-80GB",
        drain_kill_grace_s=GRACE,
        drain_interval=0.1,
        scheduling={"A100-80GB": {"quota": {"*": 1}, "preempt_notice": 0.3}},
    )
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob = srv.client("alice"), srv.client("bob")
    alice.acquire(1)  # within quota
    above = alice.acquire(1)  # above quota: preemptible
    assert above.raw.get("preemptible")
    proc = procs()
    name(alice, above, proc)
    rid = bob.new_request_id()
    t = threading.Thread(target=lambda: bob.acquire(1, wait=30, request_id=rid), daemon=True)
    t.start()
    assert_drained_then_granted(srv, watcher, above, proc, rid, "revoked")
    t.join(10)
    check_invariants(srv, redis_sync)


def test_elastic_shrink_past_its_deadline_drains_only_the_gpus_taken(
    server_factory: Any, procs: Any, redis_sync: Any
) -> None:
    """An elastic lease asked to shrink never does (its rank on GPU 1 never reaches step()): the
    server takes GPU 1 at the deadline; only the process on GPU 1 is ended, GPU 0's keeps running."""
    srv = server_factory(
        simulate="n1=2xA100-80GB",
        drain_kill_grace_s=GRACE,
        drain_interval=0.1,
        scheduling={"A100-80GB": {"preempt_notice": 0.3}},
    )
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, bob = srv.client("alice"), srv.client("bob")
    lease = alice.acquire(2, gpus_min=1)
    rank0, rank1 = procs(), procs()
    name(alice, lease, rank0, gpus=[0])
    name(alice, lease, rank1, gpus=[1])
    rid = bob.new_request_id()
    t = threading.Thread(target=lambda: bob.acquire(1, wait=30, request_id=rid), daemon=True)
    t.start()
    shrunk = watcher.wait_for(lambda e: e["type"] == "shrunk" and e["lease"] == lease.id, 20, "shrunk")
    assert shrunk["by"] == "server" and shrunk["draining"] == [1]
    assert_drained_then_granted(srv, watcher, lease, rank1, rid, "shrunk")
    assert rank0.proc.poll() is None  # the rank on the GPU that stays was not touched
    assert alice.get(lease.id)["state"] == "active"
    t.join(10)
    check_invariants(srv, redis_sync)


def test_an_owners_release_drains_only_what_it_did_not_see_gone(srv: Any, procs: Any, redis_sync: Any) -> None:
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, admin = srv.client("alice"), srv.client("root", "admin")
    plain = alice.acquire(1)
    admin.revoke(plain.id)
    assert board_states(admin, "n1")[plain.gpus[0]["index"]] == "free"  # nothing named: nothing to drain
    lease = alice.acquire(2)
    name(alice, lease, procs())
    alice.release(lease, verified=True)  # the magic saw its worker gone first: free at once
    assert board_states(admin, "n1") == {0: "free", 1: "free"}
    # Released without having seen it gone (the board's Release while the cell runs, a kernel shut
    # down): the GPU the named process uses drains, the other is free at once.
    lease = alice.acquire(2)
    proc = procs()
    name(alice, lease, proc, gpus=[0])
    alice.release(lease)
    assert board_states(admin, "n1") == {0: "draining", 1: "free"}
    drained = watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease.id, 20, "drained")
    assert drained["ended"] == "released" and drained["gpus"] == [0] and drained["killed"] == 1
    proc.wait(5)
    assert board_states(admin, "n1") == {0: "free", 1: "free"}
    check_invariants(srv, redis_sync)


def test_claims_refuse_what_is_not_theirs_and_change_nothing(srv: Any, procs: Any, redis_sync: Any) -> None:
    """A claim names only the process that makes it; the agent still refuses one for another
    user's lease, a GPU or node the lease does not hold, a stale fencing token. Users cannot
    record processes themselves: the old route is gone, the agents' one is for agent tokens."""
    from lease_server.store.keys import Keys

    alice, bob = srv.client("alice"), srv.client("bob")
    lease = alice.acquire(1)
    idx = lease.gpus[0]["index"]
    proc = procs()
    assert "another user" in name(bob, lease, proc, says="refused")  # bob's token, alice's lease
    assert f"GPU {1 - idx}" in name(alice, lease, proc, gpus=[1 - idx], says="refused")
    assert "fencing token" in name(alice, dataclasses.replace(lease, token=lease.token + 1), proc, says="refused")
    assert "procs" not in json.loads(redis_sync.hget(Keys(srv.settings.prefix).leases, lease.id))
    with pytest.raises(errors.NotFound):
        alice.request("POST", f"/api/v1/leases/{lease.id}/procs", json={"token": lease.token, "procs": []})
    body = {"lease": lease.id, "fence": lease.token, "token": alice.token, "pid": proc.pid, "start": 1, "uid": 0}
    for who in (alice, srv.client("root", "admin")):
        with pytest.raises(errors.Forbidden):
            who.request("POST", "/api/v1/nodes/n1/procs", json=body)
    assert "procs" not in json.loads(redis_sync.hget(Keys(srv.settings.prefix).leases, lease.id))
    name(alice, lease, proc)  # its owner's claim, for its own process: recorded
    rec = json.loads(redis_sync.hget(Keys(srv.settings.prefix).leases, lease.id))
    assert rec["procs"] == [{"node": "n1", "pid": proc.pid, "start": proc.start, "uid": os.getuid(), "gpus": [idx]}]
    with pytest.raises(errors.Forbidden):
        alice.request("GET", "/api/v1/nodes/n1/draining")
    with pytest.raises(errors.Forbidden):
        alice.request("POST", "/api/v1/nodes/n1/drained", json={"lease": lease.id, "gpus": [idx]})


def test_the_http_agent_drains_its_node(server_factory: Any, procs: Any, redis_sync: Any) -> None:
    """gpulease agent (over HTTP, not in the server) reads its draining GPUs and reports them clean."""
    from lease_server.leasing.inventory import parse_simulate
    from lease_server.node.agent import run_remote

    srv = server_factory(simulate="", drain_kill_grace_s=GRACE)  # no agent in the server
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    stop = threading.Event()
    agent_client = srv.client("agent-r1", "agent")
    agent = threading.Thread(
        target=run_remote,
        args=(agent_client, parse_simulate("r1=2xA100-80GB"), 0.5, stop, 5.0, 0.1, GRACE),
        daemon=True,
    )
    agent.start()
    try:
        watcher.wait_for(lambda e: e["type"] == "node_registered" and e["node"] == "r1", 10, "r1 declared")
        alice, admin = srv.client("alice"), srv.client("root", "admin")
        lease = alice.acquire(2)
        proc = procs()
        name(alice, lease, proc)
        admin.revoke(lease.id)
        drained = watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease.id, 20, "drained")
        exited = proc.wait(5)
        assert drained["killed"] == 1 and drained["ts"] * 1000 >= exited - JITTER_MS
        assert board_states(admin, "r1") == {0: "free", 1: "free"}
    finally:
        stop.set()
        agent.join(10)
        agent_client.close()
    check_invariants(srv, redis_sync)


def test_an_idle_agent_long_polls_its_drains(server_factory: Any, redis_sync: Any) -> None:
    """GET /nodes/{node}/draining?wait= holds an idle agent's request until a drain starts on its
    node, then answers with it at once; with none, it answers an empty list when the wait ends. So
    an idle agent asks about its drains once a wait (40 s), not twice a second. A wait out of range
    is a 400 that says the range, and changes nothing."""
    from lease_server.leasing.inventory import parse_simulate

    srv = server_factory(simulate="")  # no agent in the server: the node is this test's
    agent, poller = srv.client("agent-r1", "agent"), srv.client("agent-r1", "agent")
    path = "/api/v1/nodes/r1/draining"
    agent.request("PUT", "/api/v1/nodes/r1", json=json.loads(parse_simulate("r1=1xA100-80GB")[0].to_json()))
    assert agent.request("GET", path, params={"wait": "1"}) == {"node": "r1", "draining": []}
    for bad in ("-1", "61", "soon"):
        with pytest.raises(errors.BadRequest, match="wait must be an integer between 0 and 60"):
            agent.request("GET", path, params={"wait": bad})

    alice, admin = srv.client("alice"), srv.client("root", "admin")
    lease = alice.acquire(1)
    answer: dict[str, Any] = {}
    wait = {"wait": "60"}
    poll = threading.Thread(target=lambda: answer.update(poller.request("GET", path, params=wait, timeout=90)))
    poll.start()
    claim = {"lease": lease.id, "fence": lease.token, "token": alice.token, "pid": os.getpid(),
             "start": start_ticks(os.getpid()), "uid": os.getuid(), "gpus": lease.indexes}  # fmt: skip
    agent.request("POST", "/api/v1/nodes/r1/procs", json=claim)  # (recorded only: nothing here signals it)
    admin.revoke(lease.id)  # its GPU drains, and the waiting poll answers with it
    poll.join(30)  # well inside its 60 s wait
    assert not poll.is_alive() and [d["lease"] for d in answer["draining"]] == [lease.id], answer
    freed = agent.request("POST", "/api/v1/nodes/r1/drained", json={"lease": lease.id, "gpus": lease.indexes})
    assert freed["freed"] == 1 and agent.request("GET", path, params={"wait": "0"})["draining"] == []
    for c in (agent, poller, alice, admin):
        c.close()
    check_invariants(srv, redis_sync)
