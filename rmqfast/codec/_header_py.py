"""Pure-Python twin of the header walk compiled from ``ext/header_walk.pxi``.

One reading of a header
-----------------------
What the scanner decides from a header (code, flag, opaque, topic, properties) must be what the
broker reads.  Brokers decode JSON headers with fastjson, which keeps the *first* of duplicate keys,
decodes escapes, matches RemotingCommand fields ignoring case, ``_`` and ``-``, and also accepts
single quotes, unquoted keys and ``\\x`` escapes; ROCKETMQ binary headers become a HashMap (the last
duplicate wins).  Rather than guess which reading applies, the walk accepts only headers whose
reading is unambiguous and refuses everything else (the scanner reports ``EV_ERROR``; the relay
closes the connection and logs the reason):

* JSON that is not strict RFC 8259: single quotes, unquoted keys, comments, ``NaN``, leading zeros,
  escapes other than ``\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX``, lone surrogates, raw control
  characters in strings, invalid or overlong UTF-8, nesting deeper than 32 levels;
* a top-level key with an escape, or spelled like ``code``/``flag``/``opaque``/``extFields`` in
  another case, with ``_``/``-`` inserted or an ``is`` prefix, or any of those four twice;
* an ``extFields`` key with an escape, ``b``/``topic``/``i``/``properties`` twice or not a string;
* an escaped topic in a send or pull (topics are ``[%|a-zA-Z0-9_-]``; no encoder escapes them);
* a binary header whose lengths do not add up exactly, whose key length Java reads as negative,
  or with ``b``/``topic``/``i``/``properties`` twice.

No RocketMQ client (Java, Go, C++) produces any of these.  The compiled walk implements exactly
this algorithm, step by step, with the same error messages.
"""

from __future__ import annotations

import struct

from rmqfast.codec.tables import MAX_JSON_DEPTH  # noqa: F401 - re-exported

#: Error messages by code (the compiled walk's ``_ERRORS``, same order).
ERRORS = (
    "",
    "unterminated string",
    "value expected",
    "unterminated object or array",
    "unexpected character",
    "integer out of range",
    "integer expected",
    "header is not a JSON object",
    "no code field",
    "key expected",
    "':' expected",
    "',' or '}' expected",
    "trailing data after the header object",
    "binary header shorter than 21 bytes",
    "remark length out of bounds",
    "extFields length out of bounds",
    "extFields key length truncated",
    "extFields key out of bounds",
    "extFields value out of bounds",
    "escape other than \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX (or a lone surrogate)",
    "raw control character in a string",
    "invalid UTF-8",
    "malformed number",
    "nested deeper than 32 levels",
    "escaped key (fastjson would decode it; no client escapes keys)",
    "key spelled like code/flag/opaque/extFields in another case or with '_'/'-' (fastjson would match it)",
    "duplicate code/flag/opaque/extFields key (fastjson keeps the first)",
    "escaped extFields key",
    "duplicate extFields key b/topic/i/properties/m/batch",
    "extFields b/topic/i/properties/m/batch is not a string",
    "binary header has bytes after extFields",
    "duplicate binary extFields key b/topic/i/properties/m/batch",
    "escaped topic in a send or pull",
)
(E_OK, E_UNTERMINATED_STRING, E_VALUE_EXPECTED, E_UNTERMINATED_NESTED, E_UNEXPECTED_CHAR, E_INT_RANGE,
 E_INT_EXPECTED, E_NOT_OBJECT, E_NO_CODE, E_KEY_EXPECTED, E_COLON_EXPECTED, E_COMMA_EXPECTED, E_TRAILING,
 E_BIN_SHORT, E_BIN_REMARK, E_BIN_EXT, E_BIN_KEY_TRUNC, E_BIN_KEY, E_BIN_VALUE, E_BAD_ESCAPE, E_CONTROL_CHAR,
 E_BAD_UTF8, E_BAD_NUMBER, E_TOO_DEEP, E_KEY_ESCAPED, E_KEY_VARIANT, E_DUP_KEY, E_EXT_KEY_ESCAPED,
 E_EXT_DUP_KEY, E_EXT_NOT_STRING, E_BIN_TRAILING, E_BIN_DUP_KEY, E_TOPIC_ESCAPED) = range(len(ERRORS))

