# Included by _speedups.pyx. ScanStats: the counters every scanner of a worker shares (published to
# Prometheus once a second).

cdef struct TopicEntry:
    uint64_t sends
    uint64_t messages
    uint64_t pulls
    uint64_t nbytes
    uint32_t hash
    int16_t length          # -1: empty slot
    char name[MAX_TOPIC_LEN_C + 1]


# SAMPLE_RING_C: tables.pxi

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
    cdef int _last_topic     # index of the entry topic_slot returned last: most sends repeat it
    cdef public uint64_t frames
    cdef public uint64_t bytes
    cdef public uint64_t protocol_errors
    cdef public uint64_t untracked
    cdef uint64_t* _lat      # CODE_SLOTS_C rows of LATENCY_BUCKETS_C counts + the sum of ns
    cdef uint64_t* _res      # CODE_SLOTS_C rows of NRESULTS_C counts
    cdef SampleRec* _ring    # sampled requests, drained by the records writer once a second
    cdef Py_ssize_t _ring_len
    cdef uint32_t _sample_every, _sample_left
    cdef public uint64_t samples_dropped

    def __cinit__(self):
        cdef int i
        self._topics = <TopicEntry*>calloc(TOPIC_SLOTS_C, sizeof(TopicEntry))
        self._lat = <uint64_t*>calloc(CODE_SLOTS_C * (LATENCY_BUCKETS_C + 1), sizeof(uint64_t))
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
        cdef uint64_t* row = self._lat + slot * (LATENCY_BUCKETS_C + 1)
        row[latency_bucket(ns)] += 1
        row[LATENCY_BUCKETS_C] += <uint64_t>ns
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
            row = self._lat + i * (LATENCY_BUCKETS_C + 1)
            for b in range(LATENCY_BUCKETS_C):
                if row[b]:
                    out.append((i, tuple([row[k] for k in range(LATENCY_BUCKETS_C)]), row[LATENCY_BUCKETS_C]))
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
        cdef TopicEntry* e = &self._topics[self._last_topic]
        if e.length == length and memcmp(e.name, name, length) == 0:
            return e     # the same topic as the last send or pull: no hash
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
                self._last_topic = idx
                return e
            if e.hash == h and e.length == length and memcmp(e.name, name, length) == 0:
                self._last_topic = idx
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
