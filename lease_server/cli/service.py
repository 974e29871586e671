"""Running the service: ``gpulease up`` (everything on one machine), ``server`` and ``agent``."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import getpass
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from rich.text import Text

from ..client import DEFAULT_HOME, UP_SOCKET, Client
from ..node import rayworkers
from ._common import console, err_console

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT)


UP_LOG = "up.log"  # gpulease up's log, in its data dir
UP_LOG_KEEP = 20 * 1024 * 1024  # a longer one is moved to up.log.1 when up starts


class OneLine(logging.Formatter):
    """A warning or an error as a person reads it on up's terminal: one line (``12:04:31 warning:
    heartbeat of box failed: ...``), its traceback left to the log file, which the line names."""

    def __init__(self, log_file: Path | None = None) -> None:
        super().__init__(datefmt="%H:%M:%S")
        self.log_file = log_file

    def format(self, record: logging.LogRecord) -> str:
        text = " ".join(record.getMessage().split())
        if (record.exc_info or record.stack_info) and self.log_file is not None:
            text += f" (details in {self.log_file})"
        return f"{self.formatTime(record, self.datefmt)} {record.levelname.lower()}: {text}"


def _up_logging(verbose: bool) -> logging.Handler:
    """``gpulease up``'s terminal: with ``-v`` every log line, as ``server`` and ``agent`` print
    them; otherwise only warnings and errors, a line each (its INFO lines, dozens while a notebook
    runs, go to its log file: :func:`_up_log_file`). Returns the terminal's handler."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    terminal = logging.StreamHandler(sys.stderr)
    if verbose:
        terminal.setFormatter(logging.Formatter(LOG_FORMAT))
    else:
        terminal.setLevel(logging.WARNING)
        terminal.setFormatter(OneLine())
    root.addHandler(terminal)
    return terminal