_K_CODE, _K_FLAG, _K_OPAQUE, _K_EXT = 1, 2, 4, 8
_HEADER_KEYS = {b"code": _K_CODE, b"flag": _K_FLAG, b"opaque": _K_OPAQUE, b"extFields": _K_EXT}
_FIELD_NAMES = (b"code", b"flag", b"opaque", b"extfields")
_EXT_KEYS = {b"b": "b", b"topic": "topic", b"i": "i", b"properties": "props", b"m": "m_true", b"batch": "batch_true"}
_BOOL_FIELDS = ("m_true", "batch_true")
_SIMPLE_ESCAPES = b'"\\/bfnrt'
_WS = b" \t\r\n"
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_U16 = struct.Struct(">H")


class HeaderError(Exception):
    """A header the walk refuses; ``code`` indexes :data:`ERRORS`."""

    def __init__(self, code: int) -> None:
        super().__init__(ERRORS[code])
        self.code = code


class HeaderInfo:
    """What the walk read: code, flag, opaque, the spans (start, length, escaped) of the
    extFields values b, topic, i and properties (``None``: absent) and whether extFields m
    (SendMessageRequestHeaderV2) and batch (SendMessageRequestHeader) read true."""

    __slots__ = ("code", "flag", "opaque", "b", "topic", "i", "props", "m_true", "batch_true")

    def __init__(self) -> None:
        self.code = 0
        self.flag = 0
        self.opaque = 0
        self.b: tuple[int, int, bool] | None = None
        self.topic: tuple[int, int, bool] | None = None
        self.i: tuple[int, int, bool] | None = None
        self.props: tuple[int, int, bool] | None = None
        self.m_true = False
        self.batch_true = False


def reads_true(s: bytes, esc: bool) -> bool:
    """Whether a header value reads true as Boolean.parseBoolean reads it: "true" ignoring case
    (no character outside ASCII folds to one of its letters), after JSON escapes are decoded."""
    if esc:
        if len(s) > 24:  # every character of "true" takes at most 6 escaped bytes
            return False
        s = json_unescape(s)
    return len(s) == 4 and bytes(c | 32 for c in s) == b"true"


def _skip_ws(h: bytes, i: int, n: int) -> int:
    while i < n and h[i] in _WS:
        i += 1
    return i


def _hex4(h: bytes, i: int) -> int:
    s = h[i : i + 4]
    if len(s) != 4 or any(c not in b"0123456789abcdefABCDEF" for c in s):
        return -1
    return int(s, 16)


def scan_string(h: bytes, i: int, n: int) -> tuple[int, bool]:
    """``h[i]`` is the opening quote: (index after the closing quote, had an escape)."""
    i += 1
    esc = False
    while i < n:
        c = h[i]
        if c == 0x22:
            return i + 1, esc
        if c == 0x5C:
            esc = True
            if i + 1 >= n:
                raise HeaderError(E_UNTERMINATED_STRING)
            c = h[i + 1]
            if c == 0x75:  # \uXXXX, surrogates only in pairs
                if i + 6 > n:
                    raise HeaderError(E_BAD_ESCAPE)
                u = _hex4(h, i + 2)
                if u < 0 or 0xDC00 <= u <= 0xDFFF:
                    raise HeaderError(E_BAD_ESCAPE)
                i += 6
                if 0xD800 <= u <= 0xDBFF:
                    if i + 6 > n or h[i] != 0x5C or h[i + 1] != 0x75:
                        raise HeaderError(E_BAD_ESCAPE)
                    lo = _hex4(h, i + 2)
                    if lo < 0xDC00 or lo > 0xDFFF:
                        raise HeaderError(E_BAD_ESCAPE)
                    i += 6
                continue
            if c in _SIMPLE_ESCAPES:
                i += 2
                continue
            raise HeaderError(E_BAD_ESCAPE)
        if c < 0x20:
            raise HeaderError(E_CONTROL_CHAR)
        if c < 0x80:
            i += 1
            continue
        i += utf8_sequence(h, i, n)
    raise HeaderError(E_UNTERMINATED_STRING)


def utf8_sequence(h: bytes, i: int, n: int) -> int:
    """Length of the strict UTF-8 sequence (no overlong forms, no surrogates, at most U+10FFFF)
    starting at the non-ASCII byte ``h[i]`` of ``h[:n]``; HeaderError if there is none."""
    c = h[i]
    if 0xC2 <= c <= 0xDF:
        need, cp = 1, c & 0x1F
    elif 0xE0 <= c <= 0xEF:
        need, cp = 2, c & 0x0F
    elif 0xF0 <= c <= 0xF4:
        need, cp = 3, c & 0x07
    else:
        raise HeaderError(E_BAD_UTF8)
    if i + need >= n:
        raise HeaderError(E_UNTERMINATED_STRING)
    for k in range(1, need + 1):
        if h[i + k] & 0xC0 != 0x80:
            raise HeaderError(E_BAD_UTF8)
        cp = (cp << 6) | (h[i + k] & 0x3F)
    if (need == 2 and (cp < 0x800 or 0xD800 <= cp <= 0xDFFF)) or (need == 3 and not 0x10000 <= cp <= 0x10FFFF):
        raise HeaderError(E_BAD_UTF8)
    return need + 1


