# Included by _speedups.pyx.  Reactor: the readable sources of every compiled pump of a process
# in one edge-triggered epoll set, stepped in C from one gevent callback per event-loop turn.
#
# Without it each pump waits on a libev watcher of its own: every receive costs a watcher start
# and stop, a Waiter, two greenlet switches and a few Python lines around ``step``, more than
# the scan and the two syscalls.  With it the hub watches one file descriptor (the epoll set);
# ``turn`` collects every ready source with one ``epoll_wait`` and steps their pumps in C.  A
# pump whose step ends waiting for its source again (P_WAIT_READ) stays parked: no Python runs
# for it.  Any other status (policy frame, boundary for a local answer, write lock or buffer
# full, end of stream, error) wakes the pump's greenlet with that status through its gevent
# Waiter, and the relay handles it exactly as if its own ``step`` had returned it.
#
# Registration is edge-triggered and permanent (one epoll_ctl when a session starts, one when
# it ends): an edge that arrives while the pump is busy in Python is remembered (``ready_in``)
# and acted on when the pump parks again.  A spurious edge costs one receive that finds nothing
# (EAGAIN: the pump stays parked).  The frames are scanned by the same scanner as before; only
# who calls ``step`` changes.
#
# A turn whose poll found several sources ready polls again (at most ``repoll`` times, while each
# poll finds two or more): under concurrent load more sources are ready by the time those are
# stepped, and taking them in the same turn saves a hub wake-up each (the hub's epoll_wait, the
# getpid libev makes per loop iteration, gevent's callback into ``turn``).  A poll that finds one
# source, or none, ends the turn: a lone connection pays no extra system call.
#
# With io_uring (``uring.h``; on unless ``Reactor(uring=False)`` or the kernel refuses it), the
# pumps a poll found ready (two or more) queue their receive or send in the reactor's ring instead of calling
# recv/send (PS_QUEUED), and one ``io_uring_enter`` issues them all.  Each carries MSG_DONTWAIT,
# so the kernel completes it inline, within that call (checked when the ring is made): by the
# time it returns every queued pump has its result, and ``_resume`` takes it exactly as the
# system call's.  A pump that goes on to another receive or send queues again, and the next
# ``io_uring_enter`` issues those.  No Python runs while operations are queued: the greenlets of
# pumps that need Python are woken once every operation of the poll is done.

cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void* ptr
        int fd
        uint32_t u32
        uint64_t u64
    cdef struct epoll_event:
        uint32_t events
        epoll_data_t data
    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event* event)
    int epoll_wait(int epfd, epoll_event* events, int maxevents, int timeout)
    enum: EPOLL_CLOEXEC
    enum: EPOLL_CTL_ADD
    enum: EPOLL_CTL_DEL
    enum: EPOLLIN
    enum: EPOLLRDHUP
    enum: EPOLLHUP
    enum: EPOLLERR
    enum: EPOLLET

cdef extern from "<unistd.h>" nogil:
    int c_close "close"(int fd)

cdef extern from "<string.h>" nogil:
    char* c_strerror "strerror"(int errnum)
    void* memset(void* s, int c, size_t n)

cdef extern from "<errno.h>" nogil:
    enum: ECANCELED
    enum: EIO
    enum: EBADF
    enum: EMFILE

cdef enum:
    REACTOR_EVENTS = 256
    URING_ENTRIES = 256   # size of the submission ring (at most one queued operation per pump)
# Pumps queued before the reactor issues their operations: each holds a receive buffer until its
# operation is done, and the process keeps only POOL_MAX free ones for reuse.
cdef enum:
    URING_BATCH = 32
    FD_TABLE_MAX = 1 << 26  # descriptor numbers the fd table covers (512 MiB of pointers at most)


