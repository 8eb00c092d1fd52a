"""Test ports: reserved below the ephemeral range, exclusive across processes, and a proxy whose
port was taken by another program after the reservation moves to new ports instead of failing."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
from fake_remoting import FakeNameServer

from rmqfast.testing.ports import CLUSTER_RANGE, PROXY_RANGE, ephemeral_range, is_bind_error, reserve
from rmqfast.testing.proxy import ProxyProcess


def test_ranges_lie_below_the_ephemeral_range() -> None:
    eph_lo, _ = ephemeral_range()
    assert PROXY_RANGE[1] <= CLUSTER_RANGE[0] and CLUSTER_RANGE[1] <= eph_lo, (PROXY_RANGE, CLUSTER_RANGE, eph_lo)
    with reserve(range(22)) as lease:
        assert lease.ports == list(range(lease.base, lease.base + 22))
        assert PROXY_RANGE[0] <= lease.base and lease.ports[-1] < PROXY_RANGE[1]


def test_reservations_never_share_a_port_in_one_process() -> None:
    leases = [reserve(range(22), (15000, 15300)) for _ in range(6)]  # 132 of 300 ports
    try:
        taken = [p for lease in leases for p in lease.ports]
        assert len(taken) == len(set(taken)) == 132
    finally:
        for lease in leases:
            lease.release()
    with reserve(range(22), (15000, 15300)):  # given back: room again
        pass


def test_reservations_exclude_other_processes() -> None:
    """Another process (another pytest run, the demo) holding a port keeps us off it, and its
    locks go when it exits, even without releasing."""
    code = textwrap.dedent("""
        import sys, time
        from rmqfast.testing.ports import reserve
        lease = reserve(range(10), (16000, 16010))  # the only block there is
        print(lease.base, flush=True)
        sys.stdin.read()  # hold until told
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "16000"
        with pytest.raises(RuntimeError, match="could not reserve 1 loopback ports in 16000-16010"):
            reserve([0], (16000, 16010), attempts=50)
    finally:
        child.kill()
        child.wait()
    with reserve(range(10), (16000, 16010)) as lease:
        assert lease.base == 16000


def test_a_listener_in_the_range_is_skipped() -> None:
    with reserve(range(2)) as pair:
        pass
    with socket.socket() as s:  # a program that takes no lock listens on the first of the two
        s.bind(("127.0.0.1", pair.base))
        s.listen()
        with reserve([0], (pair.base, pair.base + 2), attempts=200) as lease:
            assert lease.base == pair.base + 1


@pytest.mark.parametrize("which", ["namesrv_port", "admin_port"])
def test_proxy_moves_when_another_program_took_its_port(which: str) -> None:
    """The race the reservation cannot close: a program that knows nothing of our locks binds one
    of the proxy's ports between the reservation and the proxy's bind."""
    ns = FakeNameServer()
    squatter = socket.socket()
    try:
        proxy = ProxyProcess([f"127.0.0.1:{ns.server_address[1]}"], workers=1)
        taken = getattr(proxy, which)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with proxy:
            assert getattr(proxy, which) != taken
            assert proxy.health()["workers_alive"] == 1
            socket.create_connection(("127.0.0.1", proxy.namesrv_port), timeout=10).close()
            log = proxy.log_path.read_text()
            assert "a port was taken" in log and is_bind_error(log), log[-2000:]
    finally:
        squatter.close()
        ns.close()
