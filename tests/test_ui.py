"""The GPU Leases panel in a real JupyterLab, driven by Playwright in Debian's headless Chromium.

JupyterLab runs as a child process with the installed server extension and labextension, against a
real lease server (the ``server`` fixture) through GPULEASE_URL / GPULEASE_TOKEN, as ``gpulease up``
starts it. Screenshots are kept in the test's tmp directory (printed at the end of each test).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from lease_server.redis_proc import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
INSTALL_HINT = "server extension missing: run pip install gpulease and restart JupyterLab"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: apt-get install -y chromium to run the UI tests"
)


class Lab:
    """``jupyter lab`` as a child process, isolated from the user's Jupyter settings."""

    def __init__(self, tmp: Path, lease_url: str, lease_token: str) -> None:
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}/"
        dirs = {name: tmp / name for name in ("root", "config", "data", "runtime", "settings", "workspaces")}
        for d in dirs.values():
            d.mkdir(parents=True)
        env = {
            **os.environ,
            "GPULEASE_URL": lease_url,
            "GPULEASE_TOKEN": lease_token,
            "JUPYTER_CONFIG_DIR": str(dirs["config"]),
            "JUPYTER_DATA_DIR": str(dirs["data"]),
            "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
            "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
            "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        }
        # No "would you like news?" toast over the page.
        notification = dirs["settings"] / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        notification.parent.mkdir(parents=True)
        notification.write_text('{"fetchNews": "false", "checkForUpdates": false}')
        self.log = tmp / "jupyterlab.log"
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
                f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={dirs['root']}",
                *(["--allow-root"] if os.geteuid() == 0 else []),
            ],
            env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}api/status", params={"token": self.token}, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling a process that is starting: there is no event to wait on
        raise AssertionError(f"jupyter lab did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def lease_server_settings() -> dict[str, Any]:
    """Settings of the lease server under test (the idle-reclaim test makes it sample fast)."""
    return {}


@pytest.fixture
def server(server_factory: Any, lease_server_settings: dict[str, Any]) -> Any:  # overrides conftest's
    return server_factory(**lease_server_settings)


@pytest.fixture
def lab(server: Any, tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path / "lab", server.url, server.token("alice"))
    yield lab
    lab.stop()


@pytest.fixture
def clients(server: Any) -> dict[str, Any]:
    # Made before Playwright starts: making a token runs asyncio.run, which cannot run inside
    # the sync Playwright API's event loop.
    return {**{user: server.client(user) for user in ("alice", "bob")}, "root": server.client("root", "admin")}


@pytest.fixture
def page(lab: Lab, clients: dict[str, Any], tmp_path: Path) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            context.set_default_timeout(20_000)
            yield context.new_page()
        finally:
            browser.close()


def open_panel(page: Any, lab: Lab) -> None:
    """Load JupyterLab and open GPU Leases from the command palette (the launcher has it too)."""
    from playwright.sync_api import expect

    page.goto(f"{lab.url}lab?token={lab.token}")
    expect(page.locator(".jp-LauncherCard", has_text="GPU Leases")).to_be_visible(timeout=60_000)
    page.keyboard.press("Control+Shift+C")
    page.keyboard.type("GPU Leases")
    page.locator(".lm-CommandPalette-item", has_text="GPU Leases").first.click()
    expect(page.get_by_role("heading", name="GPU Leases")).to_be_visible()


def test_a_lease_appears_live_and_the_release_button_frees_it(
    page: Any, lab: Lab, server: Any, clients: dict[str, Any], tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    shots = tmp_path / "screenshots"
    shots.mkdir()
    open_panel(page, lab)
    expect(page.get_by_role("status", name="live updates")).to_have_text("live")
    expect(page.get_by_role("cell", name=re.compile(r"^n1 GPU 0: free$"))).to_be_visible()
    status = page.get_by_role("button", name=re.compile(r"^GPU: \d+ held"))
    expect(status).to_have_text("GPU: 0 held · 8 free")
    expect(page.get_by_text("You hold no GPUs.")).to_be_visible()
    page.evaluate("window.__notReloaded = true")

    # Leases taken from Python appear on the board by themselves (the event stream), mine marked.
    mine = clients["alice"].acquire(gpus=2, pool="A100-80GB", ttl=120, label="resnet sweep")
    theirs = clients["bob"].acquire(gpus=1, pool="T4-16GB", ttl=120)
    for i in mine.indexes:
        cell = page.get_by_role("cell", name=re.compile(rf"^{mine.node} GPU {i}: leased, by alice \(you\), held "))
        expect(cell).to_be_visible()
        expect(cell).to_contain_text("resnet sweep")
    expect(
        page.get_by_role("cell", name=re.compile(rf"^{theirs.node} GPU {theirs.indexes[0]}: leased, by bob,"))
    ).to_be_visible()
    expect(status).to_have_text("GPU: 2 held · 5 free")
    release = page.get_by_role(
        "button", name=f"Release lease {mine.id} ({mine.node} GPU {', '.join(map(str, mine.indexes))})"
    )
    expect(release).to_be_visible()
    page.screenshot(path=str(shots / "1-leased.png"), full_page=True)

    # A release elsewhere (bob, from Python) also shows up without a reload.
    clients["bob"].release(theirs)
    expect(page.get_by_role("cell", name=re.compile(rf"^{theirs.node} GPU {theirs.indexes[0]}: free$"))).to_be_visible()

    release.click()
    for i in mine.indexes:
        expect(page.get_by_role("cell", name=re.compile(rf"^{mine.node} GPU {i}: free$"))).to_be_visible()
    expect(page.get_by_text("You hold no GPUs.")).to_be_visible()
    expect(status).to_have_text("GPU: 0 held · 8 free")
    assert clients["alice"].get(mine.id)["state"] == "released"
    assert page.evaluate("window.__notReloaded") is True
    page.screenshot(path=str(shots / "2-released.png"), full_page=True)

    # The lease server goes away: the panel says so and that what it shows is stale.
    server.stop()
    server._loop = None  # stopped: the fixture's teardown must not stop it again (its loop is closed)
    panel = page.get_by_role("tabpanel", name="GPU Leases")
    expect(panel.get_by_role("alert")).to_contain_text(f"cannot reach the lease server at {server.url}")
    expect(panel.get_by_role("alert")).to_contain_text("showing the state of")
    expect(page.get_by_role("status", name="live updates")).to_have_text("reconnecting…")
    expect(status).to_have_text("GPU: 0 held · 8 free (stale)")
    page.screenshot(path=str(shots / "3-lease-server-down.png"), full_page=True)
    print(f"screenshots: {shots}")


def test_the_panel_says_how_to_install_a_missing_server_extension(page: Any, lab: Lab, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    # As if jupyter_ext were not installed: the Jupyter server answers 404 under /gpulease/.
    api = re.compile(r"^/gpulease/")  # the API, not the labextension's files under /lab/extensions/gpulease/
    page.route(
        lambda url: bool(api.match(urlsplit(url).path)),
        lambda route: route.fulfill(status=404, content_type="text/html", body="Not Found"),
    )
    open_panel(page, lab)
    expect(page.get_by_role("tabpanel", name="GPU Leases").get_by_role("alert")).to_have_text(INSTALL_HINT)
    expect(page.get_by_role("button", name=re.compile(r"^GPU: server extension missing"))).to_be_visible()
    page.screenshot(path=str(tmp_path / "missing-extension.png"))
    print(f"screenshot: {tmp_path / 'missing-extension.png'}")


# Samples every 0.2 s and a 1 s idle window: an unused simulated GPU is warned within about a second
# and a half, then reclaimed 30 s later unless kept.
FAST_RECLAIM = {"sample_interval": 0.2, "idle_timeout": 1.0, "grace": 30, "min_age": 0}


@pytest.mark.parametrize("lease_server_settings", [FAST_RECLAIM])
def test_an_idle_warned_lease_shows_its_countdown_and_still_using_it_keeps_it(
    page: Any, lab: Lab, clients: dict[str, Any], tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    shots = tmp_path / "screenshots"
    shots.mkdir()
    alice, root = clients["alice"], clients["root"]
    open_panel(page, lab)
    expect(page.get_by_role("status", name="live updates")).to_have_text("live")
    page.evaluate("window.__notReloaded = true")
    board = page.get_by_role("region", name="GPU board")
    mine_section = page.get_by_role("region", name="My leases")

    # A lease taken from Python whose GPUs stay at 0 %: idle reclaim warns it within a second or two.
    lease = alice.acquire(gpus=2, pool="A100-80GB", ttl=300, label="forgotten notebook")
    root.request("PUT", f"/api/v1/simulate/{lease.node}", json={"gpus": {str(i): {"util": 0} for i in lease.indexes}})
    gpus = f"{lease.node} GPU {', '.join(map(str, lease.indexes))}"
    countdown = re.compile(r"idle — reclaimed in \d{1,2} s")

    def keep_on_board(i: int) -> Any:
        return board.get_by_role("button", name=f"Still using it: keep lease {lease.id} ({lease.node} GPU {i})")

    # The board and My leases show the countdown and the button, without a reload.
    for i in lease.indexes:
        cell = board.get_by_role("cell", name=re.compile(rf"^{lease.node} GPU {i}: leased, by alice \(you\), "))
        expect(cell).to_have_attribute("data-state", "idle", timeout=15_000)
        expect(cell).to_have_accessible_name(re.compile(countdown.pattern + "$"))
        expect(cell).to_contain_text(countdown)
        expect(keep_on_board(i)).to_be_enabled()
    warning = mine_section.get_by_role("group", name=f"idle warning of lease {lease.id}")
    expect(warning.get_by_role("timer")).to_have_text(countdown)
    keep_mine = mine_section.get_by_role("button", name=f"Still using it: keep lease {lease.id} ({gpus})")
    expect(keep_mine).to_be_enabled()
    assert alice.get(lease.id)["reclaim_at"] > time.time() + 10
    page.screenshot(path=str(shots / "1-idle-warned.png"), full_page=True)

    # Nobody uses the GPUs after the keep either: a long idle window, so the warning stays away.
    root.request("PUT", "/api/v1/policy/A100-80GB", json={"idle_timeout": 600, "max_extensions": 1})
    keep_on_board(lease.indexes[0]).click()
    for i in lease.indexes:
        cell = board.get_by_role("cell", name=re.compile(rf"^{lease.node} GPU {i}: leased, by alice \(you\), "))
        expect(cell).to_have_attribute("data-state", "leased")
        expect(cell).not_to_contain_text("idle")
    expect(page.get_by_role("button", name=re.compile("^Still using it"))).to_have_count(0)
    expect(warning).to_have_count(0)
    expect(mine_section.get_by_role("button", name=f"Release lease {lease.id} ({gpus})")).to_be_visible()
    kept = alice.get(lease.id)
    assert (kept["state"], kept["extensions"]) == ("active", 1) and "reclaim_at" not in kept
    page.screenshot(path=str(shots / "2-kept.png"), full_page=True)

    # Idle again, and the pool allows one keep per lease: the button shows the lease server's refusal.
    root.request("PUT", "/api/v1/policy/A100-80GB", json={"idle_timeout": 1})
    expect(keep_mine).to_be_enabled(timeout=15_000)
    keep_mine.click()
    alert = mine_section.get_by_role("alert")
    expect(alert).to_contain_text(f"could not keep {lease.id}: lease {lease.id} was already kept 1 times")
    expect(alert).to_contain_text("release them and acquire again")
    expect(warning.get_by_role("timer")).to_have_text(countdown)  # still warned, still counting down
    expect(board.get_by_text("not kept: see My leases").first).to_be_visible()
    assert alice.get(lease.id)["state"] == "active"
    assert page.evaluate("window.__notReloaded") is True
    page.screenshot(path=str(shots / "3-keep-refused.png"), full_page=True)
    print(f"screenshots: {shots}")
