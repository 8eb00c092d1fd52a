"""Broker addresses inside messages: codec patches and the RewriteMessageAddresses filter."""

from __future__ import annotations

from typing import Any

import pytest

from rmqfast.codec import codes as C
from rmqfast.codec.admincodes import PRESETS, preset_codes
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.codec.msgaddr import (
    format_host,
    header_field_span,
    host_bytes,
    patch_offset_ids,
    patch_store_hosts,
)
from rmqfast.codec.store import BORNHOST_V6_FLAG, STOREHOST_V6_FLAG, StoreRecord, decode_records, encode_records
from rmqfast.filters.addresses import RewriteMessageAddresses
from rmqfast.filters.api import Frame, Kind

REAL = "10.1.2.3:10911"
OTHER = "10.1.2.4:10911"
PROXY_HOST = "127.0.0.1"


def record(i: int, store_host: str = REAL, sys_flag: int = 0, born: str = "192.168.0.9:5555") -> StoreRecord:
    return StoreRecord(
        topic="T", body=f"body-{i}".encode() * 3, properties={"UNIQ_KEY": f"U{i:030d}", "KEYS": f"k{i}"},
        queue_id=i % 4, queue_offset=i, commit_log_offset=1000 + 97 * i, sys_flag=sys_flag,
        born_timestamp=1, born_host=born, store_timestamp=2, store_host=store_host,
    )


def simple_map(table: dict[str, str]) -> Any:
    raw = {host_bytes(*_split(k)): host_bytes(*_split(v)) for k, v in table.items()}
    return raw.get


def _split(hp: str) -> tuple[str, int]:
    h, _, p = hp.rpartition(":")
    return h, int(p)


def test_host_bytes_roundtrip_and_refusals() -> None:
    assert format_host(host_bytes("10.1.2.3", 10911)) == REAL
    with pytest.raises(ValueError, match="not an IPv4"):
        host_bytes("broker-a", 1)
    with pytest.raises(ValueError, match="not an IPv4"):
        host_bytes("10.1.2.300", 1)


def test_store_hosts_patched_identity_untouched() -> None:
    recs = [record(0), record(1, OTHER), record(2, sys_flag=BORNHOST_V6_FLAG, born="[::1]:5555"),
            record(3, "[fe80::1]:10911", sys_flag=STOREHOST_V6_FLAG)]
    body = encode_records(recs)
    mapping = simple_map({REAL: "127.0.0.1:40001", OTHER: "127.0.0.1:40002"})
    out, seen = patch_store_hosts(body, mapping)
    assert seen == 4 and out is not None and len(out) == len(body)
    after = decode_records(bytes(out))
    assert [r.store_host for r in after] == ["127.0.0.1:40001", "127.0.0.1:40002", "127.0.0.1:40001",
                                              "[fe80::1]:10911"]
    for a, b in zip(recs, after, strict=True):  # everything but the store host is the same
        assert (a.body, a.properties, a.born_host, a.commit_log_offset, a.queue_offset) == (
            b.body, b.properties, b.born_host, b.commit_log_offset, b.queue_offset)
    assert after[0].msg_id[16:] == recs[0].msg_id[16:]  # same commit-log offset in the offset id


def test_store_hosts_nothing_to_change_and_frame_offset() -> None:
    body = encode_records([record(0, "10.9.9.9:1")])
    assert patch_store_hosts(body, simple_map({REAL: "127.0.0.1:1"})) == (None, 1)
    framed = b"HEADERXX" + encode_records([record(0)])
    out, seen = patch_store_hosts(framed, simple_map({REAL: "127.0.0.1:7"}), start=8)
    assert seen == 1 and out is not None and out[:8] == b"HEADERXX"
    assert decode_records(bytes(out[8:]))[0].store_host == "127.0.0.1:7"


