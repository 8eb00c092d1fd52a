"""Broker endpoint table: consistent across workers, persistent, bounded."""

from __future__ import annotations

import json

import pytest

from rmqfast import config
from rmqfast.proxy.endpoints import Endpoint, EndpointRegistry, EndpointTableError


def make_cfg(tmp_path, **brokers):
    raw = {
        "proxy": {"state_dir": str(tmp_path / "state")},
        "namesrv": {"listen": "127.0.0.1:19876", "upstreams": ["127.0.0.1:9876"]},
        "brokers": {"port_range": "31000-31010", **brokers},
    }
    return config.from_dict(raw)


class Binder:
    """Records binds; ports in ``taken`` behave like ports another program holds."""

    def __init__(self, taken=()):
        self.bound: list[Endpoint] = []
        self.taken = set(taken)

    def __call__(self, ep: Endpoint) -> None:
        if ep.listen.port in self.taken:
            raise OSError(98, "Address already in use")
        self.bound.append(ep)


def test_two_workers_agree_and_bind_vip_pairs(tmp_path):
    cfg = make_cfg(tmp_path)
    b1, b2 = Binder(), Binder()
    w1, w2 = EndpointRegistry(cfg, b1), EndpointRegistry(cfg, b2)
    a = w1.advertised("10.0.0.1:10911")
    b = w2.advertised("10.0.0.2:10911")
    assert a == "127.0.0.1:31002" and b == "127.0.0.1:31003"  # 31002-2 and 31003-2 stay in range
    assert w2.advertised("10.0.0.1:10911") == a  # w2 sees w1's allocation, allocates nothing new
    w1.refresh()
    ports1 = sorted(ep.listen.port for ep in b1.bound)
    assert ports1 == [31000, 31001, 31002, 31003]
    vip = [ep for ep in b1.bound if ep.vip]
    assert {(ep.listen.port, ep.upstream.port) for ep in vip} == {(31000, 10909), (31001, 10909)}
    assert w1.is_proxy_address(a) and not w1.is_proxy_address("10.0.0.1:10911")


def test_table_survives_restart(tmp_path):
    cfg = make_cfg(tmp_path)
    EndpointRegistry(cfg, Binder()).advertised("10.0.0.9:10911")
    fresh = Binder()
    again = EndpointRegistry(cfg, fresh)
    again.refresh()
    assert again.advertised("10.0.0.9:10911") == "127.0.0.1:31002"
    assert {ep.listen.port for ep in fresh.bound} == {31000, 31002}


def test_taken_port_is_skipped_and_range_exhaustion_is_reported(tmp_path, caplog):
    cfg = make_cfg(tmp_path, port_range="31000-31004", vip_channel=False)
    reg = EndpointRegistry(cfg, Binder(taken={31000}))
    got = [reg.advertised(f"10.0.0.{i}:10911") for i in range(1, 6)]
    assert got == ["127.0.0.1:31001", "127.0.0.1:31002", "127.0.0.1:31003", "127.0.0.1:31004", None]
    assert "exhausted" in caplog.text


def test_static_mapping_wins_and_no_range(tmp_path):
    cfg = make_cfg(tmp_path, port_range="", static=[{"listen": "127.0.0.1:32911", "upstream": "10.0.0.1:10911"}])
    reg = EndpointRegistry(cfg, Binder())
    assert reg.advertised("10.0.0.1:10911") == "127.0.0.1:32911"
    assert reg.advertised("10.0.0.2:10911") is None


def test_corrupt_table_is_a_clear_error(tmp_path):
    cfg = make_cfg(tmp_path)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "endpoints.json").write_text("{broken")
    with pytest.raises(EndpointTableError, match="fix or delete it"):
        EndpointRegistry(cfg, Binder()).refresh()
    (tmp_path / "state" / "endpoints.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(EndpointTableError, match="unknown format"):
        EndpointRegistry(cfg, Binder()).refresh()
