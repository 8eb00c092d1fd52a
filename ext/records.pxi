# Included by _speedups.pyx. Broker addresses in the store records of pull, pop, query and view
# answers, mapped to proxy endpoints in C (twin: rmqfast/codec/_records_py.py).
#
# A records answer's body is a sequence of store records (apache/rocketmq MessageDecoder):
#   TOTALSIZE i32 | MAGICCODE i32 | BODYCRC | QUEUEID | FLAG | QUEUEOFFSET i64 | PHYSICALOFFSET i64 |
#   SYSFLAG i32 (36) | BORNTIMESTAMP i64 | BORNHOST 4+4, or 16+4 with sysFlag 0x10 (48) |
#   STORETIMESTAMP i64 | STOREHOST 4+4, or 16+4 with sysFlag 0x20 | ...
# Only the IPv4 STOREHOST (8 bytes: address and int32 port) is read and patched, at the same
# length; bodies (compressed or inner batches alike), properties and CRCs are not touched.  An
# IPv6 store host is left as it is.  The walk first checks every record (sizes, magic codes, and
# that its fields as a client reads them end at its TOTALSIZE) and
# looks every store host up; only when all of them are known does a second pass patch them.  A
# body that is not a sequence of whole records, or a store host the map does not know, leaves
# the frame as it is for the policy path (the filter resolves the address, or logs and relays
# the answer unchanged): the walk never guesses.

# The records constants (ACTION_RECORDS, REC_*, MAX_ADDRESSES, RECORD_MAGIC_*, MIN_RECORD, SYSFLAG_POS,
# STOREHOST_POS...) are in tables.pxi, generated from rmqfast/codec/tables.py.
cdef enum:
    ADDR_SLOTS_C = 1024          # the open-addressing table of at most MAX_ADDRESSES_C addresses

cdef enum:
    RS_OK = REC_OK_C
    RS_MISS = REC_MISS_C
    RS_BAD = REC_BAD_C


cdef inline uint64_t rd_u64(const uint8_t* p) noexcept nogil:
    return ((<uint64_t>p[0] << 56) | (<uint64_t>p[1] << 48) | (<uint64_t>p[2] << 40) | (<uint64_t>p[3] << 32) |
            (<uint64_t>p[4] << 24) | (<uint64_t>p[5] << 16) | (<uint64_t>p[6] << 8) | <uint64_t>p[7])


cdef inline void wr_u64(uint8_t* p, uint64_t v) noexcept nogil:
    cdef int i
    for i in range(8):
        p[i] = <uint8_t>(v >> (56 - 8 * i))


cdef inline uint64_t _key_of(bytes raw) except? 0:
    if len(raw) != 8:
        raise ValueError(f"an address is 8 bytes (IPv4 and int32 port), got {len(raw)}")
    return rd_u64(<const uint8_t*><const char*>raw)


cdef class AddressMap:
    """Real broker ``ip4 + port`` (8 bytes) -> the 8 bytes the records get instead (itself: leave
    it), filled by the message-address filter and read by the scanner.  At most MAX_ADDRESSES
    entries; an address beyond them stays unknown (its answers take the policy path)."""

    cdef uint64_t keys[ADDR_SLOTS_C]
    cdef uint64_t vals[ADDR_SLOTS_C]
    cdef uint8_t used[ADDR_SLOTS_C]
    cdef readonly Py_ssize_t count
    cdef public uint64_t rewritten   # answers the scanner changed
    cdef public uint64_t walked      # answers the scanner walked and relayed in C

    def __len__(self):
        return self.count

    cdef inline Py_ssize_t _home(self, uint64_t key) noexcept nogil:
        return <Py_ssize_t>((key * 11400714819323198485ULL) >> 54)  # 10 bits: ADDR_SLOTS_C

    cdef bint lookup(self, uint64_t key, uint64_t* out) noexcept nogil:
        cdef Py_ssize_t j = self._home(key)
        while self.used[j]:
            if self.keys[j] == key:
                out[0] = self.vals[j]
                return True
            j = (j + 1) & (ADDR_SLOTS_C - 1)
        return False

    def set(self, bytes real not None, bytes new not None):
        """Remember ``real`` -> ``new``; False when the map is full (nothing stored)."""
        cdef uint64_t k = _key_of(real), v = _key_of(new)
        cdef Py_ssize_t j = self._home(k)
        while self.used[j]:
            if self.keys[j] == k:
                self.vals[j] = v
                return True
            j = (j + 1) & (ADDR_SLOTS_C - 1)
        if self.count >= MAX_ADDRESSES_C:
            return False
        self.used[j] = 1
        self.keys[j] = k
        self.vals[j] = v
        self.count += 1
        return True

    def get(self, bytes real not None):
        """The 8 bytes ``real`` maps to, or None."""
        cdef uint64_t v
        cdef bytearray out
        if not self.lookup(_key_of(real), &v):
            return None
        out = bytearray(8)
        wr_u64(<uint8_t*><char*>out, v)
        return bytes(out)


