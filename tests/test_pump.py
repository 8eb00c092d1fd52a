"""The compiled relay pump against the pure-Python scanner on the same byte streams.

The reference is the pure-Python scanner run over the whole stream at once: it says which
frames need policy and which bytes are forwarded.  The C pump must forward exactly those bytes
and hand over exactly those frames, however the stream is split into reads, whatever its
buffer size (frames larger than the buffer stream through, policy frames grow it), and when
the destination pushes back.
"""

from __future__ import annotations

import errno
import random
import socket
import struct

import pytest

from rmqfast import codec
from tests.test_scan import binary_frame, json_frame, send_v2

pytestmark = pytest.mark.skipif(codec.Pump is None, reason="compiled extension not in use")

if codec.Pump is not None:
    from rmqfast._speedups import (
        P_BOUNDARY,
        P_EOF,
        P_OS_ERROR,
        P_OVER_BUDGET,
        P_POLICY,
        P_PROTOCOL_ERROR,
        P_WAIT_LOCK,
        P_WAIT_READ,
        P_WAIT_WRITE,
        P_YIELD,
        BufferBudget,
    )

POLICY_CODES = (25, 105)  # UPDATE_BROKER_CONFIG, GET_ROUTEINFO_BY_TOPIC


def actions() -> bytes:
    table = bytearray(codec.CODE_SLOTS)
    for c in POLICY_CODES:
        table[codec.code_slot(c)] = codec.ACTION_POLICY
    return bytes(table)


def random_stream(rng: random.Random, n: int) -> bytes:
    frames = []
    for i in range(n):
        kind = rng.random()
        body = bytes([i % 256]) * rng.choice([0, 10, 300, 5000, 20000])
        if kind < 0.5:
            frames.append(send_v2(f"T{rng.randrange(5)}", opaque=i, body=body))
        elif kind < 0.7:
            frames.append(json_frame({"code": rng.choice(POLICY_CODES), "flag": 0, "opaque": i}, body))
        elif kind < 0.85:
            frames.append(binary_frame(rng.choice([11, 34, 105]), 0, i, {"topic": "B"}, body=body))
        else:
            frames.append(json_frame({"code": 0, "flag": 1, "opaque": i, "extFields": {"x": "y"}}, body))
    return b"".join(frames)


def reference(stream: bytes) -> tuple[bytes, list[bytes]]:
    """What must be forwarded and what must reach policy, per the pure-Python scanner."""
    sc = codec.FrameScannerPy(codec.ScanStatsPy(), actions=actions())
    forwarded = bytearray()
    policy = []
    pos = 0
    while True:
        ev, a, b = sc.scan(stream, pos, len(stream))
        forwarded += stream[pos:a]
        if ev == codec.EV_POLICY:
            policy.append(stream[a:b])
            pos = b
            continue
        assert ev == codec.EV_FORWARD and a == len(stream), (ev, a, b, sc.error)
        return bytes(forwarded), policy


def nonblocking_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def drain(sock: socket.socket, into: bytearray) -> None:
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return
        if not chunk:
            return
        into += chunk


def run_pump(stream: bytes, buffer_size: int, chunks: list[int], sndbuf: int | None = None):
    """Feed ``stream`` in ``chunks`` through a C pump; return (forwarded, policy frames, stats, events)."""
    stats = codec.ScanStatsC()
    scanner = codec.FrameScannerC(stats, actions=actions())
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    if sndbuf:
        dst.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), buffer_size)
    out = bytearray()
    policy: list[bytes] = []
    events: set[int] = set()
    pos = 0
    pending = b""
    fed_all = False
    while True:
        st = pump.step(True)
        events.add(st)
        if st == P_POLICY:
            policy.append(pump.frame())
            pump.consume()
        elif st == P_WAIT_WRITE:
            drain(dst_peer, out)
        elif st == P_YIELD:
            continue
        elif st == P_WAIT_READ:
            drain(dst_peer, out)
            if fed_all and not pending:
                src_peer.shutdown(socket.SHUT_WR)
                fed_all = False  # next WAIT_READ/EOF ends it
                continue
            if not pending:
                if pos >= len(stream):
                    fed_all = True
                    continue
                n = chunks[len(policy) % len(chunks)] if chunks else len(stream)
                pending = stream[pos : pos + n]
                pos += n
            try:
                sent = src_peer.send(pending)
            except BlockingIOError:
                sent = 0
            pending = pending[sent:]
        elif st == P_EOF:
            drain(dst_peer, out)
            break
        else:
            raise AssertionError(f"unexpected pump status {st} ({scanner.error})")
    for s in (src_peer, src, dst, dst_peer):
        s.close()
    return bytes(out), policy, stats, events


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_match_the_python_reference(seed):
    rng = random.Random(seed)
    stream = random_stream(rng, 60)
    want_fwd, want_policy = reference(stream)
    size = rng.choice([64, 100, 1024, 4096, 65536])
    chunks = [rng.choice([1, 7, 100, 999, 4096, 70000]) for _ in range(5)]
    got_fwd, got_policy, stats, _ = run_pump(stream, size, chunks)
    assert got_policy == want_policy
    assert got_fwd == want_fwd
    ref = reference_stats(stream)  # same counters as the reference scanner over the same bytes
    assert (stats.frames, stats.bytes) == (ref.frames, ref.bytes)
    assert stats.requests() == ref.requests() and stats.responses() == ref.responses()
    assert sorted(stats.topics()) == sorted(ref.topics())


