"""Inputs shared by the codec micro-benchmarks (``pytest bench/``).

The default ``pytest`` run does not collect this folder (``testpaths = ["tests"]``); name it
to run it: ``pytest bench/`` (add ``--benchmark-json=FILE`` to keep the numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rmqfast import codec
from rmqfast.codec import codes as C
from rmqfast.codec.batch import BatchEntry, encode_batch
from rmqfast.codec.command import RemotingCommand, encode, make_response
from rmqfast.codec.properties import format_properties

BODY = bytes((33 + (i * 7919) % 94) for i in range(1024))  # 1 KiB, printable


def java_properties(n: int) -> str:
    """The ``i`` field a Java 5.x producer writes: KEYS, UNIQ_KEY, WAIT, TAGS."""
    return format_properties({"KEYS": f"k{n}", "UNIQ_KEY": f"7F0000011B6D8A3C{n:016X}", "WAIT": "true",
                              "TAGS": "TagA"})


def send_request(n: int, topic: str = "BenchTopic", body: bytes = BODY) -> bytes:
    """A SEND_MESSAGE_V2 frame as the Java client encodes it (fastjson header, a..n ext fields)."""
    ext = {"a": "PG_bench", "b": topic, "c": "TBW102", "d": "4", "e": str(n % 4), "f": "0",
           "g": "1700000000000", "h": "0", "i": java_properties(n), "j": "0", "k": "false", "m": "false",
           "n": "broker-a"}
    return encode(RemotingCommand(code=C.SEND_MESSAGE_V2, version=435, opaque=n, ext_fields=ext, body=body))


def send_response(n: int) -> bytes:
    req = RemotingCommand(code=C.SEND_MESSAGE_V2, version=435, opaque=n)
    ext = {"queueId": str(n % 4), "TRACE_ON": "true", "MSG_REGION": "DefaultRegion",
           "msgId": f"7F00000100002A9F{n * 1100:016X}", "queueOffset": str(n)}
    return encode(make_response(req, C.SUCCESS, ext_fields=ext))


def route_body(brokers: int = 4, replicas: int = 2) -> bytes:
    """TopicRouteData in the legacy (fastjson, bare integer keys) dialect of a 5.x name server."""
    datas = []
    queues = []
    for b in range(brokers):
        addrs = ",".join(f'{r}:"10.0.{b}.{r + 1}:10911"' for r in range(replicas))
        datas.append(f'{{"brokerAddrs":{{{addrs}}},"brokerName":"broker-{b}","cluster":"DefaultCluster",'
                     '"enableActingMaster":false}')
        queues.append(f'{{"brokerName":"broker-{b}","perm":6,"readQueueNums":8,"topicSysFlag":0,'
                      '"writeQueueNums":8}')
    return (f'{{"brokerDatas":[{",".join(datas)}],"filterServerTable":{{}},'
            f'"queueDatas":[{",".join(queues)}]}}').encode()


def batch_body(messages: int = 32, size: int = 256) -> bytes:
    return encode_batch([
        BatchEntry(flag=0, body=BODY[:size], properties={"UNIQ_KEY": f"7F0000011B6D8A3C{i:016X}", "WAIT": "true",
                                                           "TAGS": "TagA", "KEYS": f"k{i}"})
        for i in range(messages)
    ])


class Wire:
    """The builders above, handed to the benchmarks as the ``wire`` fixture."""

    body = BODY
    java_properties = staticmethod(java_properties)
    send_request = staticmethod(send_request)
    send_response = staticmethod(send_response)
    route_body = staticmethod(route_body)
    batch_body = staticmethod(batch_body)


@pytest.fixture(scope="session")
def wire() -> Wire:
    return Wire()


_SCANNERS = [pytest.param((codec.FrameScannerPy, codec.ScanStatsPy), id="pure")]
if codec.FrameScannerC is not None:
    _SCANNERS.insert(0, pytest.param((codec.FrameScannerC, codec.ScanStatsC), id="compiled"))


@pytest.fixture(params=_SCANNERS)
def scanner_impl(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """(FrameScanner, ScanStats) of the compiled scanner (when built) and of the pure one."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def scan_forward(benchmark: Any) -> Callable[[Any, bytearray, int], None]:
    """``scan_forward(scanner, buf, frames)`` benchmarks one scan of ``buf`` that forwards it
    whole (EV_FORWARD up to its end), with the frames and bytes per call in ``extra_info``."""

    def run(scanner: Any, buf: bytearray, frames: int) -> None:
        end = len(buf)

        def scan() -> None:
            ev, a, _ = scanner.scan(buf, 0, end)
            assert ev == codec.EV_FORWARD and a == end

        benchmark.extra_info.update(frames=frames, bytes=end)
        benchmark(scan)

    return run


def pytest_benchmark_update_machine_info(config: Any, machine_info: dict[str, Any]) -> None:
    """Record which scanners were available, next to pytest-benchmark's own machine info."""
    machine_info["rmqfast_compiled_scanner"] = codec.FrameScannerC is not None
    machine_info["rmqfast_default_scanner"] = codec.IMPLEMENTATION
