"""``rmqfast check-config``: FILE or --config FILE, a line for every section that is on, the admin
codes denied and allowed (the preset included), hints that fit the field they are about."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rmqfast import config
from rmqfast.cli import main
from rmqfast.codec import admincodes
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.errors import ConfigError
from rmqfast.filters.api import Frame, Kind
from rmqfast.filters.deny import DenyAdminCodes, deny_hint

#: a read-only admin code (brokerStatus, clusterList)
GET_BROKER_RUNTIME_INFO = admincodes.READ_ONLY_BROKER["GET_BROKER_RUNTIME_INFO"]

BASE = '[namesrv]\nlisten = "127.0.0.1:19876"\nupstreams = ["10.0.0.1:9876"]\n'

EVERYTHING = BASE + """
[policy]
preset = "read-only-admin"
allow_codes = [25]
deny_codes = [28]
[delay]
topics = ["Delayed*"]
[[gray.group]]
group = "G"
topics = ["T"]
clients = ["10.1.*"]
[grpc]
enabled = true
listen = "127.0.0.1:18081"
[[clouds.remote]]
name = "remote-b"
namesrv = ["10.9.0.1:9876"]
[failover]
enabled = true
[[limits.rule]]
topic = "T"
rate = 5
[admin]
listen = "127.0.0.1:19400"
allowed_hosts = ["proxy.example"]
[acl]
unsigned = "deny"
[acl.topics]
AK1 = ["T"]
"""


def _lines(out: str) -> dict[str, str]:
    """The summary's rows, by their name (the two-space gap separates name and text)."""
    rows = {}
    for ln in out.splitlines()[1:]:
        name, _, text = ln.strip().partition("  ")
        rows[name] = text.strip()
    return rows


