"""``[acl]`` on the gRPC front: 5.x signatures verified, the topic allowlist applied per call."""

from __future__ import annotations

import asyncio
import calendar
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("grpc")

from rmqfast.codec import codes as C  # noqa: E402
from rmqfast.codec.command import RemotingCommand  # noqa: E402
from rmqfast.errors import ConfigError  # noqa: E402
from rmqfast.grpcfront import protos  # noqa: E402
from rmqfast.grpcfront.auth import (  # noqa: E402
    CONSUME,
    SEND,
    GrpcAcl,
    Refused,
    parse_authorization,
    parse_date_time,
    sign,
)
from rmqfast.grpcfront.service import MessagingService, Route  # noqa: E402
from rmqfast.grpcfront.settings import GrpcSection  # noqa: E402
from rmqfast.proxy.acl import AclSection, parse_acl  # noqa: E402

NOW = calendar.timegm((2026, 1, 23, 10, 11, 12, 0, 0, 0))
STAMP = "20260123T101112Z"
SECTION = parse_acl({"topics": {"app": ["Orders", "Orders-*"], "all": ["*"]},
                     "secret_keys": {"app": "s3cret", "all": "another", "stranger": "x"}})


def metadata(ak: str = "app", secret: str = "s3cret", stamp: str = STAMP, **extra: str) -> tuple[tuple[str, str], ...]:
    """What rocketmq-clients' Signature puts in a call's metadata."""
    auth = f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, Signature={sign(secret, stamp)}"
    md = {"x-mq-language": "JAVA", "x-mq-date-time": stamp, "x-mq-client-id": "c1", "authorization": auth, **extra}
    return tuple(md.items())


def acl(section: AclSection = SECTION, clock: float = NOW) -> GrpcAcl:
    return GrpcAcl(section, clock=lambda: clock)


def refusal(fn: Any) -> Refused:
    with pytest.raises(Refused) as ei:
        fn()
    return ei.value


def test_signature_is_the_clients_hmac_sha1_of_the_date_time() -> None:
    """The client libraries' own signing (rocketmq-python-client's Signature.sign) against ours."""
    from rocketmq.v5.util.signature import Signature

    assert sign("s3cret", STAMP) == Signature.sign("s3cret", STAMP)
    assert len(sign("s3cret", STAMP)) == 40
    assert parse_authorization(dict(metadata())["authorization"]) == ("MQv2-HMAC-SHA1", "app", sign("s3cret", STAMP))
    # read as Apache's proxy reads it: the Credential's part before '/' is the user
    assert parse_authorization("MQv2-HMAC-SHA1 Credential=app/x/y,Signature=ab")[1:] == ("app", "ab")
    assert parse_date_time(STAMP) == NOW
    for bad in ("", "20260123101112Z", "20261323T101112Z", "2026012xT101112Z", "20260123T101112"):
        assert parse_date_time(bad) is None


def test_valid_signature_and_allowlist() -> None:
    a = acl()
    assert a.check(metadata(), "SendMessage", [("Orders", SEND), ("Orders-eu", CONSUME)]) == "app"
    assert a.check(metadata("all", "another"), "SendMessage", [("Anything", SEND)]) == "all"
    # the Python client's metadata: the same header, upper-case hex is read too
    auth = f"MQv2-HMAC-SHA1 Credential=app, SignedHeaders=x-mq-date-time, Signature={sign('s3cret', STAMP).upper()}"
    assert a.check((("x-mq-date-time", STAMP), ("authorization", auth)), "QueryRoute") == "app"
    # retry topics are checked as any other (5.x clients never name one)
    r = refusal(lambda: a.check(metadata(), "ReceiveMessage", [("%RETRY%G", CONSUME)]))
    assert r.code == "FORBIDDEN"


