"""50 clients (threads and processes) acquire, renew, release, let leases expire and get revoked,
for thousands of operations; the event log and the state are then checked: no GPU was ever held
by two live leases, no token was reused, and every GPU is free at the end."""

from __future__ import annotations

import multiprocessing as mp
import random
import subprocess
import sys
import threading

import pytest

from lease_server import errors
from lease_server.client import Client
from lease_server.store.keys import Keys
from tests.invariants import check_event_log, check_state, read_events

OPS_PER_CLIENT = 60


def churn(url: str, token: str, seed: int, ops: int, admin_token: str | None = None) -> dict[str, int]:
    """One client's random walk over the API. Returns counts of what happened."""
    rng = random.Random(seed)
    stats = {
        "ops": 0,
        "granted": 0,
        "busy": 0,
        "renewed": 0,
        "released": 0,
        "lost": 0,
        "abandoned": 0,
        "revoked": 0,
        "workers": 0,
    }
    held = []
    instance = ""
    # Some leases name a real process, as the magic names its worker: one the server ends (expiry,
    # revoke) then drains, and the checker sees no GPU granted again before its `drained`.
    workers: dict[str, subprocess.Popen[bytes]] = {}
    with Client(url, token, timeout=30) as c, Client(url, admin_token) if admin_token else Client(url, token) as admin:
        for _ in range(ops):
            stats["ops"] += 1
            roll = rng.random()
            if (roll < 0.45 and len(held) < 2) or not held:
                try:
                    pool = rng.choice([None, None, "T4-16GB"])
                    gpus = rng.choice([1, 1, 2]) if pool else rng.choice([1, 1, 2, 3, 4])
                    lease = c.acquire(gpus, pool=pool, ttl=rng.choice([1, 2, 4]), wait=rng.choice([0, 0.2, 1]))
                    held.append(lease)
                    stats["granted"] += 1
                    if rng.random() < 0.2:
                        # A worker that claims its lease at the node agent, as the magic's does.
                        instance = instance or c.request("GET", "/api/v1/info")["instance"]
                        args = [instance, lease.node, lease.id, str(lease.token), c.token]
                        w = workers[lease.id] = subprocess.Popen(
                            [sys.executable, "-c", CLAIMER, *args], stdout=subprocess.PIPE
                        )
                        assert w.stdout is not None
                        if w.stdout.readline().strip() != b"claimed":  # a 1 s lease may have ended already
                            end_worker(workers, lease.id)
                except errors.NoCapacity:
                    stats["busy"] += 1
                except errors.LeaseEnded:
                    # Granted from the queue, and its 1 s TTL ran out before the server (starved on
                    # a loaded machine) saw the grant: the lease is gone, and the caller is told so.
                    stats["lost"] += 1
            elif roll < 0.65:
                lease = rng.choice(held)
                try:
                    c.renew(lease)
                    stats["renewed"] += 1
                except (errors.LeaseEnded, errors.LeaseExpired):
                    held.remove(lease)
                    stats["lost"] += 1
            elif roll < 0.92:
                lease = held.pop(rng.randrange(len(held)))
                end_worker(workers, lease.id)  # the owner's release is verified: its worker is gone first
                c.release(lease)
                stats["released"] += 1
            elif roll < 0.97:
                held.pop(rng.randrange(len(held)))  # walk away: the TTL must take it back
                stats["abandoned"] += 1
            elif admin_token:
                lease = held.pop(rng.randrange(len(held)))
                admin.revoke(lease.id, "test revoke")
                stats["revoked"] += 1
        for lease in held:
            end_worker(workers, lease.id)
            c.release(lease)
    for w in workers.values():  # the others were ended by the node agent: reap them
        w.wait(60)
    stats["workers"] = len(workers)
    return stats


