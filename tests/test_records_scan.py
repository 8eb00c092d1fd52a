"""Store hosts of records answers mapped by the scanner (ext/records.pxi and its pure twin).

The walk of both twins is compared on the same inputs (generated store records with every
host layout, compressed and inner-batch bodies, V1 and V2 magic; the same bodies cut short and
with bytes changed; random bytes): the same status, record count and patched bytes, and the same
decision as the policy path's ``patch_store_hosts`` (a body it refuses is never patched here).
Then the scanner: a records request is tracked in C, its answer patched in place, and an answer
it cannot map (unknown address, malformed body, read-only buffer) goes to policy untouched.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmqfast import codec
from rmqfast.codec import _scan_py
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.codec.msgaddr import host_bytes, patch_store_hosts
from rmqfast.codec.store import (
    BORNHOST_V6_FLAG,
    COMPRESSED_FLAG,
    INNER_BATCH_FLAG,
    MAGIC_V1,
    MAGIC_V2,
    STOREHOST_V6_FLAG,
    StoreRecord,
    decode_records,
    encode_records,
)
from tests.test_scan import run
from tests.twins import all_twins


@pytest.fixture
def m(twin: Any) -> Any:
    """The module of each twin (the ``twin`` fixture of tests/conftest.py)."""
    return twin.module


CM = codec.compiled_twin()
needs_c = pytest.mark.skipif(CM is None, reason="compiled extension not built")

REAL = ("10.1.2.3", 10911)
OTHER = ("10.1.2.4", 10911)
UNKNOWN = ("10.9.9.9", 10911)
EP = ("127.0.0.1", 40001)
EP2 = ("127.0.0.1", 40002)


def hb(hp: tuple[str, int]) -> bytes:
    return host_bytes(*hp)


def fill(amap: Any) -> Any:
    amap.set(hb(REAL), hb(EP))
    amap.set(hb(OTHER), hb(EP2))
    amap.set(hb(EP), hb(EP))  # an endpoint already: left as it is
    return amap


def rec(i: int, store: tuple[str, int] | str = REAL, sys_flag: int = 0, born: str = "192.168.0.9:5555",
        magic: int = MAGIC_V1, body: bytes | None = None) -> StoreRecord:
    return StoreRecord(
        topic="T" * (200 if magic == MAGIC_V2 else 1), body=body if body is not None else f"body-{i}".encode() * 3,
        properties={"UNIQ_KEY": f"U{i:030d}"}, queue_id=i % 4, queue_offset=i, commit_log_offset=1000 + 97 * i,
        sys_flag=sys_flag, born_timestamp=1, born_host=born, store_timestamp=2,
        store_host=store if isinstance(store, str) else f"{store[0]}:{store[1]}", magic=magic)


LAYOUTS = [
    dict(),
    dict(sys_flag=BORNHOST_V6_FLAG, born="[::1]:5555"),
    dict(store="[fe80::1]:10911", sys_flag=STOREHOST_V6_FLAG),
    dict(store="[fe80::1]:10911", sys_flag=STOREHOST_V6_FLAG | BORNHOST_V6_FLAG, born="[::2]:1"),
    dict(sys_flag=COMPRESSED_FLAG, body=b"\x78\x9c" + bytes(range(40))),  # a compressed body: not read
    dict(sys_flag=INNER_BATCH_FLAG, body=b"\x00\x00\x00\x20" + b"\xda\xa3\x20\xab" + b"\x00" * 24),  # inner batch
    dict(magic=MAGIC_V2),
    dict(store=OTHER),
    dict(store=EP),
]


def walk_both(body: bytes, start: int = 0, end: int | None = None, known: bool = True) -> tuple[Any, bytes]:
    """Walk ``body`` with every twin (patching a copy each); assert they agree; return one result."""
    end = len(body) if end is None else end
    results = []
    for m in [t.module for t in all_twins()]:
        amap = fill(m.AddressMap()) if known else m.AddressMap()
        buf = bytearray(body)
        results.append((m.walk_store_hosts(buf, start, end, amap, True), bytes(buf)))
    assert all(r == results[0] for r in results), results
    return results[0]


def policy_path(body: bytes, start: int = 0) -> bytes | None:
    """What the filter's policy path makes of it (None: nothing changed); ValueError: relayed as it is."""
    m = fill(_scan_py.AddressMap())
    out, _ = patch_store_hosts(body, lambda raw: m.get(raw), start)
    return None if out is None else bytes(out)


