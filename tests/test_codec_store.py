"""Store records: pull/pop response bodies (``MessageDecoder.decode``/``encode``)."""

from __future__ import annotations

import ipaddress
import struct
import sys
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rmqfast.codec.store import (
    BLANK_MAGIC,
    BORNHOST_V6_FLAG,
    COMPRESSED_FLAG,
    COMPRESSION_LZ4,
    COMPRESSION_ZLIB,
    COMPRESSION_ZSTD,
    MAGIC_V1,
    MAGIC_V2,
    STOREHOST_V6_FLAG,
    CompressionUnavailable,
    StoreRecord,
    decode_records,
    decompress_body,
    encode_records,
    is_compressed,
)
from rmqfast.errors import BodyError


def java_record(
    *, magic: int = MAGIC_V1, body_crc: int = 0x1234, queue_id: int = 3, flag: int = 0,
    queue_offset: int = 42, phys: int = 1234, sys_flag: int = 0, born_ts: int = 1700000000000,
    born: bytes = bytes([10, 0, 0, 5]), born_port: int = 53211, store_ts: int = 1700000000005,
    store: bytes = bytes([192, 168, 0, 1]), store_port: int = 10911, reconsume: int = 0,
    prepared: int = 0, body: bytes = b"Hello", topic: bytes = b"TopicTest",
    props: bytes = b"TAGS\x01TagA\x02", total: int | None = None,
) -> bytes:
    """A record laid out field by field as in the reference table (section 6.10)."""
    # Java writes the V1 length with (byte) topics.length: a wrapping cast.
    topic_len = (struct.pack(">B", len(topic) & 0xFF) if magic == MAGIC_V1
                 else struct.pack(">h", len(topic)))
    rest = (struct.pack(">I", magic) + struct.pack(">i", body_crc) + struct.pack(">i", queue_id)
            + struct.pack(">i", flag) + struct.pack(">q", queue_offset) + struct.pack(">q", phys)
            + struct.pack(">i", sys_flag) + struct.pack(">q", born_ts) + born
            + struct.pack(">i", born_port) + struct.pack(">q", store_ts) + store
            + struct.pack(">i", store_port) + struct.pack(">i", reconsume)
            + struct.pack(">q", prepared) + struct.pack(">i", len(body)) + body + topic_len + topic
            + struct.pack(">h", len(props)) + props)
    return struct.pack(">i", total if total is not None else 4 + len(rest)) + rest


def test_decode_v1_ipv4_record() -> None:
    raw = java_record()
    [rec] = decode_records(raw)
    assert rec == StoreRecord(
        topic="TopicTest", body=b"Hello", properties={"TAGS": "TagA"}, queue_id=3, flag=0,
        queue_offset=42, commit_log_offset=1234, sys_flag=0, born_timestamp=1700000000000,
        born_host="10.0.0.5:53211", store_timestamp=1700000000005,
        store_host="192.168.0.1:10911", reconsume_times=0, prepared_transaction_offset=0,
        body_crc=0x1234, magic=MAGIC_V1,
    )
    assert len(raw) == 4 * 5 + 8 * 2 + 4 + 8 + 8 + 8 + 8 + 4 + 8 + 4 + 5 + 1 + 9 + 2 + 10
    assert encode_records([rec]) == raw
    # MessageDecoder.createMessageId: store ip, port, commit-log offset, upper-case hex.
    assert rec.msg_id == "C0A8000100002A9F00000000000004D2"


def test_decode_v2_ipv6_records() -> None:
    topic = ("T" * 200).encode()
    v6a = ipaddress.IPv6Address("2001:db8::1").packed
    v6b = ipaddress.IPv6Address("fe80::abcd:1").packed
    raw = (java_record(magic=MAGIC_V2, topic=topic, sys_flag=BORNHOST_V6_FLAG, born=v6a)
           + java_record(sys_flag=STOREHOST_V6_FLAG, store=v6b, queue_offset=43)
           + java_record(magic=MAGIC_V2, sys_flag=BORNHOST_V6_FLAG | STOREHOST_V6_FLAG,
                         born=v6a, store=v6b, props=b""))
    a, b, c = decode_records(raw)
    assert a.topic == "T" * 200 and a.magic == MAGIC_V2
    assert a.born_host == "[2001:db8::1]:53211" and a.store_host == "192.168.0.1:10911"
    assert b.born_host == "10.0.0.5:53211" and b.store_host == "[fe80::abcd:1]:10911"
    assert b.queue_offset == 43
    assert c.properties == {} and c.born_host.startswith("[")
    assert len(b.msg_id) == 56 and b.msg_id.startswith("FE80")
    assert encode_records([a, b, c]) == raw


