"""Gray (canary) releases inside one consumer group (real RocketMQ 5.3.3, two masters; real Java 5.3.3
and 4.9.4 push consumers and producers through rmqfast with ``[gray]``).

One consumer group: two normal consumers (client 5 and 4) and two gray ones (instance names
``canary-*``, client 5 and 4).  Three producers send continuously: a normal one (client 5), a gray one by
producer group (``pg-canary``, client 4) and a gray one by user property (``gray=true``, client 5).  The
topic has 4 queues on each broker; the last one of each is gray.  Phases, each paced by acknowledged
sends and by consumption: running canary, abort mid-traffic, back to a canary, promote mid-traffic, back
to a canary, ``kill -9`` of both gray consumers (normal consumers take the gray queues after the grace
period).  Every acknowledged message is checked: consumed (lost = 0), by which side, and how often.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from itutil import BOUND, unique, wait_until

from rmqfast.testing import JarPaths, RocketMQCluster, ensure_jars
from rmqfast.testing.javaclient import DriverProcess, start_driver
from rmqfast.testing.jvm import kill_group
from rmqfast.testing.proxy import ProxyProcess
from rmqfast.testing.tools import java_executable

pytestmark = pytest.mark.integration

QUEUES = 4  # per broker; queue 3 of each broker is gray
SETTLE = 4.0
GRACE = 8.0
MAIN = "io.rmqfast.driver.FailoverProducer"
_DELIVERED = re.compile(r"^DELIVERED (\S+) (\S+):(-?\d+) (\d+)$", re.M)


@pytest.fixture(scope="module")
def jars4(jars: JarPaths) -> JarPaths:
    return ensure_jars(jars.java_dir, rocketmq4=True)


@pytest.fixture(scope="module")
def pair(jars4: JarPaths) -> Iterator[tuple[RocketMQCluster, RocketMQCluster]]:
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(RocketMQCluster(jars=jars4, broker_name="broker-a"))
        b = stack.enter_context(RocketMQCluster(jars=jars4, broker_name="broker-b", join=a))
        yield a, b


@dataclass
class Producer:
    """A FailoverProducer JVM (sync sends until a stop file appears; one line per send)."""

    name: str
    gray: bool
    client: str
    run: str
    work: Path
    extra: list[str]
    proc: subprocess.Popen[bytes] | None = None
    ok: list[tuple[int, int, str, int]] = field(default_factory=list)  # idx, epoch ms, broker, queue id
    _pos: int = 0

    @property
    def out(self) -> Path:
        return self.work / f"{self.name}.out"

    def start(self, jars: JarPaths, namesrv: str, topic: str) -> None:
        cmd = [java_executable(), "-Xms32m", "-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
               f"-Drocketmq.client.logRoot={self.work}", "-Drocketmq.client.logUseSlf4j=false",
               "-cp", jars.driver_classpath(self.client), MAIN, "failover", "--namesrv", namesrv, "--topic", topic,
               "--run", self.run, "--stop-file", str(self.work / f"{self.name}.stop"), "--interval-ms", "20",
               *self.extra]
        err = (self.work / f"{self.name}.err").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.out.open("wb"), stderr=err, start_new_session=True)

    def poll(self) -> int:
        with contextlib.suppress(FileNotFoundError), self.out.open("rb") as f:
            f.seek(self._pos)
            data = f.read()
            end = data.rfind(b"\n")
            if end >= 0:
                self._pos += end + 1
                for line in data[: end + 1].decode("utf-8", "replace").splitlines():
                    p = line.split(" ")
                    if p[0] == "OK" and len(p) >= 5:
                        self.ok.append((int(p[1]), int(p[2]), p[3], int(p[4])))
        return len(self.ok)

    def stop(self) -> None:
        (self.work / f"{self.name}.stop").touch()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
        self.poll()


@dataclass
class Consumer:
    name: str
    gray: bool
    proc: DriverProcess

    def deliveries(self) -> list[tuple[str, str, int, int]]:
        """(run:idx, broker, queue id, epoch ms) in delivery order, from the driver's trace."""
        return [(m[1], m[2], int(m[3]), int(m[4])) for m in _DELIVERED.finditer(self.proc.stderr_text())]


