"""Edge-triggered orderings of the relay: every way the bytes of a peer and its close (FIN, RST)
can arrive relative to what the pump's greenlet is doing, driven on real sockets.

The reactor's epoll set is edge-triggered: each arrival is reported once.  An arrival reported
while the pump's greenlet is busy (a policy frame, a write that waits, the write lock, a local
answer at a boundary, a yield after many receives) must still be acted on, and a close that came
in with the last bytes must end the pump.  A lost report is a connection that never closes.

The first part plays the pump's greenlet (``relay.Session._pump_c``) by hand over a ``Reactor``
and socketpairs (delivery is synchronous: when a write returns, the bytes and any close are at
the other end), so each ordering is exact; a pump left parked with no event to come is a hang
and fails at once.  The second part runs whole relay sessions (reactor, libev watchers, the
pure-Python pump) under gevent with the same orderings at the connection level.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import socket
import ssl
import struct
import sys

import pytest

from rmqfast import codec
from tests.test_pump import actions, drain, nonblocking_pair
from tests.test_scan import json_frame, send_v2

compiled = codec.Pump is not None and codec.is_compiled(codec.FrameScanner)

if codec.Pump is not None:
    from rmqfast._speedups import (  # type: ignore[attr-defined]
        P_BOUNDARY,
        P_EOF,
        P_OS_ERROR,
        P_OVER_BUDGET,
        P_POLICY,
        P_WAIT_LOCK,
        P_WAIT_READ,
        P_WAIT_WRITE,
        P_YIELD,
        BufferBudget,
    )
    from rmqfast._speedups import Reactor as CompiledReactor  # type: ignore[attr-defined]

    Reactor = CompiledReactor  # the reactor_mode fixture makes it one kind or the other per test

needs_reactor = pytest.mark.skipif(codec.Pump is None, reason="the reactor drives the compiled pump only")


@pytest.fixture(autouse=True, params=["io_uring", "syscalls"])
def reactor_mode(request, monkeypatch):
    """Every reactor of a test issues its pumps' receives and sends through io_uring, or makes
    the plain system calls: the same edges hold either way."""
    if codec.Pump is None:
        return request.param
    uring = request.param == "io_uring"
    if uring and not CompiledReactor().uring:
        pytest.skip(f"io_uring is not available here: {CompiledReactor().uring_off}")

    def make() -> CompiledReactor:
        reactor = CompiledReactor(uring=uring)
        reactor.ring_min = 1  # every step of a turn through the ring, even a lone source's
        return reactor

    monkeypatch.setattr(sys.modules[__name__], "Reactor", make)
    return request.param

HANG = -2  # parked, and the epoll set has nothing to report: nothing will ever wake the pump
BUF = 4096


def policy_frame(opaque: int, body: bytes = b"") -> bytes:
    return json_frame({"code": 25, "flag": 0, "opaque": opaque}, body)  # UPDATE_BROKER_CONFIG: policy


def forward_frame(opaque: int, size: int = 100) -> bytes:
    return send_v2("TopicE", opaque=opaque, body=bytes([opaque % 251]) * size)


class Wake:
    """Stands in for a parked greenlet's Waiter: records the status the reactor hands it."""

    def __init__(self) -> None:
        self.got: list[int] = []

    def switch(self, status: int) -> None:
        self.got.append(status)


class Greenlet:
    """Plays the pump's greenlet of ``relay.Session._pump_c`` over a real Reactor, one status at a
    time.  ``hook(status, self)`` runs when the greenlet gets a status, before it acts on it: the
    test makes bytes or a close arrive there, and may let the reactor take a turn (the hub runs
    while the greenlet waits in Python), exactly the window in which an edge could be lost."""

    def __init__(self, pump, reactor, dst_peer: socket.socket, patience: float = 2.0) -> None:
        self.pump = pump
        self.reactor = reactor
        self.dst_peer = dst_peer
        self.patience = patience
        self.lock_held = False
        self.seen: list[int] = []
        self.sink = bytearray()
        self.policy: list[bytes] = []
        self.wakes = 0
        reactor.attach(pump, lambda: self.lock_held)

    def _wait_parked(self, wake: Wake) -> int:
        epfd = self.reactor.fileno()
        while True:
            self.reactor.turn()
            if wake.got:
                assert len(wake.got) == 1, wake.got
                self.wakes += 1
                return wake.got[0]
            # Parked with nothing reported: only a new edge can wake the pump.
            if not select.select([epfd], [], [], self.patience)[0]:
                return HANG

    def run(self, hook=None, limit: int = 10_000) -> int:
        pump = self.pump
        st = pump.step(not self.lock_held)
        for _ in range(limit):
            self.seen.append(st)
            if hook is not None:
                hook(st, self)
            if st == P_WAIT_READ:
                wake = Wake()
                st = self.reactor.park(pump, wake)
                if st < 0:
                    st = self._wait_parked(wake)
                    if st == HANG:
                        return HANG
                continue
            if st == P_WAIT_WRITE:
                drain(self.dst_peer, self.sink)  # the destination's peer reads: writable again
            elif st == P_WAIT_LOCK:
                self.lock_held = False  # the other writer finished
            elif st == P_POLICY:
                self.policy.append(pump.frame())
                pump.consume()
            elif st == P_BOUNDARY:
                pump.hold = False  # the held answers were written
            elif st != P_YIELD:
                drain(self.dst_peer, self.sink)
                return st
            st = pump.step(not self.lock_held)
        raise AssertionError(f"no end after {limit} statuses: {self.seen[-20:]}")


