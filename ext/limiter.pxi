# Included by _speedups.pyx. Limiter: send limits over GCRA buckets shared by all workers (twin:
# rmqfast/limits/_limiter_py.py).

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

# SLOT_WORDS_C (int64 words per shared slot: [msgs TAT, bytes TAT, unused...]), MAX_RULES_C (slot 0
# is the global bucket), SHM_HEADER_BYTES_C, SHM_BYTES_C, MODE_* and MAX_COST_NS_C: tables.pxi.
# The shared bucket file starts with a header (rmqfast.limits.create_shared writes it, and
# rmqfast._args.check_shared_header reads it for both twins) naming the twin whose locking the
# buckets use: compiled CAS and pure-Python flock would lose each other's updates.
cdef enum:
    LIM_TOPICS_C = 1024      # the limiter's topic cache (C only)
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


# A send whose cost (ns) would reach this is refused outright: 146 years of the rule's rate, and
# past it the int64 arithmetic below would overflow (a batch of millions of tiny records at a
# very slow rate).  The pure twin refuses at the same double comparison.
# (MAX_COST_NS_C, 2 ** 62: tables.pxi)


cdef inline bint gcra(int64_t* tat_p, int64_t now, double interval, double tolerance, int64_t n,
                      int64_t* charged) noexcept nogil:
    if interval * n >= MAX_COST_NS_C:
        return False
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
            self.slots = <int64_t*>(<char*>view.buf + SHM_HEADER_BYTES_C)
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
            if r.mode == MODE_OPEN_C:
                continue
            if r.mode == MODE_REJECT_C or \
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
