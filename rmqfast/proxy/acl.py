"""ACL: signed requests pass through; an optional per-AccessKey topic allowlist (``[acl]``).

This module holds the section, its parsing and the topic patterns (the gRPC front uses them too);
the Remoting allowlist filter is :class:`rmqfast.filters.acl.AclTopics`.

RocketMQ's ACL (5.x "ACL 2.0": broker ``authenticationEnabled`` / ``authorizationEnabled``; 4.x
plain ACL) is checked by the broker.  A client signs each request with its secret key
(``AclClientRPCHook``): it adds ``AccessKey`` (and ``SecurityToken``) to the extFields and a
``Signature``, the Base64 HmacSHA1 over the extFields *values* sorted by key, then the body.
The proxy relays requests byte for byte, so signatures stay valid; it never holds a secret key
and never re-signs.  Nothing the proxy changes is signed: route and message-address rewrites
touch answers only, and the opaque a relay could renumber is not part of the signature.

The allowlist is the proxy's own, on top of the broker's ACL::

    [acl]
    topics = { "app-orders" = ["Orders", "Orders-*"], "reporting" = ["*"] }
    unsigned = "deny"       # requests without an AccessKey: "deny" (default) | "allow"
    other_keys = "deny"     # AccessKeys that acl.topics does not name: "deny" (default) | "allow"

An entry is a topic name, a prefix ending in ``*``, or ``*`` (every topic). A listed AccessKey
may send to (10, 310, 320, 324, 325), recall delayed messages of (370), consume from (11, 361,
200050, 200052) and query (12) the topics listed for it; anything else of those codes is
answered ``NO_PERMISSION`` (16) with a remark naming the AccessKey, the topic and the setting
that would allow it (a one-way send is dropped). Retry topics (``%RETRY%group``) are not
checked: they belong to consumer groups, which the broker's ACL governs. The proxy cannot verify
a signature (it has no secret), so the allowlist only narrows what holders of valid credentials
can reach; the broker still rejects a forged AccessKey. Without ``acl.topics`` nothing is
checked and these codes stay on the compiled path.

The AccessKey and topic are read as the broker reads them (``extFields.get`` by exact key, JSON
escapes decoded): the header walk has already refused frames whose topic field is duplicated,
escaped or not a string, escaped keys and the other ambiguous JSON; here a JSON header naming
``AccessKey`` twice in one object (fastjson and Python need not agree on which one counts) and an
AccessKey that is not a string are refused too.  ROCKETMQ binary headers become a map in which
the last duplicate wins, in Java and in the codec alike.

gRPC calls (the front, :mod:`rmqfast.grpcfront.auth`) get the same allowlist; there the proxy does
verify signatures, with ``acl.secret_keys`` (AccessKey -> secret key), since the brokers never see
a gRPC client's signature; ``acl.signature_max_age`` bounds the signed date-time's distance from
the proxy's clock.

Cost: with an allowlist these codes leave the compiled path; measured with
``bench/acl_allowlist.py`` (see docs/acl.md for the figures).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from rmqfast.codec import codes as C
from rmqfast.errors import ConfigError
from rmqfast.filters.api import Frame
from rmqfast.settings.base import ConfigErrors
from rmqfast.settings.engine import section

log = logging.getLogger("rmqfast.acl")

ACCESS_KEY = "AccessKey"
RETRY_PREFIX = "%RETRY%"

#: Request code -> (extFields key of its topic, what the request does to the topic).
TOPIC_FIELDS: dict[int, tuple[str, str]] = {
    C.SEND_MESSAGE: ("topic", "send to"),
    C.SEND_REPLY_MESSAGE: ("topic", "send to"),
    C.SEND_MESSAGE_V2: ("b", "send to"),
    C.SEND_BATCH_MESSAGE: ("b", "send to"),
    C.SEND_REPLY_MESSAGE_V2: ("b", "send to"),
    C.PULL_MESSAGE: ("topic", "consume from"),
    C.LITE_PULL_MESSAGE: ("topic", "consume from"),
    C.POP_MESSAGE: ("topic", "consume from"),
    C.PEEK_MESSAGE: ("topic", "consume from"),
    C.QUERY_MESSAGE: ("topic", "query"),
    # RECALL_MESSAGE (5.3.2+) writes a timer-delete marker into the topic (Action.PUB in the broker's
    # ACL); the broker refuses a recall handle naming another topic than this field.
    C.RECALL_MESSAGE: ("topic", "recall a message of"),
}

CHOICES = ("deny", "allow")
_TOPIC = re.compile(r"[%|a-zA-Z0-9_-]{1,127}")  # RocketMQ's topic name rule
_KNOWN = {"topics", "unsigned", "other_keys", "secret_keys", "signature_max_age"}
#: s: default of ``acl.signature_max_age`` (how far a gRPC request's signed date-time may be from the proxy's clock)
SIGNATURE_MAX_AGE = 900.0


@section("acl", "Per-AccessKey topic allowlist (docs/acl.md).", parse=lambda raw: parse_acl(raw))
@dataclass
class AclSection:
    """``[acl]``: AccessKey -> topic patterns; what to do with unsigned requests and unlisted keys."""

    topics: dict[str, list[str]] = field(default_factory=dict)
    unsigned: str = "deny"
    other_keys: str = "deny"
    #: AccessKey -> secret key: the gRPC front verifies 5.x clients' signatures with them
    #: (rmqfast.grpcfront.auth); Remoting signatures are the broker's to verify
    secret_keys: dict[str, str] = field(default_factory=dict)
    signature_max_age: float = SIGNATURE_MAX_AGE  # s; 0: the signed date-time is not checked

    @property
    def enabled(self) -> bool:
        return bool(self.topics)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AclSection:
        return cls(topics={k: list(v) for k, v in d.get("topics", {}).items()},
                   unsigned=d.get("unsigned", "deny"), other_keys=d.get("other_keys", "deny"),
                   secret_keys=dict(d.get("secret_keys", {})),
                   signature_max_age=float(d.get("signature_max_age", SIGNATURE_MAX_AGE)))


def _v(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_acl(raw: Any) -> AclSection:
    """Validate the ``[acl]`` table; every problem is reported (one message per line)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"acl: {_v(raw)} is not allowed; expected a table [acl]")
    errors: list[str] = [f"acl.{k}: unknown key; allowed here: {', '.join(sorted(_KNOWN))}"
                         for k in raw if k not in _KNOWN]
    sec = AclSection()
    for key in ("unsigned", "other_keys"):
        if key in raw:
            if raw[key] in CHOICES:
                setattr(sec, key, raw[key])
            else:
                errors.append(f"acl.{key}: {_v(raw[key])} is not allowed; expected one of {', '.join(CHOICES)}")
    topics = raw.get("topics", {})
    if not isinstance(topics, dict):
        errors.append(f"acl.topics: {_v(topics)} is not allowed; expected a table AccessKey = [topics], "
                      "e.g. topics = { \"app-orders\" = [\"Orders\", \"Orders-*\"] }")
        topics = {}
    for ak, pats in topics.items():
        where = f"acl.topics.{_v(ak)}"
        if not ak or any(ord(ch) < 0x20 or ch == "\ufffd" for ch in ak):
            errors.append(f"{where}: not allowed as an AccessKey; expected a non-empty name without control "
                          "characters")
            continue
        if not isinstance(pats, list) or not pats:
            errors.append(f"{where}: {_v(pats)} is not allowed; expected a non-empty list of topics "
                          "(a name, a prefix ending in '*', or \"*\")")
            continue
        good: list[str] = []
        for i, p in enumerate(pats):
            name = p[:-1] if isinstance(p, str) and p.endswith("*") else p
            if isinstance(p, str) and (p == "*" or (isinstance(name, str) and _TOPIC.fullmatch(name))):
                good.append(p)
            else:
                errors.append(f"{where}[{i}]: {_v(p)} is not allowed; expected a topic name (letters, digits, "
                              "'%', '|', '_', '-'; at most 127), a prefix ending in '*', or \"*\"")
        sec.topics[ak] = good
    _parse_secrets(raw, sec, errors)
    if not sec.topics and not errors and raw:
        errors.append("acl.topics: required when [acl] is present; name each AccessKey and the topics it "
                      "may use, e.g. topics = { \"app-orders\" = [\"Orders\"] }")
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigErrors(errors)
    return sec