def _up_log_file(data_dir: Path, terminal: logging.Handler) -> Path:
    """Every log line of this up from now on also in ``<data_dir>/up.log`` (0600, appended to; one
    over UP_LOG_KEEP is moved to up.log.1 first). The terminal's one-line warnings name it."""
    path = data_dir / UP_LOG
    with contextlib.suppress(OSError):
        if path.stat().st_size > UP_LOG_KEEP:
            os.replace(path, path.with_name(UP_LOG + ".1"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    handler = logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8", errors="replace"))
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    if isinstance(terminal.formatter, OneLine):
        terminal.formatter.log_file = path
    return path


BANNER_WIDTH = 80
_LABEL = 12  # the widest label ("lease server"): values start at column 2 + 12 + 2


def banner_lines(head: str, rows: list[tuple[str, str]], width: int = BANNER_WIDTH) -> list[str]:
    """``gpulease up``'s banner, every line within ``width`` columns: ``head``, then a row per
    ``(label, value)``: ``  label         value``, or, where that would not fit (a lab URL with a
    5-digit port), the label alone with the value on the line under it. A row of label ``""`` is a
    note on the row above: under its value, wrapped at spaces (only a word longer than a line, a
    long path, goes past ``width``)."""
    import textwrap

    out = textwrap.wrap(head, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
    under = " " * (2 + _LABEL + 2)
    for label, value in rows:
        if label:
            line = f"  {label:<{_LABEL}}  {value}"
            out += [line] if len(line) <= width else [f"  {label}", f"    {value}"]
        else:
            out += textwrap.wrap(
                value,
                width,
                initial_indent=under,
                subsequent_indent=under + " ",
                break_long_words=False,
                break_on_hyphens=False,
            )
    return out


def _more_files(most: int = 65536) -> None:
    """The soft limit of open files raised toward the hard one (at most ``most``): a server, an
    agent and their claim sockets hold one per connection, and 1,024 (the usual soft limit) is
    what one local user's connections could use up. The claim socket caps each uid's
    connections (node/claims.py Gate); this leaves room for everyone else's."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _inventories(simulate: str | None, node: str | None, pool: str | None, cpu_slots: int = 0) -> list[Any]:
    from ..leasing.inventory import parse_simulate
    from ..node.agent import nvml_inventories

    if simulate:
        invs = parse_simulate(simulate, default_node=node)
        if pool:
            for inv in invs:
                inv.pool = pool
    else:
        invs = nvml_inventories(node, pool)
    if cpu_slots:
        # CPU slots for %%gpu_train --gpus 0: a node of their own in the CPU pool, on this machine.
        invs += parse_simulate(f"{invs[0].node}-cpu={cpu_slots}xCPU")
    return invs


CPU_SLOTS_HELP = "Also declare this many CPU slots (pool CPU) for %%gpu_train --gpus 0 (default: none)"


def _local_user() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", getpass.getuser()) or "user"
    return name[:63]


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.fchmod(fd, 0o600)  # a file from before, with a looser mode: tightened before the secret is in it
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


async def _check_layout(redis_url: str, prefix: str, hint: str) -> None:
    """Refuse (ConfigurationError, one line naming gpulease migrate) data of another layout."""
    from ..store.engine import connect
    from ..store.keys import Keys
    from ..store.layout import check

    r = connect(redis_url)
    try:
        await check(r, Keys(prefix), hint)
    finally:
        await r.aclose()


async def _ensure_token(redis_url: str, prefix: str, token_file: Path, user: str, role: str = "admin") -> str:
    """Reuse the token in ``token_file`` if Redis still knows it as ``user``'s with ``role``, else
    create such a token and write it there (0600)."""
    from ..store.engine import connect
    from ..store.keys import Keys
    from ..store.layout import migrate_untagged
    from ..web.auth import create_token, hash_token

    r = connect(redis_url)
    try:
        keys = Keys(prefix)
        await migrate_untagged(r, keys)  # a token made before keys carried the hash tag still counts
        if token_file.exists():
            token = token_file.read_text().strip()
            raw = await r.hget(keys.tokens, hash_token(token)) if token else None
            rec = json.loads(raw) if raw else {}
            if rec.get("user") == user and rec.get("role") == role:
                return token
        token = await create_token(r, keys, user, role)
        _write_private(token_file, token)
        return token
    finally:
        await r.aclose()


def _tool(name: str) -> str:
    """A console script of this environment first (the one whose packages we import), else PATH's."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else (shutil.which(name) or str(here))


def _start_ray(
    data_dir: Path, nodes: list[Any], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes] | None, str]:
    ray = _tool("ray")
    if not Path(ray).exists():
        err_console.print("[yellow]ray is not installed: %%gpu_train will not run (pip install ray)[/]")
        return None, ""
    from ..node.redis_proc import free_port

    port = free_port()
    log = open(data_dir / "ray.log", "ab")
    # Ray makes its temp dir and every session dir in it 0777 (sockets, logs, objects spilled to
    # disk): under /tmp/ray any local user could read a cell's spilled inputs or move the raylet's
    # socket away. Its temp dir goes under a directory only this user may enter (mkdtemp: 0700),
    # in /tmp whatever TMPDIR says: short enough for its socket paths (108 bytes). Gone when the
    # head stops (left behind if up is killed with SIGKILL).
    private = Path(tempfile.mkdtemp(prefix="gpulease-", dir="/tmp" if os.path.isdir("/tmp") else None))
    # Ray starts one idle Python worker per CPU when the first driver joins, for tasks; gpulease runs
    # only actors, each with its lease's environment, which never reuse those workers: on a 64-core
    # GPU host that was 64 idle processes (~100 MB each) from `gpulease up`'s own readiness check on.
    # Its workers start with the PYTHONPATH a kernel of this environment gives them, so a kernel
    # starts them without a runtime environment: a quarter of the CPU each (node/rayworkers.py).
    env = {**rayworkers.with_worker_pythonpath(env), "RAY_prestart_worker_first_driver": "0"}
    resources: dict[str, float] = {f"gpulease_node_{n.node}": 1000 for n in nodes}
    resources[rayworkers.boot_resource(env["PYTHONPATH"])] = 1
    proc = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            f"--port={port}",
            "--block",
            "--disable-usage-stats",
            "--include-dashboard=false",
            f"--temp-dir={private / 'ray'}",
            "--num-gpus=0",
            # Every lease-server node this machine serves is a Ray resource, so that a call is
            # placed on the Ray node of its lease (magics.runner.node_resource).
            "--resources=" + json.dumps(resources),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    _RAY_DIRS[proc.pid] = private
    return proc, f"127.0.0.1:{port}"


_RAY_DIRS: dict[int, Path] = {}  # a Ray head's pid -> the private directory of its temp dir


def _wait_for_ray(address: str, timeout: float = 180.0, env: dict[str, str] | None = None, last: bool = True) -> bool:
    """Connect one throw-away driver, so that "gpulease is up" means a notebook's first
    %%gpu_train finds a Ray head that accepts drivers (its first connection can take ~10 s).
    False if it did not; ``last``: say so (else the caller starts the head again)."""
    code = (
        "import logging, ray; "
        f"ray.init(address={address!r}, log_to_driver=False, logging_level=logging.ERROR, configure_logging=False); "
        "ray.shutdown()"
    )
    # With magics/_boot first on its path, as the head's workers: its `import ray` costs a third.
    env = rayworkers.with_worker_pythonpath(env)
    with console.status("waiting for the Ray head…"):
        try:
            done = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
            )
        except subprocess.TimeoutExpired:
            if last:
                err_console.print(f"[yellow]the Ray head at {address} did not accept a driver within {timeout:g}s[/]")
            return False
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        if last:
            err_console.print(f"[yellow]the Ray head at {address} refused a driver: {tail[0]}[/]")
        return False
    return True


def lab_environment(
    redis_url: str,
    prefix: str,
    data_dir: Path,
    url: str,
    ray_address: str = "",
    ray_token: Path | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of the JupyterLab that ``gpulease up`` starts, and so of every kernel it
    spawns: a *user* token of the OS user who ran ``gpulease up`` (kept in ``<data_dir>/lab_token``,
    0600), never the admin token, which stays in ``<data_dir>/token`` for the CLI. Notebook code
    holds its token in its environment; with the admin's, any cell (or anyone the notebook is
    shared with) could revoke leases, change policy and mint tokens. The Jupyter login token goes in
    ``JUPYTER_TOKEN``, not on the command line, where ``ps`` would show it to every local user."""
    token = asyncio.run(_ensure_token(redis_url, prefix, data_dir / "lab_token", _local_user(), "user"))
    env = {**(os.environ if base is None else base)}
    env.pop("GPULEASE_REDIS_URL", None)  # it may carry a Redis password: kernels talk HTTP only
    env.update(GPULEASE_URL=url, GPULEASE_TOKEN=token, JUPYTER_TOKEN=secrets.token_hex(16))
    # the token goes only to a listener of this user (or root) on up's port (client.ServerGuard),
    # should up die and another user bind the port while JupyterLab and its kernels run on
    env["GPULEASE_SERVER_UID"] = str(os.geteuid())
    env["GPULEASE_SOCKET"] = str(data_dir / UP_SOCKET)  # and it goes there at all (client.up_socket)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    if ray_token is not None:
        from ..node import rayauth

        env = rayauth.clean_env(env, ray_token)
    return env


def _lab_command(jupyter: str, port: int) -> list[str]:
    """JupyterLab's argv: no secret in it (the login token is the environment's JUPYTER_TOKEN)."""
    return [
        jupyter,
        "lab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        "--ServerApp.port_retries=0",  # the port the banner names, or none
        *(["--allow-root"] if os.geteuid() == 0 else []),  # containers often run as root
    ]


# Defaults of the JupyterLab that ``gpulease up`` starts (a plugin's settings, as in JupyterLab's
# Settings editor): no "Would you like to get notified about official Jupyter news?" prompt over the
# notebook on its first page. Defaults only: a user who turns news on in Settings gets them.
LAB_SETTING_DEFAULTS = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}
LAB_SERVER_CONFIG = {"MultiKernelManager": {"default_kernel_name": "gpulease"}}


def lab_config_path(data_dir: Path, env: Mapping[str, str]) -> str:
    """The ``JUPYTER_CONFIG_PATH`` of the JupyterLab that ``gpulease up`` starts: a folder of its own
    under ``data_dir`` (its ``labconfig/default_setting_overrides.json`` holds
    :data:`LAB_SETTING_DEFAULTS`, and its ``jupyter_server_config.json`` makes the gpulease kernel the
    default) first, then any path the environment already names. The user's own
    ``~/.jupyter`` is left as it is, and still wins over these defaults."""
    folder = data_dir / "jupyter-config"
    (folder / "labconfig").mkdir(parents=True, exist_ok=True)
    (folder / "labconfig" / "default_setting_overrides.json").write_text(
        json.dumps(LAB_SETTING_DEFAULTS, indent=2) + "\n"
    )
    # The gpulease kernel is the one a new notebook gets, and the first card of the launcher.
    (folder / "jupyter_server_config.json").write_text(json.dumps(LAB_SERVER_CONFIG, indent=2) + "\n")
    given = env.get("JUPYTER_CONFIG_PATH", "")
    return os.pathsep.join([str(folder), *([given] if given else [])])


def _start_lab(data_dir: Path, port: int, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    jupyter = _tool("jupyter")
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        err_console.print("[yellow]JupyterLab is not installed: pip install 'gpulease[lab]' to get it[/]")
        return None
    from ..node.kernelspec import install

    install(prefix=sys.prefix)  # the CPU-only "Python 3 (gpulease)" kernel, beside this JupyterLab
    log = open(data_dir / "jupyterlab.log", "ab")
    return subprocess.Popen(
        _lab_command(jupyter, port),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**env, "JUPYTER_CONFIG_PATH": lab_config_path(data_dir, env)},
        start_new_session=True,
    )


def _lab_answers(proc: subprocess.Popen[bytes], port: int, timeout: float = 120.0) -> bool:
    """Whether JupyterLab opens its port within ``timeout`` (False at once if it exits)."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)  # a process that is starting: there is no event to wait on
    return False


