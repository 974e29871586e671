"""Warm cells: a finished ``%%gpu_train`` cell's worker stays on its GPUs for the notebook's next cell.

When a one-node cell ends normally (or its own code raised), its worker process and its namespace
stay alive, the call's grant and world kept together as the kernel's one :class:`WarmWorker`, and
its lease turns *warm* (``POST /leases/{id}/warm``): lendable. The next cell of the same kernel asking for the
same GPUs (count, and pool if it names one) runs in that worker at once: no queue, no new process,
whatever the last cell left on the GPU still there, and only the names that changed in the kernel
since they last crossed are sent (:meth:`WarmWorker.strip`).

Whoever would otherwise wait evicts a warm lease: the lease server says ``evicting`` on the lease's
event stream, and :class:`WarmWorker` (following it while the notebook does other things) hands
the lease back with its worker **suspended** (``POST /leases/{id}/suspend``): the node agent moves
the worker's GPU state to host memory (lease_server/node/onhost.py), sees the GPU clean of it, and
only then is the waiter granted. The worker process lives on with its namespace, holding no lease;
the notebook's next cell takes a new lease of the same GPUs and, on the same node, runs in it
again, restored onto the new GPU first (its line says ``restored 3.2 GB to box GPU 1 in 0.7s``).
Where the node cannot suspend (no checkpoint API, several processes, suspend = off), the worker is
ended, seen gone and the lease released at once, well inside the pool's notice (2 s), and the next
cell starts cold; its line says so. A kernel that misses the notice (paused, cut off) loses the
lease and the node agent ends the worker before anyone is granted the GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from lease_server import errors, procs, protocol
from lease_server.protocol import EndCause, EndCauseJson
from lease_server.sizes import parse_gpu_mem

from . import slices
from .calls import Call, event_client
from .grant import Grant, slice_place
from .options import Options
from .outcomes import Lent, describe_cause, describe_end
from .session import Session
from .world import World

log = logging.getLogger(__name__)
_MISSING = object()
SUSPEND_WAIT_S = 30.0  # the next cell waits this long at most for an eviction's suspend to land


@dataclass
class _Slot:
    """A kernel's warm worker, and the last one that ended while warm (the next cell says so)."""

    current: WarmWorker | None = None
    gone: WarmWorker | None = None


_slots: weakref.WeakKeyDictionary[Session, _Slot] = weakref.WeakKeyDictionary()
_slots_lock = threading.Lock()


def _slot(sess: Session) -> _Slot:
    with _slots_lock:
        slot = _slots.get(sess)
        if slot is None:
            slot = _slots[sess] = _Slot()
            sess.before_release.append(functools.partial(_end_for_release, sess))
        return slot


def _end_for_release(sess: Session, why: str) -> None:
    end_warm(sess, why)


def current(sess: Session) -> WarmWorker | None:
    """The kernel's warm worker, if it keeps one."""
    return _slot(sess).current


def end_warm(sess: Session, why: str) -> bool:
    """End the kernel's warm worker, if any, and release its lease; whether there was one."""
    slot = _slot(sess)
    w, slot.current = slot.current, None
    if w is None:
        return False
    w.end(why)
    return True


def warmable(opts: Options, call: Call) -> bool:
    """Whether this call may run on (and leave behind) a warm worker: a one-node GPU cell of a
    fixed size, not elastic, that did not ask for ``--cold``."""
    return (
        opts.warm
        and call.kind == "cell"
        and bool(opts.gpus)
        and opts.gpus_min == opts.gpus
        and not (opts.nodes and opts.nodes > 1)
        and not opts.elastic
    )