def _bad_key(ak: Any) -> bool:
    return not isinstance(ak, str) or not ak or any(ord(ch) < 0x20 or ch == "\ufffd" for ch in ak)


def _parse_secrets(raw: dict[str, Any], sec: AclSection, errors: list[str]) -> None:
    """``secret_keys`` (AccessKey -> secret key, for the gRPC front) and ``signature_max_age``."""
    secrets = raw.get("secret_keys", {})
    if not isinstance(secrets, dict):
        errors.append(f"acl.secret_keys: {_v(type(secrets).__name__)} is not allowed; expected a table "
                      "AccessKey = \"secret key\", e.g. secret_keys = { \"app-orders\" = \"...\" }")
        secrets = {}
    for ak, sk in secrets.items():
        if _bad_key(ak) or " " in ak or "," in ak or "/" in ak:
            errors.append(f"acl.secret_keys.{_v(ak)}: not allowed as an AccessKey; expected a non-empty name "
                          "without control characters, spaces, ',' or '/' (a 5.x client's Credential)")
        elif not isinstance(sk, str) or not sk:
            errors.append(f"acl.secret_keys.{_v(ak)}: expected the AccessKey's secret key, a non-empty string")
        else:
            sec.secret_keys[ak] = sk
    if "signature_max_age" in raw:
        v = raw["signature_max_age"]
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 86400:
            errors.append(f"acl.signature_max_age: {_v(v)} is not allowed; expected seconds in [0, 86400] "
                          "(0: the signed date-time is not checked)")
        else:
            sec.signature_max_age = float(v)


