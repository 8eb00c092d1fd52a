"""The frame scanner: compiled and pure-Python twins, on the same inputs.

Every behaviour test runs against both implementations (``scanner_impl`` fixture), and the
equivalence tests feed random and hand-built Java-shaped frames to both and require the same
events, counters and errors.
"""

from __future__ import annotations

import json
import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmqfast import codec
from rmqfast.codec import _scan_py


@pytest.fixture
def impl(twin):
    """(scanner class, stats class) of each twin (the ``twin`` fixture of tests/conftest.py)."""
    return twin.FrameScanner, twin.ScanStats


def json_frame(header: dict, body: bytes = b"") -> bytes:
    hb = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">ii", 4 + len(hb) + len(body), len(hb)) + hb + body


def binary_frame(code: int, flag: int, opaque: int, ext: dict[str, str], remark: str = "", body: bytes = b"") -> bytes:
    rb = remark.encode()
    eb = b"".join(
        struct.pack(">H", len(k.encode())) + k.encode() + struct.pack(">i", len(v.encode())) + v.encode()
        for k, v in ext.items()
    )
    h = (
        struct.pack(">hbhii", code, 0, 401, opaque, flag)
        + struct.pack(">i", len(rb))
        + rb
        + struct.pack(">i", len(eb))
        + eb
    )
    return struct.pack(">ii", 4 + len(h) + len(body), (1 << 24) | len(h)) + h + body


def send_v2(topic: str, opaque: int = 1, body: bytes = b"x" * 100, tag: str = "TagA") -> bytes:
    props = f"TAGS\x01{tag}\x02KEYS\x01k{opaque}\x02UNIQ_KEY\x01ABC{opaque}\x02WAIT\x01true\x02"
    return json_frame(
        {
            "code": 310,
            "extFields": {
                "a": "PG",
                "b": topic,
                "c": "TBW102",
                "d": "4",
                "e": "-1",
                "f": "0",
                "g": "1700000000000",
                "h": "0",
                "i": props,
                "j": "0",
                "k": "false",
                "m": "false",
            },
            "flag": 0,
            "language": "JAVA",
            "opaque": opaque,
            "serializeTypeCurrentRPC": "JSON",
            "version": 401,
        },
        body,
    )


def batch_body(n: int) -> bytes:
    out = b""
    for i in range(n):
        body = f"m{i}".encode()
        props = b"UNIQ_KEY\x01u\x02"
        rec = struct.pack(">iiiii", 0, 0, 0, 0, len(body)) + body + struct.pack(">h", len(props)) + props
        out += struct.pack(">i", len(rec)) + rec[4:]
    return out


def response(code: int, opaque: int) -> bytes:
    return json_frame(
        {
            "code": code,
            "flag": 1,
            "language": "JAVA",
            "opaque": opaque,
            "serializeTypeCurrentRPC": "JSON",
            "version": 401,
            "extFields": {"msgId": "7F00000100002A9F0000000000000000", "queueId": "1"},
        }
    )


def run(scanner, data: bytes, chunk: int | None = None) -> list:
    """Feed ``data`` like a relay would (in chunks); return the events and forwarded bytes."""
    events = []
    forwarded = bytearray()
    buf = bytearray()
    pos_data = 0
    while pos_data < len(data) or buf:
        step = chunk or len(data)
        new = data[pos_data : pos_data + step]
        pos_data += len(new)
        buf += new
        start = pos = 0
        while True:
            ev, a, b = scanner.scan(buf, pos, len(buf))
            forwarded += buf[start:a]
            start = a
            if ev == codec.EV_POLICY:
                events.append(("policy", bytes(buf[a:b]), scanner.code, scanner.opaque))
                forwarded += buf[a:b]
                start = pos = b
                continue
            if ev == codec.EV_ERROR:
                events.append(("error", scanner.error))
                return [events, bytes(forwarded)]
            break
        del buf[:start]
        if not new:
            break
    return [events, bytes(forwarded), bytes(buf)]


