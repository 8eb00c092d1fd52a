"""Broker health as one worker sees it: probed in the background, told by the sessions.

Every real broker address a worker relays to (the upstreams of its broker endpoints) has a
prober greenlet that keeps one Remoting connection open and asks it a cheap question
(``GET_MAX_OFFSET`` of ``TBW102`` queue 0; any answer, even an error code, means the broker
process is serving) every ``failover.probe_interval`` seconds while it is up, every
``failover.probe_interval_down`` seconds while it is down.  The probe connection also watches
passively: a broker killed with ``kill -9`` closes it at once, which wakes the prober at once.

A refused probe connection marks the broker down at once; any other failure (no answer in time,
connect timeout, connection closed while asking) does so the second time running (a hung or cut-off
broker nobody sends to: about ``2 * probe_timeout``).

A hung broker that clients are sending to is seen sooner, from two witnesses that must agree: the
worker's sweep reports relayed sends that have waited ``hang_timeout`` with nothing at all read
back from the broker on their connection (:meth:`BrokerHealth.stalled`), which makes the prober
ask at once; if that probe then goes unanswered for ``hang_timeout / 2`` too (and no answer sits
unread in its socket: a worker that is itself starved of CPU has not read it yet), the broker is
down (about ``hang_timeout`` plus a sweep period after it stopped: 0.6 s by default).  A broker that is slow but alive
answers the probe (it is served by another thread pool of the broker than sends): one witness is
never enough.
Sessions add what they see, off the send path, as hints (:meth:`BrokerHealth.suspect`): a failed
upstream connect, an upstream connection that ended, a moved send that failed make the prober ask
again now; only the prober decides (one slow connect on a loaded machine must not cut every client
of a healthy broker).  :meth:`BrokerHealth.connect_failed` marks a broker down at once.  A broker
comes back only through a successful probe.

The proxy's own starvation is never taken for the broker's (issue 30, finding 5): probe deadlines
are measured in the time the worker's event loop actually ran (:mod:`rmqfast.proxy.looplag`), not
in wall time, so a probe answered in time while the worker was held is not a failure; a probe that
failed only by the wall clock, or for the proxy's own lack of descriptors (EMFILE, ENFILE, ENOBUFS),
proves nothing either way and is asked again (``rmqfast_probes_discounted_total``).

The tracker never blocks a caller: every question is a dict lookup, every report an
``Event.set``.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import select
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import gevent
from gevent import monkey
from gevent.event import Event

from rmqfast.errors import ConfigError
from rmqfast.log import ctx
from rmqfast.proxy.looplag import LoopLag
from rmqfast.settings.base import toml_value
from rmqfast.settings.engine import parse_section, section, setting

log = logging.getLogger("rmqfast.health")

_poll = monkey.get_original("select", "poll")  # the real poll(2), also in a monkey-patched process

#: Request code of the probe: GET_MAX_OFFSET (30) answers from memory, needs no body.
PROBE_CODE = 30
#: connect errors that are the proxy's own shortage (descriptors, buffers), never the broker's
_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: the probe request's own deadline, as a multiple of ``probe_timeout`` (the prober enforces
#: ``probe_timeout`` itself, in the time the loop ran; this only bounds a lost request)
_ASK_SLACK = 4


RESEND_MODES = ("policy", "all", "off")


def _patterns(key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise ConfigError(f"{key}: {toml_value(value)} is not allowed; expected a list of topic names or patterns "
                          "(fnmatch)")
    return list(value)


def _secs(default: float, doc: str) -> Any:
    return setting(default, kind="duration", lo=0.01, hi=600, doc=doc)


@section("failover", "Broker health, route healing and send failover.")
@dataclass
class FailoverSection:
    """``[failover]``: broker health, route healing and send failover."""

    enabled: bool = setting(True, doc="health probes, route healing and moving sends off a dead broker")
    heal_routes: bool = setting(True, doc="route answers (105) mark a dead master's queues unwritable")
    probe_interval: float = _secs(1.0, "between probes of a broker that is up")
    probe_interval_down: float = _secs(0.2, "... of a broker that is down")
    probe_timeout: float = _secs(1.0, "a probe not answered within this time fails")
    hang_timeout: float = _secs(0.5, "relayed sends unanswered this long with nothing read back (a probe: half): hung")
    send_timeout: float = _secs(3.0, "a moved send waits this long for the other broker's answer")
    ordered_topics: list[str] = setting(factory=list, parse=_patterns, expect="a list of topic names or patterns "
                                        "(fnmatch)", doc="topics whose sends are never moved: their order matters")
    ordered_property: str = setting("__SHARDINGKEY", doc='sends carrying this property are ordered; "" disables')
    go_away: bool = setting(True, doc="draining workers answer 5.3.2+ clients GO_AWAY (1500) instead of cutting them")
    resend: str = setting("policy", choices=RESEND_MODES, doc='sends in flight when their broker dies: "policy" '
                          '(those Python holds anyway) resent, "all" (leaves the fast path), "off" (SYSTEM_ERROR)')

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FailoverSection:
        return cls(**d)

    def is_ordered_topic(self, topic: str) -> bool:
        return any(fnmatch.fnmatchcase(topic, p) for p in self.ordered_topics)


def parse_failover(raw: Any) -> FailoverSection:
    """The ``[failover]`` table, checked; every problem named at once."""
    return parse_section(FailoverSection, "failover", raw)


class HealthMetrics:
    """Prometheus objects of broker health and failover (created once per worker)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.broker_up = Gauge(
            "rmqfast_broker_up", "1 while the broker answers this worker's probes, 0 while it is seen dead",
            ["broker"], multiprocess_mode="livemin",
        )
        self.broker_down_events = Counter(
            "rmqfast_broker_down_total", "Times a broker was seen dead (probe failed or connect refused)", ["broker"],
        )
        self.failovers = Counter(
            "rmqfast_failovers_total", "Sends that could not reach their broker and were moved to another master",
            ["broker", "to"],
        )
        self.failover_refused = Counter(
            "rmqfast_failover_refused_total",
            "Sends to a dead broker answered with a retryable error instead of being moved, by reason",
            ["broker", "reason"],
        )
        self.possible_duplicates = Counter(
            "rmqfast_failover_possible_duplicates_total",
            "Moved sends that had already been written to the dying broker (may be stored twice)", ["broker"],
        )
        self.resent = Counter(
            "rmqfast_failover_resent_total",
            "Sends in flight when their broker died, resent by rmqfast to another master (answered with its result)",
            ["broker"],
        )
        self.route_heals = Counter(
            "rmqfast_route_heals_total", "Route answers in which a dead master's queues were marked unwritable",
            ["broker"],
        )
        self.go_away = Counter(
            "rmqfast_go_away_total", "Requests answered GO_AWAY (1500) by a draining worker", ["role"],
        )
        self.probes_discounted = Counter(
            "rmqfast_probes_discounted_total",
            "Failed probes not counted against a broker: the worker's own loop lag (loop_lag) or lack of "
            "descriptors (local_shortage)",
            ["broker", "reason"],
        )


