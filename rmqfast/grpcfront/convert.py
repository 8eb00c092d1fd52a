"""Between ``apache.rocketmq.v2`` messages and Remoting sends and pop records.

Mirrors apache/rocketmq's gRPC proxy (``SendMessageActivity.buildMessageProperty``,
``GrpcConverter.buildSystemProperties``, ``ConsumerProcessor.createHandle``) and the 5.x client's
``processPopResponse`` (the receipt handle a popped message carries).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from rmqfast.codec.properties import format_properties
from rmqfast.codec.store import COMPRESSED_FLAG, TRANSACTION_PREPARED_TYPE, StoreRecord

# MessageConst property names
KEYS, TAGS, UNIQ_KEY, SHARDING_KEY = "KEYS", "TAGS", "UNIQ_KEY", "__SHARDINGKEY"
TRAN_MSG, PGROUP, RECONSUME_TIME = "TRAN_MSG", "PGROUP", "RECONSUME_TIME"
TIMER_DELIVER_MS, TIMER_DELAY_SEC, DELAY = "TIMER_DELIVER_MS", "TIMER_DELAY_SEC", "DELAY"
TRACE_CONTEXT, BORN_HOST, BORN_TIMESTAMP = "TRACE_CONTEXT", "__BORNHOST", "BORN_TIMESTAMP"
POP_CK, FIRST_POP_TIME = "POP_CK", "1ST_POP_TIME"
DLQ_ORIGIN_TOPIC, DLQ_ORIGIN_MESSAGE_ID = "DLQ_ORIGIN_TOPIC", "DLQ_ORIGIN_MESSAGE_ID"
CHECK_IMMUNITY = "CHECK_IMMUNITY_TIME_IN_SECONDS"

#: Property names the system uses (``MessageConst.STRING_HASH_SET``): refused as user properties on
#: send, left out of a received message's user properties.
SYSTEM_KEYS = frozenset({
    "KEYS", "TAGS", "WAIT", "DELAY", "RETRY_TOPIC", "REAL_TOPIC", "REAL_QID", "TRAN_MSG", "PGROUP",
    "MIN_OFFSET", "MAX_OFFSET", "BUYER_ID", "ORIGIN_MESSAGE_ID", "TRANSFER_FLAG", "CORRECTION_FLAG",
    "MQ2_FLAG", "RECONSUME_TIME", "MSG_REGION", "TRACE_ON", "UNIQ_KEY", "EXTEND_UNIQ_INFO",
    "MAX_RECONSUME_TIMES", "CONSUME_START_TIME", "INNER_NUM", "INNER_BASE", "CHECK_IMMUNITY_TIME_IN_SECONDS",
    "TRAN_PREPARED_QUEUE_OFFSET", "__transactionId__", "TRANSACTION_CHECK_TIMES", "INSTANCE_ID",
    "CORRELATION_ID", "REPLY_TO_CLIENT", "TTL", "ARRIVE_TIME", "PUSH_REPLY_TIME", "CLUSTER", "MSG_TYPE",
    "POP_CK", "POP_CK_OFFSET", "1ST_POP_TIME", "__SHARDINGKEY", "PROPERTY_FORWARD_QUEUE_ID", "REDIRECT",
    "INNER_MULTI_DISPATCH", "INNER_MULTI_QUEUE_OFFSET", "TRACE_CONTEXT", "TIMER_DELAY_SEC", "TIMER_DELIVER_MS",
    "__BORNHOST", "BORN_TIMESTAMP", "TIMER_ENQUEUE_MS", "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES", "TIMER_OUT_MS",
    "TIMER_DEL_UNIQKEY", "TIMER_DELAY_LEVEL", "TIMER_DELAY_MS", "__CRC32#", "DLQ_ORIGIN_TOPIC",
    "DLQ_ORIGIN_MESSAGE_ID",
})

RETRY_PREFIX = "%RETRY%"


class BadRequest(ValueError):
    """A request the proxy refuses; ``code`` is the ``apache.rocketmq.v2.Code`` name to answer."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


_NO_BREAK = "\u00a0\u2007\u202f"  # spaces Java's Character.isWhitespace does not count


