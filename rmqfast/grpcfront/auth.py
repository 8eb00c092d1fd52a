"""``[acl]`` on the gRPC front: 5.x clients' signatures verified, the topic allowlist applied.

A RocketMQ 5 client given credentials signs every call in its gRPC metadata (rocketmq-clients'
``Signature``, Java and Python alike)::

    x-mq-date-time: 20260123T101112Z
    authorization:  MQv2-HMAC-SHA1 Credential=<AccessKey>, SignedHeaders=x-mq-date-time,
                    Signature=<hex HMAC-SHA1 of the x-mq-date-time value, keyed with the secret key>

Apache's proxy reads the header as here (``DefaultAuthenticationContextBuilder``: the text after the
first space split at ``,``, each item at its first ``=``; the Credential's part before any ``/`` is
the user) and compares the signature with one it computes from the user's secret key.  The
broker never sees a gRPC signature (the front speaks Remoting to it, unsigned), so the front
verifies it itself, with ``acl.secret_keys``; an AccessKey without a secret key there cannot be
verified and is refused.

What is decided, with the semantics of the Remoting allowlist (:mod:`rmqfast.proxy.acl`):

* no ``authorization`` header, or an empty Credential (the Python client sends one when it has no
  credentials): unsigned, refused ``UNAUTHORIZED`` unless ``acl.unsigned = "allow"`` (then nothing
  more is checked, as on the Remoting side);
* a signature that does not verify, an unknown AccessKey, a date-time that cannot be read or is
  more than ``acl.signature_max_age`` from the proxy's clock: ``UNAUTHORIZED``;
* a verified AccessKey not named in ``acl.topics``: ``FORBIDDEN`` unless ``acl.other_keys =
  "allow"``; one named there: ``FORBIDDEN`` for a topic its patterns do not cover.  Retry topics
  (``%RETRY%group``...) are checked as any other: 5.x clients never name one (the front pops a
  topic's retries for the topic asked and reports that topic), and a send to ``%RETRY%G`` reaches
  group G's consumers whatever they subscribe.

The clients write their *local* wall-clock time followed by a literal ``Z`` (Java's
``SimpleDateFormat`` without a zone, Python's ``datetime.now()``), so the date-time is accepted
when it is within ``signature_max_age`` of the proxy's clock read in UTC or in the proxy's own
local zone; clients in a third zone need ``signature_max_age = 0`` (not checked, as Apache's
proxy).  The signature covers the date-time only, not the request: a captured header works for
any call until it is that old, so serve gRPC over TLS (``[grpc] tls``) where the network is not
trusted.
"""

from __future__ import annotations

import binascii
import calendar
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from rmqfast.log import ctx
from rmqfast.proxy.acl import AclSection, TopicPatterns

log = logging.getLogger("rmqfast.grpc.acl")

AUTHORIZATION = "authorization"
DATE_TIME = "x-mq-date-time"
ALGORITHM = "MQv2-HMAC-SHA1"
UNAUTHORIZED, FORBIDDEN = "UNAUTHORIZED", "FORBIDDEN"  # apache.rocketmq.v2.Code names

#: What a call does to the topics it names, for the refusal's message.
SEND, CONSUME, ROUTE = "send to", "consume from", "look up the route of"


