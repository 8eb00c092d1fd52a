"""RocketMQ 5 gRPC clients through rmqfast's gRPC front (real RocketMQ 5.3.3 brokers, pop on).

Two masters of the session's name server hold the topic: the session broker (broker-a) and a
second one started here (broker-b).  The real Python 5.x client (``rocketmq-python-client``) sends
with a Producer and receives and acks with a SimpleConsumer through rmqfast; the pop-with-notify
check puts a message on broker-b only and asks the front to pop broker-a first: the receive must
return that message well before its long poll ends (no false empty).  The real Java 5.x client
(``java/grpcclient``) sends with message groups and transactions (commit, rollback, check-back) and
receives with a SimpleConsumer, orderly for a group with ``consumeMessageOrderly``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rmqfast.testing import JarPaths, RocketMQCluster
from rmqfast.testing.ports import reserve
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

grpc = pytest.importorskip("grpc")
rocketmq = pytest.importorskip("rocketmq")

TOPIC = "grpc_front_topic"
BOUND = 60.0


def wait_until(fn: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def two_brokers(jars: JarPaths, cluster: RocketMQCluster) -> Iterator[tuple[RocketMQCluster, RocketMQCluster]]:
    with RocketMQCluster(jars=jars, broker_name="broker-b", join=cluster) as b:
        cluster.create_topic(TOPIC, 2)
        b.create_topic(TOPIC, 2)

        def both() -> bool:
            route = cluster.topic_route(TOPIC) or {}
            names = {q.get("brokerName") for q in route.get("queueDatas", []) if isinstance(q, dict)}
            return {cluster.broker_name, "broker-b"} <= names

        wait_until(both, BOUND, "both brokers in the route")
        yield cluster, b


def _topic_on_both(two_brokers: tuple[RocketMQCluster, RocketMQCluster], topic: str) -> None:
    a, b = two_brokers
    a.create_topic(topic, 2)
    b.create_topic(topic, 2)

    def both() -> bool:
        route = a.topic_route(topic) or {}
        names = {q.get("brokerName") for q in route.get("queueDatas", []) if isinstance(q, dict)}
        return {a.broker_name, b.broker_name} <= names

    wait_until(both, BOUND, f"both brokers in the route of {topic}")


@pytest.fixture(scope="module")
def front(two_brokers: tuple[RocketMQCluster, RocketMQCluster]) -> Iterator[str]:
    a, _ = two_brokers
    lease = reserve([0])
    port = lease.base
    extra = f'\n[grpc]\nenabled = true\nlisten = "127.0.0.1:{port}"\n'
    with contextlib.ExitStack() as stack:
        stack.callback(lease.release)
        stack.enter_context(ProxyProcess([a.namesrv_addr], workers=1, extra_config=extra))
        addr = f"127.0.0.1:{port}"
        channel = grpc.insecure_channel(addr)
        grpc.channel_ready_future(channel).result(timeout=BOUND)
        channel.close()
        yield addr


def _client_config(addr: str) -> Any:
    from rocketmq import ClientConfiguration, Credentials

    return ClientConfiguration(addr, Credentials())


def test_python_client_send_receive_ack(front: str) -> None:
    """Producer.send of 10 messages (tags, keys, user properties), then SimpleConsumer receive + ack
    of all of them, every body and property as sent; a second consumer of the group then finds none."""
    from rocketmq import FilterExpression, Message, Producer, SimpleConsumer

    run = uuid.uuid4().hex[:8]
    producer = Producer(_client_config(front), (TOPIC,))
    producer.startup()
    sent: dict[str, bytes] = {}
    try:
        for i in range(10):
            m = Message()
            m.topic = TOPIC
            m.body = f"grpc-{run}-{i}".encode()
            m.tag = "t1"
            m.keys = f"k-{run}-{i}"
            m.add_property("run", run)
            receipt = producer.send(m)
            sent[receipt.message_id] = m.body
    finally:
        producer.shutdown()
    assert len(sent) == 10

    group = f"grpc_sc_{run}"
    consumer = SimpleConsumer(_client_config(front), group, {TOPIC: FilterExpression("t1")}, await_duration=5)
    consumer.startup()
    got: dict[str, bytes] = {}
    try:
        deadline = time.monotonic() + BOUND
        while len(got) < len(sent) and time.monotonic() < deadline:
            for msg in consumer.receive(16, 30) or []:
                if msg.properties.get("run") == run:
                    assert msg.tag == "t1"
                    got[msg.message_id] = msg.body
                consumer.ack(msg)
    finally:
        consumer.shutdown()
    assert got == sent


def _pb() -> Any:
    from rmqfast.grpcfront import protos

    return protos.load()


def _send_direct(broker_addr: str, broker: str, body: bytes) -> None:
    """A message straight to one broker over Remoting (not through the front)."""
    from rmqfast.codec import codes as C
    from rmqfast.grpcfront.convert import send_header
    from rmqfast.grpcfront.upstream import Pool

    async def go() -> None:
        pool = Pool()
        try:
            ext = send_header(TOPIC, broker, 0, {"UNIQ_KEY": uuid.uuid4().hex.upper()}, 0, int(time.time() * 1000),
                              "grpc-it", 0)
            r = await pool.request(broker_addr, C.SEND_MESSAGE_V2, ext, body, timeout=10)
            assert r.code == 0, (r.code, r.remark)
        finally:
            await pool.close()

    asyncio.run(go())


def _receive(pb: Any, addr: str, group: str, first_broker: str, long_poll: int) -> tuple[list[Any], Any, float]:
    channel = grpc.insecure_channel(addr)
    try:
        call = channel.unary_stream(f"/{pb.service.full_name}/ReceiveMessage",
                                    request_serializer=pb.ReceiveMessageRequest.SerializeToString,
                                    response_deserializer=pb.ReceiveMessageResponse.FromString)
        req = pb.ReceiveMessageRequest(batch_size=4, auto_renew=False)
        req.group.name = group
        req.message_queue.topic.name = TOPIC
        req.message_queue.id = -1
        req.message_queue.broker.name = first_broker
        req.filter_expression.type = pb.FilterType.TAG
        req.filter_expression.expression = "*"
        req.invisible_duration.seconds = 30
        req.long_polling_timeout.seconds = long_poll
        t0 = time.monotonic()
        answers = list(call(req, timeout=long_poll + 5))
        took = time.monotonic() - t0
        assert answers[-1].HasField("delivery_timestamp"), answers[-1]  # the stream ends with the proxy's clock
        return [a.message for a in answers if a.HasField("message")], answers[0].status, took
    finally:
        channel.close()


def _ack(pb: Any, addr: str, group: str, msgs: list[Any]) -> Any:
    channel = grpc.insecure_channel(addr)
    try:
        call = channel.unary_unary(f"/{pb.service.full_name}/AckMessage",
                                   request_serializer=pb.AckMessageRequest.SerializeToString,
                                   response_deserializer=pb.AckMessageResponse.FromString)
        req = pb.AckMessageRequest()
        req.group.name = group
        req.topic.name = TOPIC
        for m in msgs:
            sp = m.system_properties
            req.entries.add(message_id=sp.message_id, receipt_handle=sp.receipt_handle)
        return call(req, timeout=10)
    finally:
        channel.close()


def test_pop_with_notify_no_false_empty(front: str, two_brokers: tuple[RocketMQCluster, RocketMQCluster]) -> None:
    """A message waiting on broker-b, a receive whose first pop goes to (empty) broker-a: the message
    comes back at once, not after the 20 s long poll; then one sent to broker-b while a receive is
    parked comes back before that receive's long poll ends; acks by receipt handle reach broker-b."""
    a, b = two_brokers
    pb = _pb()
    group = f"grpc_notify_{uuid.uuid4().hex[:8]}"
    # the group's first receives: whatever the topic already holds for a new group, read and acked
    deadline = time.monotonic() + BOUND
    while True:
        msgs, status, _ = _receive(pb, front, group, a.broker_name, 1)
        if not msgs:
            assert status.code == pb.Code.MESSAGE_NOT_FOUND, status
            break
        assert _ack(pb, front, group, msgs).status.code == pb.Code.OK
        assert time.monotonic() < deadline, "the topic does not drain"

    _send_direct(b.broker_addr, "broker-b", b"waiting-on-b")
    msgs, status, took = _receive(pb, front, group, a.broker_name, 20)
    assert status.code == pb.Code.OK, status
    assert [m.body for m in msgs] == [b"waiting-on-b"]
    assert msgs[0].system_properties.receipt_handle.split(" ")[5] == "broker-b"
    assert took < 10, took
    ack = _ack(pb, front, group, msgs)
    assert ack.status.code == pb.Code.OK, ack

    result: dict[str, Any] = {}
    th = threading.Thread(target=lambda: result.update(r=_receive(pb, front, group, a.broker_name, 20)))
    th.start()
    t_send = time.monotonic()
    _send_direct(b.broker_addr, "broker-b", b"arrives-on-b")
    th.join(timeout=40)
    msgs, status, took = result["r"]
    assert status.code == pb.Code.OK, status
    assert [m.body for m in msgs] == [b"arrives-on-b"]
    latency = time.monotonic() - t_send
    print(f"\npop with notify: parked receive answered {latency * 1000:.0f} ms after the send to broker-b")
    assert latency < 10, latency
    assert _ack(pb, front, group, msgs).status.code == pb.Code.OK


