"""Prometheus metrics: names in one place, multiprocess aggregation across workers.

Workers never touch prometheus-client per frame: the compiled scanner counts in C arrays
(:class:`rmqfast.codec.ScanStats`) and :class:`StatsPublisher` adds the deltas to the
Prometheus counters once a second.  The supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` before
it starts workers (prometheus-client reads it at import) and serves ``/metrics`` from a
``MultiProcessCollector``, so the figures add up across all worker processes, and survive
a worker restart (the dead worker's files are kept; its live gauges are dropped).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

from rmqfast.codec import LATENCY_BOUNDS_NS, RESULTS, slot_code

NAMESPACE = "rmqfast"

# what ``from prometheus_client import ...`` finds without the package's __init__ (light_prometheus)
_LIGHT_NAMES = {
    "prometheus_client.metrics": ("Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"),
    "prometheus_client.registry": ("CollectorRegistry", "REGISTRY"),
    "prometheus_client.metrics_core": ("Metric",),
}


def light_prometheus() -> None:
    """Let a worker process import prometheus-client's metric classes without the rest.

    A worker only writes its metrics to the multiprocess files (the supervisor serves
    ``/metrics``); the package's ``__init__`` also imports its HTTP exposition (http.server,
    urllib.request, email, hashlib with OpenSSL's libcrypto): ~6 MiB of RSS per worker.  After
    this call, ``prometheus_client`` is the package without its ``__init__`` run, holding the names
    of ``_LIGHT_NAMES``; any other name (``generate_latest``, ``multiprocess``...) runs the real
    ``__init__`` on first use, so everything the package offers is still there.  Nothing happens
    when the package is already imported.
    """
    if "prometheus_client" in sys.modules:
        return
    spec = importlib.util.find_spec("prometheus_client")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed (or not a package): the ordinary import says so where it is used
    loader = spec.loader
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["prometheus_client"] = pkg
    try:
        for name, attrs in _LIGHT_NAMES.items():
            mod = importlib.import_module(name)
            for attr in attrs:
                setattr(pkg, attr, getattr(mod, attr))
    except BaseException:
        for name in [n for n in sys.modules if n == "prometheus_client" or n.startswith("prometheus_client.")]:
            del sys.modules[name]
        raise
    whole: list[bool] = []

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module attribute hook (PEP 562)
        if not whole:
            whole.append(True)
            loader.exec_module(pkg)  # the package's own __init__, in the same module object
            if name in pkg.__dict__:
                return pkg.__dict__[name]
        raise AttributeError(f"module 'prometheus_client' has no attribute {name!r}")

    pkg.__getattr__ = __getattr__  # type: ignore[attr-defined]


class Metrics:
    """The worker-side metric objects (created after PROMETHEUS_MULTIPROC_DIR is set)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter(
            "rmqfast_requests_total",
            "Requests that ended, by role, request code and result (success, system_busy..., oneway, unanswered)",
            ["role", "code", "result"],
        )
        self.request_duration = Histogram(
            "rmqfast_request_duration_seconds",
            "From a request passing the proxy to its response passing back, by role and request code",
            ["role", "code"],
            buckets=[b / 1e9 for b in LATENCY_BOUNDS_NS],
        )
        self.untimed = Counter(
            "rmqfast_untimed_requests_total",
            "Requests not timed: their connection already had the maximum of requests awaiting answers",
            ["role"],
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
        self.tls_handshakes = Counter(
            "rmqfast_tls_handshakes_total",
            "TLS handshakes with clients (side=client) and upstreams (side=upstream), by result (ok, failed)",
            ["role", "side", "result"],
        )
        self.limit_admitted = Counter(
            "rmqfast_limit_admitted_total", "Messages admitted by a send limit rule (batches count every message)",
            ["topic", "tag"],
        )
        self.limit_rejected = Counter(
            "rmqfast_limit_rejected_total", "Messages answered SYSTEM_BUSY by a send limit rule (over limit or reject)",
            ["topic", "tag"],
        )
        self.limit_rate = Gauge(
            "rmqfast_limit_rate", "Configured limit of a rule (0: none), unit messages or bytes per second",
            ["topic", "tag", "unit"], multiprocess_mode="max",
        )
        self.workers_up = Gauge(
            "rmqfast_worker_up", "1 for every running worker process", multiprocess_mode="livesum",
        )
        self.publishes = Counter(
            "rmqfast_worker_publishes_total",
            "Times a worker published its counters (about once a second), by worker index",
            ["worker"],
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
        self._req: dict[int, int] = {}
        self._results: dict[tuple[int, int], int] = {}
        self._lat: dict[int, tuple[tuple[int, ...], int]] = {}
        self._untimed = 0
        self._resp: dict[int, int] = {}
        self._topics: dict[bytes, tuple[int, int, int, int]] = {}
        self._bytes = 0
        self._errors = 0

    def publish(self) -> None:
        m, role, st = self.m, self.role, self.stats
        for slot, _count, nbytes in st.requests():
            b0 = self._req.get(slot, 0)
            if nbytes != b0:
                m.request_bytes.labels(role, _code_label(slot)).inc(nbytes - b0)
                self._req[slot] = nbytes
        for slot, result, count in st.results():
            c0 = self._results.get((slot, result), 0)
            if count != c0:
                m.requests.labels(role, _code_label(slot), RESULTS[result]).inc(count - c0)
                self._results[(slot, result)] = count
        self._publish_latencies()
        if st.untracked != self._untimed:
            m.untimed.labels(role).inc(st.untracked - self._untimed)
            self._untimed = st.untracked
        for slot, count in st.responses():
            c0 = self._resp.get(slot, 0)
            if count != c0:
                m.responses.labels(role, _code_label(slot)).inc(count - c0)
                self._resp[slot] = count
        self._publish_topics()
        if st.bytes != self._bytes:
            m.frame_bytes.labels(role).inc(st.bytes - self._bytes)
            self._bytes = st.bytes
        if st.protocol_errors != self._errors:
            m.protocol_errors.labels(role).inc(st.protocol_errors - self._errors)
            self._errors = st.protocol_errors

    def _publish_latencies(self) -> None:
        for slot, buckets, sum_ns in self.stats.latencies():
            old_buckets, old_sum = self._lat.get(slot, ((0,) * len(buckets), 0))
            if sum_ns != old_sum or buckets != old_buckets:
                add_to_histogram(
                    self.m.request_duration.labels(self.role, _code_label(slot)),
                    [b - a for a, b in zip(old_buckets, buckets, strict=True)],
                    (sum_ns - old_sum) / 1e9,
                )
                self._lat[slot] = (buckets, sum_ns)

    def _publish_topics(self) -> None:
        m = self.m
        for topic, sends, msgs, pulls, nbytes in self.stats.topics():
            old = self._topics.get(topic, (0, 0, 0, 0))
            new = (sends, msgs, pulls, nbytes)
            if new == old:
                continue
            t = topic.decode("utf-8", "replace")
            if sends != old[0]:
                m.topic_sends.labels(t).inc(sends - old[0])
            if msgs != old[1]:
                m.topic_messages.labels(t).inc(msgs - old[1])
            if pulls != old[2]:
                m.topic_pulls.labels(t).inc(pulls - old[2])
            m.topic_bytes.labels(t).inc(nbytes - old[3])
            self._topics[topic] = new


def add_to_histogram(child: Any, bucket_deltas: list[int], sum_delta: float) -> None:
    """Add observations counted elsewhere (per bucket, in C) to a prometheus-client histogram.

    prometheus-client can only ``observe()`` one value at a time; its per-bucket values
    (``_buckets``, non-cumulative, and ``_sum``) take increments directly, in multiprocess mode
    too.  Should a future version hide them, each bucket's count is observed at the bucket's
    upper bound instead (same bucket counts; the sum is then an upper bound).
    """
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if buckets is not None and total is not None and len(buckets) == len(bucket_deltas):
        for value, d in zip(buckets, bucket_deltas, strict=True):
            if d:
                value.inc(d)
        total.inc(sum_delta)
        return
    bounds = [*child._upper_bounds]  # pragma: no cover - only with an incompatible prometheus-client
    for bound, d in zip(bounds, bucket_deltas, strict=False):  # pragma: no cover
        for _ in range(d):
            child.observe(bound if bound != float("inf") else bounds[-2])
