"""Which sends ask for a delivery time, when they are due, and the properties a release carries.

The delivery-time properties, as apache/rocketmq ``MessageConst`` names them and as a 5.x
broker reads them (``HookUtils.checkIfTimerMessage`` / ``transformTimerMessage``):

* ``DELAY`` (a delay level, 4.x and 5.x): when it is set (> 0) the broker ignores and clears the
  timer properties; the proxy holds it only when ``[delay] levels`` maps that level;
* ``TIMER_DELAY_SEC``: seconds from the moment the broker (here: the proxy) receives the send;
* ``TIMER_DELAY_MS``: milliseconds from that moment (5.x clients' ``setDelayTimeMs``);
* ``TIMER_DELIVER_MS``: an absolute time, epoch milliseconds (``setDeliverTimeMs``);
* ``__STARTDELIVERTIME``: an absolute time, epoch milliseconds (the name commercial RocketMQ
  services and their SDKs use).

The broker reads the relative forms first (seconds, then milliseconds, then the absolute time);
the proxy reads them in the same order.  A message that already went through a broker's timer
(``TIMER_OUT_MS`` set) is not a delay request.  A value that is not an integer as Java's
``Long.parseLong`` reads it (blanks, ``_``, out of range) makes the send invalid (the broker
answers ``WHEEL_TIMER_MSG_ILLEGAL``; the proxy answers MESSAGE_ILLEGAL); a relative time is added
in Java's wrapping long arithmetic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from rmqfast.codec.properties import DELAY, TIMER_DELAY_MS, TIMER_DELAY_SEC, TIMER_DELIVER_MS

START_DELIVER_TIME = "__STARTDELIVERTIME"
TIMER_OUT_MS = "TIMER_OUT_MS"
#: Every property a release removes, so the broker delivers at once.
DELAY_PROPERTIES = (DELAY, TIMER_DELAY_SEC, TIMER_DELAY_MS, TIMER_DELIVER_MS, START_DELIVER_TIME)
#: 4.x/5.x brokers' default ``messageDelayLevel``: "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h".
BROKER_LEVELS_MS = (1_000, 5_000, 10_000, 30_000, 60_000, 120_000, 180_000, 240_000, 300_000, 360_000, 420_000,
                    480_000, 540_000, 600_000, 1_200_000, 1_800_000, 3_600_000, 7_200_000)


class DelayInvalid(ValueError):
    """A delivery-time property whose value is not an integer (the message says which)."""


_JAVA_INT = re.compile(r"[+-]?\d+")  # Long.parseLong / Integer.parseInt: a sign, decimal digits, nothing else


def _int(name: str, value: str, bits: int = 64) -> int:
    """``value`` as Java's ``Long.parseLong`` (``Integer.parseInt`` for 32 bits) reads it: no
    blanks, no ``_`` (Python's ``int`` takes both), in range; DelayInvalid where Java throws."""
    if _JAVA_INT.fullmatch(value):
        v = int(value)
        if -(1 << (bits - 1)) <= v < 1 << (bits - 1):
            return v
    raise DelayInvalid(f"property {name}={value!r} is not an integer")


def _long(v: int) -> int:
    """``v`` wrapped as Java's long arithmetic wraps it."""
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)


def due_ms(props: Mapping[str, str], now_ms: int, levels: Mapping[int, int]) -> int | None:
    """The epoch millisecond a send asks to be delivered at, or None (not a delay the proxy holds).

    ``levels``: delay level -> milliseconds for the levels the proxy holds (``[delay] levels``);
    a level not in it is left to the broker.
    """
    level = props.get(DELAY)
    if level is not None:
        lv = _int(DELAY, level, 32)
        if lv > 0:  # a level wins over the timer properties (the broker clears those)
            ms = levels.get(lv)
            return None if ms is None else now_ms + ms
    if TIMER_OUT_MS in props:
        return None
    v = props.get(TIMER_DELAY_SEC)
    if v is not None:
        return _long(now_ms + _long(_int(TIMER_DELAY_SEC, v) * 1000))
    v = props.get(TIMER_DELAY_MS)
    if v is not None:
        return _long(now_ms + _int(TIMER_DELAY_MS, v))
    v = props.get(TIMER_DELIVER_MS)
    if v is not None:
        return _int(TIMER_DELIVER_MS, v)
    v = props.get(START_DELIVER_TIME)
    if v is not None:
        return _int(START_DELIVER_TIME, v)
    return None


def has_delay_property(props: Mapping[str, str]) -> bool:
    return any(k in props for k in DELAY_PROPERTIES)


def strip_delay(properties: str) -> str:
    """``properties`` (``k\\x01v\\x02...``) without the delivery-time pairs, the rest byte for byte.

    Pieces are cut as Java cuts them; a removed name is removed wherever it occurs (Java keeps
    the last duplicate; no duplicate may survive to be read by the broker).
    """
    out = []
    for piece in properties.split("\x02"):
        name, sep, _value = piece.partition("\x01")
        if sep and name in DELAY_PROPERTIES:
            continue
        out.append(piece)
    return "\x02".join(out)
