"""The backlog watch of gray releases, run by the supervisor (one per proxy, a thread).

Every ``gray.backlog_interval`` seconds (every second while a promote or an abort is draining) it asks
the brokers for the backlog of every gray queue (:func:`rmqfast.gray.backlog.gray_backlog`: max offset
minus the group's committed offset) and

* exports it: ``rmqfast_gray_backlog_messages{group,topic,broker,queue}``, with
  ``rmqfast_gray_backlog_read_age_seconds{group}`` (since the last complete read; -1: none yet),
  ``rmqfast_gray_backlog_read_errors_total{group}`` and ``rmqfast_gray_drain{group}`` (0 no command,
  1 draining, 2 drained, 3 timed out); also ``rmqfast_gray_phase{group}``, from the command file when
  scraped (the phase every worker is in, give or take the second they take to read the file);
* ends drains.  The first complete read after a promote records each gray queue's max offset as the
  promote's marks (in the state file): the gray version keeps its queues during the drain and its
  producers keep sending to them (a tag only the gray version subscribes to is consumed by nobody
  else), so the drain cannot wait for a backlog of 0; it is over once the group's committed offsets of
  the gray queues reach the marks (everything on them when the promote was seen is consumed and
  committed), no earlier than ``settle`` after the command.  Then the promote is marked ``drained`` in
  the state file and the workers end it (:func:`rmqfast.gray.rules.phase`); past ``drain_timeout`` it
  is marked ``timeout`` with the messages below the marks not committed (the workers end it at that
  time anyway, logged as an error).  An abort's drain (normal consumers taking the gray queues after
  the settle; every send goes to a normal queue) is over at backlog 0; it is reported and changes
  nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rmqfast.gray.backlog import gray_backlog
from rmqfast.gray.rules import Phase, phase
from rmqfast.gray.state import mark_drain, read_commands, set_marks, state_path
from rmqfast.log import ctx

log = logging.getLogger("rmqfast.gray")

DRAIN_VALUE = {None: 0, "draining": 1, "drained": 2, "timeout": 3}
PHASE_VALUE = {Phase.ACTIVE: 0, Phase.PROMOTING: 1, Phase.PROMOTED: 2, Phase.ABORTING: 3, Phase.ABORTED: 4}
BUSY_INTERVAL = 1.0  # seconds between reads while a drain is under way

Backlog = Callable[[Any, list[str]], dict[str, Any]]


def behind_marks(marks: list[dict[str, Any]] | None, res: dict[str, Any]) -> int | None:
    """Messages below a promote's marks the group has not committed (None: no marks yet, or a marked
    queue not read).  A gray queue that is not marked (added after the marks) holds only later messages."""
    if marks is None:
        return None
    committed = {(r["topic"], r["broker"], r["queue"]): r["committed"] for r in res.get("queues", [])}
    left = 0
    for m in marks:
        done = committed.get((m["topic"], m["broker"], m["queue"]))
        if done is None:
            return None
        left += max(0, m["offset"] - done)
    return left


def drain_state(cmd: dict[str, Any] | None) -> str | None:
    """None (no command), ``draining``, ``drained`` or ``timeout``."""
    if cmd is None:
        return None
    return str(cmd.get("drain", "draining"))


class GrayWatch:
    """Reads the backlog, exports it and ends drains.  ``cfg()`` gives the running configuration (reloads)."""

    def __init__(self, cfg: Callable[[], Any], backlog: Backlog = gray_backlog,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.backlog = backlog
        self.clock = clock
        self._lock = threading.Lock()
        self._rows: dict[str, list[dict[str, Any]]] = {}  # group: its gray queues at the last complete read
        self._read_at: dict[str, float] = {}
        self._errors: dict[str, int] = {}
        self._drain: dict[str, str | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # One round ------------------------------------------------------------------------------------

    def step(self) -> float:
        """One read of every group; returns the seconds until the next one (0: the watch is off)."""
        c = self.cfg()
        g = c.gray
        if not g.enabled or g.backlog_interval <= 0:
            return 0.0
        path = state_path(g.state_file, c.proxy.state_dir)
        namesrvs = [str(u) for u in c.namesrv.upstreams]
        busy = False
        for grp in g.groups:
            cmd = read_commands(path).get(grp.group)
            res = self.backlog(grp, namesrvs)
            now = self.clock()
            with self._lock:
                if "error" in res:
                    self._errors[grp.group] = self._errors.get(grp.group, 0) + 1
                    log.warning("gray: backlog not read", extra=ctx(group=grp.group, error=res["error"]))
                else:
                    self._rows[grp.group] = list(res["queues"])
                    self._read_at[grp.group] = now
            if cmd is not None and "drain" not in cmd:
                busy = True
                self._end_drain(path, grp.group, cmd, res, now, g.settle, g.drain_timeout)
                cmd = read_commands(path).get(grp.group)
            with self._lock:
                self._drain[grp.group] = drain_state(cmd)
        known = {grp.group for grp in g.groups}
        with self._lock:  # groups no longer configured leave the metrics
            for d in (self._rows, self._read_at, self._errors, self._drain):
                for k in [k for k in d if k not in known]:
                    del d[k]
        return min(BUSY_INTERVAL, g.backlog_interval) if busy else g.backlog_interval

    def _end_drain(self, path: Any, group: str, cmd: dict[str, Any], res: dict[str, Any], now: float,
                   settle: float, drain_timeout: float) -> None:
        action, at = cmd["action"], cmd["at"]
        waited = now - at
        complete = "error" not in res and all(r["backlog"] is not None for r in res["queues"])
        if action == "promote":
            marks = cmd.get("marks")
            if marks is None and complete:
                # the gray version goes on consuming (and its producers sending to) the gray queues: the
                # drain is over once everything on them when the promote was seen is committed
                marks = [{"topic": r["topic"], "broker": r["broker"], "queue": r["queue"], "offset": r["max"]}
                         for r in res["queues"]]
                if set_marks(path, group, action, at, marks):
                    log.info("gray: promote seen; drain marks taken",
                             extra=ctx(group=group, marks={f"{m['broker']}:{m['topic']}:{m['queue']}": m["offset"]
                                                           for m in marks}))
            left = behind_marks(marks, res) if complete else None
        else:  # an abort's drain starts when the normal side takes the gray queues, the settle after the command
            left = res["total"] if complete else None
        if left == 0 and waited >= settle:
            if mark_drain(path, group, action, at, "drained", now, 0):
                log.info("gray: gray queues drained", extra=ctx(group=group, action=action, seconds=round(waited, 1)))
        elif waited >= drain_timeout:
            if mark_drain(path, group, action, at, "timeout", now, left):
                log.error("gray: gray queues not drained in time; the "
                          + ("promote ends with messages below its marks not committed" if action == "promote"
                             else "abort's normal consumers are still behind"),
                          extra=ctx(group=group, action=action, backlog=left, drain_timeout=drain_timeout))

    # Thread ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gray-backlog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.step()
            except Exception:  # a bad answer must not end the watch
                log.exception("gray: backlog watch round failed")
                wait = 5.0
            self._stop.wait(wait or 5.0)  # off: look again later (a reload may turn it on)

    # Metrics ----------------------------------------------------------------------------------------

    def metrics_text(self) -> bytes:
        """The watch's metrics in the Prometheus text format (appended to the workers' on /metrics)."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            rows = {g: list(r) for g, r in self._rows.items()}
            read_at = dict(self._read_at)
            errors = dict(self._errors)
            drain = dict(self._drain)
        now = self.clock()
        c = self.cfg()
        cmds = read_commands(state_path(c.gray.state_file, c.proxy.state_dir))
        ph = GaugeMetricFamily("rmqfast_gray_phase", "0 active, 1 promoting, 2 promoted, 3 aborting, 4 aborted",
                               labels=["group"])
        backlog = GaugeMetricFamily("rmqfast_gray_backlog_messages",
                                    "Messages on a gray queue not yet committed by the group (max offset - "
                                    "committed offset), at the last read", labels=["group", "topic", "broker", "queue"])
        age = GaugeMetricFamily("rmqfast_gray_backlog_read_age_seconds",
                                "Seconds since the last complete backlog read of the group (-1: none yet)",
                                labels=["group"])
        errs = CounterMetricFamily("rmqfast_gray_backlog_read_errors", "Backlog reads that failed", labels=["group"])
        dr = GaugeMetricFamily("rmqfast_gray_drain", "0 no promote/abort, 1 draining, 2 drained, 3 timed out",
                               labels=["group"])
        for g in sorted({grp.group for grp in c.gray.groups}):
            cmd = cmds.get(g)
            p = phase(cmd["action"], cmd["at"], now, c.gray.settle, cmd.get("drained_at"), c.gray.drain_timeout) \
                if cmd else Phase.ACTIVE
            ph.add_metric([g], PHASE_VALUE[p])
            for r in rows.get(g, []):
                if r["backlog"] is not None:
                    backlog.add_metric([g, r["topic"], r["broker"], str(r["queue"])], r["backlog"])
            age.add_metric([g], round(now - read_at[g], 3) if g in read_at else -1.0)
            errs.add_metric([g], errors.get(g, 0))
            dr.add_metric([g], DRAIN_VALUE.get(drain.get(g), 0))

        class _Families:
            def collect(self) -> Any:
                return [ph, backlog, age, errs, dr]

        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Families())  # type: ignore[arg-type]
        return generate_latest(reg)

    def view(self, group: str) -> dict[str, Any] | None:
        """The last read of ``group``'s backlog (for ``rmqfast gray status``)."""
        with self._lock:
            if group not in self._read_at:
                return None
            rows = list(self._rows.get(group, []))
            return {"queues": rows, "total": sum(r["backlog"] or 0 for r in rows),
                    "age": round(self.clock() - self._read_at[group], 1)}