class Rig:
    """A pump from ``src`` to ``dst`` (socketpairs) attached to a reactor of its own."""

    def __init__(self, size: int = BUF, budget=None, tcp_src: bool = False) -> None:
        if tcp_src:
            self.src_peer, self.src = tcp_pair()
        else:
            self.src_peer, self.src = nonblocking_pair()
        self.dst, self.dst_peer = nonblocking_pair()
        for s in (self.src_peer, self.dst):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self.scanner = codec.FrameScannerC(codec.ScanStatsC(), actions=actions())
        self.pump = codec.Pump(self.scanner, self.src.fileno(), self.dst.fileno(), size, budget)
        self.reactor = Reactor()
        self.g = Greenlet(self.pump, self.reactor, self.dst_peer, patience=10.0 if tcp_src else 2.0)

    def send(self, data: bytes) -> None:
        """Deliver ``data`` to the pump's source now (all of it, or the test is wrong)."""
        n = self.src_peer.send(data)
        assert n == len(data), f"the source took {n} of {len(data)} bytes"

    def fin(self) -> None:
        self.src_peer.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        if self.pump is not None:
            self.reactor.detach(self.pump)
        for s in (self.src_peer, self.src, self.dst, self.dst_peer):
            s.close()


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP connection (a reset needs TCP), both ends non-blocking."""
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


@pytest.fixture
def rig():
    made: list[Rig] = []

    def make(**kw) -> Rig:
        r = Rig(**kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def script(*steps):
    """A hook running each (when(status, greenlet), do(greenlet)) once, in order; ``left`` lists
    those that never ran (a test asserts it is empty: the ordering it names really happened)."""
    left = list(steps)

    def hook(st, g):
        while left and left[0][0](st, g):
            left.pop(0)[1](g)

    hook.left = left  # type: ignore[attr-defined]
    return hook


def at(status: int):
    return lambda st, g: st == status


def parked_first(st, g) -> bool:
    return st == P_WAIT_READ


VIA = ["own-step", "reactor-step"]  # the first bytes are read by the greenlet's first step, or in a turn


# --------------------------------------------------------------------------------------------
# Reactor level: one ordering per test, exact.


@needs_reactor
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("when", ["with-the-frame", "while-busy", "before-park"])
def test_close_around_a_policy_frame(rig, when, via):
    """A policy frame wakes the greenlet; the rest of the stream and the close arrive with it, while
    the greenlet handles it (the reactor reports them then), or after it stepped on."""
    r = rig()
    frame, tail = policy_frame(1, b"cfg"), forward_frame(2)

    def first(g):
        r.send(frame)
        if when == "with-the-frame":
            r.send(tail)
            r.fin()

    def rest_and_close(g):
        r.send(tail)
        r.fin()
        if when == "while-busy":
            r.reactor.turn()  # the hub turns while the greenlet is busy with the policy frame

    steps = [] if via == "own-step" else [(parked_first, first)]
    if when == "while-busy":
        steps.append((at(P_POLICY), rest_and_close))
    elif when == "before-park":
        steps.append((lambda st, g: st == P_WAIT_READ and bool(g.policy), rest_and_close))
    if via == "own-step":
        first(None)
    hook = script(*steps)
    assert r.g.run(hook) == P_EOF
    assert hook.left == []
    assert r.g.policy == [frame]
    assert bytes(r.g.sink) == tail


@needs_reactor
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("when", ["with-the-bytes", "while-busy"])
def test_close_after_a_yield(rig, when, via):
    """More than READS_BEFORE_YIELD full receives in one report: the pump yields with bytes still
    in the socket (no edge will come for them), then must read on to the close."""
    r = rig()
    data = forward_frame(1, 40 * BUF) + forward_frame(2)

    def first(g):
        r.send(data)
        if when == "with-the-bytes":
            r.fin()

    def close_while_busy(g):
        r.fin()
        r.reactor.turn()

    steps = [] if via == "own-step" else [(parked_first, first)]
    if when == "while-busy":
        steps.append((at(P_YIELD), close_while_busy))
    if via == "own-step":
        first(None)
    hook = script(*steps)
    assert r.g.run(hook) == P_EOF
    assert hook.left == []
    assert P_YIELD in r.g.seen
    assert bytes(r.g.sink) == data


@needs_reactor
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("when", ["with-the-bytes", "while-busy"])
def test_close_while_waiting_to_write(rig, when, via):
    """The destination is full: the greenlet waits for it to drain while the rest of the source's
    bytes and its close arrive (the reactor reports them to a pump that is not parked)."""
    r = rig()
    junk = bytearray()
    while True:  # fill the destination: its peer does not read yet
        try:
            junk += b"j" * r.dst.send(b"j" * 65536)
        except BlockingIOError:
            break
    head = forward_frame(1, 3 * BUF)
    rest = forward_frame(2) + forward_frame(3, 2 * BUF)

    def first(g):
        r.send(head)
        if when == "with-the-bytes":
            r.send(rest)
            r.fin()

    def rest_while_busy(g):
        r.send(rest)
        r.fin()
        r.reactor.turn()

    steps = [] if via == "own-step" else [(parked_first, first)]
    if when == "while-busy":
        steps.append((at(P_WAIT_WRITE), rest_while_busy))
    if via == "own-step":
        first(None)
    hook = script(*steps)
    assert r.g.run(hook) == P_EOF
    assert hook.left == []
    assert P_WAIT_WRITE in r.g.seen
    assert bytes(r.g.sink) == bytes(junk) + head + rest


@needs_reactor
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("when", ["with-the-bytes", "while-busy"])
def test_close_while_waiting_for_the_write_lock(rig, when, via):
    """Another writer holds the destination's lock when the bytes come: the greenlet gets
    P_WAIT_LOCK; the close arrives with the bytes or while it waits for the lock."""
    r = rig()
    r.g.lock_held = True
    data = forward_frame(1, 500)
    cut = len(data) - 50  # the header is whole: the pump has bytes to forward

    def first(g):
        r.send(data[:cut])
        if when == "with-the-bytes":
            r.send(data[cut:])
            r.fin()

    def rest_while_busy(g):
        r.send(data[cut:])
        r.fin()
        r.reactor.turn()

    steps = [] if via == "own-step" else [(parked_first, first)]
    if when == "while-busy":
        steps.append((at(P_WAIT_LOCK), rest_while_busy))
    if via == "own-step":
        first(None)
    hook = script(*steps)
    assert r.g.run(hook) == P_EOF
    assert hook.left == []
    assert P_WAIT_LOCK in r.g.seen
    assert bytes(r.g.sink) == data


@needs_reactor
@pytest.mark.parametrize("when", ["with-the-bytes", "while-busy"])
@pytest.mark.parametrize("tail", ["frame-end", "next-frame-part", "next-frames"])
def test_close_at_a_boundary_for_a_held_answer(rig, tail, when):
    """A local answer waits (``hold``) while the pump is parked in the middle of a frame; the rest
    of the frame, maybe more, and the close arrive in one report (or the close while the greenlet
    writes the answers): the pump stops at the boundary (P_BOUNDARY), then reads on to the close."""
    r = rig()
    f1 = forward_frame(1, 2000)
    more = {"frame-end": b"", "next-frame-part": forward_frame(2)[:-9],
            "next-frames": forward_frame(2) + forward_frame(3)}[tail]
    r.send(f1[:700])

    def hold_then_rest(g):
        r.pump.hold = True  # an answer was queued for the next boundary
        r.send(f1[700:] + more)
        if when == "with-the-bytes":
            r.fin()

    def close_while_busy(g):
        r.fin()
        r.reactor.turn()

    steps = [(lambda st, g: st == P_WAIT_READ and not r.pump.at_boundary, hold_then_rest)]
    if when == "while-busy":
        steps.append((at(P_BOUNDARY), close_while_busy))
    hook = script(*steps)
    assert r.g.run(hook) == P_EOF
    assert hook.left == []
    assert P_BOUNDARY in r.g.seen
    assert bytes(r.g.sink) == f1 + more


@needs_reactor
def test_close_in_a_frame_held_whole(rig):
    """A policy frame larger than the buffer is held whole (a grown buffer, charged to the budget);
    its sender closes in the middle of it: the pump ends instead of waiting for the rest."""
    budget = BufferBudget(1 << 20)
    r = rig(budget=budget)
    big = policy_frame(1, b"x" * (6 * BUF))
    hook = script((parked_first, lambda g: (r.send(big[: 3 * BUF + 17]), r.fin())))
    assert r.g.run(hook) == P_EOF
    assert hook.left == []
    assert r.g.sink == b"" and r.g.policy == []
    assert budget.used > 0  # it was held in a grown buffer
    r.reactor.detach(r.pump)
    r.g.pump = r.pump = None  # the pump goes: its grown buffer goes back to the budget
    assert budget.used == 0


@needs_reactor
def test_over_budget_with_the_close(rig):
    """The frame held whole takes the budget past its limit in the report that also carries the
    close: P_OVER_BUDGET (the relay closes), not a wait."""
    budget = BufferBudget(BUF)
    r = rig(budget=budget)
    big = policy_frame(1, b"x" * (8 * BUF))
    hook = script((parked_first, lambda g: (r.send(big[: 5 * BUF]), r.fin())))
    assert r.g.run(hook) == P_OVER_BUDGET
    assert hook.left == []


@needs_reactor
@pytest.mark.parametrize("before", ["bytes-and-close", "bytes", "close-only"])
def test_attach_after_arrival(before):
    """What arrived before the pump was attached (the upstream pump starts a moment after the
    connection): the registration's first report may be the only one."""
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    data = forward_frame(1) + policy_frame(2) + forward_frame(3)[:-30]
    if before != "close-only":
        src_peer.sendall(data)
    if before != "bytes":
        src_peer.shutdown(socket.SHUT_WR)
    scanner = codec.FrameScannerC(codec.ScanStatsC(), actions=actions())
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), BUF)
    reactor = Reactor()
    try:
        g = Greenlet(pump, reactor, dst_peer)  # attaches
        steps = []
        if before == "bytes":  # the close comes after the attach, before anything was read
            steps.append((lambda st, g: True, lambda g: src_peer.shutdown(socket.SHUT_WR)))
        hook = script(*steps)
        assert g.run(hook) == P_EOF
        assert hook.left == []
        if before != "close-only":
            assert bytes(g.sink) == forward_frame(1) + forward_frame(3)[:-30]
            assert g.policy == [policy_frame(2)]
    finally:
        reactor.detach(pump)
        for s in (src_peer, src, dst, dst_peer):
            s.close()