STREAM = (
    send_v2("TopicA", 1)
    + send_v2("TopicB", 2)
    + response(0, 9)
    + binary_frame(310, 0, 3, {"a": "PG", "b": "TopicA"}, body=b"bin")
    + json_frame({"code": 320, "extFields": {"b": "TopicB", "m": "true"}, "flag": 0, "opaque": 4}, batch_body(5))
    + json_frame({"code": 11, "extFields": {"topic": "TopicA", "queueId": "0"}, "flag": 0, "opaque": 5})
    + json_frame({"code": 34, "flag": 2, "opaque": 6}, b'{"clientID":"x"}')
    + json_frame({"code": 200050, "extFields": {"topic": "TopicP"}, "flag": 0, "opaque": 7})
)


@pytest.mark.parametrize("chunk", [None, 1, 7, 64, 1000])
def test_passthrough_forwards_everything_and_counts(impl, chunk):
    Scanner, Stats = impl
    stats = Stats()
    sc = Scanner(stats)
    events, fwd, rest = run(sc, STREAM, chunk)
    assert events == []
    assert fwd == STREAM and rest == b""
    reqs = {s: (c, b) for s, c, b in stats.requests()}
    assert reqs[310][0] == 3 and reqs[320][0] == 1 and reqs[11][0] == 1 and reqs[34][0] == 1
    assert reqs[codec.code_slot(200050)][0] == 1
    assert dict(stats.responses()) == {0: 1}
    topics = {t: rest for t, *rest in stats.topics()}
    assert topics[b"TopicA"][:3] == [2, 2, 1] or tuple(topics[b"TopicA"][:3]) == (2, 2, 1)
    assert tuple(topics[b"TopicB"][:3]) == (2, 6, 0)  # one send + one batch of five
    assert stats.frames == 8 and stats.bytes == len(STREAM)
    assert sc.requests == 6 and sc.responses == 1  # the oneway heartbeat is not awaited


@pytest.mark.parametrize("chunk", [None, 1, 13])
def test_policy_frames_come_whole(impl, chunk):
    Scanner, Stats = impl
    actions = bytearray(codec.CODE_SLOTS)
    actions[310] = codec.ACTION_POLICY
    sc = Scanner(Stats(), actions=bytes(actions))
    events, fwd, _ = run(sc, STREAM, chunk)
    policy = [e for e in events if e[0] == "policy"]
    assert [(e[2], e[3]) for e in policy] == [(310, 1), (310, 2), (310, 3)]
    assert policy[0][1] == send_v2("TopicA", 1)
    assert fwd == STREAM


def test_response_policy(impl):
    Scanner, Stats = impl
    sc = Scanner(Stats(), response_policy=True)
    events, fwd, _ = run(sc, STREAM, 5)
    assert [(e[2], e[3]) for e in events] == [(0, 9)]


def test_trailing_partial_frame_is_kept(impl):
    Scanner, Stats = impl
    sc = Scanner(Stats())
    f = send_v2("T", 1)
    ev, a, b = sc.scan(f + f[:5], 0, len(f) + 5)
    assert (ev, a, b) == (codec.EV_FORWARD, len(f), 8)
    hlen = struct.unpack(">i", f[4:8])[0]
    ev, a, b = sc.scan(f[:20], 0, 20)
    assert (ev, a, b) == (codec.EV_FORWARD, 0, 8 + hlen)


BAD = [
    (struct.pack(">ii", 2, 0), "shorter than the 4-byte header-length word"),
    (struct.pack(">ii", 100, (5 << 24) | 10) + b"x" * 96, "unknown serialize type 5"),
    (struct.pack(">ii", 20, 40) + b"x" * 16, "header length 40 exceeds frame length 20"),
    (struct.pack(">ii", 0x7FFFFFF0, 10), "exceeds the limit"),
    (struct.pack(">ii", 14, 10) + b"not json!!", "invalid JSON header"),
    (struct.pack(">ii", 14, 10) + b'{"flag":0}', "no code field"),
    (struct.pack(">ii", 16, 12) + b'{"code":1.5}', "integer expected"),
    (struct.pack(">ii", 14, (1 << 24) | 10) + b"\x00" * 10, "binary header shorter than 21 bytes"),
    (struct.pack(">ii", -5, 0), "shorter than the 4-byte"),
]


