"""The null-broker bench's scenarios and its two modes (short, full)."""

from __future__ import annotations

from dataclasses import dataclass

from rmqfast.bench.nullbroker import PULL_BODY, PULL_MSGS


@dataclass(frozen=True)
class Scenario:
    """One traffic shape for the load generator."""

    name: str
    conns: int
    inflight: int = 1
    rate: float = 0.0  # > 0: open loop at this many requests/s in total
    body: int = 1024
    topics: int = 8
    pull_pct: int = 0
    what: str = ""

    @property
    def open_loop(self) -> bool:
        return self.rate > 0

    def loadgen_args(self) -> list[str]:
        return ["--conns", str(self.conns), "--inflight", str(self.inflight), "--rate", f"{self.rate:g}",
                "--body", str(self.body), "--topics", str(self.topics), "--pull-pct", str(self.pull_pct)]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("send-16x32", 16, 32, what="1 KiB sends, 16 connections x 32 in flight (throughput)"),
        Scenario("send-64x1", 64, 1, what="1 KiB sends, 64 connections x 1 in flight (sync clients)"),
        Scenario("open-60k", 16, rate=60000, what="1 KiB sends, open loop at 60,000/s over 16 connections (latency)"),
        Scenario("open-120k", 16, rate=120000,
                 what="1 KiB sends, open loop at 120,000/s over 16 connections (latency near saturation)"),
        Scenario("pull-16x4", 16, 4, pull_pct=100,
                 what=f"pulls answered with {PULL_MSGS} x {PULL_BODY} B records, 16 connections x 4 in flight"),
    )
}


@dataclass(frozen=True)
class Mode:
    """Defaults of a run: rounds, seconds per run, which scenarios and targets."""

    rounds: int
    warmup: float
    duration: float
    scenarios: tuple[str, ...]
    targets: tuple[str, ...]


SHORT = Mode(1, 0.5, 2.0, ("send-16x32", "send-64x1", "open-60k"), ("direct", "haproxy", "rmqfast", "rmqfast-pure"))
FULL = Mode(3, 2.0, 8.0, tuple(SCENARIOS),
            ("direct", "relay-floor", "haproxy", "haproxy-1t", "rmqfast", "rmqfast-1w", "rmqfast-pure"))
#: ``rmqfast-1w``: rmqfast with one worker, beside ``rmqfast`` (``--workers``, default 2), as
#: ``haproxy-1t`` is beside ``haproxy``: on a machine whose cores the load generator and the
#: null broker share, one proxy process can beat two.
#: ``rmqfast-syscalls`` (asked for with ``--targets``): ``rmqfast`` with ``RMQFAST_URING=0``, its
#: reactor making one recv/send per pump instead of batching them through io_uring.
#: ``relay-floor`` (full mode, or asked for with ``--targets``): ``bench/relayfloor.c``, a bare relay (see
#: ``rmqfast.bench.floor``): what one more user-space hop costs on this machine, with nothing else.
ALL_TARGETS = ("direct", "haproxy", "haproxy-1t", "rmqfast", "rmqfast-1w", "rmqfast-syscalls", "rmqfast-pure",
               "relay-floor")