def check_same_decision(body: bytes, start: int = 0) -> int:
    (status, seen, changed), patched = walk_both(body, start)
    try:
        want = policy_path(body, start)
    except ValueError:
        assert status != _scan_py.REC_OK  # never patched where the policy path refuses
        assert patched == body
        return status
    if status == _scan_py.REC_OK:
        assert patched == (want if want is not None else body) and changed == (want is not None)
    else:
        assert status == _scan_py.REC_MISS and patched == body
    return status


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_every_layout_is_patched_as_the_policy_path_does(layout: int) -> None:
    recs = [rec(0), rec(1, **LAYOUTS[layout]), rec(2, store=OTHER)]  # type: ignore[arg-type]
    body = encode_records(recs)
    (status, seen, changed), patched = walk_both(body)
    assert (status, seen, changed) == (_scan_py.REC_OK, 3, True)
    assert patched == policy_path(body)
    after = decode_records(patched)
    assert after[0].store_host == "127.0.0.1:40001" and after[2].store_host == "127.0.0.1:40002"
    v6 = recs[1].sys_flag & STOREHOST_V6_FLAG
    mapped = "127.0.0.1:40002" if recs[1].store_host == "10.1.2.4:10911" else "127.0.0.1:40001"
    assert after[1].store_host == (recs[1].store_host if v6 else mapped)  # IPv6 store hosts are left as they are
    for a, b in zip(recs, after, strict=True):
        assert (a.body, a.properties, a.born_host, a.sys_flag, a.queue_offset) == (
            b.body, b.properties, b.born_host, b.sys_flag, b.queue_offset)


def test_unknown_address_and_empty_body() -> None:
    body = encode_records([rec(0), rec(1, store=UNKNOWN), rec(2)])
    (status, seen, changed), patched = walk_both(body)
    assert (status, seen, changed) == (_scan_py.REC_MISS, 1, False) and patched == body  # nothing patched
    assert walk_both(b"")[0] == (_scan_py.REC_OK, 0, False)
    assert walk_both(body, known=False)[0][0] == _scan_py.REC_MISS
    # only endpoints already: walked, nothing changed
    assert walk_both(encode_records([rec(0, store=EP)]))[0] == (_scan_py.REC_OK, 1, False)


def test_cut_and_malformed_records_are_left_alone() -> None:
    body = encode_records([rec(0), rec(1, **LAYOUTS[1]), rec(2, magic=MAGIC_V2)])  # type: ignore[arg-type]
    ends = {len(encode_records([rec(0)])), len(encode_records([rec(0), rec(1, **LAYOUTS[1])]))}  # type: ignore[arg-type]
    for cut in range(1, len(body)):
        assert check_same_decision(body[:cut]) == (_scan_py.REC_OK if cut in ends else _scan_py.REC_BAD)
    # a bad magic code, a size too small, too large, negative
    second = len(encode_records([rec(0)]))
    for pos, value in [(second + 4, 0xCBD43194), (second, 90), (second, 10**6), (second, -5), (4, 0)]:
        bad = bytearray(body)
        bad[pos : pos + 4] = struct.pack(">I", value & 0xFFFFFFFF)
        assert check_same_decision(bytes(bad)) == _scan_py.REC_BAD


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts=st.lists(st.integers(0, len(LAYOUTS) - 1), min_size=1, max_size=6),
       unknown=st.booleans(), edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       cut=st.integers(0, 40), start=st.integers(0, 12))
def test_twins_and_policy_path_agree_on_generated_bodies(layouts: list[int], unknown: bool,
                                                         edits: list[tuple[int, int]], cut: int,
                                                         start: int) -> None:
    recs = [rec(i, **LAYOUTS[k]) for i, k in enumerate(layouts)]  # type: ignore[arg-type]
    if unknown:
        recs.append(rec(99, store=UNKNOWN))
    body = bytearray(b"H" * start + encode_records(recs))
    for pos, value in edits:
        body[pos % len(body)] = value
    check_same_decision(bytes(body[: len(body) - cut]), start)


