"""Offset ids of send answers mapped by the scanner (ext/records.pxi ``map_header_ids`` and its pure
twin): the ``msgId`` header field of a SendResult names the proxy endpoint, in C, by default.

Both twins are compared on the same headers (JSON and ROCKETMQ, one id and a batch's list, ids
that are not offset ids, a field twice or escaped, random bytes) and against the policy path's
``patch_offset_ids``; then the scanner: a send is tracked in C, its answer patched in place, and
an answer it cannot map goes to policy untouched, where the filter maps it and fills the map.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rmqfast import codec
from rmqfast.codec import _scan_py
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.codec.msgaddr import header_field_span, host_bytes, patch_offset_ids
from rmqfast.filters.addresses import RewriteMessageAddresses
from rmqfast.filters.api import Frame, Kind
from tests.test_scan import run

CM = codec.compiled_twin()
TWINS = [pytest.param(_scan_py, id="py")] + ([pytest.param(CM, id="c")] if CM is not None else [])
needs_c = pytest.mark.skipif(CM is None, reason="compiled extension not built")

REAL = ("10.1.2.3", 10911)
UNKNOWN = ("10.9.9.9", 10911)
EP = ("127.0.0.1", 40001)


def hb(hp: tuple[str, int]) -> bytes:
    return host_bytes(*hp)


def mid(hp: tuple[str, int], offset: int = 0x12AB, lower: bool = False) -> str:
    text = hb(hp).hex().upper() + f"{offset:016X}"
    return text.lower() if lower else text


def fill(amap: Any) -> Any:
    amap.set(hb(REAL), hb(EP))
    amap.set(hb(EP), hb(EP))
    return amap


def sent(opaque: int, msg_id: str | None, code: int = C.SUCCESS, stype: int = 0, **extra: str) -> bytes:
    fields = {"queueId": "1", "queueOffset": "7", **extra}
    if msg_id is not None:
        fields["msgId"] = msg_id
    return encode(RemotingCommand(code=code, opaque=opaque, flag=1, serialize_type=stype, ext_fields=fields))


def header_range(frame: bytes | bytearray) -> tuple[int, int, int]:
    mark = int.from_bytes(frame[4:8], "big")
    return 8, 8 + (mark & 0xFFFFFF), mark >> 24


def map_both(frame: bytes, known: bool = True) -> tuple[int, bytes, int, int]:
    """Map ``frame``'s header with every twin (a copy each); assert they agree; return one result."""
    results = []
    for m in [_scan_py] + ([CM] if CM is not None else []):
        amap = fill(m.AddressMap()) if known else m.AddressMap()
        buf = bytearray(frame)
        s, e, stype = header_range(buf)
        status = m.map_send_ids(buf, s, e, stype, amap)
        results.append((status, bytes(buf), amap.walked, amap.rewritten))
    assert all(r == results[0] for r in results), results
    return results[0]


def msg_id_of(frame: bytes) -> str:
    fields = decode_frame(frame).ext_fields
    assert fields is not None
    return fields["msgId"]


@pytest.mark.parametrize("stype", [0, 1])
def test_one_id_and_a_batch_list_mapped_like_the_policy_path(stype: int) -> None:
    batch = ",".join([mid(REAL, 1), mid(REAL, 2, lower=True), "UNIQ0000KEY", mid(EP, 3)])
    for value in (mid(REAL), batch):
        frame = sent(3, value, stype=stype)
        status, out, walked, rewritten = map_both(frame)
        assert (status, walked, rewritten) == (_scan_py.REC_OK, 1, 1)
        assert len(out) == len(frame)
        expect = patch_offset_ids(value, {hb(REAL): hb(EP)}.get)
        assert msg_id_of(out) == expect
        fields = decode_frame(out).ext_fields
        assert fields is not None and fields["queueOffset"] == "7"  # the rest as the broker wrote it
    ids = msg_id_of(map_both(sent(3, batch, stype=stype))[1]).split(",")
    assert ids[0] == mid(EP, 1) and ids[1] == mid(EP, 2)  # upper case, as createMessageId writes
    assert ids[2] == "UNIQ0000KEY" and ids[3] == mid(EP, 3)  # not an offset id; an endpoint: left


