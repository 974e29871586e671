"""The Ray head of ``gpulease up`` runs with token authentication: a driver without the token is
refused, one with it (from the data dir, or handed out by the lease server to %%gpu_train) joins.

Every driver here is a subprocess with a clean environment and its own HOME, so neither the token
of this stack nor a stray ``~/.ray/auth_token`` can leak into or out of the test process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Up, port_open

pytest.importorskip("ray")

JOIN = (
    "import logging, sys, ray\n"
    "ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR, configure_logging=False)\n"
    "print('joined', int(ray.cluster_resources().get('gpulease_node_box', 0)), flush=True)\n"
    "print('temp', ray._private.worker._global_node.get_temp_dir_path(), flush=True)\n"
    "ray.shutdown()\n"
)
MAGIC = (
    "import sys\n"
    "from magics.session import Session\n"
    "s = Session()\n"
    "s.defaults.url, s.defaults.token = sys.argv[1], sys.argv[2]\n"
    "s.connect_ray()\n"
    "import ray\n"
    "print('joined', int(ray.cluster_resources().get('gpulease_node_box', 0)), flush=True)\n"
    "ray.shutdown()\n"
)


def driver(code: str, home: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    clean = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", **env}
    root = str(Path(__file__).resolve().parent.parent)
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env={**clean, "PYTHONPATH": root},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=root,
    )


@pytest.mark.slow
def test_up_starts_ray_with_token_auth(tmp_path):
    stray = Path.home() / ".ray" / "auth_token"
    stray_before = stray.exists()
    up = Up(tmp_path / "home")
    drivers: list[subprocess.Popen[str]] = []
    try:
        token_file = up.data / "ray_auth_token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert len(token) == 64
        admin = (up.data / "token").read_text().strip()
        info = httpx.get(f"{up.url}/api/v1/info", headers={"Authorization": f"Bearer {admin}"}).json()
        address = info["ray_address"]
        assert info["ray_auth_token"] == token  # what %%gpu_train joins with
        agent = httpx.post(
            f"{up.url}/api/v1/tokens",
            json={"user": "a1", "role": "agent"},
            headers={"Authorization": f"Bearer {admin}"},
        ).json()["token"]
        as_agent = httpx.get(f"{up.url}/api/v1/info", headers={"Authorization": f"Bearer {agent}"}).json()
        assert "ray_auth_token" not in as_agent and as_agent["ray_address"] == address
        deadline = time.monotonic() + 60

        def started() -> bool:  # GCS opens its port before `ray start` has started the rest and said so
            log = up.data / "ray.log"
            return port_open(int(address.rpartition(":")[2])) and "Ray runtime started" in log.read_text()

        while not started() and time.monotonic() < deadline:
            time.sleep(0.2)  # Ray's head takes a few seconds; no event to wait on
        ray_log = (up.data / "ray.log").read_text()
        assert started(), ray_log[-3000:]
        home = tmp_path / "nobody"
        home.mkdir()
        # All three at once: the refused one retries for ~20 s before it gives up.
        refused = driver(JOIN, home, address)
        with_token = driver(JOIN, home, address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
        magic = driver(MAGIC, home, up.url, admin)
        drivers += [refused, with_token, magic]
        out, err = with_token.communicate(timeout=120)
        assert with_token.returncode == 0 and "joined 1000" in out, err[-2000:]
        # Ray's temp dir (its sockets, logs, spilled objects; Ray makes it 0777) is in a directory
        # only this user may enter, not /tmp/ray where anyone may read and move what is there
        temp = Path(out.split("temp ", 1)[1].split()[0])
        private = temp.parent.stat()
        assert not str(temp).startswith("/tmp/ray") and (temp / "session_latest").exists(), temp
        assert private.st_uid == os.geteuid() and private.st_mode & 0o777 == 0o700, oct(private.st_mode)
        out, err = magic.communicate(timeout=120)
        assert magic.returncode == 0 and "joined 1000" in out, err[-2000:]
        out, err = refused.communicate(timeout=120)
        assert refused.returncode != 0 and "joined" not in out
        assert "InvalidAuthToken" in err or "AuthenticationError" in err, err[-2000:]
        assert not (home / ".ray" / "auth_token").exists()  # Ray made no token of its own
    finally:
        for d in drivers:
            if d.poll() is None:
                d.kill()
            d.communicate(timeout=30)
        code, log = up.interrupt()
    assert code == 0, log
    assert f"(token auth: {token_file}, mode 0600)" in " ".join(log.split())  # (a long path: wrapped)
    assert not temp.parent.exists()  # gone with the head
    assert stray.exists() == stray_before  # the user's ~/.ray is left alone
