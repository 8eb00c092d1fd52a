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

DEF REACTOR_EVENTS = 256


cdef class Reactor:
    """One epoll set for the sources of the compiled pumps of a process (see the section comment).

    The relay registers a pump with ``attach`` when its session starts and ``detach`` when it
    ends (before the sockets close: a file descriptor number may be reused at once).  After its
    own ``step`` returned P_WAIT_READ, the pump's greenlet calls ``park``: it returns a status
    at once if the source became readable meanwhile, else -1 and the greenlet waits on the
    Waiter it passed.  The hub calls ``turn`` when the epoll set is readable.
    """

    cdef int epfd
    cdef dict pumps              # source fd -> Pump
    cdef readonly Py_ssize_t turns, steps, wakeups, repolls, polls_empty
    # Extra epoll_waits a turn may make while the previous one found several sources ready (0:
    # one per turn): under concurrent load more are ready by the time those are stepped, and
    # taking them here saves the hub's wait, libev's getpid and the callback into the turn.
    cdef public int repoll

    def __cinit__(self):
        self.epfd = epoll_create1(EPOLL_CLOEXEC)
        if self.epfd < 0:
            raise OSError(errno, c_strerror(errno).decode())
        self.pumps = {}

    def __dealloc__(self):
        if self.epfd >= 0:
            c_close(self.epfd)

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
        if epoll_ctl(self.epfd, EPOLL_CTL_ADD, pump.src, &ev) < 0:
            raise OSError(errno, c_strerror(errno).decode())
        self.pumps[pump.src] = pump
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
            epoll_ctl(self.epfd, EPOLL_CTL_DEL, pump.src, &ev)  # fails harmlessly once closed
        waiter = pump.waiter
        pump.waiter = None
        pump.locked = None
        return waiter

    def park(self, Pump pump not None, object waiter not None):
        """The pump's own step said P_WAIT_READ: step it again while its source became readable
        meanwhile; -1 when it waits now (``waiter`` gets the next status)."""
        cdef int st
        if not pump.attached:
            raise RuntimeError("pump not attached")
        while pump.ready_in:
            pump.ready_in = False
            self.steps += 1
            st = pump._step(pump.locked is None or not pump.locked())
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

    cdef void _handle(self, epoll_event* evs, int n) except *:
        cdef int i, st
        cdef Pump pump
        cdef object found, waiter
        for i in range(n):
            found = self.pumps.get(evs[i].data.fd)
            if found is None:
                continue  # detached by a greenlet woken earlier in this turn
            pump = <Pump>found
            if evs[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR):
                # The peer closed (or the socket failed).  Edge-triggered: if the close came in
                # with the last bytes, no later edge will report it, so the pump reads until
                # recv says so instead of trusting a short read to mean "drained".
                pump.peer_closed = True
            if pump.waiter is None:
                pump.ready_in = True  # its greenlet is busy: acted on when it parks
                continue
            self.steps += 1
            try:
                st = pump._step(pump.locked is None or not pump.locked())
            except BaseException:
                st = PS_YIELD  # the greenlet steps again itself and meets the error there
            if st == PS_WAIT_READ:
                continue
            waiter = pump.waiter
            pump.waiter = None
            self.wakeups += 1
            waiter.switch(st)  # runs the greenlet until it waits again
