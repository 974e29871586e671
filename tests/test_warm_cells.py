"""Warm cells through a real kernel, `gpulease up` (Redis, lease server, node agent), a real Ray
head and simulated GPUs: a finished %%gpu_train cell's worker stays warm on its lease for the
notebook's next cell, and is lent out the moment someone else waits."""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lease_server.client import Client
from tests.api_helpers import EventWatcher
from tests.conftest import Up
from tests.test_magics import Kernel, _alive, api, displays, errors_of, kernel_stack, status, text

WARM_MAX = "8"  # seconds: long enough for a test's cells, short enough to watch it run out


STACK = kernel_stack("box=2xA100-80GB", GPULEASE_WARM="on", GPULEASE_WARM_MAX=WARM_MAX)  # conftest's `up`


@pytest.fixture(scope="module")
def stack(up: Up) -> Up:
    return up  # the module's `gpulease up` (conftest's `up` of STACK), by the name its tests use


@pytest.fixture
def kernel(stack: Up) -> Iterator[Kernel]:
    k = Kernel(stack)
    yield k
    k.shutdown()


def admin_token(up: Up) -> str:
    return (up.data / "token").read_text().strip()


def other_user(up: Up, name: str = "bob") -> Client:
    token = api(up, "POST", "/api/v1/tokens", json={"user": name})["token"]
    return Client(up.url, token)


def board(up: Up) -> dict[int, str]:
    (node,) = api(up, "GET", "/api/v1/cluster")["nodes"]
    return {g["index"]: g["state"] for g in node["gpus"]}


def warm_cell(kernel: Kernel, body: str, flags: str = "--gpus 1") -> list[dict[str, Any]]:
    out = kernel.run(f"%%gpu_train {flags}\n{body}")
    assert not errors_of(out), out
    return out


def worker_pid(kernel: Kernel) -> int:
    return int(text(warm_cell(kernel, "import os\npid = os.getpid()\nprint(pid)")).split()[-1])


COUNTED = """
class Counted:
    pickled = 0  # in the kernel: how often an instance was pickled (to check it, or to send it)
    def __reduce__(self):
        Counted.pickled += 1
        return (Counted, ())
counted = Counted()
"""


def test_the_next_cell_runs_in_the_warm_worker_with_its_objects_and_unchanged_names_stay(stack, kernel):
    kernel.run("big = list(range(100000))")
    kernel.run(COUNTED)
    out = warm_cell(kernel, "import os\nmodel = {'w': [1.0, 2.0]}\nwid, bid, pid = id(model), id(big), os.getpid()")
    line = status(out)
    assert line.startswith("gpu_train: ran ") and line.endswith("; kept warm on box GPU 0 (lent out if someone waits)")
    assert len(line) <= 80, line
    assert board(stack)[0] == "warm"
    lease_id = api(stack, "GET", "/api/v1/leases")["leases"][0]["id"]
    warm_cell(kernel, "c = counted")
    before = text(kernel.run("print(Counted.pickled)")).strip()
    out = warm_cell(
        kernel, "import os\nsame = (id(model) == wid, id(big) == bid, os.getpid() == pid, c is counted)\nsame"
    )
    assert text(out, "execute_result") == "(True, True, True, True)", out
    assert text(kernel.run("print(Counted.pickled)")).strip() == before  # neither sent nor checked again
    running = [d for d in displays(out) if d.startswith("gpu_train: running")]
    assert running and "(warm worker, " in running[0] and "s since the last cell)" in running[0], running
    assert api(stack, "GET", "/api/v1/leases")["leases"][0]["id"] == lease_id  # no new lease, no queue
    # The kernel rebinds a name: it crosses again; the object the worker made stays the worker's.
    kernel.run("big = [0]")
    out = warm_cell(kernel, "n = len(big), id(big) == bid, model['w']\nn")
    assert text(out, "execute_result") == "(1, False, [1.0, 2.0])", out
    # --fresh: a new worker, every name sent again; the old one ended, its lease released.
    out = warm_cell(kernel, "import os\nfresh_pid = os.getpid()", flags="--gpus 1 --fresh")
    assert text(kernel.run("print(fresh_pid != pid)")).strip() == "True"
    assert api(stack, "GET", f"/api/v1/leases/{lease_id}")["state"] == "released"
    assert not _alive(int(text(kernel.run("print(pid)")).strip()))
    # Another GPU count: the warm worker ends first and the cell starts cold on its own lease, and
    # says so in a line under its status (the objects on the GPU are not there any more).
    out = warm_cell(kernel, "x = 1", flags="--gpus 2")
    assert board(stack) == {0: "warm", 1: "warm"}
    notices = [d for d in displays(out) if "\n  ! " in d]
    assert notices and notices[0].endswith(
        "\n  ! warm worker on box GPU 0 ended: this cell asks for 2 GPUs (a cold start)"
    )
    assert status(out).endswith("\n  ! warm worker on box GPU 0 ended: this cell asks for 2 GPUs (a cold start)")
    shown = text(kernel.run("%gpu_lease"))
    assert shown.startswith("user ") and "; this notebook:\n  lease " in shown, shown
    assert "kept warm " in shown and "\n    for this notebook's next cell (lent out if someone waits)" in shown, shown
    assert "your other notebooks" not in shown, shown
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    out = kernel.run("%gpu_lease release")
    assert "released; its warm worker ended" in text(out), out
    assert board(stack) == {0: "free", 1: "free"}
    # A kind of cell no warm worker serves (elastic, a gang, --gpu-mem auto) says so too.
    warm_cell(kernel, "x = 1")
    out = warm_cell(kernel, "x = 2", flags="--gpus 1-2")
    assert "\n  ! warm worker on box GPU 0 ended: this cell asks for 1-2 GPUs (a cold start)" in status(out), out
    assert board(stack) == {0: "free", 1: "free"}  # (an elastic cell is not kept warm)


