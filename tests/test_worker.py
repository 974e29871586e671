"""The worker process's side of a recall, in this process: a loop that stops on ``preempted()``
must find its checkpoint already taken and the notice already written."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from magics import worker as w
from magics.calls import CHECKPOINT_STREAM


@pytest.fixture
def fresh() -> Iterator[w.GpuWorker]:
    w._NOTICE.clear(), w._RECALL_SEEN.clear(), w._RECALL.clear(), w._HOOKS.clear()
    yield w.GpuWorker()
    w._NOTICE.clear(), w._RECALL_SEEN.clear(), w._RECALL.clear(), w._HOOKS.clear()


def test_preempted_turns_true_only_after_the_hook_ran(fresh: w.GpuWorker) -> None:
    in_hook = threading.Event()
    release_hook = threading.Event()
    seen_during_hook: list[bool] = []

    def hook() -> dict[str, int]:
        in_hook.set()
        seen_during_hook.append(w.preempted())
        release_hook.wait(10)
        return {"step": 7}

    w.on_preempt(hook)
    t = threading.Thread(target=w._recalled, args=(fresh, {"recall_at": time.time() + 5, "recall_reason": "bob"}))
    t.start()
    assert in_hook.wait(10)
    assert not w.preempted()  # the loop keeps going while its state is being saved
    release_hook.set()
    t.join(10)
    assert w.preempted() and seen_during_hook == [False]
    chunks, _ = fresh.read_output(0)
    streams = [s for s, _ in chunks]
    assert streams == ["stderr", CHECKPOINT_STREAM]  # the notice, then the checkpoint
    assert "these GPUs are recalled (bob)" in chunks[0][1]


def test_a_failing_hook_still_lets_the_loop_stop(fresh: w.GpuWorker) -> None:
    w.on_preempt(lambda: 1 / 0)
    w._recalled(fresh, {"recall_at": time.time(), "recall_reason": "quota"})
    assert w.preempted()
    chunks, _ = fresh.read_output(0)
    assert "the checkpoint hook failed: ZeroDivisionError" in chunks[-1][1]
