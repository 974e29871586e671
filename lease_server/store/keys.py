"""The one Redis key schema of gpulease.

Every key the project uses is built here, under one prefix written as a hash tag
(``{gpulease}:leases``): all of a deployment's keys live in one Redis Cluster slot, as multi-key
scripts require. Lua scripts never build keys: each script declares the keys it uses in its header
(``-- KEYS: leases deadlines ...``, the names of the properties below) and receives exactly those
through ``KEYS[]`` (see ``scripts.py``). To make that possible without per-node or per-lease keys,
state lives in a handful of global structures:

``nodes``      hash   node -> JSON inventory {pool, gpus:[{index, uuid, model, memory_mb}], source}
``alive``      zset   node -> heartbeat deadline (ms); a node past it is down and never granted
``free``       hash   node -> JSON list of free GPU indexes (alive or not)
``fit``        zset   lexicographic "pool|FFFFF|node" (FFFFF = zero-padded free count) for every
                      *alive* node: ZRANGEBYLEX from "[pool|00002|" finds the best fit in O(log N)
``pool_free``  hash   pool -> the free GPUs of its alive nodes: the sum of its ``fit`` counts, kept
                      with each fit entry (fit_put/fit_drop in _lib.lua; layout 6)
``sizes``      zset   lexicographic "pool|TTTTT|node" (total GPUs): the largest node of a pool
``holders``    hash   "node/index" -> lease id, or "~" while the GPU drains (below)
``draining``   hash   "node/index" -> JSON {lease, user, pool, since, state, pids:[{pid, start}]}: a GPU
                      whose lease the server ended (expiry, revoke, reclaim, preemption, shrink) and
                      that is not free until its node agent reports no process of that lease on it
``suspended``  hash   node -> JSON {pid: {pid, start, uid, user, lease, pool, gpu, bytes, since, until}}: the
                      workers of warm leases evicted with their GPU state suspended to host memory
                      (lua/suspend.lua; the node agent records them, drained.lua, and ends or restores
                      them, unsuspend.lua): alive, holding no GPU and no lease
``sliced``     hash   "node/index" -> JSON {pool, total_mb, used_mb, max, leases:{id: MB}, draining:{id: {mb,
                      user, state, since, pids}}, fit}: a GPU shared by slices (its holders entry is
                      "~slices"); used_mb, what its live and draining slices are promised, never
                      exceeds total_mb (lua/_lib_slice.lua)
``slice_fit``  zset   lexicographic "pool|FFFFFFFF|node/index" (F = free MB, zero-padded) for every sliced
                      GPU that can take one more slice: ZRANGEBYLEX from "[pool|<MB>|" is the best fit
``leases``     hash   lease id -> JSON lease record (live leases only)
``deadlines``  zset   lease id -> expires_at (ms)
``ended``      hash   lease id -> JSON record of a released / expired / revoked lease (kept a while)
``ended_at``   zset   lease id -> end time (ms), to trim ``ended``
``queue``      zset   lexicographic "pool|SEQUENCE|waiter id" (FIFO per pool)
``queue_seq``  string counter giving every waiter its place in arrival order
``waiters``    hash   waiter id -> JSON request
``wait_due``   zset   waiter id -> ms of its own deadline: the sweep drops a waiter whose server went
                      away (WAITER_GRACE_MS past it) by range, without reading the queue (layout 5)
``waiting_by`` hash   user -> requests of the user in the queue now (capped: max_queued_per_user)
``usage``      hash   "pool|user" -> JSON {"v":decayed GPU-seconds,"t":ms,"r":GPUs running now}, written in
                      that one layout so the scripts read it with patterns (other layouts: decoded)
``fence``      hash   {e: fencing epoch, n: tokens issued in it}: token = e * 10**9 + n (lua/_lib_schedule.lua)
``events``     stream the audit log / live feed
``grants``     channel on which a grant to a queued waiter is published (waiter id), and "~tokens"
                      when a token is created, revoked or bound (every server drops its token cache)
``tokens``     hash   sha256(api token) -> JSON {user, role, created[, expires, acts_for, node]} (web/auth.py)
``token_used`` hash   sha256(api token) -> epoch seconds of its last use (written at most once a minute)
``layout``     string the version of this data layout (lease_server/store/layout.py); absent before versions
``instance``   string a random id of this deployment, set once: node agents name their claim socket with
                      it (lease_server/node/claims.py), so two deployments on one host never meet

Bookings (bookings.py, book.lua; dispatch enforces them, so most scripts take them). Layouts 0 and 1
named these three ``resv``, ``resv_idx`` and ``resv_due`` (``gpulease migrate`` renames them, see
layout.py); a lease record still names the booking it is served from ``resv``:

``bookings``    hash  booking id -> JSON booking (times in ms, UTC; weekly repeats are 168 h apart)
``booking_idx`` zset  lexicographic "pool|id" for every booking, so a pool's bookings are one range
``booking_due`` zset  booking id -> ms of its next no-show check (or of its removal, when past)
``booking_occ`` zset  lexicographic "pool|SSSSSSSSSSSSSSS|EEEEEEEEEEEEEEE|id|k" (start and end ms,
                      zero-padded) for each occurrence of an active booking that is neither released
                      nor seen ended (layout 7): the bookings in force in a pool are read from the
                      occurrences that started, "[pool|" to "(pool|<now + 1>", not from every booking
                      of the pool; a reader drops the ended ones it meets (active_bookings)
``booking_own`` zset  lexicographic "owner|LLLLLLLLLLLLLLL|id" (L: the end of its last occurrence) for
                      each active booking whose last occurrence was not released: an owner's bookings
                      not yet ended are one ZLEXCOUNT (booking_max_per_owner, book.lua)
``recall``     zset   borrowed lease id -> ms when it is revoked because a booking's holder needs it

Scheduling:

``lease_util`` hash   "<lease id>|n|busy|sum|peak" -> the agent's samples of a live lease's GPUs
``ledger``     stream one entry per ended lease: who, notebook, cell, pool, GPUs, held, utilization
``rollup``     hash   "HHHHHHH|pool|user" (H: hours since the epoch, UTC, zero-padded) -> JSON {n, held,
                      sampled, used, warm, wait_ms, wh:{bucket: count}, reclaimed, evicted, warm_cells,
                      teams}: the hourly usage rollup, summed from the ledger lines of that hour (folded
                      in batches by each sweep, and by a reader before it reads: lua/_lib_end.lua
                      fold_rollups; read by store/rollup.py). At most 5000
                      rows an hour ("~other" beyond), kept 400 days (layout 4); and "~total|pool" ->
                      the pool's running totals of every lease ended (GET /metrics' counters; not in
                      rollup_idx)
``rollup_idx`` zset   lexicographic "HHHHHHH|pool|user" for every rollup row: a range of hours is one
                      ZRANGEBYLEX, never a scan
``rollup_at``  string the id of the last ledger entry folded into the rollups (absent: none yet)
``held_by``    hash   "pool|user" and "pool|team:NAME" -> GPUs held now (quotas), and "pool|user|m",
                      "pool|team:NAME|m" -> milli-GPUs held now as slices (a slice counts its
                      fraction of the GPU); "pool|~preemptible" -> preemptible leases live (a blocked
                      request looks for victims only if any)
``sched``      hash   pool -> JSON {scheduler, quotas, preempt_notice_ms, idle_weight, share, slice_unit_mb,
                      max_sharers, slice_busy_pct} from the config
``elastic``    zset   lexicographic "pool|lease id" for every live elastic lease (gpus_min < gpus), so a
                      blocked request finds the pool's leases it may ask to shrink without reading them all
``shrink_due`` zset   elastic lease id -> ms when the server shrinks it to its shrink_to (its owner was
                      asked to give GPUs back for a waiting request and has not yet)
``victims``    zset   lexicographic "pool|C|R|node|lease id" for every live lease a recall may take back
                      (C: w warm, p preemptible, b borrowed, o other, r being recalled; R sorts the
                      newest first, warm leases the largest first): a recall reads the first few of
                      each class, not every lease
                      (lua/_lib.lua victim_member; layout 3)
``evict_miss`` hash   pool -> "n|at_ms|warm": the last warm eviction that found no node where n GPUs
                      could be freed, and the pool's warm leases then; another for n or more is not
                      tried again within a second while they are the same (lua/_lib_recall.lua);
                      "pool|~blocked" -> "least|held node|warm|preemptible|at_ms": the pool's queue
                      found blocked, until something that could serve a waiter happens
                      (lua/_lib_schedule.lua blocked_memo). Both are forgotten when GPUs come free
                      on a node whose free and warm GPUs reach their n (lua/_lib.lua set_free)

Idle-GPU reclaim (reclaim.py, samples.lua):

``samples:<node>/<index>`` list   the GPU's rolling window of samples "ts_ms,util%,mem_mb"
``last``       hash   node/index -> "ts_ms,util,mem_mb" of the newest sample
``busy_at``    hash   node/index -> ms of the newest sample at or above the pool's threshold
``covered_since`` hash node/index -> ms since when the GPU was sampled without a gap
``unleased``   hash   node/index -> JSON {pids, since}: processes on a GPU no live lease holds
``sim``        hash   node/index -> JSON {util, mem_mb, procs}: what a simulated GPU reports
``policy``     hash   pool -> JSON reclaim policy set at run time by an admin
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class Keys:
    prefix: str = "gpulease"

    def _k(self, name: str) -> str:
        # One hash tag for the whole deployment: every key hashes to one slot, so every script (whose
        # keys must share a slot) runs on a Redis Cluster or a managed Redis in cluster mode too.
        return f"{{{self.prefix}}}:{name}"

    def pattern(self) -> str:
        """A SCAN pattern that matches every key of this prefix."""
        return self._k("*")

    def untagged(self, key: str) -> str:
        """The name ``key`` had before keys carried the hash tag ("gpulease:leases")."""
        return self.prefix + key[len(self.prefix) + 2 :]

    @property
    def nodes(self) -> str:
        return self._k("nodes")

    @property
    def alive(self) -> str:
        return self._k("alive")

    @property
    def free(self) -> str:
        return self._k("free")

    @property
    def fit(self) -> str:
        return self._k("fit")

    @property
    def sizes(self) -> str:
        return self._k("sizes")

    @property
    def holders(self) -> str:
        return self._k("holders")

    @property
    def draining(self) -> str:
        return self._k("draining")

    @property
    def suspended(self) -> str:
        return self._k("suspended")

    @property
    def sliced(self) -> str:
        return self._k("sliced")

    @property
    def pool_free(self) -> str:
        return self._k("pool_free")

    @property
    def slice_fit(self) -> str:
        return self._k("slice_fit")

    @property
    def leases(self) -> str:
        return self._k("leases")

    @property
    def deadlines(self) -> str:
        return self._k("deadlines")

    @property
    def ended(self) -> str:
        return self._k("ended")

    @property
    def ended_at(self) -> str:
        return self._k("ended_at")

    @property
    def queue(self) -> str:
        return self._k("queue")

    @property
    def waiters(self) -> str:
        return self._k("waiters")

    @property
    def wait_due(self) -> str:
        return self._k("wait_due")

    @property
    def waiting_by(self) -> str:
        return self._k("waiting_by")

    @property
    def layout(self) -> str:
        return self._k("layout")

    @property
    def instance(self) -> str:
        return self._k("instance")

    @property
    def usage(self) -> str:
        return self._k("usage")

    @property
    def fence(self) -> str:
        return self._k("fence")

    @property
    def queue_seq(self) -> str:
        return self._k("queue_seq")

    @property
    def events(self) -> str:
        return self._k("events")

    @property
    def grants(self) -> str:
        return self._k("grants")

    @property
    def bookings(self) -> str:
        return self._k("bookings")

    @property
    def booking_idx(self) -> str:
        return self._k("booking_idx")

    @property
    def booking_due(self) -> str:
        return self._k("booking_due")

    @property
    def booking_occ(self) -> str:
        return self._k("booking_occ")

    @property
    def booking_own(self) -> str:
        return self._k("booking_own")

    @property
    def recall(self) -> str:
        return self._k("recall")

    @property
    def victims(self) -> str:
        return self._k("victims")

    @property
    def evict_miss(self) -> str:
        return self._k("evict_miss")

    @property
    def lease_util(self) -> str:
        return self._k("lease_util")

    @property
    def ledger(self) -> str:
        return self._k("ledger")

    @property
    def rollup(self) -> str:
        return self._k("rollup")

    @property
    def rollup_idx(self) -> str:
        return self._k("rollup_idx")

    @property
    def rollup_at(self) -> str:
        return self._k("rollup_at")

    @property
    def held_by(self) -> str:
        return self._k("held_by")

    @property
    def sched(self) -> str:
        return self._k("sched")

    @property
    def elastic(self) -> str:
        return self._k("elastic")

    @property
    def shrink_due(self) -> str:
        return self._k("shrink_due")

    @property
    def tokens(self) -> str:
        return self._k("tokens")

    @property
    def token_used(self) -> str:
        return self._k("token_used")

    def samples(self, slot: str) -> str:
        """The sample window of one GPU, ``slot`` = "node/index" (passed to Lua via KEYS[])."""
        return self._k(f"samples:{slot}")

    @property
    def last(self) -> str:
        return self._k("last")

    @property
    def busy_at(self) -> str:
        return self._k("busy_at")

    @property
    def covered_since(self) -> str:
        return self._k("covered_since")

    @property
    def unleased(self) -> str:
        return self._k("unleased")

    @property
    def sim(self) -> str:
        return self._k("sim")

    @property
    def policy(self) -> str:
        return self._k("policy")

    def core(self) -> list[str]:
        """Every key of the lease life cycle (what a replay deletes when it is done)."""
        return [
            self.nodes,
            self.alive,
            self.free,
            self.fit,
            self.pool_free,
            self.sizes,
            self.holders,
            self.leases,
            self.deadlines,
            self.ended,
            self.ended_at,
            self.queue,
            self.waiters,
            self.wait_due,
            self.usage,
            self.fence,
            self.events,
            self.grants,
            self.queue_seq,
            self.bookings,
            self.booking_idx,
            self.booking_due,
            self.booking_occ,
            self.booking_own,
            self.recall,
            self.lease_util,
            self.ledger,
            self.rollup,
            self.rollup_idx,
            self.rollup_at,
            self.held_by,
            self.sched,
            self.elastic,
            self.shrink_due,
            self.draining,
            self.waiting_by,
            self.sliced,
            self.slice_fit,
            self.victims,
            self.evict_miss,
        ]

    def all(self) -> list[str]:
        return self.core() + [
            self.tokens,
            self.token_used,
            self.layout,
            self.last,
            self.busy_at,
            self.covered_since,
            self.unleased,
            self.sim,
            self.policy,
        ]
