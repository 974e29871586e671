"""One process of this host as Linux's ``/proc`` tells it: its stat fields, start time and owner,
whether it still runs, its ancestors and descendants, and ending it with a grace.

A pid is only a number: once a process is reaped, the kernel may give its pid to any new process.
So a process is known by its pid *and* its start time (clock ticks since boot, stat field 22), and
signals go through a pidfd (Linux >= 5.3) where there is one, which names that very process: a pid
reused meanwhile is never signalled. A process that has exited (a zombie, ``Z``, or one being
reaped, ``X``) does not run: it has no start time here and is not alive.

This is the only reader of ``/proc/PID/stat``: the node agent (claims, drains, the memory watch,
unleased kills) and the kernel side (a worker's start time, the verified release) use it. It
imports the standard library only: a worker loads it from a bare Python (``node/claims.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import time
from typing import Literal

Pid = int | Literal["self"]

# Indexes into :func:`stat_fields` (proc(5) numbers the fields from 1, the command name is field 2).
STATE, PPID, FLAGS, START = 0, 1, 6, 19
ENDED = ("Z", "X")  # states of a process that has exited: a zombie, or one being reaped
PF_KTHREAD = 0x00200000  # a FLAGS bit: a kernel thread
POLL_S = 0.005  # how often a process held without a pidfd is looked at while waiting
MAX_DESCENDANTS = 4096  # a fork bomb's tree is not walked whole


def stat_fields(pid: Pid) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: ``[state, ppid, pgrp, ...]`` (proc(5)'s field N
    at index N - 3); None if the process is gone. The command name may hold spaces and parentheses
    (``ray::IDLE (x) (y)``): the fields start after its last ")"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: Pid) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot); None when it is gone or has exited."""
    rest = stat_fields(pid)
    if rest is None or rest[STATE] in ENDED:
        return None
    try:
        return int(rest[START])
    except (IndexError, ValueError):
        return None


def alive(pid: Pid) -> bool:
    """Whether process ``pid`` still runs (a zombie has exited)."""
    rest = stat_fields(pid)
    return rest is not None and rest[STATE] not in ENDED


def parent(pid: Pid) -> int | None:
    """The pid of process ``pid``'s parent (0 for init and kernel threads' root); None if gone."""
    rest = stat_fields(pid)
    return None if rest is None else int(rest[PPID])


def kernel_thread(rest: list[str]) -> bool:
    """Whether the process whose :func:`stat_fields` are ``rest`` is a kernel thread."""
    return bool(int(rest[FLAGS]) & PF_KTHREAD)


def uid(pid: Pid) -> int | None:
    """The uid owning process ``pid``; None if it is gone (or not visible from here)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def account_name(uid: int) -> str | None:
    """The unix account of ``uid`` on this host (None: it has no name here)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def ancestors(pid: int) -> set[int]:
    """``pid`` and every process above it, init left out."""
    out: set[int] = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        up = parent(pid)
        if up is None:
            break
        pid = up
    return out


def descendants(pids: list[int]) -> list[int]:
    """Every process below ``pids`` in the process tree (``/proc/PID/task/TID/children``); those
    that exit meanwhile are skipped."""
    found: list[int] = []
    todo, seen = list(pids), set(pids)
    while todo and len(found) < MAX_DESCENDANTS:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in seen:
                    seen.add(kid)
                    found.append(kid)
                    todo.append(kid)
    return found


class Held:
    """One process, held to be watched and signalled: by a pidfd where there is one (it turns
    readable once that process has exited, and signals through it reach that process only);
    without one, by its pid and, where known, its start time. Close it (or use it in a ``with``)."""

    def __init__(self, pid: int, fd: int | None, start: int | None = None) -> None:
        self.pid, self.fd, self.start = pid, fd, start

    def gone(self) -> bool:
        """Whether the process has exited (held without a pidfd: or its pid names another process
        now, one that started at another time)."""
        return self.wait(0)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for the process to exit; whether it has."""
        if self.fd is not None:
            p = select.poll()
            p.register(self.fd, select.POLLIN)
            return bool(p.poll(math.ceil(max(0.0, timeout) * 1000)))
        deadline = time.monotonic() + timeout
        while True:
            now = start_ticks(self.pid)
            if now is None or (self.start is not None and now != self.start):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def send(self, sig: signal.Signals) -> None:
        """Signal the process. ProcessLookupError once it is gone; PermissionError (an OSError)
        where it is not this process's to signal."""
        if self.fd is not None:
            signal.pidfd_send_signal(self.fd, sig)
            return
        if self.gone():
            raise ProcessLookupError(f"process {self.pid} is gone")
        os.kill(self.pid, sig)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def hold(pid: int, start: int | None = None) -> Held | None:
    """Process ``pid``, held (:class:`Held`); None when it has exited, or, given its ``start``
    time, when the pid names a process that started at another time. The pidfd is opened first and
    the start time read after, so a pid reused between a caller's own checks and this hold is never
    the one held."""
    fd: int | None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):  # no pidfd on this kernel (or a thread's id): by pid and start
        fd = None
    held = Held(pid, fd, start)
    if held.gone() or (start is not None and start_ticks(pid) != start):
        held.close()
        return None
    return held


def end(
    pid: int,
    grace: float,
    timeout: float,
    start: int | None = None,
    first: signal.Signals | None = signal.SIGTERM,
) -> bool:
    """End process ``pid`` (started at ``start``, where known): signal ``first`` (None: it was
    asked to exit otherwise), SIGKILL if it still runs ``grace`` seconds later, and wait for it
    until ``timeout`` seconds in all. True once it is gone (at once if it was, or if the pid names
    another process now: that one is never signalled). PermissionError where it is not ours."""
    held = hold(pid, start)
    if held is None:
        return True
    with held:
        if first is not None:
            with contextlib.suppress(ProcessLookupError):
                held.send(first)
        if held.wait(grace):
            return True
        with contextlib.suppress(ProcessLookupError):
            held.send(signal.SIGKILL)
        return held.wait(max(0.0, timeout - grace))
