"""Several GPU hosts: docs/deploy.md's commands on three hosts made of Linux network namespaces.

A service host (``svc``: redis-server, ``gpulease server``, the Ray head, a notebook kernel) and two
GPU hosts (``gpu-a``: 2 GPUs, ``gpu-b``: 4), each a network namespace with its own address on a
bridge, as if on three machines. The lease server and its settings, the tokens, the Ray head, both
GPU hosts' services (``ray start`` and ``gpulease agent``) and the first cell run what
docs/deploy.md shows, read from the doc's marked blocks, so the doc cannot drift from what works.
Only what cannot be the same here is changed: ``/etc/gpulease`` is a directory of this test,
``SVC_IP`` the service namespace's address, every ``ray start`` gets a ``--temp-dir`` of its own,
``gpulease agent`` gets ``--node`` and ``--simulate`` (no GPU here, and the namespaces share one host
name), and Redis is one plain redis-server: the lease server (the doc's first one, on the proxy's
port, standing in for the proxy and both replicas) gets its URL, no ``replicas_ack``, and a short
``heartbeat_timeout``. The kernel has what JupyterHub gives kernels (the proxy token and its user),
and nothing for Ray: it joins with the token the lease server hands out.

Needs root and iproute2's ``ip``; skipped otherwise. Every namespace, link and process is removed
at the end, whatever happened; every process's output stays in pytest's temporary directory.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from lease_server import errors
from lease_server.client import Client
from lease_server.node.redis_proc import redis_server_binary
from tests.api_helpers import EventWatcher
from tests.multihost_driver import ANSWER

# One cluster for the whole module: starting it (three Ray nodes on a small machine) is most of the
# time, and is counted in the first test's timeout.
pytestmark = pytest.mark.timeout(480)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploy.md"
BIN = Path(sys.executable).parent  # this environment's gpulease and ray, on PATH in every namespace
HOSTS = {"gpu-a": "2xA100-80GB", "gpu-b": "4xA100-80GB"}
POOL = "A100-80GB"
SERVER_PORT = 8470  # the doc's proxy port: the one server stands in for proxy and replicas
RAY_PORT = 6380  # the doc's Ray head port
T = TypeVar("T")


# ---- the doc's commands --------------------------------------------------------------------------


def doc_block(name: str) -> list[str]:
    """The logical lines of the fenced block after ``<!-- test_multihost: NAME -->`` in the doc
    (continuations joined; blank lines and comment lines dropped)."""
    text = DOC.read_text()
    m = re.search(rf"<!-- test_multihost: {re.escape(name)} -->\n```[a-z]*\n(.*?)^```", text, re.S | re.M)
    assert m, f"docs/deploy.md has no fenced block after <!-- test_multihost: {name} -->"
    body = m.group(1).replace("\\\n", " ")
    return [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def split_exports(lines: list[str]) -> tuple[list[str], list[str]]:
    return [ln for ln in lines if ln.startswith("export ")], [ln for ln in lines if not ln.startswith("export ")]


# ---- waiting -------------------------------------------------------------------------------------


def wait_until(check: Callable[[], T | None], timeout: float, what: str, procs: Sequence[Proc] = ()) -> T:
    """Poll ``check`` until it returns a value, with a deadline: starting processes and a node's
    heartbeats have no event to wait on from here. Fails at once if one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        for p in procs:
            assert p.popen.poll() is None, f"{what}: {p.name} exited ({p.popen.returncode}):\n{p.tail()}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s\n" + "\n".join(p.tail() for p in procs)
        time.sleep(0.1)


# ---- the three hosts -----------------------------------------------------------------------------


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 3000) -> str:
        try:
            return f"--- {self.name} ({self.log}):\n" + self.log.read_text(errors="replace")[-n:]
        except OSError:
            return f"--- {self.name}: no log"