@pytest.mark.parametrize("cut", [1, 20, 90])
def test_store_hosts_refuses_what_is_not_records(cut: int) -> None:
    body = encode_records([record(0), record(1)])
    with pytest.raises(ValueError, match="record 1"):
        patch_store_hosts(body[: len(body) - cut], simple_map({REAL: "127.0.0.1:1"}))
    with pytest.raises(ValueError, match="magic code"):
        patch_store_hosts(b"\x00" * 100, simple_map({}))


def test_offset_ids_patched() -> None:
    rec = record(5)
    mid = rec.msg_id
    mapping = simple_map({REAL: "127.0.0.1:40001"})
    new = patch_offset_ids(mid, mapping)
    assert new is not None and len(new) == 32 and new[16:] == mid[16:]
    assert new[:16] == host_bytes("127.0.0.1", 40001).hex().upper()
    batch = ",".join([mid, record(6).msg_id, "not-an-id"])
    out = patch_offset_ids(batch, mapping)
    assert out is not None and out.split(",")[2] == "not-an-id" and len(out) == len(batch)
    assert patch_offset_ids("0" * 32, mapping) is None


@pytest.mark.parametrize("stype", [0, 1])
def test_header_field_span_json_and_binary(stype: int) -> None:
    cmd = RemotingCommand(code=0, flag=1, opaque=9, remark="x\"msgId\":\"",
                          ext_fields={"queueId": "1", "msgId": "ABC", "MSG_REGION": "r"}, serialize_type=stype)
    data = encode(cmd)
    span = header_field_span(data, "msgId")
    assert span is not None and data[span[0]:span[1]] == b"ABC"
    assert header_field_span(data, "offsetMsgId") is None


class FakeRegistry:
    advertise_host = PROXY_HOST

    def __init__(self) -> None:
        self.ports = {REAL: 40001}

    def advertised(self, real: str) -> str | None:
        port = self.ports.get(real)
        return None if port is None else f"{PROXY_HOST}:{port}"

    def is_proxy_address(self, addr: str) -> bool:
        return addr in {f"{PROXY_HOST}:{p}" for p in self.ports.values()}


class FakeSession:
    role = "broker"
    client_addr = "127.0.0.1:1"
    upstream_addr = REAL

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}


def frame_of(cmd: RemotingCommand) -> Frame:
    data = encode(cmd)
    return Frame(data, cmd.code, cmd.flag, cmd.opaque)


@pytest.mark.parametrize("stype", [0, 1])
def test_filter_rewrites_pull_answer(stype: int) -> None:
    f = RewriteMessageAddresses(FakeRegistry())  # type: ignore[arg-type]
    s = FakeSession()
    req = frame_of(RemotingCommand(code=C.PULL_MESSAGE, opaque=7, ext_fields={"topic": "T"}, serialize_type=stype))
    assert f.on_request(s, req) is None and req.want_response
    body = encode_records([record(0), record(1, "10.7.7.7:1")])
    resp = frame_of(RemotingCommand(code=0, flag=1, opaque=7, ext_fields={"nextBeginOffset": "2"}, body=body,
                                    serialize_type=stype))
    v = f.on_response(s, resp)
    assert v is not None and v.kind is Kind.REWRITE
    out = decode_frame(v.data)
    assert [r.store_host for r in decode_records(out.body)] == ["127.0.0.1:40001", "10.7.7.7:1"]
    assert out.ext_fields == {"nextBeginOffset": "2"}
    assert f.on_response(s, resp) is None  # the opaque was answered already


def test_filter_closes_rather_than_let_an_answer_through_unrewritten() -> None:
    # a second pull on an opaque still pending: its answer (the second back) would not be pending any
    # more and would reach the client with the broker's own store host; likewise pending opaques
    # forgotten past the bound
    f = RewriteMessageAddresses(FakeRegistry())  # type: ignore[arg-type]
    s = FakeSession()

    def pull(opaque: int) -> Any:
        return f.on_request(s, frame_of(RemotingCommand(code=C.PULL_MESSAGE, opaque=opaque, ext_fields={"topic": "T"})))

    assert pull(7) is None
    v = pull(7)
    assert v is not None and v.kind is Kind.CLOSE and "reuses opaque 7" in v.reason
    assert all(pull(100 + i) is None for i in range(9999))  # 10000 pending with opaque 7
    v = pull(50000)
    assert v is not None and v.kind is Kind.CLOSE and "unanswered" in v.reason


