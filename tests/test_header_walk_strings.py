"""The header walk's string scan: a special byte at every offset of a key or value, and strings
that end at (or run past) the header's end, read the same by both twins and the broker.

The compiled walk scans strings eight bytes at a time and finds the first special byte of a word
from its mask; these cases put each kind of special byte ('"', '\\', a control character, a
non-ASCII byte, an escape) at each position of a word, and put the header's end at each position
after a string, with body bytes after it that must not be read as part of the header.
"""

from __future__ import annotations

import pytest

from rmqfast import codec
from rmqfast.testing import header_fuzz

SPECIALS = [b"\\u0001", b"\\\"", b"\\\\", b"\\n", b"\x01", b"\x1f", b"\x7f", "\u00e9".encode(),
            "\u20ac".encode(), "\U0001f600".encode(), b"\xc3", b"\xff", b"\\x41", b"\\ud800", b'"']


def _check_all(frames: list[bytes]) -> tuple[int, int]:
    twins = header_fuzz.Twins()
    accepted = refused = 0
    for frame in frames:
        failure = header_fuzz.check(twins, frame)
        assert failure is None, f"{frame!r}: {failure}"
        if twins.scan(frame)[-1].event == codec.EV_ERROR:
            refused += 1
        else:
            accepted += 1
    return accepted, refused


def _frames_with(place: str) -> list[bytes]:
    frames = []
    for special in SPECIALS:
        for before in range(0, 20):
            for after in (0, 1, 7, 8, 9):
                s = b"T" * before + special + b"x" * after
                if place == "topic":
                    header = (b'{"code":310,"extFields":{"a":"PG","b":"' + s
                              + b'","i":"TAGS\\u0001A"},"flag":0,"opaque":1}')
                elif place == "ext-value":
                    header = b'{"code":310,"extFields":{"b":"TopicA","zz":"' + s + b'"},"flag":0,"opaque":1}'
                elif place == "ext-key":
                    header = b'{"code":310,"extFields":{"' + s + b'":"v","b":"TopicA"},"flag":0,"opaque":1}'
                elif place == "key":
                    header = b'{"code":25,"' + s + b'":"v","flag":0,"opaque":1}'
                else:
                    header = b'{"code":25,"remark":"' + s + b'","flag":0,"opaque":1}'
                frames.append(header_fuzz.frame_of(header))
    return frames


@pytest.mark.parametrize("place", ["topic", "ext-value", "ext-key", "key", "value"])
def test_a_special_byte_at_every_offset_is_read_alike(place):
    accepted, refused = _check_all(_frames_with(place))
    assert accepted and refused  # both sides of the decision are exercised


def test_a_header_cut_inside_or_just_after_a_string_is_read_alike():
    """The header ends at every byte of a long string; the body after it holds the string's rest
    (and a closing quote), which the walk must not read."""
    whole = b'{"code":310,"extFields":{"b":"TopicAbcdefghijklmnopqrstuvwxyz0123456789"},"flag":0,"opaque":1}'
    start = whole.index(b"TopicA")
    frames = []
    for cut in range(start - 2, len(whole) + 1):
        frames.append(header_fuzz.frame_of(whole[:cut], body=whole[cut:] + b'"}' * 4))
    accepted, refused = _check_all(frames)
    assert accepted == 1  # only the whole header
    assert refused == len(frames) - 1


def test_long_plain_strings_of_every_length_are_read_alike():
    frames = []
    for k in range(0, 40):
        topic = (b"Topic" + b"abcdefghij" * 4)[:k]
        frames.append(header_fuzz.frame_of(
            b'{"code":310,"extFields":{"b":"' + topic + b'","language":"' + b"J" * k + b'"},"flag":0,"opaque":1}'))
        frames.append(header_fuzz.frame_of(b'{"code":25,"' + b"k" * k + b'":"' + b"v" * k + b'","opaque":1}'))
    accepted, refused = _check_all(frames)
    assert accepted >= 70


KEYS = [b"", b"_", b"-_-", b"c", b"C", b"code", b"Code", b"_code", b"c-o-d-e", b"isCode", b"IS_FLAG", b"is", b"i",
        b"-is-opaque", b"Opaque", b"extfields", b"ExtFields", b"e", b"f", b"o", b"flags", b"codes", b"iscodes",
        b"language", b"version", b"remark", b"serializeTypeCurrentRPC", b"Language", b"_language", b"xcode",
        b"\xc3\xa9code", b"ocode", b"ecode", b"fcode", b"co_de_______________x", b"c" * 17, b"_" * 20 + b"code"]


def test_top_level_key_spellings_are_read_alike():
    """Keys that are, or are not, a spelling of code/flag/opaque/extFields: the walk's quick
    refusal of other keys (by their first letter) decides as the full comparison does."""
    frames = []
    for key in KEYS:
        frames.append(header_fuzz.frame_of(b'{"code":25,"' + key + b'":"1","flag":0,"opaque":1}'))
        frames.append(header_fuzz.frame_of(b'{"' + key + b'":0,"code":25,"opaque":1}'))
    accepted, refused = _check_all(frames)
    assert accepted and refused


SPECIALS_SHORT = [b"", b"\\u0001", b'\\"', b"\\\\", "\u00e9".encode(), b"\x01", b"\xff", b'"']


def _padded(total: int, at: int, special: bytes) -> bytes | None:
    """A send header of ``total`` bytes whose ext value "zz" holds ``special`` ``at`` bytes in."""
    prefix = b'{"code":310,"extFields":{"b":"TopicA","zz":"'
    suffix = b'"},"flag":0,"opaque":1}'
    fill = total - len(prefix) - len(suffix) - len(special)
    if fill < 0 or at > fill:
        return None
    return prefix + b"v" * at + special + b"v" * (fill - at) + suffix


def test_strings_across_bitmap_words_and_the_long_header_switch_are_read_alike():
    """The compiled walk finds the end of a string in a bitmap of the header's special bytes (64
    bytes a word) for headers up to 4,095 bytes, and with the eight-byte loop beyond: special bytes
    at every offset of a word and across word boundaries, headers whose end falls on, just before
    and just after a word boundary and the 4,095-byte switch, and headers cut inside a string
    (the body after them holds the rest, which must not be read)."""
    frames = []
    for total, offsets in ((127, range(0, 70)), (128, range(0, 70)), (129, range(0, 70)),
                           (4095, range(56, 72)), (4096, range(56, 72)), (4097, range(56, 72))):
        for special in SPECIALS_SHORT:
            for at in offsets:
                header = _padded(total, at, special)
                if header is not None:
                    frames.append(header_fuzz.frame_of(header))
    for total in list(range(120, 137)) + list(range(4088, 4105)):
        for special in SPECIALS_SHORT:
            header = _padded(total, 40, special)
            assert header is not None
            frames.append(header_fuzz.frame_of(header, body=b'"}' * 4))
            cut = header[:-len(b'"},"flag":0,"opaque":1}')]
            frames.append(header_fuzz.frame_of(cut, body=b'"},"flag":0,"opaque":1}'))
    accepted, refused = _check_all(frames)
    assert accepted > 500 and refused > 500  # both sides of the decision, on both sides of the switch
