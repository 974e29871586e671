"""GPU isolation by the OS (lease_server/node/cgroup.py): a lease's worker in its cgroup gets EPERM
opening a GPU it did not lease, whatever ``CUDA_VISIBLE_DEVICES`` says.

Real cgroups (v1's devices controller under /sys/fs/cgroup; v2 on a cgroup2 mounted in a temporary
directory) and real device nodes made with mknod: ``nvidia0`` (195:0), ``nvidia1`` (195:1) and
``nvidiactl`` (195:255). No driver owns major 195 here, so an open the cgroup lets through fails
with ENXIO (or ENODEV): "not refused". EPERM is the cgroup's refusal. Every cgroup, mount and node
made is removed at the end, also when a test fails."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from lease_server.node.cgroup import V1, V2, DeviceIsolation, Unavailable, gpu_minors

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and mknod need root: not root here"),
    pytest.mark.exclusive("cgroup"),  # the host's gpulease cgroup: one test at a time (tests/conftest.py)
]

LEASE, OTHER = "l-00000000000000aa", "l-00000000000000bb"
# Waits for "go" (the test places it first), tries each node, reports, forks a child that does the
# same and waits on stdin (so the test can see it in the cgroup), then waits for that child.
WORKER = """
import json, os, sys
def report(who):
    opens = {}
    for name in sys.argv[1:]:
        try:
            os.close(os.open(name, os.O_RDWR))
            opens[os.path.basename(name)] = 0
        except OSError as exc:
            opens[os.path.basename(name)] = exc.errno
    cgroups = open("/proc/self/cgroup").read().splitlines()
    print(json.dumps({"who": who, "pid": os.getpid(), "opens": opens, "cgroups": cgroups}), flush=True)
os.read(0, 3)
report("worker")
child = os.fork()
if child == 0:
    report("child")
    os.read(0, 1)
    os._exit(0)
os.waitpid(child, 0)
"""


@pytest.fixture
def nodes() -> Iterator[str]:
    """A directory with nvidia0, nvidia1 (minor 1) and nvidiactl (195:255) in it."""
    with tempfile.TemporaryDirectory(prefix="gpulease-dev-") as d:
        for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
            os.mknod(os.path.join(d, name), stat.S_IFCHR | 0o666, os.makedev(195, minor))
        yield d


def _wait_gone(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it has exited (its pidfd turns readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], 10)
    finally:
        os.close(fd)


def _teardown(iso: DeviceIsolation) -> None:
    """End every process left in the test's lease cgroups, then remove them and the base."""
    for lease in iso.leases():
        for _ in range(10):  # a process may fork while being killed: look again
            pids = iso.pids(lease)
            if not pids:
                break
            for pid in pids:
                _wait_gone(pid)
        iso.remove(lease)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(iso.base)


@pytest.fixture(params=["v1", "v2"])
def iso(request: pytest.FixtureRequest) -> Iterator[DeviceIsolation]:
    """The isolation of each kind, on a cgroup base of its own (``gpulease-test-<random>``)."""
    name = f"gpulease-test-{uuid.uuid4().hex[:8]}"
    if request.param == "v1":
        if not os.path.exists("/sys/fs/cgroup/devices/devices.deny"):
            pytest.skip("no cgroup v1 devices controller at /sys/fs/cgroup/devices")
        got = DeviceIsolation.detect("/sys/fs/cgroup", name)
        assert isinstance(got, DeviceIsolation), got
        assert got.kind == V1
        try:
            yield got
        finally:
            _teardown(got)
        return
    mnt = tempfile.mkdtemp(prefix="gpulease-cg2-")
    try:
        out = subprocess.run(["mount", "-t", "cgroup2", "none", mnt], capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"cannot mount cgroup2 here: {out.stderr.strip() or out.returncode}")
        try:
            got = DeviceIsolation.detect(mnt, name)
            if isinstance(got, Unavailable):
                pytest.skip(f"cgroup v2 device programs unavailable here: {got.reason}")
            assert got.kind == V2
            try:
                yield got
            finally:
                _teardown(got)
        finally:
            subprocess.run(["umount", mnt], check=True)
    finally:
        os.rmdir(mnt)


class Worker:
    """A WORKER process, stopped at its first line until :meth:`go`."""

    def __init__(self, nodes: str) -> None:
        paths = [os.path.join(nodes, n) for n in ("nvidia0", "nvidia1", "nvidiactl")]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, *paths], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pid = self.proc.pid

    def go(self) -> dict[str, dict[str, Any]]:
        """Let it open the nodes; both reports ({who: {pid, opens, cgroups}}), the child still alive."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        reports = [json.loads(self.proc.stdout.readline()) for _ in range(2)]
        return {r["who"]: r for r in reports}

    def finish(self) -> None:
        """Close its stdin (the child exits), reap it: afterwards nothing of it remains."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=10) == 0

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def workers(nodes: str) -> Iterator[Any]:
    started: list[Worker] = []

    def start() -> Worker:
        w = Worker(nodes)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def refused(err: int) -> bool:
    """EPERM is the cgroup's answer; ENXIO/ENODEV (no driver) or a success means it let the open through."""
    assert err in (0, errno.EPERM, errno.ENXIO, errno.ENODEV), os.strerror(err)
    return err == errno.EPERM


