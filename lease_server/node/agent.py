"""The node agent: finds this node's GPUs and keeps the node alive in the lease server.

Two inventory sources:

* NVML (``pynvml`` from nvidia-ml-py): the real GPUs, with index, UUID, model and memory.
* a declared (simulated) inventory, ``--simulate 4xA100-80GB``, for machines without GPUs.

The agent declares the inventory once, then sends a heartbeat every ``heartbeat_interval``; if the
server answers that the node is unknown (Redis was wiped) it declares it again. A node whose
heartbeats stop is marked down and its free GPUs are not granted.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import math
import re
import threading
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

from .. import errors, procs, protocol
from ..leasing.inventory import Gpu, NodeInventory, default_node_name, register
from ..leasing.reclaim import agent_samples, policies, record_kills, simulated_sample
from ..procs import account_name
from ..store.engine import Engine
from ..store.layout import LAYOUT
from .cgroup import DeviceIsolation, Unavailable
from .claims import AsyncClaims, Claim, Peer, ThreadClaims
from .drain import Drainer, Draining, Pass, abandon, drained, draining_of, record_claim
from .enforce import Enforcer, nvidia_majors, uses_gpu_device
from .memwatch import MemWatch, Watched, judge_pass, resident_mb, watch_pass, watched_from_json
from .onhost import OnHost, Probes
from .suspend import Suspender, detect

log = logging.getLogger(__name__)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pool_name(model: str, memory_mb: int) -> str:
    """Default pool of a GPU: its model and memory, e.g. "A100-SXM4-80GB" -> "A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3" -> "H100-80GB-HBM3", "Tesla T4" -> "Tesla-T4-15GB"."""
    name = model.replace("NVIDIA ", "").strip().replace(" ", "-")
    gb = round(memory_mb / 1024)
    if gb and not re.search(r"\d+GB", name.upper()):  # the model may name its memory anywhere in it
        name = f"{name}-{gb}GB"
    return "".join(c for c in name if c.isalnum() or c in "._-")[:63] or "gpu"


class Isolation:
    """This agent's per-lease cgroups (lease_server/node/cgroup.py), or why it has none."""

    SWEEP_S = 5.0  # how often cgroups of leases whose processes are all gone are removed

    def __init__(self, mode: str, inventories: list[NodeInventory]) -> None:
        self.cgroups: DeviceIsolation | None = None
        self._swept = 0.0
        # a MIG node's instances: the cgroup allows their GPU's device node (node -> index -> NVML's)
        self.parent_of: dict[str, dict[int, int]] = {
            inv.node: inv.extra["mig_parent"] for inv in inventories if inv.extra.get("mig_parent")
        }
        if mode == "off":
            self.what = "off (gpu_isolation = off)"
        elif mode == "auto" and not any(inv.source == "nvml" for inv in inventories):
            self.what = ""  # simulated GPUs have no device nodes to guard: nothing to say
        else:
            got = DeviceIsolation.detect()
            if isinstance(got, Unavailable):
                self.what = f"off: {got.reason}"
            else:
                self.cgroups, self.what = got, got.kind
        if self.cgroups is None and mode != "off" and any(inv.source == "nvml" for inv in inventories):
            log.warning("GPU isolation %s", self.what)
        elif self.what:
            log.info("GPU isolation: %s", self.what)

    def place(self, claim: Claim, peer: Peer) -> None:
        """Put a process that claimed a lease in the lease's cgroup (only its GPUs; its children too)."""
        if self.cgroups is None or not claim.gpus:
            return
        gpus = list(claim.gpus)
        if claim.node in self.parent_of:  # MIG instances: their GPU's node (the caps are not filtered)
            gpus = sorted({self.parent_of[claim.node][g] for g in gpus if g in self.parent_of[claim.node]})
        try:
            self.cgroups.place(claim.lease, peer.pid, gpus)
        except (OSError, ValueError) as exc:
            log.warning("pid %s of lease %s not put in its cgroup: %s", peer.pid, claim.lease, exc)

    def of(self, inv: NodeInventory) -> str:
        """What this agent's isolation is for ``inv`` (a MIG node's says what it does not cover)."""
        if self.cgroups is not None and inv.node in self.parent_of:
            return f"{self.what}; MIG: to the instance's GPU, not from its other instances"
        return self.what

    def pids(self, lease: str) -> list[int]:
        if self.cgroups is None:
            return []
        try:
            return self.cgroups.pids(lease)
        except (OSError, ValueError):
            return []

    def sweep(self, now: float) -> None:
        """Remove the cgroups whose processes are all gone (a lease ended, verified or drained)."""
        if self.cgroups is None or now - self._swept < self.SWEEP_S:
            return
        self._swept = now
        try:
            for lease in self.cgroups.leases():
                if not self.cgroups.pids(lease):
                    self.cgroups.remove(lease)
        except (OSError, ValueError) as exc:
            log.warning("removing lease cgroups: %s", exc)


