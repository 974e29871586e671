"""Redis high availability for tests and benches: a primary, a replica and three sentinels on
loopback (real redis-server processes), kill -9 of the primary, and a load of lease clients checked
by an invariant checker over what the clients observed.

Used by tests/test_failover.py and bench/ha_bench.py.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis

from lease_server import errors
from lease_server.client import Client
from lease_server.node.redis_proc import RedisProcess, free_port, redis_server_binary

SERVICE = "mymaster"
DEPLOY_DOC = Path(__file__).resolve().parent.parent / "docs" / "deploy.md"


def doc_block(name: str) -> list[str]:
    """The lines of the fenced block after ``<!-- test_failover: NAME -->`` in docs/deploy.md: the
    tests run the settings the deployment guide gives, so the two cannot drift apart."""
    import re

    m = re.search(
        rf"<!-- test_failover: {re.escape(name)} -->\n```[a-z]*\n(.*?)^```", DEPLOY_DOC.read_text(), re.S | re.M
    )
    assert m, f"docs/deploy.md has no fenced block after <!-- test_failover: {name} -->"
    return [line.strip() for line in m.group(1).splitlines() if line.strip()]


def _sentinel_settings() -> dict[str, str]:
    """{"down-after-milliseconds": "1000", ...}: the guide's sentinel.conf, but its monitor line."""
    out = {}
    for line in doc_block("sentinel"):
        words = line.split()
        if words[:2] != ["sentinel", "monitor"]:
            assert words[0] == "sentinel" and words[2] == SERVICE, line
            out[words[1]] = words[3]
    return out


# Sentinel settings of docs/deploy.md: a primary unreachable for 1 s is down, and the failover
# itself is bounded by 5 s. The guide's redis.conf lines go to every node.
SENTINEL_SETTINGS = _sentinel_settings()
REDIS_SETTINGS = [arg for line in doc_block("redis") for arg in (f"--{line.split()[0]}", *line.split()[1:])]


