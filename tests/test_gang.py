"""Multi-node gangs on a real Ray cluster (the tests' Ray head, serving two lease-server nodes
through their ``gpulease_node_<node>`` resources; tests/test_multihost.py runs a gang across two
real hosts) and a real lease server with simulated GPUs: all ranks start or none, every rank sees its node's
leased GPUs and the torch.distributed variables, and one rank dying ends all and frees every GPU."""

from __future__ import annotations

import importlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lease_server import errors
from magics import runner
from magics.calls import Call
from magics.runner import CallResult, GpuTrainError, Options, RecordingUI, Session

ray = pytest.importorskip("ray")
# magics.session is also the name of the function the package exports: take the module itself.
session_module = importlib.import_module("magics.session")

NODES = "n1=2xA100-80GB,n2=2xA100-80GB"
ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "GPULEASE_LEASE_ID",
    "GPULEASE_NODE",
    "GPULEASE_GPU_UUIDS",
)


@pytest.fixture(scope="module")
def cluster(ray_head: Any) -> Iterator[Any]:
    """The tests' Ray head (conftest's ``ray_head``), which carries the ``gpulease_node_<node>``
    resources of n1 and n2: each rank is placed by its node's resource, as on two hosts."""
    from ray import cloudpickle

    # The rank functions below travel by value: the Ray workers need not import this test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray_head
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def srv(cluster: Any, server_factory: Any) -> Any:
    return server_factory(NODES, ray_address=cluster.address, ray_auth_token_file=str(cluster.token))


@pytest.fixture
def sess(srv: Any) -> Iterator[Session]:
    s = Session()
    s.defaults.url = srv.url
    s.defaults.token = srv.token("alice")
    yield s
    s.release_all()
    s.reset_client()


def run(sess: Session, fn: Any, *args: Any, ui: Any = None, **opts: Any) -> CallResult:
    return runner.run_call(Call.function(fn, *args), Options(**opts), ui or RecordingUI(), sess)