def test_refusals_say_why_and_what_to_change() -> None:
    a = acl()
    r = refusal(lambda: a.check(metadata(), "SendMessage", [("Payments", SEND)]))
    assert r.code == "FORBIDDEN" and "'app' may not send to topic 'Payments'" in str(r) and "acl.topics" in str(r)
    r = refusal(lambda: a.check(metadata(secret="wrong"), "SendMessage", [("Orders", SEND)]))
    assert r.code == "UNAUTHORIZED" and "does not verify" in str(r)
    r = refusal(lambda: a.check(metadata("nobody", "x"), "QueryRoute"))
    assert r.code == "UNAUTHORIZED" and "acl.secret_keys" in str(r)
    # verified but not in acl.topics: other_keys decides
    r = refusal(lambda: a.check(metadata("stranger", "x"), "SendMessage", [("Orders", SEND)]))
    assert r.code == "FORBIDDEN" and "not in the proxy's topic allowlist" in str(r)
    other = parse_acl({"topics": {"app": ["Orders"]}, "secret_keys": {"stranger": "x"}, "other_keys": "allow"})
    assert acl(other).check(metadata("stranger", "x"), "SendMessage", [("Payments", SEND)]) == "stranger"
    # bad headers
    r = refusal(lambda: a.check(metadata(stamp="yesterday"), "Heartbeat"))
    assert r.code == "UNAUTHORIZED" and "x-mq-date-time" in str(r)
    r = refusal(lambda: a.check((("authorization", "garbage"),), "Heartbeat"))
    assert r.code == "UNAUTHORIZED"
    r = refusal(lambda: a.check((("authorization", "MQv2-HMAC-SHA1 Credential"),), "Heartbeat"))
    assert r.code == "UNAUTHORIZED"
    hdr = dict(metadata())["authorization"].replace("MQv2-HMAC-SHA1", "MQv9-HMAC-MD5")
    r = refusal(lambda: a.check((("authorization", hdr), ("x-mq-date-time", STAMP)), "Heartbeat"))
    assert r.code == "UNAUTHORIZED" and "algorithm" in str(r)
    nothex = "MQv2-HMAC-SHA1 Credential=app, SignedHeaders=x-mq-date-time, Signature=nothex"
    r = refusal(lambda: a.check((("x-mq-date-time", STAMP), ("authorization", nothex)), "Heartbeat"))
    assert r.code == "UNAUTHORIZED" and "does not verify" in str(r)
    assert a.denied == 9


def test_unsigned_calls() -> None:
    """No authorization header, or the Python client's empty Credential: refused unless acl.unsigned allows
    them (then no topic is checked, as on the Remoting side)."""
    no_ak = f"MQv2-HMAC-SHA1 Credential=, SignedHeaders=x-mq-date-time, Signature={sign('', STAMP)}"
    empty = (("authorization", no_ak), ("x-mq-date-time", STAMP))
    for md in ((), (("x-mq-date-time", STAMP),), empty):
        r = refusal(lambda md=md: acl().check(md, "SendMessage", [("Orders", SEND)]))
        assert r.code == "UNAUTHORIZED" and "unsigned" in str(r) and 'acl.unsigned = "allow"' in str(r)
    open_ = parse_acl({"topics": {"app": ["Orders"]}, "secret_keys": {"app": "s3cret"}, "unsigned": "allow"})
    assert acl(open_).check(empty, "SendMessage", [("Payments", SEND)]) is None
    # a signed call of that configuration is still verified and checked
    assert refusal(lambda: acl(open_).check(metadata(), "SendMessage", [("Payments", SEND)])).code == "FORBIDDEN"


def test_expired_and_future_date_times() -> None:
    """Within signature_max_age of the proxy's clock in UTC (or in its local zone: the clients write local
    time marked Z); 0 turns the check off."""
    a = acl()
    assert a.max_age == 900
    assert a.check(metadata(), "QueryRoute") == "app"
    for skew in (-899, 899):
        assert acl(clock=NOW + skew).check(metadata(), "QueryRoute") == "app"
    local_offset = time.localtime(NOW).tm_gmtoff
    for skew in (-3600, 7200):
        if abs(skew + local_offset) <= 900:
            continue  # this machine's zone makes it current
        r = refusal(lambda skew=skew: acl(clock=NOW - skew).check(metadata(), "QueryRoute"))
        assert r.code == "UNAUTHORIZED" and "signature_max_age" in str(r)
    # a header verified once (kept, so the calls of one second cost one HMAC) still expires
    clock = [float(NOW)]
    kept = GrpcAcl(SECTION, clock=lambda: clock[0])
    assert kept.check(metadata(), "QueryRoute") == "app" and kept.check(metadata(), "QueryRoute") == "app"
    assert len(kept._verified) == 1
    clock[0] += 86400
    assert refusal(lambda: kept.check(metadata(), "QueryRoute")).code == "UNAUTHORIZED"
    assert refusal(lambda: kept.check(metadata(secret="wrong"), "QueryRoute")).code == "UNAUTHORIZED"
    unchecked = parse_acl({"topics": {"app": ["Orders"]}, "secret_keys": {"app": "s3cret"}, "signature_max_age": 0})
    assert acl(unchecked, clock=NOW + 10 * 86400).check(metadata(), "QueryRoute") == "app"