@pytest.fixture(scope="module")
def java_driver(jars: JarPaths) -> str:
    from rmqfast.testing.grpcclient import ensure_grpc_driver

    return ensure_grpc_driver(jars.java_dir)


def test_java_client_send_and_simple_consumer(front: str, java_driver: str) -> None:
    """rocketmq-client-java 5.0.7: a Producer sends 8 messages in 2 message groups (FIFO properties)
    through rmqfast, a SimpleConsumer receives and acks all 8 with their groups; per group the
    order of the queue offsets follows the send order (one group, one queue)."""
    from rmqfast.testing.grpcclient import run_driver

    run = f"java-{uuid.uuid4().hex[:8]}"
    sent = run_driver(java_driver, "produce", front, TOPIC, run, "8", "2")
    assert sent.lines[-1] == "DONE 8", sent.lines
    bodies = [e[1] for e in sent.events("SENT")]
    got = run_driver(java_driver, "consume", front, TOPIC, f"grpc_jc_{run}", run, "8", "60")
    assert got.lines[-1] == "DONE 8", (got.lines, got.stderr[-2000:])
    recv = got.events("RECV")  # id group attempt body
    assert sorted(e[3] for e in recv) == sorted(bodies)
    for e in recv:
        i = int(e[3].rsplit("-", 1)[1])
        assert e[1] == f"g{i % 2}", e  # the message group came back with the message
    assert {e[0] for e in recv} == {e[0] for e in sent.events("SENT")}  # message ids as the producer saw them


