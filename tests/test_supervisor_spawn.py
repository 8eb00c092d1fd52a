"""Children run the code the supervisor runs, and start errors name what went wrong.

Real ``rmqfast serve`` processes in front of a fake name server (tests/fake_remoting.py):

* started from a directory holding a hostile ``rmqfast/`` package, no child imports it (it
  would write a marker file) and the proxy relays;
* a supervisor whose version or codec differs from its workers' refuses them and says why;
* a listen address already in use is named in the error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fake_remoting import FakeNameServer, kv_roundtrip

from rmqfast.testing.proxy import ProxyProcess

QUERY_NOT_FOUND = 22


@pytest.fixture(scope="module")
def namesrv() -> Iterator[object]:
    srv = FakeNameServer()
    yield srv
    srv.close()


@contextmanager
def shared_port() -> Iterator[int]:
    """A port from the OS, held by a bound (not listening) SO_REUSEPORT socket for the test's
    duration: workers bind it too (same user, SO_REUSEPORT), nobody else can take it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def write_config(path: Path, namesrv_port: int, upstream: str, extra: str = "") -> Path:
    path.write_text(f"""
[proxy]
workers = 1
state_dir = "{path.parent / 'state'}"
drain_timeout = 1
[namesrv]
listen = "127.0.0.1:{namesrv_port}"
upstreams = ["{upstream}"]
[brokers]
port_range = ""
[log]
format = "json"
{extra}
""")
    return path


def run_serve(config: Path, *, patch: str = "", timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``rmqfast serve`` in a supervisor whose rmqfast was patched by ``patch`` (Python code)."""
    code = (f"import sys, rmqfast, rmqfast.codec\n{patch}\n"
            f"from rmqfast.cli import main\nsys.exit(main(['serve', '--config', {str(config)!r}]))\n")
    tmp = config.parent / "tmp"  # its own temporary directory: what it leaves there is seen
    tmp.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=config.parent, env=dict(os.environ, TMPDIR=str(tmp)))


def test_hostile_rmqfast_in_the_start_directory_is_never_imported(tmp_path: Path, namesrv) -> None:
    hostile = tmp_path / "cwd"
    marker = tmp_path / "hostile-code-ran"
    for sub in ("rmqfast", "rmqfast/server", "rmqfast/deliver"):
        (hostile / sub).mkdir(parents=True)
        (hostile / sub / "__init__.py").write_text(
            f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n")
    # the attack works against a plain `python -m` child started there (what the workers were)
    subprocess.run([sys.executable, "-m", "rmqfast.server.worker", "--help"], cwd=hostile,
                   capture_output=True, timeout=60)
    assert marker.exists(), "the test's hostile package is not importable; the test would prove nothing"
    marker.unlink()

    remote = FakeNameServer()  # a remote cloud: the supervisor also starts a deliver process
    try:
        extra = f'[[clouds.remote]]\nname = "other"\nnamesrv = ["{remote.addr}"]\n'
        with ProxyProcess([namesrv.addr], workers=2, cwd=hostile, extra_config=extra) as proxy:
            assert kv_roundtrip(proxy.namesrv_addr).code == QUERY_NOT_FOUND
            health = proxy.health()
            assert len(health["worker_pids"]) == 2 and len(health["deliver_pids"]) == 1
            for pid in health["worker_pids"] + health["deliver_pids"]:
                assert os.readlink(f"/proc/{pid}/cwd") != str(hostile)
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                assert cmdline[1] == b"-P", cmdline
    finally:
        remote.close()
    assert not marker.exists(), f"hostile code ran in: {marker.read_text()}"


@pytest.mark.parametrize("what,patch,expected", [
    ("version", "rmqfast.__version__ = '0.0.0+other'", "version: worker {version}, supervisor 0.0.0+other"),
    ("codec", "rmqfast.codec.IMPLEMENTATION = {'compiled': 'python'}.get(rmqfast.codec.IMPLEMENTATION, 'compiled')",
     "codec: worker {codec}"),
])
def test_supervisor_refuses_a_worker_that_runs_other_code(tmp_path: Path, namesrv, what: str, patch: str,
                                                          expected: str) -> None:
    import rmqfast
    import rmqfast.codec

    with shared_port() as port:
        cfg = write_config(tmp_path / "rmqfast.toml", port, namesrv.addr)
        t0 = time.monotonic()
        done = run_serve(cfg, patch=patch)
    assert done.returncode == 1, done.stderr[-3000:]
    refused = [json.loads(line) for line in done.stderr.splitlines()
               if line.startswith("{") and "worker refused" in line]
    assert refused, done.stderr[-3000:]
    assert expected.format(version=rmqfast.__version__, codec=rmqfast.codec.IMPLEMENTATION) in refused[0]["mismatch"]
    assert time.monotonic() - t0 < 50  # refused once, not restarted in a loop


def test_namesrv_listen_in_use_names_the_address(tmp_path: Path, namesrv) -> None:
    with socket.socket() as holder:  # no SO_REUSEPORT: the workers cannot share it
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_serve(write_config(tmp_path / "rmqfast.toml", port, namesrv.addr))
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr, done.stderr[-3000:]


def test_admin_listen_in_use_names_the_address(tmp_path: Path, namesrv) -> None:
    with socket.socket() as holder, shared_port() as ns_port:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = write_config(tmp_path / "rmqfast.toml", ns_port, namesrv.addr,
                           f'[admin]\nlisten = "127.0.0.1:{port}"\n')
        done = run_serve(cfg)
    assert done.returncode == 2
    assert f"admin.listen: cannot listen on 127.0.0.1:{port} (Address already in use)" in done.stderr
    # a start that failed still removes the supervisor's runtime folder (rmqfast-run-*)
    assert list((tmp_path / "tmp").iterdir()) == []
