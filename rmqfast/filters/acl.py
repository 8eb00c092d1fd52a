"""The ``[acl]`` per-AccessKey topic allowlist on the broker listeners (see :mod:`rmqfast.proxy.acl`
for what is checked and why; the section, its parsing and the topic patterns live there)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rmqfast.codec import codes as C
from rmqfast.filters.api import Filter, Frame, Session, Verdict, close, divert, error_response, reply, slots_of
from rmqfast.log import ctx
from rmqfast.proxy.acl import RETRY_PREFIX, TOPIC_FIELDS, AclSection, TopicPatterns, read_fields

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost

log = logging.getLogger("rmqfast.acl")


class AclTopics(Filter):
    """The ``[acl]`` allowlist on the broker listeners (see the module text)."""

    name = "acl-topics"
    _MAX_LOGGED = 4096

    def __init__(self, section: AclSection, on_deny: Callable[[Session, int], None] | None = None) -> None:
        self.section = section
        self.on_deny = on_deny
        self.keys = {ak: TopicPatterns(p) for ak, p in section.topics.items()}
        self.allow_unsigned = section.unsigned == "allow"
        self.allow_other = section.other_keys == "allow"
        self._slots = slots_of(TOPIC_FIELDS) if section.enabled else set()
        self._logged: set[tuple[str, str, str]] = set()
        self.denied = 0

    def request_slots(self) -> set[int]:
        return self._slots

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        spec = TOPIC_FIELDS.get(frame.code)
        if spec is None:
            return None
        key, verb = spec
        ak, topic, repeated = read_fields(frame, key)
        if repeated:
            return self._deny(session, frame, "", "", "rmqfast: the request names AccessKey more than once; "
                              "refused (the broker and the proxy could read different keys)")
        if not isinstance(topic, str):
            return self._deny(session, frame, "", "", f"rmqfast: request code {frame.code} names no topic "
                              f"(extFields '{key}'); the proxy's topic allowlist (acl.topics) cannot admit it")
        if topic.startswith(RETRY_PREFIX):
            return None
        if ak is None:
            if self.allow_unsigned:
                return None
            return self._deny(session, frame, "", topic,
                              f"rmqfast: unsigned request (no AccessKey) to {verb} topic {topic!r} refused by the "
                              "proxy's topic allowlist; sign requests (AclClientRPCHook with the AccessKey's "
                              "credentials), or set acl.unsigned = \"allow\"")
        if not isinstance(ak, str) or "\ufffd" in ak:
            return self._deny(session, frame, "", topic, "rmqfast: the AccessKey is not a valid UTF-8 string; "
                              "refused")
        pats = self.keys.get(ak)
        if pats is None:
            if self.allow_other:
                return None
            return self._deny(session, frame, ak, topic,
                              f"rmqfast: AccessKey {ak!r} is not in the proxy's topic allowlist (acl.topics); "
                              f"to let it {verb} topic {topic!r}, add {ak!r} = [{topic!r}] to acl.topics and "
                              "reload the proxy (SIGHUP)")
        if pats.allows(topic):
            return None
        return self._deny(session, frame, ak, topic,
                          f"rmqfast: AccessKey {ak!r} may not {verb} topic {topic!r} through this proxy; allow "
                          f"it by adding {topic!r} (or a prefix ending in '*') to acl.topics[{ak!r}] and reloading "
                          "the proxy (SIGHUP)")

    def _deny(self, session: Session, frame: Frame, ak: str, topic: str, remark: str) -> Verdict:
        self.denied += 1
        seen = (ak, topic, str(frame.code))
        fields = ctx(code=frame.code, access_key=ak, topic=topic, client=session.client_addr, reason=remark)
        if seen not in self._logged:
            if len(self._logged) >= self._MAX_LOGGED:
                self._logged.clear()
            self._logged.add(seen)
            log.warning("request refused by the topic allowlist", extra=fields)
        else:  # the same refusal again: counted in the metrics, logged at debug
            log.debug("request refused by the topic allowlist", extra=fields)
        if self.on_deny is not None:
            self.on_deny(session, frame.code)
        if frame.is_oneway:
            return divert(remark)
        try:
            return reply(error_response(frame, C.NO_PERMISSION, remark))
        except ValueError as exc:  # a header the codec cannot decode cannot be answered either
            return close(f"{remark}; unreadable header ({exc})")


def build(host: ChainHost, role: str) -> Filter:
    """``[acl]``'s topic allowlist."""
    return AclTopics(host.cfg.acl, host.on_denied)