@dataclasses.dataclass(frozen=True)
class MigInstance:
    """A MIG instance an admin made on GPU ``parent`` (NVML's index): leased whole, as its own GPU."""

    parent: int
    handle: Any
    uuid: str  # "MIG-...": what CUDA_VISIBLE_DEVICES names it by
    name: str
    memory_mb: int
    profile: str  # "1g.10gb"


_MIG_PROFILE = re.compile(r"\bMIG\s+(\d+g\.\d+gb)\b", re.IGNORECASE)


def mig_instances(nvml: Any, parent: int, handle: Any) -> list[MigInstance] | None:
    """The MIG instances of GPU ``parent``, or None when it is not in MIG mode (or NVML cannot say:
    a GPU without MIG). Only reads: no MIG setting is ever changed here."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except (AttributeError, nvml.NVMLError):
        return None
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        return None
    out: list[MigInstance] = []
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except nvml.NVMLError:  # no instance in that place
            continue
        name = _text(nvml.nvmlDeviceGetName(mig))
        mb = int(nvml.nvmlDeviceGetMemoryInfo(mig).total // (1024 * 1024))
        m = _MIG_PROFILE.search(name)
        # the profile as nvidia-smi names it (from the device's name; older drivers: its memory)
        profile = m.group(1).lower() if m else f"{max(1, round(mb / 1024))}gb"
        out.append(MigInstance(parent, mig, _text(nvml.nvmlDeviceGetUUID(mig)), name, mb, profile))
    return out


def nvml_inventories(
    node: str | None = None, pool: str | None = None, nvml: ModuleType | Any = None
) -> list[NodeInventory]:
    """Read this node's GPUs through NVML: one inventory of the GPUs leased whole (pool ``pool``,
    default the model's), and for GPUs an admin put in MIG mode, one per MIG profile, a node
    ``<node>-mig-<profile>`` in pool ``<model>-MIG-<profile>`` whose GPUs are the instances (index
    in that node, their MIG UUID; ``extra["mig_parent"]``: index -> the GPU's NVML index). Raises
    ConfigurationError when NVML is not available or finds nothing to lease."""
    if nvml is None:
        import pynvml  # nvidia-ml-py

        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise errors.ConfigurationError(
            f"NVML is not available on this machine ({exc}); without GPUs use --simulate 4xA100-80GB"
        ) from exc
    gpus: list[Gpu] = []
    migs: dict[str, list[tuple[Gpu, MigInstance]]] = {}
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpu = Gpu(
                index=i,
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                model=_text(nvml.nvmlDeviceGetName(handle)),
                memory_mb=int(mem.total // (1024 * 1024)),
            )
            instances = mig_instances(nvml, i, handle)
            if instances is None:
                gpus.append(gpu)
            elif not instances:
                log.warning("GPU %d is in MIG mode with no instances: nothing to lease on it", i)
            for inst in instances or []:
                migs.setdefault(inst.profile, []).append((gpu, inst))
    finally:
        nvml.nvmlShutdown()
    name = node or default_node_name()
    invs: list[NodeInventory] = []
    if gpus:
        invs.append(NodeInventory(name, pool or pool_name(gpus[0].model, gpus[0].memory_mb), gpus, "nvml"))
    for profile, found in sorted(migs.items()):
        parent = found[0][0]
        suffix = f"-mig-{profile}"
        mig_gpus = [Gpu(k, inst.uuid, inst.name, inst.memory_mb) for k, (_, inst) in enumerate(found)]
        invs.append(
            NodeInventory(
                name[: 63 - len(suffix)] + suffix,
                (pool_name(parent.model, parent.memory_mb)[: 63 - len(suffix)] + f"-MIG-{profile}"),
                mig_gpus,
                "nvml",
                extra={"mig_parent": {k: inst.parent for k, (_, inst) in enumerate(found)}},
            )
        )
    if not invs:
        raise errors.ConfigurationError("NVML found no GPU on this machine; use --simulate to declare some")
    return invs


def nvml_inventory(node: str | None = None, pool: str | None = None, nvml: ModuleType | Any = None) -> NodeInventory:
    """This node's first NVML inventory (:func:`nvml_inventories`): its GPUs leased whole, if any."""
    return nvml_inventories(node, pool, nvml)[0]


class NvmlSampler:
    """Samples this node's GPUs through NVML: utilization, memory used, compute processes.

    NVML stays initialised and the device handles are looked up once, so one sample of 8 GPUs is
    a few dozen NVML calls (bench/reclaim_bench.py measures it)."""

    def __init__(self, nvml: ModuleType | Any = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        nvml.nvmlInit()
        # index -> handle: NVML's indexes here; an inventory's own in a view (view())
        self.handles: dict[int, Any] = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())}
        self.migs: dict[str, Any] = {}  # MIG UUID -> its handle
        for i, handle in self.handles.items():
            for inst in mig_instances(nvml, i, handle) or []:
                self.migs[inst.uuid] = inst.handle
        self.root = True

    def view(self, inv: NodeInventory) -> NvmlSampler:
        """This sampler as ``inv``'s GPUs by their index in it: NVML's index for GPUs leased whole,
        the MIG handle for a MIG node's instances (by UUID). A view is not closed (its root is)."""
        v = copy.copy(self)
        v.root = False
        v.handles = {}
        for g in inv.gpus:
            if g.uuid.startswith("MIG-"):
                if g.uuid in self.migs:
                    v.handles[g.index] = self.migs[g.uuid]
            elif g.index in self.handles:
                v.handles[g.index] = self.handles[g.index]
        return v

    def used_mb(self, handle: Any) -> int:
        """Memory the processes use, in MiB. NVML's v1 reading counts what the driver reserves for
        itself (480 MiB on an idle H100 80GB HBM3, where nvidia-smi says 0); v2 does not."""
        nvml = self.nvml
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
        except (AttributeError, TypeError, nvml.NVMLError):  # an older driver or nvidia-ml-py: v1
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(mem.used // (1024 * 1024))

    def sample(self) -> list[dict[str, Any]]:
        nvml, out = self.nvml, []
        for index, handle in self.handles.items():
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except nvml.NVMLError:  # a MIG instance: NVML has no utilisation of one, so no evidence
                continue
            mem = self.used_mb(handle)
            try:
                procs = [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            except nvml.NVMLError:  # not supported on some boards: no process evidence then
                procs = []
            out.append({"index": index, "util": int(util), "mem_mb": int(mem), "procs": procs})
        return out

    def procs_on(self, index: int) -> list[int]:
        """The pids NVML lists on GPU ``index`` now (compute and graphics); [] where it cannot say."""
        nvml = self.nvml
        pids: list[int] = []
        for get in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                pids += [int(p.pid) for p in get(self.handles[index]) if int(p.pid) not in pids]
            except (KeyError, nvml.NVMLError):
                continue
        return pids

    def proc_mem(self, index: int) -> dict[int, int | None] | None:
        """MB of GPU ``index``'s memory each compute process uses now (CUDA context included), None
        for a process whose figure NVML does not give; None where NVML cannot say at all (not
        supported, or not allowed to read it here)."""
        nvml = self.nvml
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(self.handles[index])
        except (KeyError, nvml.NVMLError):
            return None
        out: dict[int, int | None] = {}
        for p in running:
            pid, used = int(p.pid), getattr(p, "usedGpuMemory", None)
            if used is None or out.get(pid, 0) is None:  # NVML_VALUE_NOT_AVAILABLE: no reading
                out[pid] = None
            else:
                out[pid] = (out.get(pid) or 0) + int(used) // (1024 * 1024)
        return out

    def free_bytes(self, index: int) -> int | None:
        """GPU ``index``'s free memory now (bytes); None where NVML cannot say."""
        try:
            return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handles[index]).free)
        except (KeyError, self.nvml.NVMLError):
            return None

    def has_process(self, index: int, pid: int) -> bool:
        """Whether ``pid`` runs on GPU ``index`` now, and is the process of that number that this
        agent sees (it has an NVIDIA device open): checked again just before it is killed."""
        nvml = self.nvml
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(self.handles[index])
        except (KeyError, nvml.NVMLError):
            return False
        return any(p.pid == pid for p in running) and uses_gpu_device(pid)

    def close(self) -> None:
        if self.root:
            self.nvml.nvmlShutdown()