def utf8_valid(b: bytes) -> bool:
    """Strict UTF-8 through and through."""
    i, n = 0, len(b)
    try:
        while i < n:
            i += 1 if b[i] < 0x80 else utf8_sequence(b, i, n)
    except HeaderError:
        return False
    return True


def _digits(h: bytes, i: int, n: int) -> int:
    while i < n and 0x30 <= h[i] <= 0x39:
        i += 1
    return i


def _scan_number(h: bytes, i: int, n: int) -> int:
    """-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?"""
    if i < n and h[i] == 0x2D:
        i += 1
    if i < n and h[i] == 0x30:
        i += 1
    elif i < n and 0x31 <= h[i] <= 0x39:
        i = _digits(h, i, n)
    else:
        raise HeaderError(E_BAD_NUMBER)
    if i < n and h[i] == 0x2E:
        s = i + 1
        i = _digits(h, s, n)
        if i == s:
            raise HeaderError(E_BAD_NUMBER)
    if i < n and h[i] in b"eE":
        i += 1
        if i < n and h[i] in b"+-":
            i += 1
        s = i
        i = _digits(h, s, n)
        if i == s:
            raise HeaderError(E_BAD_NUMBER)
    return i


def _scan_literal(h: bytes, i: int) -> int:
    for lit in (b"true", b"null", b"false"):
        if h.startswith(lit, i):
            return i + len(lit)
    raise HeaderError(E_UNEXPECTED_CHAR)


def _scan_member_key(h: bytes, i: int, n: int) -> int:
    """A key of a nested object, its ':' and the whitespace after it."""
    if i >= n or h[i] != 0x22:
        raise HeaderError(E_KEY_EXPECTED)
    i = _skip_ws(h, scan_string(h, i, n)[0], n)
    if i >= n or h[i] != 0x3A:
        raise HeaderError(E_COLON_EXPECTED)
    return _skip_ws(h, i + 1, n)


# The pure-Python twin of a C function, branch for branch, run per frame: splitting it would add
# Python calls per frame.
def skip_value(h: bytes, i: int, n: int, depth0: int) -> int:  # noqa: C901
    """Validate and skip one strict JSON value inside containers ``depth0`` deep."""
    stack: list[bool] = []  # True: object, False: array
    while True:
        if i >= n:
            raise HeaderError(E_VALUE_EXPECTED)
        c = h[i]
        if c == 0x7B or c == 0x5B:
            if depth0 + len(stack) + 1 > MAX_JSON_DEPTH:
                raise HeaderError(E_TOO_DEEP)
            stack.append(c == 0x7B)
            i = _skip_ws(h, i + 1, n)
            if i < n and h[i] == c + 2:
                i += 1
                stack.pop()
            elif c == 0x7B:
                i = _scan_member_key(h, i, n)
                continue
            else:
                continue
        elif c == 0x22:
            i = scan_string(h, i, n)[0]
        elif c == 0x2D or 0x30 <= c <= 0x39:
            i = _scan_number(h, i, n)
        elif c in b"tfn":
            i = _scan_literal(h, i)
        else:
            raise HeaderError(E_UNEXPECTED_CHAR)
        while True:
            if not stack:
                return i
            i = _skip_ws(h, i, n)
            if i >= n:
                raise HeaderError(E_UNTERMINATED_NESTED)
            c = h[i]
            is_obj = stack[-1]
            if c == 0x2C:
                i = _skip_ws(h, i + 1, n)
                if is_obj:
                    i = _scan_member_key(h, i, n)
                break
            if (is_obj and c == 0x7D) or (not is_obj and c == 0x5D):
                i += 1
                stack.pop()
                continue
            raise HeaderError(E_COMMA_EXPECTED)


def _parse_int(h: bytes, i: int, n: int) -> tuple[int, int]:
    """A strict JSON integer in int32 range: (value, index after it)."""
    neg = False
    v = 0
    if i < n and h[i] == 0x2D:
        neg = True
        i += 1
    if i < n and h[i] == 0x30:
        i += 1
    elif i < n and 0x31 <= h[i] <= 0x39:
        while i < n and 0x30 <= h[i] <= 0x39:
            v = v * 10 + (h[i] - 0x30)
            if v > 0x80000000:
                raise HeaderError(E_INT_RANGE)
            i += 1
    else:
        raise HeaderError(E_INT_EXPECTED)
    if i < n and (h[i] in b".eE" or 0x30 <= h[i] <= 0x39):
        raise HeaderError(E_INT_EXPECTED)
    if neg:
        v = -v
    if v > 0x7FFFFFFF:
        raise HeaderError(E_INT_RANGE)
    return v, i


