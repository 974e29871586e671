"""The world of worker processes a call runs on: one rank on its node, or a multi-node gang's ranks
placed together, each seeing only its own node's leased GPUs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .options import Options
from .outcomes import GpuTrainError, _first_line
from .session import GANG_BUNDLE_SHARE, Session, Worker

if TYPE_CHECKING:
    from .grant import Grant

log = logging.getLogger(__name__)
PRELOAD_WAIT_S = 120.0  # a spare still importing what earlier cells imported: the cell waits for it


@dataclass
class Rank:
    node: str
    local: int
    env: dict[str, str]
    worker: Worker


def start_world(sess: Session, grant: Grant, opts: Options) -> None:
    """One worker for a one-node or CPU call; one per GPU in a placement group for a gang."""
    lease = grant.lease
    if lease is None:
        grant.ranks = [Rank("cpu", 0, grant.env("cpu"), sess.new_worker(None, num_cpus=1))]
        return
    if not (opts.nodes and opts.nodes > 1):
        kept = grant.relay.claim(lease) if grant.relay is not None and not grant.cpu else None
        worker = kept or sess.take_worker(lease.node)
        if worker.preloaded is not None:  # it is importing what earlier cells imported: the cell would too
            import ray

            ray.wait([worker.preloaded], timeout=PRELOAD_WAIT_S)
        grant.ranks = [Rank(lease.node, 0, grant.env(lease.node), worker)]
        return
    _start_gang(sess, grant)


def _start_gang(sess: Session, grant: Grant) -> None:
    """A multi-node gang: one rank per leased GPU, numbered node by node in the lease's order.
    A Ray placement group reserves a bundle per rank on the leased nodes, all or nothing; if Ray
    cannot place (or start) every rank within ``gang_start_timeout``, none runs the call. Every
    rank sees its node's leased GPUs and the ``torch.distributed`` variables."""
    from ray.util import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    lease = grant.lease
    assert lease is not None
    parts = lease.parts()
    order = [n for n in lease.nodes if n in parts] + [n for n in parts if n not in lease.nodes]
    places = [(node, local) for node in order for local in range(len(parts[node]))]
    shares = [sess.node_share(node) for node, _ in places]
    grant.pg = placement_group(
        [share or {"CPU": GANG_BUNDLE_SHARE} for share in shares], strategy="PACK", name=f"gpulease-{lease.id}"
    )
    if not grant.pg.wait(sess.gang_start_timeout):
        raise GpuTrainError(
            f"Ray could not place all {len(places)} ranks on {', '.join(order)} within "
            f"{sess.gang_start_timeout:g}s; no rank was started",
            node=",".join(order),
        )
    for i, (node, local) in enumerate(places):
        strategy = PlacementGroupSchedulingStrategy(grant.pg, placement_group_bundle_index=i)
        worker = sess.new_worker(None, scheduling_strategy=strategy, **({"resources": shares[i]} if shares[i] else {}))
        grant.ranks.append(Rank(node, local, grant.env(node), worker))
    master = wait_ranks_started(sess, grant.ranks)
    world = len(places)
    for rank, r in enumerate(grant.ranks):
        r.env.update(
            RANK=str(rank),
            LOCAL_RANK=str(r.local),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(len(parts[r.node])),
            MASTER_ADDR=str(master["ip"]),
            MASTER_PORT=str(master["port"]),
        )


def wait_ranks_started(sess: Session, ranks: list[Rank]) -> dict[str, Any]:
    """Wait until every rank's process is up (none runs the call before all are); return rank
    0's endpoint (its node IP and a free port) for MASTER_ADDR / MASTER_PORT."""
    import ray

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
        rank = owner[refs.index(ready[0])]
        try:
            ray.get(ready[0])
        except ray.exceptions.RayError as exc:
            raise GpuTrainError(
                f"rank {rank} on node {ranks[rank].node} could not start: {_first_line(exc)}; no rank ran the call",
                node=ranks[rank].node,
                rank=rank,
            ) from None
    return ray.get(refs[-1])  # type: ignore[no-any-return]
