"""%%gpu_train in a real kernel (the CPU-only kernelspec) against `gpulease up` with a real Ray
head, Redis and lease server; the GPUs are simulated."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from tests.api_helpers import EventWatcher
from tests.conftest import Stack, Up

TTL = "3"  # seconds: short, so that a dead kernel's lease runs out quickly


def kernel_stack(simulate: str, **env: str) -> Stack:
    """`gpulease up` with short TTL and sweep, and the gpulease kernelspec on its JUPYTER_PATH."""
    # Warm cells (a finished cell's worker kept for the next) are tested in tests/test_warm_cells.py;
    # these tests are of the cold path, where every cell releases its GPUs as it ends.
    env = {"GPULEASE_WARM": "off", "GPULEASE_DEFAULT_TTL": TTL, "GPULEASE_SWEEP_INTERVAL": "0.2", **env}
    return Stack.of(simulate, kernels=True, **env)


STACK = kernel_stack("box=2xA100-80GB,cpu=2xCPU", GPULEASE_BORROW_NOTICE="4")  # conftest's `up`


@pytest.fixture(scope="module")
def stack(up: Up) -> Up:
    return up  # the module's `gpulease up` (conftest's `up` of STACK), by the name its tests use


def api(up: Up, method: str, path: str, token: str | None = None, **kw: Any) -> Any:
    token = token or (up.data / "token").read_text().strip()
    r = httpx.request(method, up.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=10, **kw)
    return r.json()


def free_gpus(up: Up) -> int:
    return int(api(up, "GET", "/api/v1/cluster")["pools"]["A100-80GB"]["free"])


class Kernel:
    """A kernel of the gpulease kernelspec, driven message by message."""

    def __init__(self, up: Up, **env: str) -> None:
        ksm = KernelSpecManager(kernel_dirs=[up.env["JUPYTER_PATH"] + "/kernels"])
        self.km = KernelManager(kernel_name="gpulease", kernel_spec_manager=ksm)
        self.km.start_kernel(env={**up.env, **env})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def start(self, code: str) -> str:
        return self.kc.execute(code)

    def outputs(
        self, msg_id: str, timeout: float = 120, until: str | None = None, until_shown: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Collect iopub output of ``msg_id`` until the kernel is idle (or ``until`` appears in a
        stream, or ``until_shown`` in the cell's status line). Returns (outputs, finished)."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                return out, True
            if kind in ("stream", "error", "execute_result", "display_data", "update_display_data"):
                out.append({"type": kind, **content})
                if until and kind == "stream" and until in content["text"]:
                    return out, False
                if until_shown and "display" in kind and until_shown in content["data"].get("text/plain", ""):
                    return out, False
        raise AssertionError(f"no idle status within {timeout}s; got {out}")

    def run(self, code: str, timeout: float = 120) -> list[dict[str, Any]]:
        return self.outputs(self.start(code), timeout)[0]

    def reply(self, msg_id: str, timeout: float = 30) -> dict[str, Any]:
        """The cell's execute_reply: "error" stops the cells queued after it (Run All)."""
        while True:
            msg = self.kc.get_shell_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") == msg_id:
                return dict(msg["content"])

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def text(outputs: list[dict[str, Any]], kind: str = "stream") -> str:
    parts = []
    for o in outputs:
        if o["type"] == kind == "stream":
            parts.append(o["text"])
        elif o["type"] == kind == "error":
            parts.append("\n".join(o["traceback"]))
        elif o["type"] == kind:
            parts.append(o.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def errors_of(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in outputs if o["type"] == "error"]


@pytest.fixture
def kernel(stack: Up) -> Iterator[Kernel]:
    k = Kernel(stack)
    yield k
    k.shutdown()


def test_kernel_is_cpu_only_and_the_cell_sees_exactly_its_lease(stack, kernel):
    out = kernel.run("import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))")
    assert text(out).strip() == "''"
    kernel.run("scale = 3")
    out = kernel.run(
        "%%gpu_train --gpus 2\n"
        "import os\n"
        "seen = os.environ['CUDA_VISIBLE_DEVICES']\n"
        "lease_id = os.environ['GPULEASE_LEASE_ID']\n"
        "uuids = os.environ['GPULEASE_GPU_UUIDS']\n"
        "import ray\n"
        "boot = ray.get_runtime_context().runtime_env.get('env_vars'), os.environ['PYTHONPATH'].split(':')[0]\n"
        "for epoch in range(3):\n"
        "    print('epoch', epoch, flush=True)\n"
        "losses = [epoch * scale for epoch in range(4)]\n"
        "len(losses)\n"
    )
    assert not errors_of(out), out
    assert "epoch 0\nepoch 1\nepoch 2\n" in text(out)
    line = status(out)  # the success line is a display, not stderr (no pink background)
    assert line.startswith("gpu_train: held 2 GPUs on box (GPU 0,1) for ") and "released; GPU memory freed" in line
    assert not [o for o in out if o["type"] == "stream" and o["name"] == "stderr"], out
    assert any("running on box GPU 0,1" in t for t in displays(out)), out
    assert text(out, "execute_result") == "4"
    out = kernel.run("print(seen, losses, uuids)")
    assert text(out).strip() == "0,1 [0, 3, 6, 9] GPU-sim-box-0,GPU-sim-box-1"
    lease_id, count = text(kernel.run("print(lease_id, get_ipython().execution_count)")).split()
    lease = api(stack, "GET", f"/api/v1/leases/{lease_id}")
    assert lease["state"] == "released" and [g["index"] for g in lease["gpus"]] == [0, 1]
    # The lease names the cell as the notebook numbers it (In [n]): the board's tile says "cell n".
    assert lease["cell"] == str(int(count) - 2), (lease, count)
    assert free_gpus(stack) == 2
    # The head that `gpulease up` starts gives its workers the kernel's worker PYTHONPATH (with
    # magics/_boot first): they start without a runtime environment, for a quarter of the CPU.
    env_vars, first = text(kernel.run("print(*boot, sep='|')")).strip().split("|")
    assert env_vars == "None" and first.endswith(os.path.join("magics", "_boot")), (env_vars, first)


def test_line_form_and_out_names(stack, kernel):
    kernel.run("def double(x):\n    return 2 * x")
    out = kernel.run("%gpu_train double(21)")
    assert text(out, "execute_result") == "42", out
    out = kernel.run("%%gpu_train --out b\na = 1\nb = 2")
    assert not errors_of(out)
    assert text(kernel.run("print('a' in globals(), b)")).strip() == "False 2"


def test_exception_releases_and_shows_the_remote_traceback_once(stack, kernel):
    out = kernel.run("%%gpu_train\nx = 1\nraise ValueError('bad batch')")
    (err,) = errors_of(out)
    assert err["ename"] == "GpuTrainError"
    tb = "\n".join(err["traceback"])
    assert tb.count("ValueError: bad batch") == 1, tb  # the remote traceback once, its last line once
    assert "traceback from the worker on node box" in tb and 'File "<gpu_train cell>", line 2' in tb
    assert tb.count("raise ValueError('bad batch')") == 1
    assert "released; GPU memory freed" in status(out) and "failed after" in status(out)
    assert free_gpus(stack) == 2
    assert text(kernel.run("print('usable')")).strip() == "usable"


def said_once(out: list[dict[str, Any]], reply: dict[str, Any], ename: str) -> list[str]:
    """An expected end (Stop, --timeout, a lease someone else ended) is the cell's own closing
    line, once: no error output repeats it, every line fits 80 columns, and the kernel still
    answers the cell as failed (Run All stops there). Returns every line the cell showed."""
    assert not errors_of(out), errors_of(out)
    assert reply["status"] == "error" and reply["ename"] == ename, reply
    shown = [*status(out).splitlines(), *text(out).splitlines()]
    assert all(len(line) <= 80 for line in shown), [line for line in shown if len(line) > 80]
    assert not any(frag in line for line in shown for frag in FRAMES), shown
    closing = status(out).splitlines()[0]
    assert sum(closing in line for line in shown) == 1, shown
    return shown


def test_timeout_stops_the_call_and_releases(stack, kernel):
    msg_id = kernel.start("%%gpu_train --timeout 1s\nimport time\nprint('start', flush=True)\ntime.sleep(60)")
    out = kernel.outputs(msg_id)[0]
    said_once(out, kernel.reply(msg_id), "GpuTrainTimeout")
    # the limit as given, beside the time held (which also counts the worker's start)
    assert status(out).startswith("gpu_train: stopped by --timeout 1s (held "), status(out)
    assert free_gpus(stack) == 2
    assert text(kernel.run("print('usable')")).strip() == "usable"


def test_a_cell_that_waits_out_its_wait_says_it_once_in_its_own_flags(stack, kernel):
    """The cell's line says how long it waited, where it stood and what to change, in the cell's
    flags (not the API's "wait (seconds)"); the error under it is that line's first half, once."""
    held = api(stack, "POST", "/api/v1/leases", json={"gpus": 2, "ttl": 60})
    try:
        out = kernel.run("%%gpu_train --wait 2s\nx = 1")
    finally:
        api(stack, "DELETE", f"/api/v1/leases/{held['id']}")
    gave_up = "gave up after --wait 2s, still 1st in line for 1 GPU of A100-80GB"
    assert status(out) == f"gpu_train: {gave_up}\n  a longer --wait waits more, or ask for fewer GPUs", out
    assert text(out).strip() == f"UsageError: {gave_up}", out
    assert not errors_of(out) and free_gpus(stack) == 2


def test_stop_while_queued_says_it_once(stack, kernel):
    """Stop on a queued cell: its line says the request was withdrawn, and nothing repeats it (a
    pink KeyboardInterrupt under it said the same)."""
    held = api(stack, "POST", "/api/v1/leases", json={"gpus": 2, "ttl": 60})
    try:
        msg_id = kernel.start("%%gpu_train\nx = 1")
        first, _ = kernel.outputs(msg_id, until_shown="1st in line", timeout=60)
        kernel.km.interrupt_kernel()
        rest, finished = kernel.outputs(msg_id, timeout=30)
        assert finished
        said_once(first + rest, kernel.reply(msg_id), "GpuTrainStopped")
        assert status(rest) == "gpu_train: stopped while queued; the request was withdrawn"
    finally:
        api(stack, "DELETE", f"/api/v1/leases/{held['id']}")
    assert free_gpus(stack) == 2


def test_interrupt_cancels_the_worker_and_releases(stack, kernel):
    msg_id = kernel.start("%%gpu_train\nimport time\nprint('training', flush=True)\ntime.sleep(60)")
    first, finished = kernel.outputs(msg_id, until="training")
    assert not finished and free_gpus(stack) == 1
    kernel.km.interrupt_kernel()
    rest, finished = kernel.outputs(msg_id, timeout=30)
    assert finished
    shown_lines = said_once(first + rest, kernel.reply(msg_id), "GpuTrainStopped")
    assert len(shown_lines) <= 3, shown_lines  # 'training', the closing line (two where 80 columns need)
    assert status(first + rest).startswith("gpu_train: stopped after")
    assert free_gpus(stack) == 2
    assert text(kernel.run("print('usable')")).strip() == "usable"


def test_usage_errors_are_one_clear_line(stack, kernel):
    for line, expect in [
        ("%gpu_train --bogus x()", "unrecognized arguments"),
        ("%%gpu_train --gpus 3-1\nx = 1", "MIN-MAX"),
        ("%%gpu_train --gpus 3\nx = 1", "A100-80GB has 3 GPUs (the largest has 2): ask --gpus 2"),
        ("%%gpu_train --pool H100\nx = 1", "unknown pool 'H100'"),
        ("%%gpu_train --timeout soon\nx = 1", "--timeout: cannot read duration"),
    ]:
        out = kernel.run(line)
        assert "UsageError: " in text(out) and expect in text(out), (line, out)
        assert len(text(out).strip().splitlines()) == 1, out
    assert free_gpus(stack) == 2


def test_a_refused_priority_is_one_clear_line(stack):
    """A 403 for the request (here --priority high from a user the server's high_priority does
    not name) is the refusal's words, within 80 columns, not a traceback."""
    bob = api(stack, "POST", "/api/v1/tokens", json={"user": "bob"})["token"]
    k = Kernel(stack, GPULEASE_TOKEN=bob)
    try:
        out = text(k.run("%%gpu_train --priority high\nx = 1"))
        assert out.startswith("UsageError: priority high is for admins only (high_priority names no one)"), out
        assert len(out.strip().splitlines()) <= 2 and all(len(line) <= 80 for line in out.splitlines()), out
    finally:
        k.shutdown()
    assert free_gpus(stack) == 2


def test_no_lease_server_is_a_usage_error(stack):
    k = Kernel(stack, GPULEASE_URL="http://127.0.0.1:9", GPULEASE_TOKEN="x")
    try:
        out = text(k.run("%%gpu_train\nx = 1"))
        assert out.startswith("UsageError: cannot reach the lease server") and len(out.strip().splitlines()) == 1
    finally:
        k.shutdown()


def test_two_notebooks_contend_for_one_gpu(stack, tmp_path):
    first, second = Kernel(stack), Kernel(stack)
    done = tmp_path / "first-may-end"  # the first cell holds its GPUs until the second is seen queued
    try:
        m1 = first.start(
            "%%gpu_train --gpus 2 --timeout 5m\nimport os, time\nprint('first running', flush=True)\n"
            f"while not os.path.exists({str(done)!r}):\n    time.sleep(0.05)\nwho = 'first'"
        )
        first.outputs(m1, until="first running")
        m2 = second.start("%%gpu_train --gpus 1\nwho = 'second'\nprint('second running', flush=True)")
        queued, _ = second.outputs(m2, until_shown="1st in line", timeout=60)
        time.sleep(1.0)  # not to synchronise: a wait under 1 s is not shown, and the line's is checked
        done.touch()
        out2, _ = second.outputs(m2, until="second running", timeout=60)
        waits = [o for o in queued + out2 if o["type"] in ("display_data", "update_display_data")]
        assert any("(waited " in o["data"]["text/plain"] for o in waits), out2  # how long it waited
        # why it waits: the first notebook (the same user: "you") holds both, ending by its --timeout
        # (5 min and its worker's start, declared at the acquire), in 80 columns
        lines = [o["data"]["text/plain"] for o in waits if "1st in line" in o["data"]["text/plain"]]
        why = [t.splitlines()[1] for t in lines if len(t.splitlines()) > 1]
        assert why and why[0].startswith("  held by you (2 GPUs, ends in ~5 min)"), lines
        assert all(len(line) <= 80 for t in lines for line in t.splitlines()), lines
        out1, done1 = first.outputs(m1, timeout=60)
        assert done1 and not errors_of(out1)
        rest2, done2 = second.outputs(m2, timeout=60)
        assert done2 and not errors_of(rest2)
        assert text(first.run("print(who)")).strip() == "first"
        assert text(second.run("print(who)")).strip() == "second"
        events = api(stack, "GET", "/api/v1/events/log?limit=10000")["events"]
        grants = [e for e in events if e["type"] == "grant"]
        assert grants[-1]["waited_ms"] > 0  # the second waited for the first
    finally:
        first.shutdown()
        second.shutdown()
    assert free_gpus(stack) == 2


def test_killed_kernel_frees_its_gpus_and_its_worker_stops(stack):
    k = Kernel(stack)
    msg_id = k.start("%%gpu_train\nimport os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)")
    out, _ = k.outputs(msg_id, until="pid")
    worker_pid = int(text(out).split("pid")[1].split()[0])
    lease = api(stack, "GET", "/api/v1/leases?all=true")["leases"][0]
    headers = {"Authorization": f"Bearer {(stack.data / 'token').read_text().strip()}"}
    # Follow the event stream from before the kill: the sweeper's "expired" event ends the wait.
    with httpx.stream("GET", f"{stack.url}/api/v1/events", headers=headers, timeout=httpx.Timeout(5, read=30)) as s:
        lines = s.iter_lines()
        next(lines)  # the stream's opening comment: we are subscribed
        os.kill(k.km.provisioner.process.pid, signal.SIGKILL)  # the kernel dies: nobody releases
        k.kc.stop_channels()
        for line in lines:
            if line.startswith("data:") and lease["id"] in line and '"expired"' in line:
                break
        ended = api(stack, "GET", f"/api/v1/leases/{lease['id']}")
        # Ended within TTL + 1 s of the last renewal: the final deadline plus at most one sweep.
        assert ended["state"] == "expired" and ended["ended_at"] <= ended["expires_at"] + 1.0
        # Its GPU drains: free once the node agent sees the worker the kernel named gone (Ray ends
        # the actors of a dead driver, the watchdog backs it up, the agent ends what remains).
        for line in lines:
            if line.startswith("data:") and lease["id"] in line and '"drained"' in line:
                break
        gone_when_free = not _alive(worker_pid)
    assert gone_when_free, "the GPU was free again while the orphaned worker still ran"
    assert free_gpus(stack) == 2


def test_revoke_stops_the_worker_and_the_cell_says_why(stack, kernel):
    msg_id = kernel.start("%%gpu_train\nimport time\nprint('training', flush=True)\ntime.sleep(120)")
    kernel.outputs(msg_id, until="training")
    lease = api(stack, "GET", "/api/v1/leases?all=true")["leases"][0]
    watcher = EventWatcher(stack.url, (stack.data / "token").read_text().strip()).start()
    revoked_at = time.monotonic()
    api(stack, "POST", f"/api/v1/leases/{lease['id']}/revoke", json={"reason": "maintenance"})
    out, finished = kernel.outputs(msg_id, timeout=30)
    assert finished and time.monotonic() - revoked_at < 60  # by the revoke, not the 120 s sleep
    reply = kernel.reply(msg_id)
    said_once(out, reply, "GpuLeaseEnded")
    assert reply["evalue"].startswith("revoked by ") and reply["evalue"].endswith(": maintenance"), reply
    assert status(out).startswith("gpu_train: revoked by ") and "maintenance" in status(out)
    assert not any(w in text(out) + status(out) for w in ("worker died", "Ray", "SIGSEGV")), out
    # A revoke drains: the GPU is free once the node agent saw the worker gone.
    watcher.wait_for(lambda e: e["type"] == "drained" and e.get("lease") == lease["id"], 30, "drained")
    assert free_gpus(stack) == 2


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs: not gone, not a zombie (Z) and not dead while being reaped (X).
    The state follows the command name, which may hold spaces and parentheses ("ray::IDLE")."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_example_notebook_runs_end_to_end(stack):
    import nbformat
    from nbclient import NotebookClient

    path = __import__("pathlib").Path(__file__).parent.parent / "examples" / "train_then_plot.ipynb"
    nb = nbformat.read(path, as_version=4)
    ksm = KernelSpecManager(kernel_dirs=[stack.env["JUPYTER_PATH"] + "/kernels"])
    km = KernelManager(kernel_name="gpulease", kernel_spec_manager=ksm)
    old = dict(os.environ)
    os.environ.update(stack.env)  # the kernel inherits GPULEASE_HOME from here
    try:
        NotebookClient(nb, km=km, timeout=300).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    streams = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "training on cpu with CUDA_VISIBLE_DEVICES = '0'" in streams
    shown_ = "".join(o.get("data", {}).get("text/plain", "") for o in outputs if o.output_type == "display_data")
    assert "epoch   0" in streams and "released; GPU memory freed" in shown_ and "final loss" in streams
    assert any("image/png" in o.get("data", {}) for o in outputs if o.output_type == "display_data")
    assert free_gpus(stack) == 2


def test_worker_crash_shows_rays_error_and_releases(stack, kernel):
    out = kernel.run("%%gpu_train\nimport os\nprint('about to crash', flush=True)\nos._exit(3)")
    (err,) = errors_of(out)
    assert err["ename"] == "GpuTrainError" and "exited unexpectedly" in err["evalue"]
    assert "released" in status(out)
    assert free_gpus(stack) == 2
    assert text(kernel.run("print('usable')")).strip() == "usable"


def test_kernel_shutdown_releases_at_once(stack):
    k = Kernel(stack)
    msg_id = k.start("%%gpu_train\nimport time\nprint('training', flush=True)\ntime.sleep(120)")
    k.outputs(msg_id, until="training")
    (lease,) = api(stack, "GET", "/api/v1/leases?all=true")["leases"]
    k.kc.stop_channels()
    k.km.shutdown_kernel(now=False)  # a polite shutdown: the kernel's exit hook releases
    ended = api(stack, "GET", f"/api/v1/leases/{lease['id']}")
    assert ended["state"] == "released", ended  # released by the hook, not expired by the TTL
    assert free_gpus(stack) == 2


def test_recalled_call_checkpoints_and_resumes(stack, kernel):
    """bob books the whole box; the notebook's call runs on borrowed GPUs; when bob asks for them
    the call's on_preempt hook saves its state, the loop stops, and --resume continues from it."""
    admin = (stack.data / "token").read_text().strip()
    bob = api(stack, "POST", "/api/v1/tokens", json={"user": "bob"})["token"]
    now = time.time()
    booking = api(
        stack,
        "POST",
        "/api/v1/bookings",
        bob,
        json={"pool": "A100-80GB", "gpus": 2, "start": now - 1, "end": now + 3600},
    )
    try:
        code = (
            "%%gpu_train --gpus 1\n"
            "import time, magics\n"
            "state = {'step': resume_state['step'] if resume_state else 0}\n"
            "magics.on_preempt(lambda: dict(state))\n"
            "print('training', flush=True)\n"
            "while not magics.preempted():\n"
            "    state['step'] += 1\n"
            "    time.sleep(0.01)\n"
            "steps = state['step']"
        )
        msg_id = kernel.start(code)
        out, _ = kernel.outputs(msg_id, until="training")
        assert "borrowed from a booking" in shown(out)
        got: dict[str, Any] = {}
        asker = threading.Thread(
            target=lambda: got.update(api(stack, "POST", "/api/v1/leases", bob, json={"gpus": 2, "wait": 30}))
        )
        asker.start()
        out, finished = kernel.outputs(msg_id, timeout=60)
        asker.join(30)
        assert finished and not errors_of(out), out
        said = text(out)
        assert "these GPUs are recalled" in said and "checkpoint saved" in status(out)
        assert got["user"] == "bob" and got["reservation"] == booking["id"]
        api(stack, "DELETE", f"/api/v1/leases/{got['id']}", bob)
        out = kernel.run("print(gpu_checkpoint['step'] > 0, gpu_checkpoint['step'] <= steps)")
        assert text(out).strip() == "True True"
        out = kernel.run("%%gpu_train --resume\nstarted_at = resume_state['step']\n")
        assert not errors_of(out)
        assert text(kernel.run("print(started_at == gpu_checkpoint['step'])")).strip() == "True"
    finally:
        api(stack, "DELETE", f"/api/v1/bookings/{booking['id']}", bob)
    assert admin


def test_cpu_worker_and_elastic_gpus(stack, kernel):
    out = kernel.run(
        "%%gpu_train --gpus 0\nimport os\nseen = (os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GPULEASE_NODE'])\n"
    )
    assert not errors_of(out) and "a CPU slot of cpu" in status(out), out
    # --gpus 0 leased a slot of the CPU pool: it ran on that node, with no GPU, and is in the ledger
    assert text(kernel.run("print(seen)")).strip() == "('', 'cpu')"
    by_pool = {r["pool"]: r for r in api(stack, "GET", "/api/v1/usage?by=pool")["rows"]}
    assert by_pool["CPU"]["calls"] >= 1
    out = kernel.run("%%gpu_train --gpus 1-4\nimport os\nn = len(os.environ['CUDA_VISIBLE_DEVICES'].split(','))\n")
    assert not errors_of(out) and "2 of 1-4 asked" in shown(out), out
    assert text(kernel.run("print(n)")).strip() == "2"
    out = kernel.run("%%gpu_train --resume\n1")
    assert "UsageError: " in text(out) and "no gpu_checkpoint" in text(out), out


def shown(outputs: list[dict[str, Any]]) -> str:
    """The status line(s) the magic displays and updates in place."""
    return "\n".join(
        o.get("data", {}).get("text/plain", "") for o in outputs if o["type"] in ("display_data", "update_display_data")
    )


FRAMES = ("magics/", "lease_server/", "ray/", "Traceback", "site-packages")


def displays(outputs: list[dict[str, Any]]) -> list[str]:
    """Every state the cell's status line went through, in order."""
    return [o["data"]["text/plain"] for o in outputs if o["type"] in ("display_data", "update_display_data")]


def status(outputs: list[dict[str, Any]]) -> str:
    """The cell's status line as it stands at the end."""
    seen = displays(outputs)
    return seen[-1] if seen else ""


def test_a_plain_kernel_says_which_kernel_runs_gpu_cells(tmp_path):
    """The plain "Python 3 (ipykernel)" card comes first in a launcher without gpulease up's
    config: %%gpu_train there said only "Cell magic not found". Every kernel of the environment
    now answers with the kernel to pick, or the line that loads the magics (magics/hint.py, from
    etc/ipython), and %load_ext magics still brings the real ones."""
    import sys

    spec_dir = Path(sys.prefix) / "share" / "jupyter" / "kernels"
    assert (Path(sys.prefix) / "etc" / "ipython" / "ipython_kernel_config.py").exists(), "installed with the wheel"
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir)]))
    km.start_kernel(cwd=str(tmp_path), env={k: v for k, v in os.environ.items() if not k.startswith("GPULEASE_")})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        reply = kc.execute_interactive("%%gpu_train\nx = 1", timeout=60, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "error", reply["content"]
        said = reply["content"]["evalue"]
        assert "Change Kernel > 'Python 3 (gpulease)'" in said and "%load_ext magics" in said, said
        assert all(len(line) <= 80 for line in f"UsageError: {said}".splitlines()), said
        loaded = kc.execute_interactive("%load_ext magics\n%lsmagic", timeout=60, output_hook=lambda msg: None)
        assert loaded["content"]["status"] == "ok", loaded["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
