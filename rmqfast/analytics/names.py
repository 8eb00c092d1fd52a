"""Names of Remoting request and response codes for the report ("SEND_MESSAGE_V2 (310)").

Request names come from rmqfast.codec.codes (the codes the proxy knows); response names from
Apache RocketMQ's ResponseCode (RemotingSysResponseCode 0-4 and ResponseCode), because the
report shows every answer a broker or name server gave, not only those the proxy acts on.
"""

from __future__ import annotations

from rmqfast.codec import codes
from rmqfast.records.schema import NO_CODE, OTHER_CODE

RESPONSE_NAMES: dict[int, str] = {
    0: "SUCCESS", 1: "SYSTEM_ERROR", 2: "SYSTEM_BUSY", 3: "REQUEST_CODE_NOT_SUPPORTED", 4: "TRANSACTION_FAILED",
    10: "FLUSH_DISK_TIMEOUT", 11: "SLAVE_NOT_AVAILABLE", 12: "FLUSH_SLAVE_TIMEOUT", 13: "MESSAGE_ILLEGAL",
    14: "SERVICE_NOT_AVAILABLE", 15: "VERSION_NOT_SUPPORTED", 16: "NO_PERMISSION", 17: "TOPIC_NOT_EXIST",
    18: "TOPIC_EXIST_ALREADY", 19: "PULL_NOT_FOUND", 20: "PULL_RETRY_IMMEDIATELY", 21: "PULL_OFFSET_MOVED",
    22: "QUERY_NOT_FOUND", 23: "SUBSCRIPTION_PARSE_FAILED", 24: "SUBSCRIPTION_NOT_EXIST",
    25: "SUBSCRIPTION_NOT_LATEST", 26: "SUBSCRIPTION_GROUP_NOT_EXIST", 27: "FILTER_DATA_NOT_EXIST",
    28: "FILTER_DATA_NOT_LATEST", 29: "INVALID_PARAMETER", 200: "TRANSACTION_SHOULD_COMMIT",
    201: "TRANSACTION_SHOULD_ROLLBACK", 202: "TRANSACTION_STATE_UNKNOW", 203: "TRANSACTION_STATE_GROUP_WRONG",
    204: "NO_BUYER_ID", 205: "NOT_IN_CURRENT_UNIT", 206: "CONSUMER_NOT_ONLINE", 207: "CONSUME_MSG_TIMEOUT",
    208: "NO_MESSAGE", 209: "POLLING_FULL", 210: "POLLING_TIMEOUT", 1500: "GO_AWAY",
}

_NOT_REQUESTS = set(RESPONSE_NAMES.values()) | {"SERIALIZE_JSON", "SERIALIZE_ROCKETMQ", "FLAG_RESPONSE",
                                                 "FLAG_ONEWAY"}
REQUEST_NAMES: dict[int, str] = {
    v: k for k, v in vars(codes).items()
    if k.isupper() and isinstance(v, int) and not isinstance(v, bool) and k not in _NOT_REQUESTS
}


def _label(names: dict[int, str], code: object) -> str:
    if code is None or code == NO_CODE:
        return ""
    if code == OTHER_CODE:
        return f"other codes ({OTHER_CODE})"
    try:
        n = int(code)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return str(code)
    name = names.get(n)
    return f"{name} ({n})" if name else f"code {n}"


def request_label(code: object) -> str:
    """``SEND_MESSAGE_V2 (310)``; ``code 9999`` for a code without a known name."""
    return _label(REQUEST_NAMES, code)


def response_label(code: object) -> str:
    """``TOPIC_NOT_EXIST (17)``; ``code 9999`` for a code without a known name."""
    return _label(RESPONSE_NAMES, code)
