"""Differential fuzzing of the header walk: compiled scanner, pure twin and the broker's reading.

For every input header the two scanners must agree exactly (event, positions, error, code, flag,
opaque, counted topic, limit decision), and whenever they accept a frame, what they read must be
what a RocketMQ broker reads (:func:`broker_reading`, an independent model of fastjson's and
RocketMQSerializable's rules).  Inputs are Java-, Go- and C++-shaped headers with the smuggling
tricks applied (duplicate, escaped and case-variant keys, single quotes, ``\\x`` escapes, lying
binary lengths, hidden tags, batch flags of every spelling...) and random byte mutations of them.

``python -m rmqfast.testing.header_fuzz --seconds 600`` runs it for longer than CI does.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from rmqfast import codec, limits
from rmqfast.codec import _scan_py, codes

# Topics and tags the generated frames use; the limiter rules below make the scanners' reading
# of them observable (which rule rejected the send).
TOPICS = ("TopicA", "TopicB", "TopicC")
TAGS = ("TagX", "TagY")
#: [delay] topics of the second scanner pair: a send of these that asks for a delivery time goes to policy
DELAY_TOPICS = [b"TopicA", b"TopicC*"]
#: ``policy_topics`` of the same pair: every send of these goes to policy (gray releases' split topics)
SEND_TOPICS = [b"TopicB", b"TopicA*"]
DELAY_NAMES = ("DELAY", "TIMER_DELAY_SEC", "TIMER_DELAY_MS", "TIMER_DELIVER_MS", "__STARTDELIVERTIME")
RULES = [  # (topic, tag, rate, burst, bytes rate, bytes burst, mode, slot); mode 1 = reject
    (b"TopicA", None, 0.0, 0.0, 0.0, 0.0, 1, 1),
    (b"TopicB", b"TagX", 0.0, 0.0, 0.0, 0.0, 1, 2),
]
#: codes whose message the broker stores in the header's topic: sends and reply messages (324, 325)
STORED_CODES = (10, 310, 320, 324, 325)
_FIELDS = ("code", "flag", "opaque", "extfields", "language", "version", "remark")


@dataclass(frozen=True)
class Reading:
    """What a broker reads from a request header: code, flag, opaque, topic and TAGS (None: absent)."""

    code: int
    flag: int
    opaque: int
    topic: str | None
    tag: str | None
    delay: bool = False  # a delivery-time property (DELAY, TIMER_*, __STARTDELIVERTIME) is read
    batch: bool = False  # the send is a batch (SendMessageProcessor: requestHeader.isBatch())


class Unreadable(Exception):
    """The broker cannot decode this header (it closes the connection or answers an error)."""


# ---------------------------------------------------------------------------------------------
# The broker's reading (model of fastjson + RocketMQSerializable, written apart from the walk)


def _fastjson_int(v: Any) -> int:
    if isinstance(v, bool) or v is None:
        raise Unreadable("not an int")
    if isinstance(v, int):
        if not -(2**31) <= v < 2**31:
            raise Unreadable("int overflow")
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return _fastjson_int(int(v))
    raise Unreadable(f"{type(v).__name__} for an int field")


def _smart_name(key: str) -> str | None:
    """The RemotingCommand field fastjson's smart match binds ``key`` to (None: none)."""
    low = "".join(c for c in key if c not in "_-")
    low = "".join(chr(ord(c) + 32) if "A" <= c <= "Z" else c for c in low)
    return low if low in _FIELDS else None


def _message_properties(s: str | None) -> dict[str, str]:
    """MessageDecoder.string2messageProperties."""
    out: dict[str, str] = {}
    if s is None:
        return out
    index, n = 0, len(s)
    while index < n:
        new = s.find("\x02", index)
        if new < 0:
            new = n
        if new - index >= 3:
            kv = s.find("\x01", index)
            if index < kv < new - 1:
                out[s[index:kv]] = s[kv + 1 : new]
        index = new + 1
    return out


