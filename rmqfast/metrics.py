"""Prometheus metrics: names in one place, multiprocess aggregation across workers.

Workers never touch prometheus-client per frame: the compiled scanner counts in C arrays
(:class:`rmqfast.codec.ScanStats`) and :class:`StatsPublisher` adds the deltas to the
Prometheus counters once a second.  The supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` before
it starts workers (prometheus-client reads it at import) and serves ``/metrics`` from a
``MultiProcessCollector``, so the figures add up across all worker processes, and survive
a worker restart (the dead worker's files are kept; its live gauges are dropped).
"""

from __future__ import annotations

from typing import Any

from rmqfast.codec import slot_code

NAMESPACE = "rmqfast"


class Metrics:
    """The worker-side metric objects (created after PROMETHEUS_MULTIPROC_DIR is set)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.requests = Counter(
            "rmqfast_requests_total", "Requests relayed or answered, by role and request code",
            ["role", "code"],
        )
        self.request_bytes = Counter(
            "rmqfast_request_bytes_total", "Bytes of request frames, by role and request code",
            ["role", "code"],
        )
        self.responses = Counter(
            "rmqfast_responses_total", "Response frames, by role and response code", ["role", "code"],
        )
        self.frame_bytes = Counter("rmqfast_bytes_total", "Bytes of all frames seen, by role", ["role"])
        self.topic_sends = Counter("rmqfast_topic_sends_total", "Send requests by topic", ["topic"])
        self.topic_messages = Counter(
            "rmqfast_topic_messages_total", "Messages sent by topic (batches count every message)", ["topic"],
        )
        self.topic_pulls = Counter("rmqfast_topic_pulls_total", "Pull requests by topic", ["topic"])
        self.topic_bytes = Counter("rmqfast_topic_bytes_total", "Request bytes by topic", ["topic"])
        self.protocol_errors = Counter(
            "rmqfast_protocol_errors_total", "Connections closed for malformed frames", ["role"],
        )
        self.denied = Counter(
            "rmqfast_denied_requests_total", "Requests refused by policy, by request code", ["role", "code"],
        )
        self.route_rewrites = Counter(
            "rmqfast_route_rewrites_total", "Route answers rewritten to proxy endpoints", ["code"],
        )
        self.connections = Counter("rmqfast_connections_total", "Client connections accepted", ["role"])
        self.connections_active = Gauge(
            "rmqfast_connections_active", "Client connections open now", ["role"], multiprocess_mode="livesum",
        )
        self.upstream_errors = Counter(
            "rmqfast_upstream_errors_total", "Failed upstream connection attempts", ["role"],
        )
        self.workers_up = Gauge(
            "rmqfast_worker_up", "1 for every running worker process", multiprocess_mode="livesum",
        )


def _code_label(slot: int) -> str:
    code = slot_code(slot)
    return "other" if code is None else str(code)


class StatsPublisher:
    """Turns the scanner's cumulative C counters into Prometheus counter increments."""

    def __init__(self, metrics: Metrics, role: str, stats: Any) -> None:
        self.m = metrics
        self.role = role
        self.stats = stats
        self._req: dict[int, tuple[int, int]] = {}
        self._resp: dict[int, int] = {}
        self._topics: dict[bytes, tuple[int, int, int, int]] = {}
        self._bytes = 0
        self._errors = 0

    def publish(self) -> None:
        m, role, st = self.m, self.role, self.stats
        for slot, count, nbytes in st.requests():
            c0, b0 = self._req.get(slot, (0, 0))
            if count != c0:
                label = _code_label(slot)
                m.requests.labels(role, label).inc(count - c0)
                m.request_bytes.labels(role, label).inc(nbytes - b0)
                self._req[slot] = (count, nbytes)
        for slot, count in st.responses():
            c0 = self._resp.get(slot, 0)
            if count != c0:
                m.responses.labels(role, _code_label(slot)).inc(count - c0)
                self._resp[slot] = count
        for topic, sends, msgs, pulls, nbytes in st.topics():
            old = self._topics.get(topic, (0, 0, 0, 0))
            new = (sends, msgs, pulls, nbytes)
            if new != old:
                t = topic.decode("utf-8", "replace")
                if sends != old[0]:
                    m.topic_sends.labels(t).inc(sends - old[0])
                if msgs != old[1]:
                    m.topic_messages.labels(t).inc(msgs - old[1])
                if pulls != old[2]:
                    m.topic_pulls.labels(t).inc(pulls - old[2])
                m.topic_bytes.labels(t).inc(nbytes - old[3])
                self._topics[topic] = new
        if st.bytes != self._bytes:
            m.frame_bytes.labels(role).inc(st.bytes - self._bytes)
            self._bytes = st.bytes
        if st.protocol_errors != self._errors:
            m.protocol_errors.labels(role).inc(st.protocol_errors - self._errors)
            self._errors = st.protocol_errors
