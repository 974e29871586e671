"""Inventory sources: the NVML path against pynvml's real API shape, and declared inventories."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import types
from typing import Any

import pynvml
import pytest

from lease_server import errors
from lease_server.leasing.inventory import NodeInventory, parse_simulate
from lease_server.node.agent import nvml_inventories, nvml_inventory, pool_name


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


def test_a_slice_is_measured_per_gpu_and_an_unreadable_neighbour_hides_only_itself():
    """A lease of two slices is held to its size on each GPU (its most used one), not to the sum;
    a process whose memory NVML does not give (usedGpuMemory None) leaves its own lease unjudged,
    not every slice on its GPU."""
    from lease_server.leasing.inventory import NodeInventory
    from lease_server.node.agent import NvmlSampler, _measure
    from lease_server.node.memwatch import Watched

    gib = 1024**3
    nvml = nvml_like([("GPU-a", "NVIDIA A100-SXM4-80GB", 80 * gib), ("GPU-b", "NVIDIA A100-SXM4-80GB", 80 * gib)])
    running = {0: [(100, 6 * gib), (200, None)], 1: [(100, 2 * gib)]}

    def nvmlDeviceGetComputeRunningProcesses(handle):  # noqa: ANN001, ANN202, N802
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in running[handle]]

    real = pynvml.nvmlDeviceGetComputeRunningProcesses
    assert list(inspect.signature(nvmlDeviceGetComputeRunningProcesses).parameters) == list(
        inspect.signature(real).parameters
    )
    nvml.nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses
    sampler = NvmlSampler(nvml)
    inv = NodeInventory("box", "A100-80GB", [], source="nvml")
    measure = _measure(inv, sampler)
    two = Watched("L1", 1, "A100-80GB", (0, 1), 10 * 1024, ((100, 1, 0),))
    assert measure(two, [100]) == 6 * 1024  # its most used GPU, held to 10 GB there
    hidden = Watched("L2", 2, "A100-80GB", (0,), 10 * 1024, ((200, 1, 0),))
    assert measure(hidden, [200]) is None
    assert sampler.proc_mem(0) == {100: 6 * 1024, 200: None}
    sampler.close()


# ---- MIG: instances an admin made, leased whole as their own pool ----------------------------------


def nvml_with_mig(gpus: list[tuple[str, str, int]], migs: dict[int, list[tuple[str, str, int] | None]]) -> Any:
    """nvml_like, where GPU i of ``migs`` is in MIG mode with those instances (uuid, name, bytes;
    None: an empty place), as NVML answers: the MIG functions exist in pynvml with these
    parameters, a GPU without MIG answers NOT_SUPPORTED, an empty place NOT_FOUND, and a MIG
    instance has no utilisation (NOT_SUPPORTED). A MIG handle is ("mig", gpu, place)."""
    nvml = nvml_like(gpus)
    base_uuid, base_name, base_mem = nvml.nvmlDeviceGetUUID, nvml.nvmlDeviceGetName, nvml.nvmlDeviceGetMemoryInfo

    def nvmlDeviceGetMigMode(device):  # noqa: ANN001, ANN202, N802
        if device not in migs:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]

    def nvmlDeviceGetMaxMigDeviceCount(device):  # noqa: ANN001, ANN202, N802
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(device, index):  # noqa: ANN001, ANN202, N802
        places = migs[device]
        if index >= len(places) or places[index] is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return ("mig", device, index)

    def inst(handle):  # noqa: ANN001, ANN202
        return migs[handle[1]][handle[2]]

    def nvmlDeviceGetUUID(handle):  # noqa: ANN001, ANN202, N802
        return inst(handle)[0] if isinstance(handle, tuple) else base_uuid(handle)

    def nvmlDeviceGetName(handle):  # noqa: ANN001, ANN202, N802
        return inst(handle)[1] if isinstance(handle, tuple) else base_name(handle)

    def nvmlDeviceGetMemoryInfo(handle, version=None):  # noqa: ANN001, ANN202, N802
        if not isinstance(handle, tuple):
            return base_mem(handle)
        mem = pynvml.c_nvmlMemory_t()
        mem.total = inst(handle)[2]
        return mem

    def nvmlDeviceGetUtilizationRates(handle):  # noqa: ANN001, ANN202, N802
        if isinstance(handle, tuple):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu = 50
        return rates

    def nvmlDeviceGetComputeRunningProcesses(handle):  # noqa: ANN001, ANN202, N802
        pid = 7000 + handle[2] if isinstance(handle, tuple) else 6000 + handle
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=2**30)]

    def nvmlDeviceGetGraphicsRunningProcesses(handle):  # noqa: ANN001, ANN202, N802
        return []

    for fn in (
        nvmlDeviceGetMigMode,
        nvmlDeviceGetMaxMigDeviceCount,
        nvmlDeviceGetMigDeviceHandleByIndex,
        nvmlDeviceGetUUID,
        nvmlDeviceGetName,
        nvmlDeviceGetMemoryInfo,
        nvmlDeviceGetUtilizationRates,
        nvmlDeviceGetComputeRunningProcesses,
        nvmlDeviceGetGraphicsRunningProcesses,
    ):
        real = getattr(pynvml, fn.__name__)
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(real).parameters), fn.__name__
        setattr(nvml, fn.__name__, fn)
    nvml.NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    return nvml


GIB = 1024**3
A100 = "NVIDIA A100-SXM4-80GB"
MIG_BOX = (
    [("GPU-a", A100, 80 * GIB), ("GPU-b", A100, 80 * GIB), ("GPU-c", A100, 80 * GIB)],
    {
        1: [
            ("MIG-1a", f"{A100} MIG 1g.10gb", 9728 * 2**20),
            None,  # an empty place
            ("MIG-1b", f"{A100} MIG 1g.10gb", 9728 * 2**20),
            ("MIG-1c", f"{A100} MIG 3g.40gb", 40192 * 2**20),
        ],
        2: [("MIG-2a", "NVIDIA A100-SXM4-80GB MIG", 40192 * 2**20)],  # an older driver's name
    },
)


def test_mig_instances_are_their_own_pools_and_their_gpus_are_not_leased_whole():
    invs = {inv.node: inv for inv in nvml_inventories("box", nvml=nvml_with_mig(*MIG_BOX))}
    whole, one_g, three_g, by_mem = (invs[n] for n in ("box", "box-mig-1g.10gb", "box-mig-3g.40gb", "box-mig-39gb"))
    assert (whole.node, whole.pool, [g.index for g in whole.gpus]) == ("box", "A100-SXM4-80GB", [0])
    assert (one_g.node, one_g.pool) == ("box-mig-1g.10gb", "A100-SXM4-80GB-MIG-1g.10gb")
    assert [(g.index, g.uuid, g.memory_mb) for g in one_g.gpus] == [(0, "MIG-1a", 9728), (1, "MIG-1b", 9728)]
    assert one_g.extra["mig_parent"] == {0: 1, 1: 1} and one_g.source == "nvml"
    assert (three_g.node, three_g.pool, [g.uuid for g in three_g.gpus]) == (
        "box-mig-3g.40gb",
        "A100-SXM4-80GB-MIG-3g.40gb",
        ["MIG-1c"],
    )
    assert (by_mem.pool, by_mem.extra["mig_parent"]) == ("A100-SXM4-80GB-MIG-39gb", {0: 2})
    # every name is one the server takes (what an agent sends is checked as any other)
    for inv in (whole, one_g, three_g, by_mem):
        assert NodeInventory.from_body(inv.node, json.loads(inv.to_json())).gpus == inv.gpus


def test_a_host_of_mig_gpus_only_has_no_whole_gpu_inventory():
    gpus, migs = MIG_BOX
    invs = nvml_inventories("box", nvml=nvml_with_mig(gpus[1:], {0: migs[1], 1: migs[2]}))
    assert sorted(inv.node for inv in invs) == ["box-mig-1g.10gb", "box-mig-39gb", "box-mig-3g.40gb"]
    with pytest.raises(errors.ConfigurationError, match="no GPU"):
        nvml_inventories("box", nvml=nvml_with_mig(gpus[:1], {0: [None, None]}))


def test_the_sampler_reads_a_mig_node_by_its_instances_and_reports_no_utilisation_for_them():
    from lease_server.node.agent import NvmlSampler

    nvml = nvml_with_mig(*MIG_BOX)
    whole, one_g = nvml_inventories("box", nvml=nvml)[:2]
    assert one_g.node == "box-mig-1g.10gb"
    sampler = NvmlSampler(nvml)
    mig = sampler.view(one_g)
    # processes and memory by the instance's own handle; no utilisation sample: no idle evidence
    assert mig.procs_on(0) == [7000] and mig.procs_on(1) == [7002]
    assert mig.proc_mem(1) == {7002: 1024} and mig.sample() == []
    assert [g["index"] for g in sampler.view(whole).sample()] == [0]
    mig.close()  # a view does not shut NVML down; its root does
    sampler.close()


def test_a_mig_lease_shows_cuda_its_instance_by_uuid_and_the_claim_its_indexes():
    from lease_server.client import Lease, visible_devices

    gpus = [{"index": 0, "uuid": "MIG-1a"}, {"index": 1, "uuid": "MIG-1b"}]
    assert visible_devices(gpus) == "MIG-1a,MIG-1b"
    assert visible_devices([{"index": 3, "uuid": "GPU-x"}]) == "3"
    lease = Lease.from_json(
        {"id": "l-1", "user": "ann", "pool": "p", "node": "n-mig-1g.10gb", "gpus": gpus, "expires_at": 0, "ttl": 60}
    )
    assert lease.cuda_visible_devices == "MIG-1a,MIG-1b"
