"""Security review, findings 1 and 2: the node agent ends only what tied itself to a lease.

A hostile colleague holds a token and a shell on the GPU host. They used to name any pid to their
lease (``POST /leases/{id}/procs``) and have the node agent signal it when the lease ended
(released unverified, expired, revoked), or name one it could not end and leave the GPUs draining
forever. Here, on a real lease server and Redis with its in-process agent, each attack is tried
and fails: users cannot name processes at all, a claim ties only the process that makes it
(``SO_PEERCRED``), and a process the agent must not or cannot end is given up with a
``drain_abandoned`` event, the GPU flagged for an admin, who lists and clears it with
``gpulease drain``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest
from click.testing import CliRunner

from lease_server import errors, procs
from lease_server.cli import main
from lease_server.node import claims
from tests.api_helpers import EventWatcher
from tests.invariants import check_event_log, check_state, read_events
from tests.test_drain import CLAIMS, Watched, board_states, name

GRACE = 0.5


@pytest.fixture
def srv(server_factory: Any) -> Any:
    return server_factory(simulate="n1=2xA100-80GB", drain_kill_grace_s=GRACE, drain_interval=0.1, default_ttl=60)


@pytest.fixture
def victim() -> Any:
    """A process of the host that no lease has anything to do with (a colleague's job, a service)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    yield proc
    proc.kill()
    proc.wait()


def check(srv: Any, redis_sync: Any) -> None:
    from lease_server.store.keys import Keys

    keys = Keys(srv.settings.prefix)
    check_event_log(read_events(redis_sync, keys))
    check_state(redis_sync, keys)


def test_a_user_cannot_have_the_agent_end_a_process_they_name(srv: Any, victim: Any, redis_sync: Any) -> None:
    """Finding 1: naming another process to one's lease, then ending the lease every way it can end."""
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    mallory, admin = srv.client("mallory"), srv.client("root", "admin")
    for end in ("release", "revoke", "expire"):
        lease = mallory.acquire(2, ttl=1 if end == "expire" else 30)
        named = {"node": "n1", "pid": victim.pid, "start": 0, "gpus": [0]}
        with pytest.raises(errors.NotFound):  # the route that took pids from users is gone
            mallory.request("POST", f"/api/v1/leases/{lease.id}/procs", json={"token": lease.token, "procs": [named]})
        forged = {
            "lease": lease.id,
            "fence": lease.token,
            "token": mallory.token,
            "pid": victim.pid,
            "start": 1,
            "uid": 0,
        }
        with pytest.raises(errors.Forbidden):  # the agents' route: agent tokens only
            mallory.request("POST", "/api/v1/nodes/n1/procs", json=forged)
        if end == "release":
            mallory.release(lease)  # unverified: what it named would drain
        elif end == "revoke":
            admin.revoke(lease.id, "test")
        ev = watcher.wait_for(
            lambda e, lid=lease.id: e.get("lease") == lid and e["type"] in ("released", "revoked", "expired"),
            10,
            f"{end} of {lease.id}",
        )
        assert ev["type"] != "drain_abandoned"
        # Nothing claimed the lease: its GPUs are free at once, and nobody was signalled.
        assert board_states(admin, "n1") == {0: "free", 1: "free"}
    assert victim.poll() is None
    assert not [e for e in watcher.events if e["type"] in ("drained", "drain_abandoned", "unleased_killed")]
    check(srv, redis_sync)


def test_a_claim_ties_only_the_process_that_makes_it(srv: Any, victim: Any, redis_sync: Any) -> None:
    """A claim carries no pid: the kernel names the process that connected. A process that claims
    a lease for another pid's sake (its parent's, say) only ever ties itself."""
    mallory, admin = srv.client("mallory"), srv.client("root", "admin")
    lease = mallory.acquire(1)
    # The victim's child would like to get its parent ended: whatever it sends, it claims itself.
    child = Watched("print('up', flush=True)\n" + CLAIMS + "import time; time.sleep(600)\n")
    try:
        name(mallory, lease, child)
        from lease_server.store.keys import Keys

        rec = json.loads(redis_sync.hget(Keys(srv.settings.prefix).leases, lease.id))
        assert [p["pid"] for p in rec["procs"]] == [child.pid]
        admin.revoke(lease.id, "test")
        child.wait(10)  # mallory's own process: ended
        assert victim.poll() is None
    finally:
        child.kill()
    check(srv, redis_sync)


def test_the_agents_own_services_cannot_claim(srv: Any, redis_sync: Any) -> None:
    """Redis, Ray's daemons and JupyterLab are registered with the agent (claims.protect) under
    gpulease up: they can never be tied to a lease, so never ended by a drain."""
    mallory = srv.client("mallory")
    lease = mallory.acquire(1)
    svc = Watched("print('up', flush=True)\n" + CLAIMS + "import time; time.sleep(600)\n")
    try:
        claims.protect(svc.pid)
        assert "a service the node agent started" in name(mallory, lease, svc, says="refused")
    finally:
        claims._PROTECTED.pop(svc.pid, None)
        svc.kill()
    assert claims.refusal(1) is not None and claims.refusal(2) is not None  # init, a kernel thread
    import os

    assert claims.refusal(os.getpid()) == "the node agent or one of its parents"


def test_a_process_the_agent_must_not_end_is_given_up_and_flagged(srv: Any, redis_sync: Any) -> None:
    """Finding 2: a lease whose process cannot be ended no longer keeps its GPUs draining silently
    forever: the agent gives it up (drain_abandoned names it), the GPU stays out of service and
    flagged, ``gpulease drain list`` shows it and ``gpulease drain clear`` frees it."""
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    mallory, admin = srv.client("mallory"), srv.client("root", "admin")
    admin_token = srv.token("root", "admin")
    lease = mallory.acquire(1)
    idx = lease.gpus[0]["index"]
    proc = Watched("print('up', flush=True)\n" + CLAIMS + "import time; time.sleep(600)\n")
    try:
        name(mallory, lease, proc)
        claims.protect(proc.pid)  # now a process the agent must never end (as if it were Redis)
        mallory.release(lease)  # unverified: its GPU drains
        gone = watcher.wait_for(lambda e: e["type"] == "drain_abandoned" and e["lease"] == lease.id, 10, "given up")
        assert gone["pid"] == proc.pid and gone["gpus"] == [idx] and "service" in gone["why"]
        assert proc.proc.poll() is None  # not signalled
        assert board_states(admin, "n1")[idx] == "draining"
        listed = CliRunner().invoke(main, ["drain", "list", "--url", srv.url, "--token", admin_token])
        assert listed.exit_code == 0, listed.output
        line = next(ln for ln in listed.output.splitlines() if f"n1 GPU {idx}" in ln)
        assert "gave up" in line and str(proc.pid) in line, listed.output
        assert all(len(ln) <= 80 for ln in listed.output.splitlines()), listed.output
        refused = CliRunner().invoke(main, ["drain", "clear", "n1", "--url", srv.url, "--token", mallory.token])
        assert refused.exit_code != 0 and "admin" in refused.output
        cleared = CliRunner().invoke(main, ["drain", "clear", "n1", "--url", srv.url, "--token", admin_token])
        assert cleared.exit_code == 0 and "1 GPU" in cleared.output, cleared.output
        assert board_states(admin, "n1")[idx] == "free"
    finally:
        claims._PROTECTED.pop(proc.pid, None)
        proc.kill()
    assert not threading.current_thread().daemon
    check(srv, redis_sync)


@pytest.mark.exclusive("cgroup")  # the host's gpulease cgroup: one test at a time (tests/conftest.py)
def test_a_claimed_worker_and_its_children_share_the_leases_cgroup_and_end_with_it(
    server_factory: Any, redis_sync: Any
) -> None:
    """Where the agent runs as root with cgroups (gpu_isolation on), a claim puts the process in its
    lease's cgroup (device rules: only its GPUs, tests/test_sec_cgroup.py), and what it starts
    later is in there too: when the server ends the lease, the drain ends the children as well,
    though they never claimed anything themselves."""
    from lease_server.node.cgroup import DeviceIsolation, Unavailable

    iso = DeviceIsolation.detect()
    if isinstance(iso, Unavailable):
        pytest.skip(iso.reason)
    srv = server_factory(simulate="n1=2xA100-80GB", drain_kill_grace_s=GRACE, drain_interval=0.1, gpu_isolation="on")
    assert srv.client("root", "admin").cluster()["nodes"][0]["isolation"] == iso.kind
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice, admin = srv.client("alice"), srv.client("root", "admin")
    lease = alice.acquire(1)
    parent = Watched(
        "print('up', flush=True)\n"
        + CLAIMS
        + "import subprocess, time\n"
        + "child = subprocess.Popen(['sleep', '600'])\n"
        + "print(child.pid, flush=True)\n"
        + "time.sleep(600)\n"
    )
    child_pid = 0
    try:
        name(alice, lease, parent)
        assert parent.proc.stdin is not None and parent.proc.stdout is not None
        parent.proc.stdin.close()  # no more claims: it starts its child
        child_pid = int(parent.proc.stdout.readline())
        assert sorted(iso.pids(lease.id)) == sorted([parent.pid, child_pid])
        admin.revoke(lease.id, "test")
        drained = watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == lease.id, 20, "drained")
        parent.wait(5)
        assert drained["killed"] == 2
        assert procs.start_ticks(child_pid) is None  # ended (or a zombie of its ended parent)
    finally:
        parent.kill()
    check(srv, redis_sync)
