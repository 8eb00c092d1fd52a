"""Route healing: a dead master's queues lose PERM_WRITE in route answers, byte-patched in either dialect."""

from __future__ import annotations

from typing import Any

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, encode
from rmqfast.codec.route import PERM_WRITE, BrokerAddr, parse_route, rewrite_broker_addrs
from rmqfast.filters.api import Frame
from rmqfast.filters.routes import RewriteRoutes
from rmqfast.proxy.failover import RouteBook
from tests.test_codec_route import LEGACY_ROUTE, STANDARD_ROUTE


def _clear_write_of(dead: str) -> Any:
    def perm(found: list[BrokerAddr], name: str, p: int) -> int | None:
        masters = {b.broker_name: b.addr for b in found if b.broker_id == 0}
        return p & ~PERM_WRITE if masters.get(name) == dead else None
    return perm


def test_perm_patched_in_both_dialects_and_nothing_else() -> None:
    for body in (LEGACY_ROUTE, STANDARD_ROUTE):
        new, found = rewrite_broker_addrs(body, lambda a: None, perm=_clear_write_of("10.0.0.1:10911"))
        assert len(new) == len(body)
        # exactly one byte differs: broker-a's perm 6 -> 4 (read only); broker-b keeps 6
        diff = [i for i in range(len(body)) if body[i] != new[i]]
        assert len(diff) == 1 and body[diff[0]:diff[0] + 1] == b"6" and new[diff[0]:diff[0] + 1] == b"4"
        obj, dialect = parse_route(new)
        assert dialect == parse_route(body)[1]
        perms = {q["brokerName"]: q["perm"] for q in obj["queueDatas"]}
        assert perms == {"broker-a": 4, "broker-b": 6}
        assert {b.addr for b in found} >= {"10.0.0.1:10911", "10.0.1.1:10911"}


def test_perm_and_address_edits_together_keep_order() -> None:
    mapping = {"10.0.0.1:10911": "proxy:30000", "10.0.1.1:10911": "proxy:30002"}
    new, _ = rewrite_broker_addrs(LEGACY_ROUTE, mapping.get, perm=_clear_write_of("10.0.1.1:10911"))
    obj, dialect = parse_route(new)
    assert dialect == "legacy"
    assert obj["brokerDatas"][0]["brokerAddrs"][0] == "proxy:30000"
    assert obj["brokerDatas"][1]["brokerAddrs"][0] == "proxy:30002"
    assert {q["brokerName"]: q["perm"] for q in obj["queueDatas"]} == {"broker-a": 6, "broker-b": 4}
    expected = LEGACY_ROUTE.replace(b"10.0.0.1:10911", b"proxy:30000").replace(b"10.0.1.1:10911", b"proxy:30002")
    expected = expected.replace(b'"broker-b","perm":6', b'"broker-b","perm":4')
    assert new == expected


def test_no_perm_mapper_or_no_change_returns_the_same_body() -> None:
    new, _ = rewrite_broker_addrs(LEGACY_ROUTE, lambda a: None, perm=lambda f, n, p: None)
    assert new is LEGACY_ROUTE


def test_perm_outside_queue_data_is_not_touched() -> None:
    body = b'{"perm":6,"x":{"brokerName":"broker-a","perm":6}}'  # no writeQueueNums: not a QueueData
    calls: list[str] = []
    new, _ = rewrite_broker_addrs(body, lambda a: None, perm=lambda f, n, p: calls.append(n) or 0)
    assert new == body and calls == []


class _Health:
    def __init__(self, down: set[str]) -> None:
        self._down = down

    def is_down(self, addr: str) -> bool:
        return addr in self._down


class _Registry:
    def is_proxy_address(self, addr: str) -> bool:
        return addr.startswith("proxy:")

    def advertised(self, real: str) -> str:
        return "proxy:" + real.rsplit(":", 1)[1]


class _Sess:
    role = "namesrv"
    client_addr = "c:1"
    upstream_addr = "ns:9876"

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}


