"""Sweeps (gpu_map, %%gpu_sweep) against one `gpulease up` (real Ray, Redis, lease server; four
simulated GPUs): incremental allocation read from the server's event log, fair share against
another user's cell, the median stopping rule, Stop, the cell form; and the parts that need no
stack (search spaces, the table, the stopping rule)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from lease_server import errors
from lease_server.client import Client
from lease_server.procs import alive as _alive
from magics import report
from magics.outcomes import GpuTrainError, GpuTrainStopped
from magics.runner import Options, run_cell
from magics.session import Session
from magics.space import grid, loguniform, parse_over, randint, sample, uniform
from magics.sweep import MedianStopping, SweepDisplay, SweepResults, Trial, _Series, gpu_map, render_table
from tests.api_helpers import EventWatcher
from tests.conftest import Stack, Up, all_events, ray_session

ray = pytest.importorskip("ray")
# The trial functions below travel to the workers by value (the workers cannot import tests/).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

POOL = "A100-80GB"
QUIET = SweepDisplay(quiet=True)


# ---- functions the trials run (on the workers) ---------------------------------------------------


def square(config: dict[str, Any]) -> dict[str, Any]:

    t0 = time.time()
    i = config["i"]
    print(f"trial {i}")
    report(step=0, loss=1.0 / (i + 1))
    if i == 5:
        raise ValueError(f"bad config {i}")
    time.sleep(0.2)  # the trial's work
    report(step=1, loss=0.5 / (i + 1))
    gpus = os.environ["CUDA_VISIBLE_DEVICES"]
    return {"sq": i * i, "start": t0, "end": time.time(), "gpus": gpus, "pid": os.getpid()}


def hold(config: dict[str, Any]) -> int:
    """Write this worker's pid, then run until the test creates ``go`` (bounded)."""

    Path(config["pid"]).write_text(str(os.getpid()))
    deadline = time.time() + 60
    while not os.path.exists(config["go"]) and time.time() < deadline:
        time.sleep(0.01)  # a file the test creates: no event crosses into this process
    return int(config["i"])


def descend(config: dict[str, Any]) -> int:
    """Report a loss for ``steps`` steps; a slow trial takes ``pause`` seconds a step."""

    for step in range(config["steps"]):
        report(step=step, loss=config["base"] / (step + 1))
        time.sleep(config["pause"])
    return int(config["steps"])


# ---- the stack -----------------------------------------------------------------------------------


STACK = Stack.of("box=4xA100-80GB", GPULEASE_DEFAULT_TTL="3")  # conftest's `up`


@pytest.fixture(scope="module")
def sess(up: Up) -> Iterator[Session]:
    yield from ray_session(up, spares=4)  # as many as trials run at once: no sweep here changes it


def assert_all_free(c: Client) -> None:
    assert c.queue() == []
    assert int(c.cluster()["pools"][POOL]["free"]) == 4
    assert c.leases() == []


# ---- with the stack ------------------------------------------------------------------------------


