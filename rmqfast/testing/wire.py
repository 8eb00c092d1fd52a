"""Blocking frame reads for tests and tools that talk Remoting over a plain (or gevent) socket."""

from __future__ import annotations

import socket
import struct


def read_frame(sock: socket.socket) -> bytes | None:
    """One whole frame (length word included), or None when the peer closed first."""
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (length,) = struct.unpack(">i", head)
    rest = b""
    while len(rest) < length:
        chunk = sock.recv(length - len(rest))
        if not chunk:
            return None
        rest += chunk
    return head + rest
