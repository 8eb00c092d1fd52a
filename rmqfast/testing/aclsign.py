"""Client-side request signing for the test harness: :mod:`rmqfast.codec.aclsign`."""

from rmqfast.codec.aclsign import ACCESS_KEY, SECRET_KEY, SECURITY_TOKEN, SIGNATURE, sign, signature

__all__ = ["ACCESS_KEY", "SECRET_KEY", "SECURITY_TOKEN", "SIGNATURE", "sign", "signature"]