def name_owners(gpus: list[dict[str, Any]], real: bool) -> list[dict[str, Any]]:
    """Each GPU sample with the owner (uid) of each of its processes (``uids``, -1 where unknown),
    so that the server can tell another user's process on a leased GPU from the lease's own
    (reclaim.foreign_pids). For real GPUs a uid is named only for a process seen here with an
    NVIDIA device open: NVML names host pids, and an agent in another pid namespace would read
    another process under the same number. A simulated GPU's processes are this host's."""
    majors = nvidia_majors() if real else None
    for g in gpus:
        uids = []
        for pid in g.get("procs", []):
            uid = procs.uid(int(pid))
            if uid is None or (majors is not None and not uses_gpu_device(int(pid), majors)):
                uid = -1
            uids.append(uid)
        g["uids"] = uids
    return gpus


async def heartbeat_local(
    engine: Engine,
    inventories: list[NodeInventory],
    stop: asyncio.Event,
    whose: Callable[[str, str], Awaitable[str]] | None = None,
) -> None:
    """The in-process agent of ``gpulease up``: heartbeats and GPU samples straight into the engine;
    with ``unleased_action = "kill"`` it terminates unleased processes (lease_server/node/enforce.py).
    ``whose(api_token, acting_for)``: the user a claim's API token names (the server's authenticator),
    who must hold the lease a process claims (claims.py)."""
    interval = engine.settings.heartbeat_interval
    sample_every = engine.settings.sample_interval
    nvml = NvmlSampler() if any(inv.source == "nvml" for inv in inventories) else None
    views = _views(nvml, inventories)
    enforcer = Enforcer()
    drainer = Drainer(enforcer, engine.settings.drain_kill_grace_s)
    drain_every = engine.settings.drain_interval
    pool_of = {inv.node: inv.pool for inv in inventories}
    isolation = Isolation(engine.settings.gpu_isolation, inventories)
    if isolation.what:
        inventories = [dataclasses.replace(inv, isolation=isolation.of(inv)) for inv in inventories]
    suspenders = _suspenders(engine.settings.suspend, inventories, whose is not None)
    inventories = [dataclasses.replace(inv, suspend=suspenders[inv.node].kind) if inv.node in suspenders else inv
                   for inv in inventories]  # fmt: skip
    probes = {inv.node: _probes(inv, views.get(inv.node)) for inv in inventories}
    onhost = OnHost(
        engine, suspenders, enforcer, int(engine.settings.suspend_host_budget_gb * 10**9),
        engine.settings.drain_kill_grace_s, probes, inventories,
    )  # fmt: skip
    for inv in inventories:
        await register(engine, inv, quiet=True)
        log.info("node %s registered: %d GPU(s) in pool %s (%s)", inv.node, len(inv.gpus), inv.pool, inv.source)

    async def record(claim: Claim, peer: Peer) -> dict[str, Any] | None:
        if whose is None:
            raise errors.Forbidden("this agent cannot check API tokens: it ties no process to a lease")
        user = await whose(claim.token, claim.user)
        if claim.restore:  # checked before the claim is recorded: a refused restore claims nothing
            if claim.node not in suspenders:
                raise errors.Conflict(f"the node agent of {claim.node} suspends no worker")
            await onhost.check(claim, peer, user)
        await record_claim(engine, claim, user, peer, account_name(peer.uid))
        isolation.place(claim, peer)
        return await onhost.restore(claim, peer, user) if claim.restore else None

    claims = AsyncClaims(await engine.instance(), [inv.node for inv in inventories], record)
    await claims.start()
    # Slices held to their memory (memwatch.py), in the pools that share: one judge per node and kind.
    s = engine.settings
    sharing = [inv for inv in inventories if s.sched_table(inv.pool)["share"]]
    slice_watch = {inv.node: MemWatch(s.slice_over_pct, s.slice_over_s) for inv in sharing}
    check_every = s.slice_check_interval
    loop = asyncio.get_running_loop()
    next_beat = next_sample = next_drain = next_check = loop.time()
    try:
        while not stop.is_set():
            now = loop.time()
            if now >= next_drain:
                next_drain = now + drain_every
                for inv in inventories:
                    try:
                        entries = await draining_of(engine, inv.node, [g.index for g in inv.gpus])
                        if inv.node in suspenders:
                            entries = await onhost.drain(inv.node, entries)  # (suspended: off the list)
                            await onhost.upkeep(inv.node)
                        done = _drain_step(drainer, inv, entries, views.get(inv.node), isolation)
                        for lease, clean, ended in done.clean:
                            await drained(engine, inv.node, lease, clean, ended)
                        for lease, index, pid, why in done.abandoned:
                            await abandon(engine, inv.node, lease, [index], pid, why)
                    except Exception as exc:  # Redis away: the next pass retries; the GPUs stay draining
                        log.warning("draining %s failed: %s", inv.node, exc)
                isolation.sweep(now)
            if sharing and now >= next_check:
                next_check = now + check_every
                for inv in sharing:
                    try:
                        await watch_pass(
                            engine, inv.node, [g.index for g in inv.gpus], slice_watch[inv.node],
                            _measure(inv, views.get(inv.node)), isolation.pids if isolation.cgroups else None,
                            whole=True,
                        )  # fmt: skip
                    except Exception as exc:  # Redis away: the next pass measures again
                        log.warning("measuring the slices of %s failed: %s", inv.node, exc)
            if now >= next_beat:
                next_beat = now + interval
                await claims.start()  # (a node whose claim socket another process holds: bound once free)
                for inv in inventories:
                    if not claims.missing.serving(inv.node):
                        continue  # no heartbeat: no lease there while its workers could not claim
                    try:
                        await register(engine, None, inv.node)
                    except errors.UnknownNode:
                        await register(engine, inv)
                    except Exception as exc:  # Redis away: the next beat retries
                        log.warning("heartbeat of %s failed: %s", inv.node, exc)
            if now >= next_sample:
                next_sample = now + sample_every
                try:
                    pols = await policies(engine)  # once per pass: each pool's idle threshold
                except Exception as exc:
                    log.warning("reading the reclaim policies failed: %s", exc)
                    pols = {}
                for inv in inventories:
                    try:
                        verify = None
                        if (view := views.get(inv.node)) is not None:
                            gpus, verify = name_owners(view.sample(), True), view.has_process
                        else:
                            gpus = await simulated_sample(engine, inv.node, [g.index for g in inv.gpus])
                            gpus = name_owners(gpus, False)
                        answer = await agent_samples(engine, inv.node, inv.pool, gpus, pols=pols)
                        killed = enforcer.act(inv.node, gpus, answer, verify)
                        if killed:
                            await record_kills(engine, inv.node, inv.pool, killed)
                    except Exception as exc:
                        log.warning("sampling %s failed: %s", inv.node, exc)
            for node, report in enforcer.tick():
                if report.get("drain"):
                    continue  # a drain's SIGKILL: its `drained` event counts it
                try:
                    await record_kills(engine, node, pool_of[node], [report])
                except Exception as exc:
                    log.warning("recording a kill on %s failed: %s", node, exc)
            kill_due = enforcer.next_due()
            due = min(next_beat, next_sample, next_drain, math.inf if kill_due is None else kill_due)
            if sharing:
                due = min(due, next_check)
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.01, due - loop.time()))
            except TimeoutError:
                pass
    finally:
        await claims.close()
        enforcer.close()
        if nvml is not None:
            nvml.close()


