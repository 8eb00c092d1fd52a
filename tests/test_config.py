"""Config validation: every error names the key, the bad value and what is allowed."""

import json
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
        (merged(proxy={"workers": "2"}), 'proxy.workers: "2" is not allowed'),
        (merged(proxy={"idle_timeout": 5}), "proxy.idle_timeout: 5 is not allowed"),
        (merged(proxy={"bogus": 1}), "proxy.bogus: unknown key; allowed here:"),
        ({"namesrv": {"listen": "127.0.0.1:1"}}, "namesrv.upstreams: [] is not allowed"),
        (
            merged(namesrv={"upstreams": ["nohost"]}),
            'namesrv.upstreams[0]: "nohost" is not allowed; expected "host:port"',
        ),
        (merged(namesrv={"listen": "1.2.3.4:70000"}), "the port must be from 1 to 65535"),
        (merged(brokers={"port_range": "5-3"}), 'brokers.port_range: "5-3" is not allowed'),
        (merged(brokers={"port_range": "19870-19880"}), "contains port 19876 already used by namesrv.listen"),
        (
            merged(brokers={"static": [{"listen": "127.0.0.1:30000"}]}),
            "brokers.static[0]: both 'listen' and 'upstream'",
        ),
        (
            merged(brokers={"static": [{"listen": "127.0.0.1:19878", "upstream": "1.1.1.1:10911"}]}),
            "brokers.static[0].listen (VIP channel, port - 2): port 19876 is already used by namesrv.listen",
        ),
        (merged(policy={"allow_codes": ["25"]}), 'policy.allow_codes[0]: "25" is not allowed'),
        (merged(log={"format": "xml"}), 'log.format: "xml" is not allowed; expected one of json, human'),
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


# check-config: every error at once, in TOML terms; host:port syntax; a summary on success


def test_every_error_is_reported_at_once(tmp_path, capsys):
    p = tmp_path / "c.toml"
    p.write_text(
        "[proxy]\nworkers = true\nidle_timeout = 5\nbogus = 1\n"
        '[namesrv]\nlisten = "127.0.0.1:19876"\nupstreams = ["10.0.0.1:9876", "bad host:1", "10.0.0.2"]\n'
        '[records]\nenabled = "yes"\n'
        '[[limits.rule]]\ntopic = "T"\nrate = -1\n[[limits.rule]]\ntopic = "U"\nrate = 5\n'
        '[[limits.rule]]\ntopic = "V"\nrate = -2\n'
        '[[clouds.remote]]\nname = "b"\nnamesrv = ["x:1;y:0"]\n'
    )
    assert main(["check-config", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"invalid configuration in {p} (9 errors):" in err, err
    for line in (
        "proxy.bogus: unknown key",
        "proxy.workers: true is not allowed",  # TOML's true, not Python's True
        "proxy.idle_timeout: 5 is not allowed",
        'namesrv.upstreams[1]: "bad host:1" is not allowed; "bad host" is neither an IP address nor a host name',
        'namesrv.upstreams[2]: "10.0.0.2" is not allowed; expected "host:port"',
        "limits.rule[0].rate: -1 is not allowed",
        "limits.rule[2].rate: -2 is not allowed",
        'records.enabled: "yes" is not allowed; expected true or false',
        'clouds.remote[0].namesrv[0]: "y:0" is not allowed; the port must be from 1 to 65535',
    ):
        assert f"\n  {line}" in err, (line, err)
    assert "True" not in err


def test_config_errors_carry_a_list():
    with pytest.raises(config.ConfigErrors) as exc:
        config.from_dict(merged(proxy={"workers": -1, "buffer_size": 1}, log={"level": "loud"}))
    assert [e.split(":")[0] for e in exc.value.errors] == ["proxy.workers", "proxy.buffer_size", "log.level"]
    with pytest.raises(ConfigError) as one:  # a single problem stays a plain ConfigError
        config.from_dict(merged(proxy={"workers": -1}))
    assert not isinstance(one.value, config.ConfigErrors)


@pytest.mark.parametrize("value,text", [
    (True, "true"), (False, "false"), ("x", '"x"'), (3, "3"), (1.5, "1.5"), ([1, "a", True], '[1, "a", true]'),
    ({"a": 1}, "{ a = 1 }"), ({}, "{}"), (None, "nothing"), ("é\n", '"é\\n"'),
])
def test_toml_value(value, text):
    assert config.toml_value(value) == text


@pytest.mark.parametrize("value,hosts", [
    ("10.0.0.1:9876;10.0.0.2:9876", ["10.0.0.1:9876", "10.0.0.2:9876"]),  # RocketMQ's namesrvAddr form
    (["a.example:9876;b.example:9876;", "c:9876"], ["a.example:9876", "b.example:9876", "c:9876"]),
    (["[::1]:9876", "ns_1.svc:9876"], ["[::1]:9876", "ns_1.svc:9876"]),
])
def test_upstreams_accept_rocketmq_list_form(value, hosts):
    cfg = config.from_dict(merged(namesrv={"upstreams": value}))
    assert [str(u) for u in cfg.namesrv.upstreams] == hosts


@pytest.mark.parametrize("raw,message", [
    (merged(namesrv={"listen": "127.0.0.1:1;127.0.0.1:2"}),
     'namesrv.listen: "127.0.0.1:1;127.0.0.1:2" is not allowed; one "host:port" here (RocketMQ\'s'),
    (merged(namesrv={"upstreams": ["ns..x:9876"]}), '"ns..x" is neither an IP address nor a host name'),
    (merged(namesrv={"upstreams": ["-ns:9876"]}), '"-ns" is neither an IP address nor a host name'),
    (merged(namesrv={"upstreams": ["http://ns:9876"]}), 'is neither an IP address nor a host name'),
    (merged(brokers={"static": [{"listen": "127.0.0.1:30911", "upstream": "a:1;b:2"}]}),
     "brokers.static[0].upstream:"),
])
def test_hostport_syntax(raw, message):
    with pytest.raises(ConfigError) as exc:
        config.from_dict(raw)
    assert message in str(exc.value)


def test_check_config_prints_a_summary(tmp_path, capsys):
    p = tmp_path / "c.toml"
    p.write_text('[namesrv]\nlisten = "127.0.0.1:19876"\nupstreams = "10.0.0.1:9876;10.0.0.2:9876"\n'
                 '[proxy]\nworkers = 3\n[admin]\nlisten = "127.0.0.1:19400"\ntoken = "t"\n'
                 '[[limits.rule]]\ntopic = "T"\nrate = 5\n')
    assert main(["check-config", str(p)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{p}: ok"
    assert "clients connect to 127.0.0.1:19876, relayed to 10.0.0.1:9876, 10.0.0.2:9876" in out
    assert "workers          3" in out and "limit changes need the admin.token" in out
    assert "1 rule(s)" in out and not out.lstrip().startswith("{")
    assert len(lines) < 20  # one line per part (sections that are off included)
    assert main(["check-config", str(p), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["proxy"]["workers"] == 3