class WarmWorker:
    """A finished cell's worker kept on its lease, and what of the notebook it already holds."""

    def __init__(self, sess: Session, grant: Grant, world: World) -> None:
        assert grant.lease is not None
        self.sess = sess
        self.grant = grant
        self.world = world
        self.lease = grant.lease
        self.since = time.monotonic()  # the last cell's end
        self.sent: dict[str, Any] = {}  # name -> the kernel's object the worker holds a copy of
        self.asked: Any = None  # a slice: the size its cell asked for (parse_gpu_mem's), for fits
        self.gone: str = ""  # why it ended while warm ("evicted for bob's request"), once it did
        self.gone_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._http: Any = None
        # Suspended on eviction: "suspending" (asked), "suspended" (the agent has it off the GPU);
        # the snapshot is the `suspended` event (bytes, ms); settled once the agent answered.
        self.suspend_state = ""
        self.snapshot: dict[str, Any] = {}
        self.evicted_why, self.evicted_at = "", 0.0
        self.lent: Lent | None = None  # evicted for another request: whose, and when
        self._settled = threading.Event()
        self._sus_stop = threading.Event()
        self._sus_http: Any = None

    # ---- the notebook's side ----------------------------------------------------------------------

    def fits(self, opts: Options) -> bool:
        """The next cell asks for what this lease holds: as many whole GPUs, or a slice of the
        size the last cell asked for (or got: "1GB" after "1000MB" rounded up to 1 GB)."""
        if opts.pool not in (None, self.lease.pool):
            return False
        if not self.lease.gpu_mem_mb:
            return opts.gpu_mem is None and opts.gpus == len(self.lease.gpus)
        if opts.gpu_mem is None or (opts.gpus or 1) != len(self.lease.gpus):
            return False
        try:
            size = parse_gpu_mem(opts.gpu_mem)
        except ValueError:
            return False
        return size in (self.asked, parse_gpu_mem(self.lease.gpu_mem_mb))

    def where(self) -> str:
        if self.lease.gpu_mem_mb:
            return slice_place(self.lease)
        return f"{self.lease.node} GPU {','.join(str(g['index']) for g in self.lease.gpus)}"

    def take(self) -> bool:
        """Run the next cell here: the lease runs again (``warm: false``). False once it was
        evicted or ended (the worker is then gone; :attr:`gone` says why)."""
        with self._lock:
            if self.gone:
                return False
            if not self._worker_alive():
                self._end_locked("its worker process exited")
                return False
            self._unfollow()
            try:
                self.sess.client().warm(self.lease, on=False)
            except errors.GpuLeaseError as exc:
                self._end_locked(_why(exc, self))
                return False
            return True

    def _worker_alive(self) -> bool:
        """False when the worker's process is known gone (crashed, OOM-killed while warm); where
        the driver cannot see its process table, the call finds out."""
        try:
            where = self.world.ranks[0].worker.where(timeout=1)
        except Exception:  # noqa: BLE001 - it never answered: not fit for a cell
            return False
        if where.machine != self.sess.machine:
            return True
        return procs.alive(where.pid) and (not where.start or procs.start_ticks(where.pid) == where.start)

    def strip(self, call: Call) -> Call:
        """The call with only the names whose objects changed in the kernel since they last
        crossed (by identity); the rest are in the worker's namespace already."""
        call.inputs = {k: v for k, v in call.inputs.items() if self.sent.get(k, _MISSING) is not v}
        return call

    def crossed(self, sent: dict[str, Any], back: dict[str, Any]) -> None:
        """``sent`` went to the worker, ``back`` came back (the kernel's copies): the worker holds both."""
        self.sent.update(sent)
        self.sent.update(back)

    def ended_line(self) -> str:
        """What the notebook's next cell says of a warm worker that was ended while warm (or suspended)."""
        ago = time.monotonic() - self.gone_at
        if self.suspend_state == "suspended":
            return f"the worker suspended from {self.where()} ended {ago:.0f}s ago ({self.gone}): this cell starts cold"
        return (
            f"the warm worker on {self.where()} ended {ago:.0f}s ago ({self.gone}; its GPU state was not "
            f"suspended: {self.not_suspended or 'no CUDA checkpoint on these GPUs'}): this cell starts cold"
        )

    def resumed_note(self) -> str:
        """The running line's note for a cell resumed in this suspended worker."""
        if self.lent is not None:  # "suspended worker: your warm GPU was lent to bob at 14:02"
            return f"suspended worker: {self.lent.line()}"
        return f"suspended worker, evicted {time.monotonic() - self.evicted_at:.0f}s ago"

    def resumed(self) -> None:
        """The notebook's next cell resumes in this suspended worker: stop following the old lease."""
        self._sus_stop.set()
        if self._sus_http is not None:
            with contextlib.suppress(Exception):
                self._sus_http.close()

    def settle(self, timeout: float = SUSPEND_WAIT_S) -> bool:
        """Wait until the node agent has suspended the worker (True) or it was ended (False: :attr:`gone`)."""
        if not self._settled.wait(timeout):
            self.end("its GPU state was not suspended in time")
        return not self.gone

    def end(self, why: str) -> None:
        """End the worker now (seen gone) and release the lease: %gpu_lease release, a kernel
        shutdown, the notebook's next cell asking for other GPUs, or --cold."""
        with self._lock:
            self._end_locked(why)

    # ---- while the notebook does other things ------------------------------------------------------

    def follow(self) -> None:
        """Follow the lease's events until the next cell takes it: evicted (or ended by anyone),
        end the worker and release at once, so the waiter is granted within its notice."""
        client = self.sess.client()
        lease_id = self.lease.id

        def run() -> None:
            while not self._stop.is_set():
                http = event_client(client.url, client.headers, client.guard)
                self._http = http
                try:
                    with http.stream("GET", protocol.EVENTS, params={"lease": lease_id}) as s:
                        if self._stop.is_set():
                            return
                        if self._missed(client):  # evicted (or ended) before we subscribed
                            return
                        kind = ""
                        for line in s.iter_lines():
                            if self._stop.is_set():
                                return
                            if line.startswith("event:"):
                                kind = line.split(":", 1)[1].strip()
                            elif line.startswith("data:") and kind in protocol.RECALL_EVENTS | protocol.ENDED_EVENTS:
                                self._evicted(kind, line[5:])
                                return
                except Exception as exc:  # noqa: BLE001 - closed by take()/end(), or the server is away
                    if self._stop.wait(1.0):
                        return
                    log.debug("warm lease %s: event stream lost (%s); following again", lease_id, exc)

        threading.Thread(target=run, name=f"gpulease-warm-{lease_id}", daemon=True).start()

    def _missed(self, client: Any) -> bool:
        """Whether the lease was evicted or ended before its events were followed (going warm
        serves the queue at once: a request already waiting evicts it in that same step)."""
        import json

        try:
            rec = client.get(self.lease.id)
        except errors.GpuLeaseError:
            return False
        if rec.get("state") in protocol.ENDED_STATES:
            ended = {"reason": rec.get("end_reason", ""), "by": rec.get("ended_by", ""), "cause": rec.get("cause")}
            self._evicted(rec["state"], json.dumps(ended))
            return True
        if rec.get("recall_at"):
            recalled = {"reason": rec.get("recall_reason", ""), "cause": rec.get("recall_cause")}
            evicted = (rec.get("recall_cause") or {}).get("code") == EndCause.EVICTED
            if evicted and rec.get("recall_for"):  # (as the event says it: whose request, since when)
                recalled.update(requested_by=rec["recall_for"], recalled_at=rec.get("recalled_at"))
            self._evicted(protocol.EventType.EVICTING.value, json.dumps(recalled))
            return True
        return False

    def _evicted(self, kind: str, data: str) -> None:
        import json

        body: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            body = json.loads(data)
        cause = body.get("cause")
        lent = None
        if kind == protocol.EventType.EVICTING and body.get("requested_by"):  # lent to whoever waited
            who = str(body["requested_by"])
            at = body.get("recalled_at") or body.get("ts") or time.time()  # (the event's time: the server's clock)
            lent = Lent(who, float(at), mine=who == self.lease.user)
        if kind in protocol.RECALL_EVENTS:
            why = str((cause or {}).get("why") or "evicted for another request")
            if lent is not None:
                why = f"its GPU was lent to {'your other notebook' if lent.mine else lent.user} at {lent.clock()}"
        elif kind in protocol.ENDED_STATES:
            if not cause:  # (an older server's event)
                cause = EndCauseJson(code=EndCause(kind), by=str(body.get("by", "")), why=str(body.get("reason", "")))
            why = describe_cause(cause, self.lease.user)
        else:
            why = kind
        with self._lock:
            if self._stop.is_set():
                return
            self.lent = lent
            if kind in protocol.RECALL_EVENTS and self._suspend_locked(why):
                return  # lives on off the GPU: the notebook's next cell restores it
            self._end_locked(why)
            _slot(self.sess).gone = self  # the notebook's next cell says what became of it

    # ---- suspended on eviction -----------------------------------------------------------------------

    not_suspended = ""  # why the lease server refused to suspend it (the line says so)

    def _suspend_locked(self, why: str) -> bool:
        """Hand the lease back with the worker suspended, where its node can (one GPU, one process)."""
        held = self.grant.held
        if held is None or len(self.world.ranks) != 1 or len(self.lease.gpus) != 1:
            return False
        try:
            held.suspend()
        except errors.GpuLeaseError as exc:  # refused (the node cannot): ended, as before
            self.not_suspended = exc.message.split(": ", 1)[-1].split(";")[0]
            return False
        self.suspend_state, self.evicted_why, self.evicted_at = "suspending", why, time.monotonic()
        self._unfollow()
        self.grant.stop_following()
        self.sess.held.discard(held)
        threading.Thread(target=self._follow_suspend, name=f"gpulease-suspended-{self.lease.id}", daemon=True).start()
        return True

    def _follow_suspend(self) -> None:
        """Follow the old lease's events: ``suspended`` (the agent has the worker off the GPU),
        ``drained`` without it (the agent could not: it ended the worker), ``suspend_ended``
        (ended later: warm_max, the node's host-memory budget, its process gone)."""
        import json

        client = self.sess.client()
        while not self._sus_stop.is_set():
            http = self._sus_http = event_client(client.url, client.headers, client.guard)
            if self._sus_stop.is_set():
                return
            try:
                with http.stream("GET", protocol.EVENTS, params={"lease": self.lease.id}) as s:
                    # what came before the stream opened (the agent may have answered already)
                    log_ = client.request("GET", protocol.EVENT_LOG, params={"lease": self.lease.id})
                    for e in log_.get("events", []):
                        if self._heard(str(e.get("type", "")), e):
                            return
                    kind = ""
                    for line in s.iter_lines():
                        if self._sus_stop.is_set():
                            return
                        if line.startswith("event:"):
                            kind = line.split(":", 1)[1].strip()
                        elif line.startswith("data:"):
                            with contextlib.suppress(ValueError):
                                if self._heard(kind, json.loads(line[5:])):
                                    return
            except Exception as exc:  # noqa: BLE001 - the server is away: follow again
                log.debug("suspended worker of %s: event stream lost (%s)", self.lease.id, exc)
                if self._sus_stop.wait(1.0):
                    return
            finally:
                http.close()

    def _heard(self, kind: str, body: dict[str, Any]) -> bool:
        """One event of the old lease; True once nothing more can come of it."""
        with self._lock:
            if self.gone:
                return True
            if kind == protocol.EventType.SUSPENDED and self.suspend_state == "suspending":
                self.suspend_state, self.snapshot = "suspended", body
                self._settled.set()
            elif kind == protocol.EventType.DRAINED and self.suspend_state == "suspending":
                self.not_suspended = "its node agent could not, and ended it"
                self._gone_locked(self.evicted_why)
                return True
            elif kind == protocol.EventType.SUSPEND_ENDED:
                self._gone_locked(str(body.get("reason") or "ended while suspended"))
                return True
        return False

    def _gone_locked(self, why: str) -> None:
        """Ended elsewhere while suspended (or suspending): the next cell says so and starts cold."""
        self.gone, self.gone_at = why, time.monotonic()
        self._sus_stop.set()
        self._settled.set()
        slot = _slot(self.sess)
        if slot.current is self:
            slot.current, slot.gone = None, self

    # ---- ending ----------------------------------------------------------------------------------

    def _unfollow(self) -> None:
        self._stop.set()
        if self._http is not None:
            with contextlib.suppress(Exception):
                self._http.close()
            self._http = None

    def _end_locked(self, why: str) -> None:
        if self.gone:
            return
        self.gone, self.gone_at = why, time.monotonic()
        self._unfollow()
        self._sus_stop.set()
        self._settled.set()
        try:
            self.grant.finish(self.world)  # the worker seen gone, then a verified release: free at once
        except Exception as exc:  # noqa: BLE001 - the TTL and the node agent are the backstop
            log.warning("could not end the warm worker of lease %s: %s", self.lease.id, exc)
        slot = _slot(self.sess)
        if slot.current is self:
            slot.current = None


