# Type stub of the compiled hot path (ext/_speedups.pyx and its .pxi files).  The pure-Python
# twins (rmqfast/codec/_scan_py.py, rmqfast/codec/_header_py.py, rmqfast/limits/_limiter_py.py)
# have the same signatures; tests/test_twins.py checks the constants against them.

from collections.abc import Callable, Sequence
from typing import Any

from _typeshed import ReadableBuffer, WriteableBuffer

IMPLEMENTATION: str
EV_FORWARD: int
EV_POLICY: int
EV_ERROR: int
ACTION_PASS: int
ACTION_POLICY: int
ACTION_RECORDS: int
REC_OK: int
REC_MISS: int
REC_BAD: int
MAX_ADDRESSES: int
RECORD_MAGIC_V1: int
RECORD_MAGIC_V2: int
BORNHOST_V6: int
STOREHOST_V6: int
MIN_RECORD: int
SYSFLAG_POS: int
STOREHOST_POS: int
CODE_SLOTS: int
OTHER_SLOT: int
TOPIC_SLOTS: int
MAX_TOPIC_LEN: int
OTHER_TOPIC: bytes
DEFAULT_MAX_FRAME: int
DEFAULT_MAX_HEADER: int
MAX_TRACKED: int
LATENCY_BOUNDS_NS: tuple[int, ...]
LATENCY_BUCKETS: int
NRESULTS: int
R_ONEWAY: int
R_UNANSWERED: int
SAMPLE_RING: int
MAX_JSON_DEPTH: int
SLOT_WORDS: int
SLOT_BYTES: int
MAX_RULES: int
SHM_HEADER_BYTES: int
SHM_BYTES: int
MODE_LIMIT: int
MODE_REJECT: int
MODE_OPEN: int
P_WAIT_READ: int
P_WAIT_WRITE: int
P_WAIT_LOCK: int
P_POLICY: int
P_EOF: int
P_OS_ERROR: int
P_PROTOCOL_ERROR: int
P_YIELD: int
P_BOUNDARY: int
P_OVER_BUDGET: int
_ERRORS: tuple[str, ...]

# header-walk error codes (indexes into _ERRORS); the same names as in rmqfast.codec._header_py
E_OK: int
E_UNTERMINATED_STRING: int
E_VALUE_EXPECTED: int
E_UNTERMINATED_NESTED: int
E_UNEXPECTED_CHAR: int
E_INT_RANGE: int
E_INT_EXPECTED: int
E_NOT_OBJECT: int
E_NO_CODE: int
E_KEY_EXPECTED: int
E_COLON_EXPECTED: int
E_COMMA_EXPECTED: int
E_TRAILING: int
E_BIN_SHORT: int
E_BIN_REMARK: int
E_BIN_EXT: int
E_BIN_KEY_TRUNC: int
E_BIN_KEY: int
E_BIN_VALUE: int
E_BAD_ESCAPE: int
E_CONTROL_CHAR: int
E_BAD_UTF8: int
E_BAD_NUMBER: int
E_TOO_DEEP: int
E_KEY_ESCAPED: int
E_KEY_VARIANT: int
E_DUP_KEY: int
E_EXT_KEY_ESCAPED: int
E_EXT_DUP_KEY: int
E_EXT_NOT_STRING: int
E_BIN_TRAILING: int
E_BIN_DUP_KEY: int
E_TOPIC_ESCAPED: int

def code_slot(code: int) -> int: ...
def slot_code(slot: int) -> int | None: ...
def result_index_of(code: int) -> int: ...
def latency_bucket_of(ns: int) -> int: ...
def scanner_skip(scanner: FrameScanner) -> int: ...

class ScanStats:
    frames: int
    bytes: int
    protocol_errors: int
    untracked: int
    samples_dropped: int
    def __init__(self) -> None: ...
    def set_sampling(self, every: int) -> None: ...
    def take_samples(self) -> list[tuple[int, int, int, int, bytes, int, int, int]]: ...
    def observe(self, slot: int, ns: int, result: int) -> None: ...
    def count_result(self, slot: int, result: int) -> None: ...
    def latencies(self) -> list[tuple[int, tuple[int, ...], int]]: ...
    def results(self) -> list[tuple[int, int, int]]: ...
    @property
    def request_counts(self) -> list[int]: ...
    @property
    def request_bytes(self) -> list[int]: ...
    @property
    def response_counts(self) -> list[int]: ...
    def requests(self) -> list[tuple[int, int, int]]: ...
    def responses(self) -> list[tuple[int, int]]: ...
    def topics(self) -> list[tuple[bytes, int, int, int, int]]: ...

