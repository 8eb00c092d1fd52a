"""SEND_BATCH_MESSAGE (320) bodies: ``MessageDecoder.encodeMessages`` / ``decodeMessages``.

Each inner message is one record (big-endian)::

    int32 totalSize   = 22 + bodyLen + propsLen (the whole record, this field included)
    int32 magicCode   = 0
    int32 bodyCRC     = 0
    int32 flag        user flag
    int32 bodyLen     ; byte[bodyLen] body
    int16 propsLen    ; byte[propsLen] properties (``k\\x01v\\x02...``, UTF-8)

The layout is the same in apache/rocketmq 4.9.x and 5.x.  Java's decoders (client
``decodeMessages``, broker ``MessageExtEncoder.encode(MessageExtBatch)``) read the fields in
sequence and ignore ``totalSize``, ``magicCode`` and ``bodyCRC``; ``countInnerMsgNum`` walks by
``totalSize`` only.  We decode like Java and additionally require ``totalSize`` to agree with
the lengths, because a body on which the two walks disagree is counted one way and stored
another.  ``magicCode`` and ``bodyCRC`` are ignored on decode and written as 0.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from rmqfast.codec.properties import MAX_PROPERTIES_BYTES, parse_properties, properties_bytes_for
from rmqfast.errors import BodyError

_HEAD = struct.Struct(">iiiii")  # totalSize, magic, bodyCRC, flag, bodyLen
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
#: Fixed part of a record: five int32 fields and the int16 properties length.
RECORD_OVERHEAD = _HEAD.size + 2

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


@dataclass
class BatchEntry:
    """One message of a batch.

    ``raw_properties`` holds the bytes the entry was decoded from; :func:`encode_batch` emits
    them unchanged while ``properties`` still equals what they parse to (see
    :func:`~rmqfast.codec.properties.properties_bytes_for`).  It does not take part in
    equality.
    """

    flag: int = 0
    body: bytes = b""
    properties: dict[str, str] = field(default_factory=dict)
    raw_properties: bytes | None = field(default=None, compare=False, repr=False)


def decode_batch(body: bytes | bytearray | memoryview) -> list[BatchEntry]:
    """Decode a batch body into its messages; :class:`BodyError` names the offset of a fault."""
    mv = _byte_view(body)
    end = len(mv)
    out: list[BatchEntry] = []
    pos = 0
    while pos < end:
        index = len(out)
        if end - pos < RECORD_OVERHEAD:
            raise BodyError(
                f"batch record {index} at offset {pos}: {end - pos} bytes left, "
                f"a record needs at least {RECORD_OVERHEAD}"
            )
        total, _magic, _crc, flag, body_len = _HEAD.unpack_from(mv, pos)
        if body_len < 0 or body_len > end - pos - RECORD_OVERHEAD:
            raise BodyError(
                f"batch record {index} at offset {pos}: body length {body_len} at offset "
                f"{pos + 16} is negative or runs past the end of the body ({end} bytes)"
            )
        body_at = pos + _HEAD.size
        props_len_at = body_at + body_len
        props_len = _I16.unpack_from(mv, props_len_at)[0]
        props_at = props_len_at + 2
        if props_len < 0 or props_at + props_len > end:
            raise BodyError(
                f"batch record {index} at offset {pos}: properties length {props_len} at "
                f"offset {props_len_at} is negative or runs past the end of the body "
                f"({end} bytes)"
            )
        expected = RECORD_OVERHEAD + body_len + props_len
        if total != expected:
            raise BodyError(
                f"batch record {index} at offset {pos}: totalSize is {total} but the body "
                f"({body_len}) and properties ({props_len}) lengths make {expected}"
            )
        raw = bytes(mv[props_at : props_at + props_len])
        out.append(
            BatchEntry(
                flag=flag,
                body=bytes(mv[body_at : body_at + body_len]),
                properties=parse_properties(raw),
                raw_properties=raw,
            )
        )
        pos += expected
    return out


def encode_batch(entries: list[BatchEntry]) -> bytes:
    """Encode ``entries`` exactly as Java's ``encodeMessages`` does (magic and CRC are 0)."""
    parts: list[bytes] = []
    for index, entry in enumerate(entries):
        props = properties_bytes_for(entry.properties, entry.raw_properties)
        if len(props) > MAX_PROPERTIES_BYTES:
            raise BodyError(
                f"batch entry {index}: properties are {len(props)} bytes, "
                f"at most {MAX_PROPERTIES_BYTES} fit the int16 length"
            )
        if not _INT32_MIN <= entry.flag <= _INT32_MAX:
            raise BodyError(f"batch entry {index}: flag {entry.flag} does not fit an int32")
        total = RECORD_OVERHEAD + len(entry.body) + len(props)
        if total > _INT32_MAX:
            raise BodyError(f"batch entry {index}: record of {total} bytes does not fit an int32")
        parts.append(_HEAD.pack(total, 0, 0, entry.flag, len(entry.body)))
        parts.append(bytes(entry.body))
        parts.append(_I16.pack(len(props)))
        parts.append(props)
    return b"".join(parts)


def count_batch(body: bytes | bytearray | memoryview) -> int:
    """Count the records by walking ``totalSize`` only, like Java's ``countInnerMsgNum``.

    Unlike Java (which loops forever on a zero size) this refuses a size below the
    22-byte minimum record or one that runs past the end.
    """
    mv = _byte_view(body)
    end = len(mv)
    pos = 0
    count = 0
    while pos < end:
        if end - pos < 4:
            raise BodyError(
                f"batch record {count} at offset {pos}: {end - pos} bytes left, "
                "too few for the int32 totalSize"
            )
        total = _I32.unpack_from(mv, pos)[0]
        if total < RECORD_OVERHEAD or total > end - pos:
            raise BodyError(
                f"batch record {count} at offset {pos}: totalSize {total} is below the "
                f"{RECORD_OVERHEAD}-byte minimum or runs past the end of the body ({end} bytes)"
            )
        pos += total
        count += 1
    return count


def scanned_batch_count(body: bytes) -> int:
    """Records in a SEND_BATCH_MESSAGE body as the relay's scanner counts them for the limiter and
    the topic counters: the totalSize words walked until the first non-positive size or the end
    (no error: the broker judges the body).  The pure scanner and the failover's resend
    accounting call this; the compiled scanner walks the same way in ``ext/scanner.pxi``."""
    count = 0
    i = 0
    n = len(body)
    while n - i >= 4:
        size = _I32.unpack_from(body, i)[0]
        if size <= 0:
            break
        count += 1
        i += size
    return count
