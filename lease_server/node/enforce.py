"""The node agent's side of ``unleased_action = "kill"``: terminating processes that run on a GPU
no live lease covers.

The lease server decides (``reclaim.agent_samples``): it answers each sample with the pool's
``unleased_action`` and, for "kill", the processes of that sample on GPUs that no live lease holds
(never one that also runs on a GPU a live lease holds). The agent then, for each such process:

1. checks that it reported that pid for that GPU itself, in the sample just sent (so a simulated
   node kills only the pids its own simulated GPUs report, and a server cannot name any other
   process of the machine), that the pid is not 0, 1 or the agent itself, and, with NVML, that
   the process still runs on that GPU and, seen from the agent, has an NVIDIA device open;
2. sends SIGTERM, through a pidfd where Linux has them (a pid reused meanwhile cannot be hit;
   ``lease_server/procs.py`` holds the process);
3. sends SIGKILL if it is still alive ``unleased_kill_grace_s`` later.

Each signal sent (or refused by the OS) becomes a report ``{index, pid, user, signal, grace_s |
error}`` that the server records as an ``unleased_killed`` event; ``user`` is the process's
owner, read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import procs
from .claims import refusal

log = logging.getLogger(__name__)


def process_user(pid: int) -> str:
    """The user name of the process's owner ("" if it is gone), its uid if it has no name."""
    uid = procs.uid(pid)
    if uid is None:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


NVIDIA_MAJOR = 195  # the character devices /dev/nvidia0.. and /dev/nvidiactl (nvidia-uvm's is dynamic)


def nvidia_majors() -> frozenset[int]:
    """The device numbers (majors) of this host's NVIDIA character devices: 195, and those of every
    /dev/nvidia* (nvidia-uvm and nvidia-caps get theirs at load)."""
    majors = {NVIDIA_MAJOR}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/dev"):
            if entry.name.startswith("nvidia"):
                with contextlib.suppress(OSError):
                    st = entry.stat()
                    if stat.S_ISCHR(st.st_mode):
                        majors.add(os.major(st.st_rdev))
    return frozenset(majors)


def uses_gpu_device(pid: int, majors: frozenset[int] | None = None) -> bool:
    """Whether process ``pid`` of this agent's pid namespace has an NVIDIA device open. NVML names
    processes by their pid in the host's namespace: an agent in a container that does not share it
    would find another process under the same number, and must not kill that one.

    The device is known by what the open file is (a character device of an NVIDIA major), not by
    its path: a process that bind-mounted /dev elsewhere and chrooted there (``unshare -Urm``) opens
    the GPU under a path of its choosing, and would otherwise be neither killed as unleased nor
    drained."""
    majors = nvidia_majors() if majors is None else majors
    try:
        fds = list(os.scandir(f"/proc/{pid}/fd"))
    except OSError:  # gone, or not ours to look into: not known to use a GPU
        return False
    for fd in fds:
        try:
            st = os.stat(fd.path)  # follows the fd to the open file itself
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) in majors:
            return True
    return False


@dataclass
class _Signalled:
    """A process sent SIGTERM: SIGKILL at ``due`` unless it is gone by then."""

    node: str
    index: int
    pid: int
    user: str
    held: procs.Held
    due: float
    why: str = "unleased"  # or "drain": the GPU's lease was ended by the server (lease_server/node/drain.py)


