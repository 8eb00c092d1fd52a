"""Smuggled admin requests: what the proxy lets through is what the broker reads.

Each variant hides an UPDATE_BROKER_CONFIG (25) or UPDATE_NAMESRV_CONFIG (318) behind a header the
old scanner read as something harmless (duplicate keys: fastjson keeps the first; escaped and
upper-case keys: fastjson decodes and matches them; a duplicate flag: a request disguised as a
response).  Sent directly, the real RocketMQ 5.3.3 broker executes them (checked here, so the
variants are real); through rmqfast they are refused and the configuration read back directly
is unchanged.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator

import pytest
from itutil import (
    BOUND,
    GET_BROKER_CONFIG,
    GET_NAMESRV_CONFIG,
    NO_PERMISSION,
    PROTOCOL_ERROR_MSG,
    SUCCESS,
    UPDATE_BROKER_CONFIG,
    UPDATE_NAMESRV_CONFIG,
    connect,
    log_records,
    properties,
    proxy_broker_endpoint,
    read_frame,
    request,
    wait_until,
)

from rmqfast.testing import RocketMQCluster
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

HEART_BEAT = 34
_opaque = iter(range(7_000_000, 8_000_000))


def _rest(opaque: int) -> str:
    return f'"language":"JAVA","opaque":{opaque},"serializeTypeCurrentRPC":"JSON","version":401'


# name -> header text for (admin code, opaque).  Which duplicate fastjson keeps depends on where
# it stands (its field-order fast path, then a slow path), so duplicates come in both orders.
JSON_VARIANTS: dict[str, Callable[[int, int], bytes]] = {
    "duplicate-code-admin-first": lambda c, o: f'{{"code":{c},"flag":0,{_rest(o)},"code":{HEART_BEAT}}}'.encode(),
    "duplicate-code-admin-last": lambda c, o: f'{{"code":{HEART_BEAT},"flag":0,{_rest(o)},"code":{c}}}'.encode(),
    "duplicate-code-unsorted": lambda c, o: f'{{"opaque":{o},"code":{c},"code":{HEART_BEAT},"flag":0}}'.encode(),
    "escaped-key": lambda c, o: f'{{"\\u0063ode":{c},"flag":0,{_rest(o)},"code":{HEART_BEAT}}}'.encode(),
    "upper-case-key": lambda c, o: f'{{"CODE":{c},"flag":0,{_rest(o)},"code":{HEART_BEAT}}}'.encode(),
    "duplicate-flag-request-first": lambda c, o: f'{{"code":{c},"flag":0,{_rest(o)},"flag":1}}'.encode(),
    "duplicate-flag-request-last": lambda c, o: f'{{"code":{c},"flag":1,{_rest(o)},"flag":0}}'.encode(),
    "snake-key": lambda c, o: f'{{"c_ode":{c},"flag":0,{_rest(o)},"code":{HEART_BEAT}}}'.encode(),
}
# the tricks of the attack report: each must make the real broker run the admin code in some order
TRICKS = {
    "duplicate code": ("duplicate-code-admin-first", "duplicate-code-admin-last", "duplicate-code-unsorted"),
    "escaped key": ("escaped-key",),
    "upper-case key": ("upper-case-key",),
    "duplicate flag": ("duplicate-flag-request-first", "duplicate-flag-request-last"),
}


def json_frame(header: bytes, body: bytes) -> bytes:
    return struct.pack(">ii", 4 + len(header) + len(body), len(header)) + header + body


def binary_frame(code: int, opaque: int, ext_len_delta: int, body: bytes) -> bytes:
    """A ROCKETMQ binary header whose extFields length lies by ``ext_len_delta``."""
    ext = struct.pack(">H", 1) + b"x" + struct.pack(">i", 1) + b"y"
    h = struct.pack(">hbhii", code, 0, 401, opaque, 0) + struct.pack(">ii", 0, len(ext) + ext_len_delta) + ext
    return struct.pack(">ii", 4 + len(h) + len(body), (1 << 24) | len(h)) + h + body


def outcome(addr: str, frame: bytes, opaque: int) -> str:
    """'closed' (the proxy refused the frame), 'denied' (NO_PERMISSION), 'no answer' or the answer's code."""
    with connect(addr, timeout=10.0) as s:
        s.sendall(frame)
        try:
            while True:
                r = read_frame(s)
                if r.flag & 1 and r.header.get("opaque") == opaque:
                    return "denied" if r.code == NO_PERMISSION else f"code {r.code}"
        except TimeoutError:
            return "no answer"  # forwarded, and read by the broker as something it does not answer
        except (ConnectionError, OSError):
            return "closed"