def _control(s: str) -> bool:
    """A character Java's ``Character.isISOControl`` (Apache's ``containControlCharacter``) refuses:
    U+0000-U+001F, U+007F-U+009F."""
    return any(c < " " or "\x7f" <= c <= "\x9f" for c in s)


def _blank(s: str) -> bool:
    """Commons-lang's ``StringUtils.isBlank`` of a non-empty string: whitespace only."""
    return all(c.isspace() and c not in _NO_BREAK for c in s)


def _check(value: str, code: str, what: str) -> None:
    """Apache's proxy checks of a tag, key or message group (non-empty): not blank, no control character."""
    if _blank(value):
        raise BadRequest(code, f"{what} cannot be the char sequence of whitespace")
    if _control(value):
        raise BadRequest(code, f"{what} cannot contain control character")


def _millis(ts: Any) -> int:
    return ts.seconds * 1000 + ts.nanos // 1_000_000


def check_send(msg: Any) -> None:
    """Raise :class:`BadRequest` (its code and message as Apache's proxy answers) for what the proxy
    refuses in a message to send: control characters in properties, tags, keys and message groups,
    blank ones, a '|' in a tag, a system property name; and what RocketMQ's property string cannot
    carry (an empty property name or value, a control character in the message id, trace context or
    born host), so nothing the broker would read differently gets through."""
    sp = msg.system_properties
    for k, v in msg.user_properties.items():
        if k in SYSTEM_KEYS:
            raise BadRequest("ILLEGAL_MESSAGE_PROPERTY_KEY", f"property is used by system: {k}")
        if not k or _control(k):
            raise BadRequest("ILLEGAL_MESSAGE_PROPERTY_KEY", "the key of property cannot be empty or contain "
                             "control character")
        if not v or _control(v):
            raise BadRequest("ILLEGAL_MESSAGE_PROPERTY_KEY", f"the value of property {k} cannot be empty or "
                             "contain control character")
    if sp.tag:
        _check(sp.tag, "ILLEGAL_MESSAGE_TAG", "tag")
        if "|" in sp.tag:
            raise BadRequest("ILLEGAL_MESSAGE_TAG", "tag cannot contain '|'")
    for key in sp.keys:
        if key:
            _check(key, "ILLEGAL_MESSAGE_KEY", "key")
    if _blank(sp.message_id):
        raise BadRequest("ILLEGAL_MESSAGE_ID", "message id cannot be empty")
    if _control(sp.message_id):
        raise BadRequest("ILLEGAL_MESSAGE_ID", "message id cannot contain control character")
    if sp.message_group:
        _check(sp.message_group, "ILLEGAL_MESSAGE_GROUP", "message group")
    if _control(sp.trace_context):
        raise BadRequest("BAD_REQUEST", "trace context cannot contain control character")
    if _control(sp.born_host):
        raise BadRequest("BAD_REQUEST", "born host cannot contain control character")


def send_properties(pb: Any, msg: Any, producer_group: str, peer: str) -> tuple[dict[str, str], int]:
    """The Remoting properties and sysFlag of a v2 message (as the Java proxy builds them); raises
    :class:`BadRequest` for what :func:`check_send` refuses."""
    check_send(msg)
    sp = msg.system_properties
    props: dict[str, str] = dict(msg.user_properties)
    if sp.tag:
        props[TAGS] = sp.tag
    if any(sp.keys):
        props[KEYS] = " ".join(sp.keys)
    props[UNIQ_KEY] = sp.message_id
    sys_flag = 0
    if sp.message_type == pb.MessageType.TRANSACTION:
        props[TRAN_MSG] = "true"
        sys_flag |= TRANSACTION_PREPARED_TYPE
        if sp.HasField("orphaned_transaction_recovery_duration"):
            props[CHECK_IMMUNITY] = str(sp.orphaned_transaction_recovery_duration.seconds)
    if sp.HasField("delivery_timestamp"):
        props[TIMER_DELIVER_MS] = str(_millis(sp.delivery_timestamp))
    props[RECONSUME_TIME] = str(sp.delivery_attempt)
    props[PGROUP] = producer_group
    if sp.message_group:
        props[SHARDING_KEY] = sp.message_group
    if sp.trace_context:
        props[TRACE_CONTEXT] = sp.trace_context
    props[BORN_HOST] = sp.born_host or peer
    if sp.HasField("born_timestamp"):
        props[BORN_TIMESTAMP] = str(_millis(sp.born_timestamp))
    if sp.body_encoding == pb.Encoding.GZIP:
        sys_flag |= COMPRESSED_FLAG
    return props, sys_flag


