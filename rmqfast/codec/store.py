"""Store records: the body of pull and pop responses (``MessageDecoder.decode``/``encode``).

A pull (11, 361) or pop (200050) response body is a concatenation of commit-log records, all
fields big-endian::

     1 int32  TOTALSIZE        the whole record, this field included
     2 int32  MAGICCODE        MAGIC_V1 (1-byte topic length) or MAGIC_V2 (2-byte)
     3 int32  BODYCRC
     4 int32  QUEUEID
     5 int32  FLAG
     6 int64  QUEUEOFFSET
     7 int64  PHYSICALOFFSET   (commit-log offset)
     8 int32  SYSFLAG
     9 int64  BORNTIMESTAMP
    10        BORNHOST         4-byte IPv4 or, with BORNHOST_V6_FLAG, 16-byte IPv6; int32 port
    11 int64  STORETIMESTAMP
    12        STOREHOST        likewise, with STOREHOST_V6_FLAG
    13 int32  RECONSUMETIMES
    14 int64  PREPARED TRANSACTION OFFSET
    15 int32  bodyLen ; body
    16 int8 (V1) / int16 (V2) topicLen ; topic (UTF-8)
    17 int16  propsLen ; properties (``k\\x01v\\x02...``, UTF-8)

Checked against apache/rocketmq ``MessageDecoder`` (4.9.8 and 5.x HEAD), ``MessageVersion``,
``MessageSysFlag``, ``CompressionType`` and ``MessageExtEncoder.calMsgLength``.  Java reads
the topic and properties lengths as *signed* byte/short; values that Java would read as
negative are refused here too.  Java ignores TOTALSIZE when decoding, but the broker computes
it from the lengths (``calMsgLength``), so a record whose TOTALSIZE disagrees is refused.
4.9.x decoders ignore MAGICCODE and always read a 1-byte topic length, so V2 records (written
by 5.x brokers only for topics over 127 bytes) are readable by 5.x clients only.
"""

from __future__ import annotations

import ipaddress
import struct
import zlib
from dataclasses import dataclass, field

from rmqfast.codec.properties import MAX_PROPERTIES_BYTES, parse_properties, properties_bytes_for
from rmqfast.errors import BodyError

#: MAGICCODE of a V1 record (1-byte topic length); Java's ``-626843481``.
MAGIC_V1 = 0xDAA320A7
#: MAGICCODE of a V2 record (2-byte topic length, for topics over 127 bytes); ``-626843477``.
MAGIC_V2 = 0xDAA320AB
#: MAGICCODE of the blank filler at the end of a commit-log file; never a message.
BLANK_MAGIC = 0xCBD43194

# MessageSysFlag bits.
COMPRESSED_FLAG = 0x1
MULTI_TAGS_FLAG = 0x2
TRANSACTION_PREPARED_TYPE = 0x4
TRANSACTION_COMMIT_TYPE = 0x8
TRANSACTION_ROLLBACK_TYPE = 0xC
BORNHOST_V6_FLAG = 0x10
STOREHOST_V6_FLAG = 0x20
NEED_UNWRAP_FLAG = 0x40
INNER_BATCH_FLAG = 0x80
COMPRESSION_TYPE_MASK = 0x700

# Compression types: ``(sysFlag & COMPRESSION_TYPE_MASK) >> 8``.  Java maps 0 to ZLIB for
# records written before the type bits existed.
COMPRESSION_LZ4 = 1
COMPRESSION_ZSTD = 2
COMPRESSION_ZLIB = 3

#: Default cap of :func:`decompress_body` output, against decompression bombs.
DEFAULT_MAX_DECOMPRESSED = 64 * 1024 * 1024

# TOTALSIZE, MAGICCODE, BODYCRC, QUEUEID, FLAG, QUEUEOFFSET, PHYSICALOFFSET, SYSFLAG,
# BORNTIMESTAMP: the fixed part before the first host.
_PREFIX = struct.Struct(">iIiiiqqiq")
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_I8 = struct.Struct(">b")


class CompressionUnavailable(BodyError):
    """A body is compressed with an algorithm whose Python module is not installed."""


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