# A worker process: claims the lease named on its command line at the node agent, says so, runs.
CLAIMER = (
    "import sys, time\n"
    "from lease_server.node.claims import ClaimRefused, claim\n"
    "instance, node, lease, fence, token = sys.argv[1:6]\n"
    "try:\n"
    "    claim(instance, node, lease, int(fence), token)\n"
    "except (ClaimRefused, OSError) as exc:\n"
    "    print('refused', exc, flush=True)\n"
    "    sys.exit(0)\n"
    "print('claimed', flush=True)\n"
    "time.sleep(60)\n"
)


def end_worker(workers: dict[str, subprocess.Popen[bytes]], lease_id: str) -> None:
    w = workers.pop(lease_id, None)
    if w is not None:
        w.kill()
        w.wait()


def snapshot_while_running(threads: list[threading.Thread], redis_sync, keys: Keys) -> int:
    """Check consistent snapshots of the state while ``threads`` run; returns how many were taken."""
    snapshots = 0
    while any(t.is_alive() for t in threads):
        check_state(redis_sync, keys)
        snapshots += 1
        threads[0].join(0.05)
    for t in threads:
        t.join()
    return snapshots


def totals(results: list) -> dict[str, int]:
    failures = [r for r in results if isinstance(r, str)]
    assert not failures, failures
    return {k: sum(r[k] for r in results if isinstance(r, dict)) for k in results[0]}


def drain_and_check_all_free(redis_sync, keys: Keys) -> dict[str, int]:
    """Abandoned leases expire by TTL + one sweep: wait for the deadline index and the queue to
    drain, then check that every GPU is free and replay the event log."""
    wait = threading.Event()
    for _ in range(400):
        if (
            redis_sync.zcard(keys.deadlines) == 0
            and redis_sync.zcard(keys.queue) == 0
            and not redis_sync.hlen(keys.draining)
        ):
            break
        wait.wait(0.05)
    check_state(redis_sync, keys, expect_all_free=True)
    counts = check_event_log(read_events(redis_sync, keys))
    assert counts["grant"] == sum(counts.get(t, 0) for t in ("released", "expired", "revoked"))
    return counts


def _proc_main(args: tuple[str, str, int, int], out: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        out.put(churn(*args))
    except BaseException as exc:
        out.put(repr(exc))
        raise


@pytest.mark.slow
def test_fifty_clients_never_double_grant(server_factory, redis_sync):
    srv = server_factory(
        simulate="n1=8xA100-80GB,n2=8xA100-80GB,n3=4xA100-80GB,n4=2xA100-80GB,t1=4xT4-16GB", sweep_interval=0.05
    )
    keys = Keys(srv.settings.prefix)
    admin = srv.token("root", "admin")
    results: list[dict[str, int] | str] = []
    lock = threading.Lock()

    def thread_main(i: int) -> None:
        try:
            r = churn(srv.url, srv.token(f"t{i % 8}"), i, OPS_PER_CLIENT, admin if i % 5 == 0 else None)
        except BaseException as exc:
            r = repr(exc)
        with lock:
            results.append(r)

    tokens = [srv.token(f"p{i}") for i in range(10)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_proc_main, args=((srv.url, tokens[i], 1000 + i, OPS_PER_CLIENT), queue)) for i in range(10)
    ]
    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(40)]
    for p in procs:
        p.start()
    for t in threads:
        t.start()
    # While the load runs, take consistent snapshots of the state and check them.
    snapshots = snapshot_while_running(threads, redis_sync, keys)
    for _ in procs:
        results.append(queue.get(timeout=120))
    for p in procs:
        p.join(30)

    total = totals(results)
    assert total["ops"] == 50 * OPS_PER_CLIENT
    # (enough grants for the check to mean something: 448-472 on a quiet 2-core machine, 378 in a
    # fresh clone's full run beside the other worker, where more short waits time out)
    assert total["granted"] > 300 and total["busy"] > 0 and total["abandoned"] > 0
    counts = drain_and_check_all_free(redis_sync, keys)
    assert counts.get("expired", 0) > 0 and counts.get("queued", 0) > 0
    assert total["workers"] > 0 and counts.get("drained", 0) > 0  # forced ends of leases with a process drained
    assert snapshots > 3