@needs_reactor
def test_a_source_numbered_past_the_first_table_and_a_number_reused():
    """The reactor finds a source's pump by its descriptor number in a table it grows on attach:
    a source numbered 3000 is stepped, and after a detach the same number serves the next pump."""
    high = 3000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= high:
        pytest.skip(f"the open-files limit ({hard}) is below {high + 1}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, high + 1), hard))
    reactor = Reactor()
    try:
        for round_ in (1, 2):
            src_peer, src = nonblocking_pair()
            dst, dst_peer = nonblocking_pair()
            os.dup2(src.fileno(), high)
            try:
                scanner = codec.FrameScannerC(codec.ScanStatsC(), actions=actions())
                pump = codec.Pump(scanner, high, dst.fileno(), BUF)
                reactor.attach(pump, lambda: False)
                assert pump.step(True) == P_WAIT_READ
                wake = Wake()
                assert reactor.park(pump, wake) == -1  # parked: only the turn can step it now
                src_peer.sendall(forward_frame(round_))
                assert select.select([reactor.fileno()], [], [], 10)[0]
                reactor.turn()  # finds the pump by number 3000, which forwards and parks again
                sink = bytearray()
                drain(dst_peer, sink)
                assert bytes(sink) == forward_frame(round_) and wake.got == []
                assert reactor.detach(pump) is wake
                assert len(reactor) == 0
            finally:
                os.close(high)
                for sock in (src_peer, src, dst, dst_peer):
                    sock.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@needs_reactor
def test_detach_in_the_middle_of_a_turn(rig):
    """Two pumps are ready in one turn; the first one's greenlet ends the other's session (detach)
    while the turn wakes them.  A turn steps every ready pump before it wakes any greenlet (no
    Python runs while receives and sends are queued in its ring), so the other was stepped and
    its waiter taken already: detach returns no waiter, and the turn still wakes it once with its
    status (its greenlet then finds the session closed), so no greenlet is left waiting."""
    a, b = rig(), rig()
    reactor = Reactor()  # one set for both
    for r in (a, b):
        r.reactor.detach(r.pump)
        r.reactor = reactor
    got: dict[str, list[int]] = {"a": [], "b": []}
    detached: dict[str, object] = {}
    reactor.attach(a.pump, lambda: False)
    reactor.attach(b.pump, lambda: False)
    for r in (a, b):
        assert r.pump.step(True) == P_WAIT_READ

    class EndOther(Wake):
        def __init__(self, me: str, other: Rig) -> None:
            super().__init__()
            self.me, self.other = me, other

        def switch(self, status: int) -> None:
            got[self.me].append(status)
            if not detached:
                detached[self.me] = reactor.detach(self.other.pump)

    assert reactor.park(a.pump, EndOther("a", b)) == -1
    assert reactor.park(b.pump, EndOther("b", a)) == -1
    a.send(policy_frame(1))
    b.send(policy_frame(2))
    reactor.turn()
    assert got == {"a": [P_POLICY], "b": [P_POLICY]}  # each woken once, with its own status
    assert list(detached.values()) == [None]  # the turn had taken the other's waiter already
    assert len(reactor) == 1
    for r in (a, b):
        assert r.pump.frame() == policy_frame(1 if r is a else 2)


@needs_reactor
@pytest.mark.parametrize("with_bytes", [False, True], ids=["reset", "bytes-then-reset"])
def test_reset_while_parked(rig, with_bytes):
    """The source's peer resets the connection (SO_LINGER 0) while the pump is parked, alone or
    right after bytes: the pump ends (an error, or the end of the stream), it does not wait."""
    r = rig(tcp_src=True)
    data = forward_frame(1, 300)

    def reset(g):
        if with_bytes:
            r.src_peer.sendall(data)
        r.src_peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        r.src_peer.close()

    hook = script((parked_first, reset))
    st = r.g.run(hook)
    assert hook.left == []
    assert st in (P_OS_ERROR, P_EOF), st
    if st == P_OS_ERROR:
        assert r.pump.errno_value in (errno.ECONNRESET, errno.EPIPE)
    r.src_peer = socket.socket()  # closed above; the rig closes this one instead


@needs_reactor
def test_a_spurious_report_costs_nothing(rig):
    """A report for bytes the pump already read (its greenlet's own step read them before it
    parked) finds nothing: the pump stays parked, and the next bytes still wake it."""
    r = rig()
    r.send(forward_frame(1))
    assert r.pump.step(True) == P_WAIT_READ  # the greenlet's own step read them
    wake = Wake()
    assert r.reactor.park(r.pump, wake) == -1
    r.reactor.turn()  # the report of those bytes: nothing left to read
    assert wake.got == []
    r.send(forward_frame(2))
    r.fin()
    r.reactor.turn()
    assert wake.got == [P_EOF]


# --------------------------------------------------------------------------------------------
# Session level: the relay's own loops (reactor, libev watchers, the pure-Python pump).


MODES = ["reactor", "watchers", "python"]


class Events:
    def upstream_error(self, role: str) -> None:
        pass

    def upstream_ok(self, session, hp) -> None:
        pass


class Relayed:
    """One relay session between a socketpair (the client's end is ``client``) and a broker the
    test plays (``broker``: the upstream connection the session opened)."""

    def __init__(self, mode: str, early: bytes | None = None) -> None:
        import gevent
        from gevent import socket as gsocket

        from rmqfast.codec import codes as C
        from rmqfast.config import HostPort
        from rmqfast.filters.api import FilterChain
        from rmqfast.filters.deny import DenyAdminCodes
        from rmqfast.proxy.relay import RelaySettings, Session

        self.mode = mode
        listener = gsocket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        self.client, proxy_side = gsocket.socketpair()
        if early is not None:  # the client's bytes and its close are there before the session starts
            self.client.sendall(early)
            self.client.shutdown(socket.SHUT_WR)
        chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
        settings = RelaySettings(BUF, 16 << 20, 1 << 16, 5.0, 300.0)
        self.session = Session("broker", proxy_side, "test:1", [HostPort("127.0.0.1", listener.getsockname()[1])],
                               chain, codec.ScanStats(), settings, Events())
        self.runner = gevent.spawn(self.session.run)
        with gevent.Timeout(30):
            self.broker, _ = listener.accept()
        listener.close()
        # the session is past its connect (a close before that is test_close_while_connecting_upstream)
        until(lambda: self.session.to_client is not None, "the session's pumps start")

    def read_exactly(self, sock, n: int) -> bytes:
        got = bytearray()
        while len(got) < n:
            chunk = sock.recv(n - len(got))
            if not chunk:
                break
            got += chunk
        return bytes(got)

    def end(self) -> None:
        self.session.close()
        self.runner.join(timeout=10)
        for s in (self.client, self.broker):
            s.close()


@pytest.fixture(params=MODES)
def relayed(request, monkeypatch):
    import gevent

    from rmqfast.proxy import relay

    mode = request.param
    if mode != "python" and not compiled:
        pytest.skip("the reactor and the compiled pump's watchers need the compiled extension")
    monkeypatch.setattr(relay, "USE_REACTOR", mode == "reactor")
    if mode == "python":
        monkeypatch.setattr(relay, "Pump", None)
    made: list[Relayed] = []

    def make(**kw) -> Relayed:
        r = Relayed(mode, **kw)
        made.append(r)
        return r

    with gevent.Timeout(60):
        yield make
    for r in made:
        r.end()


def request_frame(opaque: int, body: bytes = b"hi") -> bytes:
    from rmqfast.codec import codes as C
    from rmqfast.codec.command import RemotingCommand, encode

    return encode(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=opaque, version=401,
                                  ext_fields={"a": "PG", "b": "TopicE", "e": "-1"}, body=body))


