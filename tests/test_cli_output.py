"""What a user reads on the first day, at 80 columns: gpulease events / status / leases /
bookings, ids given by their start, errors that name commands, a missing program.

One `gpulease up` for the module; every command runs as a subprocess with COLUMNS=80, and no line
of what it prints may be longer (a longer one would wrap in the terminal).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lease_server import errors
from lease_server.cli.events import Wanted, newest, parse_since, position, read_forward
from lease_server.client import Client
from lease_server.store.keys import Keys
from tests.conftest import CLI, Stack, Up

WIDTH = 80


STACK = Stack.of("box=2xA100-80GB,vm=4xA100-80GB", "--no-ray", COLUMNS=str(WIDTH))  # conftest's `up`


def client(up: Up, user: str | None = None) -> Client:
    token = (up.data / "token").read_text().strip()
    if user is None:
        return Client(up.url, token)
    made = up.run("token", "create", user, "--url", up.url, "--token", token)
    assert made.returncode == 0, made.stderr
    # up is one person's: a token for someone else says so (their cells would run as up's user)
    said = " ".join(made.stderr.split())
    assert "note: gpulease up runs every cell as " in said and "docs/deploy.md (multi_user)" in said, made.stderr
    return Client(up.url, made.stdout.strip())


def run(up: Up, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it; every line it prints for people (out and err) fits 80
    columns (JSON lines are for programs)."""
    done = up.run(*args)
    if ok:
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    for stream in (done.stderr,) if "--json" in args else (done.stdout, done.stderr):
        for line in stream.splitlines():
            assert len(line) <= WIDTH, f"{args}: {len(line)} columns: {line!r}"
    assert "Traceback" not in done.stderr, done.stderr
    return done


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def end_all(c: Client) -> None:
    for lease in c.leases(everyone=True):
        c.release(lease["id"])


# ---- events ------------------------------------------------------------------------------------

EVENT_LINE = re.compile(r"^(\d\d:\d\d:\d\d)  (\w+) +(\S+) +(.*)$")


def test_events_shows_the_newest_a_line_each(up: Up) -> None:
    c = client(up)
    end_all(c)
    for i in range(30):  # 60 lease events, besides the nodes' registrations: more than a page of 50
        lease = c.acquire(2, label=f"run {i}")
        c.release(lease)
    log = c.events("-", 10_000)
    assert len(log) > 54

    shown = lines(run(up, "events").stdout)
    assert len(shown) == 50
    assert all(EVENT_LINE.match(line) for line in shown), shown
    last = log[-1]  # the newest event is the last line (oldest first within the page)
    assert last["type"] == "released" and last["lease"][:10] in shown[-1]
    assert shown[-1].split()[1:3] == ["released", last["user"]]
    grant = next(line for line in shown if " grant " in line)
    assert re.search(r"grant +\S+ +2x A100-80GB on (box|vm) \(GPU \d,\d\) \"run \d+\"  l-[0-9a-f]{8}$", grant), grant

    raw = [json.loads(line) for line in run(up, "events", "--json").stdout.splitlines()]
    assert raw == log[-50:]
    assert [json.loads(line) for line in run(up, "events", "-n", "3", "--json").stdout.splitlines()] == log[-3:]
    assert len(lines(run(up, "events", "-n", "0", "--json").stdout)) == len(log)