class TopicPatterns:
    __slots__ = ("all", "exact", "prefixes")

    def __init__(self, patterns: list[str]) -> None:
        self.all = "*" in patterns
        self.exact = frozenset(p for p in patterns if not p.endswith("*"))
        self.prefixes = tuple(p[:-1] for p in patterns if p.endswith("*") and p != "*")

    def allows(self, topic: str) -> bool:
        return self.all or topic in self.exact or (bool(self.prefixes) and topic.startswith(self.prefixes))


def read_fields(frame: Frame, topic_key: str) -> tuple[Any, Any, bool]:
    """(AccessKey, topic, AccessKey named twice in one JSON object) as the broker reads them.

    A JSON header (what Java clients send) is read with one ``json.loads`` and only the two
    values are taken from its ``extFields`` (the full decode into a command costs about three
    times as much); a ROCKETMQ binary header is decoded by the codec.  Values that are not
    strings come back as they are (the caller refuses them).
    """
    data = frame.data
    if data[4] != C.SERIALIZE_JSON:
        try:
            ext = frame.command().ext_fields or {}
        except ValueError:  # the walk accepted it, the codec did not: nothing can be read
            return None, None, False
        return ext.get(ACCESS_KEY), ext.get(topic_key), False
    header = data[8 : 8 + frame.header_length]
    if header.count(b'"AccessKey"') > 1 and access_key_repeated(header):
        return None, None, True
    try:
        obj = json.loads(header.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        obj = None
    ext = obj.get("extFields") if isinstance(obj, dict) else None
    if not isinstance(ext, dict):
        return None, None, False
    return ext.get(ACCESS_KEY), ext.get(topic_key), False


def access_key_repeated(header: bytes) -> bool:
    """True when a JSON header names ``AccessKey`` twice in one object (or cannot be read to tell)."""
    if header.count(b'"AccessKey"') < 2:
        return False
    repeated = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal repeated
        if sum(1 for k, _ in items if k == ACCESS_KEY) > 1:
            repeated = True
        return dict(items)

    try:
        json.loads(header.decode("utf-8", "replace"), object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return True
    return repeated