@pytest.mark.parametrize("seed", range(5))
def test_twins_agree_on_random_bytes(seed: int) -> None:
    r = random.Random(seed)
    for _ in range(300):
        n = r.choice([0, 1, 50, 91, 92, 200, 400])
        data = bytearray(r.randbytes(n))
        if n >= 8 and r.random() < 0.7:  # plausible heads get further into the walk
            data[0:8] = struct.pack(">iI", r.choice([91, 100, n, n + 1]), MAGIC_V1)
        check_same_decision(bytes(data))


def test_address_map(m: Any) -> None:
    amap = m.AddressMap()
    assert len(amap) == 0 and amap.get(hb(REAL)) is None
    assert amap.set(hb(REAL), hb(EP)) and amap.get(hb(REAL)) == hb(EP) and len(amap) == 1
    assert amap.set(hb(REAL), hb(EP2)) and amap.get(hb(REAL)) == hb(EP2) and len(amap) == 1
    with pytest.raises(ValueError, match="8 bytes"):
        amap.set(b"1234567", hb(EP))
    with pytest.raises(TypeError):
        amap.set("12345678", hb(EP))
    for i in range(1, m.MAX_ADDRESSES):
        assert amap.set(struct.pack(">II", i, 7), hb(EP))
    assert len(amap) == m.MAX_ADDRESSES
    assert not amap.set(hb(OTHER), hb(EP)) and amap.get(hb(OTHER)) is None  # full: stays unknown
    assert amap.set(hb(REAL), hb(EP))  # known ones can still change
    with pytest.raises(BufferError):
        m.walk_store_hosts(b"", 0, 0, amap, True)  # patching needs a writable buffer
    with pytest.raises(ValueError, match="outside"):
        m.walk_store_hosts(bytearray(4), 0, 5, amap)


# The scanner -----------------------------------------------------------------------------------


def records_actions() -> bytes:
    table = bytearray(codec.CODE_SLOTS)
    for code in (C.PULL_MESSAGE, C.POP_MESSAGE, C.QUERY_MESSAGE):
        table[_scan_py.code_slot(code)] = _scan_py.ACTION_RECORDS
    return bytes(table)


def scanners(m: Any, amap: Any = None) -> tuple[Any, Any, Any]:
    stats, inflight = m.ScanStats(), m.InFlight()
    c2u = m.FrameScanner(stats, actions=records_actions(), inflight=inflight, direction=0)
    u2c = m.FrameScanner(stats, inflight=inflight, direction=1)
    u2c.address_map = fill(m.AddressMap()) if amap is None else amap
    return c2u, u2c, inflight


def pull(opaque: int, code: int = C.PULL_MESSAGE, flag: int = 0, stype: int = 0) -> bytes:
    return encode(RemotingCommand(code=code, opaque=opaque, flag=flag, version=401, serialize_type=stype,
                                  ext_fields={"topic": "T", "queueId": "0", "consumerGroup": "G"}))


def answer(opaque: int, body: bytes, code: int = C.SUCCESS, stype: int = 0) -> bytes:
    return encode(RemotingCommand(code=code, opaque=opaque, flag=1, serialize_type=stype,
                                  ext_fields={"nextBeginOffset": "3", "minOffset": "0"}, body=body))


def hosts(frame: bytes) -> list[str]:
    return [r.store_host for r in decode_records(decode_frame(frame).body)]