def test_events_filters(up: Up) -> None:
    c = client(up)
    end_all(c)
    bob = client(up, "bob")
    held = bob.acquire(1, label="bob's")
    bob.release(held)
    log = c.events("-", 10_000)

    of_bob = lines(run(up, "events", "--user", "bob").stdout)
    assert [line.split()[1] for line in of_bob] == ["grant", "released"]
    assert all(line.split()[2] == "bob" and held.id[:10] in line for line in of_bob)

    grants = lines(run(up, "events", "--type", "grant", "-n", "5").stdout)
    assert len(grants) == 5 and all(line.split()[1] == "grant" for line in grants)
    assert held.id[:10] in grants[-1]
    both = run(up, "events", "--type", "grant,released", "-n", "4", "--json").stdout
    assert [json.loads(x)["type"] for x in both.splitlines()] == ["grant", "released"] * 2

    for given in (held.id, held.id[:8], held.id[2:10]):  # the whole id, a start of it, without "l-"
        mine = lines(run(up, "events", "--lease", given).stdout)
        assert [line.split()[1] for line in mine] == ["grant", "released"], given

    since = log[-3]["id"]
    after = [json.loads(x) for x in run(up, "events", "--since", since, "--json").stdout.splitlines()]
    assert after == log[-2:]
    assert len(lines(run(up, "events", "--since", "1h", "-n", "0").stdout)) == len(log)
    assert run(up, "events", "--since", "1m", "--user", "nobody").stdout.strip() == "no events match"

    bad = run(up, "events", "--type", "grnat", ok=False)
    assert bad.returncode == 2 and "no event type 'grnat'; did you mean grant?" in bad.stderr
    bad = run(up, "events", "--since", "yesterday-ish", ok=False)
    assert bad.returncode == 2 and "give an age (10m, 2h, 3d)" in " ".join(bad.stderr.split())


