"""The compiled pump holds a receive buffer only while it has bytes it could not forward.

Each step takes a base buffer from the process's pool and gives it back when the step ends with
nothing buffered: an idle connection holds none.  Whatever a step leaves behind (an incomplete
frame head, bytes the destination would not take yet, a frame with Python) stays in the pump's
own buffer until it is gone, and the bytes relayed are the same either way.
"""

from __future__ import annotations

import gc
import socket

import pytest

from rmqfast import codec
from tests.test_pump import actions, drain, nonblocking_pair
from tests.test_scan import json_frame, send_v2

pytestmark = pytest.mark.skipif(codec.Pump is None, reason="compiled extension not in use")

if codec.Pump is not None:
    from rmqfast._speedups import (  # type: ignore[attr-defined]
        P_POLICY,
        P_WAIT_LOCK,
        P_WAIT_READ,
        P_WAIT_WRITE,
        BufferBudget,
        pump_pool_free,
    )


@pytest.fixture
def pair():
    scanner = codec.FrameScannerC(codec.ScanStatsC(), actions=actions())
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), 4096)
    yield pump, src_peer, dst_peer, dst
    del pump
    gc.collect()
    for s in (src_peer, src, dst, dst_peer):
        s.close()


def test_a_new_and_an_idle_pump_hold_no_buffer(pair):
    pump, src_peer, dst_peer, _ = pair
    assert not pump.holds_buffer
    assert pump.step(True) == P_WAIT_READ  # nothing there: the buffer taken for the receive goes back
    assert not pump.holds_buffer
    frame = send_v2("T", opaque=1, body=b"x" * 100)
    src_peer.send(frame)
    assert pump.step(True) == P_WAIT_READ
    assert dst_peer.recv(65536) == frame
    assert not pump.holds_buffer and pump.buffered == 0 and pump.at_boundary


def test_an_incomplete_frame_head_keeps_the_buffer_until_the_frame_is_out(pair):
    pump, src_peer, dst_peer, _ = pair
    frame = send_v2("T", opaque=1, body=b"y" * 50)
    src_peer.send(frame[:7])  # not even the header length: nothing can be forwarded yet
    assert pump.step(True) == P_WAIT_READ
    assert pump.holds_buffer and pump.buffered == 7
    assert pump.stalled_since > 0  # a frame started: the frame deadline sees it
    src_peer.send(frame[7:])
    assert pump.step(True) == P_WAIT_READ
    assert dst_peer.recv(65536) == frame
    assert not pump.holds_buffer and pump.stalled_since == 0


def test_a_large_frame_streams_through_without_keeping_a_buffer(pair):
    """Bytes of a frame larger than the buffer go out as they come: between receives the pump
    keeps nothing once the header was seen."""
    pump, src_peer, dst_peer, _ = pair
    frame = send_v2("T", opaque=1, body=b"z" * 20000)
    out = bytearray()
    for i in range(0, len(frame), 3000):
        src_peer.send(frame[i : i + 3000])
        while pump.step(True) != P_WAIT_READ:
            pass
        drain(dst_peer, out)
        assert not pump.holds_buffer  # forwarded up to the last byte received
        assert pump.stalled_since > 0 or len(out) == len(frame)
    assert bytes(out) == frame


def test_bytes_waiting_for_the_lock_stay_with_the_pump(pair):
    pump, src_peer, dst_peer, _ = pair
    frame = send_v2("T", opaque=1)
    src_peer.send(frame)
    assert pump.step(False) == P_WAIT_LOCK
    assert pump.holds_buffer and pump.buffered == len(frame)
    other = codec.Pump(codec.FrameScannerC(codec.ScanStatsC()), -1, -1, 4096)
    assert other.step(True) != P_WAIT_LOCK  # another pump's step in between (the pool's buffer)
    assert pump.step(True) == P_WAIT_READ
    assert dst_peer.recv(65536) == frame and not pump.holds_buffer


def test_bytes_the_destination_would_not_take_stay_with_the_pump(pair):
    pump, src_peer, dst_peer, dst = pair
    dst.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    stream = b"".join(send_v2("T", opaque=i, body=b"w" * 1500) for i in range(200))
    out = bytearray()
    pos, waited = 0, False
    while len(out) < len(stream):
        if pos < len(stream):
            try:
                pos += src_peer.send(stream[pos : pos + 8192])
            except BlockingIOError:
                pass
        st = pump.step(True)
        if st == P_WAIT_WRITE:
            waited = True
            assert pump.holds_buffer and pump.buffered > 0
        drain(dst_peer, out)
    assert waited and bytes(out) == stream
    while pump.step(True) != P_WAIT_READ:
        pass
    assert not pump.holds_buffer


def test_a_policy_frame_stays_in_the_buffer_until_consumed(pair):
    pump, src_peer, dst_peer, _ = pair
    policy = json_frame({"code": 105, "flag": 0, "opaque": 3}, b"")
    after = send_v2("T", opaque=4)
    src_peer.send(policy + after)
    assert pump.step(True) == P_POLICY
    assert pump.holds_buffer
    other = codec.Pump(codec.FrameScannerC(codec.ScanStatsC()), -1, -1, 4096)
    other.step(True)  # another pump takes and gives back a pool buffer meanwhile
    assert pump.frame() == policy
    pump.consume()
    assert pump.step(True) == P_WAIT_READ
    assert dst_peer.recv(65536) == after and not pump.holds_buffer


def test_a_frame_held_whole_goes_back_to_no_buffer_and_gives_the_budget_back():
    scanner = codec.FrameScannerC(codec.ScanStatsC(), actions=actions())
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    budget = BufferBudget(1 << 20)
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), 4096, budget)
    policy = json_frame({"code": 25, "flag": 0, "opaque": 1}, b"p" * 30000)  # larger than the buffer
    pos, st = 0, P_WAIT_READ
    while st != P_POLICY:
        if pos < len(policy):
            pos += src_peer.send(policy[pos : pos + 5000])
        st = pump.step(True)
    assert pump.capacity >= len(policy) and budget.used > 0
    assert pump.frame() == policy
    pump.consume()
    assert pump.step(True) == P_WAIT_READ
    assert not pump.holds_buffer and budget.used == 0 and pump.capacity == 4096
    del pump
    for s in (src_peer, src, dst, dst_peer):
        s.close()


def test_the_pool_keeps_a_few_buffers_for_reuse():
    """Buffers given back are kept for the next steps, but only a few: a burst of pumps holding
    bytes at once does not leave their buffers mapped once they are done."""
    from rmqfast._speedups import PUMP_POOL_MAX  # type: ignore[attr-defined]

    pumps, socks = [], []
    for i in range(PUMP_POOL_MAX + 8):
        src_peer, src = nonblocking_pair()
        dst, dst_peer = nonblocking_pair()
        socks += [src_peer, src, dst, dst_peer]
        pump = codec.Pump(codec.FrameScannerC(codec.ScanStatsC()), src.fileno(), dst.fileno(), 4096)
        src_peer.send(send_v2("T", opaque=i)[:5])
        assert pump.step(True) == P_WAIT_READ and pump.holds_buffer
        pumps.append(pump)
    del pumps, pump
    gc.collect()
    assert 1 <= pump_pool_free() <= PUMP_POOL_MAX
    for s in socks:
        s.close()