def test_another_users_request_suspends_the_warm_worker_and_the_next_cell_resumes_in_it(stack, kernel):
    """Evicted for bob, the warm worker is suspended (simulated GPUs: it simply lives on without a
    lease), bob is granted once the node agent has it off the GPU, and the notebook's next cell runs
    in the same process with its objects (same id) under a new lease, restored onto its GPU."""
    out = warm_cell(kernel, "import os\nstate = [1, 2, 3]\nsid, pid = id(state), os.getpid()")
    pid = int(text(kernel.run("print(pid)")).strip())
    old_id = api(stack, "GET", "/api/v1/leases")["leases"][0]["id"]
    bob = other_user(stack)
    watcher = EventWatcher(stack.url, admin_token(stack)).start()
    lease = bob.acquire(2, wait=30)  # one GPU is free, the other is the warm one
    assert _alive(pid), "the suspended worker should live on"
    ev = watcher.wait_for(lambda e: e["type"] == "evicting", 10, "evicting")
    sus = watcher.wait_for(lambda e: e["type"] == "suspended" and e["lease"] == ev["lease"] == old_id, 10, "suspended")
    grant = next(e for e in watcher.events if e["type"] == "grant" and e["lease"] == lease.id)
    assert sus["ts"] <= grant["ts"] and grant["ts"] - ev["ts"] < 2.0  # off the GPU first, within the notice
    (old,) = [e for e in watcher.events if e["type"] in ("released", "revoked") and e["lease"] == old_id]
    assert old["type"] == "released"  # handed back by the kernel within the notice, not revoked
    shown = text(kernel.run("%gpu_lease"))
    assert "  suspended · on host (" in shown, shown
    assert "s): worker from box\n    this notebook's next cell restores it\n" in shown, shown
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    # Another notebook of the same user: it holds nothing, and names this one's worker as another's
    other = Kernel(stack)
    try:
        elsewhere = text(other.run("%gpu_lease"))
    finally:
        other.shutdown()
    assert "this notebook:\n  holds nothing: its next GPU cell starts a worker\n" in elsewhere, elsewhere
    assert "your other notebooks:\n  suspended · on host (" in elsewhere, elsewhere
    assert "that notebook's next cell restores it" in elsewhere and "this notebook's next" not in elsewhere
    bob.release(lease)
    out = kernel.run("%%gpu_train --gpus 1\nimport os\nid(state) == sid, os.getpid() == pid, len(state)")
    assert not errors_of(out), out
    assert text(out, "execute_result") == "(True, True, 3)", out
    running = [d for d in displays(out) if d.startswith("gpu_train: running")]
    # it says whom its GPU was lent to, and when (in 80 columns)
    assert running and "(suspended worker: your warm GPU was lent to bob at " in " ".join(running[0].split())
    assert all(len(line) <= 80 for line in running[0].splitlines()), running
    final = status(out)
    assert final.startswith("gpu_train: ran ") and "kept warm on box GPU " in final, final
    restored = final.splitlines()[1].strip()
    assert restored.startswith("restored ") and " to box GPU " in restored and restored.endswith("s"), final
    assert all(len(line) <= 80 for line in final.splitlines()), final
    new_id = max(api(stack, "GET", "/api/v1/leases")["leases"], key=lambda x: x.get("warm_since", 0))["id"]
    ev = watcher.wait_for(lambda e: e["type"] == "restored" and e["lease"] == new_id, 10, "restored")
    assert ev["suspended_lease"] == old_id and ev["bytes"] == sus["bytes"] > 0
    assert not [n for n in api(stack, "GET", "/api/v1/cluster")["nodes"] if n.get("suspended")]


