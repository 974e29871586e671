"""Release a kernel's leases the moment the kernel is gone.

The magic labels every lease with its kernel's session: the kernel's connection-file name without
``.json`` (``kernel-<kernel id>`` under jupyter_server; see ``magics.magic._kernel_session``). The
Jupyter server knows when a kernel ends, so it releases those leases at once instead of leaving
the GPUs idle for a TTL:

* shutdown (the user, the session API or the idle culler) and restart (the user, or the restarter
  after the kernel process died): jupyter_server's ``kernel_actions`` events;
* a kernel that died and could not be restarted: the kernel manager's ``dead`` restart callback,
  registered when the kernel starts;
* the Jupyter server stopping (its kernels are shut down right after the extensions stop).

Nothing depends on this: the lease TTL frees the GPUs of a kernel whose Jupyter server died too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from lease_server import errors

from .upstream import LeaseApi

log = logging.getLogger(__name__)

KERNEL_ACTIONS = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"


def kernel_session(kernel_id: str, connection_file: str = "") -> str:
    """The session name the magic gives its leases, for the kernel with this id."""
    name = os.path.basename(connection_file).removesuffix(".json") if connection_file else ""
    return name or f"kernel-{kernel_id}"


class KernelLeaseReleaser:
    """Listens to the Jupyter server's kernel lifecycle and releases the leases of ended kernels."""

    def __init__(self, api: LeaseApi, kernel_manager: Any, event_logger: Any) -> None:
        self.api = api
        self.kernel_manager = kernel_manager
        self.event_logger = event_logger
        self._sessions: dict[str, str] = {}  # kernel id -> session, learned when the kernel started
        self._tasks: set[asyncio.Task[list[str]]] = set()
        # For tests and logs: (kernel id, why, lease ids released), newest last.
        self.history: deque[tuple[str, str, list[str]]] = deque(maxlen=100)
        self.changed = asyncio.Condition()

    def start(self) -> None:
        if self.event_logger is None:
            log.warning("gpulease: this Jupyter server has no event bus; kernels' leases end by their TTL")
            return
        self.event_logger.add_listener(schema_id=KERNEL_ACTIONS, listener=self._on_kernel_action)

    async def stop(self) -> None:
        """Stop listening, then release the leases of every kernel still running (the Jupyter
        server shuts them down right after its extensions stop)."""
        if self.event_logger is not None:
            self.event_logger.remove_listener(schema_id=KERNEL_ACTIONS, listener=self._on_kernel_action)
        running = list(self._running_kernel_ids())
        if running:
            try:
                await asyncio.wait_for(self.release(running, "the Jupyter server is stopping"), timeout=5)
            except Exception as exc:  # noqa: BLE001 - stopping must go on; the TTL frees the GPUs anyway
                log.warning("gpulease: could not release the leases of %d kernel(s) at stop: %s", len(running), exc)
        for task in list(self._tasks):
            task.cancel()

    def _running_kernel_ids(self) -> Iterable[str]:
        try:
            return list(self.kernel_manager.list_kernel_ids())
        except Exception:  # noqa: BLE001 - a remote (gateway) kernel manager that cannot list: nothing to do
            return []

    async def _on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        kernel_id = data.get("kernel_id")
        if data.get("status") != "success" or not kernel_id:
            return
        action = data.get("action")
        if action == "start":
            self._watch(kernel_id)
        elif action == "shutdown":
            self._spawn([kernel_id], "the kernel shut down")
            self._sessions.pop(kernel_id, None)
        elif action == "restart":
            # The restarted kernel keeps its id and connection file, hence its session: release
            # only what the old process acquired. The restart finished before this event, and the
            # new process has not run a cell yet, so "created before now" is the old process's.
            self._spawn([kernel_id], "the kernel restarted", before=time.time())

    def _watch(self, kernel_id: str) -> None:
        try:
            km = self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            return
        self._sessions[kernel_id] = kernel_session(kernel_id, getattr(km, "connection_file", ""))
        try:
            km.add_restart_callback(lambda: self._spawn([kernel_id], "the kernel died"), "dead")
        except Exception as exc:  # noqa: BLE001 - a kernel manager without restarter callbacks
            log.debug("gpulease: no restart callbacks on kernel %s: %s", kernel_id, exc)

    def _session_of(self, kernel_id: str) -> str:
        return self._sessions.get(kernel_id) or kernel_session(kernel_id)

    def _spawn(self, kernel_ids: list[str], why: str, before: float | None = None) -> None:
        sessions = {self._session_of(k): k for k in kernel_ids}  # now: a shutdown forgets the session
        task = asyncio.ensure_future(self._release(sessions, why, before))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[list[str]]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.warning("gpulease: releasing a kernel's leases failed (their TTL will free them): %s", exc)

    async def release(self, kernel_ids: list[str], why: str, before: float | None = None) -> list[str]:
        """Release this Jupyter user's live leases whose session is one of these kernels'.

        ``before``: only leases created before this time (epoch seconds). Returns the ids released.
        """
        return await self._release({self._session_of(k): k for k in kernel_ids}, why, before)

    async def _release(self, sessions: dict[str, str], why: str, before: float | None) -> list[str]:
        mine = (await self.api.request("GET", "/leases"))["leases"]
        doomed = [
            lease
            for lease in mine
            if lease.get("session") in sessions and (before is None or lease.get("created_at", 0) <= before)
        ]
        released: list[str] = []
        for lease in doomed:
            try:
                await self.api.request("DELETE", f"/leases/{lease['id']}")
            except (errors.NotFound, errors.LeaseEnded) as exc:  # ended meanwhile: nothing to free
                log.debug("gpulease: %s already ended: %s", lease["id"], exc)
                continue
            released.append(lease["id"])
            log.info(
                "gpulease: released %s (%s GPU(s) on %s) because %s (kernel %s)",
                lease["id"],
                len(lease.get("gpus", [])),
                lease.get("node"),
                why,
                sessions[lease["session"]],
            )
        async with self.changed:
            for session, kernel_id in sessions.items():
                ids = [lease["id"] for lease in doomed if lease["session"] == session and lease["id"] in released]
                self.history.append((kernel_id, why, ids))
            self.changed.notify_all()
        return released
