"""Upstream connects: numeric hosts skip gevent's resolver (its thread pool), names still resolve."""

from __future__ import annotations

import socket as stdsocket
from collections.abc import Iterator

import gevent.socket
import pytest

from rmqfast.proxy import connect as connect_mod
from rmqfast.proxy.connect import connect_tcp


@pytest.fixture
def listener() -> Iterator[stdsocket.socket]:
    s = stdsocket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s
    s.close()


def test_numeric_host_connects_without_getaddrinfo(listener: stdsocket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_resolver(*a: object, **k: object) -> None:
        raise AssertionError("getaddrinfo called for a numeric address")

    monkeypatch.setattr(gevent.socket, "getaddrinfo", no_resolver)
    monkeypatch.setattr(gevent._socketcommon, "getaddrinfo", no_resolver)
    port = listener.getsockname()[1]
    with connect_tcp("127.0.0.1", port, 2.0) as s:
        assert s.getpeername() == ("127.0.0.1", port)
        assert s.gettimeout() == 2.0


def test_name_is_resolved(listener: stdsocket.socket) -> None:
    port = listener.getsockname()[1]
    with connect_tcp("localhost", port, 2.0) as s:
        assert s.getpeername()[1] == port


def test_refused_connect_raises_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[gevent.socket.socket] = []
    real = gevent.socket.socket

    def track(*a: object, **k: object) -> gevent.socket.socket:
        s = real(*a, **k)
        made.append(s)
        return s

    monkeypatch.setattr(connect_mod.socket, "socket", track)
    probe = stdsocket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with pytest.raises(OSError):
        connect_tcp("127.0.0.1", port, 2.0)
    assert made and made[0].fileno() == -1
