"""A worker's feature services behind the filters: cross-cloud replication, proxy-held delay, peak
shaving, and the worker's own spill they share (one writer per RocksDB), opened at start and on
reload before the filter chains are built, and closed in order when the worker drains; the gray
filter's hand-over tick.

Functions of the worker (``w``: :class:`rmqfast.server.worker.Worker`), which keeps the services as
its attributes (``replication``, ``delay``, ``shaper``, ``own_spill``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gevent

from rmqfast.log import ctx

log = logging.getLogger("rmqfast.worker")


def spill_dir(state_dir: str | Path, index: int) -> Path:
    """``rmqfast.spill.store.worker_dir`` without importing the spill (a test keeps them equal)."""
    return Path(state_dir) / "spill" / f"worker-{index}"


def setup_replication(w: Any) -> None:
    """Cross-cloud copies (rmqfast.replicate): the service made once, reconfigured on reload."""
    from rmqfast.replicate import ReplicationService

    if getattr(w, "replication", None) is None:
        w.replication = ReplicationService(w.cfg, w.index)
    else:
        w.replication.reconfigure(w.cfg)


def setup_delay(w: Any) -> None:
    """[delay]: proxy-held delayed messages, in the worker's spill (the replicator's when there is one)."""
    if getattr(w, "delay", None) is not None:
        w.delay.reconfigure(w.cfg.delay)
        return
    w.delay = None
    repl = getattr(w, "replication", None)
    if not w.cfg.delay.enabled and repl is None and not spill_dir(w.cfg.proxy.state_dir, w.index).exists():
        return
    try:
        spill = repl.replicator.store if repl is not None else own_spill(w)
        from rmqfast.delay import open_delay

        w.delay = open_delay(w.cfg, w.index, spill)
        if w.delay is not None:  # released sends speak TLS where [tls.upstream] says so
            w.delay.releaser.pool.wrap = w.tls.wrapper("broker", w.cfg.proxy.connect_timeout)
    except Exception as exc:  # an unusable spill: delayed sends go to the broker as they are
        log.error("proxy-held delay unavailable: cannot open the spill",
                  extra=ctx(worker=w.index, error=str(exc)))
        return
    if w.delay is not None and getattr(w, "_started", False):
        w.delay.start()


def own_spill(w: Any) -> Any:
    """The worker's own spill (no replicator), opened once and shared by [delay] and the
    shaper: one writer per RocksDB (a second open of it fails on its lock)."""
    if getattr(w, "own_spill", None) is None:
        from rmqfast.spill.store import SpillStore, worker_dir  # here: ~0.6 MiB a worker without a spill skips

        rp = w.cfg.replicate
        w.own_spill = SpillStore(
            worker_dir(w.cfg.proxy.state_dir, w.index), write_buffer_bytes=rp.write_buffer_bytes,
            block_cache_bytes=rp.block_cache_bytes, disk_cap_bytes=rp.disk_cap_bytes)
    return w.own_spill


def setup_shaper(w: Any) -> None:
    """Start peak shaving when a shape rule exists or the spill may hold a shaped backlog.

    It shares the cross-cloud replicator's spill when there is one (one writer per RocksDB).
    """
    if w.limits is None or w.shaper is not None:
        return
    repl = getattr(w, "replication", None)
    if (repl is None and getattr(w, "own_spill", None) is None and not any(
            r.mode == "shape" for r in w.cfg.limits.rules)
            and not spill_dir(w.cfg.proxy.state_dir, w.index).exists()):
        return  # shaping_wanted's answer without importing the shaper and the spill (~1 MiB)
    from rmqfast.limits.shaper import Shaper, shaping_wanted

    if not shaping_wanted(w.cfg, w.index, repl.replicator.store if repl is not None
                          else getattr(w, "own_spill", None)):
        return
    try:
        shaper = Shaper(w.cfg, w.index, w.limits, metrics=w.metrics,
                        store=repl.replicator.store if repl is not None else own_spill(w),
                        committer=repl.replicator.committer if repl is not None else None)
    except Exception as exc:  # an unusable spill: shape rules answer SYSTEM_BUSY instead
        log.error("peak shaving unavailable: cannot open the spill; sends over a shape rule get SYSTEM_BUSY",
                  extra=ctx(worker=w.index, error=str(exc)))
        return
    if not shaper.needed:
        shaper.close()
        return
    w.shaper = shaper
    w.limits.shaper = shaper
    shaper.pool.wrap = w.tls.wrapper("broker", w.cfg.proxy.connect_timeout)  # [tls.upstream]
    if getattr(w, "_started", False):
        shaper.start()


def gray_loop(w: Any) -> None:
    """[gray]: phase changes seen within 0.1 s, consumers notified, held pulls answered
    (:meth:`rmqfast.filters.gray.GrayFilter.tick`)."""
    while not w.draining:
        gevent.sleep(0.1)
        gray = getattr(w, "gray", None)
        if gray is None or not w.cfg.gray.enabled:
            continue
        try:
            gray.tick(w.sessions)
        except Exception:
            log.exception("gray hand-over tick failed")


def close_services(w: Any) -> None:
    """A draining worker's records, shaper, delay, spill and replication, in that order, once
    its sessions are closed."""
    if w.records is not None:
        w.records.close()
    if w.shaper is not None:
        w.shaper.close()  # before the replicator: they may share its spill
    if getattr(w, "delay", None) is not None:
        w.delay.close()
    if getattr(w, "own_spill", None) is not None:
        w.own_spill.close()
    if getattr(w, "replication", None) is not None:
        w.replication.close()