@pytest.mark.parametrize("data,message", BAD)
def test_malformed_frames_give_the_same_error(impl, data, message):
    Scanner, Stats = impl
    stats = Stats()
    sc = Scanner(stats)
    good = send_v2("T", 1)
    ev, a, _ = sc.scan(good + data, 0, len(good) + len(data))
    assert ev == codec.EV_ERROR and a == len(good)
    assert message in sc.error
    assert stats.protocol_errors == 1


def test_frame_limit_is_checked_before_the_frame_arrives(impl):
    Scanner, Stats = impl
    sc = Scanner(Stats(), max_frame_size=1024)
    head = struct.pack(">ii", 2000, 10)  # only 8 bytes of a 2004-byte frame
    ev, _, _ = sc.scan(head, 0, 8)
    assert ev == codec.EV_ERROR and "exceeds the limit of 1024" in sc.error


def test_header_limit(impl):
    Scanner, Stats = impl
    sc = Scanner(Stats(), max_header_size=64)
    f = send_v2("T", 1)
    ev, _, _ = sc.scan(f, 0, len(f))
    assert ev == codec.EV_ERROR and "exceeds the limit of 64" in sc.error


def test_bad_arguments(impl):
    Scanner, Stats = impl
    with pytest.raises(ValueError, match="action table"):
        Scanner(Stats(), actions=b"\x00" * 3)
    with pytest.raises(ValueError, match="max_frame_size"):
        Scanner(Stats(), max_frame_size=2)
    sc = Scanner(Stats())
    with pytest.raises(ValueError, match="outside a buffer"):
        sc.scan(b"abc", 0, 10)


def test_topic_table_overflow_goes_to_other(impl):
    Scanner, Stats = impl
    stats = Stats()
    sc = Scanner(stats)
    data = b"".join(send_v2(f"T{i}", i) for i in range(_scan_py.TOPIC_SLOTS + 10))
    data += send_v2("X" * 300, 1)
    ev, a, _ = sc.scan(data, 0, len(data))
    assert (ev, a) == (codec.EV_FORWARD, len(data))
    topics = {t: s for t, s, *_ in stats.topics()}
    assert len(topics) == _scan_py.TOPIC_SLOTS
    assert topics[b"__other__"] == 12
    assert sum(topics.values()) == _scan_py.TOPIC_SLOTS + 11


def test_code_slots_round_trip():
    for code in (0, 10, 310, 1023, 200050, 200151, 201022):
        assert codec.slot_code(codec.code_slot(code)) == code
    assert codec.code_slot(5000) == codec.OTHER_SLOT and codec.slot_code(codec.OTHER_SLOT) is None
    assert codec.code_slot(-1) == codec.OTHER_SLOT


# --- equivalence: the two implementations on the same inputs ------------------------------

needs_c = pytest.mark.skipif(codec.FrameScannerC is None, reason="extension not built")


def _both(data: bytes, chunk: int | None, actions: bytes | None = None, response_policy: bool = False,
          policy_topics: list[bytes] | None = None):
    results = []
    for Scanner, Stats in ((codec.FrameScannerPy, codec.ScanStatsPy), (codec.FrameScannerC, codec.ScanStatsC)):
        stats = Stats()
        sc = Scanner(stats, actions=actions, response_policy=response_policy, max_frame_size=1 << 20)
        sc.policy_topics = policy_topics
        out = run(sc, data, chunk)
        out.append(
            (
                stats.requests(),
                stats.responses(),
                sorted(stats.topics()),
                stats.frames,
                stats.bytes,
                stats.protocol_errors,
                sc.requests,
                sc.responses,
            )
        )
        results.append(out)
    return results