@pytest.mark.parametrize("chunk", [None, 1, 13, 700])
@pytest.mark.parametrize("stype", [0, 1])
def test_scanner_maps_the_answers_of_records_requests(m: Any, chunk: int | None, stype: int) -> None:
    c2u, u2c, inflight = scanners(m)
    second = C.POP_MESSAGE if stype == 0 else C.QUERY_MESSAGE  # binary headers: int16 codes
    reqs = pull(1, stype=stype) + pull(2, second, stype=stype) + pull(3, flag=2, stype=stype)
    events, fwd, rest = run(c2u, reqs, chunk)
    assert (events, fwd, rest) == ([], reqs, b"")  # relayed without policy
    assert (inflight.want_of(0, 1), inflight.want_of(0, 2), inflight.want_of(0, 3)) == (2, 2, -1)  # oneway: none
    body = encode_records([rec(0), rec(1, store=OTHER), rec(2, **LAYOUTS[2])])  # type: ignore[arg-type]
    answers = answer(2, body, stype=stype) + answer(1, body, stype=stype) + answer(7, body, stype=stype)
    events, fwd, rest = run(u2c, answers, chunk)
    assert events == [] and rest == b"" and len(fwd) == len(answers)
    n = len(answer(1, body, stype=stype))
    expect = ["127.0.0.1:40001", "127.0.0.1:40002", "[fe80::1]:10911"]
    assert hosts(fwd[:n]) == expect and hosts(fwd[n : 2 * n]) == expect
    assert fwd[2 * n :] == answers[2 * n :]  # an answer to no records request: untouched
    assert len(inflight) == 0 and inflight.nwant == 0
    assert (u2c.address_map.walked, u2c.address_map.rewritten) == (2, 2)
    assert u2c.stats.latencies()  # timed like every other request


@pytest.mark.parametrize("chunk", [None, 5])
def test_answers_the_scanner_cannot_map_go_to_policy_untouched(m: Any, chunk: int | None) -> None:
    c2u, u2c, inflight = scanners(m)
    good = encode_records([rec(0)])
    cases = [
        encode_records([rec(0), rec(1, store=UNKNOWN)]),  # an address the map does not know yet
        good[:-1],  # cut short
        good + b"\x00" * 95,  # trailing bytes that are not a record
    ]
    run(c2u, b"".join(pull(10 + i) for i in range(len(cases) + 2)), chunk)
    stream = b"".join(answer(10 + i, body) for i, body in enumerate(cases))
    stream += answer(13, good, code=C.PULL_NOT_FOUND) + answer(14, b"")  # not SUCCESS / no body: relayed
    events, fwd, rest = run(u2c, stream, chunk)
    assert [e[0] for e in events] == ["policy"] * 3
    assert [e[1] for e in events] == [answer(10 + i, body) for i, body in enumerate(cases)]  # untouched
    assert fwd == stream and rest == b""
    assert u2c.records == 1
    assert u2c.address_map.walked == 0
    # read-only buffers: nothing can be patched, so the answer goes to policy
    run(c2u, pull(20), None)
    ev, a, b = u2c.scan(answer(20, good), 0, len(answer(20, good)))
    assert (ev, a, b, u2c.records) == (codec.EV_POLICY, 0, len(answer(20, good)), 1)
    # without a map: policy, records set
    u2c.address_map = None
    run(c2u, pull(21), None)
    assert run(u2c, answer(21, good), None)[0][0][0] == "policy" and u2c.records == 1


def test_opaque_reuse_and_full_table_close_the_connection(m: Any) -> None:
    c2u, u2c, inflight = scanners(m)
    events, fwd, *_ = run(c2u, pull(5) + pull(5), None)
    assert events == [("error", "request 11 reuses opaque 5 while a request with it is unanswered (its answer "
                                "could not be told apart and its broker addresses rewritten)")]
    assert fwd == pull(5)
    c2u, u2c, inflight = scanners(m)
    events, *_ = run(c2u, pull(5) + send(5), None)  # another request on that opaque would take its answer
    assert events[0][0] == "error" and "whose answer's broker addresses are rewritten" in events[0][1]
    c2u, u2c, inflight = scanners(m)
    events, *_ = run(c2u, send(5) + pull(5), None)  # and the other way round
    assert events[0][0] == "error" and "reuses opaque 5" in events[0][1]
    stats, small = m.ScanStats(), m.InFlight(2)
    c2u = m.FrameScanner(stats, actions=records_actions(), inflight=small)
    events, *_ = run(c2u, pull(1) + pull(2) + pull(3), None)
    assert events == [("error", "more than 2 requests unanswered on one connection (the answers' broker "
                                "addresses could not be rewritten)")]
    # without an in-flight table the scanner cannot track them: policy
    c2u = m.FrameScanner(m.ScanStats(), actions=records_actions())
    assert [e[0] for e in run(c2u, pull(1), None)[0]] == ["policy"]


