"""The admin-code denial filter, first in both chains: refused request codes get NO_PERMISSION.

``[policy]`` ``allow_codes``, ``deny_codes`` and ``preset`` configure it
(:mod:`rmqfast.codec.admincodes` lists the presets' codes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from rmqfast.codec import CODE_SLOTS, OTHER_SLOT
from rmqfast.codec import codes as C
from rmqfast.codec.admincodes import preset_codes
from rmqfast.filters.api import Filter, Frame, Session, Verdict, divert, error_response, reply, slots_of
from rmqfast.log import ctx

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost

log = logging.getLogger("rmqfast.policy")


def deny_hint(preset: str) -> str:
    """The part of a refused admin request's remark that says what would let it through."""
    if preset:
        return (f'policy.preset = "{preset}" lets through only the read-only admin codes and this is '
                "not one of them; allow it with policy.allow_codes")
    return ('admin codes are denied by default; the read-only ones pass with policy.preset = '
            '"read-only-admin", any other with policy.allow_codes')


class DenyAdminCodes(Filter):
    """Refuse every request code that is not data-plane (or allowlisted) with NO_PERMISSION.

    The broker and name-server config-update codes (25, 318) were a remote-code-execution
    CVE; a proxy that ordinary applications reach must not relay admin traffic by default.
    """

    name = "deny-admin"

    def __init__(
        self,
        data_plane: Iterable[int],
        allow: Iterable[int] = (),
        deny: Iterable[int] = (),
        on_deny: Callable[[Session, int], None] | None = None,
        preset: str = "",
    ) -> None:
        self.on_deny = on_deny
        self.denied = frozenset(deny)
        self.allowed = (frozenset(data_plane) | frozenset(allow)) - self.denied
        #: what the refusal's remark tells the operator to change
        self.hint = deny_hint(preset)
        allowed_slots = slots_of(self.allowed) - {OTHER_SLOT}
        # A slot is handed to Python unless every code mapping to it is allowed; the shared
        # "other" slot stands for infinitely many codes, so it is always checked.
        self._slots = set(range(CODE_SLOTS)) - allowed_slots

    def request_slots(self) -> set[int]:
        return self._slots

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        if frame.code in self.allowed:
            return None
        hint = "it is listed in policy.deny_codes" if frame.code in self.denied else self.hint
        remark = f"rmqfast: request code {frame.code} is not allowed through this proxy ({hint})"
        log.warning(
            "denied request",
            extra=ctx(code=frame.code, client=session.client_addr, upstream=session.upstream_addr, role=session.role),
        )
        if self.on_deny is not None:
            self.on_deny(session, frame.code)
        if frame.is_oneway:
            return divert(remark)
        return reply(error_response(frame, C.NO_PERMISSION, remark))


def build(host: ChainHost, role: str) -> Filter:
    """``[policy]``'s denial for ``role``'s listeners: its data-plane codes, the preset's and
    ``allow_codes`` pass."""
    pol = host.cfg.policy
    data_plane = C.NAMESRV_DATA_PLANE_CODES if role == "namesrv" else C.BROKER_DATA_PLANE_CODES
    allow = [*pol.allow_codes, *preset_codes(pol.preset, role)]
    return DenyAdminCodes(data_plane, allow, pol.deny_codes, host.on_denied, preset=pol.preset)