def test_config_flag_works_as_help_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(BASE)
    assert main(["check-config", "--config", str(p)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{p}: ok"
    assert main(["check-config", "-c", str(p)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{p}: ok"
    assert main(["check-config", str(p)]) == 0  # the positional form stays
    assert capsys.readouterr().out.splitlines()[0] == f"{p}: ok"
    assert main(["check-config", str(p), "--config", str(p)]) == 0  # the same file twice is one file
    capsys.readouterr()
    other = tmp_path / "other.toml"
    assert main(["check-config", str(p), "--config", str(other)]) == 2
    assert "two config files given" in capsys.readouterr().err


def test_config_flag_in_a_real_process(tmp_path: Path) -> None:
    """As an operator types it: the error 'required: FILE' is gone."""
    p = tmp_path / "c.toml"
    p.write_text(BASE)
    r = subprocess.run([sys.executable, "-m", "rmqfast", "check-config", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{p}: ok")
    helptext = subprocess.run([sys.executable, "-m", "rmqfast", "check-config", "--help"],
                              capture_output=True, text=True, timeout=60).stdout
    assert "--config FILE" in helptext and "FILE or --config FILE" in helptext.replace("\n", " ")


def test_every_enabled_section_has_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(EVERYTHING)
    assert main(["check-config", "--config", str(p)]) == 0
    rows = _lines(capsys.readouterr().out)
    assert rows["delay"].startswith("held by rmqfast for Delayed*")
    assert rows["gray releases"].startswith("1 group(s): G (1 topic(s)")
    assert rows["gRPC front"].startswith("RocketMQ 5 gRPC clients on 127.0.0.1:18081")
    assert rows["cross-cloud"].startswith("fast, to remote-b")
    assert rows["broker failover"].startswith("probes every")
    assert rows["send limits"] == "1 rule(s)"
    assert rows["admin endpoint"].startswith("http://127.0.0.1:19400/") and "proxy.example" in rows["admin endpoint"]
    assert rows["topic allowlist"].startswith("1 AccessKey(s) listed; unsigned requests: deny")
    assert rows["TLS"] and rows["addresses"].startswith("route answers point at rmqfast")


def test_sections_that_are_off_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(BASE)
    assert main(["check-config", str(p)]) == 0
    rows = _lines(capsys.readouterr().out)
    for name in ("delay", "gray releases", "gRPC front", "cross-cloud", "topic allowlist",
                 "traffic records", "admin endpoint"):
        assert rows[name].startswith("off"), (name, rows[name])
    assert rows["send limits"] == "none"


def test_policy_line_names_the_preset_and_what_is_denied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(EVERYTHING)
    assert main(["check-config", str(p)]) == 0
    policy = _lines(capsys.readouterr().out)["policy"]
    n_broker = len(admincodes.preset_codes("read-only-admin", "broker"))
    assert f'policy.preset = "read-only-admin": {n_broker} read-only broker' in policy
    assert "every other admin code denied" in policy
    assert "also allowed: 25" in policy and "denied whatever else says: 28" in policy
    assert "every admin code denied (" not in policy  # the old line, wrong with the preset on

    p.write_text(BASE)
    assert main(["check-config", str(p)]) == 0
    policy = _lines(capsys.readouterr().out)["policy"]
    assert policy.startswith("data-plane codes pass") and "every admin code denied" in policy


@pytest.mark.parametrize("key_toml,hint,not_hint", [
    ('[namesrv]\nlisten = "127.0.0.1:19876"\nupstreams = [":9876"]\n',
     'write the address of a real RocketMQ name server, e.g. "10.0.0.1:9876"', "0.0.0.0:9876"),
    ('[namesrv]\nlisten = ":9876"\nupstreams = ["10.0.0.1:9876"]\n',
     'where to listen: "0.0.0.0:9876" for every address', "name server"),
    (BASE + '[[brokers.static]]\nlisten = "127.0.0.1:30911"\nupstream = ":10911"\n',
     'write the address of the real broker, e.g. "10.0.0.1:10911"', "for every address"),
])
def test_missing_host_hint_fits_the_field(key_toml: str, hint: str, not_hint: str, tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(key_toml)
    with pytest.raises(ConfigError) as exc:
        config.load(p)
    assert hint in str(exc.value) and not_hint not in str(exc.value)


def _refusal_remark(f: DenyAdminCodes, code: int) -> str:
    data = encode(RemotingCommand(code=code, opaque=7, body=b"x=1"))
    frame = Frame(data, code, 0, 7)
    v = f.on_request(SimpleNamespace(client_addr="c", upstream_addr="u", role="broker", state={}), frame)
    assert v is not None and v.kind is Kind.REPLY
    answer = decode_frame(v.data)
    assert answer.code == C.NO_PERMISSION and answer.opaque == 7
    return answer.remark or ""


def test_refused_admin_code_remark_names_preset_and_allow_codes() -> None:
    """Without the preset the remark says how to let the read-only codes through; with it, that this
    code is not one of them; both name policy.allow_codes."""
    off = _refusal_remark(DenyAdminCodes(C.BROKER_DATA_PLANE_CODES), GET_BROKER_RUNTIME_INFO)
    assert 'policy.preset = "read-only-admin"' in off and "policy.allow_codes" in off
    assert str(GET_BROKER_RUNTIME_INFO) in off
    preset = admincodes.preset_codes("read-only-admin", "broker")
    on_filter = DenyAdminCodes(C.BROKER_DATA_PLANE_CODES, preset, preset="read-only-admin")
    on = _refusal_remark(on_filter, C.UPDATE_BROKER_CONFIG)
    assert 'policy.preset = "read-only-admin"' in on and "not one of them" in on and "policy.allow_codes" in on
    assert on_filter.on_request(SimpleNamespace(client_addr="c", upstream_addr="u", role="broker", state={}),
                                Frame(b"", GET_BROKER_RUNTIME_INFO, 0, 8)) is None  # read-only: passes
    denied = DenyAdminCodes(C.BROKER_DATA_PLANE_CODES, preset, deny=[GET_BROKER_RUNTIME_INFO],
                            preset="read-only-admin")
    assert "listed in policy.deny_codes" in _refusal_remark(denied, GET_BROKER_RUNTIME_INFO)
    assert deny_hint("read-only-admin") in on