def _request_reading(code: int, flag: int, opaque: int, ext: dict[str, str | None]) -> Reading:
    if code in (310, 320, 325):
        topic, props = ext.get("b"), ext.get("i")
    elif code in (10, 324):
        topic, props = ext.get("topic"), ext.get("properties")
    else:
        topic, props = ext.get("topic"), None
    read = _message_properties(props)
    # SendMessageRequestHeaderV2.m (310, 320) / SendMessageRequestHeader.batch (10), read by
    # Boolean.parseBoolean: String.equalsIgnoreCase("true")
    flag_value = ext.get("m") if code in (310, 320) else ext.get("batch") if code == 10 else None
    batch = flag_value is not None and len(flag_value) == 4 and flag_value.lower() == "true"
    return Reading(code, flag, opaque, topic, read.get("TAGS"), any(k in read for k in DELAY_NAMES), batch)


def _json_reading(header: bytes) -> Reading:
    try:
        text = header.decode("utf-8")  # the walk refuses what Java would decode with replacements
    except UnicodeDecodeError as e:
        raise Unreadable(str(e)) from e
    pairs_seen: list[list[tuple[str, Any]]] = []

    def hook(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        pairs_seen.append(pairs)
        return pairs  # type: ignore[return-value]

    try:
        top = json.loads(text, object_pairs_hook=hook)
    except (ValueError, RecursionError) as e:
        raise Unreadable(str(e)) from e
    if not isinstance(top, list):
        raise Unreadable("not an object")
    fields: dict[str, Any] = {}
    for k, v in top:  # fastjson: smart-matched field names, the first occurrence wins
        name = _smart_name(k)
        if name is not None and name not in fields:
            fields[name] = v
    if "code" not in fields:
        raise Unreadable("no code")
    ext_raw = fields.get("extfields")
    ext: dict[str, str | None] = {}
    if isinstance(ext_raw, list):
        for k, v in ext_raw:  # HashMap<String, String>: the last occurrence wins
            ext[k] = v if isinstance(v, str) or v is None else json.dumps(v)
    return _request_reading(_fastjson_int(fields["code"]), _fastjson_int(fields.get("flag", 0)),
                            _fastjson_int(fields.get("opaque", 0)), ext)


def _binary_reading(h: bytes) -> Reading:
    """RocketMQSerializable.rocketMQProtocolDecode (5.x), reading only inside the header."""
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(h):
            raise Unreadable("read past the header")
        pos += n
        return h[pos - n : pos]

    def read_str(short: bool, limit: int) -> str | None:
        (n,) = struct.unpack(">h" if short else ">i", take(2 if short else 4))
        if n == 0:
            return None
        if n > limit or n < 0:
            raise Unreadable("string length")
        return take(n).decode("utf-8", errors="replace")

    code, _lang, _ver, opaque, flag = struct.unpack(">hbhii", take(13))
    read_str(False, len(h))  # remark
    (elen,) = struct.unpack(">i", take(4))
    ext: dict[str, str | None] = {}
    if elen > 0:
        if elen > len(h):
            raise Unreadable("extFields length")
        end = pos + elen
        while pos < end:
            k = read_str(True, elen)
            v = read_str(False, elen)
            ext[k] = v  # type: ignore[index]
    return _request_reading(code, flag, opaque, ext)


def broker_reading(frame: bytes) -> Reading:
    """What a broker reads from one whole frame's header; :class:`Unreadable` if it cannot."""
    if len(frame) < 8:
        raise Unreadable("short frame")
    length, mark = struct.unpack_from(">ii", frame)
    hlen = mark & 0xFFFFFF
    if length + 4 != len(frame) or hlen > length - 4:
        raise Unreadable("frame lengths")
    header = frame[8 : 8 + hlen]
    stype = (mark >> 24) & 0xFF
    if stype == 0:
        return _json_reading(header)
    if stype == 1:
        return _binary_reading(header)
    raise Unreadable("serialize type")


# ---------------------------------------------------------------------------------------------
# What the scanners read


@dataclass(frozen=True)
class Verdict:
    event: int
    a: int
    b: int
    error: str
    code: int
    flag: int
    opaque: int
    topics: tuple[bytes, ...]
    limited: int
    #: the event of a scanner with no policy codes and [delay] topics DELAY_TOPICS (0: EV_FORWARD)
    delayed: int = 0
    #: the event of that scanner for this frame with ``policy_topics`` SEND_TOPICS as well
    sent: int = 0
    #: messages counted under the frame's topic
    messages: int = 0


def _limiter(compiled: bool) -> Any:
    shm = limits.new_shared_memory("compiled" if compiled else "python")
    lim = limits.limiter_class(compiled)(shm)
    lim.configure(RULES)
    return lim


class Twins:
    """Both scanners, set up so that every accepted frame stops for policy (its reading shows)."""

    def __init__(self) -> None:
        self.impls: list[tuple[Any, Any, bool]] = [(_scan_py.FrameScanner, _scan_py.ScanStats, False)]
        compiled = codec.compiled_twin()
        if compiled is not None:
            self.impls.append((compiled.FrameScanner, compiled.ScanStats, True))
        self.limiters = [_limiter(compiled) for _, _, compiled in self.impls]
        self.actions = bytes([codec.ACTION_POLICY]) * codec.CODE_SLOTS

    def scan(self, frame: bytes) -> list[Verdict]:
        out = []
        for (scanner_cls, stats_cls, _), lim in zip(self.impls, self.limiters, strict=True):
            stats = stats_cls()
            sc = scanner_cls(stats, actions=self.actions, response_policy=True, limiter=lim)
            ev, a, b = sc.scan(frame, 0, len(frame), 1)
            ds = scanner_cls(stats_cls())
            ds.delay_topics = list(DELAY_TOPICS)
            delayed = ds.scan(frame, 0, len(frame), 1)[0]
            ds = scanner_cls(stats_cls())
            ds.delay_topics = list(DELAY_TOPICS)
            ds.policy_topics = list(SEND_TOPICS)
            out.append(Verdict(ev, a, b, sc.error, sc.code, sc.flag, sc.opaque,
                               tuple(sorted(t[0] for t in stats.topics())), sc.limited, delayed,
                               ds.scan(frame, 0, len(frame), 1)[0], sum(t[2] for t in stats.topics())))
        return out


def expected_limit(r: Reading) -> int:
    """The rule of RULES the broker's reading makes the limiter pick (-1: none)."""
    if r.code not in STORED_CODES or r.flag & 1 or r.topic is None:
        return -1
    if r.topic == "TopicB" and r.tag == "TagX":
        return 1
    if r.topic == "TopicA":
        return 0
    return -1


def check(twins: Twins, frame: bytes) -> str | None:
    """None when the twins agree with each other and with the broker; else what differs."""
    verdicts = twins.scan(frame)
    if len(verdicts) == 2 and verdicts[0] != verdicts[1]:
        return f"twins disagree: py={verdicts[0]} c={verdicts[1]}"
    v = verdicts[-1]
    if v.event == codec.EV_ERROR:
        return None  # refused: the connection is closed, nothing is forwarded
    if v.event != codec.EV_POLICY or (v.a, v.b) != (0, len(frame)):
        return f"a whole frame did not come out whole: {v}"
    try:
        r = broker_reading(frame)
    except Unreadable as e:
        return f"accepted a frame the broker cannot read ({e}): {v}"
    if (v.code, v.flag, v.opaque) != (r.code, r.flag, r.opaque):
        return f"code/flag/opaque {v.code}/{v.flag}/{v.opaque}, broker reads {r.code}/{r.flag}/{r.opaque}"
    if not r.flag & 1 and r.code in (10, 310, 320, 11, 361):
        want = () if r.topic is None or len(r.topic.encode()) > 255 else (r.topic.encode(),)
        if v.topics != want:
            return f"counted topics {v.topics}, broker reads topic {r.topic!r}"
    if v.limited != expected_limit(r):
        return f"limit rule {v.limited}, broker's reading (topic {r.topic!r}, tag {r.tag!r}) gives {expected_limit(r)}"
    held = (not r.flag & 1 and r.code in (10, 310, 320) and r.topic is not None
            and (r.topic == "TopicA" or r.topic.startswith("TopicC")) and (r.batch or r.delay))
    if v.delayed != (codec.EV_POLICY if held else codec.EV_FORWARD):
        return f"[delay] scanner event {v.delayed}, broker's reading (topic {r.topic!r}, delay {r.delay}) holds: {held}"
    sent = held or (not r.flag & 1 and r.code in STORED_CODES and r.topic is not None
                    and (r.topic == "TopicB" or r.topic.startswith("TopicA")))
    if v.sent != (codec.EV_POLICY if sent else codec.EV_FORWARD):
        return f"policy_topics scanner event {v.sent}, broker's reading (topic {r.topic!r}) sends it to policy: {sent}"
    if not r.flag & 1 and r.code in codes.SEND_CODES and r.topic is not None and len(r.topic.encode()) <= 255:
        want_msgs = _batch_records(frame) if r.batch else 1
        if v.messages != want_msgs:
            return f"counted {v.messages} messages, broker reads {want_msgs} (batch: {r.batch})"
    return None


# ---------------------------------------------------------------------------------------------
# Inputs


def frame_of(header: bytes, stype: int = 0, body: bytes = b"") -> bytes:
    return struct.pack(">ii", 4 + len(header) + len(body), (stype << 24) | len(header)) + header + body


def batch_body(n: int) -> bytes:
    """A body of ``n`` MessageDecoder.encodeMessages records (no properties)."""
    rec = struct.pack(">iiiii", 20 + 4 + 2, 0, 0, 0, 4) + b"body" + struct.pack(">h", 0)
    return rec * n


def _batch_records(frame: bytes) -> int:
    """How many messages the broker decodes from a batch frame's body (MessageDecoder.decodeMessages)."""
    from rmqfast.codec.batch import decode_batch

    hlen = struct.unpack_from(">i", frame, 4)[0] & 0xFFFFFF
    try:
        return len(decode_batch(frame[8 + hlen :]))
    except ValueError:
        return -1


#: values of a batch flag (``m``, ``batch``): Boolean.parseBoolean reads only "true" in any case
FLAG_VALUES = ("true", "TRUE", "True", "false", "FALSE", "", "1", "yes", "tru", "true ", " true", "truex")


def _flag_pair(code: int, rng: random.Random) -> tuple[str, str]:
    """A batch flag for ``code``: mostly its own key, now and then the other header's."""
    key = "batch" if code in (10, 324) else "m"
    if rng.random() < 0.15:
        key = "m" if key == "batch" else "batch"
    return key, rng.choice(FLAG_VALUES)


def _props(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 4)):
        k = rng.choice(["TAGS", "KEYS", "UNIQ_KEY", "WAIT", "TAGSX", "gray", "", *DELAY_NAMES, "TIMER_DELAY_SECS",
                        "DELA"])
        v = rng.choice([*TAGS, "", "v", "TagX\x01x", "\u4e2d", "a<b&c>"])
        parts.append(f"{k}\x01{v}")
    return "\x02".join(parts) + rng.choice(["", "\x02"])