def send(opaque: int) -> bytes:
    return encode(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=opaque, version=401,
                                  ext_fields={"a": "G", "b": "T"}, body=b"x"))


@needs_c
@pytest.mark.parametrize("seed", range(3))
def test_scanner_twins_agree_on_mixed_streams(seed: int) -> None:
    r = random.Random(seed)
    body_ok = encode_records([rec(0), rec(1, store=OTHER)])
    bodies = [body_ok, encode_records([rec(0, store=UNKNOWN)]), body_ok[:-3], b"", encode_records([rec(0)]) * 3]
    reqs = b"".join(r.choice([pull(i), pull(i, C.POP_MESSAGE), send(i)]) for i in range(40))
    answers = b"".join(answer(i, r.choice(bodies), code=r.choice([0, 0, 0, 19])) for i in r.sample(range(45), 45))
    chunk = [None, 3, 100][seed]
    out = []
    for m in (_scan_py, CM):
        c2u, u2c, _ = scanners(m)
        out.append((run(c2u, reqs, chunk), run(u2c, answers, chunk), u2c.address_map.walked,
                    u2c.address_map.rewritten))
    assert out[0] == out[1]
    assert out[0][2] > 0  # some answers were mapped in the scanner


# Through the relay (both pumps, both scanners) -------------------------------------------------


class PullBroker:
    """Answers every PULL_MESSAGE with ``body`` (SUCCESS), everything else with SUCCESS alone."""

    def __init__(self, body: bytes) -> None:
        from gevent.server import StreamServer

        self.body = body
        self.server = StreamServer(("127.0.0.1", 0), self.handle)
        self.server.start()

    def handle(self, sock: Any, _addr: Any) -> None:
        from rmqfast.codec.command import make_response
        from rmqfast.testing.wire import read_frame

        while (data := read_frame(sock)) is not None:
            cmd = decode_frame(data)
            body = self.body if cmd.code == C.PULL_MESSAGE else b""
            sock.sendall(encode(make_response(cmd, C.SUCCESS, ext_fields={"nextBeginOffset": "2"}, body=body)))


class Registry:
    advertise_host = "127.0.0.1"

    def advertised(self, real: str) -> str | None:
        return "127.0.0.1:40001" if real == "10.1.2.3:10911" else None

    def is_proxy_address(self, addr: str) -> bool:
        return addr == "127.0.0.1:40001"


@pytest.fixture
def relay_impl(relay_twin: Any, monkeypatch: Any) -> Any:
    from rmqfast.proxy import relay

    monkeypatch.setattr(relay, "FrameScanner", relay_twin.FrameScanner)
    if not relay_twin.pump:
        monkeypatch.setattr(relay, "Pump", None)
    return relay_twin.FrameScanner, relay_twin.ScanStats, relay_twin.pump


