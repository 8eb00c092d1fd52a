"""[acl]: config parsing and the per-AccessKey topic allowlist filter (rmqfast.proxy.acl).

Frames are built with the project codec and signed as AclClientRPCHook signs them
(rmqfast.testing.aclsign); the filter must read the AccessKey and topic the broker reads,
answer refusals with NO_PERMISSION and a remark, and leave allowed frames untouched (None:
relayed byte for byte, so the signature stays valid).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import pytest

from rmqfast import config
from rmqfast.cli import summary
from rmqfast.codec import code_slot
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.errors import ConfigError
from rmqfast.filters.acl import AclTopics
from rmqfast.filters.api import FilterChain, Frame
from rmqfast.proxy.acl import (
    TOPIC_FIELDS,
    AclSection,
    access_key_repeated,
    parse_acl,
    read_fields,
)
from rmqfast.testing.aclsign import sign, signature

BASE = {"namesrv": {"listen": "127.0.0.1:19876", "upstreams": ["10.0.0.1:9876"]}}
AK, SK = "app-orders", "orders-secret"


@dataclass
class FakeSession:
    role: str = "broker"
    client_addr: str = "10.1.1.1:5555"
    upstream_addr: str = "10.0.0.2:10911"
    state: dict[str, Any] = field(default_factory=dict)


def frame_of(code: int, ext: dict[str, str], body: bytes = b"", *, oneway: bool = False, binary: bool = False,
             creds: tuple[str, str] | None = (AK, SK)) -> Frame:
    fields = sign(ext, body, *creds) if creds else dict(ext)
    flag = C.FLAG_ONEWAY if oneway else 0
    cmd = RemotingCommand(code=code, opaque=7, flag=flag, version=453, ext_fields=fields, body=body,
                          serialize_type=C.SERIALIZE_ROCKETMQ if binary else C.SERIALIZE_JSON)
    return Frame(encode(cmd), code, flag, 7)


def filt(topics: dict[str, list[str]], **kw: str) -> AclTopics:
    return AclTopics(parse_acl({"topics": topics, **kw}))


def kind(verdict: Any) -> str:
    """The verdict's kind as text (a plain string or an Enum of strings)."""
    return str(getattr(verdict.kind, "value", verdict.kind))


def answer(verdict: Any) -> RemotingCommand:
    assert verdict is not None and kind(verdict) == "reply", verdict
    return decode_frame(verdict.data)


# --------------------------------------------------------------------------- config


def test_config_round_trip_and_defaults() -> None:
    raw = {**BASE, "acl": {"topics": {AK: ["Orders", "Orders-*"], "reporting": ["*"]}}}
    cfg = config.from_dict(raw)
    assert cfg.acl.enabled and cfg.acl.unsigned == "deny" and cfg.acl.other_keys == "deny"
    assert cfg.acl.topics == {AK: ["Orders", "Orders-*"], "reporting": ["*"]}
    assert config.from_json(cfg.to_json()) == cfg  # the worker hand-off
    assert not config.from_dict(dict(BASE)).acl.enabled
    assert "topic allowlist  2 AccessKey(s) listed; unsigned requests: deny" in summary("x.toml", cfg)


def test_config_toml_table_form(tmp_path: Any) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[namesrv]\nupstreams = ["10.0.0.1:9876"]\n[acl]\nunsigned = "allow"\n'
                 '[acl.topics]\n"app-orders" = ["Orders"]\nreporting = ["Rep*"]\n')
    cfg = config.load(p)
    assert cfg.acl == AclSection({"app-orders": ["Orders"], "reporting": ["Rep*"]}, "allow", "deny")