def denied(opaque: int) -> bytes:
    from rmqfast.codec import codes as C
    from rmqfast.codec.command import RemotingCommand, encode

    return encode(RemotingCommand(code=C.UPDATE_BROKER_CONFIG, opaque=opaque, version=401, body=b"a=b"))


def answer(opaque: int, body: bytes = b"") -> bytes:
    from rmqfast.codec import codes as C
    from rmqfast.codec.command import RemotingCommand, encode

    return encode(RemotingCommand(code=C.SUCCESS, flag=C.FLAG_RESPONSE, opaque=opaque, version=401,
                                  ext_fields={"msgId": "X", "queueId": "0"}, body=body))


def until(cond, what: str, limit: float = 20.0) -> None:
    """Let the relay's greenlets run until ``cond()`` (paced by their progress, bounded)."""
    import time

    import gevent

    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        gevent.sleep(0.001)


@pytest.mark.parametrize("lead", ["", "denied"], ids=["half-frame", "denied-then-half-frame"])
def test_client_half_frame_then_shutdown(relayed, lead):
    """The CI hang: the client sends half a frame (after a frame the proxy answers itself, so the
    close arrives while the client's pump is busy with policy) and shuts down its writing side; the
    proxy closes both connections."""
    from rmqfast.codec import codes as C
    from rmqfast.codec.command import decode_frame
    from rmqfast.testing.wire import read_frame

    r = relayed()
    half = request_frame(7, b"x" * 300)[:-5]
    r.client.sendall((denied(1) if lead else b"") + half)
    r.client.shutdown(socket.SHUT_WR)
    if lead:
        assert decode_frame(read_frame(r.client)).code == C.NO_PERMISSION
    assert read_frame(r.client) is None  # closed by the proxy
    got = r.broker.recv(1 << 16)
    while got and len(got) < len(half):
        more = r.broker.recv(1 << 16)
        if not more:
            break
        got += more
    assert got == half  # relayed as it came (partial frames are forwarded), then the close


