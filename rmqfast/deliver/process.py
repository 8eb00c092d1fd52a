"""A deliver process: receives copies from workers over a Unix socket, sends them to remote clouds.

Started by the supervisor as ``python -m rmqfast.deliver.process --runtime DIR --index K``
(``replicate.deliver_processes`` of them); worker N hands its copies to deliver process
``N mod deliver_processes``.  See :mod:`rmqfast.deliver` for why the hand-off is a socket.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

import gevent
import gevent.event
from gevent import socket
from gevent.lock import Semaphore
from gevent.server import StreamServer

from rmqfast import config as config_mod
from rmqfast import log as log_mod
from rmqfast.config import Config
from rmqfast.deliver import protocol as P
from rmqfast.deliver.hold import OrderHold
from rmqfast.deliver.sender import Item, RemoteSender
from rmqfast.log import ctx
from rmqfast.spill.record import CopyRecord

log = logging.getLogger("rmqfast.deliver")


class DeliverMetrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.delivered_total = Counter(
            "rmqfast_deliver_messages_total", "Copies delivered to a remote cloud, by remote and topic",
            ["remote", "topic"],
        )
        self.retries_total = Counter("rmqfast_deliver_retries_total", "Remote send attempts that failed", ["remote"])
        self.failures_total = Counter(
            "rmqfast_deliver_failures_total", "Copies given up (the remote refused them for good)",
            ["remote", "reason"],
        )
        self.lag = Histogram(
            "rmqfast_deliver_lag_seconds", "Time from the producer's send to the remote's SUCCESS, by remote",
            ["remote"], buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600, 3600),
        )
        self.last_lag = Gauge(
            "rmqfast_deliver_last_lag_seconds", "Lag of the last delivered copy, by remote", ["remote"],
            multiprocess_mode="livemax",
        )
        self.queued = Gauge(
            "rmqfast_deliver_queued", "Copies a deliver process holds for sending, by remote", ["remote"],
            multiprocess_mode="livesum",
        )
        self.remote_up = Gauge(
            "rmqfast_remote_up", "1 when the deliver process reaches the remote cloud", ["remote"],
            multiprocess_mode="livemin",
        )
        self.order_holds = Counter(
            "rmqfast_deliver_order_holds_total",
            "Holds of the other workers' copies after a worker's link broke, by how they ended "
            "(released: its replay was handed over; timed_out: replicate.order_hold_max passed)", ["outcome"],
        )
        self.already_stored_total = Counter(
            "rmqfast_deliver_already_stored_total",
            "Copies that may have been stored without an answer and were found in the remote by UNIQ_KEY "
            "(not sent again), by remote", ["remote"],
        )
        self.parked = Gauge(
            "rmqfast_deliver_parked", "Copies a deliver process holds back while a crashed worker replays",
            multiprocess_mode="livesum",
        )

    def delivered(self, remote: str, rec: CopyRecord) -> None:
        self.delivered_total.labels(remote, rec.topic).inc()
        lag = max(0.0, time.time() - rec.created_ms / 1000)
        self.lag.labels(remote).observe(lag)
        self.last_lag.labels(remote).set(lag)

    def already_stored(self, remote: str) -> None:
        self.already_stored_total.labels(remote).inc()

    def retried(self, remote: str) -> None:
        self.retries_total.labels(remote).inc()

    def failed(self, remote: str, reason: str) -> None:
        self.failures_total.labels(remote, reason).inc()


class WorkerLink:
    """One connected worker."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = Semaphore()
        self.alive = True
        self.worker = -1
        self.lost = False  # its end was already reported to the order hold

    def send(self, data: bytes) -> None:
        if not self.alive:
            return
        try:
            with self.lock:
                self.sock.sendall(data)
        except OSError:
            self.alive = False


