"""GPU slices from a notebook (issue 35, items 1, 3 and 4): cells that share one GPU, each held to
the memory it leased, and ``--gpu-mem auto``.

A real ``gpulease up`` (Redis, lease server, its node agent) and a real Ray head; the GPUs are
simulated, so the node agent measures each slice's resident memory, the simulation's stand-in for
the GPU memory it uses (lease_server/node/memwatch.py). The A100 pool shares its GPUs in units of
256 MB (tests/data/slices.toml), the T4 pool does not.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from lease_server import errors
from lease_server.client import Client
from magics.grant import Cancel
from magics.runner import (
    GpuLeaseEnded,
    Options,
    RecordingUI,
    Running,
    Session,
    plan_call,
    run_call,
    run_cell,
)
from tests.api_helpers import EventWatcher
from tests.conftest import Stack, Up, all_events, ray_session

ray = pytest.importorskip("ray")

A100 = "A100-80GB"
CONFIG = Path(__file__).parent / "data" / "slices.toml"
STACK = Stack.of("box=2xA100-80GB,t4=1xT4-16GB", "--config", str(CONFIG), GPULEASE_DEFAULT_TTL="3")


@pytest.fixture
def sess(up: Up) -> Iterator[Session]:
    yield from ray_session(up)


@pytest.fixture
def admin(up: Up, sess: Session) -> Iterator[Client]:
    c = Client(up.url, sess.defaults.token)
    yield c
    c.close()


class Seen(RecordingUI):
    """A RecordingUI that says when its call runs."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def running(self, r: Running) -> None:
        super().running(r)
        self.started.set()


def running(ui: RecordingUI) -> Running:
    return next(s for s in ui.states if isinstance(s, Running))


def nothing_leased(c: Client) -> bool:
    view = c.cluster()
    return view["pools"][A100]["free"] == 2 and not any(
        g["state"] == "sliced" for n in view["nodes"] for g in n["gpus"]
    )


def lines_fit(text: str) -> bool:
    return all(len(line) <= 80 for line in text.splitlines())


# ---- two slices on one GPU: only the one over its memory is ended ---------------------------------------


def test_two_slices_share_a_gpu_and_only_the_one_over_its_memory_is_ended(up, sess, admin, tmp_path):
    watcher = EventWatcher(up.url, sess.defaults.token).start()
    go = tmp_path / "go"
    os.mkfifo(go)  # the neighbour's cell blocks reading it: it runs until the test writes
    neighbour_ui, hog_ui = Seen(), Seen()
    out: dict[str, Any] = {}
    opts = Options(gpu_mem="512MB", pool=A100, label="neighbour")

    def neighbour() -> None:
        try:
            call = plan_call(f"said = open({str(go)!r}).read()\nsaid", {}, opts)
            out["value"] = run_call(call, opts, neighbour_ui, sess, cancel=Cancel()).value
        except BaseException as exc:  # noqa: BLE001 - the test reads it below
            out["error"] = exc

    t = threading.Thread(target=neighbour, daemon=True)
    t.start()
    assert neighbour_ui.started.wait(120), neighbour_ui.states
    # The hog: 800 MB of resident memory (written, so resident) in a 512 MB slice, and it stays there.
    with pytest.raises(GpuLeaseEnded):
        run_cell(
            "import time\nhog = b'x' * (800 * 2**20)\ntime.sleep(120)",
            {},
            Options(gpu_mem="512MB", pool=A100, label="hog"),
            hog_ui,
            sess,
        )
    with open(go, "w") as f:  # the neighbour runs on, and finishes
        f.write("done")
    t.join(60)
    assert out.get("value") is not None and out["value"].result == "done", out
    # Both on GPU 0 of box, each promised 512 MB of its 80 GB
    for ui in (neighbour_ui, hog_ui):
        assert running(ui).where == "box GPU 0, 512 MB of 80 GB, shared", running(ui)
    assert neighbour_ui.ending.state == "released" and neighbour_ui.ending.where == "a 512 MB slice of box GPU 0"
    # The hog: warned in one line while it ran, then ended with what it used and what would fit
    warned = [s for s in hog_ui.states if isinstance(s, str)]
    assert any(
        re.fullmatch(r"over its 512 MB slice, using [\d.]+ [MG]B: ended unless it drops back", w) for w in warned
    )
    line = hog_ui.ending.line()
    first, used, nxt = line.splitlines()[:3]
    assert first.startswith("gpu_train: stopped: over its 512 MB slice; released"), line
    assert re.fullmatch(r"  used [\d.]+ [MG]B for [\d.]+s", used), line
    assert re.fullmatch(r"  next: --gpu-mem (\d+)(MB|GB) \(its .* peak \+ 20 %, rounded up\)", nxt), line
    assert lines_fit(line) and "Traceback" not in line
    fit = re.search(r"--gpu-mem (\d+)MB", nxt)
    assert fit is None or int(fit.group(1)) % 256 == 0  # in the pool's unit
    # Only the hog was ended, by the node agent, for its memory; the neighbour by its own release
    hog_id, neighbour_id = running(hog_ui).lease_id, running(neighbour_ui).lease_id
    assert admin.get(hog_id)["cause"]["code"] == "over_memory"
    assert admin.get(neighbour_id)["cause"]["code"] == "released"
    assert [e["lease"] for e in all_events(admin) if e["type"] == "over_memory"] == [hog_id]
    assert admin.get(hog_id)["over_memory"]["peak_mb"] > 512 * 1.05
    # A forced end drains: the hog's memory stays promised until its node agent saw the worker gone
    watcher.wait_for(lambda e: e["type"] == "drained" and e.get("lease") == hog_id, 60, "the hog drained")
    assert nothing_leased(admin)


