"""Pure-Python reference of the frame scanner compiled from ``ext/scanner.pxi``.

Theory of operation
-------------------
The relay reads whole receive buffers and asks a :class:`FrameScanner` which part of the
buffer may be forwarded unchanged.  The scanner walks the frames in the buffer::

    int32 length | int32 (serializeType << 24 | headerLength) | header | body

For every frame it reads only the fixed fields it needs (request code, flag, opaque and, for
sends and pulls, the topic) and looks the request code up in an *action table*.  A frame
whose action is ``PASS`` is counted and skipped: it is forwarded as raw bytes, even before
its body has fully arrived.  A frame whose action is ``POLICY`` (or any response, when
``response_policy`` is set) stops the scan so that Python can look at the whole frame.

``scan(buf, start, end)`` returns ``(event, a, b)``:

* ``EV_FORWARD``: ``buf[start:a]`` may be forwarded; ``buf[a:end]`` is the incomplete head of
  a frame that must be kept, and ``b`` is how many bytes (counted from ``a``) the scanner
  needs before it can make progress (the caller grows its buffer if it is smaller).
* ``EV_POLICY``: ``buf[start:a]`` may be forwarded; ``buf[a:b]`` is one whole frame that the
  policy must handle; scanning resumes at ``b``.
* ``EV_ERROR``: ``buf[start:a]`` may be forwarded; the frame at ``a`` is malformed and
  :attr:`FrameScanner.error` says why.  The connection must be closed.

The compiled twin implements exactly this algorithm; ``tests/test_scan.py`` and ``tests/test_header_fuzz.py``
runs both on the same random and captured inputs.  Nothing here allocates per frame in the
compiled version, which is why the JSON walk below is a hand-written byte scanner rather
than ``json.loads``.
"""

from __future__ import annotations

import struct
import time
from typing import Any

from rmqfast._args import c_int
from rmqfast.codec import _records_py
from rmqfast.codec._header_py import (
    E_TOPIC_ESCAPED,
    ERRORS,
    HeaderError,
    HeaderInfo,
    parse_binary_header,
    parse_json_header,
    props_delay,
)
from rmqfast.codec.batch import scanned_batch_count

# The tables both twins share (rmqfast/codec/tables.py), re-exported beside the scanner that uses them.
from rmqfast.codec.tables import (  # noqa: F401 - re-exported
    ACTION_PASS,
    ACTION_POLICY,
    ACTION_RECORDS,
    BORNHOST_V6,
    CODE_SLOTS,
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_HEADER,
    EV_ERROR,
    EV_FORWARD,
    EV_POLICY,
    LATENCY_BOUNDS_NS,
    LATENCY_BUCKETS,
    MAX_ADDRESSES,
    MAX_TOPIC_LEN,
    MAX_TRACKED,
    MIN_RECORD,
    NRESULTS,
    OTHER_SLOT,
    OTHER_TOPIC,
    R_ONEWAY,
    R_UNANSWERED,
    REC_BAD,
    REC_MISS,
    REC_OK,
    RECORD_MAGIC_V1,
    RECORD_MAGIC_V2,
    RESULTS,
    SAMPLE_RING,
    STOREHOST_POS,
    STOREHOST_V6,
    SYSFLAG_POS,
    TOPIC_SLOTS,
    latency_bucket,
    result_index,
)

AddressMap = _records_py.AddressMap
map_records = _records_py.map_records
map_header_ids = _records_py.map_header_ids
map_send_ids = _records_py.map_send_ids
walk_store_hosts = _records_py.walk_store_hosts

# Request codes whose topic is counted, and where the topic sits in extFields.
_SEND_V1 = 10
_SEND_V2 = 310
_SEND_BATCH = 320
_SEND_REPLY_V1 = 324
_SEND_REPLY_V2 = 325
_PULL = 11
_LITE_PULL = 361

_I32 = struct.Struct(">i")


def code_slot(code: int) -> int:
    """Index of ``code`` in the action and counter tables."""
    if type(code) is not int or not -(1 << 63) <= code < 1 << 63:  # a C long in the compiled twin
        code = c_int("code", code)
    if 0 <= code < 1024:
        return code
    if 200000 <= code < 200000 + 1023:
        return 1024 + code - 200000
    return OTHER_SLOT