class InFlight:
    @property
    def capacity(self) -> int: ...
    @property
    def nwant(self) -> int: ...
    def __init__(self, capacity: int = ...) -> None: ...
    def __len__(self) -> int: ...
    def track(self, direction: int, opaque: int, slot: int, now_ns: int, req_bytes: int = 0, topic: int = -1,
              want: int = 0) -> bool: ...
    def want_of(self, direction: int, opaque: int) -> int: ...
    def take(self, direction: int, opaque: int) -> tuple[int, int] | None: ...
    def waiting(self, direction: int) -> list[tuple[int, int]]: ...
    def abandon(self, stats: ScanStats) -> int: ...

class AddressMap:
    rewritten: int
    walked: int
    @property
    def count(self) -> int: ...
    def __len__(self) -> int: ...
    def set(self, real: bytes, new: bytes) -> bool: ...
    def get(self, real: bytes) -> bytes | None: ...

def walk_store_hosts(buf: ReadableBuffer, start: int, end: int, amap: AddressMap,
                     patch: bool = False) -> tuple[int, int, bool]: ...

class Limiter:
    @property
    def nrules(self) -> int: ...
    @property
    def active(self) -> bool: ...
    def __init__(self, shm: WriteableBuffer) -> None: ...
    def configure(self, rules: Sequence[tuple[Any, ...]]) -> None: ...
    def counters(self) -> list[tuple[int, int, int]]: ...
    def admit(self, topic: bytes, tag: bytes | None = None, msgs: int = 1, nbytes: int = 0,
              now_ns: int = -1) -> int: ...

class FrameScanner:
    response_policy: bool
    requests: int
    responses: int
    error: str
    code: int
    flag: int
    opaque: int
    limiter: Limiter | None
    limited: int
    conn_id: int
    delay_topics: list[bytes] | None
    policy_topics: list[bytes] | None
    address_map: AddressMap | None
    records: int
    @property
    def stats(self) -> ScanStats: ...
    @property
    def max_frame_size(self) -> int: ...
    @property
    def max_header_size(self) -> int: ...
    @property
    def inflight(self) -> InFlight | None: ...
    @property
    def direction(self) -> int: ...
    def __init__(self, stats: ScanStats, *, actions: bytes | None = None, response_policy: bool = False,
                 max_frame_size: int = ..., max_header_size: int = ..., inflight: InFlight | None = None,
                 direction: int = 0, limiter: Limiter | None = None) -> None: ...
    def set_actions(self, actions: bytes) -> None: ...
    def scan(self, buf: ReadableBuffer, start: int, end: int, now_ns: int = -1) -> tuple[int, int, int]: ...

class BufferBudget:
    limit: int
    used: int
    def __init__(self, limit: int = ...) -> None: ...

def pump_pool_free() -> int: ...

class Pump:
    hold: bool
    locked: Callable[[], bool] | None  # the destination's write lock's ``locked`` (None: no lock yet)
    @property
    def errno_value(self) -> int: ...
    @property
    def frame_start(self) -> int: ...
    @property
    def frame_end(self) -> int: ...
    @property
    def budget(self) -> BufferBudget | None: ...
    @property
    def need(self) -> int: ...
    @property
    def buffered(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def holds_buffer(self) -> bool: ...
    @property
    def at_boundary(self) -> bool: ...
    @property
    def stalled_since(self) -> int: ...
    def __init__(self, scanner: FrameScanner, src_fd: int, dst_fd: int, size: int,
                 budget: BufferBudget | None = None) -> None: ...
    @property
    def last_receive(self) -> int: ...
    def frame(self) -> bytes: ...
    def consume(self) -> None: ...
    def step(self, may_send: bool) -> int: ...

class Reactor:
    @property
    def turns(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def wakeups(self) -> int: ...
    @property
    def repolls(self) -> int: ...
    @property
    def polls_empty(self) -> int: ...
    repoll: int
    def __init__(self) -> None: ...
    def fileno(self) -> int: ...
    def __len__(self) -> int: ...
    def attach(self, pump: Pump, locked: Callable[[], bool] | None) -> None: ...
    def detach(self, pump: Pump) -> Any: ...
    def park(self, pump: Pump, waiter: Any) -> int: ...
    def turn(self) -> None: ...