def _route_exchange(f: RewriteRoutes, body: bytes, topic: str = "T") -> bytes:
    sess = _Sess()
    req = encode(RemotingCommand(code=C.GET_ROUTEINFO_BY_TOPIC, opaque=7, ext_fields={"topic": topic}))
    assert f.on_request(sess, Frame(req, C.GET_ROUTEINFO_BY_TOPIC, 0, 7)) is None
    resp = encode(RemotingCommand(code=C.SUCCESS, opaque=7, flag=C.FLAG_RESPONSE, body=body))
    v = f.on_response(sess, Frame(resp, C.SUCCESS, C.FLAG_RESPONSE, 7))
    assert v is not None and getattr(v.kind, "value", v.kind) == "rewrite"
    return Frame(v.data, 0, 1, 7).body


def test_rewrite_routes_heals_dead_master_and_learns_route() -> None:
    healed: list[str] = []
    book = RouteBook(lambda: [])
    f = RewriteRoutes(_Registry(), health=_Health({"10.0.0.1:10911"}), book=book,  # type: ignore[arg-type]
                      on_heal=healed.append)
    obj, _ = parse_route(_route_exchange(f, LEGACY_ROUTE))
    assert {q["brokerName"]: q["perm"] for q in obj["queueDatas"]} == {"broker-a": 4, "broker-b": 6}
    assert obj["brokerDatas"][0]["brokerAddrs"][0] == "proxy:10911"
    assert healed == ["10.0.0.1:10911"]
    got = book.cached("T")
    assert got is not None
    masters, queues = got
    assert masters == {"broker-a": "10.0.0.1:10911", "broker-b": "10.0.1.1:10911"}  # real addresses
    assert sorted(queues) == [("broker-a", 4, 6), ("broker-b", 4, 6)]


def test_rewrite_routes_keeps_write_when_no_live_master_is_left() -> None:
    f = RewriteRoutes(_Registry(), health=_Health({"10.0.0.1:10911", "10.0.1.1:10911"}))  # type: ignore[arg-type]
    obj, _ = parse_route(_route_exchange(f, STANDARD_ROUTE))
    assert {q["perm"] for q in obj["queueDatas"]} == {6}


def test_rewrite_routes_without_health_changes_no_perm() -> None:
    f = RewriteRoutes(_Registry())  # type: ignore[arg-type]
    obj, _ = parse_route(_route_exchange(f, LEGACY_ROUTE))
    assert {q["perm"] for q in obj["queueDatas"]} == {6}


def test_route_answers_cannot_pass_unrewritten() -> None:
    """An answer whose opaque is not pending is relayed as it is: a second route request on an
    opaque still pending (the second answer back) or more requests pending than are remembered
    would reach the client with the real broker addresses. The connection is closed instead."""
    f = RewriteRoutes(_Registry())  # type: ignore[arg-type]
    sess = _Sess()

    def request(opaque: int, topic: str) -> Any:
        req = encode(RemotingCommand(code=C.GET_ROUTEINFO_BY_TOPIC, opaque=opaque, ext_fields={"topic": topic}))
        return f.on_request(sess, Frame(req, C.GET_ROUTEINFO_BY_TOPIC, 0, opaque))

    assert request(7, "A") is None
    v = request(7, "B")
    assert v is not None and getattr(v.kind, "value", v.kind) == "close" and "reuses opaque 7" in v.reason
    resp = encode(RemotingCommand(code=C.SUCCESS, opaque=7, flag=C.FLAG_RESPONSE, body=LEGACY_ROUTE))
    v = f.on_response(sess, Frame(resp, C.SUCCESS, C.FLAG_RESPONSE, 7))
    assert v is not None and b"10.0.0.1" not in v.data  # the one pending answer is rewritten
    assert request(7, "B") is None  # answered: the opaque may be used again
    many = _Sess()
    sess = many
    assert all(request(100 + i, "T") is None for i in range(10000))
    v = request(20000, "T")
    assert v is not None and getattr(v.kind, "value", v.kind) == "close" and "10000" in v.reason
