"""Run ``rmqfast serve`` as a real subprocess in front of a cluster (tests and the demo)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rmqfast.testing.ports import PortLease, is_bind_error, reserve


class _BindFailed(RuntimeError):
    """The proxy exited because a port it was given is in use (taken after it was reserved)."""



class ProxyProcess:
    """``rmqfast serve`` with a generated config; ``with ProxyProcess(...) as proxy: ...``.

    Ports come from :func:`rmqfast.testing.ports.reserve`: one block below the kernel's ephemeral
    range, locked against every other user of that module while this object holds it, with
    the name-server listener (``namesrv_port``), the admin endpoint (``admin_port``), the
    automatic broker endpoint range (``port_range``) and, if asked for, ``static_ports`` for
    ``[[brokers.static]]`` endpoints (each with its VIP channel port, ``p - 2``, reserved too).
    If the proxy still cannot bind one of them (another program took it), :meth:`start`
    picks a new block, rewrites the config and starts again.

    ``extra_config`` is TOML appended to the config; a callable gets this object and returns
    it, so it can name ``static_ports``, which change when the proxy is restarted on new ports.
    """

    bind_attempts = 5

    def __init__(
        self,
        namesrv_upstreams: list[str],
        *,
        workers: int = 2,
        extra_config: str | Callable[[ProxyProcess], str] = "",
        range_size: int = 20,
        static_endpoints: int = 0,
        log_format: str = "json",
        env: dict[str, str] | None = None,
        records: dict[str, Any] | None = None,
        cwd: str | Path | None = None,
        proxy_settings: str = "",
    ) -> None:
        self.cwd = cwd  # the directory `rmqfast serve` is started from (default: the caller's)
        self.proxy_settings = proxy_settings  # TOML lines for the [proxy] table (e.g. "max_connections = 10\n")
        self.workdir = Path(tempfile.mkdtemp(prefix="rmqfast-proxy-"))
        self.workers = workers
        self.range_size = range_size
        self.static_endpoints = static_endpoints
        self.namesrv_upstreams = list(namesrv_upstreams)
        self.extra_config = extra_config
        self.log_format = log_format
        self.config_path = self.workdir / "rmqfast.toml"
        #: ``records={"dir": ..., "sample_rate": ...}`` enables [records] with those keys
        self.records = records
        self.records_dir = Path(records["dir"]) if records and "dir" in records else self.workdir / "records"
        self.log_path = self.workdir / "rmqfast.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._lease: PortLease | None = None
        self.namesrv_port = self.admin_port = 0
        self.port_range = (0, 0)
        self.static_ports: list[int] = []
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Reserve a new block and write the config for it."""
        if self._lease is not None:
            self._lease.release()
        n = self.range_size
        # ns, admin, range (n), then per static endpoint: VIP channel, a gap, the endpoint
        offsets = [0, 1, *range(2, 2 + n), *range(2 + n, 2 + n + 3 * self.static_endpoints)]
        self._lease = lease = reserve(offsets)
        base = lease.base
        self.namesrv_port = base
        self.admin_port = base + 1
        self.port_range = (base + 2, base + 1 + n)
        self.static_ports = [base + 2 + n + 3 * i + 2 for i in range(self.static_endpoints)]
        self._write_config()

    def _write_config(self) -> None:
        ups = ", ".join(json.dumps(u) for u in self.namesrv_upstreams)
        records_toml = ""
        if self.records is not None:
            keys = {"enabled": True, **self.records, "dir": str(self.records_dir)}
            records_toml = "\n[records]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
        extra = self.extra_config(self) if callable(self.extra_config) else self.extra_config
        self.config_path.write_text(
            f"""
[proxy]
workers = {self.workers}
{self.proxy_settings}state_dir = "{self.workdir / 'state'}"
drain_timeout = 5

[namesrv]
listen = "127.0.0.1:{self.namesrv_port}"
upstreams = [{ups}]

[brokers]
port_range = "{self.port_range[0]}-{self.port_range[1]}"

[admin]
listen = "127.0.0.1:{self.admin_port}"

[log]
format = "{self.log_format}"
level = "info"
{records_toml}
{extra}
"""
        )

    @property
    def namesrv_addr(self) -> str:
        return f"127.0.0.1:{self.namesrv_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def argv(self) -> list[str]:
        """The command that starts the proxy (subclasses add flags)."""
        # -P: like the installed `rmqfast` script, the start directory is not on sys.path
        return [sys.executable, "-P", "-m", "rmqfast", "serve", "--config", str(self.config_path)]

    def start(self, timeout: float = 120.0) -> ProxyProcess:
        """Start and wait for /readyz; on a port another program took, again on new ports.

        ``timeout`` bounds a hang, it is no speed target: a worker took over 30 s to become ready
        at a load average of 25 on 2 cores (RocksDB, deliver processes, gevent start).
        """
        if self._lease is None:  # stopped before: its ports were given back
            self._pick_ports()
        for attempt in range(1, self.bind_attempts + 1):
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed by stop()
            self._log_offset = self._log.tell()
            # the supervisor's runtime folder (rmqfast-run-*) inside the workdir: gone with it even
            # when the proxy was killed and could not remove it itself
            tmp = self.workdir / "tmp"
            tmp.mkdir(exist_ok=True)
            env = {**os.environ, "TMPDIR": str(tmp), **(self.env or {})}
            self.proc = subprocess.Popen(self.argv(), stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
            try:
                self.wait_ready(timeout)
                return self
            except _BindFailed as exc:
                self._stop_proc()
                if attempt == self.bind_attempts:
                    raise RuntimeError(f"rmqfast could not bind its ports {self.bind_attempts} times: {exc}") from None
                with open(self.log_path, "ab") as f:
                    f.write(f"--- ProxyProcess: a port was taken ({exc}); restarting on new ports\n".encode())
                self._pick_ports()
        raise AssertionError("unreachable")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                new = self._log_since_start()
                if is_bind_error(new):
                    line = next((ln for ln in new.splitlines() if is_bind_error(ln)), "")
                    raise _BindFailed(line.strip()[:300])
                raise RuntimeError(f"rmqfast exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # short per attempt: a program squatting on the admin port accepts and never
                # answers, and the proxy's exit (a bind error) must be seen while we wait
                code, body = self.get("/readyz", timeout=min(3.0, max(0.1, deadline - time.monotonic())))
                if code == 200:
                    return
                last = body.decode()
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise RuntimeError(f"rmqfast not ready after {timeout}s ({last}):\n{self.log_tail()}")

    def _log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_offset", 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        """GET on the admin endpoint: (status, body). The timeout is generous: a loaded machine is slow."""
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
        """SIGTERM, wait (SIGKILL after ``timeout``); gives the ports back. Returns the exit code."""
        if self.proc is None:
            return 0
        self._stop_proc(timeout)
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        return self.proc.returncode

    def _stop_proc(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

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

    def __exit__(self, exc_type: object = None, *exc: object) -> None:
        self.stop()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if exc_type is not None:
            # the test failed inside the block: keep the proxy's log for the post-mortem
            # (pytest shows stderr of a failed test; CI keeps its output)
            print(f"rmqfast log kept at {self.log_path}; its last lines:\n{self.log_tail(60)}", file=sys.stderr)
            return
        shutil.rmtree(self.workdir, ignore_errors=True)