def test_python_client_change_invisible_duration(front: str) -> None:
    """A received message whose invisible time is changed to 1 s (receipt handle renewed) and not
    acked comes back (second delivery attempt) and is then acked with the new handle."""
    from rocketmq import FilterExpression, Message, Producer, SimpleConsumer

    run = uuid.uuid4().hex[:8]
    producer = Producer(_client_config(front), (TOPIC,))
    producer.startup()
    try:
        m = Message()
        m.topic = TOPIC
        m.body = f"cid-{run}".encode()
        m.tag = "cid"
        producer.send(m)
    finally:
        producer.shutdown()
    consumer = SimpleConsumer(_client_config(front), f"grpc_cid_{run}", {TOPIC: FilterExpression("cid")},
                              await_duration=5)
    consumer.startup()
    attempts: list[int] = []
    try:
        deadline = time.monotonic() + BOUND
        while len(attempts) < 2 and time.monotonic() < deadline:
            for msg in consumer.receive(4, 30) or []:
                if msg.body != m.body:
                    consumer.ack(msg)
                    continue
                attempts.append(msg.delivery_attempt)
                if len(attempts) == 1:
                    consumer.change_invisible_duration(msg, 1)
                else:
                    consumer.ack(msg)
    finally:
        consumer.shutdown()
    assert attempts == [1, 2], attempts