def test_relay_maps_store_hosts_in_the_scanner_after_the_first_answer(relay_impl: Any) -> None:
    import gevent
    from gevent import socket
    from gevent.server import StreamServer

    from rmqfast.config import HostPort
    from rmqfast.filters.addresses import RewriteMessageAddresses
    from rmqfast.filters.api import FilterChain
    from rmqfast.filters.deny import DenyAdminCodes
    from rmqfast.proxy.relay import RelaySettings, Session
    from rmqfast.testing.wire import read_frame
    from tests.test_relay import Events

    _Scanner, Stats, _c_pump = relay_impl
    body = encode_records([rec(i) for i in range(4)] + [rec(9, store=UNKNOWN)])
    broker = PullBroker(body)
    f = RewriteMessageAddresses(Registry(), "records")  # type: ignore[arg-type]
    chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES), f])
    assert chain.request_actions[C.PULL_MESSAGE] == _scan_py.ACTION_RECORDS
    stats = Stats()
    settings = RelaySettings(4096, 16 << 20, 1 << 16, 1.0, 30.0)  # answers larger than the buffer

    def handle(sock: Any, addr: Any) -> None:
        Session("broker", sock, f"{addr[0]}:{addr[1]}", [HostPort("127.0.0.1", broker.server.server_port)], chain,
                stats, settings, Events()).run()

    server = StreamServer(("127.0.0.1", 0), handle)
    server.start()
    try:
        s = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
        want = ["127.0.0.1:40001"] * 4 + ["10.9.9.9:10911"]  # no endpoint for the last: left as is
        with gevent.Timeout(10):
            s.sendall(pull(1))
            first = decode_frame(read_frame(s))
            assert [r.store_host for r in decode_records(first.body)] == want
            assert f.rewritten == 1  # the first answer: through the filter, which fills the map
            s.sendall(b"".join(pull(i) for i in range(2, 12)) + send(50))
            got = [decode_frame(read_frame(s)) for _ in range(11)]
        assert [c.opaque for c in got] == [*range(2, 12), 50]
        for c in got[:10]:
            assert [r.store_host for r in decode_records(c.body)] == want
            assert c.body[:60] == body[:60] and len(c.body) == len(body)
        amaps = list(f._amaps.values())
        assert len(amaps) == 1 and amaps[0].walked == 10 and amaps[0].rewritten == 10  # in the scanner
        assert f.rewritten == 11
        s.close()
    finally:
        server.stop(timeout=1)
        broker.server.stop(timeout=1)


def test_filter_maps_what_the_scanner_left_and_fills_its_maps() -> None:
    from rmqfast.filters.addresses import RewriteMessageAddresses
    from rmqfast.filters.api import Filter, FilterChain, Frame, Kind, slots_of

    f = RewriteMessageAddresses(Registry(), "records")  # type: ignore[arg-type]
    amap = f.address_map(False)
    assert isinstance(amap, _scan_py.AddressMap) and len(amap) == 0
    assert C.PULL_MESSAGE not in {_scan_py.slot_code(s) for s in f.request_slots()}
    assert _scan_py.code_slot(C.PULL_MESSAGE) in f.record_slots()

    class Session:
        role, client_addr, upstream_addr = "broker", "c", "u"

        def __init__(self) -> None:
            self.state: dict[str, Any] = {}

    body = encode_records([rec(0), rec(1, store=UNKNOWN)])
    data = answer(3, body)
    assert f.on_response(Session(), Frame(data, 0, 1, 3)) is None  # neither pending nor left by the scanner
    v = f.on_response(Session(), Frame(data, 0, 1, 3, records=1))
    assert v is not None and v.kind is Kind.REWRITE
    assert hosts(v.data) == ["127.0.0.1:40001", "10.9.9.9:10911"]
    assert amap.get(hb(REAL)) == hb(EP) and amap.get(hb(UNKNOWN)) == hb(UNKNOWN)  # asked once: left as is
    assert f.address_map(False) is amap
    # now the scanner knows every address: it maps the next answer itself
    buf = bytearray(body)
    assert _scan_py.walk_store_hosts(buf, 0, len(buf), amap, True) == (_scan_py.REC_OK, 2, True)
    if CM is not None:
        assert f.address_map(True).get(hb(REAL)) == hb(EP)  # made later: filled with what is known

    class Reader(Filter):  # another filter that reads pulls in Python: the policy path wins
        def request_slots(self) -> set[int]:
            return slots_of([C.PULL_MESSAGE])

    chain = FilterChain([f])
    assert chain.request_actions[_scan_py.code_slot(C.POP_MESSAGE)] == _scan_py.ACTION_RECORDS
    assert chain.address_map(False) is amap
    both = FilterChain([Reader(), f])
    assert both.request_actions[C.PULL_MESSAGE] == codec.ACTION_POLICY
    assert both.request_actions[C.QUERY_MESSAGE] == _scan_py.ACTION_RECORDS
    s = Session()
    req = Frame(pull(4), C.PULL_MESSAGE, 0, 4)
    assert both.on_request(s, req).kind is Kind.PASS and req.want_response  # marked: its answer comes to Python
    off = RewriteMessageAddresses(Registry(), "off")  # type: ignore[arg-type]
    assert off.record_slots() == set() and off.address_map(False) is None
