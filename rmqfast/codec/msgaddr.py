"""Broker addresses inside messages: find them and patch them in place, same length.

A client learns a broker address from a message in three places (checked against
apache/rocketmq ``MessageDecoder`` and rocketmq-client-go v2.1.2 ``primitive.decodeMessage``):

* the STOREHOST of every store record in a pull, pop, query or view answer (the Go consumer
  sends CONSUMER_SEND_MSG_BACK to it; Java's ``sendMessageBack`` falls back to it);
* the *offset message id* (``MessageDecoder.createMessageId``): 16 bytes, store IPv4 + port +
  commit-log offset, as 32 upper-case hex digits.  Clients compute it from STOREHOST when they
  decode a record, and a send answer carries it in its ``msgId`` header field (a batch answer:
  comma-separated ids).  ``viewMessage``/``queryMsgById`` connect to the address it encodes.

Every patch here keeps lengths: an IPv4 address and port (8 bytes, 16 hex digits) is replaced
by another IPv4 address and port, so frame and record sizes, CRCs (which cover only the
body) and the message identity (UNIQ_KEY, keys, body) are untouched.  IPv6 store hosts are
left alone (an IPv4 replacement would change the record length).

``Mapping`` below is any callable from the 8 raw bytes ``ip4 + port`` of a real broker to the
8 bytes of its proxy endpoint, or ``None`` when it is not to be changed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from rmqfast.codec.layout import layout_fits

#: 8 raw bytes (IPv4 + int32 port) -> 8 replacement bytes, or None: leave it.
Mapping = Callable[[bytes], "bytes | None"]

_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_HEAD = struct.Struct(">iI")  # TOTALSIZE, MAGICCODE
_MAGIC_V1 = 0xDAA320A7
_MAGIC_V2 = 0xDAA320AB
_BORNHOST_V6 = 0x10
_STOREHOST_V6 = 0x20
# TOTALSIZE..BORNTIMESTAMP: 4+4+4+4+4+8+8+4+8
_BORNHOST_POS = 48
_SYSFLAG_POS = 36
#: The smallest record that still holds both hosts (IPv4) and the fields after them.
_MIN_RECORD = 64 + 8 + 4 + 8 + 4 + 1 + 2
#: Binary (ROCKETMQ) header fixed part: code, language, version, opaque, flag, remark length.
_BIN_FIXED = 2 + 1 + 2 + 4 + 4 + 4

OFFSET_ID_HEX = 32  # IPv4 offset message id: 16 bytes in hex
_HEX_DIGITS = frozenset("0123456789ABCDEFabcdef")


def host_bytes(host: str, port: int) -> bytes:
    """``ip4 + port`` as they sit in a store record; ValueError for anything but IPv4."""
    parts = host.split(".")
    if len(parts) != 4 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
        raise ValueError(f"{host!r} is not an IPv4 address")
    if not 0 <= port <= 0x7FFFFFFF:
        raise ValueError(f"port {port} is out of range")
    return bytes(int(p) for p in parts) + _I32.pack(port)


def format_host(raw: bytes) -> str:
    """``"a.b.c.d:port"`` of 8 raw bytes."""
    return f"{raw[0]}.{raw[1]}.{raw[2]}.{raw[3]}:{_I32.unpack_from(raw, 4)[0]}"


def store_host_offset(body: bytes | bytearray | memoryview, pos: int) -> int:
    """Where the STOREHOST of the record at ``pos`` starts, or -1 when it is IPv6."""
    sys_flag = _I32.unpack_from(body, pos + _SYSFLAG_POS)[0]
    if sys_flag & _STOREHOST_V6:
        return -1
    born = 20 if sys_flag & _BORNHOST_V6 else 8
    return pos + _BORNHOST_POS + born + 8


def patch_store_hosts(
    body: bytes | bytearray, mapping: Mapping, start: int = 0, cache: dict[bytes, bytes] | None = None
) -> tuple[bytearray | None, int]:
    """Replace mapped STOREHOSTs in the store records that fill ``body[start:]``.

    ``start`` lets a caller pass a whole frame and the offset of its body (one copy less).
    ``cache`` (real -> replacement, identity for "leave it") is consulted before ``mapping``:
    the hot path is one dict lookup per record.  Returns ``(patched copy of body or None when
    nothing changed, records seen)``.  Raises ValueError when the body is not a sequence of
    records (the caller then relays it unchanged and logs: a body it cannot walk is not one it
    may patch).
    """
    if not isinstance(body, bytes):  # slices must be hashable (cache keys)
        body = bytes(body)
    n = len(body)
    pos = start
    out: bytearray | None = None
    seen = 0
    head = _HEAD.unpack_from
    i32 = _I32.unpack_from
    get = (cache if cache is not None else {}).get
    while pos < n:
        if n - pos < _MIN_RECORD:
            raise ValueError(f"record {seen} at body byte {pos - start} is cut off ({n - pos} bytes left, a "
                             f"record needs at least {_MIN_RECORD})")
        total, magic = head(body, pos)
        if magic != _MAGIC_V1 and magic != _MAGIC_V2:
            raise ValueError(f"record {seen} at body byte {pos - start} has magic code {magic:#010x}, "
                             "not a message")
        if total < _MIN_RECORD or total > n - pos:
            raise ValueError(f"record {seen} at body byte {pos - start} claims {total} bytes; {n - pos} are left")
        sys_flag = i32(body, pos + _SYSFLAG_POS)[0]
        if not layout_fits(body, pos, total, sys_flag, magic == _MAGIC_V2):
            raise ValueError(f"record {seen} at body byte {pos - start} claims {total} bytes, but its fields "
                             "(as a client reads them) do not end there")
        if not sys_flag & _STOREHOST_V6:
            at = pos + (_BORNHOST_POS + 16 if not sys_flag & _BORNHOST_V6 else _BORNHOST_POS + 28)
            raw = body[at : at + 8]
            new = get(raw)
            if new is None:
                new = mapping(raw)
                if new is None:
                    new = raw
            if new != raw:
                if out is None:
                    out = bytearray(body)
                out[at : at + 8] = new
        seen += 1
        pos += total
    return out, seen


def patch_offset_ids(value: str, mapping: Mapping) -> str | None:
    """Map the address in each IPv4 offset message id of ``value`` (comma-separated ids).

    Returns the new value (same length, upper-case hex as ``createMessageId`` writes), or
    ``None`` when nothing changed.  Ids that are not 32 hex digits are kept as they are.
    """
    ids = value.split(",")
    changed = False
    for i, mid in enumerate(ids):
        if len(mid) != OFFSET_ID_HEX or not all(c in _HEX_DIGITS for c in mid[:16]):
            continue  # as the scanner (ext/records.pxi): 16 hex digits of address, nothing else
        raw = bytes.fromhex(mid[:16])
        new = mapping(raw)
        if new is not None:
            ids[i] = new.hex().upper() + mid[16:]
            changed = True
    return ",".join(ids) if changed else None


def header_field_span(data: bytes | bytearray, key: str) -> tuple[int, int] | None:
    """``(start, end)`` in the whole frame ``data`` of the value of extFields ``key``; None: absent.

    JSON headers (what a Java broker answers a JSON request with) are searched for the
    structural ``"key":"`` (a quote inside a JSON string is always escaped, so the sequence
    cannot come from a value); ROCKETMQ binary headers are walked field by field.
    """
    if len(data) < 8:
        return None
    mark = _I32.unpack_from(data, 4)[0]
    stype, hlen = (mark >> 24) & 0xFF, mark & 0xFFFFFF
    h0, h1 = 8, 8 + hlen
    if h1 > len(data):
        return None
    if stype == 0:
        needle = b'"' + key.encode() + b'":"'
        at = data.find(needle, h0, h1)
        if at < 0:
            return None
        start = at + len(needle)
        end = data.find(b'"', start, h1)
        if end < 0 or data.find(b"\\", start, end) >= 0:  # escaped values are not ids: leave them
            return None
        return start, end
    if stype != 1 or hlen < _BIN_FIXED + 4:
        return None
    pos = h0 + _BIN_FIXED
    remark_len = _I32.unpack_from(data, pos - 4)[0]
    if remark_len < 0 or pos + remark_len + 4 > h1:
        return None
    pos += remark_len + 4
    want = key.encode()
    while pos + 2 <= h1:
        klen = _I16.unpack_from(data, pos)[0]
        if klen < 0 or pos + 2 + klen + 4 > h1:
            return None
        k = bytes(data[pos + 2 : pos + 2 + klen])
        pos += 2 + klen
        vlen = _I32.unpack_from(data, pos)[0]
        pos += 4
        if vlen < 0 or pos + vlen > h1:
            return None
        if k == want:
            return pos, pos + vlen
        pos += vlen
    return None