def test_twelve_trials_on_four_gpus_come_back_in_order(sess, admin):
    configs = [{"i": i} for i in range(12)]
    results = gpu_map(square, configs, gpus=1, sess=sess, display=QUIET)

    assert isinstance(results, SweepResults) and [t.index for t in results] == list(range(12))
    assert [t.params for t in results] == configs
    assert [t.state for t in results] == ["done"] * 5 + ["failed"] + ["done"] * 6
    assert [t.value["sq"] for t in results if t.ok] == [i * i for i in range(12) if i != 5]
    # A failing trial does not stop the others; its remote traceback is in its record.
    bad = results[5]
    assert isinstance(bad.error, GpuTrainError) and "ValueError: bad config 5" in bad.traceback
    assert bad.output == "trial 5\n" and bad.metrics == [{"step": 0, "loss": 1 / 6}]
    # Output is kept per trial, not printed; metrics come back as a history.
    assert results[3].output == "trial 3\n"
    assert results[3].metrics == [{"step": 0, "loss": 0.25}, {"step": 1, "loss": 0.125}]
    assert all(t.gpu_seconds > 0 and t.run_s > 0 and t.wait_s >= 0 and t.verified for t in results)
    assert len({t.lease_id for t in results}) == 12
    rows = results.records()
    assert rows[3]["i"] == 3 and rows[3]["loss"] == 0.125 and rows[3]["state"] == "done" and rows[3]["steps"] == 2
    assert len(results.history()) == 23 and results.best("loss").index == 11  # type: ignore[union-attr]

    # The server's event log: every grant to a request that had to wait was made by the script
    # that released another trial's GPU (so the next trial starts on the release, not on a poll),
    # and never more than 4 of the sweep's leases were live at once.
    ids = {t.lease_id for t in results}
    log = all_events(admin)
    live = most = 0
    queued = {e["lease"] for e in log if e["type"] == "queued" and e.get("lease") in ids}
    assert queued, "12 trials on 4 GPUs: some had to wait"
    for k, e in enumerate(log):
        if e.get("lease") not in ids:
            continue
        if e["type"] == "grant":
            live += 1
            most = max(most, live)
            if e["lease"] in queued:
                before = log[k - 1]
                assert before["type"] == "released" and before["lease"] in ids and before["ts"] == e["ts"], (
                    before,
                    e,
                )
        elif e["type"] in ("released", "expired", "revoked"):
            live -= 1
    assert most <= 4 and live == 0
    # The workers' own clocks agree: at most 4 trials ran at once, each on its own GPU.
    spans = sorted((t.value["start"], t.value["end"]) for t in results if t.ok)
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 4
    assert all(t.value["gpus"] in {"0", "1", "2", "3"} for t in results if t.ok)

    # A trial that returned hands its GPU and its worker to the oldest queued trial (nobody else
    # waits): the server ended its lease and granted the next one in one step, and the next trial
    # ran in the same process on the same GPU. The failed trial's worker was not handed on.
    by_id = {t.lease_id: t for t in results}
    handed = [
        (by_id[e["lease"]], by_id[e["reason"].split()[2].rstrip(",")])
        for e in log
        if e["type"] == "released" and e.get("lease") in ids and e.get("reason", "").startswith("handed to ")
    ]
    assert handed, "no trial was handed the GPU and worker of the trial before it"
    for before, after in handed:
        assert before.ok and before is not after
        if after.ok:  # (a trial handed a worker may still fail: trial 5 raises)
            assert after.value["pid"] == before.value["pid"] and after.value["gpus"] == before.value["gpus"]
    assert all(b.index != 5 for b, _ in handed)
    pids = {t.value["pid"] for t in results if t.ok}
    assert len(pids) < 11
    # Once the sweep returns, no trial's process is left running.
    assert not [p for p in pids if _alive(p)]
    assert_all_free(admin)


def test_another_users_cell_is_served_before_the_sweeps_later_trials(sess, admin, up, tmp_path):
    bob_token = admin.request("POST", "/api/v1/tokens", json={"user": "bob", "role": "user"})["token"]
    me = admin.whoami()["user"]
    go = tmp_path / "go"
    configs = [{"i": i, "go": str(go), "pid": str(tmp_path / f"pid{i}")} for i in range(3)]
    watcher = EventWatcher(up.url, sess.defaults.token).start()
    bob = Session()
    bob.defaults.url, bob.defaults.token = up.url, bob_token
    bob.set_spares("box", 0)  # bob's one cell starts its own worker, and no spare after it
    bob_out: dict[str, Any] = {}

    def bobs_cell() -> None:
        try:
            bob_out["cell"] = run_cell("x = 6 * 7", {}, Options(gpus=1, wait=60), sess=bob)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            bob_out["error"] = exc

    def orchestrate() -> None:
        # 2 trials of 2 GPUs granted and 1 waiting in the queue; then bob's cell (1 GPU) joins the
        # queue; then the running trials end.
        def mine(kind: str, n: int) -> Any:
            return lambda e: sum(1 for x in watcher.events if x["type"] == kind and x.get("user") == me) >= n

        watcher.wait_for(mine("grant", 2), 60, "2 grants")
        watcher.wait_for(mine("queued", 1), 60, "a queued trial")
        cell = threading.Thread(target=bobs_cell)
        cell.start()
        bob_out["thread"] = cell
        watcher.wait_for(lambda e: e["type"] == "queued" and e.get("user") == "bob", 60, "bob queued")
        go.write_text("go")

    t = threading.Thread(target=orchestrate)
    t.start()
    results = gpu_map(hold, configs, gpus=2, sess=sess, display=QUIET)
    t.join(60)
    bob_out["thread"].join(60)
    try:
        assert "error" not in bob_out, bob_out.get("error")
        assert bob_out["cell"].names == {"x": 42}
        assert [r.value for r in results] == list(range(3))
        # Fair share: once bob waits, the next GPU released goes to bob, before the trial that
        # had been waiting longer.
        ids = {r.lease_id for r in results}
        log = all_events(admin)
        k_bob = next(k for k, e in enumerate(log) if e["type"] == "queued" and e.get("user") == "bob")
        grants_after = [e for e in log[k_bob:] if e["type"] == "grant"]
        assert grants_after[0]["user"] == "bob", grants_after
        assert sum(1 for e in grants_after if e.get("lease") in ids) == 1
    finally:
        bob.release_all()
        bob.reset_client()
    assert_all_free(admin)