@pytest.mark.parametrize("stype", [0, 1])
def test_unknown_address_duplicate_or_escaped_field_are_not_patched(stype: int) -> None:
    frame = sent(3, mid(UNKNOWN), stype=stype)
    assert map_both(frame)[:3] == (_scan_py.REC_MISS, frame, 0)
    frame = sent(3, mid(REAL), stype=stype)
    assert map_both(frame, known=False)[:2] == (_scan_py.REC_MISS, frame)
    nothing = sent(3, None, stype=stype)
    assert map_both(nothing) == (_scan_py.REC_OK, nothing, 0, 0)  # no msgId: nothing to do
    # JSON: the structural "msgId":" twice is not walked (fastjson keeps the last, a first-match patch
    # would leave it)
    one = sent(3, mid(REAL), stype=0)
    s, e, _ = header_range(one)
    header = one[s:e].replace(b'"queueId":"1"', b'"msgId":"' + mid(REAL).encode() + b'"')
    assert header.count(b'"msgId":"') == 2
    twice = (4 + len(header)).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header
    assert map_both(twice)[:2] == (_scan_py.REC_BAD, twice)
    escaped = sent(3, mid(REAL)[:10] + '"' + mid(REAL)[11:])
    assert map_both(escaped)[:2] == (_scan_py.REC_BAD, escaped)


def test_binary_field_twice_goes_to_policy() -> None:
    # two msgId fields in a ROCKETMQ header: the client keeps the last, the policy path finds the first
    one = sent(3, mid(REAL), stype=1)
    s, e, _ = header_range(one)
    field = b"\x00\x05msgId" + len(mid(REAL)).to_bytes(4, "big") + mid(REAL).encode()
    header = one[s:e] + field
    frame = (4 + len(header)).to_bytes(4, "big") + ((1 << 24) | len(header)).to_bytes(4, "big") + header
    assert map_both(frame)[:2] == (_scan_py.REC_BAD, frame)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=200), st.sampled_from([0, 1]))
def test_twins_agree_on_random_headers(data: bytes, stype: int) -> None:
    buf = bytearray(data)
    results = []
    for m in [_scan_py] + ([CM] if CM is not None else []):
        b = bytearray(buf)
        results.append((m.map_send_ids(b, 0, len(b), stype, fill(m.AddressMap())), bytes(b)))
    assert all(r == results[0] for r in results)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(['"msgId":"', '"msgId"', "msgId", '"', ":", ",", "\\", "I", "0A0B0C0D",
                                 hb(REAL).hex().upper(), "00000000000012AB", "x"]), max_size=12))
def test_twins_agree_on_headers_made_of_the_key_s_pieces(pieces: list[str]) -> None:
    """The JSON search (memchr for the 'I', then the 9 bytes) against the twin's bytes.find."""
    data = "".join(pieces).encode()
    results = []
    for m in [_scan_py] + ([CM] if CM is not None else []):
        b = bytearray(data)
        results.append((m.map_send_ids(b, 0, len(b), 0, fill(m.AddressMap())), bytes(b)))
    assert all(r == results[0] for r in results), (data, results)


@settings(max_examples=100, deadline=None)
@example(["0" * 31, ""], 0)  # 32 characters with a comma: two tokens, no id (the one-id fast path must see it)
@example([mid(REAL)[:20], mid(REAL)[:11]], 1)
@given(st.lists(st.sampled_from([mid(REAL), mid(REAL, lower=True), mid(EP), "X" * 32, "", "0" * 31]),
                min_size=1, max_size=5), st.sampled_from([0, 1]))
def test_twins_and_policy_path_agree_on_id_lists(ids: list[str], stype: int) -> None:
    value = ",".join(ids)
    frame = sent(9, value, stype=stype)
    status, out, _, rewritten = map_both(frame)
    assert status == _scan_py.REC_OK
    expect = patch_offset_ids(value, {hb(REAL): hb(EP)}.get)
    assert msg_id_of(out) == (value if expect is None else expect)
    assert rewritten == (expect is not None)


def test_argument_checks() -> None:
    for m in [_scan_py] + ([CM] if CM is not None else []):
        amap = m.AddressMap()
        with pytest.raises(ValueError, match="outside"):
            m.map_send_ids(bytearray(4), 0, 5, 0, amap)
        with pytest.raises(ValueError, match="serialize type"):
            m.map_send_ids(bytearray(4), 0, 4, 2, amap)
        with pytest.raises(BufferError):
            m.map_send_ids(b"abcd", 0, 4, 0, amap)


