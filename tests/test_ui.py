"""The GPU Leases panel in a real JupyterLab, driven by Playwright in Debian's headless Chromium.

JupyterLab runs as a child process with the installed server extension and the labextension built
in this source tree (``jupyter_ext/labextension``, what ``npm run build`` and ``pip install`` write;
else the installed one), against a real lease server (the ``server`` fixture) through GPULEASE_URL /
GPULEASE_TOKEN, as ``gpulease up`` starts it. Screenshots are kept under ``test-artifacts/ui/<test>/``
(git-ignored by a ``.gitignore`` the tests write there; GPULEASE_TEST_ARTIFACTS moves it), printed at
the end of each test.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo

import httpx
import pytest

from lease_server.node.redis_proc import free_port

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
REPO = Path(__file__).resolve().parents[1]
BUILT = REPO / "jupyter_ext" / "labextension"
ARTIFACTS = Path(os.environ.get("GPULEASE_TEST_ARTIFACTS", REPO / "test-artifacts"))
# The browser's time zone: not UTC, so the calendar's local times really are converted.
TIME_ZONE = "Europe/Berlin"
# The browser's locale: en-GB reads a 24-hour clock. One test runs in en-US (12-hour) to show that every
# time on the page follows the locale's clock, as the form's native date-time inputs do.
LOCALE = "en-GB"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: apt-get install -y chromium to run the UI tests"
)


class Lab:
    """``jupyter lab`` as a child process, isolated from the user's Jupyter settings."""

    def __init__(
        self, tmp: Path, lease_url: str, lease_token: str, *, mute_news: bool = True, env: dict[str, str] | None = None
    ) -> None:
        """``mute_news``: turn Jupyter's news prompt off in the user's settings (off: the test sees
        whatever ``env``, more environment of the Lab, makes of it)."""
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
            **(env or {}),
        }
        if mute_news:  # no "would you like news?" toast over the page
            notification = dirs["settings"] / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
            notification.parent.mkdir(parents=True)
            notification.write_text('{"fetchNews": "false", "checkForUpdates": false}')
        # The bundle built from this tree wins over the installed copy: extra paths come first.
        extra = []
        if (BUILT / "package.json").exists():
            (tmp / "labextensions").mkdir()
            (tmp / "labextensions" / "gpulease").symlink_to(BUILT, target_is_directory=True)
            extra = [f"--LabApp.extra_labextensions_path={tmp / 'labextensions'}"]
        self.log = tmp / "jupyterlab.log"
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
                f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={dirs['root']}", *extra,
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
def page(lab: Lab, clients: dict[str, Any], tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    locale = getattr(request, "param", LOCALE)  # @pytest.mark.parametrize("page", ["en-US"], indirect=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900}, timezone_id=TIME_ZONE, locale=locale)
            context.set_default_timeout(20_000)
            yield context.new_page()
        finally:
            browser.close()


@pytest.fixture
def shots(request: pytest.FixtureRequest) -> Path:
    """Where a test keeps its screenshots: test-artifacts/ui/<test name>/, emptied first, git-ignored."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    ignore = ARTIFACTS / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# screenshots and other test artifacts: never committed\n*\n")
    where = ARTIFACTS / "ui" / re.sub(r"[^\w.-]+", "_", request.node.name)
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    return where


def open_panel(page: Any, lab: Lab) -> None:
    """Load JupyterLab and open GPU Leases from the command palette (the launcher has it too)."""
    from playwright.sync_api import expect

    page.goto(f"{lab.url}lab?token={lab.token}")
    expect(page.locator(".jp-LauncherCard", has_text="GPU Leases")).to_be_visible(timeout=60_000)
    palette_item(page, "GPU Leases").click()
    expect(page.get_by_role("heading", name="GPU Leases")).to_be_visible()


def palette_item(page: Any, label: str) -> Any:
    """Open the command palette, type ``label``, and return the item of exactly that label."""
    page.keyboard.press("Control+Shift+C")
    page.keyboard.type(label)
    item_label = page.locator(".lm-CommandPalette-itemLabel", has_text=re.compile(rf"^{re.escape(label)}$"))
    return page.locator(".lm-CommandPalette-item").filter(has=item_label)


def confirm(page: Any, title: str, button: str) -> None:
    """Answer JupyterLab's confirmation dialog titled ``title`` with ``button``."""
    from playwright.sync_api import expect

    dialog = page.locator(".jp-Dialog")
    expect(dialog.locator(".jp-Dialog-header")).to_have_text(title)
    dialog.get_by_role("button", name=button, exact=True).click()
    expect(dialog).to_have_count(0)


def test_a_lease_appears_live_and_the_release_button_frees_it(
    page: Any, lab: Lab, server: Any, clients: dict[str, Any], shots: Path
) -> None:
    from playwright.sync_api import expect

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
    confirm(page, f"Release lease {mine.id}?", "Release")
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


def test_the_panel_says_how_to_install_a_missing_server_extension(page: Any, lab: Lab, shots: Path) -> None:
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
    page.screenshot(path=str(shots / "missing-extension.png"))
    print(f"screenshot: {shots / 'missing-extension.png'}")


# Samples every 0.2 s and a 1 s idle window: an unused simulated GPU is warned within about a second
# and a half, then reclaimed 30 s later unless kept.
FAST_RECLAIM = {"sample_interval": 0.2, "idle_timeout": 1.0, "grace": 30, "min_age": 0}


@pytest.mark.parametrize("lease_server_settings", [FAST_RECLAIM])
def test_an_idle_warned_lease_shows_its_countdown_and_still_using_it_keeps_it(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    from playwright.sync_api import expect

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


# ---- the booking calendar ----------------------------------------------------------------------------------


def tomorrow() -> date:
    return datetime.now(ZoneInfo(TIME_ZONE)).date() + timedelta(days=1)


def at(day: date, hhmm: str) -> float:
    """Epoch seconds of a wall-clock time in the browser's time zone."""
    h, m = map(int, hhmm.split(":"))
    return datetime(day.year, day.month, day.day, h, m, tzinfo=ZoneInfo(TIME_ZONE)).timestamp()


def book(client: Any, day: date, start: str, end: str, gpus: int, pool: str = "A100-80GB", **kw: Any) -> Any:
    body = {"pool": pool, "gpus": gpus, "start": at(day, start), "end": at(day, end), **kw}
    return client.request("POST", "/api/v1/bookings", json=body)


def bookings_of(client: Any, owner: str) -> list[dict[str, Any]]:
    listed = client.request("GET", "/api/v1/bookings")["bookings"]
    return [r for r in listed if r["owner"] == owner and r["state"] == "active"]


def shown_window(start: str, end: str) -> str:
    """How the page writes a window of two datetime-local values: "Tue 24 Nov 12:00–14:00"."""
    a, b = datetime.fromisoformat(start), datetime.fromisoformat(end)
    tail = b.strftime("%H:%M") if a.date() == b.date() else f"{b:%a} {b.day} {b:%b %H:%M}"
    return f"{a:%a} {a.day} {a:%b %H:%M}–{tail}"


def open_calendar(page: Any, lab: Lab, pool: str, day: date) -> None:
    """Open the Calendar tab, pick the pool, and show ``day`` in the day view."""
    from playwright.sync_api import expect

    open_panel(page, lab)
    expect(page.get_by_role("status", name="live updates")).to_have_text("live")
    page.get_by_role("tab", name="Calendar").click()
    page.get_by_label("Calendar pool").select_option(pool)
    page.get_by_role("button", name="day", exact=True).click()
    column = page.locator(f'td.fc-timegrid-col[data-date="{day.isoformat()}"]')
    while column.count() == 0:  # each click renders the next day at once: no wait in between
        page.get_by_role("button", name="Next day").click()
    expect(column).to_be_visible()


def drag(page: Any, day: date, first: str, last: str) -> None:
    """Press the mouse on the slot ``first`` (HH:MM) of ``day``, move it to the slot ``last``, release.

    A real drag over FullCalendar's time grid: down, moves in steps, up. The selection covers both
    slots (half an hour each), so first=10:00, last=11:30 selects 10:00-12:00.
    """
    lane = page.locator(f'td.fc-timegrid-slot-lane[data-time="{first}:00"]')
    lane.evaluate("el => el.scrollIntoView({block: 'center'})")
    column = page.locator(f'td.fc-timegrid-col[data-date="{day.isoformat()}"]').bounding_box()
    a = lane.bounding_box()
    b = page.locator(f'td.fc-timegrid-slot-lane[data-time="{last}:00"]').bounding_box()
    x = column["x"] + column["width"] * 0.3
    y0, y1 = a["y"] + a["height"] / 2, b["y"] + b["height"] / 2
    page.mouse.move(x, y0)
    page.mouse.down()
    page.mouse.move(x, y0 + (y1 - y0) / 2, steps=5)
    page.mouse.move(x, y1, steps=5)
    page.mouse.up()


def test_booking_by_dragging_on_the_calendar(page: Any, lab: Lab, clients: dict[str, Any], shots: Path) -> None:
    from playwright.sync_api import expect

    alice, bob = clients["alice"], clients["bob"]
    day = tomorrow()
    open_calendar(page, lab, "A100-80GB", day)
    page.evaluate("window.__notReloaded = true")

    # Someone else's booking appears by itself (the event stream), with its owner and GPU count.
    theirs = book(bob, day, "14:00", "16:00", 1, note="bob's eval")
    expect(
        page.get_by_role("button", name=re.compile(rf"^Booking {theirs['id']}: bob, 1 GPU, .* 14:00–16:00"))
    ).to_be_visible()

    # One pool at a time: the T4 pool has no bookings.
    bobs = page.get_by_role("button", name=re.compile(rf"^Booking {theirs['id']}:"))
    page.get_by_label("Calendar pool").select_option("T4-16GB")
    expect(bobs).to_have_count(0)
    page.get_by_label("Calendar pool").select_option("A100-80GB")
    expect(bobs).to_be_visible()

    # Drag over 10:00-12:00: the form opens with that window, and says (dry run) that it fits.
    drag(page, day, "10:00", "11:30")
    dialog = page.get_by_role("dialog", name="Book GPUs of A100-80GB")
    expect(dialog).to_be_visible()
    expect(dialog.get_by_label("Start")).to_have_value(f"{day.isoformat()}T10:00")
    expect(dialog.get_by_label("End")).to_have_value(f"{day.isoformat()}T12:00")
    expect(dialog.get_by_role("status", name="booking check")).to_have_text("Fits: no clash with other bookings.")
    dialog.get_by_label("GPUs").fill("2")
    dialog.get_by_label("Note").fill("paper deadline")
    expect(dialog.get_by_role("status", name="booking check")).to_have_text("Fits: no clash with other bookings.")
    page.screenshot(path=str(shots / "1-dragged.png"), full_page=True)
    dialog.get_by_role("button", name="Book", exact=True).click()

    expect(dialog).to_have_count(0)
    expect(page.get_by_role("status", name="booking result")).to_contain_text("Booked r-")
    mine = page.get_by_role(
        "button", name=re.compile(r"^Booking r-\w+: alice, 2 GPUs, .* 10:00–12:00, paper deadline, yours")
    )
    expect(mine).to_be_visible()
    [made] = bookings_of(alice, "alice")
    assert (made["gpus"], made["start"], made["end"]) == (2, at(day, "10:00"), at(day, "12:00"))
    assert made["note"] == "paper deadline" and made["pool"] == "A100-80GB"
    page.screenshot(path=str(shots / "2-booked.png"), full_page=True)

    # Click it to change it: 3 GPUs.
    mine.click()
    dialog = page.get_by_role("dialog", name=f"Change booking {made['id']}")
    dialog.get_by_label("GPUs").fill("3")
    expect(dialog.get_by_role("status", name="booking check")).to_have_text("Fits: no clash with other bookings.")
    dialog.get_by_role("button", name="Save changes").click()
    expect(dialog).to_have_count(0)
    expect(page.get_by_role("button", name=re.compile(rf"^Booking {made['id']}: alice, 3 GPUs, "))).to_be_visible()
    assert alice.request("GET", f"/api/v1/bookings/{made['id']}")["gpus"] == 3

    # Bob's booking opens read-only: no Save, no Cancel.
    page.get_by_role("button", name=re.compile(rf"^Booking {theirs['id']}:")).click()
    dialog = page.get_by_role("dialog", name=f"Booking {theirs['id']} of bob")
    expect(dialog.get_by_label("Note")).to_have_value("bob's eval")
    expect(dialog.get_by_label("Note")).to_be_disabled()
    expect(dialog.get_by_role("button", name=re.compile("Save|Cancel booking"))).to_have_count(0)
    dialog.get_by_role("button", name="Close").click()

    # My bookings (Board tab) lists it, with Cancel.
    page.get_by_role("tab", name="Board").click()
    section = page.get_by_role("region", name="My bookings")
    cancel = section.get_by_role("button", name=re.compile(rf"^Cancel booking {made['id']} \(A100-80GB, 3 GPUs, "))
    expect(cancel).to_be_visible()
    page.screenshot(path=str(shots / "3-my-bookings.png"), full_page=True)
    cancel.click()
    confirm(page, f"Cancel booking {made['id']}?", "Cancel booking")
    expect(section.get_by_text("You have no bookings in the next two weeks.")).to_be_visible()
    assert alice.request("GET", f"/api/v1/bookings/{made['id']}")["state"] == "cancelled"
    assert page.evaluate("window.__notReloaded") is True
    print(f"screenshots: {shots}")


def test_a_clash_is_refused_with_the_clashing_booking_and_a_suggestion_books_in_one_click(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    from playwright.sync_api import expect

    alice, bob = clients["alice"], clients["bob"]
    day = tomorrow()
    full = book(bob, day, "10:00", "12:00", 6, note="all of them")  # every A100 GPU (n1: 4, n2: 2)
    open_calendar(page, lab, "A100-80GB", day)
    expect(
        page.get_by_role("button", name=re.compile(rf"^Booking {full['id']}: bob, 6 GPUs, .* 10:00–12:00"))
    ).to_be_visible()

    # Drag upwards from 12:30 to 11:00 (beside bob's booking, over it): 11:00-13:00 clashes with it.
    drag(page, day, "12:30", "11:00")
    dialog = page.get_by_role("dialog", name="Book GPUs of A100-80GB")
    expect(dialog.get_by_label("Start")).to_have_value(f"{day.isoformat()}T11:00")
    expect(dialog.get_by_label("End")).to_have_value(f"{day.isoformat()}T13:00")
    clash = dialog.get_by_role("alert", name="clash")
    # Shown before saving (the dry run): the booking in the way, and windows that fit.
    expect(clash).to_contain_text("At most 0 GPUs of the 6 in A100-80GB can be booked then")
    expect(clash.get_by_role("list", name="clashing bookings")).to_contain_text("bob · 6 GPUs")
    expect(clash.get_by_role("list", name="clashing bookings")).to_contain_text(full["id"])
    suggestions = clash.get_by_role("group", name="windows that fit").get_by_role("button")
    expect(suggestions.first).to_be_visible()
    # Every time in the browser's zone (24-hour, as the calendar grid), the zone said once: no UTC.
    expect(clash.locator("strong")).to_contain_text(shown_window(f"{day}T11:00", f"{day}T13:00"))
    expect(clash).to_contain_text(f"Times in {TIME_ZONE} (24-hour)")
    expect(clash).not_to_contain_text("UTC")

    # Booking anyway is refused by the lease server, with the same details.
    dialog.get_by_role("button", name="Book", exact=True).click()
    expect(clash).to_contain_text("Refused: ")
    expect(clash).to_contain_text("would over-book it")
    expect(clash.get_by_role("list", name="clashing bookings")).to_contain_text("bob · 6 GPUs")
    assert bookings_of(alice, "alice") == []
    page.screenshot(path=str(shots / "1-clash-refused.png"), full_page=True)

    # One click on a suggestion moves the window there; it fits, and is booked.
    first = suggestions.first
    label = first.get_attribute("aria-label")
    first.click()
    expect(dialog.get_by_role("status", name="booking check")).to_have_text("Fits: no clash with other bookings.")
    start = dialog.get_by_label("Start").input_value()
    end = dialog.get_by_label("End").input_value()
    assert label == f"Use {shown_window(start, end)}"
    page.screenshot(path=str(shots / "2-suggestion-applied.png"), full_page=True)
    dialog.get_by_role("button", name="Book", exact=True).click()
    expect(dialog).to_have_count(0)
    [made] = bookings_of(alice, "alice")
    tz = ZoneInfo(TIME_ZONE)
    assert datetime.fromtimestamp(made["start"], tz).strftime("%Y-%m-%dT%H:%M") == start
    assert datetime.fromtimestamp(made["end"], tz).strftime("%Y-%m-%dT%H:%M") == end
    assert made["end"] - made["start"] == 2 * 3600
    assert made["end"] <= full["start"] or made["start"] >= full["end"]
    expect(page.get_by_role("button", name=re.compile(rf"^Booking {made['id']}: alice, 1 GPU, "))).to_be_attached()
    page.screenshot(path=str(shots / "3-booked.png"), full_page=True)
    print(f"screenshots: {shots}")


@pytest.mark.parametrize("page", ["en-US"], indirect=True)
def test_in_a_12_hour_locale_every_time_on_the_page_reads_12_hour(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    """en-US: Chromium's date-time inputs show 12-hour times, so the grid, the bookings and the clash
    panel do too (one clock on the page, named once beside the zone)."""
    from playwright.sync_api import expect

    day = tomorrow() + timedelta(days=2)
    full = book(clients["bob"], day, "13:00", "15:00", 6, note="all of them")
    open_calendar(page, lab, "A100-80GB", day)
    slot = page.locator('td.fc-timegrid-slot-label[data-time="13:00:00"]')
    expect(slot).to_have_text(re.compile(r"^\s*1:00\sPM\s*$"))
    name = re.compile(rf"^Booking {full['id']}: bob, 6 GPUs, \w+ \d+ \w+ 1:00 PM–3:00 PM")
    expect(page.get_by_role("button", name=name)).to_be_visible()

    drag(page, day, "15:30", "14:30")  # upwards from below bob's booking: 14:30-16:00 clashes with it
    dialog = page.get_by_role("dialog", name="Book GPUs of A100-80GB")
    expect(dialog.get_by_label("Start")).to_have_value(f"{day.isoformat()}T14:30")  # the input's value is ISO
    clash = dialog.get_by_role("alert", name="clash")
    expect(clash).to_contain_text(f"Times in {TIME_ZONE} (12-hour)")
    expect(clash.get_by_role("list", name="clashing bookings")).to_contain_text("1:00 PM–3:00 PM")
    expect(clash.locator("strong")).to_contain_text("2:30 PM–4:00 PM")
    expect(clash).not_to_contain_text("13:")
    page.screenshot(path=str(shots / "1-en-US-clash.png"), full_page=True)


def test_the_keyboard_form_books_without_dragging(page: Any, lab: Lab, clients: dict[str, Any], shots: Path) -> None:
    from playwright.sync_api import expect

    alice = clients["alice"]
    day = tomorrow() + timedelta(days=1)
    open_panel(page, lab)
    page.get_by_role("tab", name="Board").focus()
    page.keyboard.press("ArrowRight")  # the tabs move with the arrow keys
    expect(page.get_by_role("tab", name="Calendar")).to_have_attribute("aria-selected", "true")
    page.get_by_role("button", name="New booking…").focus()
    page.keyboard.press("Enter")
    dialog = page.get_by_role("dialog", name=re.compile("^Book GPUs of "))
    expect(dialog.get_by_label("Pool")).to_be_focused()
    dialog.get_by_label("Pool").select_option("T4-16GB")
    page.keyboard.press("Tab")
    expect(dialog.get_by_label("GPUs")).to_be_focused()
    page.keyboard.press("Control+A")
    page.keyboard.type("2")
    dialog.get_by_label("Start").fill(f"{day.isoformat()}T09:00")
    dialog.get_by_label("End").fill(f"{day.isoformat()}T11:30")
    dialog.get_by_label("Repeat").select_option("weekly")
    dialog.get_by_label("Weeks").fill("3")
    dialog.get_by_label("Note").fill("weekly sync")
    expect(dialog.get_by_role("status", name="booking check")).to_have_text("Fits: no clash with other bookings.")
    page.screenshot(path=str(shots / "1-keyboard-form.png"), full_page=True)
    dialog.get_by_label("Note").press("Enter")  # Enter submits the form
    expect(dialog).to_have_count(0)
    [made] = bookings_of(alice, "alice")
    assert (made["pool"], made["gpus"], made["repeat"], made["occurrences"]) == ("T4-16GB", 2, "weekly", 3)
    assert (made["start"], made["end"]) == (at(day, "09:00"), at(day, "11:30"))
    print(f"screenshots: {shots}")


@pytest.mark.parametrize("lease_server_settings", [{"borrow_notice": 8}])
def test_the_board_shows_reserved_and_borrowed_gpus_and_a_recall(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    from playwright.sync_api import expect

    alice, bob = clients["alice"], clients["bob"]
    open_panel(page, lab)
    expect(page.get_by_role("status", name="live updates")).to_have_text("live")
    board = page.get_by_role("region", name="GPU board")
    legend = page.get_by_role("list", name="legend")
    for state in ("free", "leased", "reserved", "borrowed", "down"):
        expect(legend.get_by_role("listitem").filter(has_text=re.compile(rf"^{state}$"))).to_be_visible()

    # A booking of both T4 GPUs in force now: they are held back for alice, live.
    now = time.time()
    booking = alice.request(
        "POST",
        "/api/v1/bookings",
        json={"pool": "T4-16GB", "gpus": 2, "start": now - 60, "end": now + 3600, "note": "demo"},
    )
    for i in (0, 1):
        cell = board.get_by_role("cell", name=f"t1 GPU {i}: reserved, for alice (you)")
        expect(cell).to_have_attribute("data-state", "reserved")
    mine = page.get_by_role("region", name="My bookings")
    expect(
        mine.get_by_role("button", name=re.compile(rf"^End booking {booking['id']} now \(T4-16GB, 2 GPUs, "))
    ).to_be_visible()

    # Bob takes one while alice does not use them: a borrowed lease.
    borrowed = bob.acquire(gpus=1, pool="T4-16GB", ttl=120, label="borrowing")
    cell = board.get_by_role("cell", name=re.compile(rf"^t1 GPU {borrowed.indexes[0]}: borrowed, by bob, held "))
    expect(cell).to_have_attribute("data-state", "borrowed")
    expect(cell).to_contain_text("borrowed")
    page.screenshot(path=str(shots / "1-reserved-and-borrowed.png"), full_page=True)

    # Alice asks for her GPUs: bob's lease is recalled with notice (the countdown), then hers.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        granted = pool.submit(alice.acquire, gpus=2, pool="T4-16GB", ttl=120, wait=60)
        expect(cell).to_have_accessible_name(re.compile(r"recalled — revoked in \d s$"))
        expect(cell).to_contain_text(re.compile(r"recalled — revoked in \d s"))
        page.screenshot(path=str(shots / "2-recalled.png"), full_page=True)
        lease = granted.result(timeout=60)
    for i in lease.indexes:
        expect(board.get_by_role("cell", name=re.compile(rf"^t1 GPU {i}: leased, by alice \(you\), "))).to_be_visible()
    assert bob.get(borrowed.id)["state"] == "revoked"
    page.screenshot(path=str(shots / "3-holder-served.png"), full_page=True)

    # I'm done: End now gives the booking's GPUs back (the lease ends by itself, or with Release).
    alice.release(lease)
    mine.get_by_role("button", name=re.compile(rf"^End booking {booking['id']} now")).click()
    for i in (0, 1):
        expect(board.get_by_role("cell", name=f"t1 GPU {i}: free")).to_be_visible()
    expect(mine.get_by_text("You have no bookings in the next two weeks.")).to_be_visible()
    print(f"screenshots: {shots}")


def test_the_first_day_palette_commands_tile_origin_kernel_logo_a_narrow_board_and_confirmations(
    page: Any, lab: Lab, clients: dict[str, Any], tmp_path: Path, shots: Path
) -> None:
    """The first day with gpulease: what a new user meets in JupyterLab."""
    from playwright.sync_api import expect

    from lease_server.node.kernelspec import DISPLAY_NAME, KERNEL_NAME, write_spec

    alice = clients["alice"]
    # The CPU-only kernelspec, as `gpulease kernel install` writes it, where this JupyterLab looks.
    write_spec(tmp_path / "lab" / "data" / "kernels" / KERNEL_NAME)
    page.goto(f"{lab.url}lab?token={lab.token}")

    # The kernel's launcher cards show its logo (not a bare "P"), and the logo loads.
    cards = page.locator(".jp-LauncherCard", has_text=DISPLAY_NAME)
    expect(cards.first).to_be_visible(timeout=60_000)
    for card in cards.all():
        logo = card.locator("img")
        expect(logo).to_be_visible()
        page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=logo.element_handle())
        assert logo.evaluate("img => img.naturalWidth") in (32, 64)
        expect(card.locator(".jp-LauncherCard-noKernelIcon")).to_have_count(0)
    page.screenshot(path=str(shots / "1-launcher.png"))

    # The palette finds the calendar and the booking form, not only the panel.
    palette_item(page, "GPU Leases: Calendar").click()
    expect(page.get_by_role("tab", name="Calendar")).to_have_attribute("aria-selected", "true")
    # The week shown starts today: tomorrow is on screen whatever the day of the week.
    today = datetime.now(ZoneInfo(TIME_ZONE)).date()
    columns = page.locator("td.fc-timegrid-col[data-date]")
    expect(columns).to_have_count(7)
    days = [columns.nth(i).get_attribute("data-date") for i in range(7)]
    assert days == [(today + timedelta(days=i)).isoformat() for i in range(7)]
    page.get_by_role("tab", name="Board").click()
    palette_item(page, "GPU Leases: New booking…").click()
    dialog = page.get_by_role("dialog", name=re.compile("^Book GPUs of "))
    expect(dialog).to_be_visible()
    expect(page.get_by_role("tab", name="Calendar")).to_have_attribute("aria-selected", "true")
    dialog.get_by_role("button", name="Close").click()
    expect(dialog).to_have_count(0)
    page.get_by_role("tab", name="Board").click()
    expect(page.get_by_role("status", name="live updates")).to_have_text("live")

    # A tile names the lease's notebook and cell; the cell's first line (the label) is its tooltip.
    lease = alice.acquire(gpus=1, pool="T4-16GB", ttl=300, label="import time", notebook="work/train.ipynb", cell="4")
    board = page.get_by_role("region", name="GPU board")
    cell = board.get_by_role("cell", name=re.compile(rf"^{lease.node} GPU {lease.indexes[0]}: leased, by alice"))
    origin = cell.locator(".jp-GpuLease-cellOrigin")
    expect(origin).to_have_text("train.ipynb · cell 4")
    expect(origin).to_have_attribute("title", "import time")

    # A booking with a long note keeps its Cancel button beside its text.
    day = tomorrow()
    note = "fine-tuning the large model for the camera-ready version of the paper, please do not move " * 2
    made = book(alice, day, "10:00", "12:00", 1, note=note.strip())
    section = page.get_by_role("region", name="My bookings")
    cancel = section.get_by_role("button", name=re.compile(rf"^Cancel booking {made['id']} "))

    # Half a screen wide: every tile of the 4-GPU node is whole inside the panel (they wrap).
    page.set_viewport_size({"width": 700, "height": 900})
    expect(cancel).to_be_visible()
    panel = page.locator(".jp-GpuLease-panel").bounding_box()
    tiles = board.get_by_role("cell", name=re.compile(r"^n1 GPU \d"))
    expect(tiles).to_have_count(4)
    for i in range(4):
        tile = tiles.nth(i).bounding_box()
        assert tile["width"] >= 90, tile
        assert panel["x"] <= tile["x"] and tile["x"] + tile["width"] <= panel["x"] + panel["width"] + 0.5, (i, tile)
    assert page.locator(".jp-GpuLease-panel").evaluate("el => el.scrollWidth <= el.clientWidth")
    text = section.locator(f'li[aria-label="booking {made["id"]}"] .jp-GpuLease-leaseText').bounding_box()
    button = cancel.bounding_box()
    assert button["y"] < text["y"] + text["height"] and button["x"] >= text["x"] + text["width"], (button, text)
    page.screenshot(path=str(shots / "2-half-width.png"), full_page=True)

    # Cancel and Release ask first: "Keep it" keeps the booking and the lease.
    cancel.click()
    confirm(page, f"Cancel booking {made['id']}?", "Keep it")
    expect(cancel).to_be_visible()
    assert alice.request("GET", f"/api/v1/bookings/{made['id']}")["state"] == "active"
    release = page.get_by_role("region", name="My leases").get_by_role(
        "button", name=re.compile(rf"^Release lease {lease.id} ")
    )
    release.click()
    expect(page.locator(".jp-Dialog")).to_contain_text(f"{lease.node} GPU {lease.indexes[0]}")
    page.screenshot(path=str(shots / "3-confirm-release.png"))
    confirm(page, f"Release lease {lease.id}?", "Keep it")
    expect(cell).to_have_accessible_name(re.compile(r": leased, by alice"))
    assert alice.get(lease.id)["state"] == "active"
    release.click()
    confirm(page, f"Release lease {lease.id}?", "Release")
    expect(board.get_by_role("cell", name=f"{lease.node} GPU {lease.indexes[0]}: free")).to_be_visible()
    cancel.click()
    confirm(page, f"Cancel booking {made['id']}?", "Cancel booking")
    expect(section.get_by_text("You have no bookings in the next two weeks.")).to_be_visible()
    assert alice.request("GET", f"/api/v1/bookings/{made['id']}")["state"] == "cancelled"
    print(f"screenshots: {shots}")


@pytest.mark.parametrize("lease_server_settings", [{"warm_evict_notice": 30.0}])
def test_the_board_shows_a_warm_gpu_as_lendable_and_its_eviction(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    """A finished cell's lease kept warm for its notebook's next cell: warm · lendable, with its
    holder and how long; another user's request evicts it (a countdown) and gets the GPU."""
    from playwright.sync_api import expect

    alice, bob = clients["alice"], clients["bob"]
    open_panel(page, lab)
    expect(page.get_by_role("status", name="live updates")).to_have_text("live")
    board = page.get_by_role("region", name="GPU board")
    legend = page.get_by_role("list", name="legend")
    expect(legend.get_by_role("listitem").filter(has_text=re.compile(r"^warm · lendable$"))).to_be_visible()

    lease = bob.acquire(gpus=2, pool="T4-16GB", ttl=120, label="train")
    bob.warm(lease)
    cells = [board.locator(f'td[role="cell"][aria-label^="t1 GPU {i}: "]') for i in lease.indexes]
    for cell in cells:
        expect(cell).to_have_attribute("data-state", "warm")
        expect(cell).to_have_accessible_name(
            re.compile(r": warm · lendable, by bob, held \d+s, label train, kept warm \d+s, lent out if someone waits$")
        )
        expect(cell).to_contain_text("warm")
    page.screenshot(path=str(shots / "1-warm.png"), full_page=True)

    # Alice asks for one: bob's warm lease is evicted (a countdown) until his kernel releases it.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        granted = pool.submit(alice.acquire, gpus=1, pool="T4-16GB", ttl=120, wait=60)
        expect(cells[0]).to_have_accessible_name(re.compile(r"evicted for a waiting request — free in \d+ s$"))
        page.screenshot(path=str(shots / "2-evicting.png"), full_page=True)
        bob.release(lease, verified=True)  # what his kernel does: the worker ended and seen gone
        mine = granted.result(timeout=60)
    expect(board.get_by_role("cell", name=re.compile(rf"^t1 GPU {mine.indexes[0]}: leased, by alice"))).to_be_visible()
    alice.release(mine)


def test_the_status_bar_says_the_moment_a_warm_gpu_is_lent_and_to_whom(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    """Alice's warm GPU (her notebook's finished cell) is lent to bob's request: the status bar
    says so at once, "warm GPU lent to bob", and its tooltip which GPU and at what time; the
    notice goes once alice's next lease is granted (her notebook's next cell says the rest)."""
    from playwright.sync_api import expect

    alice, bob = clients["alice"], clients["bob"]
    page.goto(f"{lab.url}lab?token={lab.token}")
    item = page.locator(".jp-GpuLease-status")
    expect(item).to_have_text(re.compile(r"^GPU: 0 held · \d+ free$"), timeout=60_000)
    lease = alice.acquire(gpus=2, pool="T4-16GB", ttl=120, label="train")
    alice.warm(lease)
    expect(item).to_have_text(re.compile(r"^GPU: 0 held · 2 warm · \d+ free$"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        granted = pool.submit(bob.acquire, gpus=1, pool="T4-16GB", ttl=120, wait=60)
        # what her kernel does on the notice: the worker ended and seen gone, then released
        deadline = time.monotonic() + 30
        while not alice.get(lease.id).get("recall_at") and time.monotonic() < deadline:
            time.sleep(0.05)  # the eviction is the server's: polled, nothing here could wait on it
        alice.release(lease, verified=True)
        theirs = granted.result(timeout=60)
    expect(item).to_have_text(re.compile(r"^GPU: 0 held · \d+ free · warm GPU lent to bob$"))
    title = item.get_attribute("title") or ""
    said = r"^your warm GPU \(t1 GPU [01],[01]\) was lent to bob at \d\d:\d\d: bob waited for it; "
    assert re.search(said, title, re.M), title
    page.screenshot(path=str(shots / "1-lent.png"), full_page=True)
    # her notebook's next cell takes GPUs again: the notice has done its work
    bob.release(theirs)
    again = alice.acquire(gpus=1, pool="T4-16GB", ttl=120)
    expect(item).to_have_text(re.compile(r"^GPU: 1 held · \d+ free$"))
    alice.release(again)


def _measured(server: Any, lease_id: str, used_mb: int, peak_mb: int) -> None:
    """What the node agent's memory watch reports of a lease (node/memwatch.py, mem_peaks.lua), sent
    from a thread: asyncio.run cannot run inside the sync Playwright API's event loop."""
    import asyncio
    import json

    from lease_server.store.engine import Engine, connect
    from lease_server.store.scripts import MemPeaks

    async def send() -> None:
        r = connect(server.settings.redis_url)
        try:
            await Engine(r, server.settings).run(MemPeaks(json.dumps({lease_id: [used_mb, peak_mb]})))
        finally:
            await r.aclose()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, send()).result(timeout=30)


@pytest.mark.parametrize("lease_server_settings", [{"scheduling": {"A100-80GB": {"share": True}}}])
def test_the_board_draws_a_sliced_gpu_as_its_slices(
    page: Any, lab: Lab, server: Any, clients: dict[str, Any], shots: Path
) -> None:
    """Two slices of one GPU: the tile is the GPU's slices, each with its holder, its memory of the
    GPU's and what it uses at its peak where measured, and the memory no slice holds (unpromised);
    the status bar counts a slice as a slice, not a GPU held, and says what is unpromised; a release
    shows at once."""
    from playwright.sync_api import expect

    alice, bob = clients["alice"], clients["bob"]
    open_panel(page, lab)
    expect(page.get_by_role("status", name="live updates")).to_have_text("live")
    board = page.get_by_role("region", name="GPU board")
    status = page.get_by_role("button", name=re.compile(r"^GPU: \d+ held"))
    expect(status).to_have_text("GPU: 0 held · 8 free")

    big = bob.acquire(1, "A100-80GB", ttl=120, label="big", gpu_mem="30GB")
    _measured(server, big.id, 2900, 4000)  # before the next grant, whose event refetches the board
    small = alice.acquire(1, "A100-80GB", ttl=120, label="small", gpu_mem="10GB")
    node, index = small.node, small.gpus[0]["index"]
    assert (big.node, big.gpus[0]["index"]) == (node, index)  # best fit packs them on one GPU
    where = f"{node} GPU {index}"
    cell = board.get_by_role("cell", name=f"{where}: sliced · shared, 2 slices, 40 GB of 80 GB unpromised")
    expect(cell).to_have_attribute("data-state", "sliced")
    slices = cell.get_by_role("list", name=f"slices of {where}").get_by_role("listitem")
    expect(slices).to_have_count(2)
    expect(slices.nth(0)).to_have_accessible_name(
        re.compile(rf"^slice {big.id}: bob, 30 GB of 80 GB, using 2.8 GB, peak 3.9 GB, held \d+s, label big$")
    )
    expect(slices.nth(0)).to_have_text("bob · 30 GB of 80 GBusing 2.8 GB, peak 3.9 GB")  # two lines
    expect(slices.nth(1)).to_have_accessible_name(
        re.compile(rf"^slice {small.id}: alice \(you\), 10 GB of 80 GB, held \d+s, label small$")
    )
    expect(cell).to_contain_text("40 GB of 80 GB unpromised")
    expect(status).to_have_text("GPU: 0 held · 1 slice · 7 free · 40 GB unpromised")
    mine = page.get_by_role("list", name="leases I hold")
    expect(mine.get_by_text(f"{where} · 10 GB of 80 GB slice")).to_be_visible()
    legend = page.get_by_role("list", name="legend")
    expect(legend.get_by_role("listitem").filter(has_text=re.compile(r"^sliced · shared$"))).to_be_visible()
    page.screenshot(path=str(shots / "1-two-slices.png"), full_page=True)

    # alice's slice kept warm for her notebook's next cell: said on its line, and counted apart
    alice.warm(small)
    expect(slices.nth(1)).to_have_text("alice (you) · 10 GB of 80 GB · warm")
    expect(slices.nth(1)).to_have_accessible_name(re.compile(r"kept warm \d+s, lent out if someone waits"))
    expect(status).to_have_text("GPU: 0 held · 1 warm slice · 7 free · 40 GB unpromised")

    bob.release(big)
    cell = board.get_by_role("cell", name=f"{where}: sliced · shared, 1 slice, 70 GB of 80 GB unpromised")
    expect(cell.get_by_role("listitem")).to_have_count(1)
    alice.release(small)
    expect(board.get_by_role("cell", name=f"{where}: free")).to_be_visible()
    expect(status).to_have_text("GPU: 0 held · 8 free")
    print(f"screenshots: {shots}")


# The WCAG contrast of every text of the GPU board against what is drawn under it, from the colours
# the page computes (getComputedStyle): a text's colour (its alpha, and its ancestors' opacity) over
# the backgrounds under it, composited from the page up (each stop of a striped background counts:
# the worst one). Returns every text with its ratio, the lowest first.
CONTRAST_JS = """(root) => {
  const parse = c => {
    let m = c.match(/^rgba?\\(([^)]*)\\)$/);
    if (m) {
      const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
      return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
    }
    m = c.match(/^color\\(srgb ([^)]*)\\)$/);
    if (m) {
      const p = m[1].split(/[\\s\\/]+/).filter(Boolean).map(Number);
      return [p[0] * 255, p[1] * 255, p[2] * 255, p.length > 3 ? p[3] : 1];
    }
    throw new Error('a colour this check cannot read: ' + c);
  };
  const over = (top, under) => [0, 1, 2].map(i => top[i] * top[3] + under[i] * (1 - top[3])).concat([1]);
  const lin = v => (v /= 255) <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
  const lum = c => 0.2126 * lin(c[0]) + 0.7152 * lin(c[1]) + 0.0722 * lin(c[2]);
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const stops = img => [...img.matchAll(/rgba?\\([^)]*\\)|color\\(srgb[^)]*\\)/g)].map(m => parse(m[0]));
  const out = [];
  for (const el of root.querySelectorAll('*')) {
    if (el.closest('button, select, option, svg') || !el.getClientRects().length) continue;
    const text = [...el.childNodes].filter(n => n.nodeType === 3).map(n => n.textContent).join('').trim();
    if (!text) continue;
    const chain = [];
    let alpha = 1;
    for (let e = el; e; e = e.parentElement) {
      const cs = getComputedStyle(e);
      alpha *= Number(cs.opacity);
      chain.push({ bg: parse(cs.backgroundColor), stops: stops(cs.backgroundImage) });
    }
    let unders = [[255, 255, 255, 1]];
    for (const layer of chain.reverse()) {
      unders = unders.map(u => over(layer.bg, u));
      if (layer.stops.length) unders = unders.flatMap(u => layer.stops.map(s => over(s, u)));
    }
    const fg = parse(getComputedStyle(el).color);
    fg[3] *= alpha;
    const worst = Math.min(...unders.map(u => ratio(over(fg, u), u)));
    out.push({ text: text.slice(0, 60), cls: String(el.className).slice(0, 80), ratio: Math.round(worst * 100) / 100 });
  }
  return out.sort((a, b) => a.ratio - b.ratio);
}"""

# Every state a tile and a slice is drawn in, each drawn once off the board (a copy of the board's
# markup in a panel of its own), so that the contrast check sees the states no test made happen.
PROBES_JS = """(states) => {
  const panel = document.createElement('div');
  panel.className = 'jp-GpuLease-panel jp-GpuLease-probes';
  panel.setAttribute('aria-label', 'every state, drawn for the contrast check');
  const cells = states.tiles.map(s =>
    `<td class="jp-GpuLease-cell jp-GpuLease-state-${s}"><div class="jp-GpuLease-cellIndex">GPU 0 · ${s}</div>` +
    `<div class="jp-GpuLease-cellState">${s}</div><div class="jp-GpuLease-cellHeld">1m05s</div>` +
    `<div class="jp-GpuLease-cellLabel">train.ipynb · cell 4</div><div class="jp-GpuLease-cellIdle">idle — 27 s</div>` +
    `<div class="jp-GpuLease-cellError">not kept</div></td>`).join('');
  const slices = states.slices.map(s =>
    `<li class="jp-GpuLease-slice jp-GpuLease-slice-${s}"><div class="jp-GpuLease-sliceText">bob · 30 GB · ${s}</div>` +
    `<div class="jp-GpuLease-sliceText jp-GpuLease-sliceUsed">using 3 GB, peak 4 GB</div></li>`).join('');
  panel.innerHTML = `<table class="jp-GpuLease-board"><tbody><tr><th class="jp-GpuLease-node">` +
    `<div class="jp-GpuLease-nodeName">p1</div><div class="jp-GpuLease-nodePool">A100</div></th>${cells}` +
    `<td class="jp-GpuLease-cell jp-GpuLease-state-sliced"><ul class="jp-GpuLease-slices">${slices}</ul></td></tr>` +
    `<tr class="jp-GpuLease-suspendedRow"><th class="jp-GpuLease-suspendedHead">suspended · on host</th>` +
    `<td class="jp-GpuLease-suspendedCell"><ul class="jp-GpuLease-suspended">` +
    `<li class="jp-GpuLease-suspendedWorker">alice · 3 GB on host · 5s</li></ul></td></tr></tbody></table>`;
  document.body.appendChild(panel);
  return panel.querySelectorAll('td, li').length;
}"""


def _contrast(page: Any, root: str) -> list[dict[str, Any]]:
    return page.locator(root).first.evaluate(CONTRAST_JS)  # type: ignore[no-any-return]


def _suspend_on(server: Any, node: str, user: str, lease: str, gb: float, worker: subprocess.Popen[bytes]) -> None:
    """A worker suspended to host memory on ``node``, as the node agent records it (drained.lua):
    a live process stands in for it (the agent forgets an entry whose process is gone)."""
    import json

    import redis

    from lease_server.procs import start_ticks
    from lease_server.store.keys import Keys

    entry = {
        "pid": worker.pid,
        "start": start_ticks(worker.pid),
        "uid": os.getuid(),
        "user": user,
        "lease": lease,
        "pool": "A100-80GB",
        "gpu": 0,
        "bytes": int(gb * 2**30),
        "since": int(time.time() * 1000) - 65_000,
    }
    r = redis.Redis.from_url(server.settings.redis_url)
    try:
        r.hset(Keys(server.settings.prefix).suspended, node, json.dumps({str(worker.pid): entry}))
    finally:
        r.close()


@pytest.mark.parametrize("lease_server_settings", [{"scheduling": {"A100-80GB": {"share": True}}}])
def test_the_board_reads_in_light_and_dark_with_slices_over_memory_and_suspended_workers(
    page: Any, lab: Lab, server: Any, clients: dict[str, Any], shots: Path
) -> None:
    """The board in JupyterLab's light and dark themes: every text of every tile (and of every
    state, drawn off the board) at 4.5:1 or more against what is under it (WCAG AA); a slice over
    its memory coloured and named; a slice's row holds its text; a node's suspended workers in a
    row of their own; the status bar's free count says what sliced GPUs still have unpromised."""
    from playwright.sync_api import expect

    alice, bob, root = clients["alice"], clients["bob"], clients["root"]
    mine = alice.acquire(1, "T4-16GB", ttl=300, label="import torch", notebook="work/train.ipynb", cell="4")
    warm = bob.acquire(1, "T4-16GB", ttl=300, label="eval")
    bob.warm(warm)
    big = bob.acquire(1, "A100-80GB", ttl=300, label="big", gpu_mem="30GB")
    _measured(server, big.id, 34 * 1024, 35 * 1024)  # over the 30 GB it was promised
    small = alice.acquire(1, "A100-80GB", ttl=300, label="small", gpu_mem="10GB")
    node, index = small.node, small.gpus[0]["index"]
    assert (big.node, big.gpus[0]["index"]) == (node, index)
    now = time.time()
    bob.request("POST", "/api/v1/bookings", json={"pool": "A100-80GB", "gpus": 1, "start": now - 60, "end": now + 3600})
    worker = subprocess.Popen(["sleep", "600"])
    try:
        _suspend_on(server, "n2", "alice", "l-evicted", 3.2, worker)
        deadline = time.monotonic() + 15
        while not next(n for n in root.cluster()["nodes"] if n["name"] == "n2").get("suspended"):
            assert time.monotonic() < deadline, "the board's view never showed the suspended worker"
            time.sleep(0.2)  # the shared view reads every node again within 5 s

        open_panel(page, lab)
        expect(page.get_by_role("status", name="live updates")).to_have_text("live")
        board = page.get_by_role("region", name="GPU board")
        where = f"{node} GPU {index}"
        cell = board.get_by_role("cell", name=f"{where}: sliced · shared, 2 slices, 40 GB of 80 GB unpromised")
        slices = cell.get_by_role("list", name=f"slices of {where}").get_by_role("listitem")
        over = slices.filter(has_text="bob")
        expect(over).to_have_attribute("data-state", "over")
        expect(over).to_have_accessible_name(
            re.compile(rf"^slice {big.id}: bob, 30 GB of 80 GB, using 34 GB, peak 35 GB, over its memory: ended if")
        )
        expect(over.locator(".jp-GpuLease-sliceText").first).to_have_text("bob · 30 GB of 80 GB · over its memory")
        expect(slices.filter(has_text="alice")).to_have_attribute("data-state", "leased")
        legend = page.get_by_role("list", name="legend")
        expect(legend.get_by_role("listitem").filter(has_text=re.compile(r"^slice over its memory$"))).to_be_visible()
        # A slice's row holds its text: no bar or border drawn across it, each line whole inside the row.
        for i in range(2):
            row = slices.nth(i).bounding_box()
            for line in slices.nth(i).locator(".jp-GpuLease-sliceText").all():
                box = line.bounding_box()
                assert line.evaluate("el => el.scrollWidth <= el.clientWidth"), line.inner_text()
                assert row["x"] <= box["x"] and box["x"] + box["width"] <= row["x"] + row["width"] + 0.5, (row, box)
            meter = slices.nth(i).locator(".jp-GpuLease-sliceMeter").bounding_box()
            assert meter["y"] >= box["y"] + box["height"] - 0.5, (meter, box)  # under the text, not through it
        # The suspended worker: a row of its own, not in the node's name.
        suspended = board.get_by_role("row", name="n2: suspended workers")
        expect(suspended).to_contain_text("alice (you) · 3.2 GB on host · 1m0")
        expect(board.get_by_role("rowheader").filter(has_text="n2").first).to_have_text("n2A100-80GB")
        status = page.get_by_role("button", name=re.compile(r"^GPU: \d+ held"))
        expect(status).to_have_text("GPU: 1 held · 1 slice · 4 free · 40 GB unpromised")
        expect(board.get_by_role("cell", name=re.compile(r": reserved, for bob$")).first).to_be_visible()
        expect(board.get_by_role("cell", name=re.compile(r": warm · lendable, by bob,"))).to_be_visible()
        yours = re.compile(rf"^{mine.node} GPU {mine.indexes[0]}: leased, by alice \(you\)")
        leased = board.get_by_role("cell", name=yours)
        expect(leased).to_contain_text("train.ipynb · cell 4")

        page.evaluate(PROBES_JS, {"tiles": list(TILE_STATES), "slices": ["leased", "warm", "over", "draining"]})
        assert page.locator(".jp-GpuLease-probes td, .jp-GpuLease-probes li").count() == len(TILE_STATES) + 7
        seen = {}
        for theme, light in (("JupyterLab Light", "true"), ("JupyterLab Dark", "false")):
            if light == "false":
                palette_item(page, f"Use Theme: {theme}").click()
                expect(page.locator("body")).to_have_attribute("data-jp-theme-light", light)
                expect(page.locator("#jupyterlab-splash")).to_have_count(0)  # JupyterLab's splash while it swaps themes
                page.wait_for_function(  # the theme's CSS is swapped in after the body's attribute
                    "() => getComputedStyle(document.querySelector('.jp-GpuLease-panel')).backgroundColor"
                    " === 'rgb(33, 33, 33)'"
                )
            for part in ('section[aria-label="GPU board"]', ".jp-GpuLease-probes"):
                texts = _contrast(page, part)
                assert len(texts) > 20, texts
                low = [t for t in texts if t["ratio"] < 4.5]
                assert not low, (theme, part, low)
                seen[(theme, part)] = texts[0]
            page.evaluate("document.querySelector('.jp-GpuLease-probes').hidden = true")
            page.screenshot(path=str(shots / f"board-{'light' if light == 'true' else 'dark'}.png"))
            page.evaluate("document.querySelector('.jp-GpuLease-probes').hidden = false")
        print(f"lowest contrast: {seen}")
    finally:
        worker.kill()
        worker.wait()
    print(f"screenshots: {shots}")


# The states a whole GPU's tile is drawn in (STATES in labextension/src/panel.tsx, less sliced and over).
TILE_STATES = ("free", "leased", "warm", "reserved", "borrowed", "idle", "draining", "down")


MANY_NODES = ",".join([*(f"a{i:02d}=1xA100-80GB" for i in range(40)), *(f"t{i:02d}=1xT4-16GB" for i in range(30))])


@pytest.mark.parametrize("lease_server_settings", [{"simulate": MANY_NODES}])
def test_a_board_of_more_nodes_than_a_page_shows_a_page_a_pool_and_the_next_page(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    """70 nodes: the board asks for and draws the first 64 (GET /cluster?limit=64), says so, and
    shows the rest on request; a pool's nodes on their own; the counts stay the whole cluster's."""
    from playwright.sync_api import expect

    alice = clients["alice"]
    held = alice.acquire(1, "T4-16GB", ttl=300, label="far down the list")
    open_panel(page, lab)
    expect(page.get_by_role("status", name="live updates")).to_have_text("live")
    board = page.get_by_role("table", name="GPUs by node")
    rows = board.get_by_role("row")
    expect(rows).to_have_count(64)
    expect(page.get_by_text("64 of 70 nodes")).to_be_visible()
    expect(board.get_by_role("rowheader").filter(has_text="t29")).to_have_count(0)  # not on the first page
    page.screenshot(path=str(shots / "1-first-page.png"), full_page=True)

    more = page.get_by_role("button", name="Show 6 more")
    expect(more).to_have_count(2)  # above the board and under its last node
    more.last.click()
    expect(rows).to_have_count(70)
    expect(page.get_by_text("70 of 70 nodes")).to_be_visible()
    expect(page.get_by_role("button", name=re.compile(r"^Show \d+ more$"))).to_have_count(0)

    page.get_by_role("combobox", name="the board's pool").select_option("T4-16GB")
    expect(rows).to_have_count(30)
    expect(page.get_by_text("30 of 30 nodes")).to_be_visible()
    cell = board.get_by_role("cell", name=re.compile(rf"^{held.node} GPU 0: leased, by alice \(you\), "))
    expect(cell).to_be_visible()
    # The status bar still counts the whole cluster, not the page: 69 GPUs free.
    expect(page.get_by_role("button", name=re.compile(r"^GPU: 1 held · 69 free"))).to_be_visible()
    alice.release(held)  # the page follows events as the whole board does
    expect(board.get_by_role("cell", name=f"{held.node} GPU 0: free")).to_be_visible()
    page.screenshot(path=str(shots / "2-one-pool.png"), full_page=True)
    print(f"screenshots: {shots}")
