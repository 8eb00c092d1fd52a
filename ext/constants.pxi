# Included by _speedups.pyx. The lookups over the shared tables (the twin of the functions of
# rmqfast/codec/tables.py; asserted equal by tests/test_twins.py) and the request codes the scanner reads.

# The shared constants themselves are in tables.pxi (generated from rmqfast/codec/tables.py).

cdef inline int latency_bucket(int64_t ns) noexcept nogil:
    cdef int i
    for i in range(LATENCY_BOUNDS_NS_LEN_C):
        if ns <= LATENCY_BOUNDS_NS_C[i]:
            return i
    return LATENCY_BOUNDS_NS_LEN_C


cdef inline int result_index(int32_t code) noexcept nogil:
    # same table as rmqfast.codec.tables.RESULT_OF_CODE
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
    return R_OTHER_ERROR_C


def result_index_of(int32_t code):
    """:func:`result_index` from Python (tests compare it with tables.result_index)."""
    return result_index(code)


def latency_bucket_of(int64_t ns):
    """:func:`latency_bucket` from Python (tests compare it with tables.latency_bucket)."""
    return latency_bucket(ns)

cdef enum:
    SEND_V1 = 10
    SEND_V2 = 310
    SEND_BATCH = 320
    SEND_REPLY_V1 = 324
    SEND_REPLY_V2 = 325
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