def _header_key(key: bytes) -> int:
    """The key bit of a top-level key; 0 for other keys; -1 for a spelling fastjson's smart match
    could read as one of them (another case, '_' or '-' inserted, an "is" prefix)."""
    bit = _HEADER_KEYS.get(key)
    if bit is not None:
        return bit
    low = bytes(c + 32 if 65 <= c <= 90 else c for c in key if c not in (0x5F, 0x2D))
    if len(low) > 16:
        return 0
    if low in _FIELD_NAMES or (low[:2] == b"is" and low[2:] in _FIELD_NAMES):
        return -1
    return 0


def _walk_ext_fields(h: bytes, i: int, n: int, info: HeaderInfo) -> int:
    i = _skip_ws(h, i + 1, n)
    if i < n and h[i] == 0x7D:
        return i + 1
    seen: set[str] = set()
    while True:
        if i >= n or h[i] != 0x22:
            raise HeaderError(E_KEY_EXPECTED)
        ks = i + 1
        i, esc = scan_string(h, i, n)
        if esc:
            raise HeaderError(E_EXT_KEY_ESCAPED)
        field = _EXT_KEYS.get(h[ks : i - 1])
        if field is not None:
            if field in seen:
                raise HeaderError(E_EXT_DUP_KEY)
            seen.add(field)
        i = _skip_ws(h, i, n)
        if i >= n or h[i] != 0x3A:
            raise HeaderError(E_COLON_EXPECTED)
        i = _skip_ws(h, i + 1, n)
        if field is not None:
            if i >= n or h[i] != 0x22:
                raise HeaderError(E_EXT_NOT_STRING)
            vs = i + 1
            i, esc = scan_string(h, i, n)
            if field in _BOOL_FIELDS:
                setattr(info, field, reads_true(h[vs : i - 1], esc))
            else:
                setattr(info, field, (vs, i - 1 - vs, esc))
        else:
            i = skip_value(h, i, n, 2)
        i = _skip_ws(h, i, n)
        if i < n and h[i] == 0x2C:
            i = _skip_ws(h, i + 1, n)
            continue
        if i < n and h[i] == 0x7D:
            return i + 1
        raise HeaderError(E_COMMA_EXPECTED)


# The pure-Python twin of a C function, branch for branch, run per frame: splitting it would add
# Python calls per frame.
def parse_json_header(h: bytes, info: HeaderInfo) -> None:  # noqa: C901
    n = len(h)
    i = _skip_ws(h, 0, n)
    if i >= n or h[i] != 0x7B:
        raise HeaderError(E_NOT_OBJECT)
    i = _skip_ws(h, i + 1, n)
    if i < n and h[i] == 0x7D:
        raise HeaderError(E_NO_CODE)
    seen = 0
    while True:
        if i >= n or h[i] != 0x22:
            raise HeaderError(E_KEY_EXPECTED)
        ks = i + 1
        i, esc = scan_string(h, i, n)
        if esc:
            raise HeaderError(E_KEY_ESCAPED)
        k = _header_key(h[ks : i - 1])
        if k < 0:
            raise HeaderError(E_KEY_VARIANT)
        if k & seen:
            raise HeaderError(E_DUP_KEY)
        seen |= k
        i = _skip_ws(h, i, n)
        if i >= n or h[i] != 0x3A:
            raise HeaderError(E_COLON_EXPECTED)
        i = _skip_ws(h, i + 1, n)
        if k == _K_CODE:
            info.code, i = _parse_int(h, i, n)
        elif k == _K_FLAG:
            info.flag, i = _parse_int(h, i, n)
        elif k == _K_OPAQUE:
            info.opaque, i = _parse_int(h, i, n)
        elif k == _K_EXT and i < n and h[i] == 0x7B:
            i = _walk_ext_fields(h, i, n, info)
        else:
            i = skip_value(h, i, n, 1)
        i = _skip_ws(h, i, n)
        if i < n and h[i] == 0x2C:
            i = _skip_ws(h, i + 1, n)
            continue
        if i < n and h[i] == 0x7D:
            i += 1
            break
        raise HeaderError(E_COMMA_EXPECTED)
    if _skip_ws(h, i, n) != n:
        raise HeaderError(E_TRAILING)
    if not seen & _K_CODE:
        raise HeaderError(E_NO_CODE)