def _hold(data_dir: Path, what: str = "up") -> int:
    """The data directory held for this ``up`` (or ``migrate``: ``what``) with
    :func:`redis_proc.hold_data_dir`, or a refusal naming what holds it."""
    from ..node.redis_proc import DataDirInUse, hold_data_dir

    try:
        return hold_data_dir(data_dir, what)
    except DataDirInUse as exc:
        raise click.ClickException(str(exc)) from None


def _port_taken(port: int, flag: str) -> click.ClickException:
    return click.ClickException(f"port {port} is taken on 127.0.0.1: pick another with gpulease up {flag} N")


def _bind_port(port: int) -> list[Any]:
    """The lease server's listening socket, bound before anything starts (its server serves it
    once ready; a client that connects meanwhile waits in the backlog)."""
    import tornado.netutil

    try:
        return tornado.netutil.bind_sockets(port, "127.0.0.1", reuse_port=False)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise _port_taken(port, "--port") from None
        raise click.ClickException(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None


def _lab_port_free(port: int) -> None:
    """JupyterLab's port is free now (it is started with ``port_retries=0``: taken by the time it
    starts, it stops, and the banner says so, rather than moving to another port the banner would
    not name)."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise _port_taken(port, "--lab-port") from None
            raise click.ClickException(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None


def _stop(proc: subprocess.Popen[bytes] | None, name: str) -> None:
    """SIGTERM the leader (Ray's `start --block` then stops its own children in order), then
    SIGKILL whatever is left in its process group."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            # Ray drains for up to 30 s when workers of dead drivers linger; nothing it holds
            # needs saving, so a short grace then SIGKILL is enough.
            proc.wait(8)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    private = _RAY_DIRS.pop(proc.pid, None)
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)
    err_console.print(f"stopped {name}")


@click.command()
@click.option(
    "--simulate",
    metavar="SPEC",
    help="Declare GPUs instead of reading NVML: 4xA100-80GB or node-a=4xA100-80GB,node-b=2xT4-16GB",
)
@click.option("--port", default=8470, show_default=True, help="Port of the lease server (127.0.0.1)")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=DEFAULT_HOME,
    show_default=True,
    help="Redis AOF, token, logs",
)
@click.option("--ray/--no-ray", default=True, show_default=True, help="Start a local Ray head")
@click.option(
    "--ray-address",
    metavar="HOST:PORT",
    default=None,
    help="Join this running Ray cluster instead of starting a head: its nodes need the resources "
    "that `gpulease agent --simulate SPEC --print-ray-resources` prints",
)
@click.option(
    "--ray-token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="With --ray-address: the cluster's auth token file (RAY_AUTH_MODE=token), handed to kernels",
)
@click.option("--lab/--no-lab", default=True, show_default=True, help="Start JupyterLab (if installed)")
@click.option("--lab-port", default=8888, show_default=True)
@click.option("--cpu-slots", type=click.IntRange(0, 1024), default=0, help=CPU_SLOTS_HELP)
@click.option("--config", type=click.Path(exists=True), help="TOML settings file")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help=f"Print the log here too, with debug lines (it goes to DATA_DIR/{UP_LOG}; warnings come here anyway)",
)
def up(
    simulate: str | None,
    cpu_slots: int,
    port: int,
    data_dir: Path,
    ray: bool,
    ray_address: str | None,
    ray_token_file: Path | None,
    lab: bool,
    lab_port: int,
    config: str | None,
    verbose: bool,
) -> None:
    """Run everything on this machine: Redis (AOF), lease server, node agent, Ray head, JupyterLab."""
    from ..config import Settings
    from ..node import claims, rayauth
    from ..node.redis_proc import PASSWORD_FILE, for_data_dir, note_redis
    from ..web.server import serve

    if ray_token_file is not None and not ray_address:
        raise click.UsageError("--ray-token-file goes with --ray-address (a head gpulease starts makes its own)")
    if ray_address and not ray:
        raise click.UsageError("--ray-address joins a Ray cluster and --no-ray starts none: drop one of them")
    terminal = _up_logging(verbose)
    _more_files()
    data_dir = data_dir.expanduser().resolve()
    nodes = _inventories(simulate, None, None, cpu_slots)
    # Before starting anything: the data directory is this up's alone, and its ports are free (a
    # port taken once Redis, Ray and JupyterLab had started cost minutes and ended in a traceback).
    held = _hold(data_dir)
    log_file = _up_log_file(data_dir, terminal)
    logging.getLogger(__name__).info("gpulease up (pid %d) starting on %s", os.getpid(), data_dir)
    sockets = _bind_port(port)
    port = sockets[0].getsockname()[1]  # (--port 0: the one the system chose)
    if lab:
        _lab_port_free(lab_port)
    # Redis on 127.0.0.1 with a password from a 0600 file in the 0700 data directory (every local
    # user can reach the port; without the password one could write an admin token's hash into it).
    try:
        redis_proc = for_data_dir(data_dir, held=held).start()  # it keeps the data dir held too
    except BaseException:
        for s in sockets:
            s.close()
        os.close(held)
        raise
    if redis_proc.proc is not None:
        note_redis(held, "up", redis_proc.proc.pid)
    # The services this process starts are never ended by its node agent (lease_server/node/claims.py):
    # Redis; ``ray start`` and its children, Ray's daemons (Ray's workers, the raylet's children, may
    # be); JupyterLab and its kernels.
    if redis_proc.proc is not None:
        claims.protect(redis_proc.proc.pid)
    ray_proc = lab_proc = None
    try:
        settings = Settings.load(config, redis_url=redis_proc.url, port=port, host="127.0.0.1")
        asyncio.run(_check_layout(settings.redis_url, settings.prefix, f" --data-dir {data_dir}"))
        token = asyncio.run(_ensure_token(settings.redis_url, settings.prefix, data_dir / "token", _local_user()))
        # and a user token for notebooks, lab or not: a kernel or a Jupyter server started apart
        # finds it (client.discover), never the admin's
        asyncio.run(_ensure_token(settings.redis_url, settings.prefix, data_dir / "lab_token", _local_user(), "user"))
        url = f"http://127.0.0.1:{port}"
        (data_dir / "url").write_text(url + "\n")
        ray_token: Path | None = None
        if ray_address:
            # A Ray cluster run by someone else (or shared by several stacks): joined, never
            # started or stopped here; a driver must be accepted before the banner says so.
            ray_token = ray_token_file.expanduser().resolve() if ray_token_file else None
            ray_env = rayauth.clean_env(dict(os.environ), ray_token) if ray_token else None
            if not _wait_for_ray(ray_address, timeout=60, env=ray_env):
                raise click.ClickException(f"the Ray cluster at {ray_address} did not accept a driver; is it running?")
            settings.ray_address = ray_address
            (data_dir / "ray_address").write_text(ray_address + "\n")
            if ray_token is not None:
                settings.ray_auth_token_file = str(ray_token)
        elif ray:
            # Token authentication: the head, its workers, JupyterLab's kernels and the lease
            # server's /info share the token in data_dir, through the environment (lease_server/node/rayauth.py).
            ray_token = rayauth.ensure_token(data_dir)
            ray_env = rayauth.clean_env(dict(os.environ), ray_token)
            for attempt in (1, 2, 3):
                ray_proc, settings.ray_address = _start_ray(data_dir, nodes, ray_env)
                if ray_proc is None or _wait_for_ray(settings.ray_address, env=ray_env, last=attempt == 3):
                    break
                # A Ray head on a busy machine can give up on its own agents while starting (they
                # have a fixed time to come up): start it again, as a service manager would.
                err_console.print(f"[yellow]the Ray head did not come up (try {attempt} of 3); starting it again[/]")
                _stop(ray_proc, "ray")
            (data_dir / "ray_address").write_text(settings.ray_address + "\n")
            if ray_proc is not None:
                claims.protect(ray_proc.pid, children=True)
                settings.ray_auth_token_file = str(ray_token)
        lab_url = ""
        if lab:
            env = lab_environment(
                settings.redis_url,
                settings.prefix,
                data_dir,
                url,
                settings.ray_address,
                ray_token if settings.ray_auth_token_file else None,
            )
            lab_proc = _start_lab(data_dir, lab_port, env)
            if lab_proc is not None:
                claims.protect(lab_proc.pid, children=True)
                lab_url = f"http://127.0.0.1:{lab_port}/lab?token={env['JUPYTER_TOKEN']}"

        def ready(bound: int) -> None:
            # The banner says everything is up, so it waits for JupyterLab to answer (it starts
            # beside the lease server and takes a few seconds more); the server serves meanwhile.
            if lab_proc is not None:
                threading.Thread(target=banner, args=(_lab_answers(lab_proc, lab_port),), daemon=True).start()
            else:
                banner(True)

        def banner(lab_up: bool) -> None:
            # One write, every line within 80 columns (each thing on its line, what it is under it):
            # a log line (with -v) never lands inside it, a long URL is never wrapped under its label.
            gpus = sum(len(n.gpus) for n in nodes)
            rows = [
                ("lease server", url),
                ("token", token),
                ("", f"(also in {data_dir / 'token'}, mode 0600)"),
                ("redis", redis_proc.address),
                ("", f"(AOF in {data_dir / 'redis'}; password in {PASSWORD_FILE})"),
            ]
            if settings.ray_address:
                rows.append(("ray head", settings.ray_address))
                if settings.ray_auth_token_file:
                    rows.append(("", f"(token auth: {ray_token}, mode 0600)"))
            if lab_url and lab_up:
                rows.append(("jupyterlab", lab_url))
            elif lab_url:
                rows.append(("jupyterlab", f"did not answer: see {data_dir / 'jupyterlab.log'}"))
            rows.append(("log", str(log_file)))
            if not verbose:
                rows.append(("", "(gpulease up -v: here too; warnings come here anyway)"))
            pools = ", ".join(sorted({n.pool for n in nodes}))
            lines = banner_lines(f"gpulease is up: {gpus} GPU(s) in {pools}", rows)
            lines.append("Ctrl-C stops everything.")
            text = Text("\n".join(lines))
            text.stylize("bold green", 0, len("gpulease is up"))
            console.print(text, soft_wrap=True)
            logging.getLogger(__name__).info("gpulease is up: %d GPU(s) in %s, lease server %s", gpus, pools, url)

        from ..web.server import run_loop

        sock = str(data_dir / UP_SOCKET)  # up's own clients (client.up_socket): no other user may bind it
        run_loop(
            serve(
                settings,
                sockets,
                stop=None,
                on_ready=ready,
                local_nodes=nodes,
                own_process=True,
                unix_socket=sock,
            )
        )
    finally:
        for s in sockets:
            s.close()
        _stop(lab_proc, "jupyterlab")
        _stop(ray_proc, "ray head")
        redis_proc.stop()
        os.close(held)
        err_console.print("stopped redis; gpulease is down")


