# Included by _speedups.pyx. Pump: one direction of a relayed connection, receive -> scan -> send in
# C (twin: the relay's Python pump).

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
# Memory: a pump holds a receive buffer only while it has bytes it could not forward yet (an
# incomplete frame head, bytes waiting for the destination, a frame with Python).  Each step takes
# a buffer of the base size from the process's pool (a few mappings reused in turn) and gives it
# back when it ends with nothing buffered, so an idle connection holds none and a relayed frame
# that goes out whole costs no mapping.  The buffer holds a whole frame only when a policy needs
# it whole (or a header is larger than the buffer).  The bigger buffer is an anonymous mapping of the frame's size
# (pages cost memory only once bytes arrive; unmapped when the frame is done, where malloc
# would keep a 16 MiB hole in its heap), filled at most ``base_cap`` bytes per receive; the
# bytes it holds beyond the base size are charged to a BufferBudget shared by the pumps of the
# process, and P_OVER_BUDGET says the budget is exhausted.  It goes back to the base buffer as
# soon as the bytes still buffered fit.

cdef extern from "<sys/socket.h>" nogil:
    ssize_t c_recv "recv"(int fd, void* buf, size_t n, int flags)
    ssize_t c_send "send"(int fd, const void* buf, size_t n, int flags)
    enum: MSG_NOSIGNAL

cdef extern from "uring.h" nogil:
    ctypedef struct rmq_uring:
        int fd
        int op_flags
    void rmq_uring_zero(rmq_uring* r)
    const char* rmq_uring_init(rmq_uring* r, unsigned entries)
    void rmq_uring_free(rmq_uring* r)
    int rmq_uring_prep_send(rmq_uring* r, int fd, const void* buf, unsigned length, uint64_t data)
    int rmq_uring_prep_recv(rmq_uring* r, int fd, void* buf, unsigned length, uint64_t data)
    int rmq_uring_prep_cancel(rmq_uring* r, uint64_t target)
    void rmq_uring_rewind(rmq_uring* r)
    int rmq_uring_submit(rmq_uring* r, unsigned wait)
    int rmq_uring_reap(rmq_uring* r, uint64_t* data, int* res)

cdef extern from "<sys/mman.h>" nogil:
    void* c_mmap "mmap"(void* addr, size_t length, int prot, int flags, int fd, long offset)
    int c_munmap "munmap"(void* addr, size_t length)
    enum: PROT_READ
    enum: PROT_WRITE
    enum: MAP_PRIVATE
    enum: MAP_ANONYMOUS
    void* MAP_FAILED


cdef enum:
    PS_WAIT_READ = 0
    PS_WAIT_WRITE = 1
    PS_WAIT_LOCK = 2
    PS_POLICY = 3
    PS_EOF = 4
    PS_OS_ERROR = 5
    PS_PROTOCOL_ERROR = 6
    PS_YIELD = 7
    PS_BOUNDARY = 8      # ``hold`` is set and the destination stream is at a frame boundary
    PS_OVER_BUDGET = 9   # a frame held whole took the BufferBudget past its limit
    PS_QUEUED = 10       # (reactor only) a receive or send is queued in the reactor's ring

# ``may_send`` of a step: 0 no (another writer holds the destination), 1 yes (the caller checked, or
# holds the lock itself), MAY_ASK: the pump asks its ``locked`` right before a send (the reactor:
# most steps of a turn send nothing, and the question is a Python call).
cdef enum:
    MAY_ASK = 2

P_WAIT_READ = PS_WAIT_READ
P_WAIT_WRITE = PS_WAIT_WRITE
P_WAIT_LOCK = PS_WAIT_LOCK
P_POLICY = PS_POLICY
P_EOF = PS_EOF
P_OS_ERROR = PS_OS_ERROR
P_PROTOCOL_ERROR = PS_PROTOCOL_ERROR
P_YIELD = PS_YIELD
P_BOUNDARY = PS_BOUNDARY
P_OVER_BUDGET = PS_OVER_BUDGET

cdef enum:
    PH_SCAN = 0      # scan [pos, filled)
    PH_FLUSH = 1     # send [start, fwd), then act on the pending scan event
    PH_READ = 2      # compact, then receive more
    PH_POLICY = 3    # frame [start, pend_b) is with Python until consume()
    PH_SENDQ = 4     # the send of [start, fwd) is queued in the reactor's ring
    PH_RECVQ = 5     # a receive into [filled, filled + qspace) is queued in the reactor's ring

