"""The Usage tab of the GPU Leases panel, in a real JupyterLab driven by Playwright in Debian's
headless Chromium (the Lab, page and screenshot fixtures of test_ui.py).

One lease server and one JupyterLab serve the whole module (a Lab start costs ~30 s in CI). The
usage is made the way it is made for real: leases taken, sampled, kept warm, waited for, evicted
and ended through the lease server's HTTP API, which writes the ledger and its hourly rollups. Every
figure the tab shows, in its tables and CSV downloads, is checked against the lease server's own
answer (GET /api/v1/usage/summary) for the same range, as the Lab's lease user (alice).

The same Lab is started as ``gpulease up`` starts its own: with the Lab defaults of
``lease_server.cli.service.lab_config_path`` and no news setting of the user's, so a test checks
that Jupyter's news prompt stays away, and (cheaply, on the same page) the status bar's warm count.
"""

from __future__ import annotations

import concurrent.futures
import csv
import io
import os
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from lease_server.cli.service import lab_config_path
from lease_server.client import Client
from tests.conftest import ServerHandle, servers_on
from tests.test_ui import Lab, page, palette_item, shots
from tests.test_ui import pytestmark as pytestmark  # skipped with test_ui where Chromium is missing

REUSED_FIXTURES = (page, shots)  # test_ui's, taken by name: its Playwright page (on the `lab` below)
REPO = Path(__file__).resolve().parents[1]
TEAMS = {"vision": ["alice", "bob"], "nlp": ["cy"]}
A100, T4 = "A100-80GB", "T4-16GB"
DAY_S = 86_400
NEWS = "get notified about official Jupyter news"
# A chart's drawing (Plot's figure holds its legend's swatches, small SVGs of their own, and the chart's)
CHART = ".jp-GpuLease-chart > figure > svg, .jp-GpuLease-chart > svg"


@pytest.fixture(scope="module")
def server(redis_server: Any) -> Iterator[ServerHandle]:  # overrides test_ui's: one for the module
    factory = servers_on(redis_server.url, f"uiu{os.getpid()}")
    make = next(factory)
    yield make(simulate=f"n1=2x{A100},t1=2x{T4}", teams=TEAMS)
    next(factory, None)  # its teardown: stops the server


@pytest.fixture(scope="module")
def clients(server: ServerHandle) -> Iterator[dict[str, Client]]:  # overrides test_ui's
    # Made before Playwright starts: making a token runs asyncio.run, which cannot run inside the
    # sync Playwright API's event loop.
    made = {**{u: server.client(u) for u in ("alice", "bob", "cy")}, "root": server.client("root", "admin")}
    yield made
    for c in made.values():
        c.close()


def _sample(root: Client, node: str, indexes: list[int], util: float) -> None:
    """What the node agent reports of GPUs: one utilization sample each."""
    root.request("POST", f"/api/v1/nodes/{node}/samples", json={"gpus": [{"index": i, "util": util} for i in indexes]})


@pytest.fixture(scope="module")
def usage(clients: dict[str, Client]) -> None:
    """Usage of today, made through the real API: alice trains on 2 A100s (sampled busy) and runs a
    second cell warm; cy holds an A100 idle (sampled idle); alice's warm T4 is evicted for bob, who
    waits for 2 T4s. The sleeps are the time each lease is held: what the ledger measures."""
    alice, bob, cy, root = clients["alice"], clients["bob"], clients["cy"], clients["root"]
    lease = alice.acquire(gpus=2, pool=A100, ttl=60, label="resnet")
    for _ in range(3):
        _sample(root, lease.node, lease.indexes, 90)
    time.sleep(1.0)
    alice.warm(lease)
    time.sleep(0.5)
    alice.warm(lease, on=False)  # her next cell runs on the warm worker
    time.sleep(0.5)
    alice.release(lease, verified=True)

    idle = cy.acquire(gpus=1, pool=A100, ttl=60, label="eda")
    for _ in range(2):
        _sample(root, idle.node, idle.indexes, 0)
    time.sleep(0.5)
    cy.release(idle, verified=True)

    warm = alice.acquire(gpus=1, pool=T4, ttl=60, label="finetune")
    alice.warm(warm)
    with alice.event_stream(lease=warm.id) as events, concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(bob.acquire, gpus=2, pool=T4, ttl=60, wait=60, label="sweep")
        next(e for e in events if e.get("type") == "evicting")  # bob waits: her warm GPU is lent out
        alice.release(warm, verified=True)  # what her kernel does once its worker is gone
        got = waiting.result(timeout=60)
    time.sleep(0.5)
    bob.release(got, verified=True)