class Refused(Exception):
    """A call refused: ``code`` is the ``Code`` name to answer with, the text says why and what to change."""

    def __init__(self, code: str, message: str, access_key: str = "", topic: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.access_key = access_key
        self.topic = topic


def parse_authorization(value: str) -> tuple[str, str, str]:
    """(algorithm, AccessKey, signature hex) of an ``authorization`` value, read as Apache's proxy
    reads it; raises :class:`Refused` (UNAUTHORIZED) when it cannot be read."""
    algorithm, sep, rest = value.partition(" ")
    if not sep:
        raise Refused(UNAUTHORIZED, "rmqfast: the authorization header is not '<algorithm> Credential=..., "
                      "SignedHeaders=..., Signature=...'")
    items: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, val = item.strip().partition("=")
        if not eq:
            raise Refused(UNAUTHORIZED, f"rmqfast: the authorization header has an item without '=' ({item.strip()!r})")
        items[key] = val
    return algorithm, items.get("Credential", "").split("/")[0], items.get("Signature", "")


def parse_date_time(text: str) -> float | None:
    """Seconds since the epoch of ``yyyyMMdd'T'HHmmss'Z'`` read as UTC, or None."""
    if len(text) != 16 or text[8] != "T" or text[15] != "Z" or not (text[:8] + text[9:15]).isdigit():
        return None
    try:
        return float(calendar.timegm((int(text[:4]), int(text[4:6]), int(text[6:8]), int(text[9:11]),
                                      int(text[11:13]), int(text[13:15]), 0, 0, 0)))
    except (ValueError, OverflowError):
        return None


def sign(secret_key: str, date_time: str) -> str:
    """The clients' signature: hex HMAC-SHA1 of the date-time keyed with the secret key."""
    return hmac.new(secret_key.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def _header(metadata: Iterable[Any], name: str) -> str | None:
    """The last value of metadata key ``name`` (grpc-java's ``Metadata.get``), as text."""
    found = None
    for item in metadata or ():
        key, value = item[0], item[1]
        if key == name:
            found = value
    if isinstance(found, bytes):
        found = found.decode("utf-8", "replace")
    return found


class GrpcAcl:
    """``[acl]`` for the gRPC service: :meth:`check` per call (see the module text)."""

    _MAX_LOGGED = 4096

    def __init__(self, section: AclSection, on_deny: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.section = section
        self.on_deny = on_deny  # (gRPC method, Code name): the denied-requests metric
        self.clock = clock
        self.keys = {ak: TopicPatterns(p) for ak, p in section.topics.items()}
        self.secrets = dict(section.secret_keys)
        self.max_age = section.signature_max_age
        self.allow_unsigned = section.unsigned == "allow"
        self.allow_other = section.other_keys == "allow"
        self._logged: set[tuple[str, str, str, str]] = set()
        self.denied = 0
        if not self.secrets:
            log.warning("[acl] names no secret key (acl.secret_keys): no signed gRPC call can be verified, "
                        "so only unsigned calls can pass, and only with acl.unsigned = \"allow\"")
        #: (authorization, x-mq-date-time) -> (AccessKey, signed time) of signatures that verified: a
        #: client signs with the date-time to the second, so its calls of one second share one entry
        self._verified: dict[tuple[str, str], tuple[str, float]] = {}

    # --- deciding ---------------------------------------------------------------------------

    def authenticate(self, metadata: Iterable[Any]) -> str | None:
        """The verified AccessKey of a call, None for an unsigned call that may pass; raises Refused."""
        auth = _header(metadata, AUTHORIZATION)
        date_time = _header(metadata, DATE_TIME) or ""
        hit = self._verified.get((auth, date_time)) if auth else None
        if hit is not None:
            self._fresh(hit[0], date_time, hit[1])
            return hit[0]
        algorithm, ak, signature = parse_authorization(auth) if auth else ("", "", "")
        if not ak:
            if self.allow_unsigned:
                return None
            raise Refused(UNAUTHORIZED, "rmqfast: unsigned call (no AccessKey) refused by the proxy's ACL; give "
                          "the client credentials (an AccessKey of acl.secret_keys), or set acl.unsigned = \"allow\"")
        if algorithm != ALGORITHM:
            raise Refused(UNAUTHORIZED, f"rmqfast: signature algorithm {algorithm[:40]!r} not supported (only "
                          f"{ALGORITHM})", ak)
        secret = self.secrets.get(ak)
        if secret is None:
            raise Refused(UNAUTHORIZED, f"rmqfast: AccessKey {ak!r} is not known to the proxy (no secret key in "
                          "acl.secret_keys), so its signature cannot be verified; add it there and restart the "
                          "proxy", ak)
        when = parse_date_time(date_time)
        if when is None:
            raise Refused(UNAUTHORIZED, f"rmqfast: the signed {DATE_TIME} header {date_time[:40]!r} is missing or not "
                          "yyyyMMdd'T'HHmmss'Z'", ak)
        try:
            given = binascii.unhexlify(signature)
        except (binascii.Error, ValueError):
            given = b""
        expected = hmac.new(secret.encode(), date_time.encode(), hashlib.sha1).digest()
        if not hmac.compare_digest(given, expected):
            raise Refused(UNAUTHORIZED, f"rmqfast: the signature of AccessKey {ak!r} does not verify (wrong secret "
                          "key?)", ak)
        self._fresh(ak, date_time, when)
        if len(self._verified) >= 4096:
            self._verified.clear()
        self._verified[(auth, date_time)] = (ak, when)  # type: ignore[index]
        return ak

    def _fresh(self, ak: str, date_time: str, when: float) -> None:
        """Raise Refused when the signed time is more than ``max_age`` from the proxy's clock, read in UTC
        and in the proxy's local zone (the clients write their local time marked Z)."""
        if self.max_age <= 0:
            return
        now = self.clock()
        if abs(when - now) <= self.max_age or abs(when - now - time.localtime(now).tm_gmtoff) <= self.max_age:
            return
        raise Refused(UNAUTHORIZED, f"rmqfast: the signed date-time {date_time} of AccessKey {ak!r} is more than "
                      f"acl.signature_max_age ({self.max_age:g} s) from the proxy's clock (UTC and local); check "
                      "the client's clock, or set acl.signature_max_age = 0", ak)

    def authorize(self, ak: str | None, topic: str, verb: str) -> None:
        """Whether AccessKey ``ak`` (None: an unsigned call that passed) may ``verb`` ``topic``; raises Refused."""
        if ak is None:
            return
        pats = self.keys.get(ak)
        if pats is None:
            if self.allow_other:
                return
            raise Refused(FORBIDDEN, f"rmqfast: AccessKey {ak!r} is not in the proxy's topic allowlist (acl.topics); "
                          f"to let it {verb} topic {topic!r}, add {ak!r} = [{topic!r}] to acl.topics", ak, topic)
        if not pats.allows(topic):
            raise Refused(FORBIDDEN, f"rmqfast: AccessKey {ak!r} may not {verb} topic {topic!r} through this proxy; "
                          f"allow it by adding {topic!r} (or a prefix ending in '*') to acl.topics[{ak!r}]", ak,
                          topic)

    def check(self, metadata: Iterable[Any], method: str, topics: Iterable[tuple[str, str]] = ()) -> str | None:
        """Authenticate a call of ``method`` and authorize each (topic, verb); the AccessKey (None:
        unsigned, allowed).  A refusal is counted, logged (once per key, topic, method and code) and
        raised."""
        try:
            ak = self.authenticate(metadata)
            for topic, verb in topics:
                self.authorize(ak, topic, verb)
        except Refused as r:
            self.refused(r, method)
            raise
        return ak

    def refused(self, r: Refused, method: str) -> None:
        """Count and log a refusal of ``method``."""
        self.denied += 1
        seen = (r.access_key, r.topic, method, r.code)
        fields = ctx(method=method, access_key=r.access_key, topic=r.topic, code=r.code, reason=str(r))
        if seen not in self._logged:
            if len(self._logged) >= self._MAX_LOGGED:
                self._logged.clear()
            self._logged.add(seen)
            log.warning("gRPC call refused by the ACL", extra=fields)
        else:
            log.debug("gRPC call refused by the ACL", extra=fields)
        if self.on_deny is not None:
            self.on_deny(method, r.code)


def denied_counter() -> Callable[[str, str], None] | None:
    """``rmqfast_denied_requests_total{role="grpc", code=<gRPC method>}`` in the workers' multiprocess
    metric files (the supervisor's ``PROMETHEUS_MULTIPROC_DIR``, inherited through the worker); None
    when this process has no metric directory (then the refusals are logged only)."""
    import os

    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    try:
        from rmqfast.metrics import light_prometheus

        light_prometheus()
        from prometheus_client import Counter

        counter = Counter("rmqfast_denied_requests_total", "Requests refused by policy, by request code",
                          ["role", "code"])
    except Exception as exc:  # no prometheus-client, an unusable directory: log only
        log.warning("gRPC ACL refusals are not counted in the metrics: %s", exc)
        return None

    def count(method: str, _code: str) -> None:
        counter.labels("grpc", method).inc()

    return count