def slot_code(slot: int) -> int | None:
    """Inverse of :func:`code_slot`; ``None`` for the shared 'other' slot."""
    slot = c_int("slot", slot, "int")
    if slot < 1024:
        return slot
    if slot < OTHER_SLOT:
        return 200000 + slot - 1024
    return None


class ScanStats:
    """Counters shared by every scanner of one worker process (read by the metrics publisher)."""

    def __init__(self) -> None:
        self.request_counts = [0] * CODE_SLOTS
        self.request_bytes = [0] * CODE_SLOTS
        self.response_counts = [0] * CODE_SLOTS
        self.frames = 0
        self.bytes = 0
        self.protocol_errors = 0
        # topic -> [sends, messages, pulls, bytes]
        self._topics: dict[bytes, list[int]] = {}
        # slot -> [bucket counts..., sum of nanoseconds]
        self._latency: dict[int, list[int]] = {}
        # (slot, result index) -> count
        self._results: dict[tuple[int, int], int] = {}
        #: Requests not timed because their connection already tracked MAX_TRACKED.
        self.untracked = 0
        self._sample_every = 0
        self._sample_left = 0
        self._samples: list[tuple[int, int, int, int, bytes, int, int, int]] = []
        #: Sampled requests lost because nobody took them (ring of SAMPLE_RING entries full).
        self.samples_dropped = 0

    def set_sampling(self, every: int) -> None:
        """Keep one completed request in ``every`` (0: none) for :meth:`take_samples`."""
        every = c_int("sampling interval", every, "uint32")  # OverflowError when negative, as in C
        self._sample_every = self._sample_left = every

    def sample(self, t: int, lat: int, slot: int, resp_code: int, topic: bytes, conn: int, req_bytes: int,
               resp_bytes: int) -> None:
        if not self._sample_every:
            return
        self._sample_left -= 1
        if self._sample_left:
            return
        self._sample_left = self._sample_every
        if len(self._samples) >= SAMPLE_RING:
            self.samples_dropped += 1
            return
        self._samples.append((t, lat, slot, resp_code, topic, conn, req_bytes, resp_bytes))

    def take_samples(self) -> list[tuple[int, int, int, int, bytes, int, int, int]]:
        """The sampled requests since the last call: ``(start ns, latency ns, request code slot,
        response code, topic, connection id, request bytes, response bytes)``."""
        out, self._samples = self._samples, []
        return out

    def observe(self, slot: int, ns: int, result: int) -> None:
        """A request of code slot ``slot`` ended with ``result`` after ``ns`` nanoseconds."""
        slot, result = self._check(slot, result)
        ns = max(c_int("ns", ns), 0)  # a clock step back counts as 0 ns (as in the compiled twin)
        h = self._latency.get(slot)
        if h is None:
            h = self._latency[slot] = [0] * (LATENCY_BUCKETS + 1)
        h[latency_bucket(ns)] += 1
        h[LATENCY_BUCKETS] += ns
        self.count_result(slot, result)

    def count_result(self, slot: int, result: int) -> None:
        """A request ended without a timed round trip (oneway, answered by the proxy, unanswered)."""
        slot, result = self._check(slot, result)
        key = (slot, result)
        self._results[key] = self._results.get(key, 0) + 1

    @staticmethod
    def _check(slot: int, result: int) -> tuple[int, int]:
        slot, result = c_int("slot", slot, "int"), c_int("result", result, "int")
        if not 0 <= slot < CODE_SLOTS or not 0 <= result < len(RESULTS):
            raise ValueError(f"slot {slot} / result {result} out of range")
        return slot, result

    def latencies(self) -> list[tuple[int, tuple[int, ...], int]]:
        """``(slot, bucket counts, sum of ns)`` for every slot with a timed request."""
        return [(s, tuple(h[:LATENCY_BUCKETS]), h[LATENCY_BUCKETS]) for s, h in sorted(self._latency.items())]

    def results(self) -> list[tuple[int, int, int]]:
        """``(slot, result index, count)`` for every non-zero pair."""
        return [(s, r, n) for (s, r), n in sorted(self._results.items())]

    def _topic_slot(self, topic: bytes) -> list[int]:
        entry = self._topics.get(topic)
        if entry is None:
            if len(topic) > MAX_TOPIC_LEN or len(self._topics) >= TOPIC_SLOTS - 1:
                topic = OTHER_TOPIC
                entry = self._topics.get(topic)
            if entry is None:
                entry = [0, 0, 0, 0]
                self._topics[topic] = entry
        return entry

    def topics(self) -> list[tuple[bytes, int, int, int, int]]:
        """``(topic, sends, messages, pulls, bytes)`` for every topic seen so far."""
        return [(t, *v) for t, v in self._topics.items()]  # type: ignore[misc]

    def requests(self) -> list[tuple[int, int, int]]:
        """``(slot, count, bytes)`` for every request-code slot with a non-zero count."""
        return [
            (s, self.request_counts[s], self.request_bytes[s])
            for s in range(CODE_SLOTS)
            if self.request_counts[s]
        ]

    def responses(self) -> list[tuple[int, int]]:
        """``(slot, count)`` for every response-code slot with a non-zero count."""
        return [(s, self.response_counts[s]) for s in range(CODE_SLOTS) if self.response_counts[s]]


