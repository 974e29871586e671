"""The data layout has a version: a server meets data of another layout and refuses to start with one
line naming ``gpulease migrate``; ``--dry-run`` lists what changes; after the migration it starts and
reads the old data.

The old data is a real data directory written by the release at commit 77f5c60 (layout 0, before
versions): tests/data/layout0-77f5c60 (its make.py says how), one lease of alice's on 2 GPUs and one
request of bob's in the queue, its Redis killed as in a crash.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from redis import Redis

from lease_server.cli import main
from lease_server.node.redis_proc import RedisProcess
from lease_server.store.keys import Keys
from lease_server.store.layout import LAYOUT
from tests.conftest import ServerHandle, make_settings

OLD = Path(__file__).parent / "data" / "layout0-77f5c60"


@pytest.fixture
def old_redis(tmp_path: Path) -> Any:
    shutil.copytree(OLD / "redis", tmp_path / "redis")
    proc = RedisProcess(tmp_path / "redis").start()
    yield proc
    proc.stop()


def test_a_layout_0_data_dir_is_refused_then_migrated_and_read(old_redis: RedisProcess) -> None:
    r = Redis.from_url(old_redis.url, decode_responses=True)
    keys = Keys("gpulease")
    lease_id = (OLD / "lease").read_text().strip()
    assert r.get(keys.layout) is None and r.hexists(keys.leases, lease_id)  # the old release's data
    settings = make_settings(old_redis.url, "gpulease")

    with pytest.raises(RuntimeError) as refused:
        ServerHandle(settings, "box=2xA100-80GB").start()
    said = str(refused.value)
    assert "has layout 0, from an older gpulease" in said and "gpulease migrate --redis-url URL --dry-run" in said

    cli = CliRunner()
    before = {k: r.type(k) for k in r.scan_iter("*")}
    dry = cli.invoke(main, ["migrate", "--redis-url", old_redis.url, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.output.splitlines()[0] == f"would migrate layout 0 -> {LAYOUT}:"
    assert "1 request(s) of 1 user(s)" in dry.output and "(dry run: nothing changed)" in dry.output
    assert {k: r.type(k) for k in r.scan_iter("*")} == before

    done = cli.invoke(main, ["migrate", "--redis-url", old_redis.url])
    assert done.exit_code == 0 and done.output.startswith(f"migrated layout 0 -> {LAYOUT}:"), done.output
    assert r.get(keys.layout) == str(LAYOUT) and r.hgetall(keys.waiting_by) == {"bob": "1"}
    again = cli.invoke(main, ["migrate", "--redis-url", old_redis.url])
    assert again.output.strip() == f"the data has layout {LAYOUT}, this release's: nothing to do"

    srv = ServerHandle(settings, "box=2xA100-80GB").start()
    try:
        admin = srv.client("root", "admin")
        old = admin.get(lease_id)  # the old lease, read (and ended by its TTL long ago, by now)
        assert old["user"] == "alice" and old["label"] == "layout-0 lease" and len(old["gpus"]) == 2
    finally:
        srv.stop()
    r.close()


def test_a_newer_layout_is_refused_and_a_fresh_store_gets_this_one(old_redis: RedisProcess, prefix: str) -> None:
    r = Redis.from_url(old_redis.url, decode_responses=True)
    keys = Keys("gpulease")
    r.set(keys.layout, LAYOUT + 1)
    with pytest.raises(RuntimeError, match=f"has layout {LAYOUT + 1}, written by a newer gpulease"):
        ServerHandle(make_settings(old_redis.url, "gpulease"), "box=2xA100-80GB").start()
    dry = CliRunner().invoke(main, ["migrate", "--redis-url", old_redis.url, "--dry-run"])
    assert dry.exit_code == 1 and "newer than this gpulease's" in dry.output
    # A prefix with no data (a token alone is none): the server writes this layout and starts.
    fresh = Keys(prefix)
    srv = ServerHandle(make_settings(old_redis.url, prefix), "box=2xA100-80GB")
    srv.token("alice")
    srv.start()
    srv.stop()
    assert r.get(fresh.layout) == str(LAYOUT)
    r.close()
