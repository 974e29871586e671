"""Draining: a GPU whose lease the server ended is free only once no process of that lease is on it.

When the holder ends its own call, it verifies its worker gone before it releases (magics). When
the **server** ends a lease (expiry, an admin's revoke, an idle reclaim, a preemption or recall
whose notice ran out, an elastic shrink past its deadline), the old process may still run: the
scripts then put the lease's GPUs in ``draining`` (``lua/_lib_drain.lua``, ``start_drain``) instead of
the free list. The node agent of each node:

1. reads its draining GPUs (:func:`draining_of`), each naming the lease and the processes that
   claimed it there (``claims.py``: the kernel named them to the agent; never a pid a user sent);
2. finds what of that lease remains on the GPU: on an NVML node, every process NVML lists on
   it (nobody else holds a draining GPU); on a simulated node, the claimed processes that still
   run (the same process: its start time and uid are checked);
3. ends what remains, SIGTERM then SIGKILL after ``drain_kill_grace_s``, through a pidfd opened
   before the process is checked again (:class:`lease_server.node.enforce.Enforcer`), never a
   process :func:`claims.refusal` protects (a kernel thread, the agent's own tree, a service it
   started; another user's process when the agent is not root);
4. reports the GPUs clean (:func:`drained`, ``lua/drained.lua``): they turn free and the pool's
   queue is served in the same script; one ``drained`` event says how long it took;
5. gives up a process it cannot end (the OS refuses, it outlives its SIGKILL, or it is protected):
   one ``drain_abandoned`` event names it and the GPUs stay out of service, flagged for an admin
   (``gpulease drain list`` / ``clear``), instead of draining quietly forever.

An agent that is down reports nothing: its GPUs stay draining, never free. A simulated node's
lease that no process claimed has nothing to drain: its GPUs are free at once, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import errors, procs
from ..store.engine import Engine
from ..store.scripts import DrainAbandon, Drained, LeaseRecord, Procs
from .claims import Claim, Peer, refusal
from .enforce import Enforcer, uses_gpu_device

log = logging.getLogger(__name__)

# A process signalled SIGKILL that still runs this long after its SIGTERM is given up (an
# uninterruptible sleep in a driver call, a zombie NVML still lists): the GPU is flagged instead.
ABANDON_AFTER_S = 30.0

__all__ = ["Drainer", "Draining", "abandon", "drained", "draining_of", "record_claim"]


@dataclass(frozen=True)
class Proc:
    """A process that claimed a lease on a node (claims.py): what the agent may end."""

    pid: int
    start: int  # clock ticks since boot; 0 only in entries written before claims (never signalled)
    uid: int  # -1: unknown (an entry written before claims)


@dataclass(frozen=True)
class Draining:
    """One draining GPU of a node, as its agent reads it."""

    index: int
    lease: str
    user: str
    state: str  # how the lease ended: expired, revoked, shrunk
    since_ms: int
    pids: tuple[Proc, ...]
    abandoned: dict[str, Any] | None = None  # {pid, why, at}: given up, flagged for an admin
    # A slice's drain (its GPU is shared, lua/_lib_slice.lua): its MB stay promised until it is clean.
    # Only the processes it named are ended; NVML's list of the GPU is its neighbours' too.
    gpu_mem_mb: int = 0

    def to_json(self) -> dict[str, Any]:
        out = {
            "index": self.index,
            "lease": self.lease,
            "user": self.user,
            "state": self.state,
            "since": self.since_ms / 1000,
            "pids": [{"pid": p.pid, "start": p.start, "uid": p.uid} for p in self.pids],
        }
        if self.abandoned:
            out["abandoned"] = self.abandoned
        if self.gpu_mem_mb:
            out["gpu_mem_mb"] = self.gpu_mem_mb
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Draining:
        return cls(
            int(d["index"]),
            str(d["lease"]),
            str(d.get("user", "")),
            str(d.get("state", "")),
            int(float(d.get("since", 0)) * 1000),
            _procs(d.get("pids")),
            d.get("abandoned") or None,
            int(d.get("gpu_mem_mb") or 0),
        )


def _procs(raw: Any) -> tuple[Proc, ...]:
    if not isinstance(raw, list):  # cjson writes an empty list as {}
        return ()
    return tuple(Proc(int(p["pid"]), int(p.get("start") or 0), int(p.get("uid", -1))) for p in raw)


def _entry(index: int, raw: str) -> Draining:
    d = json.loads(raw)
    return Draining(
        index,
        str(d["lease"]),
        str(d.get("user", "")),
        str(d.get("state", "")),
        int(d.get("since", 0)),
        _procs(d.get("pids")),
        d.get("abandoned") or None,
    )


def _slice_entries(index: int, raw: str) -> list[Draining]:
    """The draining slices in the ledger of a GPU shared by slices (keys.py ``sliced``)."""
    out = []
    for lease, d in (json.loads(raw).get("draining") or {}).items():
        since = int(d.get("since", 0))
        out.append(Draining(index, lease, str(d.get("user", "")), str(d.get("state", "")), since,
                            _procs(d.get("pids")), None, int(d["mb"])))  # fmt: skip
    return out


async def draining_of(engine: Engine, node: str, indexes: list[int]) -> list[Draining]:
    """The draining GPUs among ``indexes`` of ``node``, and the draining slices on them."""
    if not indexes:
        return []
    slots = [f"{node}/{i}" for i in indexes]
    raws = await engine.redis.hmget(engine.keys.draining, slots)
    out = [_entry(i, str(raw)) for i, raw in zip(indexes, raws, strict=True) if raw]
    for i, raw in zip(indexes, await engine.redis.hmget(engine.keys.sliced, slots), strict=True):
        if raw:
            out += _slice_entries(i, str(raw))
    return out


async def all_draining(engine: Engine) -> list[dict[str, Any]]:
    """Every draining GPU of the cluster (an admin's ``gpulease drain list``), and every draining
    slice, oldest first."""
    out = []
    for slot, raw in (await engine.redis.hgetall(engine.keys.draining)).items():
        node, _, index = str(slot).rpartition("/")
        out.append({"node": node, **_entry(int(index), str(raw)).to_json()})
    for slot, raw in (await engine.redis.hgetall(engine.keys.sliced)).items():
        node, _, index = str(slot).rpartition("/")
        out += [{"node": node, **e.to_json()} for e in _slice_entries(int(index), str(raw))]
    return sorted(out, key=lambda d: (d["since"], d["node"], d["index"]))


async def drained(
    engine: Engine, node: str, lease: str, indexes: list[int], killed: int = 0, suspended: str = ""
) -> int:
    """Report ``indexes`` of ``node`` clean of ``lease``'s processes; returns the GPUs freed.
    ``suspended``: a suspend's drain, the worker the agent suspended (JSON, ``onhost.py``)."""
    return await engine.run(Drained(node, lease, json.dumps(sorted(set(indexes))), killed, suspended))


async def abandon(engine: Engine, node: str, lease: str, indexes: list[int], pid: int, why: str) -> int:
    """Give up ``pid`` on draining ``indexes``: flagged for an admin; returns the GPUs flagged now."""
    return await engine.run(DrainAbandon(node, lease, json.dumps(sorted(set(indexes))), pid, why[:200]))


async def record_claim(engine: Engine, claim: Claim, user: str, peer: Peer, account: str | None = None) -> LeaseRecord:
    """Record that process ``peer`` (as the kernel named it to the agent) works for ``claim.lease``
    on ``claim.node``; ``user`` is whom the claim's API token names (procs.lua checks they hold it).
    Under ``multi_user``, ``account`` (the process's unix account, as its host names it) must be
    ``user``'s: a token read off someone else claims nothing for a process of another account, and
    the refusal is an event (``claim_refused``) as well as the claimer's answer."""
    s = engine.settings
    if s.multi_user and account != s.account_of(user):
        theirs = s.account_of(user)
        said = f"account {account}" if account else "an account the agent did not name"
        await engine.redis.xadd(
            engine.keys.events,
            {
                "type": "claim_refused",
                "data": json.dumps(
                    {"lease": claim.lease, "user": user, "node": claim.node, "pid": peer.pid, "account": account or ""}
                ),
            },
            maxlen=s.event_log_max,
            approximate=True,
        )
        log.warning(
            "claim of lease %s on %s by pid %s of %s refused: not %s's", claim.lease, claim.node, peer.pid, said, theirs
        )
        raise errors.Forbidden(
            f"pid {peer.pid} runs as {said}, not as {theirs}, whose lease {claim.lease} is: a lease's processes "
            f"run as its owner's account (multi_user); start the kernel as {theirs}"
        )
    entry = {"node": claim.node, "pid": peer.pid, "start": peer.start, "uid": peer.uid}
    if claim.gpus:
        entry["gpus"] = list(claim.gpus)
    return await engine.run(Procs(claim.lease, str(claim.fence), user, json.dumps([entry], separators=(",", ":"))))


# ---- the agent's side ----------------------------------------------------------------------------


def still_runs(p: Proc) -> bool:
    """Whether the claimed process (pid, start) runs: the same pid with another start time is
    another process, which is never touched. An entry without a start time is never acted on."""
    return p.start != 0 and procs.start_ticks(p.pid) == p.start


@dataclass
class Pass:
    """What one pass over a node's draining GPUs found."""

    clean: list[tuple[str, list[int], int]]  # (lease, GPU indexes now clean, processes it ended)
    abandoned: list[tuple[str, int, int, str]]  # (lease, GPU index, pid, why): give it up


class Drainer:
    """One agent's drain work: which processes of a draining GPU remain, ending them (through the
    agent's :class:`Enforcer`, so SIGKILL follows after the grace), which GPUs are clean, and which
    processes it must give up."""

    def __init__(self, enforcer: Enforcer, grace_s: float, abandon_after_s: float = ABANDON_AFTER_S) -> None:
        self.enforcer = enforcer
        self.grace_s = grace_s
        self.abandon_after_s = max(abandon_after_s, grace_s * 2)
        self.killed: dict[tuple[str, str], int] = {}  # (node, lease) -> processes signalled
        # Ended already, by (node, pid, start time) -> when: waited for, never signalled twice (a
        # process that ignored SIGTERM gets its SIGKILL from the Enforcer); one still there past
        # abandon_after_s is given up.
        self.signalled: dict[tuple[str, int, int], float] = {}
        self.given_up: dict[tuple[str, str, int, int], None] = {}  # (node, lease, index, pid)
        self.unseen: dict[tuple[str, int], float] = {}  # (node, pid) NVML lists and /proc does not -> since
        self.unnamed: dict[tuple[str, str, int], float] = {}  # a slice that named no process, waited on -> since
        # A draining slice's processes that claimed nothing (its worker's descendants, its cgroup's),
        # by (node, lease, index): still waited for once its worker is gone, when they are no one's
        # descendants any more (an orphan that ignores SIGTERM outlives the worker that adopted it).
        self.kin: dict[tuple[str, str, int], dict[int, Proc]] = {}

    def step(
        self,
        node: str,
        entries: list[Draining],
        nvml_procs: Callable[[int], list[int]] | None = None,
        verify: Callable[[int, int], bool] | None = None,
        in_cgroup: Callable[[str], list[int]] | None = None,
    ) -> Pass:
        """Act on ``node``'s draining GPUs. ``nvml_procs(index)``: the pids NVML lists on that GPU
        (an NVML node); without it the claimed processes are what must be gone. ``in_cgroup(lease)``:
        the processes in the lease's cgroup (their claimer's children), where the agent keeps one."""
        out = Pass([], [])
        clean: dict[str, list[int]] = {}
        now = self.enforcer.clock()
        for e in entries:
            if e.state == "unleased":
                continue  # held while a process no lease covers uses it: freed by a clean sample
            remaining: list[Proc] = []
            if e.gpu_mem_mb:
                # A slice: its GPU's other processes are its neighbours'. Only what it named (and its
                # cgroup holds) is ended, and on an NVML node only while NVML lists it on the GPU (a
                # process of it that never used the GPU holds none of its memory: clean, as a
                # whole GPU's drain is). Naming none, it is clean once NVML lists nothing on the
                # GPU, or, with neighbours there, after abandon_after_s: whose they are is not known.
                remaining = [p for p in e.pids if still_runs(p)]
                seen = {p.pid for p in remaining}
                kin = procs.descendants([p.pid for p in remaining])  # a cell's children, which claim nothing
                known = self.kin.setdefault((node, e.lease, e.index), {})
                for pid in [*kin, *(in_cgroup(e.lease) if in_cgroup is not None else [])]:
                    start, uid = procs.start_ticks(pid), procs.uid(pid)
                    if pid not in seen and start is not None and uid is not None and uid in {p.uid for p in e.pids}:
                        seen.add(pid)
                        remaining.append(Proc(pid, start, uid))
                        known[pid] = remaining[-1]
                remaining += [p for p in known.values() if p.pid not in seen and still_runs(p)]
                if nvml_procs is not None and remaining:
                    # (NVML's pids are the host's: one this agent cannot match, in another pid
                    # namespace, still counts while it has an NVIDIA device open)
                    on_gpu = set(nvml_procs(e.index))
                    remaining = [p for p in remaining if p.pid in on_gpu or uses_gpu_device(p.pid)]
                if not e.pids and nvml_procs is not None and nvml_procs(e.index):
                    first = self.unnamed.setdefault((node, e.lease, e.index), now)
                    if now - first <= self.abandon_after_s:
                        continue  # waited for, never signalled
                    log.warning(
                        "draining %s GPU %s: slice %s named no process; freed after %.0fs with others' on the GPU",
                        node,
                        e.index,
                        e.lease,
                        self.abandon_after_s,
                    )
            elif nvml_procs is not None:
                for pid in nvml_procs(e.index):
                    start, uid = procs.start_ticks(pid), procs.uid(pid)
                    # NVML lists it, /proc does not (yet): exiting, or in another pid namespace
                    remaining.append(Proc(pid, start or 0, -1 if uid is None else uid))
            else:
                remaining = [p for p in e.pids if still_runs(p)]
                seen = {p.pid for p in remaining}
                uids = {p.uid for p in e.pids}
                for pid in in_cgroup(e.lease) if in_cgroup is not None else []:
                    start, uid = procs.start_ticks(pid), procs.uid(pid)
                    if pid not in seen and start is not None and uid is not None and uid in uids:
                        remaining.append(Proc(pid, start, uid))
            if not remaining:
                self.kin.pop((node, e.lease, e.index), None)
                clean.setdefault(e.lease, []).append(e.index)
                continue
            for p in remaining:
                why = self._act(node, e, p, now, verify)
                if why is not None and (node, e.lease, e.index, p.pid) not in self.given_up and not e.abandoned:
                    self.given_up[(node, e.lease, e.index, p.pid)] = None
                    out.abandoned.append((e.lease, e.index, p.pid, why))
                    log.warning(
                        "draining %s GPU %s: giving up pid %s of lease %s: %s", node, e.index, p.pid, e.lease, why
                    )
        while len(self.signalled) > 10_000:
            del self.signalled[next(iter(self.signalled))]
        while len(self.given_up) > 10_000:
            del self.given_up[next(iter(self.given_up))]
        while len(self.unseen) > 10_000:
            del self.unseen[next(iter(self.unseen))]
        while len(self.unnamed) > 10_000:
            del self.unnamed[next(iter(self.unnamed))]
        while len(self.kin) > 10_000:
            del self.kin[next(iter(self.kin))]
        out.clean = [(lease, idx, self.killed.pop((node, lease), 0)) for lease, idx in clean.items()]
        return out

    def _act(
        self, node: str, e: Draining, p: Proc, now: float, verify: Callable[[int, int], bool] | None
    ) -> str | None:
        """End ``p`` if it may be ended and is not being ended already; the reason to give it up, if any."""
        if p.start == 0:  # waited for (an exiting process NVML still lists), given up if it stays
            first = self.unseen.setdefault((node, p.pid), now)
            if now - first > self.abandon_after_s:
                return "NVML lists it on the GPU but this agent cannot see it (another pid namespace?)"
            return None
        key = (node, p.pid, p.start)
        if key in self.signalled:
            if now - self.signalled[key] > self.abandon_after_s:
                return f"still runs {self.abandon_after_s:.0f}s after SIGKILL (stuck in the driver?)"
            return None
        if (node, p.pid) in self.enforcer.pending:
            return None
        why = refusal(p.pid)
        if why is not None:
            return f"not ended: {why}"
        if p.uid >= 0 and procs.uid(p.pid) != p.uid:
            return "not ended: its owner changed since it claimed the lease"
        if verify is not None and not verify(e.index, p.pid):
            return None  # gone from the GPU meanwhile: the next pass finds it clean
        report = self.enforcer.terminate(node, e.index, p.pid, self.grace_s, why="drain", start=p.start)
        if report is None:
            return None  # gone already
        if report.get("error"):
            return f"the OS refused SIGTERM: {report['error']}"
        self.signalled[key] = now
        self.killed[(node, e.lease)] = self.killed.get((node, e.lease), 0) + 1
        log.warning("draining %s GPU %s: SIGTERM to pid %s of lease %s (%s)", node, e.index, p.pid, e.lease, e.state)
        return None
