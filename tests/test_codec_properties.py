"""Message properties strings (``MessageDecoder.string2messageProperties`` and back)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rmqfast.codec import properties as P
from rmqfast.codec.properties import (
    encode_properties,
    format_properties,
    parse_properties,
    properties_bytes_for,
)


def java_string2message_properties(s: str) -> dict[str, str]:
    """A literal transcription of the Java algorithm (indexOf walk), as the oracle."""
    out: dict[str, str] = {}
    length = len(s)
    index = 0
    while index < length:
        new_index = s.find("\x02", index)
        if new_index < 0:
            new_index = length
        if new_index - index >= 3:
            kv = s.find("\x01", index)
            if index < kv < new_index - 1:
                out[s[index:kv]] = s[kv + 1 : new_index]
        index = new_index + 1
    return out


def test_parse_java_written_string() -> None:
    s = "KEYS\x01k1 k2\x02UNIQ_KEY\x01AC1100010000\x02WAIT\x01true\x02TAGS\x01TagA\x02"
    assert parse_properties(s) == {
        "KEYS": "k1 k2", "UNIQ_KEY": "AC1100010000", "WAIT": "true", "TAGS": "TagA",
    }
    assert list(parse_properties(s)) == ["KEYS", "UNIQ_KEY", "WAIT", "TAGS"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("k\x01v", {"k": "v"}),  # the last pair needs no trailing separator
        ("\x01v\x02", {}),  # empty name
        ("k\x01\x02", {}),  # empty value
        ("kv\x02", {}),  # no name/value separator
        ("ab\x02k\x01v\x02", {"k": "v"}),
        ("k\x01a\x01b\x02", {"k": "a\x01b"}),  # split at the first \x01 only
        ("\x02\x02k\x01v\x02\x02", {"k": "v"}),
        ("k\x01one\x02k\x01two\x02", {"k": "two"}),  # HashMap.put: the later value wins
        ("x\x02k\x01v", {"k": "v"}),  # a piece without \x01 does not borrow the next one's
    ],
)
def test_parse_mirrors_java_skips(text: str, expected: dict[str, str]) -> None:
    assert parse_properties(text) == expected
    assert java_string2message_properties(text) == expected


def test_parse_bytes_and_invalid_utf8() -> None:
    assert parse_properties(b"TAGS\x01\xc3\xa9t\xc3\xa9\x02") == {"TAGS": "été"}
    assert parse_properties(bytearray(b"k\x01\xff\x02")) == {"k": "\ufffd"}
    assert parse_properties(memoryview(b"k\x01v\x02")) == {"k": "v"}


@given(st.text(alphabet=st.sampled_from("ab\x01\x02é")))
def test_parse_matches_java_oracle(text: str) -> None:
    assert parse_properties(text) == java_string2message_properties(text)


def test_format_appends_separator_after_every_pair() -> None:
    assert format_properties({"TAGS": "A", "KEYS": "k"}) == "TAGS\x01A\x02KEYS\x01k\x02"
    assert format_properties({}) == ""
    assert format_properties({"a": None, "b": "1"}) == "b\x011\x02"
    assert encode_properties({"T": "é"}) == b"T\x01\xc3\xa9\x02"


@pytest.mark.parametrize(
    "props",
    [{"": "v"}, {"k\x01": "v"}, {"k\x02": "v"}, {"k": ""}, {"k": "a\x02b"}],
)
def test_format_refuses_pairs_that_cannot_round_trip(props: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="property"):
        format_properties(props)


def test_format_refuses_non_str() -> None:
    with pytest.raises(TypeError, match="must be str"):
        format_properties({"k": 1})  # type: ignore[dict-item]


_names = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x01\x02"),
    min_size=1, max_size=12,
)
_values = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x02"),
    min_size=1, max_size=20,
)


@given(st.dictionaries(_names, _values, max_size=8))
def test_round_trip_dict(props: dict[str, str]) -> None:
    text = format_properties(props)
    assert parse_properties(text) == props
    assert parse_properties(text.encode()) == props
    assert format_properties(parse_properties(text)) == text


def test_properties_bytes_for_keeps_raw_until_changed() -> None:
    raw = b"k\x01v\x02junk\x02x\x01y"  # not what Java's formatter writes
    props = parse_properties(raw)
    assert properties_bytes_for(props, raw) is raw
    props["z"] = "1"
    assert properties_bytes_for(props, raw) == b"k\x01v\x02x\x01y\x02z\x011\x02"
    assert properties_bytes_for({"a": "b"}, None) == b"a\x01b\x02"


def test_well_known_keys() -> None:
    assert (P.TAGS, P.KEYS, P.UNIQ_KEY, P.SHARDING_KEY) == ("TAGS", "KEYS", "UNIQ_KEY",
                                                             "__SHARDINGKEY")
    assert (P.DELAY, P.TIMER_DELIVER_MS, P.TRAN_MSG, P.PGROUP) == (
        "DELAY", "TIMER_DELIVER_MS", "TRAN_MSG", "PGROUP")
    assert (P.MSG_REGION, P.TRACE_ON, P.INNER_NUM, P.POP_CK) == (
        "MSG_REGION", "TRACE_ON", "INNER_NUM", "POP_CK")
    assert P.FIRST_POP_TIME == "1ST_POP_TIME"
