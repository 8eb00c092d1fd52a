"""The layout of a store record as a client reads it: shared by both records walks.

The scanner's records walk (``rmqfast/codec/_records_py.py``, compiled twin ``ext/records.pxi``)
and the policy path's (:mod:`rmqfast.codec.msgaddr`) patch a store host only in a record whose
fields end exactly where its TOTALSIZE says; this module holds that check for the Python side.
"""

from __future__ import annotations

import struct

from rmqfast.codec.tables import BORNHOST_V6, STOREHOST_V6

_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_I8 = struct.Struct(">b")


def layout_fits(mv: memoryview | bytes | bytearray, pos: int, total: int, sys_flag: int, v2: bool) -> bool:
    """Whether the record's fields, read as a client reads them (``MessageDecoder.decode``: field by
    field, TOTALSIZE only stored), end exactly at TOTALSIZE: else the client would find the next
    record (and its store host) elsewhere than this walk.  A non-positive body or properties
    length reads nothing, a negative topic length throws (as in Java)."""
    rec_end = pos + total
    at = pos + 84 + (12 if sys_flag & BORNHOST_V6 else 0) + (12 if sys_flag & STOREHOST_V6 else 0)
    if at + 4 > rec_end:
        return False
    n = _I32.unpack_from(mv, at)[0]
    at += 4 + (n if n > 0 else 0)
    width = 2 if v2 else 1
    if at + width > rec_end:
        return False
    n = (_I16 if v2 else _I8).unpack_from(mv, at)[0]
    if n < 0:
        return False
    at += width + n
    if at + 2 > rec_end:
        return False
    n = _I16.unpack_from(mv, at)[0]
    return at + 2 + (n if n > 0 else 0) == rec_end
