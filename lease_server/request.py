"""The requests the API takes as typed objects, each declared once: every field's type, default,
bounds, description and the one-line message a bad value gets.

:class:`AcquireRequest` is the body of ``POST /api/v1/leases``. From its declaration alone:

* the OpenAPI document's ``AcquireRequest`` schema is generated (:meth:`Request.schema`, in
  ``web/openapi.py``), as the ``Lease`` schema is generated from ``protocol.LeaseJson``;
* the web handler parses a JSON body into one (:meth:`Request.parse`): an unknown field, a value of
  the wrong type or out of bounds, a missing required field or a broken rule is a 400 naming the
  field and what would work, before anything changes;
* ``LeaseStore.acquire`` takes one, and holds it to the same declaration (:meth:`Request.check`),
  so a request that Python code builds meets the rules an HTTP one does;
* the Python client builds one and sends :meth:`Request.json`.

A field is ``Annotated[type, Spec(...)]``: ``int`` is a JSON integer, ``float`` a number, ``str`` a
string; a field with a default may be sent as null, which means the default. A bound may name a
server setting (``maximum="max_ttl"``): whoever checks or documents the request reads it from the
settings it is given, and a description or message may quote settings the same way
(``{default_ttl:g}``). Rules beyond single fields (``gpus_min`` at most ``gpus``) are the request's
``RULES``, which the document lists, and its :meth:`Request.rules`, which enforces them.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, fields
from functools import cache, lru_cache
from typing import Annotated, Any, ClassVar, Self, get_args, get_origin, get_type_hints

from . import errors
from .protocol import PRIORITIES, UNSAFE_CHARS

# ---- bounds and patterns shared by the API's requests -----------------------------------------------
# Patterns: ECMA-262 (the OpenAPI document) and Python read them alike: ASCII classes, anchored at both ends.

MAX_GPUS_PER_REQUEST = 1024
MAX_TEXT = 200
MAX_NODES = 64
MAX_GPU_MEM_MB = 16 * 1024 * 1024  # 16 TB: above any GPU's memory (the pool's own GPUs bound a slice)
MAX_ENDS_WITHIN_S = 30 * 86400  # a declared end (a cell's --timeout) within 30 days
NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
REQUEST_ID_PATTERN = "^[A-Za-z0-9._-]{8,64}$"
# Text a user sends (labels, notes, reasons): anything but protocol.UNSAFE_CHARS.
TEXT_PATTERN = f"^[^{UNSAFE_CHARS}]*$"
NAME_MESSAGE = "must be a name of letters, digits, '.', '_' or '-' (at most 63)"
TEXT_MESSAGE = f"must be a string of at most {MAX_TEXT} characters"

_UNSAFE_RE = re.compile(f"[{UNSAFE_CHARS}]")

_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(raw: bytes, data: Any) -> str | None:
    """The first lone UTF-16 surrogate (as ``\\udXXX``) in the strings of ``data``, the JSON that
    ``raw`` decoded to (as strict UTF-8, which carries none itself), if any: JSON's ``\\ud800``
    escape decodes to one, which no UTF-8 (Redis, HTTP) can carry. A pair, escaped or not, decodes
    to one code point and is fine. Only a body that escapes one is walked."""
    if not _ESCAPED_SURROGATE.search(raw):
        return None
    todo = [data]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            m = _SURROGATE.search(value)
            if m:
                return m[0].encode("unicode_escape").decode("ascii")
        elif isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return None


@lru_cache(maxsize=64)
def regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled as ECMA-262 reads it: Python's "$" also matches before a final newline."""
    return re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern)


def matches(pattern: str, value: str) -> bool:
    return regex(pattern).search(value) is not None


def unsafe_char(kind: str, value: str) -> str | None:
    """Why ``value`` is refused when it holds a character of :data:`UNSAFE_CHARS` (None: it holds none):
    the field, and the character's code point and place, since the character itself cannot be shown."""
    found = _UNSAFE_RE.search(value)
    if found is None:
        return None
    code = ord(found[0])
    what = "a control character" if code <= 0x9F else "a bidi or line-breaking formatting character"
    return (
        f"{kind} holds {what}, U+{code:04X} at position {found.start()}: labels and names take "
        "printable text only (no control, bidi override or isolate characters)"
    )


