"""The proxy's own lack of descriptors is never a broker's fault (issue 30): an upstream connect
that fails with EMFILE marks the session (``local_shortage``), is not counted as an upstream
error, is not retried on the next upstream, and the worker does not suspect the broker."""

from __future__ import annotations

import errno
from types import SimpleNamespace
from typing import Any

import gevent
from gevent import socket

from rmqfast.codec import ScanStats
from rmqfast.codec import codes as C
from rmqfast.config import HostPort
from rmqfast.filters.api import FilterChain
from rmqfast.filters.deny import DenyAdminCodes
from rmqfast.proxy import relay
from rmqfast.proxy.relay import RelaySettings, Session
from rmqfast.server.accept import ConnectionCaps
from rmqfast.server.worker import Worker


class Events:
    def __init__(self) -> None:
        self.errors = 0

    def upstream_error(self, role: str) -> None:
        self.errors += 1

    def upstream_ok(self, session: Session, hp: HostPort) -> None:
        raise AssertionError("no upstream was reached")


def session_with(connect_error: int, monkeypatch: Any) -> tuple[Session, Events, list[HostPort]]:
    tried: list[HostPort] = []

    def connect(host: str, port: int, timeout: float) -> Any:
        tried.append(HostPort(host, port))
        raise OSError(connect_error, "connect failed")

    monkeypatch.setattr(relay, "connect_plain", connect)
    a, b = socket.socketpair()
    events = Events()
    ups = [HostPort("127.0.0.1", 1), HostPort("127.0.0.1", 2)]
    s = Session("broker", a, "127.0.0.9:5000", ups, FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)]),
                ScanStats(), RelaySettings(4096, 1 << 20, 1 << 16, 1.0, 30.0), events)
    b.close()  # the refusal path reads the client until it closes
    with gevent.Timeout(10):
        s.run()
    return s, events, tried


def test_an_emfile_connect_is_the_proxys_shortage(monkeypatch) -> None:
    s, events, tried = session_with(errno.EMFILE, monkeypatch)
    assert s.local_shortage and not s.upstream_addr
    assert events.errors == 0 and len(tried) == 1  # the next upstream would fail alike


def test_a_refused_connect_is_the_upstreams(monkeypatch) -> None:
    s, events, tried = session_with(errno.ECONNREFUSED, monkeypatch)
    assert not s.local_shortage
    assert events.errors == 2 and len(tried) == 2


def test_the_worker_suspects_the_broker_only_when_the_failure_was_not_its_own(monkeypatch) -> None:
    suspected: list[str] = []
    shortage: list[str] = []
    fake = SimpleNamespace(
        sessions=set(), records=None, caps=ConnectionCaps(10, 10),
        health=SimpleNamespace(suspect=lambda addr, why: suspected.append(addr)),
        listen_metrics=SimpleNamespace(local_shortage=SimpleNamespace(
            labels=lambda where: SimpleNamespace(inc=lambda: shortage.append(where)))),
        metrics=SimpleNamespace(connections_active=SimpleNamespace(
            labels=lambda role: SimpleNamespace(dec=lambda: None))),
        evictor=SimpleNamespace(blocked="", check=lambda: None),
        trimmer=SimpleNamespace(maybe_trim=lambda n, counts: False),
    )
    for code in (errno.EMFILE, errno.ECONNREFUSED):
        fake.caps.admit("127.0.0.9")
        s, _, _ = session_with(code, monkeypatch)
        Worker._ended(fake, s)  # type: ignore[arg-type]
    assert shortage == ["upstream_connect"]
    assert suspected == ["127.0.0.1:1"]
    assert fake.caps.open == 0  # each session's admission released once