@click.command()
@click.option(
    "--redis-url",
    envvar="GPULEASE_REDIS_URL",
    default=None,
    help="redis://HOST:PORT/DB; redis+sentinel://H1:26379,H2:26379/SERVICE/DB for a primary that Sentinel "
    "fails over; redis+cluster://H1:P1,H2:P2 for a Redis Cluster (default: the config file's redis_url, "
    "else redis://127.0.0.1:6379/0)",
)
@click.option("--host", default=None, help="Address to listen on (default: the config file's, else 127.0.0.1)")
@click.option("--port", type=int, default=None, help="Port (default: the config file's, else 8470)")
@click.option("--workers", default=1, show_default=True, help="Processes sharing the port")
@click.option("--config", type=click.Path(exists=True), help="TOML settings file")
@click.option("--ray-address", default=None, help="Ray cluster the clients should use")
@click.option("-v", "--verbose", is_flag=True)
def server(
    redis_url: str | None,
    host: str | None,
    port: int | None,
    workers: int,
    config: str | None,
    ray_address: str | None,
    verbose: bool,
) -> None:
    """Run the HTTP lease server against an existing Redis (any number of replicas)."""
    from ..config import Settings
    from ..web.server import run

    _setup_logging(verbose)
    _more_files()
    settings = Settings.load(config, redis_url=redis_url, host=host, port=port, ray_address=ray_address)
    run(settings, workers)


