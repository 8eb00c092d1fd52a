"""Whole-frame codec for Remoting commands: the policy side, where exactness beats speed.

A frame (``RemotingCommand.encode`` / ``NettyDecoder`` in apache/rocketmq)::

    int32 length        = 4 + headerLen + bodyLen (excludes itself)
    int32 headerMark    = serializeType << 24 | headerLen   (0 = JSON, 1 = ROCKETMQ)
    byte[headerLen] header
    byte[bodyLen]   body

JSON headers are what fastjson 1.2.83 writes for ``RemotingCommand`` (getters in alphabetical
order, ``remark`` and ``extFields`` omitted when null, default string escaping).  ROCKETMQ
headers follow ``RocketMQSerializable.rocketMQProtocolEncode``/``Decode``.

Leniency on decode mirrors the Java side where it is harmless:

* JSON: unknown keys and ``serializeTypeCurrentRPC`` are ignored (the type byte of the frame
  is authoritative, as in ``RemotingCommand.headerDecode``); a missing ``language`` is
  ``"JAVA"`` and missing ``version``/``opaque``/``flag`` are 0 (the Java field defaults);
  ``language`` may be an ordinal; integer fields may be decimal strings (fastjson casts them);
  a non-string ``extFields`` or ``remark`` value becomes its JSON text, numbers exactly as
  written (fastjson's ``castToString``), and a null ``extFields`` value is dropped (both Java
  encoders skip null values anyway).  A missing or non-integer ``code`` is an error.
* ROCKETMQ: an unknown language ordinal ``n`` decodes to ``"UNKNOWN_n"`` (Java decodes it to
  null) and encodes back to ``n``; a zero-length ext key or value decodes to ``""`` (4.9.x;
  5.x reads null).  A header whose fields do not end exactly at its length is an error:
  Java would read the body from the wrong place.

Decoded ``ext_fields`` keep the order of the frame, so ``encode(decode_frame(f)) == f`` for
frames Java writes.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from rmqfast.codec.codes import (
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    LANGUAGES,
    SERIALIZE_JSON,
    SERIALIZE_ROCKETMQ,
)
from rmqfast.codec.tables import DEFAULT_MAX_FRAME, DEFAULT_MAX_HEADER
from rmqfast.errors import FrameError, FrameTooLarge, HeaderError

__all__ = [
    "DEFAULT_MAX_FRAME", "DEFAULT_MAX_HEADER", "RemotingCommand", "decode_frame",
    "decode_header", "encode", "encode_header", "fastjson_quote", "make_response",
]

_FRAME_HEAD = struct.Struct(">iI")
_BIN_FIXED = struct.Struct(">hBhiii")  # code, language, version, opaque, flag, remarkLen
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_INT16 = (-(2**15), 2**15 - 1)
_INT32 = (-(2**31), 2**31 - 1)
_MAX_HEADER_FIELD = 0xFFFFFF
_UNKNOWN_LANGUAGE = re.compile(r"UNKNOWN_([0-9]{1,3})")
_DECIMAL = re.compile(r"-?[0-9]{1,19}")
_LANGUAGE_ORDINAL = {name: i for i, name in enumerate(LANGUAGES)}
_SERIALIZE_NAMES = {SERIALIZE_JSON: "JSON", SERIALIZE_ROCKETMQ: "ROCKETMQ"}


@dataclass
class RemotingCommand:
    """One Remoting request or response.

    ``language`` is the ``LanguageCode`` name; ``ext_fields`` is ``None`` when the header has
    none (Java's null map), which differs from ``{}`` in JSON.  ``serialize_type`` is the
    header format used by :func:`encode`.
    """

    code: int
    language: str = "JAVA"
    version: int = 0
    opaque: int = 0
    flag: int = 0
    remark: str | None = None
    ext_fields: dict[str, str] | None = None
    body: bytes = b""
    serialize_type: int = SERIALIZE_JSON

    @property
    def is_response(self) -> bool:
        """Whether the response bit (``RPC_TYPE``, bit 0) is set."""
        return bool(self.flag & FLAG_RESPONSE)

    @property
    def is_oneway(self) -> bool:
        """Whether the one-way bit (``RPC_ONEWAY``, bit 1) is set."""
        return bool(self.flag & FLAG_ONEWAY)


# --- decoding ---------------------------------------------------------------------------


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def decode_frame(
    frame: bytes | bytearray | memoryview,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME,
    max_header_size: int = DEFAULT_MAX_HEADER,
) -> RemotingCommand:
    """Decode one whole frame, its leading 4-byte length word included.

    :class:`FrameTooLarge` for a frame (``4 + length``) above ``max_frame_size`` or a header
    above ``max_header_size``; :class:`FrameError` for a length that disagrees with the data
    or an unknown serialize type; :class:`HeaderError` for an undecodable header.
    """
    mv = _byte_view(frame)
    size = len(mv)
    if size < 8:
        raise FrameError(
            f"frame of {size} bytes is shorter than its 8-byte length and header-length words"
        )
    length, mark = _FRAME_HEAD.unpack_from(mv, 0)
    if length != size - 4:
        raise FrameError(
            f"length word at offset 0 is {length}, but {size - 4} bytes follow it"
        )
    if size > max_frame_size:
        raise FrameTooLarge(f"frame of {size} bytes exceeds the limit of {max_frame_size} bytes")
    stype = mark >> 24
    header_len = mark & _MAX_HEADER_FIELD
    if stype not in _SERIALIZE_NAMES:
        raise FrameError(
            f"unknown serialize type {stype} in the header-length word at offset 4; "
            "expected 0 (JSON) or 1 (ROCKETMQ)"
        )
    if header_len > length - 4:
        raise FrameError(
            f"header length {header_len} at offset 4 exceeds the {length - 4} bytes "
            "after the header-length word"
        )
    if header_len > max_header_size:
        raise FrameTooLarge(
            f"header of {header_len} bytes exceeds the limit of {max_header_size} bytes"
        )
    cmd = _decode_header(mv[8 : 8 + header_len], stype, base=8)
    cmd.body = bytes(mv[8 + header_len :])
    return cmd


def decode_header(header: bytes | bytearray | memoryview, serialize_type: int) -> RemotingCommand:
    """Decode a header alone (offsets in errors count from the header's first byte)."""
    if serialize_type not in _SERIALIZE_NAMES:
        raise FrameError(
            f"unknown serialize type {serialize_type}; expected 0 (JSON) or 1 (ROCKETMQ)"
        )
    return _decode_header(_byte_view(header), serialize_type, base=0)


def _decode_header(header: memoryview, stype: int, base: int) -> RemotingCommand:
    if stype == SERIALIZE_JSON:
        return _decode_json_header(bytes(header), base)
    return _decode_binary_header(header, base)


class _JsonNumber(str):
    """A non-integer JSON number, kept as the text it was written as."""


def _json_text(value: Any) -> str:
    """The text fastjson's ``castToString`` gives a parsed JSON value."""
    if isinstance(value, str):  # includes _JsonNumber: the token as written
        return value
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(
            f"{fastjson_quote(k)}:{_json_value(v)}" for k, v in value.items()
        ) + "}"
    return "[" + ",".join(_json_value(v) for v in value) + "]"


def _json_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str) and not isinstance(value, _JsonNumber):
        return fastjson_quote(value)
    return _json_text(value)


def _json_int(obj: dict[str, Any], key: str, default: int | None, base: int) -> int:
    value = obj.get(key)
    if value is None:
        if default is None:
            raise HeaderError(f"JSON header at offset {base} has no {key!r}")
        return default
    result: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        result = value
    elif type(value) is str and _DECIMAL.fullmatch(value):
        result = int(value)
    if result is None:
        raise HeaderError(
            f"JSON header at offset {base}: {key!r} is {value!r}; expected an integer"
        )
    if not _INT32[0] <= result <= _INT32[1]:
        raise HeaderError(
            f"JSON header at offset {base}: {key!r} is {result}, which does not fit an int32"
        )
    return result


def _decode_json_header(data: bytes, base: int) -> RemotingCommand:
    # Java decodes the bytes as UTF-8 with replacement of malformed sequences.
    text = data.decode("utf-8", "replace")
    try:
        obj = json.loads(text, parse_float=_JsonNumber, parse_constant=_JsonNumber)
    except json.JSONDecodeError as exc:
        at = base + len(text[: exc.pos].encode("utf-8"))
        raise HeaderError(f"JSON header is not valid JSON: {exc.msg} at offset {at}") from exc
    except RecursionError as exc:
        raise HeaderError(f"JSON header at offset {base} is nested too deeply") from exc
    except ValueError as exc:  # an integer beyond Python's digit limit
        raise HeaderError(f"JSON header at offset {base} is not decodable: {exc}") from exc
    if not isinstance(obj, dict):
        raise HeaderError(
            f"JSON header at offset {base} is a {type(obj).__name__}; expected an object"
        )
    code = _json_int(obj, "code", None, base)
    language = obj.get("language")
    if language is None:
        language = "JAVA"
    elif isinstance(language, int) and not isinstance(language, bool):
        if not 0 <= language < len(LANGUAGES):
            raise HeaderError(
                f"JSON header at offset {base}: language ordinal {language} is not one of "
                f"0..{len(LANGUAGES) - 1}"
            )
        language = LANGUAGES[language]
    elif type(language) is not str:
        raise HeaderError(
            f"JSON header at offset {base}: language is {language!r}; expected a name"
        )
    remark = obj.get("remark")
    if remark is not None:
        remark = _json_text(remark)
    raw_ext = obj.get("extFields")
    ext: dict[str, str] | None = None
    if raw_ext is not None:
        if not isinstance(raw_ext, dict):
            raise HeaderError(
                f"JSON header at offset {base}: extFields is a {type(raw_ext).__name__}; "
                "expected an object"
            )
        ext = {k: _json_text(v) for k, v in raw_ext.items() if v is not None}
    return RemotingCommand(
        code=code,
        language=language,
        version=_json_int(obj, "version", 0, base),
        opaque=_json_int(obj, "opaque", 0, base),
        flag=_json_int(obj, "flag", 0, base),
        remark=remark,
        ext_fields=ext,
        serialize_type=SERIALIZE_JSON,
    )


def _decode_binary_header(h: memoryview, base: int) -> RemotingCommand:
    size = len(h)
    if size < _BIN_FIXED.size + 4:
        raise HeaderError(
            f"ROCKETMQ header at offset {base} is {size} bytes; the fixed part needs "
            f"{_BIN_FIXED.size + 4}"
        )
    code, lang, version, opaque, flag, remark_len = _BIN_FIXED.unpack_from(h, 0)
    language = LANGUAGES[lang] if lang < len(LANGUAGES) else f"UNKNOWN_{lang}"
    pos = _BIN_FIXED.size
    if remark_len < 0 or remark_len > size - pos - 4:
        raise HeaderError(
            f"ROCKETMQ header: remark length {remark_len} at offset {base + pos - 4} is "
            f"negative or leaves no room for the extFields length (header is {size} bytes)"
        )
    remark = bytes(h[pos : pos + remark_len]).decode("utf-8", "replace") if remark_len else None
    pos += remark_len
    ext_len = _I32.unpack_from(h, pos)[0]
    if ext_len < 0 or ext_len != size - pos - 4:
        raise HeaderError(
            f"ROCKETMQ header: extFields length {ext_len} at offset {base + pos} should be "
            f"the {size - pos - 4} bytes left in the header"
        )
    pos += 4
    ext: dict[str, str] | None = None
    if ext_len:
        ext = {}
        end = pos + ext_len
        while pos < end:
            if end - pos < 2:
                raise HeaderError(
                    f"ROCKETMQ header: extFields entry at offset {base + pos} is cut off "
                    "before its int16 key length"
                )
            key_len = _I16.unpack_from(h, pos)[0]
            if key_len < 0 or key_len > end - pos - 2 - 4:
                raise HeaderError(
                    f"ROCKETMQ header: extFields key length {key_len} at offset {base + pos} "
                    f"is negative or runs past the extFields end at offset {base + end}"
                )
            pos += 2
            key = bytes(h[pos : pos + key_len]).decode("utf-8", "replace")
            pos += key_len
            val_len = _I32.unpack_from(h, pos)[0]
            if val_len < 0 or val_len > end - pos - 4:
                raise HeaderError(
                    f"ROCKETMQ header: value length {val_len} of key {key!r} at offset "
                    f"{base + pos} is negative or runs past the extFields end at offset "
                    f"{base + end}"
                )
            pos += 4
            ext[key] = bytes(h[pos : pos + val_len]).decode("utf-8", "replace")
            pos += val_len
    return RemotingCommand(
        code=code, language=language, version=version, opaque=opaque, flag=flag,
        remark=remark, ext_fields=ext, serialize_type=SERIALIZE_ROCKETMQ,
    )


# --- encoding ---------------------------------------------------------------------------

_SHORT_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r",
                  '"': '\\"', "\\": "\\\\"}
