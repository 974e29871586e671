"""Administration: revoking leases, idle-GPU reclaim, policies, the notebook kernel, tokens."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from .. import errors, protocol
from ..client import Client, _up_tokens
from ._common import console, resolve_lease, resolve_past_lease, server_options


@click.command()
@click.argument("lease_id")
@click.option("--reason", default="")
@server_options
def revoke(lease_id: str, reason: str, url: str | None, token: str | None) -> None:
    """Revoke anyone's lease (admin). LEASE_ID may be any unique start of the id."""
    with Client(url, token) as c:
        lease_id = resolve_lease(c, lease_id)
        out = c.revoke(lease_id, reason)
    click.echo(f"{lease_id}: {out['state']}")


@click.group()
def reclaim() -> None:
    """Idle-GPU reclaim: explain a decision."""


# The ``ended_by`` of a lease that the idle-GPU reclaimer took back (lua/reclaim.lua's end_lease).
RECLAIMER = "reclaimer"


def sparkline(values: list[float], top: float = 100.0) -> str:
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[min(len(bars) - 1, int(v / top * (len(bars) - 1) + 0.5))] for v in values)


@reclaim.command("explain")
@click.argument("lease_id")
@server_options
def reclaim_explain(lease_id: str, url: str | None, token: str | None) -> None:
    """Why a lease was warned or reclaimed: the policy, the holder's activity, the samples."""
    with Client(url, token) as c:
        lease_id = resolve_past_lease(c, lease_id)  # the short id gpulease events shows, too
        lease = c.get(lease_id)
    ev = lease.get("idle_evidence")
    if not ev:
        click.echo(f"lease {lease_id} ({lease['state']}) was never judged idle.")
        return
    state = lease["state"]
    verdict = (
        "reclaimed"
        if lease.get("ended_by") == RECLAIMER
        else (
            "warned: reclaim at " + time.strftime("%H:%M:%S", time.localtime(lease["reclaim_at"]))
            if lease.get("reclaim_at")
            else state
        )
    )
    console.print(f"[bold]{lease_id}[/] of {lease['user']} on {lease['node']} ({lease['pool']}): {verdict}")
    console.print(
        f"  idle for {ev.get('idle_s', 0):.0f}s under {ev.get('threshold')}% "
        f"(policy: idle_timeout {ev.get('idle_timeout')}s); holder activity: {ev.get('activity') or 'none reported'}"
    )
    table = Table()
    for col in ("GPU", "samples", "util min/mean/max %", "mem MB (last)", "utilization over the window"):
        table.add_column(col)
    for idx, samples in sorted(ev.get("gpus", {}).items()):
        utils = [s[1] for s in samples] or [0.0]
        table.add_row(
            idx,
            str(len(samples)),
            f"{min(utils):.0f} / {sum(utils) / len(utils):.1f} / {max(utils):.0f}",
            str(samples[-1][2] if samples else 0),
            sparkline(utils),
        )
    console.print(table)


@click.group()
def policy() -> None:
    """Reclaim policy per pool."""


@policy.command("show")
@server_options
def policy_show(url: str | None, token: str | None) -> None:
    """Every pool's idle-GPU reclaim policy."""
    with Client(url, token) as c:
        click.echo(json.dumps(c.request("GET", protocol.POLICIES)["policies"], indent=2))


@policy.command("set")
@click.argument("pool")
@click.argument("changes", nargs=-1, required=True, metavar="KEY=VALUE...")
@server_options
def policy_set(pool: str, changes: tuple[str, ...], url: str | None, token: str | None) -> None:
    """Change a pool's policy (admin), e.g.: gpulease policy set A100-80GB idle_timeout=900 grace=300"""
    body: dict[str, Any] = {}
    for item in changes:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.UsageError(f"cannot read {item!r}: write KEY=VALUE")
        try:
            body[key] = json.loads(value)
        except json.JSONDecodeError:
            body[key] = [v for v in value.split(",") if v] if key.startswith("exempt") else value
    with Client(url, token) as c:
        click.echo(json.dumps(c.request("PUT", protocol.policy(pool), json=body), indent=2))


@click.group()
def kernel() -> None:
    """The CPU-only Jupyter kernel with the %%gpu_train magics."""


@kernel.command("install")
@click.option("--user", is_flag=True, help="Install for this user only (~/.local/share/jupyter)")
@click.option("--prefix", default=None, help="Install under this prefix (e.g. a virtualenv: sys.prefix)")
def kernel_install(user: bool, prefix: str | None) -> None:
    """Install the kernelspec "Python 3 (gpulease)": no GPU visible, magics preloaded."""
    from ..node.kernelspec import DISPLAY_NAME, install

    path = install(user=user, prefix=prefix)
    click.echo(f"installed kernel {DISPLAY_NAME!r} in {path}")


