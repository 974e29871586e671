import pytest

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


def test_a_request_whose_connection_closes_unanswered_is_sent_once_more(server):
    """A kept-alive connection the server closes (idle) just as a request goes out gets no answer:
    the client sends it once more on a new connection, to the real server here; a peer that drops
    it twice is an error that says what to check."""
    import socket
    import threading

    from lease_server.client import Client

    def dropper(times: int) -> tuple[str, list[int]]:
        """A TCP peer in front of the server that reads the first ``times`` requests and closes
        each unanswered, then passes each later connection through to the real server."""
        lsock = socket.create_server(("127.0.0.1", 0))
        seen = [0]
        host, port = server.url.removeprefix("http://").split(":")

        def pipe(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    s.close()

        def serve() -> None:
            while True:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    return
                seen[0] += 1
                if seen[0] <= times:
                    conn.recv(65536)
                    conn.close()
                    continue
                up = socket.create_connection((host, int(port)))
                threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
                threading.Thread(target=pipe, args=(up, conn), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{lsock.getsockname()[1]}", seen

    url, seen = dropper(1)
    with Client(url, server.token("alice")) as c:
        lease = c.acquire(1, request_id="r-dropped-once")  # sent twice, granted once
        assert seen[0] == 2 and [x["id"] for x in c.leases()] == [lease.id]
        c.release(lease)
    url, seen = dropper(2)
    with (
        Client(url, server.token("alice")) as c,
        pytest.raises(errors.ServerUnavailable, match="twice without an answer"),
    ):
        c.leases()
    # a POST that makes something is not sent twice: the server may have made it already
    url, seen = dropper(1)
    with Client(url, server.token("root", "admin")) as c:
        with pytest.raises(errors.ServerUnavailable, match="may have been done; look before sending it again"):
            c.request("POST", "/api/v1/tokens", json={"user": "bob"})
        assert seen[0] == 1
