"""On a machine with an NVIDIA GPU: two slices share one GPU, one allocates past its slice with
torch, and only that one stops (torch's own out-of-memory error from the per-process memory
fraction its worker was started with, or, failing that, the node agent); the other finishes; and
NVML's per-process memory of the one that runs agrees with what the board shows for its slice.
Skipped, with the reason, where NVML finds no GPU (CI, laptops).

`gpulease up` without --simulate, its pools sharing their GPUs in 1 GB units (GPULEASE_SHARE): the
node agent reads each slice's processes' memory through NVML (CUDA context included)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Up


def _nvml_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver here
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


pytestmark = pytest.mark.skipif(_nvml_gpus() == 0, reason="NVML finds no NVIDIA GPU on this machine")
torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")

SLICE_GB = 4


def hold_and_wait(gate: str) -> dict[str, Any]:
    """In the neighbour's worker: hold 1 GiB on its slice, say what NVML sees of this process and
    the fraction torch was given, and wait for the gate (a FIFO the test writes once it looked)."""
    import os

    import pynvml
    import torch

    x = torch.ones(2**28, dtype=torch.float32, device="cuda:0")  # 1 GiB
    torch.cuda.synchronize()
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ["CUDA_VISIBLE_DEVICES"]))
    mine = [int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
    pynvml.nvmlShutdown()
    print(f"nvml {sum(mine) // 2**20}", flush=True)  # the test reads this line while the call runs
    with open(gate) as f:
        f.read()
    return {"nvml_mb": sum(mine) // 2**20, "sum": float(x.sum()), "pid": os.getpid()}


def overrun(slice_gb: int) -> None:
    """In the hog's worker: allocate past its slice, in steps, as a training loop that grows would."""
    import time

    import torch

    keep = []
    for _ in range(4 * slice_gb):
        keep.append(torch.empty(2**28, dtype=torch.float32, device="cuda:0"))  # 1 GiB more each
        torch.cuda.synchronize()
        time.sleep(0.1)
    time.sleep(60)  # still there: the node agent ends it


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(
        tmp_path_factory.mktemp("gpulease-home"),
        simulate=None,
        GPULEASE_SHARE="true",
        GPULEASE_SLICE_UNIT_MB="1024",
        GPULEASE_WARM="off",
    )
    yield u
    u.interrupt()


@pytest.fixture(scope="module")
def sess(up: Up) -> Iterator[Any]:
    from magics.runner import Session

    s = Session()
    s.defaults.url, s.defaults.token = up.url, (up.data / "token").read_text().strip()
    yield s
    s.release_all()
    ray.shutdown()


class Lines:
    """A UI that keeps what the call printed and said, and says when a line has come."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.notes: list[str] = []
        self.endings: list[Any] = []
        self.printed = threading.Event()
        self.where = ""

    def waiting(self, w: Any) -> None: ...
    def running(self, r: Any) -> None:
        self.where = r.where

    def notice(self, t: str) -> None:
        self.notes.append(t)

    def output(self, s: str, t: str) -> None:
        self.out.append(t)
        if "nvml " in t:
            self.printed.set()

    def ended(self, e: Any) -> None:
        self.endings.append(e)


def test_two_slices_on_one_gpu_only_the_one_past_its_slice_stops(sess, tmp_path):
    from magics.calls import Call
    from magics.grant import Cancel
    from magics.runner import GpuTrainError, Options, run_call

    gate = tmp_path / "gate"
    os.mkfifo(gate)
    opts = Options(gpu_mem=f"{SLICE_GB}GB", wait=120)
    neighbour, hog, got = Lines(), Lines(), {}

    def run_neighbour() -> None:
        try:
            got["value"] = run_call(
                Call.function(hold_and_wait, str(gate)), opts, neighbour, sess, cancel=Cancel()
            ).value
        except BaseException as exc:  # noqa: BLE001
            got["error"] = exc

    t = threading.Thread(target=run_neighbour, daemon=True)
    t.start()
    assert neighbour.printed.wait(300), (neighbour.out, got)
    with pytest.raises(GpuTrainError) as exc:  # torch's own OOM from the fraction, or the agent's end
        run_call(Call.function(overrun, SLICE_GB), opts, hog, sess)
    said = f"{exc.value.summary} {exc.value.remote_type} {exc.value.remote_traceback}"
    assert "OutOfMemoryError" in said or "over its" in said, said
    # The neighbour still runs on the same GPU: NVML's reading of its process agrees with the board
    nvml_mb = int("".join(neighbour.out).split("nvml ")[1].split()[0])
    board = [
        s
        for n in sess.client().cluster()["nodes"]
        for g in n["gpus"]
        for s in g.get("slices", [])
        if "mem_used_mb" in s
    ]
    assert board, "the board shows no slice's memory"
    assert abs(board[0]["mem_used_mb"] - nvml_mb) <= max(64, nvml_mb // 20), (board, nvml_mb)
    with open(gate, "w") as f:
        f.write("go")
    t.join(120)
    assert got.get("value") is not None and got["value"]["sum"] == 2**28, got
    assert neighbour.where == hog.where, (neighbour.where, hog.where)  # one GPU, shared
    assert neighbour.endings and neighbour.endings[0].state == "released"