class InFlight:
    """Requests of one connection awaiting their response: (direction, opaque) -> (slot, start ns).

    Both scanners of a relayed connection share one: the client-to-upstream scanner (direction
    0) tracks client requests and takes the answers to the upstream's requests, the other one
    (direction 1) the reverse.  Requests that need policy are tracked by the relay once it has
    forwarded them.
    """

    def __init__(self, capacity: int = MAX_TRACKED) -> None:
        capacity = c_int("capacity", capacity, "ssize")  # the compiled twin's conversion and errors
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._pending: dict[tuple[int, int], tuple[int, int, int, bytes]] = {}
        self._want: dict[tuple[int, int], int] = {}  # requests whose answer is wanted: 1 policy, 2 records

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def nwant(self) -> int:
        return len(self._want)

    def track(self, direction: int, opaque: int, slot: int, now_ns: int, req_bytes: int = 0,
              topic: bytes = b"", want: int = 0) -> bool:
        """``want``: 0 (or False) nothing, 1 (or True) a filter wants the answer, 2 the scanner
        maps the store hosts of its records."""
        # the C types of the compiled twin's arguments: the same conversions and errors
        direction, opaque = c_int("direction", direction, "int"), c_int("opaque", opaque, "int")
        slot, now_ns = c_int("slot", slot, "int"), c_int("now_ns", now_ns)
        req_bytes = c_int("req_bytes", req_bytes)
        want = c_int("want", want, "int")
        if not 0 <= want <= 2:
            raise ValueError(f"want must be 0, 1 or 2, got {want}")
        key = (direction, opaque)
        if len(self._pending) >= self.capacity and key not in self._pending:
            return False
        self._pending[key] = (slot, now_ns, req_bytes, topic)
        if want:
            self._want[key] = want
        else:
            self._want.pop(key, None)
        return True

    def wants(self, direction: int, opaque: int) -> bool:
        """Whether a filter wants the answer to this request (the entry stays)."""
        return (direction, opaque) in self._want

    def want_of(self, direction: int, opaque: int) -> int:
        """-1: not tracked; else what is wanted of its answer (0 nothing, 1 policy, 2 records)."""
        direction, opaque = c_int("direction", direction, "int"), c_int("opaque", opaque, "int")
        key = (direction, opaque)
        if key not in self._pending:
            return -1
        return self._want.get(key, 0)

    def take(self, direction: int, opaque: int) -> tuple[int, int] | None:
        e = self.take_full(c_int("direction", direction, "int"), c_int("opaque", opaque, "int"))
        return None if e is None else (e[0], e[1])

    def take_full(self, direction: int, opaque: int) -> tuple[int, int, int, bytes] | None:
        self._want.pop((direction, opaque), None)
        return self._pending.pop((direction, opaque), None)

    def waiting(self, direction: int) -> list[tuple[int, int]]:
        """``[(opaque, slot)]`` of the requests of ``direction`` still waiting, oldest first."""
        direction = c_int("direction", direction, "int")
        found = sorted((e[1], o, e[0]) for (d, o), e in self._pending.items() if d == direction)
        return [(o, s) for _, o, s in found]

    def abandon(self, stats: ScanStats) -> int:
        """The connection closed: every request still waiting ends as ``unanswered``."""
        if not isinstance(stats, ScanStats):
            raise TypeError(f"stats must be a {__name__}.ScanStats, "
                            f"got {type(stats).__module__}.{type(stats).__name__}")
        n = len(self._pending)
        for slot, *_ in self._pending.values():
            stats.count_result(slot, R_UNANSWERED)
        self._pending.clear()
        self._want.clear()
        return n


