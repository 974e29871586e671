"""gpulease under a real JupyterHub: README's recipe, two users, one shared proxy token.

A real JupyterHub (SharedPasswordAuthenticator, SimpleLocalProcessSpawner: single-user servers as this
process's user, each with its own home under a temporary folder) behind a real configurable-http-proxy,
configured with ``examples/jupyterhub_config.py`` exactly as README shows it, against a real lease
server. alice and bob each get a single-user JupyterLab with the gpulease server extension; a kernel
on each leases through ``%%gpu_train``'s own client, and Chromium (Debian's, driven by Playwright)
logs in as alice and uses the GPU board.

configurable-http-proxy comes from the PATH, else from npm into ~/.cache/gpulease-test (once; XDG_CACHE_HOME
moves it). Skipped, saying why, without npm (or when that install fails); the browser test also
without /usr/bin/chromium. One Hub serves every test of this module.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from lease_server.client import Client
from lease_server.node.redis_proc import RedisProcess, free_port
from tests.conftest import ServerHandle, make_settings, token_for
from tests.test_ui import ARTIFACTS, BUILT, CHROMIUM, CHROMIUM_ARGS, confirm, palette_item

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "jupyterhub_config.py"
README = REPO / "README.md"
USERS = ("alice", "bob")
POOL = "A100-80GB"
CHP_SPEC = "configurable-http-proxy@4.6"  # node >= 10; 5.x brings commander 15, which wants node >= 22.12
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpulease-test"


def configurable_http_proxy() -> str:
    """The configurable-http-proxy executable: from the PATH, else npm-installed once into CACHE."""
    found = shutil.which("configurable-http-proxy")
    if found:
        return found
    prefix = CACHE / CHP_SPEC.replace("@", "-")
    exe = prefix / "node_modules" / ".bin" / "configurable-http-proxy"
    npm = shutil.which("npm")
    if shutil.which("node") is None or (npm is None and not exe.exists()):
        pytest.skip(
            "configurable-http-proxy (JupyterHub's proxy) is not on the PATH, and Node.js and npm are missing to "
            "install it: apt-get install -y nodejs npm (or npm install -g configurable-http-proxy)"
        )
    if not exe.exists():
        assert npm is not None
        prefix.mkdir(parents=True, exist_ok=True)
        with open(CACHE / "npm.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another test run may be installing it right now
            if not exe.exists():
                cmd = [npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(prefix), CHP_SPEC]
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                except subprocess.TimeoutExpired:
                    pytest.skip(f"{' '.join(cmd)} took more than 5 minutes: is the npm registry reachable?")
                if done.returncode != 0 or not exe.exists():
                    pytest.skip(
                        f"could not install configurable-http-proxy ({' '.join(cmd)} exited {done.returncode}): "
                        f"{(done.stderr or done.stdout)[-1500:]}"
                    )
    return str(exe)


def readme_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


# ---- the Hub ------------------------------------------------------------------------------------------------


@dataclass
class Hub:
    """``jupyterhub`` as a child process; its proxy, single-user servers and kernels are its descendants."""

    tmp: Path
    lease_url: str
    proxy_token: str
    chp: str
    port: int = field(default_factory=free_port)
    password: str = field(default_factory=lambda: uuid.uuid4().hex)
    service_token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.tmp / "jupyterhub.log"
        self.homes = self.tmp / "home"
        for user in USERS:
            # No "would you like news?" toast over the page.
            settings = self.homes / user / ".jupyter" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
            settings.mkdir(parents=True)
            (settings / "notification.jupyterlab-settings").write_text(
                '{"fetchNews": "false", "checkForUpdates": false}'
            )
        args = ["--ServerApp.allow_root=True"] if os.geteuid() == 0 else []
        if (BUILT / "package.json").exists():  # the bundle built from this tree wins over the installed copy
            (self.tmp / "labextensions").mkdir()
            (self.tmp / "labextensions" / "gpulease").symlink_to(BUILT, target_is_directory=True)
            args.append(f"--LabApp.extra_labextensions_path={self.tmp / 'labextensions'}")
        # This test's own settings, then README's recipe as it is.
        config = self.tmp / "jupyterhub_config.py"
        config.write_text(
            "c = get_config()  # noqa\n"
            + "".join(
                f"c.{name} = {value!r}\n"
                for name, value in {
                    "JupyterHub.bind_url": self.url,
                    "JupyterHub.hub_bind_url": f"http://127.0.0.1:{free_port()}",
                    "ConfigurableHTTPProxy.api_url": f"http://127.0.0.1:{free_port()}",
                    "ConfigurableHTTPProxy.command": [self.chp],
                    "JupyterHub.db_url": f"sqlite:///{self.tmp / 'jupyterhub.sqlite'}",
                    "JupyterHub.cookie_secret_file": str(self.tmp / "cookie_secret"),
                    "JupyterHub.pid_file": str(self.tmp / "jupyterhub.pid"),
                    "JupyterHub.authenticator_class": "shared-password",
                    "SharedPasswordAuthenticator.user_password": self.password,
                    "Authenticator.allowed_users": set(USERS),
                    "JupyterHub.tornado_settings": {"slow_spawn_timeout": 0},  # spawn requests answer at once
                    "JupyterHub.spawner_class": "simple",  # SimpleLocalProcessSpawner: no system users
                    "SimpleLocalProcessSpawner.home_dir_template": f"{self.homes}/{{username}}",
                    "Spawner.cmd": [sys.executable, "-m", "jupyterhub.singleuser"],
                    "Spawner.args": args,
                    "Spawner.default_url": "/lab",
                    "Spawner.start_timeout": 120,
                    "Spawner.http_timeout": 120,
                    # The test's own client of the Hub API: starts the servers and reaches them.
                    "JupyterHub.services": [{"name": "gpulease-test", "api_token": self.service_token}],
                    "JupyterHub.load_roles": [
                        {
                            "name": "gpulease-test",
                            "scopes": ["admin:users", "admin:servers", "access:servers"],
                            "services": ["gpulease-test"],
                        }
                    ],
                }.items()
            )
            + f"load_subconfig({str(RECIPE)!r})  # noqa\n"
        )
        env = {**os.environ, "GPULEASE_URL": self.lease_url, "GPULEASE_TOKEN": self.proxy_token, "GPULEASE_WARM": "off"}
        env.pop("GPULEASE_USER", None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", str(config)],
                cwd=self.tmp, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self.ps = psutil.Process(self.proc.pid)
        self.seen: set[psutil.Process] = set()
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"token {self.service_token}"}, timeout=30
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # polling a process that is starting: there is no event to wait on
            assert self.proc.poll() is None, self.tail()
            try:
                if self.http.get("/hub/api/").status_code == 200:  # through the proxy: both are up
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"JupyterHub did not answer: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]

    def spawn(self, *users: str) -> None:
        """Start the users' servers together, then follow each one's progress events until it is ready."""
        for user in users:
            resp = self.http.post(f"/hub/api/users/{user}/server")
            assert resp.status_code in (201, 202), (resp.status_code, resp.text, self.tail())
        for user in users:
            with self.http.stream("GET", f"/hub/api/users/{user}/server/progress", timeout=180) as events:
                for line in events.iter_lines():
                    event = json.loads(line[5:]) if line.startswith("data:") else {}
                    if event.get("failed"):
                        raise AssertionError(f"{user}'s server failed to start: {event}: {self.tail()}")
                    if event.get("ready"):
                        break
                else:
                    raise AssertionError(f"{user}'s progress ended before it was ready: {self.tail()}")
        self.seen.update(self.ps.children(recursive=True))

    def server(self, user: str, path: str) -> str:
        return f"/user/{user}/{path.lstrip('/')}"

    def stop(self) -> None:
        """Stop the Hub (it stops the proxy and the servers, which stop their kernels); kill what outlives it."""
        self.seen.update(self.ps.children(recursive=True))
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _, alive = psutil.wait_procs([p for p in self.seen if p.is_running()], timeout=20)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="module")
def lease_server(redis_server: RedisProcess) -> Iterator[ServerHandle]:
    settings = make_settings(redis_server.url, f"hub{os.getpid()}")
    handle = ServerHandle(settings, "n1=2xA100-80GB,n2=2xA100-80GB").start()
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def hub(lease_server: ServerHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    chp = configurable_http_proxy()
    proxy_token = token_for(lease_server.settings.redis_url, lease_server.settings.prefix, "hub", "proxy")
    hub = Hub(tmp_path_factory.mktemp("hub"), lease_server.url, proxy_token, chp)
    try:
        hub.wait_ready()
        hub.spawn(*USERS)
        yield hub
    finally:
        hub.stop()


@pytest.fixture(scope="module")
def admin(lease_server: ServerHandle) -> Iterator[Client]:
    client = lease_server.client("root", "admin")
    yield client
    client.close()


# ---- kernels on each user's server --------------------------------------------------------------------------


async def _execute(hub: Hub, user: str, code: str) -> str:
    """Run ``code`` in a new kernel of ``user``'s server (REST API and its websocket); its stdout."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    auth = {"Authorization": f"token {hub.service_token}"}
    async with httpx.AsyncClient(base_url=hub.url, headers=auth, timeout=60) as http:
        resp = await http.post(hub.server(user, "api/kernels"), json={"name": "python3"})
        assert resp.status_code == 201, resp.text
        kernel = resp.json()["id"]
        ws_url = hub.url.replace("http", "ws", 1) + hub.server(user, f"api/kernels/{kernel}/channels")
        ws = await websocket_connect(HTTPRequest(ws_url, headers=auth))
        msg_id, out, replied, idle = uuid.uuid4().hex, [], False, False
        header = {"msg_id": msg_id, "msg_type": "execute_request", "session": uuid.uuid4().hex}
        content = {"code": code, "silent": False, "store_history": False, "allow_stdin": False, "stop_on_error": True}
        await ws.write_message(
            json.dumps(
                {
                    "channel": "shell",
                    "header": {**header, "username": user, "version": "5.3"},
                    "parent_header": {},
                    "metadata": {},
                    "content": {**content, "user_expressions": {}},
                    "buffers": [],
                }
            )
        )
        try:
            while not (replied and idle):
                raw = await asyncio.wait_for(ws.read_message(), 60)
                assert raw is not None, f"{user}'s kernel websocket closed: {hub.tail()}"
                msg = json.loads(raw)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind = msg["header"]["msg_type"]
                if kind == "stream":
                    out.append(msg["content"]["text"])
                elif kind == "error":
                    raise AssertionError(f"{user}'s kernel: {msg['content']['ename']}: {msg['content']['evalue']}")
                replied |= kind == "execute_reply"
                idle |= kind == "status" and msg["content"]["execution_state"] == "idle"
        finally:
            ws.close()
            await http.delete(hub.server(user, f"api/kernels/{kernel}"))
    return "".join(out)


