"""Slow and idle clients cannot starve the admin endpoint's liveness probe (issue 30, finding 4).

Forty slow loopback clients turned ``/healthz`` into 503 ("too many admin connections") when
handler threads read request heads: the Kubernetes liveness probe would get the pod restarted.
Heads are now read by one event-driven thread (:mod:`rmqfast.server.admin_heads`).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Iterator

import pytest
from test_admin_http import RULE, Backend, request, serve  # noqa: F401  (serve: the fixture)

from rmqfast.config import HostPort
from rmqfast.server import admin as admin_mod
from rmqfast.server import admin_heads as admin_mod_heads

PROBE_TIMEOUT = 3.0  # the manifests' livenessProbe timeoutSeconds


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[socket.socket]]:
    """Slow clients' sockets, closed at the end; the endpoint's timeouts long enough that they stay
    open while the test looks (a loaded machine may take seconds to open 200 connections)."""
    monkeypatch.setattr(admin_mod, "READ_TIMEOUT", 120.0)
    monkeypatch.setattr(admin_mod._Handler, "timeout", 120.0)
    monkeypatch.setattr(admin_mod, "CONNECTION_DEADLINE", 120.0)
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def _slowloris(port: int, n: int, into: list[socket.socket]) -> None:
    """``n`` clients that send part of a request head and then nothing."""
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        into.append(s)
        s.sendall(f"GET /limits HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: ".encode())


def _still_open(s: socket.socket) -> bool:
    """Whether the server still holds ``s`` open: nothing to read, no end of stream."""
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


def test_healthz_answers_while_200_slow_clients_hold_connections(serve, held) -> None:  # noqa: F811
    srv, backend = serve()
    _slowloris(srv.port, 200, held)
    for _ in range(5):  # each within the probe's timeout (a timeout fails the request)
        code, body = request(srv.port, "GET", "/healthz", timeout=PROBE_TIMEOUT)
        assert code == 200 and body == {"status": "ok"}, (code, body)
    # the other paths are served too, and changes go through
    assert request(srv.port, "GET", "/limits", timeout=30)[0] == 200
    assert request(srv.port, "PUT", "/limits/rule", RULE, timeout=30)[0] == 200
    assert backend.changes == 1
    # the slow clients were held all along: the probes were answered beside them, not after them
    assert sum(_still_open(s) for s in held) == 200
    assert srv.httpd.reader.evicted == 0 and len(srv.httpd.reader.pending) == 200


def test_past_the_pending_cap_the_oldest_waiting_connection_is_closed(serve, held,  # noqa: F811
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin_mod, "MAX_PENDING", 50)
    srv, _ = serve()
    _slowloris(srv.port, 80, held)
    assert request(srv.port, "GET", "/healthz", timeout=PROBE_TIMEOUT)[0] == 200
    # the reader took all 80 and then the probe (accepted in that order), keeping the 50 newest
    assert srv.httpd.reader.evicted == 31 and len(srv.httpd.reader.pending) == 49
    open_now = [_still_open(s) for s in held]
    assert open_now == [False] * 31 + [True] * 49, open_now


def test_head_bytes_waiting_are_bounded(serve, held, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Clients that send most of a 64 KiB head and stop hold at most MAX_PENDING_BYTES together."""
    monkeypatch.setattr(admin_mod, "MAX_PENDING_BYTES", 256 * 1024)
    srv, _ = serve()
    pad = b"X-Pad: " + b"a" * 60000 + b"\r\n"
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        held.append(s)
        s.sendall(f"GET /limits HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n".encode() + pad)
    assert request(srv.port, "GET", "/healthz", timeout=PROBE_TIMEOUT)[0] == 200
    reader = srv.httpd.reader
    assert reader.pending_bytes <= 256 * 1024 and reader.evicted >= 4, (reader.pending_bytes, reader.evicted)
    assert request(srv.port, "GET", "/limits", timeout=30)[0] == 200


def test_busy_handlers_do_not_stop_the_probe(serve, held, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Handler threads are bounded (MAX_CONNECTIONS): past them a request gets a 503 at once, and
    /healthz, answered without a handler, stays 200."""
    monkeypatch.setattr(admin_mod, "MAX_CONNECTIONS", 4)
    srv, _ = serve()
    for _ in range(4):  # whole heads announcing a body that never comes: each holds a handler
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        held.append(s)
        s.sendall(f"PUT /limits/rule HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
                  "Content-Length: 10\r\n\r\n".encode())
    deadline = time.monotonic() + 60
    while True:  # the four heads reach their handlers before this request's (or soon after)
        code, body = request(srv.port, "GET", "/limits", timeout=30)
        if code == 503 or time.monotonic() > deadline:
            break
    assert code == 503 and "too many admin connections" in body["error"], (code, body)
    assert request(srv.port, "GET", "/healthz", timeout=PROBE_TIMEOUT)[0] == 200
    for s in held:
        s.close()
    held.clear()
    deadline = time.monotonic() + 60
    while request(srv.port, "GET", "/limits", timeout=30)[0] != 200:  # slots come back as clients go
        assert time.monotonic() < deadline, "the handler slots did not come back"
        time.sleep(0.05)


class _ShortOfDescriptors:
    """The endpoint's listening socket, whose first ``fail`` accepts fail with EMFILE."""

    def __init__(self, sock: socket.socket, fail: int) -> None:
        self.sock = sock
        self.fail = fail
        self.failed = 0

    def accept(self) -> tuple[socket.socket, object]:
        if self.failed < self.fail:
            self.failed += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


def test_accept_short_of_descriptors_backs_off_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    srv = admin_mod.AdminServer(HostPort("127.0.0.1", 0), Backend())
    short = _ShortOfDescriptors(srv.httpd.socket, fail=3)
    srv.httpd.reader.listener = short  # type: ignore[assignment]
    srv.start()
    try:
        with caplog.at_level(logging.WARNING, logger="rmqfast.admin"):
            assert request(srv.port, "GET", "/healthz", timeout=30)[0] == 200  # served once accept works again
        assert short.failed == 3
        warnings = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
        assert len(warnings) == 1 and "Too many open files" in warnings[0].getMessage(), warnings  # one, no traceback
        assert not warnings[0].exc_info
    finally:
        srv.shutdown()


def test_answered_connections_lingering_are_bounded(serve, held, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """After an answer from the head reader the connection is read and dropped for up to 1 s; a
    flood of requests whose clients never close holds at most MAX_ANSWERING of them."""
    monkeypatch.setattr(admin_mod, "MAX_ANSWERING", 2)
    monkeypatch.setattr(admin_mod_heads, "LINGER", 120.0)  # they would linger while the test looks
    srv, _ = serve()
    for _ in range(6):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        held.append(s)
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(4096):  # the answer, then the server's half-close
            answer += chunk
        assert answer.startswith(b"HTTP/1.0 200 "), answer
        assert len(srv.httpd.reader.answering) <= 2
    assert request(srv.port, "GET", "/healthz", timeout=PROBE_TIMEOUT)[0] == 200
