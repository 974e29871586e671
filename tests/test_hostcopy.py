"""What a cell brings back crosses as host objects (magics/hostcopy.py): each name pickled on its own
on the worker, so that a GPU tensor arrives on the CPU and the closing line can name what was big.
(The GPU half, a CUDA tensor arriving on the CPU, is tests/gpu/hostcopy_check.py.)"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from magics import hostcopy
from magics.calls import CellValue


@dataclasses.dataclass
class Run:
    model: object
    losses: list[float]


def test_names_come_back_whole_with_nested_torch_objects() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    value = CellValue({"run": Run(model, [1.0, 0.5]), "state": {"opt": opt.state_dict(), "w": [model.weight]}}, 42)
    back, big = hostcopy.unpack(hostcopy.pack(value))
    assert isinstance(back, CellValue) and back.result == 42 and big == []
    assert torch.equal(back.names["run"].model.weight, model.weight)
    assert isinstance(back.names["run"].model.weight, torch.nn.Parameter)
    assert back.names["run"].losses == [1.0, 0.5]
    assert back.names["state"]["opt"]["param_groups"][0]["lr"] == 0.1


def test_a_big_name_is_named_with_its_size_and_a_function_value_crosses_too() -> None:
    blob = bytes(hostcopy.BIG + 1)
    back, big = hostcopy.unpack(hostcopy.pack(CellValue({"blob": blob, "small": 1}, None)))
    assert back.names["blob"] == blob and [b.name for b in big] == ["blob"]
    assert big[0].size > hostcopy.BIG and big[0].text().startswith("blob (0.1 GB, ")
    value, big = hostcopy.unpack(hostcopy.pack([1, 2]))
    assert value == [1, 2] and big == []


def test_a_name_that_cannot_cross_is_named() -> None:
    import threading

    with pytest.raises(TypeError, match="the cell's 'lock' cannot come back to the notebook"):
        hostcopy.pack(CellValue({"ok": 1, "lock": threading.Lock()}, None))


def test_a_cpu_only_process_loads_what_a_worker_packed() -> None:
    """The kernel sees no GPU (CUDA_VISIBLE_DEVICES=""): what the worker packed loads there."""
    torch = pytest.importorskip("torch")
    data = hostcopy.dumps({"t": torch.arange(6.0).reshape(2, 3)})
    code = "import pickle, sys; d = pickle.loads(sys.stdin.buffer.read()); print(d['t'].device, float(d['t'].sum()))"
    out = subprocess.run(
        [sys.executable, "-c", code], input=data, capture_output=True, env={"CUDA_VISIBLE_DEVICES": ""}, check=True
    )
    assert out.stdout.decode().split() == ["cpu", "15.0"]
