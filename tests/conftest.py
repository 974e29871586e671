"""Fixtures: a real redis-server on a free port, and real lease servers (in a thread or a process).

Each test gets its own key prefix, so tests share one Redis without seeing each other's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from lease_server.client import Client
from lease_server.config import Settings
from lease_server.leasing.inventory import parse_simulate
from lease_server.node.redis_proc import RedisProcess, free_port
from lease_server.store.keys import Keys
from lease_server.web.auth import create_token

_prefixes = itertools.count()

# The kernels of the test stacks (and their sessions) keep no started worker ready, unless a
# module asks for spares (ray_session(up, spares=N)): a started worker costs ~2.5 s of CPU, and Ray
# workers were a third of the suite's CPU on two cores. A cold cell then starts its worker itself:
# what it does is the same, only later.
os.environ.setdefault("GPULEASE_SPARES", "0")


@pytest.fixture(autouse=True)
def default_sigint() -> Iterator[None]:
    """Each test starts with Ctrl-C raising KeyboardInterrupt, as in a terminal or a kernel. A
    library that an earlier test ran in this process can leave SIGINT ignored or handled its own
    way; processes started then inherit an ignored SIGINT and can no longer be stopped with it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


# ---- running beside each other (pytest-xdist: README's `pytest -n 2`) --------------------------------

# Under xdist each module runs whole on one worker (its `up`, its module fixtures start once), and
# the modules that run Ray (a `gpulease up` with its head, a Ray cluster, kernels that join one) all
# run on one worker, in this order: one Ray cluster runs at a time, as in a serial run. Two at once
# starve each other on two cores (measured: 50 tests in 17 minutes). The other modules, mostly Redis
# and HTTP in the test process, run beside them on the other worker(s), longest first.
# Lengths measured with `--durations=0` (seconds, 2-core VM, loaded): a hint for scheduling only; a
# module missing from both lists still runs, after these.
RAY_GROUP = (
    # These join the one Ray head of the tests (conftest's RayHead, `gpulease up --ray-address`),
    # one after the other, so it starts once...
    "test_magics",  # 234
    "test_elastic",  # 194
    "test_run_cell",  # 166
    "test_cell_edges",  # 151
    "test_slice_cells",  # 150
    "test_warm_cells",  # 137
    "test_ui_stop",  # 107
    "test_sweep",  # 89
    "test_elastic_drain",  # 72
    "test_gang",  # 200 (three raylets of its own before)
    "test_sim_sessions",  # 112 (its live replay, where the traces are)
    # ... and this starts Ray clusters of its own, once it has stopped.
    "test_multihost",  # 114 (two network namespaces, a raylet in each)
)
LONGEST_FIRST = (
    "test_ui",  # 237 (a browser)
    "test_ui_usage",  # a browser, one JupyterLab for the module
    "test_openapi_fuzz",  # 75
    "test_cli_output",  # 65
    "test_concurrency",  # 65
    "test_failover",  # 63
    "test_slices",
    "test_faults",  # 34
    "test_hub",  # 32
)
# These start a Ray head of their own in a `gpulease up` (which tries three times) and run last, on
# whichever worker is free first: the other worker's modules end ~5 minutes before the Ray group's
# (measured: 925 s against 1,237 s), so they no longer wait at the end of it.
LAST = (
    "test_benches",  # 142 (every bench/*.py in its quick mode; three start a `gpulease up` with Ray)
    "test_ray_auth",  # 51
    "test_gpu_run",  # 51 (tests/gpu/run_all.sh --simulate: a `gpulease up`, a notebook)
    "test_cli",  # 29
)
_RANK = {m: k for k, m in enumerate(RAY_GROUP + LONGEST_FIRST)}
_RANK.update({m: 1000 + k for k, m in enumerate(LAST)})
_HEAD_MODULES: set[Path] = set()  # the modules with a test on the shared Ray head (RayHead)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _RANK.get(item.path.stem, len(_RANK)))  # stable: a module's order stays
    for spec in {_stack_of(item) for item in items} - {None}:
        if spec is not None and spec.shares_ray:
            _RAY_NODES.update(inv.node for inv in parse_simulate(spec.simulate))
    _HEAD_MODULES.update(item.path for item in items if _uses_head(item))
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.exclusive("load"))


