"""Readiness probe: does an upstream name server speak Remoting?  (one round trip, off the hot path)

A TCP connect proves only that something listens.  The probe sends one ``GET_KV_CONFIG`` (101)
request -- the read-only call Java clients make for ordered-topic configuration, so it is on the
data plane, needs no ACL a client would not have, and costs the name server one map lookup --
for a key that does not exist (namespace ``rmqfast``, key ``readyz``).  A RocketMQ name server
answers ``QUERY_NOT_FOUND`` (22).  Any well-formed Remoting *response* frame carrying our opaque
counts as "speaks Remoting", whatever its code: only the protocol is checked here, not the data.

Only the 8-byte frame head and the header are read (the header at most 64 KiB), with one overall
deadline, so a silent, slow or chatty non-Remoting server costs at most ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_header, encode
from rmqfast.errors import RemotingError

PROBE_CODE = C.GET_KV_CONFIG
MAX_PROBE_HEADER = 64 * 1024
MAX_PROBE_FRAME = 16 * 1024 * 1024


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # "Remoting response code 22 in 1.3 ms", or what went wrong
    seconds: float


class _Deadline:
    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.end = time.monotonic() + timeout

    def recv_exact(self, n: int, what: str) -> bytes:
        buf = b""
        while len(buf) < n:
            left = self.end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete {what} within the probe timeout")
            self.sock.settimeout(left)
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"the server closed the connection after {len(buf)} bytes of the {what}")
            buf += chunk
        return buf


def probe_remoting(host: str, port: int, timeout: float = 1.0, tls: Any = None) -> ProbeResult:
    """One Remoting round trip to ``host:port`` within ``timeout`` seconds (never raises).

    ``tls``: ``(ssl.SSLContext, server name or "")`` for an upstream that speaks TLS
    (``[tls.upstream]``, :func:`rmqfast.proxy.tls.probe_tls`)."""
    t0 = time.monotonic()
    opaque = int.from_bytes(os.urandom(3), "big") + 1
    request = encode(RemotingCommand(code=PROBE_CODE, opaque=opaque, version=0,
                                     ext_fields={"namespace": "rmqfast", "key": "readyz"}))

    def result(ok: bool, detail: str) -> ProbeResult:
        return ProbeResult(ok, detail, time.monotonic() - t0)

    try:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.create_connection((host, port), timeout=timeout))
            if tls is not None:  # the handshake runs within the socket's timeout
                sock = stack.enter_context(tls[0].wrap_socket(sock, server_hostname=tls[1] or host))
            d = _Deadline(sock, max(0.01, timeout - (time.monotonic() - t0)))
            sock.settimeout(max(0.01, d.end - time.monotonic()))
            sock.sendall(request)
            length, mark = struct.unpack(">iI", d.recv_exact(8, "frame head"))
            stype, header_len = mark >> 24, mark & 0xFFFFFF
            if not 4 <= length <= MAX_PROBE_FRAME or stype not in (0, 1) or header_len > length - 4:
                return result(False, f"not a Remoting frame (first bytes {struct.pack('>iI', length, mark).hex()})")
            if header_len > MAX_PROBE_HEADER:
                return result(False, f"answer header of {header_len} bytes is too large for a probe answer")
            cmd = decode_header(d.recv_exact(header_len, "header"), stype)
    except (OSError, TimeoutError) as exc:
        return result(False, getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)
    except (RemotingError, ValueError) as exc:
        return result(False, f"not a Remoting answer: {exc}")
    if not cmd.is_response:
        return result(False, f"the answer is a request (code {cmd.code}), not a response")
    if cmd.opaque != opaque:
        return result(False, f"the answer's opaque {cmd.opaque} is not the request's {opaque}")
    return result(True, f"Remoting response code {cmd.code} in {(time.monotonic() - t0) * 1000:.1f} ms")