class LineReader:
    """A process's stdout lines, read by a thread as they come (a select() on the pipe would miss
    lines already taken into the file's buffer by an earlier readline)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.lines: queue.Queue[str] = queue.Queue()
        stdout = proc.stdout
        threading.Thread(target=lambda: [self.lines.put(line) for line in stdout], daemon=True).start()

    def next(self, deadline: float) -> str:
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError("no line from gpulease events --follow in time") from None


def test_events_follow_prints_what_happens(up: Up) -> None:
    c = client(up)
    end_all(c)
    proc = subprocess.Popen(
        [*CLI, "events", "--follow", "-n", "1"],
        env=up.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    try:
        deadline = time.monotonic() + 30
        reader = LineReader(proc)
        first = reader.next(deadline)  # the page (one line): the stream is open after it
        assert EVENT_LINE.match(first), first
        # The stream is subscribed before the gap is read: an event now is printed, wherever it falls.
        lease = c.acquire(1, label="followed")
        c.release(lease)
        seen = []
        while len(seen) < 2:
            line = reader.next(deadline)
            assert len(line.rstrip("\n")) <= WIDTH, line
            if lease.id[:10] in line:
                seen.append(line.split()[1])
        assert seen == ["grant", "released"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)  # stdout is the reader's; stderr holds a line or two
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"events --follow did not stop on Ctrl-C: {proc.stderr.read()}") from None
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert proc.returncode == 0 and "Traceback" not in err, err


class Counting(Client):
    """A client that counts its reads of the log: requests, and entries they carried."""

    calls = read = 0

    def events(self, *args: Any, **kw: Any) -> list[dict[str, Any]]:
        page = super().events(*args, **kw)
        self.calls += 1
        self.read += len(page)
        return page


def test_newest_is_one_request_filtered_by_the_server(server_factory: Any, redis_sync: Any) -> None:
    """The newest 50 of 25 000 entries are one request of 51 entries; so are the newest of a type
    or of a user; a start of an id pages back newest first; --since bounds what is read."""
    srv = server_factory(log_read_burst=200_000)  # the whole log is read once below: within a token's budget
    key = Keys(srv.settings.prefix).events
    pipe = redis_sync.pipeline(transaction=False)
    for i in range(25_000):  # a node_down every 1000th, a booking's every 500th, the rest grants
        data: dict[str, Any] = {"ts": 1_800_000_000_000 + i, "user": "bob" if i % 7 == 0 else "alice"}
        kind = "grant" if i % 1000 else "node_down"
        if i % 500 == 250:
            kind, data["id"] = "reservation_created", f"r-{i:012x}"
        pipe.xadd(key, {"type": kind, "data": json.dumps(data)})
    pipe.execute()
    c = Counting(srv.url, srv.token("alice"))
    log = list(read_forward(c, None))
    assert len(log) >= 25_000  # and the node the server registered

    c.calls = c.read = 0
    got, more, last = newest(c, 50, Wanted())
    assert got == log[-50:] and more and last == position(log[-1])
    assert (c.calls, c.read) == (1, 51)

    c.calls = 0
    downs, more, _ = newest(c, 3, Wanted(types=frozenset({"node_down"})))
    assert downs == [ev for ev in log if ev["type"] == "node_down"][-3:] and more and c.calls == 1
    c.calls = 0
    bobs, _, _ = newest(c, 5, Wanted(user="bob"))
    assert bobs == [ev for ev in log if ev.get("user") == "bob"][-5:] and c.calls == 1

    c.calls = 0
    start = "r-000000005"  # 8 bookings' ids start so (i = 0x5000..0x5fff), the newest 2 at 20 000 and up
    mine, more, _ = newest(c, 2, Wanted(prefix=start))
    assert mine == [ev for ev in log if str(ev.get("reservation", "")).startswith(start)][-2:] and more
    # The newest two such bookings are 750 and 1250 entries back: the newest two pages (a page is
    # the server's cap, EVENT_LOG_PAGE_CAP), not the whole log.
    assert c.calls == 2

    c.calls = c.read = 0
    tail, more, _ = newest(c, 50, Wanted(), after=position(log[-10]))
    assert tail == log[-9:] and not more and c.calls == 1

    everything, more, _ = newest(c, 10**6, Wanted())
    assert everything == log and not more


def test_parse_since() -> None:
    now = 1_800_000_000.0
    assert parse_since("1700000000000-3", now) == (1_700_000_000_000, 3)
    assert parse_since("10m", now) == (int((now - 600) * 1000), 0)
    assert parse_since("2h", now) == (int((now - 7200) * 1000), 0)
    assert parse_since("2026-01-01T00:00:00+00:00", now) == (1_767_225_600_000, 0)
    hh = parse_since("00:00", now)
    assert hh[0] <= now * 1000 and now * 1000 - hh[0] < 86_400_000


# ---- status, leases, ids by their start --------------------------------------------------------

LABEL = "fine tune the big model on the whole corpus"


def test_status_is_a_line_per_lease_with_whole_ids(up: Up) -> None:
    c = client(up)
    end_all(c)
    two = c.acquire(2, label=LABEL)
    one = c.acquire(1, label="x")
    try:
        out = run(up, "status").stdout
        rows = [line for line in out.splitlines() if re.match(r"^l-[0-9a-f]{16} ", line)]
        assert [r.split()[0] for r in rows] == [two.id, one.id], out
        assert re.search(r"\w GPU \d,\d", rows[0]) and "fine tune" in rows[0] and LABEL not in rows[0]
        assert rows[0].rstrip().endswith("…"), rows[0]  # the label is cut, on its line
        header = next(line for line in out.splitlines() if line.startswith("lease "))
        assert header.split() == ["lease", "user", "GPUs", "util", "held", "label"]  # no model repeating the pool

        wide = up.run("status", "--wide").stdout
        assert "model" in wide and wide.count(two.id) == 2 and one.id in wide
        assert f"{LABEL[:39]}…" in wide and LABEL not in wide  # a label's first 40 columns, even here

        mine = run(up, "leases").stdout
        assert two.id in mine and one.id in mine and "fine tune" in mine
        assert "user" not in lines(mine)[0]
        everyone = run(up, "leases", "--all").stdout
        assert "user" in lines(everyone)[0]
        assert json.loads(run(up, "leases", "--json").stdout)["leases"][0]["id"] == two.id

        # a warm lease (between a notebook's cells): its state, and a warm column for its pool
        c.warm(one, on=True)
        out = run(up, "status").stdout
        pools_header = next(line for line in out.splitlines() if " pool " in f" {line}" and " free " in line)
        assert [w for w in re.split(r"[┃│ ]+", pools_header) if w] == [
            "pool",
            "nodes",
            "gpus",
            "free",
            "leased",
            "warm",
            "down",
            "waiting",
        ], pools_header
        warm_row = next(line for line in out.splitlines() if line.startswith(one.id))
        two_row = next(line for line in out.splitlines() if line.startswith(two.id))
        assert " warm " in warm_row and " active " in two_row, out
        mine = {line.split()[0]: line.split()[1] for line in run(up, "leases").stdout.splitlines()[1:]}
        assert mine == {two.id: "active", one.id: "warm"}, mine

        released = run(up, "release", two.id[:8])  # any unique start of the id
        assert released.stdout.strip() == f"{two.id}: released"
        again = run(up, "release", two.id[2:12], ok=False)  # ended: no live lease starts so, the server says
        assert again.returncode == 2 and "gpulease leases" in again.stderr and "/api/" not in again.stderr
    finally:
        end_all(c)


def test_ambiguous_start_lists_the_matches(up: Up) -> None:
    c = client(up)
    end_all(c)
    a = c.acquire(1, label="first", request_id="l-abcd000000000001")
    b = c.acquire(1, label="second", request_id="l-abcd000000000002")
    try:
        amb = run(up, "release", "l-abcd", ok=False)
        assert amb.returncode == 2
        assert a.id in amb.stderr and b.id in amb.stderr and "first" in amb.stderr
        assert "gpulease leases" in amb.stderr
        assert c.get(a.id)["state"] == "active" and c.get(b.id)["state"] == "active"
        kept = run(up, "keep", "abcd000000000002", ok=False)  # a unique start, without "l-"
        assert b.id in kept.stdout + kept.stderr and "/api/" not in kept.stderr
        assert run(up, "revoke", "l-abcd000000000001", "--reason", "test").stdout.strip() == f"{a.id}: revoked"
    finally:
        end_all(c)


def test_errors_name_commands_not_http_paths(up: Up) -> None:
    gone = run(up, "release", "l-6a6683", ok=False)
    assert gone.returncode == 2
    assert "no lease 'l-6a6683'" in gone.stderr and "gpulease leases" in gone.stderr
    assert "/api/v1" not in gone.stderr and "GET " not in gone.stderr
    no_booking = run(up, "unbook", "r-000000000000", ok=False)
    assert no_booking.returncode == 2 and "gpulease bookings" in no_booking.stderr
    assert "/api/v1" not in no_booking.stderr


# ---- bookings ----------------------------------------------------------------------------------

NOTE = "paper deadline experiments for the NeurIPS rebuttal, ablations first"


def test_bookings_are_a_line_each(up: Up) -> None:
    booked = run(up, "book", "A100-80GB", "2", "2027-01-04T09:00:00+00:00", "2027-01-04T11:00:00+00:00")
    plain = booked.stdout.split(":")[0]
    weekly = run(
        up, "book", "A100-80GB", "1", "2027-01-05T09:00Z", "2027-01-05T10:00Z", "--note", NOTE, "--weekly", "3"
    ).stdout.split(":")[0]
    out = run(up, "bookings", "--days", "365").stdout
    rows = lines(out)[1:]
    assert len(rows) == 4 and [r.split()[0] for r in rows] == [plain] + [weekly] * 3, out
    noted = [r for r in rows if r.startswith(weekly)]
    assert all("paper deadline" in r and r.rstrip().endswith("…") for r in noted), out
    assert NOTE in up.run("bookings", "--days", "365", "--wide").stdout

    assert run(up, "unbook", weekly[:6]).stdout.strip() == f"{weekly}: cancelled"
    assert run(up, "unbook", plain[2:]).stdout.strip() == f"{plain}: cancelled"


def test_usage_keeps_its_headers_on_one_line_and_a_long_notebook_path_whole(up: Up) -> None:
    c = client(up)
    end_all(c)
    path = "experiments/2027/vision/resnet50-finetune-imagenet-subset.ipynb"  # 62 characters
    c.release(c.acquire(1, notebook=path, cell="3"))
    out = run(up, "usage", "--by", "notebook").stdout
    none = run(up, "usage", "--days", "1e-9").stdout  # a window nothing ended in: a sentence, not an empty table
    assert none.strip() == "no lease ended in the last 1e-09 days (--days 30 looks further back)", none
    head = next(line for line in out.splitlines() if line.startswith("notebook"))
    heads = ["notebook", "calls", "GPU-h", "charged", "util", "%", "peak", "MiB", "wait", "p50", "revoked"]
    assert head.split() == heads, out
    assert path in "".join(line.split()[0] for line in lines(out)[2:] if line.split()), out  # folded, not cut
    assert "…" not in out


def test_a_warm_lease_and_its_next_cell_read_as_words_in_the_log(up: Up) -> None:
    """The warm-cell events (kept warm, resumed) are sentences, not key=value dumps."""
    c = client(up)
    end_all(c)
    lease = c.acquire(1, pool="A100-80GB", label="warm one")
    c.warm(lease, on=True)
    c.warm(lease, on=False)
    c.release(lease)
    shown = lines(run(up, "events", "-n", "6").stdout)
    kinds = {line.split()[1]: line for line in shown}
    assert re.search(r"  warm +root +on (box|vm) \(GPU \d\) until \d\d:\d\d, lendable  ", kinds["warm"]), kinds
    assert re.search(r"  resumed +root +on (box|vm): a cell runs, 0m0\ds warm  ", kinds["resumed"]), kinds
    assert not any("=" in line for line in shown), shown


def test_an_evicted_warm_lease_reads_as_words_in_the_log(up: Up) -> None:
    """Someone waits for a warm lease's GPU: the log says who it is recalled for and when the GPU
    comes back (here no kernel follows the lease: it is revoked at the end of the notice)."""
    c, bob = client(up), client(up, "bob")
    end_all(c)
    warm = c.acquire(1, pool="A100-80GB", label="warm one")
    c.warm(warm, on=True)
    held = []
    while True:  # every other GPU of the pool, so that bob's request can only be served by eviction
        try:
            held.append(c.acquire(1, pool="A100-80GB"))
        except errors.NoCapacity:
            break
    try:
        granted = bob.acquire(1, pool="A100-80GB", wait=30)
        bob.release(granted)
    finally:
        for lease in held:
            c.release(lease)
    shown = lines(run(up, "events", "-n", "40").stdout)
    evicting = next(line for line in shown if "  evicting " in line)
    assert re.search(r" on (box|vm) for bob: GPUs back at \d\d:\d\d:\d\d  l-", evicting), evicting
    assert not any("=" in line for line in shown), shown


# ---- acquire -- a missing program --------------------------------------------------------------


def test_acquire_a_missing_program_says_so_like_a_shell(up: Up) -> None:
    c = client(up)
    end_all(c)
    missing = run(up, "acquire", "--", "no-such-program-nvidia-smi", "-L", ok=False)
    assert missing.returncode == 127
    assert missing.stderr.strip().splitlines()[-1] == "gpulease: no-such-program-nvidia-smi: command not found"
    assert c.leases(everyone=True) == []
    # `gpulease acquire 2`: a count where a program goes; the line says how to ask for 2 GPUs
    count = run(up, "acquire", "2", ok=False)
    assert count.returncode == 127
    assert count.stderr.strip().splitlines()[-1] == (
        "gpulease: 2: command not found; to lease 2 GPUs: gpulease acquire --gpus 2"
    )
    assert c.leases(everyone=True) == []
    # `gpulease acquire --gpu 1`: a mistyped option, not a program to run
    typo = run(up, "acquire", "--gpu", "1", ok=False)
    assert typo.returncode == 2
    said = " ".join(typo.stderr.split())
    assert "no such option: --gpu (did you mean --gpus?)." in said and "goes after --" in said, typo.stderr
    assert "command not found" not in said and all(len(line) <= 80 for line in typo.stderr.splitlines())
    assert c.leases(everyone=True) == []

    # A short folder: the line names the path whole, and pytest's tmp_path (longer under xdist:
    # .../popen-gw2/...) alone can pass 80 columns.
    short = Path(tempfile.mkdtemp(prefix="gl-"))
    try:
        script = short / "train.sh"
        script.write_text("#!/bin/sh\necho hi\n")
        script.chmod(0o644)
        denied = run(up, "acquire", "--", str(script), ok=False)
        assert denied.returncode == 126 and f"gpulease: {script}: Permission denied" in " ".join(denied.stderr.split())
        assert c.leases(everyone=True) == []
    finally:
        shutil.rmtree(short)


def test_acquire_a_gang_over_nodes_as_the_refusal_suggests(up: Up) -> None:
    """More GPUs than any node has: the refusal names --nodes K, and acquire takes it; a gang with a
    COMMAND is refused before anything is leased (the command would run on this machine only)."""
    c = client(up)
    end_all(c)
    too_big = run(up, "acquire", "--gpus", "6", ok=False)
    assert too_big.returncode == 2 and "ask --gpus 4, or --nodes K" in " ".join(too_big.stderr.split()), too_big.stderr
    lease = json.loads(run(up, "acquire", "--gpus", "4", "--nodes", "2").stdout)
    assert sorted(lease["nodes"]) == ["box", "vm"] and len(lease["gpus"]) == 4
    c.release(lease["id"])
    three = run(up, "acquire", "--gpus", "3", "--nodes", "3", ok=False)
    said = " ".join(three.stderr.split())
    assert three.returncode == 2, said
    assert "a gang of 1 GPU on each of 3 nodes cannot fit pool 'A100-80GB': only 2 of its nodes have 1 GPU;" in said
    with_command = run(up, "acquire", "--gpus", "4", "--nodes", "2", "--", "true", ok=False)
    assert with_command.returncode == 2
    assert "or run it with %%gpu_train --nodes 2" in " ".join(with_command.stderr.split())
    assert c.leases(everyone=True) == []


def test_acquire_waits_for_a_duration_says_where_it_stands_and_ctrl_c_withdraws(up: Up) -> None:
    """--wait takes 30s or 10m as %%gpu_train's does (a bad one: a usage error that shows how to
    write it); a queued acquire says its place in the queue, and Ctrl-C leaves the queue with one
    line and exit 130, not click's bare "Aborted!"."""
    c = client(up)
    end_all(c)
    bad = run(up, "acquire", "--wait", "3x", ok=False)
    assert bad.returncode == 2 and "write e.g. 90, 90s, 10m or 1h30m" in " ".join(bad.stderr.split()), bad.stderr
    held = [json.loads(run(up, "acquire", "--gpus", str(n), "--wait", "30s").stdout) for n in (4, 2)]  # all 6
    assert sorted(h["node"] for h in held) == ["box", "vm"]
    proc = subprocess.Popen(
        [*CLI, "acquire", "--wait", "10m"],
        env=up.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    try:
        reader = LineReader(proc)
        deadline = time.monotonic() + 30
        line = reader.next(deadline)
        assert line.rstrip("\n") == "queued for 1 GPU of A100-80GB: 1st in line", line  # the default pool, named
        assert len(c.queue()) == 1
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        rest = []
        while not rest or not rest[-1].startswith("withdrawn"):
            rest.append(reader.next(time.monotonic() + 5).rstrip("\n"))
        last = rest[-1]
        # A Ctrl-C that lands inside rich's print can leave that line in its buffer, and the next
        # print writes it again: the same place in the queue, never anything else.
        assert set(rest[:-1]) <= {line.rstrip("\n")}, rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, last
    assert re.fullmatch(r"withdrawn after \d+s: no GPU was taken", last), last
    assert c.queue() == []
    # Refused in the words of acquire's own flag: a duration, not the API's "wait (seconds)".
    now = run(up, "acquire", "--pool", "A100-80GB", ok=False)
    assert now.returncode == 2 and "pass --wait (e.g. --wait 10m) to queue for them" in now.stderr, now.stderr
    assert "(seconds)" not in now.stderr
    out = run(up, "acquire", "--pool", "A100-80GB", "--wait", "2s", ok=False)
    assert out.returncode == 2 and c.queue() == []
    assert lines(out.stderr)[-2:] == [
        "error: gave up after --wait 2s, still 1st in line for 1 GPU of A100-80GB",
        "  a longer --wait waits more, or ask for fewer GPUs",
    ], out.stderr
    for h in held:
        c.release(h["id"])


def test_acquire_without_a_command_prints_a_line_on_a_terminal_and_json_to_a_pipe(up: Up) -> None:
    import pty

    c = client(up)
    end_all(c)
    master, replica = pty.openpty()  # stdout a terminal, as a person runs it
    proc = subprocess.Popen([*CLI, "acquire", "--gpus", "2"], stdout=replica, stderr=subprocess.PIPE, env=up.env)
    os.close(replica)
    _, err = proc.communicate(timeout=60)
    shown = b""
    with contextlib.suppress(OSError):  # EIO once the command has exited and its output is read
        while chunk := os.read(master, 4096):
            shown += chunk
    os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode())
    assert proc.returncode == 0, err
    [lease] = c.leases()
    assert text.strip().splitlines()[-1] == f"leased box GPU 0,1 ({lease['id']})", text
    said = err.decode()
    assert "expires in 0m15s unless renewed (--ttl 1h for longer)" in said, said
    assert f"release it with: gpulease release {lease['id']}" in said
    c.release(lease["id"])
    # to a pipe (a script), or with --json: the lease as JSON
    for args in (("acquire",), ("acquire", "--json")):
        piped = run(up, *args, "--ttl", "5m")
        got = json.loads(piped.stdout)
        assert got["user"] == "root" and "--ttl 1h" not in piped.stderr
        c.release(got["id"])


