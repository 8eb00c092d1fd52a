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


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_plain_connect_is_a_non_blocking_plain_socket(listener: stdsocket.socket,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import _socket

    def no_resolver(*a: object, **k: object) -> None:
        raise AssertionError("getaddrinfo called for a numeric address")

    monkeypatch.setattr(gevent.socket, "getaddrinfo", no_resolver)
    monkeypatch.setattr(gevent._socketcommon, "getaddrinfo", no_resolver)
    port = listener.getsockname()[1]
    s = connect_mod.connect_plain("127.0.0.1", port, 2.0)
    try:
        assert type(s) is _socket.socket  # no gevent socket object, no watchers
        assert s.getpeername() == ("127.0.0.1", port) and s.gettimeout() == 0.0
        peer, _ = listener.accept()
        s.send(b"x")
        assert peer.recv(1) == b"x"
        peer.close()
    finally:
        s.close()


def test_plain_connect_to_a_name_resolves_and_gives_a_plain_socket(listener: stdsocket.socket) -> None:
    import _socket

    port = listener.getsockname()[1]
    s = connect_mod.connect_plain("localhost", port, 2.0)
    try:
        assert type(s) is _socket.socket and s.getpeername()[1] == port and s.gettimeout() == 0.0
    finally:
        s.close()


def test_plain_connect_refused_or_timed_out_raises_and_closes() -> None:
    probe = stdsocket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    before = _open_fds()
    with pytest.raises(ConnectionRefusedError):
        connect_mod.connect_plain("127.0.0.1", port, 2.0)
    assert _open_fds() == before
    # a listener whose accept queue is full drops the next SYN: the connect waits out its timeout
    full = stdsocket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = []
    try:
        for _ in range(3):  # Linux queues backlog + 1 connections
            f = stdsocket.socket()
            f.setblocking(False)
            f.connect_ex(full.getsockname())
            fillers.append(f)
        gevent.sleep(0.1)
        before = _open_fds()
        with pytest.raises(TimeoutError):
            connect_mod.connect_plain("127.0.0.1", full.getsockname()[1], 0.3)
        assert _open_fds() == before
    finally:
        for f in fillers:
            f.close()
        full.close()


def test_plain_and_gevent_sockets_convert_on_the_same_descriptor(listener: stdsocket.socket) -> None:
    import _socket

    s = connect_mod.connect_plain("127.0.0.1", listener.getsockname()[1], 2.0)
    fd = s.fileno()
    g = connect_mod.to_gevent(s)
    assert isinstance(g, gevent.socket.socket) and g.fileno() == fd and s.fileno() == -1
    assert connect_mod.to_gevent(g) is g
    back = connect_mod.plain(g)
    assert type(back) is _socket.socket and back.fileno() == fd and back.gettimeout() == 0.0
    assert connect_mod.plain(back) is back
    back.close()