def churn_scheduled(
    url: str, token: str, seed: int, ops: int, elastic: float = 0.2, waits: tuple[float, ...] = (0, 0.3, 1)
) -> dict[str, int]:
    """A random walk that also uses what scheduling added: elastic requests (``elastic``: their share
    of the requests), gangs, priorities, and elastic leases growing and shrinking (or being asked to
    shrink for others' requests). ``waits``: the seconds a request may wait, one drawn per request."""
    rng = random.Random(seed)
    stats = {"ops": 0, "granted": 0, "busy": 0, "released": 0, "lost": 0, "gang": 0, "grown": 0, "shrunk": 0}
    stats["refused"] = 0
    held = []
    with Client(url, token, timeout=30) as c:
        for _ in range(ops):
            stats["ops"] += 1
            roll = rng.random()
            if roll < 0.5 or not held:
                kind = rng.random()
                kw: dict = {"priority": rng.choice(["low", "normal", "high"])}
                if kind < 0.2:
                    gpus, kw["nodes"] = 4, 2
                elif kind < 0.2 + elastic:
                    gpus, kw["gpus_min"] = rng.choice([2, 4]), 1
                else:
                    gpus = rng.choice([1, 1, 2])
                try:
                    lease = c.acquire(gpus, ttl=rng.choice([1, 2]), wait=rng.choice(waits), **kw)
                    held.append(lease)
                    stats["granted"] += 1
                    stats["gang"] += bool(lease.nodes)
                except errors.NoCapacity:
                    stats["busy"] += 1
                except errors.LeaseEnded:  # granted from the queue, its 1-2 s ttl out before the
                    stats["lost"] += 1  # loaded server saw the grant: gone, and the caller is told so
            elif roll < 0.7:
                # Resize, an elastic lease by preference (the others are refused: not elastic).
                resizable = [i for i, held_lease in enumerate(held) if held_lease.raw.get("elastic")]
                i = rng.choice(resizable or range(len(held)))
                lease = held[i]
                at_max = len(lease.gpus) >= lease.raw.get("elastic", {}).get("max", 0)
                try:
                    # Give one back (always at the maximum), then try to take one: a GPU given back
                    # goes to a waiter if there is one, else the lease may grow into it again.
                    if len(lease.gpus) > 1 and (at_max or rng.random() < 0.3):
                        held[i] = lease = c.shrink(lease, 1)
                        stats["shrunk"] += 1
                    held[i] = c.grow(lease, 1)
                    stats["grown"] += 1
                except (errors.LeaseEnded, errors.NoSuchLease):  # expired, preempted or recalled meanwhile
                    held.pop(i)
                    stats["lost"] += 1
                except errors.Conflict:  # refused: nothing changed (someone waits, no free GPU, ...)
                    stats["refused"] += 1
            else:
                lease = held.pop(rng.randrange(len(held)))
                try:
                    c.release(lease)
                    stats["released"] += 1
                except errors.GpuLeaseError:
                    stats["lost"] += 1
        for lease in held:
            c.release(lease)
    return stats