def _suspenders(mode: str, inventories: list[NodeInventory], claims: bool) -> dict[str, Suspender]:
    """Each node's suspender (suspend.py), where it has one: a worker must be able to claim its
    lease here (``claims``) for the agent to know which process to suspend."""
    out: dict[str, Suspender] = {}
    for inv in inventories:
        got = detect(mode, inv.source == "nvml") if claims else "no claims: the agent cannot tell its workers"
        if isinstance(got, str):
            log.info("node %s: evicted warm workers are ended, not suspended: %s", inv.node, got)
        else:
            out[inv.node] = got
    return out


def _views(nvml: NvmlSampler | None, inventories: list[NodeInventory]) -> dict[str, NvmlSampler]:
    """The sampler as each NVML inventory's GPUs (NvmlSampler.view): node -> view."""
    if nvml is None:
        return {}
    return {inv.node: nvml.view(inv) for inv in inventories if inv.source == "nvml"}


def _probes(inv: NodeInventory, nvml: NvmlSampler | None) -> Probes:
    """How the suspended workers' memory and GPUs are read on this node (onhost.py): through NVML,
    or, on simulated GPUs, a process's resident memory stands in for its GPU memory."""
    if inv.source == "nvml" and nvml is not None:
        sampler = nvml

        def mem_bytes(index: int, pid: int) -> int:
            return ((sampler.proc_mem(index) or {}).get(pid) or 0) * 1024 * 1024

        return Probes(mem_bytes, sampler.procs_on, sampler.free_bytes)
    return Probes(lambda _index, pid: resident_mb(pid) * 1024 * 1024)