@pytest.fixture
def broker_config(cluster: RocketMQCluster) -> Iterator[dict[str, str]]:
    """The broker's config before; fileReservedTime restored afterwards, whatever happened."""
    before = properties(request(cluster.broker_addr, GET_BROKER_CONFIG).body)
    yield before
    now = properties(request(cluster.broker_addr, GET_BROKER_CONFIG).body)
    if now.get("fileReservedTime") != before["fileReservedTime"]:
        restore = f"fileReservedTime={before['fileReservedTime']}\n".encode()
        request(cluster.broker_addr, UPDATE_BROKER_CONFIG, body=restore)


def reserved(cluster: RocketMQCluster) -> str:
    return properties(request(cluster.broker_addr, GET_BROKER_CONFIG).body)["fileReservedTime"]


def test_variants_are_real_when_sent_directly(cluster: RocketMQCluster, broker_config: dict[str, str]) -> None:
    """Control: the real broker reads each JSON variant as UPDATE_BROKER_CONFIG and applies it."""
    base = int(broker_config["fileReservedTime"])
    executed = {}
    for i, (name, make) in enumerate(JSON_VARIANTS.items()):
        want = str(base + 11 + i)
        op = next(_opaque)
        frame = json_frame(make(UPDATE_BROKER_CONFIG, op), f"fileReservedTime={want}\n".encode())
        outcome(cluster.broker_addr, frame, op)
        executed[name] = reserved(cluster) == want
    print(f"executed directly by the broker: {executed}")
    for trick, names in TRICKS.items():
        assert any(executed[n] for n in names), f"{trick}: the broker executed no variant directly ({executed})"


@pytest.mark.parametrize("name", sorted(JSON_VARIANTS))
def test_smuggled_update_broker_config_is_refused(
    cluster: RocketMQCluster, proxy: ProxyProcess, broker_config: dict[str, str], name: str
) -> None:
    endpoint = proxy_broker_endpoint(proxy)
    want = str(int(broker_config["fileReservedTime"]) + 5)
    op = next(_opaque)
    frame = json_frame(JSON_VARIANTS[name](UPDATE_BROKER_CONFIG, op), f"fileReservedTime={want}\n".encode())
    got = outcome(endpoint, frame, op)
    assert got in ("closed", "denied"), f"{name}: the proxy let it through ({got})"
    assert reserved(cluster) == broker_config["fileReservedTime"], f"{name}: the broker's config changed"
    if got == "closed":
        wait_until(lambda: [r for r in log_records(proxy, PROTOCOL_ERROR_MSG) if "header" in str(r.get("error", ""))],
                   BOUND, "a log line naming the refused header")


@pytest.mark.parametrize("name", sorted(JSON_VARIANTS))
def test_smuggled_update_namesrv_config_is_refused(cluster: RocketMQCluster, proxy: ProxyProcess, name: str) -> None:
    before = properties(request(cluster.namesrv_addr, GET_NAMESRV_CONFIG).body)
    want = str(int(before["clientRequestThreadPoolNums"]) + 2)
    op = next(_opaque)
    frame = json_frame(JSON_VARIANTS[name](UPDATE_NAMESRV_CONFIG, op), f"clientRequestThreadPoolNums={want}\n".encode())
    got = outcome(proxy.namesrv_addr, frame, op)
    assert got in ("closed", "denied"), f"{name}: the proxy let it through ({got})"
    after = properties(request(cluster.namesrv_addr, GET_NAMESRV_CONFIG).body)
    assert after["clientRequestThreadPoolNums"] == before["clientRequestThreadPoolNums"]


@pytest.mark.parametrize("delta", [-3, 4, 100])
def test_binary_header_with_lying_lengths_is_refused(
    cluster: RocketMQCluster, proxy: ProxyProcess, broker_config: dict[str, str], delta: int
) -> None:
    endpoint = proxy_broker_endpoint(proxy)
    op = next(_opaque)
    want = str(int(broker_config["fileReservedTime"]) + 3)
    got = outcome(endpoint, binary_frame(UPDATE_BROKER_CONFIG, op, delta, f"fileReservedTime={want}\n".encode()), op)
    assert got in ("closed", "denied"), got
    assert reserved(cluster) == broker_config["fileReservedTime"]


def test_plain_requests_still_pass(cluster: RocketMQCluster, proxy: ProxyProcess) -> None:
    """The refusals above are not a closed door: a well-formed data-plane request is answered."""
    endpoint = proxy_broker_endpoint(proxy)
    op = next(_opaque)
    header = json.dumps({"code": 30, "extFields": {"topic": "TBW102", "queueId": "0"}, "flag": 0,
                         "language": "JAVA", "opaque": op, "serializeTypeCurrentRPC": "JSON", "version": 401}).encode()
    assert outcome(endpoint, json_frame(header, b""), op) == f"code {SUCCESS}"
