"""Config validation: every error names the key, the bad value and what is allowed."""

import subprocess
import sys

import pytest

from rmqfast import config
from rmqfast.cli import main
from rmqfast.errors import ConfigError

BASE = {"namesrv": {"listen": "127.0.0.1:19876", "upstreams": ["10.0.0.1:9876"]}}


def merged(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return raw


def test_defaults():
    cfg = config.from_dict(merged())
    assert cfg.namesrv.listen == config.HostPort("127.0.0.1", 19876)
    assert cfg.brokers.port_range == (30900, 30999)
    assert cfg.proxy.max_frame_size == 16 * 1024 * 1024
    assert cfg.advertise_host == "127.0.0.1"
    assert cfg.worker_count >= 1
    assert config.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    "raw,message",
    [
        (merged(proxy={"workers": -1}), "proxy.workers: -1 is not allowed; expected an integer from 0"),
        (merged(proxy={"workers": "2"}), "proxy.workers: '2' is not allowed"),
        (merged(proxy={"idle_timeout": 5}), "proxy.idle_timeout: 5 is not allowed"),
        (merged(proxy={"bogus": 1}), "proxy.bogus: unknown key; allowed here:"),
        ({"namesrv": {"listen": "127.0.0.1:1"}}, "namesrv.upstreams: [] is not allowed"),
        (
            merged(namesrv={"upstreams": ["nohost"]}),
            "namesrv.upstreams[0]: 'nohost' is not allowed; expected 'host:port'",
        ),
        (merged(namesrv={"listen": "1.2.3.4:70000"}), "the port must be from 1 to 65535"),
        (merged(brokers={"port_range": "5-3"}), "brokers.port_range: '5-3' is not allowed"),
        (merged(brokers={"port_range": "19870-19880"}), "contains port 19876 already used by namesrv.listen"),
        (
            merged(brokers={"static": [{"listen": "127.0.0.1:30000"}]}),
            "brokers.static[0]: both 'listen' and 'upstream'",
        ),
        (
            merged(brokers={"static": [{"listen": "127.0.0.1:19878", "upstream": "1.1.1.1:10911"}]}),
            "brokers.static[0].listen (VIP channel, port - 2): port 19876 is already used by namesrv.listen",
        ),
        (merged(policy={"allow_codes": ["25"]}), "policy.allow_codes[0]: '25' is not allowed"),
        (merged(log={"format": "xml"}), "log.format: 'xml' is not allowed; expected one of json, human"),
        (
            merged(namesrv={"listen": "0.0.0.0:9876"}),
            "proxy.advertise_host: required when namesrv.listen binds a wildcard",
        ),
        (merged(proxy={"max_header_size": 4096, "max_frame_size": 2048}), "must not exceed proxy.max_frame_size"),
        ({"nonsense": {}}, "nonsense: unknown key"),
    ],
)
def test_errors_name_key_value_and_allowed(raw, message):
    with pytest.raises(ConfigError) as exc:
        config.from_dict(raw)
    assert message in str(exc.value)


def test_bad_toml_file(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text("[proxy\nworkers=1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        config.load(p)
    with pytest.raises(ConfigError, match="cannot read it"):
        config.load(tmp_path / "missing.toml")


def test_flags_override_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[namesrv]\nlisten = "127.0.0.1:19876"\nupstreams = ["10.0.0.1:9876"]\n[proxy]\nworkers = 3\n')
    cfg = config.load(p, {"proxy.workers": 5, "namesrv.upstreams": ["10.0.0.2:9876", "10.0.0.3:9876"]})
    assert cfg.proxy.workers == 5
    assert [str(u) for u in cfg.namesrv.upstreams] == ["10.0.0.2:9876", "10.0.0.3:9876"]


def test_check_config_cli(tmp_path, capsys):
    p = tmp_path / "c.toml"
    p.write_text('[namesrv]\nupstreams = ["10.0.0.1:9876"]\n[proxy]\nworkers = 0\n')
    assert main(["check-config", str(p)]) == 0
    assert ": ok" in capsys.readouterr().out
    p.write_text('[namesrv]\nupstreams = ["10.0.0.1:9876"]\n[proxy]\nworkers = 999\n')
    assert main(["check-config", str(p)]) == 2
    assert "proxy.workers: 999 is not allowed" in capsys.readouterr().err


def test_broker_flag_syntax(capsys):
    assert main(["check-config", "/dev/null", "--namesrv-upstream", "10.0.0.1:9876", "--broker", "30911"]) == 2
    assert "expected LISTEN=UPSTREAM" in capsys.readouterr().err


def test_help_documents_everything():
    out = subprocess.run(
        [sys.executable, "-m", "rmqfast", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in (
        "--config",
        "--namesrv-listen",
        "--namesrv-upstream",
        "--broker",
        "--broker-port-range",
        "--workers",
        "--admin-listen",
        "SIGHUP",
    ):
        assert flag in out