def test_gray_consumers_and_producers_abort_promote_kill(
        jars4: JarPaths, pair: tuple[RocketMQCluster, RocketMQCluster], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = pair
    topic, group = unique("gray"), unique("graycg")
    _topic_on_both(pair, topic)
    extra = f"""
[gray]
settle = {SETTLE}
grace = {GRACE}
[[gray.group]]
group = "{group}"
topics = ["{topic}"]
gray_queues = 1
clients = ["*@canary*"]
producer_groups = ["pg-canary*"]
property = "gray=true"
"""
    with ProxyProcess([a.namesrv_addr], workers=2, extra_config=extra) as proxy:
        ns = proxy.namesrv_addr
        stop = tmp_path / "consumers.stop"
        consumers = [
            Consumer(name, gray, start_driver(
                "consume-push", ns, client, jars=jars4, log_dir=tmp_path, topic=topic, group=group,
                instance_name=name, expect=10**6, timeout_ms=600000, stop_file=str(stop), trace_deliveries=True,
                settle_ms=0, **{"from": "CONSUME_FROM_FIRST_OFFSET"}))
            for name, gray, client in (("app-n1", False, "5"), ("app-n2", False, "4"),
                                       ("canary-g1", True, "5"), ("canary-g2", True, "4"))]
        producers = [Producer("normal", False, "5", f"n{os.getpid()}", tmp_path, ["--group", "pg-app"]),
                     Producer("graypg", True, "4", f"g{os.getpid()}", tmp_path, ["--group", "pg-canary-1"]),
                     Producer("grayprop", True, "5", f"p{os.getpid()}", tmp_path,
                              ["--group", "pg-app2", "--props", "gray=true"])]
        try:
            for c in consumers:
                c.proc.wait_started(BOUND)
            for p in producers:
                p.start(jars4, ns, topic)
            marks: list[tuple[str, float, float]] = []
            status, promoted = _phases(proxy, group, producers, consumers, marks)
            stop.touch()
            for c in consumers:
                if not c.gray:
                    c.proc.result(BOUND, check=False)
            metrics = proxy.metrics()
            with urllib.request.urlopen(f"{proxy.admin_url}/gray?backlog=1", timeout=BOUND) as resp:
                final = next(g["backlog"] for g in json.loads(resp.read())["groups"] if g["group"] == group)
        finally:
            for p in producers:
                if p.proc is not None and p.proc.poll() is None:
                    kill_group(p.proc)
            for c in consumers:
                c.proc.kill()
            with contextlib.suppress(OSError):
                shutil.copy(proxy.log_path, tmp_path / "proxy.log")  # kept with the drivers' logs
    res = _judge(producers, consumers, marks)
    gray_metrics = {f"{n}{dict(lbl)}": v for (n, lbl), v in metrics.items() if n.startswith("rmqfast_gray_")
                    and not n.endswith("_created")}
    with capsys.disabled():
        print(f"\ngray: {res}\npromote: drained after {promoted['drained_after']} s (settle {SETTLE} s)"
              f"\ngray queues at the end (consumers stopped): {final}"
              f"\nstatus before the kill:\n{status}\nmetrics: {gray_metrics}")
    assert res["lost"] == 0, res
    assert res["sent_wrong_share"] == [], res  # gray sends on gray queues only, normal ones never there
    assert res["wrong_side"] == [], res  # per phase, the side that may consume it
    assert res["sent"]["gray"] >= 100 and res["sent"]["normal"] >= 100, res
    assert "error" not in final and final["total"] == 0, final  # every consumed message committed, nothing stuck


def _phases(proxy: ProxyProcess, group: str, producers: list[Producer], consumers: list[Consumer],
            marks: list[tuple[str, float, float]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Canary, abort, canary, promote, canary, kill -9 of both gray consumers; the status before the kill
    and the group's status once the promote ended."""

    def sent(n: int) -> None:
        base = [len(p.ok) for p in producers]
        wait_until(lambda: all(p.poll() >= b0 + n for p, b0 in zip(producers, base, strict=True)),
                   BOUND, f"{n} more acknowledged sends per producer")

    def consumed_all() -> None:
        def done() -> bool:
            got = {d[0] for c in consumers for d in c.deliveries()}
            return all(f"{p.run}:{i}" in got for p in producers for i, *_ in p.ok)
        wait_until(done, BOUND, "every acknowledged message consumed")

    def command(action: str) -> None:  # what `rmqfast gray ACTION GROUP` sends (tests/test_gray.py runs it)
        before = time.time()
        req = urllib.request.Request(f"{proxy.admin_url}/gray/{action}?group={group}", data=b"", method="POST",
                                     headers={"Content-Type": "application/json"})  # as the admin endpoint needs
        with urllib.request.urlopen(req, timeout=BOUND) as resp:
            view = json.loads(resp.read())
        since = next(g["since"] for g in view["groups"] if g["group"] == group) or time.time()
        marks.append((action, before, since))

    # 1. a running canary
    sent(15)
    consumed_all()
    command("abort")  # 2. mid-traffic
    sent(15)
    wait_until(lambda: time.time() > marks[-1][2] + SETTLE + 1, BOUND, "abort settled")
    sent(15)
    consumed_all()
    command("reset")  # 3. a canary again, then promote mid-traffic
    sent(40)
    command("promote")
    sent(15)
    # the promote ends when the group's commits of the gray queues reach the marks the supervisor's backlog
    # watch took when it saw the promote; the gray producers go on sending to the gray queues meanwhile
    promoted = wait_until(lambda: (g := _status(proxy, group))["drain"] != "draining" and g, BOUND, "promote drained")
    assert promoted["drain"] == "drained" and promoted["phase"] == "promoted", promoted
    end = promoted["since"] + promoted["drained_after"]  # rounded to 0.1 s
    marks.append(("promoted", end - 0.1, end))
    wait_until(lambda: time.time() > end + 1.5, BOUND, "every worker past the promote's end")
    sent(15)
    consumed_all()
    command("reset")  # 4. a canary again; then both gray consumers die
    sent(40)
    consumed_all()
    with urllib.request.urlopen(f"{proxy.admin_url}/gray?backlog=1", timeout=BOUND) as resp:
        status: dict[str, Any] = json.loads(resp.read())  # what `rmqfast gray status --backlog` shows
    backlog = next(g["backlog"] for g in status["groups"] if g["group"] == group)
    assert "error" not in backlog and len(backlog["queues"]) == 2, backlog  # queue 3 of each broker
    before = time.time()
    for c in consumers:
        if c.gray:
            c.proc.kill()  # SIGKILL
    marks.append(("kill", before, time.time()))
    sent(15)
    wait_until(lambda: time.time() > marks[-1][2] + GRACE + 1, BOUND, "grace period over")
    sent(15)
    for p in producers:
        p.stop()
    consumed_all()
    return status, promoted


def _phase_at(marks: list[tuple[str, float, float]], t: float) -> tuple[str, float] | None:
    """The phase at epoch ``t``: the last command written 1.5 s before (None while a command is on its way:
    from the call until 1.5 s after the admin endpoint wrote it; the workers read the file once a second)."""
    cur = ("active", 0.0)
    for name, before, after in marks:
        if before <= t <= after + 1.5:
            return None
        if after + 1.5 < t:
            cur = (name, after)
    return cur


def _queue_ok(phase: tuple[str, float], gray_side: bool, q: int, t: float, kill_at: float, consumer: bool) -> bool:
    """Whether a client of that side may put (producer) / take (consumer) queue ``q`` at ``t``."""
    name, at = phase
    on_gray = q == QUEUES - 1
    if name in ("active", "reset"):
        return on_gray == gray_side
    if name == "kill":  # gray consumers are dead; normal ones take the gray queues after the grace period
        return on_gray == gray_side or (consumer and not gray_side and t > kill_at + GRACE - 1)
    if name == "abort":  # nothing stored on gray queues; gray consumers take nothing, normal ones all after the settle
        if consumer:
            return not gray_side and (not on_gray or t > at + SETTLE)
        return not on_gray
    if name == "promoted":  # one group again
        return True
    # promote, until it ends by its drain: as a running canary (gray sends on the gray queues, which only
    # gray consumers take)
    return on_gray == gray_side


def _judge(producers: list[Producer], consumers: list[Consumer],
           marks: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Per acknowledged message: where it was stored, consumed or not, by which side.

    Stored: while a canary runs and until a promote ends by its drain, gray messages on gray queues and
    normal ones on normal queues; after an abort none on a gray queue.  Consumed: while a canary runs and
    until a promote ends, gray queues by gray consumers only, normal queues by normal consumers only
    (after the kill of both gray consumers and the grace period, normal ones take the gray queues too);
    after an abort gray consumers take nothing; after a promote ended, one group.  Moments within a
    command's (or the promote's end's) way to the workers are not judged (see :func:`_phase_at`).
    """
    kill_at = next((after for n, _, after in marks if n == "kill"), 0.0)
    sent_by: dict[str, tuple[bool, float, int]] = {}
    wrong_share: list[Any] = []
    for p in producers:
        for idx, t_ms, broker, q in p.ok:
            t = t_ms / 1000
            sent_by[f"{p.run}:{idx}"] = (p.gray, t, q)
            ph = _phase_at(marks, t)
            if ph is not None and not _queue_ok(ph, p.gray, q, t, kill_at, consumer=False):
                wrong_share.append((p.name, idx, broker, q, ph[0], round(t - ph[1], 1)))
    got: dict[str, list[tuple[str, bool, float]]] = defaultdict(list)
    wrong: list[Any] = []
    for c in consumers:
        for key, _broker, q, t_ms in c.deliveries():
            if key not in sent_by:
                continue
            t = t_ms / 1000
            got[key].append((c.name, c.gray, t))
            ph = _phase_at(marks, t)
            if ph is None:
                continue
            if not _queue_ok(ph, c.gray, q, t, kill_at, consumer=True):
                wrong.append((key, c.name, q, ph[0], round(t - ph[1], 1)))
    lost = [k for k in sent_by if k not in got]
    cross = Counter(("gray" if sent_by[k][0] else "normal") + " by " + ("gray" if by_gray else "normal")
                    for k, ds in got.items() for _, by_gray, _ in ds if by_gray != sent_by[k][0])
    return {"sent": {"gray": sum(1 for v in sent_by.values() if v[0]),
                     "normal": sum(1 for v in sent_by.values() if not v[0])},
            "lost": len(lost), "lost_keys": lost[:10],
            "duplicates": sum(len(v) - 1 for v in got.values()),
            "sent_wrong_share": wrong_share[:5], "sent_wrong_share_count": len(wrong_share),
            "wrong_side": wrong[:5], "wrong_side_count": len(wrong),
            "other_version_deliveries": dict(cross),  # allowed by abort, promote, the kill (see above)
            "by_consumer": {c.name: len(c.deliveries()) for c in consumers},
            "marks": [(n, round(b - marks[0][1], 1), round(a - b, 1)) for n, b, a in marks]}


# A gray version subscribing to other tags, with the Go client; a promote bounded by the drain -----------

NORMAL_SUB = "TagA || TagB"
GRAY_SUB = "TagA || TagB || TagC"  # the gray version also takes TagC
SUBS = {False: {"TagA", "TagB"}, True: {"TagA", "TagB", "TagC"}}
TAG_SETTLE = 3.0
DRAIN_TIMEOUT = 90.0
FAIL_EVERY = 10  # the gray consumers refuse the first delivery of idx % 10 == 0 (a retry)
ROUNDING = 0.1  # the status gives drained_after rounded to 0.1 s: the promote's end is known to that


def _backlog_sum(proxy: ProxyProcess, group: str) -> float | None:
    rows = [v for (n, lbl), v in proxy.metrics().items()
            if n == "rmqfast_gray_backlog_messages" and dict(lbl).get("group") == group]
    return sum(rows) if len(rows) == 2 else None  # queue 3 of each broker


def _status(proxy: ProxyProcess, group: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{proxy.admin_url}/gray", timeout=BOUND) as resp:
        return next(g for g in json.loads(resp.read())["groups"] if g["group"] == group)  # type: ignore[no-any-return]


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def test_gray_version_with_other_tags_java4_java5_go_and_a_drained_promote(
        jars4: JarPaths, pair: tuple[RocketMQCluster, RocketMQCluster], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two normal consumers (Java 5.3.3, Java 4.9.4) subscribe to ``TagA || TagB``, two gray ones (Java
    4.9.4, Go v2 2.1.2) to ``TagA || TagB || TagC``, one group.  A normal producer (Java 5) and a gray one
    (Java 4.9.4, by producer group) send TagA, TagB, TagC round robin.  Then the gray consumers are paused
    (SIGSTOP), more gray messages wait on the gray queues (the backlog metric shows them), ``promote`` is
    given: it stays ``promoting`` past its settle until the resumed gray consumers have committed the gray
    queues up to the marks taken when the promote was seen, then ends (``drained``), before its drain
    timeout.  The gray producer sends TagC throughout the drain (while the gray version is paused and after
    it resumes): every such message must be consumed by a gray-version consumer.  Per message: which side
    consumed it, lost, duplicates.  The gray consumers refuse the first delivery of every tenth message
    (RECONSUME_LATER): until the promote ends it must come back to the gray side, not through the retry
    topic to the normal side."""
    import signal

    from rmqfast.testing.goclient import start_godriver

    a, _ = pair
    topic, group = unique("graytag"), unique("graytagcg")
    _topic_on_both(pair, topic)
    extra = f"""
[gray]
settle = {TAG_SETTLE}
grace = 120
drain_timeout = {DRAIN_TIMEOUT}
backlog_interval = 1
[[gray.group]]
group = "{group}"
topics = ["{topic}"]
clients = ["*@canary*"]
producer_groups = ["pg-canary*"]
"""
    stop = tmp_path / "consumers.stop"
    with ProxyProcess([a.namesrv_addr], workers=2, extra_config=extra) as proxy:
        ns = proxy.namesrv_addr
        common: dict[str, Any] = {"jars": jars4, "log_dir": tmp_path, "topic": topic, "group": group,
                                  "expect": 10**6, "timeout_ms": 600000, "stop_file": str(stop), "settle_ms": 0,
                                  "trace_deliveries": True, "from": "CONSUME_FROM_FIRST_OFFSET"}
        java = {"app-n1": (False, start_driver("consume-push", ns, "5", instance_name="app-n1", sub=NORMAL_SUB,
                                                **common)),
                "app-n2": (False, start_driver("consume-push", ns, "4", instance_name="app-n2", sub=NORMAL_SUB,
                                                **common)),
                "canary-j4": (True, start_driver("consume-push", ns, "4", instance_name="canary-j4", sub=GRAY_SUB,
                                                  fail_every=FAIL_EVERY, retry_delay_level=1, **common))}
        go = start_godriver("consume-push", ns, topic=topic, group=group, expect=10**6, timeout_ms=600000,
                            instance="canary-go", sub=GRAY_SUB, stop_file=str(stop), trace_deliveries=True,
                            fail_every=FAIL_EVERY)
        gray_pids = [java["canary-j4"][1].pid, go.pid]
        traces = {n: p.stderr_text for n, (_, p) in java.items()} | {"canary-go": lambda: go.stderr_tail(10**8)}
        gray_of = {n: g for n, (g, _) in java.items()} | {"canary-go": True}
        results: dict[str, dict[str, Any]] = {}
        try:
            for _, p in java.values():
                p.wait_started(BOUND)
            wait_until(lambda: "CONSUMER_STARTED" in go.stderr_tail(10**6) or go.poll() is not None, BOUND,
                       "the Go consumer started")
            assert go.poll() is None, go.stderr_tail()
            sent = _produce(jars4, ns, topic, tmp_path, "b1", 45)  # 1. a running canary
            _wait_consumed(traces, sent, "batch 1 consumed")
            wait_until(lambda: _backlog_sum(proxy, group) == 0, BOUND, "gray queues committed (metric 0)")
            for pid in gray_pids:  # 2. the gray version stalls; its messages wait on the gray queues
                _signal_group(pid, signal.SIGSTOP)
            batch2 = _produce(jars4, ns, topic, tmp_path, "b2", 30)
            sent.update(batch2)
            n_gray2 = sum(1 for v in batch2.values() if v[0])
            wait_until(lambda: _backlog_sum(proxy, group) == n_gray2, BOUND,
                       f"the backlog metric shows the {n_gray2} waiting gray messages")
            req = urllib.request.Request(f"{proxy.admin_url}/gray/promote?group={group}", data=b"", method="POST",
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=BOUND).close()
            since = _status(proxy, group)["since"]
            # 3. both producers send during the drain (the gray one TagC only, here and below)
            drain_batches = [(_produce(jars4, ns, topic, tmp_path, "d0", 12, gray_tags="TagC"), time.time())]
            wait_until(lambda: time.time() > since + TAG_SETTLE + 2, BOUND, "past the settle")
            st = _status(proxy, group)
            m = proxy.metrics()
            held = (st["phase"], st["drain"], m.get(("rmqfast_gray_drain", (("group", group),))), st.get("drain_left"))
            for pid in gray_pids:  # 4. the gray version resumes and drains its queues; its producer goes on
                _signal_group(pid, signal.SIGCONT)
            while _status(proxy, group)["drain"] == "draining" and len(drain_batches) < 20:
                drain_batches.append((_produce(jars4, ns, topic, tmp_path, f"d{len(drain_batches)}", 6,
                                               normal=False, gray_tags="TagC"), time.time()))
            st = wait_until(lambda: (s := _status(proxy, group))["drain"] != "draining" and s, BOUND,
                            "the promote's drain over")
            for batch, _ in drain_batches:
                sent.update(batch)
            promoted_at = st["since"] + st["drained_after"]
            # a batch acknowledged before the promote ended was sent during the drain; the last one may
            # straddle its end: its TagC messages on a queue an old-version instance owns after the
            # hand-over are skipped by that instance (documented), so they are judged apart, not awaited;
            # so are the refused messages still in flight to the gray version at the end (not delivered yet
            # count as delivered now: the judgement below decides on the complete traces)
            straddled = {k for batch, ended in drain_batches if ended >= promoted_at - ROUNDING for k in batch}
            in_flight, _ = _refused_in_flight(sent, _traced(traces), gray_of, promoted_at, undelivered_at=time.time())
            awaited = {k: v for k, v in sent.items() if k not in straddled and k not in in_flight}
            _wait_consumed(traces, awaited, "batches 2 and d consumed")
            wait_until(lambda: _backlog_sum(proxy, group) == 0, BOUND, "the gray queues committed")
            m = proxy.metrics()
            after = (st, _backlog_sum(proxy, group), m.get(("rmqfast_gray_drain", (("group", group),))),
                     m.get(("rmqfast_gray_phase", (("group", group),))))
            stop.touch()
            for name, (_, p) in java.items():
                results[name] = p.result(BOUND, check=False)
            wait_until(lambda: go.poll() is not None, BOUND, "the Go consumer ended")
            go_trace = go.stderr_tail(10**8)  # read before result(), which removes its folder
            go.result(BOUND, check=False)
        finally:
            for pid in gray_pids:
                _signal_group(pid, signal.SIGCONT)
            for _, p in java.values():
                p.kill()
            go.kill()
            with contextlib.suppress(OSError):
                shutil.copy(proxy.log_path, tmp_path / "proxy.log")
    deliveries = _deliveries(results, go_trace)
    in_flight, redelivery = _refused_in_flight(sent, [(n, k, t) for n, k, _, _, t in deliveries], gray_of,
                                               promoted_at)
    res = _judge_tags(sent, deliveries, gray_of, promoted_at, straddled, in_flight)
    # sent during the drain (acknowledged before its end) and not refused in flight at its end
    drain_tagc = [k for batch, ended in drain_batches if ended < promoted_at - ROUNDING
                  for k, (gray, tag, _) in batch.items() if gray and tag == "TagC" and k not in in_flight]
    with capsys.disabled():
        shown = {k: v for k, v in res.items() if k != "gray_consumed"}
        print(f"\ngray tags: {shown}\npromote held: {held}\nafter: {after}\ndrain batches (messages, s after "
              f"the promote): {[(len(b), round(e - st['since'], 1)) for b, e in drain_batches]}; gray TagC sent "
              f"during the drain {len(drain_tagc)}, consumed by the gray version "
              f"{sum(1 for k in drain_tagc if k in res['gray_consumed'])}; gray redelivery of a refused message "
              f"after {redelivery and round(redelivery, 1)} s: {len(in_flight)} refused in flight at the end")
    assert held[:3] == ("promoting", "draining", 1.0) and held[3], held  # past its settle, gray messages waiting
    assert redelivery is not None, res  # measured on the gray consumers' refusals before the end
    # every TagC message the gray producer sent during the drain, consumed by the gray version
    assert len(drain_tagc) >= 4 and all(k in res["gray_consumed"] for k in drain_tagc), (drain_tagc, res)
    assert st["drain"] == "drained" and st["phase"] == "promoted", st
    assert TAG_SETTLE + 2 < st["drained_after"] < DRAIN_TIMEOUT, st  # ended by the drain, not by time
    assert after[1] == 0 and after[2] == 2.0 and after[3] == 2.0, after
    assert res["lost"] == 0, res
    assert res["wrong_side"] == [], res  # until the promote ended; retries of gray messages included
    # the messages the gray consumers refused came back to them (Java 4.9.4 and Go), never to the normal side
    assert res["retries"].get("gray retried, taken by canary-j4", 0) > 0, res
    assert res["retries"].get("gray retried, taken by canary-go", 0) > 0, res
    assert res["unwanted"] == [], res  # nobody takes a tag it does not subscribe to
    assert res["stored_wrong_share"] == [], res
    assert res["gray_tagc_by_gray"] > 0 and res["by_consumer"]["canary-go"] > 0, res
    assert res["by_consumer"]["app-n2"] > 0 and res["by_consumer"]["canary-j4"] > 0, res


def _topic_on_both(pair: tuple[RocketMQCluster, RocketMQCluster], topic: str) -> None:
    """Creates ``topic`` with QUEUES queues on both brokers and waits until the route names both."""
    a, b = pair
    for c in (a, b):
        c.create_topic(topic, QUEUES)
    wait_until(lambda: {q.get("brokerName") for q in (a.topic_route(topic) or {}).get("queueDatas", [])}
               >= {"broker-a", "broker-b"}, BOUND, "the route names both brokers")


def _produce(jars: JarPaths, ns: str, topic: str, work: Path, batch: str, count: int, normal: bool = True,
             gray_tags: str = "TagA,TagB,TagC") -> dict[str, tuple[bool, str, int]]:
    """A normal (Java 5) and a gray (Java 4.9.4, producer group pg-canary-1) producer, concurrently, tags
    TagA, TagB, TagC round robin (the gray one ``gray_tags``): {run:idx: (gray, tag, queue id)} of every
    acknowledged message."""
    procs = [(False, f"n{batch}", "5", "pg-app", "TagA,TagB,TagC")] if normal else []
    procs.append((True, f"g{batch}", "4", "pg-canary-1", gray_tags))
    running = [(gray, run, start_driver("produce", ns, client, jars=jars, log_dir=work, topic=topic, count=count,
                                        mode="sync", tags=tags, group=pg, run_id=run))
               for gray, run, client, pg, tags in procs]
    out: dict[str, tuple[bool, str, int]] = {}
    for gray, run, p in running:
        for r in p.result(BOUND)["sent"]:
            out[f"{run}:{r['idx']}"] = (gray, str(r["tag"]), int(r["queue_id"]))
    return out


_TRACED = re.compile(r"^DELIVERED (\S+) \S+:-?\d+ \d+(?: \d+)?(?: refused)?$", re.M)  # Java and Go drivers


def _not_consumed(traces: dict[str, Any], sent: dict[str, tuple[bool, str, int]]) -> tuple[list[str], int]:
    """The messages some consumer subscribes to that were not delivered yet (traces so far; a gray message
    both gray consumers refuse the first time, idx % FAIL_EVERY == 0, must be delivered again), and the
    number of deliveries traced."""
    seen: Counter[str] = Counter()
    for text in (t() for t in traces.values()):
        seen.update(_TRACED.findall(text))
    missing = [k for k, (gray, tag, _) in sent.items() if tag in SUBS[gray]
               and seen[k] < (2 if gray and int(k.rsplit(":", 1)[1]) % FAIL_EVERY == 0 else 1)]
    return missing, sum(seen.values())


def _wait_consumed(traces: dict[str, Any], sent: dict[str, tuple[bool, str, int]], what: str) -> None:
    """Waits until every awaited message was delivered, paced by progress: it fails only when no new
    delivery was traced for BOUND seconds (a loaded machine makes the consumers slower, not the test red)."""
    start = stalled_since = time.monotonic()
    count = -1
    while True:
        missing, n = _not_consumed(traces, sent)
        if not missing:
            return
        if n != count:
            stalled_since, count = time.monotonic(), n
        if time.monotonic() - stalled_since > BOUND or time.monotonic() - start > 4 * BOUND:
            raise AssertionError(f"{what}: {len(missing)} not consumed after {time.monotonic() - start:.0f} s "
                                 f"(the last delivery {time.monotonic() - stalled_since:.0f} s ago) "
                                 f"(first: {sorted(missing)[:12]}; gray, tag, queue: "
                                 f"{[sent[k] for k in sorted(missing)[:12]]})")
        time.sleep(0.5)


_SEEN = re.compile(r"^DELIVERED (\S+) \S+:-?\d+ (\d+)(?: \d+)?(?: refused)?$", re.M)  # Java and Go drivers


def _traced(traces: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(consumer, run:idx, epoch s) of every delivery traced so far."""
    return [(name, m[1], int(m[2]) / 1000) for name, text in traces.items() for m in _SEEN.finditer(text())]


def _refused_in_flight(sent: dict[str, tuple[bool, str, int]], seen: list[tuple[str, str, float]],
                       gray_of: dict[str, bool], promoted_at: float,
                       undelivered_at: float | None = None) -> tuple[set[str], float | None]:
    """The gray messages the gray consumers refuse (their first delivery, idx % FAIL_EVERY == 0) that were
    still in flight to the gray version when the promote ended, and the redelivery delay that says so.

    While the gray side owns its queues, a refused message's send-back is refused and the client delivers
    the message again itself after a delay (Java: 5 s; Go: its 3 s send-back timeout, then 5 s), measured
    here: the longest gap between a gray consumer's first and second delivery of such a message, both before
    the end.  Until then the message is neither consumed nor, if sent after the promote was seen, below its
    marks, so the drain does not wait for it.  One first delivered less than that delay before the end
    (or after it) is in flight at the end: its send-back may pass (the retry topic, which an old-version
    instance may pull) or its queue leave the gray consumer at its rebalance before the redelivery (an
    old-version instance then skips a tag it does not subscribe to): docs/gray.md, "After a
    promote ends".  ``undelivered_at``: the first delivery assumed for one the gray version has not been
    delivered yet (the traces still growing); None: such a message is not in flight (it was due before)."""
    refused = {k for k, (gray, _, _) in sent.items() if gray and int(k.rsplit(":", 1)[1]) % FAIL_EVERY == 0}
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    for name, key, t in seen:
        if key in refused and gray_of.get(name):
            times[(name, key)].append(t)
    gaps = [ts[1] - ts[0] for ts in map(sorted, times.values()) if len(ts) > 1 and ts[1] < promoted_at - ROUNDING]
    if not gaps:
        return set(), None
    redelivery = max(gaps)
    first: dict[str, float] = {}
    for (_, key), ts in times.items():
        first[key] = min(first.get(key, ts[0]), *ts)
    late: set[str] = set()
    for k in refused:
        t = first.get(k, undelivered_at)
        if t is not None and t + redelivery >= promoted_at - ROUNDING:
            late.add(k)
    return late, redelivery


_GO_TRACE = re.compile(r"^DELIVERED (\S+) \S+:-?\d+ (\d+) (\d+)( refused)?$", re.M)


def _deliveries(results: dict[str, dict[str, Any]], go_trace: str) -> list[tuple[str, str, bool, int, float]]:
    """(consumer, run:idx, acknowledged, reconsume times, epoch s): the Java consumers' final JSON and the
    Go consumer's trace (every delivery, acknowledged or refused)."""
    out = [(name, f"{r.get('run')}:{r.get('idx')}", bool(r.get("acked")), int(r.get("reconsume_times") or 0),
            int(r.get("recv_epoch_ms") or 0) / 1000)
           for name, res in results.items() for r in res.get("received") or []]
    out += [("canary-go", m[1], not m[4], int(m[3]), int(m[2]) / 1000) for m in _GO_TRACE.finditer(go_trace)]
    return out


def _judge_tags(sent: dict[str, tuple[bool, str, int]], deliveries: list[tuple[str, str, bool, int, float]],
                gray_of: dict[str, bool], promoted_at: float, straddled: set[str],
                in_flight: set[str]) -> dict[str, Any]:
    """Per acknowledged message: until the promote ended (``promoted_at``), consumed by the side of its
    producer only (a retry too), and only by a consumer subscribing to its tag; after it one group.
    ``straddled``: messages that may have been sent after the promote ended (placed as the producer chose;
    a gray TagC message on a queue an old-version consumer owns is then skipped): reported apart.
    ``in_flight``: refused messages still in flight to the gray version at the end
    (:func:`_refused_in_flight`; a gray TagC one may be skipped by the old version): reported apart."""
    acked: dict[str, list[str]] = defaultdict(list)
    wrong, unwanted, cross_after = [], [], []
    retried: Counter[str] = Counter()
    for name, key, ack, again, t in deliveries:
        if key not in sent:
            continue
        gray, tag, _q = sent[key]
        if again:
            retried[f"{'gray' if gray else 'normal'} retried, taken by {name}"] += 1
        if gray_of[name] != gray:
            (cross_after if t >= promoted_at else wrong).append((key, name, tag, again))
        if tag not in SUBS[gray_of[name]] and not again:  # a retry comes from %RETRY%group, subscribed to '*'
            unwanted.append((key, name, tag))
        if ack:
            acked[key].append(name)
    wanted = [k for k, (gray, tag, _) in sent.items() if tag in SUBS[gray]]
    only_gray = [k for k in wanted if k in straddled and sent[k][0] and sent[k][1] not in SUBS[False]]
    refused_late = [k for k in wanted if k in in_flight and k not in straddled and sent[k][1] not in SUBS[False]]
    lost = [k for k in wanted if k not in acked and k not in only_gray and k not in refused_late]
    return {"sent": {"gray": sum(1 for v in sent.values() if v[0]),
                     "normal": sum(1 for v in sent.values() if not v[0])},
            "wanted": len(wanted), "lost": len(lost), "lost_keys": lost[:10],
            "duplicates": sum(len(v) - 1 for v in acked.values()),
            "wrong_side": wrong[:5], "wrong_side_count": len(wrong), "unwanted": unwanted[:5],
            "other_side_after_promote": len(cross_after),
            "normal_tagc_consumed": sum(1 for k in acked if not sent[k][0] and sent[k][1] == "TagC"),
            "stored_wrong_share": [(k, q) for k, (gray, _, q) in sent.items()
                                   if (q == QUEUES - 1) != gray and k not in straddled][:5],
            "gray_consumed": {k for k, names in acked.items() if any(gray_of[n] for n in names)},
            "straddled_gray_tagc": {"sent": len(only_gray), "consumed": sum(1 for k in only_gray if k in acked),
                                    "on_gray_queue": sum(1 for k in only_gray if sent[k][2] == QUEUES - 1)},
            "refused_in_flight_gray_tagc": {
                "sent": len(refused_late),
                "consumed_by_gray": sum(1 for k in refused_late if any(gray_of[n] for n in acked.get(k, ()))),
                "consumed_by_nobody": sum(1 for k in refused_late if k not in acked)},
            "gray_tagc_by_gray": sum(1 for k, names in acked.items() if sent[k][0] and sent[k][1] == "TagC"
                                     and any(gray_of[n] for n in names)),
            "retries": dict(retried),
            "by_consumer": dict(Counter(d[0] for d in deliveries))}