def _why(exc: errors.GpuLeaseError, w: WarmWorker) -> str:
    """Why the next cell could not take the warm lease: evicted, or ended by someone."""
    try:
        rec = w.sess.client().get(w.lease.id)
    except errors.GpuLeaseError:
        return exc.message
    if "recall_cause" in rec:
        return rec["recall_cause"]["why"]
    return describe_end(rec, w.lease.user) or exc.message


def _refused(sess: Session, opts: Options) -> None:
    """Raise what the lease server would refuse this cell's request with at once (an unknown pool,
    more GPUs than any node of the pool has, a gang on more nodes than have its GPUs), asked
    before a warm worker is ended for that request: a typo in ``--pool`` must not cost the
    notebook its objects on the GPU."""
    c = sess.client()
    if opts.gpu_mem is not None and not slices.is_auto(opts.gpu_mem):  # too big, or a pool that does not share
        c.estimate(opts.gpus or 1, opts.pool, gpu_mem_mb=c.gpu_mem_mb(opts.gpu_mem, opts.pool))
        return
    if (opts.nodes or 1) > 1:  # a gang: as many nodes of the pool with gpus / nodes GPUs each
        c.estimate(opts.gpus or opts.nodes or 1, opts.pool, nodes=opts.nodes or 1)
        return
    c.estimate((opts.gpus_min or opts.gpus or 1) if opts.gpu_mem is None else 1, opts.pool)