def _base_pairs(rng: random.Random) -> list[tuple[str, Any]]:
    code = rng.choice([10, 310, 320, 324, 325, 11, 361, 25, 26, 34, 105, 318, 0])
    topic_key = "b" if code in (310, 320, 325) else "topic"
    props_key = "i" if code in (310, 320, 325) else "properties"
    ext: list[tuple[str, Any]] = [("a", "PG"), (topic_key, rng.choice(TOPICS)), (props_key, _props(rng))]
    if rng.random() < 0.6:
        ext.append(_flag_pair(code, rng))
    rng.shuffle(ext)
    pairs = [("code", code), ("extFields", ext), ("flag", rng.choice([0, 0, 2, 1])),
             ("language", rng.choice(["JAVA", "GO", "CPP"])), ("opaque", rng.randint(-5, 100000)),
             ("serializeTypeCurrentRPC", "JSON"), ("version", rng.choice([401, 317, 0]))]
    rng.shuffle(pairs)
    return pairs


def _encode_str(s: str, rng: random.Random, style: str) -> str:
    if style == "java":  # fastjson: control characters as \\uXXXX, the rest raw
        return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or c in '"\\' else c for c in s) + '"'
    if style == "go":  # encoding/json: also <, >, & escaped
        return json.dumps(s, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    if style == "ascii":
        return json.dumps(s)
    return json.dumps(s, ensure_ascii=False)


@dataclass(frozen=True)
class Raw:
    """JSON text written as it is (an intentionally escaped value)."""

    text: str


def _encode(value: Any, rng: random.Random, style: str) -> str:
    """Keys are written raw (they are ASCII names, or tricks that carry their own escapes)."""
    if isinstance(value, list):
        sep = rng.choice([",", ", ", ",\n  "])
        return "{" + sep.join(f'"{k}":{_encode(v, rng, style)}' for k, v in value) + "}"
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, str):
        return _encode_str(value, rng, style)
    return json.dumps(value)