def free_gpus(srv: Any) -> int:
    with srv.client("alice") as c:
        return int(c.cluster()["pools"]["A100-80GB"]["free"])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")  # zombie, or being reaped
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    """The pids still alive after ``timeout`` (a killed process's exit has no event to wait on here)."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def ray_node_of(node: str) -> str:
    (node_id,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and runner.node_resource(node) in n["Resources"]]
    return node_id  # type: ignore[no-any-return]


# ---- what the ranks run (pickled by value) ------------------------------------------------------


def report_env() -> dict[str, Any]:
    import os

    import ray

    env: dict[str, Any] = {k: os.environ.get(k) for k in ENV_KEYS}
    env["pid"] = os.getpid()
    env["ray_node"] = ray.get_runtime_context().get_node_id()
    print(f"hello from rank {env['RANK']}", flush=True)
    print("partial ", end="", flush=True)
    print("line", flush=True)
    return env


def mark(marker_dir: str) -> int:
    import os
    from pathlib import Path

    Path(marker_dir, f"rank-{os.environ['RANK']}").write_text(str(os.getpid()))
    return int(os.environ["RANK"])


def die_on_rank_1(marker_dir: str) -> None:
    import os
    import time
    from pathlib import Path

    import magics.worker

    # Without the lease watchdog (it would end this process after the release anyway), only the
    # driver's kill can stop the ranks that are still running: that is what this test checks.
    magics.worker._die = lambda lease_id, why: None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    d = Path(marker_dir)
    print("pid", os.getpid(), flush=True)  # before its marker: printed by all once rank 1 dies
    (d / f"pid-{rank}.tmp").write_text(str(os.getpid()))
    (d / f"pid-{rank}.tmp").rename(d / f"pid-{rank}")
    if rank == 1:
        # Die only once every rank is running, so that the others really have to be stopped.
        deadline = time.monotonic() + 60
        while len(list(d.glob("pid-?"))) < world and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), 9)
    time.sleep(120)


def sleep_long(marker_dir: str) -> None:
    import os
    import time
    from pathlib import Path

    import magics.worker

    magics.worker._die = lambda lease_id, why: None  # only the driver may stop this process
    rank = os.environ["RANK"]
    Path(marker_dir, f"pid-{rank}.tmp").write_text(str(os.getpid()))
    Path(marker_dir, f"pid-{rank}.tmp").rename(Path(marker_dir, f"pid-{rank}"))
    time.sleep(120)


def gloo_all_reduce() -> float:
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        t = torch.tensor([float(os.environ["RANK"]) + 1.0])
        dist.all_reduce(t)
        assert dist.get_world_size() == int(os.environ["WORLD_SIZE"])
        return float(t.item())
    finally:
        dist.destroy_process_group()


# ---- tests ---------------------------------------------------------------------------------------


def test_two_node_gang_runs_every_rank_with_its_env(srv, sess):
    ui = RecordingUI()
    outcome = run(sess, report_env, gpus=4, nodes=2, wait=0, all_ranks=True, ui=ui)
    envs = outcome.value
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    with srv.client("alice") as c:
        lease = c.get(outcome.lease_id)
    assert lease["state"] == "released" and sorted(lease["nodes"]) == ["n1", "n2"]
    by_node: dict[str, list[dict[str, Any]]] = {}
    for e in envs:
        by_node.setdefault(e["GPULEASE_NODE"], []).append(e)
    assert sorted(by_node) == ["n1", "n2"]
    for node, ranks in by_node.items():
        leased = [g for g in lease["gpus"] if g["node"] == node]
        assert sorted(e["LOCAL_RANK"] for e in ranks) == ["0", "1"]
        assert {e["LOCAL_WORLD_SIZE"] for e in ranks} == {"2"}
        assert {e["CUDA_VISIBLE_DEVICES"] for e in ranks} == {",".join(str(g["index"]) for g in leased)}
        assert {e["GPULEASE_GPU_UUIDS"] for e in ranks} == {",".join(g["uuid"] for g in leased)}
        assert {e["ray_node"] for e in ranks} == {ray_node_of(node)}  # placed on the node's Ray node
    assert {e["GPULEASE_LEASE_ID"] for e in envs} == {outcome.lease_id}
    assert len({e["pid"] for e in envs}) == 4  # one process per GPU
    text = "".join(t for s, t in ui.out if s == "stdout")
    for rank in range(4):
        assert f"[rank {rank}] hello from rank {rank}\n" in text
        assert f"[rank {rank}] partial line\n" in text
    ending = ui.ending
    assert ending.state == "released" and ending.gpus == 4 and ending.verified
    assert free_gpus(srv) == 4
    assert wait_gone([e["pid"] for e in envs]) == []


def test_run_on_gpus_returns_rank_0s_value(srv, sess, monkeypatch):
    monkeypatch.setattr(session_module, "_session", sess)
    assert runner.run_on_gpus(report_env, gpus=4, nodes=2, wait=5)["RANK"] == "0"
    for bad in ({"gpus": 0}, {"gpus": "2-4"}, {"gpus": 3}, {}):
        with pytest.raises(ValueError):
            runner.run_on_gpus(report_env, nodes=2, **bad)
    sess.wait_background()  # run_on_gpus returns the value first; its verified release follows
    assert free_gpus(srv) == 4


def test_gang_is_all_or_nothing(srv, sess, tmp_path):
    with srv.client("bob") as bob:
        blocker = bob.acquire(2, wait=0)  # one whole node: only 2 GPUs on one node stay free
        with pytest.raises(errors.NoCapacity):
            run(sess, mark, str(tmp_path), gpus=4, nodes=2, wait=0)
        assert list(tmp_path.iterdir()) == []  # no rank ever started
        assert free_gpus(srv) == 2 and [x["user"] for x in bob.leases(everyone=True)] == ["bob"]
        bob.release(blocker)
    # Ray's side is all or nothing too: with room for one rank on n2 only, no rank starts.
    from ray.util import placement_group, placement_group_table, remove_placement_group

    hog = placement_group([{runner.node_resource("n2"): 1000 - runner.GANG_BUNDLE_SHARE}])
    assert hog.wait(30)
    sess.gang_start_timeout = 2.0
    try:
        with pytest.raises(GpuTrainError, match="could not place all 4 ranks") as err:
            run(sess, mark, str(tmp_path), gpus=4, nodes=2, wait=0)
    finally:
        remove_placement_group(hog)
    assert list(tmp_path.iterdir()) == []
    assert free_gpus(srv) == 4
    gang_pgs = [p for p in placement_group_table().values() if p["name"].startswith("gpulease-")]
    assert gang_pgs and {p["state"] for p in gang_pgs} == {"REMOVED"}, err.value
    # With room again the same gang runs, every rank.
    sess.gang_start_timeout = runner.GANG_START_TIMEOUT_S
    assert run(sess, mark, str(tmp_path), gpus=4, nodes=2, wait=0, all_ranks=True).value == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank-{r}" for r in range(4)]


def test_a_worker_ray_cannot_start_fails_its_cell_and_frees_the_gpu(srv, sess, tmp_path):
    """A one-node cell whose worker Ray cannot place (here its node's resource is all held, as
    anyone with the Ray token can) used to wait, holding its lease, until someone stopped it."""
    from ray.util import placement_group, remove_placement_group

    sess.connect_ray()  # (this driver joins the tests' Ray head, as a cell's would, before it asks Ray)
    hog = placement_group([{runner.node_resource(n): 1000} for n in ("n1", "n2")], strategy="SPREAD")
    assert hog.wait(30)
    sess.worker_start_timeout = 2.0
    try:
        with pytest.raises(GpuTrainError, match="Ray did not start this cell's worker on n[12] within 2s"):
            run(sess, mark, str(tmp_path), gpus=1, wait=0)
    finally:
        remove_placement_group(hog)
        sess.worker_start_timeout = runner.WORKER_START_TIMEOUT_S
    assert list(tmp_path.iterdir()) == []
    sess.wait_background()
    assert free_gpus(srv) == 4
    assert run(sess, report_env, gpus=1, wait=0).value["CUDA_VISIBLE_DEVICES"]  # with room again, it runs


def test_killing_one_rank_ends_all_and_frees_every_gpu(srv, sess, tmp_path):
    ui = RecordingUI()
    t0 = time.monotonic()
    with pytest.raises(GpuTrainError) as err:
        run(sess, die_on_rank_1, str(tmp_path), gpus=4, nodes=2, wait=0, ui=ui)
    assert time.monotonic() - t0 < 60  # not the other ranks' 120 s sleep
    e = err.value
    assert e.rank == 1 and e.node in ("n1", "n2")
    assert f"rank 1 on {e.node}" in str(e) and "exited unexpectedly" in str(e) and "every rank was stopped" in str(e)
    pids = {int(p.name.split("-")[1]): int(p.read_text()) for p in tmp_path.glob("pid-?")}
    assert sorted(pids) == [0, 1, 2, 3]
    shown = "".join(t for _, t in ui.out)
    for rank in (0, 2, 3):
        assert f"[rank {rank}] pid {pids[rank]}\n" in shown
    assert wait_gone(list(pids.values())) == []  # every rank's process is gone
    assert free_gpus(srv) == 4
    with srv.client("alice") as c:
        assert [x for x in c.leases() if x["state"] == "active"] == []


def test_torch_distributed_gloo_all_reduce(srv, sess):
    pytest.importorskip("torch")
    values = run(sess, gloo_all_reduce, gpus=4, nodes=2, wait=0, all_ranks=True, timeout=120).value
    assert values == [10.0, 10.0, 10.0, 10.0]  # 1 + 2 + 3 + 4 on every rank
    assert free_gpus(srv) == 4


def test_timeout_and_interrupt_stop_every_rank(srv, sess, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    t0 = time.monotonic()
    with pytest.raises(runner.GpuTrainTimeout, match="every rank was stopped"):
        run(sess, sleep_long, str(d), gpus=4, nodes=2, wait=0, timeout=5)
    assert time.monotonic() - t0 < 60
    pids = [int(p.read_text()) for p in d.glob("pid-?")]
    assert len(pids) == 4 and wait_gone(pids) == []
    assert free_gpus(srv) == 4

    # Ctrl-C in the notebook: a KeyboardInterrupt in the driver while the ranks run.
    d = tmp_path / "i"
    d.mkdir()

    def interrupt_once_all_run() -> None:
        deadline = time.monotonic() + 60
        while len(list(d.glob("pid-?"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)  # the ranks' pid files are the only sign that they run
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    t = threading.Thread(target=interrupt_once_all_run, daemon=True)
    # SIGINT raises KeyboardInterrupt, as in a kernel (an earlier test in this process may have left
    # another handler installed: then the interrupt never arrives and the ranks run their 120 s).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        t.start()
        with pytest.raises(KeyboardInterrupt):
            run(sess, sleep_long, str(d), gpus=4, nodes=2, wait=0)
        t.join(10)
    finally:
        signal.signal(signal.SIGINT, before)
    pids = [int(p.read_text()) for p in d.glob("pid-?")]
    assert len(pids) == 4 and wait_gone(pids) == []
    assert free_gpus(srv) == 4


def test_gpu_train_magic_with_nodes(srv, sess, monkeypatch, capsys):
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import start_ipython

    from magics.magic import GpuMagics

    monkeypatch.setattr(session_module, "_session", sess)
    ip = start_ipython()
    assert ip is not None
    magics = GpuMagics(ip)
    result = magics.gpu_train(
        "--gpus 4 --nodes 2 --wait 10s",
        "import os\nrank = os.environ['RANK']\nworld = int(os.environ['WORLD_SIZE'])\nprint('hi', rank)\nworld * 10",
    )
    assert result == 40 and ip.user_ns["rank"] == "0" and ip.user_ns["world"] == 4  # rank 0's names
    out, err = capsys.readouterr()
    for rank in range(4):
        assert f"[rank {rank}] hi {rank}\n" in out
    assert "held 4 GPUs on n" in out and "(GPU 0,1) + n" in out and "released; GPU memory freed" in out
    assert free_gpus(srv) == 4
    for line, expect in [
        ("--gpus 0 --nodes 2", "--gpus 0 leases none"),
        ("--gpus 2-4 --nodes 2", "not a range"),
        ("--gpus 3 --nodes 2", "not a multiple"),
        ("--nodes 2", "needs --gpus N"),
        ("--gpus 2 --nodes 0", ">= 1"),
    ]:
        with pytest.raises(UsageError, match=expect):
            magics.gpu_train(line, "x = 1")


def train_until_preempted() -> str:
    import time

    import magics

    state = {"step": 0}
    magics.on_preempt(lambda: dict(state))
    while not magics.preempted():
        state["step"] += 1
        time.sleep(0.005)
    return "stopped"


def test_above_quota_call_is_preempted_and_its_checkpoint_hook_returns_state(cluster: Any, server_factory: Any) -> None:
    """Issue 6's quota test end to end: alice's second GPU is above her quota of 1, so her call runs
    preemptible; bob (within quota) asks; the call's on_preempt hook runs during the notice, the
    loop stops, and the state comes back to alice's session while bob gets the GPUs."""
    from tests.api_helpers import EventWatcher

    srv = server_factory(
        "n1=2xA100-80GB",
        ray_address=cluster.address,
        ray_auth_token_file=str(cluster.token),
        scheduling={"A100-80GB": {"quota": {"*": 1}, "preempt_notice": 15}},  # ample under load: it ends at notice
    )
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    s = Session()
    s.defaults.url, s.defaults.token = srv.url, srv.token("alice")
    within = srv.client("alice").acquire(1, ttl=60)
    assert not within.raw.get("preemptible")
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["outcome"] = run(s, train_until_preempted, gpus=1, wait=30)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            out["error"] = exc

    t = threading.Thread(target=call)
    t.start()
    try:
        granted = watcher.wait_for(lambda e: e["type"] == "grant" and e.get("preemptible"), 60, "preemptible grant")
        bob = srv.client("bob").acquire(1, wait=30, ttl=60)
        t.join(60)
        assert "error" not in out, out
        assert out["outcome"].value == "stopped"
        notice = watcher.wait_for(lambda e: e["type"] == "preempt_notice", 20, "preempt_notice")
        assert notice["lease"] == granted["lease"] and notice["requested_by"] == "bob"
        assert out["outcome"].has_checkpoint and out["outcome"].checkpoint["step"] > 0
        assert bob.node == "n1" and srv.client("bob").get(within.id)["state"] == "active"
    finally:
        t.join(60)
        s.release_all()
        s.reset_client()
