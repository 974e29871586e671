from lease_server import errors


def test_acquire_renew_release_roundtrip(server):
    c = server.client("alice")
    lease = c.acquire(2, label="smoke")
    assert lease.pool == "A100-80GB" and len(lease.gpus) == 2
    renewed = c.renew(lease)
    assert renewed.expires_at >= lease.expires_at
    out = c.release(lease)
    assert out["state"] == "released" and out["changed"] is True
    again = c.release(lease)
    assert again["changed"] is False
    try:
        c.renew(lease)
    except errors.LeaseEnded as exc:
        assert "released" in exc.message
    else:
        raise AssertionError("renew of a released lease must fail")


def test_resent_acquire_with_the_same_id_returns_the_same_grant(server):
    c = server.client("alice")
    body = {"id": "req-12345678", "gpus": 1}
    first = c.request("POST", "/api/v1/leases", json=body)
    again = c.request("POST", "/api/v1/leases", json=body)
    assert again["id"] == first["id"] == "req-12345678" and again["token"] == first["token"]
    other = server.client("bob")
    try:
        other.request("POST", "/api/v1/leases", json=body)
    except errors.Conflict as exc:
        assert "already in use" in exc.message
    else:
        raise AssertionError("another user's request must not get alice's lease")
    assert len(c.leases()) == 1


def test_progress_reports_queue_position_while_waiting(server):
    import threading

    holder = server.client("alice")
    waiter = server.client("bob")
    held = holder.acquire(2, pool="T4-16GB")
    seen: list[tuple[int | None, float]] = []
    reported = threading.Event()

    def progress(position, elapsed):
        seen.append((position, elapsed))
        reported.set()

    result: dict[str, object] = {}
    t = threading.Thread(
        target=lambda: result.update(lease=waiter.acquire(1, pool="T4-16GB", wait=30, progress=progress))
    )
    t.start()
    assert reported.wait(15)
    holder.release(held)
    t.join(15)
    assert seen[0][0] == 1 and seen[0][1] > 0
    assert result["lease"].pool == "T4-16GB"


def test_owner_release_records_a_reason(server):
    c = server.client("alice")
    lease = c.acquire(1)
    out = c.request("DELETE", f"/api/v1/leases/{lease.id}", params={"reason": "kernel shut down"})
    assert out["state"] == "released" and out["end_reason"] == "kernel shut down"
    ended = [e for e in c.events(limit=1000) if e["type"] == "released" and e["lease"] == lease.id]
    assert ended[0]["reason"] == "kernel shut down"