def parse_binary_header(h: bytes, info: HeaderInfo) -> None:
    """RocketMQSerializable's layout; the extFields region must end exactly at the header's end."""
    n = len(h)
    if n < 21:
        raise HeaderError(E_BIN_SHORT)
    info.code = _I16.unpack_from(h, 0)[0]
    info.opaque = _I32.unpack_from(h, 5)[0]
    info.flag = _I32.unpack_from(h, 9)[0]
    rlen = _I32.unpack_from(h, 13)[0]
    i = 17
    if rlen < 0 or rlen > n - i - 4:
        raise HeaderError(E_BIN_REMARK)
    i += rlen
    elen = _I32.unpack_from(h, i)[0]
    i += 4
    if elen < 0 or elen > n - i:
        raise HeaderError(E_BIN_EXT)
    end = i + elen
    if end != n:
        raise HeaderError(E_BIN_TRAILING)
    seen: set[str] = set()
    while i < end:
        if end - i < 2:
            raise HeaderError(E_BIN_KEY_TRUNC)
        klen = _U16.unpack_from(h, i)[0]
        i += 2
        if klen >= 0x8000 or klen > end - i - 4:  # Java reads the length as a signed short
            raise HeaderError(E_BIN_KEY)
        key = h[i : i + klen]
        i += klen
        vlen = _I32.unpack_from(h, i)[0]
        i += 4
        if vlen < 0 or vlen > end - i:
            raise HeaderError(E_BIN_VALUE)
        field = _EXT_KEYS.get(key)
        if field is not None:
            if field in seen:
                raise HeaderError(E_BIN_DUP_KEY)
            seen.add(field)
            if vlen > 0:  # Java reads an empty value as null: absent
                if not utf8_valid(h[i : i + vlen]):  # Java would read U+FFFD where the walk sees bytes
                    raise HeaderError(E_BAD_UTF8)
                if field in _BOOL_FIELDS:
                    setattr(info, field, reads_true(h[i : i + vlen], False))
                else:
                    setattr(info, field, (i, vlen, False))
        i += vlen


_UNESCAPE = {0x62: b"\b", 0x66: b"\f", 0x6E: b"\n", 0x72: b"\r", 0x74: b"\t"}


def json_unescape(s: bytes) -> bytes:
    """Decode the contents of a JSON string the walk accepted into UTF-8."""
    out = bytearray()
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c != 0x5C:
            out.append(c)
            i += 1
            continue
        c = s[i + 1]
        i += 2
        if c == 0x75:
            u = int(s[i : i + 4], 16)
            i += 4
            if 0xD800 <= u <= 0xDBFF:
                u = 0x10000 + ((u - 0xD800) << 10) + (int(s[i + 2 : i + 6], 16) - 0xDC00)
                i += 6
            out += chr(u).encode("utf-8")
        else:
            out += _UNESCAPE.get(c, bytes((c,)))
    return bytes(out)


def find_tag(props: bytes) -> bytes | None:
    """The TAGS value of decoded message properties as the broker reads them (None: none).

    MessageDecoder.string2messageProperties: entries split at \\x02; an entry of at least 3 bytes
    whose first \\x01 leaves a non-empty name and a non-empty value is a property; the last wins.
    """
    found = None
    for entry in props.split(b"\x02"):
        if len(entry) >= 3:
            kv = entry.find(b"\x01")
            if 0 < kv < len(entry) - 1 and entry[:kv] == b"TAGS":
                found = entry[kv + 1 :]
    return found


def props_tag(props: bytes, esc: bool) -> bytes | None:
    """The TAGS value of a send's properties (JSON-escaped when ``esc``)."""
    return find_tag(json_unescape(props) if esc else props)


_DELAY_NAMES = frozenset((b"DELAY", b"TIMER_DELAY_SEC", b"TIMER_DELAY_MS", b"TIMER_DELIVER_MS", b"__STARTDELIVERTIME"))


def find_delay(props: bytes) -> bool:
    """True when decoded message properties hold a delivery-time property as the broker reads
    them (the entries :func:`find_tag` reads)."""
    for entry in props.split(b"\x02"):
        if len(entry) >= 3:
            kv = entry.find(b"\x01")
            if 0 < kv < len(entry) - 1 and entry[:kv] in _DELAY_NAMES:
                return True
    return False


def props_delay(props: bytes, esc: bool) -> bool:
    """True when a send's properties (JSON-escaped when ``esc``) ask for a delivery time."""
    return find_delay(json_unescape(props) if esc else props)
