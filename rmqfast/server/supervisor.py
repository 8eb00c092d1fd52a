"""The supervisor: starts N worker processes, restarts the ones that die, serves /metrics.

Theory of operation
-------------------
* ``run()`` validates the configuration, writes it to ``<runtime>/config.json`` and starts
  ``workers`` processes (``python -P -m rmqfast.server.worker`` in the private runtime
  directory, importing exactly the supervisor's ``rmqfast``: see :mod:`rmqfast.server.spawn`).
  Each worker binds every listening port itself with SO_REUSEPORT, so there is no accept
  hand-off between processes.
* Each worker has a status pipe: it writes ``ready`` once its listeners are bound (or
  ``fatal`` if it cannot start, which stops the whole proxy: a restart would not help).  The
  ready message carries the worker's rmqfast version, codec twin and package directory; a
  worker that differs from the supervisor is refused (killed, logged, the proxy stops).
* A worker that exits is restarted at once (the loop polls every 0.1 s); the others keep
  serving.  Its Prometheus files are kept (counters stay correct), its live gauges dropped.
* SIGTERM/SIGINT: forward SIGTERM, wait for workers to drain (``proxy.drain_timeout`` + 5 s),
  kill what is left, exit 0.  SIGHUP: re-read and validate the config file, rewrite
  ``config.json`` and forward SIGHUP.  A reload that fails for any reason (unreadable file,
  invalid UTF-8 or TOML, nesting too deep, an invalid value, a full disk) is logged and the
  running configuration kept: no input takes the supervisor down.
* The admin HTTP endpoint lives in :mod:`rmqfast.server.admin`; this class is its backend.
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
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rmqfast.config import Config
from rmqfast.errors import ConfigError
from rmqfast.limits import create_shared, reset_changed
from rmqfast.limits.rules import LimitsSection
from rmqfast.log import ctx
from rmqfast.proxy.tls import probe_tls
from rmqfast.server.admin import AdminServer
from rmqfast.server.deliverpool import DeliverPool
from rmqfast.server.probe import ProbeResult, probe_remoting
from rmqfast.server.spawn import child_command, child_cwd, child_env, identity_mismatch

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
    refused: str = ""  # why the supervisor refused it (version or codec differs)
    # listen address -> why this worker cannot accept there now (descriptors, bind), as it reported
    blocked: dict[str, str] = field(default_factory=dict)


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


READY_PROBE_TIMEOUT = 1.0  # one Remoting round trip per upstream name server
READY_CACHE_SECONDS = 2.0


def absolute_paths(cfg: Config) -> Config:
    """Make the config's relative paths absolute (children run in another working directory)."""
    cfg.proxy.state_dir = os.path.abspath(cfg.proxy.state_dir)
    cfg.records.dir = os.path.abspath(cfg.records.dir)
    return cfg


class _LimitChange:
    """One admin limit change waiting for the main loop, and what became of it."""

    def __init__(self, change: Callable[[LimitsSection], LimitsSection]) -> None:
        self.change = change
        self.done = threading.Event()
        self.applied = False
        self.error: BaseException | None = None