@pytest.fixture(scope="module")
def lab(server: ServerHandle, clients: dict[str, Client], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab (overrides test_ui's) as alice, once for the module, with the Lab defaults that
    ``gpulease up`` gives its own and no news setting of the user's."""
    from lease_server.node.kernelspec import install

    tmp = tmp_path_factory.mktemp("usage-lab")
    install(prefix=str(tmp / "kernels"))  # as up does, beside its JupyterLab
    lab = Lab(
        tmp / "lab",
        server.url,
        clients["alice"].token,
        mute_news=False,
        env={"JUPYTER_CONFIG_PATH": lab_config_path(tmp, {}), "JUPYTER_PATH": str(tmp / "kernels/share/jupyter")},
    )
    yield lab
    lab.stop()


def _window(days: int) -> dict[str, Any]:
    """The range the tab asks for: from UTC midnight ``days - 1`` days ago, up to now."""
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return {"from": int((today - timedelta(days=days - 1)).timestamp())}


def _summary(client: Client, **params: Any) -> dict[str, Any]:
    return client.request("GET", "/api/v1/usage/summary", params=params)  # type: ignore[no-any-return]


def open_panel(page: Any, lab: Lab) -> None:
    """test_ui's open_panel on this module's one Lab: ``?reset`` first, as the workspace an earlier
    test left (the panel open, no launcher) would otherwise be restored."""
    from playwright.sync_api import expect

    page.goto(f"{lab.url}lab?reset&token={lab.token}")
    expect(page.locator(".jp-LauncherCard", has_text="GPU Leases")).to_be_visible(timeout=60_000)
    palette_item(page, "GPU Leases").click()
    expect(page.get_by_role("heading", name="GPU Leases")).to_be_visible()


def open_usage(page: Any, lab: Lab) -> Any:
    """Open the panel's Usage tab and wait for its first answer; returns the tab panel."""
    from playwright.sync_api import expect

    open_panel(page, lab)
    page.get_by_role("tab", name="Usage").click()
    panel = page.get_by_role("tabpanel", name="Usage")
    expect(panel.locator(".jp-GpuLease-usage[data-load-ms]")).to_have_count(1)
    return panel


def table(panel: Any, caption: str | re.Pattern[str]) -> Any:
    return panel.get_by_role("table", name=caption)


def rows(tbl: Any) -> list[list[str]]:
    """A table's body, as the text of each row's cells."""
    return [r.locator("th, td").all_inner_texts() for r in tbl.locator("tbody tr").all()]


def download_csv(page: Any, panel: Any, caption: str) -> list[dict[str, str]]:
    with page.expect_download() as got:
        panel.get_by_role("button", name=f"Download CSV: {caption}").click()
    return list(csv.DictReader(io.StringIO(Path(got.value.path()).read_text())))


def _close(shown: str, value: float) -> bool:
    """A figure as the table shows it (2 decimals) is the server's, rounded."""
    return abs(float(shown) - value) <= 0.006


def _num(v: str) -> float | None:
    return None if v == "" else float(v)


def _color_sum(page: Any) -> int:
    """The sum of the R, G, B of the charts' text colour (Plot draws axes and labels in currentColor)."""
    rgb = page.locator(CHART).first.evaluate("el => getComputedStyle(el).color")
    return sum(int(x) for x in re.findall(r"\d+", rgb)[:3])


def test_ups_lab_offers_the_gpulease_kernel_first(page: Any, lab: Lab) -> None:
    """A new notebook in up's JupyterLab gets the gpulease kernel: the plain "Python 3
    (ipykernel)" card came first in the launcher, and %%gpu_train there was 'not found'."""
    from playwright.sync_api import expect

    page.goto(f"{lab.url}lab?reset&token={lab.token}")
    section = page.locator(".jp-Launcher-section", has_text="Notebook")
    expect(section.locator(".jp-LauncherCard").first).to_have_attribute("title", re.compile(r"gpulease"))


def test_the_usage_tab_shows_the_servers_figures_in_light_and_dark_and_its_csv_agrees(
    page: Any, lab: Lab, clients: dict[str, Client], usage: None, shots: Path
) -> None:
    from playwright.sync_api import expect

    want = _summary(clients["alice"], by="user", **_window(7))
    assert {g["key"] for g in want["groups"]} == {"alice", "bob", "cy"}, want["groups"]
    open_panel(page, lab)
    started = time.monotonic()
    page.get_by_role("tab", name="Usage").click()
    panel = page.get_by_role("tabpanel", name="Usage")
    expect(panel.locator(CHART)).to_have_count(5)
    shown_ms = 1000 * (time.monotonic() - started)
    load_ms = panel.locator(".jp-GpuLease-usage").get_attribute("data-load-ms")
    print(f"usage tab: its two answers in {load_ms} ms; from the click on the tab to its five charts {shown_ms:.0f} ms")

    total = want["total"]
    # One word, one count: the cells that ran, those that started warm among them (never "calls").
    cells = f"{total['cells']} cells ({total['warm_cells']} started warm)"
    expect(panel.locator(".jp-GpuLease-usageTotals")).to_contain_text(cells)
    assert total["cells"] == total["calls"] + total["warm_cells"] and total["warm_cells"] >= 1, total
    assert not re.search(r"\bcalls?\b", panel.inner_text()), "the tab counts cells, in one word"
    # Under the chart of what the GPU time was: why "used" is what it is on these simulated GPUs,
    # and what warm time is (lendable, not charged).
    note = panel.get_by_role("region", name="Held GPU time, split").get_by_role("note")
    expect(note).to_contain_text(f"The GPUs of {A100}, {T4} are simulated: nothing runs on them")
    expect(note).to_contain_text("(gpulease simulate util)")
    expect(note).to_contain_text("a warm worker keeps a notebook's model on its GPU between cells")
    expect(note).to_contain_text("the GPU is lent to anyone who waits meanwhile, and warm time is not charged as use")
    # five charts, each drawn with data
    for region in ("Held GPU time, split", "Utilisation per pool", "Waits", "Taken back and warm cells"):
        expect(panel.get_by_role("region", name=region).locator(CHART)).to_be_visible()

    # The table by user: each user's cells and GPU-seconds as the server counts them.
    by_user = re.compile(r"^GPU-seconds per day, by user \(held \+ warm\): each user's totals")
    got = {r[0]: r for r in rows(table(panel, by_user))}
    assert list(got) == [g["key"] for g in want["groups"]]  # largest first, as the server orders them
    for g in want["groups"]:
        name, cells, held, used, util, warm, _p95 = got[g["key"]]
        t = g["total"]
        assert int(cells) == t["cells"] and _close(held, t["held_gpu_s"]) and _close(warm, t["warm_gpu_s"]), (name, t)
        assert _close(used, t["used_gpu_s"]) if t["sampled_gpu_s"] else used == "-"  # not measured is not 0
        assert util == ("-" if t["util_pct"] is None else f"{t['util_pct']:.0f}%")
    alice = next(g["total"] for g in want["groups"] if g["key"] == "alice")
    assert alice["util_pct"] and alice["util_pct"] > 50 and alice["warm_cells"] >= 1 and alice["evicted_gpu_s"] > 0
    bob = next(g["total"] for g in want["groups"] if g["key"] == "bob")
    assert bob["wait_p95_ms"] and bob["wait_p95_ms"] > 0, bob  # he waited for alice's warm T4 to be lent out

    # Its CSV: the server's figures as they are, per user and day and in total.
    caption = table(panel, by_user).locator("caption").inner_text()
    lines = download_csv(page, panel, caption)
    assert len(lines) == len(want["groups"]) * (len(want["days"]) + 1)
    for g in want["groups"]:
        for d in [*g["daily"], {**g["total"], "day": "total"}]:
            (line,) = [x for x in lines if x["user"] == g["key"] and x["day"] == d["day"]]
            for f in ("cells", "warm_cells", "calls", "held_gpu_s", "used_gpu_s", "util_pct", "warm_gpu_s"):
                assert _num(line[f]) == d[f], (g["key"], d["day"], f, line[f], d[f])

    # The split per day, and its CSV: used + held idle + not measured = held.
    split = "What the GPU-seconds were: used, held idle, not measured, warm, per day"
    (today,) = [r for r in rows(table(panel, split)) if r[0] == want["days"][-1]]
    assert _close(today[1], want["daily"][-1]["held_gpu_s"]) and _close(today[5], want["daily"][-1]["warm_gpu_s"])
    (line,) = [x for x in download_csv(page, panel, split) if x["day"] == "total"]
    parts = sum(float(line[f]) for f in ("used_gpu_s", "idle_gpu_s", "unmeasured_gpu_s"))
    assert abs(parts - total["held_gpu_s"]) < 1e-6 and float(line["warm_gpu_s"]) == total["warm_gpu_s"]

    # Waits, who waited longest, taken back: the server's figures.
    longest = rows(table(panel, re.compile(r"^Waits per user, the longest p95 first")))
    assert longest[0][0] == max(want["groups"], key=lambda g: g["total"]["wait_p95_ms"] or 0)["key"] == "bob"
    taken = download_csv(page, panel, "GPU-seconds taken back, and cells that started warm, per day")
    (line,) = [x for x in taken if x["day"] == "total"]
    assert float(line["evicted_gpu_s"]) == total["evicted_gpu_s"] > 0
    assert int(line["warm_cells"]) == total["warm_cells"] >= 1
    # (docs/usage.png: the top of the tab, the file browser folded away)
    page.set_viewport_size({"width": 1400, "height": 1200})
    page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
    page.get_by_role("tab", name="Usage").scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "1-usage-light.png"))

    # Dark: the same figures, the charts' text in the theme's light colour (currentColor).
    light = _color_sum(page)
    palette_item(page, "Use Theme: JupyterLab Dark").click()
    expect(page.locator("body")).to_have_attribute("data-jp-theme-light", "false")
    expect(page.locator("#jupyterlab-splash")).to_have_count(0)  # JupyterLab's splash while it swaps themes
    expect(table(panel, by_user).locator("tbody tr")).to_have_count(len(want["groups"]))
    page.wait_for_function(  # (the theme's CSS is swapped in after the body's attribute)
        f"() => {{ const el = document.querySelector({CHART!r});"
        " return el && getComputedStyle(el).color.match(/\\d+/g).slice(0, 3).reduce((a, b) => a + +b, 0) > 384; }"
    )
    assert light < 384 < _color_sum(page), light
    page.screenshot(path=str(shots / "2-usage-dark.png"))
    palette_item(page, "Use Theme: JupyterLab Light").click()  # the Lab's setting: back for the next test
    expect(page.locator("body")).to_have_attribute("data-jp-theme-light", "true")
    expect(page.locator("#jupyterlab-splash")).to_have_count(0)
    print(f"screenshots: {shots}")


