"""What a call brings back crosses as host objects: a torch tensor or module on a GPU arrives in
the CPU kernel on the CPU, usable there for plotting and evaluation, while the worker keeps its GPU
originals (a warm cell's namespace). Without this, torch refuses to unpickle a CUDA tensor in a
process without CUDA ("Attempting to deserialize object on a CUDA device").

The worker pickles each name on its own (:func:`pack`), so the kernel knows what each weighed and
how long it took; :func:`unpack` names those over :data:`BIG` for the cell's closing line.
"""

from __future__ import annotations

import io
import sys
import time
from dataclasses import dataclass, field
from typing import Any

BIG = 100 * 10**6  # bytes: a name that weighs more is named in the cell's closing line


def _same(obj: Any) -> Any:
    """The reducer of a GPU tensor: its host copy, pickled as a CPU tensor."""
    return obj


def _host_pickler(buf: io.BytesIO) -> Any:
    from ray import cloudpickle

    class HostPickler(cloudpickle.CloudPickler):  # type: ignore[misc,name-defined]
        def reducer_override(self, obj: Any) -> Any:
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                host = obj.detach().to("cpu")
                if isinstance(obj, torch.nn.Parameter):
                    host = torch.nn.Parameter(host, requires_grad=obj.requires_grad)
                return _same, (host,)
            return super().reducer_override(obj)

    return HostPickler(buf, protocol=5)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled with every GPU tensor in it (nested in modules, optimizers, containers,
    dataclasses) replaced by its host copy."""
    buf = io.BytesIO()
    _host_pickler(buf).dump(obj)
    return buf.getvalue()


@dataclass
class Packed:
    """A call's value, pickled name by name on the worker (``names`` None: a function's value)."""

    names: dict[str, bytes] | None
    value: bytes
    seconds: dict[str, float] = field(default_factory=dict)  # pickling time per name ("" the value)


@dataclass
class Crossed:
    """A name that came back over :data:`BIG`: its size and the time it took (pickle + unpickle)."""

    name: str
    size: int
    seconds: float

    def text(self) -> str:
        return f"{self.name} ({self.size / 1e9:.1f} GB, {self.seconds:.1f}s)"


def pack(value: Any) -> Packed:
    """On the worker: a cell's names (and last value), or a function's value, as host pickles.
    Raises TypeError naming the first one that cannot cross."""
    from .calls import CellValue

    def one(name: str, obj: Any, seconds: dict[str, float]) -> bytes:
        t0 = time.perf_counter()
        try:
            data = dumps(obj)
        except Exception as exc:  # noqa: BLE001 - named for the user below
            what = f"the cell's {name!r}" if name else "the value"
            raise TypeError(f"{what} cannot come back to the notebook ({type(exc).__name__}: {exc})") from None
        seconds[name] = time.perf_counter() - t0
        return data

    seconds: dict[str, float] = {}
    if isinstance(value, CellValue):
        names = {n: one(n, v, seconds) for n, v in value.names.items()}
        return Packed(names, one("", value.result, seconds), seconds)
    return Packed(None, one("", value, seconds), seconds)


def unpack(packed: Packed) -> tuple[Any, list[Crossed]]:
    """In the kernel: the value again, and what of it weighed over :data:`BIG`."""
    import pickle

    from .calls import CellValue

    big: list[Crossed] = []

    def one(name: str, data: bytes) -> Any:
        t0 = time.perf_counter()
        obj = pickle.loads(data)  # noqa: S301 - our own worker's pickle of the user's own objects
        if len(data) > BIG:
            big.append(Crossed(name or "the value", len(data), packed.seconds.get(name, 0) + time.perf_counter() - t0))
        return obj

    if packed.names is None:
        return one("", packed.value), big
    names = {n: one(n, d) for n, d in packed.names.items()}
    return CellValue(names, one("", packed.value)), big
