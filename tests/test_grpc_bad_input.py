"""A gRPC SendMessage with what RocketMQ forbids in a message (issue 30, finding 6): answered with the
``apache.rocketmq.v2.Code`` Apache's proxy answers (ILLEGAL_MESSAGE_KEY for a key with ``\\x02``...),
never ``UNKNOWN: ValueError``, and nothing of it reaches the broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from rmqfast.codec import codes as C  # noqa: E402
from rmqfast.codec.command import RemotingCommand  # noqa: E402
from rmqfast.grpcfront import protos  # noqa: E402
from rmqfast.grpcfront.service import MessagingService, Route  # noqa: E402
from rmqfast.grpcfront.settings import GrpcSection  # noqa: E402


@pytest.fixture(scope="module")
def pb() -> Any:
    return protos.load()


class SendPool:
    """A broker that takes every send."""

    def __init__(self) -> None:
        self.sends: list[dict[str, str]] = []

    async def request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                      timeout: float = 3.0) -> RemotingCommand:
        assert code == C.SEND_MESSAGE_V2
        self.sends.append(ext)
        return RemotingCommand(code=0, flag=1, ext_fields={"queueOffset": "1", "msgId": "X"})


class Ctx:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def _service(pb: Any) -> tuple[MessagingService, SendPool]:
    svc = MessagingService(pb, [], GrpcSection(enabled=True))
    pool = SendPool()
    svc.pool = pool  # type: ignore[assignment]
    svc._routes = {"T": Route.parse(b'{"brokerDatas":[{"brokerName":"a","brokerAddrs":{"0":"a:1"}}],'
                                    b'"queueDatas":[{"brokerName":"a","perm":6,"readQueueNums":2,'
                                    b'"writeQueueNums":2}]}', 3600)}
    return svc, pool


def _sys(field: str, value: str) -> Callable[[Any], None]:
    return lambda m: setattr(m.system_properties, field, value)


def _prop(k: str, v: str) -> Callable[[Any], None]:
    return lambda m: m.user_properties.__setitem__(k, v)


def _keys(*keys: str) -> Callable[[Any], None]:
    return lambda m: m.system_properties.keys.extend(keys)


CASES = [
    ("key \\x02", _keys("a\x02b"), "ILLEGAL_MESSAGE_KEY", "key cannot contain control character"),
    ("key \\x01", _keys("ok", "a\x01"), "ILLEGAL_MESSAGE_KEY", "key cannot contain control character"),
    ("key \\x7f", _keys("\x7f"), "ILLEGAL_MESSAGE_KEY", "key cannot contain control character"),
    ("key blank", _keys(" \t"), "ILLEGAL_MESSAGE_KEY", "key cannot be the char sequence of whitespace"),
    ("tag \\x02", _sys("tag", "t\x02"), "ILLEGAL_MESSAGE_TAG", "tag cannot contain control character"),
    ("tag |", _sys("tag", "a|b"), "ILLEGAL_MESSAGE_TAG", "tag cannot contain '|'"),
    ("tag blank", _sys("tag", "  "), "ILLEGAL_MESSAGE_TAG", "tag cannot be the char sequence of whitespace"),
    ("group \\x02", _sys("message_group", "g\x02"), "ILLEGAL_MESSAGE_GROUP",
     "message group cannot contain control character"),
    ("group blank", _sys("message_group", " "), "ILLEGAL_MESSAGE_GROUP",
     "message group cannot be the char sequence of whitespace"),
    ("id \\x02", _sys("message_id", "ID\x02"), "ILLEGAL_MESSAGE_ID", "message id cannot contain control character"),
    ("id blank", _sys("message_id", " "), "ILLEGAL_MESSAGE_ID", "message id cannot be empty"),
    ("property value \\x02", _prop("k", "v\x02"), "ILLEGAL_MESSAGE_PROPERTY_KEY", "control character"),
    ("property name \\x01", _prop("k\x01", "v"), "ILLEGAL_MESSAGE_PROPERTY_KEY", "control character"),
    ("property value empty", _prop("k", ""), "ILLEGAL_MESSAGE_PROPERTY_KEY", "cannot be empty"),
    ("property name empty", _prop("", "v"), "ILLEGAL_MESSAGE_PROPERTY_KEY", "cannot be empty"),
    ("property of the system", _prop("UNIQ_KEY", "v"), "ILLEGAL_MESSAGE_PROPERTY_KEY", "property is used by system"),
    ("trace context \\x02", _sys("trace_context", "t\x02"), "BAD_REQUEST", "trace context cannot contain"),
    ("born host \\x02", _sys("born_host", "h\x02"), "BAD_REQUEST", "born host cannot contain"),
]


@pytest.mark.parametrize("mutate,code,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_message_rocketmq_forbids_is_refused_with_apaches_code(pb: Any, mutate: Any, code: str,
                                                                 message: str) -> None:
    svc, pool = _service(pb)
    req = pb.SendMessageRequest()
    m = req.messages.add(body=b"x")
    m.topic.name, m.system_properties.message_id = "T", "ID"
    mutate(m)
    resp = asyncio.run(svc.SendMessage(req, Ctx()))
    assert pb.Code.Name(resp.status.code) == code, resp
    assert pb.Code.Name(resp.entries[0].status.code) == code and message in resp.entries[0].status.message
    assert pool.sends == []  # nothing of it reached the broker


def test_what_is_allowed_still_goes_through(pb: Any) -> None:
    """Spaces inside keys, non-ASCII text, empty keys among others, a non-breaking space (Java's
    isWhitespace does not count it) reach the broker as sent."""
    svc, pool = _service(pb)
    req = pb.SendMessageRequest()
    m = req.messages.add(body=b"x")
    m.topic.name, m.system_properties.message_id = "T", "ID"
    m.system_properties.keys.extend(["order 1", "", "\u4e2d\u6587", "\u00a0"])
    m.system_properties.tag = "tag-\u00e9"
    m.user_properties["k"] = "v w"
    resp = asyncio.run(svc.SendMessage(req, Ctx()))
    assert resp.status.code == pb.Code.OK, resp
    assert "KEYS\x01order 1  \u4e2d\u6587 \u00a0\x02" in pool.sends[0]["i"]


def test_a_key_with_x02_over_the_wire_is_illegal_message_key(pb: Any) -> None:
    """End to end through the nghttp2 server and grpcio's client: the call ends OK (as Apache's proxy
    answers) with status ILLEGAL_MESSAGE_KEY, not the RPC failing UNKNOWN: ValueError."""
    h2server = pytest.importorskip("rmqfast.grpcfront.h2server")
    if h2server.lib is None:
        pytest.skip("rmqfast.grpcfront._h2 not built (libnghttp2-dev)")
    from tests.test_h2server import SVC, run

    async def go() -> None:
        svc, pool = _service(pb)
        server = h2server.H2Server(svc, 1 << 20)
        port = await server.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            send = ch.unary_unary(SVC + "SendMessage", request_serializer=pb.SendMessageRequest.SerializeToString,
                                  response_deserializer=pb.SendMessageResponse.FromString)
            req = pb.SendMessageRequest()
            m = req.messages.add(body=b"x")
            m.topic.name, m.system_properties.message_id = "T", "ID"
            m.system_properties.keys.append("k\x02injected\x01x")
            resp = await send(req, timeout=30)
        assert pb.Code.Name(resp.status.code) == "ILLEGAL_MESSAGE_KEY", resp
        assert resp.status.message == "key cannot contain control character"
        assert pool.sends == []
        await server.stop(1.0)

    run(go())