@pytest.mark.parametrize("acl,message", [
    ({"topics": {AK: ["Or ders"]}}, f'acl.topics."{AK}"[0]: "Or ders" is not allowed; expected a topic name'),
    ({"topics": {AK: ["*Orders"]}}, "a prefix ending in '*'"),
    ({"topics": {AK: []}}, f'acl.topics."{AK}": [] is not allowed; expected a non-empty list'),
    ({"topics": {AK: "Orders"}}, f'acl.topics."{AK}": "Orders" is not allowed'),
    ({"topics": ["Orders"]}, 'acl.topics: ["Orders"] is not allowed; expected a table AccessKey = [topics]'),
    ({"topics": {AK: ["A"]}, "unsigned": "yes"}, 'acl.unsigned: "yes" is not allowed; expected one of deny, allow'),
    ({"topics": {AK: ["A"]}, "other_keys": True}, "acl.other_keys: true is not allowed"),
    ({"topics": {AK: ["A"]}, "bogus": 1},
     "acl.bogus: unknown key; allowed here: other_keys, secret_keys, signature_max_age, topics, unsigned"),
    ({"unsigned": "deny"}, "acl.topics: required when [acl] is present"),
    ({"topics": {"": ["A"]}}, 'acl.topics."": not allowed as an AccessKey'),
])
def test_config_errors(acl: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as ei:
        config.from_dict({**BASE, "acl": acl})
    assert message in str(ei.value)


def test_config_reports_every_problem() -> None:
    with pytest.raises(config.ConfigErrors) as ei:
        config.from_dict({**BASE, "acl": {"topics": {AK: ["a b", "ok"], "k2": []}, "unsigned": 1}})
    assert len(ei.value.errors) == 3, ei.value.errors


# --------------------------------------------------------------------------- the filter


def test_signature_matches_aclclientrpchook_reference() -> None:
    # AclClientRPCHookTest / AclUtils: values sorted by key, Signature left out, then the body
    fields = {"b": "T", "a": "G", "AccessKey": "ak", "Signature": "old"}
    import base64
    import hashlib
    import hmac

    want = base64.b64encode(hmac.new(b"sk", b"akGT" + b"BODY", hashlib.sha1).digest()).decode()
    assert signature(fields, b"BODY", "sk") == want


@pytest.mark.parametrize("code", sorted(TOPIC_FIELDS))
def test_every_topic_code_allowed_and_denied(code: int) -> None:
    key, _ = TOPIC_FIELDS[code]
    f = filt({AK: ["Orders", "Pay-*"]})
    for topic in ("Orders", "Pay-1", "Pay-"):
        fr = frame_of(code, {key: topic, "queueId": "0"})
        assert f.on_request(FakeSession(), fr) is None, topic
    fr = frame_of(code, {key: "Other", "queueId": "0"})
    cmd = answer(f.on_request(FakeSession(), fr))
    assert cmd.code == C.NO_PERMISSION and cmd.is_response and cmd.opaque == 7
    assert AK in cmd.remark and "'Other'" in cmd.remark and f"acl.topics['{AK}']" in cmd.remark
    assert f.denied == 1
    assert code_slot(code) in f.request_slots()


def test_v2_send_reads_b_not_topic() -> None:
    # SEND_MESSAGE_V2 names its topic in "b" (what the broker authorizes); a "topic" field is ignored
    f = filt({AK: ["Orders"]})
    assert f.on_request(FakeSession(), frame_of(C.SEND_MESSAGE_V2, {"b": "Orders", "topic": "Other"})) is None
    denied = answer(f.on_request(FakeSession(), frame_of(C.SEND_MESSAGE_V2, {"b": "Other", "topic": "Orders"})))
    assert denied.code == C.NO_PERMISSION


def test_unsigned_and_other_keys_deny_by_default_and_can_be_allowed() -> None:
    unsigned = frame_of(C.SEND_MESSAGE, {"topic": "Orders"}, creds=None)
    other = frame_of(C.SEND_MESSAGE, {"topic": "Orders"}, creds=("someone", "x"))
    f = filt({AK: ["Orders"]})
    r = answer(f.on_request(FakeSession(), unsigned))
    assert r.code == C.NO_PERMISSION and "unsigned request (no AccessKey)" in r.remark
    assert 'acl.unsigned = "allow"' in r.remark
    r = answer(f.on_request(FakeSession(), other))
    assert "AccessKey 'someone' is not in the proxy's topic allowlist" in r.remark
    f2 = filt({AK: ["Orders"]}, unsigned="allow", other_keys="allow")
    assert f2.on_request(FakeSession(), unsigned) is None
    assert f2.on_request(FakeSession(), other) is None
    # a listed key stays restricted whatever other_keys says
    assert answer(f2.on_request(FakeSession(), frame_of(C.SEND_MESSAGE, {"topic": "X"}))).code == C.NO_PERMISSION


def test_retry_topics_pass_and_missing_topic_is_denied() -> None:
    f = filt({AK: ["Orders"]})
    assert f.on_request(FakeSession(), frame_of(C.PULL_MESSAGE, {"topic": "%RETRY%grp"})) is None
    assert f.on_request(FakeSession(), frame_of(C.SEND_MESSAGE_V2, {"b": "%RETRY%grp"}, creds=None)) is None
    r = answer(f.on_request(FakeSession(), frame_of(C.PULL_MESSAGE, {"consumerGroup": "g"})))
    assert r.code == C.NO_PERMISSION and "names no topic" in r.remark


def test_star_allows_everything() -> None:
    f = filt({AK: ["*"]})
    assert f.on_request(FakeSession(), frame_of(C.POP_MESSAGE, {"topic": "Anything"})) is None


def test_oneway_denial_is_dropped_not_answered() -> None:
    f = filt({AK: ["Orders"]})
    v = f.on_request(FakeSession(), frame_of(C.SEND_MESSAGE_V2, {"b": "Other"}, oneway=True))
    assert v is not None and kind(v) == "divert" and "may not send to topic 'Other'" in v.reason


def test_binary_header_read_like_the_broker() -> None:
    f = filt({AK: ["Orders"]})
    assert f.on_request(FakeSession(), frame_of(C.SEND_MESSAGE_V2, {"b": "Orders"}, binary=True)) is None
    r = answer(f.on_request(FakeSession(), frame_of(C.SEND_MESSAGE_V2, {"b": "Other"}, binary=True)))
    assert r.code == C.NO_PERMISSION


def json_frame(header: bytes, code: int) -> Frame:
    data = struct.pack(">iI", 4 + len(header), len(header)) + header
    return Frame(data, code, 0, 9)


def test_duplicate_access_key_in_json_is_refused() -> None:
    f = filt({"good": ["Orders"]}, other_keys="allow")
    hdr = (b'{"code":10,"extFields":{"AccessKey":"good","topic":"Orders","AccessKey":"evil",'
           b'"Signature":"x"},"flag":0,"language":"JAVA","opaque":9,"serializeTypeCurrentRPC":"JSON","version":1}')
    r = answer(f.on_request(FakeSession(), json_frame(hdr, C.SEND_MESSAGE)))
    assert r.code == C.NO_PERMISSION and "AccessKey more than once" in r.remark
    assert access_key_repeated(hdr)
    # "AccessKey" twice in the bytes but once per object (a value, a top-level key): read normally
    hdr2 = (b'{"AccessKey":"x","code":10,"extFields":{"AccessKey":"good","topic":"Orders","k":"AccessKey"},'
            b'"flag":0,"opaque":9}')
    assert not access_key_repeated(hdr2)
    assert f.on_request(FakeSession(), json_frame(hdr2, C.SEND_MESSAGE)) is None


def test_escaped_access_key_value_read_decoded() -> None:
    # fastjson decodes the escape; so does the codec: "go\u006fd" is the key "good"
    f = filt({"good": ["Orders"]})
    hdr = b'{"code":10,"extFields":{"AccessKey":"go\\u006fd","topic":"Orders"},"flag":0,"opaque":9}'
    assert f.on_request(FakeSession(), json_frame(hdr, C.SEND_MESSAGE)) is None
    hdr = b'{"code":10,"extFields":{"AccessKey":"go\\u006fd","topic":"Other"},"flag":0,"opaque":9}'
    assert "AccessKey 'good' may not send to topic 'Other'" in answer(
        f.on_request(FakeSession(), json_frame(hdr, C.SEND_MESSAGE))).remark


def test_non_string_access_key_refused() -> None:
    f = filt({"123": ["Orders"]}, other_keys="allow")
    hdr = b'{"code":10,"extFields":{"AccessKey":123,"topic":"Orders"},"flag":0,"opaque":9}'
    r = answer(f.on_request(FakeSession(), json_frame(hdr, C.SEND_MESSAGE)))
    assert r.code == C.NO_PERMISSION and "not a valid UTF-8 string" in r.remark


@pytest.mark.parametrize("binary", [False, True])
def test_read_fields_agrees_with_the_codec(binary: bool) -> None:
    # the quick JSON reading and the full decode agree on what the filter looks at
    for ext in ({"b": "T1", "AccessKey": "k\u00e9y", "i": "a\u0001b\u0002", "x": "\"q\"\\"},
                {"topic": "T2"}, {"AccessKey": "only"}, {}):
        fr = frame_of(C.SEND_MESSAGE_V2, ext, creds=None, binary=binary)
        cmd = decode_frame(fr.data)
        want = ((cmd.ext_fields or {}).get("AccessKey"), (cmd.ext_fields or {}).get("b"), False)
        assert read_fields(fr, "b") == want


def test_non_topic_codes_untouched_and_disabled_section_sees_nothing() -> None:
    f = filt({AK: ["Orders"]})
    assert f.on_request(FakeSession(), frame_of(C.HEART_BEAT, {})) is None
    assert AclTopics(AclSection()).request_slots() == set()
    chain = FilterChain([AclTopics(AclSection())])
    assert chain.request_actions == bytes(len(chain.request_actions))


def test_denials_logged_once_per_key_topic_code(caplog: pytest.LogCaptureFixture) -> None:
    f = filt({AK: ["Orders"]})
    caplog.set_level("DEBUG", logger="rmqfast.acl")
    for _ in range(5):
        f.on_request(FakeSession(), frame_of(C.SEND_MESSAGE, {"topic": "Other"}))
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f.denied == 5


def test_on_deny_callback_counts() -> None:
    seen: list[int] = []
    f = AclTopics(parse_acl({"topics": {AK: ["Orders"]}}), lambda s, code: seen.append(code))
    f.on_request(FakeSession(), frame_of(C.PULL_MESSAGE, {"topic": "Other"}))
    assert seen == [C.PULL_MESSAGE]


def test_json_dump_of_section_is_plain_data() -> None:
    cfg = config.from_dict({**BASE, "acl": {"topics": {AK: ["Orders"]}}})
    assert json.loads(cfg.to_json())["acl"] == {"topics": {AK: ["Orders"]}, "unsigned": "deny", "other_keys": "deny",
                                                "secret_keys": {}, "signature_max_age": 900.0}


# --------------------------------------------------------------------------- shaping and signatures


def test_shape_rule_refuses_signed_sends_instead_of_holding_them(tmp_path: Any) -> None:
    """Peak shaving releases a held send later as a request of its own, which the proxy cannot
    sign: a signed send over a shape rule gets SYSTEM_BUSY (the client retries) and nothing is held;
    an unsigned one is shaped as before."""
    from rmqfast.limits import create_shared
    from rmqfast.limits.rules import parse_limits
    from rmqfast.limits.shaper import Shaper
    from rmqfast.limits.worker import WorkerLimits

    cfg = config.Config()
    cfg.proxy.state_dir = str(tmp_path / "state")
    cfg.limits = parse_limits({"rule": [{"topic": "Orders", "rate": 1, "burst": 1, "mode": "shape"}]})
    create_shared(tmp_path)
    limits = WorkerLimits(tmp_path / "limits.shm", cfg.limits)
    shaper = Shaper(cfg, 0, limits, publish=False)
    limits.shaper = shaper
    try:
        ext = {"a": "PG", "b": "Orders", "c": "TBW102", "d": "4", "e": "0", "f": "0", "g": "1700000000000",
               "h": "0", "i": "UNIQ_KEY\x017F0000011A2B18B4AAC2123456780000\x02", "j": "0", "k": "false",
               "m": "false", "n": "broker-a"}
        r = answer(shaper.shape(frame_of(C.SEND_MESSAGE_V2, ext), 0, "127.0.0.1:9"))
        assert r.code == C.SYSTEM_BUSY and "a signed send (AccessKey) cannot be released later" in r.remark
        assert shaper.shaped == 0 and shaper.refused == 1
        v = shaper.shape(frame_of(C.SEND_MESSAGE_V2, ext, creds=None), 0, "127.0.0.1:9")
        assert answer(v).code == C.SUCCESS and shaper.shaped == 1
    finally:
        shaper.close()


def test_failover_does_not_move_signed_sends() -> None:
    """Moving a send to another master rewrites its broker name and queue id, which the signature
    covers: a signed send to a dead broker gets SERVICE_NOT_AVAILABLE (producers retry it on another
    broker themselves, signed) instead of a move the other broker would refuse."""
    from rmqfast.proxy.failover import SERVICE_NOT_AVAILABLE, FailoverService, RouteBook
    from rmqfast.proxy.health import BrokerHealth, FailoverSection

    fast = FailoverSection(probe_interval=0.2, probe_interval_down=0.05, probe_timeout=0.5, send_timeout=2.0)
    health = BrokerHealth(fast)
    svc = FailoverService(fast, health, RouteBook(lambda: []))
    try:
        ext = {"a": "PG", "b": "Orders", "e": "1", "f": "0", "i": "", "n": "broker-a"}
        signed = decode_frame(frame_of(C.SEND_MESSAGE_V2, ext).data)
        ans, to = svc.move(signed, "127.0.0.1:1")
        assert ans.code == SERVICE_NOT_AVAILABLE and to == "refused:signed"
        assert "signed send (AccessKey) is not moved" in (ans.remark or "")
        unsigned = decode_frame(frame_of(C.SEND_MESSAGE_V2, ext, creds=None).data)
        assert svc.move(unsigned, "127.0.0.1:1")[1] == "refused:no_route"  # the usual path: no route known here
    finally:
        health.close()


def test_failover_does_not_move_what_the_allowlist_refuses() -> None:
    """A client of a dead broker's endpoint is served by the failover service, not the relay's filter
    chain: with [acl] unsigned = "deny" its unsigned sends were moved to another broker all the same."""
    from rmqfast.proxy.failover import FailoverService, RouteBook
    from rmqfast.proxy.health import BrokerHealth, FailoverSection

    fast = FailoverSection(probe_interval=0.2, probe_interval_down=0.05, probe_timeout=0.5, send_timeout=2.0)
    health = BrokerHealth(fast)
    route = ({"broker-a": "127.0.0.1:1", "broker-b": "127.0.0.1:2"}, [("broker-a", 4, 6), ("broker-b", 4, 6)])
    book = RouteBook(lambda: [])
    book._routes["Payroll"] = (1e18, route)
    svc = FailoverService(fast, health, book)
    sent: list[str] = []

    def request(addr: str, cmd: RemotingCommand) -> RemotingCommand:
        sent.append(addr)
        return RemotingCommand(code=C.SUCCESS, flag=C.FLAG_RESPONSE, opaque=cmd.opaque)

    svc._request = request  # type: ignore[method-assign]
    try:
        ext = {"a": "PG", "b": "Payroll", "e": "1", "f": "0", "i": "", "n": "broker-a"}
        unsigned = decode_frame(frame_of(C.SEND_MESSAGE_V2, ext, creds=None).data)
        svc.acl_denies_unsigned = True
        ans, to = svc.move(unsigned, "127.0.0.1:1")
        assert ans.code == C.NO_PERMISSION and to == "refused:unsigned" and sent == []
        assert "acl.unsigned" in (ans.remark or "")
        svc.acl_denies_unsigned = False  # acl.unsigned = "allow" (or no [acl]): moved as before
        ans, to = svc.move(unsigned, "127.0.0.1:1")
        assert ans.code == C.SUCCESS and to == "127.0.0.1:2" and sent == ["127.0.0.1:2"]
    finally:
        health.close()



def test_unreadable_headers_are_refused_never_raised() -> None:
    """Whatever reaches the filter (the walk refuses most of it first), it answers, passes, or
    closes the connection when the header cannot even be answered; it never raises."""
    import random

    rnd = random.Random(7)
    f = filt({AK: ["Orders"]}, other_keys="allow")
    good = frame_of(C.SEND_MESSAGE_V2, {"b": "Orders"}).data
    good_bin = frame_of(C.SEND_MESSAGE_V2, {"b": "Orders"}, binary=True).data
    for i in range(3000):
        base = bytearray(good if i % 2 else good_bin)
        for _ in range(rnd.randint(1, 6)):
            base[rnd.randrange(8, len(base))] = rnd.randrange(256)
        v = f.on_request(FakeSession(), Frame(bytes(base), C.SEND_MESSAGE_V2, 0, 7))
        assert v is None or kind(v) in ("reply", "close")


# --------------------------------------------------------------------------- the proxy's own signed requests


def test_remote_cloud_credentials_parse() -> None:
    raw = {**BASE, "clouds": {"remote": [{"name": "east", "namesrv": ["10.0.0.9:9876"], "access_key": "rmqfast",
                                          "secret_key": "s3cret"}, {"name": "west", "namesrv": "10.0.0.8:9876"}]}}
    cfg = config.from_dict(raw)
    assert [r.credentials for r in cfg.clouds.remotes] == [("rmqfast", "s3cret"), None]
    assert config.from_json(cfg.to_json()) == cfg
    raw["clouds"]["remote"][1]["access_key"] = "only-the-key"
    with pytest.raises(ConfigError) as ei:
        config.from_dict(raw)
    assert "clouds.remote[1]: 'access_key' and 'secret_key' go together" in str(ei.value)


def test_connection_pool_signs_with_the_proxys_own_credentials() -> None:
    """What a remote broker with ACL on checks: AccessKey, and a Signature over the values and body."""
    import gevent
    from gevent.server import StreamServer

    from rmqfast.clouds.remoting import ConnectionPool
    from rmqfast.codec.command import make_response

    seen: list[RemotingCommand] = []

    def handle(sock: Any, _addr: Any) -> None:
        buf = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return
            buf += chunk
            while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">i", buf[:4])[0]:
                n = 4 + struct.unpack(">i", buf[:4])[0]
                cmd = decode_frame(buf[:n])
                buf = buf[n:]
                seen.append(cmd)
                sock.sendall(encode(make_response(cmd, 0, None)))

    server = StreamServer(("127.0.0.1", 0), handle)
    server.start()
    addr = f"127.0.0.1:{server.server_port}"
    signed, plain = ConnectionPool(2.0, ("rmqfast", "s3cret")), ConnectionPool(2.0)
    try:
        body = b"message body \x00\x01"
        ext = {"b": "Orders", "i": "UNIQ_KEY\x01abc\x02", "e": "1"}
        assert signed.request(addr, C.SEND_MESSAGE_V2, dict(ext), body, timeout=5).code == 0
        assert plain.request(addr, C.SEND_MESSAGE_V2, dict(ext), body, timeout=5).code == 0
        got, unsigned = seen
        fields = got.ext_fields or {}
        assert fields["AccessKey"] == "rmqfast" and fields["b"] == "Orders"
        assert fields["Signature"] == signature(fields, body, "s3cret")
        assert fields["Signature"] != signature(fields, body, "other")
        assert "AccessKey" not in (unsigned.ext_fields or {}) and "Signature" not in (unsigned.ext_fields or {})
    finally:
        signed.close()
        plain.close()
        server.stop()
        gevent.sleep(0)


def test_recall_of_an_unlisted_topic_is_refused() -> None:
    # RECALL_MESSAGE (370) puts a timer-delete marker into the topic its header names (the broker
    # checks the recall handle names the same topic): a write the allowlist must see
    f = filt({AK: ["Orders"]})
    assert f.on_request(FakeSession(), frame_of(C.RECALL_MESSAGE, {"topic": "Orders", "recallHandle": "h"})) is None
    r = answer(f.on_request(FakeSession(), frame_of(C.RECALL_MESSAGE, {"topic": "Payroll", "recallHandle": "h"})))
    assert r.code == C.NO_PERMISSION and "'Payroll'" in r.remark
    assert code_slot(C.RECALL_MESSAGE) in f.request_slots()
