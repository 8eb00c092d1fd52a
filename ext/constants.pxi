# Included by _speedups.pyx. Constants and small tables shared with the pure-Python twins (asserted
# equal by tests/test_twins.py).

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
