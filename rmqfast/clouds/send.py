"""Sending one message to a broker until it is stored: the request of a held or copied message.

Shared by every feature that sends a message the proxy holds: cross-cloud copies
(:mod:`rmqfast.deliver.sender`), peak shaving (:mod:`rmqfast.limits.shaper`) and delayed messages
(:mod:`rmqfast.delay.service`). It sits beside the Remoting client (:mod:`rmqfast.clouds.remoting`)
so that none of them imports another feature for it.

Request: ``SEND_MESSAGE_V2`` (310), or ``SEND_BATCH_MESSAGE`` (320) for batches, header fields
``a``..``n`` of ``SendMessageRequestHeaderV2`` with the producer's body, flags, born timestamp and
properties. Answers SUCCESS, FLUSH_DISK_TIMEOUT (10), FLUSH_SLAVE_TIMEOUT (12) and
SLAVE_NOT_AVAILABLE (11) mean the message is stored (as for the Java client); MESSAGE_ILLEGAL (13)
never succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import gevent

from rmqfast.clouds.remoting import ConnectionPool, RemoteError
from rmqfast.codec import codes as C
from rmqfast.codec.batch import decode_batch, encode_batch
from rmqfast.errors import BodyError
from rmqfast.log import ctx
from rmqfast.spill.record import ORIGIN_PROPERTY, CopyRecord

STORED_CODES = frozenset({0, 10, 11, 12})
PERMANENT_CODES = frozenset({13})
TOPIC_NOT_EXIST = 17


def with_origin(properties: str, origin: str) -> str:
    """``properties`` plus ``RMQFAST_ORIGIN=origin`` (kept if already there)."""
    if f"{ORIGIN_PROPERTY}\x01" in properties:
        return properties
    if properties and not properties.endswith("\x02"):
        properties += "\x02"
    return properties + f"{ORIGIN_PROPERTY}\x01{origin}\x02"


def build_request(rec: CopyRecord, broker_name: str, queue_id: int,
                  origin: str | None) -> tuple[int, dict[str, str], bytes]:
    """(code, V2 header fields, body) of the remote send of ``rec``.

    ``origin`` None sends the message unmarked (peak shaving releases to the local cluster)."""
    body = rec.body
    if rec.is_batch and origin is not None:
        entries = decode_batch(body)
        for e in entries:
            e.properties[ORIGIN_PROPERTY] = origin
        body = encode_batch(entries)
    ext = {
        "a": rec.producer_group or "RMQFAST_DELIVER",
        "b": rec.topic,
        "c": "TBW102",
        "d": "4",
        "e": str(queue_id),
        "f": str(rec.sys_flag),
        "g": str(rec.born_timestamp),
        "h": str(rec.flag),
        "i": with_origin(rec.properties, origin) if origin is not None else rec.properties,
        "j": str(rec.reconsume_times),
        "k": "false",
        "l": str(rec.max_reconsume_times),
        "m": "true" if rec.is_batch else "false",
        "n": broker_name,
    }
    return (C.SEND_BATCH_MESSAGE if rec.is_batch else C.SEND_MESSAGE_V2), ext, body


def send_until_stored(pool: ConnectionPool, addr: str, rec: CopyRecord, *, what: str, logger: logging.Logger,
                      stopping: Callable[[], bool], retry_initial: float, retry_max: float, timeout: float,
                      drop: Callable[[str], None] | None = None, missing_topic_attempts: int = 0,
                      **fields: Any) -> bool | None:
    """Send a message the proxy held (``what``: "shaped", "delayed") to the local broker ``addr``
    with the producer's header fields and queue, retrying with backoff: True once stored, False
    when refused for good (``drop(reason)`` is told why), None when ``stopping()``.
    ``missing_topic_attempts`` > 0: after that many TOPIC_NOT_EXIST (17) answers in a row the
    message is refused for good too (reason ``topic_not_exist``)."""
    delay = retry_initial
    attempts = 0
    missing = 0
    while not stopping():
        try:
            code, ext, body = build_request(rec, rec.broker_name, rec.queue_id, None)
            if not rec.broker_name:
                ext.pop("n", None)
            resp = pool.request(addr, code, ext, body, timeout=timeout)
            if resp.code in STORED_CODES:
                return True
            if resp.code in PERMANENT_CODES:
                logger.error(f"broker refused a {what} message for good; giving it up",
                             extra=ctx(**fields, broker=addr, topic=rec.topic, code=resp.code, remark=resp.remark))
                if drop is not None:
                    drop(f"code_{resp.code}")
                return False
            missing = missing + 1 if resp.code == TOPIC_NOT_EXIST else 0
            if missing_topic_attempts and missing >= missing_topic_attempts:
                logger.error(f"the broker has no topic for a {what} message after {missing} attempts; giving it up",
                             extra=ctx(**fields, broker=addr, topic=rec.topic, remark=resp.remark))
                if drop is not None:
                    drop("topic_not_exist")
                return False
            err = f"{addr} answered code {resp.code}: {resp.remark}"
        except RemoteError as exc:
            err = str(exc)
        except BodyError as exc:
            logger.error(f"cannot encode a {what} message; giving it up", extra=ctx(topic=rec.topic, error=str(exc)))
            if drop is not None:
                drop("unencodable")
            return False
        attempts += 1
        if attempts in (1, 10) or attempts % 100 == 0:
            logger.warning(f"releasing a {what} message failed; retrying",
                           extra=ctx(**fields, broker=addr, topic=rec.topic, attempt=attempts, error=err,
                                     retry_in_s=round(delay, 3)))
        gevent.sleep(delay)
        delay = min(retry_max, delay * 2)
    return None
