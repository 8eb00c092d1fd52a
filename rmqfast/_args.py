"""Argument checks shared by the compiled and the pure-Python twins, so both raise the same
exception for the same bad argument.

The compiled classes take C integers: Cython raises ``TypeError`` for a value that is not an
integer and ``OverflowError`` for one that does not fit the C type, before any of our code
runs (see :func:`c_int` for floats).  The pure twins call :func:`c_int` to raise the same
types (with the argument's name in the message); checks both twins make in their own code
(a slot out of range, a direction that is not 0 or 1) raise ``ValueError``.
``Limiter.configure`` is not on the hot path: both twins validate its rules here, so their
errors are identical to the letter.

No imports from the rest of rmqfast: the extension module imports this one.
"""

from __future__ import annotations

import operator
from typing import Any

_RANGES = {
    "int": (-(1 << 31), (1 << 31) - 1),
    "uint32": (0, (1 << 32) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1),
    "ssize": (-(1 << 63), (1 << 63) - 1),
}

MAX_RULES = 1023
MODES = (0, 1, 2)  # limit, reject, open

# The limiter's shared bucket file: a header, then (MAX_RULES + 1) slots of SLOT_WORDS int64.
SHM_HEADER_BYTES = 64
SHM_MAGIC = b"RMQFLIM\x00"
SHM_LAYOUT = 2  # 1: no header (before the twins were told apart)
SHM_IMPL_OFFSET = 16
SHM_IMPL_LEN = 16


def c_int(name: str, value: Any, kind: str = "int64") -> int:
    """``value`` as a Python int that fits the C type ``kind``, converted as Cython converts it:
    TypeError for a non-integer, OverflowError when it does not fit.  Cython truncates a float
    passed for a C ``int``/``long``/``int64_t`` (it calls ``__int__``) and refuses one for a
    ``Py_ssize_t`` (``__index__``); the pure twins do the same, so both read ``1.9`` alike."""
    if isinstance(value, float) and kind != "ssize":
        value = int(value)  # ValueError for NaN, OverflowError for inf: as Cython's __int__
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}") from None
    lo, hi = _RANGES[kind]
    if not lo <= v <= hi:
        raise OverflowError(f"{name}={v} does not fit a C {kind} ({lo}..{hi})")
    return v


def _number(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r:.40}")
    v = float(value)
    if not v >= 0 or v == float("inf"):  # also NaN
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return v


def _bytes(what: str, value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(value).__name__} {value!r:.40}")
    b = bytes(value)
    if len(b) - b.endswith(b"*") > 255:  # a prefix pattern's '*' is not stored
        raise ValueError(f"{what} is {len(b)} bytes long; at most 255")
    return b


def limit_rules(rules: Any) -> list[tuple[bytes, bytes | None, float, float, float, float, int, int]]:
    """Validate ``Limiter.configure``'s rules (both twins): a list of
    ``(topic, tag or None, rate, burst, bytes_rate, bytes_burst, mode, slot)``."""
    try:
        items = list(rules)
    except TypeError:
        raise TypeError(f"limit rules must be a list of tuples, got {type(rules).__name__}") from None
    if len(items) > MAX_RULES + 1:
        raise ValueError(f"{len(items)} limit rules; at most {MAX_RULES} (plus the global one)")
    out = []
    slots: dict[int, int] = {}
    for i, r in enumerate(items):
        if not isinstance(r, (tuple, list)) or len(r) != 8:
            raise ValueError(f"limit rule {i}: expected (topic, tag, rate, burst, bytes_rate, bytes_burst, mode, "
                             f"slot), got {r!r:.80}")
        topic, tag, rate, burst, brate, bburst, mode, slot = r
        topic = _bytes(f"limit rule {i}: topic", topic)
        tag = None if tag is None else _bytes(f"limit rule {i}: tag", tag)
        nums = [_number(f"limit rule {i}: {k}", v)
                for k, v in (("rate", rate), ("burst", burst), ("bytes_rate", brate), ("bytes_burst", bburst))]
        for what, v in (("mode", mode), ("slot", slot)):
            if isinstance(v, (bool, float)):  # shared code: stricter than a C int conversion
                raise TypeError(f"limit rule {i}: {what} must be an integer, got {v!r}")
        mode = c_int(f"limit rule {i}: mode", mode, "int")
        if mode not in MODES:
            raise ValueError(f"limit rule {i}: mode {mode} unknown; expected 0 (limit), 1 (reject) or 2 (open)")
        slot = c_int(f"limit rule {i}: slot", slot, "int")
        if not 0 <= slot <= MAX_RULES:
            raise ValueError(f"limit rule {i}: slot {slot} outside 0..{MAX_RULES}")
        if slot in slots:
            raise ValueError(f"limit rules {slots[slot]} and {i} share bucket slot {slot}; each rule needs its own")
        slots[slot] = i
        out.append((topic, tag, nums[0], nums[1], nums[2], nums[3], mode, slot))
    return out


def shared_header(implementation: str) -> bytes:
    """The header of a shared bucket file whose buckets the ``implementation`` twin updates."""
    name = implementation.encode("ascii")
    if not name or len(name) > SHM_IMPL_LEN:
        raise ValueError(f"implementation name {implementation!r}: expected 1..{SHM_IMPL_LEN} ASCII characters")
    head = bytearray(SHM_HEADER_BYTES)
    head[:8] = SHM_MAGIC
    head[8:12] = SHM_LAYOUT.to_bytes(4, "little")
    head[SHM_IMPL_OFFSET : SHM_IMPL_OFFSET + len(name)] = name
    return bytes(head)


def check_shared_header(shm: Any, own: str, need: int) -> None:
    """Refuse to attach a limiter of kind ``own`` (``"compiled"``/``"python"``) to shared memory
    that is too small, has no bucket header, or whose buckets the other twin updates."""
    from rmqfast.errors import TwinMismatchError

    view = memoryview(shm)
    if len(view) < need:
        raise ValueError(f"shared limiter memory of {len(view)} bytes is too small (need {need}); "
                         "create it with rmqfast.limits.create_shared")
    head = bytes(view[:SHM_HEADER_BYTES])
    if head[:8] != SHM_MAGIC or int.from_bytes(head[8:12], "little") != SHM_LAYOUT:
        raise ValueError(f"shared limiter memory has no rmqfast bucket header (layout {SHM_LAYOUT}); "
                         "create it with rmqfast.limits.create_shared")
    kind = head[SHM_IMPL_OFFSET : SHM_IMPL_OFFSET + SHM_IMPL_LEN].rstrip(b"\x00").decode("ascii", "replace")
    if kind != own:
        raise TwinMismatchError(
            f"the shared limiter buckets were created for the {kind!r} limiter; a {own!r} limiter would update "
            "them with different locking (compiled: CAS, python: flock) and lose updates. Run the supervisor "
            "and every worker with the same codec (RMQFAST_NO_EXTENSIONS set everywhere or nowhere)")