def test_local_zone_date_time_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client on a machine at UTC+2 writes its local time with a Z: accepted when the proxy's zone is
    the same, refused when the proxy runs in UTC."""
    monkeypatch.setenv("TZ", "Etc/GMT-2")  # POSIX sign: UTC+2
    time.tzset()
    try:
        local_stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(NOW + 7200))
        assert acl().check(metadata(stamp=local_stamp), "QueryRoute") == "app"
        monkeypatch.setenv("TZ", "UTC")
        time.tzset()
        assert refusal(lambda: acl().check(metadata(stamp=local_stamp), "QueryRoute")).code == "UNAUTHORIZED"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_acl_config_secret_keys() -> None:
    sec = parse_acl({"topics": {"app": ["Orders"]}, "secret_keys": {"app": "s"}, "signature_max_age": 60})
    assert sec.secret_keys == {"app": "s"} and sec.signature_max_age == 60
    assert AclSection.from_dict(__import__("dataclasses").asdict(sec)) == sec  # the workers' config.json
    for bad, words in ((["x"], "expected a table"), ({"app": ""}, "non-empty string"), ({"a b": "s"}, "spaces"),
                       ({"app": 3}, "non-empty string")):
        with pytest.raises(ConfigError) as ei:
            parse_acl({"topics": {"app": ["Orders"]}, "secret_keys": bad})
        assert words in str(ei.value)
    for bad in (-1, "60", True, 10**6):
        with pytest.raises(ConfigError) as ei:
            parse_acl({"topics": {"app": ["Orders"]}, "signature_max_age": bad})
        assert "acl.signature_max_age" in str(ei.value)
    # the config hand-off to the workers and gRPC fronts, and check-config's summary
    from rmqfast import config
    from rmqfast.cli import summary

    base = {"namesrv": {"listen": "127.0.0.1:19876", "upstreams": ["10.0.0.1:9876"]}, "grpc": {"enabled": True}}
    cfg = config.from_dict({**base, "acl": {"topics": {"app": ["Orders"]}, "secret_keys": {"app": "s"}}})
    assert config.from_json(cfg.to_json()).acl == cfg.acl
    assert "gRPC calls verified with 1 secret key(s)" in summary("x.toml", cfg)
    cfg = config.from_dict({**base, "acl": {"topics": {"app": ["Orders"]}}})
    assert "gRPC: no acl.secret_keys, so only unsigned calls can pass" in summary("x.toml", cfg)
    # a secret key never appears in a configuration error
    with pytest.raises(ConfigError) as ei:
        parse_acl({"topics": {"app": ["Orders"]}, "secret_keys": {"app": ["hunter2"]}})
    assert "hunter2" not in str(ei.value)


# --- the service ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pb() -> Any:
    return protos.load()


class Ctx:
    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self.md = md

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.md

    def time_remaining(self) -> float:
        return 2.0


class Brokers:
    """Answers sends, pops (empty), acks, invisible-time changes and sends back; records them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.oneways: list[int] = []

    async def request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                      timeout: float = 3.0) -> RemotingCommand:
        self.calls.append((ext.get("topic") or ext.get("b") or ext.get("originTopic") or "", code))
        if code == C.POP_MESSAGE:
            return RemotingCommand(code=C.PULL_NOT_FOUND, flag=1)
        return RemotingCommand(code=0, flag=1, ext_fields={"queueOffset": "1", "msgId": "X"})

    async def oneway(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"") -> None:
        self.oneways.append(code)


def _service(pb: Any, section: AclSection | None = SECTION) -> tuple[MessagingService, Brokers]:
    svc = MessagingService(pb, [], GrpcSection(enabled=True, notify=False), acl=section)
    brokers = Brokers()
    svc.pool = svc.lanes = brokers  # type: ignore[assignment]
    for topic in ("Orders", "Payments"):
        svc._routes[topic] = Route({"a": "a:1"}, [{"brokerName": "a", "perm": 6, "readQueueNums": 2,
                                                   "writeQueueNums": 2}], time.monotonic() + 3600, [("a", 0)])
    svc.acl.clock = lambda: NOW  # type: ignore[union-attr]
    return svc, brokers


