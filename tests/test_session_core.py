"""The session's decisions without sockets (rmqfast.proxy.core.SessionCore).

A core is driven with frames (built here, or cut by the pure-Python scanner with its limiter)
and writers that record what is written where: the filter chain, the verdicts, the answers
the proxy makes itself (written at once at a frame boundary, queued otherwise, flushed in
order at the next boundary), request tracking and the in-flight count a drain waits for.
The pumps and sockets around it are tested in tests/test_relay.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rmqfast import codec
from rmqfast.codec import code_slot
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response
from rmqfast.filters.api import Filter, FilterChain, Frame, Kind, Verdict, close, divert, rewrite
from rmqfast.filters.deny import DenyAdminCodes
from rmqfast.filters.limits import SendLimitFilter
from rmqfast.limits import create_shared, parse_limits
from rmqfast.limits.worker import WorkerLimits
from rmqfast.proxy.core import PumpState, SessionCore, Writer
from tests.twins import Twin


class RecordingWriter(Writer):
    """Appends every write to a log shared by both writers: (destination, frame bytes)."""

    __slots__ = ("name", "log")

    def __init__(self, name: str, log: list[tuple[str, bytes]]) -> None:
        super().__init__()
        self.name = name
        self.log = log

    def write(self, data: object) -> None:
        self.log.append((self.name, bytes(data)))  # type: ignore[call-overload]


def send(opaque: int, topic: str = "T", flag: int = 0) -> bytes:
    return encode(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=opaque, flag=flag, version=401, ext_fields={
        "a": "PG", "b": topic, "e": "0", "i": "TAGS\u0001A\u0002UNIQ_KEY\u0001U1\u0002"}, body=b"m" * 32))


def admin(opaque: int, flag: int = 0) -> bytes:
    return encode(RemotingCommand(code=C.UPDATE_BROKER_CONFIG, opaque=opaque, flag=flag, body=b"x=1"))


def answer(opaque: int, code: int = C.SUCCESS) -> bytes:
    return encode(make_response(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=opaque), code))


def frame_of(data: bytes, limited: int = -1) -> Frame:
    cmd = decode_frame(data)
    return Frame(data, cmd.code, cmd.flag, cmd.opaque, limited)


def result_count(stats, code: int, result: str) -> int:
    return sum(n for slot, r, n in stats.results() if slot == code_slot(code) and codec.RESULTS[r] == result)


class Harness:
    def __init__(self, filters: list[Filter]) -> None:
        self.log: list[tuple[str, bytes]] = []
        self.stats = codec.ScanStatsPy()
        self.core = SessionCore("broker", "10.0.0.1:5000", FilterChain(filters), self.stats)
        self.core.inflight = codec.InFlightPy()
        self.core.c2u = SimpleNamespace(requests=0)  # the scanners' request / response counts
        self.core.u2c = SimpleNamespace(responses=0)
        self.client = self.core.to_client = RecordingWriter("client", self.log)
        self.upstream = self.core.to_upstream = RecordingWriter("upstream", self.log)

    def request(self, data: bytes, limited: int = -1) -> bool:
        """A client request the scanner handed over (counted as the scanner counts it)."""
        f = frame_of(data, limited)
        if not f.is_oneway:
            self.core.c2u.requests += 1
        return self.core.policy(self.upstream, f, from_client=True)

    def response(self, data: bytes) -> bool:
        self.core.u2c.responses += 1
        return self.core.policy(self.client, frame_of(data), from_client=False)

    def codes(self) -> list[tuple[str, int, int]]:
        return [(dst, decode_frame(d).code, decode_frame(d).opaque) for dst, d in self.log]


@pytest.fixture
def limits(tmp_path: Path) -> WorkerLimits:
    sec = parse_limits({"rule": [{"topic": "Busy", "mode": "reject"},
                                 {"topic": "Shaped", "rate": 1, "burst": 1, "mode": "shape"}]})
    return WorkerLimits(create_shared(tmp_path, "python"), sec)


def test_a_passed_request_is_written_whole_upstream_and_tracked() -> None:
    h = Harness([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    data = send(7)
    assert h.request(data)
    assert h.log == [("upstream", data)]
    assert len(h.core.inflight) == 1 and h.core.in_flight == 1
    assert h.response(answer(7))
    assert h.codes()[-1] == ("client", C.SUCCESS, 7)
    assert h.core.in_flight == 0


def test_a_denied_request_is_answered_to_the_client_and_never_relayed() -> None:
    h = Harness([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    assert h.request(admin(3))
    assert h.codes() == [("client", C.NO_PERMISSION, 3)]
    assert h.core.local_answers == 1 and h.core.in_flight == 0
    assert result_count(h.stats, C.UPDATE_BROKER_CONFIG, "no_permission") == 1


def test_a_denied_oneway_request_is_dropped_and_counted_oneway() -> None:
    h = Harness([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    assert h.request(admin(4, flag=C.FLAG_ONEWAY))
    assert h.log == []
    assert h.core.local_answers == 0 and h.core.in_flight == 0
    assert result_count(h.stats, C.UPDATE_BROKER_CONFIG, "oneway") == 1


def test_a_local_answer_waits_for_the_frame_boundary_and_goes_out_in_order() -> None:
    h = Harness([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    pump = h.client.pump = PumpState()
    pump.at_boundary = False  # the pump writing to the client is in the middle of a frame
    assert h.request(admin(1)) and h.request(admin(2))
    assert h.log == [] and pump.hold  # held back; the pump stops at the next boundary
    assert h.core.local_answers == 0 and h.core.in_flight == 2 + 1  # answers not written yet, stream mid-frame
    pump.at_boundary = True
    h.core.flush_answers(h.client)
    assert h.codes() == [("client", C.NO_PERMISSION, 1), ("client", C.NO_PERMISSION, 2)]
    assert not pump.hold and h.core.local_answers == 2 and h.core.in_flight == 0


def test_queued_answers_go_before_the_next_policy_frame_into_that_stream() -> None:
    class Responses(Filter):
        wants_responses = True

    h = Harness([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES), Responses()])
    pump = h.client.pump = PumpState()
    pump.at_boundary = False
    assert h.request(send(9))  # relayed
    assert h.request(admin(8))  # answered, but the client stream is mid-frame: queued
    pump.at_boundary = True  # the scanner stops at the end of that frame and hands over the next one
    assert h.response(answer(9))
    assert h.codes() == [("upstream", C.SEND_MESSAGE_V2, 9), ("client", C.NO_PERMISSION, 8), ("client", C.SUCCESS, 9)]


def test_rewrite_close_and_broker_requests() -> None:
    new = send(5, topic="Other")

    class Decide(Filter):
        def request_slots(self) -> set[int]:
            return {code_slot(C.SEND_MESSAGE_V2), code_slot(C.HEART_BEAT)}

        def on_request(self, session, frame: Frame) -> Verdict | None:
            return rewrite(new) if frame.code == C.SEND_MESSAGE_V2 else close("no heartbeats here")

    h = Harness([Decide()])
    assert h.request(send(5))
    assert h.log == [("upstream", new)] and len(h.core.inflight) == 1
    assert not h.request(encode(RemotingCommand(code=C.HEART_BEAT, opaque=6)))  # close: the pump ends
    assert len(h.log) == 1
    # a request from the broker to the client is relayed without asking the chain
    check = encode(RemotingCommand(code=C.HEART_BEAT, opaque=9, flag=C.FLAG_ONEWAY))
    assert h.core.policy(h.client, frame_of(check), from_client=False)
    assert h.log[-1] == ("client", check)


def test_a_verdict_kind_is_the_enum() -> None:
    assert divert("x").kind is Kind.DIVERT
    with pytest.raises(TypeError, match="not a policy.Kind"):
        Verdict("reply", b"")  # type: ignore[arg-type]


def test_send_limit_filter_answers_refused_sends_and_keeps_sends_out_of_python(limits: WorkerLimits) -> None:
    h = Harness([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES), SendLimitFilter(limits)])
    # the action table hands no send to Python: the limiter in the scanner picks the refused ones
    assert h.core.chain.request_actions[code_slot(C.SEND_MESSAGE_V2)] == 0
    assert h.core.chain.limiter(False) is limits.limiter_for(False)
    assert h.request(send(1, topic="Busy"), limited=0)
    assert h.request(send(2, topic="Free"))  # handed over for another reason: relayed as it is
    (dst, data), relayed = h.log
    resp = decode_frame(data)
    assert dst == "client" and resp.code == C.SYSTEM_BUSY and resp.opaque == 1
    assert resp.ext_fields == {"MSG_REGION": "DefaultRegion", "TRACE_ON": "false"}
    assert "topic Busy is switched to reject" in resp.remark
    assert relayed == ("upstream", send(2, topic="Free"))
    assert result_count(h.stats, C.SEND_MESSAGE_V2, "system_busy") == 1


def test_send_limit_filter_shapes_without_a_shaper_as_busy_or_drops_oneway(limits: WorkerLimits) -> None:
    h = Harness([SendLimitFilter(limits)])
    assert limits.is_shape(1) and limits.shaper is None
    assert h.request(send(1, topic="Shaped"), limited=1)
    assert h.codes() == [("client", C.SYSTEM_BUSY, 1)]
    assert "shaping is unavailable" in decode_frame(h.log[0][1]).remark
    assert h.request(send(2, topic="Shaped", flag=C.FLAG_ONEWAY), limited=1)
    assert len(h.log) == 1  # a oneway send has no answer to give
    assert result_count(h.stats, C.SEND_MESSAGE_V2, "oneway") == 1


def test_scanner_limiter_to_session_core_without_sockets(tmp_path: Path, twin: Twin) -> None:
    """A scanner with the chain's limiter cuts a pipelined buffer: sends under no rule are
    forwarded as raw spans, the refused one is handed over with its rule and answered."""
    compiled = twin.compiled
    rules = parse_limits({"rule": [{"topic": "Busy", "mode": "reject"}]})
    limits = WorkerLimits(create_shared(tmp_path, twin.name), rules)
    h = Harness([SendLimitFilter(limits)])
    h.stats = h.core.stats = codec.ScanStatsC() if compiled else codec.ScanStatsPy()
    h.core.inflight = codec.InFlightC() if compiled else codec.InFlightPy()
    scanner_cls = codec.FrameScannerC if compiled else codec.FrameScannerPy
    scanner = scanner_cls(h.stats, actions=h.core.chain.request_actions, inflight=h.core.inflight,
                          direction=0, limiter=h.core.chain.limiter(compiled))
    h.core.c2u = scanner
    buf = send(1, topic="Free") + send(2, topic="Busy") + send(3, topic="Free")
    pos, handed = 0, []
    while pos < len(buf):  # what a pump does between its receive and its send
        ev, a, b = scanner.scan(buf, pos, len(buf))
        if a > pos:
            h.upstream.write(buf[pos:a])
        if ev != codec.EV_POLICY:
            break
        handed.append(scanner.limited)
        assert h.core.policy(h.upstream, Frame(buf[a:b], scanner.code, scanner.flag, scanner.opaque,
                                               scanner.limited), from_client=True)
        pos = b
    assert handed == [0]
    assert h.log[0] == ("upstream", send(1, topic="Free"))
    assert [(d, decode_frame(x).code, decode_frame(x).opaque) for d, x in h.log[1:2]] == [
        ("client", C.SYSTEM_BUSY, 2)]
    assert h.log[2] == ("upstream", send(3, topic="Free"))
    assert h.core.local_answers == 1 and h.core.in_flight == 2  # two sends relayed, unanswered yet


def test_answers_held_for_a_client_that_never_reads_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that stops reading keeps the stream to it mid-frame; its requests answered by the proxy
    queue for the next boundary.  Past the bound the connection closes instead of growing without end."""
    import rmqfast.proxy.core as core_mod

    monkeypatch.setattr(core_mod, "MAX_HELD_ANSWERS", 2000)
    h = Harness([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    pump = h.client.pump = PumpState()
    pump.at_boundary = False
    kept = 0
    while h.request(admin(kept + 1)):
        kept += 1
        assert kept < 1000, "never closed"
    size = len(h.client.queue[0][0])  # type: ignore[index]
    assert len(h.client.queue) == kept and h.client.held == kept * size and h.client.held <= 2000 < h.client.held + size
    assert h.log == []  # nothing was written mid-frame
    pump.at_boundary = True
    h.core.flush_answers(h.client)  # what was held still goes out whole and in order
    assert [op for _, _, op in h.codes()] == list(range(1, kept + 1))


def test_a_filter_failing_on_a_frame_closes_only_that_connection_with_a_log(caplog: pytest.LogCaptureFixture) -> None:
    """A frame a filter cannot handle (here a JSON heartbeat body nested deeper than Python's parser
    goes) ends its connection with a logged reason; no exception reaches the pump's greenlet."""
    class Fails(Filter):
        def request_slots(self) -> set[int]:
            return {code_slot(C.HEART_BEAT)}

        def on_request(self, session: object, frame: Frame) -> Verdict | None:
            import json

            json.loads(frame.body)
            return None

    h = Harness([Fails()])
    deep = b"[" * 200000 + b"]" * 200000
    data = encode(RemotingCommand(code=C.HEART_BEAT, opaque=5, body=deep))
    with caplog.at_level("WARNING", logger="rmqfast.relay"):
        assert h.request(data) is False
    assert h.log == [] and "filter failed" in caplog.text
    h2 = Harness([Fails()])
    assert h2.response(answer(7))  # responses are not seen by that filter


@pytest.mark.parametrize("code", [C.SEND_REPLY_MESSAGE_V2, C.SEND_REPLY_MESSAGE])
def test_reply_messages_take_the_send_limits(tmp_path: Path, twin: Twin, code: int) -> None:
    """A reply message is stored by the broker in its header's topic like a send: a topic over its
    limit cannot be written through SEND_REPLY_MESSAGE(_V2) instead."""
    compiled = twin.compiled
    rules = parse_limits({"rule": [{"topic": "Busy", "mode": "reject"}]})
    limits = WorkerLimits(create_shared(tmp_path, twin.name), rules)
    h = Harness([SendLimitFilter(limits)])
    h.stats = h.core.stats = codec.ScanStatsC() if compiled else codec.ScanStatsPy()
    scanner_cls = codec.FrameScannerC if compiled else codec.FrameScannerPy
    scanner = scanner_cls(h.stats, actions=h.core.chain.request_actions, limiter=h.core.chain.limiter(compiled))
    props = "TAGS\u0001A\u0002"
    ext = ({"a": "PG", "b": "Busy", "e": "0", "i": props} if code == C.SEND_REPLY_MESSAGE_V2 else
           {"producerGroup": "PG", "topic": "Busy", "queueId": "0", "properties": props})
    data = encode(RemotingCommand(code=code, opaque=6, ext_fields=ext, body=b"m" * 32))
    assert scanner.scan(data, 0, len(data)) == (codec.EV_POLICY, 0, len(data))
    assert scanner.limited == 0
    assert h.core.policy(h.upstream, Frame(data, scanner.code, scanner.flag, scanner.opaque, scanner.limited),
                         from_client=True)
    assert h.codes() == [("client", C.SYSTEM_BUSY, 6)]  # answered, never relayed
