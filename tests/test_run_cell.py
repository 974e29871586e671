"""run_cell without a kernel: a plain dict is the notebook, against `gpulease up` (real Ray, Redis,
lease server; simulated GPUs). Names in and out, the last expression, errors, Stop."""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lease_server import errors
from lease_server.client import Client
from lease_server.procs import alive as _alive
from lease_server.sizes import show_duration
from magics.runner import (
    GpuTrainError,
    GpuTrainStopped,
    Options,
    RecordingUI,
    Running,
    Session,
    Waiting,
    describe_end,
    run_cell,
)
from tests.conftest import Stack, Up, ray_session

ray = pytest.importorskip("ray")


STACK = Stack.of("box=2xA100-80GB", GPULEASE_DEFAULT_TTL="3")  # conftest's `up`


@pytest.fixture
def sess(up: Up) -> Iterator[Session]:
    yield from ray_session(up)


def free(s: Session) -> int:
    return int(s.client().cluster()["pools"]["A100-80GB"]["free"])


def test_names_in_and_out_and_the_last_expression(sess):
    ns: dict[str, Any] = {"scale": 3, "unused": object()}
    ui = RecordingUI()
    got = run_cell(
        "import os\nseen = os.environ['CUDA_VISIBLE_DEVICES']\nys = [scale * i for i in range(3)]\nsum(ys)",
        ns,
        Options(gpus=2),
        ui,
        sess,
    )
    assert got.result == 9 and got.names == {"seen": "0,1", "ys": [0, 3, 6]}
    assert ns["ys"] == [0, 3, 6] and ns["seen"] == "0,1" and "os" not in ns  # modules stay behind
    running = next(s for s in ui.states if isinstance(s, Running))
    assert running.where == "box GPU 0,1" and running.gpus == 2
    e = ui.ending
    assert e.state == "released" and e.verified and e.where == "2 GPUs on box (GPU 0,1)"
    assert e.line().startswith("gpu_train: held 2 GPUs on box (GPU 0,1) for ") and e.line().endswith(
        "; released; GPU memory freed"
    )
    assert free(sess) == 2


def test_out_names_and_a_name_that_cannot_travel(sess):
    ns: dict[str, Any] = {}
    run_cell("a = 1\nb = 2", ns, Options(outputs=["b"]), RecordingUI(), sess)
    assert ns == {"b": 2}
    with pytest.raises(GpuTrainError, match="NameError: --out names c, which the cell never set"):
        run_cell("a = 1", ns, Options(outputs=["c"]), RecordingUI(), sess)
    ns["lock"] = threading.Lock()
    with pytest.raises(ValueError, match="the cell reads 'lock', which cannot be sent"):
        run_cell("x = lock", ns, Options(), RecordingUI(), sess)
    with pytest.raises(ValueError, match="nothing to run"):
        run_cell("  ", ns, Options(), RecordingUI(), sess)
    assert free(sess) == 2


def test_an_error_comes_back_as_the_remote_traceback_once(sess):
    ui = RecordingUI()
    with pytest.raises(GpuTrainError) as err:
        run_cell("print('step 1')\nraise ValueError('bad batch')", {}, Options(), ui, sess)
    lines = err.value._render_traceback_()
    assert lines[0] == "--- traceback from the worker on node box ---"
    assert sum("ValueError: bad batch" in line for line in lines) == 1
    assert not any("magics/" in line or "ray/" in line for line in lines)
    assert ui.out == [("stdout", "step 1\n")]
    assert ui.ending.state == "failed" and ui.ending.verified
    assert free(sess) == 2


def test_stop_ends_the_call_frees_the_gpus_and_the_worker(sess, tmp_path: Path):
    marker = tmp_path / "pid"
    code = f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    main = threading.get_ident()

    def stop_when_running() -> None:
        while not marker.exists() or not marker.read_text():
            threading.Event().wait(0.01)  # the cell's marker file: no event crosses processes
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=stop_when_running)
    t.start()
    ui = RecordingUI()
    with pytest.raises(GpuTrainStopped) as err:
        run_cell(code, {}, Options(), ui, sess)
    t.join(10)
    assert isinstance(err.value, KeyboardInterrupt)
    assert err.value._render_traceback_() == ["KeyboardInterrupt: gpu_train stopped; its GPUs are free"]
    assert ui.ending.state == "stopped" and ui.ending.verified
    pid = int(marker.read_text())
    assert not _alive(pid)
    assert free(sess) == 2


def test_stop_while_queued_withdraws_the_request(sess, up):
    holder = Client(up.url, sess.defaults.token)
    held = holder.acquire(2, ttl=60)
    main = threading.get_ident()
    ui = RecordingUI()

    def stop_when_queued() -> None:
        while not any(isinstance(s, Waiting) and s.position for s in ui.states):
            threading.Event().wait(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=stop_when_queued)
    t.start()
    try:
        with pytest.raises(GpuTrainStopped, match="withdrawn"):
            run_cell("x = 1", {}, Options(gpus=1, wait=60), ui, sess)
        t.join(10)
        assert holder.queue() == []
        assert ui.ending.state == "withdrawn"
        rid = next(s.request for s in ui.states if isinstance(s, Waiting))
        holder.release(held)
        assert "grant" not in [e["type"] for e in holder.events(limit=10000) if e.get("lease") == rid]
    finally:
        holder.release(held)
        holder.close()
    assert free(sess) == 2


