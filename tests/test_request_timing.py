"""Request timing and results: the in-flight table and the latency histogram, C and Python twins.

A relayed connection's two scanners share one in-flight table: the client-to-upstream scanner
notes each request (code slot, arrival time), the other one finds it again by opaque when the
response passes and records the latency and the result.  Times are injected (``now_ns``) so
that both twins can be compared exactly.
"""

from __future__ import annotations

import random

import pytest

from rmqfast import codec
from rmqfast.codec import _scan_py
from tests.test_scan import json_frame, send_v2


def response(opaque: int, code: int = 0) -> bytes:
    return json_frame({"code": code, "flag": 1, "opaque": opaque, "extFields": {"msgId": "X"}})


def pair(twin, actions=None, capacity=None):
    Scanner, Stats, InFlight = twin.FrameScanner, twin.ScanStats, twin.InFlight
    stats = Stats()
    inflight = InFlight() if capacity is None else InFlight(capacity)
    c2u = Scanner(stats, inflight=inflight, direction=0, actions=actions)
    u2c = Scanner(stats, inflight=inflight, direction=1)
    return stats, inflight, c2u, u2c


def test_latency_and_result_of_a_round_trip(twin):
    stats, inflight, c2u, u2c = pair(twin)
    reqs = send_v2("T", opaque=7) + send_v2("T", opaque=8)
    c2u.scan(reqs, 0, len(reqs), now_ns=1_000_000)
    assert len(inflight) == 2
    resp = response(7) + response(8, code=2)
    u2c.scan(resp, 0, len(resp), now_ns=1_300_000)  # 300 us later
    assert len(inflight) == 0
    ((slot, buckets, total_ns),) = stats.latencies()
    assert slot == 310 and total_ns == 600_000
    assert buckets[_scan_py.latency_bucket(300_000)] == 2 and sum(buckets) == 2
    assert stats.results() == [(310, codec.RESULTS.index("success"), 1), (310, codec.RESULTS.index("system_busy"), 1)]


def test_oneway_unanswered_and_unknown_responses(twin):
    stats, inflight, c2u, u2c = pair(twin)
    oneway = json_frame({"code": 37, "flag": 2, "opaque": 1})  # END_TRANSACTION, oneway
    req = json_frame({"code": 34, "flag": 0, "opaque": 2})
    c2u.scan(oneway + req, 0, len(oneway + req), now_ns=5)
    stray = response(99)  # answers nothing we sent: ignored
    u2c.scan(stray, 0, len(stray), now_ns=10)
    assert stats.latencies() == []
    assert inflight.abandon(stats) == 1 and len(inflight) == 0
    assert stats.results() == [(34, codec.RESULTS.index("unanswered"), 1), (37, codec.RESULTS.index("oneway"), 1)]


def test_broker_to_client_requests_are_timed_the_other_way(twin):
    stats, inflight, c2u, u2c = pair(twin)
    check = json_frame({"code": 39, "flag": 0, "opaque": 5})  # CHECK_TRANSACTION_STATE from the broker
    u2c.scan(check, 0, len(check), now_ns=0)
    answer = response(5)
    c2u.scan(answer, 0, len(answer), now_ns=2_000_000_000)
    assert stats.latencies()[0][0] == 39 and stats.latencies()[0][2] == 2_000_000_000


def test_policy_requests_are_left_to_the_relay(twin):
    actions = bytearray(codec.CODE_SLOTS)
    actions[25] = codec.ACTION_POLICY
    stats, inflight, c2u, _ = pair(twin, actions=bytes(actions))
    frame = json_frame({"code": 25, "flag": 0, "opaque": 3})
    assert c2u.scan(frame, 0, len(frame), now_ns=1)[0] == codec.EV_POLICY
    assert len(inflight) == 0 and stats.results() == []


def test_capacity_bounds_the_table_and_counts_the_rest(twin):
    stats, inflight, c2u, _ = pair(twin, capacity=4)
    reqs = b"".join(send_v2("T", opaque=i) for i in range(10))
    c2u.scan(reqs, 0, len(reqs), now_ns=1)
    assert len(inflight) == 4 and stats.untracked == 6