cdef inline bint layout_fits(const uint8_t* p, Py_ssize_t pos, Py_ssize_t total, int32_t sys_flag,
                             bint v2) noexcept nogil:
    """Whether the record's fields, read as a client reads them (``MessageDecoder.decode``: field by
    field, TOTALSIZE only stored), end exactly at TOTALSIZE: else the client would find the next
    record (and its store host) elsewhere than this walk.  A non-positive body or properties
    length reads nothing, a negative topic length throws (as in Java)."""
    cdef Py_ssize_t rec_end = pos + total, at
    cdef int64_t n
    at = pos + 84 + (12 if sys_flag & BORNHOST_V6_C else 0) + (12 if sys_flag & STOREHOST_V6_C else 0)  # BODYLENGTH
    if at + 4 > rec_end:
        return False
    n = rd_i32(p + at)
    at += 4 + (n if n > 0 else 0)
    if at + (2 if v2 else 1) > rec_end:
        return False
    n = rd_i16(p + at) if v2 else <int8_t>p[at]  # TOPIC length: int16 (V2) or signed byte (V1)
    if n < 0:
        return False
    at += (2 if v2 else 1) + n
    if at + 2 > rec_end:
        return False
    n = rd_i16(p + at)  # PROPERTIES length
    return at + 2 + (n if n > 0 else 0) == rec_end


cdef int walk_records(uint8_t* p, Py_ssize_t start, Py_ssize_t end, AddressMap amap, bint patch,
                      Py_ssize_t* seen, bint* changed) noexcept:
    """Walk the store records that fill ``p[start:end]``; RS_OK (patched when ``patch``), RS_MISS
    (a store host ``amap`` does not know) or RS_BAD (not a sequence of whole records)."""
    cdef Py_ssize_t pos = start, at
    cdef int32_t total, sys_flag, magic
    cdef uint64_t raw, new, last_raw = 0, last_new = 0
    cdef bint have_last = False  # the records of an answer mostly name one store host
    seen[0] = 0
    changed[0] = False
    while pos < end:
        if end - pos < MIN_RECORD_C:
            return RS_BAD
        total = rd_i32(p + pos)
        magic = rd_i32(p + pos + 4)
        if magic != RECORD_MAGIC_V1_I32_C and magic != RECORD_MAGIC_V2_I32_C:  # read as int32
            return RS_BAD
        if total < MIN_RECORD_C or total > end - pos:
            return RS_BAD
        sys_flag = rd_i32(p + pos + SYSFLAG_POS_C)
        if not patch and not layout_fits(p, pos, total, sys_flag, magic == -626843477):
            return RS_BAD  # (the patching pass follows a checking one over the same bytes)
        if not sys_flag & STOREHOST_V6_C:
            at = pos + (STOREHOST_POS_C if not sys_flag & BORNHOST_V6_C else STOREHOST_POS_C + 12)
            raw = rd_u64(p + at)
            if have_last and raw == last_raw:
                new = last_new
            elif amap.lookup(raw, &new):
                last_raw, last_new, have_last = raw, new, True
            else:
                return RS_MISS
            if patch and new != raw:
                wr_u64(p + at, new)
                changed[0] = True
        seen[0] += 1
        pos += total
    return RS_OK


cdef int map_records(uint8_t* p, Py_ssize_t start, Py_ssize_t end, AddressMap amap) noexcept:
    """Check, then patch: the body is changed only when every record is whole and known."""
    cdef Py_ssize_t seen
    cdef bint changed
    cdef int st = walk_records(p, start, end, amap, False, &seen, &changed)
    if st != RS_OK:
        return st
    walk_records(p, start, end, amap, True, &seen, &changed)
    amap.walked += 1
    if changed:
        amap.rewritten += 1
    return RS_OK


