"""The reactor's io_uring batches (``ext/uring.h``): the receives and sends of the pumps one poll
found ready go out in one ``io_uring_enter``; a ring that fails, or one the kernel refuses, leaves
the reactor on plain system calls with the reason, and no frame is lost."""

from __future__ import annotations

import os
import resource
import sys

import pytest

from rmqfast import codec
from tests.test_reactor_edges import Wake, drain, forward_frame, reactor_mode, rig
from tests.test_reactor_repoll import _on_one_reactor

needs_reactor = pytest.mark.skipif(codec.Pump is None, reason="the reactor drives the compiled pump only")

__all__ = ["reactor_mode", "rig"]  # the fixtures, imported for the tests below


def _refcounts(rigs) -> list[int]:
    """The pumps' reference counts: a queued pump holds one more until its operation is done."""
    return [sys.getrefcount(r.pump) for r in rigs]


@needs_reactor
@pytest.mark.parametrize("n, submits", [(8, 2), (70, 6)])
def test_the_pumps_of_one_poll_share_each_io_uring_enter(rig, reactor_mode: str, n: int, submits: int) -> None:  # noqa: F811
    """``n`` sources ready at one poll: with io_uring their receives go out in one io_uring_enter
    and their sends in the next, a batch (32 queued pumps) at a time: with 70, receives of 32,
    their sends, 32 more of each, then the last 6 of each.  Every frame arrives whole, no greenlet
    runs, and the references the queue took are all given back.  With plain system calls the
    ring is not used."""
    rigs, reactor = _on_one_reactor(rig, n, 0)
    wakes = []
    for r in rigs:
        wakes.append(Wake())
        assert reactor.park(r.pump, wakes[-1]) == -1
    for i, r in enumerate(rigs):
        r.send(forward_frame(i, 100 + i))
    refs = _refcounts(rigs)
    reactor.turn()
    assert _refcounts(rigs) == refs
    for i, r in enumerate(rigs):
        sink = bytearray()
        drain(r.dst_peer, sink)
        assert bytes(sink) == forward_frame(i, 100 + i)
    assert all(w.got == [] for w in wakes)
    if reactor_mode == "io_uring":
        assert (reactor.submits, reactor.ring_ops) == (submits, 2 * n)
    else:
        assert (reactor.submits, reactor.ring_ops) == (0, 0)


@needs_reactor
def test_a_ring_that_fails_is_given_up_and_nothing_is_lost(rig, reactor_mode: str) -> None:  # noqa: F811
    """io_uring_enter fails (here: the ring's descriptor now names /dev/null): the reactor gives
    the ring up for good, says why, and steps the queued pumps with plain system calls; the
    frames of that turn and of the next ones arrive whole."""
    if reactor_mode != "io_uring":
        pytest.skip("the ring is what fails here")
    rigs, reactor = _on_one_reactor(rig, 4, 0)
    for r in rigs:
        assert reactor.park(r.pump, Wake()) == -1
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), reactor.uring_fd)
    refs = _refcounts(rigs)
    for round_ in range(2):
        for i, r in enumerate(rigs):
            r.send(forward_frame(10 * round_ + i, 200))
        reactor.turn()
        assert _refcounts(rigs) == refs
        for i, r in enumerate(rigs):
            sink = bytearray()
            drain(r.dst_peer, sink)
            assert bytes(sink) == forward_frame(10 * round_ + i, 200)
        assert not reactor.uring and "io_uring_enter failed" in reactor.uring_off
    assert reactor.ring_ops == 0 and reactor.submits == 1  # the one that failed



@needs_reactor
def test_a_kernel_that_refuses_the_ring_leaves_plain_system_calls_with_the_reason(reactor_mode: str) -> None:  # noqa: F811
    """io_uring_setup fails (here: no file descriptor is left for the ring after the epoll set's):
    the reactor says why and works with plain system calls."""
    if reactor_mode != "io_uring":
        pytest.skip("the ring is what is refused here")
    from rmqfast._speedups import Reactor  # type: ignore[attr-defined]

    lowest_free = os.dup(0)
    os.close(lowest_free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free + 1, hard))  # room for the epoll set only
    try:
        reactor = Reactor()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not reactor.uring and reactor.uring_fd == -1
    assert reactor.uring_off == "io_uring_setup failed (Too many open files)"


@needs_reactor
def test_an_operation_left_in_the_kernel_is_cancelled_and_the_ring_given_up(rig, reactor_mode: str) -> None:  # noqa: F811
    """A receive that does not complete inside io_uring_enter (here: queued without MSG_DONTWAIT on
    a drained socket, after a receive that filled the buffer) is cancelled and waited for before
    its pump goes on with plain system calls; the ring is given up and every byte arrives."""
    if reactor_mode != "io_uring":
        pytest.skip("the ring is what is tested here")
    rigs, reactor = _on_one_reactor(rig, 2, 0)
    reactor._test_ops_may_wait()
    for r in rigs:
        assert reactor.park(r.pump, Wake()) == -1
    frames = b"".join(forward_frame(i, 200) for i in range(40))
    first = frames[:4096]  # exactly one buffer: the pump receives again and finds nothing
    for r in rigs:
        r.send(first)
    refs = _refcounts(rigs)
    reactor.turn()
    assert not reactor.uring and reactor.uring_off == "an operation did not complete inside io_uring_enter"
    assert _refcounts(rigs) == refs
    for r in rigs:
        r.send(frames[4096:])
    reactor.turn()
    for r in rigs:
        sink = bytearray()
        drain(r.dst_peer, sink)
        assert bytes(sink) == frames
