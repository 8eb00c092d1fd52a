"""systemd's notify protocol (Type=notify), against a real AF_UNIX datagram socket.

(a) ``sd_notify`` itself: the exact datagram, a path socket and an abstract one, and no socket.
(b) the real supervisor (``python -m rmqfast serve``) under NOTIFY_SOCKET: READY=1 only once the
    listeners accept connections, RELOADING=1 + READY=1 around SIGHUP (also for a config file
    that became invalid), STOPPING=1 on SIGTERM, and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rmqfast.server.supervisor import sd_notify
from rmqfast.testing.ports import is_bind_error, reserve


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: AF_UNIX socket paths are limited to 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="rmqfast-sdn-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def notify_socket(short_dir: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(short_dir / "notify.sock")
    sock.bind(path)
    sock.settimeout(5.0)
    try:
        yield sock, path
    finally:
        sock.close()


# (a) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("message", ["READY=1", "RELOADING=1", "STOPPING=1", "STATUS=draining 3 connections"])
def test_sd_notify_sends_the_exact_datagram(
    message: str, notify_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sd_notify(message) is True
    data, _ = sock.recvfrom(4096)
    assert data == message.encode()


def test_sd_notify_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"rmqfast-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)  # what systemd means by NOTIFY_SOCKET=@name
        sock.settimeout(5.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify("READY=1") is True
        data, _ = sock.recvfrom(4096)
        assert data == b"READY=1"


def test_sd_notify_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert sd_notify("READY=1") is False


def test_sd_notify_unreachable_socket_does_not_raise(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_dir / "nobody-listens.sock"))
    assert sd_notify("READY=1") is False


# (b) ------------------------------------------------------------------------------------------


def _config(ports: int, upstream: int, state: Path, log_level: str = "info") -> str:
    ns, admin, static = ports, ports + 1, ports + 4  # static endpoint at +4, its VIP channel at +2
    return f"""
[proxy]
workers = 2
drain_timeout = 2
state_dir = "{state}"

[namesrv]
listen = "127.0.0.1:{ns}"
upstreams = ["127.0.0.1:{upstream}"]

[brokers]
port_range = ""

[[brokers.static]]
listen = "127.0.0.1:{static}"
upstream = "127.0.0.1:{upstream + 2}"

[admin]
listen = "127.0.0.1:{admin}"

[log]
format = "json"
level = "{log_level}"
"""


def _recv(
    sock: socket.socket, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0, fail_on_exit: bool = True
) -> bytes | None:
    """The next datagram; if rmqfast exits first: fail, or None with ``fail_on_exit=False``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(0.2)
        try:
            return sock.recv(4096)
        except TimeoutError:
            if proc.poll() is not None:
                # The exit may race the last datagram: one more look before giving up.
                sock.settimeout(0.5)
                try:
                    return sock.recv(4096)
                except TimeoutError:
                    pass
                if not fail_on_exit:
                    return None
                pytest.fail(f"rmqfast exited ({proc.returncode}) before notifying:\n{log.read_text()[-3000:]}")
    pytest.fail(f"no notification within {timeout}s:\n{log.read_text()[-3000:]}")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_supervisor_notify_lifecycle(notify_socket: tuple[socket.socket, str], short_dir: Path) -> None:
    sock, path = notify_socket
    # A name server stand-in: /readyz needs one that answers a Remoting request.
    from fake_remoting import FakeNameServer

    upstream = FakeNameServer()
    up_port = upstream.server_address[1]
    cfg_path = short_dir / "rmqfast.toml"
    log = short_dir / "rmqfast.log"
    env = dict(os.environ, NOTIFY_SOCKET=path)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    for attempt in range(3):
        # reserved ports (below the ephemeral range, locked against our other tests); a port some
        # other program took meanwhile makes the proxy exit: then again on new ones
        lease = reserve(range(5))
        base = lease.base
        cfg_path.write_text(_config(base, up_port, short_dir / "state"))
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "rmqfast", "serve", "--config", str(cfg_path)],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        first = _recv(sock, proc, log, fail_on_exit=False)
        if first is not None or attempt == 2 or not is_bind_error(log.read_text(errors="replace")):
            break
        lease.release()
    try:
        assert first == b"READY=1", f"rmqfast exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        # READY=1 promises bound listeners: connect at once, no retry.
        for port, what in ((base, "namesrv.listen"), (base + 4, "static broker endpoint"),
                           (base + 2, "its VIP channel")):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            except OSError as exc:
                pytest.fail(f"READY=1 arrived but {what} 127.0.0.1:{port} refused a connection: {exc}")
        admin = f"http://127.0.0.1:{base + 1}"
        code, body = _get(admin + "/readyz")
        assert code == 200, f"/readyz right after READY=1: {code} {body!r}"
        health = json.loads(_get(admin + "/healthz")[1])
        assert health["workers_alive"] == 2, health

        # SIGHUP with a changed, valid file: RELOADING=1, then READY=1.
        cfg_path.write_text(_config(base, up_port, short_dir / "state", log_level="debug"))
        proc.send_signal(signal.SIGHUP)
        assert _recv(sock, proc, log) == b"RELOADING=1"
        assert _recv(sock, proc, log) == b"READY=1"

        # SIGHUP with a broken file: still RELOADING=1 then READY=1 (the running config stays).
        cfg_path.write_text("[proxy]\nworkers = -1\n")
        proc.send_signal(signal.SIGHUP)
        assert _recv(sock, proc, log) == b"RELOADING=1"
        assert _recv(sock, proc, log) == b"READY=1"
        assert proc.poll() is None, "an invalid file on reload must not stop the proxy"
        socket.create_connection(("127.0.0.1", base), timeout=2).close()

        proc.send_signal(signal.SIGTERM)
        assert _recv(sock, proc, log) == b"STOPPING=1"
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            extra = sock.recv(4096)
            pytest.fail(f"unexpected notification after STOPPING=1: {extra!r}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lease.release()
        upstream.close()
