"""One reading of a header: the scanners refuse what a broker could read differently.

The differential fuzzer (rmqfast.testing.header_fuzz) runs the compiled scanner, the pure twin and
an independent model of the broker's reading on the same generated headers; the hand-written
cases below are the smuggling variants found by attacking the proxy, each refused by both twins.
Longer runs: ``python -m rmqfast.testing.header_fuzz --seconds 600``.
"""

from __future__ import annotations

import os
import struct

import pytest

from rmqfast import codec
from rmqfast.codec import _header_py
from rmqfast.testing import header_fuzz


@pytest.fixture
def impl(twin):
    """(scanner class, stats class) of each twin (the ``twin`` fixture of tests/conftest.py)."""
    return twin.FrameScanner, twin.ScanStats


FUZZ_INPUTS = int(os.environ.get("RMQFAST_FUZZ_INPUTS", "5000"))
FUZZ_SEED = int(os.environ.get("RMQFAST_FUZZ_SEED", "20261123"))


def test_differential_fuzz_twins_and_broker_agree(capsys):
    n, accepted, failures = header_fuzz.run(seconds=600, seed=FUZZ_SEED, max_inputs=FUZZ_INPUTS)
    with capsys.disabled():
        print(f"\nheader fuzz: seed {FUZZ_SEED}, {n} inputs, {accepted} accepted, {n - accepted} refused")
    assert not failures, "\n".join(failures)
    assert n == FUZZ_INPUTS
    # the generator must exercise both sides of the decision
    assert accepted > n // 10 and n - accepted > n // 10


def test_fuzzer_catches_a_scanner_that_keeps_the_last_duplicate(monkeypatch):
    """The check is not vacuous: the old reading (last duplicate wins) is caught."""
    frame = header_fuzz.frame_of(b'{"code":25,"flag":0,"opaque":1,"code":34}')
    twins = header_fuzz.Twins()
    assert header_fuzz.check(twins, frame) is None  # refused: fine

    class LastWins(header_fuzz.Twins):
        def scan(self, frame: bytes) -> list[header_fuzz.Verdict]:
            return [header_fuzz.Verdict(codec.EV_POLICY, 0, len(frame), "", 34, 0, 1, (), -1)]

    assert "broker reads 25" in header_fuzz.check(LastWins(), frame)


def test_fuzzer_catches_a_delay_scanner_that_ignores_the_properties():
    """A [delay] topic's send without a delivery time stays on the fast path; holding it is caught."""
    header = (b'{"code":310,"extFields":{"b":"TopicA","i":"TAGS\\u0001TagY\\u0002DELAY\\u0001\\u0002"},'
              b'"flag":0,"opaque":1}')
    frame = header_fuzz.frame_of(header)
    assert header_fuzz.check(header_fuzz.Twins(), frame) is None

    class Eager(header_fuzz.Twins):
        def scan(self, frame: bytes) -> list[header_fuzz.Verdict]:
            return [header_fuzz.Verdict(codec.EV_POLICY, 0, len(frame), "", 310, 0, 1, (b"TopicA",), 0,
                                        codec.EV_POLICY)]

    assert "[delay] scanner" in header_fuzz.check(Eager(), frame)


def scan(impl, header: bytes, stype: int = 0) -> tuple[int, str]:
    scanner_cls, stats_cls = impl
    frame = header_fuzz.frame_of(header, stype)
    sc = scanner_cls(stats_cls())
    ev, _, _ = sc.scan(frame, 0, len(frame))
    return ev, sc.error