def test_the_range_picker_and_the_drill_down_to_one_user(
    page: Any, lab: Lab, clients: dict[str, Client], usage: None, shots: Path
) -> None:
    from playwright.sync_api import expect

    panel = open_usage(page, lab)
    split = table(panel, "What the GPU-seconds were: used, held idle, not measured, warm, per day")
    expect(split.locator("tbody tr")).to_have_count(7)  # 7 days, the default
    ranges = panel.get_by_role("radiogroup", name="Range")

    ranges.get_by_role("radio", name="Today").click()
    expect(split.locator("tbody tr")).to_have_count(1)
    today = _summary(clients["alice"], **_window(1))
    expect(split.locator("tbody tr th")).to_have_text([today["days"][0]])
    expect(panel.locator(".jp-GpuLease-usageTotals")).to_contain_text(f"{today['total']['cells']} cells")

    ranges.get_by_role("radio", name="30 days").click()
    expect(split.locator("tbody tr")).to_have_count(30)

    # A custom range: a week long ago has no use; a last day before the first says what to pick.
    ranges.get_by_role("radio", name="Custom").click()
    long_ago = datetime.now(UTC).date() - timedelta(days=60)
    panel.get_by_label("First day (UTC)").fill(str(long_ago))
    panel.get_by_label("Last day (UTC)").fill(str(long_ago + timedelta(days=6)))
    expect(panel.get_by_role("status").filter(has_text="No GPU use in this range yet")).to_have_text(
        re.compile(r"^No GPU use in this range yet — run a %%gpu_train cell, or pick a longer range\.")
    )
    expect(panel.locator(".jp-GpuLease-usageTotals")).to_contain_text(f"{long_ago} – {long_ago + timedelta(days=6)}")
    panel.get_by_label("First day (UTC)").fill(str(long_ago + timedelta(days=7)))
    expect(panel.get_by_role("alert")).to_have_text(
        f"The last day ({long_ago + timedelta(days=6)}) is before the first ({long_ago + timedelta(days=7)}): "
        "pick a last day on or after it."
    )
    page.screenshot(path=str(shots / "1-custom-range.png"))

    # Drill down by a click on a user's bar: alice's (the tallest), then back; then bob's from the table.
    ranges.get_by_role("radio", name="7 days").click()
    bars = panel.get_by_role("region", name=re.compile(r"by user")).locator('g[aria-label="bar"] rect')
    expect(bars.first).to_be_attached()
    tallest = max(bars.all(), key=lambda r: (r.bounding_box() or {"height": 0})["height"])
    tallest.click()
    expect(panel.get_by_role("status").filter(has_text="usage only")).to_have_text("Showing alice's usage only.")
    panel.get_by_role("button", name="Back to everyone").click()
    panel.get_by_role("button", name="Show bob's usage").click()
    expect(panel.get_by_role("status").filter(has_text="usage only")).to_have_text("Showing bob's usage only.")
    bobs = _summary(clients["alice"], user="bob", **_window(7))
    expect(panel.locator(".jp-GpuLease-usageTotals")).to_contain_text(f"{bobs['total']['cells']} cell")
    by_user = table(panel, re.compile(r"^GPU-seconds per day, by user \(held \+ warm\): each user's totals"))
    expect(by_user.locator("tbody tr")).to_have_count(1)
    (row,) = rows(by_user)
    assert row[0] == "bob" and int(row[1]) == bobs["total"]["cells"] and _close(row[2], bobs["total"]["held_gpu_s"])
    expect(panel.get_by_label("Group by")).to_have_count(0)  # one user: nothing to group
    page.screenshot(path=str(shots / "2-bob.png"))
    panel.get_by_role("button", name="Back to everyone").click()
    expect(by_user.locator("tbody tr")).to_have_count(3)

    # By pool: the table's keys are the pools.
    panel.get_by_label("Group by").select_option("pool")
    by_pool = table(panel, re.compile(r"^GPU-seconds per day, by pool"))
    expect(by_pool.locator("tbody tr th")).to_have_text([A100, T4])


