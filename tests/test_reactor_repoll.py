"""A reactor turn that polls its epoll set again (``Reactor.repoll``) while the previous poll found
several sources ready: sources that became ready while those were stepped are stepped in the same
turn, none is lost, and a turn that found one source ready polls once."""

from __future__ import annotations

import pytest

from rmqfast import codec
from tests import test_reactor_edges as edges
from tests.test_reactor_edges import Wake, drain, forward_frame, policy_frame, rig

needs_reactor = pytest.mark.skipif(codec.Pump is None, reason="the reactor drives the compiled pump only")

__all__ = ["rig"]  # the fixture, imported for the tests below


def _on_one_reactor(rig, n: int, repoll: int):  # noqa: F811
    rigs = [rig() for _ in range(n)]
    reactor = edges.Reactor()
    reactor.repoll = repoll
    for r in rigs:
        r.reactor.detach(r.pump)
        r.reactor = reactor
        reactor.attach(r.pump, lambda: False)
        assert r.pump.step(True) == edges.P_WAIT_READ
    return rigs, reactor


class SendTo(Wake):
    """A parked greenlet woken for a policy frame: while it runs, bytes arrive for another pump."""

    def __init__(self, other, data: bytes) -> None:
        super().__init__()
        self.other, self.data = other, data

    def switch(self, status: int) -> None:
        super().switch(status)
        self.other.send(self.data)


@needs_reactor
@pytest.mark.parametrize("repoll", [0, 1, 4])
def test_sources_ready_during_a_turn_are_stepped_in_it(rig, repoll: int) -> None:  # noqa: F811
    (a, b, c), reactor = _on_one_reactor(rig, 3, repoll)
    assert reactor.park(a.pump, SendTo(c, forward_frame(7))) == -1
    assert reactor.park(b.pump, Wake()) == -1
    waked_c = Wake()
    assert reactor.park(c.pump, waked_c) == -1
    a.send(policy_frame(1))
    b.send(forward_frame(2))
    reactor.turn()  # a and b ready at the first poll; c's bytes arrive while a's greenlet runs
    sink_b, sink_c = bytearray(), bytearray()
    drain(b.dst_peer, sink_b)
    drain(c.dst_peer, sink_c)
    assert bytes(sink_b) == forward_frame(2)
    assert (reactor.repolls, reactor.polls_empty) == ((1, 0) if repoll else (0, 0))
    if repoll:
        assert bytes(sink_c) == forward_frame(7)  # stepped in the same turn
    else:
        assert sink_c == b""  # the next turn steps it
        reactor.turn()
        drain(c.dst_peer, sink_c)
        assert bytes(sink_c) == forward_frame(7)
    assert waked_c.got == []  # forwarded in C: its greenlet never ran
    assert reactor.turns == (1 if repoll else 2)


@needs_reactor
def test_one_ready_source_polls_once_and_an_empty_poll_ends_the_turn(rig) -> None:  # noqa: F811
    (a, b), reactor = _on_one_reactor(rig, 2, 8)
    wa, wb = Wake(), Wake()
    assert reactor.park(a.pump, wa) == -1 and reactor.park(b.pump, wb) == -1
    a.send(forward_frame(1))
    reactor.turn()
    assert (reactor.turns, reactor.repolls, reactor.polls_empty) == (1, 0, 0)
    a.send(forward_frame(2))
    b.send(policy_frame(3))
    reactor.turn()  # two ready: one more poll, which finds nothing
    assert (reactor.turns, reactor.repolls, reactor.polls_empty) == (2, 1, 1)
    assert wb.got == [edges.P_POLICY] and wa.got == []
    sink = bytearray()
    drain(a.dst_peer, sink)
    assert bytes(sink) == forward_frame(1) + forward_frame(2)