def test_client_bytes_and_close_before_the_session_starts(relayed):
    """Everything the client will ever send (a request, half of the next, its close) is there
    before the session attaches its pumps (the registration's first report is the only one): the
    bytes are relayed, then the proxy closes both connections."""
    from rmqfast.testing.wire import read_frame

    first, half = request_frame(1), request_frame(2, b"x" * 300)[:-7]
    r = relayed(early=first + half)
    assert r.read_exactly(r.broker, len(first)) == first
    rest = r.read_exactly(r.broker, len(half))  # the half frame, then the proxy's close
    assert rest == half
    assert r.broker.recv(1) == b""
    assert read_frame(r.client) is None


@pytest.mark.parametrize("how", ["answer-and-close", "answer-split-then-close", "answer-then-reset"])
def test_broker_closes_right_after_its_last_answer(relayed, how):
    """The broker answers and closes at once (its last bytes and its FIN in one report): the client
    gets the whole answer, then the close."""
    from rmqfast.testing.wire import read_frame

    r = relayed()
    r.client.sendall(request_frame(5))
    assert read_frame(r.broker) == request_frame(5)
    ans = answer(5, b"z" * 3000)
    head = b""
    if how == "answer-split-then-close":
        r.broker.sendall(ans[:400])
        head = r.read_exactly(r.client, 400)  # relayed: the client's stream is mid-frame
    if how == "answer-then-reset":
        r.broker.sendall(ans)
        r.broker.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        r.broker.close()
        got = read_frame(r.client)
        assert got in (ans, None)  # a reset may discard what the proxy had not read yet
        if got is not None:
            assert read_frame(r.client) is None
        return
    r.broker.sendall(ans[len(head):])
    r.broker.shutdown(socket.SHUT_WR)
    assert head + r.read_exactly(r.client, len(ans) - len(head)) == ans
    assert read_frame(r.client) is None