@dataclass
class StoreRecord:
    """One decoded store record.

    Hosts are ``"a.b.c.d:port"`` or, for IPv6, ``"[v6addr]:port"``; which one a record
    carries is decided by ``sys_flag`` (``BORNHOST_V6_FLAG``, ``STOREHOST_V6_FLAG``).  The
    topic is decoded with ``surrogateescape`` so that even invalid UTF-8 re-encodes to the
    same bytes.  ``raw_properties`` (excluded from equality) keeps the decoded properties
    bytes so that :func:`encode_records` reproduces them exactly while ``properties`` is
    unchanged.  ``magic`` picks V1 or V2 on encode.
    """

    topic: str = ""
    body: bytes = b""
    properties: dict[str, str] = field(default_factory=dict)
    queue_id: int = 0
    flag: int = 0
    queue_offset: int = 0
    commit_log_offset: int = 0
    sys_flag: int = 0
    born_timestamp: int = 0
    born_host: str = "0.0.0.0:0"
    store_timestamp: int = 0
    store_host: str = "0.0.0.0:0"
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0
    body_crc: int = 0
    magic: int = MAGIC_V1
    raw_properties: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def is_compressed(self) -> bool:
        """Whether the body is compressed (``COMPRESSED_FLAG``)."""
        return is_compressed(self.sys_flag)

    @property
    def compression_type(self) -> int:
        """The compression type bits (0 and 3 mean ZLIB, 1 LZ4, 2 ZSTD)."""
        return (self.sys_flag & COMPRESSION_TYPE_MASK) >> 8

    @property
    def msg_id(self) -> str:
        """The offset message id, as ``MessageDecoder.createMessageId`` makes it.

        Upper-case hex of store-host address, port (int32) and commit-log offset (int64):
        32 characters for IPv4, 56 for IPv6.  It names the *real* broker.
        """
        ip, port = _parse_host(self.store_host, bool(self.sys_flag & STOREHOST_V6_FLAG),
                               "store_host")
        return (ip + _I32.pack(port) + _I64.pack(self.commit_log_offset)).hex().upper()


def is_compressed(sys_flag: int) -> bool:
    """Whether ``sys_flag`` has ``COMPRESSED_FLAG`` (0x1)."""
    return bool(sys_flag & COMPRESSED_FLAG)


def decompress_body(record: StoreRecord, *,
                    max_size: int | None = DEFAULT_MAX_DECOMPRESSED) -> bytes:
    """The record's body, decompressed if ``COMPRESSED_FLAG`` is set.

    ZLIB (types 0 and 3, Java's ``Deflater`` stream: zlib header) uses the standard library;
    LZ4 (frame format, ``lz4-java``'s ``LZ4FrameOutputStream``) needs the ``lz4`` package and
    ZSTD the ``zstandard`` package, otherwise :class:`CompressionUnavailable` is raised.
    Output above ``max_size`` bytes (``None``: no cap) raises :class:`BodyError`.
    """
    if not record.is_compressed:
        return record.body
    ctype = record.compression_type
    data = record.body
    try:
        if ctype in (0, COMPRESSION_ZLIB):
            return _zlib_decompress(data, max_size)
        if ctype == COMPRESSION_LZ4:
            return _lz4_decompress(data, max_size)
        if ctype == COMPRESSION_ZSTD:
            return _zstd_decompress(data, max_size)
    except BodyError:
        raise
    except Exception as exc:  # each library raises its own error type for corrupt input
        raise BodyError(
            f"record at queue offset {record.queue_offset}: cannot decompress the "
            f"{len(data)}-byte body (compression type {ctype}): {exc}"
        ) from exc
    raise BodyError(
        f"record at queue offset {record.queue_offset}: unknown compression type {ctype} "
        f"in sys_flag {record.sys_flag:#x} (expected 1 LZ4, 2 ZSTD, 0 or 3 ZLIB)"
    )


def _too_big(max_size: int) -> BodyError:
    return BodyError(f"decompressed body exceeds the limit of {max_size} bytes")


def _zlib_decompress(data: bytes, max_size: int | None) -> bytes:
    d = zlib.decompressobj()
    out = d.decompress(data, max_size + 1 if max_size is not None else 0)
    if max_size is not None and len(out) > max_size:
        raise _too_big(max_size)
    if not d.eof:
        raise BodyError(f"zlib stream of {len(data)} bytes is truncated")
    return out


def _lz4_decompress(data: bytes, max_size: int | None) -> bytes:
    try:
        import lz4.frame  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise CompressionUnavailable(
            "the body is LZ4-compressed (compression type 1); install the 'lz4' package "
            "to decompress it"
        ) from exc
    d = lz4.frame.LZ4FrameDecompressor()
    out: bytes = d.decompress(data, max_length=max_size + 1 if max_size is not None else -1)
    if max_size is not None and len(out) > max_size:
        raise _too_big(max_size)
    if not d.eof:
        raise BodyError(f"LZ4 frame of {len(data)} bytes is truncated")
    return out


def _zstd_decompress(data: bytes, max_size: int | None) -> bytes:
    try:
        import zstandard  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise CompressionUnavailable(
            "the body is ZSTD-compressed (compression type 2); install the 'zstandard' "
            "package to decompress it"
        ) from exc
    # Java's ZstdOutputStream does not record the content size, so the size cap is enforced
    # with a bounded streaming read first; a frame within the cap is then decompressed in
    # one go, which also tells whether it was complete.
    if max_size is not None:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            if len(reader.read(max_size + 1)) > max_size:
                raise _too_big(max_size)
    d = zstandard.ZstdDecompressor().decompressobj()
    out: bytes = d.decompress(data)
    if not d.eof:
        raise BodyError(f"ZSTD frame of {len(data)} bytes is truncated")
    return out