def test_acquire_a_program_gone_by_exec_time_releases(up: Up, tmp_path: Path) -> None:
    """The program there when checked, before the lease, but gone when run: the same one line and
    127, after the lease (granted) is released."""
    c = client(up)
    end_all(c)
    env = dict(up.env)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    prog = bin_dir / "vanishing"
    # The CLI in a child whose subprocess.call first deletes the program: the exec then fails.
    prog.write_text("#!/bin/sh\nexit 0\n")
    prog.chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    code = (
        "import os, sys, shutil, subprocess\n"
        "real = subprocess.call\n"
        f"def call(args, **kw):\n    os.unlink({str(prog)!r})\n    return real(args, **kw)\n"
        "subprocess.call = call\n"
        "from lease_server.cli import main\n"
        "sys.argv = ['gpulease', 'acquire', '--', 'vanishing']\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 127, done.stderr
    assert "gpulease: vanishing: command not found" in done.stderr and "Traceback" not in done.stderr
    assert "leased" in done.stderr and "released" in done.stderr and c.leases(everyone=True) == []


# ---- an idle warning, answered by the id's start ------------------------------------------------


def test_idle_lease_in_status_names_the_keep_command(up: Up) -> None:
    """Last in the module: it makes A100-80GB's reclaim policy hair-trigger (restored after)."""
    c = client(up)
    end_all(c)
    run(up, "policy", "set", "A100-80GB", "idle_timeout=1", "min_age=0", "grace=600")
    try:
        lease = c.acquire(2, ttl=600, label="waiting for data")
        deadline = time.monotonic() + 60
        while not c.get(lease.id).get("reclaim_at"):  # the reclaimer runs on its own clock
            assert time.monotonic() < deadline, "no idle warning within 60 s"
            time.sleep(0.2)
        out = run(up, "status").stdout
        row = next(line for line in out.splitlines() if line.startswith(lease.id))
        assert re.search(r"\d+m\d\ds +idle +waiting for data", row), row
        note = next(line for line in out.splitlines() if line.startswith(f"{lease.id[:10]} idle"))
        assert f"(gpulease keep {lease.id[:10]})" in note
        kept = run(up, "keep", lease.id[:10])
        assert kept.stdout.startswith(f"{lease.id}: kept")
    finally:
        run(up, "policy", "set", "A100-80GB", "idle_timeout=600", "min_age=120", "grace=120")
        end_all(c)


def test_status_shows_a_sliced_gpu_and_its_slices_in_80_columns(server_factory: Any) -> None:
    """A GPU shared by slices: the pools table counts it and its slices (every column there is, a
    second pool and a warm lease, and still each pool's whole name within 80 columns), each slice's
    line says its size of its GPU, and a line per sliced GPU says its slices and the memory left. A
    label that holds a whole code line is its start, cut with an ellipsis, in --wide too."""
    srv = server_factory("box=2xA100-80GB,gh=1xH100_NVL-94GB", scheduling={"A100-80GB": {"share": True}})
    c = Client(srv.url, srv.token("alice"))
    # Long TTLs: nothing renews these, and two CLI runs on a loaded CI machine outlast the default 15 s.
    code_line = "model.fit(train_loader, epochs=100, callbacks=[EarlyStopping(patience=5)], verbose=2)"
    small = c.acquire(1, "A100-80GB", gpu_mem="10GB", label=code_line, ttl=600)
    big = c.acquire(1, "A100-80GB", gpu_mem="30GB", label="big", ttl=600)
    c.warm(big)  # kept for its notebook's next cell: its state says warm
    whole = c.acquire(1, "H100_NVL-94GB", label=code_line, ttl=600)
    c.warm(whole)  # a warm whole GPU: its pool's warm column too, the widest the table gets
    env = {**os.environ, "COLUMNS": str(WIDTH), "GPULEASE_URL": srv.url, "GPULEASE_TOKEN": srv.token("alice")}
    done = subprocess.run([*CLI, "status"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    out = done.stdout
    for line in (*out.splitlines(), *done.stderr.splitlines()):
        assert len(line) <= WIDTH, f"{len(line)} columns: {line!r}"
    default = json.loads(subprocess.run([*CLI, "status", "--json"], env=env, capture_output=True, text=True).stdout)
    assert f"Pools (default: {default['default_pool']})" in out, out
    pools_header = next(line for line in out.splitlines() if " pool " in f" {line}" and " free " in line)
    cols = pools_header.split()
    assert cols == ["pool", "nodes", "gpus", "free", "leased", "warm", "sliced", "slices", "down", "waiting"], out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if re.match(r"^[AH]100[-_]", line)}
    assert rows == {  # each pool's name whole, on its line with its counts
        "A100-80GB": ["1", "2", "1", "0", "0", "1", "2", "0", "0"],
        "H100_NVL-94GB": ["1", "1", "0", "0", "1", "0", "0", "0", "0"],
    }, out
    gpu = small.gpus[0]["index"]
    rows = {line.split()[0]: line for line in out.splitlines() if re.match(r"^l-[0-9a-f]{16} ", line)}
    assert f"box GPU {gpu} 10G/80G" in rows[small.id] and f"box GPU {gpu} 30G/80G" in rows[big.id], out
    assert rows[small.id].rstrip().endswith("…") and "model.fit(" in rows[small.id]
    assert " warm " in rows[big.id] and " active " in rows[small.id], out
    assert f"sliced: box GPU {gpu}: 2 slices, 40G of 80G leased, 40G free" in out, out
    done = subprocess.run([*CLI, "status", "--wide"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    wide = done.stdout
    row = next((line for line in wide.splitlines() if " sliced " in line and line.startswith("box ")), wide)
    assert row.split()[:2] == ["box", str(gpu)], row  # its GPU's row
    assert " 2 slices " in row and "40G of 80G leased, 40G free" in row, row
    # a label in --wide: its first 40 columns, on its GPU's line (a code line made it 190 wide)
    row = next(line for line in wide.splitlines() if whole.id in line)
    assert code_line not in wide and f"{code_line[:39]}…" in row, row
    width = max(len(line.rstrip()) for line in wide.splitlines())
    assert width <= 130, wide


def test_help_lists_every_command_on_one_line_not_cut_off() -> None:
    done = subprocess.run([*CLI, "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": str(WIDTH)})
    listed = done.stdout.split("Commands:\n")[1].splitlines()
    assert listed and all(len(line) <= WIDTH and not line.endswith("...") for line in listed), done.stdout
    from lease_server.cli import main

    shown = {name for name, c in main.commands.items() if not c.hidden}
    assert {line.split()[0] for line in listed} == shown