def _escape_some(s: str, rng: random.Random) -> str:
    return "".join(f"\\u{ord(c):04x}" if rng.random() < 0.5 else c for c in s)


_KEY_TRICKS = (
    lambda k: k.upper(), lambda k: k.capitalize(), lambda k: k[:1] + "_" + k[1:], lambda k: "-" + k,
    lambda k: "is" + k.capitalize(), lambda k: "".join(f"\\u{ord(c):04x}" for c in k),
    lambda k: k[:1] + f"\\u{ord(k[1]):04x}" + k[2:] if len(k) > 1 else k, lambda k: k + " ",
    lambda k: k[:1] + "\\/" + k[1:],
    lambda k: k.replace("e", "\u0435"),  # a Cyrillic look-alike
)
_RAW_TRICKS = (
    b"'", b"\\x", b"\\x22", b"\\'", b"/*c*/", b"\x0c", b"\x00", b"\xc0\xa2", b"\xed\xa0\x80", b"\xff",
    b"\\ud800", b"\\udc00x", b"NaN", b"01", b"1e5", b"-", b"+1", b"[", b"{", b"}", b"]", b",", b":",
    b'"', b"\\", b"\\u00", b"true", b"nul", b"\\u0002TAGS\\u0001TagX", b"\x02TAGS\x01TagX",
)


