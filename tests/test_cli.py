"""The gpulease command line, run as a user would: `gpulease up`, then the client commands."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Up, port_open

CLI = [sys.executable, "-m", "lease_server.cli"]


def test_up_serves_the_cli_and_stops_cleanly_on_ctrl_c(tmp_path):
    up = Up(tmp_path / "home", "--no-ray", "--cpu-slots", "2")
    try:
        token_file = up.data / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        # up's own clients talk to it over a Unix socket in its data dir (0700), where no other
        # user may listen in its place, as anyone may on its TCP port once it is down
        sock = up.data / "api.sock"
        assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(up.data.stat().st_mode) == 0o700

        status = up.run("status", "--json")
        assert status.returncode == 0, status.stderr
        view = json.loads(status.stdout)
        assert view["default_pool"] == "A100-80GB" and len(view["nodes"][0]["gpus"]) == 2
        assert view["pools"]["CPU"]["gpus"] == 2 and view["nodes"][1]["name"] == "box-cpu"

        ran = up.run(
            "acquire",
            "--gpus",
            "2",
            "--",
            sys.executable,
            "-c",
            "import os; print('CVD=' + os.environ['CUDA_VISIBLE_DEVICES'])",
        )
        assert ran.returncode == 0, ran.stderr
        assert "CVD=0,1" in ran.stdout
        code = up.run("acquire", "--gpus", "1", "--", sys.executable, "-c", "raise SystemExit(7)")
        assert code.returncode == 7
        # a newline in the command (bash -c 'a\nb') is a space in the lease's label: it never fails it
        lines = up.run("acquire", "--gpus", "1", "--", sys.executable, "-c", "import sys\nprint('two lines')")
        assert lines.returncode == 0 and "two lines" in lines.stdout, lines.stderr

        kept = up.run("acquire", "--gpus", "1", "--ttl", "3600", "--label", "keep")
        assert kept.returncode == 0, kept.stderr
        kept_id = json.loads(kept.stdout)["id"]

        too_many = up.run("acquire", "--gpus", "3")
        assert too_many.returncode == 2 and "the largest has 2" in too_many.stderr
        assert "Traceback" not in too_many.stderr

        table = up.run("status")
        assert "keep" in table.stdout and "leased" in table.stdout

        start, end = "2027-01-04T09:00:00+00:00", "2027-01-04T11:00:00+00:00"
        booked = up.run("book", "A100-80GB", "2", start, end, "--note", "paper", "--weekly", "2")
        assert booked.returncode == 0, booked.stderr
        booking_id = booked.stdout.split(":")[0]
        assert "weekly x2" in booked.stdout
        clash = up.run("book", "A100-80GB", "1", "2027-01-11T10:00:00+00:00", "2027-01-11T12:00:00+00:00")
        assert clash.returncode == 1 and "clash" in clash.stderr and "fits:" in clash.stderr
        assert "Traceback" not in clash.stderr
        assert (
            up.run("book", "A100-80GB", "1", "2027-01-04T11:00Z", "2027-01-04T12:00Z", "--dry-run").stdout.strip()
            == "fits"
        )
        listed = up.run("bookings", "--days", "100")
        assert listed.returncode == 0 and listed.stdout.count(booking_id) == 2, listed.stdout
        # The commands' names of earlier releases still run, and say what replaces them.
        old = up.run("reservations", "--days", "100")
        assert old.returncode == 0 and old.stdout == listed.stdout, old.stderr
        assert "gpulease reservations is deprecated: use gpulease bookings" in old.stderr
        assert "reservations" not in up.run("--help").stdout
        assert up.run("unbook", booking_id).stdout.strip() == f"{booking_id}: cancelled"
        used = up.run("usage", "--json")
        assert used.returncode == 0 and json.loads(used.stdout)["calls"] >= 2, used.stdout
        assert "calls" in up.run("usage", "--by", "pool").stdout
    finally:
        code, out = up.interrupt()
    assert code == 0, out
    assert "gpulease is down" in out
    assert not sock.exists()
    redis_port = int(out.split("redis://127.0.0.1:")[1].split("/")[0])
    assert not port_open(up.port) and not port_open(redis_port)

    # Up again on the same data dir: same token, and the lease taken before is still there (AOF).
    again = Up(tmp_path / "home", "--no-ray")
    try:
        assert (again.data / "token").read_text().strip() == token
        lease = httpx.get(
            f"http://127.0.0.1:{again.port}/api/v1/leases/{kept_id}", headers={"Authorization": f"Bearer {token}"}
        ).json()
        assert lease["state"] == "active" and lease["label"] == "keep"
        assert again.run("release", kept_id).returncode == 0
        # A second up on the same data dir (a second Redis on the same AOF), or on a taken port,
        # is refused in one line before it starts anything.
        env = {k: v for k, v in again.env.items() if k != "GPULEASE_HOME"}
        twice = subprocess.run(
            [*CLI, "up", "--simulate", "1xT4-16GB", "--no-ray", "--no-lab", "--data-dir", str(again.data)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert twice.returncode == 1, twice.stderr
        said = " ".join(twice.stderr.split())  # wrapped to the terminal's width
        assert f"gpulease up (pid {again.proc.pid}) is using {again.data.resolve()}." in said
        assert "Traceback" not in twice.stderr
        other = tmp_path / "other"
        for flag in ("--port", "--lab-port"):
            taken = subprocess.run(
                [
                    *CLI,
                    "up",
                    "--simulate",
                    "1xT4-16GB",
                    "--no-ray",
                    "--data-dir",
                    str(other),
                    "--port",
                    "0",
                    flag,
                    str(again.port),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert taken.returncode == 1, taken.stderr
            said = f"error: port {again.port} is taken on 127.0.0.1: pick another with gpulease up {flag} N"
            assert " ".join(taken.stderr.split()) == said
            assert not (other / "redis").exists()  # nothing started
    finally:
        # its terminal closed (SIGHUP): down as cleanly as on Ctrl-C (where this very test runs
        # with SIGHUP ignored, nohup's way, up leaves it ignored: Ctrl-C then)
        hangup = signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
        code, out = again.interrupt(signal.SIGHUP if hangup else signal.SIGINT)
    assert code == 0 and "gpulease is down" in out, out
    assert not port_open(again.port)


@pytest.mark.slow
def test_up_starts_and_stops_a_ray_head(tmp_path):
    up = Up(tmp_path / "home")
    try:
        token = (up.data / "token").read_text().strip()
        info = httpx.get(f"http://127.0.0.1:{up.port}/api/v1/info", headers={"Authorization": f"Bearer {token}"}).json()
        host, port = info["ray_address"].split(":")
        deadline = time.monotonic() + 60
        while not port_open(int(port)) and time.monotonic() < deadline:
            time.sleep(0.2)  # Ray's head takes a few seconds to open its port; no event to wait on
        assert port_open(int(port))
    finally:
        code, out = up.interrupt()
    assert code == 0, out
    assert "stopped ray head" in out and not port_open(int(port))


def test_up_refuses_ray_options_that_contradict_each_other(tmp_path):
    token = tmp_path / "ray_token"
    token.write_text("t\n")
    env = {**os.environ, "GPULEASE_HOME": str(tmp_path / "home")}
    for args, said in (
        (["--ray-token-file", str(token)], "--ray-token-file goes with --ray-address"),
        (["--ray-address", "127.0.0.1:6380", "--no-ray"], "drop one of them"),
    ):
        done = subprocess.run([*CLI, "up", "--no-lab", *args], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and said in " ".join(done.stderr.split()), done.stderr
        assert not (tmp_path / "home").exists()  # refused before anything started


def test_click_errors_wrap_to_80_columns_and_a_group_alone_shows_its_help():
    """click's own errors are wrapped as every other CLI error is; a group named without a
    subcommand still shows its help (click raises that as a usage error too)."""
    long = subprocess.run([*CLI, "token", "create", "bob", "--proxy"], capture_output=True, text=True, timeout=60)
    assert long.returncode == 2 and "Try 'python -m lease_server.cli token create --help'" in long.stderr
    said = long.stderr.split("\n\n", 1)[1]
    assert said.startswith("error: a proxy token needs --acts-for") and max(map(len, said.splitlines())) <= 80
    alone = subprocess.run([*CLI, "token"], capture_output=True, text=True, timeout=60)
    assert "Commands:" in alone.stdout + alone.stderr and "error:" not in alone.stderr, alone.stderr


def test_a_killed_up_leaves_its_data_dir_held_while_its_redis_runs(tmp_path):
    """up killed with SIGKILL leaves its Redis running on the AOF (its child, now an orphan): the
    Redis keeps the data dir's lock, so a second up does not start another Redis on the same AOF,
    and says which process to stop. Once that Redis is gone, the directory is free again."""
    import select

    from lease_server.node.redis_proc import hold_data_dir

    up = Up(tmp_path / "home", "--no-ray")
    pid, what, redis = (up.data / "in_use.lock").read_text().split()
    assert (int(pid), what) == (up.proc.pid, "up")
    up.proc.kill()
    up.proc.wait()
    try:
        again = subprocess.run(
            [*CLI, "up", "--simulate", "1xT4-16GB", "--no-ray", "--no-lab", "--data-dir", str(up.data), "--port", "0"],
            env={k: v for k, v in up.env.items() if k != "GPULEASE_HOME"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 1, again.stderr
        said = " ".join(again.stderr.split())
        assert f"killed (pid {pid}) still runs on {up.data.resolve()} (pid {redis})" in said, said
        assert f"Stop it (kill {redis}), then start again." in said
    finally:
        fd = os.pidfd_open(int(redis))
        os.kill(int(redis), signal.SIGKILL)
        select.select([fd], [], [], 30)  # its exit
        os.close(fd)
    os.close(hold_data_dir(up.data, "up"))  # free again


def test_the_lock_file_must_be_a_plain_file_of_ones_own(tmp_path):
    """A lock file planted in a data directory from before (a link elsewhere) is not written to."""
    from lease_server.node.redis_proc import DataDirInUse, hold_data_dir

    data = tmp_path / "home"
    data.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    (data / "in_use.lock").symlink_to(target)
    with pytest.raises(DataDirInUse, match="cannot be opened"):
        hold_data_dir(data, "up")
    (data / "in_use.lock").unlink()
    os.link(target, data / "in_use.lock")  # a hard link: the same file as another name's
    with pytest.raises(DataDirInUse, match="not a plain file of yours"):
        hold_data_dir(data, "up")
    assert target.read_text() == "keep\n"


# ---- what up's terminal shows ------------------------------------------------------------------


def _banner(up: Up, timeout: float = 120) -> tuple[list[str], list[str]]:
    """Up's terminal so far, and its banner's lines in it (printed once JupyterLab answers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        said = up.log.read_text().splitlines()
        if "Ctrl-C stops everything." in said:
            start = next(i for i, line in enumerate(said) if line.startswith("gpulease is up: "))
            return said, said[start : said.index("Ctrl-C stops everything.") + 1]
        assert up.proc.poll() is None, "\n".join(said)
        time.sleep(0.1)  # the banner comes from a thread of a starting process: nothing to wait on
    raise AssertionError(up.log.read_text())


def test_up_prints_its_banner_whole_within_80_columns_with_a_5_digit_lab_port(tmp_path):
    """With -v (its log lines on the terminal as it starts) and JupyterLab on a 5-digit port: the
    banner is one block, no log line inside it, every line within 80 columns; the lab's URL, too
    long beside its label, is on the line under it, whole (it was wrapped under an empty label)."""
    pytest.importorskip("jupyterlab")
    from lease_server.node.redis_proc import free_port

    lab_port = free_port()
    assert lab_port >= 10_000
    # A data dir as short as ~/.gpulease: only a path longer than a line may pass 80 columns.
    data = Path(tempfile.mkdtemp(prefix="gl-", dir="/tmp")) / "home"
    up = Up(data, "--no-ray", "--lab", "--lab-port", str(lab_port), "-v", COLUMNS="80")
    try:
        said, banner = _banner(up)
        assert any(" INFO " in line for line in said), said  # -v: the log is here too
        assert all(len(line) <= 80 for line in banner), banner
        assert all(line.startswith("  ") for line in banner[1:-1]), banner  # no log line inside
        labels = [line.split()[0] for line in banner[1:-1] if not line.startswith("   ")]
        assert labels == ["lease", "token", "redis", "jupyterlab", "log"], banner
        at = banner.index("  jupyterlab")
        assert banner[at + 1].startswith(f"    http://127.0.0.1:{lab_port}/lab?token="), banner
        token = banner[at + 1].split("token=")[1]
        assert len(token) == 32 and httpx.get(f"http://127.0.0.1:{lab_port}/api/status?token={token}").is_success
        assert f"  log           {data.resolve() / 'up.log'}" in banner
    finally:
        code, out = up.interrupt()
        shutil.rmtree(data.parent, ignore_errors=True)
    assert code == 0, out


def test_up_logs_to_its_file_and_its_terminal_shows_no_info_line(tmp_path):
    """Without -v, up's terminal has its banner and what a person must act on; the INFO lines (a
    dozen as it starts, more for each lease) are in DATA_DIR/up.log, 0600, which the banner names."""
    up = Up(tmp_path / "home", "--no-ray")
    try:
        said, banner = _banner(up)
        assert "                (gpulease up -v: here too; warnings come here anyway)" in banner, banner
        ran = up.run("acquire", "--gpus", "1", "--", sys.executable, "-c", "pass")
        assert ran.returncode == 0, ran.stderr
    finally:
        code, out = up.interrupt()
    assert code == 0, out
    assert not [line for line in out.splitlines() if " INFO " in line], out
    assert out.splitlines()[-1] == "stopped redis; gpulease is down", out
    log = up.data / "up.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    logged = log.read_text()
    for said in ("INFO lease_server.cli.service: gpulease up (pid", "INFO lease_server.node.redis_proc: ", "is up"):
        assert said in logged, logged
    assert len([line for line in logged.splitlines() if " INFO " in line]) >= 5, logged


def test_a_warning_on_ups_terminal_is_one_line_naming_the_log_file(tmp_path):
    """A warning or an error with a traceback: one line on the terminal, the traceback in the file."""
    import logging

    from lease_server.cli.service import OneLine

    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "sweep failed:\n %s", ("boom",), sys.exc_info())
    line = OneLine(tmp_path / "up.log").format(record)
    assert "\n" not in line and line.endswith(f" error: sweep failed: boom (details in {tmp_path / 'up.log'})")