def test_median_stopping_ends_a_clearly_losing_trial_early(sess, admin):
    good = [{"steps": 5, "base": 1.0, "pause": 0.0} for _ in range(3)]
    losing = {"steps": 600, "base": 50.0, "pause": 0.05}  # 30 s if nothing stopped it
    # One trial at a time: the losing trial reports after three finished ones (deterministic).
    results = gpu_map(
        descend,
        [*good, losing],
        max_parallel=1,
        early_stop="median",
        metric="loss",
        sess=sess,
        display=QUIET,
    )
    assert [t.state for t in results] == ["done", "done", "done", "stopped early"]
    loser = results[3]
    assert loser.value is None and loser.error is None and loser.verified
    assert 3 <= len(loser.metrics) < 600 and loser.metrics[0] == {"step": 0, "loss": 50.0}
    assert [len(t.metrics) for t in results[:3]] == [5, 5, 5]
    lease = admin.get(loser.lease_id)
    assert lease["state"] == "released"  # its GPU went back at once, not at the end of its 600 steps
    assert_all_free(admin)


def test_stop_withdraws_queued_trials_and_stops_running_ones(sess, admin, up, tmp_path):
    me = admin.whoami()["user"]
    configs = [{"i": i, "go": str(tmp_path / "never"), "pid": str(tmp_path / f"pid{i}")} for i in range(4)]
    watcher = EventWatcher(up.url, sess.defaults.token).start()
    main = threading.get_ident()

    def stop_when_busy() -> None:
        watcher.wait_for(
            lambda e: sum(1 for x in watcher.events if x["type"] == "queued" and x.get("user") == me) >= 2,
            60,
            "2 queued trials",
        )
        pids = [tmp_path / f"pid{i}" for i in range(4)]
        while sum(1 for p in pids if p.exists() and p.read_text()) < 2:
            threading.Event().wait(0.01)  # the workers' pid files: no event crosses processes
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=stop_when_busy)
    t.start()
    with pytest.raises(GpuTrainStopped) as err:
        gpu_map(hold, configs, gpus=2, sess=sess, display=QUIET)
    t.join(30)
    line = err.value._render_traceback_()
    assert len(line) == 1 and line[0].startswith("KeyboardInterrupt: gpu_sweep: stopped: 2 stopped, 2 withdrawn;")
    assert line[0].endswith("every lease released")
    results = err.value.results  # type: ignore[attr-defined]
    assert sorted(r.state for r in results) == ["stopped"] * 2 + ["withdrawn"] * 2
    # Nothing left queued on the server, no lease live, no worker running.
    assert_all_free(admin)
    for r in results:
        if r.state == "stopped":
            pid = int((tmp_path / f"pid{r.index}").read_text())
            assert not _alive(pid)
            assert admin.get(r.lease_id)["state"] == "released"
        else:
            assert not r.lease_id and not (tmp_path / f"pid{r.index}").exists()