class Deliverer:
    def __init__(self, cfg: Config, index: int, metrics: Any = None) -> None:
        self.cfg = cfg
        self.index = index
        self.metrics = metrics
        self.links: set[WorkerLink] = set()
        rp = cfg.replicate
        self.senders = {
            r.name: RemoteSender(
                r.name, r.namesrv, cfg.clouds.local, retry_initial=rp.retry_initial, retry_max=rp.retry_max,
                timeout=cfg.clouds.detect_timeout, metrics=metrics, on_status=self._status,
                credentials=r.credentials,
            )
            for r in cfg.clouds.remotes
        }
        self.hold = OrderHold(rp.order_hold_max, lambda sender, item: sender.submit(item), metrics, index=index)
        self.path = P.socket_path(cfg.proxy.state_dir, index)
        P.check_socket_path(self.path)
        self.server: StreamServer | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        sock.listen(64)
        self.server = StreamServer(sock, self._handle)
        self.server.start()
        if self.metrics is not None:
            for name in self.senders:
                self.metrics.remote_up.labels(name).set(1)
            gevent.spawn(self._publish_loop)
        log.info("deliver process ready", extra=ctx(deliver=self.index, socket=str(self.path),
                                                  remotes=list(self.senders)))

    def _publish_loop(self) -> None:
        while True:
            gevent.sleep(1.0)
            for name, s in self.senders.items():
                self.metrics.queued.labels(name).set(s.backlog())

    def _status(self, remote: str, up: bool, error: str) -> None:
        if self.metrics is not None:
            self.metrics.remote_up.labels(remote).set(1 if up else 0)
        data = P.json_frame(P.STATUS, {"remote": remote, "up": up, "error": error})
        for link in list(self.links):
            link.send(data)

    def _handle(self, sock: socket.socket, _addr: Any) -> None:
        link = WorkerLink(sock)
        self.links.add(link)
        reader = P.FrameReader()
        try:
            for name, s in self.senders.items():
                if not s.up:
                    link.send(P.json_frame(P.STATUS, {"remote": name, "up": False, "error": "unreachable"}))
            while True:
                data = sock.recv(262144)
                if not data:
                    break
                if len(self.links) > 1:
                    self._peers_gone(link)
                for kind, payload in reader.feed(data):
                    if kind == P.COPY or kind == P.RESEND:
                        self._on_copy(link, payload, kind == P.RESEND)
                    elif kind == P.HELLO:
                        hello = json.loads(payload)
                        link.worker = int(hello.get("worker", -1))
                        replaying = bool(hello.get("replaying", False))
                        log.info("worker connected", extra=ctx(deliver=self.index, worker=link.worker,
                                                               replaying=replaying))
                        self.hold.hello(link.worker, replaying)
                    elif kind == P.REPLAYED:
                        log.info("worker replayed its spill", extra=ctx(deliver=self.index, worker=link.worker))
                        self.hold.replayed(link.worker)
        except (OSError, ValueError) as exc:
            log.warning("worker link failed", extra=ctx(deliver=self.index, worker=link.worker, error=str(exc)))
        finally:
            link.alive = False
            self.links.discard(link)
            if not link.lost:
                link.lost = True
                self.hold.lost(link.worker)
            try:
                sock.close()
            except OSError:
                pass

    def _peers_gone(self, link: WorkerLink) -> None:
        """Hold for every other worker whose link the kernel already saw close, before this
        worker's copies are admitted.  A copy this worker took after another one crashed (its
        producer moved here) reaches us after that crash; without this look, the event loop may
        serve this socket before the dead worker's end-of-file (seen on a loaded machine)."""
        poller = select.poll()
        others = {}
        for other in self.links:
            if other is not link and other.alive and other.worker >= 0 and other.worker not in self.hold.held:
                try:
                    fd = other.sock.fileno()
                except OSError:
                    continue
                if fd >= 0:
                    poller.register(fd, select.POLLRDHUP)
                    others[fd] = other
        if not others:
            return
        for fd, events in poller.poll(0):
            if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) and fd in others:
                other = others[fd]
                other.lost = True
                other.alive = False  # its copies will come again from its replacement
                self.hold.lost(other.worker)

    def _on_copy(self, link: WorkerLink, payload: bytes, maybe_stored: bool = False) -> None:
        seq, remote, raw = P.parse_copy(memoryview(payload))
        sender = self.senders.get(remote)
        if sender is None:
            log.error("copy for an unknown remote; giving it up", extra=ctx(remote=remote))
            link.send(P.ack_frame(seq, P.ACK_GAVE_UP))
            return
        try:
            rec = CopyRecord.decode(raw)
        except ValueError as exc:
            log.error("undecodable copy; giving it up", extra=ctx(remote=remote, error=str(exc)))
            link.send(P.ack_frame(seq, P.ACK_GAVE_UP))
            return
        item = Item(seq, rec, raw, lambda s, st: link.send(P.ack_frame(s, st)), lambda: link.alive,
                    maybe_stored=maybe_stored)
        self.hold.admit(link.worker, sender, item)

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for s in self.senders.values():
            s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rmqfast-deliver")
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--index", type=int, required=True)
    args = ap.parse_args(argv)
    cfg = config_mod.from_json((Path(args.runtime) / "config.json").read_text())
    log_mod.setup(cfg.log.format, cfg.log.level)
    metrics = DeliverMetrics() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None
    try:
        d = Deliverer(cfg, args.index, metrics)
        d.start()
    except Exception as exc:
        log.error("deliver process cannot start", extra=ctx(deliver=args.index, error=str(exc)))
        return 3
    done = gevent.event.Event()
    gevent.signal_handler(signal.SIGTERM, done.set)
    gevent.signal_handler(signal.SIGINT, done.set)
    done.wait()
    d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
