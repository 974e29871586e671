"""The notebook toolbar's Stop (interrupt) button on a %%gpu_train cell, in a real JupyterLab driven by
Playwright in Debian's headless Chromium (the fixtures of test_ui.py).

%%gpu_train needs a Ray cluster that the lease server names, so the lease server here is ``gpulease
up`` (a Ray head, Redis and a lease server with simulated GPUs: one box of 2 A100s), not the
in-thread server of test_ui.py. JupyterLab finds the CPU-only "gpulease" kernelspec through
JUPYTER_PATH and runs its kernels as alice; bob is the other user who holds GPUs.

Stop means stop: pressed while the cell is queued, the request is withdrawn and never granted later;
pressed while it runs, the GPUs are free at once, the cell says so in a few lines (no frames of
gpulease's or Ray's code), and the kernel runs the next cell straight away.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lease_server.client import Client
from magics.kernel import DISPLAY_NAME, KERNEL_NAME
from tests.conftest import Stack, Up
from tests.test_ui import Lab, page, shots
from tests.test_ui import pytestmark as pytestmark  # skipped with test_ui where Chromium is missing

# test_ui's fixtures, which the tests here take by name: its Playwright page (on the `lab` below) and
# its screenshot folder.
REUSED_FIXTURES = (page, shots)

POOL = "A100-80GB"
NOTEBOOK = "stop.ipynb"
WITHDRAWN = "gpu_train: stopped while queued; the request was withdrawn"
# What a Stop must not show: frames of gpulease's or Ray's code.
CODE_PATHS = ("magics/", "lease_server/", "ray/", "Traceback")


# ``gpulease up`` with a Ray head and one simulated box of 2 GPUs, and the kernelspec installed under a
# prefix of its own (up.env["JUPYTER_PATH"]): conftest's `up` of this STACK.
STACK = Stack.of(f"box=2x{POOL}", kernels=True, GPULEASE_SWEEP_INTERVAL="0.2", GPULEASE_WARM="off")


@pytest.fixture(scope="module")
def stack(up: Up) -> Up:
    return up  # by the name this module's tests use


def _admin(stack: Up) -> Client:
    return Client(stack.url, (stack.data / "token").read_text().strip())


@pytest.fixture
def clients(stack: Up) -> Iterator[dict[str, Any]]:  # overrides test_ui's: users of the `gpulease up` server
    root = _admin(stack)
    made = {"root": root}
    for user in ("alice", "bob"):
        made[user] = Client(stack.url, root.request("POST", "/api/v1/tokens", json={"user": user})["token"])
    yield made
    for c in made.values():
        c.close()


@pytest.fixture
def lab(stack: Up, clients: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lab]:
    """JupyterLab (overrides test_ui's) against `gpulease up`, as alice, with the gpulease kernelspec."""
    monkeypatch.setenv("JUPYTER_PATH", stack.env["JUPYTER_PATH"])  # Lab's child process inherits it
    lab = Lab(tmp_path / "lab", stack.url, clients["alice"].token)
    yield lab
    lab.stop()


def _free(client: Client) -> int:
    return int(client.cluster()["pools"][POOL]["free"])


def open_notebook(page: Any, lab: Lab, *cells: str) -> Any:
    """Write a notebook of ``cells`` with the gpulease kernelspec, open it, and wait until its kernel
    is idle. Returns the notebook panel."""
    from playwright.sync_api import expect

    nb = {
        "cells": [
            {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
            for src in cells
        ],
        "metadata": {
            "kernelspec": {"name": KERNEL_NAME, "display_name": DISPLAY_NAME, "language": "python"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    resp = httpx.put(
        f"{lab.url}api/contents/{NOTEBOOK}",
        params={"token": lab.token},
        json={"type": "notebook", "format": "json", "content": nb},
        timeout=10,
    )
    assert resp.status_code in (200, 201), resp.text
    page.goto(f"{lab.url}lab/tree/{NOTEBOOK}?token={lab.token}")
    panel = page.locator(".jp-NotebookPanel", has=page.locator(".jp-Notebook"))
    expect(panel.locator(".jp-Notebook .jp-CodeCell")).to_have_count(len(cells), timeout=60_000)
    expect(panel.locator(".jp-Toolbar").get_by_text(DISPLAY_NAME)).to_be_visible()
    # The kernel joins Ray as it starts: idle only once it can take a cell.
    try:
        expect(panel.locator(".jp-Notebook-ExecutionIndicator")).to_have_attribute(
            "data-status", "idle", timeout=120_000
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- jupyterlab log ---\n{lab.log.read_text()[-4000:]}") from None
    return panel


def run_cell(panel: Any, i: int) -> Any:
    """Select cell ``i`` (command mode, by its prompt) and run it with Shift+Enter; returns its output area."""
    cell = panel.locator(".jp-Notebook .jp-CodeCell").nth(i)
    cell.locator(".jp-InputPrompt").click()
    cell.page.keyboard.press("Shift+Enter")
    return cell.locator(".jp-OutputArea")


def press_stop(panel: Any) -> None:
    """The notebook toolbar's Stop: "Interrupt the kernel"."""
    panel.locator('.jp-Toolbar [data-command="notebook:interrupt-kernel"]').click()


def test_stop_while_queued_withdraws_the_request_and_it_is_never_granted(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    from playwright.sync_api import expect

    alice, bob = clients["alice"], clients["bob"]
    holding = bob.acquire(gpus=2, pool=POOL, ttl=300, label="holds the whole pool")
    try:
        assert _free(bob) == 0
        panel = open_notebook(page, lab, "%%gpu_train --gpus 1\nran = True")
        out = run_cell(panel, 0)
        expect(out).to_contain_text(re.compile(rf"^gpu_train: queued for 1 GPU( of {POOL})?: 1st in line, \d+s"))
        (waiting,) = alice.queue()
        assert waiting["user"] == "alice" and waiting["gpus"] == 1
        rid = waiting["id"]
        page.screenshot(path=str(shots / "1-queued.png"), full_page=True)

        press_stop(panel)
        expect(out).to_contain_text(WITHDRAWN, timeout=5_000)
        expect(panel.locator(".jp-Notebook-ExecutionIndicator")).to_have_attribute("data-status", "idle")
        assert alice.queue() == []
        text = out.inner_text()
        assert "KeyboardInterrupt" not in text and len([x for x in text.splitlines() if x.strip()]) == 1, text
        assert not any(bad in text for bad in CODE_PATHS), text
        page.screenshot(path=str(shots / "2-withdrawn.png"), full_page=True)
    finally:
        bob.release(holding)

    # The release re-runs dispatch in the same script: had the request still waited, it would hold
    # a GPU now, and its grant would be in the log.
    assert _free(alice) == 2
    events = alice.request("GET", "/api/v1/events/log", params={"lease": rid, "limit": 1000})["events"]
    assert [e["type"] for e in events] == ["queued", "wait_cancelled"], events
    everyone = alice.request("GET", "/api/v1/events/log", params={"limit": 10000})["events"]
    assert not [e for e in everyone if e["type"] == "grant" and e.get("lease") == rid], everyone
    # A later request of the same size is served at once: nothing is queued ahead of it.
    later = bob.acquire(gpus=2, pool=POOL, ttl=60)
    bob.release(later)
    everyone = alice.request("GET", "/api/v1/events/log", params={"limit": 10000})["events"]
    assert not [e for e in everyone if e["type"] == "grant" and e.get("lease") == rid]
    page.screenshot(path=str(shots / "3-released-never-granted.png"), full_page=True)
    print(f"screenshots: {shots}")


def test_stop_while_running_frees_the_gpus_in_a_few_clean_lines_and_the_kernel_goes_on(
    page: Any, lab: Lab, clients: dict[str, Any], shots: Path
) -> None:
    from playwright.sync_api import expect

    alice = clients["alice"]
    assert _free(alice) == 2
    panel = open_notebook(
        page,
        lab,
        "%%gpu_train\nimport time\nprint('training', flush=True)\ntime.sleep(60)",
        "print('usable after stop')",
    )
    out = run_cell(panel, 0)
    expect(out).to_contain_text(re.compile(r"gpu_train: running on box GPU \d"))
    expect(out).to_contain_text("training", timeout=60_000)  # the first call may start its worker process
    assert _free(alice) == 1
    page.screenshot(path=str(shots / "1-running.png"), full_page=True)

    press_stop(panel)
    expect(out).to_contain_text(re.compile(r"gpu_train: stopped after [\d.]+s on 1 GPU on box \(GPU \d\)\s+released"))
    assert _free(alice) == 2
    assert alice.leases() == []
    text = out.inner_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) <= 3 and "KeyboardInterrupt" not in text, text  # the stop said once, in its line
    assert not any(bad in text for bad in CODE_PATHS), text

    nxt = run_cell(panel, 1)
    expect(nxt).to_have_text("usable after stop", timeout=5_000)
    page.screenshot(path=str(shots / "2-stopped-and-next-cell.png"), full_page=True)
    print(f"screenshots: {shots}")