frame_strategy = st.one_of(
    st.builds(
        lambda t, o, n: send_v2(t, o, b"y" * n),
        st.text("abcXYZ_-%|0", min_size=1, max_size=20),
        st.integers(-(2**31), 2**31 - 1),
        st.integers(0, 300),
    ),
    st.builds(
        lambda c, f, o, t: binary_frame(c, f, o, {"b": t, "topic": t}),
        st.sampled_from([10, 11, 310, 320, 34, 105, 25]),
        st.integers(0, 3),
        st.integers(0, 1000),
        st.text("ab", max_size=5),
    ),
    st.builds(lambda c, o: response(c, o), st.integers(0, 300), st.integers(0, 100)),
    st.builds(
        lambda n: json_frame({"code": 320, "extFields": {"b": "B"}, "flag": 0}, batch_body(n)), st.integers(0, 6)
    ),
    st.binary(min_size=0, max_size=40),  # garbage
)


@needs_c
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(frame_strategy, max_size=6),
    st.one_of(st.none(), st.integers(1, 50)),
    st.binary(min_size=codec.CODE_SLOTS, max_size=codec.CODE_SLOTS).map(lambda b: bytes(x & 1 for x in b)),
    st.booleans(),
)
def test_compiled_and_python_agree(frames, chunk, actions, response_policy):
    data = b"".join(frames)
    py, c = _both(data, chunk, actions, response_policy)
    assert py == c


@needs_c
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(frame_strategy, max_size=6),
    st.one_of(st.none(), st.integers(1, 50)),
    st.lists(st.sampled_from([b"a", b"ab", b"a*", b"b*", b"*", b"", b"abcXYZ", b"B"]), max_size=3),
)
def test_compiled_and_python_agree_on_policy_topics(frames, chunk, policy_topics):
    data = b"".join(frames)
    py, c = _both(data, chunk, None, False, policy_topics)
    assert py == c


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 30))
def test_fuzz_only_frames_or_protocol_errors(data, chunk):
    """Random bytes (behind a valid frame header or not) never crash either twin."""
    for payload in (data, struct.pack(">ii", 4 + len(data), len(data)) + data):
        py, c = _both(payload, chunk)
        assert py == c


@needs_c
def test_json_headers_mutated():
    """Byte flips inside real headers: both twins agree on parse result or error text."""
    rng = random.Random(7)
    base = STREAM
    for _ in range(400):
        b = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(8, len(b))
            b[i] = rng.choice(b'{}[]":,\\ 0123456789abcx-')
        py, c = _both(bytes(b), rng.choice([None, 3, 17]))
        assert py == c


@pytest.mark.parametrize("topic,props,code,stype,held", [
    ("Later", "TAGS\x01a\x02TIMER_DELAY_SEC\x015\x02", 310, 0, True),       # JSON: \u0001 escapes decoded
    ("Later", "TIMER_DELIVER_MS\x011\x02", 310, 1, True),                   # binary header
    ("Later-x", "__STARTDELIVERTIME\x019", 10, 0, True),                    # prefix; SEND_MESSAGE (v1)
    ("Later", "DELAY\x013\x02KEYS\x01k", 310, 0, True),                     # a level: the policy decides
    ("Later", "TAGS\x01a\x02UNIQ_KEY\x01U", 310, 0, False),                 # no delivery time: fast path
    ("Later", "KEYS\x01TIMER_DELAY_MS\x02", 310, 1, False),                 # a value, not a name
    ("Later", "TIMER_DELAY_MS\x01\x02TAGS\x01a", 310, 0, False),            # empty value: the broker skips it
    ("Later", "TIMER_DELAY_MSX\x015", 310, 0, False),
    ("Other", "TIMER_DELAY_SEC\x015", 310, 0, False),                       # not a [delay] topic
    ("Later", "", 320, 0, True),                                            # a batch: its body decides
])
def test_delay_topics_hand_only_delayed_sends_to_policy(impl, topic, props, code, stype, held):
    scanner_cls, stats_cls = impl
    ext = {"b": topic, "i": props} if code != 10 else {"topic": topic, "properties": props}
    if code == 320:
        ext["m"] = "true"  # as every client sends a batch
    frame = (binary_frame(code, 0, 5, ext) if stype else
             json_frame({"code": code, "extFields": ext, "flag": 0, "opaque": 5}))
    sc = scanner_cls(stats_cls())
    sc.delay_topics = [b"Later", b"Later-*"]
    assert sc.scan(frame, 0, len(frame))[0] == (codec.EV_POLICY if held else codec.EV_FORWARD)
    sc.delay_topics = None  # off: every send is relayed
    assert sc.scan(frame, 0, len(frame))[0] == codec.EV_FORWARD


