"""A send is a batch when its header's batch flag reads true, whatever its request code.

The broker (SendMessageProcessor.processRequest) takes SEND_MESSAGE (10), SEND_MESSAGE_V2 (310)
and SEND_BATCH_MESSAGE (320) alike and calls sendBatchMessage when ``requestHeader.isBatch()``:
extFields ``m`` (SendMessageRequestHeaderV2, 310 and 320) or ``batch`` (SendMessageRequestHeader,
10) read with Boolean.parseBoolean ("true" in any case).  Both scanner twins, the limiter they
feed and the Python filters must read the flag that way.
"""

from __future__ import annotations

import pytest

from rmqfast import codec
from rmqfast.codec import codes as C
from rmqfast.codec.sendheader import is_batch
from tests.test_limits import T0, rule, shm_for
from tests.test_scan import batch_body, binary_frame, json_frame


@pytest.fixture
def impl(twin):
    """(scanner class, stats class, limiter class) of each twin (the ``twin`` fixture of tests/conftest.py)."""
    return twin.FrameScanner, twin.ScanStats, twin.Limiter

FLAG_KEY = {10: "batch", 310: "m", 320: "m", 325: "m"}
TOPIC_KEY = {10: "topic", 310: "b", 320: "b", 325: "b"}

# (code, the flag's key (None: the code's own), its value (None: absent), read as a batch)
CASES = [
    (310, None, "true", True),
    (310, None, "TRUE", True),
    (310, None, "tRuE", True),
    (310, None, "false", False),
    (310, None, None, False),
    (310, None, "1", False),
    (310, None, "yes", False),
    (310, None, "", False),
    (310, None, "true ", False),
    (310, None, "truee", False),
    (310, "batch", "true", False),    # SendMessageRequestHeaderV2 has no field "batch"
    (320, None, "true", True),
    (320, None, "false", False),      # the broker stores the body as one message
    (320, None, None, False),
    (10, None, "true", True),
    (10, None, "True", True),
    (10, None, "false", False),
    (10, None, None, False),
    (10, "m", "true", False),         # SendMessageRequestHeader has no field "m"
    (325, None, "true", False),       # a reply message is never a batch
]


def _frame(code: int, key: str | None, value: str | None, binary: bool, opaque: int = 5) -> bytes:
    ext = {TOPIC_KEY[code]: "T"}
    if value is not None:
        ext[key or FLAG_KEY[code]] = value
    body = batch_body(3)
    if binary:
        return binary_frame(code, 0, opaque, ext, body=body)
    return json_frame({"code": code, "extFields": ext, "flag": 0, "opaque": opaque}, body)


def _messages(impl, frame: bytes) -> tuple[int, int]:
    """(event, messages counted under the topic) of one scan."""
    scanner_cls, stats_cls, _ = impl
    stats = stats_cls()
    sc = scanner_cls(stats)
    ev = sc.scan(frame, 0, len(frame))[0]
    return ev, sum(t[2] for t in stats.topics())


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("code,key,value,batch", CASES)
def test_stats_count_the_messages_of_a_flagged_send(impl, binary, code, key, value, batch):
    ev, msgs = _messages(impl, _frame(code, key, value, binary))
    assert ev == codec.EV_FORWARD
    if code == 325:
        assert msgs == 0  # reply messages are not counted under their topic
    else:
        assert msgs == (3 if batch else 1)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("code,key,value,batch", CASES)