def send_header(topic: str, broker: str, queue_id: int, props: dict[str, str], sys_flag: int, born_ms: int,
                producer_group: str, reconsume_times: int) -> dict[str, str]:
    """SEND_MESSAGE_V2 ext fields (SendMessageRequestHeaderV2 short names)."""
    return {
        "a": producer_group, "b": topic, "c": "TBW102", "d": "4", "e": str(queue_id), "f": str(sys_flag),
        "g": str(born_ms), "h": "0", "i": format_properties(props), "j": str(reconsume_times), "k": "false",
        "l": "16", "m": "false", "n": broker,
    }


def _retry_mark(topic: str) -> str:
    """``ExtraInfoUtil.getRetry``: "2" for a pop retry topic V2, "1" for other retry topics, else "0"."""
    if topic.startswith(RETRY_PREFIX):
        return "2" if "+" in topic else "1"
    return "0"


def _offset_info(text: str | None) -> dict[str, list[int]]:
    """``startOffsetInfo``/``msgOffsetInfo``: ``mark qid v[,v...]`` entries joined by ``;`` -> {"mark@qid": [v...]}."""
    out: dict[str, list[int]] = {}
    for one in (text or "").split(";"):
        parts = one.split(" ")
        if len(parts) == 3:
            out[f"{parts[0]}@{parts[1]}"] = [int(x) for x in parts[2].split(",") if x]
    return out


def attach_handles(records: list[StoreRecord], ext: dict[str, str], broker: str) -> None:
    """Give each popped record its receipt handle (``POP_CK``: extra info plus commit-log offset),
    as the 5.x client's ``processPopResponse`` and the proxy's ``createHandle`` do; an orderly pop's
    ``orderCountInfo`` gives the record's reconsume count."""
    pop_time, invisible, revive = ext.get("popTime", "0"), ext.get("invisibleTime", "0"), ext.get("reviveQid", "0")
    start = _offset_info(ext.get("startOffsetInfo"))
    offsets = _offset_info(ext.get("msgOffsetInfo"))
    # orderly pops: how often each message (or queue) was delivered, the store's reconsume count stays 0
    counts = _offset_info(ext.get("orderCountInfo"))
    by_queue: dict[str, list[int]] = {}
    for r in records:
        by_queue.setdefault(f"{_retry_mark(r.topic)}@{r.queue_id}", []).append(r.queue_offset)
    for v in by_queue.values():
        v.sort()
    for r in records:
        if POP_CK in r.properties:
            continue
        mark = _retry_mark(r.topic)
        key = f"{mark}@{r.queue_id}"
        if key in start:
            ck = start[key][0]
            idx = by_queue[key].index(r.queue_offset)
            msg_offset = offsets.get(key, by_queue[key])[idx]
        else:  # brokers before startOffsetInfo: the first record of the queue is the check point
            ck, msg_offset = by_queue[key][0], r.queue_offset
        r.properties[POP_CK] = f"{ck} {pop_time} {invisible} {revive} {mark} {broker} {r.queue_id} {msg_offset}"
        count = counts.get(f"{mark}@qo{r.queue_id}%{r.queue_offset}") or counts.get(key)
        if count and count[0] > 0:
            r.reconsume_times = count[0]
        r.properties.setdefault(FIRST_POP_TIME, pop_time)


