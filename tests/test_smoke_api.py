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