def _calls(pb: Any, svc: MessagingService, topic: str, md: tuple[tuple[str, str], ...]) -> dict[str, int]:
    """The status code of every served call naming ``topic``, made with metadata ``md``."""
    ctx = Ctx(md)
    handle = "5 1000 30000 3 0 a 1 6 600"

    async def go() -> dict[str, int]:
        out: dict[str, int] = {}
        req = pb.SendMessageRequest()
        m = req.messages.add(body=b"x")
        m.topic.name, m.system_properties.message_id = topic, "ID"
        out["SendMessage"] = (await svc.SendMessage(req, ctx)).status.code
        out["QueryRoute"] = (await svc.QueryRoute(pb.QueryRouteRequest(topic=pb.Resource(name=topic)), ctx)).status.code
        out["QueryAssignment"] = (await svc.QueryAssignment(pb.QueryAssignmentRequest(
            topic=pb.Resource(name=topic)), ctx)).status.code
        rr = pb.ReceiveMessageRequest(batch_size=1)
        rr.group.name, rr.message_queue.topic.name = "G", topic
        rr.long_polling_timeout.seconds = 0
        out["ReceiveMessage"] = [r async for r in svc.ReceiveMessage(rr, ctx)][0].status.code
        ack = pb.AckMessageRequest(topic=pb.Resource(name=topic), group=pb.Resource(name="G"))
        ack.entries.add(message_id="ID", receipt_handle=handle)
        out["AckMessage"] = (await svc.AckMessage(ack, ctx)).status.code
        out["ChangeInvisibleDuration"] = (await svc.ChangeInvisibleDuration(pb.ChangeInvisibleDurationRequest(
            topic=pb.Resource(name=topic), group=pb.Resource(name="G"), receipt_handle=handle,
            message_id="ID"), ctx)).status.code
        out["ForwardMessageToDeadLetterQueue"] = (await svc.ForwardMessageToDeadLetterQueue(
            pb.ForwardMessageToDeadLetterQueueRequest(topic=pb.Resource(name=topic), group=pb.Resource(name="G"),
                                                      receipt_handle=handle, message_id="ID"), ctx)).status.code
        out["EndTransaction"] = (await svc.EndTransaction(pb.EndTransactionRequest(
            topic=pb.Resource(name=topic), transaction_id="1 2 a X"), ctx)).status.code
        out["Heartbeat"] = (await svc.Heartbeat(pb.HeartbeatRequest(), ctx)).status.code
        out["NotifyClientTermination"] = (await svc.NotifyClientTermination(pb.NotifyClientTerminationRequest(),
                                                                            ctx)).status.code
        return out

    return asyncio.run(go())


def test_every_served_call_is_checked(pb: Any) -> None:
    """Allowed topic: every call goes to the brokers; another topic: FORBIDDEN and nothing reaches a broker
    (before the ACL, a key refused on Remoting could send, receive and ack through gRPC); a wrong secret:
    UNAUTHORIZED, even for the calls without a topic."""
    svc, brokers = _service(pb)
    ok = _calls(pb, svc, "Orders", metadata())
    assert set(ok) | {"Telemetry"} == set(MessagingService.SERVED)  # a newly served call must be checked here too
    assert set(ok.values()) == {pb.Code.OK, pb.Code.MESSAGE_NOT_FOUND}, ok
    assert ok["ReceiveMessage"] == pb.Code.MESSAGE_NOT_FOUND
    assert {c for _t, c in brokers.calls} >= {C.SEND_MESSAGE_V2, C.POP_MESSAGE, C.ACK_MESSAGE,
                                              C.CHANGE_MESSAGE_INVISIBLETIME, C.CONSUMER_SEND_MSG_BACK}
    assert brokers.oneways == [C.END_TRANSACTION]
    brokers.calls.clear()
    brokers.oneways.clear()
    forbidden = _calls(pb, svc, "Payments", metadata())
    topicless = {"Heartbeat", "NotifyClientTermination"}
    assert {k for k, v in forbidden.items() if v == pb.Code.FORBIDDEN} == set(forbidden) - topicless, forbidden
    assert brokers.calls == [] and brokers.oneways == []
    wrong = _calls(pb, svc, "Orders", metadata(secret="wrong"))
    assert set(wrong.values()) == {pb.Code.UNAUTHORIZED}, wrong
    assert brokers.calls == [] and brokers.oneways == []
    assert svc.acl is not None and svc.acl.denied == 8 + 10