def _measure(inv: NodeInventory, nvml: NvmlSampler | None) -> Callable[[Watched, list[int]], int | None]:
    """How a lease's processes' memory is measured on this node (memwatch.py): their memory on the
    lease's GPUs as NVML reads it per process (CUDA context included), or, on simulated GPUs, which
    have no memory, their resident memory: the simulation's stand-in."""
    if inv.source == "nvml" and nvml is not None:
        sampler = nvml

        def on_gpu(w: Watched, pids: list[int]) -> int | None:
            most = 0  # on its most used GPU: a slice (--gpu-mem) is a size per GPU
            for index in w.indexes:
                mem = sampler.proc_mem(index)
                if mem is None or any(pid in mem and mem[pid] is None for pid in pids):
                    return None  # its own processes' figures are not given: it cannot be judged
                most = max(most, sum(mem.get(pid) or 0 for pid in pids))
            return most

        return on_gpu
    # (resident memory is no GPU's: shared evenly by its GPUs)
    return lambda w, pids: sum(resident_mb(pid) for pid in pids) // max(1, len(w.indexes))


def _drain_step(
    drainer: Drainer, inv: NodeInventory, entries: list[Draining], nvml: NvmlSampler | None, isolation: Isolation
) -> Pass:
    """One pass over a node's draining GPUs: on an NVML node the processes NVML lists on them, on a
    simulated one the processes that claimed the lease (and their children, in its cgroup), must be gone."""
    if not entries:
        return Pass([], [])
    if inv.source == "nvml" and nvml is not None:
        return drainer.step(inv.node, entries, nvml.procs_on, nvml.has_process)
    return drainer.step(inv.node, entries, in_cgroup=isolation.pids if isolation.cgroups else None)