# ---- bad input: one line that says what would work, nothing leased ----------------------------------


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (Options(gpu_mem="0", pool=A100), "must be above 0"),
        (Options(gpu_mem="ten GB", pool=A100), "write a size such as 10GB"),
        (Options(gpu_mem="100GB", pool=A100), "more than one GPU of pool"),
        (Options(gpu_mem="2GB", pool="T4-16GB"), "does not share its GPUs"),
        (Options(gpu_mem="2GB", gpus=2, nodes=2, pool=A100), "a slice (--gpu-mem) is part of one GPU: drop --nodes"),
        (Options(gpu_mem="auto", gpus=2, pool=A100), "--gpu-mem auto sizes one GPU's slice"),
    ],
)
def test_bad_slice_requests_are_one_line_and_lease_nothing(sess, admin, options, says):
    with pytest.raises((ValueError, errors.BadRequest)) as exc:
        run_cell("x = 1", {}, options, RecordingUI(), sess)
    text = getattr(exc.value, "message", None) or str(exc.value)
    assert says in text and "\n" not in text, text
    assert nothing_leased(admin)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("--gpu-mem 0", "must be above 0"),
        ("--gpu-mem 10parsecs", "write a size such as 10GB"),
        ("--gpus 1-2 --gpu-mem 1GB", "part of each GPU of a fixed count"),
        ("--gpus 2 --gpu-mem auto", "--gpu-mem auto sizes one GPU's slice"),
        ("--gpus 0.25 --gpu-mem 1GB", "already asks for part of one GPU"),
        ("--gpus 1.5", "fraction of one GPU"),
    ],
)
def test_the_magic_refuses_a_bad_size_in_one_line(line, says):
    from IPython.core.interactiveshell import InteractiveShell

    from magics.magic import GpuMagics

    fresh = not InteractiveShell.initialized()
    shell = InteractiveShell.instance()
    try:
        shell.register_magics(GpuMagics)
        with pytest.raises(UsageError) as exc:
            shell.run_cell_magic("gpu_train", line, "x = 1")
    finally:
        if fresh:  # a shell of this test's own would stop a later test's IPython app from starting
            InteractiveShell.clear_instance()
    assert says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_size_between_units_is_rounded_up_and_the_line_says_so(sess, admin):
    ui = RecordingUI()
    got = run_cell("x = 1", {}, Options(gpu_mem="1000MB", pool=A100), ui, sess)
    assert got.names == {"x": 1}
    r = running(ui)
    assert r.where == "box GPU 0, 1 GB of 80 GB, shared" and r.note == "1000 MB rounded up to the pool's unit"
    assert ui.ending.where == "a 1 GB slice of box GPU 0" and nothing_leased(admin)


# ---- --gpu-mem auto -------------------------------------------------------------------------------


def test_gpu_mem_auto_sizes_the_next_cell_from_the_last_cells_measured_peak(sess, admin, tmp_path):
    go = tmp_path / "go"
    os.mkfifo(go)
    first_ui, out = Seen(), {}
    opts = Options(gpu_mem="auto", pool=A100)

    def first() -> None:
        try:
            src = f"big = b'x' * (600 * 2**20)\nopen({str(go)!r}).read()\nlen(big)"
            out["value"] = run_call(plan_call(src, {}, opts), opts, first_ui, sess, cancel=Cancel()).value
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc

    t = threading.Thread(target=first, daemon=True)
    t.start()
    assert first_ui.started.wait(120)
    lease_id = running(first_ui).lease_id
    # The node agent measures the whole GPU's lease too (its pool shares): wait until the board
    # shows its peak past the 600 MB the cell holds. Polled: the board has no event for it.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and peak_on_board(admin, lease_id) < 600:
        time.sleep(0.2)
    with open(go, "w") as f:
        f.write("go")
    t.join(60)
    assert out.get("value") is not None, out
    r = running(first_ui)
    assert (
        re.fullmatch(r"box GPU \d", r.where)
        and r.note == "a whole GPU: no cell of this notebook has a measured peak yet"
    )
    peak = admin.get(lease_id)["mem_peak_mb"]
    assert peak >= 600 and sess.mem_peak_mb >= peak
    ui = RecordingUI()
    run_cell("y = 2", {}, Options(gpu_mem="auto", pool=A100), ui, sess)
    second = running(ui)
    m = re.fullmatch(r"box GPU \d, ([\d.]+ [MG]B) of 80 GB, shared", second.where)
    assert m, second
    assert re.fullmatch(rf"{re.escape(m.group(1))}: last cell peaked at [\d.]+ [MG]B \+ 20 %", second.note), second
    assert nothing_leased(admin)


