"""What travels between the notebook and a GPU worker: one :class:`Call` out, one :class:`Result` back.

Both sides import this module (the driver in the kernel, :mod:`magics.worker` in the Ray worker
process), so the contract has one owner and no untyped dicts cross the process boundary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

CHECKPOINT_STREAM = "checkpoint"  # an output chunk that carries a checkpoint hook's state
METRICS_STREAM = "metrics"  # an output chunk that carries one magics.report(...) as JSON
ELASTIC_STREAM = "elastic"  # an output chunk that carries one magics.elastic.step(...) of rank 0 as JSON
RESIZED = "__gpulease_resized__"  # the value of a rank that stopped for an elastic resize


@dataclass
class Call:
    """One unit of work for a worker: a notebook cell, or a function with its arguments.

    A cell runs ``body`` (then evaluates ``last_expr``) in a fresh namespace holding ``inputs``,
    and brings back the names in ``outputs``. A function call runs ``fn(*args, **kwargs)``.
    """

    kind: Literal["cell", "function"]
    # kind == "cell"
    source: str = ""
    body: str = ""
    last_expr: str | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    explicit_outputs: bool = False
    # A warm cell: run in the worker's own namespace, which the worker keeps for the notebook's next
    # cell (``inputs`` then holds only the names that changed in the kernel since they last crossed).
    keep_ns: bool = False
    # kind == "function"
    fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def function(cls, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Call:
        return cls("function", fn=fn, args=args, kwargs=kwargs)


@dataclass
class CellValue:
    """What a cell call returns: the names it assigned (those asked for) and its last expression."""

    names: dict[str, Any]
    result: Any = None


@dataclass
class Result:
    """How a call ended on its worker. A worker never raises: a failure comes back as data so that
    the notebook shows the remote traceback once, tagged with the node."""

    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    seconds: float = 0.0
    peak_memory: int | None = None  # bytes on the leased GPUs, where NVML could tell
    pid: int = 0
    imported: list[str] = field(default_factory=list)  # installed packages the call imported (a spare preloads them)
    restored: dict[str, Any] | None = None  # a suspended worker restored for this call: {bytes, ms} (its node agent's)


@dataclass(frozen=True)
class Where:
    """Where a worker process lives: enough to tell whether the driver can watch its pid itself."""

    pid: int
    machine: str  # boot id + pid namespace: equal means the same process table
    node_id: str = ""
    start: int = 0  # the process's start time (/proc/PID/stat field 22): with pid, names it for good


def this_machine() -> str:
    """An id of this process table: the kernel's boot id and the pid namespace."""
    import os

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        import socket

        return f"host:{socket.gethostname()}"


@functools.cache
def _tls() -> Any:
    import ssl

    return ssl.create_default_context()


def event_client(url: str, headers: Any, guard: Any = None) -> Any:
    """An HTTP client for one long-lived event stream. Building an httpx client loads the CA bundle
    (~50 ms of CPU); the TLS context is made once per process, so a call pays nothing for it.
    ``guard``: the kernel's Client's (lease_server.client.ServerGuard), so that the whole session
    trusts one server user; without one, a guard of its own for the token in ``headers``."""
    import httpx

    from lease_server.client import ServerGuard

    if guard is None:
        from lease_server.client import up_socket

        token = httpx.Headers(headers).get("authorization", "").removeprefix("Bearer ").strip()
        guard = ServerGuard(url, token, uds=up_socket(url, token))  # (client.py)
    return httpx.Client(
        base_url=url,
        headers=headers,
        timeout=httpx.Timeout(5, read=None),
        verify=_tls(),
        event_hooks={"request": [guard.check]},
        transport=httpx.HTTPTransport(uds=guard.uds, verify=_tls()) if guard.uds else None,
    )
