"""Run ``rmqfast serve`` as a real subprocess in front of a cluster (tests and the demo)."""

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
from pathlib import Path
from typing import Any


def free_port_block(count: int, start: int = 33000, end: int = 40000) -> int:
    """First port p in [start, end) such that p .. p+count-1 are all free on 127.0.0.1."""
    p = start + (os.getpid() * 37) % 3000
    tried = 0
    while tried < end - start:
        if p + count >= end:
            p = start
        ok = True
        for q in range(p, p + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
        p += count
        tried += count
    raise RuntimeError(f"no block of {count} free ports in {start}-{end}")


class ProxyProcess:
    """``rmqfast serve`` with a generated config; ``with ProxyProcess(...) as proxy: ...``.

    Ports: a block of free loopback ports holds the name-server listener, the admin endpoint
    and the automatic broker endpoint range.
    """

    def __init__(
        self,
        namesrv_upstreams: list[str],
        *,
        workers: int = 2,
        extra_config: str = "",
        range_size: int = 20,
        log_format: str = "json",
        env: dict[str, str] | None = None,
        records: dict[str, Any] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.cwd = cwd  # the directory `rmqfast serve` is started from (default: the caller's)
        self.workdir = Path(tempfile.mkdtemp(prefix="rmqfast-proxy-"))
        base = free_port_block(range_size + 2)
        self.namesrv_port = base
        self.admin_port = base + 1
        self.port_range = (base + 2, base + 1 + range_size)
        self.config_path = self.workdir / "rmqfast.toml"
        ups = ", ".join(json.dumps(u) for u in namesrv_upstreams)
        #: ``records={"dir": ..., "sample_rate": ...}`` enables [records] with those keys
        self.records_dir = Path(records["dir"]) if records and "dir" in records else self.workdir / "records"
        records_toml = ""
        if records is not None:
            keys = {"enabled": True, **records, "dir": str(self.records_dir)}
            records_toml = "\n[records]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
        self.config_path.write_text(
            f"""
[proxy]
workers = {workers}
state_dir = "{self.workdir / 'state'}"
drain_timeout = 5

[namesrv]
listen = "127.0.0.1:{self.namesrv_port}"
upstreams = [{ups}]

[brokers]
port_range = "{self.port_range[0]}-{self.port_range[1]}"

[admin]
listen = "127.0.0.1:{self.admin_port}"

[log]
format = "{log_format}"
level = "info"
{records_toml}
{extra_config}
"""
        )
        self.log_path = self.workdir / "rmqfast.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def namesrv_addr(self) -> str:
        return f"127.0.0.1:{self.namesrv_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout: float = 30.0) -> ProxyProcess:
        self._log = open(self.log_path, "ab")
        env = dict(os.environ, **(self.env or {}))
        # -P: like the installed `rmqfast` script, the start directory is not on sys.path
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "rmqfast", "serve", "--config", str(self.config_path)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
        )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"rmqfast exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                code, body = self.get("/readyz")
                if code == 200:
                    return
                last = body.decode()
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise RuntimeError(f"rmqfast not ready after {timeout}s ({last}):\n{self.log_tail()}")

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.admin_url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Scrape /metrics over HTTP and parse the exposition into {(name, labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        code, body = self.get("/metrics")
        if code != 200:
            raise RuntimeError(f"/metrics answered {code}")
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def health(self) -> dict[str, Any]:
        return json.loads(self.get("/healthz")[1])

    def worker_pids(self) -> list[int]:
        return list(self.health()["worker_pids"])

    def reload(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