def peak_on_board(c: Client, lease_id: str) -> int:
    for n in c.cluster()["nodes"]:
        for g in n["gpus"]:
            lease = g.get("lease") or {}
            if lease.get("id") == lease_id:
                return int(lease.get("mem_peak_mb") or 0)
    return 0


# ---- warm slices ------------------------------------------------------------------------------------


def test_a_slice_stays_warm_for_the_next_cell_of_its_size_and_is_lent_to_a_slice_that_needs_it(up, sess, admin):
    """A 40 GB slice cell keeps its worker warm; the next cell of the same size (written another
    way) runs in it. bob, with the other GPU taken, asks for 50 GB: the warm slice is evicted for
    him (its worker ended, its lease released) and our next cell starts cold, saying why."""
    from dataclasses import replace

    from tests.test_warm_cells import other_user

    ns: dict[str, Any] = {}
    opts = Options(gpu_mem="40GB", pool=A100, warm=True)
    first = RecordingUI()
    run_cell("import os\npid = os.getpid()\nmodel = [1.0, 2.0]", ns, opts, first, sess)
    assert first.ending.warm and first.ending.where == "a 40 GB slice of box GPU 0", first.ending
    line = first.ending.line()
    assert "kept warm on a 40 GB slice of box GPU 0" in line and lines_fit(line), line
    again = RecordingUI()
    run_cell("import os\nsame = os.getpid() == pid\nn = len(model)", ns, replace(opts, gpu_mem="40960MB"), again, sess)
    assert ns["same"] is True and ns["n"] == 2 and again.ending.warm
    # bob: the other GPU whole, then a slice that fits only where the warm slice is
    bob = other_user(up)
    try:
        whole = bob.acquire(1, A100)
        assert whole.gpus[0]["index"] == 1
        got = bob.acquire(1, A100, gpu_mem="50GB", wait=60)
        assert got.gpus[0]["index"] == 0 and got.gpu_mem_mb == 51200
        bob.release(got)
        bob.release(whole)
    finally:
        bob.close()
    third = RecordingUI()
    run_cell("import os\nsame = os.getpid() == pid", ns, opts, third, sess)
    assert ns["same"] is False
    notes = " ".join(third.ending.notes)
    assert "a 40 GB slice of box GPU 0" in notes and "its GPU was lent to bob at " in notes, third.ending.notes
    assert lines_fit(third.ending.line()), third.ending.line()
    # the third cell left its slice warm; a whole-GPU cell ends it (a cold start, one line)
    fourth = RecordingUI()
    run_cell("x = 1", ns, replace(opts, gpu_mem=None, gpus=1), fourth, sess)
    assert any("this cell asks for 1 GPU" in n for n in fourth.ending.notes), fourth.ending.notes
    run_cell("x = 1", ns, replace(opts, gpu_mem=None, gpus=1, warm=False), RecordingUI(), sess)
    assert nothing_leased(admin)


def test_k_slices_run_one_cell_on_a_slice_of_each_of_k_gpus(sess, admin):
    """--gpus 2 --gpu-mem 1GB: one worker sees two GPUs, each held to its 1 GB slice (the env the
    worker's torch limit and MPS read), and the lines say so."""
    ui = RecordingUI()
    got = run_cell(
        "import os\nseen = (os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GPULEASE_GPU_MEM_MB'])",
        {},
        Options(gpu_mem="1GB", gpus=2, pool=A100),
        ui,
        sess,
    )
    visible, mb = got.names["seen"]
    assert len(visible.split(",")) == 2 and mb == "1024", got.names
    r = running(ui)
    assert re.fullmatch(r"box GPU \d,\d, 1 GB of 80 GB each, shared", r.where), r
    assert re.fullmatch(r"1 GB slices of box GPU \d,\d", ui.ending.where), ui.ending
    assert lines_fit(ui.ending.line()) and nothing_leased(admin)
