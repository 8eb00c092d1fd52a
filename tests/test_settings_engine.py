"""The settings engine: one declaration per field drives parsing, errors, TOML output, JSON and docs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from rmqfast import config
from rmqfast.errors import ConfigError, ConfigErrors
from rmqfast.settings import engine
from rmqfast.settings.engine import format_duration, format_size, parse_duration, parse_section, parse_size, setting
from rmqfast.settings.reference import changed, reference, replace_generated

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
NS = {"namesrv": {"upstreams": ["127.0.0.1:9876"]}}


@dataclass
class Sample:
    """A section declared only by its fields: nothing else is written for it."""

    count: int = setting(4, lo=1, hi=10, doc="how many")
    wait: float = setting(30.0, kind="duration", lo=0.25, hi=3600, doc="how long")
    room: int = setting(64 << 10, kind="size", lo=1024, hi=1 << 30, doc="how much")
    mode: str = setting("a", choices=("a", "b"), doc="which")
    on: bool = setting(False, doc="whether")


def test_one_declaration_parses_checks_and_renders() -> None:
    s = parse_section(Sample, "sample", {"count": 7, "wait": "250ms", "room": "1MiB", "mode": "b", "on": True})
    assert (s.count, s.wait, s.room, s.mode, s.on) == (7, 0.25, 1 << 20, "b", True)
    plain = parse_section(Sample, "sample", {"wait": 90, "room": 2048})  # plain numbers: seconds, bytes
    assert (plain.wait, plain.room) == (90.0, 2048)
    assert changed("sample", s) == ['sample.count = 7', 'sample.wait = "250ms"', 'sample.room = "1MiB"',
                                    'sample.mode = "b"', 'sample.on = true']
    assert changed("sample", Sample()) == []


def test_every_error_at_once_in_one_wording() -> None:
    with pytest.raises(ConfigErrors) as ei:
        parse_section(Sample, "sample", {"count": 0, "wait": "soon", "room": "64KB", "mode": "c", "on": "yes",
                                         "colour": 1})
    errors = ei.value.errors
    assert errors[0] == "sample.colour: unknown key; allowed here: count, mode, on, room, wait"
    assert errors[1:] == [
        "sample.count: 0 is not allowed; expected an integer from 1 to 10",
        'sample.wait: "soon" is not allowed; expected a duration from 250ms to 1h such as "250ms", "30s", "5m" '
        "(a plain number counts as seconds)",
        'sample.room: "64KB" is not allowed; expected a size from 1KiB to 1GiB such as "64KiB", "16MiB" '
        "(a plain number counts as bytes)",
        'sample.mode: "c" is not allowed; expected one of a, b',
        'sample.on: "yes" is not allowed; expected true or false',
    ]
    with pytest.raises(ConfigError, match=r"^sample: 3 is not allowed; expected a table$"):
        parse_section(Sample, "sample", 3)


def test_duration_and_size_style() -> None:
    assert [parse_duration("k", v) for v in ("250ms", "30s", "1.5m", "2h", "1d", 7, 0.5)] == \
        [0.25, 30.0, 90.0, 7200.0, 86400.0, 7.0, 0.5]
    assert [parse_size("k", v) for v in ("512B", "64KiB", "16MiB", "1GiB", 100)] == \
        [512, 64 << 10, 16 << 20, 1 << 30, 100]
    for bad in ("30", "30 sec", True, -1, "1e3s", float("nan")):
        with pytest.raises(ConfigError, match="^k: .* is not allowed; expected a duration"):
            parse_duration("k", bad)
    for bad in ("64kb", "1.5MiB", True, -1, 2.0):
        with pytest.raises(ConfigError, match="^k: .* is not allowed; expected a size"):
            parse_size("k", bad)
    assert [format_duration(v) for v in (30, 0.25, 7200, 90, 0)] == ["30s", "250ms", "2h", "90s", "0ms"]
    assert [format_size(v) for v in (65536, 1000, 3 << 30)] == ["64KiB", "1000B", "3GiB"]


def test_every_section_uses_the_style() -> None:
    cfg = config.from_dict({**NS, "proxy": {"idle_timeout": "5m", "max_frame_size": "8MiB", "frame_timeout": 0},
                            "records": {"rotate_seconds": "2m", "rotate_bytes": "1MiB"},
                            "grpc": {"request_timeout": "750ms", "max_body_size": "1MiB"},
                            "delay": {"max_pending_bytes": "2GiB"}})
    assert (cfg.proxy.idle_timeout, cfg.proxy.max_frame_size, cfg.proxy.frame_timeout) == (300.0, 8 << 20, 0.0)
    assert (cfg.records.rotate_seconds, cfg.records.rotate_bytes) == (120.0, 1 << 20)
    assert (cfg.grpc.request_timeout, cfg.grpc.max_body_size, cfg.delay.max_pending_bytes) == (0.75, 1 << 20, 2 << 30)
    with pytest.raises(ConfigError, match=r"proxy\.frame_timeout: 0\.5 is not allowed; expected a duration of 0 "
                                          r"\(no deadline\) or from 1s to 1h"):
        config.from_dict({**NS, "proxy": {"frame_timeout": 0.5}})


def test_json_round_trip_is_generic() -> None:
    cfg = config.from_dict({**NS, "brokers": {"static": [{"listen": "127.0.0.1:10911", "upstream": "10.0.0.1:10911"}]},
                            "delay": {"topics": ["D"], "levels": {"19": "1d"}}, "admin": {"listen": "127.0.0.1:19400"},
                            "clouds": {"remote": [{"name": "b", "namesrv": ["10.0.0.9:9876"]}]},
                            "replicate": {"topic": [{"name": "T", "remotes": ["b"]}]}})
    back = config.from_json(cfg.to_json())
    assert back == cfg and asdict(back) == asdict(cfg)
    assert back.brokers.static[0].listen.port == 10911 and back.brokers.port_range == (30900, 30999)
    assert json.loads(back.to_json()) == json.loads(cfg.to_json())


def test_core_settings_import_no_feature() -> None:
    for mod in ("engine", "base", "reference", "hostport", "cpus"):
        text = (Path(engine.__file__).parent / f"{mod}.py").read_text()
        imports = [line for line in text.splitlines() if line.startswith(("from rmqfast", "import rmqfast"))]
        assert all(line.startswith(("from rmqfast.settings", "from rmqfast.errors")) for line in imports), imports


def test_the_reference_page_is_generated_from_the_declarations() -> None:
    """Fails when docs/configuration.md is stale: run ``python -m rmqfast.checkconfig --write-reference``."""
    page = DOCS.read_text(encoding="utf-8")
    assert replace_generated(page, reference(engine.sections())) == page, \
        "docs/configuration.md is stale: run python -m rmqfast.checkconfig --write-reference"
    assert "| `first_frame_timeout` | `\"10s\"` |" in page
    with pytest.raises(ValueError, match="no generated part"):
        replace_generated("# no markers", "x")


def test_a_section_is_declared_once() -> None:
    specs = engine.sections()
    assert {"proxy", "namesrv", "brokers", "policy", "admin", "log", "records", "delay", "grpc"} <= set(specs)
    with pytest.raises(TypeError, match=r"section \[proxy\] is declared twice"):
        engine.section("proxy", "again")(Sample)


def test_environment_knobs_are_documented_as_test_aids() -> None:
    """No second, untyped configuration channel: every ``RMQFAST_*`` variable read in rmqfast/ is listed
    in docs/testing.md's table of test and comparison aids."""
    import re

    root = Path(engine.__file__).resolve().parents[1]
    used = set()
    for path in root.rglob("*.py"):
        used |= set(re.findall(r"environ(?:\.get|\.setdefault)?\(?\s*\[?[\"'](RMQFAST_[A-Z_]+)", path.read_text()))
        used |= set(re.findall(r"getenv\([\"'](RMQFAST_[A-Z_]+)", path.read_text()))
    assert {"RMQFAST_RELAY_REACTOR", "RMQFAST_URING", "RMQFAST_REACTOR_REPOLL"} <= used
    table = (DOCS.parent / "testing.md").read_text().partition("## Environment variables")[2]
    assert table, "docs/testing.md has no 'Environment variables' section"
    missing = sorted(v for v in used if f"`{v}`" not in table)
    assert not missing, f"read in rmqfast/ but not documented in docs/testing.md: {missing}"