_beside_ray: list[bool] = [False]


@pytest.fixture(autouse=True)
def yield_to_ray(request: pytest.FixtureRequest) -> None:
    """Under xdist, the worker that runs the other modules beside the Ray ones lowers its priority
    (and its children's: their servers, browsers), once, at its first such test: the Ray group is
    the run's longest, and a Ray head starved of CPU misses its own start-up waits."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not _beside_ray[0] and request.path.stem not in RAY_GROUP:
        os.nice(10)
        _beside_ray[0] = True


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler for this suite, whatever ``--dist`` says: whole modules, the Ray ones as
    one unit, handed out in collection order (the order above). (xdist's own ``loadgroup`` cannot
    do it under pytest 9: it renames items through an attribute pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayApart(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray" if Path(module).stem in RAY_GROUP else module

    config.option.loadscopereorder = False
    return RayApart(config, log)


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Held by one process of this machine at a time (a lock file; released when it is closed)."""
    with open(Path(tempfile.gettempdir()) / f"gpulease-tests-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True)
def exclusive(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``exclusive(NAME)`` runs while no other test marked with NAME runs on this
    machine: for what is the machine's own, not a test's (the gpulease cgroup; a test that loads
    the machine on purpose, as every ``slow`` one does)."""
    names = sorted({str(m.args[0]) for m in request.node.iter_markers("exclusive")})
    with contextlib.ExitStack() as held:
        for name in names:
            held.enter_context(machine_lock(name))
        yield


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    proc = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield proc
    proc.stop()


@pytest.fixture
def prefix() -> str:
    return f"t{os.getpid()}x{next(_prefixes)}"


@pytest.fixture
def redis_sync(redis_server: RedisProcess) -> Iterator[Redis]:
    r = Redis.from_url(redis_server.url, decode_responses=True)
    yield r
    r.close()


def make_settings(redis_url: str, prefix: str, **kw: object) -> Settings:
    base: dict[str, object] = dict(
        redis_url=redis_url, prefix=prefix, port=0, sweep_interval=0.1, heartbeat_interval=0.5, heartbeat_timeout=3.0
    )
    base.update(kw)
    return Settings.load(None, **base)


def token_for(redis_url: str, prefix: str, user: str, role: str = "user") -> str:
    async def make() -> str:
        from lease_server.store.engine import connect

        r = connect(redis_url)  # redis:// or redis+sentinel://
        try:
            return await create_token(r, Keys(prefix), user, role)
        finally:
            await r.aclose()

    return asyncio.run(make())


@dataclass
class ServerHandle:
    """A lease server running in a background thread of the test process."""

    settings: Settings
    simulate: str
    url: str = ""
    tokens: dict[str, str] = field(default_factory=dict)
    _stop: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    def start(self) -> ServerHandle:
        from lease_server.web.server import serve

        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            async def main() -> None:
                self._loop = asyncio.get_running_loop()
                self._stop = asyncio.Event()

                def on_ready(port: int) -> None:
                    self.url = f"http://127.0.0.1:{port}"
                    ready.set()

                nodes = parse_simulate(self.simulate) if self.simulate else None
                await serve(self.settings, stop=self._stop, on_ready=on_ready, local_nodes=nodes)

            try:
                asyncio.run(main())
            except BaseException as exc:  # surfaced by start()
                errors.append(exc)
                ready.set()

        self._thread = threading.Thread(target=run, name="lease-server", daemon=True)
        self._thread.start()
        if not ready.wait(30) or errors:
            raise RuntimeError(f"lease server did not start: {errors}")
        return self

    def stop(self) -> None:
        """Stop the server; safe to call again."""
        if self._thread is None or not self._thread.is_alive():
            return
        if self._loop and self._stop and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def token(self, user: str, role: str = "user") -> str:
        if user not in self.tokens:
            self.tokens[user] = token_for(self.settings.redis_url, self.settings.prefix, user, role)
        return self.tokens[user]

    def client(self, user: str = "alice", role: str = "user") -> Client:
        return Client(self.url, self.token(user, role))


def servers_on(redis_url: str, prefix: str) -> Iterator[Any]:
    """A factory of lease servers in this process on ``redis_url`` (any URL ``connect`` takes), each
    under its own prefix; stopped when the generator is closed (as a fixture's teardown)."""
    started: list[ServerHandle] = []

    def make(simulate: str = "n1=4xA100-80GB,n2=2xA100-80GB,t1=2xT4-16GB", **kw: object) -> ServerHandle:
        settings = make_settings(redis_url, f"{prefix}s{len(started)}", **kw)
        handle = ServerHandle(settings, simulate).start()
        started.append(handle)
        return handle

    yield make
    for h in started:
        h.stop()


@pytest.fixture
def server_factory(redis_server: RedisProcess, prefix: str) -> Iterator[object]:
    yield from servers_on(redis_server.url, prefix)


@pytest.fixture
def server(server_factory: object) -> ServerHandle:
    return server_factory()  # type: ignore[operator]


class ServerProcess:
    """``gpulease server`` as a child process (for kill -9 tests), plus an HTTP agent process."""

    def __init__(self, redis_url: str, prefix: str, tmp: Path, port: int | None = None) -> None:
        self.redis_url, self.prefix, self.tmp = redis_url, prefix, tmp
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        env = {
            **os.environ,
            "GPULEASE_PREFIX": self.prefix,
            "GPULEASE_SWEEP_INTERVAL": "0.2",
            "GPULEASE_HEARTBEAT_TIMEOUT": "5",
        }
        log = open(self.tmp / f"server-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lease_server.cli",
                "server",
                "--redis-url",
                self.redis_url,
                "--port",
                str(self.port),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30

        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError((self.tmp / f"server-{self.port}.log").read_text()[-2000:])
            time.sleep(0.05)
        raise RuntimeError("gpulease server did not come up")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


CLI = [sys.executable, "-m", "lease_server.cli"]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Up:
    """``gpulease up`` as a child process, as a user starts it."""

    def __init__(self, data: Path, *extra: str, simulate: str | None = "box=2xA100-80GB", **env: str) -> None:
        self.data, self.port = data, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "GPULEASE_HOME": str(data), **env}
        self.env.pop("GPULEASE_URL", None)
        self.env.pop("GPULEASE_TOKEN", None)
        # Output goes to a file: a pipe nobody reads would block the server once it fills up.
        self.log = data.with_name(data.name + f"-up-{self.port}.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    *CLI,
                    "up",
                    *(["--simulate", simulate] if simulate else []),  # None: the real GPUs, through NVML
                    "--no-lab",
                    "--port",
                    str(self.port),
                    "--data-dir",
                    str(data),
                    *extra,
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/api/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling a process that is starting: there is no event to wait on
        # Stopped, not left behind: an orphaned stack (Redis, a Ray head) would slow every later test.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.interrupt()
        if self.proc.poll() is None:
            self.proc.kill()
        raise AssertionError(f"gpulease up did not answer within 120 s; its log: {self.log}")

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, *args], env=self.env, capture_output=True, text=True, timeout=60)

    def interrupt(self, sig: int = signal.SIGINT) -> tuple[int, str]:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        return self.proc.returncode, self.log.read_text()


# ---- `gpulease up` stacks: one per inventory and settings, shared by the modules that ask for it ------


@dataclass(frozen=True)
class Stack:
    """What a module's ``gpulease up`` is: the simulated inventory, its extra arguments, its settings
    (environment) and whether the gpulease kernelspec is on its JUPYTER_PATH (for kernels). Modules
    that ask for equal stacks share one (:class:`Stacks`); ``own`` (the asking module's name) keeps
    one apart for a module whose tests leave what another module's would see."""

    simulate: str = "box=2xA100-80GB"
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kernels: bool = False
    own: str = ""

    @property
    def shares_ray(self) -> bool:
        """Whether it joins the session's one Ray head (:class:`RayHead`) rather than starting its own."""
        return "--no-ray" not in self.args and "--ray-address" not in self.args

    @classmethod
    def of(
        cls, simulate: str = "box=2xA100-80GB", *args: str, kernels: bool = False, own: str = "", **env: str
    ) -> Stack:
        return cls(simulate, args, tuple(sorted(env.items())), kernels, own)

    def start(self, tmp: pytest.TempPathFactory, head: RayHead | None = None) -> Up:
        kernels = tmp.mktemp("kernels") if self.kernels else None
        if kernels is not None:
            from magics.kernel import install

            install(prefix=str(kernels))
        for attempt in (1, 2):
            home = tmp.mktemp("gpulease-home")
            # One Ray head starts at a time here: its agents must start within ~15 s of its raylet,
            # which several heads starting together on two cores can miss.
            joins = ("--ray-address", head.address, "--ray-token-file", str(head.token)) if head else ()
            with machine_lock("ray-start") if "--no-ray" not in self.args else contextlib.nullcontext():
                up = Up(home, *self.args, *joins, simulate=self.simulate, **dict(self.env))
            # `gpulease up` says so, and goes on, when its Ray head did not come up (a loaded machine
            # can time out Ray's own start): a kernel or driver would then hang joining it. Once more.
            said = up.log.read_text()
            if "--no-ray" in self.args or "the Ray head at" not in said:
                break
            up.interrupt()
            ray_log = (home / "ray.log").read_text()[-2000:] if (home / "ray.log").exists() else ""
            assert attempt == 1, f"the Ray head of gpulease up did not start:\n{said[-1000:]}\n{ray_log}"
        if kernels is not None:
            up.env["JUPYTER_PATH"] = str(kernels / "share" / "jupyter")
        return up


_RAY_NODES: set[str] = {"n1", "n2"}  # the nodes on the shared Ray head: these (test_gang's), the stacks'


class RayHead:
    """One Ray head for every stack that runs Ray (``gpulease up --ray-address``), started as
    ``gpulease up`` starts its own (the same ``ray start``, token auth on), with the node resources
    of all of them: a head start and a first driver cost 20-40 s on two cores, once per module
    before. Each stack still has its own Redis, lease server, agent and kernels; the workers of a
    module's kernels end with those kernels."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        from lease_server.cli import service
        from lease_server.node import rayauth

        self.dir = tmp.mktemp("ray-head")
        self.token = rayauth.ensure_token(self.dir)
        env = rayauth.clean_env(dict(os.environ), self.token)
        nodes = [parse_simulate(f"{n}=1xA100-80GB")[0] for n in sorted(_RAY_NODES | {"box"})]
        self._stop = service._stop
        # Ray gives its raylet a fixed 30 s to register (ray/_private/node.py), which a loaded
        # machine can miss a few times in a row: the whole Ray group waits on this one head.
        for attempt in range(1, 6):
            with machine_lock("ray-start"):
                self.proc, self.address = service._start_ray(self.dir, nodes, env)
                assert self.proc is not None, "ray is not installed"
                if service._wait_for_ray(self.address, env=env, last=attempt == 5):
                    return
            service._stop(self.proc, "ray head")
        raise AssertionError(f"the tests' Ray head did not start: {(self.dir / 'ray.log').read_text()[-2000:]}")

    def stop(self) -> None:
        self._stop(self.proc, "ray head")


class Stacks:
    """The session's stacks, each started when a module first asks for it and stopped when the next
    test to run here asks for another (or none), so that at most one idles while the next starts;
    and the Ray head they share, stopped once no test to come here needs it."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.live: dict[Stack, Up] = {}
        self.head: RayHead | None = None

    def ray_head(self) -> RayHead:
        if self.head is None:
            self.head = RayHead(self.tmp)
        return self.head

    def get(self, spec: Stack) -> Up:
        if spec not in self.live:
            self.live[spec] = spec.start(self.tmp, self.ray_head() if spec.shares_ray else None)
        return self.live[spec]

    def done(self, spec: Stack | None, next_item: pytest.Item | None) -> None:
        if spec is not None and spec != _stack_of(next_item) and spec in self.live:
            self.live.pop(spec).interrupt()
        if self.head is not None and not _needs_head(next_item):
            self.head.stop()
            self.head = None

    def stop_all(self) -> None:
        while self.live:
            self.live.popitem()[1].interrupt()
        if self.head is not None:
            self.head.stop()
            self.head = None


@pytest.fixture(scope="session")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    registry = Stacks(tmp_path_factory)
    yield registry
    registry.stop_all()


_next_item: list[pytest.Item | None] = [None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Note the test that runs next here, for the ``up`` fixture's teardown (runs inside this hook)."""
    _next_item[0] = nextitem
    yield


def _stack_of(item: pytest.Item | None) -> Stack | None:
    if item is None or "up" not in getattr(item, "fixturenames", ()):
        return None
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "up" in callspec.params:
        return callspec.params["up"]  # type: ignore[no-any-return]
    return getattr(getattr(item, "module", None), "STACK", None)


def _uses_head(item: pytest.Item) -> bool:
    """Whether ``item`` runs on the tests' shared Ray head (:class:`RayHead`)."""
    spec = _stack_of(item)
    return "ray_head" in getattr(item, "fixturenames", ()) or (spec is not None and spec.shares_ray)


def _needs_head(item: pytest.Item | None) -> bool:
    """Whether the head must stay up for ``item``: its module has a test on it. (A module's test
    that needs no stack, such as test_elastic's first, must not stop the head that the module's
    next test starts again: 30-40 s each time on two cores.)"""
    return item is not None and (item.path in _HEAD_MODULES or _uses_head(item))


@pytest.fixture(scope="module")
def up(request: pytest.FixtureRequest, stacks: Stacks) -> Iterator[Up]:
    """The module's ``gpulease up``: the :class:`Stack` it names as ``STACK`` (or an indirect
    parameter), shared with the other modules that name the same one."""
    spec = getattr(request, "param", None) or request.module.STACK
    yield stacks.get(spec)
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()  # this process joined the stack's Ray cluster as a driver
    stacks.done(spec, _next_item[0])


@pytest.fixture(scope="module")
def ray_head(stacks: Stacks) -> Iterator[RayHead]:
    """The tests' one Ray head, for a module that joins it without a ``gpulease up`` (its lease
    servers in this process: ``server_factory(..., ray_address=ray_head.address,
    ray_auth_token_file=str(ray_head.token))``)."""
    yield stacks.ray_head()
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()  # this process joined it as a driver
    stacks.done(None, _next_item[0])


# ---- what the stack tests share: a kernel's session on `up`, an admin client, the whole log ---------


def ray_session(up: Up, spares: int = 0, node: str = "box") -> Iterator[Any]:
    """A kernel's :class:`magics.session.Session` on ``up``'s lease server and Ray head (waited for
    while it starts), with ``spares`` workers kept started on ``node``; its leases released and its
    client reset at the end. For a module's ``sess`` fixture: ``yield from ray_session(up, 4)``."""
    from lease_server.errors import ConfigurationError
    from magics.session import Session

    s = Session()
    s.defaults.url, s.defaults.token = up.url, (up.data / "token").read_text().strip()
    if spares:
        deadline = time.monotonic() + 120
        while True:
            try:
                s.connect_ray()
                break
            except ConfigurationError:
                assert time.monotonic() < deadline, "the Ray head of gpulease up did not answer"
                time.sleep(0.5)  # the Ray head is still starting: there is no event to wait on
        s.set_spares(node, spares)
    yield s
    s.release_all()
    s.reset_client()


@pytest.fixture
def admin(up: Up, sess: Any) -> Iterator[Client]:
    """The stack's admin (the token ``gpulease up`` made), for the module's ``up`` and ``sess``."""
    c = Client(up.url, sess.defaults.token)
    yield c
    c.close()


def all_events(c: Client) -> list[dict[str, Any]]:
    """The whole event log, oldest first (what ``gpulease events export`` reads)."""
    from lease_server.cli.events import read_forward

    return list(read_forward(c, None))