def test_a_cell_queued_behind_whom_its_warm_gpu_was_lent_to_says_so_and_when_their_lease_ends(stack, kernel):
    """Bob's request takes the notebook's warm GPU (and the free one) and he never renews his
    short lease. The notebook's next cell queues behind him: its line says the warm GPU was lent to
    bob, at what time, and that his lease expires in a few seconds (it is past half its TTL
    unrenewed), and its estimate is no longer than that, every line within 80 columns; once bob's
    lease expires the cell runs."""
    warm_cell(kernel, "state = [1, 2, 3]")
    bob = other_user(stack)
    watcher = EventWatcher(stack.url, admin_token(stack)).start()
    lease = bob.acquire(2, ttl=6, wait=30)  # never renewed: a raw client has no renewal thread
    ev = watcher.wait_for(lambda e: e["type"] == "evicting", 10, "evicting")
    assert ev["requested_by"] == "bob"
    lent_at = time.strftime("%H:%M", time.localtime(ev["ts"]))
    time.sleep(max(0.0, lease.expires_at - 2.6 - time.time()))  # past half its TTL, not renewed
    out = kernel.run("%%gpu_train --gpus 1\nlen(state)")
    assert not errors_of(out), out
    assert text(out, "execute_result") == "3", out
    queued = [d for d in displays(out) if d.startswith("gpu_train: queued for 1 GPU")]
    assert queued, displays(out)
    first, why = queued[0].splitlines()[:2]
    assert why.startswith(f"  your warm GPU was lent to bob at {lent_at}; bob's lease expires in ~"), queued
    left = int(why.split("~")[1].split()[0])
    assert left <= 3, queued  # its deadline, not the pool's typical cell
    more = first.split("; about ")[1] if "; about " in first else ""
    assert not more or int(more.split()[0]) <= left + 1, first  # the estimate counts on it
    for shown in displays(out):
        assert all(len(line) <= 80 for line in shown.splitlines()), shown


def test_a_frozen_kernel_misses_the_notice_and_its_warm_worker_is_ended_before_the_grant(stack):
    k = Kernel(stack)
    try:
        pid = worker_pid(k)
        os.kill(k.km.provisioner.process.pid, signal.SIGSTOP)  # it can neither end the worker nor release
        bob = other_user(stack, "carol")
        watcher = EventWatcher(stack.url, admin_token(stack)).start()
        lease = bob.acquire(2, wait=60)
        assert not _alive(pid), "granted while the frozen kernel's warm worker still ran"
        evicting = watcher.wait_for(lambda e: e["type"] == "evicting", 10, "evicting")
        assert evicting["reason"].startswith("evicted for carol's request")
        # Frozen, the kernel neither releases nor renews: the sweeper ends the lease at the notice's
        # end (revoked) or, if its TTL runs out first, at its deadline (expired). Either way its
        # GPUs drain before anyone is granted them.
        ended = watcher.wait_for(
            lambda e: e["type"] in ("revoked", "expired") and e.get("lease") == evicting["lease"], 10, "its end"
        )
        if ended["type"] == "revoked":
            assert ended["reason"].startswith("evicted for carol's request")
        watcher.wait_for(lambda e: e["type"] == "drained" and e["lease"] == evicting["lease"], 10, "drained")
        bob.release(lease)
        os.kill(k.km.provisioner.process.pid, signal.SIGCONT)
        out = k.run("%%gpu_train --gpus 1\n1 + 1")
        assert text(out, "execute_result") == "2" and not errors_of(out), out
        assert "this cell starts cold" in " ".join(" ".join(displays(out)).split())
    finally:
        os.kill(k.km.provisioner.process.pid, signal.SIGCONT)
        k.shutdown()


def test_warm_max_ends_the_warm_worker(stack, kernel):
    watcher = EventWatcher(stack.url, admin_token(stack)).start()
    pid = worker_pid(kernel)
    lease_id = max(api(stack, "GET", "/api/v1/leases")["leases"], key=lambda x: x.get("warm_since", 0))["id"]
    ev = watcher.wait_for(
        lambda e: e["type"] == "expired" and e["lease"] == lease_id, float(WARM_MAX) + 10, "expired at warm_max"
    )
    assert ev["warm"] is True and "warm_max" in ev["reason"]
    watcher.wait_for(lambda e: e["type"] in ("drained", "released") and e["lease"] == ev["lease"], 10, "clean")
    assert not _alive(pid)
    assert board(stack)[0] == "free"