def test_broker_closes_after_the_frame_a_held_answer_waits_for(relayed):
    """A local answer waits for the end of a response the broker is sending (the stream to the
    client is mid-frame); the rest of the response and the broker's close come together: the
    client gets the response, the held answer, then the close."""
    from rmqfast.codec import codes as C
    from rmqfast.codec.command import decode_frame
    from rmqfast.testing.wire import read_frame

    r = relayed()
    r.client.sendall(request_frame(5))
    assert read_frame(r.broker) == request_frame(5)
    ans = answer(5, b"z" * 20000)
    r.broker.sendall(ans[:3000])
    head = r.read_exactly(r.client, 3000)  # the head of the response reached the client: mid-frame
    r.client.sendall(denied(6))
    out = r.session.to_client
    until(lambda: bool(out.queue), "the denied request's answer is held for the boundary")
    r.broker.sendall(ans[3000:])
    r.broker.shutdown(socket.SHUT_WR)
    assert head + r.read_exactly(r.client, len(ans) - 3000) == ans
    refused = decode_frame(read_frame(r.client))
    assert (refused.code, refused.opaque) == (C.NO_PERMISSION, 6)
    assert read_frame(r.client) is None


def quietly(fn, *args) -> None:
    """Run ``fn`` in a greenlet of its own; the connection it writes to may be closed under it."""
    def run() -> None:
        try:
            fn(*args)
        except OSError:
            pass

    return __import__("gevent").spawn(run)