@dataclass
class Hosts:
    """Network namespaces on one bridge; ``up`` makes them, ``down`` removes them and every
    process in them (``ip netns pids``: whatever a process forked or daemonized stays in its
    namespace, so nothing escapes the sweep)."""

    dir: Path  # short: Ray's temp dirs and this test's /etc/gpulease
    logs: Path  # every process's output, kept by pytest after the run
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: str = ""
    ns: dict[str, str] = field(default_factory=dict)  # host -> namespace name
    addr: dict[str, str] = field(default_factory=dict)  # host -> its address on the bridge
    netns_ino: dict[str, int] = field(default_factory=dict)  # host -> its namespace's inode
    procs: list[Proc] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"glm{self.tag}b"

    def _free_subnet(self) -> str:
        used = ip("-4", "-o", "addr", "show").stdout + ip("-4", "route", "show").stdout
        for third in random.sample(range(1, 255), 254):
            prefix = f"10.77.{third}"
            if f"{prefix}." not in used:
                return prefix
        raise RuntimeError("no free 10.77.x.0/24 subnet")

    def up(self, hosts: list[str]) -> None:
        self.subnet = self._free_subnet()
        ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, host in enumerate(hosts):
            ns = f"glm-{self.tag}-{host}"
            ip("netns", "add", ns)
            self.ns[host] = ns
            veth = f"glm{self.tag}{i}"
            ip("link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            self.links.append(veth)
            ip("link", "set", veth + "p", "netns", ns)
            ip("-n", ns, "link", "set", veth + "p", "name", "eth0")
            self.addr[host] = f"{self.subnet}.{10 + i}"
            ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "set", veth, "master", self.bridge)
            ip("link", "set", veth, "up")
            self.netns_ino[host] = os.stat(f"/run/netns/{ns}").st_ino

    def env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("GPULEASE_", "RAY_"))}
        home = self.dir / "home"  # nothing a process here writes to $HOME lands in root's
        home.mkdir(exist_ok=True)
        base.update(PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", HOME=str(home), SVC_IP=self.addr["svc"])
        base.update(extra)
        return base

    def spawn(self, host: str, name: str, argv: list[str], env: dict[str, str], **kw: Any) -> Proc:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as f:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], *argv],
                env=env,
                stdout=kw.pop("stdout", f),
                stderr=f,
                stdin=kw.pop("stdin", subprocess.DEVNULL),
                start_new_session=True,
                **kw,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def script(self, host: str, name: str, exports: list[str], command: str, env: dict[str, str], **kw: Any) -> Proc:
        """Run one of the doc's commands the way a service manager would: its environment lines,
        then the command in the foreground (``exec``: the process is the command itself)."""
        text = "\n".join(["set -e", *exports, f"exec {command}"])
        return self.spawn(host, name, ["bash", "-c", text], env, **kw)

    def run(self, host: str, script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns[host], "bash", "-c", "set -euo pipefail\n" + script],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )

    def stop(self, proc: Proc, timeout: float = 10.0) -> None:
        if proc.popen.poll() is None:
            proc.popen.terminate()
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout)

    def kill_rest(self, host: str) -> None:
        """SIGKILL every process of ``host`` but the services started here that still run (what a
        failed Ray start left: its GCS holds its port, its agents rename themselves), and wait
        until they are gone."""
        keep = {p.popen.pid for p in self.procs if p.popen.poll() is None}

        def rest() -> list[int]:
            pids = ip("netns", "pids", self.ns[host], check=False).stdout.split()
            return [int(pid) for pid in pids if int(pid) not in keep]

        for pid in rest():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not rest() or None, 20, f"what a failed Ray start on {host} left exits")

    def _pids(self) -> list[int]:
        pids: list[int] = []
        for ns in self.ns.values():
            out = ip("netns", "pids", ns, check=False).stdout
            pids += [int(p) for p in out.split() if p.isdigit()]
        return pids

    def down(self) -> None:
        for p in self.procs:  # the kernel ends on EOF, releasing what it holds
            if p.popen.stdin is not None and p.popen.poll() is None:
                p.popen.stdin.close()
                try:
                    p.popen.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):  # nothing here needs saving
            pids = self._pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while self._pids() and time.monotonic() < deadline:
                time.sleep(0.1)  # processes of other parents: no exit event reaches us
        for p in self.procs:
            try:
                p.popen.wait(5)  # reap ours
            except subprocess.TimeoutExpired:
                pass
        for ns in self.ns.values():
            ip("netns", "del", ns, check=False)
        for link in reversed(self.links):  # a veth goes with its namespace; the bridge stays
            if ip("link", "show", link, check=False).returncode == 0:
                ip("link", "del", link, check=False)