@cython.no_gc_clear  # its fd table borrows the pumps its dict owns: the dict must stay until __dealloc__
cdef class Reactor:
    """One epoll set for the sources of the compiled pumps of a process (see the section comment).

    The relay registers a pump with ``attach`` when its session starts and ``detach`` when it
    ends (before the sockets close: a file descriptor number may be reused at once).  After its
    own ``step`` returned P_WAIT_READ, the pump's greenlet calls ``park``: it returns a status
    at once if the source became readable meanwhile, else -1 and the greenlet waits on the
    Waiter it passed.  The hub calls ``turn`` when the epoll set is readable.
    """

    cdef int epfd
    cdef dict pumps              # source fd -> Pump (owns them)
    # The same map as a table indexed by fd (borrowed pointers, NULL where none): a poll's
    # events are looked up without a dict lookup and an int object each.
    cdef void** by_fd
    cdef int by_fd_cap
    cdef readonly Py_ssize_t turns, steps, wakeups, repolls, polls_empty
    cdef rmq_uring ring
    cdef bint use_ring
    # The pumps with an operation in the ring, in submission order: two arrays of pointers, the
    # one being filled and the one being issued.  Each entry holds a reference (taken by
    # ``_queue``, dropped once its operation is done), so that a pump stays alive whatever
    # happens between queueing and completion (an error escaping a turn leaks it rather than
    # leaving the kernel a freed buffer).  A queue holds at most URING_BATCH pumps: ``_handle``
    # issues a full one, and the pumps of a batch being resumed queue at most one operation
    # each.  (A Python list cost ~180 instructions per send and answer.)
    cdef void* qbuf[2 * URING_BATCH]
    cdef void** queued
    cdef int nqueued
    cdef list wake               # greenlets to wake after the poll's operations, with their statuses
    # ``uring``: whether receives and sends go through io_uring; ``uring_off``: why not (None
    # when they do); ``submits``: io_uring_enter calls; ``ring_ops``: operations they issued.
    cdef readonly object uring_off
    cdef readonly Py_ssize_t submits, ring_ops
    # Ready sources a poll must find for their pumps to use the ring (default 2: a lone source's
    # receive and send cost one system call each either way, and the plain ones skip the ring's
    # own work; tests set 1 to drive every step through the ring).
    cdef public int ring_min
    # Extra epoll_waits a turn may make while the previous one found several sources ready (0:
    # one per turn): under concurrent load more are ready by the time those are stepped, and
    # taking them here saves the hub's wait, libev's getpid and the callback into the turn.
    cdef public int repoll

    def __cinit__(self, bint uring=True):
        cdef const char* why
        rmq_uring_zero(&self.ring)
        self.epfd = epoll_create1(EPOLL_CLOEXEC)
        if self.epfd < 0:
            raise OSError(errno, c_strerror(errno).decode())
        self.pumps = {}
        self.queued = &self.qbuf[0]
        self.nqueued = 0
        self.wake = []
        self.ring_min = 2
        if not uring:
            self.uring_off = "turned off"
            return
        why = rmq_uring_init(&self.ring, URING_ENTRIES)
        if why != NULL:
            self.uring_off = why.decode() + (f" ({c_strerror(errno).decode()})" if errno else "")
            return
        self.use_ring = True

    def __dealloc__(self):
        if self.epfd >= 0:
            c_close(self.epfd)
        rmq_uring_free(&self.ring)
        free(self.by_fd)

    def _test_ops_may_wait(self):
        """A test aid: queue operations without MSG_DONTWAIT from now on, so that one can stay in
        the kernel past io_uring_enter (the case the check at start rules out)."""
        self.ring.op_flags = 0

    @property
    def uring_fd(self):
        """The ring's file descriptor (-1: none; a test and debugging aid)."""
        return self.ring.fd if self.use_ring else -1

    @property
    def uring(self):
        """Whether the pumps' receives and sends go through io_uring (see the section comment)."""
        return self.use_ring

    def fileno(self):
        return self.epfd

    def __len__(self):
        return len(self.pumps)

    def attach(self, Pump pump not None, object locked):
        """Watch ``pump``'s source from now on; ``locked()`` says whether its destination's
        write lock is held (then the pump must not send); None: no lock yet (the relay sets
        ``pump.locked`` when it makes one)."""
        cdef epoll_event ev
        if pump.attached:
            raise RuntimeError("pump already attached")
        ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET
        ev.data.u64 = 0
        ev.data.fd = pump.src
        if pump.src < 0:
            raise OSError(EBADF, "the pump's source is closed")
        if pump.src >= self.by_fd_cap:
            self._grow(pump.src)
        if epoll_ctl(self.epfd, EPOLL_CTL_ADD, pump.src, &ev) < 0:
            raise OSError(errno, c_strerror(errno).decode())
        self.pumps[pump.src] = pump
        self.by_fd[pump.src] = <void*>pump
        pump.locked = locked
        pump.ready_in = True  # bytes may have arrived before the registration
        pump.waiter = None
        pump.attached = True

    def detach(self, Pump pump not None):
        """Stop watching ``pump``'s source; returns the Waiter of its parked greenlet, if any
        (the caller wakes it)."""
        cdef epoll_event ev
        if not pump.attached:
            return None
        pump.attached = False
        if self.pumps.get(pump.src) is pump:
            del self.pumps[pump.src]
            self.by_fd[pump.src] = NULL
            epoll_ctl(self.epfd, EPOLL_CTL_DEL, pump.src, &ev)  # fails harmlessly once closed
        waiter = pump.waiter
        pump.waiter = None
        pump.locked = None
        return waiter

    cdef int _grow(self, int fd) except -1:
        cdef size_t cap = <size_t>self.by_fd_cap * 2 if self.by_fd_cap else 1024
        cdef void** table
        if fd >= FD_TABLE_MAX:
            raise OSError(EMFILE, f"descriptor {fd} is past the reactor's table ({FD_TABLE_MAX} entries)")
        while cap <= <size_t>fd:
            cap *= 2
        if cap > FD_TABLE_MAX:
            cap = FD_TABLE_MAX
        table = <void**>realloc(self.by_fd, cap * sizeof(void*))
        if table == NULL:
            raise MemoryError()
        memset(table + self.by_fd_cap, 0, (cap - <size_t>self.by_fd_cap) * sizeof(void*))
        self.by_fd = table
        self.by_fd_cap = <int>cap
        return 0

    def park(self, Pump pump not None, object waiter not None):
        """The pump's own step said P_WAIT_READ: step it again while its source became readable
        meanwhile; -1 when it waits now (``waiter`` gets the next status)."""
        cdef int st
        if not pump.attached:
            raise RuntimeError("pump not attached")
        while pump.ready_in:
            pump.ready_in = False
            self.steps += 1
            st = pump._step(MAY_ASK)
            if st != PS_WAIT_READ:
                return st
        pump.waiter = waiter
        return -1

    def turn(self):
        """Step every pump whose source is ready; wake the greenlets of those that need Python."""
        cdef epoll_event evs[REACTOR_EVENTS]
        cdef int n, rounds = 0
        n = epoll_wait(self.epfd, evs, REACTOR_EVENTS, 0)
        if n <= 0:
            return
        self.turns += 1
        while True:
            self._handle(evs, n)
            if n < 2 or rounds >= self.repoll:
                return
            rounds += 1
            self.repolls += 1
            n = epoll_wait(self.epfd, evs, REACTOR_EVENTS, 0)
            if n <= 0:
                self.polls_empty += 1
                return

    cdef int _handle(self, epoll_event* evs, int n) except -1:
        cdef int i, st, fd
        cdef Pump pump
        for i in range(n):
            fd = evs[i].data.fd
            if fd < 0 or fd >= self.by_fd_cap or self.by_fd[fd] == NULL:
                continue  # detached by a greenlet woken earlier in this turn
            pump = <Pump>self.by_fd[fd]
            if evs[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR):
                # The peer closed (or the socket failed).  Edge-triggered: if the close came in
                # with the last bytes, no later edge will report it, so the pump reads until
                # recv says so instead of trusting a short read to mean "drained".
                pump.peer_closed = True
            if pump.waiter is None:
                pump.ready_in = True  # its greenlet is busy: acted on when it parks
                continue
            self.steps += 1
            if self.use_ring and n >= self.ring_min:
                pump.ring = &self.ring
            try:
                st = pump._step(MAY_ASK)
            except BaseException:
                st = PS_YIELD  # the greenlet steps again itself and meets the error there
            if st == PS_QUEUED:
                self._queue(pump)
                if self.nqueued >= URING_BATCH:
                    self._run_ring()
            else:
                self._settle(pump, st)
        if self.nqueued:
            self._run_ring()
        if self.wake:
            self._wake_all()
        return 0

    cdef int _settle(self, Pump pump, int st) except -1:
        """A pump stepped in this turn is done (``st``): parked again, or its greenlet is woken
        once the turn's operations are all done."""
        pump.ring = NULL
        if st == PS_WAIT_READ:
            return 0
        waiter = pump.waiter
        pump.waiter = None
        self.wakeups += 1
        self.wake.append(waiter)
        self.wake.append(st)
        return 0

    cdef int _wake_all(self) except -1:
        """Wake the greenlets of the pumps that need Python, each once, in order; one that raises
        does not keep the others waiting (the first error goes on to the hub afterwards)."""
        cdef list wake = self.wake
        cdef Py_ssize_t i
        cdef object error = None
        self.wake = []
        for i in range(0, len(wake), 2):
            try:
                wake[i].switch(wake[i + 1])  # runs the greenlet until it waits again
            except BaseException as exc:
                if error is None:
                    error = exc
        if error is not None:
            raise error
        return 0

    cdef inline int _queue(self, Pump pump) except -1:
        if self.nqueued >= URING_BATCH:  # cannot happen (see ``qbuf``): fail loudly, not past the array
            raise RuntimeError("reactor ring queue overflow")
        Py_INCREF(pump)  # dropped by _run_ring (or _cancel_pending) once its operation is done
        self.queued[self.nqueued] = <void*>pump
        self.nqueued += 1
        return 0

    cdef inline void _release(self, void** pumps, int n) noexcept:
        """Drop the references ``_queue`` took for ``pumps[:n]``."""
        cdef int i
        for i in range(n):
            Py_DECREF(<object>pumps[i])

    cdef int _run_ring(self) except -1:
        """Issue the queued operations with one io_uring_enter, resume their pumps, and again
        while resumed pumps queue more."""
        cdef void** batch
        cdef int nb, queued_n, i
        cdef int k, res, left
        cdef uint64_t data
        while self.nqueued:
            # Issue this queue; resumed pumps queue into the other array meanwhile.
            batch = self.queued
            nb = queued_n = self.nqueued
            if batch == &self.qbuf[0]:
                self.queued = &self.qbuf[URING_BATCH]
            else:
                self.queued = &self.qbuf[0]
            self.nqueued = 0
            if not self.use_ring:
                for i in range(nb):
                    self._step_plain(<Pump>batch[i])
                self._release(batch, queued_n)
                continue
            k = rmq_uring_submit(&self.ring, 0)
            self.submits += 1
            if k < nb:
                # The kernel took the first k (none: k < 0 is -errno); forget the others' entries
                # and step their pumps with plain system calls.  The ring is not used again.
                rmq_uring_rewind(&self.ring)
                self._give_up(f"io_uring_enter failed ({c_strerror(-k).decode() if k < 0 else 'took part of a batch'})")
                if k < 0:
                    k = 0
                for i in range(k, nb):
                    self._step_plain(<Pump>batch[i])
                nb = k
            self.ring_ops += k
            for i in range(nb):
                (<Pump>batch[i]).in_ring = True
            left = k
            while left > 0:
                if rmq_uring_reap(&self.ring, &data, &res):
                    if data != 0:  # (0: a cancellation's own completion)
                        left -= 1
                        self._complete(<Pump><void*>data, res)
                    continue
                # An operation did not complete inside io_uring_enter, which the check at start
                # rules out.  Its buffer is the kernel's until it completes: cancel it, wait for
                # its completion, and give the ring up.
                left = self._cancel_pending(batch, nb, left)
            self._release(batch, queued_n)
        return 0

    cdef int _complete(self, Pump pump, int res) except -1:
        """The completion of ``pump``'s operation: resume it with the result."""
        cdef int st
        pump.in_ring = False
        if not self.use_ring:
            pump.ring = NULL
            if res == -ECANCELED:  # cancelled (see _cancel_pending): it did not happen
                self._step_plain(pump)
                return 0
        try:
            st = pump._resume(res, MAY_ASK)
        except BaseException:
            st = PS_YIELD
        if st == PS_QUEUED:
            self._queue(pump)
        else:
            self._settle(pump, st)
        return 0

    cdef int _step_plain(self, Pump pump) except -1:
        """Step a pump whose queued operation is not issued through the ring after all."""
        cdef int st
        pump._unqueue()
        try:
            st = pump._step(MAY_ASK)
        except BaseException:
            st = PS_YIELD
        self._settle(pump, st)
        return 0

    cdef int _cancel_pending(self, void** batch, int nb, int left) except -1:
        """``left`` operations of ``batch`` have not completed: drop what resumed pumps queued
        since (not submitted yet), cancel those operations and wait until each has completed;
        the ring is given up.  Returns how many completions are still to be reaped (0 when the
        wait itself failed and the pumps were ended instead)."""
        cdef Pump pump
        cdef void** later = self.queued
        cdef int nlater = self.nqueued
        cdef int n = 0, tries, i
        rmq_uring_rewind(&self.ring)
        # (``later`` stays valid: nothing queues from here on, the ring is given up.)
        self.nqueued = 0
        self._give_up("an operation did not complete inside io_uring_enter")
        for i in range(nb):
            pump = <Pump>batch[i]
            if pump.in_ring:
                rmq_uring_prep_cancel(&self.ring, <uint64_t><void*>pump)
                n += 1
        # Wait for the cancellations' completions and the operations' own.
        for tries in range(3):
            if rmq_uring_submit(&self.ring, n + left) >= 0:
                break
        else:
            # The kernel may still write into those buffers: their pumps end with an error and
            # keep them for good (never given back, see Pump.__dealloc__).
            for i in range(nb):
                pump = <Pump>batch[i]
                if pump.in_ring:
                    pump.ring = NULL
                    pump.errno_value = EIO
                    self._settle(pump, PS_OS_ERROR)
            left = 0
        for i in range(nlater):
            self._step_plain(<Pump>later[i])
        self._release(later, nlater)
        return left

    cdef int _give_up(self, str why) except -1:
        self.use_ring = False
        self.uring_off = why
        return 0
