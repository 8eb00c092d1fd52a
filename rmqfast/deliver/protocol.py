"""The local hand-off between a worker and a deliver process (a Unix stream socket).

Frames: ``u32 length`` (of what follows) + ``u8 type`` + payload.

========  ==================  ==========================================================
type      direction           payload
========  ==================  ==========================================================
``H``     worker → deliver    JSON ``{"worker": N, "pid": P, "replaying": bool}`` (hello)
``C``     worker → deliver    ``u64 seq`` + ``u8 len`` + remote name + encoded CopyRecord
``R``     worker → deliver    as ``C``, for a copy that may already be stored in the remote
                              (it was handed over before a link broke or a worker crashed):
                              the remote is asked for its UNIQ_KEY before it is sent again
``D``     worker → deliver    empty: every copy the worker inherited from its spill at start
                              was handed over (sent after a hello with ``replaying`` true)
``A``     deliver → worker    ``u64 seq`` + ``u8 status`` (0 delivered, 1 given up, counted)
``S``     deliver → worker    JSON ``{"remote": R, "up": bool, "error": "..."}``
========  ==================  ==========================================================

A copy is acknowledged (``A``) only after the remote broker answered SUCCESS; the worker
then deletes it from its spill.  Everything unacknowledged when the connection breaks is
sent again by the worker (duplicates are possible, losses are not).

Order across a worker crash: when worker N's link breaks, its deliver process holds the copies
of every other worker (they are parked, not sent) until a worker N says hello with
``replaying`` false, or sends ``D`` (its inherited spill was handed over, so it is queued ahead
of the parked copies), or ``replicate.order_hold_max`` seconds passed.  See
:mod:`rmqfast.deliver.hold`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_HEAD = struct.Struct(">IB")
_SEQ = struct.Struct(">Q")
_ACK = struct.Struct(">QB")

HELLO = ord("H")
COPY = ord("C")
ACK = ord("A")
STATUS = ord("S")
REPLAYED = ord("D")
RESEND = ord("R")

ACK_DELIVERED = 0
ACK_GAVE_UP = 1

#: sun_path is 108 bytes on Linux.
MAX_SOCKET_PATH = 107


def socket_path(state_dir: str | Path, index: int) -> Path:
    return Path(state_dir) / "deliver" / f"d{index}.sock"


def check_socket_path(path: Path) -> None:
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"deliver socket path {str(path)!r} is {len(str(path).encode())} bytes, longer than the "
            f"{MAX_SOCKET_PATH} a Unix socket allows; choose a shorter proxy.state_dir"
        )


def frame(kind: int, payload: bytes) -> bytes:
    return _HEAD.pack(len(payload) + 1, kind) + payload


def copy_frame(seq: int, remote: str, record: bytes, kind: int = COPY) -> bytes:
    r = remote.encode()
    return _HEAD.pack(1 + 8 + 1 + len(r) + len(record), kind) + _SEQ.pack(seq) + bytes([len(r)]) + r + record


def parse_copy(payload: memoryview) -> tuple[int, str, bytes]:
    (seq,) = _SEQ.unpack_from(payload, 0)
    n = payload[8]
    return seq, bytes(payload[9 : 9 + n]).decode(), bytes(payload[9 + n :])


def ack_frame(seq: int, status: int) -> bytes:
    return frame(ACK, _ACK.pack(seq, status))


def parse_ack(payload: memoryview) -> tuple[int, int]:
    return _ACK.unpack_from(payload, 0)  # type: ignore[return-value]


def json_frame(kind: int, obj: dict[str, Any]) -> bytes:
    return frame(kind, json.dumps(obj).encode())


class FrameReader:
    """Accumulates bytes; :meth:`frames` yields ``(type, payload)`` of every whole frame."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buf += data
        out = []
        pos = 0
        buf = self.buf
        while len(buf) - pos >= 5:
            n, kind = _HEAD.unpack_from(buf, pos)
            if n < 1 or n > 1 << 30:
                raise ValueError(f"deliver hand-off frame of length {n} at offset {pos} is not valid")
            if len(buf) - pos < 4 + n:
                break
            out.append((kind, bytes(buf[pos + 5 : pos + 4 + n])))
            pos += 4 + n
        if pos:
            del buf[:pos]
        return out