def test_limiter_counts_the_messages_of_a_flagged_send(impl, binary, code, key, value, batch):
    scanner_cls, stats_cls, limiter_cls = impl
    lim = limiter_cls(shm_for(limiter_cls))
    lim.configure([rule(b"T", rate=1, burst=4, slot=1)])
    sc = scanner_cls(stats_cls(), limiter=lim)
    frames = _frame(code, key, value, binary, opaque=5) + _frame(code, key, value, binary, opaque=6)
    ev, a, b = sc.scan(frames, 0, len(frames), now_ns=T0)
    # two batches of 3 are over a burst of 4 (the second is rejected whole); two single messages are not
    if batch:
        assert (ev, a, b, sc.opaque, sc.limited) == (codec.EV_POLICY, len(frames) // 2, len(frames), 6, 0)
        assert lim.counters() == [(0, 3, 3)]
    else:
        assert (ev, a) == (codec.EV_FORWARD, len(frames))
        assert lim.counters() == [(0, 2, 0)]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("code,key,value,batch", CASES)
def test_delay_topics_hand_flagged_sends_to_policy(impl, binary, code, key, value, batch):
    """A batch's delivery times are in its body: a [delay] topic's batch goes to policy; a single
    send without a delivery-time property in its header stays on the fast path."""
    scanner_cls, stats_cls, _ = impl
    sc = scanner_cls(stats_cls())
    sc.delay_topics = [b"T"]
    frame = _frame(code, key, value, binary)
    assert sc.scan(frame, 0, len(frame))[0] == (codec.EV_POLICY if batch else codec.EV_FORWARD)


def test_a_flagged_send_split_across_reads_is_decided_whole(impl):
    scanner_cls, stats_cls, limiter_cls = impl
    lim = limiter_cls(shm_for(limiter_cls))
    lim.configure([rule(b"T", rate=1, burst=4, slot=1)])
    sc = scanner_cls(stats_cls(), limiter=lim)
    first = _frame(310, None, "true", False, opaque=5)
    assert sc.scan(first, 0, len(first), now_ns=T0)[0] == codec.EV_FORWARD  # 3 of 4
    frame = _frame(310, None, "true", False, opaque=6)
    ev, a, b = sc.scan(frame, 0, len(frame) - 1, now_ns=T0)
    assert (ev, a, b) == (codec.EV_FORWARD, 0, len(frame))  # waits for the body it counts
    ev, a, b = sc.scan(frame, 0, len(frame), now_ns=T0)
    assert (ev, sc.opaque, sc.limited) == (codec.EV_POLICY, 6, 0)
    assert lim.counters() == [(0, 3, 3)]


JSON_ONLY = [
    ('"m":"\\u0074rue"', True),        # fastjson decodes the escape: "true"
    ('"m":"\\u0054RUE"', True),
    ('"m":"tru\\u0065"', True),
    ('"m":"\\u0066alse"', False),
    ('"m":"\\u0074rue\\u0020"', False),
    ('"m":"\\u0074\\u0072\\u0075\\u0065"', True),
    ('"m":"\\t"', False),
]


@pytest.mark.parametrize("member,batch", JSON_ONLY)
def test_escaped_flag_values_are_read_decoded(impl, member, batch):
    header = ('{"code":310,"extFields":{"b":"T",' + member + '},"flag":0,"opaque":5}').encode()
    body = batch_body(3)
    frame = len(header + body).__add__(4).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header + body
    ev, msgs = _messages(impl, frame)
    assert (ev, msgs) == (codec.EV_FORWARD, 3 if batch else 1)


REFUSED = [
    b'{"code":310,"extFields":{"b":"T","m":"false","m":"true"},"flag":0,"opaque":5}',  # duplicate
    b'{"code":310,"extFields":{"b":"T","m":"true","m":"false"},"flag":0,"opaque":5}',
    b'{"code":10,"extFields":{"topic":"T","batch":"true","batch":"true"},"flag":0,"opaque":5}',
    b'{"code":310,"extFields":{"b":"T","m":true},"flag":0,"opaque":5}',                 # not a string
    b'{"code":310,"extFields":{"b":"T","m":null},"flag":0,"opaque":5}',
    b'{"code":310,"extFields":{"b":"T","\\u006d":"true"},"flag":0,"opaque":5}',         # escaped key
]


@pytest.mark.parametrize("header", REFUSED)
def test_ambiguous_flags_are_refused(impl, header):
    frame = (len(header) + 4).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header
    scanner_cls, stats_cls, _ = impl
    sc = scanner_cls(stats_cls())
    assert sc.scan(frame, 0, len(frame))[0] == codec.EV_ERROR


@pytest.mark.parametrize("key", ["m", "batch"])
def test_duplicate_binary_flags_are_refused(impl, key):
    code = 310 if key == "m" else 10
    topic = TOPIC_KEY[code]
    # binary_frame takes a dict: the duplicate key is built by hand
    ext = b"".join(len(k).to_bytes(2, "big") + k + len(v).to_bytes(4, "big") + v
                   for k, v in ((topic.encode(), b"T"), (key.encode(), b"false"), (key.encode(), b"true")))
    h = (code.to_bytes(2, "big", signed=True) + b"\x00" + (401).to_bytes(2, "big") + (5).to_bytes(4, "big")
         + (0).to_bytes(4, "big") + (0).to_bytes(4, "big") + len(ext).to_bytes(4, "big") + ext)
    frame = (len(h) + 4).to_bytes(4, "big") + ((1 << 24) | len(h)).to_bytes(4, "big") + h
    scanner_cls, stats_cls, _ = impl
    sc = scanner_cls(stats_cls())
    assert sc.scan(frame, 0, len(frame))[0] == codec.EV_ERROR


@pytest.mark.parametrize("code,key,value,batch", CASES)
def test_python_filters_read_the_flag_like_the_scanners(code, key, value, batch):
    ext = {TOPIC_KEY[code]: "T"}
    if value is not None:
        ext[key or FLAG_KEY[code]] = value
    assert is_batch(code, ext) is batch


def test_is_batch_of_other_codes():
    assert is_batch(C.PULL_MESSAGE, {"m": "true", "batch": "true"}) is False
    assert is_batch(C.SEND_MESSAGE_V2, None) is False


def test_fuzzer_catches_a_scanner_that_ignores_the_batch_flag():
    from rmqfast.testing import header_fuzz

    header = b'{"code":310,"extFields":{"b":"TopicA","m":"TRUE"},"flag":0,"opaque":5}'
    frame = header_fuzz.frame_of(header, 0, header_fuzz.batch_body(3))

    class OneMessage(header_fuzz.Twins):
        def scan(self, frame: bytes) -> list[header_fuzz.Verdict]:
            return [header_fuzz.Verdict(codec.EV_POLICY, 0, len(frame), "", 310, 0, 5, (b"TopicA",), 0,
                                        codec.EV_POLICY, codec.EV_POLICY, 1)]

    assert header_fuzz.check(header_fuzz.Twins(), frame) is None
    assert "counted 1 messages, broker reads 3" in header_fuzz.check(OneMessage(), frame)


@pytest.mark.parametrize("code,key,value", [
    (C.SEND_MESSAGE_V2, "m", "true"),          # a batch sent as SEND_MESSAGE_V2
    (C.SEND_MESSAGE, "batch", "TRUE"),         # ... as SEND_MESSAGE
])
def test_delay_service_holds_a_flagged_send_as_a_batch(tmp_path, code, key, value):
    """The delivery times of a flagged send's messages are in its body: the batch is held until
    the latest, and released as a batch without them."""
    from rmqfast.codec.batch import BatchEntry, decode_batch, encode_batch
    from rmqfast.codec.command import decode_frame
    from tests.test_delay import FakeSession, GeventBroker, frame_of, make_service, send_cmd, wait_for

    broker = GeventBroker()
    svc, spill = make_service(tmp_path)
    try:
        entries = [BatchEntry(body=b"b%d" % i, properties={"UNIQ_KEY": f"U{i}", "TIMER_DELAY_MS": str(200 + 100 * i)})
                   for i in range(3)]
        cmd = send_cmd("Delayed", 1, {}, uniq=None, code=code, body=encode_batch(entries))
        cmd.ext_fields[key] = value
        a = decode_frame(svc.filter.on_request(FakeSession(broker.addr), frame_of(cmd)).data)
        assert a.code == C.SUCCESS and a.ext_fields["msgId"] == "U0,U1,U2"
        wait_for(lambda: len(broker.got) == 1, 20, "the batch released")
        got = broker.got[0][1]
        assert got.code == C.SEND_BATCH_MESSAGE and got.ext_fields["m"] == "true"
        assert [e.properties for e in decode_batch(got.body)] == [{"UNIQ_KEY": f"U{i}"} for i in range(3)]
    finally:
        svc.close()
        spill.close()
        broker.close()


def test_delay_service_takes_an_unflagged_320_as_one_message(tmp_path):
    """SEND_BATCH_MESSAGE without m=true is stored by the broker as one message with the header's
    properties: the header's delivery time decides, the body is not decoded."""
    from rmqfast.codec.command import decode_frame
    from tests.test_delay import FakeSession, GeventBroker, frame_of, make_service, send_cmd, wait_for

    broker = GeventBroker()
    svc, spill = make_service(tmp_path)
    try:
        cmd = send_cmd("Delayed", 1, {"TIMER_DELAY_MS": "200"}, code=C.SEND_BATCH_MESSAGE, body=b"not a batch body")
        cmd.ext_fields["m"] = "false"
        a = decode_frame(svc.filter.on_request(FakeSession(broker.addr), frame_of(cmd)).data)
        assert a.code == C.SUCCESS
        wait_for(lambda: len(broker.got) == 1, 20, "the message released")
        got = broker.got[0][1]
        assert got.code == C.SEND_MESSAGE_V2 and got.ext_fields["m"] == "false" and got.body == b"not a batch body"
        assert "TIMER_DELAY_MS" not in got.ext_fields["i"]
    finally:
        svc.close()
        spill.close()
        broker.close()