class Supervisor:
    def __init__(self, cfg: Config, load_config: Callable[[], Config]) -> None:
        self.cfg = absolute_paths(cfg)
        self.load_config = load_config
        self.state = SupervisorState()
        self.runtime = Path(tempfile.mkdtemp(prefix="rmqfast-run-"))  # removed by run() or close()
        try:  # whatever fails here leaves no folder behind
            self.prom_dir = self.runtime / "prometheus"
            self.prom_dir.mkdir()
            self.prom_lock = threading.Lock()  # admin threads read the files the main loop retires
            self.sel = selectors.DefaultSelector()
            self.stopping = False
            self.reload_requested = False
            self.all_ready_notified = False
            self.admin: AdminServer | None = None
            self.exit_code = 0
            self._ready_cache: tuple[float, bool, str, dict[str, str]] = (0.0, False, "", {})
            self._ready_lock = threading.Lock()  # one probe round at a time; the others read its result
            self.deliver: DeliverPool | None = None  # cross-cloud deliver processes (rmqfast.deliver)
            # send-limit buckets shared by the workers; live rule changes from the admin endpoint
            self.limits_shm = create_shared(self.runtime)
            self._limits_lock = threading.Lock()
            self._limit_changes: list[_LimitChange] = []  # admin changes the main loop applies next, in order
            from rmqfast.gray.watch import GrayWatch

            self.gray_watch = GrayWatch(lambda: self.cfg)  # [gray]: backlog metric, ends drains (rmqfast.gray.watch)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the private runtime folder (``run()`` does it on its way out; for a supervisor
        that is never run, such as the tests' in-process ones)."""
        shutil.rmtree(self.runtime, ignore_errors=True)

    # Workers ----------------------------------------------------------------------------------

    def _write_config(self) -> None:
        tmp = self.runtime / "config.json.tmp"
        tmp.write_text(self.cfg.to_json())
        os.replace(tmp, self.runtime / "config.json")

    def _spawn(self, index: int) -> None:
        r, w = os.pipe()
        env = child_env(dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(self.prom_dir)))
        cmd = child_command("rmqfast.server.worker", "--runtime", str(self.runtime),
                            "--index", str(index), "--status-fd", str(w))
        try:
            proc = subprocess.Popen(cmd, pass_fds=(w,), env=env, cwd=child_cwd(self.runtime))
        except BaseException:
            os.close(r)
            os.close(w)
            raise
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
            if not isinstance(msg, dict):
                continue
            if msg.get("event") == "ready":
                why = identity_mismatch(msg)
                if why:
                    wp.refused = why
                    log.error("worker refused: it does not run the supervisor's rmqfast; stopping the proxy "
                              "(reinstall rmqfast so that one version and one codec build are installed)",
                              extra=ctx(worker=wp.index, worker_pid=wp.proc.pid, mismatch=why))
                    wp.proc.kill()
                    continue
                wp.ready = True
            elif msg.get("event") == "fatal":
                wp.fatal = str(msg.get("error", ""))
            elif msg.get("event") == "listeners":  # a listener cannot accept, or can again (/readyz)
                blocked = msg.get("blocked")
                if isinstance(blocked, dict):
                    wp.blocked = {str(k): str(v) for k, v in blocked.items()}

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
            if wp.refused:
                self.exit_code = 1
                self.stop()
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
        reset_changed(self.limits_shm, old, new)  # buckets of unchanged rules keep their state

    def set_limits(self, new: LimitsSection, timeout: float = 5.0) -> bool:
        """Apply new limits in every worker (called from the admin thread); True once signalled."""
        return self.change_limits(lambda _cur: new, timeout)

    def change_limits(self, change: Callable[[LimitsSection], LimitsSection], timeout: float = 5.0) -> bool:
        """``change(limits in force)`` applied in every worker; True once signalled, False when the
        main loop did not get to it within ``timeout`` (it is applied when it does) or could not
        write the workers' configuration.  Raises what ``change`` raised (a bad rule).

        The main loop computes it from the limits in force when it applies it, after a reload
        that came first and after the changes queued before it: concurrent PUTs all end up in
        force, and a reload's rules are never undone by a change computed before it.
        """
        item = _LimitChange(change)
        with self._limits_lock:
            self._limit_changes.append(item)
        if not item.done.wait(timeout):
            return False
        if item.error is not None:
            raise item.error
        return item.applied

    def _apply_limits_update(self) -> None:
        with self._limits_lock:
            items, self._limit_changes = self._limit_changes, []
        if not items:
            return
        old = new = self.cfg.limits
        good: list[_LimitChange] = []
        for item in items:
            try:
                new = item.change(new)
            except Exception as exc:  # a bad rule (ConfigError...): its request answers 400
                item.error = exc
                item.done.set()
                continue
            good.append(item)
        if not good:
            return
        try:
            self.cfg.limits = new
            self._write_config()
        except Exception as exc:  # e.g. a full disk: keep the limits in force
            self.cfg.limits = old
            log.error("limit change not applied: cannot write the workers' configuration",
                      extra=ctx(error=f"{type(exc).__name__}: {exc}"))
            for item in good:
                item.done.set()  # applied stays False: the request answers 503
            return
        self._reset_changed_buckets(old, new)
        self._signal_workers(signal.SIGHUP)
        log.info("limits changed over the admin endpoint", extra=ctx(rules=len(new.rules), changes=len(good)))
        for item in good:
            item.applied = True
            item.done.set()

    def _signal_workers(self, sig: int) -> None:
        for wp in list(self.state.workers.values()):
            try:
                wp.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def _reload(self) -> None:
        self.reload_requested = False
        sd_notify("RELOADING=1")
        old = self.cfg
        try:
            new = absolute_paths(self.load_config())
            new.limits.inherit_slots(old.limits)  # unchanged rules keep their buckets (rmqfast.limits.rules)
            self.cfg = new
            self._write_config()
        except Exception as exc:  # whatever is wrong with the file (or the disk), the proxy keeps running
            self.cfg = old
            try:
                self._write_config()  # the workers keep (or get back) the running configuration
            except Exception:
                pass
            reason = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            log.error("reload refused; keeping the running configuration", extra=ctx(error=reason))
            sd_notify("READY=1")
            return
        if new.worker_count != old.worker_count:
            log.warning("proxy.workers changes need a restart; keeping the current worker count")
        self._reset_changed_buckets(old.limits, new.limits)
        if self.admin is not None:
            self.admin.set_allowed_hosts(new.admin.allowed_hosts)
        self._signal_workers(signal.SIGHUP)
        log.info("configuration reloaded")
        sd_notify("READY=1")

    def _step(self) -> None:
        for key, _ in self.sel.select(timeout=0.1):
            self._read_status(key.data)
        self._reap()
        if self.deliver is not None:
            self.deliver.reap()
        if self.reload_requested and not self.stopping:
            self._reload()
        if self._limit_changes and not self.stopping:
            self._apply_limits_update()
        if not self.all_ready_notified and self.state.workers and all(
            w.ready for w in self.state.workers.values()
        ):
            self.all_ready_notified = True
            sd_notify("READY=1")
            log.info("proxy ready", extra=ctx(workers=len(self.state.workers),
                                             namesrv=str(self.cfg.namesrv.listen)))

    def run(self) -> int:
        prev: dict[int, Any] = {}
        try:  # the finally below also removes the runtime folder when the start itself fails
            self._write_config()
            self._start_admin()
            self.gray_watch.start()
            prev = {
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: self.stop()),
                signal.SIGINT: signal.signal(signal.SIGINT, lambda *_: self.stop()),
                signal.SIGHUP: signal.signal(signal.SIGHUP, lambda *_: setattr(self, "reload_requested", True)),
            }
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
                try:
                    self._step()
                except Exception:  # a bug in one step must not leave the workers unsupervised
                    log.exception("supervisor step failed; continuing")
                    time.sleep(0.1)
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
            self.gray_watch.stop()
            if self.admin is not None:
                self.admin.shutdown()
            self.close()
        log.info("proxy stopped", extra=ctx(exit_code=self.exit_code))
        return self.exit_code


    # Admin HTTP backend (rmqfast.server.admin.AdminBackend) ------------------------------------

    def _start_admin(self) -> None:
        if self.cfg.admin.listen is None:
            return
        self.admin = AdminServer(self.cfg.admin.listen, self, self.cfg.admin.allowed_hosts)
        self.admin.start()

    def admin_token(self) -> str:
        return self.cfg.admin.token

    def health(self) -> tuple[bool, dict[str, Any]]:
        # Snapshot first: the main loop replaces entries while restarting workers,
        # and list() copies the dict in one step under the GIL.
        workers = list(self.state.workers.values())
        alive = sum(1 for w in workers if w.proc.poll() is None)
        return bool(alive), {"status": "ok" if alive else "down", "workers_alive": alive,
                             "worker_pids": [w.proc.pid for w in workers],
                             "restarts": self.state.restarts,
                             "deliver_pids": self.deliver.pids() if self.deliver is not None else []}

    def ready(self) -> tuple[bool, str]:
        """Ready when every worker has bound its listeners and a name server answers Remoting.

        Each upstream name server gets one Remoting round trip (:mod:`rmqfast.server.probe`),
        all at once, at most every ``READY_CACHE_SECONDS`` whatever the number of callers: the
        probes run in the admin thread, never in a worker.
        """
        if self.stopping:
            return False, "stopping"
        workers = list(self.state.workers.values())
        if not workers or not all(w.ready for w in workers):
            return False, f"{sum(w.ready for w in workers)}/{self.cfg.worker_count} workers ready"
        blocked = [f"worker {w.index}: {why}" for w in workers for why in sorted(w.blocked.values())]
        if blocked:  # not cached: true again as soon as the worker says it accepts again
            return False, "cannot accept: " + "; ".join(blocked)
        with self._ready_lock:
            t, ok, why, _ = self._ready_cache
            if time.monotonic() - t < READY_CACHE_SECONDS:
                return ok, why
            ups = list(self.cfg.namesrv.upstreams)
            tls = probe_tls(self.cfg.tls)  # None unless name servers are reached over TLS
            with ThreadPoolExecutor(max_workers=min(8, len(ups))) as pool:
                results: list[ProbeResult] = list(
                    pool.map(lambda hp: probe_remoting(hp.host, hp.port, READY_PROBE_TIMEOUT, tls), ups))
            detail = {str(hp): ("ok: " if r.ok else "failed: ") + r.detail for hp, r in zip(ups, results, strict=True)}
            if any(r.ok for r in results):
                ok, why = True, "ok"
            else:
                ok, why = False, "no name server answers Remoting: " + "; ".join(
                    f"{hp}: {r.detail}" for hp, r in zip(ups, results, strict=True))
            self._ready_cache = (time.monotonic(), ok, why, detail)
            return ok, why

    def ready_detail(self) -> dict[str, Any]:
        """The last probe of each upstream name server (for /readyz's body)."""
        return {"upstreams": dict(self._ready_cache[3])}

    def metrics_text(self) -> bytes:
        """The workers' metrics, summed (prometheus-client multiprocess files).

        A file can vanish, be empty (just created by a worker starting) or still be growing while
        a worker dies or starts: empty files are left out (they hold nothing yet) and a failed read
        is retried a few times before the error goes to the caller.
        """
        from prometheus_client import generate_latest

        for attempt in range(5):
            try:
                with self.prom_lock:
                    text = generate_latest(_PromFiles(self.prom_dir))  # type: ignore[arg-type]
                if self.cfg.gray.enabled:  # the gray backlog, read by the supervisor's watch
                    text += self.gray_watch.metrics_text()
                return text
            except (OSError, ValueError, KeyError, struct.error):
                if attempt == 4:
                    raise
                time.sleep(0.05)
        raise AssertionError("unreachable")

    def limits_view(self) -> dict[str, Any]:
        """The rules in force and what they admitted and rejected so far (summed over workers)."""
        with self.prom_lock:
            families = list(_PromFiles(self.prom_dir).collect())
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


class _PromFiles:
    """A collector over the multiprocess files of a folder, leaving out empty ones."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def collect(self) -> Any:
        from prometheus_client.multiprocess import MultiProcessCollector

        files = []
        for f in sorted(self.folder.glob("*.db")):
            try:
                if f.stat().st_size >= 8:
                    files.append(str(f))
            except OSError:
                continue  # gone since the listing
        return MultiProcessCollector.merge(files, accumulate=True)