def walk_store_hosts(buf, Py_ssize_t start, Py_ssize_t end, AddressMap amap not None, bint patch=False):
    """``(status, records, changed)`` of the store records in ``buf[start:end]`` (REC_OK, REC_MISS,
    REC_BAD); with ``patch`` (a writable buffer) the known store hosts are rewritten in place, but
    only when the status is REC_OK (a first pass checks them all).  A test aid: the scanner walks
    the records of the answers it was asked to."""
    cdef Py_buffer view
    cdef Py_ssize_t seen
    cdef bint changed
    cdef int st
    PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE if patch else PyBUF_SIMPLE)
    try:
        if start < 0 or end > view.len or start > end:
            raise ValueError(f"walk range [{start}:{end}] outside a buffer of {view.len} bytes")
        st = walk_records(<uint8_t*>view.buf, start, end, amap, False, &seen, &changed)
        if st == RS_OK and patch:
            walk_records(<uint8_t*>view.buf, start, end, amap, True, &seen, &changed)
        return (st, seen, changed)
    finally:
        PyBuffer_Release(&view)


# Send answers (SEND_MESSAGE 10, V2 310, batch 320, reply 324/325) carry the offset message id in
# their ``msgId`` header field (a batch: comma-separated ids): 32 hex digits, of which the first 16
# are the store host's IPv4 address and int32 port (MessageDecoder.createMessageId).  The same map
# gives the endpoint; the 16 digits are rewritten in upper case (as createMessageId writes them), at
# the same length.  A header with the field twice, or an escaped value, goes to policy.

cdef int8_t HEX_VALUE[256]   # a hex digit's value, -1 for any other byte
cdef const char* HEX_UPPER = b"0123456789ABCDEF"


cdef void _init_hex() noexcept:
    cdef int c
    for c in range(256):
        HEX_VALUE[c] = -1
    for c in range(10):
        HEX_VALUE[48 + c] = <int8_t>c
    for c in range(6):
        HEX_VALUE[65 + c] = <int8_t>(10 + c)
        HEX_VALUE[97 + c] = <int8_t>(10 + c)


_init_hex()


cdef inline bint hex16(const uint8_t* s, uint64_t* out) noexcept nogil:
    """The 16 hex digits at ``s`` as 8 bytes (big-endian), False when one is not a hex digit."""
    cdef uint64_t v = 0
    cdef int i
    cdef int8_t d
    for i in range(16):
        d = HEX_VALUE[s[i]]
        if d < 0:
            return False
        v = (v << 4) | <uint64_t>d
    out[0] = v
    return True


cdef inline void wr_hex16(uint8_t* s, uint64_t v) noexcept nogil:
    cdef int i
    for i in range(16):
        s[i] = <uint8_t>HEX_UPPER[(v >> (60 - 4 * i)) & 15]


cdef inline Py_ssize_t find_msgid_key(const uint8_t* h, Py_ssize_t n, Py_ssize_t start) noexcept nogil:
    """Where the 9 bytes ``"msgId":"`` first are in ``h[start:n]``, or -1: found by its 'I' (rare in
    a header) with memchr, then compared; cheaper than memmem, which builds a table per call."""
    cdef const uint8_t* at
    cdef Py_ssize_t i = start + 4  # the 'I' is the needle's 5th byte
    while i < n - 4:
        at = <const uint8_t*>memchr(h + i, 73, <size_t>(n - 4 - i))
        if at == NULL:
            return -1
        i = at - h
        if memcmp(h + i - 4, b'"msgId":"', 9) == 0:
            return i - 4
        i += 1
    return -1