def test_raw_properties_are_kept_until_changed() -> None:
    raw = java_record(props=b"b\x011\x02a\x012")  # no final \x02
    [rec] = decode_records(raw)
    assert encode_records([rec]) == raw
    rec.properties["POP_CK"] = "0 1 2"
    [again] = decode_records(encode_records([rec]))
    assert again.properties == {"b": "1", "a": "2", "POP_CK": "0 1 2"}


def test_invalid_utf8_topic_round_trips() -> None:
    raw = java_record(topic=b"T\xff")
    [rec] = decode_records(raw)
    assert encode_records([rec]) == raw


def test_empty_body() -> None:
    assert decode_records(b"") == []
    assert encode_records([]) == b""


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (java_record(magic=BLANK_MAGIC), r"0xcbd43194 at offset 4 is the commit-log BLANK_MAGIC"),
        (java_record(magic=0x12345678), r"magic code 0x12345678 at offset 4 is unknown"),
        (java_record()[:30], r"store record 0 at offset 0: fixed fields"),
        (java_record()[:-1], r"TOTALSIZE 115 at offset 0 needs 115 bytes from offset 0, past the "
                            r"end at offset 114"),
        (java_record(total=200), r"TOTALSIZE 200 at offset 0 needs 200 bytes"),
        (java_record(props=b"k\x01v\x02", total=107),
         r"properties length 4 at offset 103 needs 4 bytes from offset 105, past the end at "
         r"offset 107"),
        (java_record(topic=b"x" * 200), r"topic length -56"),
        (java_record(born_port=70000), r"born host port 70000 at offset 52 is outside 0..65535"),
        (java_record(store_port=-1), r"store host port -1 at offset 68"),
    ],
)
def test_decode_errors(raw: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        decode_records(raw)


def test_total_size_must_match_fields() -> None:
    good = java_record()
    raw = java_record(total=len(good) + 2) + b"\x00\x00"
    with pytest.raises(BodyError, match=rf"TOTALSIZE is {len(good) + 2} but the fields end "
                                        rf"after {len(good)} bytes"):
        decode_records(raw)


def test_second_record_error_names_its_offset() -> None:
    first = java_record()
    with pytest.raises(BodyError, match=rf"store record 1 at offset {len(first)}"):
        decode_records(first + java_record(magic=1))


def test_negative_body_length() -> None:
    raw = bytearray(java_record(body=b""))
    at = len(raw) - (2 + 10) - (1 + 9) - 4  # properties, topic, then the body length
    assert at == 84
    raw[at : at + 4] = struct.pack(">i", -5)
    with pytest.raises(BodyError, match=r"body length -5 at offset 84 is negative"):
        decode_records(bytes(raw))


def test_encode_errors() -> None:
    with pytest.raises(BodyError, match="use magic=MAGIC_V2"):
        encode_records([StoreRecord(topic="x" * 128)])
    with pytest.raises(BodyError, match=r"born_host '10.0.0.1:1' must be '\[v6addr\]:port'"):
        encode_records([StoreRecord(sys_flag=BORNHOST_V6_FLAG, born_host="10.0.0.1:1")])
    with pytest.raises(BodyError, match=r"store_host '\[::1\]:1' must be 'a.b.c.d:port'"):
        encode_records([StoreRecord(store_host="[::1]:1")])
    with pytest.raises(BodyError, match="port in 0..65535"):
        encode_records([StoreRecord(store_host="1.2.3.4:65536")])
    with pytest.raises(BodyError, match="queue_offset 9223372036854775808 does not fit an int64"):
        encode_records([StoreRecord(queue_offset=2**63)])
    with pytest.raises(BodyError, match="magic 0x1 is neither"):
        encode_records([StoreRecord(magic=1)])
    with pytest.raises(BodyError, match="properties are 32769 bytes"):
        encode_records([StoreRecord(properties={"k": "v" * 32766})])


# --- compression ------------------------------------------------------------------------


def _compressed(data: bytes, ctype: int) -> StoreRecord:
    return StoreRecord(topic="T", body=data, sys_flag=COMPRESSED_FLAG | (ctype << 8))


def test_zlib_like_java_deflater() -> None:
    plain = b"payload " * 1000
    for ctype in (0, COMPRESSION_ZLIB):  # 0: records from before the type bits existed
        rec = _compressed(zlib.compress(plain, 5), ctype)
        assert rec.is_compressed and is_compressed(rec.sys_flag)
        assert decompress_body(rec) == plain
    assert decompress_body(StoreRecord(body=b"as is")) == b"as is"


def test_zlib_limits_and_corruption() -> None:
    rec = _compressed(zlib.compress(b"\x00" * 100_000), COMPRESSION_ZLIB)
    with pytest.raises(BodyError, match="exceeds the limit of 1000 bytes"):
        decompress_body(rec, max_size=1000)
    assert len(decompress_body(rec, max_size=None)) == 100_000
    with pytest.raises(BodyError, match="cannot decompress the 3-byte body"):
        decompress_body(_compressed(b"abc", COMPRESSION_ZLIB))
    with pytest.raises(BodyError, match="truncated"):
        decompress_body(_compressed(zlib.compress(b"x" * 100)[:-3], COMPRESSION_ZLIB))


def test_unknown_compression_type() -> None:
    with pytest.raises(BodyError, match="unknown compression type 5"):
        decompress_body(_compressed(b"abc", 5))


def test_lz4_without_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # lz4 is a declared test dependency: hide it (a None entry makes ``import`` raise ImportError)
    monkeypatch.setitem(sys.modules, "lz4", None)
    monkeypatch.setitem(sys.modules, "lz4.frame", None)
    with pytest.raises(CompressionUnavailable, match="install the 'lz4' package"):
        decompress_body(_compressed(b"abc", COMPRESSION_LZ4))


def test_zstd_without_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(CompressionUnavailable, match="install the 'zstandard' package"):
        decompress_body(_compressed(b"abc", COMPRESSION_ZSTD))


def test_lz4_frame() -> None:
    import lz4.frame as lz4_frame  # a declared test dependency: no skip
    plain = b"lz4 " * 500
    assert decompress_body(_compressed(lz4_frame.compress(plain), COMPRESSION_LZ4)) == plain
    with pytest.raises(BodyError, match="exceeds the limit"):
        decompress_body(_compressed(lz4_frame.compress(plain), COMPRESSION_LZ4), max_size=10)
    with pytest.raises(BodyError, match="truncated"):
        decompress_body(_compressed(lz4_frame.compress(plain)[:-4], COMPRESSION_LZ4))


def test_zstd_frame_without_content_size() -> None:
    import zstandard  # a declared test dependency: no skip
    plain = b"zstd " * 500
    cobj = zstandard.ZstdCompressor().compressobj()  # streaming: no content size, like Java
    data = cobj.compress(plain) + cobj.flush()
    assert decompress_body(_compressed(data, COMPRESSION_ZSTD)) == plain
    with pytest.raises(BodyError, match="exceeds the limit"):
        decompress_body(_compressed(data, COMPRESSION_ZSTD), max_size=10)
    with pytest.raises(BodyError, match="truncated"):
        decompress_body(_compressed(data[:-4], COMPRESSION_ZSTD))


# --- property tests ---------------------------------------------------------------------

_i32 = st.integers(-(2**31), 2**31 - 1)
_i64 = st.integers(-(2**63), 2**63 - 1)
_port = st.integers(0, 65535)
_v4 = st.ip_addresses(v=4).map(str)
_v6 = st.ip_addresses(v=6).map(lambda a: f"[{a.compressed}]")
_props = st.dictionaries(
    st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x01\x02"),
            min_size=1, max_size=8),
    st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x02"),
            min_size=1, max_size=16),
    max_size=4,
)