def test_the_gpu_sweep_cell(sess, admin, monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    from magics.magic import GpuMagics

    monkeypatch.setattr(sys.modules["magics.session"], "_session", sess)
    ip = InteractiveShell.instance()
    try:
        ip.register_magics(GpuMagics(ip))
        ip.user_ns.update(scale=10, sizes=[3])
        ok = ip.run_cell('%%gpu_sweep --over "x=[1, 2]; y=sizes" --gpus 1\nprint(x, y)\nx * scale + y')
        ok.raise_error()
        results = ip.user_ns["results"]
        assert [t.params for t in results] == [{"x": 1, "y": 3}, {"x": 2, "y": 3}]
        assert [t.value for t in results] == [13, 23]
        assert results[1].output == "2 3\n" and "x" not in ip.user_ns
        ok = ip.run_cell(
            '%%gpu_sweep --over "lr=loguniform(1e-4, 1e-1); b=randint(1, 3)" --samples 2 --seed 3 --as draws'
            " --out z\nz = lr * b\n"
        )
        ok.raise_error()
        draws = ip.user_ns["draws"]
        assert [t.params for t in draws] == sample(2, seed=3, lr=loguniform(1e-4, 1e-1), b=randint(1, 3))
        assert [t.names["z"] for t in draws] == [t.params["lr"] * t.params["b"] for t in draws]
        with pytest.raises(UsageError, match="--over names y, which the cell never reads"):
            ip.run_cell_magic("gpu_sweep", '--over "x=[1]; y=[2]"', "x")
        with pytest.raises(UsageError, match="a grid cannot list"):
            ip.run_cell_magic("gpu_sweep", '--over "x=uniform(0, 1)"', "x")
    finally:
        InteractiveShell.clear_instance()
    assert_all_free(admin)


# ---- without a stack -----------------------------------------------------------------------------


def test_search_spaces():
    assert grid(lr=[1e-3, 1e-2], batch=[32, 64]) == [
        {"lr": 1e-3, "batch": 32},
        {"lr": 1e-3, "batch": 64},
        {"lr": 1e-2, "batch": 32},
        {"lr": 1e-2, "batch": 64},
    ]
    assert grid(opt="adam", n=range(2)) == [{"opt": "adam", "n": 0}, {"opt": "adam", "n": 1}]
    space = parse_over('lr=[1e-3, 3e-3, 1e-2]; batch=[32, 64]; name="a;b"', {})
    assert space == {"lr": [1e-3, 3e-3, 1e-2], "batch": [32, 64], "name": "a;b"}
    assert len(grid(**space)) == 6
    drawn = sample(50, seed=1, lr=loguniform(1e-4, 1e-1), drop=uniform(0, 0.5), n=randint(1, 3), opt=["a", "b"])
    assert drawn == sample(50, seed=1, lr=loguniform(1e-4, 1e-1), drop=uniform(0, 0.5), n=randint(1, 3), opt=["a", "b"])
    assert all(1e-4 <= d["lr"] <= 1e-1 and 0 <= d["drop"] <= 0.5 and d["n"] in (1, 2, 3) for d in drawn)
    assert {d["opt"] for d in drawn} == {"a", "b"} and {d["n"] for d in drawn} == {1, 2, 3}
    assert parse_over("lr=lrs", {"lrs": (1, 2)}) == {"lr": (1, 2)}
    for bad, msg in [
        ("lr", "cannot read"),
        ("lr=[1]; lr=[2]", "twice"),
        ("lr=nope", "NameError"),
        ("", "at least one"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_over(bad, {})
    with pytest.raises(ValueError, match="a grid cannot list"):
        grid(lr=loguniform(1e-4, 1e-1))
    with pytest.raises(ValueError, match="needs 0 < low < high"):
        loguniform(0, 1)


def test_the_table_fits_80_columns_and_names_failures():
    t = [
        Trial(0, {"lr": 0.001, "batch": 32}, "done", run_s=12.3, metrics=[{"step": 99, "loss": 0.2134567}]),
        Trial(1, {"lr": 0.003, "batch": 64, "optimizer": "adamw-with-a-very-long-name"}, "running", where="box GPU 2"),
        Trial(2, {"lr": 0.01, "batch": 32}, "queued", position=3),
        Trial(3, {"lr": 0.01, "batch": 64}, "stopped early", run_s=3.2, metrics=[{"step": 4, "loss": 9.0, "acc": 0.1}]),
        Trial(
            4,
            {"lr": 0.1},
            "failed",
            error=GpuTrainError("ValueError: bad batch (on box, GPU 1)", "tb", "box", "ValueError"),
        ),
        Trial(
            5,
            {"lr": 0.2},
            "failed",
            # as the server refuses a request whose wait ran out (lease.py), in the API's words
            error=errors.NoCapacity(
                "1 GPU was not free in pool 'A100-80GB' within 600s (position 2 in the queue); "
                "pass a longer wait (seconds) or ask for fewer GPUs",
                pool="A100-80GB",
                position=2,
                gpus=1,
                wait_s=600.0,
            ),
        ),
    ]
    text = render_table(t, "gpu_sweep: 6 trials x 1 GPU of A100-80GB: 1 running, 1 queued, 1 done - 41.0s")
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert lines[1].split() == ["#", "parameters", "state", "elapsed", "last", "metrics"]
    assert "done" in lines[2] and "12.3s" in lines[2] and "step 99 loss=0.2135" in lines[2]
    assert "running box GPU 2" in lines[3] and "queued, 3rd" in lines[4] and "stopped early" in lines[5]
    assert "failed: ValueError" in lines[6] and "gave up waiting" in lines[7]
    assert lines[-2] == "  trial 4: ValueError: bad batch (on box, GPU 1)"
    # in the words of the sweep's own --wait, not the API's "wait (seconds)"
    assert lines[-1] == "  trial 5: gave up after --wait 10m, still 2nd in line for 1 GPU of A100-80GB"
    r = SweepResults(t)
    assert repr(r).startswith("gpu_sweep: 6 trials: 1 done, 1 stopped early, 2 failed, 1 running, 1 queued;")


def test_the_live_table_is_one_display_updated_in_place():
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    class Recorder(DisplayPublisher):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, str, bool]] = []

        def publish(self, data, metadata=None, source=None, *, transient=None, update=False):  # type: ignore[no-untyped-def]
            self.calls.append((data["text/plain"], (transient or {}).get("display_id"), update))

    ip = InteractiveShell.instance()
    try:
        ip.display_pub = Recorder()
        d = SweepDisplay(live=True)
        for text in ("queued", "running", "done"):
            d.show(text, final=text == "done")
        calls = ip.display_pub.calls
        assert [c[0] for c in calls] == ["queued", "running", "done"]
        assert len({c[1] for c in calls}) == 1 and calls[0][1]  # one display id
        assert [c[2] for c in calls] == [False, True, True]  # then updated in place
    finally:
        InteractiveShell.clear_instance()


def test_the_median_stopping_rule():
    rule = MedianStopping("loss", "min", min_steps=2, min_trials=2)

    def series(values: list[float], sign: float = 1.0) -> _Series:
        s = _Series(sign)
        for step, v in enumerate(values):
            s.add(step, v)
        return s

    peers = {1: series([1.0, 0.5, 0.3]), 2: series([2.0, 1.0])}
    assert rule.should_stop(0, {0: series([5.0, 4.0]), **peers}, finished=set())
    assert not rule.should_stop(0, {0: series([5.0]), **peers}, finished=set())  # before min_steps
    assert not rule.should_stop(0, {0: series([1.0, 0.4]), **peers}, finished=set())  # better than the median
    # A peer that has not reached the step (and has not finished) does not count.
    assert not rule.should_stop(0, {0: series([5.0, 4.0, 3.0]), **peers}, finished=set())
    assert rule.should_stop(0, {0: series([5.0, 4.0, 3.0]), **peers}, finished={2})
    up = MedianStopping("acc", "max", min_steps=2, min_trials=2)
    assert up.should_stop(0, {0: series([0.1, 0.2], -1), 1: series([0.5, 0.7], -1), 2: series([0.6, 0.8], -1)}, set())
    with pytest.raises(ValueError, match="early_stop='median' needs metric"):
        gpu_map(len, [1], early_stop="median", display=QUIET)
