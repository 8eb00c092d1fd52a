"""Send limits: rules (``[limits]``), the limiter (compiled, with a pure-Python twin) and the
memory its buckets share across worker processes.

The shared file (``limits.shm`` in the supervisor's runtime directory) is a 64-byte header
(:func:`rmqfast._args.shared_header`: magic, layout, and the twin whose locking the buckets use)
followed by 1024 slots of 64 bytes: slot 0 the global limit, slots 1..1023 one rule each
(the slot a rule keeps for its topic and tag, :mod:`rmqfast.limits.rules`).  The supervisor
creates it for the twin it runs (:data:`rmqfast.codec.IMPLEMENTATION`); a limiter of the other
twin refuses to attach (:class:`rmqfast.errors.TwinMismatchError`): the compiled limiter
updates buckets with a CAS, the pure one under an ``flock``, and mixing the two loses updates.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from rmqfast import codec
from rmqfast._args import SHM_HEADER_BYTES, SHM_IMPL_LEN, SHM_IMPL_OFFSET, shared_header
from rmqfast.codec import tables
from rmqfast.limits import _limiter_py
from rmqfast.limits.rules import LimitRule, LimitsSection, parse_limits

LimiterPy = _limiter_py.Limiter
SHM_BYTES = tables.SHM_BYTES
SHM_NAME = "limits.shm"
IMPLEMENTATIONS = ("compiled", "python")

__all__ = ["SHM_BYTES", "SHM_NAME", "LimitRule", "LimiterPy", "LimitsSection", "create_shared",
           "limiter_class", "new_shared_memory", "open_limiter", "parse_limits", "reset_changed", "reset_slots",
           "shared_implementation"]


def __getattr__(name: str) -> Any:
    # LimiterC: the compiled limiter for tests that compare the twins (None when not built);
    # resolved through rmqfast.codec.compiled_twin on first use, never by the proxy itself.
    if name == "LimiterC":
        mod = codec.compiled_twin()
        return mod.Limiter if mod is not None else None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kind(implementation: str | None) -> str:
    kind = codec.IMPLEMENTATION if implementation is None else implementation
    if kind not in IMPLEMENTATIONS:
        raise ValueError(f"limiter implementation {kind!r} unknown; expected one of {', '.join(IMPLEMENTATIONS)}")
    return kind


def limiter_class(compiled: bool) -> Any:
    """The limiter class of a twin.  The proxy asks for the compiled one only when it runs the
    compiled scanner (so the extension is already imported)."""
    if not compiled:
        return LimiterPy
    mod = codec.compiled_twin()
    if mod is None:
        raise RuntimeError("the compiled limiter was asked for but rmqfast._speedups is not built; "
                           "run `pip install -e .` (or use the pure-Python twin)")
    return mod.Limiter


def create_shared(runtime: Path, implementation: str | None = None) -> Path:
    """The supervisor's shared bucket file, every bucket full, for the limiter of ``implementation``
    (``"compiled"``/``"python"``; default: the twin this process runs)."""
    path = runtime / SHM_NAME
    with open(path, "wb") as f:
        f.write(shared_header(_kind(implementation)))
        f.truncate(SHM_BYTES)
    return path


def new_shared_memory(implementation: str | None = None) -> mmap.mmap:
    """Anonymous bucket memory for one process (tests, benchmarks), with its header."""
    m = mmap.mmap(-1, SHM_BYTES)
    m[:SHM_HEADER_BYTES] = shared_header(_kind(implementation))
    return m


def shared_implementation(path: Path) -> str:
    """The twin a shared bucket file was created for."""
    with open(path, "rb") as f:
        head = f.read(SHM_HEADER_BYTES)
    if head[:12] != shared_header("python")[:12]:
        raise ValueError(f"{path} is not a shared limiter bucket file (no rmqfast header); "
                         "the supervisor creates it with rmqfast.limits.create_shared")
    return head[SHM_IMPL_OFFSET : SHM_IMPL_OFFSET + SHM_IMPL_LEN].rstrip(b"\x00").decode("ascii", "replace")


def reset_slots(path: Path, slots: list[int]) -> None:
    """Zero the buckets of rules that changed (a new rate starts from a full bucket)."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), SHM_BYTES) as m:
        for s in slots:
            if not 0 <= s <= tables.MAX_RULES:
                raise ValueError(f"bucket slot {s} outside 0..{tables.MAX_RULES}")
            off = SHM_HEADER_BYTES + s * tables.SLOT_BYTES
            m[off : off + tables.SLOT_BYTES] = bytes(tables.SLOT_BYTES)


def changed_slots(old: LimitsSection, new: LimitsSection) -> list[int]:
    """Slots whose rule is new, gone or changed between two configurations (``new``'s slots
    already inherited from ``old``: :meth:`LimitsSection.inherit_slots`)."""
    before = {r[-1]: r for r in old.limiter_rules()}
    after = {r[-1]: r for r in new.limiter_rules()}
    return sorted(s for s in set(before) | set(after) if before.get(s) != after.get(s))


def reset_changed(path: Path, old: LimitsSection, new: LimitsSection) -> list[int]:
    """Reset the buckets of new or changed rules (and of removed ones: their slot is free);
    the buckets of unchanged rules keep their state.  Returns the slots reset."""
    slots = changed_slots(old, new)
    if slots:
        reset_slots(path, slots)
    return slots


def open_limiter(path: Path, compiled: bool | None = None) -> Any:
    """A limiter over the shared file: the compiled or pure twin, or (None) the one the file
    was created for.  A twin other than the file's raises TwinMismatchError."""
    if compiled is None:
        compiled = shared_implementation(path) == "compiled"
    cls = limiter_class(compiled)
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, SHM_BYTES)
        if compiled:
            lim = cls(m)
            os.close(fd)
            return lim
        return cls(m, lock_fd=fd)  # the twin keeps the fd for its flock
    except BaseException:
        os.close(fd)
        raise
