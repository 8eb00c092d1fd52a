"""Pure-Python twin of ``ext/records.pxi``: the store hosts of a records answer, walked by the scanner.

A records answer (pull, lite pull, pop, peek, query, view) carries a sequence of store records
(apache/rocketmq ``MessageDecoder``)::

    TOTALSIZE i32 | MAGICCODE i32 | BODYCRC | QUEUEID | FLAG | QUEUEOFFSET i64 | PHYSICALOFFSET i64 |
    SYSFLAG i32 (36) | BORNTIMESTAMP i64 | BORNHOST 4+4, or 16+4 with sysFlag 0x10 (48) |
    STORETIMESTAMP i64 | STOREHOST 4+4, or 16+4 with sysFlag 0x20 | ...

Only the IPv4 STOREHOST (address and int32 port, 8 bytes) is read and patched, at the same
length; bodies (compressed or inner batches alike), properties and CRCs are untouched, and an
IPv6 store host is left as it is (``rmqfast.codec.msgaddr.patch_store_hosts`` makes the same
choices for the policy path).  :func:`walk_store_hosts` checks every record (sizes, magic codes,
and that its fields as a client reads them end at its TOTALSIZE) and looks every store host up
first; it patches only when all are whole and known.  Anything else (a body that
is not whole records, an address the map does not know) is reported, and the scanner leaves the
frame to the policy path: the walk never guesses.
"""

from __future__ import annotations

import struct

from rmqfast._args import c_int
from rmqfast.codec.layout import layout_fits  # noqa: F401 - the policy path's walk shares it
from rmqfast.codec.tables import (  # noqa: F401 - re-exported
    ACTION_RECORDS,
    BORNHOST_V6,
    MAX_ADDRESSES,
    MIN_RECORD,
    REC_BAD,
    REC_MISS,
    REC_OK,
    RECORD_MAGIC_V1,
    RECORD_MAGIC_V2,
    STOREHOST_POS,
    STOREHOST_V6,
    SYSFLAG_POS,
)

_HEAD = struct.Struct(">iI")
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")


def _key(raw: object) -> bytes:
    if not isinstance(raw, bytes):
        raise TypeError(f"Argument must be bytes, not {type(raw).__name__}")
    if len(raw) != 8:
        raise ValueError(f"an address is 8 bytes (IPv4 and int32 port), got {len(raw)}")
    return raw


class AddressMap:
    """Real broker ``ip4 + port`` (8 bytes) -> the 8 bytes the records get instead (itself: leave
    it), filled by the message-address filter and read by the scanner.  At most MAX_ADDRESSES
    entries; an address beyond them stays unknown (its answers take the policy path)."""

    def __init__(self) -> None:
        self._map: dict[bytes, bytes] = {}
        self.rewritten = 0  # answers the scanner changed
        self.walked = 0  # answers the scanner walked and relayed without the policy

    def __len__(self) -> int:
        return len(self._map)

    @property
    def count(self) -> int:
        return len(self._map)

    def set(self, real: bytes, new: bytes) -> bool:
        """Remember ``real`` -> ``new``; False when the map is full (nothing stored)."""
        real, new = _key(real), _key(new)
        if real not in self._map and len(self._map) >= MAX_ADDRESSES:
            return False
        self._map[real] = new
        return True

    def get(self, real: bytes) -> bytes | None:
        """The 8 bytes ``real`` maps to, or None."""
        return self._map.get(_key(real))




def _walk(mv: memoryview, start: int, end: int, amap: AddressMap, patch: bool) -> tuple[int, int, bool]:
    pos = start
    seen = 0
    changed = False
    get = amap._map.get
    while pos < end:
        if end - pos < MIN_RECORD:
            return REC_BAD, seen, changed
        total, magic = _HEAD.unpack_from(mv, pos)
        if magic != RECORD_MAGIC_V1 and magic != RECORD_MAGIC_V2:
            return REC_BAD, seen, changed
        if total < MIN_RECORD or total > end - pos:
            return REC_BAD, seen, changed
        sys_flag = _I32.unpack_from(mv, pos + SYSFLAG_POS)[0]
        if not patch and not layout_fits(mv, pos, total, sys_flag, magic == RECORD_MAGIC_V2):
            return REC_BAD, seen, changed  # (the patching pass follows a checking one over the same bytes)
        if not sys_flag & STOREHOST_V6:
            at = pos + (STOREHOST_POS if not sys_flag & BORNHOST_V6 else STOREHOST_POS + 12)
            raw = bytes(mv[at : at + 8])
            new = get(raw)
            if new is None:
                return REC_MISS, seen, changed
            if patch and new != raw:
                mv[at : at + 8] = new
                changed = True
        seen += 1
        pos += total
    return REC_OK, seen, changed


def map_records(mv: memoryview, start: int, end: int, amap: AddressMap) -> int:
    """Check, then patch (``mv`` writable): the body changes only when every record is whole and known."""
    st = _walk(mv, start, end, amap, False)[0]
    if st != REC_OK:
        return st
    if _walk(mv, start, end, amap, True)[2]:
        amap.rewritten += 1
    amap.walked += 1
    return REC_OK