def delay_topic(patterns: list[bytes], topic: bytes) -> bool:
    """``topic`` is one of ``patterns``: a name, or a prefix ending in '*' ('*' alone: every topic)."""
    for pat in patterns:
        if not isinstance(pat, bytes):
            raise TypeError(f"Expected bytes, got {type(pat).__name__}")
        if pat[-1:] == b"*":
            if topic.startswith(pat[:-1]):
                return True
        elif topic == pat:
            return True
    return False


class FrameScanner:
    """Walks Remoting frames in receive buffers; see the module docstring."""

    def __init__(
        self,
        stats: ScanStats,
        *,
        actions: bytes | None = None,
        response_policy: bool = False,
        max_frame_size: int = DEFAULT_MAX_FRAME,
        max_header_size: int = DEFAULT_MAX_HEADER,
        inflight: InFlight | None = None,
        direction: int = 0,
        limiter: Any = None,
    ) -> None:
        # the compiled twin's argument types: the same conversions and errors (rmqfast._args)
        for name, v, cls in (("stats", stats, ScanStats), ("inflight", inflight, InFlight)):
            if not isinstance(v, cls) and (v is not None or name == "stats"):
                raise TypeError(f"{name} must be a {__name__}.{cls.__name__}"
                                f"{'' if name == 'stats' else ' or None'}, got {type(v).__module__}.{type(v).__name__}")
        if limiter is not None:
            from rmqfast.limits._limiter_py import Limiter

            if not isinstance(limiter, Limiter):
                raise TypeError(f"limiter must be a rmqfast.limits._limiter_py.Limiter or None, "
                                f"got {type(limiter).__module__}.{type(limiter).__name__}")
        direction = c_int("direction", direction, "int")
        max_frame_size = c_int("max_frame_size", max_frame_size, "ssize")
        max_header_size = c_int("max_header_size", max_header_size, "ssize")
        if direction not in (0, 1):
            raise ValueError(f"direction must be 0 (client to upstream) or 1 (upstream to client), got {direction!r}")
        if max_frame_size < 8:
            raise ValueError(f"max_frame_size must be at least 8, got {max_frame_size!r}")
        if max_header_size < 1:
            raise ValueError(f"max_header_size must be positive, got {max_header_size!r}")
        self.stats = stats
        self.response_policy = response_policy
        self.max_frame_size = max_frame_size
        self.max_header_size = max_header_size
        self._actions = bytearray(CODE_SLOTS)
        if actions is not None:
            self.set_actions(actions)
        self._skip = 0
        self.inflight = inflight
        self.direction = direction
        #: send limits (rmqfast.limits); ``limited`` is the rejecting rule of the last EV_POLICY, else -1
        self.limiter = limiter
        self.limited = -1
        #: the relay's connection id, carried into sampled records
        self.conn_id = 0
        self._delay_topics: list[bytes] | None = None
        self._policy_topics: list[bytes] | None = None
        self._address_map: AddressMap | None = None
        #: 1 when the last ``EV_POLICY`` is a records answer the scanner did not map (its store hosts
        #: are the policy's to map: an address the map does not know, or a body it could not walk)
        self.records = 0
        #: Non-oneway requests seen (for in-flight accounting by the peer direction).
        self.requests = 0
        #: Responses seen.
        self.responses = 0
        #: Why the last ``EV_ERROR`` happened.
        self.error = ""
        #: code / flag / opaque of the frame returned by the last ``EV_POLICY``.
        self.code = 0
        self.flag = 0
        self.opaque = 0

    @property
    def delay_topics(self) -> list[bytes] | None:
        """``[delay]`` topics (bytes; a trailing ``*`` makes a prefix): their sends that ask for a
        delivery time go to the policy (EV_POLICY), the other sends stay on the fast path."""
        return self._delay_topics

    @delay_topics.setter
    def delay_topics(self, value: list[bytes] | None) -> None:
        if value is not None and type(value) is not list:
            raise TypeError(f"Expected list, got {type(value).__name__}")
        self._delay_topics = value

    @property
    def policy_topics(self) -> list[bytes] | None:
        """Topics (bytes; a trailing ``*`` makes a prefix) whose every send goes to the policy
        (EV_POLICY), whatever the action table says of the send codes."""
        return self._policy_topics

    @policy_topics.setter
    def policy_topics(self, value: list[bytes] | None) -> None:
        if value is not None and type(value) is not list:
            raise TypeError(f"Expected list, got {type(value).__name__}")
        self._policy_topics = value

    @property
    def address_map(self) -> AddressMap | None:
        """Store hosts of records answers (the answers to ``ACTION_RECORDS`` requests): mapped in
        place when every one is known here, else the answer goes to the policy.  None: always
        to the policy."""
        return self._address_map

    @address_map.setter
    def address_map(self, value: AddressMap | None) -> None:
        if value is not None and not isinstance(value, AddressMap):
            raise TypeError(f"Cannot convert {type(value).__name__} to rmqfast._speedups.AddressMap")
        self._address_map = value

    def set_actions(self, actions: bytes) -> None:
        if len(actions) != CODE_SLOTS:
            raise ValueError(f"action table must have {CODE_SLOTS} entries, got {len(actions)}")
        self._actions[:] = actions

    # The pure-Python twin of the C scanner, branch for branch, run per frame: splitting it would add
    # Python calls per frame.
    def scan(  # noqa: C901
        self, buf: bytes | bytearray | memoryview, start: int, end: int, now_ns: int = -1
    ) -> tuple[int, int, int]:
        """See the module docstring; ``now_ns`` (monotonic) times requests, read once per call if -1."""
        # the compiled twin's C argument types: the same conversions and errors
        start, end = c_int("start", start, "ssize"), c_int("end", end, "ssize")
        now_ns = c_int("now_ns", now_ns)
        if now_ns < 0 and self.inflight is not None:
            now_ns = time.monotonic_ns()
        mv = memoryview(buf)
        if start < 0 or end > len(mv) or start > end:
            raise ValueError(f"scan range [{start}:{end}] outside a buffer of {len(mv)} bytes")
        pos = start
        stats = self.stats
        if self._skip:
            take = min(self._skip, end - pos)
            self._skip -= take
            pos += take
            if self._skip:
                return EV_FORWARD, end, 0
        while pos < end:
            avail = end - pos
            if avail < 4:
                return EV_FORWARD, pos, 8
            # The length word alone can already be wrong: reject it without waiting for more.
            length = _I32.unpack_from(mv, pos)[0]
            if length < 4:
                return self._fail(pos, f"frame length {length} is shorter than the 4-byte header-length word")
            total = length + 4
            if total > self.max_frame_size:
                return self._fail(
                    pos, f"frame of {total} bytes exceeds the limit of {self.max_frame_size} bytes"
                )
            if avail < 8:
                return EV_FORWARD, pos, 8
            mark = _I32.unpack_from(mv, pos + 4)[0]
            stype = (mark >> 24) & 0xFF
            hlen = mark & 0xFFFFFF
            if stype > 1:
                return self._fail(pos, f"unknown serialize type {stype} (0 = JSON, 1 = ROCKETMQ)")
            if hlen > length - 4:
                return self._fail(pos, f"header length {hlen} exceeds frame length {length}")
            if hlen > self.max_header_size:
                return self._fail(
                    pos, f"header of {hlen} bytes exceeds the limit of {self.max_header_size} bytes"
                )
            if avail < 8 + hlen:
                return EV_FORWARD, pos, 8 + hlen
            header = bytes(mv[pos + 8 : pos + 8 + hlen])
            info = HeaderInfo()
            kind = "JSON" if stype == 0 else "ROCKETMQ"
            try:
                if stype == 0:
                    parse_json_header(header, info)
                else:
                    parse_binary_header(header, info)
            except HeaderError as exc:
                return self._fail(pos, f"invalid {kind} header: {exc}")
            code = info.code
            slot = code_slot(code)
            is_response = info.flag & 1
            limit_check = False
            batch = False
            topic = b""
            topic_name = b""
            tspan = pspan = None
            rec = False
            inflight = self.inflight
            if is_response:
                policy = self.response_policy
                if inflight is not None and inflight.nwant > 0:
                    want = inflight.want_of(self.direction ^ 1, info.opaque)
                    policy = policy or want == 1
                    rec = want == 2
            else:
                # The topic and properties the broker reads for this request code.
                # A send is a batch when its header's batch flag reads true, whatever its code
                # (SendMessageProcessor: requestHeader.isBatch()); reply messages never are.
                if code == _SEND_V2 or code == _SEND_BATCH or code == _SEND_REPLY_V2:
                    tspan, pspan = info.b, info.i
                    batch = info.m_true and code != _SEND_REPLY_V2
                elif code == _SEND_V1 or code == _SEND_REPLY_V1:
                    tspan, pspan = info.topic, info.props
                    batch = info.batch_true and code == _SEND_V1
                elif code == _PULL or code == _LITE_PULL:
                    tspan = info.topic
                if tspan is not None and tspan[2]:
                    return self._fail(pos, f"invalid {kind} header: {ERRORS[E_TOPIC_ESCAPED]}")
                policy = self._actions[slot] == ACTION_POLICY
                if self._actions[slot] == ACTION_RECORDS and not info.flag & 2:
                    # the scanner maps the store hosts of the answer (_records_py); one request per
                    # opaque, or its answer could not be told apart
                    if inflight is None:
                        policy = True
                    elif inflight.want_of(self.direction, info.opaque) >= 0:
                        return self._fail(pos, f"request {code} reuses opaque {info.opaque} while a request "
                                               "with it is unanswered (its answer could not be told apart and "
                                               "its broker addresses rewritten)")
                    elif len(inflight) >= inflight.capacity:
                        return self._fail(pos, f"more than {inflight.capacity} requests unanswered on one "
                                               "connection (the answers' broker addresses could not be rewritten)")
                    else:
                        rec = True
                elif inflight is not None and inflight.nwant > 0 and \
                        inflight.want_of(self.direction, info.opaque) == 2:
                    return self._fail(pos, f"request {code} reuses opaque {info.opaque} while a request "
                                           "whose answer's broker addresses are rewritten is unanswered")
                if not policy and tspan is not None and self._policy_topics and code != _PULL and code != _LITE_PULL:
                    # every send of these topics leaves the fast path (gray releases: split topics),
                    # reply messages too (the broker stores them in the header's topic and queue)
                    policy = delay_topic(self._policy_topics, header[tspan[0] : tspan[0] + tspan[1]])
                if not policy and tspan is not None and self._delay_topics and \
                        code in (_SEND_V2, _SEND_BATCH, _SEND_V1):
                    # proxy-held delay: only a delay topic's sends that ask for a delivery time
                    # (a batch: its messages' properties are in the body) leave the fast path
                    policy = delay_topic(self._delay_topics, header[tspan[0] : tspan[0] + tspan[1]]) and (
                        batch or (pspan is not None and props_delay(
                            header[pspan[0] : pspan[0] + pspan[1]], pspan[2])))
                limiter = self.limiter
                if limiter is not None and limiter.active and tspan is not None and \
                        code != _PULL and code != _LITE_PULL:  # sends and reply messages
                    topic = header[tspan[0] : tspan[0] + tspan[1]]
                    # a limited send is decided whole (a rejected one is never relayed)
                    limit_check = limiter.applies(topic)
            # Policy frames, batches (whose inner messages are counted) and limited sends are
            # only handled whole; everything else is forwarded as soon as its header is seen.
            if (policy or batch or limit_check or (rec and is_response and code == 0)) and avail < total:
                return EV_FORWARD, pos, total
            # Count the frame (exactly once: we only get here when it is complete or passed).
            stats.frames += 1
            stats.bytes += total
            if is_response:
                stats.response_counts[slot] += 1
                self.responses += 1
            else:
                stats.request_counts[slot] += 1
                stats.request_bytes[slot] += total
                if not info.flag & 2:
                    self.requests += 1
                topic_name = self._count_topic(mv, pos, hlen, total, code, tspan, batch)
            limited = -1
            if limit_check:
                if now_ns < 0:
                    now_ns = time.monotonic_ns()
                props = header[pspan[0] : pspan[0] + pspan[1]] if pspan is not None else None
                msgs = scanned_batch_count(bytes(mv[pos + 8 + hlen : pos + total])) if batch else 1
                limited = self.limiter.decide(topic, props, pspan is not None and pspan[2], msgs, total, now_ns)
                if limited >= 0:
                    policy = True
            if rec and is_response and not policy and code == 0 and 8 + hlen < total:
                # a records answer: its store hosts mapped in place, or the frame to policy
                amap = self._address_map
                if amap is None or mv.readonly or map_records(mv, pos + 8 + hlen, pos + total, amap) != REC_OK:
                    policy = True
            elif rec and is_response and not policy and 8 + hlen == total and (code == 0 or 10 <= code <= 12):
                # a send answer (SUCCESS, or stored with FLUSH_DISK_TIMEOUT 10, SLAVE_NOT_AVAILABLE 11,
                # FLUSH_SLAVE_TIMEOUT 12): the offset ids in its header mapped in place, or to policy
                amap = self._address_map
                if amap is None or mv.readonly or \
                        map_header_ids(mv, pos + 8, pos + 8 + hlen, stype, amap) != REC_OK:
                    policy = True
            if self.inflight is not None:
                self._time(slot, code, info.flag, info.opaque, now_ns, policy, total, topic_name,
                           ACTION_RECORDS if rec and not is_response else 0)
            if policy:
                self.records = int(rec and is_response)
                self.limited = limited
                self.code = code
                self.flag = info.flag
                self.opaque = info.opaque
                return EV_POLICY, pos, pos + total
            if avail < total:
                self._skip = total - avail
                return EV_FORWARD, end, 0
            pos += total
        return EV_FORWARD, pos, 0

    def _time(self, slot: int, code: int, flag: int, opaque: int, now_ns: int, policy: bool, total: int,
              topic: bytes, want: int = 0) -> None:
        inflight = self.inflight
        assert inflight is not None
        if flag & 1:
            started = inflight.take_full(self.direction ^ 1, opaque)
            if started is not None:
                lat = max(0, now_ns - started[1])
                self.stats.observe(started[0], lat, result_index(code))
                self.stats.sample(started[1], lat, started[0], code, started[3], self.conn_id, started[2], total)
        elif policy:
            return  # the relay tracks it if it forwards it
        elif flag & 2:
            self.stats.count_result(slot, R_ONEWAY)
        elif not inflight.track(self.direction, opaque, slot, now_ns, total, topic, want):
            self.stats.untracked += 1

    def _count_topic(
        self, mv: memoryview, pos: int, hlen: int, total: int, code: int, span: tuple[int, int, bool] | None,
        batch: bool,
    ) -> bytes:
        """Count a send or pull under its topic (``span``); the name it is counted under (b"": none)."""
        if span is None or code not in (_SEND_V2, _SEND_BATCH, _SEND_V1, _PULL, _LITE_PULL):
            return b""
        topic = bytes(mv[pos + 8 + span[0] : pos + 8 + span[0] + span[1]])
        entry = self.stats._topic_slot(topic)
        entry[3] += total
        if code == _PULL or code == _LITE_PULL:
            entry[2] += 1
        else:
            entry[0] += 1
            if batch:
                entry[1] += scanned_batch_count(bytes(mv[pos + 8 + hlen : pos + total]))
            else:
                entry[1] += 1
        return topic if topic in self.stats._topics else OTHER_TOPIC

    def _fail(self, pos: int, message: str) -> tuple[int, int, int]:
        self.error = message
        self.stats.protocol_errors += 1
        return EV_ERROR, pos, 0
