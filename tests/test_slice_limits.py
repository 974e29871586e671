"""A slice's limits without a cluster (issue 35, items 3 and 4): the memory fraction its worker's
torch gets, MPS's limit only where an MPS daemon already runs, ``--gpu-mem auto``'s size from a
recorded peak, and the node agent's judgement of a slice over its memory (5 % for 2 s).

Torch here is a CPU build and there is no GPU: the fraction is computed, and setting it is skipped
cleanly; tests/gpu/slice_check.py sets it on a real GPU."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from lease_server.config import Settings
from lease_server.errors import ConfigurationError
from lease_server.node.memwatch import MemWatch, Watched, resident_mb
from lease_server.sizes import as_option, fitting_mb, show_mb
from magics import slices


def test_the_fraction_is_the_slice_over_its_gpu() -> None:
    assert slices.fraction(10240, 81920) == 0.125
    assert slices.fraction(81920, 81920) == 1.0
    assert slices.fraction(90000, 81920) == 1.0  # never above the whole GPU
    assert slices.fraction(0, 81920) is None and slices.fraction(1024, 0) is None  # a whole GPU: no limit


def test_mps_is_limited_only_where_its_daemon_already_runs(tmp_path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert slices.mps_limit(10240, env) == {}  # no daemon: nothing set, nothing started
    (tmp_path / "control").touch()  # what nvidia-cuda-mps-control makes in its pipe directory
    assert slices.mps_limit(10240, env) == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M"}


def test_a_worker_without_cuda_skips_the_torch_limit_cleanly() -> None:
    """In a fresh process, as a worker: armed on torch's import, then skipped (no CUDA here)."""
    code = (
        "import os, sys\n"
        "from magics import slices\n"
        "env = {'GPULEASE_GPU_MEM_MB': '10240', 'GPULEASE_GPU_TOTAL_MB': '81920',"
        " 'CUDA_MPS_PIPE_DIRECTORY': '/nonexistent'}\n"
        "print(slices.hold_to(env))\n"
        "import torch\n"
        "print(slices.limit_torch(0.125), torch.cuda.is_available())\n"
        "print(slices.hold_to({}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    torch_cuda = out.stdout.splitlines()[1].endswith("True")
    assert out.stdout.splitlines()[0] == "{'torch': 'on import', 'mps': ''}"
    assert out.stdout.splitlines()[1] == ("armed True" if torch_cuda else "no CUDA False")
    assert out.stdout.splitlines()[2] == "{}"  # a whole GPU: nothing held


def test_gpu_mem_auto_sizes_from_the_recorded_peak() -> None:
    assert slices.auto_size(None, 1024) == (None, "a whole GPU: no cell of this notebook has a measured peak yet")
    assert slices.auto_size(8090, 1024) == (10240, "10 GB: last cell peaked at 7.9 GB + 20 %")
    # a peak whose margin takes a GPU's all: a whole GPU, not a size the server would refuse
    assert slices.auto_size(70_000, 1024, gpu_mb=81920) == (
        None,
        "a whole GPU: last cell peaked at 68.4 GB, + 20 % is a GPU's all",
    )
    # the margin is at least one unit, and the size a whole number of units
    assert fitting_mb(100, 1024) == 2048 and fitting_mb(700, 256) == 1024 and fitting_mb(5000, 1) == 6000
    assert show_mb(512) == "512 MB" and show_mb(81920) == "80 GB" and as_option(2048) == "2GB"


def slice_of(limit_mb: int) -> Watched:
    return Watched("L1", 7, "A100-80GB", (0,), limit_mb, ((1234, 99, 1000),))


def test_a_slice_over_its_memory_is_warned_then_ended_after_the_grace() -> None:
    now = [0.0]
    w = MemWatch(over_pct=5.0, over_s=2.0, clock=lambda: now[0])
    s = slice_of(1024)
    assert w.judge(s, 1075) is None  # within 5 %
    assert w.judge(s, 1100) == "warn"
    now[0] = 1.9
    assert w.judge(s, 1200) is None  # warned once, within its grace
    now[0] = 2.1
    assert w.judge(s, 1150) == "end"
    assert w.judge(s, 1150) is None and w.peak["L1"] == 1200  # ended once; its peak kept
    # back under its memory for its grace, the clock starts again
    w2 = MemWatch(over_pct=5.0, over_s=2.0, clock=lambda: now[0])
    now[0] = 10.0
    assert w2.judge(s, 1500) == "warn"
    now[0] = 11.0
    assert w2.judge(s, 500) is None
    now[0] = 13.5
    assert w2.judge(s, 500) is None  # under for 2.5 s: forgiven
    assert w2.judge(s, 1500) == "warn"  # a new overrun, warned again, not ended at once
    assert w2.judge(slice_of(0), 50_000) is None  # a whole GPU: measured for its peak, never judged


def sampled(w: MemWatch, now: list[float], mb_at: Any, until: float, every: float = 0.5) -> list[tuple[float, str]]:
    """Judge a slice of 1 GB every ``every`` s (the agent's check interval), using ``mb_at(t)``."""
    s, out = slice_of(1024), []
    while now[0] <= until:
        verdict = w.judge(s, mb_at(now[0]))
        if verdict:
            out.append((now[0], verdict))
        now[0] += every
    return out


def test_bursts_over_a_slice_with_short_pauses_between_are_ended() -> None:
    """Over for 1.5 s, under for 0.5 s, again: the time over adds up across the pauses (a single
    sample under used to start it again, and such a cell was never ended)."""
    now = [0.0]
    w = MemWatch(over_pct=5.0, over_s=2.0, clock=lambda: now[0])
    got = sampled(w, now, lambda t: 100 if t % 2.0 >= 1.5 else 1500, until=20)
    # each sample over counts the 0.5 s before it: 0.5 + 0.5, a sample under takes a third of
    # 0.5 off, then 0.5 + 0.5 + 0.5: past its 2 s
    assert got == [(0.0, "warn"), (3.0, "end")], got


def test_bursts_shorter_than_one_check_are_ended() -> None:
    """Issue 49: a cell over its slice for 0.4 s, then under for 0.7 s, again and again. No two
    samples in a row see it over, so its time over never added up and it ran on, its bursts
    failing a neighbour's allocations (~40 % of the time over). Each sample over now counts, at
    the agent's interval or any other (the pattern must not slip between the samples)."""
    burst = lambda t: 1500 if round(t * 100) % 110 < 40 else 100  # noqa: E731
    now = [0.0]
    w = MemWatch(over_pct=5.0, over_s=2.0, clock=lambda: now[0])
    assert sampled(w, now, burst, until=60) == [(0.0, "warn"), (11.0, "end")]
    for every in (0.3, 0.45, 0.53, 0.61, 0.7):
        at = [0.0]
        got = sampled(MemWatch(over_pct=5.0, over_s=2.0, clock=lambda at=at: at[0]), at, burst, 60, every)
        assert got[0] == (0.0, "warn") and got[-1][1] == "end", (every, got)


def test_over_for_most_of_the_grace_then_under_for_longer_is_ended() -> None:
    """Over for 1.9 s, under for 2.3 s, again: never over for the whole grace at once, and each
    pause longer than the grace used to start the time over again, so a cell over 45 % of the
    time was never ended. Its time over now drains by a third of its time under: it is."""
    now = [0.0]
    w = MemWatch(over_pct=5.0, over_s=2.0, clock=lambda: now[0])
    got = sampled(w, now, lambda t: 1500 if round(t * 10) % 42 < 19 else 100, until=60, every=0.1)
    assert [v for _, v in got] == ["warn", "warn", "end"], got  # warned again after each long pause


def test_a_slice_that_spikes_over_now_and_then_is_warned_not_ended() -> None:
    """One sample over every 2.5 s: over for no time between samples, so never past its grace."""
    now = [0.0]
    w = MemWatch(over_pct=5.0, over_s=2.0, clock=lambda: now[0])
    got = sampled(w, now, lambda t: 1500 if t % 2.5 == 0 else 100, until=20)
    assert got == [(0.0, "warn")], got


def test_a_child_that_never_claimed_the_lease_is_measured_with_it() -> None:
    """A cell's subprocess (or multiprocessing worker) claims nothing: it is found below the
    claimed worker in the process tree, and its memory counts against the slice."""
    import os

    from lease_server.node.memwatch import running_pids
    from lease_server.procs import start_ticks, uid

    code = (
        "import subprocess, sys\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(kid.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "kid.kill()\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        kid = int(worker.stdout.readline())
        claimed = Watched("L1", 7, "A100-80GB", (0,), 1024, ((worker.pid, start_ticks(worker.pid), os.getuid()),))
        assert sorted(running_pids(claimed)) == sorted([worker.pid, kid])
        assert uid(kid) == os.getuid()
        # another user's claim names other owners: the child is not counted as theirs
        other = Watched("L2", 8, "A100-80GB", (0,), 1024, ((worker.pid, start_ticks(worker.pid), os.getuid() + 1),))
        assert running_pids(other) == [worker.pid]
    finally:
        worker.communicate("", timeout=30)


def test_resident_memory_stands_in_on_simulated_gpus() -> None:
    import os

    assert resident_mb(os.getpid()) > 0 and resident_mb(2**22 + 1) == 0


@pytest.mark.parametrize("bad", [{"slice_over_pct": 150.0}, {"slice_over_s": -1.0}, {"slice_check_interval": 0.0}])
def test_the_policy_numbers_are_settings_that_fail_fast(bad) -> None:
    s = Settings()
    assert (s.slice_over_pct, s.slice_over_s) == (5.0, 2.0)
    with pytest.raises(ConfigurationError):
        Settings.load(None, **bad)


def test_a_slices_drain_on_an_nvml_node_ends_when_its_processes_are_off_the_gpu() -> None:
    """Two drains a slice could be stuck in forever on an NVML node: a process it named that runs
    but holds nothing on the GPU (clean, as a whole GPU's drain is: never signalled), and a slice
    that named no process beside neighbours that stay (freed after abandon_after_s)."""
    import os

    from lease_server.node.drain import Drainer, Draining, Proc
    from lease_server.node.enforce import Enforcer
    from lease_server.procs import start_ticks

    now = [0.0]
    drainer = Drainer(Enforcer(clock=lambda: now[0]), grace_s=1.0, abandon_after_s=30.0)
    me = Proc(os.getpid(), start_ticks(os.getpid()) or 0, os.getuid())  # alive, and no GPU process
    named = Draining(0, "L1", "ann", "revoked", 0, (me,), gpu_mem_mb=1024)
    unnamed = Draining(1, "L2", "bob", "expired", 0, (), gpu_mem_mb=1024)
    neighbours = {0: [4242], 1: [4343]}  # NVML's lists: other slices' processes only
    first = drainer.step("box", [named, unnamed], nvml_procs=lambda i: neighbours[i], verify=lambda i, p: False)
    assert [(lease, idx) for lease, idx, _ in first.clean] == [("L1", [0])] and not first.abandoned
    assert not drainer.signalled  # this process was never signalled
    now[0] = 29.0
    assert drainer.step("box", [unnamed], nvml_procs=lambda i: neighbours[i]).clean == []
    now[0] = 31.0
    assert [lease for lease, _, _ in drainer.step("box", [unnamed], nvml_procs=lambda i: neighbours[i]).clean] == ["L2"]
