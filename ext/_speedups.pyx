# cython: language_level=3
"""Compiled hot path of rmqfast: the frame scanner and its counters.

This is the C twin of ``rmqfast/codec/_scan_py.py``; read that module's docstring for the
theory of operation.  Both implement the same algorithm step by step, and the test suite
runs them side by side on the same inputs.  The difference is that nothing here creates a
Python object per frame: the buffer is read through a raw pointer, counters are C arrays,
and topics are counted in an open-addressing table of fixed-size C strings.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyObject_GetBuffer, PyBuffer_Release
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcmp, memcpy

DEF CODE_SLOTS_C = 2048
DEF LAT_BUCKETS_C = 18      # len(LATENCY_BOUNDS_NS) + 1
DEF NRESULTS_C = 14         # len(RESULTS)
DEF R_ONEWAY_C = 12
DEF R_UNANSWERED_C = 13
DEF MAX_TRACKED_C = 65536
DEF TOPIC_SLOTS_C = 1024
DEF MAX_TOPIC_LEN_C = 255

EV_FORWARD = 0
EV_POLICY = 1
EV_ERROR = 2
ACTION_PASS = 0
ACTION_POLICY = 1
CODE_SLOTS = CODE_SLOTS_C
OTHER_SLOT = CODE_SLOTS_C - 1
TOPIC_SLOTS = TOPIC_SLOTS_C
MAX_TOPIC_LEN = MAX_TOPIC_LEN_C
OTHER_TOPIC = b"__other__"
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
DEFAULT_MAX_HEADER = 1024 * 1024
MAX_TRACKED = MAX_TRACKED_C

cdef int64_t[17] LAT_BOUNDS = [
    100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000, 25000000, 50000000,
    100000000, 250000000, 500000000, 1000000000, 2500000000, 5000000000, 10000000000,
    30000000000]

# The C tables as Python values, for tests/test_twins.py: every table copied from _scan_py by
# hand is asserted equal to its original there.
LATENCY_BOUNDS_NS = tuple([LAT_BOUNDS[i] for i in range(17)])
LATENCY_BUCKETS = LAT_BUCKETS_C
NRESULTS = NRESULTS_C
R_ONEWAY = R_ONEWAY_C
R_UNANSWERED = R_UNANSWERED_C

cdef extern from "<time.h>" nogil:
    ctypedef int clockid_t
    cdef struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(clockid_t clk, timespec* ts)
    enum: CLOCK_MONOTONIC


cdef inline int64_t monotonic_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int latency_bucket(int64_t ns) noexcept nogil:
    cdef int i
    for i in range(17):
        if ns <= LAT_BOUNDS[i]:
            return i
    return 17


cdef inline int result_index(int32_t code) noexcept nogil:
    # same table as _scan_py._RESULT_OF_CODE
    if code == 0: return 0
    if code == 1: return 1
    if code == 2: return 2
    if code == 3: return 3
    if code == 10 or code == 12: return 4
    if code == 11: return 5
    if code == 16: return 6
    if code == 17: return 7
    if code == 19 or code == 22: return 8
    if code == 20: return 9
    if code == 21: return 10
    return 11


def result_index_of(int32_t code):
    """:func:`result_index` from Python (tests compare it with _scan_py.result_index)."""
    return result_index(code)


def latency_bucket_of(int64_t ns):
    """:func:`latency_bucket` from Python (tests compare it with _scan_py.latency_bucket)."""
    return latency_bucket(ns)

cdef enum:
    SEND_V1 = 10
    SEND_V2 = 310
    SEND_BATCH = 320
    PULL = 11
    LITE_PULL = 361

cpdef int code_slot(long code):
    """Index of ``code`` in the action and counter tables."""
    if 0 <= code < 1024:
        return <int>code
    if 200000 <= code < 200000 + 1023:
        return <int>(1024 + code - 200000)
    return CODE_SLOTS_C - 1


def slot_code(int slot):
    """Inverse of :func:`code_slot`; ``None`` for the shared 'other' slot."""
    if slot < 1024:
        return slot
    if slot < CODE_SLOTS_C - 1:
        return 200000 + slot - 1024
    return None


cdef inline int32_t rd_i32(const uint8_t* p) nogil:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | <uint32_t>p[3])


cdef inline int16_t rd_i16(const uint8_t* p) nogil:
    return <int16_t>((<uint16_t>p[0] << 8) | <uint16_t>p[1])


cdef inline uint16_t rd_u16(const uint8_t* p) nogil:
    return <uint16_t>((<uint16_t>p[0] << 8) | <uint16_t>p[1])



cdef struct TopicEntry:
    uint64_t sends
    uint64_t messages
    uint64_t pulls
    uint64_t nbytes
    uint32_t hash
    int16_t length          # -1: empty slot
    char name[MAX_TOPIC_LEN_C + 1]


DEF SAMPLE_RING_C = 8192
SAMPLE_RING = SAMPLE_RING_C

cdef struct SampleRec:
    int64_t t_ns
    int64_t lat_ns
    int64_t req_bytes
    int64_t resp_bytes
    int32_t slot
    int32_t resp_code
    int32_t topic
    int32_t conn


cdef class ScanStats:
    """Counters shared by every scanner of one worker process (read by the metrics publisher)."""

    cdef uint64_t _req_counts[CODE_SLOTS_C]
    cdef uint64_t _req_bytes[CODE_SLOTS_C]
    cdef uint64_t _resp_counts[CODE_SLOTS_C]
    cdef TopicEntry* _topics
    cdef int _ntopics
    cdef public uint64_t frames
    cdef public uint64_t bytes
    cdef public uint64_t protocol_errors
    cdef public uint64_t untracked
    cdef uint64_t* _lat      # CODE_SLOTS_C rows of LAT_BUCKETS_C counts + the sum of ns
    cdef uint64_t* _res      # CODE_SLOTS_C rows of NRESULTS_C counts
    cdef SampleRec* _ring    # sampled requests, drained by the records writer once a second
    cdef Py_ssize_t _ring_len
    cdef uint32_t _sample_every, _sample_left
    cdef public uint64_t samples_dropped

    def __cinit__(self):
        cdef int i
        self._topics = <TopicEntry*>calloc(TOPIC_SLOTS_C, sizeof(TopicEntry))
        self._lat = <uint64_t*>calloc(CODE_SLOTS_C * (LAT_BUCKETS_C + 1), sizeof(uint64_t))
        self._res = <uint64_t*>calloc(CODE_SLOTS_C * NRESULTS_C, sizeof(uint64_t))
        if self._topics == NULL or self._lat == NULL or self._res == NULL:
            raise MemoryError()
        for i in range(TOPIC_SLOTS_C):
            self._topics[i].length = -1
        self._ntopics = 0

    def __init__(self):
        pass  # no arguments, as the pure twin (__cinit__ alone would accept and ignore any)

    def __dealloc__(self):
        free(self._topics)
        free(self._lat)
        free(self._res)
        free(self._ring)

    def set_sampling(self, uint32_t every):
        """Keep one completed request in ``every`` (0: none) for :meth:`take_samples`."""
        if every and self._ring == NULL:
            self._ring = <SampleRec*>malloc(SAMPLE_RING_C * sizeof(SampleRec))
            if self._ring == NULL:
                raise MemoryError()
        self._sample_every = every
        self._sample_left = every

    cdef inline void sample_c(self, int64_t t, int64_t lat, int slot, int32_t resp_code, int32_t topic,
                              int32_t conn, int64_t req_bytes, int64_t resp_bytes) noexcept:
        cdef SampleRec* r
        if self._sample_every == 0:
            return
        self._sample_left -= 1
        if self._sample_left:
            return
        self._sample_left = self._sample_every
        if self._ring_len >= SAMPLE_RING_C:
            self.samples_dropped += 1
            return
        r = &self._ring[self._ring_len]
        self._ring_len += 1
        r.t_ns, r.lat_ns, r.slot, r.resp_code, r.topic = t, lat, slot, resp_code, topic
        r.conn, r.req_bytes, r.resp_bytes = conn, req_bytes, resp_bytes

    def take_samples(self):
        """The sampled requests since the last call: ``(start ns, latency ns, request code slot,
        response code, topic, connection id, request bytes, response bytes)``."""
        cdef Py_ssize_t i
        cdef SampleRec* r
        cdef TopicEntry* e
        out = []
        for i in range(self._ring_len):
            r = &self._ring[i]
            topic = b""
            if r.topic >= 0:
                e = &self._topics[r.topic]
                topic = e.name[:e.length]
            out.append((r.t_ns, r.lat_ns, r.slot, r.resp_code, topic, r.conn, r.req_bytes, r.resp_bytes))
        self._ring_len = 0
        return out

    cdef inline void observe_c(self, int slot, int64_t ns, int result) noexcept nogil:
        cdef uint64_t* row = self._lat + slot * (LAT_BUCKETS_C + 1)
        row[latency_bucket(ns)] += 1
        row[LAT_BUCKETS_C] += <uint64_t>ns
        self._res[slot * NRESULTS_C + result] += 1

    def observe(self, int slot, int64_t ns, int result):
        """A request of code slot ``slot`` ended with ``result`` after ``ns`` nanoseconds."""
        self._check(slot, result)
        self.observe_c(slot, ns if ns > 0 else 0, result)

    def count_result(self, int slot, int result):
        """A request ended without a timed round trip (oneway, answered by the proxy, unanswered)."""
        self._check(slot, result)
        self._res[slot * NRESULTS_C + result] += 1

    cdef _check(self, int slot, int result):
        if not 0 <= slot < CODE_SLOTS_C or not 0 <= result < NRESULTS_C:
            raise ValueError(f"slot {slot} / result {result} out of range")

    def latencies(self):
        """``(slot, bucket counts, sum of ns)`` for every slot with a timed request."""
        cdef int i, b
        cdef uint64_t* row
        out = []
        for i in range(CODE_SLOTS_C):
            row = self._lat + i * (LAT_BUCKETS_C + 1)
            for b in range(LAT_BUCKETS_C):
                if row[b]:
                    out.append((i, tuple([row[k] for k in range(LAT_BUCKETS_C)]), row[LAT_BUCKETS_C]))
                    break
        return out

    def results(self):
        """``(slot, result index, count)`` for every non-zero pair."""
        cdef int i, r
        return [(i, r, self._res[i * NRESULTS_C + r])
                for i in range(CODE_SLOTS_C) for r in range(NRESULTS_C) if self._res[i * NRESULTS_C + r]]

    @property
    def request_counts(self):
        return [self._req_counts[i] for i in range(CODE_SLOTS_C)]

    @property
    def request_bytes(self):
        return [self._req_bytes[i] for i in range(CODE_SLOTS_C)]

    @property
    def response_counts(self):
        return [self._resp_counts[i] for i in range(CODE_SLOTS_C)]

    def requests(self):
        """``(slot, count, bytes)`` for every request-code slot with a non-zero count."""
        return [(i, self._req_counts[i], self._req_bytes[i])
                for i in range(CODE_SLOTS_C) if self._req_counts[i]]

    def responses(self):
        """``(slot, count)`` for every response-code slot with a non-zero count."""
        return [(i, self._resp_counts[i]) for i in range(CODE_SLOTS_C) if self._resp_counts[i]]

    def topics(self):
        """``(topic, sends, messages, pulls, bytes)`` for every topic seen so far."""
        cdef int i
        out = []
        for i in range(TOPIC_SLOTS_C):
            if self._topics[i].length >= 0:
                e = &self._topics[i]
                out.append((e.name[:e.length], e.sends, e.messages, e.pulls, e.nbytes))
        return out

    cdef TopicEntry* topic_slot(self, const uint8_t* name, int length) noexcept nogil:
        cdef uint32_t h = 2166136261u
        cdef int i
        cdef uint32_t idx
        cdef TopicEntry* e
        if length > MAX_TOPIC_LEN_C:
            return self.other_topic()
        for i in range(length):
            h = (h ^ name[i]) * 16777619u
        idx = h & (TOPIC_SLOTS_C - 1)
        for i in range(TOPIC_SLOTS_C):
            e = &self._topics[idx]
            if e.length < 0:
                # Keep one slot free for the overflow bucket.
                if self._ntopics >= TOPIC_SLOTS_C - 1:
                    return self.other_topic()
                e.length = length
                e.hash = h
                memcpy(e.name, name, length)
                self._ntopics += 1
                return e
            if e.hash == h and e.length == length and memcmp(e.name, name, length) == 0:
                return e
            idx = (idx + 1) & (TOPIC_SLOTS_C - 1)
        # The table is full (1023 topics and the overflow bucket).
        return self.other_topic()

    cdef TopicEntry* other_topic(self) noexcept nogil:
        cdef uint32_t h = 2166136261u
        cdef const char* other = b"__other__"
        cdef int i, idx
        cdef TopicEntry* e
        for i in range(9):
            h = (h ^ <uint8_t>other[i]) * 16777619u
        idx = h & (TOPIC_SLOTS_C - 1)
        while True:
            e = &self._topics[idx]
            if e.length < 0:
                e.length = 9
                e.hash = h
                memcpy(e.name, other, 9)
                self._ntopics += 1
                return e
            if e.length == 9 and memcmp(e.name, other, 9) == 0:
                return e
            idx = (idx + 1) & (TOPIC_SLOTS_C - 1)


include "_header_walk.pxi"


# --------------------------------------------------------------------------------------------
# The limiter: GCRA token buckets whose state lives in memory shared by all worker processes.
#
# A bucket is one int64 in the shared file: its "theoretical arrival time" (TAT, CLOCK_MONOTONIC
# nanoseconds).  A send of n messages conforms when max(TAT, now) + n*interval - now stays within
# the burst tolerance (burst*interval); it is admitted by one compare-and-swap of the TAT.  Every
# worker runs the same rules (same config) against the same TATs, so the configured rate holds
# for the whole proxy instance however connections spread over workers.  A batch larger than the
# burst passes only when its bucket is full, and is charged in full (the long-run rate holds).
# The pure-Python twin (rmqfast.limits.gcra) does the same under an flock.

cdef extern from *:
    """
    static inline int rmq_cas64(int64_t *p, int64_t *expected, int64_t desired) {
        return __atomic_compare_exchange_n(p, expected, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
    static inline int64_t rmq_load64(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline int64_t rmq_add64(int64_t *p, int64_t v) { return __atomic_add_fetch(p, v, __ATOMIC_ACQ_REL); }
    """
    bint rmq_cas64(int64_t* p, int64_t* expected, int64_t desired) nogil
    int64_t rmq_load64(int64_t* p) nogil
    int64_t rmq_add64(int64_t* p, int64_t v) nogil

DEF SLOT_WORDS_C = 8          # int64 words per shared slot: [msgs TAT, bytes TAT, unused...]
DEF MAX_RULES_C = 1023        # slot 0 is the global bucket
DEF LIM_TOPICS_C = 1024
DEF SHM_HEADER_C = 64         # the shared file's header; the buckets follow it
SLOT_WORDS = SLOT_WORDS_C
SLOT_BYTES = SLOT_WORDS_C * 8
MAX_RULES = MAX_RULES_C
MODE_LIMIT = 0
MODE_REJECT = 1
MODE_OPEN = 2
# The shared bucket file starts with a header (rmqfast.limits.create_shared writes it, and
# rmqfast._args.check_shared_header reads it for both twins) naming the twin whose locking the
# buckets use: compiled CAS and pure-Python flock would lose each other's updates.
SHM_HEADER_BYTES = SHM_HEADER_C
SHM_BYTES = SHM_HEADER_C + SLOT_WORDS_C * 8 * (MAX_RULES_C + 1)
IMPLEMENTATION = "compiled"


cdef struct Rule:
    double interval          # ns per message (0: no message limit)
    double tolerance         # burst * interval
    double binterval         # ns per byte (0: no byte limit)
    double btolerance
    int mode
    int slot
    int tlen                 # topic pattern length; prefix patterns end with '*' (not stored)
    int glen                 # tag length; -1: any tag
    bint prefix
    uint8_t topic[256]
    uint8_t tag[256]


cdef struct LimTopic:
    uint32_t hash
    int length               # -1: empty
    int gen
    int topic_rule           # best topic rule (-1: none)
    bint has_tag_rules
    uint8_t name[256]


cdef inline bint gcra(int64_t* tat_p, int64_t now, double interval, double tolerance, int64_t n,
                      int64_t* charged) noexcept nogil:
    cdef int64_t cost = <int64_t>(interval * n + 0.5)
    cdef int64_t tol = <int64_t>tolerance
    cdef int64_t tat = rmq_load64(tat_p)
    cdef int64_t base, new
    while True:
        base = tat if tat > now else now
        new = base + cost
        if base - now > tol - (cost if cost < tol else tol):
            return False
        if rmq_cas64(tat_p, &tat, new):
            charged[0] = cost
            return True


cdef class Limiter:
    """Per-topic / per-tag / global send limits of one worker over shared buckets."""

    cdef object _shm             # the mapped shared file (kept alive)
    cdef int64_t* slots
    cdef Py_ssize_t nslots
    cdef Rule* rules
    cdef readonly int nrules
    cdef int global_rule         # index into rules of the global limit (-1: none)
    cdef bint any_tag_rules
    cdef int gen
    cdef LimTopic* topics
    cdef uint64_t* admitted      # per rule: messages admitted / rejected
    cdef uint64_t* rejected
    cdef readonly bint active

    def __cinit__(self, shm):
        cdef Py_buffer view
        PyObject_GetBuffer(shm, &view, PyBUF_WRITABLE)
        try:
            from rmqfast._args import check_shared_header
            check_shared_header(shm, IMPLEMENTATION, SHM_BYTES)
            self.slots = <int64_t*>(<char*>view.buf + SHM_HEADER_C)
            self.nslots = MAX_RULES_C + 1
        finally:
            PyBuffer_Release(&view)
        self._shm = shm  # the mmap object outlives the buffer view: the pointer stays valid
        self.rules = <Rule*>calloc(MAX_RULES_C + 1, sizeof(Rule))
        self.topics = <LimTopic*>calloc(LIM_TOPICS_C, sizeof(LimTopic))
        self.admitted = <uint64_t*>calloc(MAX_RULES_C + 1, sizeof(uint64_t))
        self.rejected = <uint64_t*>calloc(MAX_RULES_C + 1, sizeof(uint64_t))
        if self.rules == NULL or self.topics == NULL or self.admitted == NULL or self.rejected == NULL:
            raise MemoryError()
        self.global_rule = -1
        self.gen = 1
        self._clear_topics()

    def __dealloc__(self):
        free(self.rules)
        free(self.topics)
        free(self.admitted)
        free(self.rejected)

    cdef void _clear_topics(self) noexcept:
        cdef int i
        for i in range(LIM_TOPICS_C):
            self.topics[i].length = -1

    def configure(self, rules):
        """Replace the rules: a list of (topic, tag or None, rate, burst, bytes_rate, bytes_burst, mode, slot).

        ``topic`` is a name, ``prefix*`` or ``*``; an empty topic marks the global limit.  The
        per-rule counters restart (the metrics publisher keeps its own running totals).
        """
        from rmqfast._args import limit_rules
        rules = limit_rules(rules)  # the same checks (and errors) as the pure twin, before any change
        cdef int i, n = len(rules)
        cdef Rule* r
        self.global_rule = -1
        self.any_tag_rules = False
        for i in range(n):
            topic, tag, rate, burst, brate, bburst, mode, slot = rules[i]
            r = &self.rules[i]
            r.prefix = topic.endswith(b"*")
            if r.prefix:
                topic = topic[:len(topic) - 1]
            r.tlen = len(topic)
            memcpy(r.topic, <const char*>topic, r.tlen)
            if tag is None:
                r.glen = -1
            else:
                r.glen = len(tag)
                memcpy(r.tag, <const char*>tag, r.glen)
                self.any_tag_rules = True
            r.interval = 1e9 / rate if rate > 0 else 0
            r.tolerance = burst * r.interval
            r.binterval = 1e9 / brate if brate > 0 else 0
            r.btolerance = bburst * r.binterval
            r.mode = mode
            r.slot = slot
            self.admitted[i] = 0
            self.rejected[i] = 0
            if r.tlen == 0 and not r.prefix and r.glen < 0:
                self.global_rule = i
        self.nrules = n
        self.active = n > 0
        self.gen += 1
        self._clear_topics()

    def counters(self):
        """``(rule index, admitted messages, rejected messages)`` per rule."""
        return [(i, self.admitted[i], self.rejected[i]) for i in range(self.nrules)]

    cdef int _topic_rule(self, const uint8_t* t, int n, bint* has_tags) noexcept:
        """Best topic rule without a tag: exact name, then the longest prefix, then '*'."""
        cdef int i, best = -1, best_len = -1
        cdef Rule* r
        has_tags[0] = False
        for i in range(self.nrules):
            r = &self.rules[i]
            if i == self.global_rule:
                continue
            if r.prefix:
                if r.tlen > n or memcmp(r.topic, t, r.tlen) != 0:
                    continue
            elif r.tlen != n or memcmp(r.topic, t, n) != 0:
                continue
            if r.glen >= 0:
                has_tags[0] = True
                continue
            if not r.prefix:
                best, best_len = i, 1 << 20
            elif r.tlen > best_len:
                best, best_len = i, r.tlen
        return best

    cdef LimTopic* _lookup(self, const uint8_t* t, int n, LimTopic* scratch) noexcept:
        cdef uint32_t h = 2166136261u
        cdef int i
        cdef uint32_t idx
        cdef LimTopic* e
        cdef bint has_tags
        if n > 255:
            n = 255
        for i in range(n):
            h = (h ^ t[i]) * 16777619u
        idx = h & (LIM_TOPICS_C - 1)
        for i in range(16):  # short probe: a miss beyond it resolves without caching
            e = &self.topics[idx]
            if e.length < 0 or (e.hash == h and e.length == n and memcmp(e.name, t, n) == 0):
                if e.length < 0 or e.gen != self.gen:
                    e.hash = h
                    e.length = n
                    memcpy(e.name, t, n)
                    e.topic_rule = self._topic_rule(t, n, &has_tags)
                    e.has_tag_rules = has_tags
                    e.gen = self.gen
                return e
            idx = (idx + 1) & (LIM_TOPICS_C - 1)
        scratch.topic_rule = self._topic_rule(t, n, &has_tags)
        scratch.has_tag_rules = has_tags
        return scratch

    cdef bint applies(self, const uint8_t* t, int n) noexcept:
        """Whether any rule may limit a send to this topic (then the scanner needs the whole frame)."""
        cdef LimTopic scratch
        cdef LimTopic* e
        if self.global_rule >= 0:
            return True
        e = self._lookup(t, n, &scratch)
        return e.topic_rule >= 0 or e.has_tag_rules

    cdef int decide(self, const uint8_t* t, int n, const uint8_t* props, Py_ssize_t plen, bint esc,
                    int64_t msgs, int64_t nbytes, int64_t now) noexcept:
        """-1: admitted; else the index of the rule that rejected the send."""
        cdef LimTopic scratch
        cdef LimTopic* e = self._lookup(t, n, &scratch)
        cdef int chain[3]
        cdef int nchain = 0, i, k, r_i
        cdef Py_ssize_t glen = 0
        cdef const uint8_t* tag
        cdef Rule* r
        cdef int64_t charged_m[3]
        cdef int64_t charged_b[3]
        if e.has_tag_rules and props != NULL:
            tag = props_tag(props, plen, esc, &glen)
            if tag != NULL:
                for i in range(self.nrules):
                    r = &self.rules[i]
                    if r.glen == glen and memcmp(r.tag, tag, glen) == 0 and i != self.global_rule:
                        if (r.prefix and r.tlen <= n and memcmp(r.topic, t, r.tlen) == 0) or \
                                (not r.prefix and r.tlen == n and memcmp(r.topic, t, n) == 0):
                            chain[nchain] = i
                            nchain += 1
                            break
        if e.topic_rule >= 0:
            chain[nchain] = e.topic_rule
            nchain += 1
        if self.global_rule >= 0:
            chain[nchain] = self.global_rule
            nchain += 1
        for k in range(nchain):
            r_i = chain[k]
            r = &self.rules[r_i]
            charged_m[k] = 0
            charged_b[k] = 0
            if r.mode == MODE_OPEN:
                continue
            if r.mode == MODE_REJECT or \
                    (r.interval > 0 and not gcra(self.slots + r.slot * SLOT_WORDS_C, now, r.interval,
                                                 r.tolerance, msgs, &charged_m[k])) or \
                    (r.binterval > 0 and not gcra(self.slots + r.slot * SLOT_WORDS_C + 1, now, r.binterval,
                                                  r.btolerance, nbytes, &charged_b[k])):
                # refund what the earlier buckets (and this one's message bucket) charged
                for i in range(k + 1):
                    r = &self.rules[chain[i]]
                    if charged_m[i]:
                        rmq_add64(self.slots + r.slot * SLOT_WORDS_C, -charged_m[i])
                    if charged_b[i]:
                        rmq_add64(self.slots + r.slot * SLOT_WORDS_C + 1, -charged_b[i])
                self.rejected[r_i] += msgs
                return r_i
        for k in range(nchain):
            self.admitted[chain[k]] += msgs
        return -1

    def admit(self, topic, tag=None, int64_t msgs=1, int64_t nbytes=0, int64_t now_ns=-1):
        """One decision from Python (tests, benchmarks): -1 admitted, else the rejecting rule."""
        cdef bytes t = bytes(topic)
        cdef bytes props = b"TAGS\x01" + bytes(tag) + b"\x02" if tag is not None else b""
        if now_ns < 0:
            now_ns = monotonic_ns()
        return self.decide(<const uint8_t*><const char*>t, len(t), <const uint8_t*><const char*>props,
                           len(props), False, msgs, nbytes, now_ns)


cdef struct PendingEntry:
    int64_t key          # -1: empty; else direction << 32 | (uint32) opaque
    int32_t slot
    int32_t topic        # index in the stats' topic table (-1: none), for sampled records
    int32_t want         # a filter wants the answer (the scanner stops at it for policy)
    int64_t t_ns
    int64_t req_bytes


cdef class InFlight:
    """Requests of one connection awaiting their response (the C twin of ``_scan_py.InFlight``).

    Open addressing with linear probing and backward-shift deletion; it grows while it is at
    most half full and never beyond ``capacity`` entries.
    """

    cdef PendingEntry* tab
    cdef Py_ssize_t size, count
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t nwant   # entries whose answer a filter wants

    def __cinit__(self, Py_ssize_t capacity=MAX_TRACKED_C):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.size = 16
        self.count = 0
        self.tab = self._alloc(16)

    cdef PendingEntry* _alloc(self, Py_ssize_t n) except NULL:
        cdef PendingEntry* t = <PendingEntry*>malloc(n * sizeof(PendingEntry))
        cdef Py_ssize_t i
        if t == NULL:
            raise MemoryError()
        for i in range(n):
            t[i].key = -1
        return t

    def __dealloc__(self):
        free(self.tab)

    def __len__(self):
        return self.count

    cdef inline Py_ssize_t _home(self, int64_t key) noexcept nogil:
        return <Py_ssize_t>((<uint64_t>key * 11400714819323198485ULL) >> 40) & (self.size - 1)

    cdef int _grow(self) except -1:
        cdef PendingEntry* old = self.tab
        cdef Py_ssize_t n = self.size, i, j
        self.tab = self._alloc(n * 2)
        self.size = n * 2
        for i in range(n):
            if old[i].key >= 0:
                j = self._home(old[i].key)
                while self.tab[j].key >= 0:
                    j = (j + 1) & (self.size - 1)
                self.tab[j] = old[i]
        free(old)
        return 0

    cdef int track_c(self, int direction, int32_t opaque, int slot, int64_t now, int64_t req_bytes=0,
                     int32_t topic=-1, bint want=False) except -1:
        """1 when tracked, 0 when the connection already tracks ``capacity`` requests."""
        cdef int64_t key = (<int64_t>direction << 32) | <uint32_t>opaque
        cdef Py_ssize_t j = self._home(key)
        while self.tab[j].key >= 0:
            if self.tab[j].key == key:
                self.nwant += (1 if want else 0) - (1 if self.tab[j].want else 0)
                self.tab[j].slot = slot
                self.tab[j].t_ns = now
                self.tab[j].req_bytes = req_bytes
                self.tab[j].topic = topic
                self.tab[j].want = want
                return 1
            j = (j + 1) & (self.size - 1)
        if self.count >= self.capacity:
            return 0
        if 2 * (self.count + 1) > self.size:
            self._grow()
            j = self._home(key)
            while self.tab[j].key >= 0:
                j = (j + 1) & (self.size - 1)
        self.tab[j].key = key
        self.tab[j].slot = slot
        self.tab[j].t_ns = now
        self.tab[j].req_bytes = req_bytes
        self.tab[j].topic = topic
        self.tab[j].want = want
        self.count += 1
        if want:
            self.nwant += 1
        return 1

    cdef bint wants_c(self, int direction, int32_t opaque) noexcept:
        """Whether a filter wants the answer to this request (the entry stays)."""
        cdef int64_t key = (<int64_t>direction << 32) | <uint32_t>opaque
        cdef Py_ssize_t j = self._home(key)
        while self.tab[j].key >= 0:
            if self.tab[j].key == key:
                return self.tab[j].want != 0
            j = (j + 1) & (self.size - 1)
        return False

    cdef bint take_c(self, int direction, int32_t opaque, int* slot, int64_t* t, int64_t* req_bytes=NULL,
                     int32_t* topic=NULL) noexcept:
        cdef int64_t key = (<int64_t>direction << 32) | <uint32_t>opaque
        cdef Py_ssize_t mask = self.size - 1
        cdef Py_ssize_t j = self._home(key), k, h
        while self.tab[j].key >= 0:
            if self.tab[j].key == key:
                slot[0] = self.tab[j].slot
                t[0] = self.tab[j].t_ns
                if req_bytes != NULL:
                    req_bytes[0] = self.tab[j].req_bytes
                if topic != NULL:
                    topic[0] = self.tab[j].topic
                if self.tab[j].want:
                    self.nwant -= 1
                # backward-shift deletion keeps every probe chain unbroken
                k = (j + 1) & mask
                while self.tab[k].key >= 0:
                    h = self._home(self.tab[k].key)
                    if ((k - h) & mask) >= ((k - j) & mask):
                        self.tab[j] = self.tab[k]
                        j = k
                    k = (k + 1) & mask
                self.tab[j].key = -1
                self.count -= 1
                return True
            j = (j + 1) & mask
        return False

    def track(self, int direction, int32_t opaque, int slot, int64_t now_ns, int64_t req_bytes=0,
              int32_t topic=-1, bint want=False):
        return self.track_c(direction, opaque, slot, now_ns, req_bytes, topic, want) == 1

    def take(self, int direction, int32_t opaque):
        cdef int slot
        cdef int64_t t
        if self.take_c(direction, opaque, &slot, &t):
            return (slot, t)
        return None

    def abandon(self, ScanStats stats not None):
        """The connection closed: every request still waiting ends as ``unanswered``."""
        cdef Py_ssize_t i, n = self.count
        for i in range(self.size):
            if self.tab[i].key >= 0:
                stats._res[self.tab[i].slot * NRESULTS_C + R_UNANSWERED_C] += 1
                self.tab[i].key = -1
        self.count = 0
        self.nwant = 0
        return n



cdef class FrameScanner:
    """Walks Remoting frames in receive buffers; see ``rmqfast/codec/_scan_py.py``."""

    cdef readonly ScanStats stats
    cdef public bint response_policy
    cdef readonly Py_ssize_t max_frame_size
    cdef readonly Py_ssize_t max_header_size
    cdef uint8_t _actions[CODE_SLOTS_C]
    cdef Py_ssize_t _skip
    cdef public uint64_t requests
    cdef public uint64_t responses
    cdef public str error
    cdef public int code
    cdef public int flag
    cdef public int opaque
    cdef readonly InFlight inflight
    cdef readonly int direction
    cdef public Limiter limiter
    cdef public int limited      # rule index when the last EV_POLICY was a send over its limit, else -1
    cdef public int conn_id      # the relay's connection id, carried into sampled records

    def __init__(self, ScanStats stats not None, *, actions=None, bint response_policy=False,
                 Py_ssize_t max_frame_size=DEFAULT_MAX_FRAME,
                 Py_ssize_t max_header_size=DEFAULT_MAX_HEADER,
                 InFlight inflight=None, int direction=0, Limiter limiter=None):
        if direction != 0 and direction != 1:
            raise ValueError(f"direction must be 0 (client to upstream) or 1 (upstream to client), got {direction!r}")
        if max_frame_size < 8:
            raise ValueError(f"max_frame_size must be at least 8, got {max_frame_size!r}")
        if max_header_size < 1:
            raise ValueError(f"max_header_size must be positive, got {max_header_size!r}")
        self.stats = stats
        self.inflight = inflight
        self.direction = direction
        self.limiter = limiter
        self.limited = -1
        self.response_policy = response_policy
        self.max_frame_size = max_frame_size
        self.max_header_size = max_header_size
        cdef int i
        for i in range(CODE_SLOTS_C):
            self._actions[i] = 0
        if actions is not None:
            self.set_actions(actions)
        self._skip = 0
        self.requests = 0
        self.responses = 0
        self.error = ""
        self.code = 0
        self.flag = 0
        self.opaque = 0

    def set_actions(self, const uint8_t[:] actions):
        if actions.shape[0] != CODE_SLOTS_C:
            raise ValueError(f"action table must have {CODE_SLOTS_C} entries, got {actions.shape[0]}")
        cdef int i
        for i in range(CODE_SLOTS_C):
            self._actions[i] = actions[i]

    def scan(self, buf, Py_ssize_t start, Py_ssize_t end, int64_t now_ns=-1):
        cdef Py_buffer view
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
        try:
            if start < 0 or end > view.len or start > end:
                raise ValueError(f"scan range [{start}:{end}] outside a buffer of {view.len} bytes")
            return self._scan(<const uint8_t*>view.buf, start, end, now_ns)
        finally:
            PyBuffer_Release(&view)

    cdef tuple _scan(self, const uint8_t* p, Py_ssize_t start, Py_ssize_t end, int64_t now):
        cdef Py_ssize_t pos = start, avail, take, total
        cdef int32_t length, mark
        cdef int stype, err, slot
        cdef Py_ssize_t hlen
        cdef bint policy, is_response, limit_check
        cdef int limited, topic_idx = -1
        cdef Py_ssize_t ts = -1, tl = 0, ps = -1, pl = 0
        cdef bint tesc = False, pesc = False
        cdef HeaderInfo info
        cdef ScanStats stats = self.stats
        if now < 0 and self.inflight is not None:
            now = monotonic_ns()
        if self._skip:
            take = self._skip if self._skip < end - pos else end - pos
            self._skip -= take
            pos += take
            if self._skip:
                return (0, end, 0)
        while pos < end:
            avail = end - pos
            if avail < 4:
                return (0, pos, 8)
            length = rd_i32(p + pos)
            if length < 4:
                return self._fail(pos, f"frame length {length} is shorter than the 4-byte header-length word")
            total = <Py_ssize_t>length + 4
            if total > self.max_frame_size:
                return self._fail(pos, f"frame of {total} bytes exceeds the limit of {self.max_frame_size} bytes")
            if avail < 8:
                return (0, pos, 8)
            mark = rd_i32(p + pos + 4)
            stype = (mark >> 24) & 0xFF
            hlen = mark & 0xFFFFFF
            if stype > 1:
                return self._fail(pos, f"unknown serialize type {stype} (0 = JSON, 1 = ROCKETMQ)")
            if hlen > length - 4:
                return self._fail(pos, f"header length {hlen} exceeds frame length {length}")
            if hlen > self.max_header_size:
                return self._fail(pos, f"header of {hlen} bytes exceeds the limit of {self.max_header_size} bytes")
            if avail < 8 + hlen:
                return (0, pos, 8 + hlen)
            header_info_clear(&info)
            if stype == 0:
                err = parse_json_header(p + pos + 8, hlen, &info)
            else:
                err = parse_binary_header(p + pos + 8, hlen, &info)
            if err != E_OK:
                return self._fail(pos, f"invalid {'JSON' if stype == 0 else 'ROCKETMQ'} header: {_ERRORS[err]}")
            slot = code_slot(info.code)
            is_response = info.flag & 1
            limit_check = False
            ts = -1
            ps = -1
            if is_response:
                policy = self.response_policy or (
                    self.inflight is not None and self.inflight.nwant > 0
                    and self.inflight.wants_c(self.direction ^ 1, info.opaque))
            else:
                # The topic and properties the broker reads for this request code.
                if info.code == SEND_V2 or info.code == SEND_BATCH:
                    ts, tl, tesc = info.b_start, info.b_len, info.b_esc
                    ps, pl, pesc = info.i_start, info.i_len, info.i_esc
                elif info.code == SEND_V1:
                    ts, tl, tesc = info.t_start, info.t_len, info.t_esc
                    ps, pl, pesc = info.pr_start, info.pr_len, info.pr_esc
                elif info.code == PULL or info.code == LITE_PULL:
                    ts, tl, tesc = info.t_start, info.t_len, info.t_esc
                if ts >= 0 and tesc:
                    return self._fail(pos, f"invalid {'JSON' if stype == 0 else 'ROCKETMQ'} header: {_ERRORS[E_TOPIC_ESCAPED]}")
                policy = self._actions[slot] == 1
                if self.limiter is not None and self.limiter.active and ts >= 0 and \
                        (info.code == SEND_V2 or info.code == SEND_BATCH or info.code == SEND_V1):
                    # a limited send is decided whole (a rejected one is never relayed)
                    limit_check = self.limiter.applies(p + pos + 8 + ts, <int>tl)
            if (policy or info.code == SEND_BATCH or limit_check) and avail < total:
                return (0, pos, total)
            stats.frames += 1
            stats.bytes += total
            if is_response:
                stats._resp_counts[slot] += 1
                self.responses += 1
            else:
                stats._req_counts[slot] += 1
                stats._req_bytes[slot] += total
                if not info.flag & 2:
                    self.requests += 1
                topic_idx = self._count_topic(p + pos, hlen, total, info.code, ts, tl)
            limited = -1
            if limit_check:
                if now < 0:
                    now = monotonic_ns()
                limited = self.limiter.decide(
                    p + pos + 8 + ts, <int>tl,
                    p + pos + 8 + ps if ps >= 0 else NULL, pl, pesc,
                    <int64_t>count_batch(p + pos + 8 + hlen, total - 8 - hlen) if info.code == SEND_BATCH else 1,
                    total, now)
                if limited >= 0:
                    policy = True
            if self.inflight is not None:
                self._time(slot, info.code, info.flag, info.opaque, now, policy, total, topic_idx)
            if policy:
                self.limited = limited
                self.code = info.code
                self.flag = info.flag
                self.opaque = info.opaque
                return (1, pos, pos + total)
            if avail < total:
                self._skip = total - avail
                return (0, end, 0)
            pos += total
        return (0, pos, 0)

    cdef void _time(self, int slot, int32_t code, int flag, int32_t opaque, int64_t now, bint policy,
                    Py_ssize_t total, int topic_idx) except *:
        cdef int started_slot
        cdef int32_t topic
        cdef int64_t started, req_bytes, lat
        if flag & 1:
            if self.inflight.take_c(self.direction ^ 1, opaque, &started_slot, &started, &req_bytes, &topic):
                lat = now - started if now > started else 0
                self.stats.observe_c(started_slot, lat, result_index(code))
                self.stats.sample_c(started, lat, started_slot, code, topic, self.conn_id, req_bytes, total)
        elif policy:
            return  # the relay tracks it if it forwards it
        elif flag & 2:
            self.stats._res[slot * NRESULTS_C + R_ONEWAY_C] += 1
        elif not self.inflight.track_c(self.direction, opaque, slot, now, total, topic_idx):
            self.stats.untracked += 1

    cdef int _count_topic(self, const uint8_t* f, Py_ssize_t hlen, Py_ssize_t total, int code, Py_ssize_t s,
                          Py_ssize_t n) noexcept:
        """Count a send or pull under its topic (at ``s``, -1: none); the topic's index in the table (-1: none)."""
        cdef TopicEntry* e
        if s < 0 or not (code == SEND_V2 or code == SEND_BATCH or code == SEND_V1 or code == PULL or code == LITE_PULL):
            return -1
        e = self.stats.topic_slot(f + 8 + s, <int>n)
        e.nbytes += total
        if code == PULL or code == LITE_PULL:
            e.pulls += 1
        else:
            e.sends += 1
            if code == SEND_BATCH:
                e.messages += count_batch(f + 8 + hlen, total - 8 - hlen)
            else:
                e.messages += 1
        return <int>(e - self.stats._topics)

    cdef tuple _fail(self, Py_ssize_t pos, str message):
        self.error = message
        self.stats.protocol_errors += 1
        return (2, pos, 0)


# --------------------------------------------------------------------------------------------
# The relay pump: one direction of a relayed connection, receive -> scan -> send in C.
#
# rmqfast.proxy.relay drives it from a greenlet: ``step`` works until it must wait (for
# readability, writability or the write lock), or until a frame needs policy, and says which.
# Python only waits on libev watchers and handles policy frames, so a receive buffer full of
# frames costs one Python call, not one per frame.  Without the extension the relay runs the
# same loop in Python (Session._pump_py) over either scanner.
#
# Frame-atomic writes: the pump forwards partial frames, so the destination stream is often in
# the middle of a frame.  ``at_boundary`` says whether it is not; the relay writes its own
# answers (NO_PERMISSION, SYSTEM_BUSY, ...) to the destination only then.  When an answer is
# queued, the relay sets ``hold``: the pump forwards up to the end of the current frame and
# returns P_BOUNDARY so the relay can write the queue before the next frame starts.
#
# Memory: the buffer holds a whole frame only when a policy needs it whole (or a header is
# larger than the buffer).  The bigger buffer is an anonymous mapping of the frame's size
# (pages cost memory only once bytes arrive; unmapped when the frame is done, where malloc
# would keep a 16 MiB hole in its heap), filled at most ``base_cap`` bytes per receive; the
# bytes it holds beyond the base size are charged to a BufferBudget shared by the pumps of the
# process, and P_OVER_BUDGET says the budget is exhausted.  It goes back to the base buffer as
# soon as the bytes still buffered fit.

cdef extern from "<sys/socket.h>" nogil:
    ssize_t c_recv "recv"(int fd, void* buf, size_t n, int flags)
    ssize_t c_send "send"(int fd, const void* buf, size_t n, int flags)
    enum: MSG_NOSIGNAL

cdef extern from "<sys/mman.h>" nogil:
    void* c_mmap "mmap"(void* addr, size_t length, int prot, int flags, int fd, long offset)
    int c_munmap "munmap"(void* addr, size_t length)
    enum: PROT_READ
    enum: PROT_WRITE
    enum: MAP_PRIVATE
    enum: MAP_ANONYMOUS
    void* MAP_FAILED

cimport cython
from libc.errno cimport errno, EAGAIN, EINTR  # EWOULDBLOCK == EAGAIN on Linux
from libc.stdlib cimport malloc  # noqa (the InFlight table above allocates with it)
from libc.string cimport memmove

P_WAIT_READ = 0
P_WAIT_WRITE = 1
P_WAIT_LOCK = 2
P_POLICY = 3
P_EOF = 4
P_OS_ERROR = 5
P_PROTOCOL_ERROR = 6
P_YIELD = 7
P_BOUNDARY = 8      # ``hold`` is set and the destination stream is at a frame boundary
P_OVER_BUDGET = 9   # a frame held whole took the BufferBudget past its limit

cdef enum:
    PH_SCAN = 0      # scan [pos, filled)
    PH_FLUSH = 1     # send [start, fwd), then act on the pending scan event
    PH_READ = 2      # compact, then receive more
    PH_POLICY = 3    # frame [start, pend_b) is with Python until consume()

DEF READS_BEFORE_YIELD = 16
DEF BIG_ALIGN = 65536   # grown buffers are rounded up to this


def scanner_skip(FrameScanner scanner not None):
    """Bytes of the current frame the scanner has not seen yet (0: it stopped at a frame
    boundary).  The Python pump's view of ``FrameScanner._skip``."""
    return scanner._skip


cdef class BufferBudget:
    """Bytes the pumps of one process hold beyond their base buffers (frames held whole).

    A pump charges the bytes it holds beyond its base buffer as they arrive (at most one base
    buffer per receive) and returns P_OVER_BUDGET once ``used`` exceeds ``limit``.  The pure-Python
    pump uses the same two attributes (``rmqfast.proxy.relay.PyBufferBudget``).
    """

    cdef public Py_ssize_t limit
    cdef public Py_ssize_t used

    def __init__(self, Py_ssize_t limit=64 * 1024 * 1024):
        if limit < 0:
            raise ValueError(f"buffer budget must not be negative, got {limit}")
        self.limit = limit
        self.used = 0


@cython.no_gc_clear  # __dealloc__ gives the grown buffer back to the budget
cdef class Pump:
    """Receive from ``src_fd``, scan, forward to ``dst_fd``; see the section comment."""

    cdef FrameScanner scanner
    cdef uint8_t* base   # mapped, base_cap bytes
    cdef uint8_t* buf    # base, or a mapping of cap bytes for a frame larger than base_cap
    cdef Py_ssize_t cap, base_cap, filled, start, pos, fwd, pend_b, scan_end
    cdef int pend_ev, phase, reads
    cdef int src, dst
    cdef bint readable
    cdef int64_t now     # when the bytes being scanned arrived
    cdef readonly int errno_value
    cdef readonly Py_ssize_t frame_start, frame_end
    cdef readonly BufferBudget budget
    cdef readonly Py_ssize_t need   # size of the frame being held (after P_OVER_BUDGET)
    cdef Py_ssize_t charged         # bytes charged to the budget
    cdef public bint hold           # a local answer waits: stop at the next frame boundary

    def __cinit__(self, FrameScanner scanner not None, int src_fd, int dst_fd, Py_ssize_t size,
                  BufferBudget budget=None):
        if size < 64:
            raise ValueError(f"pump buffer of {size} bytes is too small (at least 64)")
        # mapped, not malloc'd: given back to the kernel when the connection ends (glibc keeps
        # freed blocks of this size in its heap once a larger mapping was freed)
        self.base = <uint8_t*>c_mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if <void*>self.base == MAP_FAILED:
            self.base = NULL
            raise MemoryError(f"cannot map a pump buffer of {size} bytes")
        self.buf = self.base
        self.scanner = scanner
        self.budget = budget
        self.cap = self.base_cap = size
        self.src = src_fd
        self.dst = dst_fd
        self.phase = PH_READ
        self.readable = True
        self.now = -1

    def __dealloc__(self):
        if self.base != NULL:
            self._release_big()
            c_munmap(self.base, self.base_cap)

    cdef void _release_big(self) noexcept:
        if self.buf != self.base:
            c_munmap(self.buf, self.cap)
            self.buf = self.base
            self.cap = self.base_cap
        self._charge(0)

    cdef bint _charge(self, Py_ssize_t held) noexcept:
        """Charge ``held`` bytes (instead of the previous charge); True when over the budget."""
        if self.budget is None:
            return False
        self.budget.used += held - self.charged
        self.charged = held
        return held > 0 and self.budget.used > self.budget.limit

    @property
    def buffered(self):
        """Bytes received and not yet forwarded (a test and debugging aid)."""
        return self.filled - self.start

    @property
    def capacity(self):
        """The buffer's current size (base size unless a frame is held whole)."""
        return self.cap

    @property
    def at_boundary(self):
        """Whether the bytes written to the destination so far end at a frame boundary (a
        local answer written now cannot land inside a forwarded frame)."""
        if self.phase == PH_FLUSH and self.start < self.fwd:
            return False
        return self.scanner._skip == 0

    @property
    def stalled_since(self):
        """Monotonic ns of the last receive while the source is in the middle of a frame and
        the pump waits for its next bytes; 0 when it is not (a frame-completion deadline)."""
        if self.phase == PH_READ and (self.filled > self.start or self.scanner._skip > 0):
            return self.now
        return 0

    def frame(self):
        """The bytes of the frame that needs policy (after ``step`` returned P_POLICY)."""
        if self.phase != PH_POLICY:
            raise RuntimeError("no frame is waiting for policy")
        return (<char*>self.buf)[self.frame_start:self.frame_end]

    def consume(self):
        """Python has dealt with the policy frame: skip it and go on scanning."""
        if self.phase != PH_POLICY:
            raise RuntimeError("no frame is waiting for policy")
        self.start = self.pos = self.pend_b
        self.phase = PH_SCAN

    cdef int _fit(self, Py_ssize_t rest) except -1:
        """After compaction ([0, rest) buffered, pend_b bytes needed): map a buffer for a frame
        held whole, or go back to the base buffer.  1 when the budget is exhausted."""
        cdef Py_ssize_t n
        cdef uint8_t* grown
        if self.pend_b > self.cap:
            n = (self.pend_b + BIG_ALIGN - 1) // BIG_ALIGN * BIG_ALIGN
            grown = <uint8_t*>c_mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            if <void*>grown == MAP_FAILED:
                raise MemoryError(f"cannot map {n} bytes for a frame held whole")
            memcpy(grown, self.buf, rest)
            if self.buf != self.base:
                c_munmap(self.buf, self.cap)
            self.buf = grown
            self.cap = n
            self.need = self.pend_b
        elif self.buf != self.base and rest <= self.base_cap and self.pend_b <= self.base_cap:
            memcpy(self.base, self.buf, rest)
            self._release_big()
            return 0
        if self.buf != self.base and self._charge(rest - self.base_cap if rest > self.base_cap else 0):
            return 1
        return 0

    def step(self, bint may_send):
        cdef tuple t
        cdef ssize_t n
        cdef Py_ssize_t space, rest, end
        while True:
            if self.phase == PH_SCAN:
                end = self.filled
                if self.hold:
                    # A local answer waits: scan no further than the end of the current frame.
                    if self.scanner._skip == 0:
                        return P_BOUNDARY
                    if self.pos + self.scanner._skip < end:
                        end = self.pos + self.scanner._skip
                self.scan_end = end
                t = self.scanner._scan(self.buf, self.pos, end, self.now)
                self.pend_ev = t[0]
                self.fwd = t[1]
                self.pend_b = t[2]
                self.phase = PH_FLUSH
            if self.phase == PH_FLUSH:
                while self.start < self.fwd:
                    if not may_send:
                        return P_WAIT_LOCK
                    n = c_send(self.dst, self.buf + self.start, self.fwd - self.start, MSG_NOSIGNAL)
                    if n < 0:
                        if errno == EAGAIN:
                            return P_WAIT_WRITE
                        if errno == EINTR:
                            continue
                        self.errno_value = errno
                        return P_OS_ERROR
                    self.start += n
                    if self.start < self.fwd:
                        return P_WAIT_WRITE
                if self.pend_ev == 1:
                    self.frame_start = self.fwd
                    self.frame_end = self.pend_b
                    self.start = self.fwd
                    self.phase = PH_POLICY
                    return P_POLICY
                if self.pend_ev == 2:
                    return P_PROTOCOL_ERROR
                if self.scan_end < self.filled and self.pend_b == 0:
                    # The scan stopped at the end of a frame for a local answer: go on from there.
                    self.pos = self.fwd
                    self.phase = PH_SCAN
                    continue
                # Forward: the bytes from fwd on are an incomplete frame head of pend_b bytes.
                rest = self.filled - self.start
                if rest and self.start:
                    memmove(self.buf, self.buf + self.start, rest)
                self.filled = rest
                self.start = self.pos = 0
                if self._fit(rest):
                    return P_OVER_BUDGET
                self.phase = PH_READ
            if self.phase == PH_POLICY:
                raise RuntimeError("step() called before consume() of the policy frame")
            # PH_READ
            if self.hold and self.scanner._skip == 0:
                return P_BOUNDARY
            if not self.readable:
                # The last read drained the socket: wait for readiness rather than fail a recv.
                self.readable = True
                self.reads = 0
                return P_WAIT_READ
            if self.reads >= READS_BEFORE_YIELD:
                self.reads = 0
                return P_YIELD
            space = self.cap - self.filled
            if self.buf != self.base and space > self.base_cap:
                space = self.base_cap  # a held frame is charged as it arrives: bounded steps
            n = c_recv(self.src, self.buf + self.filled, space, 0)
            if n < 0:
                if errno == EAGAIN:
                    self.reads = 0
                    return P_WAIT_READ
                if errno == EINTR:
                    continue
                self.errno_value = errno
                return P_OS_ERROR
            if n == 0:
                return P_EOF
            self.reads += 1
            self.now = monotonic_ns()
            self.readable = n == space
            self.filled += n
            self.phase = PH_SCAN
            if self.buf != self.base and self.filled > self.base_cap and self._charge(self.filled - self.base_cap):
                return P_OVER_BUDGET
