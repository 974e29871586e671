"""The worker process's side of a recall, in this process: a loop that stops on ``preempted()``
must find its checkpoint already taken and the notice already written."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from magics import worker as w
from magics.calls import CHECKPOINT_STREAM


@pytest.fixture
def fresh() -> Iterator[w.GpuWorker]:
    w._NOTICE.clear(), w._RECALL_SEEN.clear(), w._RECALL.clear(), w._HOOKS.clear()
    yield w.GpuWorker()
    w._NOTICE.clear(), w._RECALL_SEEN.clear(), w._RECALL.clear(), w._HOOKS.clear()


def test_preempted_turns_true_only_after_the_hook_ran(fresh: w.GpuWorker) -> None:
    in_hook = threading.Event()
    release_hook = threading.Event()
    seen_during_hook: list[bool] = []

    def hook() -> dict[str, int]:
        in_hook.set()
        seen_during_hook.append(w.preempted())
        release_hook.wait(10)
        return {"step": 7}

    w.on_preempt(hook)
    t = threading.Thread(target=w._recalled, args=(fresh, {"recall_at": time.time() + 5, "recall_reason": "bob"}))
    t.start()
    assert in_hook.wait(10)
    assert not w.preempted()  # the loop keeps going while its state is being saved
    release_hook.set()
    t.join(10)
    assert w.preempted() and seen_during_hook == [False]
    chunks, _ = fresh.read_output(0)
    streams = [s for s, _ in chunks]
    assert streams == ["stderr", CHECKPOINT_STREAM]  # the notice, then the checkpoint
    assert "these GPUs are recalled (bob)" in chunks[0][1]


def test_a_failing_hook_still_lets_the_loop_stop(fresh: w.GpuWorker) -> None:
    w.on_preempt(lambda: 1 / 0)
    w._recalled(fresh, {"recall_at": time.time(), "recall_reason": "quota"})
    assert w.preempted()
    chunks, _ = fresh.read_output(0)
    assert "the checkpoint hook failed: ZeroDivisionError" in chunks[-1][1]


def test_peak_memory_counts_what_torch_gave_back_before_the_call_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    # As measured on an H100: 4 GiB taken, freed with empty_cache, 1 GiB kept; NVML then reads
    # 1636 MiB for the process (its CUDA context included), torch's peak reserved was 4 GiB.
    import os
    import sys
    import types

    mib, gib = 2**20, 2**30
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=1636 * mib),
            types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=9 * gib),  # someone else's
        ],
    )
    cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        device_count=lambda: 1,
        max_memory_reserved=lambda i: 4 * gib,
        memory_reserved=lambda i: 1026 * mib,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(w, "_NVML", [True])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert w._peak_memory() == 1636 * mib + 4 * gib - 1026 * mib
    monkeypatch.delitem(sys.modules, "torch")  # a call without torch: NVML's reading alone
    assert w._peak_memory() == 1636 * mib


def test_a_worker_guards_torch_distributed_from_its_first_import() -> None:
    """In a fresh process (torch not imported yet), as in a cold worker: once guarded, the module
    and any name imported from it give the guarded destroy_process_group."""
    import subprocess
    import sys

    code = (
        "from magics.worker import guard_process_groups\n"
        "guard_process_groups()\n"
        "import torch.distributed as dist\n"
        "from torch.distributed import destroy_process_group\n"
        "print(getattr(dist.destroy_process_group, '_gpulease_holds', False),"
        " getattr(destroy_process_group, '_gpulease_holds', False))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_a_destroyed_process_group_is_held_until_the_call_has_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """What keeps a DDP loop's return from deadlocking in torch (pytorch#56297): the group that
    destroy_process_group() drops stays referenced by the worker until the call is over."""
    dist = pytest.importorskip("torch.distributed")
    from lease_server.node.redis_proc import free_port

    monkeypatch.setattr(dist, "destroy_process_group", dist.destroy_process_group)  # undone after the test
    w._guard_destroy(dist)
    w._guard_destroy(dist)  # idempotent: one wrapper
    assert dist.destroy_process_group._gpulease_holds and not hasattr(
        dist.destroy_process_group.__wrapped__, "_gpulease_holds"
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    pg = dist.group.WORLD
    dist.destroy_process_group()
    assert not dist.is_initialized() and [g is pg for g in w._GROUPS] == [True]
    w._release_groups()
    assert w._GROUPS == []


def test_a_kernelspec_sets_how_many_spare_workers_a_kernel_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    from magics.options import Defaults

    monkeypatch.delenv("GPULEASE_SPARES", raising=False)
    assert Defaults().spares == 2
    monkeypatch.setenv("GPULEASE_SPARES", "0")
    assert Defaults().spares == 0
    for bad in ("two", "9", "-1"):
        monkeypatch.setenv("GPULEASE_SPARES", bad)
        with pytest.raises(ValueError, match=r"GPULEASE_SPARES=.*from 0 to 8"):
            Defaults()