class SentinelGroup:
    """A primary, one replica and three sentinels (quorum 2), each a redis-server child process.

    ``kill_primary()`` kills the primary with SIGKILL; ``wait_failover()`` waits until the sentinels
    name another primary and restarts the killed instance as its replica, so the next kill has a
    replica to promote again."""

    def __init__(self, tmp: Path, redis_settings: list[str] | None = None) -> None:
        import subprocess

        self._subprocess = subprocess
        self.tmp = tmp
        self.redis_settings = REDIS_SETTINGS if redis_settings is None else redis_settings
        self.nodes: dict[int, RedisProcess] = {}
        first = self._start_node(free_port(), replica_of=None)
        self._start_node(free_port(), replica_of=first)
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[Any] = []
        for port in self.sentinel_ports:
            d = tmp / f"sentinel-{port}"
            d.mkdir(parents=True)
            conf = d / "sentinel.conf"
            lines = [
                f"port {port}",
                "bind 127.0.0.1",
                f"dir {d}",
                f"logfile {d / 'sentinel.log'}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {first} 2",
                *(f"sentinel {k} {SERVICE} {v}" for k, v in SENTINEL_SETTINGS.items()),
            ]
            conf.write_text("\n".join(lines) + "\n")
            self.sentinels.append(
                subprocess.Popen(
                    [redis_server_binary(), str(conf), "--sentinel"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self.wait_ready()

    def _start_node(self, port: int, replica_of: int | None) -> int:
        # AOF on, as docs/deploy.md has it: a killed instance restarts with its data, not empty.
        # Without it, a restarted replica is empty until its first sync ends, and Sentinel (which
        # reads a replica that never synced as "link down -1 s") may promote it if a loaded host
        # makes the primary miss its pings for down-after-milliseconds: every token and lease gone.
        extra = list(self.redis_settings)
        if replica_of is not None:
            extra += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.nodes[port] = RedisProcess(self.tmp / f"redis-{port}", port=port, extra=extra).start()
        return port

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def _ask(self, port: int, *command: str) -> Any:
        r = Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=1, socket_connect_timeout=1)
        try:
            return r.execute_command(*command)
        finally:
            r.close()

    def primary(self) -> int | None:
        """The primary's port as a majority of the sentinels name it (None while they disagree)."""
        votes: dict[int, int] = defaultdict(int)
        for port in self.sentinel_ports:
            try:
                host, p = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                votes[int(p)] += 1
            except Exception:  # noqa: BLE001 - a sentinel starting or away does not vote
                continue
        best = max(votes.items(), key=lambda kv: kv[1], default=(None, 0))
        return best[0] if best[1] >= 2 else None

    def wait_ready(self, timeout: float = 30.0, sentinels_see_replica: bool = True) -> None:
        """Until the sentinels agree on the primary and its replica is in sync (and, at the start,
        every sentinel knows the replica: sentinels look for replicas every 10 s, so after a failover
        they find the restarted one well before the next kill)."""
        end = time.monotonic() + timeout
        pause = threading.Event()
        while time.monotonic() < end:
            try:
                states = [dict(_pairs(self._ask(p, "SENTINEL", "MASTER", SERVICE))) for p in self.sentinel_ports]
                ok = not sentinels_see_replica or all(
                    int(s.get("num-slaves", 0)) >= 1 and int(s.get("num-other-sentinels", 0)) >= 2 for s in states
                )
                primary = self.primary()
                if ok and primary is not None:
                    info = self._ask(primary, "INFO", "replication")
                    if _online(info):
                        return
            except Exception:  # noqa: BLE001 - not yet
                pass
            pause.wait(0.1)
        raise RuntimeError("the sentinels did not see a primary with an in-sync replica in time")

    def hold_back_replicas(self) -> Any:
        """Cut the replicas off the primary (each is pointed at a port where nothing listens), so
        that they miss its next writes: the window that asynchronous replication leaves open, made
        wide enough to hit on purpose. Returns the function that points them back (call it after
        the kill: they then find their primary down, as after a crash, and one is promoted)."""
        port = self.primary()
        assert port is not None, "no primary"
        nowhere = free_port()
        replicas = [p for p, n in self.nodes.items() if p != port and n.proc and n.proc.poll() is None]
        for p in replicas:
            self._ask(p, "REPLICAOF", "127.0.0.1", str(nowhere))

        def resume() -> None:
            for p in replicas:
                self._ask(p, "REPLICAOF", "127.0.0.1", str(port))

        return resume

    def kill_primary(self) -> int:
        port = self.primary()
        assert port is not None, "no primary to kill"
        self.nodes[port].kill()
        return port

    def wait_failover(self, old: int, timeout: float = 30.0) -> int:
        """Until the sentinels name a primary other than ``old``; then restart ``old`` as its replica
        and wait until it is in sync (a replica for the next failover). Returns the new primary."""
        end = time.monotonic() + timeout
        pause = threading.Event()
        new = None
        while time.monotonic() < end:
            new = self.primary()
            if new is not None and new != old:
                break
            pause.wait(0.05)
        else:
            raise RuntimeError(f"no failover away from port {old} within {timeout}s")
        assert new is not None
        self._start_node(old, replica_of=new)
        self.wait_ready(timeout=max(5.0, end - time.monotonic()), sentinels_see_replica=False)
        return new

    def events(self) -> list[str]:
        """The failover events each sentinel logged (+sdown, +odown, +switch-master, +tilt...),
        "PORT: line": what to read when a failover test fails."""
        keep = ("+sdown", "-sdown", "+odown", "+switch-master", "+tilt", "-tilt", "+promoted-slave", "+selected-slave")
        out = []
        for port in self.sentinel_ports:
            log = self.tmp / f"sentinel-{port}" / "sentinel.log"
            if log.exists():
                lines = log.read_text().splitlines()
                out += [f"{port}: {line.strip()}" for line in lines if any(k in line for k in keep)]
        return out

    def switches(self) -> int:
        """The failovers the sentinels made, planned or not (the most +switch-master any one logged)."""
        counts: dict[str, int] = defaultdict(int)
        for line in self.events():
            if "+switch-master" in line:
                counts[line.split(":", 1)[0]] += 1
        return max(counts.values(), default=0)

    def stop(self) -> None:
        for s in self.sentinels:
            s.kill()
            s.wait()
        for node in self.nodes.values():
            node.kill()


def _pairs(flat: Any) -> list[tuple[str, Any]]:
    if isinstance(flat, dict):
        return list(flat.items())
    return list(zip(flat[::2], flat[1::2], strict=False))


def _online(info: Any) -> bool:
    if isinstance(info, dict):
        return any(isinstance(v, dict) and v.get("state") == "online" for v in info.values())
    return False


# ---- the load and its checker -------------------------------------------------------------------


@dataclass
class Holding:
    """What one client saw of one lease: from the grant it received to the release it sent (or the
    expiry it was last told of, if earlier)."""

    lease: str
    token: int
    gpus: list[tuple[str, int]]
    start: float
    end: float = float("inf")
    expires_at: float = float("inf")


@dataclass
class Report:
    replicas_ack: int
    grants: int = 0
    failovers: int = 0
    double_grants: list[str] = field(default_factory=list)
    token_reuse: list[str] = field(default_factory=list)
    lost_grants: list[str] = field(default_factory=list)  # acknowledged, then gone from the new primary
    unavailable_s: list[float] = field(default_factory=list)  # kill -> first acknowledged grant after it
    errors: list[str] = field(default_factory=list)
    sentinel_failovers: int = 0  # as the sentinels logged them: more than failovers = one not planned

    def figures(self) -> dict[str, Any]:
        return {
            "replicas_ack": self.replicas_ack,
            "grants": self.grants,
            "failovers": self.failovers,
            "sentinel_failovers": self.sentinel_failovers,
            "double_grants": len(self.double_grants),
            "token_reuse": len(self.token_reuse),
            "lost_grants": len(self.lost_grants),
            "unavailable_s": [round(u, 2) for u in self.unavailable_s],
        }


def _transient(exc: errors.GpuLeaseError) -> bool:
    return isinstance(exc, errors.ServerUnavailable) or exc.status >= 500


def run_load(
    group: SentinelGroup,
    url: str,
    tokens: list[str],
    kills: int,
    kill_every_s: float,
    replicas_ack: int,
    prefix_keys: Any,
    replica_behind_s: float = 0.3,
) -> Report:
    """``len(tokens)`` clients acquire (1 GPU, wait 0), renew and release while the primary is killed
    ``kills`` times, ``kill_every_s`` after the load starts and after each failover ends (its replica
    held back ``replica_behind_s`` first); the load goes on ``kill_every_s`` after the last one.
    Counted in failovers, not seconds: a slow machine gets as many as a fast one. Then check what
    the clients observed."""
    report = Report(replicas_ack)
    lock = threading.Lock()
    holdings: list[Holding] = []
    live: dict[str, Holding] = {}  # acknowledged and no release sent yet
    stop = threading.Event()
    grant_times: list[tuple[float, float]] = []  # (asked, acknowledged)

    def client_main(i: int) -> None:
        import random

        rng = random.Random(i)
        pause = threading.Event()
        mine: Holding | None = None
        with Client(url, tokens[i], timeout=20, resend_503_s=0) as c:  # _retry resends, and counts
            while not stop.is_set():
                try:
                    if mine is None:
                        body = {"id": "h-" + secrets.token_hex(8), "gpus": 1, "ttl": 30, "wait": 0}
                        asked = time.time()
                        raw = _retry(lambda b=body: c.request("POST", "/api/v1/leases", json=b), stop)
                        if raw is None:
                            break
                        now = time.time()
                        mine = Holding(
                            raw["id"],
                            int(raw["token"]),
                            [(raw["node"], int(g["index"])) for g in raw["gpus"]],
                            now,
                            expires_at=float(raw["expires_at"]),
                        )
                        with lock:
                            holdings.append(mine)
                            live[mine.lease] = mine
                            grant_times.append((asked, now))
                        pause.wait(rng.uniform(0.05, 0.3))
                    elif rng.random() < 0.4:
                        held = mine
                        renewed = _retry(lambda h=held: c.renew(h.lease, h.token), stop)
                        if renewed is not None:
                            held.expires_at = float(renewed.expires_at)
                        pause.wait(rng.uniform(0.05, 0.3))
                    else:
                        held = mine
                        with lock:
                            held.end = min(time.time(), held.expires_at)
                            live.pop(held.lease, None)
                        mine = None
                        _retry(lambda h=held: c.release(h.lease, h.token), stop)
                except errors.NoCapacity:
                    pause.wait(0.05)
                except (errors.NotFound, errors.LeaseEnded) as exc:
                    # An acknowledged lease the server no longer knows, or that ended while we held
                    # it and renewed it: lost.
                    with lock:
                        if mine is not None:
                            report.lost_grants.append(f"{mine.lease} (token {mine.token}): {exc}")
                            mine.end = min(time.time(), mine.expires_at)
                            live.pop(mine.lease, None)
                    mine = None
                except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                    with lock:
                        report.errors.append(f"client {i}: {exc!r}")
                    pause.wait(0.2)
            if mine is not None:
                with lock:
                    mine.end = min(time.time(), mine.expires_at)
                    live.pop(mine.lease, None)
                last = mine
                _retry(lambda: c.release(last.lease, last.token), threading.Event())

    threads = [threading.Thread(target=client_main, args=(i,), daemon=True) for i in range(len(tokens))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    pause = threading.Event()
    next_kill = t0 + kill_every_s
    while report.failovers < kills or time.monotonic() < next_kill:
        if report.failovers < kills and time.monotonic() >= next_kill:
            # Every sentinel must know the replica that the last failover restarted, or there is
            # nothing to promote (they look for replicas every 10 s): waited for, not timed.
            group.wait_ready(timeout=30.0)
            resume = group.hold_back_replicas()
            pause.wait(replica_behind_s)
            with lock:
                snapshot = dict(live)
            old = group.kill_primary()
            killed_at = time.time()
            resume()
            new = group.wait_failover(old)
            report.failovers += 1
            # Every grant acknowledged before the kill, and not released, must be on the new primary.
            r = Redis(host="127.0.0.1", port=new, decode_responses=True)
            try:
                present = set(r.hkeys(prefix_keys.leases)) | set(r.hkeys(prefix_keys.ended))
            finally:
                r.close()
            for lid, h in snapshot.items():
                if lid not in present:
                    report.lost_grants.append(f"{lid} (token {h.token}) acknowledged before kill {report.failovers}")
            end = time.monotonic() + 30
            while time.monotonic() < end:
                with lock:
                    after = [got for asked, got in grant_times if asked > killed_at]  # asked after the kill
                if after:
                    report.unavailable_s.append(min(after) - killed_at)
                    break
                pause.wait(0.02)
            next_kill = time.monotonic() + kill_every_s
        pause.wait(0.05)
    stop.set()
    for t in threads:
        t.join(60)
    report.grants = len(holdings)
    _check(holdings, report)
    return report


def _retry(fn: Any, stop: threading.Event, deadline_s: float = 40.0) -> Any:
    """Resend after a transient failure (503, connection refused): every request is safe to resend.
    None if the load is stopping while the service is away."""
    end = time.monotonic() + deadline_s
    pause = threading.Event()
    while True:
        try:
            return fn()
        except errors.GpuLeaseError as exc:
            if not _transient(exc) or time.monotonic() > end:
                raise
            if stop.is_set():
                return None
        pause.wait(0.05)


def _check(holdings: list[Holding], report: Report) -> None:
    """No GPU held by two clients at once; tokens never reused, and rising along each GPU's holders."""
    seen: dict[int, str] = {}
    for h in holdings:
        if h.token in seen and seen[h.token] != h.lease:
            report.token_reuse.append(f"token {h.token}: {seen[h.token]} and {h.lease}")
        seen[h.token] = h.lease
    by_gpu: dict[tuple[str, int], list[Holding]] = defaultdict(list)
    for h in holdings:
        for g in h.gpus:
            by_gpu[g].append(h)
    for gpu, hs in by_gpu.items():
        hs.sort(key=lambda h: h.start)
        for a, b in zip(hs, hs[1:], strict=False):
            if b.start < a.end:
                report.double_grants.append(
                    f"{gpu}: {a.lease} [{a.start:.3f}, {a.end:.3f}] and {b.lease} from {b.start:.3f}"
                )
            if b.token <= a.token:
                report.token_reuse.append(f"{gpu}: token {b.token} ({b.lease}) after {a.token} ({a.lease})")