@st.composite
def store_records(draw: st.DrawFn) -> StoreRecord:
    sys_flag = draw(_i32)
    born_ip = draw(_v6 if sys_flag & BORNHOST_V6_FLAG else _v4)
    store_ip = draw(_v6 if sys_flag & STOREHOST_V6_FLAG else _v4)
    magic = draw(st.sampled_from([MAGIC_V1, MAGIC_V2]))
    # At most 31 characters of at most 4 UTF-8 bytes: fits the V1 limit of 127 bytes.
    topic = draw(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=31))
    if magic == MAGIC_V2:
        topic = draw(st.sampled_from([topic, topic + "x" * 150]))
    return StoreRecord(
        topic=topic, body=draw(st.binary(max_size=64)), properties=draw(_props),
        queue_id=draw(_i32), flag=draw(_i32), queue_offset=draw(_i64),
        commit_log_offset=draw(_i64), sys_flag=sys_flag, born_timestamp=draw(_i64),
        born_host=f"{born_ip}:{draw(_port)}", store_timestamp=draw(_i64),
        store_host=f"{store_ip}:{draw(_port)}", reconsume_times=draw(_i32),
        prepared_transaction_offset=draw(_i64), body_crc=draw(_i32), magic=magic,
    )


def _normal(rec: StoreRecord) -> StoreRecord:
    """``rec`` with hosts in the canonical text form decoding gives."""
    def norm(host: str) -> str:
        addr, _, port = host.rpartition(":")
        if addr.startswith("["):
            return f"[{ipaddress.IPv6Address(addr[1:-1]).compressed}]:{port}"
        return host
    rec.born_host = norm(rec.born_host)
    rec.store_host = norm(rec.store_host)
    return rec


