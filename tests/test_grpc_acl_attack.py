"""``[acl]`` on the gRPC front against calls crafted to slip through (retry topics, replayed or
mixed headers, duplicate metadata, a cached signature reused with other values)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("grpc")

from rmqfast.grpcfront.auth import CONSUME, ROUTE, SEND, GrpcAcl, Refused, sign  # noqa: E402
from rmqfast.proxy.acl import parse_acl  # noqa: E402

NOW = 1769163072.0  # 2026-01-23T10:11:12Z
STAMP = "20260123T101112Z"
SECTION = parse_acl({"topics": {"app": ["Orders"], "all": ["*"]},
                     "secret_keys": {"app": "s3cret", "all": "another"}})


def auth(ak: str = "app", secret: str = "s3cret", stamp: str = STAMP) -> str:
    return f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, Signature={sign(secret, stamp)}"


def md(ak: str = "app", secret: str = "s3cret", stamp: str = STAMP) -> tuple[tuple[str, str], ...]:
    return (("x-mq-date-time", stamp), ("authorization", auth(ak, secret, stamp)))


def refused(a: GrpcAcl, metadata: Any, topics: Any = (), method: str = "SendMessage") -> str:
    with pytest.raises(Refused) as ei:
        a.check(metadata, method, topics)
    return ei.value.code


@pytest.mark.parametrize("topic", ["%RETRY%GroupOfPayments", "%RETRY%G_Payments", "%RETRY%G+Payments"])
@pytest.mark.parametrize("verb", [SEND, CONSUME, ROUTE])
def test_retry_topics_are_checked_like_any_other(topic: str, verb: str) -> None:
    """5.x clients never name a retry topic (the front pops them for the topic asked and reports that
    topic): an AccessKey allowed only Orders must not send into, read from or route another group's
    retry topic (a send to %RETRY%G is delivered to group G's consumers, whatever they subscribe)."""
    a = GrpcAcl(SECTION, clock=lambda: NOW)
    assert refused(a, md(), [(topic, verb)]) == "FORBIDDEN"
    # an AccessKey allowed every topic still may
    assert a.check(md("all", "another"), "SendMessage", [(topic, verb)]) == "all"


def test_cached_signature_does_not_carry_to_another_date_or_key() -> None:
    now = [NOW]
    a = GrpcAcl(parse_acl({"topics": {"app": ["Orders"], "all": ["*"]},
                           "secret_keys": {"app": "s3cret", "all": "another"},
                           "signature_max_age": 60}), clock=lambda: now[0])
    assert a.check(md(), "SendMessage", [("Orders", SEND)]) == "app"
    # the cached authorization value with another date-time is verified anew (and fails)
    other = "20260123T101113Z"
    assert refused(a, (("x-mq-date-time", other), ("authorization", auth())), [("Orders", SEND)]) == "UNAUTHORIZED"
    # another AccessKey's Credential with app's signature
    forged = auth().replace("Credential=app", "Credential=all")
    assert refused(a, (("x-mq-date-time", STAMP), ("authorization", forged)), [("Payments", SEND)]) == "UNAUTHORIZED"
    # the cached entry still names app: its allowlist applies
    assert refused(a, md(), [("Payments", SEND)]) == "FORBIDDEN"
    # replayed once older than signature_max_age (in UTC and in the local zone): refused, cached or not
    import time
    now[0] = NOW + 61 + abs(time.localtime(NOW).tm_gmtoff)
    assert refused(a, md(), [("Orders", SEND)]) == "UNAUTHORIZED"


def test_duplicate_and_mixed_metadata() -> None:
    a = GrpcAcl(SECTION, clock=lambda: NOW)
    good = md()
    # the last value of each key is read (grpc-java's Metadata.get): a valid first one does not count
    assert refused(a, good + (("authorization", "MQv2-HMAC-SHA1 Credential=app, Signature=00"),)) == "UNAUTHORIZED"
    assert refused(a, good + (("x-mq-date-time", "20260123T101113Z"),)) == "UNAUTHORIZED"
    # a Credential item named twice: the last is the user, so the signature (app's) does not verify
    two = auth().replace("Credential=app,", "Credential=app, Credential=all,")
    assert refused(a, (("x-mq-date-time", STAMP), ("authorization", two)), [("Payments", SEND)]) == "UNAUTHORIZED"
    # a Credential with a scope after '/' is the same user, held to its allowlist
    scoped = auth().replace("Credential=app", "Credential=app/all")
    assert refused(a, (("x-mq-date-time", STAMP), ("authorization", scoped)), [("Payments", SEND)]) == "FORBIDDEN"
    # upper-case metadata keys are not the header (HTTP/2 names are lower case): unsigned, refused
    upper = (("X-MQ-DATE-TIME", STAMP), ("Authorization", auth()))
    assert refused(a, upper, [("Orders", SEND)]) == "UNAUTHORIZED"
    # an empty Credential with another key's signature is an unsigned call
    assert refused(a, (("x-mq-date-time", STAMP),
                       ("authorization", auth().replace("Credential=app", "Credential="))),
                   [("Orders", SEND)]) == "UNAUTHORIZED"
