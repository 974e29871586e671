"""A call's lease, from the request to the verified release.

:class:`Grant` is the one place that takes a lease (showing the queue, withdrawing the request on
Stop), keeps it renewed, follows it (ending the call's world when someone else ends it) and,
whatever happened, has the world end its workers and see them gone, and only then releases it.
It holds the lease and nothing about processes: those are the :class:`magics.world.World`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lease_server import errors, protocol
from lease_server.client import Client, HeldLease, Lease
from lease_server.request import MAX_ENDS_WITHIN_S
from lease_server.sizes import show_mb

from .calls import event_client
from .options import Options
from .outcomes import UI, Lent, Running, Waiting, _join, describe_end, waiting_estimate
from .relay import Relay
from .session import Session
from .world import World

log = logging.getLogger(__name__)
ESTIMATE_EVERY_S = 10.0  # how often a waiting cell asks the server again how long it may take
FOLLOW_DELAY_S = 0.2  # how far into a call the driver starts following its lease
WITHDRAW_AGAIN_S = 0.25  # a cancelled request whose POST had not reached the server: withdrawn again
START_SLACK_S = 10.0  # a --timeout counts the function's run; the lease also holds its worker's start


class Cancel:
    """Ends a call from another thread as Stop would: a sweep ending one trial early, or stopping.

    A call run with one (``run_call(..., cancel=c)``) waits in the queue without polling it; once
    ``request()`` is called, the call's own thread withdraws its request if it still waits (so a
    grant that raced ahead is released before any worker starts), or, if it runs, the pump raises
    KeyboardInterrupt and the call ends its workers and releases its lease as on Stop."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.requested = False

    def request(self) -> None:
        with self._cond:
            self.requested = True
            self._cond.notify_all()

    def _poke(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait(self, done: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.requested or done())


def slice_place(lease: Lease) -> str:
    """Where a slice lease is, as the cell's lines say it: "a 10 GB slice of box GPU 0", or for k
    slices "10 GB slices of box GPU 0,1"."""
    indexes = ",".join(str(i) for i in lease.indexes)
    if len(lease.indexes) > 1:
        return f"{show_mb(lease.gpu_mem_mb)} slices of {lease.node} GPU {indexes}"
    return f"a {show_mb(lease.gpu_mem_mb)} slice of {lease.node} GPU {indexes}"


class Grant:
    """A call's lease (or, for a CPU call without a CPU pool, none) from the request to the
    verified release. :meth:`finish` has the call's world end its workers and see their processes
    gone, and only then releases the lease."""

    def __init__(self, sess: Session, lease: Lease | None, waited_s: float = 0.0, cpu: bool = False) -> None:
        self.sess = sess
        self._lease = lease
        self.cpu = cpu
        self.waited_s = waited_s
        self.t0 = time.monotonic()
        self.held: HeldLease | None = None
        self.verified = False  # released once its world's processes were seen gone
        self._finished = False
        self._releasing = threading.Event()
        self.ended_elsewhere = threading.Event()
        self._follower: Any = None
        self._on_ended: Callable[[], None] = lambda: None
        self.handed_to = ""  # the request this lease and its worker were handed to
        self.asked_mb = 0  # a slice: the MB asked for (the lease's gpu_mem_mb may be rounded up)
        self.restore = False  # its first call restores a worker suspended on eviction (magics/warm.py)
        self._notes: list[str] = []  # said about the lease while it runs (a slice over its memory)
        self._notes_lock = threading.Lock()
        if lease is not None:
            self.held = HeldLease(sess.client(), lease)
            self.held.activity = {"executing": True, "source": "gpu_train"}
            sess.held.add(self.held)

    @property
    def lease(self) -> Lease | None:
        """The call's lease as last seen: one copy, the :class:`HeldLease`'s (which its renewals
        keep) when there is one."""
        return self.held.lease if self.held is not None else self._lease

    def update(self, lease: Lease) -> None:
        """The lease changed on the server (an elastic resize): every reader now sees ``lease``."""
        self._lease = lease
        if self.held is not None:
            self.held.lease = lease

    @classmethod
    def take(
        cls,
        sess: Session,
        opts: Options,
        ui: UI,
        cpu_pool: str | None,
        rid: str,
        cancel: Cancel | None = None,
        relay: Relay | None = None,
        prefer_node: str = "",
        lent: Lent | None = None,
    ) -> Grant:
        """Acquire, showing the queue; Stop or any error while queued withdraws the request.
        With ``cancel`` (a sweep's trial), the queue is not polled: ``ui`` hears one Waiting
        (position None) as the request is sent, and a cancel withdraws it (KeyboardInterrupt).
        ``prefer_node``: the node of the notebook's suspended worker, asked for when it has the GPUs
        free (whole GPUs on one node only). ``lent``: whom the notebook's warm GPU was lent to (the
        queued line says so, and when their lease ends)."""
        assert opts.gpus is not None and opts.wait is not None
        if opts.gpus == 0 and not cpu_pool:
            return cls(sess, None, cpu=True)
        cpu = opts.gpus == 0
        gpus, gpus_min, pool = (1, 1, cpu_pool) if cpu else (opts.gpus, opts.gpus_min, opts.pool)
        client = sess.client()
        asked = f"{gpus_min}-{gpus}" if gpus_min != gpus else str(gpus)
        # A slice: its size in MB now (a fraction is of one GPU of the pool); ValueError before anything is sent
        mem_mb = None if cpu or opts.gpu_mem is None else client.gpu_mem_mb(opts.gpu_mem, pool)
        if mem_mb is not None:
            asked = f"{show_mb(mem_mb)} slice"
        # the server's latest estimate, read at `at` seconds into the wait (the line counts it down)
        estimate: dict[str, Any] = {"est": None, "at": -ESTIMATE_EVERY_S}

        shown_pool = {"name": pool or ""}

        def progress(position: int | None, elapsed: float) -> None:
            if position and not shown_pool["name"]:  # the server's default pool: ask once, while waiting
                with contextlib.suppress(errors.GpuLeaseError):
                    shown_pool["name"] = client.cluster().get("default_pool") or ""
            if position and elapsed - estimate["at"] >= ESTIMATE_EVERY_S:
                estimate["at"] = elapsed
                try:
                    estimate["est"] = client.estimate(gpus, pool, request=rid)
                except errors.GpuLeaseError:
                    estimate["est"] = None
            est, at = estimate["est"], estimate["at"]
            text = waiting_estimate(est, at, opts.wait, elapsed - at, lent) if est else (lent.line() if lent else "")
            ui.waiting(Waiting(rid, asked, shown_pool["name"], position, elapsed, text))

        sess.waiting.add(rid)
        t0 = time.monotonic()
        ask: dict[str, Any] = dict(
            gpus=gpus,
            pool=pool,
            ttl=sess.defaults.ttl,
            wait=opts.wait,
            label=protocol.plain(opts.label)[:200],  # a cell's first line may hold a tab
            session=protocol.plain(opts.session)[:200],
            gpus_min=gpus_min,
            priority=opts.priority,
            nodes=opts.nodes,
            notebook=protocol.plain(opts.notebook),
            cell=opts.cell,
            request_id=rid,
        )
        if opts.timeout and not cpu:
            # the run's limit and the worker's start: the wait estimates of those behind count on it
            ask["ends_within"] = min(opts.timeout + START_SLACK_S, MAX_ENDS_WITHIN_S)
        if mem_mb is not None:
            ask["gpu_mem"] = mem_mb
        elif prefer_node and not cpu and (opts.nodes or 1) == 1:
            ask["prefer_node"] = prefer_node
        try:
            if cancel is None:
                lease = client.acquire(progress=progress, **ask)
            else:
                ui.waiting(Waiting(rid, asked, pool or "", None, 0.0))
                lease = _acquire_cancellable(client, cancel, rid, ask, relay)
        finally:
            sess.waiting.discard(rid)
        waited = lease.raw.get("waited")  # as the server measured it (seconds)
        grant = cls(sess, lease, waited if waited is not None else time.monotonic() - t0, cpu=cpu)
        grant.asked_mb = mem_mb or 0
        return grant

    @property
    def where(self) -> str:
        if self.lease is None:
            return "a CPU worker"
        if self.cpu:
            return f"a CPU slot of {self.lease.node}"
        if self.lease.gpu_mem_mb:
            return slice_place(self.lease)
        parts = self.lease.parts()
        n = len(self.lease.gpus)
        gpus = f"{n} GPU{'s' if n != 1 else ''}"
        return f"{gpus} on " + " + ".join(f"{node} (GPU {','.join(map(str, i))})" for node, i in parts.items())

    def running(self, opts: Options) -> Running:
        if self.lease is None:
            return Running("", "a CPU worker", 0, 0.0)
        lease = self.lease
        note = ""
        if opts.gpus_min != opts.gpus and not self.cpu:
            note = f"{len(lease.gpus)} of {opts.gpus_min}-{opts.gpus} asked"
        if lease.borrowed:
            note = _join(note, "borrowed from a booking: recalled with notice if its holder asks")
        elif lease.raw.get("preemptible"):
            note = _join(note, "above your quota: preemptible, recalled with notice for someone within theirs")
        where = (
            "a CPU slot of " + lease.node
            if self.cpu
            else " + ".join(f"{node} GPU {','.join(map(str, i))}" for node, i in lease.parts().items())
        )
        if lease.gpu_mem_mb:  # a slice: its share of the GPU, and why that size
            total = int(lease.raw.get("gpu_total_mb") or 0)
            each = " each" if len(lease.gpus) > 1 else ""  # k slices: that much of each of its k GPUs
            where += f", {show_mb(lease.gpu_mem_mb)}" + (f" of {show_mb(total)}" if total else "") + f"{each}, shared"
            if opts.gpu_mem_why:
                note = _join(note, opts.gpu_mem_why)
            elif self.asked_mb and lease.gpu_mem_mb > self.asked_mb:
                note = _join(note, f"{show_mb(self.asked_mb)} rounded up to the pool's unit")
        elif opts.gpu_mem_why:  # --gpu-mem auto took a whole GPU: say why
            note = _join(note, opts.gpu_mem_why)
        return Running(lease.id, where, 0 if self.cpu else len(lease.gpus), self.waited_s, note)

    def world(self) -> World:
        """The world of workers a call on this lease runs on (not started yet)."""
        return World(self.sess, self.lease, self.cpu)

    def watch(self) -> dict[str, Any]:
        """What a worker's watchdog follows: this lease, on the lease server."""
        if self.lease is None:
            return {}
        client = self.sess.client()
        # The user a proxy token acts for (JupyterHub: GPULEASE_USER): without it every request of
        # the watchdog is refused (403) and it never sees its lease end.
        user = {k.lower(): v for k, v in client.headers.items()}.get(protocol.USER_HEADER.lower(), "")
        # The worker claims the lease at its node agent with these (lease_server/node/claims.py):
        # if the server ends the lease, the agent then ends the worker before the GPUs are lent again.
        return {
            "url": client.url,
            "token": client.token,
            "id": self.lease.id,
            "user": user,
            "fence": self.lease.token,
            "instance": self.sess.instance(),
            "restore": self.restore,
            # whose listener the kernel's token went to: the worker's event stream sends it to no other
            "server_uids": sorted(client.guard.allowed) if client.guard.allowed else None,
        }

    def follow(self, on_ended: Callable[[], None]) -> None:
        """Follow this lease's own events (``GET /api/v1/events?lease=ID``) while the call runs:
        once someone else ends it (the board, an admin, the reclaimer, a preemption), call
        ``on_ended`` (the world kills its workers through Ray) at once, so the GPUs' next holder
        never meets them."""
        self._on_ended = on_ended
        if self.lease is None:
            return
        client = self.sess.client()
        lease_id = self.lease.id

        def run() -> None:
            # Short calls end before this and never pay for a stream; the renewal and the worker's
            # watchdog cover the first moments of a long one.
            if self._releasing.wait(FOLLOW_DELAY_S):
                return
            http = event_client(client.url, client.headers, client.guard)
            self._follower = http
            if self._releasing.is_set():
                return
            try:
                with http.stream("GET", protocol.EVENTS, params={"lease": lease_id}) as s:
                    if self._is_over():  # ended before we subscribed
                        self._ended()
                        return
                    kind = ""
                    for line in s.iter_lines():
                        if self._releasing.is_set():
                            return
                        if line.startswith("event:"):
                            kind = line.split(":", 1)[1].strip()
                            if kind in protocol.ENDED_EVENTS:
                                self._ended()
                                return
                        elif line.startswith("data:") and kind == protocol.EventType.OVER_MEMORY_WARNING:
                            self._over_memory(json.loads(line.split(":", 1)[1]))
            except Exception:  # noqa: BLE001 - closed by finish(), or the server is away: the renewal backs up
                pass

        threading.Thread(target=run, name=f"gpulease-follow-{lease_id}", daemon=True).start()

    def _over_memory(self, ev: dict[str, Any]) -> None:
        """The node agent saw this slice over its memory: said under the cell's line (:meth:`notes`)."""
        used, mb = int(ev.get("used_mb") or 0), int(ev.get("gpu_mem_mb") or 0)
        with self._notes_lock:
            self._notes.append(f"over its {show_mb(mb)} slice, using {show_mb(used)}: ended unless it drops back")

    def notes(self) -> list[str]:
        """What was said about the lease since the last call (from the follower's thread)."""
        with self._notes_lock:
            out, self._notes = self._notes, []
        return out

    def _is_over(self) -> bool:
        try:
            assert self.lease is not None
            return self.sess.client().get(self.lease.id).get("state") in protocol.ENDED_STATES
        except errors.GpuLeaseError:
            return False

    def _ended(self) -> None:
        if self._releasing.is_set():
            return
        self.ended_elsewhere.set()
        self._on_ended()

    def ended_by(self) -> str | None:
        """Who ended this lease and why, if it was not us ("revoked by alice: maintenance")."""
        if self.lease is None:
            return None
        try:
            rec = self.sess.client().get(self.lease.id)
        except errors.GpuLeaseError:
            return None
        return describe_end(rec, self.lease.user)

    def finish(self, world: World, relay: Relay | None = None) -> None:
        """End the call on this lease: hand the lease and ``world``'s worker to ``relay``'s next
        request (a sweep's call that returned normally), or else have ``world`` end its workers and
        see each process gone, then release the lease (verified when they were). Idempotent, and
        carried through a second Stop press."""
        if self._finished:
            return
        while True:
            try:
                self._finish(world, relay)
                break
            except KeyboardInterrupt:  # Stop pressed again during cleanup: finish it anyway
                continue
        self._finished = True

    def stop_following(self) -> None:
        """The call is over: stop following its lease (:meth:`follow`)."""
        self._releasing.set()
        if self._follower is not None:
            with contextlib.suppress(Exception):
                self._follower.close()
            self._follower = None

    def reopen(self) -> None:
        """A warm lease runs the notebook's next cell on the same worker: a new call on this grant."""
        self._finished = False
        self._releasing = threading.Event()
        self.ended_elsewhere = threading.Event()
        self.verified = False
        self.waited_s = 0.0
        self.t0 = time.monotonic()
        if self.held is not None:
            self.held.activity = {"executing": True, "source": "gpu_train"}

    def _finish(self, world: World, relay: Relay | None) -> None:
        self.stop_following()
        held = self.held
        if relay is not None and held is not None and not self.ended_elsewhere.is_set():
            handed = relay.pass_on(held, world)
            if handed:
                self.handed_to, self.verified = handed, True
                self.sess.held.discard(held)
                return
        self.verified = world.end()
        if held is not None:
            # Verified: the workers it named are gone, free at once; else the node agent makes sure.
            held.release(verified=self.verified)
            self.sess.held.discard(held)


def _acquire_cancellable(
    client: Client, cancel: Cancel, rid: str, ask: dict[str, Any], relay: Relay | None = None
) -> Lease:
    """``client.acquire(**ask)`` that ``cancel`` withdraws. The long poll runs in a helper thread;
    this thread sleeps until it returns or the cancel comes. A withdrawal that reached the server
    before the request did finds nothing (and the request would then wait), so it is sent again
    until the long poll has returned; a grant that raced ahead is released by the withdrawal."""
    if cancel.requested:  # cancelled before it was sent: nothing to withdraw
        raise KeyboardInterrupt
    box: dict[str, Any] = {}

    def post() -> None:
        try:
            box["lease"] = client.acquire(**ask)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            box["done"] = True
            cancel._poke()

    poller = threading.Thread(target=post, name=f"gpulease-acquire-{rid}", daemon=True)
    poller.start()
    cancel._wait(lambda: "done" in box)
    if cancel.requested:
        if relay is not None:
            relay.drop(rid)  # a worker handed to this request ends before its lease is released
        while True:
            client.withdraw(rid, reason="withdrawn: its sweep stopped it")
            poller.join(WITHDRAW_AGAIN_S)
            if not poller.is_alive():
                break
        raise KeyboardInterrupt
    poller.join()
    if "error" in box:
        raise box["error"]
    return box["lease"]  # type: ignore[no-any-return]
