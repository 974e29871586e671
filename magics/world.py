"""A call's world: the worker processes it runs on, and the one object that owns them.

A :class:`World` is made from a call's lease. It starts one rank on the lease's node (or, for a
multi-node gang, one rank per leased GPU placed together by a Ray placement group, or one CPU
worker), each rank seeing only its own node's leased GPUs. It holds the ranks, the placement group
and where each rank's process lives, and it is what ends them: killed, seen gone (and, where NVML
sees the GPUs, off them) before anyone releases the lease. The relay, the warm worker, the elastic
resize and the verified release all act on the world; the grant (:mod:`magics.grant`) holds only
the lease.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from lease_server.client import Lease, visible_devices
from lease_server.protocol import GpuJson

from . import slices
from .calls import Where
from .options import Options
from .outcomes import GpuTrainError, _first_line
from .session import GANG_BUNDLE_SHARE, READY_WAIT_S, Session, Worker
from .worker import verify_gone

log = logging.getLogger(__name__)
PRELOAD_WAIT_S = 120.0  # a spare still importing what earlier cells imported: the cell waits for it


@dataclass
class Rank:
    """One worker process of a world: its node, its local rank there, the GPUs it sees (NVML
    indexes and UUIDs) and the environment it runs the call with."""

    node: str
    local: int
    env: dict[str, str]
    worker: Worker
    indexes: list[int] = field(default_factory=list)
    uuids: list[str] = field(default_factory=list)


class World:
    """The worker processes of one call on ``lease`` (None: a CPU worker outside any pool).

    ``verified`` and ``nvml`` say, after :meth:`end`, whether every process was seen gone and off
    its GPUs. ``lease`` follows the grant's (an elastic resize sets it)."""

    def __init__(self, sess: Session, lease: Lease | None, cpu: bool = False) -> None:
        self.sess = sess
        self.lease = lease
        self.cpu = cpu
        self.ranks: list[Rank] = []
        self.pg: Any = None  # a gang's Ray placement group
        self.wheres: dict[int, Where] = {}  # id(worker) -> where its process lives, once known
        self.verified = False
        self.nvml = False

    # ---- what a rank sees -------------------------------------------------------------------------

    def env(self, node: str) -> dict[str, str]:
        """What a worker on ``node`` sees: exactly the GPUs leased there, in NVML's order."""
        if self.lease is None or self.cpu:
            base = {"CUDA_VISIBLE_DEVICES": ""}
            return base if self.lease is None else {**base, "GPULEASE_LEASE_ID": self.lease.id, "GPULEASE_NODE": node}
        mine = self._gpus(node)
        env = {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # CUDA's indexes = NVML's = the lease's
            "CUDA_VISIBLE_DEVICES": visible_devices(mine),
            "GPULEASE_GPU_INDEXES": ",".join(str(g["index"]) for g in mine),
            "GPULEASE_LEASE_ID": self.lease.id,
            "GPULEASE_GPU_UUIDS": ",".join(g.get("uuid", "") for g in mine),
            "GPULEASE_NODE": node,
        }
        if self.lease.gpu_mem_mb:  # a slice: the worker holds itself to it (magics.slices.hold_to)
            env[slices.MEM_ENV] = str(self.lease.gpu_mem_mb)
            env[slices.TOTAL_ENV] = str(int(self.lease.raw.get("gpu_total_mb") or 0))
        return env

    def rank(self, node: str, local: int, worker: Worker, gpus: list[GpuJson] | None = None) -> Rank:
        """A rank on ``node`` seeing ``gpus`` (default: every GPU the lease holds there)."""
        env = self.env(node)
        if gpus is None:
            gpus = [] if self.lease is None or self.cpu else self._gpus(node)
        else:
            env.update(
                CUDA_VISIBLE_DEVICES=visible_devices(gpus),
                GPULEASE_GPU_INDEXES=",".join(str(g["index"]) for g in gpus),
                GPULEASE_GPU_UUIDS=",".join(g.get("uuid", "") for g in gpus),
            )
        return Rank(
            node, local, env, worker, [int(g["index"]) for g in gpus], [g["uuid"] for g in gpus if g.get("uuid")]
        )

    def _gpus(self, node: str) -> list[GpuJson]:
        assert self.lease is not None
        return [g for g in self.lease.gpus if g.get("node", self.lease.node) == node]

    def nodes(self) -> str:
        return ",".join(dict.fromkeys(r.node for r in self.ranks))

    # ---- starting ---------------------------------------------------------------------------------

    def start(self, opts: Options, kept: Worker | None = None) -> None:
        """One worker for a one-node or CPU call (``kept``: the process a sweep's relay kept for
        this lease); one per GPU in a placement group for a gang."""
        sess, lease = self.sess, self.lease
        if lease is None:
            self.ranks = [self.rank("cpu", 0, sess.new_worker(None, num_cpus=1))]
            return
        if not (opts.nodes and opts.nodes > 1):
            worker = kept or sess.take_worker(lease.node)
            if worker.preloaded is not None:  # it is importing what earlier cells imported: the cell would too
                import ray

                ray.wait([worker.preloaded], timeout=PRELOAD_WAIT_S)
            self.ranks = [self.rank(lease.node, 0, worker)]
            return
        self._start_gang()

    def _start_gang(self) -> None:
        """A multi-node gang: one rank per leased GPU, numbered node by node in the lease's order.
        A Ray placement group reserves a bundle per rank on the leased nodes, all or nothing; if Ray
        cannot place (or start) every rank within ``gang_start_timeout``, none runs the call. Every
        rank sees its node's leased GPUs and the ``torch.distributed`` variables."""
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        sess, lease = self.sess, self.lease
        assert lease is not None
        parts = lease.parts()
        order = [n for n in lease.nodes if n in parts] + [n for n in parts if n not in lease.nodes]
        places = [(node, local) for node in order for local in range(len(parts[node]))]
        shares = [sess.node_share(node) for node, _ in places]
        self.pg = placement_group(
            [share or {"CPU": GANG_BUNDLE_SHARE} for share in shares], strategy="PACK", name=f"gpulease-{lease.id}"
        )
        if not self.pg.wait(sess.gang_start_timeout):
            raise GpuTrainError(
                f"Ray could not place all {len(places)} ranks on {', '.join(order)} within "
                f"{sess.gang_start_timeout:g}s; no rank was started",
                node=",".join(order),
            )
        for i, (node, local) in enumerate(places):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            worker = sess.new_worker(
                None, scheduling_strategy=strategy, **({"resources": shares[i]} if shares[i] else {})
            )
            self.ranks.append(self.rank(node, local, worker))
        master = self.wait_started()
        for rank, r in enumerate(self.ranks):
            r.env.update(
                RANK=str(rank),
                LOCAL_RANK=str(r.local),
                WORLD_SIZE=str(len(places)),
                LOCAL_WORLD_SIZE=str(len(parts[r.node])),
                MASTER_ADDR=str(master["ip"]),
                MASTER_PORT=str(master["port"]),
            )

    def wait_started(self) -> dict[str, Any]:
        """Wait until every rank's process is up (none runs the call before all are); return rank
        0's endpoint (its node IP and a free port) for MASTER_ADDR / MASTER_PORT."""
        import ray

        sess, ranks = self.sess, self.ranks
        deadline = time.monotonic() + sess.gang_start_timeout
        refs = [r.worker.ready_ref for r in ranks] + [ranks[0].worker.handle.endpoint.remote()]
        owner = list(range(len(ranks))) + [0]
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted({owner[refs.index(r)] for r in pending})
                raise GpuTrainError(
                    f"rank(s) {', '.join(map(str, late))} did not start within {sess.gang_start_timeout:g}s; "
                    "no rank ran the call",
                    node=ranks[late[0]].node,
                    rank=late[0],
                )
            i = refs.index(ready[0])
            rank = owner[i]
            try:
                got = ray.get(ready[0])
                if i < len(ranks):  # a rank's process is up (the last ref is rank 0's endpoint)
                    self.wheres[id(ranks[rank].worker)] = got
            except ray.exceptions.RayError as exc:
                raise GpuTrainError(
                    f"rank {rank} on node {ranks[rank].node} could not start: {_first_line(exc)}; no rank ran the call",
                    node=ranks[rank].node,
                    rank=rank,
                ) from None
        return ray.get(refs[-1])  # type: ignore[no-any-return]

    # ---- ending -----------------------------------------------------------------------------------

    def kill(self) -> None:
        """Someone else ended the lease: kill every rank through Ray now (:meth:`end` still sees
        them gone before the lease is released)."""
        import ray

        for rank in list(self.ranks):
            with contextlib.suppress(Exception):
                ray.kill(rank.worker.handle, no_restart=True)

    def take(self) -> list[Rank]:
        """The ranks, no longer this world's (an elastic resize keeps some for its next phase)."""
        ranks, self.ranks = self.ranks, []
        return ranks

    def end(self, ranks: list[Rank] | None = None) -> bool:
        """Kill the ranks (default: all of this world's, which it then no longer has) and wait
        until each process is gone (and, where NVML sees the GPUs, off them); with all of them,
        remove the placement group. The lease stays held: the grant releases it after this,
        verified when this returns True."""
        import ray

        whole = ranks is None
        ending = self.take() if ranks is None else ranks
        wheres: list[tuple[Rank, Where | None]] = []
        for rank in ending:
            wheres.append((rank, self._where(rank)))
            with contextlib.suppress(Exception):
                ray.kill(rank.worker.handle, no_restart=True)
        verified = all(w is not None for _, w in wheres) or not wheres
        nvml = True
        for rank, where in wheres:
            if where is None:
                continue
            seen = self._verify(rank, where)
            log.debug("worker %s on %s: %s", where.pid, rank.node, seen)
            verified = verified and seen["gone"]
            nvml = nvml and seen["nvml"]
            self.wheres.pop(id(rank.worker), None)
        self.verified, self.nvml = verified, nvml and bool(wheres) and not self.cpu
        if whole and self.pg is not None:
            from ray.util import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception as exc:  # noqa: BLE001 - Ray removes it with this driver anyway
                log.warning("could not remove a placement group: %s", exc)
            self.pg = None
        return verified

    def _where(self, rank: Rank) -> Where | None:
        """Where the rank's process lives: resolved long ago for a pre-started spare; a worker
        still starting is waited for, since its process may already hold a CUDA context."""
        known = self.wheres.get(id(rank.worker))
        if known is not None:
            return known
        try:
            return rank.worker.where(timeout=READY_WAIT_S)
        except Exception:  # noqa: BLE001 - it never started: nothing of it can hold a GPU
            return None

    def _verify(self, rank: Rank, where: Where) -> dict[str, Any]:
        """Is the process gone (and off its GPUs)? Watched from here when it shares our process
        table, else by a spare worker on its node."""
        if where.machine == self.sess.machine:
            return verify_gone(where.pid, rank.uuids, rank.indexes, where.start)
        import ray

        try:
            reaper = self.sess.spare(rank.node)
            reaping = reaper.handle.reap.remote(where.pid, rank.uuids, rank.indexes, where.start)
            return ray.get(reaping, timeout=30)  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001 - say so in the closing line; the lease is still released
            log.warning("could not verify that worker %s on %s exited: %s", where.pid, rank.node, exc)
            return {"gone": False, "nvml": False}
