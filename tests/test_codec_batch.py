"""SEND_BATCH_MESSAGE bodies (``MessageDecoder.encodeMessages``/``decodeMessages``)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rmqfast.codec.batch import BatchEntry, count_batch, decode_batch, encode_batch
from rmqfast.errors import BodyError


def java_record(flag: int, body: bytes, props: bytes) -> bytes:
    """One record laid out field by field as ``MessageDecoder.encodeMessage`` writes it."""
    total = 4 + 4 + 4 + 4 + 4 + len(body) + 2 + len(props)
    return (struct.pack(">i", total) + struct.pack(">i", 0) + struct.pack(">i", 0)
            + struct.pack(">i", flag) + struct.pack(">i", len(body)) + body
            + struct.pack(">h", len(props)) + props)


SAMPLE = (
    java_record(0, b"Hello RocketMQ 0",
                b"WAIT\x01true\x02UNIQ_KEY\x017F00000100002A9F0000000000000000\x02")
    + java_record(7, b"", b"TAGS\x01TagA\x02KEYS\x01k1 k2\x02")
    + java_record(-1, b"\x00\xff" * 3, b"")
)


def test_decode_java_shaped_batch() -> None:
    entries = decode_batch(SAMPLE)
    assert entries == [
        BatchEntry(0, b"Hello RocketMQ 0",
                   {"WAIT": "true", "UNIQ_KEY": "7F00000100002A9F0000000000000000"}),
        BatchEntry(7, b"", {"TAGS": "TagA", "KEYS": "k1 k2"}),
        BatchEntry(-1, b"\x00\xff" * 3, {}),
    ]
    assert encode_batch(entries) == SAMPLE
    assert count_batch(SAMPLE) == 3
    assert decode_batch(bytearray(SAMPLE)) == entries
    assert decode_batch(memoryview(SAMPLE)) == entries


def test_empty_body() -> None:
    assert decode_batch(b"") == []
    assert count_batch(b"") == 0
    assert encode_batch([]) == b""


def test_non_canonical_properties_survive_round_trip() -> None:
    body = java_record(0, b"x", b"a\x01b\x02c\x01d")  # no final \x02
    entries = decode_batch(body)
    assert entries[0].properties == {"a": "b", "c": "d"}
    assert encode_batch(entries) == body
    entries[0].properties["e"] = "f"
    assert decode_batch(encode_batch(entries))[0].properties == {"a": "b", "c": "d", "e": "f"}


def test_magic_and_crc_are_ignored_like_java() -> None:
    rec = bytearray(java_record(3, b"b", b"k\x01v\x02"))
    rec[4:12] = b"\x12\x34\x56\x78\x9a\xbc\xde\xf0"
    assert decode_batch(bytes(rec)) == [BatchEntry(3, b"b", {"k": "v"})]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (SAMPLE[:10], r"batch record 0 at offset 0: 10 bytes left"),
        (java_record(0, b"abc", b"")[:-1], r"body length 3 at offset 16"),
        (SAMPLE[: len(SAMPLE) - 1], r"batch record 2 at offset \d+"),
        (java_record(0, b"", b"k\x01v\x02")[:-2], r"properties length 4 at offset 20"),
    ],
)
def test_truncated(body: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        decode_batch(body)


def test_total_size_must_agree() -> None:
    rec = bytearray(java_record(0, b"abc", b""))
    rec[0:4] = struct.pack(">i", 99)
    with pytest.raises(BodyError, match=r"totalSize is 99 but .* make 25"):
        decode_batch(bytes(rec))
    with pytest.raises(BodyError, match=r"totalSize 99 .* runs past the end"):
        count_batch(bytes(rec))


def test_negative_lengths() -> None:
    rec = bytearray(java_record(0, b"", b""))
    rec[16:20] = struct.pack(">i", -1)
    with pytest.raises(BodyError, match="body length -1"):
        decode_batch(bytes(rec))
    rec = bytearray(java_record(0, b"", b""))
    rec[20:22] = struct.pack(">h", -2)
    with pytest.raises(BodyError, match="properties length -2"):
        decode_batch(bytes(rec))


def test_count_refuses_tiny_sizes() -> None:
    with pytest.raises(BodyError, match="totalSize 0 is below the 22-byte minimum"):
        count_batch(b"\x00" * 30)
    with pytest.raises(BodyError, match="too few for the int32 totalSize"):
        count_batch(SAMPLE + b"\x00")


def test_encode_limits() -> None:
    with pytest.raises(BodyError, match="properties are 32769 bytes"):
        encode_batch([BatchEntry(0, b"", {"k": "v" * 32766})])
    with pytest.raises(BodyError, match="flag 2147483648 does not fit"):
        encode_batch([BatchEntry(2**31, b"", {})])


_props = st.dictionaries(
    st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x01\x02"),
            min_size=1, max_size=8),
    st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x02"),
            min_size=1, max_size=16),
    max_size=5,
)
_entries = st.lists(
    st.builds(BatchEntry, st.integers(-(2**31), 2**31 - 1), st.binary(max_size=64), _props),
    max_size=6,
)


@given(_entries)
def test_round_trip(entries: list[BatchEntry]) -> None:
    body = encode_batch(entries)
    assert decode_batch(body) == entries
    assert count_batch(body) == len(entries)
    assert encode_batch(decode_batch(body)) == body


# --- captured from the real Java codecs ------------------------------------------------
# Produced by a throwaway program against the rocketmq-{remoting,common} 5.3.3 jars (and
# 4.9.4 where named so): RemotingCommand.encode(), MessageDecoder.encodeMessages/encode,
# TopicRouteData.encode() (legacy) and encode(BrowserCompatible, QuoteFieldNames,
# SkipTransientField, MapSortField) (standard), ClusterInfo.encode().

JAVA533_BATCH = bytes.fromhex(
    "0000005100000000000000000000000000000009626f64792d3020c3a9003275017630024b455953016b6579"
    "3002554e49515f4b455901554e49513002574149540174727565025441475301546167300200000051000000"
    "00000000000000000700000009626f64792d3120c3a9003275017631024b455953016b65793102554e49515f"
    "4b455901554e4951310257414954017472756502544147530154616731020000005100000000000000000000"
    "000e00000009626f64792d3220c3a9003275017632024b455953016b65793202554e49515f4b455901554e49"
    "5132025741495401747275650254414753015461673202"
)


def test_java_captured_batch() -> None:
    entries = decode_batch(JAVA533_BATCH)
    assert [(e.flag, e.body.decode()) for e in entries] == [
        (0, "body-0 é"), (7, "body-1 é"), (14, "body-2 é")]
    assert entries[1].properties == {"u": "v1", "KEYS": "key1", "UNIQ_KEY": "UNIQ1",
                                     "WAIT": "true", "TAGS": "Tag1"}
    assert encode_batch(entries) == JAVA533_BATCH
    assert count_batch(JAVA533_BATCH) == 3