def reference_stats(stream: bytes):
    st = codec.ScanStatsPy()
    sc = codec.FrameScannerPy(st, actions=actions())
    pos = 0
    while True:
        ev, a, b = sc.scan(stream, pos, len(stream))
        if ev == codec.EV_POLICY:
            pos = b
            continue
        return st


def test_destination_pushback_loses_nothing():
    stream = b"".join(send_v2("T", opaque=i, body=b"z" * 3000) for i in range(400))  # ~1.2 MB
    got, policy, _, events = run_pump(stream, 65536, [200000], sndbuf=4096)
    assert P_WAIT_WRITE in events  # the small send buffer made the pump wait for the destination
    assert got == stream and policy == []


def test_may_send_false_waits_for_the_lock_then_resumes():
    stats = codec.ScanStatsC()
    scanner = codec.FrameScannerC(stats, actions=actions())
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), 4096)
    frame = send_v2("T", opaque=1)
    src_peer.send(frame)
    assert pump.step(False) == P_WAIT_LOCK
    assert pump.buffered == len(frame)
    assert pump.step(True) == P_WAIT_READ
    assert dst_peer.recv(65536) == frame
    for s in (src_peer, src, dst, dst_peer):
        s.close()


def test_protocol_error_after_forwarding_the_good_frames():
    stats = codec.ScanStatsC()
    scanner = codec.FrameScannerC(stats, actions=actions())
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), 4096)
    good = send_v2("T", opaque=1)
    src_peer.send(good + struct.pack(">ii", 2, 0))
    assert pump.step(True) == P_PROTOCOL_ERROR
    assert "shorter than the 4-byte" in scanner.error and stats.protocol_errors == 1
    assert dst_peer.recv(65536) == good
    for s in (src_peer, src, dst, dst_peer):
        s.close()


def test_os_error_reports_errno():
    stats = codec.ScanStatsC()
    scanner = codec.FrameScannerC(stats)
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    dst_peer.close()  # writing to dst now fails with EPIPE (no SIGPIPE: MSG_NOSIGNAL)
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), 4096)
    src_peer.send(send_v2("T"))
    assert pump.step(True) == P_OS_ERROR
    assert pump.errno_value in (errno.EPIPE, errno.ECONNRESET)
    assert pump.step(True) == P_OS_ERROR  # the unsent bytes are still there: the error sticks
    src_peer.close()
    for s in (src, dst):
        s.close()


def test_misuse_is_refused_with_a_clear_error():
    scanner = codec.FrameScannerC(codec.ScanStatsC())
    with pytest.raises(ValueError, match="too small"):
        codec.Pump(scanner, 0, 1, 8)
    pump = codec.Pump(scanner, -1, -1, 4096)
    with pytest.raises(RuntimeError, match="no frame is waiting"):
        pump.frame()
    with pytest.raises(RuntimeError, match="no frame is waiting"):
        pump.consume()


def test_hold_stops_at_the_next_frame_boundary():
    """With ``hold`` set in the middle of a forwarded frame, the pump forwards up to the end of
    that frame and no further, says P_BOUNDARY, and goes on once ``hold`` is cleared."""
    stats = codec.ScanStatsC()
    scanner = codec.FrameScannerC(stats, actions=actions())
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), 4096)
    first = send_v2("T", opaque=1, body=b"a" * 10000)  # larger than the buffer: forwarded in parts
    second = send_v2("T", opaque=2, body=b"b" * 100)
    src_peer.send(first[:3000])
    assert pump.step(True) == P_WAIT_READ
    assert not pump.at_boundary  # part of the first frame went out
    pump.hold = True
    src_peer.send(first[3000:] + second)
    out = bytearray()
    while True:
        st = pump.step(True)
        drain(dst_peer, out)
        if st == P_BOUNDARY:
            break
        assert st in (P_WAIT_READ, P_YIELD), st
    assert bytes(out) == first and pump.at_boundary
    pump.hold = False
    while pump.step(True) != P_WAIT_READ:
        pass
    drain(dst_peer, out)
    assert bytes(out) == first + second
    for s in (src_peer, src, dst, dst_peer):
        s.close()


def test_budget_is_charged_by_bytes_held_and_given_back():
    stats = codec.ScanStatsC()
    scanner = codec.FrameScannerC(stats, actions=actions())
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    budget = BufferBudget(1 << 20)
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), 4096, budget)
    policy = json_frame({"code": 25, "flag": 0, "opaque": 1}, b"p" * 3_000_000)  # held whole for policy
    src_peer.send(policy[:200_000])
    while pump.step(True) != P_WAIT_READ:
        pass
    assert 0 < budget.used <= 200_000  # what arrived, not the 3 MB the frame claims
    pos, st = 200_000, P_WAIT_READ
    while st in (P_WAIT_READ, P_YIELD) and pos < len(policy):
        try:
            pos += src_peer.send(policy[pos : pos + 65536])
        except BlockingIOError:
            pass
        st = pump.step(True)
    assert st == P_OVER_BUDGET and pump.need == len(policy)
    assert budget.used <= (1 << 20) + 4096  # past the limit by at most one receive
    del pump
    assert budget.used == 0
    for s in (src_peer, src, dst, dst_peer):
        s.close()
