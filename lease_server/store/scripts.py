"""The Lua scripts and their calling convention, owned here: one typed wrapper per script.

A script is its own ``lua/<name>.lua`` body after the helpers of ``lua/_lib*.lua`` that it calls
(found by following calls, so ``keep`` carries a few lines and ``acquire`` the scheduler). Its
header declares the keys it uses (``-- KEYS: leases deadlines ...``) and its arguments
(``ARGV[6] = ...``); this module binds the keys as ``K_<NAME>`` locals, and each wrapper below
(:class:`Acquire`, :class:`Release`, ...) is the one place that builds the script's ``ARGV`` and
reads its reply, raising the typed :mod:`errors` exception for a refusal. The server, the
simulator's replay and the benches all call scripts through these wrappers;
``tests/test_scripts.py`` checks every header against its wrapper and the Lua code table against
:class:`Code`.

Every state-changing script takes five common arguments first (:class:`Common`): the virtual
"now" (only the simulator passes one), the event log's length, the fair-share half-life, how
long ended leases stay readable and the fencing epoch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import operator
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any, ClassVar, Generic, NamedTuple, Required, TypedDict, TypeVar, cast

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from .. import errors
from ..protocol import ElasticJson, EndCauseJson, GpuJson
from .keys import Keys

R = TypeVar("R")  # a script call's decoded reply


class Code(enum.IntEnum):
    """A script's first reply element (``lua/_lib.lua`` declares the same table)."""

    OK = 0
    QUEUED = 1
    BUSY = 2
    NO_SUCH = 3
    ENDED = 4
    NOT_OWNER = 5
    STALE = 6
    EXPIRED = 7
    UNKNOWN_POOL = 8
    UNSATISFIABLE = 9
    DUPLICATE = 10
    UNKNOWN_NODE = 11
    REMOVED = 12
    LIMIT = 13
    NOT_DUE = 14
    CLASH = 15
    WARNED = 16
    INVALID = 17  # the request names something the lease does not have


# ---- assembling a script from its body and the helpers it calls -----------------------------------

_LIB = "_lib"
_CHUNK_START = re.compile(r"^local (?:function )?([A-Za-z_][A-Za-z0-9_]*)\b")
_NAME = re.compile(r"(?<![.:'\"\w])[A-Za-z_][A-Za-z0-9_]*\b")  # not a field (.name) nor a quoted word
_KEYREF = re.compile(r"\bK_([A-Z_]+)\b")
_KEYS_HEADER = re.compile(r"^-- KEYS: ([a-z_ ]+)$", re.M)