class Driver:
    """The notebook kernel (tests/multihost_driver.py) in the service namespace."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="multihost-driver", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.popen.stdout is not None
        for raw in self.proc.popen.stdout:
            self.lines.put(raw.decode(errors="replace"))
        self.lines.put(None)

    def ask(self, request: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
        stdin = self.proc.popen.stdin
        assert stdin is not None
        stdin.write((json.dumps(request) + "\n").encode())
        stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"the kernel did not answer {request} within {timeout:g}s\n{self.proc.tail()}"
                ) from None
            assert line is not None, f"the kernel exited\n{self.proc.tail()}"
            if line.startswith(ANSWER):
                answer: dict[str, Any] = json.loads(line[len(ANSWER) :])
                return answer

    def cell(self, line: str, cell: str, names: Sequence[str] = (), timeout: float = 180.0) -> dict[str, Any]:
        answer = self.ask({"op": "cell", "line": line, "cell": cell, "names": list(names)}, timeout)
        assert answer["error"] is None, f"{answer['error']}\n{answer['stdout']}\n{self.proc.tail()}"
        return answer


@dataclass
class Cluster:
    hosts: Hosts
    url: str
    etc: Path  # the doc's /etc/gpulease
    agents: dict[str, Proc] = field(default_factory=dict)
    kernel: Driver | None = None

    def cell(self, line: str, cell: str, names: Sequence[str] = ()) -> dict[str, Any]:
        """Run a %%gpu_train cell in the notebook kernel on the service host."""
        assert self.kernel is not None
        return self.kernel.cell(line, cell, names)

    def status(self) -> str:
        """``gpulease status --wide``, as an admin runs it anywhere the lease server is reachable."""
        env = self.hosts.env(GPULEASE_URL=self.url, GPULEASE_TOKEN=self.token("admin"))
        done = subprocess.run(["gpulease", "status", "--wide"], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def token(self, name: str) -> str:
        return (self.etc / f"{name}-token").read_text().strip()

    def admin(self) -> Client:
        return Client(self.url, self.token("admin"), act_as="")

    def user(self, name: str) -> Client:
        return Client(self.url, self.token("hub"), act_as=name)  # as a Jupyter server under the hub

    def start_agent(self, host: str) -> Proc:
        exports, commands = split_exports(doc_block("gpu-host-env") + doc_block("gpu-host"))
        (agent,) = [c for c in commands if c.startswith("gpulease agent")]
        return self.hosts.script(
            host, f"agent-{host}", self.adapt(exports, host), self.adapt([agent], host)[0], self.hosts.env()
        )

    def adapt(self, lines: list[str], host: str) -> list[str]:
        """The doc's lines as they run on ``host`` here: this test's /etc/gpulease; on a GPU host,
        the agent's node name and declared GPUs; every Ray node its own temp dir."""
        out = []
        for line in lines:
            # The doc makes one agent token per GPU host (agent-token-HOST, copied to the host as
            # agent-token): here the hosts share one etc directory and have this test's names.
            line = line.replace("for host in gpu-01 gpu-02;", f"for host in {' '.join(HOSTS)};")
            if host in HOSTS:
                line = line.replace("/etc/gpulease/agent-token)", f"/etc/gpulease/agent-token-{host})")
            line = line.replace("/etc/gpulease", str(self.etc))
            if host in HOSTS:
                line = line.replace("gpulease agent", f"gpulease agent --node {host} --simulate {HOSTS[host]}")
            if line.startswith("ray start"):
                line += f" --temp-dir={self.hosts.dir / ('ray-' + host)}"
            out.append(line)
        return out


def start_ray(hosts: Hosts, host: str, exports: list[str], command: str, attempts: int = 3) -> Proc:
    """Start one of the doc's ``ray start --block`` commands and wait until its node runs. Like
    the service manager the doc runs it under, start it again if it fails: on a loaded machine a
    Ray node can give up on its own agents' start (Ray waits for them a fixed time)."""
    for attempt in range(1, attempts + 1):
        proc = hosts.script(host, f"ray-{host}-{attempt}", exports, command, hosts.env())
        deadline = time.monotonic() + 150
        while proc.popen.poll() is None and time.monotonic() < deadline:
            if "Ray runtime started" in proc.log.read_text(errors="replace"):
                return proc
            time.sleep(0.1)  # a starting process: nothing to wait on but its output
        hosts.stop(proc)
        hosts.kill_rest(host)
    raise AssertionError(f"the Ray node on {host} did not start in {attempts} attempts\n{proc.tail()}")