@click.group()
def token() -> None:
    """API tokens: create, list, revoke (admin)."""


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_expires(text: str, now: float | None = None) -> float:
    """Seconds from now until ``text``: a duration ("30d", "12h", "90m", "2w", "3600s") or a date
    ("2025-12-31": its midnight, local time)."""
    now = time.time() if now is None else now
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if match:
        seconds = float(match.group(1)) * UNITS[match.group(2)]
    else:
        try:
            seconds = datetime.datetime.fromisoformat(text.strip()).timestamp() - now
        except ValueError:
            raise click.BadParameter(
                f"{text!r} is neither a duration (30d, 12h, 90m, 2w) nor a date (2025-12-31)", param_hint="--expires"
            ) from None
    if seconds <= 0:
        raise click.BadParameter(f"{text!r} is not in the future", param_hint="--expires")
    return seconds


@token.command("create")
@click.argument("name")
@click.option("--admin", is_flag=True, help="Admin role: may revoke others' leases and manage tokens")
@click.option("--agent", "agent_role", is_flag=True, help="Agent role: a node agent (of one node: see --node)")
@click.option(
    "--proxy",
    "proxy_role",
    is_flag=True,
    help="Proxy role: a trusted front end (the Jupyter extension under JupyterHub) acting for its users",
)
@click.option("--expires", help="Refused after this: a duration (30d, 12h, 2w) or a date (2025-12-31); default never")
@click.option(
    "--acts-for",
    help="With --proxy (required): whom it may act for, e.g. 'alice,bob', 'lab-*', 're:^[a-z]+$', or '*' "
    "(anyone who holds no admin, agent or proxy token)",
)
@click.option("--node", help="With --agent: the one node it serves (default: the first node it serves)")
@click.option("--redis-url", envvar="GPULEASE_REDIS_URL", help="Write straight into this Redis (bootstrap)")
@click.option("--prefix", default="gpulease", show_default=True)
@click.option("--url", envvar="GPULEASE_URL")
@click.option("--token", "admin_token", envvar="GPULEASE_TOKEN")
def token_create(
    name: str,
    admin: bool,
    agent_role: bool,
    proxy_role: bool,
    expires: str | None,
    acts_for: str | None,
    node: str | None,
    redis_url: str | None,
    prefix: str,
    url: str | None,
    admin_token: str | None,
) -> None:
    """Create a token for user NAME and print it (it is stored only hashed; gpulease token list shows its id)."""
    if admin + agent_role + proxy_role > 1:
        raise click.UsageError("--admin, --agent and --proxy clash: a token has one role")
    if acts_for is not None and not proxy_role:
        raise click.UsageError("--acts-for is for proxy tokens: add --proxy")
    if node is not None and not agent_role:
        raise click.UsageError("--node is for agent tokens: add --agent")
    if proxy_role and acts_for is None:
        raise click.UsageError(
            "a proxy token needs --acts-for: the users it may act for ('alice,bob', a glob such as 'lab-*', "
            "'re:PATTERN', or '*' for anyone who holds no admin, agent or proxy token)"
        )
    role = "admin" if admin else "agent" if agent_role else "proxy" if proxy_role else "user"
    expires_in = parse_expires(expires) if expires else None
    if redis_url:
        from ..store.engine import connect
        from ..store.keys import Keys
        from ..store.layout import migrate_untagged
        from ..web.auth import create_token

        async def make() -> str:
            r = connect(redis_url)
            try:
                await migrate_untagged(r, Keys(prefix))
                return await create_token(
                    r, Keys(prefix), name, role, expires_in=expires_in, acts_for=acts_for, node=node
                )
            finally:
                await r.aclose()

        try:
            click.echo(asyncio.run(make()))
        except errors.BadRequest as exc:
            raise click.UsageError(str(exc)) from None
        return
    with Client(url, admin_token) as c:
        made = c.create_token(name, role, expires_in=expires_in, acts_for=acts_for, node=node)
        info = c.request("GET", protocol.INFO)
    click.echo(made["token"])
    if role == "user" and not info.get("multi_user") and c.token in _up_tokens():
        from .service import _local_user

        if name != _local_user():  # gpulease up is one person's: say so to whoever makes a token for another
            click.echo(
                f"note: gpulease up runs every cell as {_local_user()}: {name}'s cells would too,\n"
                "  and could read your files; for several people, see docs/deploy.md (multi_user)",
                err=True,
            )