def test_the_proxy_passes_the_usage_endpoints_on_and_refuses_bad_arguments(
    lab: Lab, clients: dict[str, Client], usage: None
) -> None:
    """What the tab and the status bar read, through the Jupyter server: the lease server's answers
    for the Lab's lease user, its 400s passed on, and nothing passed that the proxy does not know."""

    def get(path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{lab.url}gpulease/{path}", params={"token": lab.token, **params}, timeout=10)

    window = _window(7)
    got = get("usage/summary", by="team", **window)
    assert got.status_code == 200, got.text
    assert got.json() == _summary(clients["alice"], by="team", **window)
    assert {g["key"] for g in got.json()["groups"]} == {"vision", "nlp"}
    both = get("usage/summary", by="user", also_by="pool", **window)  # what the tab asks: one request
    assert both.status_code == 200 and both.json() == _summary(clients["alice"], by="user", also_by="pool", **window)
    assert {g["key"] for g in both.json()["also"]["groups"]} == {A100, T4}
    balance = get("usage/balance", pool=A100).json()
    assert balance["user"] == "alice" and [p["pool"] for p in balance["pools"]] == [A100]
    assert "in fair share" in balance["pools"][0]["text"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"colour": "red"}, "unknown query argument(s) colour"),
        ({"by": "colour"}, "by must be one of user, team, pool"),
        ({"also_by": "colour"}, "also_by must be one of user, team, pool"),
        ({"from": "yesterday"}, "from must be a time"),
        ({"user": "../admin"}, "user must be a lease user name"),
        ({"pool": "A100 80GB"}, "pool must be a pool name"),
        ({"from": 1_700_000_000, "to": 1_600_000_000}, "to must be after from"),  # the lease server's 400
        ({"from": 1_600_000_000, "to": 1_700_000_000}, "at most 400 days"),
        ({"pool": "H100"}, "unknown pool 'H100'"),
    ]
    for params, fragment in cases:
        bad = get("usage/summary", **params)
        assert bad.status_code == 400 and fragment in bad.json()["message"], (params, bad.text)
    assert get("usage/balance", user="bob").status_code == 400  # only one's own balance