class Enforcer:
    """Acts on the server's answers to one agent's samples; holds the processes waiting for SIGKILL.

    ``act`` and ``tick`` return reports for the server (the next sample carries them, or the
    in-process agent records them at once)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.pending: dict[tuple[str, int], _Signalled] = {}
        # Simulated GPUs report what an admin wrote, which outlives the process: a pid already
        # signalled there is never signalled again (its number may belong to another process by then).
        self.done: dict[tuple[str, int], None] = {}

    def act(
        self,
        node: str,
        sample: list[dict[str, Any]],
        answer: dict[str, Any],
        still_on_gpu: Callable[[int, int], bool] | None = None,
    ) -> list[dict[str, Any]]:
        """SIGTERM what ``answer`` names, within what ``sample`` (this agent's own, of ``node``)
        reported. ``still_on_gpu(index, pid)``: a fresh look (NVML) just before the signal."""
        if answer.get("unleased_action") != "kill":
            return []
        grace = float(answer.get("unleased_kill_grace_s", 10.0))
        mine = {int(g["index"]): {int(p) for p in g.get("procs", [])} for g in sample}
        reports = []
        for order in answer.get("kill") or []:
            index = int(order["index"])
            for pid in order.get("pids", []):
                pid = int(pid)
                if pid not in mine.get(index, ()):
                    log.warning("refusing to kill pid %s: this agent did not report it on %s GPU %s", pid, node, index)
                    continue
                if pid <= 1 or pid == os.getpid() or (node, pid) in self.pending:
                    continue
                why = refusal(pid)
                if why is not None and why != "gone":
                    log.warning("not ending unleased pid %s on %s GPU %s: %s", pid, node, index, why)
                    continue
                if still_on_gpu is None:
                    if (node, pid) in self.done:
                        continue
                    self.done[(node, pid)] = None
                    while len(self.done) > 10_000:
                        del self.done[next(iter(self.done))]
                elif not still_on_gpu(index, pid):
                    continue
                report = self.terminate(node, index, pid, grace)
                if report is not None:
                    reports.append(report)
        return reports

    def terminate(
        self, node: str, index: int, pid: int, grace: float, why: str = "unleased", start: int | None = None
    ) -> dict[str, Any] | None:
        """SIGTERM ``pid`` (SIGKILL at the :meth:`tick` after ``grace``); the report, None if it is
        already gone. ``start``: the process's start time as the caller checked it; the pidfd is
        opened first and the start time read again after (:func:`procs.hold`), so a pid reused
        between the caller's checks and the signal is never hit."""
        user = process_user(pid)
        held = procs.hold(pid, start)
        if held is None:  # exited, or another process now
            return None
        proc = _Signalled(node, index, pid, user, held, self.clock() + grace, why)
        report: dict[str, Any] = {"index": index, "pid": pid, "user": user, "signal": "SIGTERM", "grace_s": grace}
        try:
            held.send(signal.SIGTERM)
        except ProcessLookupError:
            held.close()
            return None
        except OSError as exc:  # e.g. an agent that is not root, and another user's process
            held.close()
            log.warning("cannot SIGTERM unleased pid %s on %s GPU %s: %s", pid, node, index, exc)
            return {**report, "error": exc.strerror or str(exc)}
        if why == "unleased":
            log.warning("SIGTERM to pid %s (user %s) on %s GPU %s: no live lease covers it", pid, user, node, index)
        else:
            report["drain"] = True
        self.pending[(node, pid)] = proc
        return report

    def tick(self) -> list[tuple[str, dict[str, Any]]]:
        """SIGKILL the processes still alive past their grace; forget those that are gone.
        Returns (node, report) per SIGKILL sent."""
        now, out = self.clock(), []
        for key, proc in list(self.pending.items()):
            if proc.held.gone():
                proc.held.close()
                del self.pending[key]
                continue
            if now < proc.due:
                continue
            report: dict[str, Any] = {"index": proc.index, "pid": proc.pid, "user": proc.user, "signal": "SIGKILL"}
            if proc.why != "unleased":
                report["drain"] = True
            try:
                proc.held.send(signal.SIGKILL)
                log.warning(
                    "SIGKILL to pid %s on %s GPU %s: still alive after its grace", proc.pid, proc.node, proc.index
                )
                out.append((proc.node, report))
            except ProcessLookupError:
                pass
            except OSError as exc:
                out.append((proc.node, {**report, "error": exc.strerror or str(exc)}))
            proc.held.close()
            del self.pending[key]
        return out

    def next_due(self) -> float | None:
        """When :meth:`tick` next has something to do (clock time), None if nothing is pending.
        Gone processes are noticed at the next tick, which is at most this late."""
        return min((p.due for p in self.pending.values()), default=None)

    def close(self) -> None:
        for proc in self.pending.values():
            proc.held.close()
        self.pending.clear()