def test_random_traffic_gives_identical_figures_in_both_twins():
    if codec.FrameScannerC is None:
        pytest.skip("compiled extension not built")
    rng = random.Random(3)
    sides = []
    for Scanner, Stats, InFlight in ((codec.FrameScannerPy, codec.ScanStatsPy, codec.InFlightPy),
                                     (codec.FrameScannerC, codec.ScanStatsC, codec.InFlightC)):
        stats = Stats()
        inflight = InFlight(300)
        sides.append((stats, inflight, Scanner(stats, inflight=inflight, direction=0),
                      Scanner(stats, inflight=inflight, direction=1)))
    pending: list[int] = []
    now = 0
    for step in range(3000):
        now += rng.randrange(0, 3_000_000)
        if pending and rng.random() < 0.45:
            opq = pending.pop(rng.randrange(len(pending)))
            data, direction = response(opq, rng.choice([0, 0, 0, 1, 2, 17, 19, 25])), 1
        else:
            opq = rng.randrange(-(2**31), 2**31) if rng.random() < 0.1 else step
            code = rng.choice([310, 11, 34, 200050, 12345])
            data, direction = json_frame({"code": code, "flag": rng.choice([0, 0, 2]), "opaque": opq}), 0
            pending.append(opq)
        for _stats, _inflight, c2u, u2c in sides:
            (c2u if direction == 0 else u2c).scan(data, 0, len(data), now_ns=now)
    (ps, pi, *_), (cs, ci, *_) = sides
    assert len(pi) == len(ci)
    assert ps.latencies() == cs.latencies() and ps.results() == cs.results() and ps.untracked == cs.untracked
    assert pi.abandon(ps) == ci.abandon(cs)
    assert ps.results() == cs.results()


def test_inflight_table_against_a_dict():
    """The C open-addressing table (growth, backward-shift deletion) behaves like a dict."""
    if codec.InFlightC is None:
        pytest.skip("compiled extension not built")
    rng = random.Random(11)
    table = codec.InFlightC(5000)
    model: dict[tuple[int, int], tuple[int, int]] = {}
    keys: list[tuple[int, int]] = []
    for i in range(40000):
        if keys and rng.random() < 0.5:
            k = keys.pop(rng.randrange(len(keys))) if rng.random() < 0.9 else (rng.randrange(2), rng.randrange(100))
            assert table.take(*k) == model.pop(k, None)
        else:
            k = (rng.randrange(2), rng.randrange(-(2**31), 2**31) if rng.random() < 0.3 else rng.randrange(3000))
            ok = table.track(k[0], k[1], i % 2048, i)
            if len(model) < 5000 or k in model:
                assert ok
                if k not in model:
                    keys.append(k)
                model[k] = (i % 2048, i)
            else:
                assert not ok
        assert len(table) == len(model)
    for k in list(model):
        assert table.take(*k) == model.pop(k)
    assert len(table) == 0


def test_bad_arguments_are_refused(twin):
    Scanner, Stats, InFlight = twin.FrameScanner, twin.ScanStats, twin.InFlight
    with pytest.raises(ValueError, match="direction must be 0"):
        Scanner(Stats(), inflight=InFlight(), direction=2)
    with pytest.raises(ValueError, match="out of range"):
        Stats().observe(5000, 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        Stats().count_result(1, len(codec.RESULTS))


def test_sampled_requests_are_identical_in_both_twins():
    if codec.FrameScannerC is None:
        pytest.skip("compiled extension not built")
    rng = random.Random(5)
    sides = []
    for Scanner, Stats, InFlight in ((codec.FrameScannerPy, codec.ScanStatsPy, codec.InFlightPy),
                                     (codec.FrameScannerC, codec.ScanStatsC, codec.InFlightC)):
        stats = Stats()
        stats.set_sampling(3)
        inflight = InFlight()
        c2u, u2c = Scanner(stats, inflight=inflight, direction=0), Scanner(stats, inflight=inflight, direction=1)
        c2u.conn_id = u2c.conn_id = 42
        sides.append((stats, c2u, u2c))
    pending: list[int] = []
    now = 0
    for step in range(2000):
        now += rng.randrange(1, 2_000_000)
        if pending and rng.random() < 0.5:
            data, direction = response(pending.pop(rng.randrange(len(pending))), rng.choice([0, 2])), 1
        else:
            data, direction = send_v2(f"Topic{rng.randrange(4)}", opaque=step, body=b"b" * rng.randrange(50)), 0
            pending.append(step)
        for _stats, c2u, u2c in sides:
            (c2u if direction == 0 else u2c).scan(data, 0, len(data), now_ns=now)
    (ps, *_), (cs, *_) = sides
    py, c = ps.take_samples(), cs.take_samples()
    assert py == c and len(py) > 200
    t, lat, slot, resp_code, topic, conn, req_bytes, resp_bytes = py[0]
    assert slot == 310 and topic.startswith(b"Topic") and conn == 42 and req_bytes > 100 and resp_bytes > 20
    assert ps.take_samples() == cs.take_samples() == []  # taken: the ring is empty again


def test_sampling_ring_is_bounded(twin):
    Scanner, Stats, InFlight = twin.FrameScanner, twin.ScanStats, twin.InFlight
    stats = Stats()
    stats.set_sampling(1)
    inflight = InFlight()
    c2u, u2c = Scanner(stats, inflight=inflight, direction=0), Scanner(stats, inflight=inflight, direction=1)
    for i in range(8200):
        r = send_v2("T", opaque=i)
        c2u.scan(r, 0, len(r), now_ns=i)
        a = response(i)
        u2c.scan(a, 0, len(a), now_ns=i + 5)
    assert len(stats.take_samples()) == 8192 and stats.samples_dropped == 8
