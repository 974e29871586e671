"""Inventory sources: the NVML path against pynvml's real API shape, and declared inventories."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types

import pynvml
import pytest

from lease_server import errors
from lease_server.leasing.inventory import parse_simulate
from lease_server.node.agent import nvml_inventory, pool_name


def nvml_like(gpus: list[tuple[str, str, int]]) -> types.SimpleNamespace:
    """An NVML stand-in for a machine with ``gpus``: every function it offers exists in the real
    pynvml with the same parameters, returns what pynvml returns (bytes or str names, the real
    ctypes memory struct), and errors are pynvml's own NVMLError."""

    def nvmlInit() -> None: ...
    def nvmlShutdown() -> None: ...
    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(index):  # noqa: ANN001, ANN202
        if not 0 <= index < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetUUID(handle):  # noqa: ANN001, ANN202
        return gpus[handle][0]

    def nvmlDeviceGetName(handle):  # noqa: ANN001, ANN202
        return gpus[handle][1]

    def nvmlDeviceGetMemoryInfo(handle, version=None):  # noqa: ANN001, ANN202
        mem = pynvml.c_nvmlMemory_t()
        mem.total = gpus[handle][2]
        return mem

    fns = {
        f.__name__: f
        for f in (
            nvmlInit,
            nvmlShutdown,
            nvmlDeviceGetCount,
            nvmlDeviceGetHandleByIndex,
            nvmlDeviceGetUUID,
            nvmlDeviceGetName,
            nvmlDeviceGetMemoryInfo,
        )
    }
    for name, fn in fns.items():
        real = getattr(pynvml, name)
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(real).parameters), name
    return types.SimpleNamespace(NVMLError=pynvml.NVMLError, nvmlMemory_v2=pynvml.nvmlMemory_v2, **fns)


def test_nvml_inventory_reads_index_uuid_model_memory():
    gib = 1024**3
    nvml = nvml_like([("GPU-aaa", b"NVIDIA A100-SXM4-80GB", 80 * gib), ("GPU-bbb", "NVIDIA A100-SXM4-80GB", 80 * gib)])
    inv = nvml_inventory("gpu-box", nvml=nvml)
    assert inv.source == "nvml" and inv.node == "gpu-box"
    assert [(g.index, g.uuid, g.model, g.memory_mb) for g in inv.gpus] == [
        (0, "GPU-aaa", "NVIDIA A100-SXM4-80GB", 81920),
        (1, "GPU-bbb", "NVIDIA A100-SXM4-80GB", 81920),
    ]
    assert inv.pool == "A100-SXM4-80GB"


def test_nvml_on_a_machine_without_gpus_says_what_to_do():
    # The real pynvml: there is no NVIDIA driver here, so nvmlInit fails.
    with pytest.raises(errors.ConfigurationError) as exc:
        nvml_inventory("x")
    assert "--simulate" in exc.value.message


def test_agent_cli_without_gpus_fails_with_one_clear_line():
    out = subprocess.run(
        [sys.executable, "-m", "lease_server.cli", "agent", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "--simulate" in out.stderr and "Traceback" not in out.stderr


def test_pool_names():
    assert pool_name("NVIDIA A100-SXM4-80GB", 81920) == "A100-SXM4-80GB"
    assert pool_name("Tesla T4", 15360) == "Tesla-T4-15GB"
    # what NVML names the H100 SXM (read on one): the memory is in the name already, mid-way
    assert pool_name("NVIDIA H100 80GB HBM3", 81559) == "H100-80GB-HBM3"


def test_parse_simulate_single_and_many_nodes():
    (one,) = parse_simulate("4xA100-80GB", default_node="box")
    assert one.node == "box" and one.pool == "A100-80GB" and len(one.gpus) == 4
    assert one.gpus[0].memory_mb == 80 * 1024 and one.gpus[3].uuid == "GPU-sim-box-3"
    a, b = parse_simulate("node-a=4xA100-80GB,node-b=2xT4-16GB", pool_overrides={"node-b": "inference"})
    assert (a.node, a.pool, b.node, b.pool, len(b.gpus)) == ("node-a", "A100-80GB", "node-b", "inference", 2)
    for bad in ("", "4", "ax4", "node a=1xT4", "0xT4", "a=1xT4,a=2xT4"):
        with pytest.raises(errors.ConfigurationError):
            parse_simulate(bad)


def test_nvml_sampler_reads_utilization_memory_and_processes():
    from lease_server.node.agent import NvmlSampler

    gib = 1024**3
    nvml = nvml_like([("GPU-a", "NVIDIA A100-SXM4-80GB", 80 * gib), ("GPU-b", "NVIDIA A100-SXM4-80GB", 80 * gib)])
    util = {0: 97, 1: 0}
    used = {0: 30 * gib, 1: 0}
    procs = {0: [4242], 1: []}

    def nvmlDeviceGetUtilizationRates(handle):  # noqa: ANN001, ANN202, N802
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu, rates.memory = util[handle], 0
        return rates

    reserved = 480 * 2**20  # what the driver keeps for itself (an idle H100 80GB HBM3)

    def nvmlDeviceGetMemoryInfo(handle, version=None):  # noqa: ANN001, ANN202, N802
        if version:  # v2: the driver's reservation apart from the processes' memory
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.total, mem.reserved, mem.used = 80 * gib, reserved, used[handle]
            return mem
        mem = pynvml.c_nvmlMemory_t()  # v1: "used" counts the reservation too
        mem.total, mem.used = 80 * gib, used[handle] + reserved
        return mem

    def nvmlDeviceGetComputeRunningProcesses(handle):  # noqa: ANN001, ANN202, N802
        return [types.SimpleNamespace(pid=p, usedGpuMemory=used[handle]) for p in procs[handle]]

    for fn in (nvmlDeviceGetUtilizationRates, nvmlDeviceGetMemoryInfo, nvmlDeviceGetComputeRunningProcesses):
        real = getattr(pynvml, fn.__name__)
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(real).parameters), fn.__name__
        setattr(nvml, fn.__name__, fn)
    sampler = NvmlSampler(nvml)
    assert sampler.sample() == [
        {"index": 0, "util": 97, "mem_mb": 30 * 1024, "procs": [4242]},
        {"index": 1, "util": 0, "mem_mb": 0, "procs": []},
    ]
    del nvml.nvmlMemory_v2  # an nvidia-ml-py without v2: the v1 reading, reservation and all
    assert [g["mem_mb"] for g in sampler.sample()] == [30 * 1024 + 480, 480]
    sampler.close()