def test_python_client_delayed_message(front: str) -> None:
    """A message sent with a delivery time 3 s ahead (TIMER_DELIVER_MS: the 5.x broker's timer) is
    not received before that time, and then is, with its delivery timestamp."""
    from rocketmq import FilterExpression, Message, Producer, SimpleConsumer

    run = uuid.uuid4().hex[:8]
    consumer = SimpleConsumer(_client_config(front), f"grpc_delay_{run}", {TOPIC: FilterExpression("dl")},
                              await_duration=5)
    consumer.startup()
    producer = Producer(_client_config(front), (TOPIC,))
    producer.startup()
    try:
        m = Message()
        m.topic, m.body, m.tag = TOPIC, f"delay-{run}".encode(), "dl"
        # rocketmq-python-client 5.1.2 documents delivery_timestamp in ms but writes the value into
        # Timestamp.seconds as it is: give it seconds (a value in ms is refused by the broker, through
        # any proxy, as a delay beyond the maximum)
        due_ms = (int(time.time()) + 3) * 1000
        m.delivery_timestamp = due_ms // 1000
        producer.send(m)
        got_at = None
        deadline = time.monotonic() + BOUND
        while got_at is None and time.monotonic() < deadline:
            for msg in consumer.receive(4, 30) or []:
                consumer.ack(msg)
                if msg.body == m.body:
                    got_at = time.time() * 1000
                    assert msg.delivery_timestamp == due_ms  # read back from the wire in ms
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert got_at is not None
    assert got_at >= due_ms - 100, (got_at, due_ms)  # the broker's timer has a 100 ms precision


def test_forward_to_dead_letter_queue(front: str, two_brokers: tuple[RocketMQCluster, RocketMQCluster]) -> None:
    """ForwardMessageToDeadLetterQueue (as a push consumer calls it after its last attempt): the
    message is stored in ``%DLQ%group`` on its broker (the front answers OK only once the broker
    also acknowledged the ack of the original)."""
    from rmqfast.codec import codes as C
    from rmqfast.testing.remoting import remoting_request

    a, b = two_brokers
    pb = _pb()
    group = f"grpc_dlq_{uuid.uuid4().hex[:8]}"
    while True:  # a new group: read and ack what the topic holds for it
        msgs, status, _ = _receive(pb, front, group, a.broker_name, 1)
        if not msgs:
            break
        _ack(pb, front, group, msgs)
    _send_direct(b.broker_addr, "broker-b", b"to-the-dlq")
    msgs, status, _ = _receive(pb, front, group, "broker-b", 10)
    assert [m.body for m in msgs] == [b"to-the-dlq"], status
    m = msgs[0]
    channel = grpc.insecure_channel(front)
    try:
        call = channel.unary_unary(f"/{pb.service.full_name}/ForwardMessageToDeadLetterQueue",
                                   request_serializer=pb.ForwardMessageToDeadLetterQueueRequest.SerializeToString,
                                   response_deserializer=pb.ForwardMessageToDeadLetterQueueResponse.FromString)
        req = pb.ForwardMessageToDeadLetterQueueRequest(receipt_handle=m.system_properties.receipt_handle,
                                                        message_id=m.system_properties.message_id,
                                                        delivery_attempt=1, max_delivery_attempts=1)
        req.group.name, req.topic.name = group, TOPIC
        resp = call(req, timeout=10)
    finally:
        channel.close()
    assert resp.status.code == pb.Code.OK, resp
    r = remoting_request(b.broker_addr, C.GET_MAX_OFFSET, {"topic": f"%DLQ%{group}", "queueId": 0})
    assert r.code == 0 and int(r.ext_fields["offset"]) == 1, (r.code, r.remark, r.ext_fields)


def test_python_push_consumer_redelivers_after_failure(front: str) -> None:
    """The Python 5.x PushConsumer through rmqfast: a listener that fails a message's first delivery
    gets it again (the client changes its invisible duration by its back-off policy, from the
    settings the front answered) and acks the second."""
    from rocketmq import ConsumeResult, FilterExpression, Message, MessageListener, Producer, PushConsumer

    run = uuid.uuid4().hex[:8]
    body = f"push-{run}".encode()
    attempts: list[int] = []
    acked = threading.Event()

    class Listener(MessageListener):
        def consume(self, message: Any) -> ConsumeResult:
            if message.body != body:
                return ConsumeResult.SUCCESS
            attempts.append(message.delivery_attempt)
            if len(attempts) == 1:
                return ConsumeResult.FAILURE
            acked.set()
            return ConsumeResult.SUCCESS

    consumer = PushConsumer(_client_config(front), f"grpc_push_{run}", Listener(), {TOPIC: FilterExpression("push")})
    consumer.startup()
    producer = Producer(_client_config(front), (TOPIC,))
    producer.startup()
    try:
        m = Message()
        m.topic, m.body, m.tag = TOPIC, body, "push"
        producer.send(m)
        assert acked.wait(BOUND), attempts
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert attempts[:2] == [1, 2], attempts