cdef enum:
    READS_BEFORE_YIELD = 16
# Larger sends go out at once with send(2) even in a reactor turn with io_uring, and a source whose
# last receive brought more is received from with recv(2): those system calls are shared by
# several frames already, and waiting for the batch only delays the other side (pipelined traffic
# through 2 workers was 4 % slower when its sends waited).
cdef enum:
    RING_BYTES_MAX = 4096
    BIG_ALIGN = 65536   # grown buffers are rounded up to this
    POOL_MAX = 40       # free base buffers a process keeps for the next steps (the rest are unmapped):
                        # a reactor turn with io_uring has up to URING_BATCH pumps holding one at once

# The process's free base buffers (one thread steps pumps: no lock).  Their pages stay resident,
# so at most POOL_MAX x buffer_size is kept for reuse (in practice the pages the frames touched:
# a 1 KiB send touches one).
cdef uint8_t* _pool_buf[POOL_MAX]
cdef Py_ssize_t _pool_size[POOL_MAX]
cdef int _pool_n = 0


cdef uint8_t* _buffer_get(Py_ssize_t size) noexcept:
    """A base buffer of ``size`` bytes: a free one of the pool, else a new mapping (NULL: none)."""
    global _pool_n
    cdef int i
    cdef uint8_t* p
    i = _pool_n - 1
    while i >= 0:
        if _pool_size[i] == size:
            p = _pool_buf[i]
            _pool_n -= 1
            _pool_buf[i] = _pool_buf[_pool_n]
            _pool_size[i] = _pool_size[_pool_n]
            return p
        i -= 1
    p = <uint8_t*>c_mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if <void*>p == MAP_FAILED:
        return NULL
    return p


cdef void _buffer_put(uint8_t* p, Py_ssize_t size) noexcept:
    """Give a base buffer back: kept in the pool while it has room, else unmapped."""
    global _pool_n
    if _pool_n < POOL_MAX:
        _pool_buf[_pool_n] = p
        _pool_size[_pool_n] = size
        _pool_n += 1
    else:
        c_munmap(p, size)


PUMP_POOL_MAX = POOL_MAX