# The scanner -----------------------------------------------------------------------------------


def send_actions() -> bytes:
    table = bytearray(codec.CODE_SLOTS)
    for code in (C.SEND_MESSAGE, C.SEND_MESSAGE_V2, C.SEND_BATCH_MESSAGE, C.PULL_MESSAGE):
        table[_scan_py.code_slot(code)] = _scan_py.ACTION_RECORDS
    return bytes(table)


def scanners(m: Any, amap: Any = None) -> tuple[Any, Any, Any]:
    stats, inflight = m.ScanStats(), m.InFlight()
    c2u = m.FrameScanner(stats, actions=send_actions(), inflight=inflight, direction=0)
    u2c = m.FrameScanner(stats, inflight=inflight, direction=1)
    u2c.address_map = fill(m.AddressMap()) if amap is None else amap
    return c2u, u2c, inflight


def send(opaque: int, code: int = C.SEND_MESSAGE_V2, flag: int = 0, stype: int = 0) -> bytes:
    return encode(RemotingCommand(code=code, opaque=opaque, flag=flag, version=401, serialize_type=stype,
                                  ext_fields={"a": "G", "b": "T", "e": "0"}, body=b"x" * 20))


@pytest.mark.parametrize("m", TWINS)
@pytest.mark.parametrize("chunk", [None, 1, 17])
@pytest.mark.parametrize("stype", [0, 1])
def test_scanner_maps_send_answers_in_place(m: Any, chunk: int | None, stype: int) -> None:
    c2u, u2c, inflight = scanners(m)
    reqs = b"".join(send(i, stype=stype) for i in range(1, 6)) + send(6, flag=2, stype=stype)
    events, fwd, rest = run(c2u, reqs, chunk)
    assert (events, fwd, rest) == ([], reqs, b"")  # relayed without policy
    assert [inflight.want_of(0, i) for i in range(1, 7)] == [2, 2, 2, 2, 2, -1]  # oneway: not tracked
    # stored (SUCCESS, FLUSH_DISK_TIMEOUT, SLAVE_NOT_AVAILABLE, FLUSH_SLAVE_TIMEOUT) and refused (SYSTEM_BUSY)
    answers = [sent(1, mid(REAL), stype=stype), sent(2, mid(REAL), code=10, stype=stype),
               sent(3, mid(REAL), code=11, stype=stype), sent(4, mid(REAL), code=12, stype=stype),
               sent(5, mid(REAL), code=C.SYSTEM_BUSY, stype=stype), sent(7, mid(REAL), stype=stype)]
    events, fwd, rest = run(u2c, b"".join(answers), chunk)
    assert events == [] and rest == b"" and len(fwd) == sum(map(len, answers))
    pos = 0
    got = []
    for a in answers:
        got.append(msg_id_of(fwd[pos : pos + len(a)]))
        pos += len(a)
    assert got[:4] == [mid(EP)] * 4
    assert got[4] == mid(REAL)  # not stored: the broker's answer untouched
    assert got[5] == mid(REAL)  # an answer to no tracked send: untouched
    assert len(inflight) == 0 and inflight.nwant == 0
    assert (u2c.address_map.walked, u2c.address_map.rewritten) == (4, 4)


@pytest.mark.parametrize("m", TWINS)
def test_send_answers_the_scanner_cannot_map_go_to_policy_untouched(m: Any) -> None:
    c2u, u2c, _ = scanners(m)
    run(c2u, send(1) + send(2), None)
    unknown, escaped = sent(1, mid(UNKNOWN)), sent(2, mid(REAL)[:5] + '"' + mid(REAL)[6:])
    events, fwd, _ = run(u2c, unknown + escaped, None)
    assert [(e[0], e[1]) for e in events] == [("policy", unknown), ("policy", escaped)]
    assert u2c.records == 1 and u2c.address_map.walked == 0
    run(c2u, send(3), None)  # a read-only buffer cannot be patched: policy
    frame = sent(3, mid(REAL))
    assert u2c.scan(frame, 0, len(frame))[0] == codec.EV_POLICY and u2c.records == 1


class FakeRegistry:
    advertise_host = "127.0.0.1"

    def advertised(self, real: str) -> str | None:
        return {"10.1.2.3:10911": "127.0.0.1:40001", "10.9.9.9:10911": "127.0.0.1:40009"}.get(real)

    def is_proxy_address(self, addr: str) -> bool:
        return addr.startswith("127.0.0.1:")


