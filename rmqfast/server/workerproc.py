"""A worker process: its arguments, status pipe and signals around :class:`rmqfast.server.worker.Worker`.

Started by the supervisor as ``python -P -m rmqfast.server.worker --runtime DIR --index N
--status-fd FD`` (that module's ``__main__`` calls :func:`main`).  It reads the validated
configuration from ``DIR/config.json``, binds every listener with SO_REUSEPORT (all workers bind
the same ports; the kernel spreads connections), reports ``ready`` on the status pipe, and serves
until SIGTERM.

Signals: SIGTERM stops accepting, lets in-flight requests finish (bounded by
``proxy.drain_timeout``) and exits 0; SIGHUP re-reads ``config.json`` and applies it without
dropping established connections.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
from pathlib import Path

import gevent
import gevent.event

from rmqfast import config as config_mod
from rmqfast import log as log_mod
from rmqfast.log import ctx
from rmqfast.server.fdlimit import raise_nofile
from rmqfast.server.worker import Worker

log = logging.getLogger("rmqfast.worker")

EXIT_FATAL = 3  # startup failed for a reason a restart will not fix (bind error, bad state)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rmqfast-worker")
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--status-fd", type=int, default=-1)
    args = ap.parse_args(argv)
    runtime = Path(args.runtime)
    from rmqfast.metrics import light_prometheus

    light_prometheus()  # the metric classes only: a worker never serves /metrics (~6 MiB less RSS)
    cfg = config_mod.from_json((runtime / "config.json").read_text())
    log_mod.setup(cfg.log.format, cfg.log.level)
    # two descriptors per client connection: the soft limit (often 1024) would cap a worker at ~500
    raise_nofile(args.index)
    status_file = os.fdopen(args.status_fd, "w", buffering=1) if args.status_fd >= 0 else None

    def status(msg: dict) -> None:
        if status_file is not None:
            try:
                status_file.write(json.dumps(msg) + "\n")
            except OSError:
                pass

    try:
        worker = Worker(cfg, args.index, status, runtime)
        worker.start()
    except Exception as exc:  # bind errors, unreadable endpoint table...
        log.error("worker cannot start", extra=ctx(worker=args.index, error=str(exc)))
        status({"event": "fatal", "error": str(exc)})
        return EXIT_FATAL
    # [grpc]: this worker's gRPC front, a process of its own (rmqfast.grpcfront.server); it ends with
    # the worker (its lifeline pipe closes)
    grpc_front = None
    if cfg.grpc.enabled:
        from rmqfast.grpcfront.keeper import FrontKeeper

        grpc_front = FrontKeeper(runtime)
        grpc_front.start()
    done = gevent.event.Event()

    def on_term() -> None:
        gevent.spawn(lambda: (worker.drain(), done.set()))

    def on_hup() -> None:
        try:
            new = config_mod.from_json((runtime / "config.json").read_text())
        except Exception as exc:
            log.error("reload failed; keeping the running configuration", extra=ctx(error=str(exc)))
            return
        worker.reload(new)
        status({"event": "reloaded"})

    gevent.signal_handler(signal.SIGTERM, on_term)
    gevent.signal_handler(signal.SIGINT, on_term)
    gevent.signal_handler(signal.SIGHUP, on_hup)
    from rmqfast.server.spawn import identity

    # what the set-up made (modules, configuration, tables) lives as long as the worker: kept out of
    # the collector's scans, a full collection pauses the event loop only for what came since
    gc.freeze()
    # version, codec twin and package directory: the supervisor refuses a worker that differs
    status({"event": "ready", "worker_pid": os.getpid(), **identity()})
    done.wait()
    if grpc_front is not None:
        grpc_front.stop()
    return 0
