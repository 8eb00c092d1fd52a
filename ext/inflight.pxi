# Included by _speedups.pyx. InFlight: the requests of one connection awaiting their response (twin:
# rmqfast/codec/_scan_py.InFlight).

cdef struct PendingEntry:
    int64_t key          # -1: empty; else direction << 32 | (uint32) opaque
    int32_t slot
    int32_t topic        # index in the stats' topic table (-1: none), for sampled records
    int32_t want         # 1: a filter wants the answer (policy); 2: the scanner maps its records
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
        # 4 entries (160 bytes; grown as requests pile up): most connections have one request in
        # flight at a time, and an idle one none (16 entries were 640 bytes per connection)
        self.size = 4
        self.count = 0
        self.tab = self._alloc(4)

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
                     int32_t topic=-1, int want=0) except -1:
        """1 when tracked, 0 when the connection already tracks ``capacity`` requests."""
        cdef int64_t key = (<int64_t>direction << 32) | <uint32_t>opaque
        cdef Py_ssize_t j = self._home(key)
        while self.tab[j].key >= 0:
            if self.tab[j].key == key:
                self.nwant += (1 if want != 0 else 0) - (1 if self.tab[j].want != 0 else 0)
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
        if want != 0:
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

    cdef int want_of_c(self, int direction, int32_t opaque) noexcept:
        """-1: not tracked; else what is wanted of its answer (0 nothing, 1 policy, 2 records)."""
        cdef int64_t key = (<int64_t>direction << 32) | <uint32_t>opaque
        cdef Py_ssize_t j = self._home(key)
        while self.tab[j].key >= 0:
            if self.tab[j].key == key:
                return self.tab[j].want
            j = (j + 1) & (self.size - 1)
        return -1

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
                if self.tab[j].want != 0:
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
              int32_t topic=-1, int want=0):
        """``want``: 0 (or False) nothing, 1 (or True) a filter wants the answer, 2 the scanner
        maps the store hosts of its records."""
        if want < 0 or want > 2:
            raise ValueError(f"want must be 0, 1 or 2, got {want}")
        return self.track_c(direction, opaque, slot, now_ns, req_bytes, topic, want) == 1

    def want_of(self, int direction, int32_t opaque):
        """-1: not tracked; else what is wanted of its answer (0 nothing, 1 policy, 2 records)."""
        return self.want_of_c(direction, opaque)

    def take(self, int direction, int32_t opaque):
        cdef int slot
        cdef int64_t t
        if self.take_c(direction, opaque, &slot, &t):
            return (slot, t)
        return None

    def waiting(self, int direction):
        """``[(opaque, slot)]`` of the requests of ``direction`` still waiting, oldest first."""
        cdef Py_ssize_t i
        cdef list found = []
        for i in range(self.size):
            if self.tab[i].key >= 0 and (self.tab[i].key >> 32) == direction:
                found.append((self.tab[i].t_ns, <int32_t>(<uint32_t>(self.tab[i].key & 0xFFFFFFFF)),
                              self.tab[i].slot))
        found.sort()
        return [(o, s) for _, o, s in found]

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