REFUSED_JSON = [
    # what reached a real broker through the old scanner
    (b'{"code":25,"flag":0,"opaque":1,"code":34}', "duplicate code/flag/opaque/extFields"),
    (b'{"\\u0063ode":25,"flag":0,"opaque":1,"code":34}', "escaped key"),
    (b'{"CODE":26,"flag":0,"opaque":1,"code":34}', "another case"),
    (b'{"code":25,"flag":0,"opaque":1,"flag":1}', "duplicate code/flag/opaque/extFields"),
    # more spellings fastjson's smart match accepts
    (b'{"Code":25,"code":34}', "another case"),
    (b'{"c_o-de":25,"code":34}', "another case"),
    (b'{"code":34,"isFlag":1}', "another case"),
    (b'{"code":34,"EXT_FIELDS":{"b":"T"}}', "another case"),
    (b'{"code":34,"extFields":{"b":"A"},"extFields":{"b":"B"}}', "duplicate code/flag/opaque/extFields"),
    # fastjson's extensions: refused rather than read two ways
    (b"{'code':25}", "key expected"),
    (b'{code:25}', "key expected"),
    (b'{"code":34,"x":"\\x22"}', "escape other than"),
    (b'{"code":34,"x":[\'"\'],"code":25}', "unexpected character"),
    (b'{"code":34 /* c */}', "',' or '}' expected"),
    (b'{"code":034}', "integer expected"),
    (b'{"code":"25"}', "integer expected"),
    (b'{"code":34,"x":NaN}', "unexpected character"),
    (b'{"code":34,"x":"\xc0\xa2"}', "invalid UTF-8"),
    (b'{"code":34,"x":"\xed\xa0\x80"}', "invalid UTF-8"),
    (b'{"code":34,"x":"\\ud800"}', "escape other than"),
    (b'{"code":34,"x":"a\x01b"}', "raw control character"),
    (b'\x0c{"code":34}', "header is not a JSON object"),
    (b'{"code":34,"x":' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than 32 levels"),
    # extFields read by a HashMap: no escaped keys, no duplicates, strings only
    (b'{"code":310,"extFields":{"\\u0062":"TopicA","b":"TopicC"}}', "escaped extFields key"),
    (b'{"code":310,"extFields":{"b":"TopicA","b":"TopicC"}}', "duplicate extFields key"),
    (b'{"code":310,"extFields":{"i":"TAGS\\u0001A","i":"TAGS\\u0001B"}}', "duplicate extFields key"),
    (b'{"code":310,"extFields":{"b":123}}', "is not a string"),
    (b'{"code":310,"extFields":{"b":"Topic\\u0041"}}', "escaped topic in a send or pull"),
    (b'{"code":11,"extFields":{"topic":"T\\u006fpic"}}', "escaped topic in a send or pull"),
]


@pytest.mark.parametrize("header,why", REFUSED_JSON)
def test_ambiguous_json_headers_are_refused_by_both_twins(impl, header, why):
    ev, error = scan(impl, header)
    assert ev == codec.EV_ERROR
    assert error.startswith("invalid JSON header: ") and why in error


ACCEPTED_JSON = [
    # what real clients send: fastjson (Java), encoding/json (Go), jsoncpp (C++, with newlines)
    b'{"code":310,"extFields":{"a":"PG","b":"TopicA","i":"TAGS\\u0001TagA\\u0002KEYS\\u0001k"},"flag":0,'
    b'"language":"JAVA","opaque":42,"serializeTypeCurrentRPC":"JSON","version":401}',
    b'{"code":310,"language":"GO","version":317,"opaque":7,"flag":0,"remark":"",'
    b'"extFields":{"b":"TopicA","i":"k\\u0001a\\u003cb\\u0026c\\u003e\\u0002TAGS\\u0001\xe4\xb8\xad"}}',
    b'{\n   "code" : 34,\n   "extFields" : null,\n   "flag" : 0,\n   "language" : "CPP",\n   "opaque" : 3\n}\n',
    b'{"code":34,"x":[1,-0.5e+3,true,false,null,{"a":[]},{}],"y":"\\ud83d\\ude00 \\" \\\\ \\/ \\b\\f\\n\\r\\t"}',
    b'{"code":-1,"flag":-2147483648,"opaque":2147483647,"remark":"caf\xc3\xa9 \xf0\x9f\x98\x80"}',
]


@pytest.mark.parametrize("header", ACCEPTED_JSON)
def test_client_headers_are_accepted_by_both_twins(impl, header):
    ev, error = scan(impl, header)
    assert (ev, error) == (codec.EV_FORWARD, "")
    assert header_fuzz.broker_reading(header_fuzz.frame_of(header)).code == _code_of(header)


def _code_of(header: bytes) -> int:
    info = _header_py.HeaderInfo()
    _header_py.parse_json_header(header, info)
    return info.code


def binary_header(code: int, ext: list[tuple[bytes, bytes]], remark: bytes = b"", ext_len_delta: int = 0,
                  trailing: bytes = b"", klen_override: int | None = None) -> bytes:
    eb = b"".join(struct.pack(">H", klen_override if klen_override is not None else len(k)) + k
                  + struct.pack(">i", len(v)) + v for k, v in ext)
    return (struct.pack(">hbhii", code, 0, 401, 1, 0) + struct.pack(">i", len(remark)) + remark
            + struct.pack(">i", len(eb) + ext_len_delta) + eb + trailing)


REFUSED_BINARY = [
    (binary_header(310, [(b"b", b"TopicA"), (b"b", b"TopicC")]), "duplicate binary extFields key"),
    (binary_header(310, [(b"b", b"TopicA")], trailing=b"\x00\x01b"), "bytes after extFields"),
    (binary_header(310, [(b"b", b"TopicA")], ext_len_delta=-3), "bytes after extFields"),
    (binary_header(310, [(b"b", b"TopicA")], ext_len_delta=4), "extFields length out of bounds"),
    (binary_header(310, [(b"b", b"Topic\xff")]), "invalid UTF-8"),
    (binary_header(310, [(b"b" * 0x8000, b"x")]), "extFields key out of bounds"),
    (struct.pack(">hbhii", 25, 0, 401, 1, 0) + struct.pack(">i", -1) + struct.pack(">i", 0), "remark length"),
]


@pytest.mark.parametrize("header,why", REFUSED_BINARY)
def test_lying_binary_headers_are_refused_by_both_twins(impl, header, why):
    ev, error = scan(impl, header, stype=1)
    assert ev == codec.EV_ERROR
    assert error.startswith("invalid ROCKETMQ header: ") and why in error


def test_binary_empty_value_reads_as_absent_like_java(impl):
    """Java's decoder reads a zero-length value as null: no topic is counted."""
    scanner_cls, stats_cls = impl
    frame = header_fuzz.frame_of(binary_header(310, [(b"a", b"PG"), (b"b", b"")]), 1)
    stats = stats_cls()
    sc = scanner_cls(stats)
    assert sc.scan(frame, 0, len(frame))[0] == codec.EV_FORWARD
    assert stats.topics() == []