_BROWSER_SHORT_ESCAPES = {**_SHORT_ESCAPES, "/": "\\/"}
# fastjson 1.2.83 default: controls, '"', '\\', U+007F..U+009F, U+2028 and U+2029.
_DEFAULT_SPECIAL = re.compile('[\x00-\x1f"\\\\\x7f-\x9f\u2028\u2029]')
# BrowserCompatible: additionally '/' and everything outside printable ASCII.
_BROWSER_SPECIAL = re.compile('[\x00-\x1f"\\\\/\x7f-\U0010ffff]')


def _unicode_escape(ch: str) -> str:
    code = ord(ch)
    if code > 0xFFFF:  # a Java string holds this as a surrogate pair, escaped one by one
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04X}\\u{0xDC00 + (code & 0x3FF):04X}"
    return f"\\u{code:04X}"


def _default_escape(m: re.Match[str]) -> str:
    ch = m.group()
    return _SHORT_ESCAPES.get(ch) or _unicode_escape(ch)


def _browser_escape(m: re.Match[str]) -> str:
    ch = m.group()
    return _BROWSER_SHORT_ESCAPES.get(ch) or _unicode_escape(ch)


def fastjson_quote(s: str, *, browser_compatible: bool = False) -> str:
    """``s`` as a double-quoted JSON string, escaped the way fastjson 1.2.83 escapes it.

    Default: ``\\b \\t \\n \\f \\r \\" \\\\`` in short form, other control characters,
    U+007F..U+009F, U+2028 and U+2029 as upper-case ``\\uXXXX``; everything else raw.
    ``browser_compatible`` (``SerializerFeature.BrowserCompatible``, used by the name server
    for standard-JSON routes) also escapes ``/`` and every non-ASCII character.
    """
    if browser_compatible:
        return '"' + _BROWSER_SPECIAL.sub(_browser_escape, s) + '"'
    return '"' + _DEFAULT_SPECIAL.sub(_default_escape, s) + '"'