cdef int msgid_span(const uint8_t* h, Py_ssize_t hlen, int stype, Py_ssize_t* vs, Py_ssize_t* ve) noexcept nogil:
    """Where the value of the ``msgId`` field is in the header ``h``: RS_OK with ``vs`` = -1 when it
    has none; RS_BAD when it is there twice, escaped, or the header cannot be walked."""
    cdef Py_ssize_t at, s, e, pos, klen, vlen, rlen
    vs[0] = -1
    ve[0] = -1
    if stype == 0:
        at = find_msgid_key(h, hlen, 0)
        if at < 0:
            return RS_OK
        s = at + 9
        e = s
        while e < hlen and h[e] != 34:  # '"'
            if h[e] == 92:  # '\\': an escaped value is not an id
                return RS_BAD
            e += 1
        if e >= hlen or find_msgid_key(h, hlen, e) >= 0:
            return RS_BAD
        vs[0] = s
        ve[0] = e
        return RS_OK
    # ROCKETMQ: code 2, language 1, version 2, opaque 4, flag 4, remark (i32 length), ext fields
    # (i32 length), then per field: key (i16 length), value (i32 length)
    if hlen < 21:
        return RS_BAD
    rlen = rd_i32(h + 13)
    if rlen < 0 or 17 + rlen + 4 > hlen:
        return RS_BAD
    pos = 17 + rlen + 4
    while pos + 2 <= hlen:
        klen = rd_i16(h + pos)
        if klen < 0 or pos + 2 + klen + 4 > hlen:
            return RS_BAD
        vlen = rd_i32(h + pos + 2 + klen)
        if vlen < 0 or pos + 2 + klen + 4 + vlen > hlen:
            return RS_BAD
        if klen == 5 and memcmp(h + pos + 2, b"msgId", 5) == 0:
            if vs[0] >= 0:
                return RS_BAD
            vs[0] = pos + 2 + klen + 4
            ve[0] = vs[0] + vlen
        pos += 2 + klen + 4 + vlen
    return RS_OK


cdef int walk_ids(uint8_t* v, Py_ssize_t n, AddressMap amap, bint patch, bint* changed) noexcept:
    """The comma-separated ids of ``v[:n]``: RS_OK (each offset id's host known; patched when
    ``patch``) or RS_MISS.  An id that is not 32 characters starting with 16 hex digits is left."""
    cdef Py_ssize_t i = 0, j
    cdef uint64_t raw, new
    changed[0] = False
    while i <= n:
        j = i
        while j < n and v[j] != 44:  # ','
            j += 1
        if j - i == 32 and hex16(v + i, &raw):
            if not amap.lookup(raw, &new):
                return RS_MISS
            if patch and new != raw:
                wr_hex16(v + i, new)
                changed[0] = True
        i = j + 1
    return RS_OK


cdef int map_header_ids(uint8_t* h, Py_ssize_t hlen, int stype, AddressMap amap) noexcept:
    """The offset ids of a send answer's header, checked, then patched: RS_OK (nothing to do counts
    as OK), RS_MISS (a store host the map does not know) or RS_BAD (see :func:`msgid_span`)."""
    cdef Py_ssize_t vs, ve
    cdef bint changed = False
    cdef uint64_t raw, new
    cdef int st = msgid_span(h, hlen, stype, &vs, &ve)
    if st != RS_OK or vs < 0:
        return st
    if ve - vs == 32 and memchr(h + vs + 16, 44, 16) == NULL:  # one id (every send but a batch's): one pass
        if hex16(h + vs, &raw):  # (a ',' in the first 16 is not a hex digit either)
            if not amap.lookup(raw, &new):
                return RS_MISS
            if new != raw:
                wr_hex16(h + vs, new)
                changed = True
    else:
        st = walk_ids(h + vs, ve - vs, amap, False, &changed)
        if st != RS_OK:
            return st
        walk_ids(h + vs, ve - vs, amap, True, &changed)
    amap.walked += 1
    if changed:
        amap.rewritten += 1
    return RS_OK


def map_send_ids(buf, Py_ssize_t start, Py_ssize_t end, int stype, AddressMap amap not None):
    """REC_OK, REC_MISS or REC_BAD for the send-answer header in ``buf[start:end]`` (writable), its
    offset ids patched in place when REC_OK.  A test aid: the scanner maps the answers it tracks."""
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
    try:
        if start < 0 or end > view.len or start > end:
            raise ValueError(f"header range [{start}:{end}] outside a buffer of {view.len} bytes")
        if stype != 0 and stype != 1:
            raise ValueError(f"serialize type must be 0 (JSON) or 1 (ROCKETMQ), got {stype}")
        return map_header_ids(<uint8_t*>view.buf + start, end - start, stype, amap)
    finally:
        PyBuffer_Release(&view)