@pytest.mark.parametrize("waiting", ["to-write", "for-the-lock"])
def test_close_while_a_pump_waits_for_its_destination(relayed, waiting):
    """The client stops reading while the broker streams to it: the upstream pump waits to write
    (or for the write lock, held by another writer waiting for the client).  Closing the session
    (the idle sweep, a drain) then ends both directions at once: the broker's connection closes."""
    r = relayed()
    r.client.sendall(request_frame(5))
    assert r.read_exactly(r.broker, len(request_frame(5))) == request_frame(5)
    lock = r.session.client_lock
    holder = None
    if waiting == "for-the-lock":  # another writer waits for the client to read, holding the lock
        holder = quietly(r.session.to_client.write, answer(6, b"h" * (8 << 20)))
        until(lock.locked, "the other writer holds the lock")
    sender = quietly(r.broker.sendall, answer(5, b"z" * (8 << 20)))
    if waiting == "to-write":
        until(lock.locked, "the upstream pump waits for the client to read (it holds the lock)")
    else:
        until(lambda: lock.linkcount() >= 1, "the upstream pump waits for the lock")
    r.session.close()
    r.runner.join(timeout=30)
    assert r.runner.dead
    r.broker.settimeout(30)
    try:
        while r.broker.recv(1 << 16):  # the proxy closed its upstream connection
            pass
    except ConnectionResetError:
        pass
    for g in (sender, holder):
        if g is not None:
            g.join(timeout=30)
            assert g.dead



def test_an_answer_waiting_for_the_lock_lands_at_a_boundary(relayed, request):
    """Another writer holds the client's write lock (an answer written while the client reads
    slowly); the client's denied request is answered at a boundary, so its answer waits for that
    lock.  The lock is released in the event-loop iteration in which the head of a large response
    arrives, and the reactor's report is handled before the waiter's wake-up: the answer must not
    land inside that response."""
    import gevent

    from rmqfast.proxy import relay

    r = relayed()
    if r.mode != "reactor":
        pytest.skip("the ordering is driven through the reactor's turn")
    r.client.sendall(request_frame(5))
    assert r.read_exactly(r.broker, len(request_frame(5))) == request_frame(5)
    lock = r.session.client_lock
    lock.acquire()  # the other writer, mid-write
    r.client.sendall(denied(6))
    until(lambda: lock.linkcount() >= 1, "the denied request's answer waits for the lock")
    ans = answer(5, b"z" * 20000)
    r.broker.sendall(ans[:2000])
    # the head is at the proxy (a blocking select: the hub does not run meanwhile)
    assert select.select([r.session.upstream.fileno()], [], [], 20)[0]
    # In the next loop iteration the hub handles the epoll set's report before the lock's wake-up
    # (both are hub callbacks, run in order): the reactor steps the pump with the lock free.
    hub = gevent.get_hub()
    hub.loop.run_callback(relay.reactor_of(hub).turn)
    lock.release()
    until(lambda: not lock.locked() and lock.linkcount() == 0, "the answer was written or queued")
    r.broker.sendall(ans[2000:])
    r.broker.shutdown(socket.SHUT_WR)
    stream = bytearray()
    while chunk := r.client.recv(1 << 16):  # everything the client gets, up to the proxy's close
        stream += chunk
    assert len(stream) > len(ans)
    answered_first = stream.endswith(ans) and len(stream) - len(ans) == struct.unpack(">i", stream[:4])[0] + 4
    answered_after = stream.startswith(ans)
    where = bytes(stream).find(b'"opaque":6')
    assert answered_first or answered_after, f"the answer was written inside the response (near byte {where})"



def test_a_closed_session_gives_its_budget_share_back(relayed, monkeypatch, request):
    """A frame the broker sends is held whole (its header is larger than the buffer) when the
    session closes: the held bytes go back to the worker's budget when the pumps end, not when
    the session object is collected."""
    from rmqfast.proxy import relay

    budget = relay.BufferBudget(1 << 30) if compiled else relay.PyBufferBudget(1 << 30)
    monkeypatch.setattr(relay, "BUDGET", budget)
    r = relayed()
    r.client.sendall(request_frame(5))
    assert r.read_exactly(r.broker, len(request_frame(5))) == request_frame(5)
    header = b'{"code":0,"flag":1,"opaque":5,"remark":"' + b"r" * (6 * BUF) + b'"}'
    frame = struct.pack(">ii", 4 + len(header), len(header)) + header
    r.broker.sendall(frame[: 3 * BUF])
    until(lambda: budget.used > 0, "the header is held in a grown buffer")
    r.session.close()
    r.runner.join(timeout=20)
    assert r.runner.dead
    assert budget.used == 0



