"""The supervisor: starts N worker processes, restarts the ones that die, serves /metrics.

Theory of operation
-------------------
* ``run()`` validates the configuration, writes it to ``<runtime>/config.json`` and starts
  ``workers`` processes (``python -m rmqfast.server.worker``).  Each worker binds every
  listening port itself with SO_REUSEPORT, so there is no accept hand-off between processes.
* Each worker has a status pipe: it writes ``ready`` once its listeners are bound (or
  ``fatal`` if it cannot start, which stops the whole proxy: a restart would not help).
* A worker that exits is restarted at once (the loop polls every 0.1 s); the others keep
  serving.  Its Prometheus files are kept (counters stay correct), its live gauges dropped.
* SIGTERM/SIGINT: forward SIGTERM, wait for workers to drain (``proxy.drain_timeout`` + 5 s),
  kill what is left, exit 0.  SIGHUP: re-read and validate the config file (an invalid file
  is logged and ignored), rewrite ``config.json`` and forward SIGHUP.
* When ``NOTIFY_SOCKET`` is set (systemd ``Type=notify``) it sends ``READY=1`` once every
  worker is ready, ``RELOADING=1``/``READY=1`` around reloads and ``STOPPING=1``.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rmqfast.config import Config
from rmqfast.errors import ConfigError
from rmqfast.log import ctx

log = logging.getLogger("rmqfast.supervisor")


@dataclass
class WorkerProc:
    index: int
    proc: subprocess.Popen
    status_r: int
    started: float
    ready: bool = False
    buf: bytes = b""
    fatal: str = ""


@dataclass
class SupervisorState:
    workers: dict[int, WorkerProc] = field(default_factory=dict)
    restarts: int = 0


def sd_notify(message: str) -> bool:
    """Send a systemd notification (``READY=1``...); False when not under systemd or it failed.

    A notification that cannot be delivered is logged, never raised: the proxy keeps serving.
    """
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    target = "\0" + addr[1:] if addr.startswith("@") else addr
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(target)
            s.sendall(message.encode())
    except OSError as exc:
        log.warning("systemd notification failed", extra=ctx(notify_socket=addr, message=message, error=str(exc)))
        return False
    return True


class Supervisor:
    def __init__(self, cfg: Config, load_config: Callable[[], Config]) -> None:
        self.cfg = cfg
        self.load_config = load_config
        self.state = SupervisorState()
        self.runtime = Path(tempfile.mkdtemp(prefix="rmqfast-run-"))
        self.prom_dir = self.runtime / "prometheus"
        self.prom_dir.mkdir()
        self.sel = selectors.DefaultSelector()
        self.stopping = False
        self.reload_requested = False
        self.all_ready_notified = False
        self.admin: ThreadingHTTPServer | None = None
        self.exit_code = 0
        self._ready_cache: tuple[float, bool, str] = (0.0, False, "")

    # Workers ----------------------------------------------------------------------------------

    def _write_config(self) -> None:
        tmp = self.runtime / "config.json.tmp"
        tmp.write_text(self.cfg.to_json())
        os.replace(tmp, self.runtime / "config.json")

    def _spawn(self, index: int) -> None:
        r, w = os.pipe()
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(self.prom_dir))
        cmd = [sys.executable, "-m", "rmqfast.server.worker", "--runtime", str(self.runtime),
               "--index", str(index), "--status-fd", str(w)]
        proc = subprocess.Popen(cmd, pass_fds=(w,), env=env)
        os.close(w)
        os.set_blocking(r, False)
        wp = WorkerProc(index, proc, r, time.monotonic())
        self.state.workers[index] = wp
        self.sel.register(r, selectors.EVENT_READ, wp)
        log.info("worker started", extra=ctx(worker=index, worker_pid=proc.pid))

    def _read_status(self, wp: WorkerProc) -> None:
        try:
            chunk = os.read(wp.status_r, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(wp.status_r)
            os.close(wp.status_r)
            wp.status_r = -1
            return
        wp.buf += chunk
        while b"\n" in wp.buf:
            line, wp.buf = wp.buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == "ready":
                wp.ready = True
            elif msg.get("event") == "fatal":
                wp.fatal = str(msg.get("error", ""))

    def _reap(self) -> None:
        for index, wp in list(self.state.workers.items()):
            code = wp.proc.poll()
            if code is None:
                continue
            # Read whatever it said last (a fatal start error) before closing its pipe.
            if wp.status_r >= 0:
                self._read_status(wp)
                if wp.status_r >= 0:
                    self.sel.unregister(wp.status_r)
                    os.close(wp.status_r)
            self._mark_dead(wp.proc.pid)
            del self.state.workers[index]
            if self.stopping:
                continue
            if wp.fatal and not wp.ready:
                log.error("worker cannot start; stopping the proxy", extra=ctx(worker=index, error=wp.fatal))
                self.exit_code = 1
                self.stop()
                continue
            log.warning("worker died; restarting it", extra=ctx(worker=index, exit_code=code, worker_pid=wp.proc.pid))
            self.state.restarts += 1
            self._spawn(index)

    def _mark_dead(self, pid: int) -> None:
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, str(self.prom_dir))
        except Exception:  # metrics must never stop the supervisor
            log.exception("could not retire a dead worker's metrics")

    # Control ------------------------------------------------------------------------------------

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        sd_notify("STOPPING=1")
        for wp in self.state.workers.values():
            try:
                wp.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _reload(self) -> None:
        self.reload_requested = False
        sd_notify("RELOADING=1")
        try:
            new = self.load_config()
        except ConfigError as exc:
            log.error("reload refused: invalid configuration; keeping the running one", extra=ctx(error=str(exc)))
            sd_notify("READY=1")
            return
        if new.worker_count != self.cfg.worker_count:
            log.warning("proxy.workers changes need a restart; keeping the current worker count")
        self.cfg = new
        self._write_config()
        for wp in self.state.workers.values():
            wp.proc.send_signal(signal.SIGHUP)
        log.info("configuration reloaded")
        sd_notify("READY=1")

    def run(self) -> int:
        self._write_config()
        self._start_admin()
        prev = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: self.stop()),
            signal.SIGINT: signal.signal(signal.SIGINT, lambda *_: self.stop()),
            signal.SIGHUP: signal.signal(signal.SIGHUP, lambda *_: setattr(self, "reload_requested", True)),
        }
        try:
            for i in range(self.cfg.worker_count):
                self._spawn(i)
            deadline: float | None = None
            while True:
                for key, _ in self.sel.select(timeout=0.1):
                    self._read_status(key.data)
                self._reap()
                if self.reload_requested and not self.stopping:
                    self._reload()
                if not self.all_ready_notified and self.state.workers and all(
                    w.ready for w in self.state.workers.values()
                ):
                    self.all_ready_notified = True
                    sd_notify("READY=1")
                    log.info("proxy ready", extra=ctx(workers=len(self.state.workers),
                                                     namesrv=str(self.cfg.namesrv.listen)))
                if self.stopping:
                    if deadline is None:
                        deadline = time.monotonic() + self.cfg.proxy.drain_timeout + 5
                    if not self.state.workers:
                        break
                    if time.monotonic() > deadline:
                        for wp in self.state.workers.values():
                            wp.proc.kill()
        finally:
            # Whatever ended the loop, no worker may outlive its supervisor (they hold the ports).
            for wp in list(self.state.workers.values()):
                if wp.proc.poll() is None:
                    wp.proc.kill()
                    wp.proc.wait()
            for sig, handler in prev.items():
                signal.signal(sig, handler)
            if self.admin is not None:
                self.admin.shutdown()
            shutil.rmtree(self.runtime, ignore_errors=True)
        log.info("proxy stopped", extra=ctx(exit_code=self.exit_code))
        return self.exit_code

    # Admin HTTP ---------------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        """Ready when every worker has bound its listeners and a name server is reachable."""
        if self.stopping:
            return False, "stopping"
        workers = list(self.state.workers.values())
        if not workers or not all(w.ready for w in workers):
            return False, f"{sum(w.ready for w in workers)}/{self.cfg.worker_count} workers ready"
        now = time.monotonic()
        t, ok, why = self._ready_cache
        if now - t < 2.0:
            return ok, why
        errors = []
        for hp in self.cfg.namesrv.upstreams:
            try:
                socket.create_connection((hp.host, hp.port), timeout=1.0).close()
                self._ready_cache = (now, True, "ok")
                return True, "ok"
            except OSError as exc:
                errors.append(f"{hp}: {exc.strerror or exc}")
        why = "no name server reachable: " + "; ".join(errors)
        self._ready_cache = (now, False, why)
        return False, why

    def _start_admin(self) -> None:
        if self.cfg.admin.listen is None:
            return
        sup = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
                    from prometheus_client.multiprocess import MultiProcessCollector

                    reg = CollectorRegistry()
                    MultiProcessCollector(reg, path=str(sup.prom_dir))
                    self._send(200, generate_latest(reg), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    # Snapshot first: the main loop replaces entries while restarting workers,
                    # and list() copies the dict in one step under the GIL.
                    workers = list(sup.state.workers.values())
                    alive = sum(1 for w in workers if w.proc.poll() is None)
                    body = {"status": "ok" if alive else "down", "workers_alive": alive,
                            "worker_pids": [w.proc.pid for w in workers],
                            "restarts": sup.state.restarts}
                    self._send(200 if alive else 503, json.dumps(body).encode(), "application/json")
                elif path == "/readyz":
                    ok, why = sup.ready()
                    self._send(200 if ok else 503, json.dumps({"ready": ok, "reason": why}).encode(),
                               "application/json")
                else:
                    self._send(404, b'{"error": "unknown path; try /metrics, /healthz, /readyz"}',
                               "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        hp = self.cfg.admin.listen
        try:
            self.admin = ThreadingHTTPServer((hp.host, hp.port), Handler)
        except OSError as exc:
            raise ConfigError(f"admin.listen: cannot bind {hp} ({exc.strerror or exc})") from None
        self.admin.daemon_threads = True
        threading.Thread(target=self.admin.serve_forever, name="admin-http", daemon=True).start()
        log.info("admin endpoint listening", extra=ctx(admin=str(hp)))