def test_without_acl_nothing_is_checked(pb: Any) -> None:
    svc = MessagingService(pb, [], GrpcSection(enabled=True))
    assert svc.acl is None
    svc2 = MessagingService(pb, [], GrpcSection(enabled=True), acl=AclSection())  # [acl] without topics
    assert svc2.acl is None


def test_send_message_checks_each_message(pb: Any) -> None:
    svc, brokers = _service(pb)
    req = pb.SendMessageRequest()
    for topic in ("Orders", "Payments"):
        m = req.messages.add(body=b"x")
        m.topic.name, m.system_properties.message_id = topic, "ID"
    resp = asyncio.run(svc.SendMessage(req, Ctx(metadata())))
    assert resp.status.code == pb.Code.MULTIPLE_RESULTS
    assert [e.status.code for e in resp.entries] == [pb.Code.OK, pb.Code.FORBIDDEN]
    assert "may not send to topic 'Payments'" in resp.entries[1].status.message
    assert brokers.calls == [("Orders", C.SEND_MESSAGE_V2)]


def test_telemetry_authenticates_and_registers_only_allowed_topics(pb: Any) -> None:
    """A producer's settings register its topics for transaction check-back (which carries half
    messages): only the topics its AccessKey may send to; a refused stream ends at once."""
    svc, _brokers = _service(pb)
    svc._start_heartbeats = lambda: None  # type: ignore[method-assign]

    async def commands() -> AsyncIterator[Any]:
        s = pb.Settings(client_type=pb.ClientType.PRODUCER)
        for t in ("Orders", "Payments"):
            s.publishing.topics.add(name=t)
        yield pb.TelemetryCommand(settings=s)

    async def go(md: tuple[tuple[str, str], ...]) -> list[Any]:
        out = []
        async for cmd in svc.Telemetry(commands(), Ctx(md)):
            out.append(cmd)
            if cmd.HasField("settings") or cmd.status.code != pb.Code.OK:
                break
        return out

    got = asyncio.run(go(metadata()))
    assert got[0].status.code == pb.Code.FORBIDDEN and "'Payments'" in got[0].status.message
    assert got[0].HasField("settings")
    got = asyncio.run(go(metadata(secret="wrong")))
    assert len(got) == 1 and got[0].status.code == pb.Code.UNAUTHORIZED and not got[0].HasField("settings")


def test_telemetry_registration_is_filtered(pb: Any) -> None:
    svc, _brokers = _service(pb)
    svc._start_heartbeats = lambda: None  # type: ignore[method-assign]
    from rmqfast.grpcfront.transaction import Stream

    async def commands() -> AsyncIterator[Any]:
        s = pb.Settings(client_type=pb.ClientType.PRODUCER)
        for t in ("Orders", "Payments"):
            s.publishing.topics.add(name=t)
        yield pb.TelemetryCommand(settings=s)
        await asyncio.Event().wait()  # the stream stays open (its end unregisters the producer)

    async def go() -> set[str]:
        stream = Stream("c1")
        task = asyncio.ensure_future(svc._telemetry_read(commands(), stream, "app"))
        answer = await stream.out.get()
        assert answer.status.code == pb.Code.FORBIDDEN
        registered = set(svc.producers.topics())
        task.cancel()
        return registered

    assert asyncio.run(go()) == {"Orders"}


def test_denied_calls_are_counted_in_the_workers_metric(pb: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """rmqfast_denied_requests_total{role="grpc", code=<method>} in the multiprocess files the supervisor
    serves /metrics from."""
    import subprocess
    import sys

    code = (
        "from rmqfast.grpcfront.auth import GrpcAcl, Refused\n"
        "from rmqfast.proxy.acl import parse_acl\n"
        "from rmqfast.grpcfront.auth import denied_counter\n"
        "a = GrpcAcl(parse_acl({'topics': {'app': ['Orders']}}), denied_counter())\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        a.check((), 'SendMessage')\n"
        "    except Refused:\n"
        "        pass\n"
    )
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(__import__("pathlib").Path(
        __file__).resolve().parents[1]), timeout=60)
    from prometheus_client import CollectorRegistry, multiprocess

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    assert reg.get_sample_value("rmqfast_denied_requests_total", {"role": "grpc", "code": "SendMessage"}) == 3
