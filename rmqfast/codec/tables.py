"""Constants and tables of the hot path, shared by both twins: the one place they are written.

The frame scanner, the header walk, the records walk and the send limiter exist twice (compiled
from ``ext/``, and as pure-Python twins beside this module and in ``rmqfast/limits``).  Their
sizes, codes and tables are declared here once, in the style of uvloop's and asyncpg's
``consts.pxi``:

* the pure-Python twins and every production module import them from here (never from a twin);
* the compiled twin includes ``ext/tables.pxi``, generated from this module by
  ``python -m rmqfast.codec.tables_pxi --write``: integer constants become members of an anonymous
  ``cdef enum`` named ``<NAME>_C`` (compile-time constants, as the ``DEF`` statements they
  replace, so the generated C is the same), floats become C macros, tuples of integers C arrays,
  and every value is also bound under its own name for Python, so the compiled module exposes the
  same constants as the twins.  ``tests/test_tables.py`` fails when ``ext/tables.pxi`` is stale,
  and ``tests/test_twins.py`` compares the built extension's values with these.

This module imports only :mod:`rmqfast._args` (a leaf), so any module can import it.

Measured when the 29 ``DEF`` statements gave way to the generated enums (callgrind instructions per
relayed frame, ``bench/relay_instructions.py``, before and after): send 5,297 and 5,260, pull with
its store hosts mapped 10,921 and 10,777, a send under a limit rule 5,816 and 5,768.
"""

from __future__ import annotations

from rmqfast._args import SHM_HEADER_BYTES

# Scanner events and actions --------------------------------------------------------------------

EV_FORWARD = 0
EV_POLICY = 1
EV_ERROR = 2

ACTION_PASS = 0
ACTION_POLICY = 1
#: A records answer (pull, pop, query...): its store hosts are mapped in the scanner.
ACTION_RECORDS = 2

#: Size of the action and counter tables.  Codes 0..1023 map to themselves, the 5.x pop
#: family (200000..201022) to 1024..2046, everything else to the last slot.
CODE_SLOTS = 2048
OTHER_SLOT = CODE_SLOTS - 1

#: Topic counter table capacity; topics beyond it are counted under ``OTHER_TOPIC``.
TOPIC_SLOTS = 1024
MAX_TOPIC_LEN = 255
OTHER_TOPIC = b"__other__"

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
DEFAULT_MAX_HEADER = 1024 * 1024

#: Upper bounds (nanoseconds) of the request latency histogram; one more bucket holds the rest.
LATENCY_BOUNDS_NS = (
    100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000, 25_000_000, 50_000_000,
    100_000_000, 250_000_000, 500_000_000, 1_000_000_000, 2_500_000_000, 5_000_000_000, 10_000_000_000,
    30_000_000_000,
)
LATENCY_BUCKETS = len(LATENCY_BOUNDS_NS) + 1

#: How a request ended (the ``result`` label of ``rmqfast_requests_total``), by index.
RESULTS = (
    "success", "system_error", "system_busy", "not_supported", "flush_timeout", "slave_unavailable",
    "no_permission", "topic_not_exist", "not_found", "retry_immediately", "offset_moved", "other_error",
    "oneway", "unanswered",
)
NRESULTS = len(RESULTS)
R_OTHER_ERROR = 11
R_ONEWAY = 12
R_UNANSWERED = 13
#: response code -> result index; codes not listed are ``R_OTHER_ERROR`` (the compiled twin's
#: ``result_index`` in ``ext/constants.pxi`` is the same table as a chain of comparisons).
RESULT_OF_CODE = {0: 0, 1: 1, 2: 2, 3: 3, 10: 4, 12: 4, 11: 5, 16: 6, 17: 7, 19: 8, 22: 8, 20: 9, 21: 10}

#: Requests awaiting their response that one connection tracks at most (more are not timed).
MAX_TRACKED = 65536
#: Sampled requests a ScanStats keeps between two take_samples() calls.
SAMPLE_RING = 8192

# Header walk -------------------------------------------------------------------------------------

#: JSON nesting a header may have (deeper is refused).
MAX_JSON_DEPTH = 32

# Records walk (store records of pull, pop, query and view answers) ----------------------------------

REC_OK = 0
REC_MISS = 1
REC_BAD = 2
#: Addresses an ``AddressMap`` holds at most (the compiled one is a fixed table).
MAX_ADDRESSES = 512
RECORD_MAGIC_V1 = 0xDAA320A7
RECORD_MAGIC_V2 = 0xDAA320AB
BORNHOST_V6 = 0x10
STOREHOST_V6 = 0x20
MIN_RECORD = 91  # TOTALSIZE .. STOREHOST (IPv4) and the fields up to the topic length
SYSFLAG_POS = 36
STOREHOST_POS = 64  # with an IPv4 born host; 12 bytes later with an IPv6 one

# Send limiter (GCRA buckets in a file shared by the workers) -------------------------------------

#: int64 words per shared slot: [msgs TAT, bytes TAT, unused...]
SLOT_WORDS = 8
SLOT_BYTES = SLOT_WORDS * 8
#: Rules at most; slot 0 is the global bucket.
MAX_RULES = 1023
#: The shared file: its header (``rmqfast._args``: magic, layout, twin), then the slots.
SHM_BYTES = SHM_HEADER_BYTES + SLOT_BYTES * (MAX_RULES + 1)
MODE_LIMIT = 0
MODE_REJECT = 1
MODE_OPEN = 2
#: A send whose cost (ns) reaches this is refused: 146 years of its rule's rate, and past it the
#: int64 arithmetic of the buckets would overflow.  2 ** 62.
MAX_COST_NS = 4611686018427387904.0


def result_index(response_code: int) -> int:
    """Index in :data:`RESULTS` of a response code."""
    return RESULT_OF_CODE.get(response_code, R_OTHER_ERROR)


def latency_bucket(ns: int) -> int:
    """Index of the latency histogram bucket of ``ns`` nanoseconds."""
    for i, bound in enumerate(LATENCY_BOUNDS_NS):
        if ns <= bound:
            return i
    return len(LATENCY_BOUNDS_NS)
