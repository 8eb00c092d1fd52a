"""Online-consumer detection: does a remote cluster have consumers online for a topic?

Asked of the remote cluster itself, over the Remoting protocol (apache/rocketmq 4.x/5.x):

1. ``GET_ROUTEINFO_BY_TOPIC`` (105) at the remote name server: the topic's master brokers;
2. the candidate groups: those named in the topic's rule (``[[replicate.topic]] groups``),
   plus what each master answers to ``QUERY_TOPIC_CONSUME_BY_WHO`` (300, header ``topic``,
   body ``{"groupList":[...]}``);
3. for each group, ``GET_CONSUMER_LIST_BY_GROUP`` (38, header ``consumerGroup``): SUCCESS
   with a non-empty ``consumerIdList`` means the group has clients connected right now
   (the broker answers SYSTEM_ERROR "no consumer for this group" otherwise).

Measured against a real RocketMQ 5.3.3 broker: code 300 does not list a group whose
consumers use the 5.3.3 Java client (its consumers are only in the broker's compensation
table, which 300 and 203 do not read, while 38 does), and lists 4.9.4-client groups only
after their first heartbeat with subscriptions.  So name the consuming groups in the rule
when you know them: 38 is a data-plane code, answered on every version (and let through by an
rmqfast in front of the remote).  Code 300 is an admin code: an rmqfast in front of the
remote refuses it unless ``policy.allow_codes = [300]``; a refusal is ignored when the rule
names groups.

Results are cached and refreshed by one background greenlet every ``interval`` seconds; the
send path only reads the cache (:meth:`OnlineDetector.online`).  A topic the detector has not
been told about is unknown (``None``) until the next refresh; topics named in the
``[[replicate.topic]]`` rules are known from the start: a worker waits (up to ``detect_timeout``)
for its first round before it serves, and starts from the answers its previous run kept in its
spill, so that a restarted worker does not skip the copies of sends it takes over (a producer's
retry after a worker crash).  When a remote cannot be asked (its
name server or brokers are down, or its name server has no route for the topic), the last
answer is kept: copies keep flowing into the spill while the remote is away, and drain when it
is back.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

import gevent
import gevent.event

from rmqfast.clouds.remoting import ConnectionPool, RemoteError, fetch_route
from rmqfast.log import ctx

log = logging.getLogger("rmqfast.clouds")

QUERY_TOPIC_CONSUME_BY_WHO = 300
GET_CONSUMER_LIST_BY_GROUP = 38


class OnlineDetector:
    def __init__(
        self,
        remotes: dict[str, list[str]],
        topics: Iterable[str] = (),
        groups: dict[str, list[str]] | None = None,
        *,
        interval: float = 2.0,
        timeout: float = 3.0,
        on_update: Callable[[str, str, bool], None] | None = None,
        credentials: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        self.remotes = remotes
        self.interval = interval
        self.timeout = timeout
        self.on_update = on_update
        self.interest: dict[str, float] = {t: time.monotonic() for t in topics}
        self.groups = groups or {}
        self.cache: dict[tuple[str, str], bool] = {}
        self.checked_at: dict[tuple[str, str], float] = {}
        self.errors: dict[str, str] = {}
        # a remote with ACL on: the questions are signed with the proxy's own credentials for it
        self.pools = {name: ConnectionPool(timeout, (credentials or {}).get(name)) for name in remotes}
        self._greenlet: gevent.Greenlet | None = None
        self.first_round = gevent.event.Event()

    def online(self, remote: str, topic: str) -> bool | None:
        """The cached answer (None: not known yet; the topic is queued for the next refresh)."""
        v = self.cache.get((remote, topic))
        if v is None and topic not in self.interest:
            self.interest[topic] = time.monotonic()
        return v

    def start(self) -> None:
        if self._greenlet is None:
            self._greenlet = gevent.spawn(self._loop)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None
        for p in self.pools.values():
            p.close()

    def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.refresh_once()
            except Exception:
                log.exception("online-consumer refresh failed")
            self.first_round.set()
            gevent.sleep(max(0.05, self.interval - (time.monotonic() - started)))

    def refresh_once(self) -> None:
        for remote, namesrvs in self.remotes.items():
            for topic in list(self.interest):
                try:
                    value = self.query(remote, namesrvs, topic)
                except RemoteError as exc:
                    if self.errors.get(remote) != str(exc):
                        log.warning(
                            "cannot ask a remote cloud for online consumers; keeping the last answer",
                            extra=ctx(remote=remote, topic=topic, error=str(exc)),
                        )
                    self.errors[remote] = str(exc)
                    continue
                self.errors.pop(remote, None)
                key = (remote, topic)
                old = self.cache.get(key)
                self.cache[key] = value
                self.checked_at[key] = time.monotonic()
                if old != value:
                    log.info("remote consumers changed", extra=ctx(remote=remote, topic=topic, online=value))
                if self.on_update is not None:
                    self.on_update(remote, topic, value)

    def query(self, remote: str, namesrvs: list[str], topic: str) -> bool:
        """True when some group consuming ``topic`` in ``remote`` has a client connected now."""
        pool = self.pools[remote]
        route = fetch_route(pool, namesrvs, topic, timeout=self.timeout)
        if route is None or not route[0]:
            # A name server drops a broker's routes the moment its connection closes: no route
            # says the brokers are away (or the topic is unknown), not that nobody consumes.
            raise RemoteError(f"{remote} has no broker serving {topic} right now")
        masters, _queues = route
        reached = 0
        last_error = ""
        known = self.groups.get(topic, [])
        for addr in masters.values():
            try:
                resp = pool.request(addr, QUERY_TOPIC_CONSUME_BY_WHO, {"topic": topic}, timeout=self.timeout)
            except RemoteError as exc:
                last_error = str(exc)
                continue
            reached += 1
            if resp.code != 0 and known:
                resp.body = b"{}"  # refused (e.g. an rmqfast in front denies admin codes): use the named groups
            elif resp.code != 0:
                raise RemoteError(
                    f"broker {addr} of {remote} refused QUERY_TOPIC_CONSUME_BY_WHO (300) for {topic}: code "
                    f"{resp.code} {resp.remark}; if an rmqfast is in front of it, allow the code there "
                    "(policy.allow_codes = [300])"
                )
            try:
                groups = json.loads(resp.body or b"{}").get("groupList") or []
            except ValueError as exc:
                raise RemoteError(f"broker {addr} answered 300 with an unreadable body: {exc}") from exc
            for group in dict.fromkeys([*known, *groups]):
                r = pool.request(addr, GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": str(group)}, timeout=self.timeout)
                if r.code == 0 and r.body:
                    try:
                        ids = json.loads(r.body).get("consumerIdList") or []
                    except ValueError:
                        ids = []
                    if ids:
                        return True
        if masters and not reached:
            raise RemoteError(f"no broker of {remote} answered for {topic}: {last_error}")
        return False
