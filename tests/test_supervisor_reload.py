"""Reloads never take the supervisor down: a bad file keeps the running configuration.

One real ``rmqfast serve`` (2 workers) in front of a fake name server; each case writes a broken
config file, sends SIGHUP, waits for the supervisor's "reload refused" log line, checks that the
supervisor and its workers still run and that the proxy still relays, then restores the file.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_remoting import FakeNameServer, kv_roundtrip

from rmqfast import config as config_mod
from rmqfast.server.supervisor import Supervisor
from rmqfast.testing.proxy import ProxyProcess

QUERY_NOT_FOUND = 22


@pytest.fixture(scope="module")
def proxy() -> Iterator[ProxyProcess]:
    ns = FakeNameServer()
    try:
        with ProxyProcess([ns.addr], workers=2) as p:
            p.good_config = p.config_path.read_bytes()  # type: ignore[attr-defined]
            yield p
    finally:
        ns.close()


def _events(proxy: ProxyProcess, msg: str) -> list[dict]:
    return [r for r in proxy.log_records() if r.get("msg") == msg]


def _wait_for(proxy: ProxyProcess, msg: str, count: int, timeout: float = 30.0) -> dict:
    """The ``count``-th log record with message ``msg`` (polled from the proxy's log file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _events(proxy, msg)
        if len(found) >= count:
            return found[count - 1]
        assert proxy.proc is not None and proxy.proc.poll() is None, proxy.log_tail()
        time.sleep(0.05)
    raise AssertionError(f"no {count}th {msg!r} within {timeout}s:\n{proxy.log_tail()}")


def _deep_toml(p: Path) -> None:
    p.write_text("[namesrv]\nupstreams = " + "[" * 20000 + "]" * 20000 + "\n")


def _missing(p: Path) -> None:
    p.unlink()


def _directory(p: Path) -> None:  # unreadable as a file (the tests run as root: chmod would not do)
    p.unlink()
    p.mkdir()


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "invalid UTF-8 in a comment": (
        lambda p: p.write_bytes(p.read_bytes() + b"\n# caf\xe9 \xff\n"), "is not valid UTF-8"),
    "deeply nested TOML": (_deep_toml, "nested too deeply"),
    "missing file": (_missing, "cannot read it"),
    "a directory instead of a file": (_directory, "cannot read it"),
    "invalid TOML": (lambda p: p.write_text("[proxy\nworkers = 1\n"), "invalid TOML"),
    "invalid value": (lambda p: p.write_text(p.read_text().replace("workers = 2", "workers = -1")),
                      "proxy.workers: -1 is not allowed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_reload_keeps_the_running_config(proxy: ProxyProcess, case: str) -> None:
    breaker, reason = CASES[case]
    assert proxy.proc is not None
    pids = sorted(proxy.worker_pids())
    refused = len(_events(proxy, "reload refused; keeping the running configuration"))
    reloaded = len(_events(proxy, "configuration reloaded"))
    breaker(proxy.config_path)
    try:
        proxy.reload()
        rec = _wait_for(proxy, "reload refused; keeping the running configuration", refused + 1)
        assert reason in rec["error"], rec
        assert proxy.proc.poll() is None
        assert sorted(proxy.worker_pids()) == pids  # no worker died or restarted
        assert kv_roundtrip(proxy.namesrv_addr).code == QUERY_NOT_FOUND
        assert proxy.get("/readyz")[0] == 200
    finally:
        if proxy.config_path.is_dir():
            shutil.rmtree(proxy.config_path)
        proxy.config_path.write_bytes(proxy.good_config)  # type: ignore[attr-defined]
    # a good file is taken again afterwards
    proxy.reload()
    _wait_for(proxy, "configuration reloaded", reloaded + 1)
    assert kv_roundtrip(proxy.namesrv_addr).code == QUERY_NOT_FOUND


def test_sighup_storm_during_bad_reloads(proxy: ProxyProcess) -> None:
    """Many SIGHUPs with a broken file: still one supervisor, the same workers, relaying."""
    assert proxy.proc is not None
    pids = sorted(proxy.worker_pids())
    refused = len(_events(proxy, "reload refused; keeping the running configuration"))
    proxy.config_path.write_bytes(b"\xff\xfe garbage")
    try:
        for _ in range(20):
            os.kill(proxy.proc.pid, signal.SIGHUP)
        _wait_for(proxy, "reload refused; keeping the running configuration", refused + 1)
        assert proxy.proc.poll() is None and sorted(proxy.worker_pids()) == pids
        assert kv_roundtrip(proxy.namesrv_addr).code == QUERY_NOT_FOUND
    finally:
        proxy.config_path.write_bytes(proxy.good_config)  # type: ignore[attr-defined]


def test_any_exception_while_loading_keeps_the_config(tmp_path: Path) -> None:
    """Not only ConfigError: whatever the loader raises, the running configuration stays."""
    cfg = config_mod.from_dict({"namesrv": {"upstreams": ["127.0.0.1:1"]},
                                "proxy": {"state_dir": str(tmp_path / "state")}})

    def broken_loader() -> config_mod.Config:
        raise RuntimeError("the loader broke")

    sup = Supervisor(cfg, broken_loader)
    try:
        sup._write_config()
        before = (sup.runtime / "config.json").read_text()
        sup.reload_requested = True
        sup._reload()
        assert sup.cfg is cfg
        assert (sup.runtime / "config.json").read_text() == before
        sup.load_config = lambda: (_ for _ in ()).throw(RecursionError("deep"))  # type: ignore[assignment]
        sup._reload()
        assert sup.cfg is cfg
    finally:
        shutil.rmtree(sup.runtime, ignore_errors=True)
