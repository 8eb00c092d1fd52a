"""Route bodies: TopicRouteData and ClusterInfo in the legacy and standard dialects."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rmqfast.codec.route import (
    BrokerAddr,
    detect_dialect,
    encode_route,
    parse_route,
    rewrite_broker_addrs,
)
from rmqfast.errors import BodyError

# Shaped like a 5.x name server's answers: fastjson sorts bean fields; HashMap<Long,String>
# keys are bare in the legacy dialect.
LEGACY_ROUTE = (
    b'{"brokerDatas":[{"brokerAddrs":{0:"10.0.0.1:10911",1:"10.0.0.2:10911",2:"10.0.0.3:10911"},'
    b'"brokerName":"broker-a","cluster":"DefaultCluster","enableActingMaster":false},'
    b'{"brokerAddrs":{0:"10.0.1.1:10911"},"brokerName":"broker-b","cluster":"DefaultCluster",'
    b'"enableActingMaster":false}],"filterServerTable":{},"queueDatas":[{"brokerName":'
    b'"broker-a","perm":6,"readQueueNums":4,"topicSysFlag":0,"writeQueueNums":4},'
    b'{"brokerName":"broker-b","perm":6,"readQueueNums":4,"topicSysFlag":0,"writeQueueNums":4}]}'
)
STANDARD_ROUTE = LEGACY_ROUTE.replace(b"{0:", b'{"0":').replace(b",1:", b',"1":').replace(
    b",2:", b',"2":')
LEGACY_CLUSTER = (
    b'{"brokerAddrTable":{"broker-a":{"brokerAddrs":{0:"10.0.0.1:10911",1:"10.0.0.2:10911"},'
    b'"brokerName":"broker-a","cluster":"DefaultCluster","enableActingMaster":false},'
    b'"broker-b":{"brokerAddrs":{0:"10.0.1.1:10911"},"brokerName":"broker-b",'
    b'"cluster":"DefaultCluster","enableActingMaster":false}},'
    b'"clusterAddrTable":{"DefaultCluster":["broker-a","broker-b"]}}'
)
ADDRS = {"10.0.0.1:10911": "proxy:30000", "10.0.0.2:10911": "proxy:30001",
         "10.0.0.3:10911": "proxy:30002", "10.0.1.1:10911": "proxy:30010"}


def test_detect_dialect() -> None:
    assert detect_dialect(LEGACY_ROUTE) == "legacy"
    assert detect_dialect(LEGACY_CLUSTER) == "legacy"
    assert detect_dialect(STANDARD_ROUTE) == "standard"
    assert detect_dialect(b'{"brokerDatas":[],"queueDatas":[]}') == "standard"
    with pytest.raises(json.JSONDecodeError):
        json.loads(LEGACY_ROUTE)  # the reason this module exists


def test_parse_route_both_dialects() -> None:
    legacy, d1 = parse_route(LEGACY_ROUTE)
    standard, d2 = parse_route(STANDARD_ROUTE)
    assert (d1, d2) == ("legacy", "standard")
    assert legacy == standard
    assert legacy["brokerDatas"][0]["brokerAddrs"] == {
        0: "10.0.0.1:10911", 1: "10.0.0.2:10911", 2: "10.0.0.3:10911"}
    assert legacy["queueDatas"][1]["perm"] == 6
    assert legacy["brokerDatas"][0]["enableActingMaster"] is False
    cluster, _ = parse_route(LEGACY_CLUSTER)
    assert cluster["clusterAddrTable"] == {"DefaultCluster": ["broker-a", "broker-b"]}
    assert cluster["brokerAddrTable"]["broker-b"]["brokerAddrs"] == {0: "10.0.1.1:10911"}


@pytest.mark.parametrize("body", [LEGACY_ROUTE, STANDARD_ROUTE, LEGACY_CLUSTER])
def test_encode_route_reproduces_name_server_bytes(body: bytes) -> None:
    obj, dialect = parse_route(body)
    assert encode_route(obj, dialect) == body
    assert encode_route(obj, dialect, sort_keys=True) == body  # fastjson order already


def test_encode_route_dialects() -> None:
    obj = {"brokerAddrs": {"1": "a/b", 0: "é"}, "x": {5: None}, "s": {"b", "a"}}
    assert encode_route(obj, "legacy", sort_keys=True) == (
        '{"brokerAddrs":{0:"é",1:"a/b"},"s":["a","b"],"x":{5:null}}'.encode())
    assert encode_route(obj, "standard", sort_keys=True) == (
        b'{"brokerAddrs":{"0":"\\u00E9","1":"a\\/b"},"s":["a","b"],"x":{"5":null}}')
    with pytest.raises(ValueError, match="dialect"):
        encode_route({}, "yaml")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not JSON"):
        encode_route({"a": object()}, "standard")


def test_rewrite_legacy_route() -> None:
    new, found = rewrite_broker_addrs(LEGACY_ROUTE, ADDRS.get)
    expected = LEGACY_ROUTE
    for real, proxy in ADDRS.items():
        expected = expected.replace(real.encode(), proxy.encode())
    assert new == expected
    assert found == [
        BrokerAddr("broker-a", 0, "10.0.0.1:10911", "DefaultCluster"),
        BrokerAddr("broker-a", 1, "10.0.0.2:10911", "DefaultCluster"),
        BrokerAddr("broker-a", 2, "10.0.0.3:10911", "DefaultCluster"),
        BrokerAddr("broker-b", 0, "10.0.1.1:10911", "DefaultCluster"),
    ]
    assert detect_dialect(new) == "legacy"


def test_rewrite_standard_route_and_cluster_info() -> None:
    new, found = rewrite_broker_addrs(STANDARD_ROUTE, ADDRS.get)
    assert json.loads(new)["brokerDatas"][0]["brokerAddrs"] == {
        "0": "proxy:30000", "1": "proxy:30001", "2": "proxy:30002"}
    assert len(found) == 4
    new, found = rewrite_broker_addrs(LEGACY_CLUSTER, ADDRS.get)
    assert parse_route(new)[0]["brokerAddrTable"]["broker-a"]["brokerAddrs"] == {
        0: "proxy:30000", 1: "proxy:30001"}
    assert [(b.broker_name, b.broker_id) for b in found] == [
        ("broker-a", 0), ("broker-a", 1), ("broker-b", 0)]


@pytest.mark.parametrize("body", [LEGACY_ROUTE, STANDARD_ROUTE, LEGACY_CLUSTER])
def test_identity_mapper_keeps_bytes(body: bytes) -> None:
    calls: list[str] = []

    def identity(addr: str) -> str:
        calls.append(addr)
        return addr

    new, found = rewrite_broker_addrs(body, identity)
    assert new is body
    assert calls == [b.addr for b in found]
    assert rewrite_broker_addrs(body, lambda a: None)[0] is body
    assert rewrite_broker_addrs(bytearray(body), lambda a: None)[0] == body


def test_siblings_before_brokeraddrs_and_missing() -> None:
    body = (b'{"brokerDatas":[{"cluster":"c1","brokerName":"b1","brokerAddrs":{0:"h:1"}},'
            b'{"brokerAddrs":{3:"h:2"}}]}')
    new, found = rewrite_broker_addrs(body, lambda a: a + "0")
    assert found == [BrokerAddr("b1", 0, "h:1", "c1"), BrokerAddr(None, 3, "h:2", None)]
    assert new == body.replace(b'"h:1"', b'"h:10"').replace(b'"h:2"', b'"h:20"')


def test_brokeraddrs_text_inside_strings_is_not_rewritten() -> None:
    trap = '\\"brokerAddrs\\":{0:\\"10.0.0.1:10911\\"}'
    body = ('{"brokerDatas":[{"brokerAddrs":{0:"10.0.0.1:10911"},"brokerName":"b\\\\\\"x'
            + trap + '","cluster":"c\\u0041"}],"orderTopicConf":"' + trap + '"}').encode()
    new, found = rewrite_broker_addrs(body, ADDRS.get)
    assert new.count(b"10.0.0.1:10911") == 2  # both inside the string values
    assert new.count(b"proxy:30000") == 1
    assert found == [BrokerAddr('b\\"x"brokerAddrs":{0:"10.0.0.1:10911"}', 0, "10.0.0.1:10911",
                                "cA")]


def test_replacement_is_escaped_for_the_dialect() -> None:
    def mapper(addr: str) -> str:
        return 'h"é/:1'

    legacy, _ = rewrite_broker_addrs(b'{"b":{"brokerAddrs":{0:"x:1"}}}', mapper)
    assert legacy == '{"b":{"brokerAddrs":{0:"h\\"é/:1"}}}'.encode()
    standard, _ = rewrite_broker_addrs(b'{"b":{"brokerAddrs":{"0":"x:1"}}}', mapper)
    assert standard == b'{"b":{"brokerAddrs":{"0":"h\\"\\u00E9\\/:1"}}}'
    assert json.loads(standard)["b"]["brokerAddrs"]["0"] == 'h"é/:1'


def test_whitespace_is_kept() -> None:
    body = b' {\n "brokerAddrs" : { 0 : "a:1" , 1:"b:2" } }\n'
    new, found = rewrite_broker_addrs(body, lambda a: "z:9" if a == "b:2" else None)
    assert new == b' {\n "brokerAddrs" : { 0 : "a:1" , 1:"z:9" } }\n'
    assert [f.broker_id for f in found] == [0, 1]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", r"route body is empty"),
        (b"   ", r"route body is empty"),
        (b"[]", r"is a JSON list; expected an object"),
        (b'{"a":1', r"ends at offset 6; expected ',' or '}'"),
        (b'{"a":1}x', r"unexpected data after the JSON value at offset 7"),
        (b'{"a":"unterminated}', r"b'\"' at offset 5; expected a complete JSON string"),
        (b'{"a":"tab\there"}', r"offset 5; expected a complete JSON string"),
        (b'{"a":"bad \\x escape"}', r"offset 5; expected a complete JSON string"),
        (b'{"brokerAddrs":{"x":"h:1"}}', r"brokerAddrs key 'x' at offset 16; expected an integer"),
        (b'{a:1}', r"b'a' at offset 1; expected an object key"),
        (b'{"a" 1}', r"offset 5; expected ':' after an object key"),
        (b'{"a":[1 2]}', r"offset 8; expected ',' or '\]' in an array"),
        (b'{"a":tru}', r"offset 5; expected a JSON value"),
        (b'{"a":"\xff"}', r"invalid UTF-8 in the string at offset 5"),
        (b'{"a":' + b"[" * 100 + b"]" * 100 + b"}", r"nests deeper than 64 levels"),
    ],
)
def test_malformed_bodies(body: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        rewrite_broker_addrs(body, lambda a: "never")


def test_mapper_not_called_on_malformed_body() -> None:
    calls: list[str] = []
    with pytest.raises(BodyError):
        rewrite_broker_addrs(LEGACY_ROUTE[:-1], lambda a: calls.append(a) or None)
    assert calls == []


def test_mapper_must_return_str_or_none() -> None:
    with pytest.raises(TypeError, match="expected str or None"):
        rewrite_broker_addrs(LEGACY_ROUTE, lambda a: 5)  # type: ignore[arg-type,return-value]


def test_non_string_addr_values_are_ignored() -> None:
    body = b'{"brokerAddrs":{0:null,1:"h:1"}}'
    new, found = rewrite_broker_addrs(body, lambda a: "p:1")
    assert new == b'{"brokerAddrs":{0:null,1:"p:1"}}'
    assert found == [BrokerAddr(None, 1, "h:1", None)]


def test_other_bare_integer_keys_parse_as_int() -> None:
    body = b'{"topicQueueMappingByBroker":{"b":{"currIdMap":{0:1,-1:2}}}}'
    obj, dialect = parse_route(body)
    assert dialect == "legacy"
    assert obj["topicQueueMappingByBroker"]["b"]["currIdMap"] == {0: 1, -1: 2}
    assert encode_route(obj, dialect) == body


# --- property tests ---------------------------------------------------------------------

_name = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=12)
_addr = st.builds(lambda h, p: f"{h}:{p}", _name, st.integers(0, 65535))


@st.composite
def routes(draw: st.DrawFn) -> dict[str, Any]:
    brokers = draw(st.lists(_name, max_size=4, unique=True))
    datas = []
    for name in brokers:
        ids = draw(st.lists(st.integers(0, 20), min_size=1, max_size=3, unique=True))
        data: dict[str, Any] = {
            "brokerAddrs": {i: draw(_addr) for i in sorted(ids)},
            "brokerName": name,
            "cluster": draw(_name),
            "enableActingMaster": draw(st.booleans()),
        }
        if draw(st.booleans()):  # sibling order must not matter
            data = dict(reversed(list(data.items())))
        datas.append(data)
    queues = [{"brokerName": n, "perm": draw(st.integers(0, 15)), "readQueueNums": 4,
               "topicSysFlag": 0, "writeQueueNums": 4} for n in brokers]
    return {"brokerDatas": datas, "filterServerTable": {}, "orderTopicConf": draw(_name),
            "queueDatas": queues}


def _mapped(obj: dict[str, Any], mapper: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(obj))  # deep copy (keys become str; restored below)
    for data, orig in zip(out["brokerDatas"], obj["brokerDatas"], strict=True):
        data["brokerAddrs"] = {i: mapper(a) or a for i, a in orig["brokerAddrs"].items()}
    return out


@given(routes(), st.sampled_from(["legacy", "standard"]))
def test_route_round_trip_and_rewrite(obj: dict[str, Any], dialect: Any) -> None:
    body = encode_route(obj, dialect)
    parsed, got_dialect = parse_route(body)
    assert parsed == obj
    has_addrs = any(d["brokerAddrs"] for d in obj["brokerDatas"])
    assert got_dialect == (dialect if has_addrs else "standard")
    if dialect == "standard":
        assert json.loads(body)["queueDatas"] == obj["queueDatas"]

    def mapper(addr: str) -> str | None:
        return None if len(addr) % 2 else "proxy/é" + addr

    new, found = rewrite_broker_addrs(body, mapper)
    # Patching bytes must give exactly what encoding the mapped route gives.
    assert new == encode_route(_mapped(obj, mapper), dialect)
    assert found == [BrokerAddr(d["brokerName"], i, a, d["cluster"])
                     for d in obj["brokerDatas"] for i, a in d["brokerAddrs"].items()]
    assert rewrite_broker_addrs(body, lambda a: a)[0] == body


@given(st.binary(max_size=200))
def test_garbage_raises_only_body_error(data: bytes) -> None:
    try:
        rewrite_broker_addrs(data, lambda a: None)
    except BodyError:
        pass


def test_oversized_numbers_are_body_errors() -> None:
    with pytest.raises(BodyError, match="5000-digit number at offset 5"):
        parse_route(b'{"a":' + b"9" * 5000 + b"}")
    with pytest.raises(BodyError, match="brokerAddrs key '1_0'"):
        parse_route(b'{"brokerAddrs":{"1_0":"h:1"}}')


# --- captured from the real Java codecs ------------------------------------------------
# Produced by a throwaway program against the rocketmq-{remoting,common} 5.3.3 jars (and
# 4.9.4 where named so): RemotingCommand.encode(), MessageDecoder.encodeMessages/encode,
# TopicRouteData.encode() (legacy) and encode(BrowserCompatible, QuoteFieldNames,
# SkipTransientField, MapSortField) (standard), ClusterInfo.encode().

JAVA533_ROUTE_LEGACY = bytes.fromhex(
    "7b2262726f6b65724461746173223a5b7b2262726f6b65724164647273223a7b303a2231302e302e302e313a"
    "3130393131222c313a2231302e302e302e323a3130393131222c323a2231302e302e302e333a313039313122"
    "7d2c2262726f6b65724e616d65223a2262726f6b65722d61222c22636c7573746572223a2244656661756c74"
    "436c7573746572222c22656e61626c65416374696e674d6173746572223a66616c73657d2c7b2262726f6b65"
    "724164647273223a7b303a225b3a3a315d3a3130393131227d2c2262726f6b65724e616d65223a2262726f6b"
    "65722dc3a9222c22636c7573746572223a22436cc3bc737465722f32222c22656e61626c65416374696e674d"
    "6173746572223a66616c73657d5d2c2266696c7465725365727665725461626c65223a7b7d2c227175657565"
    "4461746173223a5b7b2262726f6b65724e616d65223a2262726f6b65722d61222c227065726d223a362c2272"
    "65616451756575654e756d73223a342c22746f706963537973466c6167223a302c2277726974655175657565"
    "4e756d73223a347d5d7d"
)
JAVA533_ROUTE_STANDARD = bytes.fromhex(
    "7b2262726f6b65724461746173223a5b7b2262726f6b65724164647273223a7b2230223a2231302e302e302e"
    "313a3130393131222c2231223a2231302e302e302e323a3130393131222c2232223a2231302e302e302e333a"
    "3130393131227d2c2262726f6b65724e616d65223a2262726f6b65722d61222c22636c7573746572223a2244"
    "656661756c74436c7573746572222c22656e61626c65416374696e674d6173746572223a66616c73657d2c7b"
    "2262726f6b65724164647273223a7b2230223a225b3a3a315d3a3130393131227d2c2262726f6b65724e616d"
    "65223a2262726f6b65722d5c7530304539222c22636c7573746572223a22436c5c7530304643737465725c2f"
    "32222c22656e61626c65416374696e674d6173746572223a66616c73657d5d2c2266696c7465725365727665"
    "725461626c65223a7b7d2c2271756575654461746173223a5b7b2262726f6b65724e616d65223a2262726f6b"
    "65722d61222c227065726d223a362c227265616451756575654e756d73223a342c22746f706963537973466c"
    "6167223a302c22777269746551756575654e756d73223a347d5d7d"
)
JAVA533_CLUSTER = bytes.fromhex(
    "7b2262726f6b6572416464725461626c65223a7b2262726f6b65722dc3a9223a7b2262726f6b657241646472"
    "73223a7b303a225b3a3a315d3a3130393131227d2c2262726f6b65724e616d65223a2262726f6b65722dc3a9"
    "222c22636c7573746572223a22436cc3bc737465722f32222c22656e61626c65416374696e674d6173746572"
    "223a66616c73657d2c2262726f6b65722d61223a7b2262726f6b65724164647273223a7b303a2231302e302e"
    "302e313a3130393131222c313a2231302e302e302e323a3130393131222c323a2231302e302e302e333a3130"
    "393131227d2c2262726f6b65724e616d65223a2262726f6b65722d61222c22636c7573746572223a22446566"
    "61756c74436c7573746572222c22656e61626c65416374696e674d6173746572223a66616c73657d7d2c2263"
    "6c7573746572416464725461626c65223a7b22436cc3bc737465722f32223a5b2262726f6b65722dc3a9225d"
    "2c2244656661756c74436c7573746572223a5b2262726f6b65722d61225d7d7d"
)
JAVA494_ROUTE_LEGACY = bytes.fromhex(
    "7b2262726f6b65724461746173223a5b7b2262726f6b65724164647273223a7b303a2231302e302e302e313a"
    "3130393131222c313a2231302e302e302e323a3130393131222c323a2231302e302e302e333a313039313122"
    "7d2c2262726f6b65724e616d65223a2262726f6b65722d61222c22636c7573746572223a2244656661756c74"
    "436c7573746572227d2c7b2262726f6b65724164647273223a7b303a225b3a3a315d3a3130393131227d2c22"
    "62726f6b65724e616d65223a2262726f6b65722dc3a9222c22636c7573746572223a22436cc3bc737465722f"
    "32227d5d2c2266696c7465725365727665725461626c65223a7b7d2c2271756575654461746173223a5b7b22"
    "62726f6b65724e616d65223a2262726f6b65722d61222c227065726d223a362c227265616451756575654e75"
    "6d73223a342c22746f706963537973466c6167223a302c22777269746551756575654e756d73223a347d5d7d"
)


@pytest.mark.parametrize(
    ("body", "dialect"),
    [(JAVA533_ROUTE_LEGACY, "legacy"), (JAVA533_ROUTE_STANDARD, "standard"),
     (JAVA533_CLUSTER, "legacy"), (JAVA494_ROUTE_LEGACY, "legacy")],
)
def test_java_captured_routes(body: bytes, dialect: str) -> None:
    obj, got = parse_route(body)
    assert got == dialect
    assert encode_route(obj, got) == body
    new, found = rewrite_broker_addrs(body, lambda a: "proxy-" + a)
    assert rewrite_broker_addrs(body, lambda a: a)[0] is body
    assert sorted((f.broker_name, f.broker_id, f.addr, f.cluster) for f in found) == [
        ("broker-a", 0, "10.0.0.1:10911", "DefaultCluster"),
        ("broker-a", 1, "10.0.0.2:10911", "DefaultCluster"),
        ("broker-a", 2, "10.0.0.3:10911", "DefaultCluster"),
        ("broker-é", 0, "[::1]:10911", "Clüster/2"),
    ]
    assert parse_route(new)[0] == parse_route(body.replace(b':"10.', b':"proxy-10.').replace(
        b':"[::1]', b':"proxy-[::1]'))[0]
