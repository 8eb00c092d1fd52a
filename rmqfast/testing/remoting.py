"""The harness's Remoting client: one request, one answer, over rmqfast's own codec.

Used against real RocketMQ only (readiness checks, topic creation, offsets), never to judge
the proxy: a request is framed by :func:`rmqfast.codec.command.encode` and the answer read
with :func:`rmqfast.testing.wire.read_frame` and decoded by
:func:`rmqfast.codec.command.decode_frame`, so a codec bug here shows up as a broker refusing
the harness, loudly.  (The integration tests' raw frames in ``tests/integration/itutil.py``
stay independent of the codec on purpose: they check the proxy.)
"""

from __future__ import annotations

import itertools
import random
import socket
from collections.abc import Mapping

from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.testing.wire import read_frame

#: A decoded answer; ``ext_fields`` is ``{}`` (never None) when the answer has none.
RemotingResponse = RemotingCommand

#: The request version the harness sends (MQVersion V4_9_4's ordinal, like a 4.9.4+ client).
REQUEST_VERSION = 401

_opaque = itertools.count(random.randrange(1, 1 << 20))


def _text(v: object) -> str:
    # Java's String.valueOf for the values tests pass (bools as true/false).
    return "true" if v is True else "false" if v is False else str(v)


def remoting_request(
    addr: str,
    code: int,
    ext_fields: Mapping[str, object] | None = None,
    body: bytes = b"",
    *,
    timeout: float = 5.0,
    credentials: tuple[str, str] | None = None,
) -> RemotingResponse:
    """Sends one request with a JSON header to ``addr`` ("host:port") on a fresh connection and
    returns the answer with the same opaque.

    ``ext_fields`` values are sent as Java would print them (``True`` -> ``"true"``); None
    values are left out.  ``credentials`` ``(access_key, secret_key)`` signs the request as
    ``AclClientRPCHook`` does (:mod:`rmqfast.testing.aclsign`), for ACL-enabled brokers.
    ``ConnectionError`` when the peer closes before answering, ``socket.timeout`` after
    ``timeout`` seconds of silence, ``rmqfast.errors.FrameError``
    (a ValueError) for an answer that is not a Remoting frame.
    """
    host, _, port = addr.rpartition(":")
    opaque = next(_opaque) & 0x7FFFFFFF
    fields = {k: _text(v) for k, v in (ext_fields or {}).items() if v is not None}
    if credentials is not None:
        from rmqfast.testing.aclsign import sign

        fields = sign(fields, bytes(body), *credentials)
    request = RemotingCommand(code=code, version=REQUEST_VERSION, opaque=opaque, ext_fields=fields or None,
                              body=bytes(body))
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(encode(request))
        while True:
            frame = read_frame(s)
            if frame is None:
                raise ConnectionError(f"{addr} closed the connection before answering request code {code}")
            answer = decode_frame(frame)
            if answer.is_response and answer.opaque == opaque:
                if answer.ext_fields is None:
                    answer.ext_fields = {}
                return answer
            # not ours (should not happen on a fresh connection)