def test_the_lab_opens_without_the_news_prompt_and_the_status_bar_counts_a_warm_gpu_as_warm(
    page: Any, lab: Lab, clients: dict[str, Client], shots: Path
) -> None:
    from playwright.sync_api import expect

    # The Lab's own default (what `gpulease up` writes), not a setting of the user's.
    settings = httpx.get(
        f"{lab.url}lab/api/settings/@jupyterlab/apputils-extension:notification", params={"token": lab.token}
    ).json()
    assert settings["schema"]["properties"]["fetchNews"]["default"] == "false"
    assert "fetchNews" not in (settings.get("settings") or {})

    alice = clients["alice"]
    open_panel(page, lab)
    status = page.get_by_role("button", name=re.compile(r"^GPU: \d+ held"))
    expect(status).to_have_text("GPU: 0 held · 4 free")
    lease = alice.acquire(gpus=1, pool=T4, ttl=60, label="train")
    try:
        expect(status).to_have_text("GPU: 1 held · 3 free")
        alice.warm(lease)  # the cell ended; its worker waits for the notebook's next cell, lendable
        expect(status).to_have_text("GPU: 0 held · 1 warm · 3 free")
        expect(status).to_have_attribute("title", re.compile(r"kept warm for your next cell"))
        expect(status).to_have_attribute(
            "title", re.compile(rf"\n{A100}: 0 GPUs yours.*; \d+\w\w of \d+ in fair share")
        )
        page.screenshot(path=str(shots / "1-warm-status.png"))
    finally:
        alice.release(lease, verified=True)
    expect(status).to_have_text("GPU: 0 held · 4 free")
    # By now JupyterLab has long asked its settings whether to prompt: it did not.
    expect(page.get_by_text(NEWS)).to_have_count(0)