# What %%gpu_train does for its lease: the magics' session client, configured from the kernel's
# environment (GPULEASE_URL / GPULEASE_TOKEN / GPULEASE_USER, as the Hub's spawner set them).
LEASE_IN_KERNEL = f"""
import json, os
from magics.session import session
label = "hub kernel of " + os.environ["JUPYTERHUB_USER"]
lease = session().client().acquire(gpus=1, pool={POOL!r}, ttl=600, label=label)
print(json.dumps({{"id": lease.id, "user": lease.user, "node": lease.node, "indexes": lease.indexes}}))
"""


@pytest.fixture(scope="module")
def kernel_leases(hub: Hub) -> dict[str, dict[str, Any]]:
    """One lease per user, each taken in a kernel of that user's server, as %%gpu_train takes it."""

    async def both() -> list[str]:
        return await asyncio.gather(*(_execute(hub, user, LEASE_IN_KERNEL) for user in USERS))

    return {user: json.loads(out) for user, out in zip(USERS, asyncio.run(both()), strict=True)}


# ---- the tests ----------------------------------------------------------------------------------------------


def test_readme_shows_the_recipe_the_hub_runs() -> None:
    assert RECIPE.read_text() in readme_blocks(), "README's JupyterHub block must be examples/jupyterhub_config.py"