@given(st.lists(store_records(), max_size=4))
def test_round_trip(records: list[StoreRecord]) -> None:
    body = encode_records(records)
    decoded = decode_records(body)
    assert decoded == [_normal(r) for r in records]
    assert encode_records(decoded) == body


@given(st.binary(max_size=300))
def test_garbage_raises_only_body_error(data: bytes) -> None:
    try:
        decode_records(data)
    except BodyError:
        pass


# --- captured from the real Java codecs ------------------------------------------------
# Produced by a throwaway program against the rocketmq-{remoting,common} 5.3.3 jars (and
# 4.9.4 where named so): RemotingCommand.encode(), MessageDecoder.encodeMessages/encode,
# TopicRouteData.encode() (legacy) and encode(BrowserCompatible, QuoteFieldNames,
# SkipTransientField, MapSortField) (standard), ClusterInfo.encode().

JAVA533_STORE = bytes.fromhex(
    "00000082daa320a7422c6a150000000300000005000000000000002a00000000075bcd15000000000000018b"
    "cfe568000a0000050000cfdb0000018bcfe5687bc0a8000100002a9f00000002000000000000000000000007"
    "7061796c6f616409546f706963546573740017554e49515f4b45590141424302544147530154616741020000"
    "0078daa320a70000000000000000000000000000000000000007000000000000006300000030000000000000"
    "000020010db8000000000000000000000001000000010000000000000000fe80000000000000000000000000"
    "000100002a9f000000000000000000000000000000030102030254360000"
)


def test_java_captured_records() -> None:
    v4, v6 = decode_records(JAVA533_STORE)
    assert (v4.topic, v4.body, v4.queue_id, v4.flag, v4.queue_offset) == (
        "TopicTest", b"payload", 3, 5, 42)
    assert (v4.born_host, v4.store_host, v4.reconsume_times) == (
        "10.0.0.5:53211", "192.168.0.1:10911", 2)
    assert v4.properties == {"UNIQ_KEY": "ABC", "TAGS": "TagA"}
    assert v4.msg_id == "C0A8000100002A9F00000000075BCD15"
    assert (v6.born_host, v6.store_host) == ("[2001:db8::1]:1", "[fe80::1]:10911")
    # Java's MessageClientExt.getOffsetMsgId() for the same record:
    assert v6.msg_id == "FE80000000000000000000000000000100002A9F0000000000000063"
    assert encode_records([v4, v6]) == JAVA533_STORE
