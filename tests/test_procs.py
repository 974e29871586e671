"""lease_server/procs.py, the one reader of a process, against real processes: a command name that
holds ") (" and spaces, a zombie, a kernel thread, the process tree, a pid taken by another
process since (told apart by start time, never signalled), and ending with a grace by pidfd and
without one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lease_server import procs
from tests.test_sec_claims import _take_pid

# A child that names itself, says "up", and waits for its stdin to close. Its name looks like the
# end of a command name followed by fields: a reader that splits at the first ")" reads it as a
# zombie whose parent is init.
NAMED = """
import signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN) if sys.argv[2] == "stubborn" else None
with open("/proc/self/comm", "w") as f:
    f.write(sys.argv[1])
print("up", flush=True)
sys.stdin.read()
"""


def _named(name: str, how: str = "") -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", NAMED, name, how or "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    return p


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    made: list[subprocess.Popen[str]] = []
    yield made
    for p in made:
        p.kill()
        p.wait()


@pytest.mark.parametrize("name", ["x) Z 1 (y", "ray::IDLE (x)", "a) (b) c"])
def test_a_command_name_with_spaces_and_parentheses_is_read_past(name: str, children: list) -> None:
    p = _named(name)
    children.append(p)
    assert Path(f"/proc/{p.pid}/comm").read_text().strip() == name[:15]
    rest = procs.stat_fields(p.pid)
    assert rest is not None and rest[procs.STATE] in ("S", "R"), rest
    assert procs.parent(p.pid) == os.getpid()
    assert procs.alive(p.pid) and not procs.kernel_thread(rest)
    start = procs.start_ticks(p.pid)
    assert start is not None and start >= procs.start_ticks("self")  # type: ignore[operator]
    assert procs.uid(p.pid) == os.getuid()


def test_self_and_this_pid_are_one_process() -> None:
    assert procs.start_ticks("self") == procs.start_ticks(os.getpid()) is not None
    assert procs.ancestors(os.getpid()) >= {os.getpid(), os.getppid()}


def test_a_zombie_has_exited(children: list) -> None:
    """A zombie is listed in /proc (state Z) until it is reaped: it does not run, has no start
    time, cannot be held, and ending it is done at once."""
    p = _named("zombie) R 1 (x")
    children.append(p)
    pid = p.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (procs.stat_fields(pid) or ["?"])[procs.STATE] != "Z":
        assert time.monotonic() < deadline, procs.stat_fields(pid)
        time.sleep(0.01)
    assert not procs.alive(pid) and procs.start_ticks(pid) is None
    assert procs.parent(pid) == os.getpid()  # still listed: not reaped
    assert procs.hold(pid) is None
    assert procs.end(pid, grace=0.1, timeout=1)
    assert p.wait(5) == -signal.SIGKILL
    assert procs.stat_fields(pid) is None and not procs.alive(pid) and procs.uid(pid) is None


def test_a_kernel_thread_is_told_by_its_flags() -> None:
    rest = procs.stat_fields(2)
    if rest is None or Path("/proc/2/comm").read_text().strip() != "kthreadd":
        pytest.skip("no kthreadd in this pid namespace")
    assert procs.kernel_thread(rest)


def test_descendants_are_found_below_a_process(children: list) -> None:
    code = "import subprocess, sys; k = subprocess.Popen(['sleep', '60']); print(k.pid, flush=True); sys.stdin.read()"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    children.append(p)
    assert p.stdout is not None
    kid = int(p.stdout.readline())
    assert procs.descendants([p.pid]) == [kid]
    assert kid in procs.descendants([os.getpid()])
    assert procs.ancestors(kid) >= {kid, p.pid, os.getpid()}


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_end_terms_then_kills_after_the_grace(pidfd: bool, children: list, monkeypatch: pytest.MonkeyPatch) -> None:
    if not pidfd:
        monkeypatch.setattr(os, "pidfd_open", _no_pidfd)
    polite = _named("polite")
    stubborn = _named("stubborn", "stubborn")
    children += [polite, stubborn]
    t0 = time.monotonic()
    assert procs.end(polite.pid, grace=5, timeout=10, start=procs.start_ticks(polite.pid))
    assert polite.wait(5) == -signal.SIGTERM and time.monotonic() - t0 < 4
    held = procs.hold(stubborn.pid)
    assert held is not None and (held.fd is not None) == pidfd
    with held:
        held.send(signal.SIGTERM)  # ignored
        assert not held.wait(0.2) and not held.gone()
    assert procs.end(stubborn.pid, grace=0.2, timeout=10, first=None)
    assert stubborn.wait(5) == -signal.SIGKILL


def _no_pidfd(pid: int) -> int:
    raise OSError(38, "Function not implemented")


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_a_pid_taken_since_is_another_process_never_signalled(pidfd: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process is its pid and its start time: once it is gone, the process that took its pid is
    not held, not ended and not signalled, with a pidfd or without."""
    if not pidfd:
        monkeypatch.setattr(os, "pidfd_open", _no_pidfd)
    first = subprocess.Popen(["sleep", "60"])
    started = procs.start_ticks(first.pid)
    assert started is not None
    old = procs.Held(first.pid, None, started)  # held by pid and start time only, as without a pidfd
    assert not old.gone()
    first.kill()
    first.wait()
    assert old.gone()
    hz = os.sysconf("SC_CLK_TCK")  # one started in the same tick would pass for it
    while float(Path("/proc/uptime").read_text().split()[0]) * hz < started + 2:
        time.sleep(0.005)
    other = _take_pid(first.pid)
    if other is None:
        pytest.skip("cannot choose the next pid here (needs root and /proc/sys/kernel/ns_last_pid)")
    try:
        assert procs.alive(first.pid) and procs.start_ticks(first.pid) not in (None, started)
        assert procs.hold(first.pid, started) is None
        assert old.gone()
        with pytest.raises(ProcessLookupError):
            old.send(signal.SIGKILL)
        assert procs.end(first.pid, grace=0.1, timeout=1, start=started)
        time.sleep(0.2)
        assert other.poll() is None, "the process that took the pid was signalled"
        # the same call with the start time of the process the pid names now ends that one
        assert procs.end(other.pid, grace=0.1, timeout=10, start=procs.start_ticks(other.pid))
        assert other.wait(5) == -signal.SIGTERM
    finally:
        other.kill()
        other.wait()