def json_case(rng: random.Random) -> bytes:
    """A JSON header shaped like a real client's, with smuggling tricks applied."""
    pairs = _base_pairs(rng)
    style = rng.choice(["java", "go", "ascii", "raw"])
    ops = rng.randint(0, 3)
    for _ in range(ops):
        op = rng.randrange(6)
        if op == 0:  # duplicate a top-level field with another value, before or after
            name = rng.choice(["code", "flag", "opaque", "extFields"])
            val: Any = rng.choice([25, 26, 34, 1, 0, 310]) if name != "extFields" else [("b", rng.choice(TOPICS))]
            pairs.insert(rng.choice([0, len(pairs)]), (name, val))
        elif op == 1:  # duplicate an extFields value
            ext = next((v for k, v in pairs if k == "extFields" and isinstance(v, list)), None)
            if ext is not None:
                ext.insert(rng.choice([0, len(ext)]), (rng.choice(["b", "topic", "i", "properties", "m", "batch"]),
                                                        rng.choice([*TOPICS, f"TAGS\x01{rng.choice(TAGS)}", "true"])))
        elif op == 2:  # a trick on a key
            idx = rng.randrange(len(pairs))
            k, v = pairs[idx]
            pairs[idx] = (rng.choice(_KEY_TRICKS)(k), v)
        elif op == 3:  # an escaped topic or tag
            ext = next((v for k, v in pairs if k == "extFields" and isinstance(v, list)), None)
            if ext:
                j = rng.randrange(len(ext))
                k, v = ext[j]
                if isinstance(v, str):
                    ext[j] = (k, Raw('"' + _escape_some(v, rng) + '"'))
        else:
            pass
    out = _encode(pairs, rng, style).encode("utf-8", errors="surrogatepass")
    for _ in range(rng.choice([0, 0, 1, 2])):  # raw byte tricks
        pos = rng.randrange(len(out) + 1)
        out = out[:pos] + rng.choice(_RAW_TRICKS) + out[pos + rng.choice([0, 0, 1]) :]
    return out


