"""Request signing as RocketMQ's ``AclClientRPCHook`` does it.

The proxy never signs a client's request (it holds no client's secret key).  It signs only the
requests it makes itself with credentials of its own: cross-cloud copies and the online
detector's questions to remote clusters whose ``[[clouds.remote]]`` has ``access_key`` and
``secret_key``.  The test harness signs with it too (:mod:`rmqfast.testing.aclsign`).

``AclClientRPCHook.doBeforeRequest`` adds ``AccessKey`` (and ``SecurityToken`` when set) to the
request's extFields, then signs the values of all extFields sorted by key (Java ``TreeMap``,
``Signature`` left out) concatenated as UTF-8, followed by the body, with HmacSHA1 keyed by the
secret key; the Base64 of the MAC goes into ``Signature``.  The broker (ACL 2.0,
``DefaultAuthenticationContextBuilder``) recomputes the same from the extFields it decoded.

The keys are not signed, nor are code, flag, opaque, version or remark: a relay may change
those, but not one byte of an extFields value or of the body.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

ACCESS_KEY = "AccessKey"
SECRET_KEY = "SecretKey"
SIGNATURE = "Signature"
SECURITY_TOKEN = "SecurityToken"


def _java_order(key: str) -> list[int]:
    """Java's String.compareTo order: UTF-16 code units."""
    units: list[int] = []
    for ch in key:
        cp = ord(ch)
        if cp > 0xFFFF:
            cp -= 0x10000
            units += [0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF)]
        else:
            units.append(cp)
    return units


def signature(ext_fields: Mapping[str, str], body: bytes, secret_key: str) -> str:
    """The ``Signature`` value for these extFields (``Signature`` itself ignored) and body."""
    import hashlib  # here: with hmac it loads OpenSSL's libcrypto (~4 MiB), which a worker that signs nothing skips
    import hmac

    content = "".join(ext_fields[k] for k in sorted(ext_fields, key=_java_order) if k != SIGNATURE)
    data = content.encode("utf-8") + (body or b"")
    return base64.b64encode(hmac.new(secret_key.encode("utf-8"), data, hashlib.sha1).digest()).decode("ascii")


def sign(
    ext_fields: Mapping[str, str], body: bytes, access_key: str, secret_key: str, security_token: str | None = None
) -> dict[str, str]:
    """``ext_fields`` plus ``AccessKey`` (and ``SecurityToken``) and their ``Signature``."""
    out = dict(ext_fields)
    out[ACCESS_KEY] = access_key
    if security_token is not None:
        out[SECURITY_TOKEN] = security_token
    out[SIGNATURE] = signature(out, body, secret_key)
    return out