def test_each_users_server_and_kernels_act_for_that_hub_user(
    hub: Hub, kernel_leases: dict[str, dict[str, Any]], admin: Client
) -> None:
    for user in USERS:
        # The server extension: the shared proxy token, acting for this server's Hub user.
        version = hub.http.get(hub.server(user, "gpulease/version"))
        assert version.status_code == 200, version.text
        seen = version.json()["lease_server"]
        assert (seen["reachable"], seen["user"], seen["role"]) == (True, user, "user"), seen
        # The kernel's lease is the Hub user's, in the lease server's own records.
        lease = kernel_leases[user]
        assert lease["user"] == user
        record = admin.get(lease["id"])
        assert (record["user"], record["state"], record["label"]) == (user, "active", f"hub kernel of {user}")
        # Each user's board lists their own lease as theirs, and both on the cluster.
        mine = hub.http.get(hub.server(user, "gpulease/leases")).json()["leases"]
        assert [x["id"] for x in mine] == [lease["id"]]
        listed = hub.http.get(hub.server(user, "gpulease/leases"), params={"all": "true"}).json()["leases"]
        everyone = {x["id"]: x["user"] for x in listed}
        assert everyone == {kernel_leases[u]["id"]: u for u in USERS}

    # bob's server cannot release alice's lease: 403, and the lease goes on.
    theirs = kernel_leases["alice"]["id"]
    resp = hub.http.delete(hub.server("bob", f"gpulease/leases/{theirs}"))
    assert resp.status_code == 403, resp.text
    assert resp.json() == {
        "code": "not_owner",
        "message": f"lease {theirs} belongs to alice, not to bob; only its owner can release it",
    }
    assert admin.get(theirs)["state"] == "active"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: apt-get install -y chromium")
