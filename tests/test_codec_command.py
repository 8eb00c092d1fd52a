"""Whole-frame codec: JSON and ROCKETMQ headers (``RemotingCommand``, ``RocketMQSerializable``)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rmqfast.codec.codes import (
    LANGUAGES,
    POP_MESSAGE,
    SERIALIZE_JSON,
    SERIALIZE_ROCKETMQ,
    SYSTEM_BUSY,
)
from rmqfast.codec.command import (
    RemotingCommand,
    decode_frame,
    decode_header,
    encode,
    encode_header,
    fastjson_quote,
    make_response,
)
from rmqfast.errors import FrameError, FrameTooLarge, HeaderError


def frame(header: bytes, body: bytes = b"", stype: int = SERIALIZE_JSON) -> bytes:
    """Wrap a header and body as ``RemotingCommand.encode`` does."""
    return (struct.pack(">i", 4 + len(header) + len(body))
            + struct.pack(">I", (stype << 24) | len(header)) + header + body)


# Headers written the way fastjson 1.2.83 writes a RemotingCommand: getters sorted by name,
# null remark/extFields omitted, default escaping (\u0001 for the properties separators).
SEND_V2_HEADER = (
    b'{"code":310,"extFields":{"a":"PG","b":"TopicTest","c":"TBW102","d":"4","e":"1","f":"0",'
    b'"g":"1700000000000","h":"0","i":"KEYS\\u0001k1\\u0002UNIQ_KEY\\u0001AC11000100002A9F0000'
    b'000000000001\\u0002WAIT\\u0001true\\u0002TAGS\\u0001TagA\\u0002","j":"0","k":"false",'
    b'"m":"false","n":"broker-a"},"flag":0,"language":"JAVA","opaque":7,'
    b'"serializeTypeCurrentRPC":"JSON","version":435}'
)
SEND_RESPONSE_HEADER = (
    b'{"code":0,"extFields":{"queueId":"1","TRACE_ON":"true","MSG_REGION":"DefaultRegion",'
    b'"msgId":"C0A8000100002A9F00000000000004D2","queueOffset":"42"},"flag":1,'
    b'"language":"JAVA","opaque":7,"serializeTypeCurrentRPC":"JSON","version":435}'
)
TOPIC_NOT_EXIST_HEADER = (
    b'{"code":17,"flag":1,"language":"JAVA","opaque":8,"remark":"No topic route info in name '
    b'server for the topic: T\\nSee http://rocketmq.apache.org/docs/faq/ for further details.",'
    b'"serializeTypeCurrentRPC":"JSON","version":435}'
)
GO_PULL_HEADER = (
    b'{"code":11,"extFields":{"consumerGroup":"g","topic":"T","queueId":"0","queueOffset":"0",'
    b'"maxMsgNums":"32","sysFlag":"2","commitOffset":"0","suspendTimeoutMillis":"20000",'
    b'"subscription":"*","subVersion":"0","expressionType":"TAG"},"flag":0,"language":"GO",'
    b'"opaque":1,"serializeTypeCurrentRPC":"JSON","version":317}'
)
ESCAPES_HEADER = (
    '{"code":12,"extFields":{"k\\"ey":"a\\\\b/c\\u001F\\u007F\\u2028é"},"flag":2,'
    '"language":"JAVA","opaque":-5,"remark":"","serializeTypeCurrentRPC":"JSON","version":0}'
).encode()


@pytest.mark.parametrize(
    "header",
    [SEND_V2_HEADER, SEND_RESPONSE_HEADER, TOPIC_NOT_EXIST_HEADER, GO_PULL_HEADER,
     ESCAPES_HEADER],
)
def test_java_shaped_json_frames_round_trip_byte_for_byte(header: bytes) -> None:
    raw = frame(header, b"body bytes")
    assert encode(decode_frame(raw)) == raw


def test_decode_send_v2() -> None:
    cmd = decode_frame(frame(SEND_V2_HEADER, b"Hello"))
    assert (cmd.code, cmd.language, cmd.version, cmd.opaque, cmd.flag) == (310, "JAVA", 435, 7, 0)
    assert cmd.remark is None and cmd.body == b"Hello"
    assert cmd.serialize_type == SERIALIZE_JSON
    assert cmd.ext_fields is not None
    assert cmd.ext_fields["b"] == "TopicTest"
    assert cmd.ext_fields["i"].startswith("KEYS\x01k1\x02UNIQ_KEY\x01")
    assert not cmd.is_response and not cmd.is_oneway


def test_decode_response_flags_and_remark() -> None:
    cmd = decode_frame(frame(TOPIC_NOT_EXIST_HEADER))
    assert cmd.is_response and cmd.code == 17 and cmd.ext_fields is None
    assert cmd.remark is not None and "\nSee http://" in cmd.remark
    oneway = decode_frame(frame(ESCAPES_HEADER))
    assert oneway.is_oneway and oneway.remark == "" and oneway.opaque == -5
    assert oneway.ext_fields == {'k"ey': "a\\b/c\x1f\x7f\u2028é"}


def binary_header(code: int, lang: int, version: int, opaque: int, flag: int,
                  remark: bytes, ext: list[tuple[bytes, bytes]]) -> bytes:
    """A ROCKETMQ header, field by field as ``rocketMQProtocolEncode`` writes it."""
    ext_bytes = b"".join(struct.pack(">h", len(k)) + k + struct.pack(">i", len(v)) + v
                         for k, v in ext)
    return (struct.pack(">h", code) + struct.pack(">B", lang) + struct.pack(">h", version)
            + struct.pack(">i", opaque) + struct.pack(">i", flag)
            + struct.pack(">i", len(remark)) + remark
            + struct.pack(">i", len(ext_bytes)) + ext_bytes)


def test_binary_header_java_shaped() -> None:
    header = binary_header(310, 0, 435, 9, 0, b"", [(b"a", b"PG"), (b"b", b"TopicTest"),
                                                    (b"i", b"TAGS\x01A\x02")])
    raw = frame(header, b"xyz", SERIALIZE_ROCKETMQ)
    cmd = decode_frame(raw)
    assert cmd == RemotingCommand(
        code=310, language="JAVA", version=435, opaque=9, flag=0, remark=None,
        ext_fields={"a": "PG", "b": "TopicTest", "i": "TAGS\x01A\x02"}, body=b"xyz",
        serialize_type=SERIALIZE_ROCKETMQ,
    )
    assert encode(cmd) == raw
    assert len(binary_header(0, 0, 0, 0, 0, b"", [])) == 21  # the fixed part


def test_binary_response_with_remark_and_go_language() -> None:
    header = binary_header(2, 9, 317, -1, 3, "busy é".encode(), [])
    cmd = decode_frame(frame(header, stype=SERIALIZE_ROCKETMQ))
    assert (cmd.language, cmd.remark, cmd.ext_fields, cmd.opaque) == ("GO", "busy é", None, -1)
    assert cmd.is_response and cmd.is_oneway


def test_binary_unknown_language_and_empty_strings() -> None:
    header = binary_header(-3, 200, -1, 0, 0, b"", [(b"", b""), (b"k", b"")])
    cmd = decode_frame(frame(header, stype=SERIALIZE_ROCKETMQ))
    assert cmd.code == -3 and cmd.version == -1  # both int16, signed as in Java
    assert cmd.language == "UNKNOWN_200"
    assert cmd.ext_fields == {"": "", "k": ""}
    assert encode(cmd) == frame(header, stype=SERIALIZE_ROCKETMQ)


# --- leniency ---------------------------------------------------------------------------


def test_json_leniency_like_fastjson() -> None:
    header = (b'{"code":"105","extFields":{"n":12,"f":1.50,"e":1E3,"t":true,"z":null,'
              b'"o":{"x":[1,2.0,"s"]}},"language":9,"remark":42,"unknownKey":[1],'
              b'"serializeTypeCurrentRPC":"ROCKETMQ"}')
    cmd = decode_frame(frame(header))
    assert cmd.code == 105 and cmd.language == "GO"
    assert (cmd.version, cmd.opaque, cmd.flag) == (0, 0, 0)
    assert cmd.remark == "42"
    assert cmd.ext_fields == {"n": "12", "f": "1.50", "e": "1E3", "t": "true",
                              "o": '{"x":[1,2.0,"s"]}'}
    assert cmd.serialize_type == SERIALIZE_JSON  # the frame's type byte decides


def test_json_missing_language_is_java() -> None:
    assert decode_frame(frame(b'{"code":1}')).language == "JAVA"
    assert decode_frame(frame(b'{"code":1,"language":"NODE_JS2"}')).language == "NODE_JS2"


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b'{"code":1,', r"not valid JSON: Expecting property name .* at offset 18"),
        (b"[1,2]", r"JSON header at offset 8 is a list; expected an object"),
        (b'{"flag":0}', r"has no 'code'"),
        (b'{"code":1.5}', r"'code' is '1.5'; expected an integer"),
        (b'{"code":true}', r"'code' is True; expected an integer"),
        (b'{"code":"x"}', r"'code' is 'x'; expected an integer"),
        (b'{"code":4294967296}', r"does not fit an int32"),
        (b'{"code":1,"extFields":[1]}', r"extFields is a list; expected an object"),
        (b'{"code":1,"language":99}', r"language ordinal 99 is not one of 0..13"),
        (b'{"code":1,"language":[1]}', r"language is \[1\]; expected a name"),
        (b'{"code":"1","opaque":"x"}', r"'opaque' is 'x'"),
    ],
)
def test_json_header_errors(header: bytes, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        decode_frame(frame(header))


# --- frame checks -----------------------------------------------------------------------


def test_frame_errors() -> None:
    good = frame(b'{"code":1}', b"b")
    with pytest.raises(FrameError, match="shorter than its 8-byte"):
        decode_frame(good[:7])
    with pytest.raises(FrameError, match=r"length word at offset 0 is 15, but 14 bytes follow"):
        decode_frame(good[:-1])
    with pytest.raises(FrameTooLarge, match="frame of 19 bytes exceeds the limit of 18 bytes"):
        decode_frame(good, max_frame_size=18)
    assert decode_frame(good, max_frame_size=19).body == b"b"
    with pytest.raises(FrameTooLarge, match="header of 10 bytes exceeds the limit of 9"):
        decode_frame(good, max_header_size=9)
    bad_type = bytearray(good)
    bad_type[4] = 7
    with pytest.raises(FrameError, match=r"unknown serialize type 7 .* offset 4"):
        decode_frame(bytes(bad_type))
    long_header = bytearray(good)
    long_header[5:8] = (13).to_bytes(3, "big")
    with pytest.raises(FrameError, match=r"header length 13 at offset 4 exceeds the 11 bytes"):
        decode_frame(bytes(long_header))
    assert decode_frame(bytearray(good)) == decode_frame(memoryview(good))


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"\x00" * 20, r"is 20 bytes; the fixed part needs 21"),
        (binary_header(1, 0, 0, 0, 0, b"abc", [])[:-5] + b"\x00" * 4,
         r"remark length 3 at offset 21 is negative or leaves no room"),
        (binary_header(1, 0, 0, 0, 0, b"", []) + b"\x00",
         r"extFields length 0 at offset 25 should be the 1 bytes left"),
        (binary_header(1, 0, 0, 0, 0, b"", [])[:-4] + struct.pack(">i", 8)
         + b"\x00\x09k" + struct.pack(">i", 1) + b"v",
         r"key length 9 at offset 29 is negative or runs past the extFields end at offset 37"),
        (binary_header(1, 0, 0, 0, 0, b"", [(b"k", b"v")])[:-5] + struct.pack(">i", 9) + b"v",
         r"value length 9 of key 'k' at offset 32 is negative or runs past"),
        (binary_header(1, 0, 0, 0, 0, b"", [(b"k", b"v")]) + b"\x00",
         r"extFields length 8 at offset 25 should be the 9 bytes left"),
    ],
)
def test_binary_header_errors(header: bytes, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        decode_frame(frame(header, stype=SERIALIZE_ROCKETMQ))


def test_binary_ext_cut_before_key_length() -> None:
    header = binary_header(1, 0, 0, 0, 0, b"", [])[:-4] + struct.pack(">i", 1) + b"\x00"
    with pytest.raises(HeaderError, match=r"entry at offset 29 is cut off"):
        decode_frame(frame(header, stype=SERIALIZE_ROCKETMQ))


def test_decode_header_alone_counts_offsets_from_header() -> None:
    with pytest.raises(HeaderError, match="at offset 10"):
        decode_header(b'{"code":1,', SERIALIZE_JSON)
    assert decode_header(b'{"code":5}', SERIALIZE_JSON).code == 5
    with pytest.raises(FrameError, match="unknown serialize type 2"):
        decode_header(b"", 2)


# --- encoding ---------------------------------------------------------------------------


def test_json_encoding_shape() -> None:
    cmd = RemotingCommand(code=34, version=435, opaque=3, remark="hi", ext_fields={},
                          body=b"{}")
    assert encode_header(cmd) == (b'{"code":34,"extFields":{},"flag":0,"language":"JAVA",'
                                  b'"opaque":3,"remark":"hi","serializeTypeCurrentRPC":"JSON",'
                                  b'"version":435}')
    assert encode(cmd)[-2:] == b"{}"


def test_rocketmq_refuses_pop_codes() -> None:
    cmd = RemotingCommand(code=POP_MESSAGE, serialize_type=SERIALIZE_ROCKETMQ)
    with pytest.raises(FrameError, match=r"code 200050 does not fit an int16.*SERIALIZE_JSON"):
        encode(cmd)
    with pytest.raises(FrameError, match="version 40000 does not fit an int16"):
        encode(RemotingCommand(code=1, version=40000, serialize_type=SERIALIZE_ROCKETMQ))
    with pytest.raises(FrameError, match="language 'KLINGON' has no ROCKETMQ ordinal"):
        encode(RemotingCommand(code=1, language="KLINGON", serialize_type=SERIALIZE_ROCKETMQ))


def test_encode_range_and_type_checks() -> None:
    with pytest.raises(FrameError, match="opaque 2147483648 does not fit an int32"):
        encode(RemotingCommand(code=1, opaque=2**31))
    with pytest.raises(FrameError, match="unknown serialize type 3"):
        encode(RemotingCommand(code=1, serialize_type=3))
    with pytest.raises(FrameError, match="keys and values must be str"):
        encode(RemotingCommand(code=1, ext_fields={"a": 1}))  # type: ignore[dict-item]


def test_fastjson_quote() -> None:
    assert fastjson_quote('a"b\\c/d') == '"a\\"b\\\\c/d"'
    assert fastjson_quote("\b\t\n\f\r\x00\x0b\x1f") == '"\\b\\t\\n\\f\\r\\u0000\\u000B\\u001F"'
    assert fastjson_quote("\x7f\x9f\xa0é\u2028\u2029😀") == '"\\u007F\\u009F\xa0é\\u2028\\u2029😀"'
    assert fastjson_quote("a/é😀", browser_compatible=True) == '"a\\/\\u00E9\\uD83D\\uDE00"'


# --- responses --------------------------------------------------------------------------


def test_make_response() -> None:
    req = decode_frame(frame(binary_header(310, 9, 317, 77, 0, b"", [(b"a", b"b")]),
                             stype=SERIALIZE_ROCKETMQ))
    resp = make_response(req, SYSTEM_BUSY, "rate limited", {"MSG_REGION": "r"})
    assert resp == RemotingCommand(code=SYSTEM_BUSY, language="JAVA", version=317, opaque=77,
                                   flag=1, remark="rate limited",
                                   ext_fields={"MSG_REGION": "r"},
                                   serialize_type=SERIALIZE_ROCKETMQ)
    assert resp.is_response
    assert decode_frame(encode(resp)) == resp
    assert make_response(req, 200000).serialize_type == SERIALIZE_JSON
    json_req = RemotingCommand(code=POP_MESSAGE, opaque=5, version=435)
    pop_resp = make_response(json_req, 0, body=b"records")
    assert (pop_resp.serialize_type, pop_resp.opaque, pop_resp.body) == (SERIALIZE_JSON, 5,
                                                                         b"records")


# --- property tests ---------------------------------------------------------------------

_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=20)
_i32 = st.integers(-(2**31), 2**31 - 1)
_i16 = st.integers(-(2**15), 2**15 - 1)

json_commands = st.builds(
    RemotingCommand,
    code=_i32,
    language=st.one_of(st.sampled_from(LANGUAGES), _text),
    version=_i32, opaque=_i32, flag=_i32,
    remark=st.one_of(st.none(), _text),
    ext_fields=st.one_of(st.none(), st.dictionaries(_text, _text, max_size=6)),
    body=st.binary(max_size=50),
    serialize_type=st.just(SERIALIZE_JSON),
)
# ROCKETMQ cannot tell "" from null for the remark, nor {} from a null map.
binary_commands = st.builds(
    RemotingCommand,
    code=_i16,
    language=st.one_of(st.sampled_from(LANGUAGES),
                       st.integers(len(LANGUAGES), 255).map(lambda n: f"UNKNOWN_{n}")),
    version=_i16, opaque=_i32, flag=_i32,
    remark=st.one_of(st.none(), _text.filter(bool)),
    ext_fields=st.one_of(st.none(), st.dictionaries(_text, _text, min_size=1, max_size=6)),
    body=st.binary(max_size=50),
    serialize_type=st.just(SERIALIZE_ROCKETMQ),
)


@given(st.one_of(json_commands, binary_commands))
def test_round_trip(cmd: RemotingCommand) -> None:
    raw = encode(cmd)
    assert decode_frame(raw) == cmd
    assert encode(decode_frame(raw)) == raw


@given(st.binary(max_size=80), st.sampled_from([SERIALIZE_JSON, SERIALIZE_ROCKETMQ]))
def test_garbage_headers_raise_only_header_errors(header: bytes, stype: int) -> None:
    try:
        decode_frame(frame(header, stype=stype))
    except HeaderError:
        pass


def test_oversized_and_odd_integers_are_header_errors() -> None:
    with pytest.raises(HeaderError, match="not decodable"):
        decode_frame(frame(b'{"code":' + b"1" * 5000 + b"}"))
    with pytest.raises(HeaderError, match="'code' is '1_0'"):
        decode_frame(frame(b'{"code":"1_0"}'))


# --- captured from the real Java codecs ------------------------------------------------
# Produced by a throwaway program against the rocketmq-{remoting,common} 5.3.3 jars (and
# 4.9.4 where named so): RemotingCommand.encode(), MessageDecoder.encodeMessages/encode,
# TopicRouteData.encode() (legacy) and encode(BrowserCompatible, QuoteFieldNames,
# SkipTransientField, MapSortField) (standard), ClusterInfo.encode().

JAVA533_JSON_SEND = bytes.fromhex(
    "0000017d0000016b7b22636f6465223a3331302c226578744669656c6473223a7b2261223a225047222c2262"
    "223a22546f70696354657374222c2263223a22544257313032222c2264223a2234222c2265223a2231222c22"
    "66223a2230222c2267223a2231373030303030303030303030222c2268223a2230222c2269223a224b455953"
    "5c75303030316b315c7530303032554e49515f4b45595c753030303141433131303030313030303032413946"
    "303030303030303030303030303030315c7530303032574149545c7530303031747275655c75303030325441"
    "47535c7530303031546167415c7530303032222c226a223a2230222c226b223a2266616c7365222c226d223a"
    "2266616c7365222c226e223a2262726f6b65722d61227d2c22666c6167223a302c226c616e6775616765223a"
    "224a415641222c226f7061717565223a302c2273657269616c697a655479706543757272656e74525043223a"
    "224a534f4e222c2276657273696f6e223a307d48656c6c6f20526f636b65744d51"
)
JAVA533_RMQ_SEND = bytes.fromhex(
    "000000fd010000eb0136000000000000010000000000000000000000d6000161000000025047000162000000"
    "09546f7069635465737400016300000006544257313032000164000000013400016500000001310001660000"
    "0001300001670000000d313730303030303030303030300001680000000130000169000000464b455953016b"
    "3102554e49515f4b455901414331313030303130303030324139463030303030303030303030303030303102"
    "574149540174727565025441475301546167410200016a000000013000016b0000000566616c736500016d00"
    "00000566616c736500016e0000000862726f6b65722d6148656c6c6f20526f636b65744d51"
)
JAVA533_JSON_RESPONSE = bytes.fromhex(
    "000000fe000000fa7b22636f6465223a322c226578744669656c6473223a7b2254524143455f4f4e223a2274"
    "727565222c224d53475f524547494f4e223a2244656661756c74526567696f6e222c226b5c22223a22765c5c"
    "227d2c22666c6167223a332c226c616e6775616765223a224a415641222c226f7061717565223a2d372c2272"
    "656d61726b223a2262757379205c22715c22205c5c202f205c6e5c745c75303030315c75303031465c753030"
    "37465c7530303835c2a05c753230323820c3a920f09f988020687474703a2f2f782f79222c2273657269616c"
    "697a655479706543757272656e74525043223a224a534f4e222c2276657273696f6e223a307d"
)
JAVA533_RMQ_RESPONSE = bytes.fromhex(
    "0000007e0100007a0002000000fffffff9000000030000002c6275737920227122205c202f200a09011f7fc2"
    "85c2a0e280a820c3a920f09f988020687474703a2f2f782f7900000039000854524143455f4f4e0000000474"
    "727565000a4d53475f524547494f4e0000000d44656661756c74526567696f6e00026b2200000002765c"
)
JAVA494_JSON_SEND = bytes.fromhex(
    "0000016e0000015c7b22636f6465223a3331302c226578744669656c6473223a7b2261223a225047222c2262"
    "223a22546f70696354657374222c2263223a22544257313032222c2264223a2234222c2265223a2231222c22"
    "66223a2230222c2267223a2231373030303030303030303030222c2268223a2230222c2269223a224b455953"
    "5c75303030316b315c7530303032554e49515f4b45595c753030303141433131303030313030303032413946"
    "303030303030303030303030303030315c7530303032574149545c7530303031747275655c75303030325441"
    "47535c7530303031546167415c7530303032222c226a223a2230222c226b223a2266616c7365222c226d223a"
    "2266616c7365227d2c22666c6167223a302c226c616e6775616765223a224a415641222c226f706171756522"
    "3a302c2273657269616c697a655479706543757272656e74525043223a224a534f4e222c2276657273696f6e"
    "223a307d48656c6c6f20526f636b65744d51"
)
JAVA494_JSON_RESPONSE = bytes.fromhex(
    "000000fe000000fa7b22636f6465223a322c226578744669656c6473223a7b2254524143455f4f4e223a2274"
    "727565222c224d53475f524547494f4e223a2244656661756c74526567696f6e222c226b5c22223a22765c5c"
    "227d2c22666c6167223a332c226c616e6775616765223a224a415641222c226f7061717565223a2d372c2272"
    "656d61726b223a2262757379205c22715c22205c5c202f205c6e5c745c75303030315c75303031465c753030"
    "37465c7530303835c2a05c753230323820c3a920f09f988020687474703a2f2f782f79222c2273657269616c"
    "697a655479706543757272656e74525043223a224a534f4e222c2276657273696f6e223a307d"
)


@pytest.mark.parametrize(
    "raw",
    [JAVA533_JSON_SEND, JAVA533_RMQ_SEND, JAVA533_JSON_RESPONSE, JAVA533_RMQ_RESPONSE,
     JAVA494_JSON_SEND, JAVA494_JSON_RESPONSE],
)
def test_java_captured_frames_round_trip(raw: bytes) -> None:
    assert encode(decode_frame(raw)) == raw


def test_java_captured_frames_decode() -> None:
    json_send = decode_frame(JAVA533_JSON_SEND)
    rmq_send = decode_frame(JAVA533_RMQ_SEND)
    assert json_send.serialize_type == SERIALIZE_JSON
    assert rmq_send.serialize_type == SERIALIZE_ROCKETMQ
    assert json_send.ext_fields == rmq_send.ext_fields
    assert json_send.ext_fields is not None and json_send.ext_fields["n"] == "broker-a"
    assert json_send.body == rmq_send.body == b"Hello RocketMQ"
    remark = "busy \"q\" \\ / \n\t\x01\x1f\x7f\x85\xa0\u2028 é 😀 http://x/y"
    for raw in (JAVA533_JSON_RESPONSE, JAVA533_RMQ_RESPONSE, JAVA494_JSON_RESPONSE):
        resp = decode_frame(raw)
        assert (resp.code, resp.opaque, resp.flag, resp.remark) == (SYSTEM_BUSY, -7, 3, remark)
        assert resp.ext_fields == {"TRACE_ON": "true", "MSG_REGION": "DefaultRegion", 'k"': "v\\"}