def _format_host(ip: bytes, port: int) -> str:
    if len(ip) == 4:
        return f"{ipaddress.IPv4Address(ip)}:{port}"
    return f"[{ipaddress.IPv6Address(ip).compressed}]:{port}"


def _parse_host(host: str, v6: bool, what: str) -> tuple[bytes, int]:
    addr, sep, port_s = host.rpartition(":")
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not sep or not 0 <= port <= 65535:
        raise BodyError(f"{what} {host!r} is not 'ip:port' with a port in 0..65535")
    try:
        if v6:
            if not (addr.startswith("[") and addr.endswith("]")):
                raise ValueError("not bracketed")
            return ipaddress.IPv6Address(addr[1:-1]).packed, port
        return ipaddress.IPv4Address(addr).packed, port
    except ValueError as exc:
        kind = "'[v6addr]:port' (its V6 sys_flag bit is set)" if v6 else \
            "'a.b.c.d:port' (its V6 sys_flag bit is clear)"
        raise BodyError(f"{what} {host!r} must be {kind}: {exc}") from exc


def _need(pos: int, size: int, limit: int, index: int, start: int, what: str) -> None:
    if size < 0:
        raise BodyError(f"store record {index} at offset {start}: {what} is negative")
    if pos + size > limit:
        raise BodyError(
            f"store record {index} at offset {start}: {what} needs {size} bytes from offset "
            f"{pos}, past the end at offset {limit}"
        )


def decode_records(body: bytes | bytearray | memoryview) -> list[StoreRecord]:
    """Decode every record of a pull/pop response body; faults raise :class:`BodyError`."""
    mv = _byte_view(body)
    end = len(mv)
    out: list[StoreRecord] = []
    pos = 0
    while pos < end:
        out.append(_decode_one(mv, pos, end, len(out)))
        pos += _I32.unpack_from(mv, pos)[0]
    return out


def _decode_one(mv: memoryview, start: int, end: int, index: int) -> StoreRecord:
    _need(start, _PREFIX.size, end, index, start, "fixed fields")
    (total, magic, body_crc, queue_id, flag, queue_offset, commit_log_offset, sys_flag,
     born_ts) = _PREFIX.unpack_from(mv, start)
    if magic not in (MAGIC_V1, MAGIC_V2):
        what = "the commit-log BLANK_MAGIC" if magic == BLANK_MAGIC else "unknown"
        raise BodyError(
            f"store record {index} at offset {start}: magic code {magic:#010x} at offset "
            f"{start + 4} is {what}; expected {MAGIC_V1:#010x} (V1) or {MAGIC_V2:#010x} (V2)"
        )
    _need(start, total, end, index, start, f"TOTALSIZE {total} at offset {start}")
    rec_end = start + total
    pos = start + _PREFIX.size

    born_len = 16 if sys_flag & BORNHOST_V6_FLAG else 4
    _need(pos, born_len + 4 + 8, rec_end, index, start, "born host and store timestamp")
    born_ip = bytes(mv[pos : pos + born_len])
    born_port_at = pos + born_len
    born_port = _I32.unpack_from(mv, born_port_at)[0]
    pos = born_port_at + 4
    store_ts = _I64.unpack_from(mv, pos)[0]
    pos += 8

    store_len = 16 if sys_flag & STOREHOST_V6_FLAG else 4
    _need(pos, store_len + 4 + 4 + 8 + 4, rec_end, index, start,
          "store host, reconsume times, prepared offset and body length")
    store_ip = bytes(mv[pos : pos + store_len])
    store_port_at = pos + store_len
    store_port = _I32.unpack_from(mv, store_port_at)[0]
    pos = store_port_at + 4
    # Java builds an InetSocketAddress, which refuses such ports.
    for port, at, name in ((born_port, born_port_at, "born"), (store_port, store_port_at, "store")):
        if not 0 <= port <= 65535:
            raise BodyError(
                f"store record {index} at offset {start}: {name} host port {port} at offset "
                f"{at} is outside 0..65535"
            )
    reconsume_times = _I32.unpack_from(mv, pos)[0]
    prepared_offset = _I64.unpack_from(mv, pos + 4)[0]
    body_len = _I32.unpack_from(mv, pos + 12)[0]
    pos += 16
    _need(pos, body_len, rec_end, index, start, f"body length {body_len} at offset {pos - 4}")
    body = bytes(mv[pos : pos + body_len])
    pos += body_len

    if magic == MAGIC_V1:
        _need(pos, 1, rec_end, index, start, "topic length")
        topic_len = _I8.unpack_from(mv, pos)[0]
        pos += 1
    else:
        _need(pos, 2, rec_end, index, start, "topic length")
        topic_len = _I16.unpack_from(mv, pos)[0]
        pos += 2
    _need(pos, topic_len, rec_end, index, start,
          f"topic length {topic_len} (signed, as Java reads it) before offset {pos}")
    topic = bytes(mv[pos : pos + topic_len]).decode("utf-8", "surrogateescape")
    pos += topic_len

    _need(pos, 2, rec_end, index, start, "properties length")
    props_len = _I16.unpack_from(mv, pos)[0]
    pos += 2
    _need(pos, props_len, rec_end, index, start,
          f"properties length {props_len} at offset {pos - 2}")
    raw_props = bytes(mv[pos : pos + props_len])
    pos += props_len
    if pos != rec_end:
        raise BodyError(
            f"store record {index} at offset {start}: TOTALSIZE is {total} but the fields "
            f"end after {pos - start} bytes"
        )
    return StoreRecord(
        topic=topic, body=body, properties=parse_properties(raw_props), queue_id=queue_id,
        flag=flag, queue_offset=queue_offset, commit_log_offset=commit_log_offset,
        sys_flag=sys_flag, born_timestamp=born_ts, born_host=_format_host(born_ip, born_port),
        store_timestamp=store_ts, store_host=_format_host(store_ip, store_port),
        reconsume_times=reconsume_times, prepared_transaction_offset=prepared_offset,
        body_crc=body_crc, magic=magic, raw_properties=raw_props,
    )


