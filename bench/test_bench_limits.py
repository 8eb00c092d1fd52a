"""Micro-benchmarks of the send limiter (pytest-benchmark): ``pytest bench/test_bench_limits.py``.

* one limiter decision (GCRA compare-and-swap on the shared bucket), compiled and pure twins;
  the issue's target for the compiled one is well under 1 µs;
* the frame scan of 64 pipelined 1 KiB sends to a limited topic (limit high enough to admit them
  all) against the same scan without limits: what limiting adds per frame on the hot path.
"""

from __future__ import annotations

from typing import Any

import pytest

from rmqfast import codec
from rmqfast.limits import LimiterC, LimiterPy, new_shared_memory

pytest.importorskip("pytest_benchmark")

LIMITERS = [pytest.param(LimiterPy, id="py")]
if LimiterC is not None:
    LIMITERS.append(pytest.param(LimiterC, id="c"))

RULES = [(b"BenchTopic_0", None, 1e9, 1e9, 0, 0, 0, 1), (b"BenchTopic_0", b"TagA", 1e9, 1e9, 0, 0, 0, 2),
         (b"*", None, 1e9, 1e9, 0, 0, 0, 3)]


@pytest.mark.parametrize("tag", [None, b"TagA"], ids=["topic-rule", "tag-rule"])
@pytest.mark.parametrize("limiter_cls", LIMITERS)
def test_limiter_decision(benchmark: Any, limiter_cls: Any, tag: bytes | None) -> None:
    lim = limiter_cls(new_shared_memory("compiled" if codec.is_compiled(limiter_cls) else "python"))
    lim.configure(RULES)
    now = [10**12]

    def decide() -> None:
        now[0] += 1000
        assert lim.admit(b"BenchTopic_0", tag, 1, 1024, now[0]) == -1

    benchmark(decide)


@pytest.mark.parametrize("limited", [False, True], ids=["no-limits", "limited"])
def test_scan_64_sends_with_and_without_limits(scan_forward: Any, scanner_impl: tuple[Any, Any], wire: Any,
                                               limited: bool) -> None:
    scanner_cls, stats_cls = scanner_impl
    lim = None
    if limited:
        compiled = codec.is_compiled(scanner_cls)
        lim = (LimiterC if compiled else LimiterPy)(new_shared_memory("compiled" if compiled else "python"))
        lim.configure([(b"BenchTopic_0", None, 1e9, 1e9, 0, 0, 0, 1)])
    buf = bytearray(b"".join(wire.send_request(i, topic="BenchTopic_0") for i in range(64)))
    scanner = scanner_cls(stats_cls(), limiter=lim)
    scan_forward(scanner, buf, 64)
