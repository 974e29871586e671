"""On a machine with an NVIDIA GPU: a leased call really runs on the leased GPU, and its release
is verified by NVML. Skipped, with the reason, where NVML finds no GPU (CI, laptops).

`gpulease up` without --simulate: the node agent's inventory comes from NVML, and the worker's
CUDA_VISIBLE_DEVICES (with CUDA_DEVICE_ORDER=PCI_BUS_ID) names the leased NVML indexes."""

from __future__ import annotations

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


def allocate_and_look() -> dict[str, Any]:
    """In the worker: take ~1 GiB on cuda:0 and report where NVML sees this process."""
    import os

    import pynvml
    import torch

    x = torch.empty(2**28, dtype=torch.float32, device="cuda:0")  # 1 GiB
    x.fill_(1.0)
    torch.cuda.synchronize()
    pynvml.nvmlInit()
    seen: dict[int, int] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                seen[i] = int(p.usedGpuMemory or 0)
    pynvml.nvmlShutdown()
    return {"pid": os.getpid(), "visible": os.environ["CUDA_VISIBLE_DEVICES"], "seen": seen, "sum": float(x.sum())}


@pytest.fixture(scope="module")
def sess(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from magics.runner import Session

    up = Up(tmp_path_factory.mktemp("gpulease-home"), simulate=None)
    s = Session()
    s.defaults.url, s.defaults.token = up.url, (up.data / "token").read_text().strip()
    yield s
    s.release_all()
    ray.shutdown()
    up.interrupt()


def test_a_leased_call_runs_on_exactly_its_gpu_and_leaves_nothing_behind(sess):
    from magics.calls import Call
    from magics.runner import Options, run_call
    from magics.worker import gpu_pids

    endings: list[Any] = []

    class UI:
        def waiting(self, w: Any) -> None: ...
        def running(self, r: Any) -> None: ...
        def notice(self, t: str) -> None: ...
        def output(self, s: str, t: str) -> None: ...
        def ended(self, e: Any) -> None:
            endings.append(e)

    out = run_call(Call.function(allocate_and_look), Options(gpus=1, wait=60), UI(), sess)
    got = out.value
    (leased,) = out.gpus
    assert got["visible"] == str(leased) and got["sum"] == 2**28
    assert set(got["seen"]) == {leased}, got  # on the leased GPU and on no other
    (e,) = endings
    assert e.verified and e.nvml, e  # NVML saw the process gone from the GPU before the release
    assert got["pid"] not in (gpu_pids([], [leased]) or set())
    # the closing line's peak is NVML's reading of the process (within what NVML adds: context)
    assert e.peak_memory and abs(e.peak_memory - got["seen"][leased]) <= 64 * 2**20, (e.peak_memory, got)
