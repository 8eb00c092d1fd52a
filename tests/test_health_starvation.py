"""No false "hung" verdict from the proxy's own starvation (issue 30, finding 5).

A healthy broker (the fake name server: it answers every request at once, from a thread of its
own) is probed by :class:`BrokerHealth` while the worker's event loop is held for twice the probe
timeout, again and again, while the sweep reports relayed sends stalled (a starved worker reads
nothing back either):

* between the prober asking and its question being written (a load burst: the asking greenlet
  runs a long turn later; the old prober, timing in wall time with no answer in the socket yet,
  called the broker hung), or right after the probe connection's reader took the answer off the
  socket;
* right after a probe went out (blocked, or busy in Python);
* end to end: a real worker stopped with SIGSTOP and continued while a client's request is in
  flight.

The broker must never be cut; one that does not answer is still seen dead, and a probe that
failed for the proxy's own lack of descriptors is not counted against the broker.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest
from fake_remoting import FakeNameServer
from gevent import monkey

from rmqfast.clouds.remoting import Connection
from rmqfast.codec import codes as C
from rmqfast.proxy.health import BrokerHealth, FailoverSection
from rmqfast.proxy.looplag import LoopLag

_block = monkey.get_original("time", "sleep")  # holds the whole event loop, like SIGSTOP or a CPU hog

CFG = FailoverSection(probe_interval=0.05, probe_interval_down=0.05, probe_timeout=0.3, hang_timeout=0.2)
HOLDS = 8


@pytest.fixture
def broker() -> Iterator[object]:
    srv = FakeNameServer()
    yield srv
    srv.close()


def watch(health: BrokerHealth, addr: str) -> list[tuple[str, bool]]:
    changes: list[tuple[str, bool]] = []
    health.on_change(lambda a, up: changes.append((a, up)))
    health.watch([addr])
    return changes


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        gevent.sleep(0.005)


def test_loop_lag_counts_a_held_loop_and_not_a_running_one() -> None:
    lag = LoopLag()
    try:
        gevent.sleep(0.2)
        mark = lag.mark()
        _block(0.5)
        # measured before the lag greenlet ran again: the overdue wake-up counts already
        assert lag.ran_since(mark) < 0.15
        gevent.sleep(0.3)
        assert 0.2 < lag.ran_since(mark) < 0.6
    finally:
        lag.close()


class _HeldAfterRead:
    """A probe connection's socket after which the worker is held: the answer was read off the
    socket, the prober has not run yet."""

    def __init__(self, sock: object, hold: Callable[[], None]) -> None:
        self._sock = sock
        self._hold = hold

    def recv(self, n: int) -> bytes:
        data = self._sock.recv(n)  # type: ignore[attr-defined]
        if data:
            self._hold()
        return data

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


class _HeldBeforeSend(Connection):
    """A probe connection whose question goes out late: the worker is held between the prober
    asking and the request being written (a load burst: the asking greenlet runs a long turn later)."""

    hold: Callable[[], None] = staticmethod(lambda: None)

    def request(self, *args: Any, **kwargs: Any) -> Any:
        self.hold()
        return super().request(*args, **kwargs)


@pytest.mark.parametrize("where", ["before_send", "after_read"])
def test_a_healthy_broker_is_never_cut_when_the_worker_is_held_around_a_probe(broker, where: str) -> None:
    holds = [1] * HOLDS
    health: BrokerHealth

    def hold() -> None:
        if holds:
            holds.pop()
            health.stalled(broker.addr, 2 * CFG.hang_timeout)  # relayed sends look stalled too
            _block(2 * CFG.probe_timeout)

    def connect(addr: str, timeout: float) -> Connection:
        if where == "before_send":
            conn: Connection = _HeldBeforeSend(addr, connect_timeout=timeout)
            conn.hold = hold  # type: ignore[method-assign]
        else:
            conn = Connection(addr, connect_timeout=timeout)
            conn.sock = _HeldAfterRead(conn.sock, hold)  # before its reader first runs
        return conn

    health = BrokerHealth(CFG, connect=connect)
    changes = watch(health, broker.addr)
    try:
        wait_for(lambda: not holds, timeout=30)
        asked = broker.requests
        wait_for(lambda: broker.requests > asked + 2)  # probes go on, answered
        assert changes == [], f"a healthy broker was cut while the worker was starved: {changes}"
    finally:
        health.close()


@pytest.mark.parametrize("hog", ["blocked", "busy"])
def test_a_healthy_broker_is_never_cut_while_the_worker_is_starved(broker, hog: str) -> None:
    health = BrokerHealth(CFG, connect=lambda addr, t: Connection(addr, connect_timeout=t))
    addr = broker.addr
    changes = watch(health, addr)
    try:
        wait_for(lambda: broker.requests >= 2)  # probing, answered
        for _ in range(HOLDS):
            asked = broker.requests
            wait_for(lambda asked=asked: broker.requests > asked)  # a probe just went out
            health.stalled(addr, 2 * CFG.hang_timeout)  # and relayed sends look stalled too
            if hog == "blocked":
                _block(2 * CFG.probe_timeout)
            else:  # the loop busy in Python for as long
                end = time.monotonic() + 2 * CFG.probe_timeout
                while time.monotonic() < end:
                    pass
            gevent.sleep(0)
        asked = broker.requests
        wait_for(lambda: broker.requests > asked + 2)  # probes go on, answered
        assert changes == [], f"a healthy broker was cut while the worker was starved: {changes}"
        assert not health.is_down(addr)
    finally:
        health.close()


def test_a_broker_that_does_not_answer_is_still_seen_dead() -> None:
    """Accepts, reads, never answers: the probes fail on the worker's running time too."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    health = BrokerHealth(CFG, connect=lambda addr, t: Connection(addr, connect_timeout=t))
    addr = f"127.0.0.1:{srv.getsockname()[1]}"
    changes = watch(health, addr)
    try:
        wait_for(lambda: changes == [(addr, False)], timeout=10)
    finally:
        health.close()
        stop.set()
        t.join(5)
        srv.close()
        for s in held:
            s.close()