def _check_int(value: int, bounds: tuple[int, int], what: str, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FrameError(f"{what} is {value!r}; expected an int")
    if not bounds[0] <= value <= bounds[1]:
        bits = 16 if bounds is _INT16 else 32
        raise FrameError(f"{what} {value} does not fit an int{bits}{hint}")


def _utf8(s: str) -> bytes:
    # Java's getBytes(UTF_8) writes '?' for an unpaired surrogate; "replace" does the same.
    return s.encode("utf-8", "replace")


def _encode_json_header(cmd: RemotingCommand) -> bytes:
    parts = ['{"code":', str(cmd.code)]
    if cmd.ext_fields is not None:
        parts.append(',"extFields":{')
        parts.append(",".join(
            f"{fastjson_quote(_ext_str(k, 'key'))}:{fastjson_quote(_ext_str(v, k))}"
            for k, v in cmd.ext_fields.items()
        ))
        parts.append("}")
    parts += [',"flag":', str(cmd.flag), ',"language":', fastjson_quote(cmd.language),
              ',"opaque":', str(cmd.opaque)]
    if cmd.remark is not None:
        parts += [',"remark":', fastjson_quote(cmd.remark)]
    parts += [',"serializeTypeCurrentRPC":"JSON","version":', str(cmd.version), "}"]
    return _utf8("".join(parts))


def _ext_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise FrameError(
            f"extFields {what!r}: keys and values must be str, got {type(value).__name__}"
        )
    return value


def _encode_binary_header(cmd: RemotingCommand) -> bytes:
    _check_int(cmd.code, _INT16, "code",
               "; the ROCKETMQ header's code is an int16, use serialize_type=SERIALIZE_JSON")
    _check_int(cmd.version, _INT16, "version", " (the ROCKETMQ header's version is an int16)")
    if cmd.language in _LANGUAGE_ORDINAL:
        lang = _LANGUAGE_ORDINAL[cmd.language]
    else:
        m = _UNKNOWN_LANGUAGE.fullmatch(cmd.language)
        if m is None or int(m.group(1)) > 255:
            raise FrameError(
                f"language {cmd.language!r} has no ROCKETMQ ordinal; expected one of "
                f"{', '.join(LANGUAGES)} or UNKNOWN_<0..255>"
            )
        lang = int(m.group(1))
    remark = _utf8(cmd.remark) if cmd.remark else b""
    parts = [_BIN_FIXED.pack(cmd.code, lang, cmd.version, cmd.opaque, cmd.flag, len(remark)),
             remark]
    ext_parts: list[bytes] = []
    for k, v in (cmd.ext_fields or {}).items():
        key = _utf8(_ext_str(k, "key"))
        val = _utf8(_ext_str(v, k))
        if len(key) > _INT16[1]:
            raise FrameError(f"extFields key of {len(key)} bytes does not fit the int16 length")
        ext_parts += [_I16.pack(len(key)), key, _I32.pack(len(val)), val]
    ext = b"".join(ext_parts)
    parts += [_I32.pack(len(ext)), ext]
    return b"".join(parts)


def encode_header(cmd: RemotingCommand) -> bytes:
    """The header bytes of ``cmd`` in ``cmd.serialize_type`` (no length words)."""
    _check_int(cmd.code, _INT32, "code")
    _check_int(cmd.version, _INT32, "version")
    _check_int(cmd.opaque, _INT32, "opaque")
    _check_int(cmd.flag, _INT32, "flag")
    if cmd.serialize_type == SERIALIZE_JSON:
        header = _encode_json_header(cmd)
    elif cmd.serialize_type == SERIALIZE_ROCKETMQ:
        header = _encode_binary_header(cmd)
    else:
        raise FrameError(
            f"unknown serialize type {cmd.serialize_type}; expected 0 (JSON) or 1 (ROCKETMQ)"
        )
    if len(header) > _MAX_HEADER_FIELD:
        raise FrameTooLarge(
            f"header of {len(header)} bytes does not fit the 24-bit header length"
        )
    return header


def encode(cmd: RemotingCommand) -> bytes:
    """The whole frame of ``cmd``, leading length word included."""
    header = encode_header(cmd)
    length = 4 + len(header) + len(cmd.body)
    if length > _INT32[1]:
        raise FrameTooLarge(f"frame length {length} does not fit the int32 length word")
    return b"".join((
        _FRAME_HEAD.pack(length, (cmd.serialize_type << 24) | len(header)), header,
        bytes(cmd.body),
    ))


def make_response(
    request: RemotingCommand,
    code: int,
    remark: str | None = None,
    ext_fields: dict[str, str] | None = None,
    body: bytes = b"",
) -> RemotingCommand:
    """A response to ``request``, as Java's ``createResponseCommand`` builds one.

    Same opaque and version, flag = response bit, language ``"JAVA"``, the request's serialize
    type unless ``code`` does not fit the ROCKETMQ int16 (then JSON).  Note that Java clients
    read some responses' extFields unconditionally (a send response's ``MSG_REGION``): pass a
    non-empty ``ext_fields`` for those, since an empty map is null after a ROCKETMQ round trip.
    """
    stype = request.serialize_type
    if stype == SERIALIZE_ROCKETMQ and not _INT16[0] <= code <= _INT16[1]:
        stype = SERIALIZE_JSON
    return RemotingCommand(
        code=code,
        language="JAVA",
        version=request.version,
        opaque=request.opaque,
        flag=FLAG_RESPONSE,
        remark=remark,
        ext_fields=ext_fields,
        body=body,
        serialize_type=stype,
    )