@dataclass(frozen=True)
class ReceiptHandle:
    """``ReceiptHandle.decode``: ``startOffset retrieveTime invisibleTime reviveQid topicType brokerName queueId
    offset [commitLogOffset]``."""

    start_offset: int
    retrieve_time: int
    invisible_time: int
    revive_qid: int
    topic_type: str
    broker: str
    queue_id: int
    offset: int
    commit_log_offset: int
    text: str

    @classmethod
    def decode(cls, text: str) -> ReceiptHandle:
        p = text.split(" ")
        if len(p) < 8 or p[4] not in ("0", "1", "2") or not p[5]:
            raise BadRequest("INVALID_RECEIPT_HANDLE", "receipt handle is invalid")
        try:
            return cls(int(p[0]), int(p[1]), int(p[2]), int(p[3]), p[4], p[5], int(p[6]), int(p[7]),
                       int(p[8]) if len(p) > 8 else -1, text)
        except ValueError:
            raise BadRequest("INVALID_RECEIPT_HANDLE", "receipt handle is invalid") from None

    def real_topic(self, topic: str, group: str) -> str:
        if self.topic_type == "1":
            return f"{RETRY_PREFIX}{group}_{topic}"
        if self.topic_type == "2":
            return f"{RETRY_PREFIX}{group}+{topic}"
        return topic

    def renewed(self, pop_time: int, invisible_time: int, revive_qid: int) -> str:
        """The handle after a change of invisible time (the broker's new check point)."""
        return (f"{self.start_offset} {pop_time} {invisible_time} {revive_qid} {self.topic_type} {self.broker} "
                f"{self.queue_id} {self.offset} {self.commit_log_offset}")


def _timestamp(pb: Any, ms: int) -> Any:
    return pb.Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def to_message(pb: Any, rec: StoreRecord, topic: str, broker: str) -> Any:
    """A popped record as a v2 ``Message`` (``GrpcConverter.buildMessage``)."""
    props = rec.properties
    sp = pb.SystemProperties()
    if TAGS in props:
        sp.tag = props[TAGS]
    if props.get(KEYS):
        sp.keys.extend(props[KEYS].split(" "))
    sp.message_id = props.get(UNIQ_KEY) or rec.msg_id
    sp.body_digest.type = pb.DigestType.MD5
    sp.body_digest.checksum = hashlib.md5(rec.body).hexdigest().upper()
    sp.body_encoding = pb.Encoding.GZIP if rec.sys_flag & COMPRESSED_FLAG else pb.Encoding.IDENTITY
    if props.get(TRAN_MSG) == "true":
        sp.message_type = pb.MessageType.TRANSACTION
    elif DELAY in props or TIMER_DELIVER_MS in props or TIMER_DELAY_SEC in props:
        sp.message_type = pb.MessageType.DELAY
    elif SHARDING_KEY in props:
        sp.message_type = pb.MessageType.FIFO
    else:
        sp.message_type = pb.MessageType.NORMAL
    sp.born_timestamp.CopyFrom(_timestamp(pb, rec.born_timestamp))
    sp.born_host = props.get(BORN_HOST) or rec.born_host
    sp.store_timestamp.CopyFrom(_timestamp(pb, rec.store_timestamp))
    sp.store_host = rec.store_host
    if props.get(TIMER_DELIVER_MS, "").isdigit():
        sp.delivery_timestamp.CopyFrom(_timestamp(pb, int(props[TIMER_DELIVER_MS])))
    if SHARDING_KEY in props:
        sp.message_group = props[SHARDING_KEY]
    if POP_CK in props:
        sp.receipt_handle = f"{props[POP_CK]} {rec.commit_log_offset}"
    sp.queue_id = rec.queue_id
    sp.queue_offset = rec.queue_offset
    sp.delivery_attempt = rec.reconsume_times + 1
    if TRACE_CONTEXT in props:
        sp.trace_context = props[TRACE_CONTEXT]
    if DLQ_ORIGIN_TOPIC in props and DLQ_ORIGIN_MESSAGE_ID in props:
        sp.dead_letter_queue.topic = props[DLQ_ORIGIN_TOPIC]
        sp.dead_letter_queue.message_id = props[DLQ_ORIGIN_MESSAGE_ID]
    user = {k: v for k, v in props.items() if k not in SYSTEM_KEYS}
    msg = pb.Message(user_properties=user, system_properties=sp, body=rec.body)
    msg.topic.name = topic
    return msg