DRAIN_WAIT_S = 40  # an idle agent asks about its node's drains once in this long (1.5 requests a minute)


class DrainWatch:
    """A node's draining GPUs, as the server answers its agent's long-poll
    (``GET /nodes/{node}/draining?wait=``), asked by a thread of its own so that the agent's loop
    (heartbeats, samples, kills) never blocks on it. While nothing drains, the server holds the
    request until a change on the node (a drain reaches the agent at once) or the end of the wait;
    while GPUs drain, the thread asks again every ``interval`` once the loop took the last answer.
    Each answer sets ``wake``; the loop takes it with :meth:`take`."""

    def __init__(self, client: Any, node: str, interval: float, stop: threading.Event, wake: threading.Event) -> None:
        self.client, self.node, self.interval, self.stop, self.wake = client, node, interval, stop, wake
        self._lock = threading.Lock()
        self._answer: list[dict[str, Any]] | None = None
        self._taken = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"gpulease-drain-watch-{node}", daemon=True)

    def start(self) -> DrainWatch:
        self.thread.start()
        return self

    def take(self) -> list[dict[str, Any]] | None:
        """The server's newest answer not yet taken (its draining GPUs), or None."""
        with self._lock:
            got, self._answer = self._answer, None
        if got is not None:
            self._taken.set()
        return got

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                got = self.client.request(
                    "GET",
                    protocol.node_draining(self.node),
                    params={"wait": DRAIN_WAIT_S},
                    timeout=DRAIN_WAIT_S + 30,
                )["draining"]
            except errors.GpuLeaseError as exc:  # the server away: ask again after a pause
                log.warning("draining %s failed: %s", self.node, exc)
                self.stop.wait(max(self.interval, 1.0))
                continue
            self._taken.clear()
            with self._lock:
                self._answer = got
            self.wake.set()
            while not self._taken.wait(0.5):
                if self.stop.is_set():
                    return
            if got:  # GPUs drain: look again soon, as the loop acts on them (kills, then clean)
                self.stop.wait(self.interval)