def pump_pool_free():
    """Free base buffers the process's pool holds (a test and debugging aid)."""
    return _pool_n


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
    cdef uint8_t* base   # base_cap bytes from the pool while the pump holds bytes, else NULL
    cdef uint8_t* buf    # base, or a mapping of cap bytes for a frame larger than base_cap
    cdef Py_ssize_t cap, base_cap, filled, start, pos, fwd, pend_b, scan_end
    cdef int pend_ev, phase, reads
    cdef int src, dst
    cdef bint readable
    cdef bint peer_closed  # the reactor saw the source's peer close: read until recv says EOF
    cdef int64_t now     # when the bytes being scanned arrived
    cdef readonly int errno_value
    cdef readonly bint send_failed  # the error (P_OS_ERROR) came from a send to the destination
    cdef readonly Py_ssize_t frame_start, frame_end
    cdef readonly BufferBudget budget
    cdef readonly Py_ssize_t need   # size of the frame being held (after P_OVER_BUDGET)
    cdef Py_ssize_t charged         # bytes charged to the budget
    cdef public bint hold           # a local answer waits: stop at the next frame boundary
    # Reactor (see below): the source became readable while the pump was not parked; the
    # parked pump's wake-up (a gevent Waiter, None while its greenlet runs); ``locked`` of the
    # destination's write lock (the pump sends only when no one else is mid-write), None while
    # the destination has no lock yet (the relay makes it when a write first has to wait, and
    # sets ``locked`` then, before anyone holds it).
    cdef bint ready_in
    cdef object waiter
    # Set by the reactor while it steps the pump in a turn with io_uring (NULL otherwise): the
    # pump queues its receive or send there (PS_QUEUED) instead of calling recv/send, and the
    # reactor hands the result to ``_resume`` once the turn's operations are submitted together.
    cdef rmq_uring* ring
    cdef Py_ssize_t qspace
    cdef bint in_ring    # its queued operation was submitted and has not completed yet
    cdef Py_ssize_t last_n  # bytes of the last receive: a source that sends more receives alone
    cdef public object locked
    cdef bint attached

    def __cinit__(self, FrameScanner scanner not None, int src_fd, int dst_fd, Py_ssize_t size,
                  BufferBudget budget=None):
        if size < 64:
            raise ValueError(f"pump buffer of {size} bytes is too small (at least 64)")
        # Mapped, not malloc'd (glibc keeps freed blocks of this size in its heap once a larger
        # mapping was freed), and only while the pump holds bytes (``_step``).
        self.base = self.buf = NULL
        self.scanner = scanner
        self.budget = budget
        self.cap = self.base_cap = size
        self.src = src_fd
        self.dst = dst_fd
        self.phase = PH_READ
        self.readable = True
        self.now = -1

    def __dealloc__(self):
        if self.in_ring:
            return  # the kernel may still write into its buffer: kept for good (see Reactor)
        if self.base != NULL:
            self._release_big()
            _buffer_put(self.base, self.base_cap)
            self.base = self.buf = NULL
        else:
            self._charge(0)

    cdef int _take_buffer(self) except -1:
        """Before a step: a base buffer to receive into (the pool's, when the pump holds none)."""
        if self.buf == NULL:
            self.base = _buffer_get(self.base_cap)
            if self.base == NULL:
                raise MemoryError(f"cannot map a pump buffer of {self.base_cap} bytes")
            self.buf = self.base
        return 0

    cdef void _give_back(self) noexcept:
        """After a step: nothing buffered (everything received went out) and no frame with
        Python: the base buffer goes back to the pool; the offsets restart at 0."""
        if (self.buf != self.base or self.base == NULL or self.filled != self.start or self.phase == PH_POLICY
                or self.phase == PH_RECVQ or self.phase == PH_SENDQ):
            return  # (a queued operation uses the buffer until the reactor resumes the pump)
        self.filled = self.start = self.pos = self.fwd = self.scan_end = 0
        _buffer_put(self.base, self.base_cap)
        self.base = self.buf = NULL

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
    def holds_buffer(self):
        """Whether the pump holds a receive buffer now (only while it has bytes to keep)."""
        return self.buf != NULL

    @property
    def at_boundary(self):
        """Whether the bytes written to the destination so far end at a frame boundary (a
        local answer written now cannot land inside a forwarded frame)."""
        if (self.phase == PH_FLUSH or self.phase == PH_SENDQ) and self.start < self.fwd:
            return False
        return self.scanner._skip == 0

    @property
    def stalled_since(self):
        """Monotonic ns of the last receive while the source is in the middle of a frame and
        the pump waits for its next bytes; 0 when it is not (a frame-completion deadline)."""
        if (self.phase == PH_READ or self.phase == PH_RECVQ) and (self.filled > self.start or self.scanner._skip > 0):
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

    @property
    def last_receive(self):
        """Monotonic ns of the last receive (-1: none yet)."""
        return self.now

    def step(self, bint may_send):
        """Work until the pump must wait or Python must act; returns a P_* status."""
        if self.phase == PH_SENDQ or self.phase == PH_RECVQ:
            raise RuntimeError("step() called while an operation of the pump is queued in the reactor")
        return self._step(may_send)

    cdef int _step(self, int may_send) except -1:
        cdef int st
        if self.buf == NULL:
            self._take_buffer()
        st = self._work(may_send)  # raising, it keeps its buffer (given back at the next step or the end)
        self._give_back()
        return st

    cdef int _work(self, int may_send) except -1:
        cdef int st
        cdef ssize_t n
        cdef Py_ssize_t space, rest, end
        while True:
            if self.phase == PH_SCAN:
                end = self.filled
                if self.hold:
                    # A local answer waits: scan no further than the end of the current frame.
                    if self.scanner._skip == 0:
                        return PS_BOUNDARY
                    if self.pos + self.scanner._skip < end:
                        end = self.pos + self.scanner._skip
                self.scan_end = end
                self.pend_ev = self.scanner._scan_c(self.buf, self.pos, end, self.now, True, &self.fwd, &self.pend_b)
                self.phase = PH_FLUSH
            if self.phase == PH_FLUSH:
                while self.start < self.fwd:
                    if not may_send:
                        return PS_WAIT_LOCK
                    if may_send == MAY_ASK and self.locked is not None and self.locked():
                        return PS_WAIT_LOCK  # another writer is mid-write on the destination
                    if (self.ring != NULL and self.fwd - self.start <= RING_BYTES_MAX
                            and rmq_uring_prep_send(self.ring, self.dst, self.buf + self.start,
                                                                 <unsigned>(self.fwd - self.start),
                                                                 <uint64_t><void*>self) == 0):
                        self.phase = PH_SENDQ
                        return PS_QUEUED
                    n = c_send(self.dst, self.buf + self.start, self.fwd - self.start, MSG_NOSIGNAL)
                    st = self._sent(n, errno if n < 0 else 0)
                    if st >= 0:
                        return st
                if self.pend_ev == 1:
                    self.frame_start = self.fwd
                    self.frame_end = self.pend_b
                    self.start = self.fwd
                    self.phase = PH_POLICY
                    return PS_POLICY
                if self.pend_ev == 2:
                    return PS_PROTOCOL_ERROR
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
                    return PS_OVER_BUDGET
                self.phase = PH_READ
            if self.phase == PH_POLICY:
                raise RuntimeError("step() called before consume() of the policy frame")
            # PH_READ
            if self.hold and self.scanner._skip == 0:
                return PS_BOUNDARY
            if not self.readable and not self.peer_closed:
                # The last read drained the socket: wait for readiness rather than fail a recv.
                self.readable = True
                self.reads = 0
                return PS_WAIT_READ
            if self.reads >= READS_BEFORE_YIELD:
                self.reads = 0
                return PS_YIELD
            space = self.cap - self.filled
            if self.buf != self.base and space > self.base_cap:
                space = self.base_cap  # a held frame is charged as it arrives: bounded steps
            if (self.ring != NULL and self.last_n <= RING_BYTES_MAX
                    and rmq_uring_prep_recv(self.ring, self.src, self.buf + self.filled,
                                                         <unsigned>space, <uint64_t><void*>self) == 0):
                self.qspace = space
                self.phase = PH_RECVQ
                return PS_QUEUED
            n = c_recv(self.src, self.buf + self.filled, space, 0)
            st = self._received(n, errno if n < 0 else 0, space)
            if st >= 0:
                return st

    cdef int _sent(self, ssize_t n, int err) noexcept:
        """After a send of [start, fwd) (``n`` bytes, or -1 and ``err``): a status to return, or -1
        to go on working (everything went out, or EINTR: send again)."""
        if n < 0:
            if err == EAGAIN:
                return PS_WAIT_WRITE
            if err == EINTR:
                return -1
            self.errno_value = err
            self.send_failed = True
            return PS_OS_ERROR
        self.start += n
        if self.start < self.fwd:
            return PS_WAIT_WRITE
        return -1

    cdef int _received(self, ssize_t n, int err, Py_ssize_t space) noexcept:
        """After a receive of at most ``space`` bytes at ``filled`` (``n`` bytes, or -1 and ``err``):
        a status to return, or -1 to go on working (scan what came, or EINTR: receive again)."""
        if n < 0:
            if err == EAGAIN:
                self.reads = 0
                return PS_WAIT_READ
            if err == EINTR:
                return -1
            self.errno_value = err
            return PS_OS_ERROR
        if n == 0:
            return PS_EOF
        self.reads += 1
        self.last_n = n
        self.now = monotonic_ns()
        self.readable = n == space
        self.filled += n
        self.phase = PH_SCAN
        if self.buf != self.base and self.filled > self.base_cap and self._charge(self.filled - self.base_cap):
            return PS_OVER_BUDGET
        return -1

    cdef int _resume(self, int res, int may_send) except -1:
        """The reactor's ring completed the pump's queued operation with ``res`` (bytes, or
        -errno): take the result as ``_work`` would have taken the system call's, and go on."""
        cdef int st
        if self.phase == PH_SENDQ:
            self.phase = PH_FLUSH
            st = self._sent(res if res >= 0 else -1, -res if res < 0 else 0)
        elif self.phase == PH_RECVQ:
            self.phase = PH_READ
            st = self._received(res if res >= 0 else -1, -res if res < 0 else 0, self.qspace)
        else:
            raise RuntimeError("no operation of the pump is queued")
        if st < 0:
            st = self._work(may_send)  # raising, it keeps its buffer (given back at the next step or the end)
        if st != PS_QUEUED:
            self._give_back()
        return st

    cdef void _unqueue(self) noexcept:
        """Its queued operation will not be issued (or was cancelled): back to the phase that
        makes it with a system call at the next step."""
        if self.phase == PH_SENDQ:
            self.phase = PH_FLUSH
        elif self.phase == PH_RECVQ:
            self.phase = PH_READ
        self.ring = NULL
        self.in_ring = False