def test_the_proxys_own_descriptor_shortage_is_not_the_brokers(broker) -> None:
    """A probe connect failing with EMFILE (the worker out of descriptors) is discounted."""
    tries: list[int] = []

    def connect(addr: str, timeout: float) -> Connection:
        tries.append(1)
        if len(tries) <= 4:
            raise OSError(errno.EMFILE, "Too many open files")
        return Connection(addr, connect_timeout=timeout)

    health = BrokerHealth(CFG, connect=connect)
    changes = watch(health, broker.addr)
    try:
        wait_for(lambda: broker.requests >= 2)
        assert len(tries) >= 5 and changes == []
    finally:
        health.close()


def test_a_stopped_and_continued_worker_never_cuts_a_healthy_broker(broker) -> None:
    """End to end: a real worker in front of a healthy broker (the fake, answering everything),
    stopped with SIGSTOP for several probe timeouts while a client's request is in flight, then
    continued, again and again.  The broker is never seen dead, no connection is cut, and every
    request is answered."""
    import os
    import signal

    from rmqfast.codec.command import RemotingCommand, decode_frame, encode
    from rmqfast.testing.proxy import ProxyProcess
    from rmqfast.testing.wire import read_frame

    def static(p: ProxyProcess) -> str:
        return (f'\n[[brokers.static]]\nlisten = "127.0.0.1:{p.static_ports[0]}"\nupstream = "{broker.addr}"\n'
                "\n[failover]\nprobe_interval = 0.1\nprobe_timeout = 0.3\nhang_timeout = 0.2\n")

    with ProxyProcess([broker.addr], workers=1, static_endpoints=1, extra_config=static) as proxy:
        worker = proxy.worker_pids()[0]
        client = socket.create_connection(("127.0.0.1", proxy.static_ports[0]), timeout=30)
        try:
            for i in range(HOLDS):
                asked = broker.requests
                wait_for_blocking(lambda asked=asked: broker.requests > asked + 1)  # probing goes on
                client.sendall(encode(RemotingCommand(code=C.GET_KV_CONFIG, opaque=100 + i,
                                                      ext_fields={"namespace": "N", "key": "K"})))
                os.kill(worker, signal.SIGSTOP)
                try:
                    _block(3 * 0.3)  # the fault: three probe timeouts with the worker stopped
                finally:
                    os.kill(worker, signal.SIGCONT)
                answer = read_frame(client)
                assert answer is not None and decode_frame(answer).opaque == 100 + i
            metrics = proxy.metrics()
            records = proxy.log_records()
        finally:
            client.close()
    down = {k: v for k, v in metrics.items() if k[0] == "rmqfast_broker_down_total" and v}
    assert not down, f"a healthy broker was seen dead: {down}"
    cut = [r for r in records if r.get("msg") in ("broker seen dead", "connections to a dead broker cut")]
    assert not cut, cut


def wait_for_blocking(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        _block(0.005)
