"""A real Redis Cluster of three primaries on loopback, for tests: redis-server processes started
with ``--cluster-enabled yes``, the 16384 slots split between them (CLUSTER ADDSLOTS), joined with
CLUSTER MEET. The same as ``redis-cli --cluster create`` does, without needing redis-cli."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from redis import Redis

from lease_server.node.redis_proc import RedisProcess, free_port

SLOTS = 16384


def _cluster_port() -> int:
    """A free port below 55536 whose cluster bus port (+10000) is free too."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    return free_port()


class RedisCluster3:
    def __init__(self, tmp: Path, primaries: int = 3) -> None:
        self.nodes: list[RedisProcess] = []
        for _ in range(primaries):
            port = _cluster_port()
            d = tmp / f"cluster-{port}"
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"), "--appendonly", "no"]
            self.nodes.append(RedisProcess(d, port=port, extra=extra).start())
        clients = [Redis(port=n.port, decode_responses=True) for n in self.nodes]
        try:
            share = SLOTS // primaries
            for i, r in enumerate(clients):
                last = SLOTS if i == primaries - 1 else (i + 1) * share
                slots = list(range(i * share, last))
                for k in range(0, len(slots), 1000):
                    r.execute_command("CLUSTER", "ADDSLOTS", *slots[k : k + 1000])
            for r in clients[1:]:
                r.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
            end, pause = time.monotonic() + 30, threading.Event()
            while time.monotonic() < end:
                infos = [r.cluster("info") for r in clients]
                if all(i["cluster_state"] == "ok" and int(i["cluster_known_nodes"]) == primaries for i in infos):
                    return
                pause.wait(0.1)
            raise RuntimeError(f"the cluster did not come up: {infos}")
        finally:
            for r in clients:
                r.close()

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()