Prober = Callable[[str, float], Any]


class _Watch:
    __slots__ = ("addr", "up", "since", "wake", "greenlet", "conn", "fails", "refused", "back", "stall", "stall_at")

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.up = True  # optimistic until the first probe or session says otherwise
        self.since = time.monotonic()
        self.wake = Event()
        self.greenlet: Any = None
        self.conn: Any = None
        self.fails = 0
        self.refused = False  # down because connecting was refused (nothing listens), not hung
        self.back = Event()  # set while up
        self.back.set()
        self.stall = 0.0  # seconds relayed sends had waited with nothing read back, as last reported
        self.stall_at = 0.0  # when (monotonic)


class BrokerHealth:
    """Up/down state of real broker addresses ("host:port"), for one worker."""

    def __init__(
        self,
        cfg: FailoverSection | None = None,
        metrics: HealthMetrics | None = None,
        *,
        connect: Callable[[str, float], Any] | None = None,
        lag: LoopLag | None = None,
    ) -> None:
        self.cfg = cfg or FailoverSection()
        self._lag = lag  # the worker's; else one of its own, started with the first prober
        self.metrics = metrics
        self._connect = connect or _default_connect
        self._watches: dict[str, _Watch] = {}
        self._listeners: list[Callable[[str, bool], None]] = []
        self.changed = Event()  # set at every state change (then cleared by the next waiter)
        self.closed = False

    # Questions (never block) -------------------------------------------------------------------

    def is_down(self, addr: str) -> bool:
        w = self._watches.get(addr)
        return w is not None and not w.up

    def down(self) -> set[str]:
        return {a for a, w in self._watches.items() if not w.up}

    def known(self) -> list[str]:
        return list(self._watches)

    def down_for(self, addr: str, now: float | None = None) -> float:
        w = self._watches.get(addr)
        if w is None or w.up:
            return 0.0
        return (now if now is not None else time.monotonic()) - w.since

    # Reports --------------------------------------------------------------------------------------

    def watch(self, addrs: Iterable[str]) -> None:
        """Probe these addresses from now on (idempotent)."""
        for a in addrs:
            if a not in self._watches and not self.closed:
                if self._lag is None:
                    self._lag = self._own_lag = LoopLag()
                w = self._watches[a] = _Watch(a)
                if self.metrics is not None:
                    self.metrics.broker_up.labels(a).set(1)
                w.greenlet = gevent.spawn(self._probe_loop, w)

    def connect_failed(self, addr: str, reason: str) -> None:
        """A session could not connect to ``addr`` (refused, timed out): down at once."""
        self.watch([addr])
        self._set(self._watches[addr], False, reason)
        self._watches[addr].wake.set()

    def suspect(self, addr: str, reason: str) -> None:
        """A session lost its connection to ``addr`` with requests in flight: probe it now."""
        w = self._watches.get(addr)
        if w is None:
            self.watch([addr])
            w = self._watches[addr]
        log.info("broker suspected; probing now", extra=ctx(broker=addr, reason=reason))
        w.wake.set()

    def stalled(self, addr: str, waited: float, now: float | None = None) -> None:
        """Relayed sends to ``addr`` have waited ``waited`` seconds with nothing read back from the
        broker on their connections (the worker's sweep, a few times a second while it lasts).
        Past ``hang_timeout / 2`` the prober asks now; it decides (see the module docstring)."""
        w = self._watches.get(addr)
        if w is None or not w.up:
            return
        w.stall = waited
        w.stall_at = time.monotonic() if now is None else now
        if waited >= self.cfg.hang_timeout / 2 and not w.wake.is_set():
            w.wake.set()

    def report_stalls(self, stalls: dict[str, float], now: float | None = None) -> None:
        """One sweep's findings (address -> seconds, see :meth:`stalled`): a broker not named has no
        stalled send now (an earlier report of it no longer counts)."""
        now = time.monotonic() if now is None else now
        for addr, w in self._watches.items():
            waited = stalls.get(addr, 0.0)
            if waited > 0.0 or w.stall > 0.0:
                self.stalled(addr, waited, now)

    def still_down(self, addr: str) -> bool:
        """Is ``addr`` still down, asked for a new client of it? A broker seen dead because its port
        refused connections (killed) is back as soon as something listens there again, possibly
        before the next probe: try a connect, and if it is accepted, probe at once and wait for
        the answer (at most ``probe_timeout``). A hung broker (connections accepted, requests
        unanswered) is left to the probes, as a connect proves nothing about it."""
        w = self._watches.get(addr)
        if w is None or w.up:
            return False
        if not w.refused or self.closed:
            return True
        host, _, port = addr.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=self.cfg.probe_timeout).close()
        except OSError:
            return True
        w.wake.set()
        w.back.wait(timeout=self.cfg.probe_timeout)
        return not w.up

    def on_change(self, fn: Callable[[str, bool], None]) -> None:
        """``fn(addr, up)`` after every change of state."""
        self._listeners.append(fn)

    def close(self) -> None:
        self.closed = True
        own = getattr(self, "_own_lag", None)
        if own is not None:
            own.close()
        for w in self._watches.values():
            if w.greenlet is not None:
                w.greenlet.kill(block=False)
            if w.conn is not None:
                w.conn.close()

    # Internals --------------------------------------------------------------------------------------

    def _set(self, w: _Watch, up: bool, reason: str) -> None:
        if w.up == up:
            return
        was = time.monotonic() - w.since
        w.up = up
        w.since = time.monotonic()
        w.refused = not up and "refused" in reason.lower()
        (w.back.set if up else w.back.clear)()
        if up:
            log.warning("broker is back", extra=ctx(broker=w.addr, down_seconds=round(was, 3)))
        else:
            log.warning("broker seen dead", extra=ctx(broker=w.addr, reason=reason))
        if self.metrics is not None:
            self.metrics.broker_up.labels(w.addr).set(1 if up else 0)
            if not up:
                self.metrics.broker_down_events.labels(w.addr).inc()
        self.changed.set()
        for fn in list(self._listeners):
            try:
                fn(w.addr, up)
            except Exception:
                log.exception("health listener failed")

    def _probe_once(self, w: _Watch) -> tuple[bool | None, str, bool]:
        """(answered, why not, hung): a refused or closed connection, or no answer within
        probe_timeout; hung: no answer within ``hang_timeout / 2`` while relayed sends are stalled.
        Deadlines count the time the worker's loop ran (``self._lag``); answered is None when the
        probe proves nothing (it failed only by the wall clock, or for the proxy's own shortage)."""
        timeout = self.cfg.probe_timeout
        lag = self._lag
        assert lag is not None  # made by watch()
        mark = lag.mark()
        try:
            if w.conn is None or w.conn.closed:
                w.conn = self._connect(w.addr, timeout)
                reader = getattr(w.conn, "_reader", None)
                if reader is not None:  # the connection closing (kill -9) wakes the prober at once
                    reader.link(lambda _g, wake=w.wake: wake.set())
            mark = lag.mark()  # the answer's deadline starts with the question
            asking = gevent.spawn(_ask, w.conn, timeout * _ASK_SLACK)
            while not asking.ready():
                asking.join(timeout=0.05)
                if asking.ready():
                    break
                ran = lag.ran_since(mark)
                if self._hung(w, ran):
                    asking.kill(block=False)
                    w.conn.close()
                    w.conn = None
                    return False, (f"probe unanswered for {ran:.2f} s and relayed sends unanswered for "
                                   f"{w.stall:.2f} s with nothing read back (hung)"), True
                if ran >= timeout and not _readable(getattr(w.conn, "sock", None)):
                    asking.kill(block=False)
                    raise _Unanswered(f"{w.addr} did not answer the probe within {timeout:.1f} s")
            error = asking.get()
            if error is not None:
                raise error
            return True, "", False
        except Exception as exc:  # RemoteError, OSError: the broker does not serve
            if w.conn is not None:
                w.conn.close()
                w.conn = None
            if local_shortage(exc):
                return None, f"local_shortage: {exc}", False
            if _timed_out(exc) and lag.ran_since(mark) < timeout:
                return None, f"loop_lag: {exc}", False  # late by the wall clock only: the worker was held
            return False, str(exc), False

    def _hung(self, w: _Watch, probe_waited: float) -> bool:
        """Do both witnesses say the broker is hung (see the module docstring)?"""
        hang = self.cfg.hang_timeout
        # the sweep's last report counts while fresh (a sweep of a worker short of CPU comes late)
        if probe_waited < hang / 2 or w.stall < hang or time.monotonic() - w.stall_at > max(1.0, 2 * hang):
            return False
        sock = getattr(w.conn, "sock", None)
        return sock is None or not _readable(sock)

    def _probe_loop(self, w: _Watch) -> None:
        while not self.closed:
            w.wake.clear()
            ok, reason, hung = self._probe_once(w)
            if ok is None:  # proves nothing about the broker: asked again soon, counts neither way
                why = reason.partition(":")[0]
                log.info("probe failure not counted against the broker",
                         extra=ctx(broker=w.addr, reason=reason))
                if self.metrics is not None:
                    self.metrics.probes_discounted.labels(w.addr, why).inc()
                w.wake.wait(timeout=self.cfg.probe_interval_down)
                continue
            if ok:
                w.fails = 0
                self._set(w, True, "")
            else:
                w.fails += 1
                # a broker that does not answer in time twice running is hung (or cut off); one slow
                # answer on a loaded machine is not enough to move its clients away, unless relayed
                # sends are stalled too (hung)
                if w.fails >= 2 or hung or "refused" in reason.lower():
                    self._set(w, False, f"probe failed: {reason}")
            # a failed probe is asked again soon, whatever the state: a hang is confirmed (or not) quickly
            interval = self.cfg.probe_interval if w.up and w.fails == 0 else self.cfg.probe_interval_down
            w.wake.wait(timeout=interval)