def _skip_without_namespaces() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the three hosts are Linux network namespaces (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip command for the network namespaces")
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl: docs/deploy.md makes Ray's token with it")
    tag = secrets.token_hex(3)
    probe, bridge, veth = f"glm-probe-{tag}", f"glm{tag}pb", f"glm{tag}pv"
    steps = [
        ["netns", "add", probe],
        ["netns", "exec", probe, "true"],
        ["link", "add", bridge, "type", "bridge"],
        ["link", "add", veth, "type", "veth", "peer", "name", veth + "p"],
    ]
    try:
        for step in steps:
            done = subprocess.run(["ip", *step], capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                pytest.skip(f"cannot make network namespaces here: ip {' '.join(step)}: {done.stderr.strip()}")
    finally:
        for link in (veth, bridge):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    _skip_without_namespaces()
    # Short: Ray's socket paths under its temp dir must stay under 108 bytes.
    hosts = Hosts(Path(tempfile.mkdtemp(prefix="glmh-")), tmp_path_factory.mktemp("multihost"))
    etc = hosts.dir / "etc"
    try:
        hosts.up(["svc", *HOSTS])
        svc = hosts.addr["svc"]
        url = f"http://{svc}:{SERVER_PORT}"
        env = hosts.env()

        # Redis: one plain redis-server where the doc has a primary, a replica and sentinels.
        (hosts.dir / "redis").mkdir()
        redis = hosts.spawn(
            "svc",
            "redis",
            [redis_server_binary(), "--port", "6379", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(hosts.dir / "redis")],
            env,
        )
        # The doc's lease server, its first line: on the proxy's port (it stands in for the proxy
        # and both replicas), with this Redis, and the doc's settings but replicas_ack (no replica).
        settings = tomllib.loads("\n".join(doc_block("config")))["server"]
        settings.pop("replicas_ack")
        settings.update(heartbeat_timeout=6, sweep_interval=0.2)  # a stopped agent shows within seconds
        etc.mkdir(mode=0o700)
        toml = "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
        (etc / "gpulease.toml").write_text("[server]\n" + toml.replace("/etc/gpulease", str(etc)))
        cl = Cluster(hosts, url, etc)
        exports, commands = split_exports(doc_block("lease-servers"))
        exports.append("export GPULEASE_REDIS_URL=redis://127.0.0.1:6379/0")
        command = cl.adapt(commands[:1], "svc")[0] + f" --host 0.0.0.0 --port {SERVER_PORT}"
        server = hosts.script("svc", "server", exports, command, env)

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 60, "the lease server answers", [redis, server])

        # The doc's tokens, on the service host.
        done = hosts.run("svc", "\n".join(cl.adapt(doc_block("tokens"), "svc")), env)
        assert done.returncode == 0, f"the doc's token commands failed:\n{done.stdout}\n{done.stderr}"

        # The doc's Ray head, then each GPU host's two services.
        exports, (head_cmd,) = split_exports(doc_block("ray-head"))
        start_ray(hosts, "svc", cl.adapt(exports, "svc"), cl.adapt([head_cmd], "svc")[0])
        host_exports, commands = split_exports(doc_block("gpu-host-env") + doc_block("gpu-host"))
        (ray_worker,) = [c for c in commands if c.startswith("ray start")]
        assert len(commands) == 2, f"the doc's GPU host runs {commands}: this test knows ray start and gpulease agent"
        for host in HOSTS:  # one at a time: a Ray node starting is a burst of CPU
            cl.agents[host] = cl.start_agent(host)
            start_ray(hosts, host, cl.adapt(host_exports, host), cl.adapt([ray_worker], host)[0])

        def nodes_up() -> bool:
            with cl.admin() as c:
                return {n["name"] for n in c.cluster()["nodes"] if n["state"] == "up"} == set(HOSTS)

        wait_until(nodes_up, 60, "both GPU hosts' agents declare their nodes", list(cl.agents.values()))

        # The notebook kernel, with the environment JupyterHub gives it (the doc, the README's
        # recipe): the lease server's URL, the proxy token and its user; nothing for Ray.
        kernel = hosts.spawn(
            "svc",
            "kernel",
            [sys.executable, "-u", str(ROOT / "tests" / "multihost_driver.py")],
            # (warm cells off: these cells are about placement, each on a lease of its own)
            hosts.env(GPULEASE_URL=url, GPULEASE_TOKEN=cl.token("hub"), GPULEASE_USER="alice", GPULEASE_WARM="off"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=str(ROOT),
        )
        cl.kernel = Driver(kernel)
        joined = cl.kernel.ask({"op": "ray"})
        assert "error" not in joined, f"{joined}\n" + "\n".join(p.tail() for p in hosts.procs)
        assert {f"gpulease_node_{h}" for h in HOSTS} <= set(joined["resources"]) and joined["pinned"], joined
        yield cl
    finally:
        hosts.down()
        for ray_dir in hosts.dir.glob("ray-*/session_latest/logs"):  # Ray's own logs, kept by pytest
            shutil.copytree(ray_dir, hosts.logs / ray_dir.parts[-3], ignore_dangling_symlinks=True)
        shutil.rmtree(hosts.dir, ignore_errors=True)


def free_gpus(cl: Cluster) -> int:
    with cl.admin() as c:
        return int(c.cluster()["pools"][POOL]["free"])


WHERE_CELL = """
import os, ray
node = os.environ["GPULEASE_NODE"]
lease_id = os.environ["GPULEASE_LEASE_ID"]
cuda = os.environ["CUDA_VISIBLE_DEVICES"]
ip = ray.util.get_node_ip_address()
netns = os.stat("/proc/self/ns/net").st_ino
"""


# ---- tests ---------------------------------------------------------------------------------------


def gpu_rows(status: str, host: str) -> list[str]:
    """The rows of ``gpulease status --wide``'s GPU table that are ``host``'s GPUs."""
    return [ln for ln in status.splitlines() if re.search(rf"\b{host}\b", ln)]


def test_a_call_runs_on_the_host_of_its_lease(cluster: Cluster) -> None:
    cl, hosts = cluster, cluster.hosts
    status = cl.status()  # the doc's check: every GPU of both hosts, free
    for host, spec in HOSTS.items():
        rows = gpu_rows(status, host)
        assert len(rows) == int(spec.split("x")[0]) and all(" free " in r for r in rows), status

    # The doc's first cell: it prints the lease's node and the address of the host it ran on.
    first = doc_block("first-cell")
    assert first[0].startswith("%%gpu_train ")
    out = cl.cell(first[0].removeprefix("%%gpu_train "), "\n".join(first[1:]))["stdout"]
    printed = [ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in HOSTS]
    assert len(printed) == 1 and printed[0] == [printed[0][0], hosts.addr[printed[0][0]]], out
    assert "released; GPU memory freed" in out, out

    # 1 GPU: best fit puts it on gpu-a (2 GPUs); 3 GPUs fit only on gpu-b (4 GPUs).
    seen = {}
    for gpus in (1, 3):
        where = cl.cell(f"--gpus {gpus} --wait 60", WHERE_CELL, ["node", "lease_id", "cuda", "ip", "netns"])["names"]
        with cl.admin() as c:
            lease = c.get(where["lease_id"])
        node = where["node"]
        assert lease["node"] == node and lease["state"] == "released", lease
        assert where["ip"] == hosts.addr[node], where  # Ray placed it on that host's node...
        assert where["netns"] == hosts.netns_ino[node], where  # ...and its process lives there
        assert where["cuda"] == ",".join(str(g["index"]) for g in lease["gpus"]), (where, lease)
        seen[gpus] = node
    assert seen == {1: "gpu-a", 3: "gpu-b"}
    assert free_gpus(cl) == 6


def test_a_stopped_agent_takes_its_host_out_of_service(cluster: Cluster) -> None:
    cl = cluster
    watcher = EventWatcher(cl.url, cl.token("admin")).start()
    held = []
    with cl.admin() as admin, cl.user("bob") as bob:
        try:
            cl.hosts.stop(cl.agents["gpu-a"])  # the doc: "Stop its gpulease agent"
            watcher.wait_for(lambda e: e["type"] == "node_down" and e.get("node") == "gpu-a", 30, "gpu-a down")
            (node,) = [n for n in admin.cluster()["nodes"] if n["name"] == "gpu-a"]
            assert node["state"] == "down" and {g["state"] for g in node["gpus"]} == {"down"}, node
            rows = gpu_rows(cl.status(), "gpu-a")
            assert len(rows) == 2 and all(" down " in r for r in rows), rows

            held.append(bob.acquire(4, wait=0))  # all of gpu-b
            assert held[0].node == "gpu-b"
            with pytest.raises(errors.NoCapacity):  # gpu-a's 2 idle GPUs are not granted while it is down
                bob.acquire(1, wait=0)

            cl.agents["gpu-a"] = cl.start_agent("gpu-a")  # the doc: "Start the agent again"
            watcher.wait_for(
                lambda e: e["type"] in ("node_up", "node_registered") and e.get("node") == "gpu-a", 60, "gpu-a up"
            )
            held.append(bob.acquire(1, wait=10))
            assert held[1].node == "gpu-a"
        finally:
            for lease in held:
                bob.release(lease)
            if cl.agents["gpu-a"].popen.poll() is not None:  # the next test needs both hosts
                cl.agents["gpu-a"] = cl.start_agent("gpu-a")
    assert free_gpus(cl) == 6


GANG_CELL = """
import json, os, socket, time, ray
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
peers = {}
if rank == 0:  # what torch.distributed's rendezvous needs: every rank reaches MASTER_ADDR:MASTER_PORT
    with socket.create_server(master) as server:
        server.settimeout(60)
        while len(peers) < world - 1:
            conn, (peer_ip, _) = server.accept()
            with conn:
                peers[conn.recv(8).decode()] = peer_ip
else:
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(master, timeout=5) as conn:
                conn.sendall(str(rank).encode())
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
print(json.dumps({
    "rank": rank, "node": os.environ["GPULEASE_NODE"], "lease": os.environ["GPULEASE_LEASE_ID"],
    "cuda": os.environ["CUDA_VISIBLE_DEVICES"], "ip": ray.util.get_node_ip_address(),
    "netns": os.stat("/proc/self/ns/net").st_ino, "master": master[0],
}))
"""


def test_a_gang_spans_both_hosts(cluster: Cluster) -> None:
    cl, hosts = cluster, cluster.hosts
    answer = cl.cell("--gpus 4 --nodes 2 --wait 60 --out peers", GANG_CELL, ["peers"])
    ranks = {}
    for m in re.finditer(r"^\[rank (\d)\] (\{.*\})$", answer["stdout"], re.M):
        ranks[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(ranks) == [0, 1, 2, 3], answer["stdout"]
    with cl.admin() as c:
        lease = c.get(ranks[0]["lease"])
    assert sorted(lease["nodes"]) == sorted(HOSTS) and lease["state"] == "released", lease
    assert sorted(r["node"] for r in ranks.values()) == ["gpu-a", "gpu-a", "gpu-b", "gpu-b"]
    for r in ranks.values():
        node = r["node"]
        assert r["ip"] == hosts.addr[node] and r["netns"] == hosts.netns_ino[node], r
        assert r["cuda"] == ",".join(str(g["index"]) for g in lease["gpus"] if g["node"] == node), (r, lease)
        assert r["master"] == hosts.addr[ranks[0]["node"]], r
    # Every other rank reached rank 0 over the bridge, from its own host's address.
    assert answer["names"]["peers"] == {str(k): hosts.addr[ranks[k]["node"]] for k in (1, 2, 3)}, answer
    assert free_gpus(cl) == 6


def test_agent_prints_the_ray_resources_of_its_nodes() -> None:
    """What the doc's GPU host passes to ``ray start --resources`` (no namespace needed for this)."""
    cmd = [sys.executable, "-m", "lease_server.cli", "agent", "--simulate", "2xA100-80GB", "--node", "gpu-01"]
    cmd += ["--cpu-slots", "4", "--print-ray-resources"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"gpulease_node_gpu-01": 1000, "gpulease_node_gpu-01-cpu": 1000}