def test_a_lease_opens_its_gpu_and_not_another(iso: DeviceIsolation, nodes: str, workers: Any) -> None:
    # Outside any lease cgroup nothing is refused: the EPERM below is the cgroup's doing.
    for name in ("nvidia0", "nvidia1"):
        with pytest.raises(OSError) as outside:
            os.open(os.path.join(nodes, name), os.O_RDWR)
        assert not refused(outside.value.errno or 0)

    w = workers()
    iso.place(LEASE, w.pid, [0])
    got = w.go()
    for who in ("worker", "child"):  # the child was forked after the placement
        opens = got[who]["opens"]
        assert refused(opens["nvidia1"]), (who, opens)
        assert not refused(opens["nvidia0"]), (who, opens)
        assert not refused(opens["nvidiactl"]), (who, opens)
        assert any(line.endswith(f"/{LEASE}") for line in got[who]["cgroups"]), got[who]["cgroups"]
    assert iso.pids(LEASE) == sorted([w.pid, got["child"]["pid"]])
    assert iso.leases() == [LEASE]

    # Busy while a process remains; once they are gone, removed (and again: no error).
    with pytest.raises(OSError) as busy:
        iso.remove(LEASE)
    assert busy.value.errno == errno.EBUSY
    w.finish()
    assert iso.pids(LEASE) == []
    iso.remove(LEASE)
    iso.remove(LEASE)
    assert iso.leases() == [] and not os.path.exists(os.path.join(iso.base, LEASE))


def test_each_lease_its_own_rules_and_placing_again_rewrites_them(
    iso: DeviceIsolation, nodes: str, workers: Any
) -> None:
    a, b = workers(), workers()
    iso.place(LEASE, a.pid, [0])
    iso.place(OTHER, b.pid, [1])
    assert iso.leases() == sorted([LEASE, OTHER])
    got_a, got_b = a.go()["worker"]["opens"], b.go()["worker"]["opens"]
    assert refused(got_a["nvidia1"]) and not refused(got_a["nvidia0"])
    assert refused(got_b["nvidia0"]) and not refused(got_b["nvidia1"])
    a.finish()
    b.finish()

    # The lease moves to GPU 1 (and to GPUs 0 and 1): the rules written before are replaced.
    c = workers()
    iso.place(LEASE, c.pid, [1])
    got_c = c.go()["worker"]["opens"]
    assert refused(got_c["nvidia0"]) and not refused(got_c["nvidia1"])
    c.finish()
    d = workers()
    iso.place(LEASE, d.pid, [0, 1])
    got_d = d.go()["worker"]["opens"]
    assert not refused(got_d["nvidia0"]) and not refused(got_d["nvidia1"])
    d.finish()


def test_place_checks_what_it_is_given(iso: DeviceIsolation, workers: Any) -> None:
    w = workers()
    for bad in ("../x", "l-", "l-XYZ", "L-00aa", "l-00/aa", "", "l-00aa\n"):
        with pytest.raises(ValueError):
            iso.place(bad, w.pid, [0])
    for pid in (0, 1, -5, os.getpid()):
        with pytest.raises(ValueError):
            iso.place(LEASE, pid, [0])
    with pytest.raises(ValueError):
        iso.place(LEASE, w.pid, [-1])
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(ProcessLookupError):
        iso.place(LEASE, gone.pid, [0])
    assert iso.leases() == []


def test_minor_read_from_the_device_node(nodes: str) -> None:
    # NVML's index 7 whose node has minor 1: the node decides; no node: the index.
    os.mknod(os.path.join(nodes, "nvidia7"), stat.S_IFCHR | 0o666, os.makedev(195, 1))
    assert gpu_minors([7, 0, 3], nodes) == {1, 0, 3}


def test_unavailable_says_why(tmp_path: Any) -> None:
    got = DeviceIsolation.detect(str(tmp_path))  # neither a devices controller nor cgroup2 there
    assert isinstance(got, Unavailable) and "no cgroup v1 devices controller nor cgroup2" in got.reason
    # Not root: a forked copy of this process, turned into user nobody, asks.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            got = DeviceIsolation.detect()
            os.write(w, (got.reason if isinstance(got, Unavailable) else repr(got)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read()
    os.waitpid(pid, 0)
    assert said.startswith("not root: GPU device isolation is off"), said


def test_a_mig_instances_process_opens_its_gpus_node_and_not_another(
    iso: DeviceIsolation, nodes: str, workers: Any
) -> None:
    """A MIG node's GPU indexes are its instances': the agent confines a process that claims one to
    the device node of the instance's GPU (its parent), not to the node of the same number."""
    from lease_server.leasing.inventory import Gpu, NodeInventory
    from lease_server.node.agent import Isolation
    from lease_server.node.claims import Claim, Peer

    mig = NodeInventory(
        "box-mig-1g.10gb",
        "A100-MIG-1g.10gb",
        [Gpu(0, "MIG-a", "m", 9728), Gpu(1, "MIG-b", "m", 9728)],
        "nvml",
        extra={"mig_parent": {0: 1, 1: 1}},
    )
    isolation = Isolation("off", [mig])
    isolation.cgroups = iso
    w = workers()
    isolation.place(Claim(mig.node, LEASE, 1, "token", "", (0,)), Peer(w.pid, os.getuid(), 0))
    opens = w.go()["worker"]["opens"]
    assert not refused(opens["nvidia1"]) and refused(opens["nvidia0"]), opens
    w.finish()
    iso.remove(LEASE)
