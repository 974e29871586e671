"""Settings of the lease server, from defaults, a TOML file and ``GPULEASE_*`` environment variables."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigurationError

ACCOUNT_RE = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")  # a unix account name (useradd's rule, in short)

SCHEDULERS = ("fifo", "fair_share", "priority")
SCHED_SETTINGS = (
    "scheduler",
    "preempt_notice",
    "idle_weight",
    "quota",
    "aging",
    "warm_max",
    "warm_evict_notice",
    "share",
    "slice_unit_mb",
    "max_sharers",
    "slice_busy_pct",
)
UNLEASED_ACTIONS = ("flag", "kill")  # what node agents do about a process on a GPU no lease covers
# The HTTP edge's settings: (name, exclusive low, inclusive high)
EDGE_BOUNDS = (
    ("http_idle_timeout", 0, 3600),
    ("http_body_timeout", 0, 3600),
    ("max_connections", 0, 1_000_000),
    ("log_reads_at_once", 0, 1000),
    ("log_read_rate", 0, 1e9),
    ("log_read_burst", 0, 1e9),
    ("stream_connect_rate", 0, 1e6),
    ("stream_connect_burst", 0, 1e6),
    ("metrics_cache_s", 0, 60),
)


@dataclass
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "gpulease"
    # Durability: a state change is acknowledged to a client only once WAIT confirms that this many
    # replicas have it (else 503, and the client retries). 0 for one Redis (gpulease up); 1 with a
    # replica and Sentinel (docs/deploy.md), so a failover cannot lose an acknowledged grant.
    replicas_ack: int = 0
    replicas_ack_timeout: float = 1.0  # seconds WAIT waits for the replicas
    host: str = "127.0.0.1"
    port: int = 8470
    default_ttl: float = 15.0  # seconds a lease lives without renewal
    max_ttl: float = 3600.0
    max_wait: float = 3600.0  # longest a single request may wait in the queue
    sweep_interval: float = 0.5  # seconds between sweeps (expiry, dead nodes, stale waiters)
    heartbeat_interval: float = 2.0  # agent heartbeat period
    heartbeat_timeout: float = 10.0  # a node not heard from for this long is down
    default_pool: str = ""  # empty: the pool of the first node registered
    cpu_pool: str = "CPU"  # the pool of CPU slots (nodes declared as NxCPU): %%gpu_train --gpus 0 leases one
    pool_overrides: dict[str, str] = field(default_factory=dict)  # node -> pool
    fair_share_half_life: float = 3600.0  # seconds; past GPU-time counts half after this long
    ended_retention: float = 86400.0  # seconds ended leases stay readable
    event_log_max: int = 100_000  # approximate stream length kept
    max_body_bytes: int = 64 * 1024
    # The HTTP edge (web/server.py, web/limits.py): what one client can hold of the server. Seconds a
    # request head may take to arrive (counted from when the server waits for it, so a kept-alive
    # connection's idle time too; an event stream is not cut, it writes), seconds a request body
    # may take, and connections open at once (more are closed at accept).
    http_idle_timeout: float = 20.0
    http_body_timeout: float = 5.0
    max_connections: int = 1000
    # Per API token, on the expensive reads (GET /events/log pages and the backlog an event stream
    # sends on connecting): reads in flight at once, log entries read per second (a bucket that
    # holds log_read_burst), and event stream connections per second (a bucket of
    # stream_connect_burst). Beyond them: 429 with Retry-After.
    log_reads_at_once: int = 2
    log_read_rate: float = 2000.0
    log_read_burst: int = 20_000
    stream_connect_rate: float = 2.0
    stream_connect_burst: int = 256
    metrics_cache_s: float = 1.0  # GET /metrics is rendered (read from Redis) at most this often
    # GET /metrics names at most this many users in its per-user series (the top ones; the rest
    # summed as user "~other"), so a Prometheus keeps a bounded number of series (docs/usage.md)
    metrics_top_users: int = 20
    # GET /api/v1/usage/summary (docs/usage.md): false, everyone sees the team's rows; true, a user
    # who is not an admin sees only their own (and asking for another user's is a 403)
    usage_own_rows_only: bool = False
    # Seconds a refusal at the edge waits before it is sent (a 429 of the limits above, a 401 or
    # 413 whose body goes unread): a client that asks again at once then costs a request a second.
    refusal_hold_s: float = 1.0
    ray_address: str = ""  # the Ray cluster that clients (the magic) should use
    # A file with that cluster's token (RAY_AUTH_MODE=token): GET /info hands it to users and admins
    # so that %%gpu_train can join (gpulease up sets it; empty: kernels bring their own).
    ray_auth_token_file: str = ""
    sample_interval: float = 5.0  # seconds between GPU samples (node agents)
    # Idle-GPU reclaim defaults for every pool; a [policy.POOL] table in the config file or an
    # admin's PUT /api/v1/policy/POOL overrides them per pool.
    reclaim_enabled: bool = True
    idle_threshold: float = 5.0  # % utilization under which a GPU counts as idle
    idle_timeout: float = 600.0  # seconds all of a lease's GPUs must stay idle before a warning
    grace: float = 120.0  # seconds between the warning and the reclaim
    min_age: float = 120.0  # a lease younger than this is never reclaimed (data loading)
    max_extensions: int = 3  # "I'm still using it" per lease
    # A process on a GPU that no live lease covers: "flag" it (event, board) or "kill" it (its node
    # agent sends SIGTERM, then SIGKILL after unleased_kill_grace_s). Per pool like the above.
    unleased_action: str = "flag"
    unleased_kill_grace_s: float = 10.0
    # Draining (lease_server/node/drain.py): a GPU whose lease the server ended is free once its node
    # agent sees no process of that lease on it; the agent looks this often and ends what
    # remains, SIGTERM then SIGKILL after drain_kill_grace_s.
    drain_interval: float = 0.2
    # GPU isolation by the OS (lease_server/node/cgroup.py): each lease's workers in a cgroup whose
    # device rules allow only its GPUs. "auto": on NVML nodes where the agent can (root, cgroups);
    # "on": simulated nodes too (their cgroups then only track a lease's processes); "off".
    gpu_isolation: str = "auto"
    # Suspend to host (lease_server/node/suspend.py): an evicted warm worker's GPU state goes to host
    # memory and the worker lives on for its notebook's next cell. "auto": where the node can
    # (simulated nodes; NVML nodes whose driver's checkpoint API answers); "off": ended, as before.
    # Per node, the suspended workers together hold at most suspend_host_budget_gb of host memory:
    # over it, the oldest is ended.
    suspend: str = "auto"
    suspend_host_budget_gb: float = 64.0
    # Per user: requests waiting in the queue at once, and event streams open on one server replica
    # (a running call follows its lease with two: the driver's and its worker's watchdog).
    max_queued_per_user: int = 256
    max_streams_per_user: int = 128
    # ... and per token: the streams of all the users a proxy token (JupyterHub) acts for together
    max_streams_per_token: int = 1024
    drain_kill_grace_s: float = 2.0
    # Slices held to their memory (lease_server/node/memwatch.py): the node agent measures each
    # slice's processes every slice_check_interval; one over its memory by more than slice_over_pct
    # percent is warned, and ended if it stays over for more than slice_over_s seconds.
    slice_check_interval: float = 0.5
    slice_over_pct: float = 5.0
    slice_over_s: float = 2.0
    policy_overrides: dict[str, dict[str, object]] = field(default_factory=dict)
    # Bookings (GPUs of a pool booked for a time window)
    borrow_notice: float = 30.0  # seconds a borrowed lease keeps its GPUs after its booking's holder asks
    no_show_after: float = 900.0  # a booking occurrence unused this long after its start is released
    on_demand_floor: int = 0  # GPUs of every pool that are never booked, kept for people without a booking
    # of a pool's bookable GPUs, the most one person may have booked at any instant, as themselves
    # and as any team of theirs together (a team's booking counts against each member's share);
    # 1: no cap. An admin's booking is not held to it
    booking_share: float = 1.0
    # the most bookings not yet over one owner (a user, a team) may have; an admin's are not held to it
    booking_max_per_owner: int = 200
    booking_history: float = 30 * 86400.0  # seconds past bookings stay listed
    max_booking_days: float = 31.0  # longest single booking (a weekly one lasts at most 7 days)
    teams: dict[str, list[str]] = field(default_factory=dict)  # team -> members ([teams] table)
    # Each person's code runs as that person (docs/security.md): with multi_user, a lease user is a
    # unix account on every host, of the same name or as the [accounts] table maps it (alice =
    # "asmith"). A node agent then records a claim only from a process of the lease owner's
    # account, and `gpulease token create` makes a user token only for a name with an account.
    multi_user: bool = False
    accounts: dict[str, str] = field(default_factory=dict)  # lease user -> unix account ([accounts])
    # A unix socket `gpulease server` serves too, beside its port: under multi_user every account may
    # connect (mode 0666), and the kernel names each connection's account, so that a user token is
    # taken there only from its owner's processes. Its folder must be root's (or the server user's)
    # and writable by nobody else, e.g. /run/gpulease/api.sock.
    unix_socket: str = ""
    # Who may ask for priority "high" (users and "team:NAME"; admins always may). A priority class is
    # the requester's own word: "high" is served first under the priority scheduler, and a
    # preemptible lease of class high is safe from preemption by normal requests.
    high_priority: list[str] = field(default_factory=list)
    # Scheduling: defaults for every pool; a [scheduling.POOL] table overrides them per pool, e.g.
    # scheduler = "priority", preempt_notice = 60, quota = {"*" = 4, alice = 8, "team:ml" = 12}
    scheduler: str = "fair_share"  # fifo | fair_share | priority
    preempt_notice: float = 30.0  # seconds a preemptible lease keeps its GPUs after being preempted
    idle_weight: float = 1.5  # a held-but-idle GPU-second counts this much in fair share (busy: 1)
    # Warm cells: a finished %%gpu_train cell's worker stays on its GPUs for the notebook's next
    # cell, lent out when someone waits: its kernel gets warm_evict_notice seconds to end it, and
    # it ends by itself warm_max seconds after its last cell.
    warm_max: float = 1800.0
    warm_evict_notice: float = 2.0
    quota_per_user: int = 0  # GPUs at once per user and pool within quota (0: no quota)
    # GPU slices (a lease of part of one GPU's memory, gpu_mem_mb): off unless a pool's [scheduling.POOL]
    # table (or this default for every pool) says share = true. A slice's size is rounded up to a
    # multiple of slice_unit_mb; at most max_sharers slices (live or draining) share one GPU.
    share: bool = False
    slice_unit_mb: int = 1024
    max_sharers: int = 4
    # A sliced GPU whose utilisation, averaged over its node agent's recent samples, is at or above
    # this (%) is busy: a slice goes elsewhere while another GPU fits (docs/slices.md, Placement).
    slice_busy_pct: int = 50
    # GPU-seconds of fair-share credit per second waited, per GPU asked for: large requests are
    # not starved, yet a long backlog does not turn fair share into first-come-first-served
    aging: float = 0.1
    scheduling: dict[str, dict[str, object]] = field(default_factory=dict)

    def sched_table(self, pool: str = "*") -> dict[str, object]:
        """The scheduling of ``pool`` ("*": the default) as Lua reads it from the sched hash."""
        base: dict[str, object] = {
            "scheduler": self.scheduler,
            "preempt_notice": self.preempt_notice,
            "idle_weight": self.idle_weight,
            "aging": self.aging,
            "warm_max": self.warm_max,
            "warm_evict_notice": self.warm_evict_notice,
            "quota": {"*": self.quota_per_user} if self.quota_per_user else {},
            "share": self.share,
            "slice_unit_mb": self.slice_unit_mb,
            "max_sharers": self.max_sharers,
            "slice_busy_pct": self.slice_busy_pct,
        }
        base.update(self.scheduling.get(pool, {}))
        return {
            "scheduler": base["scheduler"],
            "preempt_notice_ms": int(float(base["preempt_notice"]) * 1000),  # type: ignore[arg-type]
            "idle_weight": float(base["idle_weight"]),  # type: ignore[arg-type]
            "aging": float(base["aging"]),  # type: ignore[arg-type]
            "warm_max_ms": int(float(base["warm_max"]) * 1000),  # type: ignore[arg-type]
            "warm_evict_notice_ms": int(float(base["warm_evict_notice"]) * 1000),  # type: ignore[arg-type]
            "quota": dict(base["quota"]),  # type: ignore[call-overload]
            "share": bool(base["share"]),
            "slice_unit_mb": int(base["slice_unit_mb"]),  # type: ignore[call-overload]
            "max_sharers": int(base["max_sharers"]),  # type: ignore[call-overload]
            "slice_busy_pct": int(base["slice_busy_pct"]),  # type: ignore[call-overload]
        }

    def account_of(self, user: str) -> str:
        """The unix account of lease user ``user`` on every host (multi_user): as [accounts] maps
        it, else the same name."""
        return self.accounts.get(user, user)

    def teams_of(self, user: str) -> tuple[str, ...]:
        return tuple(sorted(t for t, members in self.teams.items() if user in members))

    def validate(self) -> Settings:
        if self.default_ttl <= 0 or self.max_ttl <= 0:
            raise ConfigurationError("default_ttl and max_ttl must be positive")
        if self.default_ttl > self.max_ttl:
            raise ConfigurationError(
                f"default_ttl ({self.default_ttl}s) is larger than max_ttl ({self.max_ttl}s): "
                "raise max_ttl or lower default_ttl"
            )
        if self.sweep_interval <= 0 or self.sweep_interval >= self.default_ttl:
            raise ConfigurationError(
                f"sweep_interval ({self.sweep_interval}s) must be positive and below default_ttl "
                f"({self.default_ttl}s), or expired leases would linger"
            )
        if self.sample_interval <= 0 or self.sample_interval * 2 > self.idle_timeout:
            raise ConfigurationError(
                f"sample_interval ({self.sample_interval}s) must be positive and at most half of "
                f"idle_timeout ({self.idle_timeout}s), or an idle window holds too few samples"
            )
        if self.unleased_action not in UNLEASED_ACTIONS or not 0 <= self.unleased_kill_grace_s <= 3600:
            raise ConfigurationError(
                f"unleased_action must be one of {', '.join(UNLEASED_ACTIONS)} (got {self.unleased_action!r}) "
                f"and unleased_kill_grace_s between 0 and 3600 seconds (got {self.unleased_kill_grace_s})"
            )
        if self.max_queued_per_user < 1 or self.max_streams_per_user < 1 or self.max_streams_per_token < 1:
            raise ConfigurationError(
                f"max_queued_per_user ({self.max_queued_per_user}), max_streams_per_user "
                f"({self.max_streams_per_user}) and max_streams_per_token ({self.max_streams_per_token}) "
                "must be at least 1"
            )
        for name, low, high in EDGE_BOUNDS:
            value = getattr(self, name)
            if not low < value <= high:
                raise ConfigurationError(f"{name} must be above {low:g} and at most {high:g}, got {value!r}")
        if not 0 <= self.metrics_top_users <= 1000:
            raise ConfigurationError(f"metrics_top_users must be between 0 and 1000 (got {self.metrics_top_users})")
        if not 0 <= self.refusal_hold_s <= 60:
            raise ConfigurationError(f"refusal_hold_s must be between 0 and 60 seconds (got {self.refusal_hold_s})")
        if self.suspend not in ("auto", "off") or not 0 <= self.suspend_host_budget_gb <= 1_000_000:
            raise ConfigurationError(
                f"suspend must be auto or off (got {self.suspend!r}) and suspend_host_budget_gb between 0 and "
                f"1000000 (got {self.suspend_host_budget_gb})"
            )
        if self.gpu_isolation not in ("auto", "on", "off"):
            raise ConfigurationError(f"gpu_isolation must be auto, on or off (got {self.gpu_isolation!r})")
        if not 0 < self.drain_interval <= 10 or not 0 <= self.drain_kill_grace_s <= 600:
            raise ConfigurationError(
                f"drain_interval must be in (0, 10] seconds (got {self.drain_interval}) and "
                f"drain_kill_grace_s between 0 and 600 seconds (got {self.drain_kill_grace_s})"
            )
        if (
            not 0 < self.slice_check_interval <= 10
            or not 0 <= self.slice_over_pct <= 100
            or not 0 <= self.slice_over_s <= 600
        ):
            raise ConfigurationError(
                f"slice_check_interval must be in (0, 10] seconds (got {self.slice_check_interval}), "
                f"slice_over_pct from 0 to 100 (got {self.slice_over_pct}) and slice_over_s from 0 to 600 "
                f"seconds (got {self.slice_over_s})"
            )
        if not 0 < self.booking_share <= 1:
            raise ConfigurationError(
                f"booking_share must be above 0 and at most 1 (1: no cap), got {self.booking_share}"
            )
        n = self.booking_max_per_owner
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 100_000:
            raise ConfigurationError(
                f"booking_max_per_owner must be a whole number from 1 to 100000, got {self.booking_max_per_owner}"
            )
        if self.borrow_notice < 0 or self.no_show_after <= 0 or self.on_demand_floor < 0:
            raise ConfigurationError(
                "borrow_notice and on_demand_floor must not be negative, and no_show_after must be positive"
            )
        checks: dict[str, dict[str, Any]] = {
            "*": {
                "scheduler": self.scheduler,
                "share": self.share,
                "slice_unit_mb": self.slice_unit_mb,
                "max_sharers": self.max_sharers,
                "slice_busy_pct": self.slice_busy_pct,
            },
            **self.scheduling,
        }
        for pool, table in checks.items():
            unknown = set(table) - set(SCHED_SETTINGS)
            if unknown:
                raise ConfigurationError(
                    f"unknown scheduling setting(s) {sorted(unknown)} for pool {pool}; "
                    f"allowed: {', '.join(SCHED_SETTINGS)}"
                )
            for key in ("warm_max", "warm_evict_notice"):
                value = table.get(key, getattr(self, key))
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 7 * 86400:
                    raise ConfigurationError(
                        f"{key} of pool {pool} must be a number of seconds in (0, 604800], got {value!r}"
                    )
            if table.get("scheduler", "fair_share") not in SCHEDULERS:
                raise ConfigurationError(
                    f"scheduler of pool {pool} must be one of {', '.join(SCHEDULERS)}, got {table.get('scheduler')!r}"
                )
            if not isinstance(table.get("share", False), bool):
                raise ConfigurationError(f"share of pool {pool} must be true or false, got {table['share']!r}")
            for key, low, high in (
                ("slice_unit_mb", 1, 1024 * 1024),
                ("max_sharers", 1, 1024),
                ("slice_busy_pct", 1, 101),  # 101: never busy (placement by memory alone)
            ):
                value = table.get(key, 1)
                if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                    raise ConfigurationError(
                        f"{key} of pool {pool} must be a whole number from {low} to {high}, got {value!r}"
                    )
            quota = table.get("quota", {})
            if not isinstance(quota, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in quota.values()
            ):
                raise ConfigurationError(f'quota of pool {pool} must map users, "*" or "team:NAME" to GPU counts')
        if not isinstance(self.high_priority, list) or not all(isinstance(u, str) for u in self.high_priority):
            raise ConfigurationError(
                'high_priority must be a list of users and teams, e.g. high_priority = ["alice", "team:ops"]'
            )
        for pool, table in self.policy_overrides.items():
            if "exempt_labels" in table:
                raise ConfigurationError(
                    f"[policy.{pool}] exempt_labels is no longer a setting: a lease's label is whatever its "
                    "requester types, so it exempted anyone who typed it; use exempt_users (a CI's own user)"
                )
        if self.replicas_ack < 0 or self.replicas_ack_timeout <= 0:
            raise ConfigurationError(
                "replicas_ack must be 0 (one Redis) or the replicas a change must reach (1 with Sentinel), "
                "and replicas_ack_timeout a positive number of seconds"
            )
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ConfigurationError(
                f"heartbeat_interval ({self.heartbeat_interval}s) must be below heartbeat_timeout "
                f"({self.heartbeat_timeout}s), or live nodes would flap down"
            )
        return self

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, **overrides: object) -> Settings:
        """Defaults, then the TOML file (``[server]`` table), then GPULEASE_* env, then overrides."""
        values: dict[str, object] = {}
        names = {f.name: f for f in fields(cls)}
        if path:
            try:
                data = tomllib.loads(Path(path).read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigurationError(f"cannot read config file {path}: {exc}") from exc
            tables = ("pools", "policy", "teams", "scheduling", "accounts")
            table = data.get("server", {k: v for k, v in data.items() if k not in tables})
            for key, value in table.items():
                if key not in names:
                    raise ConfigurationError(f"unknown setting {key!r} in {path}")
                values[key] = value
            if "pools" in data:
                values["pool_overrides"] = dict(data["pools"])
            if "scheduling" in data:
                values["scheduling"] = {pool: dict(t) for pool, t in data["scheduling"].items()}
            if "teams" in data:
                teams = data["teams"]
                if not isinstance(teams, dict) or not all(
                    isinstance(m, list) and all(isinstance(u, str) for u in m) for m in teams.values()
                ):
                    raise ConfigurationError(f'[teams] in {path} must map team names to lists of users: ml = ["ann"]')
                values["teams"] = {str(t): list(m) for t, m in teams.items()}
            if "accounts" in data:
                accounts = data["accounts"]
                if not isinstance(accounts, dict) or not all(
                    isinstance(a, str) and ACCOUNT_RE.fullmatch(a) for a in accounts.values()
                ):
                    raise ConfigurationError(
                        f'[accounts] in {path} must map lease users to unix account names: alice = "asmith"'
                    )
                values["accounts"] = {str(u): a for u, a in accounts.items()}
            if "policy" in data:
                values["policy_overrides"] = {pool: dict(t) for pool, t in data["policy"].items()}
        for name, f in names.items():
            env = os.environ.get(f"GPULEASE_{name.upper()}")
            if env is not None and f.type in ("float", "int", "str", "bool"):
                values[name] = env
        values.update({k: v for k, v in overrides.items() if v is not None})
        out = cls()
        for key, value in values.items():
            typ = names[key].type
            try:
                if typ == "float":
                    value = float(value)  # type: ignore[arg-type]
                elif typ == "int":
                    value = int(value)  # type: ignore[call-overload]
                elif typ == "bool" and isinstance(value, str):
                    if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                        raise ValueError(value)
                    value = value.lower() in ("1", "true", "yes")
            except (TypeError, ValueError) as exc:
                raise ConfigurationError(f"setting {key} must be a number, got {value!r}") from exc
            setattr(out, key, value)
        return out.validate()
