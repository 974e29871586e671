"""One output pump for 1..N workers: start the call on every rank, stream what they print, and
collect their results. A world of one writes output as is; a gang's lines are ``[rank N]``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from . import hostcopy
from .calls import CHECKPOINT_STREAM, ELASTIC_STREAM, METRICS_STREAM, Call, Result
from .grant import Cancel, Grant
from .outcomes import UI, GpuLeaseEnded, GpuTrainError, GpuTrainTimeout, _first_line
from .world import World

POLL_S = 0.5  # a worker's output long poll
WAKE_S = 0.05  # the pump wakes this often: Ray's wait does not give way to Stop (SIGINT) until it returns


class Pump:
    """Starts the call on every rank and streams their output until all have returned. A world
    of one writes output as is; a gang's lines are prefixed ``[rank N]``. The first rank to fail
    raises; the caller then ends every rank. ``cancel``, once requested, raises KeyboardInterrupt
    here as Stop would (a sweep ending a trial early, or stopping)."""

    def __init__(self, grant: Grant, world: World, ui: UI, cancel: Cancel | None = None) -> None:
        self.grant = grant
        self.world = world
        self.ui = ui
        self.cancel = cancel
        self.checkpoint: Any = None
        self.has_checkpoint = False
        self.metrics: list[dict[str, Any]] = []  # rank 0's magics.report(...) records, in order
        self._warned_at: Any = None
        self.on_elastic: Callable[[dict[str, Any]], None] | None = None  # rank 0's elastic steps
        self.crossed: list[hostcopy.Crossed] = []  # rank 0's names that came back over hostcopy.BIG
        self.imported: list[str] = []  # installed packages rank 0's call imported

    def run(self, call: Call, timeout: float | None) -> list[Result]:
        import ray

        ranks = self.world.ranks
        multi = len(ranks) > 1
        writer = _RankWriter(self.ui.output) if multi else None
        watch = self.grant.watch()
        self._check_lease()
        result_refs = {r.worker.handle.run.remote(call, r.env, watch): i for i, r in enumerate(ranks)}
        out_refs = {r.worker.handle.read_output.remote(POLL_S): i for i, r in enumerate(ranks)}
        results: dict[int, Result] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        # a one-node call's worker that Ray never starts fails the call (a gang's ranks were
        # waited for in World.start), instead of holding the lease for as long as nobody stops it
        unstarted = [] if multi else [ranks[0].worker.ready_ref]
        start_by = time.monotonic() + self.world.sess.worker_start_timeout
        try:
            while len(results) < len(ranks):
                if unstarted and ray.wait(unstarted, timeout=0)[0]:
                    unstarted = []
                if unstarted and time.monotonic() >= start_by:
                    node = ranks[0].node
                    raise GpuTrainError(
                        f"Ray did not start this cell's worker on {node} within "
                        f"{self.world.sess.worker_start_timeout:g}s: is the Ray node of {node} up and "
                        "not full? (ray status)",
                        node=node,
                    )
                wait_s = WAKE_S if deadline is None else max(0.0, min(WAKE_S, deadline - time.monotonic()))
                ready, _ = ray.wait([*result_refs, *out_refs], num_returns=1, timeout=wait_s)
                if deadline is not None and time.monotonic() >= deadline and not ready:
                    every = "; every rank was stopped" if multi else ""
                    raise GpuTrainTimeout(f"stopped after --timeout {timeout:g}s{every}", node=self._nodes())
                self._check_lease()
                if self.cancel is not None and self.cancel.requested:
                    raise KeyboardInterrupt
                for ref in ready:
                    if ref in out_refs:
                        i = out_refs.pop(ref)
                        try:
                            chunks, done = ray.get(ref)
                        except ray.exceptions.RayError:
                            chunks, done = [], True
                        self._emit(i, chunks, writer)
                        if not done:
                            out_refs[ranks[i].worker.handle.read_output.remote(POLL_S)] = i
                        continue
                    i = result_refs.pop(ref)
                    try:
                        result = self._collect(ref, i, multi)
                    except (GpuTrainError, GpuLeaseEnded):  # a rank died: show what the others printed
                        self._drain(out_refs, writer)
                        raise
                    if not result.ok:
                        self._drain(out_refs, writer)
                        rank = f"rank {i} on {ranks[i].node}" if multi else ranks[i].node
                        gpus = ranks[i].env.get("CUDA_VISIBLE_DEVICES", "")
                        raise GpuTrainError(
                            f"{result.error_type}: {result.message} (on {rank}"
                            + (f", GPU {gpus}" if gpus else "")
                            + ("; every rank was stopped)" if multi else ")"),
                            remote_traceback=result.traceback,
                            node=ranks[i].node,
                            remote_type=result.error_type,
                            rank=i if multi else None,
                        )
                    results[i] = result
            self._drain(out_refs, writer)
        finally:
            if writer is not None:
                writer.flush()
        return [results[i] for i in range(len(ranks))]

    def _nodes(self) -> str:
        return self.world.nodes()

    def _check_lease(self) -> None:
        held = self.grant.held
        if held is None:
            return
        if held.lost is not None or self.grant.ended_elsewhere.is_set():  # someone else ended it
            raise GpuLeaseEnded(self.grant.ended_by() or f"the lease ended: {held.lost}", node=self._nodes())
        for note in self.grant.notes():  # a slice over its memory: warned before it is ended
            self.ui.notice(note)
        reclaim_at = held.lease.raw.get("reclaim_at")
        if reclaim_at and reclaim_at != self._warned_at:
            self._warned_at = reclaim_at
            self.ui.notice(
                f"these GPUs look idle: reclaimed in {max(0, reclaim_at - time.time()):.0f}s unless busy\n"
                f"    to keep them: %gpu_lease keep (or gpulease keep {held.lease.id})"
            )

    def _collect(self, ref: Any, i: int, multi: bool) -> Result:
        import ray

        node = self.world.ranks[i].node
        try:
            result: Result = ray.get(ref)
        except ray.exceptions.RayActorError:
            why = self.grant.ended_by()
            if why:
                raise GpuLeaseEnded(why, node=node) from None
            who = f"rank {i} on {node}" if multi else f"on {node}"
            raise GpuTrainError(
                f"the worker process {who} exited unexpectedly (os._exit, a crash, or the OOM killer)"
                + ("; every rank was stopped" if multi else ""),
                node=node,
                rank=i if multi else None,
            ) from None
        except ray.exceptions.RayError as exc:
            raise GpuTrainError(f"Ray could not run the call: {_first_line(exc)}", node=node) from None
        if isinstance(result.value, hostcopy.Packed):  # GPU tensors in it arrive as CPU ones
            result.value, big = hostcopy.unpack(result.value)
            if i == 0:
                self.crossed += big
        if i == 0:
            self.imported = result.imported
        return result

    def _emit(self, i: int, chunks: list[tuple[str, str]], writer: _RankWriter | None) -> None:
        import base64

        from ray import cloudpickle

        for stream, text in chunks:
            if stream == CHECKPOINT_STREAM:
                if i == 0:  # rank 0's state, as for one node
                    self.checkpoint = cloudpickle.loads(base64.b64decode(text))
                    self.has_checkpoint = True
            elif stream == METRICS_STREAM and i == 0:  # rank 0's metrics, as for its value
                record = json.loads(text)
                self.metrics.append(record)
                on_metrics = getattr(self.ui, "metrics", None)  # a UI that shows them (a sweep's trial)
                if on_metrics is not None:
                    on_metrics(record)
            elif stream == ELASTIC_STREAM and i == 0:  # rank 0's steps: the elastic runner's throughput
                if self.on_elastic is not None:
                    self.on_elastic(json.loads(text))
        plain = [c for c in chunks if c[0] not in (CHECKPOINT_STREAM, METRICS_STREAM, ELASTIC_STREAM)]
        if writer is not None:
            for stream, text in plain:
                writer.write(i, stream, text)
        else:
            for stream, text in _merge(plain):
                self.ui.output(stream, text)

    def _drain(self, out_refs: dict[Any, int], writer: _RankWriter | None) -> None:
        """What the ranks printed and we have not shown yet (bounded: a rank may be gone)."""
        import ray

        # A rank that is gone answers at once (its actor died); one that lives but is slow on a
        # loaded machine gets 10 s: 2 s lost a live rank's last lines (test_gang, in a fresh clone).
        for ref, i in list(out_refs.items()):
            out_refs.pop(ref)
            try:
                chunks, done = ray.get(ref, timeout=10)
                self._emit(i, chunks, writer)
                if not done:
                    chunks, _ = ray.get(self.world.ranks[i].worker.handle.read_output.remote(0), timeout=10)
                    self._emit(i, chunks, writer)
            except Exception:  # noqa: BLE001 - the rank is gone; nothing more to show
                pass


def _merge(chunks: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Join consecutive pieces of one stream (print writes several)."""
    merged: list[tuple[str, str]] = []
    for stream, text in chunks:
        if merged and merged[-1][0] == stream:
            merged[-1] = (stream, merged[-1][1] + text)
        else:
            merged.append((stream, text))
    return merged


class _RankWriter:
    """Writes the ranks' output with each line prefixed ``[rank N] ``. A line is shown once it
    is complete (or at the end), so that two ranks' pieces of a line never mix."""

    def __init__(self, write: Callable[[str, str], None]) -> None:
        self._write = write
        self._partial: dict[tuple[int, str], str] = {}

    def write(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        lines = (self._partial.pop(key, "") + text).splitlines(keepends=True)
        if lines and not lines[-1].endswith(("\n", "\r")):
            self._partial[key] = lines.pop()
        if lines:
            self._write(stream, "".join(f"[rank {rank}] {line}" for line in lines))

    def flush(self) -> None:
        for (rank, stream), text in sorted(self._partial.items()):
            self._write(stream, f"[rank {rank}] {text}\n")
        self._partial.clear()
