"""``[acl]`` on the gRPC front with the real 5.x clients signing their calls (``rocketmq-python-client``
given Credentials, ``rocketmq-client-java`` 5.0.7 given a StaticSessionCredentialsProvider) against
the session's RocketMQ 5.3.3 cluster.

The AccessKey ``app`` may use one topic: its Producer sends and its SimpleConsumer receives and acks
there; a send to another topic fails, and so does every call signed with a wrong secret key.  Raw
gRPC calls signed as the client signs them show the exact answers (FORBIDDEN, UNAUTHORIZED) and the
refusals are counted in ``rmqfast_denied_requests_total{role="grpc"}`` on the admin endpoint.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rmqfast.testing import RocketMQCluster
from rmqfast.testing.ports import reserve
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

grpc = pytest.importorskip("grpc")
rocketmq = pytest.importorskip("rocketmq")

ALLOWED = "grpc_acl_allowed"
OTHER = "grpc_acl_other"
AK, SK = "app-grpc", "s3cret-grpc"
BOUND = 60.0


@pytest.fixture(scope="module")
def front(cluster: RocketMQCluster) -> Iterator[tuple[str, ProxyProcess]]:
    for topic in (ALLOWED, OTHER):
        cluster.create_topic(topic, 2)
    deadline = time.monotonic() + BOUND
    while not all(cluster.topic_route(t) for t in (ALLOWED, OTHER)):
        assert time.monotonic() < deadline, "topics not in the name server's routes"
        time.sleep(0.1)
    lease = reserve([0])
    addr = f"127.0.0.1:{lease.base}"
    # server = "grpcio": the ACL is the service's (rmqfast.grpcfront.auth), the same under either server
    extra = (f'\n[grpc]\nenabled = true\nserver = "grpcio"\nlisten = "{addr}"\n'
             f'\n[acl]\ntopics = {{ "{AK}" = ["{ALLOWED}"] }}\nsecret_keys = {{ "{AK}" = "{SK}" }}\n')
    with contextlib.ExitStack() as stack:
        stack.callback(lease.release)
        proxy = stack.enter_context(ProxyProcess([cluster.namesrv_addr], workers=1, extra_config=extra))
        channel = grpc.insecure_channel(addr)
        grpc.channel_ready_future(channel).result(timeout=BOUND)
        channel.close()
        yield addr, proxy


def _config(addr: str, sk: str = SK) -> Any:
    from rocketmq import ClientConfiguration, Credentials

    return ClientConfiguration(addr, Credentials(AK, sk))


def _raw_send(addr: str, topic: str, secret: str | None) -> Any:
    """SendMessage signed as rocketmq-python-client signs it (None: unsigned); the response."""
    from rocketmq.v5.util.signature import Signature

    from rmqfast.grpcfront import protos

    pb = protos.load()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.localtime())  # the clients' local time marked Z
    md = [("x-mq-date-time", stamp), ("x-mq-client-id", "acl-it")]
    if secret is not None:
        md.append(("authorization", f"MQv2-HMAC-SHA1 Credential={AK}, SignedHeaders=x-mq-date-time, "
                                    f"Signature={Signature.sign(secret, stamp)}"))
    req = pb.SendMessageRequest()
    m = req.messages.add(body=b"raw")
    m.topic.name, m.system_properties.message_id = topic, uuid.uuid4().hex.upper()
    with grpc.insecure_channel(addr) as channel:
        call = channel.unary_unary(f"/{pb.service.full_name}/SendMessage",
                                   request_serializer=pb.SendMessageRequest.SerializeToString,
                                   response_deserializer=pb.SendMessageResponse.FromString)
        return pb, call(req, metadata=md, timeout=BOUND)


def test_python_client_with_credentials_allowed_topic_only(front: tuple[str, ProxyProcess]) -> None:
    from rocketmq import FilterExpression, Message, Producer, SimpleConsumer

    addr, proxy = front
    run = uuid.uuid4().hex[:8]
    producer = Producer(_config(addr), (ALLOWED,))
    producer.startup()
    sent: dict[str, bytes] = {}
    try:
        for i in range(3):
            m = Message()
            m.topic, m.body, m.tag = ALLOWED, f"acl-{run}-{i}".encode(), "acl"
            sent[producer.send(m).message_id] = m.body
        other = Message()
        other.topic, other.body = OTHER, b"not allowed"
        with pytest.raises(Exception):  # noqa: B017 - the client raises a plain Exception for a refused route
            producer.send(other)
    finally:
        producer.shutdown()
    assert len(sent) == 3

    consumer = SimpleConsumer(_config(addr), f"grpc_acl_{run}", {ALLOWED: FilterExpression("acl")}, await_duration=5)
    consumer.startup()
    got: dict[str, bytes] = {}
    try:
        deadline = time.monotonic() + BOUND
        while len(got) < len(sent) and time.monotonic() < deadline:
            for msg in consumer.receive(16, 30) or []:
                if msg.message_id in sent:
                    got[msg.message_id] = msg.body
                consumer.ack(msg)
    finally:
        consumer.shutdown()
    assert got == sent

    wrong = Producer(_config(addr, "not-the-secret"), (ALLOWED,))
    wrong.startup()
    try:
        m = Message()
        m.topic, m.body = ALLOWED, b"wrong secret"
        with pytest.raises(Exception):  # noqa: B017 - the route query is refused (UNAUTHORIZED)
            wrong.send(m)
    finally:
        wrong.shutdown()

    # the exact answers, to calls signed as the client signs them
    pb, resp = _raw_send(addr, OTHER, SK)
    assert resp.status.code == pb.Code.FORBIDDEN and f"may not send to topic '{OTHER}'" in resp.status.message
    pb, resp = _raw_send(addr, ALLOWED, "not-the-secret")
    assert resp.status.code == pb.Code.UNAUTHORIZED and "does not verify" in resp.status.message
    pb, resp = _raw_send(addr, ALLOWED, None)
    assert resp.status.code == pb.Code.UNAUTHORIZED and "unsigned" in resp.status.message
    pb, resp = _raw_send(addr, ALLOWED, SK)
    assert resp.status.code == pb.Code.OK

    def denied() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{proxy.admin_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("rmqfast_denied_requests_total{") and 'role="grpc"' in line
                   and 'code="SendMessage"' in line)

    assert denied() >= 3  # the three raw refusals at least (the clients' refused route queries count apart)


@pytest.fixture(scope="module")
def java_driver(jars: Any) -> str:
    from rmqfast.testing.grpcclient import ensure_grpc_driver

    return ensure_grpc_driver(jars.java_dir)


def test_java_client_with_credentials(front: tuple[str, ProxyProcess], java_driver: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """rocketmq-client-java 5.0.7 with StaticSessionCredentialsProvider: a Producer of the allowed topic
    sends and a SimpleConsumer receives and acks; a Producer of another topic cannot start
    (ForbiddenException naming the setting: its route look-up is refused), nor one with a wrong secret
    key (UnauthorizedException)."""
    import subprocess

    from rmqfast.testing.grpcclient import run_driver
    from rmqfast.testing.tools import java_executable

    def refused(topic: str) -> str:
        """The whole stderr of a Producer of ``topic`` that must fail to start."""
        p = subprocess.run([java_executable(), "-Xmx128m", "-XX:TieredStopAtLevel=1", "-cp", java_driver, "GrpcDriver",
                            "produce", addr, topic, run, "1"], capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and "DONE" not in p.stdout, (p.stdout, p.stderr[-2000:])
        return p.stderr

    addr, _proxy = front
    run = f"acl-java-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("RMQFAST_GRPC_ACCESS_KEY", AK)
    monkeypatch.setenv("RMQFAST_GRPC_SECRET_KEY", SK)
    sent = run_driver(java_driver, "produce", addr, ALLOWED, run, "3")
    assert sent.lines[-1] == "DONE 3", sent.lines
    got = run_driver(java_driver, "consume", addr, ALLOWED, f"grpc_acl_{run}", run, "3", "60")
    assert got.lines[-1] == "DONE 3", (got.lines, got.stderr[-2000:])
    err = refused(OTHER)
    # the Producer's start looks the topic's route up: refused there (response-code=40300)
    assert "ForbiddenException" in err and f"may not look up the route of topic '{OTHER}'" in err, err[-3000:]
    monkeypatch.setenv("RMQFAST_GRPC_SECRET_KEY", "not-the-secret")
    err = refused(ALLOWED)
    assert "UnauthorizedException" in err and "does not verify" in err, err[-3000:]
