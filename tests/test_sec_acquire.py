"""``gpulease acquire`` on the lease's own host ties what it runs to the lease, as a cell's worker is.

A hostile colleague on a shared host: a lease that no process claimed had no owner the node agent
knew, so any process seen only on its GPUs was taken for its own (another user's too). And the
command of ``gpulease acquire -- COMMAND`` went on running after an admin revoked the lease. Now
the command claims the lease at the node agent before it starts (lease_server/cli/claimexec.py),
and ``gpulease acquire`` without a command claims it for its user. Real server, Redis and
in-process agent; the CLI in its own processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lease_server.client import Client
from tests.api_helpers import EventWatcher
from tests.conftest import CLI


@pytest.fixture
def srv(server_factory: Any) -> Any:
    return server_factory(simulate="n1=2xA100-80GB", drain_kill_grace_s=0.5, drain_interval=0.1)


def env_of(srv: Any, user: str) -> dict[str, str]:
    return {**os.environ, "GPULEASE_URL": srv.url, "GPULEASE_TOKEN": srv.token(user), "COLUMNS": "80"}


def procs_of(srv: Any, redis_sync: Any, lease_id: str) -> list[dict[str, Any]]:
    """The processes the agent tied to the lease (its record in Redis: the API does not show pids)."""
    from lease_server.store.keys import Keys

    return list(json.loads(redis_sync.hget(Keys(srv.settings.prefix).leases, lease_id)).get("procs") or [])


def test_a_revoked_leases_command_is_ended_and_says_why(srv: Any, redis_sync: Any) -> None:
    admin = srv.client("root", "admin")
    script = "import os, sys, time; print(os.getpid(), flush=True); time.sleep(600)"
    cli = subprocess.Popen(
        [*CLI, "acquire", "--gpus", "1", "--ttl", "60", "--", sys.executable, "-c", script],
        env=env_of(srv, "alice"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert cli.stdout is not None
        pid = int(cli.stdout.readline())  # the command, started once its claim was answered
        (lease,) = admin.leases(everyone=True)
        # the command itself (exec'd in place of the claimer: same pid) is what the agent knows
        assert [(p["pid"], p["uid"]) for p in procs_of(srv, redis_sync, lease["id"])] == [(pid, os.getuid())]
        admin.revoke(lease["id"], "maintenance")
        _, err = cli.communicate(timeout=30)  # the drain ends the command: the CLI returns
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"lease {lease['id']} ended after ") and "revoked" in last, err
    assert all(len(line) <= 80 for line in err.splitlines()), err


def test_a_process_of_another_user_on_an_acquired_gpu_is_unleased_use(srv: Any, redis_sync: Any) -> None:
    """Without a claim, pid 4242 of another uid, seen only on alice's GPU, was taken for hers."""
    done = subprocess.run(
        [*CLI, "acquire", "--gpus", "1", "--ttl", "60", "--json"],
        env=env_of(srv, "alice"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stderr.startswith("gpulease:"), done.stderr
    lease = Client(srv.url, srv.token("alice")).get(json.loads(done.stdout)["id"])
    assert [p["uid"] for p in procs_of(srv, redis_sync, lease["id"])] == [os.getuid()]
    idx = lease["gpus"][0]["index"]
    mine = subprocess.Popen(["sleep", "60"])  # alice's own job on her GPU, started by hand
    try:
        watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
        agent = srv.client("agent-n1", "agent")
        sample = {"index": idx, "util": 50, "procs": [mine.pid, 4242], "uids": [os.getuid(), os.getuid() + 1]}
        agent.request("POST", "/api/v1/nodes/n1/samples", json={"gpus": [sample]})
        ev = watcher.wait_for(lambda e: e["type"] == "unleased_use", 10, "unleased_use")
        assert (ev["node"], ev["gpu"], ev["pids"]) == ("n1", idx, [4242]), ev
    finally:
        mine.kill()
        mine.wait()


def test_the_command_never_sees_the_claim(srv: Any, redis_sync: Any) -> None:
    """The claim carries the API token: it is taken out of the environment before the command runs
    (which claimed: its pid is the lease's)."""
    code = "import os, sys; print(os.environ.get('GPULEASE_CLAIM'), os.getpid(), flush=True); sys.stdin.readline()"
    cli = subprocess.Popen(
        [*CLI, "acquire", "--gpus", "1", "--", sys.executable, "-c", code],
        env=env_of(srv, "alice"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert cli.stdout is not None and cli.stdin is not None
        claim, pid = cli.stdout.readline().split()
        assert claim == "None"
        (lease,) = srv.client("root", "admin").leases(everyone=True)
        assert [p["pid"] for p in procs_of(srv, redis_sync, lease["id"])] == [int(pid)]
        cli.stdin.write("done\n")
        cli.stdin.flush()
        _, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err
    assert "did not tie" not in err and "released" in err, err


def test_without_an_agent_here_the_command_runs_as_before() -> None:
    """The lease's node is on another host (no claim socket of it here): nothing is claimed, nothing
    is said, and the command runs; a command that went missing since is told as a shell tells it."""
    from lease_server.node.claimexec import CLAIM_ENV, claim_env

    claim = claim_env("0123456789ab", "elsewhere", "l-0123456789abcdef", 7, "tok", "", [0])
    env = {**os.environ, CLAIM_ENV: claim}
    run = [sys.executable, "-m", "lease_server.node.claimexec"]
    done = subprocess.run([*run, sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", "")
    done = subprocess.run([*run, "no-such-program-here"], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (127, "gpulease: no-such-program-here: command not found\n")


def test_the_wrapper_runs_nothing_of_the_current_directory_and_leaves_signals_as_a_shell_does(
    srv: Any, tmp_path
) -> None:
    """A json.py in the directory the command is started from is not imported by the wrapper (it
    would run with the claim's token at hand), and the command does not inherit Python's ignored
    SIGPIPE and SIGXFSZ (`yes | head -1` would end on a write error, not on SIGPIPE)."""
    (tmp_path / "json.py").write_text("raise SystemExit('imported from the current directory')\n")
    show = "grep SigIgn /proc/self/status"
    plain = subprocess.run(["sh", "-c", show], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    env = env_of(srv, "alice")
    gpulease = str(Path(sys.executable).with_name("gpulease"))  # (as installed: `python -m` would import it too)
    done = subprocess.run(
        [gpulease, "acquire", "--gpus", "1", "--", "sh", "-c", show],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "imported from the current directory" not in done.stderr
    sig_ign = int(done.stdout.split("SigIgn:")[1].split()[0], 16)
    assert sig_ign & ((1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))) == 0, done.stdout
    assert sig_ign == int(plain.stdout.split("SigIgn:")[1].split()[0], 16)