def test_a_cell_that_waits_out_its_wait_says_so_in_its_own_flags(sess, up):
    """The refusal names --wait as the cell wrote it (the API's words ask for a wait in seconds),
    and where the request stood."""
    holder = Client(up.url, sess.defaults.token)
    held = holder.acquire(2, ttl=600)
    ui = RecordingUI()
    try:
        with pytest.raises(errors.NoCapacity):
            run_cell("x = 1", {}, Options(gpus=1, wait=3), ui, sess)
        assert holder.queue() == []
    finally:
        holder.release(held)
        holder.close()
    assert ui.ending.state == "refused"
    assert ui.ending.line() == (
        "gpu_train: gave up after --wait 3s, still 1st in line for 1 GPU of A100-80GB\n"
        "  a longer --wait waits more, or ask for fewer GPUs"
    )
    assert free(sess) == 2


@pytest.mark.parametrize(
    ("rec", "line"),
    [
        (
            {
                "state": "released",
                "ended_by": "ann",
                "end_reason": "released from the board",
                "cause": {"code": "released", "by": "ann", "why": "released from the board"},
            },
            "released from the board by you",
        ),
        (
            {
                "state": "revoked",
                "ended_by": "alice",
                "end_reason": "maintenance",
                "cause": {"code": "revoked", "by": "alice", "why": "maintenance"},
            },
            "revoked by alice: maintenance",
        ),
        (
            {
                "state": "revoked",
                "ended_by": "reclaimer",
                "end_reason": "reclaimed: its GPUs were idle for 10 min and "
                "the owner did not keep it within the grace period",
                "cause": {"code": "reclaimed", "by": "reclaimer", "why": "its GPUs were idle for 10 min"},
            },
            "reclaimed: its GPUs were idle for 10 min after a warning",
        ),
        (
            {
                "state": "revoked",
                "ended_by": "server",
                "end_reason": "recalled for team:ml's booking r-1 (2 GPU(s) of "
                "A100-80GB); save your work: the GPUs go back in 30 s",
                "cause": {
                    "code": "recalled",
                    "by": "server",
                    "why": "recalled for team:ml's booking r-1 (2 GPU(s) of A100-80GB)",
                },
            },
            "preempted for team:ml's booking r-1 (2 GPU(s) of A100-80GB)",
        ),
        (
            {
                "state": "revoked",
                "gpu_total_mb": 81920,
                "cause": {"code": "over_memory", "by": "agent", "why": "it used 75 GB"},
                "over_memory": {"limit_mb": 40960, "used_mb": 76800, "peak_mb": 76800, "fit_mb": 92160, "over_s": 2.1},
            },
            # 90 GB would fit no 80 GB GPU: a whole one is the advice
            "stopped: over its 40 GB slice\n  used 75 GB for 2.1s\n  next: a whole GPU (drop --gpu-mem)",
        ),
        ({"state": "active"}, None),
    ],
)
def test_who_ended_a_lease_in_one_line(rec, line):
    assert describe_end(rec, "ann") == line


def test_an_idle_reclaim_reads_as_one_line_from_the_real_record(server_factory):
    """The reclaimer's own ended record (not a hand-written one) turns into the cell's line."""
    from tests.api_helpers import EventWatcher

    srv = server_factory(
        simulate="n1=1xA100-80GB", sample_interval=0.1, idle_timeout=1.0, grace=0.6, min_age=0.0, idle_threshold=5.0
    )
    srv.client("root", "admin").request("PUT", "/api/v1/simulate/n1", json={"gpus": {"0": {"util": 0}}})
    watcher = EventWatcher(srv.url, srv.token("root", "admin")).start()
    alice = srv.client("alice")
    lease = alice.acquire(1, label="forgotten notebook")
    watcher.wait_for(lambda e: e["type"] == "reclaimed" and e["lease"] == lease.id, 20, "reclaimed")
    line = describe_end(alice.get(lease.id), "alice")
    assert (
        line is not None
        and line.startswith("reclaimed: its GPUs were idle for ")
        and line.endswith(" min after a warning")
    )