def test_kernel_restart_ends_the_warm_worker(stack):
    k = Kernel(stack)
    try:
        pid = worker_pid(k)
        lease_id = api(stack, "GET", "/api/v1/leases")["leases"][0]["id"]
        k.km.restart_kernel(now=False)  # the old kernel's shutdown ends its warm worker and releases
        rec = api(stack, "GET", f"/api/v1/leases/{lease_id}")
        assert rec["state"] == "released", rec
        assert not _alive(pid)
    finally:
        k.shutdown()


def test_bad_options_are_one_line_and_lease_nothing(stack, kernel):
    bad = [
        ("%gpu_config --warm maybe", "--warm"),
        ("%gpu_config --spares 9", "--spares"),
        ("%%gpu_train --fresh=1\nx = 1", "--fresh"),
    ]
    for line, expect in bad:
        out = kernel.run(line)
        assert "UsageError: " in text(out) and expect in text(out), (line, out)
        assert len(text(out).strip().splitlines()) == 1, out
    assert api(stack, "GET", "/api/v1/leases")["leases"] == []
    out = kernel.run("%gpu_config --warm off")
    assert "warm=off" in text(out) and "spares=0" in text(out)  # the tests' kernels keep none (conftest)
    out = warm_cell(kernel, "x = 1")
    assert "released; GPU memory freed" in status(out) and board(stack) == {0: "free", 1: "free"}
    assert api(stack, "GET", "/api/v1/leases")["leases"] == []


def test_a_cell_the_server_refuses_leaves_the_warm_worker_as_it_was(stack, kernel):
    """A typo in --pool, more GPUs than a node has, a slice no GPU holds, a gang on more nodes than there
    are: one UsageError line, and the notebook keeps its warm worker with its objects: the refusal is
    asked before the worker is ended."""
    out = warm_cell(kernel, "import os\nstate = [1, 2]\nsid, pid = id(state), os.getpid()")
    lease_id = api(stack, "GET", "/api/v1/leases")["leases"][0]["id"]
    for flags, said in [
        ("--pool H100", "unknown pool 'H100'; known pools: A100-80GB"),
        ("--gpus 3", "no node of A100-80GB has 3 GPUs (the largest has 2): ask --gpus 2"),
        ("--gpu-mem 100GB", "slice"),  # (this pool does not share: it takes no slice at all)
        ("--nodes 2 --gpus 2", "a gang of 1 GPU on each of 2 nodes cannot fit pool 'A100-80GB': only 1 of"),
        ("--fresh --pool H100", "unknown pool 'H100'"),  # a worker the cell would end anyway: not for a typo
    ]:
        out = kernel.run(f"%%gpu_train {flags}\nx = 1")
        assert "UsageError: " in text(out) and said in text(out), (flags, out)
        assert len(text(out).strip().splitlines()) == 1, out
        assert board(stack)[0] == "warm", flags
    out = warm_cell(kernel, "import os\nsame = (id(state) == sid, os.getpid() == pid)\nsame")
    assert text(out, "execute_result") == "(True, True)", out
    assert [x["id"] for x in api(stack, "GET", "/api/v1/leases")["leases"]] == [lease_id]
    kernel.run("%gpu_lease release")
    assert board(stack) == {0: "free", 1: "free"}


def test_a_cold_cell_finds_what_earlier_cells_imported_already_imported(stack, kernel):
    """The spares import the installed packages earlier GPU cells imported (torch, say): a cold
    cell then pays only for its own work."""
    warm_cell(kernel, "import sys\nbefore = 'jinja2' in sys.modules\nimport jinja2", flags="--gpus 1 --cold")
    assert text(kernel.run("print(before)")).strip() == "False"  # a fresh worker had not imported it
    warm_cell(kernel, "import sys\nhad = 'jinja2' in sys.modules", flags="--gpus 1 --cold")
    assert text(kernel.run("print(had)")).strip() == "True"


def test_a_warm_worker_that_died_while_warm_is_replaced_with_one_line(stack, kernel):
    pid = worker_pid(kernel)
    fd = os.pidfd_open(pid)
    os.kill(pid, signal.SIGKILL)  # the OOM killer, say, while the notebook plotted
    select.select([fd], [], [], 30)  # it has exited (the signal is asynchronous)
    os.close(fd)
    out = kernel.run("%%gpu_train --gpus 1\n2 * 21")
    assert not errors_of(out) and text(out, "execute_result") == "42", out
    shown = " ".join(" ".join(displays(out)).split())  # (a long note wraps at 80 columns)
    assert "ended 0s ago (its worker process exited" in shown and "this cell starts cold" in shown, shown