@pytest.mark.parametrize("twin", ["py"] + (["c"] if CM is not None else []))
def test_filter_maps_what_the_scanner_left_and_the_scanner_then_maps_it(twin: str) -> None:
    """The first answer naming a broker goes to the filter (frame.records, no body: a send answer),
    which maps it and fills the map; the scanner maps the next answers of that broker in C."""
    f = RewriteMessageAddresses(FakeRegistry(), "all")  # type: ignore[arg-type]
    assert f.request_slots() == set()  # sends are not handed to Python for their answers
    assert _scan_py.code_slot(C.SEND_MESSAGE_V2) in f.record_slots()
    m = CM if twin == "c" else _scan_py
    amap = f.address_map(twin == "c")
    c2u, u2c, _ = scanners(m, amap)
    run(c2u, send(1) + send(2), None)
    first = sent(1, mid(UNKNOWN))
    events, _, _ = run(u2c, first, None)
    assert events[0][0] == "policy" and u2c.records == 1
    frame = Frame(first, 0, 1, 1, records=1)
    session = SimpleNamespace(state={}, upstream_addr="u", client_addr="c", role="broker")
    v = f.on_response(session, frame)  # type: ignore[arg-type]
    assert v is not None and v.kind is Kind.REWRITE
    assert msg_id_of(v.data) == hb(("127.0.0.1", 40009)).hex().upper() + mid(UNKNOWN)[16:]
    events, fwd, _ = run(u2c, sent(2, mid(UNKNOWN)), None)  # known now: mapped in C
    assert events == [] and msg_id_of(fwd) == msg_id_of(v.data)
    # a send answer refused with SYSTEM_BUSY is left; FLUSH_DISK_TIMEOUT (stored) is mapped
    assert f.on_response(session, Frame(sent(4, mid(REAL), code=C.SYSTEM_BUSY), 2, 1, 4, records=1)) is None  # type: ignore[arg-type]
    v = f.on_response(session, Frame(sent(5, mid(REAL), code=10), 10, 1, 5, records=1))  # type: ignore[arg-type]
    assert v is not None and msg_id_of(v.data) == mid(EP)


def test_header_field_span_agrees_with_the_scanner_walk() -> None:
    for stype in (0, 1):
        frame = sent(3, mid(REAL), stype=stype)
        span = header_field_span(frame, "msgId")
        assert span is not None and frame[span[0] : span[1]].decode() == mid(REAL)


def test_map_offset_ids_for_answers_that_skip_the_scanner() -> None:
    """What the failover service uses for moved sends' answers: only with send answers mapped."""
    value = mid(REAL) + "," + mid(REAL, 9)
    f = RewriteMessageAddresses(FakeRegistry(), "all")  # type: ignore[arg-type]
    assert f.map_offset_ids(value) == mid(EP) + "," + mid(EP, 9)
    assert f.map_offset_ids("UNIQ") is None
    assert RewriteMessageAddresses(FakeRegistry(), "records").map_offset_ids(value) is None  # type: ignore[arg-type]
    assert RewriteMessageAddresses(FakeRegistry(), "off").map_offset_ids(value) is None  # type: ignore[arg-type]


@pytest.mark.usefixtures("in_process_metrics")
def test_the_worker_wires_the_default(tmp_path: Any) -> None:
    """A worker with default settings: send codes tracked in C for their answers (ACTION_RECORDS), the
    scanners' map from the message-address filter, moved sends' answers mapped by the same filter."""
    from rmqfast import config as config_mod
    from rmqfast.server.worker import Worker

    cfg = config_mod.from_dict({"namesrv": {"listen": "127.0.0.1:1", "upstreams": ["127.0.0.1:2"]},
                                "proxy": {"state_dir": str(tmp_path)}})
    w = Worker(cfg, 0, lambda status: None)
    chain = w.chains["broker"]
    for code in (C.SEND_MESSAGE, C.SEND_MESSAGE_V2, C.SEND_BATCH_MESSAGE, C.PULL_MESSAGE):
        assert chain.request_actions[_scan_py.code_slot(code)] == _scan_py.ACTION_RECORDS, code
    assert chain.address_map(CM is not None) is not None
    assert w.failover.offset_ids == w.message_addresses.map_offset_ids