def test_java_client_transactions(front: str, java_driver: str,
                                  two_brokers: tuple[RocketMQCluster, RocketMQCluster]) -> None:
    """rocketmq-client-java 5.0.7 transactional Producer through the front: a committed half message
    is delivered, a rolled-back one is not, and one left open is resolved by check-back (the broker
    asks the front, the front relays the question over the producer's Telemetry stream, the client's
    checker commits, the front sends its EndTransaction to the half message's broker)."""
    from rmqfast.testing.grpcclient import run_driver

    topic = "grpc_tx_topic"
    _topic_on_both(two_brokers, topic)
    run = f"tx{uuid.uuid4().hex[:8]}"
    out = run_driver(java_driver, "transaction", front, topic, run, "60", timeout=120)
    assert out.lines[-1] == "DONE 2", (out.lines, out.stderr[-2000:])
    assert [e[1] for e in out.events("SENT")] == [f"{run}-commit", f"{run}-rollback", f"{run}-check"]
    checked = [e[1] for e in out.events("CHECK")]
    assert f"{run}-check" in checked, out.lines  # asked by its broker through the front
    assert f"{run}-commit" not in checked and f"{run}-rollback" not in checked, out.lines
    assert sorted(e[3] for e in out.events("RECV")) == [f"{run}-check", f"{run}-commit"], out.lines


def test_java_client_fifo_group_order(front: str, java_driver: str,
                                      two_brokers: tuple[RocketMQCluster, RocketMQCluster]) -> None:
    """A consumer group with ``consumeMessageOrderly`` receives through the front with orderly pops:
    the Java SimpleConsumer holds back the first message of group g0 (invisible 2 s, not acked); no
    later g0 message comes before its redelivery (attempt 2), and each message group comes in send
    order.  (Plain pops would hand out the later g0 messages at once.)"""
    got, run = _fifo_run(front, java_driver, two_brokers, "fifo")
    _assert_group_order(got.events("RECV"), run)


def _fifo_run(front: str, java_driver: str, two_brokers: tuple[RocketMQCluster, RocketMQCluster],
              mode: str) -> tuple[Any, str]:
    """6 messages in message groups g0 and g1 (Java Producer), then the driver's ``mode`` consuming them
    as a new group created with consumeMessageOrderly on both brokers."""
    import json

    from rmqfast.testing.grpcclient import run_driver
    from rmqfast.testing.remoting import remoting_request

    topic = "grpc_fifo_topic"
    _topic_on_both(two_brokers, topic)
    run = f"{mode}{uuid.uuid4().hex[:8]}"
    group = f"grpc_fifo_{run}"
    body = json.dumps({"groupName": group, "consumeMessageOrderly": True, "consumeEnable": True,
                       "retryMaxTimes": 16}).encode()
    for broker in two_brokers:
        r = remoting_request(broker.broker_addr, 200, {}, body)  # UPDATE_AND_CREATE_SUBSCRIPTIONGROUP
        assert r.code == 0, (r.code, r.remark)
    sent = run_driver(java_driver, "produce", front, topic, run, "6", "2")
    assert sent.lines[-1] == "DONE 6", sent.lines
    got = run_driver(java_driver, mode, front, topic, group, run, "6", "60", timeout=120)
    assert got.lines[-1] == "DONE 6", (got.lines, got.stderr[-2000:])
    return got, run


def _assert_group_order(recv: list[list[str]], run: str) -> None:
    """``recv``: (id, group, attempt, body) in arrival order; run-0 (group g0) was held back once."""
    for g, bodies in (("g0", [f"{run}-0", f"{run}-0", f"{run}-2", f"{run}-4"]),
                      ("g1", [f"{run}-1", f"{run}-3", f"{run}-5"])):
        seq = [e for e in recv if e[1] == g]
        assert [e[3] for e in seq] == bodies, recv
    first, again = [e for e in recv if e[3] == f"{run}-0"]
    assert (first[2], again[2]) == ("1", "2"), recv


