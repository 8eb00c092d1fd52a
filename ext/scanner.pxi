# Included by _speedups.pyx. FrameScanner: walks the frames of a receive buffer (twin:
# rmqfast/codec/_scan_py.FrameScanner).

cdef bint delay_topic(list patterns, const uint8_t* t, Py_ssize_t n) except -1:
    """``t`` is one of ``patterns``: a name, or a prefix ending in '*' ('*' alone: every topic)."""
    cdef bytes pat
    cdef Py_ssize_t m
    cdef const uint8_t* q
    for pat in patterns:
        m = len(pat)
        q = <const uint8_t*><const char*>pat
        if m > 0 and q[m - 1] == 42:
            if n >= m - 1 and memcmp(t, q, m - 1) == 0:
                return True
        elif m == n and memcmp(t, q, n) == 0:
            return True
    return False


cdef uint8_t _NO_ACTIONS[CODE_SLOTS_C]  # zero: no code asks for policy
cdef dict _ACTION_TABLES = {}  # action table bytes -> the one object scanners share


cdef class FrameScanner:
    """Walks Remoting frames in receive buffers; see ``rmqfast/codec/_scan_py.py``."""

    cdef readonly ScanStats stats
    cdef public bint response_policy
    cdef readonly Py_ssize_t max_frame_size
    cdef readonly Py_ssize_t max_header_size
    cdef const uint8_t* _actions  # CODE_SLOTS_C entries: _NO_ACTIONS or the bytes of _actions_ref
    cdef bytes _actions_ref       # one object per distinct table (_ACTION_TABLES), shared by scanners
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
    cdef public list delay_topics  # [delay] topics (bytes; b"*" ends a prefix): their delayed sends go to policy
    cdef public list policy_topics  # topics (bytes; b"*" ends a prefix) whose every send goes to policy
    cdef public AddressMap address_map  # store hosts of records answers (ACTION_RECORDS requests), None: policy
    cdef public int records      # 1 when the last EV_POLICY is a records answer the scanner did not map

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
        self.records = 0
        self.response_policy = response_policy
        self.max_frame_size = max_frame_size
        self.max_header_size = max_header_size
        self._actions = _NO_ACTIONS
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
        # A copy (later changes to ``actions`` do not reach the scanner), one per distinct table:
        # every scanner of a chain shares it instead of carrying 2 KiB of its own.
        cdef bytes table = bytes(actions)
        if len(_ACTION_TABLES) >= 64 and table not in _ACTION_TABLES:
            _ACTION_TABLES.clear()  # tables of reloads long gone; scanners keep their own reference
        table = _ACTION_TABLES.setdefault(table, table)
        self._actions_ref = table
        self._actions = <const uint8_t*><const char*>table

    def scan(self, buf, Py_ssize_t start, Py_ssize_t end, int64_t now_ns=-1):
        """See ``_scan_py.FrameScanner.scan``.  The store hosts of records answers are patched in
        ``buf`` when it is writable; in a read-only buffer such an answer goes to policy."""
        cdef Py_buffer view
        cdef bint writable = True
        try:
            PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
        except BufferError:
            PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
            writable = False
        try:
            if start < 0 or end > view.len or start > end:
                raise ValueError(f"scan range [{start}:{end}] outside a buffer of {view.len} bytes")
            return self._scan(<uint8_t*>view.buf, start, end, now_ns, writable)
        finally:
            PyBuffer_Release(&view)

    cdef tuple _scan(self, uint8_t* p, Py_ssize_t start, Py_ssize_t end, int64_t now, bint writable=True):
        """``scan``'s (event, a, b) as a tuple: for the Python API; the pump calls ``_scan_c``."""
        cdef Py_ssize_t a, b
        cdef int ev = self._scan_c(p, start, end, now, writable, &a, &b)
        return (ev, a, b)

    cdef int _scan_c(self, uint8_t* p, Py_ssize_t start, Py_ssize_t end, int64_t now, bint writable,
                     Py_ssize_t* out_a, Py_ssize_t* out_b) except -1:
        """The scan: returns the event (0 forward, 1 policy frame, 2 protocol error) and stores
        its two positions in ``out_a``/``out_b`` (no Python object per frame)."""
        cdef Py_ssize_t pos = start, avail, take, total
        cdef int32_t length, mark
        cdef int stype, err, slot
        cdef Py_ssize_t hlen
        cdef bint policy, is_response, limit_check, batch, rec
        cdef int limited, topic_idx = -1, want
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
                out_a[0] = end
                out_b[0] = 0
                return 0
        while pos < end:
            avail = end - pos
            if avail < 4:
                out_a[0] = pos
                out_b[0] = 8
                return 0
            length = rd_i32(p + pos)
            if length < 4:
                return self._fail_c(out_a, out_b, pos, f"frame length {length} is shorter than the 4-byte header-length word")
            total = <Py_ssize_t>length + 4
            if total > self.max_frame_size:
                return self._fail_c(out_a, out_b, pos, f"frame of {total} bytes exceeds the limit of {self.max_frame_size} bytes")
            if avail < 8:
                out_a[0] = pos
                out_b[0] = 8
                return 0
            mark = rd_i32(p + pos + 4)
            stype = (mark >> 24) & 0xFF
            hlen = mark & 0xFFFFFF
            if stype > 1:
                return self._fail_c(out_a, out_b, pos, f"unknown serialize type {stype} (0 = JSON, 1 = ROCKETMQ)")
            if hlen > length - 4:
                return self._fail_c(out_a, out_b, pos, f"header length {hlen} exceeds frame length {length}")
            if hlen > self.max_header_size:
                return self._fail_c(out_a, out_b, pos, f"header of {hlen} bytes exceeds the limit of {self.max_header_size} bytes")
            if avail < 8 + hlen:
                out_a[0] = pos
                out_b[0] = 8 + hlen
                return 0
            header_info_clear(&info)
            if stype == 0:
                err = parse_json_header(p + pos + 8, hlen, &info)
            else:
                err = parse_binary_header(p + pos + 8, hlen, &info)
            if err != E_OK:
                return self._fail_c(out_a, out_b, pos, f"invalid {'JSON' if stype == 0 else 'ROCKETMQ'} header: {_ERRORS[err]}")
            slot = code_slot(info.code)
            is_response = info.flag & 1
            limit_check = False
            batch = False
            rec = False
            ts = -1
            ps = -1
            if is_response:
                policy = self.response_policy
                if self.inflight is not None and self.inflight.nwant > 0:
                    want = self.inflight.want_of_c(self.direction ^ 1, info.opaque)
                    policy = policy or want == 1
                    rec = want == 2
            else:
                # The topic and properties the broker reads for this request code.
                # A send is a batch when its header's batch flag reads true, whatever its code
                # (SendMessageProcessor: requestHeader.isBatch()); reply messages never are.
                if info.code == SEND_V2 or info.code == SEND_BATCH or info.code == SEND_REPLY_V2:
                    ts, tl, tesc = info.b_start, info.b_len, info.b_esc
                    ps, pl, pesc = info.i_start, info.i_len, info.i_esc
                    batch = info.m_true and info.code != SEND_REPLY_V2
                elif info.code == SEND_V1 or info.code == SEND_REPLY_V1:
                    ts, tl, tesc = info.t_start, info.t_len, info.t_esc
                    ps, pl, pesc = info.pr_start, info.pr_len, info.pr_esc
                    batch = info.batch_true and info.code == SEND_V1
                elif info.code == PULL or info.code == LITE_PULL:
                    ts, tl, tesc = info.t_start, info.t_len, info.t_esc
                if ts >= 0 and tesc:
                    return self._fail_c(out_a, out_b, pos, f"invalid {'JSON' if stype == 0 else 'ROCKETMQ'} header: {_ERRORS[E_TOPIC_ESCAPED]}")
                policy = self._actions[slot] == 1
                if self._actions[slot] == ACTION_RECORDS_C and not info.flag & 2:
                    # the scanner maps the store hosts of the answer (records.pxi); one request per
                    # opaque, or its answer could not be told apart
                    if self.inflight is None:
                        policy = True
                    elif self.inflight.want_of_c(self.direction, info.opaque) >= 0:
                        return self._fail_c(out_a, out_b, pos, f"request {info.code} reuses opaque {info.opaque} while a request "
                                               "with it is unanswered (its answer could not be told apart and "
                                               "its broker addresses rewritten)")
                    elif self.inflight.count >= self.inflight.capacity:
                        return self._fail_c(out_a, out_b, pos, f"more than {self.inflight.capacity} requests unanswered on one "
                                               "connection (the answers' broker addresses could not be rewritten)")
                    else:
                        rec = True
                elif self.inflight is not None and self.inflight.nwant > 0 and \
                        self.inflight.want_of_c(self.direction, info.opaque) == 2:
                    return self._fail_c(out_a, out_b, pos, f"request {info.code} reuses opaque {info.opaque} while a request "
                                           "whose answer's broker addresses are rewritten is unanswered")
                if not policy and ts >= 0 and self.policy_topics and info.code != PULL and info.code != LITE_PULL:
                    # every send of these topics leaves the fast path (gray releases: split topics),
                    # reply messages too (the broker stores them in the header's topic and queue)
                    policy = delay_topic(self.policy_topics, p + pos + 8 + ts, tl)
                if not policy and ts >= 0 and self.delay_topics and \
                        (info.code == SEND_V2 or info.code == SEND_BATCH or info.code == SEND_V1):
                    # proxy-held delay: only a delay topic's sends that ask for a delivery time
                    # (a batch: its messages' properties are in the body) leave the fast path
                    policy = delay_topic(self.delay_topics, p + pos + 8 + ts, tl) and (
                        batch or (ps >= 0 and props_delay(p + pos + 8 + ps, pl, pesc)))
                if self.limiter is not None and self.limiter.active and ts >= 0 and \
                        info.code != PULL and info.code != LITE_PULL:  # sends and reply messages
                    # a limited send is decided whole (a rejected one is never relayed)
                    limit_check = self.limiter.applies(p + pos + 8 + ts, <int>tl)
            if (policy or batch or limit_check or (rec and is_response and info.code == 0)) and avail < total:
                out_a[0] = pos
                out_b[0] = total
                return 0
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
                topic_idx = self._count_topic(p + pos, hlen, total, info.code, ts, tl, batch)
            limited = -1
            if limit_check:
                if now < 0:
                    now = monotonic_ns()
                limited = self.limiter.decide(
                    p + pos + 8 + ts, <int>tl,
                    p + pos + 8 + ps if ps >= 0 else NULL, pl, pesc,
                    <int64_t>count_batch(p + pos + 8 + hlen, total - 8 - hlen) if batch else 1,
                    total, now)
                if limited >= 0:
                    policy = True
            if rec and is_response and not policy and info.code == 0 and 8 + hlen < total:
                # a records answer: its store hosts mapped in place, or the frame to policy
                if self.address_map is None or not writable or \
                        map_records(p, pos + 8 + hlen, pos + total, self.address_map) != RS_OK:
                    policy = True
            elif rec and is_response and not policy and 8 + hlen == total and 0 <= info.code <= 12 and \
                    (info.code == 0 or info.code >= 10):
                # a send answer (SUCCESS, or stored with FLUSH_DISK_TIMEOUT 10, SLAVE_NOT_AVAILABLE 11,
                # FLUSH_SLAVE_TIMEOUT 12): the offset ids in its header mapped in place, or to policy
                if self.address_map is None or not writable or \
                        map_header_ids(p + pos + 8, hlen, stype, self.address_map) != RS_OK:
                    policy = True
            if self.inflight is not None:
                self._time(slot, info.code, info.flag, info.opaque, now, policy, total, topic_idx,
                           ACTION_RECORDS_C if rec and not is_response else 0)
            if policy:
                self.records = rec and is_response
                self.limited = limited
                self.code = info.code
                self.flag = info.flag
                self.opaque = info.opaque
                out_a[0] = pos
                out_b[0] = pos + total
                return 1
            if avail < total:
                self._skip = total - avail
                out_a[0] = end
                out_b[0] = 0
                return 0
            pos += total
        out_a[0] = pos
        out_b[0] = 0
        return 0

    cdef void _time(self, int slot, int32_t code, int flag, int32_t opaque, int64_t now, bint policy,
                    Py_ssize_t total, int topic_idx, int want=0) except *:
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
        elif not self.inflight.track_c(self.direction, opaque, slot, now, total, topic_idx, want):
            self.stats.untracked += 1

    cdef int _count_topic(self, const uint8_t* f, Py_ssize_t hlen, Py_ssize_t total, int code, Py_ssize_t s,
                          Py_ssize_t n, bint batch) noexcept:
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
            if batch:
                e.messages += count_batch(f + 8 + hlen, total - 8 - hlen)
            else:
                e.messages += 1
        return <int>(e - self.stats._topics)

    cdef int _fail_c(self, Py_ssize_t* out_a, Py_ssize_t* out_b, Py_ssize_t pos, str message) except -1:
        self.error = message
        self.stats.protocol_errors += 1
        out_a[0] = pos
        out_b[0] = 0
        return 2
