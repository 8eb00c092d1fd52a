"""Small stand-ins for upstream servers in unit tests (the real RocketMQ ones: tests/integration).

* :func:`FakeNameServer` and :func:`NotRemotingServer` live in :mod:`rmqfast.testing.standins`
  (the benchmarks use them too) and are imported here for the tests.
* :func:`kv_roundtrip` sends one ``GET_KV_CONFIG`` through a proxy and returns the answer.
"""

from __future__ import annotations

import itertools
import socket

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.testing.standins import QUERY_NOT_FOUND, FakeNameServer, NotRemotingServer
from rmqfast.testing.wire import read_frame

__all__ = ["QUERY_NOT_FOUND", "FakeNameServer", "NotRemotingServer", "kv_roundtrip"]

_opaques = itertools.count(1000)


def kv_roundtrip(addr: str, timeout: float = 10.0) -> RemotingCommand:
    """One GET_KV_CONFIG request to ``addr`` (host:port); the decoded answer."""
    host, _, port = addr.rpartition(":")
    opaque = next(_opaques)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(encode(RemotingCommand(code=C.GET_KV_CONFIG, opaque=opaque,
                                         ext_fields={"namespace": "ORDER_TOPIC_CONFIG", "key": "T"})))
        data = read_frame(s)
    assert data is not None, f"{addr} closed the connection without answering"
    cmd = decode_frame(data)
    assert cmd.opaque == opaque and cmd.is_response, cmd
    return cmd