_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


def encode_records(records: list[StoreRecord]) -> bytes:
    """Encode ``records``: the exact inverse of :func:`decode_records`."""
    parts: list[bytes] = []
    for index, rec in enumerate(records):
        parts.append(_encode_one(rec, index))
    return b"".join(parts)


def _encode_one(rec: StoreRecord, index: int) -> bytes:
    for name, bounds in (("queue_id", _INT32), ("flag", _INT32), ("sys_flag", _INT32),
                         ("reconsume_times", _INT32), ("body_crc", _INT32),
                         ("queue_offset", _INT64), ("commit_log_offset", _INT64),
                         ("born_timestamp", _INT64), ("store_timestamp", _INT64),
                         ("prepared_transaction_offset", _INT64)):
        value = getattr(rec, name)
        if not bounds[0] <= value <= bounds[1]:
            bits = 32 if bounds is _INT32 else 64
            raise BodyError(f"store record {index}: {name} {value} does not fit an int{bits}")
    topic = rec.topic.encode("utf-8", "surrogateescape")
    if rec.magic == MAGIC_V1:
        if len(topic) > 127:
            raise BodyError(
                f"store record {index}: topic of {len(topic)} bytes does not fit the V1 signed "
                f"byte length; use magic=MAGIC_V2"
            )
        topic_len = _I8.pack(len(topic))
    elif rec.magic == MAGIC_V2:
        if len(topic) > 32767:
            raise BodyError(f"store record {index}: topic of {len(topic)} bytes is too long")
        topic_len = _I16.pack(len(topic))
    else:
        raise BodyError(
            f"store record {index}: magic {rec.magic:#x} is neither MAGIC_V1 nor MAGIC_V2"
        )
    props = properties_bytes_for(rec.properties, rec.raw_properties)
    if len(props) > MAX_PROPERTIES_BYTES:
        raise BodyError(
            f"store record {index}: properties are {len(props)} bytes, at most "
            f"{MAX_PROPERTIES_BYTES} fit the int16 length"
        )
    born_ip, born_port = _parse_host(rec.born_host, bool(rec.sys_flag & BORNHOST_V6_FLAG),
                                     f"store record {index}: born_host")
    store_ip, store_port = _parse_host(rec.store_host, bool(rec.sys_flag & STOREHOST_V6_FLAG),
                                       f"store record {index}: store_host")
    total = (_PREFIX.size + len(born_ip) + 4 + 8 + len(store_ip) + 4 + 4 + 8 + 4
             + len(rec.body) + len(topic_len) + len(topic) + 2 + len(props))
    if total > _INT32[1]:
        raise BodyError(f"store record {index}: {total} bytes do not fit the int32 TOTALSIZE")
    return b"".join((
        _PREFIX.pack(total, rec.magic, rec.body_crc, rec.queue_id, rec.flag, rec.queue_offset,
                     rec.commit_log_offset, rec.sys_flag, rec.born_timestamp),
        born_ip, _I32.pack(born_port), _I64.pack(rec.store_timestamp),
        store_ip, _I32.pack(store_port), _I32.pack(rec.reconsume_times),
        _I64.pack(rec.prepared_transaction_offset), _I32.pack(len(rec.body)), bytes(rec.body),
        topic_len, topic, _I16.pack(len(props)), props,
    ))