class _Unanswered(Exception):
    """The probe had no answer within ``probe_timeout`` of the worker's running time."""


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes (a RemoteError says why with the OSError under it)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _errno_of(exc: BaseException) -> int | None:
    return next((e.errno for e in _chain(exc) if isinstance(e, OSError) and e.errno), None)


def local_shortage(exc: BaseException) -> bool:
    """Did ``exc`` (or what caused it) come from the proxy's own lack of descriptors or buffers
    (EMFILE, ENFILE, ENOBUFS, ENOMEM)?  Such a failure says nothing about the broker."""
    return _errno_of(exc) in _SHORTAGE


def _timed_out(exc: BaseException) -> bool:
    """A deadline passed (connect, or the request's own); not a refused or closed connection."""
    return any(isinstance(e, TimeoutError | gevent.Timeout) or "did not answer" in str(e) for e in _chain(exc))


def _ask(conn: Any, timeout: float) -> Exception | None:
    """One probe on ``conn``: None once answered (any code), else the error (a greenlet's own)."""
    try:
        conn.request(PROBE_CODE, {"topic": "TBW102", "queueId": "0"}, timeout=timeout)
        return None
    except Exception as exc:  # RemoteError, OSError
        return exc


def _readable(sock: Any) -> bool:
    """Bytes (an answer) wait unread in ``sock``'s receive buffer: asked of the kernel, not of gevent."""
    if sock is None:
        return False
    try:
        poller = _poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return False


def _default_connect(addr: str, timeout: float) -> Any:
    from rmqfast.clouds.remoting import Connection

    return Connection(addr, connect_timeout=timeout)