def run_remote(
    client: Any,
    inventories: list[NodeInventory],
    interval: float,
    stop: threading.Event,
    sample_interval: float = 5.0,
    drain_interval: float = 0.5,
    drain_grace_s: float = 2.0,
    gpu_isolation: str = "auto",
) -> None:
    """``gpulease agent``: declare the inventory over HTTP, then heartbeat and send GPU samples
    until ``stop``."""
    import json
    import time

    def declare(inv: NodeInventory) -> None:
        client.request("PUT", protocol.node(inv.node), json=json.loads(inv.to_json()))

    info = client.request("GET", protocol.INFO)
    theirs = info.get("layout", 0)
    if theirs != LAYOUT:
        raise errors.ConfigurationError(
            f"the lease server at {client.url} runs data layout {theirs}, this agent layout {LAYOUT}: "
            "install the same gpulease release on both (pip install -U gpulease), then start the agent again"
        )
    nvml = NvmlSampler() if any(inv.source == "nvml" for inv in inventories) else None
    views = _views(nvml, inventories)
    isolation = Isolation(gpu_isolation, inventories)
    if isolation.what:
        inventories = [dataclasses.replace(inv, isolation=isolation.of(inv)) for inv in inventories]
    enforcer = Enforcer()
    drainer = Drainer(enforcer, drain_grace_s)
    unsent: dict[str, list[dict[str, Any]]] = {}  # node -> kill reports the next sample carries
    for inv in inventories:
        declare(inv)
        log.info("node %s declared: %d GPU(s) in pool %s", inv.node, len(inv.gpus), inv.pool)

    async def record(claim: Claim, peer: Peer) -> None:
        body = {
            "lease": claim.lease,
            "fence": claim.fence,
            "token": claim.token,
            "pid": peer.pid,
            "start": peer.start,
            "uid": peer.uid,
            "gpus": list(claim.gpus),
        }
        account = account_name(peer.uid)
        if account:
            body["account"] = account
        if claim.user:
            body["user"] = claim.user
        await asyncio.to_thread(client.request, "POST", protocol.node_procs(claim.node), json=body)
        isolation.place(claim, peer)
        measuring.add(claim.node)  # its leases' memory is measured from now on (memory_pass)
        wake.set()

    # Nodes with claimed processes to measure: a claim adds its node, and a pass that finds nothing
    # to measure there takes it off, so an idle agent asks nothing about memory.
    measuring: set[str] = set()
    mem_watch: dict[str, MemWatch] = {}
    by_node = {inv.node: inv for inv in inventories}
    mem_every = [0.5]

    def memory_pass(node: str) -> None:
        """GET what to measure on ``node``, measure it, judge it, POST the result (memwatch.py)."""
        ans = client.request("GET", protocol.node_memory(node))
        mem_every[0] = float(ans.get("check_interval_s") or 0.5)
        watched = [watched_from_json(d) for d in ans.get("watched") or []]
        if not watched:
            measuring.discard(node)
            mem_watch.pop(node, None)
            return
        watch = mem_watch.setdefault(node, MemWatch(float(ans["over_pct"]), float(ans["over_s"])))
        inv = by_node[node]
        measured, verdicts = judge_pass(
            watched, watch, _measure(inv, views.get(node)), isolation.pids if isolation.cgroups else None
        )
        over = [
            {
                "lease": w.lease,
                "what": what,
                "used_mb": used,
                "peak_mb": watch.peak.get(w.lease, used),
                "over_s": round(watch.over_for.get(w.lease, 0.0), 2),
            }
            for w, what, used in verdicts
        ]
        if measured or over:
            report = {"measured": measured, "over": over, "per_gpu": True}  # (memwatch.agent_report)
            client.request("POST", protocol.node_memory(node), json=report)

    claims = ThreadClaims(str(info.get("instance", "")), [inv.node for inv in inventories], record)
    wake = threading.Event()  # set by a drain watch's answer or a claim: the loop acts on it at once
    claims.start()
    watches = {inv.node: DrainWatch(client, inv.node, drain_interval, stop, wake).start() for inv in inventories}
    next_beat = next_sample = next_drain = next_memory = time.monotonic()
    try:
        while not stop.is_set():
            now = time.monotonic()
            if measuring and now >= next_memory:
                for node in sorted(measuring):
                    try:
                        memory_pass(node)
                    except errors.GpuLeaseError as exc:
                        log.warning("measuring the leases of %s failed: %s", node, exc)
                next_memory = time.monotonic() + mem_every[0]
            for inv in inventories:
                got = watches[inv.node].take()
                if got is not None:
                    try:
                        entries = [Draining.from_json(d) for d in got]
                        done = _drain_step(drainer, inv, entries, views.get(inv.node), isolation)
                        for lease, clean, ended in done.clean:
                            report = {"lease": lease, "gpus": clean, "killed": ended}
                            client.request("POST", protocol.node_drained(inv.node), json=report)
                        for lease, index, pid, why in done.abandoned:
                            report = {"lease": lease, "gpus": [index], "abandoned": {"pid": pid, "why": why}}
                            client.request("POST", protocol.node_drained(inv.node), json=report)
                    except errors.GpuLeaseError as exc:
                        log.warning("draining %s failed: %s", inv.node, exc)
            if now >= next_drain:
                next_drain = now + drain_interval
                isolation.sweep(now)
            if now >= next_beat:
                next_beat = now + interval
                claims.start()  # (a node whose claim socket another process holds: bound once free)
                for inv in inventories:
                    if not claims.missing.serving(inv.node):
                        continue  # no heartbeat: no lease there while its workers could not claim
                    try:
                        client.request("POST", protocol.node_heartbeat(inv.node))
                    except errors.UnknownNode:
                        declare(inv)
                    except errors.GpuLeaseError as exc:
                        log.warning("heartbeat of %s failed: %s", inv.node, exc)
            if now >= next_sample:
                next_sample = now + sample_interval
                for inv in inventories:
                    try:
                        verify = None
                        if (view := views.get(inv.node)) is not None:
                            gpus, verify = name_owners(view.sample(), True), view.has_process
                        else:
                            gpus = name_owners(client.request("GET", protocol.simulate(inv.node))["gpus"], False)
                        body: dict[str, Any] = {"gpus": gpus}
                        killed = unsent.get(inv.node, [])[:1000]
                        if killed:
                            body["killed"] = killed
                        answer = client.request("POST", protocol.node_samples(inv.node), json=body)
                        del unsent.setdefault(inv.node, [])[: len(killed)]
                        unsent[inv.node] += enforcer.act(inv.node, gpus, answer, verify)
                    except errors.GpuLeaseError as exc:
                        log.warning("sampling %s failed: %s", inv.node, exc)
            for node, report in enforcer.tick():
                if not report.get("drain"):
                    unsent.setdefault(node, []).append(report)
            kill_due = enforcer.next_due()
            due = min(next_beat, next_sample, next_drain, math.inf if kill_due is None else kill_due)
            if measuring:
                due = min(due, next_memory)
            # (stop is looked at every quarter second: a drain watch's answer wakes the loop at once)
            wake.wait(max(0.01, min(0.25, due - time.monotonic())))
            wake.clear()
    finally:
        claims.close()
        enforcer.close()
        if nvml is not None:
            nvml.close()