def _asked(opts: Options) -> str:
    """What a cell asks for, as its flags say it: "2 GPUs", "--gpu-mem 10GB", "4 GPUs on 2 nodes"."""
    pool = f" of {opts.pool}" if opts.pool else ""
    if opts.gpu_mem is not None:
        return f"--gpu-mem {opts.gpu_mem}{pool}"
    if (opts.nodes or 1) > 1:
        return f"{opts.gpus} GPUs on {opts.nodes} nodes{pool}"
    if opts.gpus_min and opts.gpus_min != opts.gpus:
        return f"{opts.gpus_min}-{opts.gpus} GPUs{pool}"
    return f"{opts.gpus} GPU{'' if opts.gpus == 1 else 's'}{pool}"


def take_warm(sess: Session, opts: Options, usable: bool) -> tuple[WarmWorker | None, str, Lent | None]:
    """The kernel's warm worker for this GPU cell, if the cell may use it (``usable``), it fits
    and it is still there; else None, with a line saying what became of it ("" when there was
    none, or the notebook moved on: the warm worker is ended and its lease released first). Last,
    whom its GPU was lent to when it was evicted for another request (the cell's queued line says
    so), else None."""
    slot = _slot(sess)
    w = slot.current
    if w is None:
        gone, slot.gone = slot.gone, None
        if gone is not None and usable and not opts.fresh and gone.fits(opts):
            return None, gone.ended_line(), gone.lent
        return None, "", None
    slot.current = None
    if w.suspend_state and usable and not opts.fresh and w.fits(opts):
        # suspended on eviction: the caller takes a new lease and restores the worker onto it
        return (w, "", w.lent) if w.settle() else (None, w.ended_line(), w.lent)
    if not usable or opts.fresh or not w.fits(opts):
        try:  # a cell the server refuses changes nothing, whatever it asked for (a gang, --fresh, --cold)
            _refused(sess, opts)
        except Exception:  # a refusal, or a size it cannot read: nothing was asked, the worker stays
            slot.current = w
            raise
        w.end("--fresh" if opts.fresh else "the notebook's next GPU cell asked for other GPUs")
        # Asked for other GPUs, or for a kind of cell no warm worker serves (a gang, an elastic or an
        # --gpu-mem auto cell): say why its objects are not there. (--fresh and --cold asked for it.)
        if not opts.fresh and (usable or opts.warm):
            return None, f"warm worker on {w.where()} ended: this cell asks for {_asked(opts)} (a cold start)", None
        return None, "", None
    if w.take():
        return w, "", None
    return None, w.ended_line(), w.lent