def test_a_small_peak_on_a_big_gpu_names_the_smaller_pool_that_would_do(server_factory):
    """The right-size hint under a released cell: the peak NVML measured against the memory of the
    GPUs the lease held, which the board knows (a lease names only their indexes)."""
    from magics.runner import _right_size
    from magics.session import Session

    srv = server_factory(simulate="n1=2xA100-80GB,t1=2xT4-16GB")
    sess = Session()
    sess.defaults.url, sess.defaults.token = srv.url, srv.token("alice")
    lease = srv.client("alice").acquire(1, pool="A100-80GB")
    try:
        assert _right_size(sess, lease, 2 * 2**30) == "peak 2.0 GB of 80 GB: a T4-16GB would do, --pool T4-16GB"
        assert _right_size(sess, lease, 40 * 2**30) == ""  # half the GPU: no advice
        assert _right_size(sess, lease, None) == ""  # no NVML measure
    finally:
        sess.reset_client()


def test_a_queued_cells_line_says_whom_its_warm_gpu_was_lent_to_and_when_their_lease_ends(server_factory):
    """The line of a cell queued behind the user its warm GPU was lent to names them, and the end
    of their lease where one is known (here: they declared --timeout 30s, ends_within), counted
    down; the others holding the pool's GPUs come after, each with their end, in 80 columns."""
    import time as _time

    from magics.magic import CellDisplay
    from magics.outcomes import Lent, waiting_estimate

    srv = server_factory(simulate="n1=3xA100-80GB")
    srv.client("bob").acquire(1, pool="A100-80GB", ends_within=30)
    srv.client("carol").acquire(2, pool="A100-80GB")
    est = srv.client("alice").estimate(1, "A100-80GB")
    lent = Lent("bob", _time.time() - 60)
    shown = CellDisplay()
    shown.waiting(Waiting("r-1", "1", "A100-80GB", 1, 3.0, waiting_estimate(est, 0.0, 3600, 2.0, lent)))
    first, why, also = shown.text.splitlines()
    assert first.startswith("gpu_train: queued for 1 GPU of A100-80GB: 1st in line, 3s; about "), first
    assert why.startswith(f"  your warm GPU was lent to bob at {lent.clock()}; bob's lease ends in ~"), why
    assert int(why.split("~")[1].split()[0]) <= 28  # within its declared 30 s, counted down 2 s
    assert also == "  also held by carol (2 GPUs)"
    assert all(len(line) <= 80 for line in shown.text.splitlines()), shown.text
    # the estimate counts on bob's declared end, not the pool's typical cell (600 s with no history)
    assert est["estimate_s"] <= 30 and est["holders"][0]["end"] == "timeout", est
    # Nobody lent anything: the line names who holds what
    plain = waiting_estimate(est).splitlines()[1]
    assert plain.startswith("  held by bob (ends in ~") and plain.endswith(" s), carol (2 GPUs)"), plain


def test_a_queued_cells_line_reads_the_servers_estimate_in_80_columns(server_factory):
    """The real server's estimate, as the queued cell's line shows it: the wait and nothing the
    line already says, and a pool with GPUs free now on a line of its own."""
    from magics.magic import CellDisplay
    from magics.outcomes import about, waiting_estimate

    srv = server_factory(simulate="n1=2xA100-80GB,t1=2xT4-16GB")
    srv.client("bob").acquire(2, pool="A100-80GB")
    est = srv.client("alice").estimate(1, "A100-80GB")
    assert est["wait"].startswith("about ") and est["estimate_s"] >= 1, est
    shown = CellDisplay()
    shown.waiting(Waiting("r-1", "1", "A100-80GB", 1, 12.0, waiting_estimate(est)))
    first, why, alternative = shown.text.splitlines()
    assert first.startswith("gpu_train: queued for 1 GPU of A100-80GB: 1st in line, 12s; about "), first
    assert first.endswith(" more") and len(first) <= 80, first
    assert why == "  held by bob (2 GPUs)"  # who holds the pool's GPUs (no end known)
    assert alternative == "  2 x T4-16GB free now: --pool T4-16GB"
    # a --wait the estimate runs past: a line says the cell gives up first, and what --wait would do
    more = est["estimate_s"]
    first, _why, past, _ = waiting_estimate(est, waited_s=12.0, wait_s=12.0 + more / 2).splitlines()
    enough = show_duration(math.ceil((12.0 + more) * 1.25 / 60) * 60)  # the estimate and a margin, in minutes
    said = show_duration(12.0 + more / 2)
    assert past == f"  past --wait {said}: the cell gives up first; --wait {enough} waits it out"
    assert len(past) <= 80
    assert len(waiting_estimate(est, waited_s=12.0, wait_s=12.0 + more + 1).splitlines()) == 3  # no such line
    # read 5 s ago: the line counts down
    assert waiting_estimate(est, since_s=5.0).startswith(f"about {about(more - 5)[1:]} more\n"), est
    # and when the wait runs out, the refusal says what to change
    with pytest.raises(errors.NoCapacity) as refused:
        srv.client("alice").acquire(1, pool="A100-80GB", wait=0.5)
    assert refused.value.message == (
        "1 GPU was not free in pool 'A100-80GB' within 0.5s (position 1 in the queue); "
        "pass a longer wait (seconds) or ask for fewer GPUs"
    )