@pytest.mark.parametrize("topic,code,stype,held", [
    ("Split", 310, 0, True),                                   # SEND_MESSAGE_V2, JSON header
    ("Split", 310, 1, True),                                   # binary header
    ("Split", 10, 0, True),                                    # SEND_MESSAGE (v1): the "topic" field
    ("Split", 320, 1, True),                                   # a batch
    ("Split-x", 310, 0, True),                                 # prefix
    ("Split-", 10, 1, True),                                   # the prefix itself
    ("Splitx", 310, 0, False),                                 # not the name, not the prefix
    ("Spli", 310, 0, False),
    ("Other", 320, 0, False),                                  # not a listed topic: fast path
    ("Split", 11, 0, False),                                   # a pull of the topic: not a send
    ("Split", 361, 0, False),                                  # LITE_PULL
    # reply messages: the broker stores them in the header's topic and queue (storeReplyMessageEnable)
    ("Split", 325, 0, True),                                   # SEND_REPLY_MESSAGE_V2: b / i
    ("Split", 325, 1, True),
    ("Split", 324, 0, True),                                   # SEND_REPLY_MESSAGE: topic / properties
    ("Other", 325, 0, False),
])
def test_policy_topics_hand_every_send_of_those_topics_to_policy(impl, topic, code, stype, held):
    scanner_cls, stats_cls = impl
    ext = {"b": topic, "i": "TAGS\x01a"} if code in (310, 320, 325) else {"topic": topic, "properties": "TAGS\x01a"}
    frame = (binary_frame(code, 0, 5, ext) if stype else
             json_frame({"code": code, "extFields": ext, "flag": 0, "opaque": 5}))
    sc = scanner_cls(stats_cls())
    sc.policy_topics = [b"Split", b"Split-*"]
    ev, start, end = sc.scan(frame, 0, len(frame))
    assert ev == (codec.EV_POLICY if held else codec.EV_FORWARD)
    if held:
        assert (start, end, sc.code, sc.opaque, sc.limited) == (0, len(frame), code, 5, -1)
    sc.policy_topics = None  # off: every send is relayed
    assert sc.scan(frame, 0, len(frame))[0] == codec.EV_FORWARD
    sc.policy_topics = [b"*"]  # every topic
    assert sc.scan(frame, 0, len(frame))[0] == (codec.EV_POLICY if code not in (11, 361) else codec.EV_FORWARD)


def test_policy_topics_sends_come_whole_and_escaped_topics_fail(impl):
    scanner_cls, stats_cls = impl
    frame = send_v2("Split", opaque=9, body=b"z" * 500)
    sc = scanner_cls(stats_cls())
    sc.policy_topics = [b"Split"]
    assert sc.scan(frame, 0, 400) == (codec.EV_FORWARD, 0, len(frame))  # waits for the whole frame
    assert sc.scan(frame, 0, len(frame)) == (codec.EV_POLICY, 0, len(frame))
    hb = b'{"code":310,"extFields":{"b":"Spl\\u0069t"},"flag":0,"opaque":1}'
    escaped = struct.pack(">ii", 4 + len(hb), len(hb)) + hb
    sc2 = scanner_cls(stats_cls())
    sc2.policy_topics = [b"Split"]
    assert sc2.scan(escaped, 0, len(escaped))[0] == codec.EV_ERROR
    assert "escape" in sc2.error