def binary_case(rng: random.Random) -> bytes:
    """A ROCKETMQ binary header, with duplicate keys and lying lengths now and then."""
    code = rng.choice([10, 310, 320, 11, 25, 26, 34])
    topic_key = "b" if code in (310, 320) else "topic"
    props_key = "i" if code in (310, 320) else "properties"
    items = [("a", "PG"), (topic_key, rng.choice(TOPICS)), (props_key, _props(rng))]
    if rng.random() < 0.6:
        items.insert(rng.randrange(len(items) + 1), _flag_pair(code, rng))
    if rng.random() < 0.3:
        items.insert(rng.choice([0, len(items)]), (rng.choice(["b", "topic", "i", "properties", "m", "batch"]),
                                                   rng.choice([*TOPICS, "true"])))
    if rng.random() < 0.1:
        items.append((rng.choice(["b", "topic"]), ""))
    ext = b"".join(struct.pack(">H", len(k.encode())) + k.encode() + struct.pack(">i", len(v.encode())) + v.encode()
                   for k, v in items)
    remark = rng.choice([b"", b"r", b"remark"])
    h = bytearray(struct.pack(">hbhii", code, 0, 401, rng.randint(0, 99), rng.choice([0, 0, 1, 2]))
                  + struct.pack(">i", len(remark)) + remark + struct.pack(">i", len(ext)) + ext)
    for _ in range(rng.choice([0, 0, 1, 2])):  # lie about a length, or flip a byte
        pos = rng.randrange(len(h))
        if rng.random() < 0.5:
            h[pos] = rng.randrange(256)
        else:
            h[pos : pos + 1] = b""
    return bytes(h)


def case(rng: random.Random) -> bytes:
    body = batch_body(rng.randint(0, 3)) if rng.random() < 0.7 else b""
    if rng.random() < 0.25:
        return frame_of(binary_case(rng), 1, body)
    return frame_of(json_case(rng), 0, body)


def run(seconds: float, seed: int, max_inputs: int | None = None) -> tuple[int, int, list[str]]:
    """Fuzz for ``seconds`` (or ``max_inputs``): (inputs run, inputs accepted, failures)."""
    rng = random.Random(seed)
    twins = Twins()
    n = accepted = 0
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (max_inputs is None or n < max_inputs):
        frame = case(rng)
        n += 1
        why = check(twins, frame)
        if why is not None:
            failures.append(f"{why}\n  frame: {frame!r}")
            if len(failures) >= 20:
                break
        elif twins.scan(frame)[-1].event != codec.EV_ERROR:
            accepted += 1
    return n, accepted, failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args(argv)
    n, accepted, failures = run(args.seconds, args.seed)
    print(f"seed {args.seed}: {n} inputs, {accepted} accepted, {n - accepted} refused, {len(failures)} failures "
          f"(scanners: {'compiled and pure' if codec.compiled_twin() is not None else 'pure only'})")
    for f in failures:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