def keep_warm(
    sess: Session, grant: Grant, world: World, last: WarmWorker | None, gpu_mem: Any = None
) -> WarmWorker | None:
    """After a clean cell: keep its worker and lease for the notebook's next cell (``gpu_mem``:
    the slice size the cell asked for). None when the server will not (the lease is being
    recalled, ...) or the worker is not fit: the caller then ends the worker and releases as usual."""
    import ray

    if grant.lease is None or len(world.ranks) != 1 or grant.ended_elsewhere.is_set():
        return None
    grant.stop_following()
    try:
        # The worker readies itself while the lease server marks the lease warm (one round trip
        # each, side by side); a worker that cannot is ended and the lease released as any cell's.
        ready = world.ranks[0].worker.handle.recycle.remote(warm=True)
        sess.client().warm(grant.lease, on=True)
        if not ray.get(ready, timeout=5):
            with contextlib.suppress(errors.GpuLeaseError):
                sess.client().warm(grant.lease, on=False)
            return None
    except Exception as exc:  # noqa: BLE001 - not kept warm: ended and released as any cell
        log.debug("lease %s not kept warm: %s", grant.lease.id, exc)
        return None
    if grant.held is not None:
        grant.held.activity = {"executing": False, "source": "gpu_train warm"}
    w = WarmWorker(sess, grant, world)
    if gpu_mem is not None:
        w.asked = parse_gpu_mem(gpu_mem)
    if last is not None:
        w.sent = last.sent
    _slot(sess).current = w
    w.follow()
    return w