def test_close_while_connecting_upstream(monkeypatch):
    """The session is closed while its upstream connect is under way (slow on a loaded machine): it
    ends quietly and the upstream connection it then gets is closed."""
    import gevent
    from gevent import socket as gsocket
    from gevent.event import Event

    from rmqfast.codec import codes as C
    from rmqfast.config import HostPort
    from rmqfast.filters.api import FilterChain
    from rmqfast.filters.deny import DenyAdminCodes
    from rmqfast.proxy import relay

    started, gate = Event(), Event()
    real = relay.connect_plain

    def slow_connect(host: str, port: int, timeout: float):
        started.set()
        gate.wait()
        return real(host, port, timeout)

    monkeypatch.setattr(relay, "connect_plain", slow_connect)
    listener = gsocket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    client, proxy_side = gsocket.socketpair()
    session = relay.Session("broker", proxy_side, "test:1", [HostPort("127.0.0.1", listener.getsockname()[1])],
                            FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)]), codec.ScanStats(),
                            relay.RelaySettings(BUF, 16 << 20, 1 << 16, 5.0, 300.0), Events())
    raised: list[BaseException] = []

    def run() -> None:
        try:
            session.run()
        except BaseException as exc:  # noqa: BLE001 - what the greenlet would die of
            raised.append(exc)

    with gevent.Timeout(30):
        runner = gevent.spawn(run)
        started.wait()
        session.close()  # e.g. the worker drains while the connect is under way
        gate.set()
        broker, _ = listener.accept()
        runner.join()
        try:
            assert raised == []
            # the runner has ended: a closed upstream connection shows at once (5 s: a loaded machine)
            broker.settimeout(5)
            assert broker.recv(1) == b""
        finally:
            broker.close()
            listener.close()
            client.close()



@pytest.mark.parametrize("full_record", [True, False], ids=["full-record", "short-record"])
def test_tls_close_notify_right_after_the_last_record(tmp_path, full_record, request):
    """A TLS client sends the head of a frame and its close_notify at once, keeping its TCP side
    open (an SSL_shutdown that waits for the proxy's close_notify): the proxy reads both in one
    receive and must close the connection, not wait for bytes that will never come."""
    pytest.importorskip("cryptography")
    import os

    import gevent
    from gevent import socket as gsocket
    from gevent.server import StreamServer

    from rmqfast.codec import codes as C
    from rmqfast.filters.api import FilterChain
    from rmqfast.filters.deny import DenyAdminCodes
    from rmqfast.proxy.relay import RelaySettings, Session
    from rmqfast.proxy.tls import TlsContexts, parse_tls
    from rmqfast.testing.tlscerts import make_certs
    from tests.test_relay import FakeBroker, send_frame
    from tests.test_tls import Events as TlsEvents
    from tests.test_tls import _listen, tls_client

    certs = make_certs(tmp_path)
    tls = TlsContexts(parse_tls({"listen": _listen(certs)}))
    events = TlsEvents(tls)
    broker = FakeBroker()
    chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    settings = RelaySettings(256 * 1024, 16 << 20, 1 << 16, 5.0, 300.0)  # the default buffer: > one record

    def handle(sock, addr) -> None:
        sock = tls.accept("broker", sock, "test:1")
        if sock is not None:
            Session("broker", sock, "test:1", [broker.addr], chain, codec.ScanStats(), settings, events).run()

    server = StreamServer(("127.0.0.1", 0), handle)
    server.start()
    c = tls_client(server.server_port, certs)
    raw = None
    try:
        frame = send_frame(1, b"b" * 40000)
        head = frame[:16384] if full_record else frame[:1000]  # one TLS record: full, or short
        c.sendall(head)  # the proxy runs only when this greenlet waits: both arrive before it reads
        with pytest.raises(ssl.SSLWantReadError):
            c._sslobj.shutdown()  # close_notify sent; the reply would be awaited
        raw = gsocket.socket(fileno=os.dup(c.fileno()))
        # in-process: a proxy that saw the end closes at once (5 s: a loaded machine)
        with gevent.Timeout(5, AssertionError("the proxy did not close the connection")):
            while raw.recv(65536):  # the proxy's close_notify, then its close
                pass
    finally:
        for s in (raw, c):
            if s is not None:
                s.close()
        server.stop(timeout=2)
        broker.server.stop(timeout=2)
