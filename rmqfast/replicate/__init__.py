"""Cross-cloud selective delivery, worker side: the copy filter, lanes and spill, metrics.

:class:`ReplicationService` is what a worker creates when ``[[clouds.remote]]`` is configured;
see :mod:`rmqfast.replicate.filter` (which sends are copied), :mod:`rmqfast.replicate.replicator`
(memory channel, spill, hand-off to the deliver process) and :mod:`rmqfast.deliver` (sending).
"""

from __future__ import annotations

import json
import logging

import gevent

from rmqfast.clouds.detector import OnlineDetector
from rmqfast.config import Config
from rmqfast.replicate.filter import ReplicateFilter
from rmqfast.replicate.replicator import Replicator

log = logging.getLogger("rmqfast.replicate")


class ReplicateMetrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.copies = Counter("rmqfast_replicate_copies_total", "Copies taken for remote clouds (one per remote)")
        self.not_copied = Counter(
            "rmqfast_replicate_not_copied_total",
            "Sends that matched a rule but were not copied, by reason (disk_full with on_disk_full=drop, "
            "copy_of_copy, spill_error)", ["reason"],
        )
        self.rejected = Counter(
            "rmqfast_replicate_rejected_total", "Sends answered SYSTEM_BUSY because the spill was full (reject)"
        )
        self.backlog_messages = Gauge(
            "rmqfast_replicate_backlog_messages", "Copies not yet delivered (memory and spill), by remote and topic",
            ["remote", "topic"], multiprocess_mode="livesum",
        )
        self.backlog_bytes = Gauge(
            "rmqfast_replicate_backlog_bytes", "Bytes of copies not yet delivered, by remote and topic",
            ["remote", "topic"], multiprocess_mode="livesum",
        )
        self.backlog_oldest = Gauge(
            "rmqfast_replicate_backlog_oldest_seconds", "Age of the oldest undelivered copy, by remote and topic",
            ["remote", "topic"], multiprocess_mode="livemax",
        )
        self.spill_messages = Gauge(
            "rmqfast_spill_messages", "Copies stored in the workers' RocksDB spills", multiprocess_mode="livesum"
        )
        self.spill_bytes = Gauge(
            "rmqfast_spill_bytes", "Bytes (keys + values) in the workers' RocksDB spills", multiprocess_mode="livesum"
        )
        self.max_loss = Gauge(
            "rmqfast_replicate_max_loss_messages",
            "Most copies a crash can lose: the in-memory channel size in fast mode, 0 in durable mode",
            multiprocess_mode="livesum",
        )
        self.fsyncs = Counter("rmqfast_spill_fsyncs_total", "Synced group commits of the spill (durable mode)")
        self.synced = Counter(
            "rmqfast_spill_synced_messages_total", "Copies written by synced group commits (divide by fsyncs)"
        )
        self.acked = Counter(
            "rmqfast_replicate_delivered_total", "Copies the deliver processes acknowledged, by outcome", ["outcome"]
        )
        self.online = Gauge(
            "rmqfast_remote_consumers_online", "1 while the remote cloud has consumers online for the topic",
            ["remote", "topic"], multiprocess_mode="livemax",
        )


class ReplicationService:
    """One worker's replication: spill, detector, filter and the metrics publisher."""

    def __init__(self, cfg: Config, index: int, *, metrics: bool = True) -> None:
        self.metrics = ReplicateMetrics() if metrics else None
        self.replicator = Replicator(cfg, index, self.metrics)
        self.detector = OnlineDetector(
            {r.name: list(r.namesrv) for r in cfg.clouds.remotes},
            [t.name for t in cfg.replicate.topics if t.replicate == "online"],
            {t.name: list(t.groups) for t in cfg.replicate.topics if t.groups},
            interval=cfg.clouds.detect_interval,
            timeout=cfg.clouds.detect_timeout,
            on_update=self._online,
            credentials={r.name: r.credentials for r in cfg.clouds.remotes if r.credentials is not None},
        )
        self.filter = ReplicateFilter(cfg, self.replicator, self.detector)
        self._detect_timeout = cfg.clouds.detect_timeout
        self._saved: dict[tuple[str, str], bool] = {}
        self._restore_online()
        self._published: set[tuple[str, str]] = set()
        self._last = (0, 0, 0, 0)
        if self.metrics is not None:
            self.metrics.max_loss.set(0 if self.replicator.durable else cfg.replicate.channel_size)

    def reconfigure(self, cfg: Config) -> None:
        """New rules apply at once; the spill and its durability stay (changing those needs a restart)."""
        self.filter = ReplicateFilter(cfg, self.replicator, self.detector)
        for t in cfg.replicate.topics:
            if t.replicate == "online":
                self.detector.interest.setdefault(t.name, 0.0)

    def _restore_online(self) -> None:
        """Start from the last answers this worker's previous run saw (kept in its spill)."""
        raw = self.replicator.store.get_meta("online")
        if not raw:
            return
        try:
            known = json.loads(raw)
        except ValueError:
            return
        remotes = set(self.detector.remotes)
        for remote, topic, online in known:
            if remote in remotes:
                self.detector.cache[(remote, topic)] = bool(online)

    def _online(self, remote: str, topic: str, online: bool) -> None:
        if self.metrics is not None:
            self.metrics.online.labels(remote, topic).set(1 if online else 0)
        if self._saved.get((remote, topic)) != online:
            self._saved[(remote, topic)] = online
            data = [[r, t, v] for (r, t), v in self.detector.cache.items()]
            self.replicator.store.put_meta("online", json.dumps(data).encode())

    def start(self) -> None:
        """Start delivering and detecting; returns after the first detection round (bounded)."""
        self.replicator.start()
        self.detector.start()
        self.detector.first_round.wait(timeout=self._detect_timeout + 0.5)
        gevent.spawn(self._loop)

    def _loop(self) -> None:
        while not self.replicator.closed:
            gevent.sleep(1.0)
            try:
                self.filter.sweep()
                self.publish()
            except Exception:
                log.exception("replication metrics publishing failed")

    def publish(self) -> None:
        m = self.metrics
        if m is None:
            return
        r = self.replicator
        backlog = r.backlog()
        for key in self._published - set(backlog):
            m.backlog_messages.labels(*key).set(0)
            m.backlog_bytes.labels(*key).set(0)
            m.backlog_oldest.labels(*key).set(0)
        for key, (n, b, age) in backlog.items():
            m.backlog_messages.labels(*key).set(n)
            m.backlog_bytes.labels(*key).set(b)
            m.backlog_oldest.labels(*key).set(age or 0)
        self._published |= set(backlog)
        m.spill_messages.set(r.store.messages)
        m.spill_bytes.set(r.store.bytes)
        st = r.store
        fs, sm, dl, gu = self._last
        m.fsyncs.inc(st.fsyncs - fs)
        m.synced.inc(st.synced_messages - sm)
        m.acked.labels("delivered").inc(r.delivered - dl)
        m.acked.labels("gave_up").inc(r.gave_up - gu)
        self._last = (st.fsyncs, st.synced_messages, r.delivered, r.gave_up)

    def close(self) -> None:
        self.detector.stop()
        self.replicator.close()


__all__ = ["ReplicateFilter", "ReplicationService", "Replicator"]
