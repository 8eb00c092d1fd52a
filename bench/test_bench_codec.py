"""Micro-benchmarks of the codec's hot pieces (pytest-benchmark): ``pytest bench/``.

* frame scan: what the relay runs on every receive buffer.  Compiled and pure twins side by
  side, on a buffer of 1 and of 64 Java-shaped 1 KiB SEND_MESSAGE_V2 frames (one frame per
  recv is the sync-client case; 64 the pipelined one), on 64 send responses (the other
  direction), and with a policy asking for every send (one scan call per frame, as a future
  rate limiter would cause);
* the policy-side codec, pure Python only (it has no compiled twin): header decode
  (``command.decode_frame``), properties (``properties.parse_properties``), route rewrite
  (``route.rewrite_broker_addrs``) and batch decode (``batch.decode_batch``).

``extra_info`` carries the frames or bytes per call, to turn the time per call into frames
per second.
"""

from __future__ import annotations

from typing import Any

import pytest

from rmqfast.codec import ACTION_POLICY, CODE_SLOTS, EV_POLICY, code_slot
from rmqfast.codec import codes as C
from rmqfast.codec.batch import decode_batch
from rmqfast.codec.command import decode_frame
from rmqfast.codec.properties import parse_properties
from rmqfast.codec.route import rewrite_broker_addrs

pytest.importorskip("pytest_benchmark")


@pytest.mark.parametrize("frames", [1, 64])
def test_scan_send_requests(scan_forward: Any, scanner_impl: tuple[Any, Any], wire: Any, frames: int) -> None:
    scanner_cls, stats_cls = scanner_impl
    buf = bytearray(b"".join(wire.send_request(i, topic=f"BenchTopic_{i % 8}") for i in range(frames)))
    scanner = scanner_cls(stats_cls())
    scan_forward(scanner, buf, frames)


def test_scan_send_responses(scan_forward: Any, scanner_impl: tuple[Any, Any], wire: Any) -> None:
    scanner_cls, stats_cls = scanner_impl
    buf = bytearray(b"".join(wire.send_response(i) for i in range(64)))
    scanner = scanner_cls(stats_cls())
    scan_forward(scanner, buf, 64)


def test_scan_send_requests_policy(benchmark: Any, scanner_impl: tuple[Any, Any], wire: Any) -> None:
    scanner_cls, stats_cls = scanner_impl
    actions = bytearray(CODE_SLOTS)
    actions[code_slot(C.SEND_MESSAGE_V2)] = ACTION_POLICY
    buf = bytearray(b"".join(wire.send_request(i) for i in range(64)))
    scanner = scanner_cls(stats_cls(), actions=bytes(actions))
    end = len(buf)

    def scan() -> None:
        pos = n = 0
        while True:
            ev, _, b = scanner.scan(buf, pos, end)
            if ev != EV_POLICY:
                break
            pos = b
            n += 1
        assert n == 64

    benchmark.extra_info.update(frames=64, bytes=end)
    benchmark(scan)


def test_decode_send_frame(benchmark: Any, wire: Any) -> None:
    frame = wire.send_request(7)
    cmd = benchmark(decode_frame, frame)
    assert cmd.code == C.SEND_MESSAGE_V2 and cmd.ext_fields["b"] == "BenchTopic"


def test_parse_properties(benchmark: Any, wire: Any) -> None:
    props = wire.java_properties(7)
    parsed = benchmark(parse_properties, props)
    assert parsed["TAGS"] == "TagA"


def test_rewrite_route(benchmark: Any, wire: Any) -> None:
    body = wire.route_body(brokers=4, replicas=2)
    mapping = {f"10.0.{b}.{r + 1}:10911": f"10.9.9.9:{30900 + 2 * b + r}" for b in range(4) for r in range(2)}
    new, found = benchmark(rewrite_broker_addrs, body, mapping.get)
    assert len(found) == 8 and b"10.9.9.9:30900" in new
    benchmark.extra_info.update(bytes=len(body))


def test_decode_batch(benchmark: Any, wire: Any) -> None:
    body = wire.batch_body(messages=32, size=256)
    entries = benchmark(decode_batch, body)
    assert len(entries) == 32
    benchmark.extra_info.update(messages=32, bytes=len(body))