@pytest.mark.slow
def test_bookings_quotas_preemption_and_gangs_never_double_grant(server_factory, redis_sync):
    """24 clients under bookings in force (recalling borrowed leases), quotas (preempting), elastic
    requests that grow and shrink and 2-node gangs: the same invariants hold, and everything is free
    at the end."""
    import time as _time

    srv = server_factory(
        simulate="n1=4xA100-80GB,n2=4xA100-80GB,n3=4xA100-80GB,n4=2xA100-80GB",
        sweep_interval=0.05,
        borrow_notice=0.3,
        teams={"ml": ["u0", "u1", "u2"]},
        high_priority=["team:ml", *(f"u{i}" for i in range(3, 8))],  # (the clients ask for every class)
        scheduling={"A100-80GB": {"scheduler": "priority", "quota": {"*": 2}, "preempt_notice": 0.3}},
    )
    keys = Keys(srv.settings.prefix)
    now = _time.time()
    with Client(srv.url, srv.token("u0")) as c:
        c.book("A100-80GB", 4, now - 1, now + 3600, owner="team:ml")
        c.book("A100-80GB", 2, now - 1, now + 3600, colocate=True)
    results: list[dict[str, int] | str] = []
    lock = threading.Lock()

    def thread_main(i: int) -> None:
        try:
            r = churn_scheduled(srv.url, srv.token(f"u{i % 8}"), 7000 + i, 40)
        except BaseException as exc:
            r = repr(exc)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    snapshots = snapshot_while_running(threads, redis_sync, keys)
    total = totals(results)
    assert total["granted"] > 100 and total["gang"] > 0
    # (no lease grows here: a booking is in force all along, and growing would take GPUs it may need)
    assert total["shrunk"] > 0 and total["refused"] > 0 and total["grown"] == 0, total
    counts = drain_and_check_all_free(redis_sync, keys)
    assert counts.get("borrow_recalled", 0) + counts.get("preempt_notice", 0) > 0, counts
    assert counts.get("shrunk", 0) >= total["shrunk"], counts
    assert redis_sync.hget(keys.held_by, "A100-80GB|~preemptible") in (None, "0")
    assert all(int(v) == 0 for v in redis_sync.hvals(keys.held_by)), redis_sync.hgetall(keys.held_by)
    assert snapshots > 3


@pytest.mark.slow
def test_elastic_leases_grow_shrink_and_are_asked_to_shrink_without_double_grants(server_factory, redis_sync):
    """Clients whose elastic leases grow, shrink and are asked to shrink for others' requests (the
    sweep shrinks them when a short notice runs out), beside gangs and fixed-size requests, with no
    booking in force: no GPU is ever held twice, the quota counts, the elastic index and the shrink
    deadlines stay exact (checked on snapshots while they run), and everything is free at the end.
    First 12 clients that queue (so leases are asked to shrink, and growing is mostly refused: someone
    waits), then 4 that never queue (so leases grow into what is free)."""
    srv = server_factory(
        simulate="n1=4xA100-80GB,n2=4xA100-80GB,n3=2xA100-80GB",
        sweep_interval=0.05,
        high_priority=[f"e{i}" for i in range(6)],  # (the clients ask for every class)
        scheduling={"A100-80GB": {"preempt_notice": 0.3}},
    )
    keys = Keys(srv.settings.prefix)
    results: list[dict[str, int] | str] = []
    lock = threading.Lock()

    def thread_main(i: int, waits: tuple[float, ...]) -> None:
        try:  # (i: 0.. in the first phase, 100.. in the second: every client its own random walk)
            r = churn_scheduled(srv.url, srv.token(f"e{i % 6}"), 9000 + i, 30, elastic=0.6, waits=waits)
        except BaseException as exc:
            r = repr(exc)
        with lock:
            results.append(r)

    snapshots = 0
    for first, clients, waits in ((0, 12, (0, 0.3, 1)), (100, 4, (0,))):
        threads = [threading.Thread(target=thread_main, args=(first + i, waits)) for i in range(clients)]
        for t in threads:
            t.start()
        snapshots += snapshot_while_running(threads, redis_sync, keys)
    total = totals(results)
    assert total["granted"] > 50 and total["grown"] > 0 and total["shrunk"] > 0 and total["refused"] > 0, total
    counts = drain_and_check_all_free(redis_sync, keys)
    assert counts.get("shrink_notice", 0) > 0, counts
    assert counts.get("grown", 0) == total["grown"] and counts.get("shrunk", 0) >= total["shrunk"], counts
    assert all(int(v) == 0 for v in redis_sync.hvals(keys.held_by)), redis_sync.hgetall(keys.held_by)
    assert redis_sync.zcard(keys.elastic) == 0 and redis_sync.zcard(keys.shrink_due) == 0
    assert snapshots > 3