def test_java_push_consumer_fifo(front: str, java_driver: str,
                                 two_brokers: tuple[RocketMQCluster, RocketMQCluster]) -> None:
    """The Java 5.0.7 PushConsumer of a consumeMessageOrderly group (the front's settings answer says
    fifo): a listener that fails the first delivery of g0's first message gets it again (attempt 2)
    before any later g0 message, though it consumes with 4 threads; each group in send order."""
    got, run = _fifo_run(front, java_driver, two_brokers, "pushfifo")
    _assert_group_order(got.events("RECV"), run)


_TLS_CLIENT = """
import json, sys, time
from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer
addr, topic, run = sys.argv[1:4]
cfg = ClientConfiguration(addr, Credentials())
producer = Producer(cfg, (topic,), tls_enable=True)
producer.startup()
sent = {}
try:
    for i in range(5):
        m = Message()
        m.topic, m.body, m.tag = topic, f"{run}-{i}".encode(), "tls"
        sent[producer.send(m).message_id] = m.body.decode()
finally:
    producer.shutdown()
consumer = SimpleConsumer(cfg, f"grpc_tls_{run}", {topic: FilterExpression("tls")}, await_duration=5, tls_enable=True)
consumer.startup()
got = {}
try:
    deadline = time.monotonic() + 60
    while len(got) < len(sent) and time.monotonic() < deadline:
        for msg in consumer.receive(16, 30) or []:
            if msg.body.decode().startswith(run):
                got[msg.message_id] = msg.body.decode()
            consumer.ack(msg)
finally:
    consumer.shutdown()
print(json.dumps({"sent": sent, "got": got}))
"""


def test_tls_listener_with_the_python_client(two_brokers: tuple[RocketMQCluster, RocketMQCluster],
                                             tmp_path: Any) -> None:
    """``[grpc] tls = true`` with ``[tls.listen]``'s certificate (the Remoting listeners stay plain):
    the real Python 5.x client with TLS on, checking the certificate against the test CA and the
    address 127.0.0.1, sends 5 messages and receives and acks them; a plaintext gRPC call to the
    listener fails; a TLS client that does not trust the CA fails."""
    import json
    import os
    import subprocess
    import sys

    from rmqfast.testing.tlscerts import make_certs

    certs = make_certs(tmp_path / "certs")
    a, _ = two_brokers
    lease = reserve([0])
    addr = f"127.0.0.1:{lease.base}"
    extra = (f'\n[grpc]\nenabled = true\ntls = true\nlisten = "{addr}"\n'
             f'\n[tls.listen]\ncert = "{certs.server_cert}"\nkey = "{certs.server_key}"\n')
    pb = _pb()
    with contextlib.ExitStack() as stack:
        stack.callback(lease.release)
        stack.enter_context(ProxyProcess([a.namesrv_addr], workers=1, extra_config=extra))
        creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
        channel = grpc.secure_channel(addr, creds)
        grpc.channel_ready_future(channel).result(timeout=BOUND)
        channel.close()
        run = f"tls-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, GRPC_DEFAULT_SSL_ROOTS_FILE_PATH=str(certs.ca))  # the client's trust store
        p = subprocess.run([sys.executable, "-c", _TLS_CLIENT, addr, TOPIC, run], capture_output=True, text=True,
                           timeout=180, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert len(out["sent"]) == 5 and out["got"] == out["sent"], out

        def query_route(channel: Any) -> Any:
            call = channel.unary_unary(f"/{pb.service.full_name}/QueryRoute",
                                       request_serializer=pb.QueryRouteRequest.SerializeToString,
                                       response_deserializer=pb.QueryRouteResponse.FromString)
            req = pb.QueryRouteRequest()
            req.topic.name = TOPIC
            return call(req, timeout=5)

        plain = grpc.insecure_channel(addr)
        with pytest.raises(grpc.RpcError) as exc:
            query_route(plain)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        plain.close()
        other = make_certs(tmp_path / "other", prefix="other-")
        untrusted = grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=other.ca.read_bytes()))
        with pytest.raises(grpc.RpcError) as exc:
            query_route(untrusted)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        untrusted.close()
        trusted = grpc.secure_channel(addr, creds)
        assert query_route(trusted).status.code == pb.Code.OK
        trusted.close()
