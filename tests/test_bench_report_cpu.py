"""The bench summary names the proxies' CPU per answered request next to the throughput ratios."""

from __future__ import annotations

from rmqfast.bench.report import Cell, checks


def cell(sc: str, tg: str, rps: float, cpu_us: float, other: float = 0.0) -> Cell:
    return Cell(scenario=sc, target=tg, runs=1, rps=rps, p50_us=100.0, p99_us=500.0, p999_us=900.0,
                send_rate=rps, cores=1.0, cpu_us_per_req=cpu_us, other_cores=other, errors=0)


def test_cpu_per_request_of_rmqfast_and_haproxy_is_in_the_summary() -> None:
    cells = {(c.scenario, c.target): c for c in [
        cell("send-64x1", "rmqfast", 60_000, 15.8), cell("send-64x1", "haproxy", 59_000, 16.2),
        cell("pull-16x4", "rmqfast", 47_000, 8.1, other=1.0), cell("pull-16x4", "haproxy-1t", 23_000, 13.9),
    ]}
    found = {c.name: c for c in checks(cells, {})}
    got = {n: (c.value, c.unit, c.goal, c.disturbed) for n, c in found.items() if "CPU per request" in n}
    assert got == {
        "send-64x1 rmqfast CPU per request": (15.8, "us", "info", False),
        "send-64x1 haproxy CPU per request": (16.2, "us", "info", False),
        "pull-16x4 rmqfast CPU per request": (8.1, "us", "info", True),
        "pull-16x4 haproxy-1t CPU per request": (13.9, "us", "info", False),
    }
    assert found["send-64x1 rmqfast / best HAProxy"].value == 60_000 / 59_000


def test_one_worker_rmqfast_is_reported_beside_the_goal_target_as_info() -> None:
    cells = {(c.scenario, c.target): c for c in [
        cell("send-64x1", "rmqfast", 60_000, 15.8), cell("send-64x1", "rmqfast-1w", 63_000, 14.0),
        cell("send-64x1", "haproxy", 59_000, 16.2), cell("send-64x1", "haproxy-1t", 61_000, 15.0),
        cell("open-60k", "direct", 60_000, 0.0), cell("open-60k", "rmqfast-1w", 60_000, 10.0, other=0.5),
    ]}
    found = {c.name: c for c in checks(cells, {})}
    assert found["send-64x1 rmqfast / best HAProxy"].value == 60_000 / 61_000  # the goal stays on rmqfast
    one = found["send-64x1 rmqfast-1w / best HAProxy"]
    assert (one.value, one.goal, one.met) == (63_000 / 61_000, "info", None)
    best = found["send-64x1 best rmqfast / best HAProxy"]
    assert (best.value, best.goal, best.met) == (63_000 / 61_000, "info", None)
    assert found["send-64x1 rmqfast-1w CPU per request"].value == 14.0
    lat = found["open-60k rmqfast-1w added p99 over direct"]
    assert (lat.value, lat.goal, lat.disturbed) == (0.0, "info", True)
    assert found["open-60k rmqfast added p99 over direct"].value is None  # not measured: goal line kept


def test_the_floor_relay_is_reported_for_scale() -> None:
    cells = {(c.scenario, c.target): c for c in [
        cell("send-64x1", "rmqfast", 62_000, 10.4), cell("send-64x1", "relay-floor", 60_000, 10.1),
        cell("open-60k", "direct", 60_000, 0.0), cell("open-60k", "relay-floor", 60_000, 10.2),
        cell("open-60k", "haproxy-1t", 60_000, 11.1),
    ]}
    cells[("open-60k", "direct")].p99_us = 300.0
    found = {c.name: c for c in checks(cells, {})}
    assert found["send-64x1 rmqfast / relay-floor"].value == 62_000 / 60_000
    floor = found["open-60k relay-floor added p99 over direct"]
    assert (floor.value, floor.goal, floor.met) == (0.2, "info", None)
    assert found["open-60k haproxy-1t added p99 over direct"].value == 0.2
    assert found["open-60k relay-floor CPU per request"].value == 10.2


def test_rmqfast_with_plain_system_calls_is_compared_with_rmqfast_as_info() -> None:
    cells = {(c.scenario, c.target): c for c in [
        cell("send-64x1", "rmqfast", 62_000, 10.4), cell("send-64x1", "rmqfast-syscalls", 60_000, 11.0),
        cell("send-64x1", "haproxy", 61_000, 10.8),
    ]}
    found = {c.name: c for c in checks(cells, {})}
    pair = found["send-64x1 rmqfast / rmqfast-syscalls"]
    assert (pair.value, pair.goal, pair.met) == (62_000 / 60_000, "info", None)
    assert found["send-64x1 rmqfast-syscalls CPU per request"].value == 11.0
    assert found["send-64x1 rmqfast / best HAProxy"].value == 62_000 / 61_000  # the goal stays on rmqfast
