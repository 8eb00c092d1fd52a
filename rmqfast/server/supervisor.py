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
from rmqfast.deliver.pool import DeliverPool
from rmqfast.errors import ConfigError
from rmqfast.limits import create_shared, reset_slots
from rmqfast.limits import rules as limits_rules
from rmqfast.limits.rules import LimitsSection
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
        self.prom_lock = threading.Lock()  # admin threads read the files the main loop retires
        self.sel = selectors.DefaultSelector()
        self.stopping = False
        self.reload_requested = False
        self.all_ready_notified = False
        self.admin: ThreadingHTTPServer | None = None
        self.exit_code = 0
        self._ready_cache: tuple[float, bool, str] = (0.0, False, "")
        self.deliver: DeliverPool | None = None  # cross-cloud deliver processes (rmqfast.deliver)
        # send-limit buckets shared by the workers; live rule changes from the admin endpoint
        self.limits_shm = create_shared(self.runtime)
        self._limits_lock = threading.Lock()
        self._limits_update: tuple[LimitsSection, threading.Event] | None = None

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

            with self.prom_lock:  # never while an admin thread is reading the files
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

    def _reset_changed_buckets(self, old: LimitsSection, new: LimitsSection) -> None:
        before = {r[-1]: r for r in old.limiter_rules()}
        after = {r[-1]: r for r in new.limiter_rules()}
        changed = [slot for slot in set(before) | set(after) if before.get(slot) != after.get(slot)]
        if changed:
            reset_slots(self.limits_shm, changed)

    def set_limits(self, new: LimitsSection, timeout: float = 5.0) -> bool:
        """Apply new limits in every worker (called from the admin thread); True once signalled."""
        done = threading.Event()
        with self._limits_lock:
            self._limits_update = (new, done)
        return done.wait(timeout)

    def _apply_limits_update(self) -> None:
        with self._limits_lock:
            update, self._limits_update = self._limits_update, None
        if update is None:
            return
        new, done = update
        self._reset_changed_buckets(self.cfg.limits, new)
        self.cfg.limits = new
        self._write_config()
        for wp in self.state.workers.values():
            wp.proc.send_signal(signal.SIGHUP)
        log.info("limits changed over the admin endpoint", extra=ctx(rules=len(new.rules)))
        done.set()

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
        self._reset_changed_buckets(self.cfg.limits, new.limits)
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
            if self.cfg.replication_enabled:
                self.deliver = DeliverPool(
                    self.cfg.replicate.deliver_processes, self.runtime,
                    dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(self.prom_dir)), self._mark_dead,
                )
                self.deliver.start()
            for i in range(self.cfg.worker_count):
                self._spawn(i)
            deadline: float | None = None
            while True:
                for key, _ in self.sel.select(timeout=0.1):
                    self._read_status(key.data)
                self._reap()
                if self.deliver is not None:
                    self.deliver.reap()
                if self.reload_requested and not self.stopping:
                    self._reload()
                if self._limits_update is not None and not self.stopping:
                    self._apply_limits_update()
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
            if self.deliver is not None:
                self.deliver.stop()
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

    def metrics_text(self) -> bytes:
        """The workers' metrics, summed (prometheus-client multiprocess files).

        A file can vanish or still be growing while a worker dies or starts: such a read is
        retried a few times before the error goes to the caller.
        """
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        for attempt in range(3):
            try:
                with self.prom_lock:
                    reg = CollectorRegistry()
                    MultiProcessCollector(reg, path=str(self.prom_dir))
                    return generate_latest(reg)
            except (OSError, ValueError, KeyError):
                if attempt == 2:
                    raise
                time.sleep(0.05)
        raise AssertionError("unreachable")

    def limits_view(self) -> dict[str, object]:
        """The rules in force and what they admitted and rejected so far (summed over workers)."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        with self.prom_lock:
            reg = CollectorRegistry()
            MultiProcessCollector(reg, path=str(self.prom_dir))
            families = list(reg.collect())
        counts: dict[tuple[str, str], dict[str, float]] = {}
        for fam in families:
            if fam.name in ("rmqfast_limit_admitted", "rmqfast_limit_rejected", "rmqfast_limit_shaped"):
                kind = fam.name.rsplit("_", 1)[1]
                for smp in fam.samples:
                    if smp.name.endswith("_total"):
                        key = (smp.labels["topic"], smp.labels["tag"])
                        counts.setdefault(key, {})[kind] = smp.value
        sec = self.cfg.limits
        rules = []
        for r in sec.all_rules():
            key = (r.topic or "(global)", r.tag or "")
            rules.append({"topic": r.topic or "(global)", "tag": r.tag, "mode": r.mode, "rate": r.rate,
                          "burst": r.effective_burst(), "bytes_rate": r.bytes_rate,
                          "bytes_burst": r.effective_bytes_burst(),
                          "admitted": counts.get(key, {}).get("admitted", 0),
                          "rejected": counts.get(key, {}).get("rejected", 0),
                          "shaped": counts.get(key, {}).get("shaped", 0)})
        return {"rules": rules}

    def limits_write_refusal(self, authorization: str) -> tuple[int, str] | None:
        """Why a limit change over HTTP is refused (status, reason), or None when allowed."""
        token = self.cfg.admin.token
        if token:
            if authorization != f"Bearer {token}":
                return 401, "limit changes need 'Authorization: Bearer <admin.token>'"
            return None
        hp = self.cfg.admin.listen
        if hp is None or not (hp.host.startswith("127.") or hp.host in ("::1", "localhost")):
            return 403, ("the admin endpoint listens beyond loopback and admin.token is not set: limit changes "
                         "over HTTP are refused; set admin.token (then send it as a Bearer token)")
        return None

    def _start_admin(self) -> None:
        if self.cfg.admin.listen is None:
            return
        sup = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST

                    try:
                        body = sup.metrics_text()
                    except Exception as exc:  # a scrape must get an answer, not a dropped connection
                        log.exception("cannot collect metrics")
                        self._send(500, f"cannot collect metrics: {exc}\n".encode(), "text/plain")
                        return
                    self._send(200, body, CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    # Snapshot first: the main loop replaces entries while restarting workers,
                    # and list() copies the dict in one step under the GIL.
                    workers = list(sup.state.workers.values())
                    alive = sum(1 for w in workers if w.proc.poll() is None)
                    body = {"status": "ok" if alive else "down", "workers_alive": alive,
                            "worker_pids": [w.proc.pid for w in workers],
                            "restarts": sup.state.restarts,
                            "deliver_pids": sup.deliver.pids() if sup.deliver is not None else []}
                    self._send(200 if alive else 503, json.dumps(body).encode(), "application/json")
                elif path == "/readyz":
                    ok, why = sup.ready()
                    self._send(200 if ok else 503, json.dumps({"ready": ok, "reason": why}).encode(),
                               "application/json")
                elif path == "/limits":
                    self._json(200, sup.limits_view())
                else:
                    self._send(404, b'{"error": "unknown path; try /metrics, /healthz, /readyz, /limits"}',
                               "application/json")

            def do_PUT(self) -> None:  # noqa: N802
                self._change("PUT")

            def do_DELETE(self) -> None:  # noqa: N802
                self._change("DELETE")

            def _change(self, method: str) -> None:
                path, _, query = self.path.partition("?")
                if path != "/limits/rule":
                    self._json(404, {"error": f"{method} {path}: unknown path; use {method} /limits/rule"})
                    return
                refusal = sup.limits_write_refusal(self.headers.get("Authorization", ""))
                if refusal is not None:
                    self._json(refusal[0], {"error": refusal[1]})
                    return
                try:
                    if method == "PUT":
                        length = int(self.headers.get("Content-Length") or 0)
                        body = json.loads(self.rfile.read(length) or b"null")
                        new = limits_rules.upsert(sup.cfg.limits, limits_rules.parse_rule("rule", body))
                    else:
                        from urllib.parse import parse_qs

                        q = parse_qs(query)
                        topic = q.get("topic", [""])[0]
                        if not topic:
                            raise ConfigError("DELETE /limits/rule needs ?topic=NAME[&tag=TAG]")
                        new = limits_rules.remove(sup.cfg.limits, topic, q.get("tag", [None])[0])
                except (ConfigError, ValueError) as exc:
                    self._json(400, {"error": str(exc)})
                    return
                if not sup.set_limits(new):
                    self._json(503, {"error": "the supervisor did not apply the change within 5 s; retry"})
                    return
                self._json(200, sup.limits_view())

            def _json(self, code: int, body: object) -> None:
                self._send(code, json.dumps(body, indent=1).encode(), "application/json")

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