def _lua(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def _code_only(text: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


# The helper files, in the order a script or the library defines them (lua/_lib.lua says which
# subject each holds): a helper calls only helpers of its own file above it, or of earlier files.
LIB_FILES = (
    "_lib",
    "_lib_bookings",
    "_lib_slice",
    "_lib_recall",
    "_lib_schedule",
    "_lib_drain",
    "_lib_warm",
    "_lib_end",
    "_lib_resize",
)


@functools.cache
def _library() -> tuple[str, list[tuple[str, str]]]:
    """The helper files as (``_lib.lua``'s preamble, always included; [(helper name, its text)] in
    :data:`LIB_FILES` order, each file in its order). A helper starts at a top-level ``local
    function NAME`` / ``local NAME =`` line, with the comment lines just above it; a file's own
    header (the comments before its first helper, apart from it by a blank line) is left out."""
    preamble = ""
    chunks: list[tuple[str, str]] = []
    for file in LIB_FILES:
        lines = _lua(file).splitlines(keepends=True)
        starts: list[tuple[int, str]] = []
        for i, line in enumerate(lines):
            m = _CHUNK_START.match(line)
            if m and line.startswith("local function"):
                starts.append((i, m.group(1)))
            elif m and not starts:
                if file != _LIB:
                    raise ValueError(f"lua/{file}.lua: {line.strip()!r} before its first helper; locals go in _lib.lua")
                continue  # the preamble's own locals (codes, NOW, ...)
            elif m:
                starts.append((i, m.group(1)))
        bounds: list[tuple[int, str]] = []
        for i, name in starts:
            j = i
            while j > 0 and lines[j - 1].startswith("--"):
                j -= 1
            bounds.append((j, name))
        if file == _LIB:
            preamble = "".join(lines[: bounds[0][0]])
        chunks += [
            (name, "".join(lines[j : bounds[k + 1][0] if k + 1 < len(bounds) else len(lines)]))
            for k, (j, name) in enumerate(bounds)
        ]
    names = [name for name, _ in chunks]
    if len(set(names)) != len(names):
        raise ValueError(
            f"a helper is defined twice in lua/_lib*.lua: {sorted({n for n in names if names.count(n) > 1})}"
        )
    return preamble, chunks


def _helpers_for(body: str) -> list[str]:
    """The helpers ``body`` calls, directly or through other helpers, in the library's order."""
    _, chunks = _library()
    text = dict(chunks)
    wanted: set[str] = set()
    todo = [n for n in _NAME.findall(_code_only(body)) if n in text]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        todo += [n for n in _NAME.findall(_code_only(text[name])) if n in text and n not in wanted]
    return [name for name, _ in chunks if name in wanted]


def declared_keys(name: str) -> tuple[str, ...]:
    """The keys ``lua/<name>.lua`` declares in its header, in KEYS[] order."""
    m = _KEYS_HEADER.search(_lua(name))
    if m is None:
        raise ValueError(f"lua/{name}.lua declares no '-- KEYS: ...' line")
    return tuple(m.group(1).split())


@functools.cache
def source(name: str) -> str:
    """The whole Lua text run for script ``name``: key bindings, the preamble, the helpers it
    calls, its body. A standalone script (``STANDALONE``) is its body alone."""
    body = _lua(name)
    if name in STANDALONE:
        return body
    preamble, chunks = _library()
    keys = declared_keys(name)
    binding = "local " + ", ".join(f"K_{k.upper()}" for k in keys) + " = "
    binding += ", ".join(f"KEYS[{i}]" for i in range(1, len(keys) + 1)) + "\n"
    helpers = dict(chunks)
    return binding + preamble + "".join(helpers[h] for h in _helpers_for(_BEGIN + body)) + _BEGIN + body


_BEGIN = "\nbegin()\n"  # the call's common arguments (lua/_lib.lua begin), before the body


@functools.cache
def library() -> tuple[str, str]:
    """The Redis Functions library of every script: (its name, its code for ``FUNCTION LOAD``).

    The helpers of ``lua/_lib*.lua`` are defined once, when the library loads, and each script is a
    function ``<library>_<script>`` called with ``FCALL``. The library's name carries a hash of
    its code, so servers of two releases on one Redis (a rolling upgrade) each call their own.

    The helpers read the call's keys and common arguments as the library's locals (``K_<NAME>``,
    ``KEYS``, ``ARGV``, ``NOW``...): each function sets all of them before its body runs, the
    keys a script does not declare to nil."""
    preamble, chunks = _library()
    names = [n for n in SCRIPT_NAMES if n not in STANDALONE]
    all_keys = sorted({k for n in names for k in declared_keys(n)})
    out = ["local KEYS, ARGV\n", "local " + ", ".join(f"K_{k.upper()}" for k in all_keys) + "\n"]
    out += [preamble, *(text for _, text in chunks)]
    for name in SCRIPT_NAMES:
        out.append(f"\nlocal function script_{name}()\n{_lua(name)}\nend\n")
    digest = hashlib.sha1("".join(out).encode()).hexdigest()[:12]
    lib = f"gpulease_{digest}"
    for name in SCRIPT_NAMES:
        keys = () if name in STANDALONE else declared_keys(name)
        bind = [f"K_{k.upper()} = keys[{i}]" for i, k in enumerate(keys, 1)]
        bind += [f"K_{k.upper()} = nil" for k in all_keys if k not in keys]
        begin = "" if name in STANDALONE else "  begin()\n"
        out.append(
            f"redis.register_function('{lib}_{name}', function(keys, args)\n  KEYS, ARGV = keys, args\n"
            f"  {'; '.join(bind) if bind else ''}\n{begin}  return script_{name}()\nend)\n"
        )
    return lib, f"#!lua name={lib}\n" + "".join(out)


def used_keys(name: str) -> set[str]:
    """The keys the assembled script really refers to (``K_<NAME>``), lower-cased."""
    text = source(name)
    return {k.lower() for k in _KEYREF.findall(_code_only(text.split("\n", 1)[1]))}


# ---- the calling convention ------------------------------------------------------------------------


@dataclass(frozen=True)
class Common:
    """The five arguments every state-changing script takes first (``ARGV[1..5]``)."""

    now_ms: int | None  # a virtual clock (the simulator); None: Redis TIME
    event_log_max: int
    half_life_s: float
    retention_ms: int
    epoch: int = 0  # the fencing epoch (engine.fencing_epoch): folded into every fencing token

    def argv(self) -> list[Any]:
        now = "" if self.now_ms is None else self.now_ms
        return [now, self.event_log_max, self.half_life_s, self.retention_ms, self.epoch]


def _wire(value: Any) -> Any:
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return ""
    return value


_GETTERS: dict[type, Any] = {}


def _getter(cls: type) -> Any:
    """The call's fields in ARGV order, read in one go (the replay builds millions of calls)."""
    get = _GETTERS.get(cls)
    if get is None:
        names = [f.name for f in dataclasses.fields(cls)]
        one = operator.attrgetter(*names)
        get = _GETTERS[cls] = one if len(names) > 1 else (lambda obj: (one(obj),))
    return get


class ScriptCall(Generic[R]):
    """One call of one script: its fields are the script's own ARGV (from ``ARGV[6]``), in order;
    ``R`` is the type of its decoded reply (what :meth:`Engine.run` returns for it)."""

    script: ClassVar[str]

    def argv(self) -> list[Any]:
        return [_wire(v) for v in _getter(type(self))(self)]

    def reply(self, code: Code, rest: list[Any]) -> R:
        raise NotImplementedError

    def unexpected(self, code: Code) -> errors.GpuLeaseError:
        return errors.GpuLeaseError(f"unexpected reply {code.name} from {self.script}.lua")

    def refused(self, code: Code, rest: list[Any]) -> errors.GpuLeaseError:
        """The error for a refusal of ``owned_lease`` (lua/_lib.lua), the preamble of every script
        that acts on one lease ``self.id``: it ended (or expired here), is no one's, is another
        user's, or the token is stale. Any other code is unexpected."""
        lease_id: str = getattr(self, "id", "")
        if code in (Code.ENDED, Code.EXPIRED):
            return _ended(lease_id, rest[0])
        if code is Code.NO_SUCH:
            return no_such_lease(lease_id)
        if code is Code.NOT_OWNER:
            return _not_owner(lease_id)
        if code is Code.STALE:
            return _stale(lease_id)
        return self.unexpected(code)


def _json(raw: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(raw)
    return out


class LeaseRecord(TypedDict, total=False):
    """A lease as the Lua keeps it (``leases`` and ``ended`` hashes; times in ms): every field the
    scripts write, declared once (tests/test_scripts.py checks the two agree). The API's view of it
    is :class:`protocol.LeaseJson`, built by ``leasing.lease.public_lease``."""

    id: Required[str]
    token: Required[int]
    user: Required[str]
    pool: Required[str]
    node: Required[str]
    gpus: Required[list[GpuJson]]
    state: Required[str]
    ttl_ms: Required[int]
    created_at: Required[int]
    expires_at: Required[int]
    label: str
    session: str
    notebook: str
    cell: str
    teams: str  # comma-separated: a "team:NAME" booking serves its members
    priority: int
    renewed_at: int
    renewals: int
    waited_ms: int
    nodes: list[str]  # a multi-node gang's
    resv: str  # the booking it is served from (the stored field keeps its first name: keys.py)
    borrowed: bool
    preemptible: bool
    elastic: ElasticJson
    gpu_ms: float  # GPU-time held at earlier sizes (an elastic lease)
    sized_at: int
    activity: dict[str, Any]
    activity_at: int
    procs: list[dict[str, Any]]
    warned_at: int
    reclaim_at: int
    kept_at: int
    extensions: int
    idle_evidence: dict[str, Any]
    recall_at: int
    recall_reason: str
    recall_code: str
    recall_why: str
    recall_for: str  # the user whose request its GPUs go to
    recalled_at: int  # since when it is being recalled
    ends_by: int  # its holder means to end it by then (declared at the acquire: a cell's --timeout)
    shrink_to: int
    shrink_by: int
    shrink_reason: str
    gpu_mem_mb: int  # a slice: MB of its GPU promised to it (lua/_lib_slice.lua)
    gpu_total_mb: int  # a slice: the memory of its GPU
    mem_peak_mb: int  # ended: the most memory it used, as its node agent measured it (_lib_end.lua)
    over_memory: dict[str, float]  # a slice ended for using more than it was promised (over_memory.lua)
    warm_since: int
    warm_until: int
    suspend_until: int  # ended with its worker suspended (suspend.lua): the worker ends then (warm_max)
    warm_ms: float
    warm_cells: int  # cells run again on it while warm (warm.lua): the usage rollups count them
    ended_at: int
    end_reason: str
    ended_by: str
    cause: EndCauseJson


def lease_record(raw: Any) -> LeaseRecord:
    """A lease record from its stored JSON (or a script's reply)."""
    return cast(LeaseRecord, json.loads(raw))


def no_such_lease(lease_id: str) -> errors.NoSuchLease:
    return errors.NoSuchLease(
        f"no lease {lease_id!r}: it never existed or ended long ago; list yours with GET /api/v1/leases"
    )


def _not_owner(lease_id: str) -> errors.NotOwner:
    return errors.NotOwner(f"lease {lease_id} belongs to another user; only its owner or an admin may change it")


def _stale(lease_id: str) -> errors.StaleToken:
    return errors.StaleToken(
        f"the token given for lease {lease_id} is not its current fencing token: "
        "you hold an older grant; acquire a new lease"
    )


def _ended(lease_id: str, raw: Any) -> errors.LeaseEnded:
    ended = _json(raw)
    cls = errors.LeaseExpired if ended["state"] == "expired" else errors.LeaseEnded
    return cls(
        f"lease {lease_id} has {ended['state']} ({ended.get('end_reason', '')}); its GPUs may "
        "belong to someone else now: acquire a new lease",
        state=ended["state"],
    )


# ---- acquire ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Granted:
    lease: LeaseRecord


@dataclass(frozen=True)
class Queued:
    position: int


@dataclass(frozen=True)
class Duplicate:
    """The id is taken: a resent request whose grant already happened, or a clash of ids."""


@dataclass(frozen=True)
class Acquire(ScriptCall[Granted | Queued | Duplicate]):
    script: ClassVar[str] = "acquire"
    # The free-text fields a request sets as it is (checked as text, passed on by name): a new one
    # is a field here, its line in the script, and its field in the request (request.AcquireRequest).
    TEXT: ClassVar[tuple[str, ...]] = ("label", "session", "notebook", "cell")
    id: str
    user: str
    pool: str
    gpus: int
    ttl_ms: int
    wait_ms: int  # 0: do not queue
    label: str = ""
    session: str = ""
    teams: str = ""  # comma-separated
    priority: int = 1
    gpus_min: int = 0  # 0: = gpus (not elastic)
    nodes: int = 1
    notebook: str = ""
    cell: str = ""
    max_queued: int = 256  # the most requests one user may have waiting in the queue
    gpu_mem_mb: int = 0  # a slice: MB of one GPU's memory (0: whole GPUs)
    prefer_node: str = ""  # a node to take the GPUs on if it has them free ("": best fit alone)
    ends_within_ms: int = 0  # ms after the grant by which its holder means to end it (0: none declared)

    def argv(self) -> list[Any]:
        out = super().argv()
        out[10] = self.gpus_min or self.gpus
        return out

    def reply(self, code: Code, rest: list[Any]) -> Granted | Queued | Duplicate:
        if code is Code.OK:
            return Granted(lease_record(rest[0]))
        if code is Code.QUEUED:
            return Queued(int(rest[0]))
        if code is Code.DUPLICATE:
            return Duplicate()
        if code is Code.INVALID and rest and rest[0] == "share":
            raise errors.no_slices(self.pool)
        if code is Code.INVALID:  # "memory", the MB of one GPU of the pool
            raise errors.BadRequest(
                f"a slice of {self.gpu_mem_mb} MB is more than one GPU of pool {self.pool!r} has ({rest[1]} MB): "
                f"ask for at most {rest[1]} MB, or for whole GPUs (drop gpu_mem_mb)",
                pool=self.pool,
                gpu_mem_mb=self.gpu_mem_mb,
                largest_mb=int(rest[1]),
            )
        if code is Code.BUSY and self.gpu_mem_mb:
            raise errors.NoCapacity(
                f"no GPU in pool {self.pool!r} has {self.gpu_mem_mb} MB free for a slice now; pass wait "
                "(seconds) to queue for it, or ask for a smaller slice",
                pool=self.pool,
                most_free_on_a_node=int(rest[0]),
                position=0,
            )
        if code is Code.BUSY:
            lent = len(rest) > 1 and int(rest[1]) == 1
            hint = (
                "your booking's GPUs are lent out: pass wait (at least the booking's recall "
                "notice) and they are recalled for you"
                if lent
                else "pass wait (seconds) to queue for them"
            )
            raise errors.NoCapacity(
                f"no node in pool {self.pool!r} has {self.gpus} free GPU(s) now (the most free on one node: "
                f"{rest[0]}); {hint}",
                pool=self.pool,
                most_free_on_a_node=int(rest[0]),
                position=0,
            )
        if code is Code.LIMIT:
            raise errors.TooMany(
                f"{self.user} already has {rest[0]} requests waiting in the queue, the most one user may "
                f"({self.max_queued}); wait for some to be granted, or withdraw some (gpulease status "
                "lists them; gpulease release ID withdraws one)",
                queued=int(rest[0]),
                limit=self.max_queued,
            )
        if code is Code.UNKNOWN_POOL:
            raise errors.UnknownPool(f"unknown pool {self.pool!r}", pool=self.pool)
        if code is Code.UNSATISFIABLE and self.nodes > 1:
            raise errors.Unsatisfiable.gang(self.pool, self.nodes, self.gpus // self.nodes, int(rest[1]))
        if code is Code.UNSATISFIABLE:
            raise errors.Unsatisfiable.one_node(
                self.pool, self.gpus, int(rest[0]), int(rest[2]) if len(rest) > 2 else None
            )
        raise self.unexpected(code)


# ---- the queue, renewal, release -------------------------------------------------------------------


@dataclass(frozen=True)
class Removed:
    """A queued request left the queue (withdrawn, timed out): where it stood."""

    position: int
    waiter: dict[str, Any] | None = None


@dataclass(frozen=True)
class CancelWait(ScriptCall[Granted | Removed]):
    script: ClassVar[str] = "cancel_wait"
    id: str
    reason: str  # "timeout" | "cancelled"
    user: str

    def reply(self, code: Code, rest: list[Any]) -> Granted | Removed:
        if code is Code.OK:
            return Granted(lease_record(rest[0]))
        if code is Code.REMOVED:
            return Removed(int(rest[0]))
        if code is Code.NO_SUCH:
            raise errors.NoSuchLease(f"request {self.id} is not queued")
        if code is Code.NOT_OWNER:
            raise _not_owner(self.id)
        raise self.unexpected(code)


@dataclass(frozen=True)
class Renew(ScriptCall[LeaseRecord]):
    script: ClassVar[str] = "renew"
    id: str
    token: str
    user: str
    admin: bool
    ttl_ms: int  # 0: the lease's own ttl
    activity: str = ""  # JSON {"executing": ..., "source": ...} or ""

    def reply(self, code: Code, rest: list[Any]) -> LeaseRecord:
        if code is Code.OK:
            return lease_record(rest[0])
        raise self.refused(code, rest)


@dataclass(frozen=True)
class Ended:
    """A release's answer: the ended record, and whether this call ended it (else it had ended)."""

    record: LeaseRecord
    changed: bool


@dataclass(frozen=True)
class Release(ScriptCall[Ended | Removed]):
    script: ClassVar[str] = "release"
    id: str
    token: str  # "": ownership alone suffices
    user: str
    admin: bool
    state: str  # "released" | "revoked" | "auto"
    reason: str
    revoke_reason: str = ""  # for "auto": the reason if it turns out to be a revoke
    withdraw_reason: str = ""  # for a queued request ("": "withdrawn by its owner" / "by admin USER")
    verified: bool = False  # the caller saw the lease's named processes gone: no draining

    def reply(self, code: Code, rest: list[Any]) -> Ended | Removed:
        if code in (Code.OK, Code.ENDED):
            return Ended(lease_record(rest[0]), code is Code.OK)
        if code is Code.REMOVED:
            return Removed(int(rest[0]), _json(rest[1]))
        raise self.refused(code, rest)


@dataclass(frozen=True)
class Handed:
    """A handoff's answer: the lease it ended and the lease it granted in the same step."""

    ended: LeaseRecord
    lease: LeaseRecord


@dataclass(frozen=True)
class Handoff(ScriptCall[Handed]):
    """End lease ``id`` and grant its GPUs to its owner's queued request ``to`` in one step, when
    releasing could not have given them to anyone else (``lua/handoff.lua``); else change nothing
    and raise :class:`errors.Conflict` saying why."""

    script: ClassVar[str] = "handoff"
    id: str
    token: str
    user: str
    to: str  # the requests it may go to, comma-separated

    def reply(self, code: Code, rest: list[Any]) -> Handed:
        if code is Code.OK:
            return Handed(lease_record(rest[0]), lease_record(rest[1]))
        if code is Code.BUSY:
            raise errors.Conflict(f"lease {self.id} was not handed on: {rest[0]}; release it instead")
        raise self.refused(code, rest)


@dataclass(frozen=True)
class Resize(ScriptCall[LeaseRecord]):
    """Grow or shrink the owner's live lease ``id`` on its own node by ``gpus`` (``lua/resize.lua``):
    ``gpus > 0`` adds that many to an elastic lease, all or none, when that delays no one;
    ``gpus < 0`` gives back its highest-indexed GPUs (at least one stays: to give back all,
    release), offered to the queue at once. Else nothing changes and :class:`errors.Conflict` says
    why. The reply is the lease, its token unchanged. Unlike the other scripts, a resize resent
    after a lost answer changes the size again, unless it names the ``size`` it saw (the client
    always does): then a resend answers as done."""

    script: ClassVar[str] = "resize"
    id: str
    token: str
    user: str
    gpus: int  # > 0: GPUs to add; < 0: GPUs to give back
    size: int | None = None  # the GPUs the caller saw it hold: a resend is then harmless

    def reply(self, code: Code, rest: list[Any]) -> LeaseRecord:
        if code is Code.OK:
            return lease_record(rest[0])
        if code is Code.BUSY:
            did = f"did not {'grow' if self.gpus > 0 else 'shrink'} by {abs(self.gpus)} GPU(s)"
            raise errors.Conflict(f"lease {self.id} {did}: {rest[0]}; nothing changed")
        raise self.refused(code, rest)


class SweepCounts(NamedTuple):
    """What a sweep did (summed over the batches of one pass)."""

    expired: int = 0  # leases past their deadline
    nodes_down: int = 0  # nodes whose heartbeat ran out
    waiters_dropped: int = 0  # queued requests whose server went away
    trimmed: int = 0  # ended records past their retention
    recalled: int = 0  # borrowed leases revoked when their recall notice ran out
    booking_checks: int = 0  # no-show checks of bookings
    shrunk: int = 0  # elastic leases shrunk when their shrink notice ran out
    folded: int = 0  # ledger lines folded into the hourly rollups

    def plus(self, other: SweepCounts) -> SweepCounts:
        return SweepCounts(*(a + b for a, b in zip(self, other, strict=True)))


@dataclass(frozen=True)
class Sweep(ScriptCall[SweepCounts]):
    script: ClassVar[str] = "sweep"
    limit: int
    waiter_grace_ms: int

    def reply(self, code: Code, rest: list[Any]) -> SweepCounts:
        if code is not Code.OK:
            raise self.unexpected(code)
        return SweepCounts(*(int(x) for x in rest))


@dataclass(frozen=True)
class Fold(ScriptCall[int]):
    """Fold up to ``limit`` ledger lines written since the last fold into the hourly rollups; the
    reply is how many were read (``limit``: more may wait)."""

    script: ClassVar[str] = "fold"
    limit: int

    def reply(self, code: Code, rest: list[Any]) -> int:
        if code is not Code.OK:
            raise self.unexpected(code)
        return int(rest[0])


@dataclass(frozen=True)
class Register(ScriptCall[str]):
    script: ClassVar[str] = "register"
    node: str
    inventory: str  # JSON, or "" for a heartbeat of a registered node
    alive_ms: int

    def reply(self, code: Code, rest: list[Any]) -> str:
        if code is Code.OK:
            return str(rest[0])  # "up" | "registered" | "alive"
        if code is Code.UNKNOWN_NODE:
            raise errors.UnknownNode(f"node {self.node!r} is not registered: send its inventory first")
        raise self.unexpected(code)


# ---- idle reclaim ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class IdleWarn(ScriptCall[dict[str, Any] | None]):
    """Warn an idle lease's holder. ``reply`` is the warned lease, or None when there is nothing to
    do (released meanwhile, renewed into a newer grant, already warned)."""

    script: ClassVar[str] = "idle_warn"
    id: str
    token: str
    grace_ms: int
    evidence: str  # JSON

    def reply(self, code: Code, rest: list[Any]) -> dict[str, Any] | None:
        if code is Code.OK:
            return _json(rest[0])
        if code in (Code.NO_SUCH, Code.STALE, Code.WARNED):
            return None
        raise self.unexpected(code)


@dataclass(frozen=True)
class Reclaim(ScriptCall[dict[str, Any] | None]):
    """Take back a warned lease. ``reply``: its ended record, or None when it was released, renewed
    into a newer grant or kept meanwhile."""

    script: ClassVar[str] = "reclaim"
    id: str
    token: str
    evidence: str  # JSON

    def reply(self, code: Code, rest: list[Any]) -> dict[str, Any] | None:
        if code is Code.OK:
            return _json(rest[0])
        if code in (Code.NO_SUCH, Code.STALE, Code.NOT_DUE):
            return None
        raise self.unexpected(code)


@dataclass(frozen=True)
class Keep(ScriptCall[LeaseRecord]):
    script: ClassVar[str] = "keep"
    id: str
    user: str
    admin: bool
    max_extensions: int
    auto: bool = False  # the reclaimer clears the warning (the GPUs got busy): no extension used

    def argv(self) -> list[Any]:
        return [self.id, self.user, _wire(self.admin), self.max_extensions, "auto" if self.auto else ""]

    def reply(self, code: Code, rest: list[Any]) -> LeaseRecord:
        if code is Code.OK:
            return lease_record(rest[0])
        if code is Code.LIMIT:
            raise errors.Conflict(
                f"lease {self.id} was already kept {rest[0]} times, the most its pool allows; "
                "use the GPUs, or release them and acquire again when you need them",
                extensions=int(rest[0]),
            )
        if code is Code.ENDED:
            raise errors.LeaseEnded(f"lease {self.id} has ended ({_json(rest[0]).get('end_reason', '')})")
        if code is Code.NO_SUCH:
            raise no_such_lease(self.id)
        if code is Code.NOT_OWNER:
            raise _not_owner(self.id)
        raise self.unexpected(code)


# ---- draining: the processes of a lease, and GPUs reported clean -------------------------------------


@dataclass(frozen=True)
class Warm(ScriptCall[LeaseRecord]):
    """The owner keeps a finished cell's lease warm (``on``: its worker stays for the next cell,
    its GPUs lent to whoever would otherwise wait), or runs a cell on it again (not ``on``)."""

    script: ClassVar[str] = "warm"
    id: str
    token: str
    user: str
    on: bool

    def argv(self) -> list[Any]:
        return [self.id, self.token, self.user, _wire(self.on)]

    def reply(self, code: Code, rest: list[Any]) -> LeaseRecord:
        if code is Code.OK:
            return lease_record(rest[0])
        if code is Code.BUSY:
            what = "kept warm" if self.on else "run again"
            raise errors.Conflict(f"lease {self.id} cannot be {what}: {rest[0]}; release it and acquire again")
        raise self.refused(code, rest)


@dataclass(frozen=True)
class Suspend(ScriptCall[LeaseRecord]):
    """The owner of a warm one-GPU lease hands it back with its worker suspended off the GPU, not
    ended (``lua/suspend.lua``): the lease ends and its GPU drains as a suspend. Reply: the ended
    record; refused (:class:`errors.Conflict`) where the worker cannot be suspended."""

    script: ClassVar[str] = "suspend"
    id: str
    token: str
    user: str

    def reply(self, code: Code, rest: list[Any]) -> LeaseRecord:
        if code is Code.OK:
            return lease_record(rest[0])
        if code is Code.BUSY:
            raise errors.Conflict(f"lease {self.id} cannot be suspended: {rest[0]}; release it instead")
        raise self.refused(code, rest)


@dataclass(frozen=True)
class Unsuspend(ScriptCall[dict[str, Any] | None]):
    """A node agent is done with a suspended worker: ``what`` "restored" (``detail``: JSON
    {lease, gpus, ms} of the new lease) or "ended" (``detail``: why). Reply: its entry, None
    when there was none (``lua/unsuspend.lua``)."""

    script: ClassVar[str] = "unsuspend"
    node: str
    pid: int
    what: str
    detail: str

    def reply(self, code: Code, rest: list[Any]) -> dict[str, Any] | None:
        if code is Code.OK:
            return _json(rest[0])
        if code is Code.NO_SUCH:
            return None
        raise self.unexpected(code)


@dataclass(frozen=True)
class Procs(ScriptCall[LeaseRecord]):
    """The holder names the processes on its lease's GPUs (``procs``: JSON list of
    ``{node, pid, start, gpus}``): what the node agent must see gone if the server ends the lease."""

    script: ClassVar[str] = "procs"
    id: str
    token: str
    user: str
    procs: str

    def reply(self, code: Code, rest: list[Any]) -> LeaseRecord:
        if code is Code.OK:
            return lease_record(rest[0])
        if code is Code.INVALID:
            where = f"GPU {rest[1]} of node {rest[0]}" if len(rest) > 1 else f"node {rest[0]}"
            raise errors.BadRequest(
                f"lease {self.id} holds no {where}: name only the nodes and GPUs of the lease (GET it to see them)"
            )
        raise self.refused(code, rest)


@dataclass(frozen=True)
class Drained(ScriptCall[int]):
    """A node agent reports ``gpus`` (JSON list of indexes) of ``node`` clean of ``lease``'s
    processes (``lease`` "": of any): they turn free and the queue is served. Reply: GPUs freed."""

    script: ClassVar[str] = "drained"
    node: str
    lease: str
    gpus: str
    killed: int = 0
    suspended: str = ""  # a suspend's drain: JSON {pid, start, uid, bytes, ms} of the worker suspended

    def reply(self, code: Code, rest: list[Any]) -> int:
        if code is Code.OK:
            return int(rest[0])
        raise self.unexpected(code)


@dataclass(frozen=True)
class OverMemory(ScriptCall[dict[str, Any] | None]):
    """A node agent found slice ``id`` over its memory: ``what`` "warn" (an event its cell shows) or
    "end" (ended with cause ``over_memory``; it drains). Reply: the ended record for "end", None
    for "warn" or when the slice has ended or been granted anew meanwhile (nothing changed)."""

    script: ClassVar[str] = "over_memory"
    id: str
    token: str
    node: str
    what: str
    used_mb: int
    limit_mb: int
    peak_mb: int
    fit_mb: int
    over_s: float
    reason: str
    why: str

    def reply(self, code: Code, rest: list[Any]) -> dict[str, Any] | None:
        if code is Code.OK:
            return _json(rest[0]) if rest else None
        if code in (Code.NO_SUCH, Code.STALE, Code.INVALID):
            return None
        raise self.unexpected(code)


@dataclass(frozen=True)
class MemPeaks(ScriptCall[int]):
    """A node agent's measure of live leases (``peaks``: JSON {lease: [MB now, peak MB]}), kept until
    each ends (its ledger line and ended record carry the peak). Reply: leases recorded."""

    script: ClassVar[str] = "mem_peaks"
    peaks: str

    def reply(self, code: Code, rest: list[Any]) -> int:
        if code is Code.OK:
            return int(rest[0])
        raise self.unexpected(code)


@dataclass(frozen=True)
class UnleasedHold(ScriptCall[int]):
    """Free ``gpus`` (JSON list of indexes) of ``node`` that a process no lease covers uses: held out
    of the pool (draining, of no lease) until a clean sample frees them. Reply: GPUs held now."""

    script: ClassVar[str] = "unleased_hold"
    node: str
    gpus: str

    def reply(self, code: Code, rest: list[Any]) -> int:
        if code is Code.OK:
            return int(rest[0])
        raise self.unexpected(code)


@dataclass(frozen=True)
class DrainAbandon(ScriptCall[int]):
    """A node agent gives up process ``pid`` on draining ``gpus`` of ``node`` (``why``: one line):
    they stay out of service, flagged for an admin. Reply: GPUs flagged now."""

    script: ClassVar[str] = "drain_abandon"
    node: str
    lease: str
    gpus: str
    pid: int
    why: str

    def reply(self, code: Code, rest: list[Any]) -> int:
        if code is Code.OK:
            return int(rest[0])
        raise self.unexpected(code)


# ---- bookings --------------------------------------------------------------------------------------


def fmt(ms: float) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%a %Y-%m-%d %H:%M UTC")


def span(start_ms: float, end_ms: float) -> str:
    """ "Mon 2026-11-23 09:00-11:00 UTC", or both ends in full when they are on different days."""
    a, b = (datetime.fromtimestamp(t / 1000, UTC) for t in (start_ms, end_ms))
    if a.date() == b.date():
        return f"{a:%a %Y-%m-%d %H:%M}-{b:%H:%M} UTC"
    return f"{fmt(start_ms)} - {fmt(end_ms)}"


def clash_error(rec: dict[str, Any], report: dict[str, Any]) -> errors.BookingClash:
    clashes = [
        {
            "id": c["id"],
            "owner": c["owner"],
            "gpus": c["gpus"],
            "start": c["start"] / 1000,
            "end": c["end"] / 1000,
            "note": c.get("note") or "",
        }
        for c in report.get("clashes") or []
    ]
    suggestions = [{"start": s["start"] / 1000, "end": s["end"] / 1000} for s in report.get("suggestions") or []]
    where = f"one node of pool {rec['pool']!r}" if report.get("colocate") else f"pool {rec['pool']!r}"
    text = (
        f"{rec['gpus']} GPU(s) of {where} {span(rec['start'], rec['end'])}"
        + (f" (weekly, {rec['occurrences']} times)" if rec.get("repeat") == "weekly" else "")
        + f" would over-book it ({report['capacity']} can be booked)"
    )
    if clashes:
        seen: dict[str, dict[str, Any]] = {}
        for c in clashes:
            seen.setdefault(c["id"], c)
        text += ": it clashes with " + "; ".join(
            f"{c['owner']}'s {c['gpus']} GPU(s) {span(c['start'] * 1000, c['end'] * 1000)}"
            for c in list(seen.values())[:5]
        )
    moves = " or ".join(span(s["start"] * 1000, s["end"] * 1000) for s in suggestions[:2])
    if report.get("max_gpus", 0) > 0:
        hint = f"Book at most {report['max_gpus']} GPU(s) then" + (f", or move it to {moves}" if moves else "")
    elif moves:
        hint = f"Move it to {moves}"
    else:
        hint = "Pick another time"
    return errors.BookingClash(
        f"{text}. {hint}.",
        clashes=clashes,
        capacity=report["capacity"],
        reserved=report.get("reserved", 0),
        max_gpus=report.get("max_gpus", 0),
        suggestions=suggestions,
    )


@dataclass(frozen=True)
class Book(ScriptCall[dict[str, Any]]):
    script: ClassVar[str] = "book"
    mode: str  # "create" | "edit" | "check"
    booking: str  # JSON, validated by bookings.py
    floor: int  # on-demand GPUs of a pool that are never booked
    rev: str = ""  # for "edit": the revision the change was made against
    share: float = 1.0  # of the bookable GPUs, the most one person may have booked at once (1: no cap)
    people: str = "{}"  # JSON {person: [owners]}: whose share it counts against, and what is theirs
    max_owned: int = 0  # the most bookings not yet over one owner may have (0: no cap)

    def reply(self, code: Code, rest: list[Any]) -> dict[str, Any]:
        rec = _json(self.booking)
        if code is Code.OK:
            return _json(rest[0])
        if code is Code.CLASH:
            raise clash_error(rec, _json(rest[0]))
        if code is Code.LIMIT and rest and rest[0] == "count":
            cap, owned = int(rest[1]), int(rest[2])
            raise errors.Forbidden(
                f"{rec['owner']} has {owned} booking(s) not yet over, and one owner may have at most {cap} "
                f"(booking_max_per_owner {cap}): cancel or end one first, or ask an admin",
                limit=cap,
                bookings=owned,
            )
        if code is Code.LIMIT:
            limit, booked, at = int(rest[0]), int(rest[1]), int(rest[2])
            person = str(rest[3]) if len(rest) > 3 else rec["owner"]
            owner, left = rec["owner"], max(0, limit - booked)
            theirs = _json(self.people).get(person) or [person]
            teams = [o for o in theirs if o != person]
            whose = f" as themselves and as {', '.join(teams)}" if teams else ""
            most = (
                f"{person} may have at most {limit} GPU(s) of pool {rec['pool']!r} booked at once{whose} "
                f"(booking_share {self.share:g})"
            )
            counts = f"{owner}'s booking counts against the share of each member: " if owner != person else ""
            raise errors.Forbidden(
                f"{counts}{most}, and has {booked} booked at {fmt(at)}: book at most {left} then, another time, "
                "or ask an admin"
                if booked
                else f"{counts}{most}: book at most {limit}, or ask an admin",
                limit=limit,
                booked=booked,
            )
        if code is Code.UNKNOWN_POOL:
            raise errors.UnknownPool(f"unknown pool {rec['pool']!r}", pool=rec["pool"])
        if code is Code.UNSATISFIABLE:
            cap, largest = int(rest[0]), int(rest[1])
            if rec.get("colocate") and rec["gpus"] > largest:
                raise errors.Unsatisfiable(
                    f"no node of pool {rec['pool']!r} has {rec['gpus']} GPUs (the largest has {largest}); "
                    "book without colocate, or fewer GPUs",
                    largest_node=largest,
                )
            kept = f" ({self.floor} per pool are kept for on-demand use)" if self.floor else ""
            raise errors.Unsatisfiable(
                f"pool {rec['pool']!r} has {cap} GPU(s) that can be booked{kept}; book at most {cap}",
                capacity=cap,
            )
        if code is Code.DUPLICATE:
            raise errors.Conflict(f"booking id {rec['id']!r} is already in use")
        if code is Code.NO_SUCH:
            raise errors.NoSuchBooking(f"no booking {rec['id']!r}")
        if code is Code.STALE:
            raise errors.StaleToken(f"booking {rec['id']} changed meanwhile")
        if code is Code.ENDED:
            raise errors.Conflict(f"booking {rec['id']} was cancelled; make a new one")
        raise self.unexpected(code)


@dataclass(frozen=True)
class Unbook(ScriptCall[dict[str, Any]]):
    script: ClassVar[str] = "unbook"
    id: str
    action: str  # "cancel" | "end"
    user: str
    admin: bool
    teams: str  # comma-separated
    keep_ms: int  # how long a cancelled booking stays readable

    def reply(self, code: Code, rest: list[Any]) -> dict[str, Any]:
        if code in (Code.OK, Code.ENDED):
            return _json(rest[0])
        if code is Code.NO_SUCH:
            raise errors.NoSuchBooking(f"no booking {self.id!r}; list them with GET /api/v1/bookings")
        if code is Code.NOT_OWNER:
            raise errors.NotOwner(f"booking {self.id} is not yours; only its owner or an admin may change it")
        if code is Code.NOT_DUE:
            raise errors.Conflict(
                f"booking {self.id} is not in force now, so there is nothing to end; cancel it instead"
            )
        raise self.unexpected(code)


# ---- samples (standalone) --------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSample:
    index: int
    util: float
    mem_mb: int
    procs: str  # JSON list of pids


@dataclass(frozen=True)
class Samples:
    """One node agent's sample of its GPUs. Standalone: own ARGV from 1, per-GPU keys after the fixed
    nine; the reply is (samples recorded, GPUs in use by processes no lease holds)."""

    script: ClassVar[str] = "samples"
    FIXED_KEYS: ClassVar[tuple[str, ...]] = (
        "last",
        "busy_at",
        "holders",
        "unleased",
        "events",
        "covered_since",
        "lease_util",
        "draining",
        "sliced",
    )
    now_ms: int | None
    event_log_max: int
    window: int
    threshold: float
    node: str
    gap_ms: int
    gpus: tuple[GpuSample, ...]

    def keys(self, k: Keys) -> list[str]:
        return [getattr(k, name) for name in self.FIXED_KEYS] + [k.samples(f"{self.node}/{g.index}") for g in self.gpus]

    def argv(self) -> list[Any]:
        out: list[Any] = [_wire(self.now_ms), self.event_log_max, self.window, self.threshold, self.node, self.gap_ms]
        for g in self.gpus:
            out += [g.index, g.util, g.mem_mb, g.procs]
        return out

    def reply(self, raw: list[Any]) -> tuple[int, int]:
        return int(raw[0]), int(raw[1])


CALLS: tuple[type[ScriptCall], ...] = (
    Acquire,
    CancelWait,
    Renew,
    Release,
    Handoff,
    Resize,
    Sweep,
    Fold,
    Register,
    IdleWarn,
    Keep,
    Reclaim,
    Book,
    Unbook,
    Procs,
    Warm,
    Suspend,
    Unsuspend,
    Drained,
    DrainAbandon,
    UnleasedHold,
    OverMemory,
    MemPeaks,
)
SCRIPT_NAMES = tuple(c.script for c in CALLS) + (Samples.script,)
STANDALONE = (Samples.script,)  # no prologue, no common ARGV: see its header


class Scripts:
    """The scripts of one Redis connection, called as Redis Functions where the server has them.

    On Redis >= 7 or Valkey, the first call loads :func:`library` (``FUNCTION LOAD``) and every
    call is one ``FCALL`` of the script's function: the helpers are compiled once, not with each
    script. A server without functions (managed Redis 6) answers the load with "unknown command",
    and this connection then uses ``EVALSHA`` of each script's :func:`source` (re-loaded on
    NOSCRIPT) from then on. So does a Redis Cluster: redis-py routes an ``FCALL`` there only after
    asking the cluster for its keys (``COMMAND GETKEYS``), a round trip more per call.

    A function that has gone (``FUNCTION FLUSH``, a fresh server behind the same address) is
    loaded again and the call resent, once."""

    def __init__(self, redis: Redis, keys: Keys, replicas_ack: int = 0, ack_timeout_s: float = 1.0) -> None:
        self._redis = redis
        self._scripts: dict[str, AsyncScript] = {name: redis.register_script(source(name)) for name in SCRIPT_NAMES}
        self._keys = {c.script: [getattr(keys, k) for k in declared_keys(c.script)] for c in CALLS}
        self.keys = keys
        self.replicas_ack, self._ack_timeout_ms = replicas_ack, max(1, int(ack_timeout_s * 1000))
        # True: FCALL; False: EVALSHA; None: not known until the first call
        self.functions: bool | None = False if not hasattr(redis, "fcall") or _is_cluster(redis) else None
        self._lib = library()[0]

    def keys_of(self, script: str) -> list[str]:
        return self._keys[script]

    async def call(self, call: ScriptCall[R], common: Common) -> R:
        """Run ``call`` and return its typed reply (or raise its typed error)."""
        code, rest = await self.raw(call, common)
        return call.reply(code, rest)

    async def raw(self, call: ScriptCall, common: Common) -> tuple[Code, list[Any]]:
        """Run ``call`` and return its code and the rest of the reply, undecoded (tests, benches)."""
        keys, args = self._keys[call.script], common.argv() + call.argv()
        try:
            reply = await self._run(call.script, keys, args, acked=bool(self.replicas_ack and common.now_ms is None))
        except ResponseError as exc:
            if not str(exc).startswith("NOREPLICAS"):
                raise
            # min-replicas-to-write: the primary has too few replicas in sync to take a change (just
            # after a failover, until a replica is back). Nothing was written: the client resends.
            raise errors.ServerUnavailable(f"Redis refuses writes for now ({exc}); retry in a few seconds") from exc
        try:
            code = Code(int(reply[0]))
        except (ValueError, IndexError, TypeError) as exc:
            raise errors.GpuLeaseError(f"script {call.script} returned an unknown reply {reply!r}") from exc
        return code, list(reply[1:])

    async def samples(self, call: Samples) -> tuple[int, int]:
        return call.reply(list(await self._run(Samples.script, call.keys(self.keys), call.argv())))

    async def load(self) -> bool:
        """Load the library unless the server has it; returns whether this server has functions."""
        try:
            await self._redis.function_load(library()[1])
        except ResponseError as exc:
            text = str(exc).lower()
            if "already exists" in text:
                self.functions = True
            elif "unknown command" in text or "unknown subcommand" in text:
                self.functions = False  # Redis < 7: EVALSHA from now on
            else:
                raise
        else:
            self.functions = True
        return self.functions

    async def _run(self, script: str, keys: list[str], args: list[Any], acked: bool = False) -> Any:
        if self.functions is None:
            await self.load()
        for attempt in (1, 2):
            try:
                if acked:
                    return await self._acked(script, keys, args)
                if not self.functions:
                    return await self._scripts[script](keys=keys, args=args)
                return await self._redis.fcall(f"{self._lib}_{script}", len(keys), *keys, *args)  # type: ignore[misc]
            except ResponseError as exc:
                if attempt == 2 or not self.functions or "function not found" not in str(exc).lower():
                    raise
                await self.load()  # flushed, or a new server at this address
        raise AssertionError("unreachable")

    async def _acked(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """The script then WAIT on the same connection (one round trip): the reply counts only once
        ``replicas_ack`` replicas have the change. If they do not within the timeout, the change
        is on the primary alone and a failover could lose it: 503, and the client resends (every
        script is safe to resend)."""
        for attempt in (1, 2):
            pipe = self._redis.pipeline(transaction=False)
            if self.functions:
                pipe.execute_command("FCALL", f"{self._lib}_{script}", len(keys), *keys, *args)
            else:
                pipe.evalsha(self._scripts[script].sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", self.replicas_ack, self._ack_timeout_ms)
            try:
                reply, acked = await pipe.execute()
            except NoScriptError:
                if attempt == 2:
                    raise
                await self._redis.script_load(self._scripts[script].script)
                continue
            except ResponseError as exc:
                if "replica" not in str(exc) or str(exc).startswith("NOREPLICAS"):
                    raise
                # The primary this connection reached was demoted (a failover): nothing is acknowledged.
                why = "Redis is failing over to a new primary; retry in a few seconds"
                raise errors.ServerUnavailable(why) from exc
            if int(acked) < self.replicas_ack:
                raise errors.ServerUnavailable(
                    f"the change reached {acked} of the {self.replicas_ack} Redis replica(s) it must reach "
                    "(replicas_ack) in time; retry in a few seconds"
                )
            return reply
        raise AssertionError("unreachable")


def _is_cluster(redis: Any) -> bool:
    return hasattr(redis, "get_nodes")  # redis.asyncio.cluster.RedisCluster
