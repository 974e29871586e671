"""Typed errors of gpulease.

Every error has a stable machine-readable ``code`` and an HTTP ``status``; the API turns any
:class:`GpuLeaseError` into ``{"code", "message"}`` with that status, and the Python client turns
such a body back into the same class, so callers catch the same exception whether they talk to
Redis directly or over HTTP.
"""

from __future__ import annotations

import warnings


class GpuLeaseError(Exception):
    """Root of all gpulease errors."""

    code = "error"
    status = 500

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return body


class BadRequest(GpuLeaseError):
    code = "bad_request"
    status = 400


class PayloadTooLarge(BadRequest):
    code = "payload_too_large"
    status = 413


class Unauthorized(GpuLeaseError):
    code = "unauthorized"
    status = 401


class Forbidden(GpuLeaseError):
    code = "forbidden"
    status = 403


class NotOwner(Forbidden):
    code = "not_owner"


class NotFound(GpuLeaseError):
    code = "not_found"
    status = 404


class NoSuchLease(NotFound):
    code = "no_such_lease"


class UnknownPool(NotFound):
    code = "unknown_pool"


class UnknownNode(NotFound):
    code = "unknown_node"


class NoSuchToken(NotFound):
    code = "no_such_token"


class Conflict(GpuLeaseError):
    code = "conflict"
    status = 409


class StaleToken(Conflict):
    """The fencing token does not match the lease's: the caller holds an old grant."""

    code = "stale_token"


class LeaseEnded(Conflict):
    """The lease was released, expired or revoked: its GPUs may already belong to someone else."""

    code = "lease_ended"


class LeaseExpired(LeaseEnded):
    code = "lease_expired"


class BookingClash(Conflict):
    """A booking would over-book its pool (or its node) at some instant; details name the clashing
    bookings, the most GPUs that would fit, and the nearest windows that would.

    Its ``code`` keeps the word of the first release: clients match on it."""

    code = "reservation_clash"


class NoSuchBooking(NotFound):
    code = "no_such_reservation"  # as BookingClash's: a code clients match on


class NoCapacity(Conflict):
    """Nothing free now (``wait`` was 0) or nothing became free within ``wait`` seconds."""

    code = "no_capacity"


class TooMany(GpuLeaseError):
    """A per-user limit is reached: queued requests, open event streams."""

    code = "too_many"
    status = 429


class Withdrawn(GpuLeaseError):
    """The queued request was withdrawn (``DELETE /leases/{id}`` while it waited): it is out of the
    queue and will never be granted. Answers the ``POST /leases`` that was waiting for it."""

    code = "withdrawn"
    status = 410


def no_slices(pool: str) -> BadRequest:
    """A slice asked of a pool that does not share its GPUs (the acquire's and /estimate's words)."""
    return BadRequest(
        f"pool {pool!r} does not share its GPUs, so it takes no slice (gpu_mem_mb): ask for whole GPUs, "
        f"or have an admin set share = true under [scheduling.{pool}] in the server's --config file"
    )


class Unsatisfiable(GpuLeaseError):
    """No node of the pool could ever serve the request, however long it waited."""

    code = "unsatisfiable"
    status = 422

    @classmethod
    def one_node(cls, pool: str, gpus: int, largest: int, nodes: int | None = None) -> Unsatisfiable:
        """More GPUs on one node than any node of the pool has (the acquire's and /estimate's words);
        a gang is suggested only where the pool has more than one node (``nodes``: how many)."""
        gang = ", or spread them over K nodes, all or nothing (nodes=K)" if nodes is None or nodes > 1 else ""
        return cls(
            f"no node in pool {pool!r} has {gpus} GPUs: the largest has {largest}; ask for at most "
            f"{largest} on one node{gang}",
            pool=pool,
            gpus=gpus,
            largest_node=largest,
            **({"nodes": nodes} if nodes is not None else {}),
        )

    @classmethod
    def gang(cls, pool: str, nodes: int, per: int, able: int) -> Unsatisfiable:
        """A gang of ``per`` GPUs on each of ``nodes`` nodes, where only ``able`` nodes have that many."""
        gpus = f"{per} GPU{'s' if per != 1 else ''}"
        return cls(
            f"a gang of {gpus} on each of {nodes} nodes cannot fit pool {pool!r}: only "
            f"{able} of its nodes {'has' if able == 1 else 'have'} {gpus}; ask for fewer nodes or "
            "fewer GPUs per node",
            pool=pool,
            nodes_able=able,
        )


class ConfigurationError(GpuLeaseError):
    code = "configuration_error"
    status = 500


class ServerUnavailable(GpuLeaseError):
    """The lease server (or its Redis) cannot be reached."""

    code = "unavailable"
    status = 503


# The classes' names before bookings were called bookings everywhere: still importable, with a
# DeprecationWarning, for code outside this repository that catches them.
_DEPRECATED = {"ReservationClash": "BookingClash", "NoSuchReservation": "NoSuchBooking"}


def __getattr__(name: str) -> type[GpuLeaseError]:
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(f"errors.{name} is deprecated: use errors.{new}", DeprecationWarning, stacklevel=2)
        return globals()[new]  # type: ignore[no-any-return]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BY_CODE: dict[str, type[GpuLeaseError]] = {}


def _collect(cls: type[GpuLeaseError]) -> None:
    for sub in cls.__subclasses__():
        _BY_CODE.setdefault(sub.code, sub)
        _collect(sub)


_collect(GpuLeaseError)


def from_json(status: int, body: dict[str, object]) -> GpuLeaseError:
    """Rebuild the typed error from an API error body (used by the HTTP client)."""
    code = str(body.get("code", "error"))
    message = str(body.get("message", f"HTTP {status}"))
    details = body.get("details") or {}
    cls = _BY_CODE.get(code)
    if cls is None:
        cls = GpuLeaseError
    err = cls(message, **(details if isinstance(details, dict) else {}))
    if cls is GpuLeaseError:
        err.status = status
    return err