@click.command()
@click.option("--simulate", metavar="SPEC", help="Declared GPUs instead of NVML, e.g. 4xA100-80GB")
@click.option("--node", help="Node name (default: host name)")
@click.option("--pool", help="Pool of this node (default: GPU model and memory)")
@click.option("--url", envvar="GPULEASE_URL")
@click.option(
    "--token",
    envvar="GPULEASE_TOKEN",
    help="An agent or admin token; pass it as GPULEASE_TOKEN instead: every local user reads argv with ps",
)
@click.option("--interval", default=2.0, show_default=True, help="Heartbeat period, seconds")
@click.option("--cpu-slots", type=click.IntRange(0, 1024), default=0, help=CPU_SLOTS_HELP)
@click.option(
    "--print-ray-resources",
    is_flag=True,
    help="Print the --resources JSON that this host's `ray start` needs (its gpulease_node_<node> "
    "resources) and exit, without contacting the lease server",
)
@click.option(
    "--gpu-isolation",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Each lease's workers in a cgroup that opens only its GPUs (needs root; auto: on real GPUs)",
)
@click.option("-v", "--verbose", is_flag=True)
def agent(
    simulate: str | None,
    cpu_slots: int,
    gpu_isolation: str,
    node: str | None,
    pool: str | None,
    url: str | None,
    token: str | None,
    interval: float,
    print_ray_resources: bool,
    verbose: bool,
) -> None:
    """Declare this node's GPUs to the lease server and keep it alive."""
    from ..node.agent import run_remote

    invs = _inventories(simulate, node, pool, cpu_slots)
    if print_ray_resources:
        # A call is placed on the Ray node that carries its lease's node resource
        # (magics.session.node_resource); the same 1000 units that `gpulease up` gives its head.
        click.echo(json.dumps({f"gpulease_node_{inv.node}": 1000 for inv in invs}))
        return
    _setup_logging(verbose)
    _more_files()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Client(url, token) as client:
        try:
            run_remote(client, invs, interval, stop, gpu_isolation=gpu_isolation)
        except KeyboardInterrupt:
            pass