def walk_store_hosts(
    buf: bytes | bytearray | memoryview, start: int, end: int, amap: AddressMap, patch: bool = False
) -> tuple[int, int, bool]:
    """``(status, records, changed)`` of the store records in ``buf[start:end]`` (REC_OK, REC_MISS,
    REC_BAD); with ``patch`` (a writable buffer) the known store hosts are rewritten in place, but
    only when the status is REC_OK (a first pass checks them all).  A test aid: the scanner walks
    the records of the answers it was asked to."""
    start, end = c_int("start", start, "ssize"), c_int("end", end, "ssize")
    if not isinstance(amap, AddressMap):
        raise TypeError(f"Argument 'amap' has incorrect type (expected {__name__}.AddressMap, "
                        f"got {type(amap).__name__})")
    mv = memoryview(buf)
    if patch and mv.readonly:
        raise BufferError("Object is not writable.")
    if start < 0 or end > len(mv) or start > end:
        raise ValueError(f"walk range [{start}:{end}] outside a buffer of {len(mv)} bytes")
    st, seen, changed = _walk(mv, start, end, amap, False)
    if st == REC_OK and patch:
        st, seen, changed = _walk(mv, start, end, amap, True)
    return st, seen, changed


# Send answers: the offset ids in the ``msgId`` header field (ext/records.pxi's map_header_ids) -----

_MSGID_JSON = b'"msgId":"'
_HEX = frozenset(b"0123456789ABCDEFabcdef")


def _msgid_span(h: bytes, stype: int) -> tuple[int, int, int]:
    """(status, start, end) of the ``msgId`` value in header ``h``; start -1: no such field."""
    hlen = len(h)
    if stype == 0:
        at = h.find(_MSGID_JSON)
        if at < 0:
            return REC_OK, -1, -1
        s = at + len(_MSGID_JSON)
        e = h.find(b'"', s)
        if e < 0 or h.find(b"\\", s, e) >= 0 or h.find(_MSGID_JSON, e) >= 0:
            return REC_BAD, -1, -1
        return REC_OK, s, e
    if hlen < 21:
        return REC_BAD, -1, -1
    rlen = _I32.unpack_from(h, 13)[0]
    if rlen < 0 or 17 + rlen + 4 > hlen:
        return REC_BAD, -1, -1
    pos = 17 + rlen + 4
    vs = ve = -1
    while pos + 2 <= hlen:
        klen = _I16.unpack_from(h, pos)[0]
        if klen < 0 or pos + 2 + klen + 4 > hlen:
            return REC_BAD, -1, -1
        vlen = _I32.unpack_from(h, pos + 2 + klen)[0]
        if vlen < 0 or pos + 2 + klen + 4 + vlen > hlen:
            return REC_BAD, -1, -1
        if h[pos + 2 : pos + 2 + klen] == b"msgId":
            if vs >= 0:
                return REC_BAD, -1, -1
            vs = pos + 2 + klen + 4
            ve = vs + vlen
        pos += 2 + klen + 4 + vlen
    return REC_OK, vs, ve


def _offset_id_spans(v: bytes) -> list[tuple[int, bytes]]:
    """(offset, 8 raw address bytes) of each offset id among the comma-separated ids of ``v``."""
    out = []
    i = 0
    for tok in v.split(b","):
        if len(tok) == 32 and all(c in _HEX for c in tok[:16]):
            out.append((i, bytes.fromhex(tok[:16].decode("ascii"))))
        i += len(tok) + 1
    return out


def map_header_ids(mv: memoryview, start: int, end: int, stype: int, amap: AddressMap) -> int:
    """The offset ids of the send-answer header ``mv[start:end]``, checked, then patched (``mv``
    writable): REC_OK (no ``msgId`` counts as OK), REC_MISS or REC_BAD."""
    h = bytes(mv[start:end])
    st, vs, ve = _msgid_span(h, stype)
    if st != REC_OK or vs < 0:
        return st
    ids = _offset_id_spans(h[vs:ve])
    get = amap._map.get
    news = []
    for off, raw in ids:
        new = get(raw)
        if new is None:
            return REC_MISS
        if new != raw:
            news.append((off, new))
    for off, new in news:
        at = start + vs + off
        mv[at : at + 16] = new.hex().upper().encode("ascii")
    amap.walked += 1
    if news:
        amap.rewritten += 1
    return REC_OK


def map_send_ids(buf: bytes | bytearray | memoryview, start: int, end: int, stype: int, amap: AddressMap) -> int:
    """REC_OK, REC_MISS or REC_BAD for the send-answer header in ``buf[start:end]`` (writable), its
    offset ids patched in place when REC_OK.  A test aid: the scanner maps the answers it tracks."""
    start, end, stype = c_int("start", start, "ssize"), c_int("end", end, "ssize"), c_int("stype", stype, "int")
    if not isinstance(amap, AddressMap):
        raise TypeError(f"Argument 'amap' has incorrect type (expected {__name__}.AddressMap, "
                        f"got {type(amap).__name__})")
    mv = memoryview(buf)
    if mv.readonly:
        raise BufferError("Object is not writable.")
    if start < 0 or end > len(mv) or start > end:
        raise ValueError(f"header range [{start}:{end}] outside a buffer of {len(mv)} bytes")
    if stype != 0 and stype != 1:
        raise ValueError(f"serialize type must be 0 (JSON) or 1 (ROCKETMQ), got {stype}")
    return map_header_ids(mv, start, end, stype, amap)