def test_alice_sees_both_leases_on_the_board_and_may_release_only_hers(
    hub: Hub, kernel_leases: dict[str, dict[str, Any]], admin: Client
) -> None:
    from playwright.sync_api import expect, sync_playwright

    shots = ARTIFACTS / "ui" / "hub"
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir(parents=True)
    mine, theirs = kernel_leases["alice"], kernel_leases["bob"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
            page.set_default_timeout(20_000)

            # Log in to the Hub as alice; the Hub sends her on to her JupyterLab (OAuth with her server).
            page.goto(f"{hub.url}/hub/login?next=%2Fuser%2Falice%2Flab")
            page.locator("#username_input").fill("alice")
            page.locator("#password_input").fill(hub.password)
            page.locator("#login_submit").click()
            expect(page.locator(".jp-LauncherCard", has_text="GPU Leases")).to_be_visible(timeout=60_000)
            assert page.url.startswith(f"{hub.url}/user/alice/lab")
            palette_item(page, "GPU Leases").click()
            expect(page.get_by_role("heading", name="GPU Leases")).to_be_visible()
            expect(page.get_by_role("status", name="live updates")).to_have_text("live")

            # The board: alice's lease as hers, bob's as bob's; a Release button for hers only.
            def cell(lease: dict[str, Any], holder: str) -> Any:
                name = rf"^{lease['node']} GPU {lease['indexes'][0]}: leased, by {holder}, held "
                return page.get_by_role("cell", name=re.compile(name))

            expect(cell(mine, r"alice \(you\)")).to_be_visible()
            expect(cell(theirs, "bob")).to_be_visible()
            expect(page.get_by_role("button", name=re.compile(rf"^Release lease {theirs['id']} "))).to_have_count(0)
            release = page.get_by_role("button", name=re.compile(rf"^Release lease {mine['id']} "))
            expect(release).to_be_visible()
            page.screenshot(path=str(shots / "1-both-leases.png"), full_page=True)

            # The release endpoint the board calls, for bob's lease, from alice's page: refused.
            refused = page.evaluate(
                """async (id) => {
                    const xsrf = document.cookie.split('; ').filter(c => c.startsWith('_xsrf=')).pop();
                    const resp = await fetch(`/user/alice/gpulease/leases/${id}`, {
                        method: 'DELETE', headers: {'X-XSRFToken': xsrf.slice('_xsrf='.length)},
                    });
                    return {status: resp.status, body: await resp.json()};
                }""",
                theirs["id"],
            )
            assert refused == {
                "status": 403,
                "body": {
                    "code": "not_owner",
                    "message": f"lease {theirs['id']} belongs to bob, not to alice; only its owner can release it",
                },
            }
            assert admin.get(theirs["id"])["state"] == "active"

            # Her own: the Release button works.
            release.click()
            confirm(page, f"Release lease {mine['id']}?", "Release")
            free = rf"^{mine['node']} GPU {mine['indexes'][0]}: free$"
            expect(page.get_by_role("cell", name=re.compile(free))).to_be_visible()
            expect(cell(theirs, "bob")).to_be_visible()
            page.screenshot(path=str(shots / "2-hers-released.png"), full_page=True)
        finally:
            browser.close()
    assert admin.get(mine["id"])["state"] == "released"
    assert admin.get(theirs["id"])["state"] == "active"
    print(f"screenshots: {shots}")
