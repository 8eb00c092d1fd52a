"""The gRPC-over-HTTP/2 wire details of :mod:`rmqfast.grpcfront.h2server`: the ``grpc-timeout``
header, the ``grpc-status``/``grpc-message`` trailers (percent-encoded), the status codes it answers
with, and the table of served methods (path -> handler, kind, (de)serializers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

UNARY, SERVER_STREAM, BIDI = 0, 1, 2

# gRPC status codes
OK, CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 1, 2, 4, 8, 12, 13

_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(v: bytes) -> float | None:
    """``grpc-timeout`` (at most 8 digits and a unit) in seconds; None if absent or malformed."""
    if not v or len(v) > 9 or not v[:-1].isdigit():
        return None
    unit = _UNITS.get(v[-1:])
    return None if unit is None else int(v[:-1]) * unit


def pct(message: str) -> bytes:
    """``grpc-message``'s percent-encoding (bytes outside 0x20-0x7E, and '%')."""
    raw = message.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def trailer(code: int, message: str = "") -> bytes:
    return b"%d\0%s" % (code, pct(message[:1024]))


OK_TRAILER = b"0\0"


class Method:
    __slots__ = ("fn", "kind", "deser", "ser")

    def __init__(self, fn: Callable[..., Any], kind: int, deser: Callable[[bytes], Any],
                 ser: Callable[[Any], bytes]) -> None:
        self.fn, self.kind, self.deser, self.ser = fn, kind, deser, ser


def methods_of(svc: Any) -> dict[bytes, Method]:
    """``/package.Service/Name`` -> the handler of every served method of ``svc`` (a MessagingService)."""
    pb = svc.pb
    out = {}
    for m in pb.service.methods:
        if m.name not in svc.SERVED:
            continue
        kind = BIDI if m.client_streaming else SERVER_STREAM if m.server_streaming else UNARY
        out[f"/{pb.service.full_name}/{m.name}".encode()] = Method(
            getattr(svc, m.name), kind, getattr(pb, m.input_type.name).FromString,
            getattr(pb, m.output_type.name).SerializeToString)
    return out