def short(value: object) -> str:
    """``repr(value)``, cut to 80 characters: how a message quotes what was sent."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- the declaration of a field ------------------------------------------------------------------------

Bound = float | str | None  # a number, or the name of the server setting that is the bound


@dataclass(frozen=True)
class Spec:
    """One field of a request: what the document says of it, and the 400 a bad value gets (``bad``:
    "NAME must be ...", to which ", got VALUE" is added; ``{minimum}`` and ``{maximum}`` are the
    bounds in force). ``missing``: the message when a required field is absent."""

    description: str = ""
    bad: str = ""
    minimum: Bound = None
    maximum: Bound = None
    pattern: str | None = None
    max_length: int | None = None
    enum: tuple[str, ...] = ()
    missing: str = ""


_JSON_TYPES = {int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class _Field:
    name: str
    kind: type  # int, float or str
    spec: Spec
    required: bool
    default: Any
    nullable: bool  # None is a value of its type (the server's default)


def _bound(bound: Bound, limits: object) -> float | None:
    return getattr(limits, bound) if isinstance(bound, str) else bound


def _limits(limits: object) -> dict[str, Any]:
    """The settings a description or message may quote: every public attribute of ``limits``."""
    return {k: getattr(limits, k) for k in dir(limits) if not k.startswith("_")}


# ---- requests ------------------------------------------------------------------------------------------


class Request:
    """Base of a typed request (a frozen dataclass whose fields are ``Annotated[type, Spec]``)."""

    RULES: ClassVar[tuple[str, ...]] = ()  # what the fields' specs cannot say; refused by rules()
    __dataclass_fields__: ClassVar[dict[str, Any]]  # a subclass is a dataclass

    @classmethod
    @cache
    def declared(cls) -> tuple[_Field, ...]:
        out = []
        for f in fields(cls):
            hint = get_type_hints(cls, include_extras=True)[f.name]
            assert get_origin(hint) is Annotated, f"{cls.__name__}.{f.name}: declare it Annotated[type, Spec(...)]"
            kind, spec = get_args(hint)[:2]
            kinds = [k for k in get_args(kind) if k is not type(None)] or [kind]
            assert len(kinds) == 1 and kinds[0] in _JSON_TYPES and isinstance(spec, Spec), f.name
            required = f.default is MISSING and f.default_factory is MISSING
            nullable = type(None) in get_args(kind)
            out.append(_Field(f.name, kinds[0], spec, required, None if required else f.default, nullable))
        return tuple(out)

    # ---- the document ----

    @classmethod
    def schema(cls, limits: object) -> dict[str, Any]:
        """The JSON Schema (OpenAPI 3.1) of the body, with the bounds that are settings of ``limits``."""
        quoted = _limits(limits)
        props: dict[str, Any] = {}
        for f in cls.declared():
            s = f.spec
            p: dict[str, Any] = {}
            if s.enum:
                p["enum"] = [*s.enum, *([] if f.required else [None])]
            else:
                p["type"] = _JSON_TYPES[f.kind] if f.required else [_JSON_TYPES[f.kind], "null"]
            for key in ("minimum", "maximum"):
                if (value := _bound(getattr(s, key), limits)) is not None:
                    p[key] = value
            if s.max_length is not None:
                p["maxLength"] = s.max_length
            if s.pattern is not None:
                p["pattern"] = s.pattern
            if s.description:
                p["description"] = s.description.format(**quoted)
            props[f.name] = p
        out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props}
        required = [f.name for f in cls.declared() if f.required]
        if required:
            out["required"] = required
        if cls.RULES:
            out["description"] = "Also refused with a 400: " + "; ".join(cls.RULES) + "."
        return out

    @classmethod
    def body_required(cls) -> bool:
        """Whether the body must be sent (else an empty body is a valid one)."""
        return any(f.required for f in cls.declared())

    # ---- reading and checking ----

    @classmethod
    def parse(cls, data: dict[str, Any], limits: object) -> Self:
        """``data`` (a JSON object) read into the request, or a 400 saying what to fix: unknown
        fields first, then each field given in declared order, then the required ones, then the rules."""
        names = [f.name for f in cls.declared()]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise errors.BadRequest(f"unknown field(s) {sorted(unknown)}; allowed: {', '.join(names)}")
        values = {}
        for f in cls.declared():
            if f.name in data and (data[f.name] is not None or f.required):
                values[f.name] = _value(f, data[f.name], limits)
        for f in cls.declared():
            if f.required and f.name not in values:
                raise errors.BadRequest(f.spec.missing or f"{f.name} is required")
        request = cls(**values)
        request.rules()
        return request

    def check(self, limits: object) -> Self:
        """The request held to its declaration (a request built in Python, not parsed): itself, or a 400."""
        for f in self.declared():
            value = getattr(self, f.name)
            if value is not None or not f.nullable:
                _value(f, value, limits)
        self.rules()
        return self

    def rules(self) -> None:
        """Raise BadRequest for a broken rule of :attr:`RULES`."""

    def json(self) -> dict[str, Any]:
        """The body to send: every field that is not its default."""
        return {
            f.name: getattr(self, f.name) for f in self.declared() if f.required or getattr(self, f.name) != f.default
        }


def _value(f: _Field, value: Any, limits: object) -> Any:
    """``value`` of field ``f``, as its type (a JSON 2.0 is the integer 2), or a 400 with its message."""
    s = f.spec
    if isinstance(value, str) and (s.pattern is not None or s.max_length is not None):
        why = unsafe_char(f.name, value)
        if why is not None:  # its code point, rather than the pattern
            raise errors.BadRequest(why)
    if f.kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    lo, hi = _bound(s.minimum, limits), _bound(s.maximum, limits)
    if f.kind is str:
        ok = isinstance(value, str) and (
            value in s.enum
            if s.enum
            else (s.max_length is None or len(value) <= s.max_length)
            and (s.pattern is None or matches(s.pattern, value))
        )
    else:
        ok = (
            isinstance(value, (int, float) if f.kind is float else int)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (lo is None or value >= lo)
            and (hi is None or value <= hi)
        )
    if not ok:
        bad = s.bad.format(minimum=_num(lo), maximum=_num(hi)) if s.bad else f"{f.name} is not valid"
        raise errors.BadRequest(f"{bad}, got {short(value)}")
    return float(value) if f.kind is float else value


def _num(bound: float | None) -> str:
    if bound is None:
        return ""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


# ---- POST /api/v1/leases ---------------------------------------------------------------------------------


def _text(name: str, description: str = "") -> Spec:
    return Spec(description, f"{name} {TEXT_MESSAGE}", max_length=MAX_TEXT, pattern=TEXT_PATTERN)


def _gpus(name: str, description: str, missing: str = "") -> Spec:
    return Spec(
        description,
        f"{name} must be a whole number of GPUs such as 1 or 2, at least {{minimum}} and at most {{maximum}}",
        minimum=1,
        maximum=MAX_GPUS_PER_REQUEST,
        missing=missing,
    )


@dataclass(frozen=True, kw_only=True)
class AcquireRequest(Request):
    """A request for GPUs: the body of ``POST /api/v1/leases``. ``None`` is the server's default
    (its default pool, its default_ttl; a fresh lease id)."""

    gpus: Annotated[
        int,
        _gpus("gpus", "GPUs to lease (all on one node unless nodes is above 1)", 'gpus is required, e.g. {"gpus": 1}'),
    ]
    gpus_min: Annotated[
        int | None,
        _gpus("gpus_min", "Elastic request: granted as many as one node has free, from gpus_min to gpus"),
    ] = None
    nodes: Annotated[
        int,
        Spec(
            "A multi-node gang: gpus / nodes GPUs on each of that many nodes, all or nothing",
            "nodes must be a whole number from {minimum} to {maximum}",
            minimum=1,
            maximum=MAX_NODES,
        ),
    ] = 1
    pool: Annotated[
        str | None,
        Spec("Default: the server's default GPU pool", f"pool {NAME_MESSAGE}", pattern=NAME_PATTERN),
    ] = None
    ttl: Annotated[
        float | None,
        Spec(
            "Seconds the lease lives unless renewed (default {default_ttl:g})",
            "ttl must be a number of seconds between {minimum} and {maximum}",
            minimum=1,
            maximum="max_ttl",
        ),
    ] = None
    wait: Annotated[
        float,
        Spec(
            "Seconds to wait in the queue (0, the default: fail at once)",
            "wait must be a number of seconds between {minimum} and {maximum}",
            minimum=0,
            maximum="max_wait",
        ),
    ] = 0.0
    label: Annotated[str, _text("label")] = ""
    session: Annotated[str, _text("session")] = ""
    notebook: Annotated[str, _text("notebook", "For the usage ledger")] = ""
    cell: Annotated[
        str, _text("cell", "The cell: its number in the notebook (In [4] sends 4), else a hash of its source")
    ] = ""
    id: Annotated[
        str | None,
        Spec(
            "Optional request id chosen by the client: it becomes the lease id, shows the request in GET /queue "
            "while it waits, and makes a resent POST return the same grant",
            "id must be 8 to 64 letters, digits, '.', '_' or '-' (a random request id)",
            pattern=REQUEST_ID_PATTERN,
        ),
    ] = None
    priority: Annotated[
        str,
        Spec(
            "Priority class (the priority scheduler serves higher classes first; a request may preempt only "
            "preemptible leases of no higher class)",
            f"priority must be one of {', '.join(PRIORITIES)}",
            enum=tuple(PRIORITIES),
        ),
    ] = "normal"
    gpu_mem_mb: Annotated[
        int | None,
        Spec(
            "A slice of one GPU: this many MB of its memory, on a GPU that other slices may share (only in a "
            "pool that shares; rounded up to the pool's slice unit, and the lease says the size it got). "
            "Null: whole GPUs",
            "gpu_mem_mb must be a whole number of MB from {minimum} to {maximum}, e.g. 10240 for 10 GB",
            minimum=1,
            maximum=MAX_GPU_MEM_MB,
        ),
    ] = None

    prefer_node: Annotated[
        str | None,
        Spec(
            "A node to take the GPUs on if it has them free when they are granted (where the notebook's worker "
            "was suspended to host: it is restored there, not started cold); else wherever best fit puts them. "
            "Only for whole GPUs on one node",
            f"prefer_node {NAME_MESSAGE}",
            pattern=NAME_PATTERN,
        ),
    ] = None
    ends_within: Annotated[
        float | None,
        Spec(
            "Seconds after the grant by which the holder means to end the lease (a cell's --timeout): not "
            "enforced, but the wait estimates of those queued behind it count on it. Null: no end declared",
            "ends_within must be a number of seconds between {minimum} and {maximum}",
            minimum=1,
            maximum=MAX_ENDS_WITHIN_S,
        ),
    ] = None

    RULES = (
        "gpus_min above gpus",
        "nodes above 1 with gpus not a multiple of nodes, or with a gpus_min other than gpus",
        "gpu_mem_mb with nodes above 1 or gpus_min (k slices are one on each of k GPUs of one node)",
        "gpu_mem_mb in a pool that does not share, or above the memory of one of its GPUs",
        "prefer_node with nodes above 1 or with gpu_mem_mb",
    )

    def rules(self) -> None:
        if self.gpu_mem_mb is not None and (self.nodes != 1 or self.gpus_min is not None):
            raise errors.BadRequest(
                "a slice (gpu_mem_mb) is part of one GPU, and gpus k slices on k GPUs of one node: send no nodes "
                "or gpus_min, or drop gpu_mem_mb to lease whole GPUs"
            )
        if self.prefer_node is not None and (self.nodes != 1 or self.gpu_mem_mb is not None):
            raise errors.BadRequest(
                "prefer_node names one node for whole GPUs: send it without nodes and gpu_mem_mb, or drop it"
            )
        n, n_min, k = self.gpus, self.least, self.nodes
        if n_min > n:
            raise errors.BadRequest(f"gpus_min ({n_min}) must not exceed gpus ({n}): ask for gpus_min..gpus GPUs")
        if k > 1 and n % k:
            raise errors.BadRequest(
                f"gpus ({n}) must be a multiple of nodes ({k}): a gang has the same GPUs on every node, "
                f"e.g. gpus={k * max(1, n // k)}"
            )
        if k > 1 and n_min != n:
            raise errors.BadRequest("a multi-node gang is all or nothing: drop gpus_min, or ask for one node")

    @property
    def least(self) -> int:
        """The fewest GPUs it takes: gpus_min, else gpus (not elastic)."""
        return self.gpus if self.gpus_min is None else self.gpus_min