def _when(ts: float | None, empty: str) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(ts)) if ts else empty


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return "never"
    s = max(0.0, now - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit} ago"
    return "just now"


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def token_lines(tokens: list[dict[str, Any]], now: float | None = None) -> list[str]:
    """The token list as text of at most 80 columns: id, user, role, created, expires, last used
    and scope (a proxy's acts_for, an agent's node)."""
    now = time.time() if now is None else now
    row = "{:<12} {:<12} {:<5} {:<10} {:<10} {:<9} {}"
    out = [row.format("ID", "USER", "ROLE", "CREATED", "EXPIRES", "LAST USED", "SCOPE")]
    for t in tokens:
        exp = t.get("expires")
        expires = "expired" if exp and exp <= now else _when(exp, "never")
        scope = (
            f"for {t.get('acts_for', '*')}"
            if t["role"] == "proxy"
            else f"node {t['node']}"
            if t.get("node")
            else "first node"
            if t["role"] == "agent"
            else ""
        )
        line = row.format(
            t["id"],
            _fit(t["user"], 12),
            t["role"],
            _when(t.get("created"), "?"),
            expires,
            _ago(t.get("last_used"), now),
            scope,
        )
        out.append(_fit(line.rstrip(), 80))
    return out


@token.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the tokens as JSON")
@server_options
def token_list(as_json: bool, url: str | None, token: str | None) -> None:
    """Every API token (admin): id, user, role, created, expires, last used, scope. Never the secrets."""
    with Client(url, token) as c:
        tokens = c.tokens()
    if as_json:
        click.echo(json.dumps(tokens, indent=2))
        return
    for line in token_lines(tokens):
        click.echo(line)


@token.command("revoke")
@click.argument("token_id")
@server_options
def token_revoke(token_id: str, url: str | None, token: str | None) -> None:
    """Revoke the token TOKEN_ID (admin; gpulease token list shows the ids): refused from the next request on."""
    with Client(url, token) as c:
        gone = c.revoke_token(token_id)
    click.echo(f"revoked token {gone['id']} of {gone['user']} ({gone['role']})")


@click.command()
@click.option(
    "--redis-url",
    envvar="GPULEASE_REDIS_URL",
    default=None,
    help="The Redis of a deployment (as gpulease server takes it); default: the config file's",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Or the data directory of gpulease up (its Redis is started for the migration), e.g. ~/.gpulease",
)
@click.option("--config", type=click.Path(exists=True), help="TOML settings file (for redis_url and prefix)")
@click.option("--dry-run", is_flag=True, help="Only list what would change")
def migrate(redis_url: str | None, data_dir: Path | None, config: str | None, dry_run: bool) -> None:
    """Move the data in Redis to this release's layout (stop every lease server first)."""
    from redis.exceptions import RedisError

    from ..config import Settings
    from ..node.redis_proc import for_data_dir
    from ..store import layout
    from ..store.engine import connect
    from ..store.keys import Keys

    if redis_url and data_dir:
        raise click.UsageError("--redis-url and --data-dir clash: name one Redis")
    proc = held = None
    if data_dir is not None:
        aof = data_dir.expanduser() / "redis"
        if not aof.is_dir():
            raise click.UsageError(f"{data_dir} holds no Redis data (no {aof}); pass the --data-dir gpulease up used")
        from .service import _hold

        held = _hold(data_dir.expanduser().resolve(), "migrate")  # never beside a running gpulease up
        proc = for_data_dir(data_dir.expanduser(), held=held).start()  # with the password gpulease up uses
        redis_url = proc.url
    try:
        settings = Settings.load(config, redis_url=redis_url)

        async def run() -> tuple[int | None, list[str]]:
            r = connect(settings.redis_url)
            try:
                return await layout.migrate(r, Keys(settings.prefix), dry_run)
            finally:
                await r.aclose()

        try:
            found, changes = asyncio.run(run())
        except RedisError as exc:
            from ..web.server import safe_url

            raise click.ClickException(
                f"cannot reach Redis at {safe_url(settings.redis_url)} ({exc}); pass --redis-url, or --data-dir "
                "for the data of gpulease up (stop gpulease up first)"
            ) from None
    finally:
        if proc is not None:
            proc.stop()
        if held is not None:
            os.close(held)
    for line in layout.describe(found, changes, dry_run):
        click.echo(line)