def test_filter_rewrites_send_answer_and_skips_others() -> None:
    f = RewriteMessageAddresses(FakeRegistry(), "all")  # type: ignore[arg-type]
    s = FakeSession()
    mid = record(1).msg_id
    req = frame_of(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=3, ext_fields={"b": "T"}))
    f.on_request(s, req)
    resp = frame_of(RemotingCommand(code=0, flag=1, opaque=3, ext_fields={"msgId": mid, "queueId": "0"}))
    v = f.on_response(s, resp)
    assert v is not None
    new = decode_frame(v.data).ext_fields
    assert new is not None and new["msgId"][16:] == mid[16:] and new["msgId"] != mid
    # errors, one-way requests and other codes stay untouched
    f.on_request(s, frame_of(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=4)))
    assert f.on_response(s, frame_of(RemotingCommand(code=C.SYSTEM_BUSY, flag=1, opaque=4))) is None
    oneway = frame_of(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=5, flag=2))
    f.on_request(s, oneway)
    assert not oneway.want_response
    assert C.HEART_BEAT not in {c for c in f.codes}


def test_filter_modes() -> None:
    reg = FakeRegistry()
    assert RewriteMessageAddresses(reg, "off").request_slots() == set()  # type: ignore[arg-type]
    rec_only = RewriteMessageAddresses(reg, "records")  # type: ignore[arg-type]
    assert C.SEND_MESSAGE_V2 not in rec_only.codes and C.PULL_MESSAGE in rec_only.codes
    with pytest.raises(ValueError, match="message_addresses"):
        RewriteMessageAddresses(reg, "sometimes")  # type: ignore[arg-type]


def test_read_only_admin_preset_has_no_write_codes() -> None:
    broker = preset_codes("read-only-admin", "broker")
    ns = preset_codes("read-only-admin", "namesrv")
    assert {28, 202, 208, 203}.issubset(broker) and 206 in ns
    writes = {C.UPDATE_AND_CREATE_TOPIC, C.UPDATE_BROKER_CONFIG, C.UPDATE_NAMESRV_CONFIG, C.PUT_KV_CONFIG,
              C.DELETE_KV_CONFIG, 205, 215, 222, 309, 353, 3004, 3005}
    assert not (broker | ns) & writes
    assert preset_codes("", "broker") == frozenset()
    with pytest.raises(ValueError, match="unknown"):
        preset_codes("admin", "broker")
    assert set(PRESETS) == {"read-only-admin"}


def test_config_keys_parse_roundtrip_and_refuse_unknown_values() -> None:
    from rmqfast import config

    base = {"namesrv": {"listen": "127.0.0.1:19876", "upstreams": ["10.0.0.1:9876"]}}
    cfg = config.from_dict(base)
    # the safe default: every broker address a client sees names the proxy, send answers' offset ids too
    assert (cfg.policy.preset, cfg.policy.message_addresses) == ("", "all")
    cfg = config.from_dict({**base, "policy": {"preset": "read-only-admin", "message_addresses": "records"}})
    assert (cfg.policy.preset, cfg.policy.message_addresses) == ("read-only-admin", "records")
    again = config.from_json(cfg.to_json())  # what the supervisor hands its workers
    assert again.policy == cfg.policy
    with pytest.raises(config.ConfigError, match="policy.preset.*read-only-admin"):
        config.from_dict({**base, "policy": {"preset": "admin"}})
    with pytest.raises(config.ConfigError, match="policy.message_addresses.*records, all, off"):
        config.from_dict({**base, "policy": {"message_addresses": "rewrite"}})
