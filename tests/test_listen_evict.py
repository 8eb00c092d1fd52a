"""At the worker's connection cap a newcomer evicts an idle connection (issue 30, hostile run of
22:00: idle connections from 40 addresses, each under its per-address cap, filled the worker's cap
and the listeners answered nobody new for 7.9 s); /readyz is false exactly while the worker cannot
admit; the first-frame deadline is counted.

The end-to-end tests run a real ``rmqfast serve`` (one worker) with small caps in front of the fake
name server, or of a broker that never answers (its requests stay in flight).
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_remoting import FakeNameServer

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.proxy.relay import close_idle
from rmqfast.server import evict
from rmqfast.server.accept import ConnectionCaps, RateLimitedLog
from rmqfast.testing.proxy import ProxyProcess
from rmqfast.testing.wire import read_frame

_opaques = itertools.count(9000)


# Units ------------------------------------------------------------------------------------------


class FakeSession:
    def __init__(self, host: str, idle: float, inflight: int = 0, role: str = "broker") -> None:
        self.client_addr = f"{host}:{next(_opaques)}"
        self.role = role
        self.idle = idle
        self.inflight = [None] * inflight
        self.closed = False

    def idle_for(self, now: float) -> float:
        return self.idle

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _evictor(sessions: set[FakeSession], total: int) -> tuple[evict.Evictor, ConnectionCaps, list[str], Clock]:
    caps = ConnectionCaps(total=total, per_client=total)
    for s in sessions:
        assert caps.admit(s.client_addr.rpartition(":")[0])[1] == ""
    states: list[str] = []
    clock = Clock()
    return evict.Evictor(sessions, caps, None, RateLimitedLog(), states.append, clock), caps, states, clock


def test_the_busiest_address_loses_its_longest_idle_connection_first() -> None:
    a = [FakeSession("10.0.0.1", idle) for idle in (5.0, 60.0, 1.0)]
    b = [FakeSession("10.0.0.2", 600.0)]  # idle longer, but its address holds one connection
    ev, _, states, _ = _evictor({*a, *b}, total=4)
    assert ev.make_room() and a[1].closed and not b[0].closed
    assert ev.make_room() and a[0].closed  # the same ranking, checked again: no new pass
    assert ev.evicted == 2 and states == []


def test_a_connection_with_a_request_in_flight_or_just_active_is_never_evicted() -> None:
    busy = FakeSession("10.0.0.1", 900.0, inflight=1)
    fresh = FakeSession("10.0.0.1", evict.MIN_IDLE / 2)  # a newcomer that has not spoken yet
    ev, _, states, clock = _evictor({busy, fresh}, total=2)
    assert not ev.make_room() and not busy.closed and not fresh.closed
    assert len(states) == 1 and "cap reached" in states[0] and "proxy.max_connections" in states[0]
    fresh.idle = evict.MIN_IDLE * 2
    ev.check()  # ranked moments ago: not again before RANK_TTL
    assert ev.blocked
    clock.t += evict.RANK_TTL
    ev.check()  # fresh may be evicted now: the worker can admit again
    assert states[-1] == "" and not ev.blocked
    busy.inflight = []  # its answer came
    assert ev.make_room() and fresh.closed and not busy.closed  # the ranking check() made
    clock.t += evict.RANK_TTL
    assert ev.make_room() and busy.closed


def test_a_blocked_worker_is_ready_again_once_a_connection_ends() -> None:
    busy = FakeSession("10.0.0.1", 10.0, inflight=3)
    sessions = {busy}
    ev, caps, states, _ = _evictor(sessions, total=1)
    assert not ev.make_room() and ev.blocked
    sessions.discard(busy)
    caps.release("10.0.0.1")
    ev.check()
    assert states[-1] == "" and not ev.blocked


def test_a_flood_of_newcomers_ranks_the_sessions_once_per_period() -> None:
    sessions = {FakeSession(f"10.0.{i % 7}.1", float(i)) for i in range(2000)}
    ev, _, _, clock = _evictor(sessions, total=2000)
    ranks = 0
    real = ev._rank

    def counting(now: float) -> None:
        nonlocal ranks
        ranks += 1
        real(now)

    ev._rank = counting  # type: ignore[method-assign]
    assert all(ev.make_room() for _ in range(evict.RANK_KEEP))
    assert ranks == 1
    clock.t += evict.RANK_TTL
    assert ev.make_room() and ranks == 2


def test_deadline_closes_are_counted_by_reason() -> None:
    class S:
        role = "namesrv"
        client_addr = "127.0.0.1:1"
        closed = False
        started = 0.0
        c2u = type("Scan", (), {"requests": 0, "responses": 0})()
        settings = type("Settings", (), {"first_frame_timeout": 10.0, "frame_timeout": 0})()

        def idle_for(self, now: float) -> float:
            return 11.0

        def close(self) -> None:
            self.closed = True

    seen: list[tuple[str, str]] = []
    silent = S()
    assert close_idle([silent], 60.0, now=11.0, counted=lambda role, why: seen.append((role, why))) == 1
    assert seen == [("namesrv", "first_frame")]
    assert close_idle([S()], 5.0, now=11.0, counted=lambda role, why: seen.append((role, why))) == 1
    assert seen[-1] == ("namesrv", "idle")


# End to end -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def namesrv() -> Iterator[Any]:
    srv = FakeNameServer()
    yield srv
    srv.close()


class SilentBroker:
    """Accepts connections and never answers: every request relayed to it stays in flight."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._t = threading.Thread(target=self._accept, daemon=True)
        self._t.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def ask(source: str, port: int, timeout: float = 5.0) -> RemotingCommand | None:
    """A GET_KV_CONFIG from ``source``; the answer, or None when the proxy closed at once."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as s:
        opaque = next(_opaques)
        try:
            s.sendall(encode(RemotingCommand(code=C.GET_KV_CONFIG, opaque=opaque,
                                             ext_fields={"namespace": "N", "key": "K"})))
            data = read_frame(s)
        except (ConnectionResetError, BrokenPipeError):
            return None
    if data is None:
        return None
    cmd = decode_frame(data)
    assert cmd.opaque == opaque
    return cmd


def metric(proxy: ProxyProcess, name: str, **labels: str) -> float:
    return proxy.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def until(check: Any, seconds: float, what: str, proxy: ProxyProcess) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {seconds} s:\n{proxy.log_tail()}"
        time.sleep(0.05)


def test_idle_connections_from_many_addresses_at_the_cap_make_room_for_a_newcomer(namesrv) -> None:
    caps = "max_connections = 50\nmax_connections_per_client = 20\n"
    with ProxyProcess([namesrv.addr], workers=1, proxy_settings=caps) as proxy:
        port = proxy.namesrv_port
        idle: list[socket.socket] = []
        try:
            for i in range(60):  # 20 from each of three addresses: 50 admitted, then the cap
                src = f"127.0.0.{2 + i % 3}"
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(src, 0)))
            until(lambda: metric(proxy, "rmqfast_connections_refused_total", role="namesrv", cap="worker") >= 10,
                  30, "the 10 over the cap refused", proxy)
            time.sleep(evict.MIN_IDLE)  # the idle ones become evictable (no request ever sent)
            started = time.monotonic()
            for _ in range(3):  # each held open: each needs a place of its own
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5,
                                                     source_address=("127.0.0.9", 0)))
                idle[-1].sendall(encode(RemotingCommand(code=C.GET_KV_CONFIG, opaque=next(_opaques),
                                                        ext_fields={"namespace": "N", "key": "K"})))
                assert read_frame(idle[-1]) is not None, proxy.log_tail()
            took = time.monotonic() - started
            print(f"3 newcomers answered in {took:.3f} s at the cap")
            until(lambda: metric(proxy, "rmqfast_connections_evicted_total", role="namesrv") >= 3, 10,
                  "3 evictions counted", proxy)
            assert proxy.get("/readyz")[0] == 200
            records = proxy.log_records()
        finally:
            for s in idle:
                s.close()
    lines = [r for r in records if r.get("msg") == "idle connection evicted: worker connection cap reached"]
    # from an address that holds the most (50 admitted of 3 x 20: 17, 17 and 16)
    assert lines and all(r["held_by_address"] >= 16 and r["client"].startswith("127.0.0.") for r in lines)
    assert not any(r["client"].startswith("127.0.0.9:") for r in lines)


def test_requests_in_flight_are_never_evicted_and_readyz_says_the_worker_cannot_admit(namesrv) -> None:
    broker = SilentBroker()

    def static(p: ProxyProcess) -> str:
        return (f'\n[[brokers.static]]\nlisten = "127.0.0.1:{p.static_ports[0]}"\nupstream = "{broker.addr}"\n'
                "\n[failover]\nenabled = false\n")  # the silent broker would be seen dead and cut

    caps = "max_connections = 4\nmax_connections_per_client = 4\n"
    try:
        with ProxyProcess([namesrv.addr], workers=1, static_endpoints=1, extra_config=static,
                          proxy_settings=caps) as proxy:
            port = proxy.static_ports[0]
            held = [socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))
                    for _ in range(4)]
            try:
                for s in held:  # a request each that the broker never answers: in flight
                    s.sendall(encode(RemotingCommand(code=C.QUERY_CONSUMER_OFFSET, opaque=next(_opaques),
                                                     ext_fields={"consumerGroup": "G", "topic": "T",
                                                                 "queueId": "0"})))
                until(lambda: len(broker.held) == 4, 30, "4 upstream connections", proxy)
                time.sleep(evict.MIN_IDLE * 2)  # idle, but each with a request in flight
                assert ask("127.0.0.3", port) is None  # refused: nothing may be evicted
                assert all(s.fileno() >= 0 for s in held)
                for s in held:  # still open: nothing was read back but the proxy's silence
                    s.setblocking(False)
                    with pytest.raises(BlockingIOError):
                        s.recv(1)
                code, body = proxy.get("/readyz")
                until(lambda: proxy.get("/readyz")[0] == 503, 10, "/readyz false at the cap", proxy)
                code, body = proxy.get("/readyz")
                reason = json.loads(body)["reason"]
                assert "cap reached" in reason and "proxy.max_connections" in reason, reason
                assert metric(proxy, "rmqfast_connections_evicted_total", role="broker") == 0
                assert metric(proxy, "rmqfast_connections_refused_total", role="broker", cap="worker") >= 1
                held.pop().close()  # one ends: the worker can admit again
                until(lambda: proxy.get("/readyz")[0] == 200, 10, "/readyz true again", proxy)
            finally:
                for s in held:
                    s.close()
    finally:
        broker.close()


def test_a_connection_that_never_sends_a_frame_is_closed_and_counted(namesrv) -> None:
    settings = "first_frame_timeout = 1\n"
    with ProxyProcess([namesrv.addr], workers=1, proxy_settings=settings) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.namesrv_port), timeout=10) as s:
            s.sendall(b"\x00\x00")  # two bytes of a frame's length, then nothing
            assert s.recv(1) == b""  # closed by the deadline
        until(lambda: metric(proxy, "rmqfast_deadline_closes_total", role="namesrv", reason="first_frame") >= 1,
              10, "the close counted", proxy)


def test_a_victim_that_fails_to_close_refuses_the_newcomer_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(FakeSession):
        def close(self) -> None:
            raise RuntimeError("a filter's on_close failed")

    ev, _, _, _ = _evictor({Broken("10.0.0.1", 5.0)}, total=1)
    assert not ev.make_room() and ev.evicted == 0
    assert any("could not evict" in r.getMessage() for r in caplog.records)
